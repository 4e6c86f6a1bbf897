"""The emulated engine's service-time truth (engine/mock/truth.py), apart from the router's model."""

from __future__ import annotations

import pytest
from conftest import DECODE_PROFILE, PREFILL_PROFILE, start_worker
from test_pd import pd_request

from prfaas_sglang.adapters import http_sync
from prfaas_sglang.demo.cluster import scrape_metric
from prfaas_sglang.engine.mock.scheduler import ChunkedPrefill, PrefillJob
from prfaas_sglang.engine.mock.timing import load_timing
from prfaas_sglang.engine.mock.truth import ServiceTruth, forward_costs
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


def run_queue(queue: ChunkedPrefill, jobs: list[PrefillJob]) -> float:
    for job in jobs:
        queue.add(job)
    total = 0.0
    while (forward := queue.next_forward()) is not None:
        total += forward.duration_s
        queue.complete(forward)
    return total


def test_a_batched_engine_prefills_a_batch_for_less_than_the_sum_of_its_parts_while_the_routers_model_is_unchanged():
    """``--truth-model batched``: eight short prompts in one forward cost less than each alone (the per-forward cost
    is paid once), a long one about as much as its profile cost (compute dominates), and a decode step rises with the
    batch beyond the profile's. The router's model is the same timing object throughout: only the engine's truth
    changed."""
    timing = load_timing(PREFILL_PROFILE, 1.0, 0.01, None)
    before = (timing.prefill_s(512), timing.prefill_s(60_000), timing.decode_step_s(1, 4096), timing.decode_step_s(64, 4096))
    batched, costs = ServiceTruth(model="batched"), forward_costs(timing)

    def queue() -> ChunkedPrefill:
        return ChunkedPrefill(8192, timing.prefill_s, forward_s=lambda pieces: batched.forward_s(pieces, costs))

    together = run_queue(queue(), [PrefillJob(512) for _ in range(8)])
    alone = sum(run_queue(queue(), [PrefillJob(512)]) for _ in range(8))
    assert together < 0.8 * alone
    assert run_queue(queue(), [PrefillJob(512)]) > 1.5 * timing.prefill_s(512)  # a short prompt: fixed costs dominate
    long_s = run_queue(queue(), [PrefillJob(60_000)])  # eight chunks: each pays the per-forward cost again
    assert timing.prefill_s(60_000) < long_s < 1.1 * timing.prefill_s(60_000)
    steps = [batched.decode_step_s(timing.decode_step_s(batch, 4096), batch) / timing.decode_step_s(batch, 4096)
             for batch in (1, 16, 64)]
    assert steps[0] < steps[1] < steps[2] and steps[2] > 1.5
    # The profile truth keeps the profile's own form, and nothing above moved the router's model.
    profile = ServiceTruth()
    assert run_queue(ChunkedPrefill(8192, timing.prefill_s, forward_s=lambda p: profile.forward_s(p, costs)),
                     [PrefillJob(60_000)]) == pytest.approx(timing.prefill_s(60_000))
    assert profile.decode_step_s(0.02, 64) == 0.02 and profile.slowdown(1e6) == 1.0 and not batched.exact
    assert before == (timing.prefill_s(512), timing.prefill_s(60_000), timing.decode_step_s(1, 4096),
                      timing.decode_step_s(64, 4096))


def test_slow_periods_come_in_runs_not_as_independent_draws():
    """The batched truth's noise is not i.i.d.: durations in a slow period are all slowed, and the periods' shares of
    time follow their mean lengths (15 s slow against 120 s normal: about 11% slow)."""
    from prfaas_sglang.engine.mock.truth import NORMAL_MEAN_S, SLOW_FACTOR, SLOW_MEAN_S

    truth = ServiceTruth(model="batched", seed=5)
    factors = [truth.slowdown(1000.0 + 0.1 * k) for k in range(200_000)]  # 20,000 emulated s, any origin
    slow_share = sum(f == SLOW_FACTOR for f in factors) / len(factors)
    assert set(factors) == {1.0, SLOW_FACTOR}
    assert slow_share == pytest.approx(SLOW_MEAN_S / (SLOW_MEAN_S + NORMAL_MEAN_S), abs=0.04)
    changes = sum(a != b for a, b in zip(factors, factors[1:], strict=False))
    assert changes < 2 * 20_000 / (SLOW_MEAN_S + NORMAL_MEAN_S) * 1.5  # runs of hundreds of samples, not coin flips
    with pytest.raises(ConfigError, match="--truth-model"):
        ServiceTruth(model="oracle")


def test_restarted_slow_periods_repeat_the_same_spells_from_the_restart_whatever_ran_before():
    """Common random numbers for the capacity benchmark (bench/capacity.py restart_slow_periods): two engines
    that ran for different times meet the same slow spells at the same offsets once both restart their periods
    with one seed; another seed gives other spells."""
    offsets = [0.5 * k for k in range(4_000)]  # 2,000 emulated s after the restart

    def spells(ran_s: float, period_seed: int) -> list[float]:
        truth = ServiceTruth(model="batched", seed=3)
        for k in range(int(ran_s)):  # what ran before: its own periods advanced
            truth.slowdown(float(k))
        truth.restart_periods(period_seed)
        start = ran_s + 10.0
        return [truth.slowdown(start + x) for x in offsets]

    first, later = spells(100.0, 42), spells(5_000.0, 42)
    assert first == later and 1.0 in first and max(first) > 1.0  # the same schedule, and it has slow spells
    assert spells(100.0, 43) != first
