"""Drift: every hook target still exists in the installed sglang with the signature we wrote against.

These fail first when the pin moves; fix the hook (or its expected signature,
after reading the upstream change), never the test.
"""

from __future__ import annotations

import inspect

import pytest

from prfaas_sglang.plugin import HOOKS, REGISTRATIONS, resolve_target, signature_drift

HOOK_TYPES = {"before", "after", "around", "replace"}


@pytest.mark.parametrize("spec", HOOKS, ids=lambda s: s.name)
class TestEveryHook:
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

    def test_documented_like_a_patch(self, spec):
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
    def test_registry_and_overridden_methods_resolve(self, spec):
        assert callable(resolve_target(spec.registry))
        for target, _ in spec.overrides:
            assert callable(resolve_target(target)), target

    def test_overridden_signatures_match_the_pin(self, spec):
        assert signature_drift([spec]) == []

    def test_documented_like_a_patch(self, spec):
        for field in ("subject", "why", "how", "upstream_status", "removal", "tests", "selected_by"):
            assert getattr(spec, field).strip(), field


def test_a_drifted_override_is_reported():
    import dataclasses

    spec = REGISTRATIONS[0]
    wrong = dataclasses.replace(spec, overrides=((spec.overrides[1][0], "(self)"),))
    (problem,) = signature_drift([wrong])
    assert spec.overrides[1][0] in problem and "expected (self)" in problem
