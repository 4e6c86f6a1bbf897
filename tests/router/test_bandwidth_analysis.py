"""The bandwidth benchmark's figures, from a synthetic series (pure): each one means what its docstring says."""

from __future__ import annotations

import pytest

from prfaas_sglang.bench.bandwidth import analyse


def series(throttle=10.0, clear=40.0, raise_at=11.0, settle_t=48_000.0, recover_at=42.0, offered=lambda t: 10.0):
    out = []
    for k in range(int(50 / 0.25)):
        t = k * 0.25
        thr = settle_t if raise_at <= t < recover_at else 20_000.0
        throttled = throttle <= t < clear
        out.append({"t_s": t, "threshold_tokens": thr, "baseline_tokens": 20_000.0, "capacity_est_mbps": 40 if throttled else 400,
                    "busy": 1.0 if throttled else 0.2, "capacity_mbps": 38.0 if throttled else 390.0, "egress_mbps": 20.0,
                    "offered_mbps": offered(t), "backlog_mb": 0.0, "queue_prfaas_s": 0.0, "queue_pd_s": 0.0})
    return out


HISTORY = [{"t_s": 11.0, "threshold_tokens": 48_000.0, "why": "raise: link"},
           {"t_s": 42.0, "threshold_tokens": 20_000.0, "why": "lower: link capacity back"}]
RESULTS = [{"t_s": 1.0, "status": 200, "route": "prfaas/p/d"}, {"t_s": 20.0, "status": 503, "route": ""}]


def test_a_clean_run():
    r = analyse(series(), HISTORY, RESULTS, 10.0, 40.0, 400.0, 10.0, 5.0)
    assert r["saturation_shown_s"] == 10.0 and r["t_raise_s"] == pytest.approx(1.0)
    assert r["t_first_settle_s"] == 11.0 and r["t_changes_while_throttled"] == 0 and r["t_settled_tokens"] == 48_000.0
    assert r["egress_over_capacity_fraction"] == 0.0
    assert r["t_recovery_s"] == pytest.approx(2.0) and r["requests_failed"] == 1


def test_changes_after_the_first_settle_are_counted():
    history = HISTORY[:1] + [{"t_s": 20.0, "threshold_tokens": 50_000.0, "why": "raise"},
                             {"t_s": 30.0, "threshold_tokens": 48_000.0, "why": "lower"}] + HISTORY[1:]
    r = analyse(series(), history, RESULTS, 10.0, 40.0, 400.0, 10.0, 5.0)
    assert r["t_changes_while_throttled"] == 2 and r["t_changes_total_throttled"] == 3


def test_sustained_offered_load_above_capacity_counts_and_prior_demand_is_separate():
    over = series(offered=lambda t: 100.0 if 20 <= t < 30 else (100.0 if t < 10 else 10.0))
    r = analyse(over, HISTORY, RESULTS, 10.0, 40.0, 400.0, 10.0, 5.0)
    assert r["egress_over_capacity_fraction"] == pytest.approx(14 / 30, abs=2 / 30)  # 20..30 plus the window's tail
    assert r["egress_over_capacity_fraction_with_prior_demand"] > r["egress_over_capacity_fraction"]  # pre-throttle demand
    assert r["egress_over_capacity_fraction_settled"] > 0


def test_no_recovery_is_none_not_zero():
    r = analyse(series(recover_at=99.0), HISTORY[:1], RESULTS, 10.0, 40.0, 400.0, 10.0, 5.0)
    assert r["t_recovery_s"] is None
