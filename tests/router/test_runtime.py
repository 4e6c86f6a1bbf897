"""The runtime model: one place builds the deployment, the router's costs and t from a topology (pure)."""

from __future__ import annotations

import argparse

import pytest
from helpers import REPO_ROOT, TRACE

from prfaas_sglang import runtime
from prfaas_sglang.errors import ConfigError
from prfaas_sglang.topology import load_topology, parse_topology


def demo_args(workload: str, **kw) -> argparse.Namespace:
    from prfaas_sglang.demo.__main__ import build_parser

    args = build_parser().parse_args(["--workload", workload])
    for k, v in kw.items():
        setattr(args, k.replace("-", "_"), v)
    return args


@pytest.mark.parametrize("workload", ["case-study", f"trace:{TRACE}"])
@pytest.mark.parametrize("speedup", [5.0, 20.0])
def test_demo_and_comparison_topologies_give_the_same_t(workload, speedup):
    """Same workload and settings -> the same topology (ports aside) -> the same t, whoever builds it.
    The comparison shapes its link and states its TTFT SLO; with those two set alike, nothing differs."""
    from prfaas_sglang.bench import compare
    from prfaas_sglang.demo.__main__ import topology_for

    demo = topology_for(demo_args(workload, speedup=speedup, max_input_tokens=compare.MAX_INPUT_TOKENS, output_tokens=64))
    bench = compare.topology(compare.Setting(workload=workload, speedup=speedup), "hetero")
    demo["links"] = bench["links"]
    demo["scheduler"]["ttft_slo_s"] = bench["scheduler"]["ttft_slo_s"]
    t_demo = runtime.from_topology(parse_topology(demo)).baseline_threshold_tokens
    t_bench = runtime.from_topology(parse_topology(bench)).baseline_threshold_tokens
    assert t_demo == t_bench
    strip = lambda doc: {k: v for k, v in doc.items() if k != "clusters"}  # noqa: E731 - ports differ, nothing else
    assert strip(demo) == {**strip(bench), "model": {**bench["model"], "served_name": demo["model"]["served_name"]}}


def test_the_scale_of_emulation_moves_t_only_where_the_link_binds():
    from prfaas_sglang.demo.cluster import local_topology

    def t(speedup: float, gbps: float) -> float:
        return runtime.from_topology(parse_topology(local_topology(speedup=speedup, link_gbps=gbps))).baseline_threshold_tokens

    assert t(5, 100) == t(20, 100)  # compute-bound: time scales the same on both sides
    assert t(20, 0.1) > t(5, 0.1)   # a thin link binds harder when the engines run 4x faster


def test_emulation_applies_only_to_emulated_engines():
    topo = load_topology(REPO_ROOT / "launch" / "local-two-cluster.yaml")
    emulated = runtime.from_topology(topo)
    real = runtime.from_topology(topo, emulated=False)
    assert emulated.emulation.speedup == 20.0 and real.emulation.speedup == 1.0
    assert emulated.prefill_cost("pd").prefill_s(10_000) == pytest.approx(real.prefill_cost("pd").prefill_s(10_000) / 20)
    assert emulated.kv_bytes(10_000) == pytest.approx(real.kv_bytes(10_000) * 0.01)


def test_defaults_are_stated_and_explicit_values_win():
    from prfaas_sglang.demo.cluster import local_topology

    bare = runtime.from_topology(parse_topology(local_topology(workload=None, output_tokens=None)))
    assert {"scheduler.workload", "scheduler.output_tokens", "model.cost_model", "prfaas.accelerator", "pd.accelerator"} <= set(bare.defaults_used)
    assert bare.output_tokens == runtime.DEFAULT_OUTPUT_TOKENS and bare.prior.name == "case-study"
    shipped = runtime.from_topology(load_topology(REPO_ROOT / "launch" / "local-two-cluster.yaml"))
    assert shipped.defaults_used == () and shipped.output_tokens == 256 and shipped.link_bps == 1e9
    assert shipped.describe()["baseline_threshold_tokens"] == shipped.baseline_threshold_tokens


def test_operator_threshold_is_the_baseline():
    from prfaas_sglang.demo.cluster import local_topology

    model = runtime.from_topology(parse_topology(local_topology(threshold_tokens=12_345)))
    assert model.baseline_threshold_tokens == 12_345


def test_counts_come_from_the_nodes():
    from prfaas_sglang.demo.cluster import local_topology

    model = runtime.from_topology(parse_topology(local_topology(prfaas=2, pd_prefill=3, pd_decode=5)))
    assert (model.deployment.n_prfaas, model.n_prefill, model.n_decode, model.deployment.n_pd) == (2, 3, 5, 8)


@pytest.mark.parametrize("mutate, field", [
    (lambda d: d.update(scheduler={"workload": {"kind": "lognormal", "mu": 9.9, "sigma": -1, "max_tokens": 10}}), "scheduler.workload.sigma"),
    (lambda d: d.update(scheduler={"workload": {"kind": "nope"}}), "scheduler.workload.kind"),
    (lambda d: d.update(scheduler={"output_tokens": 0}), "scheduler.output_tokens"),
    (lambda d: d.update(scheduler={"slo_tokens_per_s": float("nan")}), "scheduler.slo_tokens_per_s"),
    (lambda d: d.update(emulation={"speedup": 0}), "emulation.speedup"),
    (lambda d: d.update(emulation={"kv_scale": 2}), "emulation.kv_scale"),
    (lambda d: d["clusters"]["pd"].update(accelerator="h999"), "clusters.pd.accelerator"),
    (lambda d: d["clusters"]["pd"].update(accelerator="h20x8", profile="x.yaml"), "clusters.pd.profile"),
    (lambda d: d["model"].update(cost_model="no-such-model"), "model.cost_model"),
    (lambda d: d.update(scheduler={"wrokload": {}}), "scheduler.wrokload"),
])
def test_bad_inputs_name_their_field(mutate, field):
    from prfaas_sglang.demo.cluster import local_topology

    doc = local_topology(tokenizer="prfaas-tiny-chatml")
    mutate(doc)
    with pytest.raises(ConfigError) as err:
        runtime.from_topology(parse_topology(doc))
    assert err.value.field.startswith(field), (err.value.field, field)
