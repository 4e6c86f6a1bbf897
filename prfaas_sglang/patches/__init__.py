"""The quilt-style patch series against the pinned SGLang, and its tooling.

``patches/series`` (in the repository; packaged into the wheel as
``prfaas_sglang/_patches``) is the only source of order. See
``python -m prfaas_sglang.patches --help`` (``__main__``) and patches/README.md.

``series`` parses the series and its headers, ``unidiff`` parses and applies unified diffs (both
pure), ``applier`` evaluates and applies a whole series against a ``tree`` (an installed sglang, an
unpacked or rewritten wheel), ``upstream_api`` reads statically where our hooks and backends meet
SGLang, and ``changes_table`` renders the table of changes against upstream (the site's reference page).
"""

from __future__ import annotations

from pathlib import Path

from prfaas_sglang._compat import require_supported
from prfaas_sglang.errors import PatchError

# The layering map (docs/architecture.md, checked by tests/unit/test_layering.py): an I/O package;
# these modules of it are pure.
PURE_MODULES = ("unidiff",)

def verify_installed(patches_dir: Path | None = None) -> str:
    """Check the installed SGLang is a supported release with every patch it needs applied (a patch
    whose Upstream-Marker the release shows is retired there: ``Series.for_tree``).

    Returns a one-line summary; raises UpstreamVersionError or PatchError
    (naming what is missing and how to fix it). Reads files only.
    """
    from prfaas_sglang.patches.applier import evaluate_tree
    from prfaas_sglang.patches.series import load_series
    from prfaas_sglang.patches.tree import default_patches_dir, installed_tree

    tree = installed_tree()
    require_supported(tree.version, tree.label)
    series = load_series(patches_dir or default_patches_dir()).for_tree(tree.root)
    report = evaluate_tree(series, tree)
    missing = [p.patch.name for p in report.patches if p.status.value != "already applied"]
    if missing:
        raise PatchError(
            f"{tree.label} lacks {len(missing)} patch(es) of the series ({', '.join(missing)}); "
            "run `python -m prfaas_sglang.patches apply` or install the patched wheel"
        )
    return f"sglang {tree.version} with all {len(series.patches)} patch(es) of the series applied"
