"""Where our hooks and registered backends meet SGLang, read statically from a source tree.

``rebase-check`` unpacks another SGLang release and cannot import it (its dependencies are
not installed), so each target a hook wraps or a backend overrides is found by parsing the
release's files: ``sglang.srt.x.y.Class.method`` -> ``sglang/srt/x/y.py``, class ``Class``,
function ``method``. A target is ``same`` when it exists with the same parameter names and
kinds as in the pinned release, ``changed`` when its parameters differ, ``missing`` when the
module, class or function is gone. A spec's ``upstream_marker`` (file, text) says where
upstream would show that it now does the job itself.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class TargetStatus:
    target: str
    status: str  # "same" | "changed" | "missing"
    detail: str


def _module_file(root: Path, parts: list[str]) -> tuple[Path, list[str]] | None:
    """The longest leading run of ``parts`` that is a module file under ``root``, and the rest."""
    for cut in range(len(parts), 0, -1):
        base = root.joinpath(*parts[:cut])
        for candidate in (base.with_suffix(".py"), base / "__init__.py"):
            if candidate.is_file():
                return candidate, parts[cut:]
    return None


def _params(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> tuple[str, ...]:
    a = fn.args
    names = [f"{p.arg}/" for p in a.posonlyargs] + [p.arg for p in a.args]
    names += [f"*{a.vararg.arg}"] if a.vararg else (["*"] if a.kwonlyargs else [])
    names += [p.arg for p in a.kwonlyargs] + ([f"**{a.kwarg.arg}"] if a.kwarg else [])
    return tuple(names)


def find_params(root: Path, dotted: str) -> tuple[str, ...] | None:
    """The parameters of the function or method at ``dotted`` in the tree at ``root`` (the
    directory holding ``sglang/``), or None when it is not there. A class resolves to its
    ``__init__``; the last definition of a name wins, as at import."""
    located = _module_file(root, dotted.split("."))
    if located is None:
        return None
    path, rest = located
    if not rest:
        return None
    body: list[ast.stmt] = ast.parse(path.read_text(), filename=str(path)).body
    node: ast.AST | None = None
    for name in rest:
        found = [n for n in body if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name]
        if not found:
            return None
        node = found[-1]
        body = node.body if isinstance(node, ast.ClassDef) else []
    if isinstance(node, ast.ClassDef):
        init = [n for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == "__init__"]
        return _params(init[-1]) if init else ()
    return _params(node)


def compare(pinned_root: Path, target_root: Path, dotted: str) -> TargetStatus:
    before, after = find_params(pinned_root, dotted), find_params(target_root, dotted)
    if after is None:
        return TargetStatus(dotted, "missing", "not found")
    if before is not None and before != after:
        return TargetStatus(dotted, "changed", f"({', '.join(before)}) -> ({', '.join(after)})")
    return TargetStatus(dotted, "same", "")


def marker_found(target_root: Path, marker: tuple[str, str] | None) -> bool:
    """Whether ``marker``'s text is in its file in the tree (None: the spec names no marker)."""
    from prfaas_sglang._compat import installed_has

    return installed_has(marker, target_root)
