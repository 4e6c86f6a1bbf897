"""Drift: every hook target still exists in the installed sglang with a signature we wrote against.

These fail first when a new release is tried; fix the hook (or add the release's signature,
after reading the upstream change), never the test. A hook or backend that does not apply to the
installed release (retired there: upstream does it itself; or for another release's layout) is
skipped, saying which.
"""

from __future__ import annotations

import inspect

import pytest

from prfaas_sglang.plugin import HOOKS, REGISTRATIONS, resolve_target, signature_drift

HOOK_TYPES = {"before", "after", "around", "replace"}


def _applies(spec) -> None:
    where = spec.where()
    if where != "applies":
        pytest.skip(f"{spec.name}: {where} on this sglang")


@pytest.mark.parametrize("spec", HOOKS, ids=lambda s: s.name)
class TestEveryHook:
    @pytest.fixture(autouse=True)
    def _only_where_it_applies(self, spec):
        _applies(spec)

    def test_target_resolves(self, spec):
        assert callable(resolve_target(spec.target))

    def test_signature_matches_the_pin(self, spec):
        assert signature_drift([spec]) == []

    def test_hook_accepts_what_the_hook_type_passes(self, spec):
        assert spec.hook_type in HOOK_TYPES
        hook_params = list(inspect.signature(spec.load_hook()).parameters.values())
        target_params = list(inspect.signature(inspect.unwrap(resolve_target(spec.target))).parameters)
        leading = {"after": 1, "around": 1}.get(spec.hook_type, 0)  # result / original_fn
        positional = [p for p in hook_params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        has_var = any(p.kind is p.VAR_POSITIONAL for p in hook_params)
        assert has_var or len(positional) == leading + len(target_params)


@pytest.mark.parametrize("spec", HOOKS, ids=lambda s: s.name)
def test_every_hook_is_documented_like_a_patch(spec):
    """Wherever it applies or not: a retired hook's notes say why it is gone on newer releases."""
    for field in ("subject", "why", "how", "upstream_status", "removal", "tests"):
        assert getattr(spec, field).strip(), field


def test_signature_drift_is_detected():
    """The drift check itself can fail: a wrong expected signature is reported."""
    import dataclasses

    wrong = dataclasses.replace(HOOKS[0], expected_signature="(server_args, extra)")
    (problem,) = signature_drift([wrong])
    assert "expected (server_args, extra)" in problem


@pytest.mark.parametrize("spec", REGISTRATIONS, ids=lambda s: s.name)
class TestEveryRegisteredBackend:
    @pytest.fixture(autouse=True)
    def _only_where_it_applies(self, spec):
        _applies(spec)

    def test_registry_and_overridden_methods_resolve(self, spec):
        assert callable(resolve_target(spec.registry))
        for target, _ in spec.overrides:
            assert callable(resolve_target(target)), target

    def test_overridden_signatures_match_the_pin(self, spec):
        assert signature_drift([spec]) == []


@pytest.mark.parametrize("spec", REGISTRATIONS, ids=lambda s: s.name)
def test_every_registered_backend_is_documented_like_a_patch(spec):
    for field in ("subject", "why", "how", "upstream_status", "removal", "tests", "selected_by"):
        assert getattr(spec, field).strip(), field


def test_a_drifted_override_is_reported():
    import dataclasses

    spec = next(s for s in REGISTRATIONS if s.applies())
    wrong = dataclasses.replace(spec, overrides=((spec.overrides[0][0], "(self)"),))
    (problem,) = signature_drift([wrong])
    assert spec.overrides[0][0] in problem and "expected (self)" in problem


def test_where_a_change_applies_is_decided_by_markers(tmp_path):
    """Retired where the release shows upstream does it; for another layout where its marker is missing."""
    import dataclasses

    (tmp_path / "sglang").mkdir()
    (tmp_path / "sglang" / "x.py").write_text("def upstream_does_it():\n")
    spec = HOOKS[0]
    assert spec.where(tmp_path) == "applies"
    assert dataclasses.replace(spec, upstream_marker=("sglang/x.py", "def upstream_does_it")).where(tmp_path) == "retired"
    assert dataclasses.replace(spec, only_if=("sglang/x.py", "def newer_seam")).where(tmp_path) == "not applicable"
    assert dataclasses.replace(spec, only_if=("sglang/x.py", "def upstream_does_it")).applies(tmp_path)
    wrong = dataclasses.replace(spec, expected_signature="(nothing)")
    assert len(signature_drift([wrong])) == 1
    assert signature_drift([dataclasses.replace(wrong, only_if=("sglang/no/such/file.py", "x"))]) == []
    assert signature_drift([dataclasses.replace(wrong, expected_signature=("(nothing)", spec.expected_signature))]) == []


def test_the_router_drops_an_idle_worker_connection_before_sglangs_server_closes_it():
    """An idle pooled connection kept past the worker's keep-alive is one the server may close while the
    router writes a leg's body on it: the leg fails and a healthy worker leaves routing. The router's
    pool must let go first, on every supported release (SGLang's uvicorn keep-alive)."""
    from sglang.srt.environ import envs

    from prfaas_sglang.router.server import WORKER_KEEPALIVE_S

    assert WORKER_KEEPALIVE_S < type(envs).SGLANG_TIMEOUT_KEEP_ALIVE.default
