"""Where our hooks and registered backends meet SGLang, read statically from a source tree.

``rebase-check`` unpacks another SGLang release and cannot import it (its dependencies are
not installed), so each target a hook wraps or a backend overrides is found by parsing the
release's files: ``sglang.srt.x.y.Class.method`` -> ``sglang/srt/x/y.py``, class ``Class``,
function ``method`` (or a base class's, followed through the module's own imports, as Python's
attribute lookup would find it). A target is ``same`` when it exists with the same parameter
names and kinds as in the pinned release, ``ported`` when they differ from the pin's but equal
those of a signature the spec records for a supported release (the port is done), ``changed``
when they differ from both, ``missing`` when the module, class or function is gone. A spec's
``upstream_marker`` (file, text) says where upstream would show that it now does the job itself.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class TargetStatus:
    target: str
    status: str  # "same" | "ported" | "changed" | "missing"
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
    ``__init__``; the last definition of a name wins, as at import; a method a class does not
    define is looked up in its bases (:func:`_find_in_class`)."""
    located = _module_file(root, dotted.split("."))
    if located is None:
        return None
    path, rest = located
    if not rest:
        return None
    module: list[ast.stmt] = ast.parse(path.read_text(), filename=str(path)).body
    cls = _last_def(module, rest[0])
    if cls is None:
        return None
    if len(rest) == 1:
        return _params(cls) if not isinstance(cls, ast.ClassDef) else _find_in_class(root, module, cls, "__init__", 0)
    if len(rest) == 2 and isinstance(cls, ast.ClassDef):
        return _find_in_class(root, module, cls, rest[1], 0)
    return None


def _last_def(body: list[ast.stmt], name: str) -> ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef | None:
    found = [n for n in body if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name]
    return found[-1] if found else None


def _find_in_class(root: Path, module: list[ast.stmt], cls: ast.ClassDef, name: str, depth: int) -> tuple[str, ...] | None:
    """``name``'s parameters in ``cls`` or, depth first in order, its bases: a base defined in the same
    module or imported into it by ``from X import Base`` (the tree's own modules only). A class without
    an ``__init__`` anywhere up its chain has ``()``."""
    method = _last_def(cls.body, name)
    if method is not None and not isinstance(method, ast.ClassDef):
        return _params(method)
    if depth < 8:
        for base in cls.bases:
            found = _base_class(root, module, base)
            if found is not None and (params := _find_in_class(root, *found, name, depth + 1)) is not None:
                return params
    return () if name == "__init__" and depth == 0 else None


def _base_class(root: Path, module: list[ast.stmt], base: ast.expr) -> tuple[list[ast.stmt], ast.ClassDef] | None:
    """Where a base class named by a plain name is defined: this module, or a ``from X import`` of it."""
    if not isinstance(base, ast.Name):
        return None
    here = _last_def(module, base.id)
    if isinstance(here, ast.ClassDef):
        return module, here
    for node in module:
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                if (alias.asname or alias.name) == base.id:
                    located = _module_file(root, [*node.module.split("."), alias.name])
                    if located is None or len(located[1]) != 1:
                        return None
                    body = ast.parse(located[0].read_text(), filename=str(located[0])).body
                    found = _last_def(body, alias.name)
                    return (body, found) if isinstance(found, ast.ClassDef) else None
    return None


def signature_params(signature: str) -> tuple[str, ...]:
    """Parameter names and kinds of ``str(inspect.signature(...))`` text, as :func:`_params` writes
    them (annotations and defaults dropped; a ``/`` marks the names before it positional-only)."""
    inner = signature[signature.index("(") + 1:]
    depth, part, parts = 0, "", []
    for ch in inner:
        if ch in "([{<" :
            depth += 1
        elif ch in ")]}>":
            if depth == 0:
                break
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(part)
            part = ""
            continue
        part += ch
    parts.append(part)
    names = [p.strip().split(":")[0].split("=")[0].strip() for p in parts if p.strip()]
    if "/" in names:
        cut = names.index("/")
        names = [f"{n}/" for n in names[:cut]] + names[cut + 1:]
    return tuple(names)


def compare(pinned_root: Path, target_root: Path, dotted: str, recorded: tuple[str, ...] = ()) -> TargetStatus:
    """``dotted`` in the target tree against the pin's, and against ``recorded``: the signatures
    (``inspect.signature`` text) the spec accepts on its supported releases."""
    before, after = find_params(pinned_root, dotted), find_params(target_root, dotted)
    if after is None:
        return TargetStatus(dotted, "missing", "not found")
    if before is not None and before != after:
        if any(signature_params(sig) == after for sig in recorded):
            return TargetStatus(dotted, "ported", "its signature there is recorded")
        return TargetStatus(dotted, "changed", f"({', '.join(before)}) -> ({', '.join(after)})")
    return TargetStatus(dotted, "same", "")


def marker_found(target_root: Path, marker: tuple[str, str] | None) -> bool:
    """Whether ``marker``'s text is in its file in the tree, so that a change naming it as its upstream
    marker is retired there (None: the spec names no marker); the upstream adapter's
    :func:`~prfaas_sglang._compat.change_status`."""
    from prfaas_sglang._compat import change_status

    return change_status(marker, root=target_root) == "retired"
