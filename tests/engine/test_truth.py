"""The emulated engine's service-time truth (engine/mock/truth.py), apart from the router's model."""

from __future__ import annotations

import pytest
from conftest import DECODE_PROFILE, PREFILL_PROFILE, start_worker
from test_pd import pd_request

from prfaas_sglang.adapters import http_sync
from prfaas_sglang.demo.cluster import scrape_metric
from prfaas_sglang.engine.mock.scheduler import ChunkedPrefill, PrefillJob
from prfaas_sglang.engine.mock.timing import load_timing
from prfaas_sglang.engine.mock.truth import ServiceTruth
from prfaas_sglang.errors import ConfigError
from prfaas_sglang.router.workers import parse_server_info

SPEEDUP = "50"
PROMPT = 12_000


def test_noise_has_mean_one_and_bias_is_the_mean_factor():
    truth = ServiceTruth(prefill_bias=1.4, noise_sigma=0.2, seed=3)
    draws = [truth.prefill_factor() for _ in range(20_000)]
    assert sum(draws) / len(draws) == pytest.approx(1.4, rel=0.01)
    assert min(draws) < 1.2 < 1.6 < max(draws)
    assert ServiceTruth(noise_sigma=0.0).prefill_factor() == 1.0 and ServiceTruth().exact


def test_a_jobs_factor_scales_every_chunk_of_its_cost():
    timing = load_timing(PREFILL_PROFILE, 1.0, 0.01, None)
    for factor in (1.0, 0.7):
        queue = ChunkedPrefill(8192, timing.prefill_s)
        queue.add(PrefillJob(PROMPT, cost_factor=factor))
        total = 0.0
        while (forward := queue.next_forward()) is not None:
            total += forward.duration_s
            queue.complete(forward)
        assert total == pytest.approx(factor * timing.prefill_s(PROMPT))


@pytest.mark.parametrize("flag, value", [("prefill_bias", 0.0), ("decode_bias", 20.0), ("noise_sigma", -1.0)])
def test_an_absurd_truth_is_refused_by_name(flag, value):
    with pytest.raises(ConfigError):
        ServiceTruth(**{flag: value})


@pytest.mark.slow
def test_the_bias_slows_the_engine_by_its_factor_and_the_router_sees_no_difference(procs):
    common = ("--speedup", SPEEDUP, "--kv-scale", "0.01", "--context-tokens", "65536", "--bootstrap-timeout-s", "5")
    pairs = {}
    for bias in ("1", "1.4"):
        truth = ("--prefill-bias", bias, "--decode-bias", bias)
        pairs[bias] = (start_worker(procs, "pd-prefill", DECODE_PROFILE, *common, *truth),
                       start_worker(procs, "pd-decode", DECODE_PROFILE, *common, *truth))
    spent = {}
    for bias, (prefill, decode) in pairs.items():
        p, d = pd_request(prefill, decode, {"input_ids": list(range(1, PROMPT + 1)), "sampling_params": {"max_new_tokens": 8}})
        assert p.status == d.status == 200
        spent[bias] = [scrape_metric(w.url, "prfaas:forward_intended_seconds_total") for w in (prefill, decode)]
    timing = load_timing(DECODE_PROFILE, float(SPEEDUP), 0.01, None)
    assert spent["1"][0] == pytest.approx(timing.prefill_s(PROMPT))
    assert spent["1.4"][0] == pytest.approx(1.4 * spent["1"][0])  # prefill
    assert spent["1.4"][1] == pytest.approx(1.4 * spent["1"][1], rel=0.05)  # decode steps (context grows alike)
    # what a router reads of a worker is the same whatever its truth
    infos = [http_sync.get(pair[0].url + "/server_info", timeout_s=5).json() for pair in pairs.values()]
    facts = [parse_server_info(info) for info in infos]
    assert facts[0].emulated == facts[1].emulated and facts[0].max_total_tokens == facts[1].max_total_tokens
    assert not any("bias" in str(info) or "noise" in str(info) for info in infos)
