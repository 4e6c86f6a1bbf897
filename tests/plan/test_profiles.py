"""Profiles: monotone interpolation, measured-point validation, the analytic roofline, Table 3 anchors."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prfaas_sglang.errors import ConfigError
from prfaas_sglang.plan.analytic import AnalyticPrefill, analytic_decode
from prfaas_sglang.plan.anchors import ANCHORS, check_anchor
from prfaas_sglang.plan.profiles import MonotoneCurve, TabulatedPrefill
from prfaas_sglang.plan.scenario import Catalog

CATALOG = Catalog()


@settings(max_examples=200, deadline=None)
@given(steps=st.lists(st.tuples(st.floats(1, 5000), st.floats(0, 10)), min_size=1, max_size=12))
def test_monotone_curve_is_monotone_and_interpolates(steps):
    xs, ys, x, y = [], [], 0.0, 0.0
    for dx, dy in steps:
        x, y = x + dx, y + dy
        xs.append(x)
        ys.append(y)
    curve = MonotoneCurve(xs, ys)
    for xi, yi in zip(xs, ys, strict=True):
        assert curve(xi) == pytest.approx(yi, abs=1e-9)
    grid = [xs[0] - 100 + k * (xs[-1] - xs[0] + 200) / 400 for k in range(401)]
    values = [curve(g) for g in grid]
    assert all(b >= a - 1e-9 for a, b in zip(values, values[1:], strict=False))


class TestTabulated:
    POINTS = [
        {"tokens": 1024, "prefill_s": 0.1, "kv_bytes": 1e6},
        {"tokens": 8192, "prefill_s": 0.9, "kv_bytes": 8e6},
        {"tokens": 32768, "prefill_s": 5.0, "kv_bytes": 32e6},
    ]

    def test_passes_through_points_and_extrapolates_upward(self):
        profile = TabulatedPrefill("m", self.POINTS)
        assert profile.prefill_s(8192) == pytest.approx(0.9)
        assert profile.kv_bytes(32768) == pytest.approx(32e6)
        assert profile.prefill_s(65536) > 5.0

    def test_below_the_first_point_a_prefill_costs_at_least_its_share_of_the_first(self):
        """The first slope here (0.8 s over 7,168 tokens) extrapolated down reaches 0 before 64 tokens:
        a prompt shorter than every measured one is priced at no less than ``y0 * x / x0``, never 0."""
        profile = TabulatedPrefill("m", self.POINTS)
        assert profile.prefill_s(64) == pytest.approx(0.1 * 64 / 1024)
        assert 0 < profile.prefill_s(16) < profile.prefill_s(64) < profile.prefill_s(512) < 0.1
        # a flat first slope (a fixed cost dominates, as on the H200): the slope's line, which lies above
        flat = TabulatedPrefill("f", [{"tokens": 1024, "prefill_s": 0.03, "kv_bytes": 1e6},
                                      {"tokens": 2048, "prefill_s": 0.035, "kv_bytes": 2e6}])
        assert flat.prefill_s(64) == pytest.approx(0.03 - 0.005 / 1024 * 960)

    @pytest.mark.parametrize("index, key, value, message", [
        (2, "prefill_s", 0.5, "prefill_s: must be non-decreasing"),
        (1, "kv_bytes", 0.5e6, "kv_bytes: must be non-decreasing"),
        (1, "tokens", 1024, "tokens: must increase"),
        (0, "prefill_s", "fast", "must be a number"),
    ])
    def test_bad_points_name_the_field(self, index, key, value, message):
        points = [dict(p) for p in self.POINTS]
        points[index][key] = value
        with pytest.raises(ConfigError) as err:
            TabulatedPrefill("m", points, "pd.profile")
        assert err.value.field == f"pd.profile.points[{index}].{key}"
        assert message.split(": ", 1)[-1] in str(err.value)


class TestAnalytic:
    def test_kv_bytes_by_attention_kind(self):
        kimi = CATALOG.model("kimi-linear-1t-hybrid")
        per_token = 15 * (512 + 64) * 2
        state = 45 * (64 * 128 * 128 * 4 + 24576 * 3 * 2)
        assert kimi.kv_bytes(1000) == pytest.approx(per_token * 1000 + state)
        qwen3 = CATALOG.model("qwen3-235b-a22b")
        assert qwen3.kv_bytes(1000) == pytest.approx(94 * 4 * 256 * 2 * 1000)
        mimo = CATALOG.model("mimo-v2-flash")
        swa = 40 * 128 * 8 * 320 * 2
        assert mimo.kv_bytes(32768) == pytest.approx(8 * 4 * 320 * 2 * 32768 + swa)

    def test_hybrid_kv_grows_much_slower_than_dense(self):
        hybrid, dense = CATALOG.model("qwen3.5-397b-a17b"), CATALOG.model("qwen3-235b-a22b")
        assert dense.kv_bytes(32768) / hybrid.kv_bytes(32768) > 4

    def test_prefill_is_superlinear_and_kv_throughput_falls_with_length(self):
        profile = AnalyticPrefill(CATALOG.model("kimi-linear-1t-hybrid"), CATALOG.accelerator("h200x8", "a"))
        assert profile.prefill_s(64_000) > 2 * profile.prefill_s(32_000)
        assert profile.phi_kv_bps(128_000) < profile.phi_kv_bps(16_000)

    def test_decode_batch_respects_the_slo(self):
        model, accel = CATALOG.model("kimi-linear-1t-hybrid"), CATALOG.accelerator("h20x8", "a")
        relaxed = analytic_decode(model, accel, 27_000, 1024, 20).bs_max
        strict = analytic_decode(model, accel, 27_000, 1024, 40).bs_max
        assert relaxed > strict >= 1
        with pytest.raises(ConfigError, match="slo_tokens_per_s"):
            analytic_decode(model, accel, 27_000, 1024, 1000)

    def test_weights_that_do_not_fit_are_refused(self):
        model = CATALOG.model("qwen3-235b-a22b")
        accel = CATALOG.accelerator("h20x8", "a")
        small = type(accel)(**{**accel.__dict__, "gpus": 2})
        with pytest.raises(ConfigError, match="cannot hold the weights"):
            analytic_decode(model, small, 1000, 100, 40)


@pytest.mark.parametrize("anchor", ANCHORS, ids=lambda a: a.model)
def test_table3_anchors_within_a_factor_of_two(anchor):
    """Shipped profiles against the paper's published KV throughputs (ratios recorded in BENCHMARKS.md)."""
    check = check_anchor(anchor, CATALOG.model(anchor.model), CATALOG.accelerator("h200x8", "a"))
    for ratio in (check.phi_ratio, check.egress_ratio):
        if ratio is not None:
            assert 0.5 <= ratio <= 2.0


def test_table3_ordering_dense_above_hybrid():
    accel = CATALOG.accelerator("h200x8", "a")
    phi = {a.model: check_anchor(a, CATALOG.model(a.model), accel).phi_kv_gbps for a in ANCHORS}
    assert phi["minimax-m2.5"] / phi["mimo-v2-flash"] > 5
    assert phi["qwen3-235b-a22b"] / phi["qwen3.5-397b-a17b"] > 2
