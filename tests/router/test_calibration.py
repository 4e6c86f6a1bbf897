"""The router's online calibration (router/calibration.py) and how the service applies it (pure)."""

from __future__ import annotations

import pytest

from prfaas_sglang.router.calibration import CalibrationSettings, OnlineCalibration


def feed(cal: OnlineCalibration, cluster: str, true_scale: float, n: int, link_s: float = 0.5) -> None:
    for i in range(n):
        modelled = 1.0 + 0.1 * (i % 7)
        cal.first_token(cluster, modelled, link_s, true_scale * modelled + link_s, modelled + link_s, float(i))


def test_the_scale_converges_to_the_ratio_of_observed_to_modelled_compute():
    cal = OnlineCalibration(CalibrationSettings(window=32, prior_samples=2.0))
    feed(cal, "pd", 1.4, 64)
    assert cal.prefill_scale("pd") == pytest.approx(1.4, rel=0.03)
    assert cal.prefill_scale("prfaas") == 1.0  # another cluster's samples move nothing here


def test_few_samples_move_the_scale_little():
    cal = OnlineCalibration(CalibrationSettings(prior_samples=10.0))
    feed(cal, "prfaas", 2.0, 1)
    assert 1.0 < cal.prefill_scale("prfaas") < 1.2


@pytest.mark.parametrize("seconds_per_model_second", [0.001, 1.0, 1000.0])
def test_the_prior_weighs_as_many_samples_whatever_the_engines_speed(seconds_per_model_second):
    """A profile 2x off on an engine whose prefills take milliseconds learns as fast as on one whose
    take seconds: the prior counts samples, not model-seconds (on a lent H200 the tiny hybrid's
    prefills were modelled at tens of ms, and a 2-second prior outweighed about 30 requests)."""
    cal = OnlineCalibration(CalibrationSettings(prior_samples=2.0))
    for i in range(6):
        modelled = seconds_per_model_second * (1.0 + 0.1 * (i % 3))
        cal.first_token("pd", modelled, 0.0, 0.5 * modelled, modelled, float(i))
    assert cal.prefill_scale("pd") == pytest.approx((6 * 0.5 + 2 * 1.0) / 8)


def test_the_link_time_is_not_calibrated():
    cal = OnlineCalibration()
    feed(cal, "prfaas", 1.0, 64, link_s=30.0)  # a slow link, exactly predicted: compute at scale 1
    assert cal.prefill_scale("prfaas") == pytest.approx(1.0, abs=0.01)


def test_disabled_keeps_the_prior_and_still_records_the_error():
    cal = OnlineCalibration(CalibrationSettings(enabled=False, prior_scales=(("pd", 1.4),)))
    feed(cal, "pd", 0.7, 40)
    assert cal.prefill_scale("pd") == 1.4 and cal.prefill_scale("prfaas") == 1.0
    series = cal.error_series()
    assert [g["requests"] for g in series] == ["1-25", "26-40"]


def test_the_error_falls_as_requests_complete():
    cal = OnlineCalibration(CalibrationSettings(prior_samples=0.5, error_group=10))
    for _ in range(60):  # the router predicts with the scale it has learned so far
        scale = cal.prefill_scale("pd")
        cal.first_token("pd", 2.0, 0.0, 2.0 * 1.5, 2.0 * scale, 0.0)
    errors = [g["mean_relative_error"] for g in cal.error_series()]
    assert cal.errors[0] == pytest.approx(1 / 3)  # the prior model: 2 s predicted, 3 s observed
    assert errors == sorted(errors, reverse=True) and errors[-1] < 0.02


def test_a_windows_median_error_is_what_a_typical_request_sees_and_its_mean_carries_the_outliers():
    cal = OnlineCalibration(CalibrationSettings(enabled=False, error_group=5))
    for observed_s in (1.0, 1.0, 1.0, 1.0, 0.1):  # one answered ten times faster than predicted
        cal.first_token("pd", 1.0, 0.0, observed_s, 1.1, 0.0)
    (window,) = cal.error_series()
    assert window["median_relative_error"] == pytest.approx(0.1)
    assert window["mean_relative_error"] == pytest.approx((4 * 0.1 + 10.0) / 5)


def test_scales_are_clamped_and_settings_checked():
    cal = OnlineCalibration(CalibrationSettings(max_scale=4.0))
    feed(cal, "pd", 100.0, 64)
    assert cal.prefill_scale("pd") == 4.0
    with pytest.raises(ValueError, match="no such cluster"):
        OnlineCalibration(CalibrationSettings(prior_scales=(("elsewhere", 1.0),)))
    with pytest.raises(ValueError):
        CalibrationSettings(prior_scales=(("pd", 100.0),))
    with pytest.raises(ValueError):
        CalibrationSettings(min_scale=2.0)


def test_a_prior_scale_names_a_cluster_or_every_cluster_of_a_kind():
    clusters = {"h200": "prfaas", "h100": "prfaas", "east": "pd"}
    cal = OnlineCalibration(CalibrationSettings(enabled=False, prior_scales=(("prfaas", 1.5), ("h100", 2.0))), clusters)
    assert (cal.prefill_scale("h200"), cal.prefill_scale("h100"), cal.prefill_scale("east")) == (1.5, 2.0, 1.0)
    assert set(cal.describe()["prefill_scale"]) == set(clusters)


def test_the_service_keeps_its_ledger_in_model_seconds_and_predicts_calibrated(tmp_path):
    from prfaas_sglang.protocol import EngineRequest
    from prfaas_sglang.router.policy import PD
    from prfaas_sglang.router.service import RouterConfig
    from prfaas_sglang.sim.fleet import FleetSpec, SimSettings, Simulation

    sim = Simulation(FleetSpec(1, 1, 1, output_tokens=64),
                     SimSettings(calibration=CalibrationSettings(enabled=False, prior_scales=(("pd", 2.0),))))
    service = sim.service
    assert isinstance(service.config, RouterConfig)
    ps = service.only_pair()
    snap = service.snapshot(set(), 0.0, ps)
    assert snap.prefill_cost[PD].prefill_s(8000) == pytest.approx(2.0 * ps.runtime.prefill_cost(PD).prefill_s(8000))
    from prfaas_sglang.router.policy import RouteInput

    req = EngineRequest("generate", tuple(range(8000)), 64, True, "r", None, None)
    decision = service.decide(RouteInput(8000, 8064, {}), set(), 0.0)
    lease = service.begin(req, decision, 0.0, 0)
    worker = service.workers[decision.prefill]
    assert worker.outstanding_prefill_s == pytest.approx(decision.estimated_prefill_s / service.calibration.prefill_scale(decision.cluster))
    service.first_token(lease, decision.estimated_ttft_s, 0.0)
    service.first_token(lease, 99.0, 0.0)  # once per request
    assert sum(service.calibration.samples.values()) == 1
    service.finish(lease)
    assert worker.outstanding_prefill_s == 0.0 and service.link_backlog_bytes == 0.0


def test_a_per_request_offset_is_learned_beside_the_scale():
    """A real engine's fixed cost per request (SGLang PD: the bootstrap, the KV's hand-over, the first
    decode step) beside compute 1.5x the model's: a scale alone cannot fit short and long prompts."""
    cal = OnlineCalibration(CalibrationSettings(window=64, prior_samples=1.0))
    for i in range(64):
        modelled = 0.02 + 0.2 * (i % 8)  # a short prompt and longer ones
        cal.first_token("pd", modelled, 0.0, 0.3 + 1.5 * modelled, modelled, 0.0)
    assert cal.prefill_offset_s("pd") == pytest.approx(0.3, rel=0.1)  # shrunk toward 0 by 4 pseudo-samples of 64
    assert cal.prefill_scale("pd") == pytest.approx(1.5, rel=0.05)
    short = cal.prefill_offset_s("pd") + cal.prefill_scale("pd") * 0.02
    assert short == pytest.approx(0.3 + 1.5 * 0.02, rel=0.1)  # the ratio alone would predict ~0.03 s here
    off = OnlineCalibration(CalibrationSettings(window=64, prior_samples=1.0, offset=False))
    for i in range(64):
        modelled = 0.02 + 0.2 * (i % 8)
        off.first_token("pd", modelled, 0.0, 0.3 + 1.5 * modelled, modelled, 0.0)
    assert off.prefill_offset_s("pd") == 0.0 and off.prefill_scale("pd") > 1.5


def test_no_offset_without_spread_or_below_zero():
    cal = OnlineCalibration()
    for _ in range(30):  # one modelled length: not identifiable
        cal.first_token("pd", 2.0, 0.0, 3.0, 2.0, 0.0)
    assert cal.prefill_offset_s("pd") == 0.0 and cal.prefill_scale("pd") == pytest.approx(1.5, rel=0.05)
    for i in range(30):  # a negative intercept is no per-request cost
        modelled = 1.0 + i * 0.1
        cal.first_token("prfaas", modelled, 0.0, 2.0 * modelled - 0.5, modelled, 0.0)
    assert cal.prefill_offset_s("prfaas") == 0.0


def test_a_calibration_quiet_for_its_max_age_returns_to_the_prior_and_sparse_samples_are_kept():
    cal = OnlineCalibration(CalibrationSettings(max_age_s=30.0))
    for i in range(20):  # one first token every 20 s: sparse, never quiet for 30 s
        cal.first_token("pd", 1.0 + 0.1 * (i % 7), 0.0, 2.0 * (1.0 + 0.1 * (i % 7)), 1.0, 20.0 * i)
        cal.forget_quiet(20.0 * i + 19.0)
    assert cal.prefill_scale("pd") == pytest.approx(2.0, rel=0.1) and len(cal._prefill["pd"]) == 20
    cal.forget_quiet(380.0 + 30.0)  # the newest is exactly 30 s old: kept
    assert len(cal._prefill["pd"]) == 20
    cal.forget_quiet(380.0 + 30.5)
    assert cal.prefill_scale("pd") == 1.0 and cal.prefill_offset_s("pd") == 0.0
    kept = OnlineCalibration(CalibrationSettings(max_age_s=None))
    feed(kept, "pd", 2.0, 20)
    kept.forget_quiet(1e6)
    assert kept.prefill_scale("pd") > 1.5
    with pytest.raises(ValueError):
        CalibrationSettings(max_age_s=0.0)


def test_a_cluster_shunned_on_a_burst_of_slow_first_tokens_gets_requests_again_after_max_age_without_one():
    """A few slow PrfaaS first tokens (a restarted router fed the backlog its front resent) teach an
    offset above the TTFT target: every long prompt then goes to PD by expected TTFT, and PrfaaS, sent
    nothing, gives no sample to unlearn it. After max_age_s without a sample it is believed again."""
    import dataclasses

    from prfaas_sglang.router.policy import PD, PRFAAS, RouteInput
    from prfaas_sglang.sim.fleet import FleetSpec, SimSettings, Simulation

    service = Simulation(FleetSpec(1, 1, 1, output_tokens=64), SimSettings()).service
    total = int(service.only_pair().controller.threshold_tokens * 2)
    long_prompt = RouteInput(total, total + 64, {})
    first = service.decide(long_prompt, set(), 0.0)
    assert first.cluster == PRFAAS
    target_s = 1.5 * first.estimated_ttft_s
    service.config = dataclasses.replace(service.config, ttft_target_s=target_s)
    for i in range(6):  # compute as modelled, each first token 3x the first estimate late: an offset
        modelled_s = first.estimated_prefill_s * (0.5 + 0.3 * i)
        service.calibration.first_token(PRFAAS, modelled_s, 0.0, modelled_s + 3 * first.estimated_ttft_s, modelled_s,
                                        1.0 + i)
    assert service.calibration.prefill_offset_s(PRFAAS) > target_s
    shunned = service.decide(long_prompt, set(), 10.0)
    assert shunned.cluster == PD and "by expected TTFT" in shunned.reason
    service.control_tick(20.0)  # quiet for less than max_age_s: still believed
    assert service.decide(long_prompt, set(), 20.0).cluster == PD
    service.control_tick(6.5 + service.calibration.settings.max_age_s)  # the newest sample came at 6 s
    assert service.decide(long_prompt, set(), 40.0).cluster == PRFAAS


def test_the_routers_flag_sets_the_age_and_a_negative_one_is_refused_by_name():
    import argparse

    from prfaas_sglang.errors import ConfigError
    from prfaas_sglang.router.__main__ import calibration_settings

    def settings(age_s: float) -> CalibrationSettings:
        return calibration_settings(argparse.Namespace(prefill_scale=[], no_calibration=False, calibration_max_age_s=age_s))

    assert settings(45.0).max_age_s == 45.0 and settings(0.0).max_age_s is None
    with pytest.raises(ConfigError, match="--calibration-max-age-s"):
        settings(-1.0)
