"""Capacity at a TTFT SLO from the plan (plan/slo_capacity.py, pure): the queueing pieces against known values and
a Monte Carlo, and the capacity against the throughput bound it must stay under."""

from __future__ import annotations

import random

import numpy as np
import pytest

from prfaas_sglang.plan.scenario import Catalog, parse_scenario
from prfaas_sglang.plan.search import search
from prfaas_sglang.plan.slo_capacity import Queue, SloModel, erlang_c, p_within, queue


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
