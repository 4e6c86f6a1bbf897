"""The sglang.srt.plugins entry point: hooks install, verify, and stop startup loudly.

Scenarios run in a subprocess (tests/unit/plugin_probe.py) because SGLang's
HookRegistry and the functions it patches are process-global.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import zygote
from helpers import REPO_ROOT

from prfaas_sglang.errors import UpstreamVersionError
from prfaas_sglang.plugin import HOOKS
from prfaas_sglang.roles import KvTransport, Role, role_contract_violations

TINY_MODEL = REPO_ROOT / "tests" / "fixtures" / "models" / "tiny-qwen3-next"
PROBE = Path(__file__).with_name("plugin_probe.py")


SCENARIOS = ("role_contract", "unresolvable_target", "apply_fails", "load_plugins_stops", "idempotent")


@pytest.fixture(scope="module")
def probes() -> dict:
    """Every scenario's result, from one process (forked from the SGLang zygote) that forks per scenario."""
    proc = zygote.run([sys.executable, str(PROBE), ",".join(SCENARIOS), str(TINY_MODEL)],
                      env={**os.environ, "PRFAAS_ROLE": ""}, timeout=240)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("PROBE-RESULT ")]
    assert lines, f"the probe printed no result\nstdout:{proc.stdout[-2000:]}\nstderr:{proc.stderr[-3000:]}"
    results = json.loads(lines[-1][len("PROBE-RESULT ") :])
    assert not [r for r in results.values() if "probe_error" in r], results
    return results


@pytest.fixture(scope="module")
def role_contract(probes) -> dict:
    return probes["role_contract"]


class TestRoleContractThroughSGLang:
    @pytest.mark.slow
    def test_entry_point_installs_every_hook(self, role_contract):
        assert role_contract["installed"] == {spec.name: True for spec in HOOKS if spec.applies()}

    def test_entry_point_registers_the_backends_with_sglangs_registries(self, role_contract):
        assert role_contract["registered"] == {"prfaas-hybrid": "build_tree_cache", "prfaas-zmq": "StateEventsZmqPublisher"}

    def test_no_role_leaves_stock_behaviour(self, role_contract):
        assert role_contract["no_role_decode"] == {"ok": True, "mode": "decode", "backend": "mooncake"}

    @pytest.mark.parametrize("case", ["prfaas_prefill", "pd_decode_decode"])
    def test_matching_role_starts(self, role_contract, case):
        assert role_contract[case]["ok"], role_contract[case]

    @pytest.mark.parametrize(
        "case, message",
        [
            ("prfaas_decode", "role prfaas needs --disaggregation-mode prefill, got 'decode'"),
            ("pd_decode_prefill", "role pd-decode needs --disaggregation-mode decode, got 'prefill'"),
            ("prfaas_tcp_without_force", "MC_FORCE_TCP is not 1"),
            ("unknown_role", "PRFAAS_ROLE: unknown role 'decoder'"),
        ],
    )
    def test_contradicting_role_stops_startup(self, role_contract, case, message):
        result = role_contract[case]
        assert not result["ok"]
        assert result["type"] == "RoleContractError"
        assert message in result["message"]


class TestLoudFailures:
    @pytest.mark.slow
    def test_unresolvable_target_exits(self, probes):
        result = probes["unresolvable_target"]
        assert result["exited"] and result["is_system_exit"]
        assert "no_such_function does not resolve" in result["message"]

    @pytest.mark.slow
    def test_hook_sglang_refuses_to_apply_exits(self, probes):
        """SGLang's HookRegistry logs and skips an AROUND hook on a class; we stop instead."""
        result = probes["apply_fails"]
        assert result["exited"]
        assert "did not take effect" in result["message"] and "class-around" in result["message"]

    @pytest.mark.slow
    def test_failure_is_not_swallowed_by_load_plugins(self, probes):
        result = probes["load_plugins_stops"]
        assert result["exited"] and "does not resolve" in result["message"]

    @pytest.mark.slow
    def test_register_is_idempotent(self, probes):
        result = probes["idempotent"]
        assert result["extra_registrations"] == {} and result["targets"] >= 2, result


class TestRoleContractPure:
    @pytest.mark.parametrize(
        "role, mode, backend, transport, env, expected",
        [
            (Role.PRFAAS, "prefill", "mooncake", None, {"MC_FORCE_TCP": "1"}, []),
            (Role.PRFAAS, "prefill", "mooncake", KvTransport.RDMA, {}, ["cannot use the rdma KV transport"]),
            (Role.PD_PREFILL, "prefill", "mooncake", KvTransport.RDMA, {}, []),
            (Role.PD_DECODE, "decode", "nixl", KvTransport.RDMA, {}, ["ships KV with Mooncake"]),
            (Role.PD_DECODE, None, "mooncake", None, {"MC_FORCE_TCP": "1"}, ["needs --disaggregation-mode decode"]),
            (Role.ROUTER, None, None, None, {}, ["control-plane role"]),
        ],
    )
    def test_violations(self, role, mode, backend, transport, env, expected):
        found = role_contract_violations(role, mode, backend, transport, env)
        assert len(found) == len(expected)
        for want, got in zip(expected, found, strict=True):
            assert want in got


class TestVersionGate:
    def test_every_supported_release_is_accepted_and_another_refused_with_the_override_named(self, monkeypatch):
        from prfaas_sglang._compat import require_supported
        from prfaas_sglang._pin import SUPPORTED_SGLANG_VERSIONS

        monkeypatch.delenv("PRFAAS_ALLOW_SGLANG_VERSION", raising=False)
        assert {"0.5.15", "0.5.23"} <= set(SUPPORTED_SGLANG_VERSIONS)
        for version in SUPPORTED_SGLANG_VERSIONS:
            require_supported(version, "this environment")
        require_supported("0.5.15+prfaas.abcd1234", "this environment")
        with pytest.raises(UpstreamVersionError, match="PRFAAS_ALLOW_SGLANG_VERSION=0.5.20"):
            require_supported("0.5.20", "this environment")
        monkeypatch.setenv("PRFAAS_ALLOW_SGLANG_VERSION", "0.5.20")
        require_supported("0.5.20", "this environment")
        with pytest.raises(UpstreamVersionError, match="not installed"):
            require_supported(None, "this environment")

    def test_other_sglang_version_is_refused_with_the_override_named(self, monkeypatch):
        from prfaas_sglang._compat import require_pinned

        monkeypatch.delenv("PRFAAS_ALLOW_SGLANG_VERSION", raising=False)
        with pytest.raises(UpstreamVersionError, match="PRFAAS_ALLOW_SGLANG_VERSION=0.5.23"):
            require_pinned("0.5.23", "this environment")
        require_pinned("0.5.15+prfaas.abcd1234", "this environment")
        monkeypatch.setenv("PRFAAS_ALLOW_SGLANG_VERSION", "0.5.23")
        require_pinned("0.5.23", "this environment")
        with pytest.raises(UpstreamVersionError, match="not installed"):
            require_pinned(None, "this environment")


def test_a_target_whose_module_fails_to_import_names_the_missing_dependency(tmp_path, monkeypatch):
    """pkgutil reports only "module 'pkg' has no attribute 'mod'"; a hook whose target sits behind a
    missing dependency (SGLang 0.5.23's CPU engine without sgl_kernel) must say which."""
    from prfaas_sglang.plugin import resolve_target

    (tmp_path / "prfaas_probe_pkg").mkdir()
    (tmp_path / "prfaas_probe_pkg" / "__init__.py").write_text("")
    (tmp_path / "prfaas_probe_pkg" / "conn.py").write_text("import prfaas_no_such_kernel\nclass Manager:\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ImportError, match="importing prfaas_probe_pkg.conn: No module named 'prfaas_no_such_kernel'"):
        resolve_target("prfaas_probe_pkg.conn.Manager.__init__")
    with pytest.raises(AttributeError):  # a path that is simply wrong stays an AttributeError
        resolve_target("prfaas_probe_pkg.gone.Manager")


def test_importing_what_the_hooks_need_registers_and_patches_nothing():
    """What the zygote preloads for probes that register the plugin (plugin.import_hook_modules): no hook
    registered, no target patched (a stock probe forked after it is stock)."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    from prfaas_sglang.plugin import import_hook_modules, reaches_hook, resolve_target

    applicable = [spec for spec in HOOKS if spec.applies()]
    registered = {target: list(hooks) for target, hooks in HookRegistry._hooks.items()}
    hooked = {spec.name for spec in applicable if reaches_hook(resolve_target(spec.target), spec.load_hook())}
    import_hook_modules()
    assert {target: list(hooks) for target, hooks in HookRegistry._hooks.items()} == registered
    assert {spec.name for spec in applicable if reaches_hook(resolve_target(spec.target), spec.load_hook())} == hooked
