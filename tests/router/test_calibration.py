"""The router's online calibration (router/calibration.py) and how the service applies it (pure)."""

from __future__ import annotations

import pytest

from prfaas_sglang.router.calibration import CalibrationSettings, OnlineCalibration


def feed(cal: OnlineCalibration, cluster: str, true_scale: float, n: int, link_s: float = 0.5) -> None:
    for i in range(n):
        modelled = 1.0 + 0.1 * (i % 7)
        cal.first_token(cluster, modelled, link_s, true_scale * modelled + link_s, modelled + link_s)


def test_the_scale_converges_to_the_ratio_of_observed_to_modelled_compute():
    cal = OnlineCalibration(CalibrationSettings(window=32, prior_weight_s=2.0))
    feed(cal, "pd", 1.4, 64)
    assert cal.prefill_scale("pd") == pytest.approx(1.4, rel=0.03)
    assert cal.prefill_scale("prfaas") == 1.0  # another cluster's samples move nothing here


def test_few_samples_move_the_scale_little():
    cal = OnlineCalibration(CalibrationSettings(prior_weight_s=10.0))
    feed(cal, "prfaas", 2.0, 1)
    assert 1.0 < cal.prefill_scale("prfaas") < 1.2


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
    cal = OnlineCalibration(CalibrationSettings(prior_weight_s=1.0, error_group=10))
    for _ in range(60):  # the router predicts with the scale it has learned so far
        scale = cal.prefill_scale("pd")
        cal.first_token("pd", 2.0, 0.0, 2.0 * 1.5, 2.0 * scale)
    errors = [g["mean_relative_error"] for g in cal.error_series()]
    assert cal.errors[0] == pytest.approx(1 / 3)  # the prior model: 2 s predicted, 3 s observed
    assert errors == sorted(errors, reverse=True) and errors[-1] < 0.02


def test_scales_are_clamped_and_settings_checked():
    cal = OnlineCalibration(CalibrationSettings(max_scale=4.0))
    feed(cal, "pd", 100.0, 64)
    assert cal.prefill_scale("pd") == 4.0
    with pytest.raises(ValueError):
        CalibrationSettings(prior_scales=(("elsewhere", 1.0),))
    with pytest.raises(ValueError):
        CalibrationSettings(min_scale=2.0)


def test_the_service_keeps_its_ledger_in_model_seconds_and_predicts_calibrated(tmp_path):
    from prfaas_sglang.protocol import EngineRequest
    from prfaas_sglang.router.policy import PD
    from prfaas_sglang.router.service import RouterConfig
    from prfaas_sglang.sim.fleet import FleetSpec, SimSettings, Simulation

    sim = Simulation(FleetSpec(1, 1, 1, output_tokens=64),
                     SimSettings(calibration=CalibrationSettings(enabled=False, prior_scales=(("pd", 2.0),))))
    service = sim.service
    assert isinstance(service.config, RouterConfig)
    snap = service.snapshot(set(), 0.0)
    assert snap.prefill_cost[PD].prefill_s(8000) == pytest.approx(2.0 * service.runtime.prefill_cost(PD).prefill_s(8000))
    from prfaas_sglang.router.policy import RouteInput

    req = EngineRequest("generate", tuple(range(8000)), 64, True, "r", None, None)
    decision = service.decide(RouteInput(8000, 8064, {}), set(), 0.0)
    lease = service.begin(req, decision, 0.0, 0)
    worker = service.workers[decision.prefill]
    assert worker.outstanding_prefill_s == pytest.approx(decision.estimated_prefill_s / service.calibration.prefill_scale(decision.cluster))
    service.first_token(lease, decision.estimated_ttft_s)
    service.first_token(lease, 99.0)  # once per request
    assert sum(service.calibration.samples.values()) == 1
    service.finish(lease)
    assert worker.outstanding_prefill_s == 0.0 and service.link_backlog_bytes == 0.0


def test_a_per_request_offset_is_learned_beside_the_scale():
    """A real engine's fixed cost per request (SGLang PD: the bootstrap, the KV's hand-over, the first
    decode step) beside compute 1.5x the model's: a scale alone cannot fit short and long prompts."""
    cal = OnlineCalibration(CalibrationSettings(window=64, prior_weight_s=0.5))
    for i in range(64):
        modelled = 0.02 + 0.2 * (i % 8)  # a short prompt and longer ones
        cal.first_token("pd", modelled, 0.0, 0.3 + 1.5 * modelled, modelled)
    assert cal.prefill_offset_s("pd") == pytest.approx(0.3, rel=0.1)  # shrunk toward 0 by 4 pseudo-samples of 64
    assert cal.prefill_scale("pd") == pytest.approx(1.5, rel=0.05)
    short = cal.prefill_offset_s("pd") + cal.prefill_scale("pd") * 0.02
    assert short == pytest.approx(0.3 + 1.5 * 0.02, rel=0.1)  # the ratio alone would predict ~0.03 s here
    off = OnlineCalibration(CalibrationSettings(window=64, prior_weight_s=0.5, offset=False))
    for i in range(64):
        modelled = 0.02 + 0.2 * (i % 8)
        off.first_token("pd", modelled, 0.0, 0.3 + 1.5 * modelled, modelled)
    assert off.prefill_offset_s("pd") == 0.0 and off.prefill_scale("pd") > 1.5


def test_no_offset_without_spread_or_below_zero():
    cal = OnlineCalibration()
    for _ in range(30):  # one modelled length: not identifiable
        cal.first_token("pd", 2.0, 0.0, 3.0, 2.0)
    assert cal.prefill_offset_s("pd") == 0.0 and cal.prefill_scale("pd") == pytest.approx(1.5, rel=0.05)
    for i in range(30):  # a negative intercept is no per-request cost
        modelled = 1.0 + i * 0.1
        cal.first_token("prfaas", modelled, 0.0, 2.0 * modelled - 0.5, modelled)
    assert cal.prefill_offset_s("prfaas") == 0.0
