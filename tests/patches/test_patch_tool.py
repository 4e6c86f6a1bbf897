"""`python -m prfaas_sglang.patches` against real sglang 0.5.15 files (fixture series)."""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import json
import shutil
import zipfile
from pathlib import Path

import pytest
from helpers import FIXTURE_PATCHES, REPO_ROOT, run_py

from prfaas_sglang.errors import PatchError, UpstreamVersionError
from prfaas_sglang.patches.applier import PatchStatus, apply_to_tree, evaluate_tree
from prfaas_sglang.patches.series import REQUIRED_FIELDS, lint, load_series, parse_header
from prfaas_sglang.patches.tree import (
    SourceTree,
    find_or_download_wheel,
    wheel_version,
    write_patched_wheel,
)

PLUGINS_FILE = "sglang/srt/plugins/__init__.py"
SEAM_FILE = "sglang/srt/prfaas_seam.py"


def patches_cli(*args: str, env: dict | None = None):
    return run_py(["-m", "prfaas_sglang.patches", *args], env=env)


def corrupt_context_line(patch_path: Path) -> None:
    """Change one context line of hunk 2 so it no longer matches upstream."""
    text = patch_path.read_text()
    needle = "\n     # Apply all registered hooks"
    assert needle in text
    patch_path.write_text(text.replace(needle, "\n     # Apply SOME registered hooks", 1))


class TestCheckCli:
    def test_fixture_series_checks_clean_against_installed_sglang(self):
        proc = patches_cli("--patches-dir", str(FIXTURE_PATCHES), "check")
        assert proc.returncode == 0, proc.stderr
        assert "applies" in proc.stdout and "0001-launch-make-plugin-failures-fatal.patch" in proc.stdout

    def test_corrupted_patch_exits_nonzero_naming_patch_and_hunk(self, fixture_series_dir):
        corrupt_context_line(fixture_series_dir / "0001-launch-make-plugin-failures-fatal.patch")
        proc = patches_cli("--patches-dir", str(fixture_series_dir), "check")
        assert proc.returncode == PatchError.exit_code
        assert "0001-launch-make-plugin-failures-fatal.patch" in proc.stderr
        assert f"{PLUGINS_FILE}: hunk 2" in proc.stderr
        assert "Apply SOME registered hooks" in proc.stderr
        # The other patch is still reported as fine.
        assert "0002-launch-add-seam-module.patch" in proc.stdout

    def test_project_series_checks_clean(self):
        proc = patches_cli("check")
        assert proc.returncode == 0, proc.stderr

    def test_unparseable_patch_is_named(self, fixture_series_dir):
        (fixture_series_dir / "0002-launch-add-seam-module.patch").write_text("Subject: x\n--- a/f\n+++ b/f\n@@ nope @@\n")
        proc = patches_cli("--patches-dir", str(fixture_series_dir), "check")
        assert proc.returncode != 0
        assert "0002-launch-add-seam-module.patch" in proc.stderr and "malformed hunk header" in proc.stderr


class TestApply:
    def test_apply_is_idempotent_and_writes_real_files(self, sglang_tree):
        series = load_series(FIXTURE_PATCHES)
        tree = SourceTree(sglang_tree, "tmp tree")
        before = (sglang_tree / PLUGINS_FILE).read_text()

        first = apply_to_tree(series, tree)
        assert [p.status for p in first.patches] == [PatchStatus.APPLIES, PatchStatus.APPLIES]
        after = (sglang_tree / PLUGINS_FILE).read_text()
        assert after != before and "PrfaaS(0001)" in after
        assert (sglang_tree / SEAM_FILE).read_text().startswith('"""PrfaaS(0002)')

        second = apply_to_tree(series, tree)
        assert [p.status for p in second.patches] == [PatchStatus.ALREADY_APPLIED] * 2
        assert (sglang_tree / PLUGINS_FILE).read_text() == after

    def test_patched_file_still_compiles(self, sglang_tree):
        apply_to_tree(load_series(FIXTURE_PATCHES), SourceTree(sglang_tree, "tmp"))
        compile((sglang_tree / PLUGINS_FILE).read_text(), PLUGINS_FILE, "exec")

    def test_apply_cli_on_a_directory(self, sglang_tree):
        args = ["--patches-dir", str(FIXTURE_PATCHES), "apply", "--target", str(sglang_tree)]
        proc = patches_cli(*args)
        assert proc.returncode == 0, proc.stderr
        assert "applied 2, already applied 0" in proc.stdout
        again = patches_cli(*args)
        assert again.returncode == 0 and "applied 0, already applied 2" in again.stdout

    def test_failed_series_writes_nothing(self, sglang_tree, fixture_series_dir):
        corrupt_context_line(fixture_series_dir / "0001-launch-make-plugin-failures-fatal.patch")
        before = (sglang_tree / PLUGINS_FILE).read_text()
        with pytest.raises(PatchError, match="hunk 2"):
            apply_to_tree(load_series(fixture_series_dir), SourceTree(sglang_tree, "tmp"))
        assert (sglang_tree / PLUGINS_FILE).read_text() == before
        assert not (sglang_tree / SEAM_FILE).exists(), "patch 0002 must not land when 0001 fails"

    def test_apply_refuses_a_mismatched_sglang_version(self, sglang_tree):
        version_file = sglang_tree / "sglang" / "_version.py"
        version_file.write_text(version_file.read_text().replace("'0.5.15'", "'0.5.14'"))
        proc = patches_cli("--patches-dir", str(FIXTURE_PATCHES), "apply", "--target", str(sglang_tree))
        assert proc.returncode == UpstreamVersionError.exit_code
        assert "sglang 0.5.14" in proc.stderr and "supports sglang 0.5.15, 0.5.23" in proc.stderr
        assert "PrfaaS" not in (sglang_tree / PLUGINS_FILE).read_text()

    def test_partially_applied_series_is_reported(self, sglang_tree):
        series = load_series(FIXTURE_PATCHES)
        seam = series.patches[1].files[0]
        (sglang_tree / SEAM_FILE).write_text("".join(seam.hunks[0].new_lines))
        report = evaluate_tree(series, SourceTree(sglang_tree, "tmp"))
        assert [p.status for p in report.patches] == [PatchStatus.APPLIES, PatchStatus.ALREADY_APPLIED]
        assert report.ok and not report.fully_applied


class TestPatchedWheel:
    @pytest.mark.slow
    def test_patched_wheel_has_version_label_content_and_valid_record(self, tmp_path):
        pristine = find_or_download_wheel("0.5.15")
        series = load_series(FIXTURE_PATCHES)
        with zipfile.ZipFile(pristine) as zf:
            tree_root = tmp_path / "unpacked"
            zf.extractall(tree_root)
        report = evaluate_tree(series, SourceTree(tree_root, "wheel"))
        out = write_patched_wheel(pristine, report.changes, f"prfaas.{series.digest}", tmp_path / "out")

        assert out.name.startswith(f"sglang-0.5.15+prfaas.{series.digest}-")
        assert wheel_version(out) == f"0.5.15+prfaas.{series.digest}"
        with zipfile.ZipFile(out) as zf:
            names = set(zf.namelist())
            info = f"sglang-0.5.15+prfaas.{series.digest}.dist-info"
            assert f"{info}/METADATA" in names and not any(n.startswith("sglang-0.5.15.dist-info/") for n in names)
            assert f"Version: 0.5.15+prfaas.{series.digest}" in zf.read(f"{info}/METADATA").decode()
            assert "PrfaaS(0001)" in zf.read(PLUGINS_FILE).decode()
            assert SEAM_FILE in names
            rows = list(csv.reader(io.StringIO(zf.read(f"{info}/RECORD").decode())))
            recorded = {row[0] for row in rows}
            assert recorded == names
            for name, digest, size in rows:
                if not digest:
                    continue
                data = zf.read(name)
                expected = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
                assert digest == f"sha256={expected}" and int(size) == len(data), name

    @pytest.mark.slow
    def test_apply_wheel_out_cli_writes_the_image_wheel(self, tmp_path):
        series = load_series(FIXTURE_PATCHES)
        proc = patches_cli("--patches-dir", str(FIXTURE_PATCHES), "apply", "--wheel-out", str(tmp_path))
        assert proc.returncode == 0, proc.stderr
        (wheel,) = tmp_path.glob("sglang-0.5.15+prfaas.*.whl")
        assert wheel_version(wheel) == f"0.5.15+prfaas.{series.digest}"
        assert f"wrote {wheel}" in proc.stdout

    def test_pin_still_matches_the_patched_version(self):
        from packaging.specifiers import SpecifierSet

        assert "0.5.15+prfaas.0123abcd" in SpecifierSet("==0.5.15")


class TestRebaseCheck:
    @pytest.mark.slow
    def test_rebase_check_table_on_a_given_wheel(self):
        wheel = find_or_download_wheel("0.5.15")
        proc = patches_cli("--patches-dir", str(FIXTURE_PATCHES), "rebase-check", "--wheel", str(wheel))
        assert proc.returncode == 0, proc.stderr
        assert "| 0001-launch-make-plugin-failures-fatal.patch | applies |" in proc.stdout

    @pytest.mark.slow
    def test_rebase_check_reports_failure_per_patch(self, fixture_series_dir):
        corrupt_context_line(fixture_series_dir / "0001-launch-make-plugin-failures-fatal.patch")
        wheel = find_or_download_wheel("0.5.15")
        proc = patches_cli("--patches-dir", str(fixture_series_dir), "rebase-check", "--wheel", str(wheel), "--json")
        assert proc.returncode == 1
        report = json.loads(proc.stdout)
        statuses = {row["patch"]: row["status"] for row in report["patches"]}
        assert statuses == {
            "0001-launch-make-plugin-failures-fatal.patch": "fails",
            "0002-launch-add-seam-module.patch": "applies",
        }

    @pytest.mark.slow
    @pytest.mark.network
    def test_rebase_check_downloads_the_newer_release(self):
        """The acceptance command: downloads sglang 0.5.23 from the index and prints a table."""
        proc = patches_cli("--patches-dir", str(FIXTURE_PATCHES), "rebase-check", "--sglang-version", "0.5.23")
        assert proc.returncode in (0, 1), proc.stderr
        assert "onto sglang 0.5.23" in proc.stdout
        assert proc.stdout.count("| 000") == 2


class TestLint:
    def test_project_series_is_clean(self):
        assert lint(REPO_ROOT / "patches", REPO_ROOT) == []

    def test_fixture_series_is_clean(self):
        assert lint(FIXTURE_PATCHES, REPO_ROOT) == []

    def test_unlisted_file_is_reported(self, fixture_series_dir):
        shutil.copy(fixture_series_dir / "0002-launch-add-seam-module.patch", fixture_series_dir / "0003-launch-stray.patch")
        assert any("0003-launch-stray.patch: in" in p and "not in series" in p for p in lint(fixture_series_dir))

    @pytest.mark.parametrize("field", REQUIRED_FIELDS)
    def test_every_missing_header_field_is_reported(self, fixture_series_dir, field):
        path = fixture_series_dir / "0002-launch-add-seam-module.patch"
        text = path.read_text()
        path.write_text("\n".join(line for line in text.splitlines() if not line.startswith(f"{field}:")) + "\n")
        assert f"0002-launch-add-seam-module.patch: header field {field!r} is missing or empty" in lint(fixture_series_dir)

    def test_bad_upstream_status_and_bad_name(self, fixture_series_dir):
        path = fixture_series_dir / "0002-launch-add-seam-module.patch"
        path.write_text(path.read_text().replace("Upstream-Status: vendor-specific", "Upstream-Status: maybe"))
        (fixture_series_dir / "series").write_text("0001-launch-make-plugin-failures-fatal.patch\n0002-launch-add-seam-module.patch\nBad_Name.patch\n")
        shutil.copy(path, fixture_series_dir / "Bad_Name.patch")
        problems = lint(fixture_series_dir)
        assert any("Upstream-Status 'maybe'" in p for p in problems)
        assert any(p.startswith("Bad_Name.patch: name must look like") for p in problems)

    def test_lint_cli_exit_code(self, fixture_series_dir):
        (fixture_series_dir / "series").write_text("0001-launch-make-plugin-failures-fatal.patch\n")
        proc = patches_cli("--patches-dir", str(fixture_series_dir), "lint")
        assert proc.returncode == 1 and "0002-launch-add-seam-module.patch: in" in proc.stdout

    def test_header_parser_reads_continuations(self):
        header = parse_header((FIXTURE_PATCHES / "0001-launch-make-plugin-failures-fatal.patch").read_text())
        assert header["Why"].startswith("sglang.srt.plugins.load_plugins logs and skips")
        assert header["Why"].endswith("deployed with.")
        assert header["Subject"] == "[PATCH] [launch] Make a failing whitelisted plugin stop startup"


class TestUpstreamApi:
    """rebase-check's static view of hook targets and overridden methods in another release."""

    def tree(self, root: Path, source: str) -> Path:
        path = root / "sglang" / "srt" / "cache.py"
        path.parent.mkdir(parents=True, exist_ok=True)
        (root / "sglang" / "__init__.py").write_text("")
        path.write_text(source)
        return root

    def test_same_changed_and_missing_targets(self, tmp_path):
        from prfaas_sglang.patches.upstream_api import compare, find_params, marker_found

        pinned = self.tree(tmp_path / "a", "class Cache:\n    def insert(self, key, value, chunked=False): ...\n"
                                           "    def evict(self, n): ...\n    def take(self): ...\n"
                                           "def release(req, cache, is_insert=True): ...\n")
        newer = self.tree(tmp_path / "b", "class Cache:\n    def insert(self, key, value, chunked=False): ...\n"
                                          "    def evict(self, n, *, mamba=0): ...\n"
                                          "def release(req, cache, *, checkpoint): ...\nFLAG = 'enable_component_events'\n")
        assert find_params(pinned, "sglang.srt.cache.Cache.insert") == ("self", "key", "value", "chunked")
        assert find_params(pinned, "sglang.srt.cache.Cache") == ()  # no __init__ of its own
        assert compare(pinned, newer, "sglang.srt.cache.Cache.insert").status == "same"
        changed = compare(pinned, newer, "sglang.srt.cache.Cache.evict")
        assert changed.status == "changed" and "(self, n, *, mamba)" in changed.detail
        assert compare(pinned, newer, "sglang.srt.cache.Cache.take").status == "missing"
        assert compare(pinned, newer, "sglang.srt.gone.Thing.method").status == "missing"
        assert compare(pinned, newer, "sglang.srt.cache.release").status == "changed"
        # a signature the spec records for a supported release is a port done
        assert compare(pinned, newer, "sglang.srt.cache.release",
                       ("(req: 'Req', tree_cache: 'BasePrefixCache', *, checkpoint: 'bool')",)).status == "changed"
        assert compare(pinned, newer, "sglang.srt.cache.release",
                       ("(req: 'Req', cache: 'X', *, checkpoint: 'bool')",)).status == "ported"
        assert marker_found(newer, ("sglang/srt/cache.py", "enable_component_events"))
        assert not marker_found(pinned, ("sglang/srt/cache.py", "enable_component_events"))
        assert not marker_found(newer, None)

    def test_a_method_a_class_inherits_is_found_in_its_base(self, tmp_path):
        from prfaas_sglang.patches.upstream_api import find_params

        root = self.tree(tmp_path, "from sglang.srt.base import Common\n"
                                   "class Receiver(Common):\n    def poll(self): ...\n")
        (root / "sglang" / "srt" / "base.py").write_text("class Root:\n    def __init__(self, mgr): ...\n"
                                                        "class Common(Root):\n    def ack(self, room): ...\n")
        assert find_params(root, "sglang.srt.cache.Receiver.ack") == ("self", "room")  # one base up, another module
        assert find_params(root, "sglang.srt.cache.Receiver") == ("self", "mgr")  # __init__ two bases up
        assert find_params(root, "sglang.srt.cache.Receiver.gone") is None

    def test_signature_text_reads_as_the_static_parameters(self):
        from prfaas_sglang.patches.upstream_api import signature_params

        assert signature_params("(self, node: 'UnifiedTreeNode', target: 'EvictLayer' = <EvictLayer.DEVICE: 1>) "
                                "-> 'tuple[int, int]'") == ("self", "node", "target")
        assert signature_params("(a, /, b: 'dict[str, int]' = {}, *args, c, **kw) -> None") == (
            "a/", "b", "*args", "c", "**kw")

    def test_every_hook_and_override_is_found_in_the_installed_release(self, installed_sglang_root):
        """The static reader agrees with import-time signatures on the pinned release."""
        import inspect

        from prfaas_sglang.patches.upstream_api import find_params
        from prfaas_sglang.plugin import HOOKS, REGISTRATIONS, resolve_target

        targets = [h.target for h in HOOKS if h.applies()] + [t for r in REGISTRATIONS if r.applies() for t, _ in r.overrides]
        for target in targets:
            found = find_params(installed_sglang_root, target)
            signature = inspect.signature(inspect.unwrap(resolve_target(target)))
            assert found is not None, target
            assert [name.strip("*/") for name in found if name != "*"] == list(signature.parameters), target

    @pytest.mark.slow
    def test_rebase_check_lists_hooks_and_backends(self):
        wheel = find_or_download_wheel("0.5.15")
        proc = patches_cli("--patches-dir", str(FIXTURE_PATCHES), "rebase-check", "--wheel", str(wheel), "--json")
        assert proc.returncode == 0, proc.stderr
        hooks = {h["name"]: h for h in json.loads(proc.stdout)["hooks"]}
        assert {"role-contract", "kv-send", "prfaas-hybrid", "prfaas-zmq"} <= set(hooks)
        from prfaas_sglang.plugin import HOOKS, REGISTRATIONS

        # what only a newer release takes (its only_if marker is not in 0.5.15, the installed release here)
        newer_only = {spec.name for spec in (*HOOKS, *REGISTRATIONS) if spec.where() == "not applicable"}
        assert {"kv-send-ack-drain", "prfaas-hybrid-unified", "decode-peer-rebootstrap"} <= newer_only
        assert all(h["status"] == "same" and not h["upstream_has_it"] for name, h in hooks.items() if name not in newer_only)
        # a hook or backend only a newer release's layout takes is not a port this release needs
        assert all(hooks[n]["status"] == "not applicable" and hooks[n]["targets"] == [] for n in newer_only)
