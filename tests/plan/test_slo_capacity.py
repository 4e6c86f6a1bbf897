"""Capacity at a TTFT SLO from the plan (plan/slo_capacity.py, pure): the queueing pieces against known values and
a Monte Carlo, and the capacity against the throughput bound it must stay under."""

from __future__ import annotations

import heapq
import random

import numpy as np
import pytest

from prfaas_sglang.plan.scenario import Catalog, parse_scenario
from prfaas_sglang.plan.search import search
from prfaas_sglang.plan.slo_capacity import Queue, SloModel, balking, erlang_c, p_within, queue


def test_erlang_c_matches_the_textbook_cases():
    assert erlang_c(1, 0.7) == pytest.approx(0.7)  # M/M/1: P(wait) = rho
    assert erlang_c(2, 1.0) == pytest.approx(1 / 3)  # M/M/2 at a = 1 Erlang
    assert erlang_c(8, 4.0) < erlang_c(8, 6.0) < erlang_c(8, 7.5) < 1


def test_two_waits_in_series_match_a_monte_carlo():
    rng = np.random.default_rng(0)
    a, b = Queue(0.6, 2.0, True), Queue(0.3, 0.5, True)
    n = 400_000
    wa = np.where(rng.random(n) < a.waits, rng.exponential(1 / a.rate_per_s, n), 0.0)
    wb = np.where(rng.random(n) < b.waits, rng.exponential(1 / b.rate_per_s, n), 0.0)
    budgets = np.array([-1.0, 0.0, 0.5, 2.0, 6.0])
    expected = [(wa + wb <= x).mean() for x in budgets]
    assert p_within(budgets, a, b) == pytest.approx(expected, abs=0.005)
    assert p_within(budgets, Queue(0.0, None, True))[1:].tolist() == [1.0] * 4
    assert p_within(budgets, queue(10.0, 1, np.array([0.2])))[-1] == 0.0  # an unstable queue: nothing meets it


@pytest.fixture(scope="module")
def case_study():
    scenario = parse_scenario({"name": "case-study", "model": "kimi-linear-1t-hybrid", "prfaas": {"accelerator": "h200x8", "instances": 4},
                               "pd": {"accelerator": "h20x8", "instances": 8}, "link": {"egress_gbps": 100},
                               "workload": {"kind": "lognormal", "mu": 9.9, "sigma": 1.0, "min_tokens": 128, "max_tokens": 131072},
                               "output_tokens": 1024, "slo_tokens_per_s": 40}, Catalog())
    return scenario, search(scenario.deployment, scenario.workload, 1024).best


def test_capacity_at_an_slo_stays_under_lambda_max_and_follows_the_slo(case_study):
    scenario, best = case_study
    point = (best.threshold_tokens, best.n_prefill, best.n_decode)
    capacities = {}
    for slo_s in (0.5, 5.0, 10.0, 1e5):
        model = SloModel(scenario.deployment, scenario.workload, slo_s, random.Random(0))
        capacities[slo_s] = model.capacity(*point)
        assert capacities[slo_s].capacity_rps <= capacities[slo_s].lambda_max_rps == pytest.approx(best.lambda_max_rps)
    assert capacities[0.5].capacity_rps < capacities[5.0].capacity_rps < capacities[10.0].capacity_rps
    # No SLO: the rate at which a stage's queue would grow for good. Equation 6 prices a stage at the mean length's
    # service time, below the mean service time for a convex T_prefill: it is the higher bound.
    stable = model.stability_limit_rps(*point)
    assert 0.97 * stable < capacities[1e5].capacity_rps <= stable < best.lambda_max_rps
    model = SloModel(scenario.deployment, scenario.workload, 5.0, random.Random(0))
    rates = [0.2, 0.5, 0.8, 0.95]
    attainment = [model.attainment(f * best.lambda_max_rps, *point) for f in rates]
    assert attainment == sorted(attainment, reverse=True) and attainment[0] > 0.9
    assert model.attainment(1.01 * best.theta_pd_decode_rps, *point) == 0.0  # past equation 5: the TBT SLO fails
    chosen = model.best([best.threshold_tokens, 16_000, 40_000])
    assert chosen.capacity_rps >= capacities[5.0].capacity_rps


def test_layerwise_overlap_raises_capacity_most_where_the_link_is_scarce(case_study):
    """Streamed KV (``layerwise``) meets the SLO at a higher rate than KV sent after the prefill, and the gain is
    larger on a link a tenth as fast, where the transfer is a larger share of each long prompt's TTFT."""
    scenario, best = case_study
    point = (best.threshold_tokens, best.n_prefill, best.n_decode)

    def gain(dep) -> float:
        after, streamed = (SloModel(dep, scenario.workload, 5.0, random.Random(0), layerwise=lw).capacity(*point)
                           for lw in (False, True))
        assert streamed.capacity_rps >= after.capacity_rps > 0
        return streamed.capacity_rps / after.capacity_rps

    import dataclasses

    scarce = dataclasses.replace(scenario.deployment, egress_bps=scenario.deployment.egress_bps / 10)
    assert gain(scarce) > gain(scenario.deployment) >= 1.0


def _batching_monte_carlo(rate_per_step: float, output_tokens: int, step_of, steps: int, seed: int) -> float:
    """A continuous-batching decoder, step by step: arrivals join the next step, each request leaves after
    ``output_tokens`` steps; the mean number running, time-weighted (each step lasts ``step_of(batch)``)."""
    rng = np.random.default_rng(seed)
    left: list[int] = []
    weighted = elapsed = 0.0
    for _ in range(steps):
        batch = len(left)
        duration = step_of(batch) if batch else 1.0
        left += [output_tokens] * int(rng.poisson(rate_per_step * duration))
        weighted += batch * duration
        elapsed += duration
        left = [n - 1 for n in left if n > 1] if batch else left
    return weighted / elapsed


def test_the_decode_stages_batch_is_littles_law_at_the_fixed_point_of_a_step_that_grows_with_it():
    """Each instance's mean batch is ``rate x L_out x E[step]``, with the step's growth (the curve's and the
    growth per sequence) fed back: the fixed point agrees with a step-by-step simulation of continuous
    batching, within its noise; TBT is met by the batches whose step fits the SLO."""
    from prfaas_sglang.plan.profiles import DecodeProfile
    from prfaas_sglang.plan.slo_capacity import DecodeStage, decode_stage

    decode = DecodeProfile(64, 0.025, ((1, 0.010), (8, 0.012), (32, 0.020)))
    growth, out = 0.01, 64
    stage = decode_stage(2 * 6.0, 2, decode, out, 0.025, growth)  # 6 req/s an instance
    simulated = _batching_monte_carlo(6.0, out, lambda b: decode.step_at(b) * (1 + growth * b), 60_000, 0)
    assert stage.mean_batch == pytest.approx(simulated, rel=0.08)
    assert stage.mean_batch > 6.0 * out * decode.step_at(1)  # the growth fed back
    flat = decode_stage(12.0, 2, DecodeProfile(64, 0.010), out, 0.025)
    assert flat.mean_batch == pytest.approx(6.0 * out * 0.010) and flat.tbt_met == pytest.approx(1.0)
    # Meeting TBT: the batches whose step fits 25 ms (the curve's 20 ms at 32, x 1 + 0.01 b: b <= 21).
    fits = decode_stage(12.0, 2, decode, out, 0.025, growth)
    assert 0.0 < fits.tbt_met < 1.0
    assert decode_stage(40.0, 2, decode, out, 0.025, growth).tbt_met < fits.tbt_met
    assert decode_stage(12.0, 4, decode, out, 0.025, growth).tbt_met > fits.tbt_met  # more instances, smaller batches
    assert decode_stage(1e4, 2, decode, out, 0.025, growth) == DecodeStage(0.0, None)  # no fixed point: the batch grows for good
    assert decode_stage(1.0, 0, decode, out, 0.025).tbt_met == 0.0


def test_a_tbt_slo_caps_the_capacity_by_decode_and_the_naive_split_competes_for_the_best(case_study):
    """With the scenario's TBT SLO, the decode stage lowers capacity where decode binds (fewer decode instances,
    a step growing faster), and the search for the best point includes every prefill on PrfaaS (0P/ND)."""
    import dataclasses

    scenario, best = case_study
    point = (best.threshold_tokens, best.n_prefill, best.n_decode)
    tbt = 1 / 40

    def capacity(growth: float, n_prefill: int = best.n_prefill) -> float:
        model = SloModel(scenario.deployment, scenario.workload, 10.0, random.Random(0), tbt_slo_s=tbt,
                         decode_growth_per_seq=growth)
        return model.capacity(point[0], n_prefill, scenario.deployment.n_pd - n_prefill).capacity_rps

    plain = SloModel(scenario.deployment, scenario.workload, 10.0, random.Random(0)).capacity(*point)
    assert capacity(0.0) <= plain.capacity_rps
    assert capacity(0.05) < capacity(0.01) <= capacity(0.0)
    assert capacity(0.0, n_prefill=7) < capacity(0.0, n_prefill=3)  # one decode instance for everything
    stage = SloModel(scenario.deployment, scenario.workload, 10.0, random.Random(0), tbt_slo_s=tbt).decode(
        best.theta_pd_decode_rps, best.n_decode)
    assert stage.tbt_met < 0.6 and stage.mean_batch > 0.5 * scenario.deployment.pd.decode.bs_max  # eq. 5's rate
    # A PD prefill 50x slower: the best point sends every prefill to PrfaaS and lets every PD instance decode.
    from prfaas_sglang.plan.profiles import ScaledPrefill

    slow = dataclasses.replace(scenario.deployment, pd=dataclasses.replace(
        scenario.deployment.pd, prefill=ScaledPrefill(scenario.deployment.pd.prefill, 50.0)))
    chosen = SloModel(slow, scenario.workload, 10.0, random.Random(0), tbt_slo_s=tbt).best([best.threshold_tokens])
    assert (chosen.threshold_tokens, chosen.n_prefill, chosen.n_decode) == (0.0, 0, slow.n_pd)
    assert chosen.tbt_met >= 0.9 and chosen.capacity_rps > 0


def test_early_rejection_keeps_what_would_miss_anyway_out_of_the_queues(case_study):
    """``early_rejection``: prompts that miss the SLO on idle servers are refused on arrival. They stay misses,
    so at a light load attainment is unchanged, but they add no work, so capacity rises; at a shorter SLO, where
    more prompts miss on an idle server, it rises more."""
    scenario, best = case_study
    point = (best.threshold_tokens, best.n_prefill, best.n_decode)

    def model(slo_s: float, rejecting: bool) -> SloModel:
        return SloModel(scenario.deployment, scenario.workload, slo_s, random.Random(0), early_rejection=rejecting)

    light = 0.01 * best.lambda_max_rps
    assert model(4.0, True).attainment(light, *point) == pytest.approx(model(4.0, False).attainment(light, *point), abs=0.01)
    gain = {slo_s: model(slo_s, True).capacity(*point).capacity_rps / model(slo_s, False).capacity(*point).capacity_rps
            for slo_s in (4.0, 5.0, 10.0)}
    assert gain[4.0] > gain[5.0] > gain[10.0] >= 1.0 and gain[5.0] > 1.1


def _refusing_queue(rate_rps: float, servers: int, service_s: np.ndarray, slo_s: float, arrivals: int, seed: int) -> float:
    """Exact FCFS M/G/c whose arrivals join only where their wait plus their service fits the SLO (early rejection
    with a true estimate): the share admitted, which is the share that meets the SLO."""
    rng = np.random.default_rng(seed)
    free_at = [0.0] * servers  # each server's time free, a heap
    met = 0
    for at, service in zip(np.cumsum(rng.exponential(1 / rate_rps, arrivals)), rng.choice(service_s, arrivals), strict=True):
        start = max(free_at[0], at)
        if start - at + service <= slo_s:
            heapq.heapreplace(free_at, start + service)
            met += 1
    return met / arrivals


@pytest.mark.parametrize("servers", [1, 4])
def test_refusing_what_its_wait_would_make_late_is_conservative_against_an_exact_simulation(servers):
    """``balking``: with arrivals refused where the wait they find would make them late, the queue stays
    stable past its bound, and the admitted share the fixed point gives is under, and near, an exact
    simulation's; without the refusals, the same queue meets far less from 0.9 of its bound."""
    service_s = np.random.default_rng(1).lognormal(0.0, 0.8, 3000)
    slo_s, bound_rps = 4.0, servers / service_s.mean()

    def queues_at(joined_rps, weights=None):
        return (queue(joined_rps, servers, service_s, weights),)

    for load, below in ((0.5, 0.03), (0.9, 0.08), (1.3, 0.16)):
        rate_rps = load * bound_rps
        simulated = _refusing_queue(rate_rps, servers, service_s, slo_s, 40_000, seed=servers)
        modelled = float(balking(rate_rps, slo_s - service_s, queues_at).mean())
        plain = float(p_within(slo_s - service_s, *queues_at(rate_rps)).mean())
        assert simulated - below <= modelled <= simulated + 0.01, (load, simulated, modelled)
        if load >= 0.9:
            assert plain < modelled - 0.15, (load, plain, modelled)
