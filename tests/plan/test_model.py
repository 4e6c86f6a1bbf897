"""The throughput model (1)-(6), the search, the baselines and their properties."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prfaas_sglang.plan.model import Deployment, evaluate, required_egress_bps
from prfaas_sglang.plan.profiles import (
    DecodeProfile,
    InstanceClass,
    ScaledPrefill,
    TabulatedPrefill,
)
from prfaas_sglang.plan.report import make_plan
from prfaas_sglang.plan.scenario import Catalog
from prfaas_sglang.plan.search import homogeneous_baseline, naive_baseline, search
from prfaas_sglang.plan.workload import EmpiricalLengths, Split, TruncatedLogNormal


def linear_prefill(name: str, seconds_per_ktoken: float, kv_bytes_per_token: float) -> TabulatedPrefill:
    """T(l) = a*l and S(l) = b*l exactly (two points, linear between and beyond)."""
    return TabulatedPrefill(name, [
        {"tokens": 1000, "prefill_s": seconds_per_ktoken, "kv_bytes": 1000 * kv_bytes_per_token},
        {"tokens": 2000, "prefill_s": 2 * seconds_per_ktoken, "kv_bytes": 2000 * kv_bytes_per_token},
    ])


FAST = InstanceClass("fast", 8, linear_prefill("fast", 0.1, 1e4))
SLOW = InstanceClass("slow", 8, linear_prefill("slow", 0.4, 1e4), DecodeProfile(bs_max=32, step_s=0.025))


def deployment(n_prfaas=2, n_pd=6, egress_gbps=100.0, prfaas=FAST, pd=SLOW) -> Deployment:
    return Deployment(prfaas, n_prfaas, pd, n_pd, egress_gbps * 1e9, 1000)


class TestEquations:
    def test_hand_computed_point(self):
        """p=0.5, l_long=20K, l_short=5K, 2 fast + 2P/4D slow, 100 Gbps."""
        point = evaluate(deployment(), Split(10_000, 0.5, 20_000, 5_000), 2, 4)
        assert point.prfaas_compute_rps == pytest.approx(2 / 2.0)  # (3): N / T(20K) = 2 / (0.1*20)
        assert point.prfaas_bandwidth_rps == pytest.approx(100e9 / (8 * 2e8))  # (3): B / S(20K)
        assert point.theta_pd_prefill_rps == pytest.approx(2 / 2.0)  # (4): 2 / (0.4*5)
        assert point.theta_pd_decode_rps == pytest.approx(4 * 32 / (0.025 * 1000))  # (5)
        assert point.lambda_max_rps == pytest.approx(min(1.0 / 0.5, 1.0 / 0.5, 5.12))  # (6)
        assert point.egress_gbps == pytest.approx(2.0 * 0.5 * 8 * 2e8 / 1e9)
        assert point.binding_stage in ("prfaas-compute", "pd-prefill")

    def test_phi_kv_and_cluster_egress(self):
        """(1) and (2): Phi = S/T; 512 GPUs in 8-GPU instances need 64 x Phi."""
        phi = FAST.prefill.phi_kv_bps(32_768)
        assert phi == pytest.approx(8 * 32_768 * 1e4 / (0.1 * 32.768))
        assert required_egress_bps(512, 8, FAST.prefill, 32_768) == pytest.approx(64 * phi)

    def test_empty_sides_do_not_limit(self):
        dep = deployment()
        all_local = evaluate(dep, Split(math.inf, 0.0, None, 5_000), 2, 4)
        assert all_local.lambda_max_rps == pytest.approx(min(2 / 2.0, 5.12))
        assert all_local.egress_gbps == 0.0
        all_remote = evaluate(dep, Split(0, 1.0, 5_000, None), 0, 6)
        assert all_remote.lambda_max_rps == pytest.approx(min(2 / 0.5, 6 * 32 / 25))

    def test_bandwidth_ceiling_binds_on_a_thin_link(self):
        thin = evaluate(deployment(egress_gbps=1.0), Split(10_000, 0.5, 20_000, 5_000), 2, 4)
        assert thin.binding_stage == "prfaas-bandwidth"
        assert thin.lambda_max_rps == pytest.approx(1e9 / (8 * 2e8) / 0.5)
        assert thin.egress_utilization == pytest.approx(1.0)


CASE = Catalog().scenario("case-study")
CASE_WORKLOAD = CASE.workload


class TestSearch:
    def test_optimum_is_the_grid_max_and_brute_force(self):
        dep = CASE.deployment
        result = search(dep, CASE_WORKLOAD, 1024)
        assert result.best.lambda_max_rps == result.best_on_grid()
        brute = max(
            evaluate(dep, CASE_WORKLOAD.split(t), n_p, dep.n_pd - n_p).lambda_max_rps
            for t in result.thresholds for n_p in range(dep.n_pd)
        )
        assert result.best.lambda_max_rps == brute

    def test_bandwidth_limited_search_raises_the_threshold(self):
        """A thin link makes the B_out/S_kv ceiling bind; the optimum moves to longer requests."""
        wide = search(CASE.deployment, CASE_WORKLOAD, 256).best
        thin_dep = Deployment(CASE.deployment.prfaas, 4, CASE.deployment.pd, 8, 5e9, 1024)
        thin = search(thin_dep, CASE_WORKLOAD, 256).best
        assert thin.binding_stage == "prfaas-bandwidth" or thin.egress_utilization == pytest.approx(1.0, rel=0.05)
        assert thin.threshold_tokens > wide.threshold_tokens
        assert thin.egress_gbps <= 5.0 + 1e-9
        assert thin.lambda_max_rps < wide.lambda_max_rps


@pytest.fixture(scope="module")
def plan():
    return make_plan(CASE)


class TestCaseStudyShape:
    """Acceptance: the paper's shape with the shipped case-study profile."""

    def test_threshold_and_split(self, plan):
        assert 10_000 <= plan.best.threshold_tokens <= 30_000
        best_decode_share = plan.best.n_decode / (plan.best.n_prefill + plan.best.n_decode)
        homo_decode_share = plan.homogeneous.n_decode / (plan.homogeneous.n_prefill + plan.homogeneous.n_decode)
        assert best_decode_share > homo_decode_share

    def test_egress_well_under_the_link(self, plan):
        assert plan.best.egress_gbps < 0.5 * 100

    def test_gains(self, plan):
        assert plan.gain_vs_homogeneous >= 1.3
        assert plan.gain_vs_naive >= 1.15

    def test_homogeneous_baseline_uses_all_instances(self, plan):
        assert plan.homogeneous.n_prefill + plan.homogeneous.n_decode == 12
        assert plan.homogeneous.offload_fraction == 0.0


def scaled_case(time_scale_prfaas=1.0, time_scale_pd=1.0, kv_scale=1.0, bs_scale=1.0, n_prfaas=4, n_pd=8, egress_gbps=100.0):
    dep = CASE.deployment
    prfaas = InstanceClass("p", 8, ScaledPrefill(dep.prfaas.prefill, time_scale_prfaas, kv_scale))
    decode = DecodeProfile(dep.pd.decode.bs_max * bs_scale, dep.pd.decode.step_s)
    pd = InstanceClass("d", 8, ScaledPrefill(dep.pd.prefill, time_scale_pd, kv_scale), decode)
    return Deployment(prfaas, n_prfaas, pd, n_pd, egress_gbps * 1e9, 1024)


def best_lambda(dep: Deployment, workload) -> float:
    return search(dep, workload, 2048).best.lambda_max_rps


workloads = st.builds(
    TruncatedLogNormal,
    mu=st.floats(8.0, 11.0), sigma=st.floats(0.3, 1.5), lo=st.just(128.0), hi=st.just(131072.0),
)
params = st.fixed_dictionaries({
    "time_scale_prfaas": st.floats(0.3, 3.0), "time_scale_pd": st.floats(0.3, 3.0),
    "kv_scale": st.floats(0.2, 20.0), "bs_scale": st.floats(0.3, 3.0),
    "n_prfaas": st.integers(0, 6), "n_pd": st.integers(2, 10), "egress_gbps": st.floats(0.5, 200.0),
})


@settings(max_examples=60, deadline=None)
@given(workload=workloads, p=params, what=st.sampled_from(["pd-node", "prfaas-node", "bandwidth", "faster-prfaas",
                                                            "faster-pd", "smaller-kv", "bigger-batch"]))
def test_more_resources_never_lower_lambda_max(workload, p, what):
    """Property: adding a node, bandwidth or a better profile never lowers the optimum."""
    before = best_lambda(scaled_case(**p), workload)
    better = dict(p)
    if what == "pd-node":
        better["n_pd"] += 1
    elif what == "prfaas-node":
        better["n_prfaas"] += 1
    elif what == "bandwidth":
        better["egress_gbps"] *= 2
    elif what == "faster-prfaas":
        better["time_scale_prfaas"] *= 0.7
    elif what == "faster-pd":
        better["time_scale_pd"] *= 0.7
    elif what == "smaller-kv":
        better["kv_scale"] *= 0.5
    else:
        better["bs_scale"] *= 1.5
    assert best_lambda(scaled_case(**better), workload) >= before * (1 - 1e-12)


@settings(max_examples=40, deadline=None)
@given(lengths=st.lists(st.integers(100, 150_000), min_size=5, max_size=40), egress=st.floats(1.0, 100.0))
def test_returned_optimum_is_the_grid_max(lengths, egress):
    dep = scaled_case(egress_gbps=egress)
    result = search(dep, EmpiricalLengths(lengths), 4096)
    assert result.best.lambda_max_rps == result.best_on_grid()


def test_naive_and_homogeneous_baselines_on_the_case_study():
    naive = naive_baseline(CASE.deployment, CASE_WORKLOAD)
    assert (naive.n_prefill, naive.n_decode, naive.offload_fraction) == (0, 8, 1.0)
    homo = homogeneous_baseline(CASE.deployment.pd, 12, CASE_WORKLOAD, 1024, 100e9)
    assert (homo.n_prefill, homo.n_decode) == (9, 3)


def test_every_shipped_model_and_a_served_config_round_trip_through_their_topology_mapping():
    """``model_mapping`` writes what ``parse_model`` reads (a topology's ``model.cost_model`` mapping): every
    catalog model (MLA, recurrent, sliding-window, MoE among them) and a config.json's model come back equal."""
    from prfaas_sglang.gpu.tiny_model import tiny_cpu_config
    from prfaas_sglang.plan.hf import model_from_hf_config
    from prfaas_sglang.plan.scenario import model_mapping, parse_model

    catalog = Catalog()
    models = [catalog.model(name) for name in catalog.names("models")]
    models.append(model_from_hf_config(tiny_cpu_config(4096, 2, 0), "tiny-llama"))
    for model in models:
        assert parse_model(model_mapping(model)) == model, model.name
    assert {"recurrent", "sliding_window", "moe"} <= {k for m in models for k in model_mapping(m)}  # every part seen
