"""The "changes against upstream" table, generated from ``patches/series`` and the hooks.

Nothing else writes that table: the site's reference page ``docs/reference/hooks.md`` holds it
(:mod:`prfaas_sglang.docsite.reference`; ``python -m prfaas_sglang.docsite write`` refreshes it and a
test fails when it is stale).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from prfaas_sglang._pin import PINNED_SGLANG_VERSION
from prfaas_sglang.patches.series import Patch, Series


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


WHERE = {"applies": "yes", "retired": "retired: upstream does it", "not applicable": "-"}


def _patch_where(patch: Patch, root: Path) -> str:
    from prfaas_sglang._compat import change_status

    return change_status(patch.upstream_marker, root=root)


def render_table(series: Series, hooks: Sequence, roots: dict[str, Path]) -> str:
    """The table in Markdown, with a line above it; ``roots``: each supported release's
    tree (the directory holding ``sglang/``), a column each: whether a change applies there, is retired
    (upstream does it itself) or is for another release's layout."""
    registered = [h for h in hooks if getattr(h, "selected_by", None)]
    versions = list(roots)
    rows = [
        f"Against `sglang=={PINNED_SGLANG_VERSION}` (the pin) and every supported release "
        f"({', '.join(versions)}): {len(series.patches)} patch(es) in `patches/series`, "
        f"{len(hooks) - len(registered)} runtime hook(s) and {len(registered)} registered backend(s) "
        "in `prfaas_sglang/plugin.py`.",
        "",
        "| # | change | mechanism | touches | " + " | ".join(f"on {v}" for v in versions) + " | Upstream-Status | removal |",
        "|---|---|---|---|" + "---|" * len(versions) + "---|---|",
    ]
    for n, patch in enumerate(series.patches, 1):
        files = ", ".join(f"`{fp.path}`" for fp in patch.files)
        cells = " | ".join(WHERE[_patch_where(patch, root)] for root in roots.values())
        rows.append(
            f"| {n} | {_cell(patch.subject)} | patch `{patch.name}` | {files} | {cells} | "
            f"{_cell(patch.header.get('Upstream-Status', ''))} | {_cell(patch.header.get('Removal', ''))} |"
        )
    for n, hook in enumerate(hooks, len(series.patches) + 1):
        selected_by = getattr(hook, "selected_by", None)
        mechanism = (f"backend `{hook.name}` registered with SGLang, selected by `{_cell(selected_by)}`"
                     if selected_by else f"{hook.hook_type} hook `{hook.name}`")
        cells = " | ".join(WHERE[hook.where(root)] for root in roots.values())
        rows.append(
            f"| {n} | {_cell(hook.subject)} | {mechanism} | `{hook.target}` | {cells} | "
            f"{_cell(hook.upstream_status)} | {_cell(hook.removal)} |"
        )
    if not series.patches:
        rows += ["", "The series is empty: no upstream file is edited yet (the engine issues add their seams)."]
    return "\n".join(rows)


def release_roots() -> dict[str, Path]:
    """Every supported release's tree here (:func:`prfaas_sglang._compat.release_root`); raises ValueError
    naming one that is missing (``make env`` builds the overlays)."""
    from prfaas_sglang._compat import release_root
    from prfaas_sglang._pin import SUPPORTED_SGLANG_VERSIONS

    roots = {v: release_root(v) for v in SUPPORTED_SGLANG_VERSIONS}
    if missing := [v for v, root in roots.items() if root is None]:
        raise ValueError(f"no sglang {', '.join(missing)} here to read: run `make env` (it builds an overlay per "
                         "supported release)")
    return roots
