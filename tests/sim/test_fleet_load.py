"""A fleet's planned capacity counts a PrfaaS cluster shared by several PD clusters once (``sim
--topology``'s default load, ``runtime.planned_capacity_rps``), a one-pair deployment's is its model's,
and a fleet simulation reports every link, none of them as "the" link."""

from __future__ import annotations

import pytest
import yaml
from helpers import REPO_ROOT

from prfaas_sglang import runtime
from prfaas_sglang.sim import __main__ as sim_cli
from prfaas_sglang.sim import arrivals
from prfaas_sglang.sim.fleet import SimSettings, Simulation
from prfaas_sglang.topology import load_topology

FLEET = REPO_ROOT / "launch" / "multi-cluster.yaml"


def test_a_shared_prfaas_cluster_counts_once_in_the_planned_capacity():
    pytest.importorskip("scipy")
    from prfaas_sglang.plan.fleet_model import PdChoice, evaluate_fleet

    topology = load_topology(FLEET)
    models = runtime.pair_models(topology, emulated=False)
    planned = runtime.planned_capacity_rps(topology)
    fleet, prior, _ = runtime.fleet_from_topology(topology)
    choices = {pd: PdChoice(min(m.baseline_threshold_tokens for p, m in models.items() if p.pd == pd),
                            next(m.n_prefill for p, m in models.items() if p.pd == pd)) for pd in ("pd-east", "pd-west")}
    assert planned == evaluate_fleet(fleet, prior, choices).lambda_max_rps
    assert planned < 0.6 * sum(m.capacity_rps() for m in models.values())  # per pair, each PrfaaS cluster counted twice


def test_a_one_pair_topologys_planned_capacity_is_its_models():
    topology = load_topology(REPO_ROOT / "launch" / "local-two-cluster.yaml")
    assert runtime.planned_capacity_rps(topology) == runtime.from_topology(topology, emulated=False).capacity_rps()


def test_sim_topologys_default_load_is_a_share_of_the_planned_capacity(monkeypatch):
    pytest.importorskip("scipy")
    rates = []
    real = arrivals.poisson
    monkeypatch.setattr(arrivals, "poisson", lambda rate, *a, **kw: rates.append(rate) or real(rate, *a, **kw))
    sim, requests, _ = sim_cli.build(sim_cli.parse_args(["--topology", str(FLEET), "--duration-s", "20"]))
    assert rates == [pytest.approx(0.8 * runtime.planned_capacity_rps(load_topology(FLEET)))]
    assert {r.entry for r in requests} <= {"pd-east", "pd-west"}


def test_a_fleet_simulation_reports_every_link_and_none_at_the_top():
    sim = Simulation(yaml.safe_load(FLEET.read_text()), SimSettings(sample_interval_s=10.0))
    requests = arrivals.entering(list(arrivals.poisson(1.0, 60, 0, sim.targets.output_tokens)),
                                 {"pd-east": 0.5, "pd-west": 0.5}, 0)
    sim.run(requests, 120)
    last = sim.series[-1]
    assert set(last["links"]) == {str(p) for p in sim.models}
    assert last["egress_gbps"] == pytest.approx(sum(link["egress_gbps"] for link in last["links"].values()))
    for key in ("threshold_tokens", "capacity_est_gbps", "link_capacity_gbps"):
        assert key not in last, key  # a fleet's links are each in "links"
    with pytest.raises(ValueError, match="names one"):
        Simulation(yaml.safe_load(FLEET.read_text()), SimSettings(link_schedule=((10.0, 1.0),)))
