"""``python -m prfaas_sglang.patches``: list, lint, check, apply, rebase-check.

Exit codes: 0 ok; 1 a check found problems (lint, rebase fails);
2 bad usage; 3 wrong SGLang version; 4 the series does not apply.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from prfaas_sglang._compat import require_pinned, require_supported
from prfaas_sglang._pin import PINNED_SGLANG_VERSION, REBASE_TARGET_SGLANG_VERSION
from prfaas_sglang.errors import PatchError, PrfaasError
from prfaas_sglang.patches.applier import (
    SeriesReport,
    apply_to_tree,
    evaluate_tree,
    failure_message,
)
from prfaas_sglang.patches.series import Series, lint, load_series
from prfaas_sglang.patches.tree import (
    SourceTree,
    default_patches_dir,
    find_or_download_wheel,
    installed_tree,
    is_checkout,
    latest_sglang_version,
    record_created_files,
    unpack_wheel,
    wheel_version,
    write_patched_wheel,
)

_REPO_ROOT = Path(__file__).resolve().parents[2]


def _resolve_target(against: str, workdir: Path, series_version: str = PINNED_SGLANG_VERSION) -> SourceTree:
    """``installed`` | ``pristine`` | a wheel path | a directory containing ``sglang/``."""
    if against == "installed":
        return installed_tree()
    if against == "pristine":
        return unpack_wheel(find_or_download_wheel(series_version), workdir)
    path = Path(against)
    if path.suffix == ".whl" and path.is_file():
        return unpack_wheel(path, workdir)
    if (path / "sglang").is_dir():
        return SourceTree(path, f"tree at {path}")
    raise PatchError(f"--against {against!r}: not 'installed', 'pristine', a .whl file or a directory holding sglang/")


def _print_report(report: SeriesReport) -> None:
    print(f"target: {report.target} (sglang {report.version or 'unknown'})")
    if not report.patches:
        print("series is empty: nothing to apply")
    for pr in report.patches:
        extra = ""
        if pr.offsets():
            extra = " (" + "; ".join(pr.offsets()) + ")"
        print(f"  {pr.status.value:<20} {pr.patch.name}{extra}")
        for line in pr.failure_lines():
            print(f"      {line}")


def cmd_list(series: Series, args) -> int:
    if not series.patches:
        print(f"{series.directory / 'series'}: empty")
    for n, patch in enumerate(series.patches, 1):
        files = ", ".join(fp.path for fp in patch.files)
        print(f"{n:>3}  {patch.name}  {patch.subject}  [{patch.header.get('Upstream-Status', '?')}]  {files}")
    return 0


def cmd_lint(series_dir: Path, args) -> int:
    # The headers' Tests fields are checked where the tests are: a checkout, not an image's build stage (its
    # context has the package and the series, no tests/; the engine images' builds failed on that).
    with_tests = is_checkout() and (_REPO_ROOT / "tests").is_dir()
    problems = lint(series_dir, _REPO_ROOT if with_tests else None)
    for problem in problems:
        print(problem)
    if not problems:
        print(f"{series_dir}: series is clean" + ("" if with_tests else " (Tests fields not checked: no tests/ here)"))
    return 1 if problems else 0


def _say_retired(series: Series, tree) -> None:
    for patch in series.retired_in(tree.root):
        print(f"{patch.name}: retired on sglang {tree.version} (upstream does it itself: {' :: '.join(patch.upstream_marker)})")


def cmd_check(series: Series, args) -> int:
    with tempfile.TemporaryDirectory(prefix="prfaas-check-") as tmp:
        tree = _resolve_target(args.against, Path(tmp))
        require_supported(tree.version, tree.label)
        _say_retired(series, tree)
        series = series.for_tree(tree.root)
        report = evaluate_tree(series, tree)
        _print_report(report)
    if not report.ok:
        print(failure_message(report), file=sys.stderr)
        return PatchError.exit_code
    print(f"ok: {len(series.patches)} patch(es) apply to sglang {report.version}")
    return 0


def cmd_apply(series: Series, args) -> int:
    if args.wheel_out:
        with tempfile.TemporaryDirectory(prefix="prfaas-apply-") as tmp:
            pristine = Path(args.wheel) if args.wheel else find_or_download_wheel(PINNED_SGLANG_VERSION)
            tree = unpack_wheel(pristine, Path(tmp))
            require_pinned(tree.version, tree.label)
            report = evaluate_tree(series, tree)
            if not report.ok:
                raise PatchError(failure_message(report))
            out = write_patched_wheel(pristine, report.changes, f"prfaas.{series.digest}", Path(args.wheel_out))
        _print_report(report)
        print(f"wrote {out}")
        return 0
    with tempfile.TemporaryDirectory(prefix="prfaas-apply-") as tmp:
        tree = _resolve_target(args.target, Path(tmp))
        require_supported(tree.version, tree.label)
        _say_retired(series, tree)
        report = apply_to_tree(series.for_tree(tree.root), tree)
        record_created_files(tree)
    _print_report(report)
    applied = sum(1 for p in report.patches if not p.status.value.startswith("already"))
    print(f"ok: applied {applied}, already applied {len(report.patches) - applied} on {tree.label}")
    return 0


DONE = ("same", "ported", "retired", "not applicable")  # a hook or backend row with nothing left to port


def _hook_row(spec, pinned: Path, root: Path) -> dict:
    """One hook's or registered backend's row of ``rebase-check`` against the tree at ``root``: ``retired``
    (upstream does it itself), ``not applicable`` (for another release's layout), ``same`` (every target
    as on the pin), ``ported`` (some targets differ from the pin's, each as the spec records for a
    supported release), or ``needs a port``."""
    from prfaas_sglang.patches import upstream_api
    from prfaas_sglang.plugin import RegistrationSpec

    where = spec.where(root)
    statuses = []
    if where == "applies":
        if isinstance(spec, RegistrationSpec):
            pairs = [*spec.overrides, (spec.registry, ())]
        else:
            pairs = [(spec.target, spec.expected_signature)]
        statuses = [upstream_api.compare(pinned, root, target, (sig,) if isinstance(sig, str) else tuple(sig))
                    for target, sig in pairs]
        bad = [s for s in statuses if s.status in ("changed", "missing")]
        status = "needs a port" if bad else "ported" if any(s.status == "ported" for s in statuses) else "same"
    else:
        status = where
    return {"name": spec.name, "mechanism": getattr(spec, "hook_type", "registry"), "status": status,
            "upstream_has_it": where == "retired",
            "targets": [{"target": s.target, "status": s.status, "detail": s.detail} for s in statuses
                        if s.status != "same"]}


def cmd_rebase_check(series: Series, args) -> int:
    from prfaas_sglang.plugin import HOOKS, REGISTRATIONS

    version = args.sglang_version
    if version == "latest":
        version = latest_sglang_version()
    with tempfile.TemporaryDirectory(prefix="prfaas-rebase-") as tmp:
        wheel = Path(args.wheel) if args.wheel else find_or_download_wheel(version)
        version = wheel_version(wheel)
        tree = unpack_wheel(wheel, Path(tmp))
        retired_patches = series.retired_in(tree.root)
        report = evaluate_tree(series.for_tree(tree.root), tree)
        pinned = installed_tree().root
        hooks = [_hook_row(spec, pinned, tree.root) for spec in HOOKS + REGISTRATIONS]
    rows = [{"patch": p.name, "status": "retired", "offsets": [], "failures": [], "upstream_has_it": True}
            for p in retired_patches]
    rows += [
        {
            "patch": pr.patch.name,
            "status": pr.status.value,
            "offsets": pr.offsets(),
            "failures": pr.failure_lines(),
            "upstream_has_it": False,
        }
        for pr in report.patches
    ]
    hooks_ok = all(h["status"] in DONE for h in hooks)
    if args.json:
        print(json.dumps({"sglang_version": version, "series_digest": series.digest, "ok": report.ok and hooks_ok,
                          "patches": rows, "hooks": hooks}, indent=2))
    else:
        print(f"rebase-check: series {series.directory} ({len(rows)} patch(es)) onto sglang {version}")
        print(f"| patch | sglang {version} | upstream does it itself | detail |")
        print("|---|---|---|---|")
        for row in rows:
            detail = "; ".join(row["failures"] or row["offsets"]) or "-"
            print(f"| {row['patch']} | {row['status']} | {'yes' if row['upstream_has_it'] else 'no'} "
                  f"| {detail} |")
        if not rows:
            print("| (series is empty) | - | - | nothing to rebase |")
        print()
        print(f"| hook or registered backend | sglang {version} | upstream does it itself | what moved |")
        print("|---|---|---|---|")
        for h in hooks:
            moved = "; ".join(f"{t['target']}: {t['status']} {t['detail']}".strip() for t in h["targets"]) or "-"
            print(f"| {h['mechanism']} `{h['name']}` | {h['status']} | {'yes' if h['upstream_has_it'] else 'no'} "
                  f"| {moved} |")
        retired = [r["patch"] for r in rows if r["status"] == "retired"] + [h["name"] for h in hooks
                                                                            if h["status"] == "retired"]
        print("result: " + ("every patch applies" if report.ok else "some patches FAIL")
              + ("; nothing left to port" if hooks_ok else "; some hooks need a port")
              + (f"; retired there (upstream does it itself): {', '.join(retired)}" if retired else ""))
    return 0 if report.ok and hooks_ok else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m prfaas_sglang.patches",
        description=f"Manage the quilt-style patch series against sglang=={PINNED_SGLANG_VERSION}.",
    )
    parser.add_argument("--patches-dir", type=Path, default=None, help="directory with `series` (default: %(default)s -> the project's patches/)")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="the series in order")
    sub.add_parser("lint", help="every file listed, every header field present")
    check = sub.add_parser("check", help="dry-run the whole series; non-zero names the failing patch and hunk")
    check.add_argument("--against", default="installed", help="installed (default) | pristine (download the pinned wheel) | PATH.whl | DIR")
    apply = sub.add_parser("apply", help="apply the series (idempotent), or write a patched wheel")
    apply.add_argument("--target", default="installed", help="installed (default) | DIR holding sglang/")
    apply.add_argument("--wheel-out", default=None, help="write sglang-<pin>+prfaas.<digest>-*.whl here instead of patching in place")
    apply.add_argument("--wheel", default=None, help="pristine wheel to start from (default: cache or download)")
    rebase = sub.add_parser("rebase-check", help="try the series on another sglang release; per-patch table")
    rebase.add_argument("--sglang-version", default=REBASE_TARGET_SGLANG_VERSION, help="a release, or 'latest' (default: %(default)s)")
    rebase.add_argument("--wheel", default=None, help="use this wheel instead of downloading")
    rebase.add_argument("--json", action="store_true", help="print the result as JSON")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    series_dir = args.patches_dir or default_patches_dir()
    try:
        if args.command == "lint":
            return cmd_lint(series_dir, args)
        series = load_series(series_dir)
        handler = {
            "list": cmd_list,
            "check": cmd_check,
            "apply": cmd_apply,
            "rebase-check": cmd_rebase_check,
        }[args.command]
        return handler(series, args)
    except PrfaasError as err:
        print(f"error: {err}", file=sys.stderr)
        return err.exit_code


if __name__ == "__main__":
    sys.exit(main())
