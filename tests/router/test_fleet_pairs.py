"""A fleet-only router: every pair of a fleet gets its own answer, none stands for the others.

On ``launch/multi-cluster.yaml`` (PrfaaS h200 and h100, each linked to PD east and PD west: four pairs)
it is always a pair other than the first, or the second PD cluster, whose conversion, ``/status``
(threshold history, link), long-term samples, worker adoption, link header and decode step are
checked: a router that answered any of them from its first pair fails here. A one-pair deployment
keeps its one-pair answers (``/status``'s top-level view), and the long-term controller of a PD
cluster fed by two PrfaaS clusters plans on both (the fleet model's linear program for that cluster).
"""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
from helpers import REPO_ROOT

from prfaas_sglang import runtime
from prfaas_sglang.plan.profiles import DecodeProfile
from prfaas_sglang.protocol import EngineRequest
from prfaas_sglang.router.conversion import RoleSwitchClient, convert
from prfaas_sglang.router.longterm import LongTermSettings
from prfaas_sglang.router.loops import adopt_facts
from prfaas_sglang.router.policy import RouteInput
from prfaas_sglang.router.server import _link_header
from prfaas_sglang.router.service import NotOnePair, RouterConfig, new_service
from prfaas_sglang.router.workers import WorkerFacts, workers_from_topology
from prfaas_sglang.sim.fleet import FleetSpec, Simulation
from prfaas_sglang.topology import SitePair, load_topology
from prfaas_sglang.wire.blocks import HASH_SCHEME
from prfaas_sglang.wire.role_switch import RoleSwitchReply
from prfaas_sglang.wire.telemetry import LinkSample

FLEET = REPO_ROOT / "launch" / "multi-cluster.yaml"
H200_EAST, H100_EAST = SitePair("pd-east", "prfaas-h200"), SitePair("pd-east", "prfaas-h100")
H200_WEST, H100_WEST = SitePair("pd-west", "prfaas-h200"), SitePair("pd-west", "prfaas-h100")


def fleet_service(config: RouterConfig | None = None):
    topology = load_topology(FLEET)
    records = workers_from_topology(topology)
    for r in records.values():
        r.healthy = True
        r.facts = WorkerFacts("m", 512, r.role, 1_000_000, 64, 131_072, None, HASH_SCHEME, None, None, None)
    service = new_service(config or RouterConfig(), runtime.pair_models(topology, emulated=False), records)
    assert list(service.pairs) == [H200_EAST, H100_EAST, H200_WEST, H100_WEST]  # the first pair: h200 -> east
    return service


def one_pair_service():
    topology = load_topology(REPO_ROOT / "launch" / "local-two-cluster.yaml")
    return new_service(RouterConfig(), runtime.from_topology(topology), workers_from_topology(topology))


def _request(n: int, rid: str = "r") -> EngineRequest:
    return EngineRequest("generate", tuple(range(n)), 16, False, rid, None, None)


def test_the_service_has_no_first_pair_facade():
    """No property stands for "the" pair, its model, controller or link: callers name a pair, or ask
    :meth:`RouterService.only_pair`, which refuses a fleet."""
    from prfaas_sglang.router.service import RouterService

    assert [name for name in ("pair", "runtime", "controller", "link", "is_fleet") if hasattr(RouterService, name)] == []


class TestStatus:
    def test_every_pair_has_its_threshold_history_and_link_and_no_pair_stands_for_the_fleet(self):
        service = fleet_service()
        service.pairs[H100_EAST].controller.override(1.0, 7_777)  # the second pair only
        h100 = service.workers["prfaas-h100-0"]
        service.pairs[H100_EAST].link.update(h100.name, LinkSample(h100.name, 100.0, 2e9, 0.5, 4e9, 1), now_s=1.0)
        status = service.status(1.5)
        second = status["pairs"][str(H100_EAST)]
        assert second["threshold_tokens"] == 7_777
        assert second["threshold_history"][-1]["threshold_tokens"] == 7_777
        assert second["threshold_history"][-1]["why"] == "override"
        assert second["link"]["egress_bps"] == 2e9 and status["pairs"][str(H200_EAST)]["link"] is None
        assert status["pairs"][str(H200_EAST)]["threshold_tokens"] != 7_777
        assert status["pairs"][str(H200_EAST)]["threshold_history"] == []  # the override is the second pair's alone
        for key in ("threshold_tokens", "threshold_history", "controller", "model", "link", "queues_s"):
            assert key not in status, key  # a fleet has no "the" threshold, link or model

    def test_a_one_pair_deployment_keeps_its_pairs_view_at_the_top(self):
        service = one_pair_service()
        status = service.status(0.0)
        (only,) = status["pairs"].values()
        for key in ("threshold_tokens", "threshold_history", "controller", "model", "link", "queues_s"):
            assert status[key] == only[key], key
        assert status["threshold_tokens"] == service.only_pair().controller.threshold_tokens

    def test_only_pair_is_refused_on_a_fleet(self):
        with pytest.raises(NotOnePair):
            fleet_service().only_pair()
        service = one_pair_service()
        assert service.only_pair() is next(iter(service.pairs.values()))
        with pytest.raises(NotOnePair):
            Simulation(load_doc()).runtime  # noqa: B018 - the property is the check
        assert Simulation(FleetSpec(1, 1, 1)).runtime.n_prefill == 1


def load_doc() -> dict:
    import yaml

    return yaml.safe_load(FLEET.read_text())


class _Client(RoleSwitchClient):
    def __init__(self):
        self.calls = []

    async def decode_graph_memory_gb(self, peers):
        return None

    async def switch(self, worker, new_role, decode_graph_gb=None):
        self.calls.append((worker.name, new_role))
        return RoleSwitchReply(True, "switched", worker.role, new_role)


class TestConversion:
    def test_a_conversion_replans_and_reports_every_pair_of_its_pd_cluster_and_no_other(self):
        service = fleet_service()
        service.workers["east-p-0"].switch_url = "http://10.2.0.10:9000"
        before = {pair: len(ps.controller.history) for pair, ps in service.pairs.items()}
        done = asyncio.run(convert(service, _Client(), "east-p-0", "decode", drain_timeout_s=5, poll_s=0.01))
        east = {str(p): service.pairs[p].controller.threshold_tokens for p in (H200_EAST, H100_EAST)}
        assert done.thresholds == east and len(set(east.values())) == 2  # each pair's own t, not the first's
        assert "threshold_tokens" not in done.to_json()  # two pairs: no single t
        for pair in (H200_EAST, H100_EAST):
            ps = service.pairs[pair]
            assert ps.runtime.n_prefill == 2 and ps.controller.history[-1][2].startswith("replan: east-p-0 -> decode")
        for pair in (H200_WEST, H100_WEST):  # the other PD cluster: untouched
            assert service.pairs[pair].runtime.n_prefill == 1 and len(service.pairs[pair].controller.history) == before[pair]

    def test_a_conversion_in_the_second_pd_cluster_moves_its_pairs(self):
        service = fleet_service()
        service.workers["west-d-0"].switch_url = "http://10.3.0.20:9000"
        service.workers["west-d-0"].bootstrap_port = 8998
        moved = service.converted("west-d-0", "prefill", 1.0)
        assert set(moved) <= {H200_WEST, H100_WEST} and moved
        assert [service.pairs[p].runtime.n_prefill for p in service.pairs] == [3, 3, 2, 2]


class TestLongTerm:
    def test_requests_waiting_for_decode_room_queue_at_the_pd_cluster_they_wait_for(self):
        service = fleet_service()
        service.start_longterm(LongTermSettings())
        service.stage_samples(0.0)
        for entry in ("pd-west", "pd-west", None):
            service.start_waiting(entry)
        samples = service.stage_samples(1.0)
        assert samples["pd-west"].queued["pd-decode"] == 3  # two entered there, one may decode anywhere
        assert samples["pd-east"].queued["pd-decode"] == 1
        assert service.waiting == 3 and service.status(1.0)["waiting_for_decode_room"] == 3
        service.stop_waiting("pd-west")
        assert service.stage_samples(2.0)["pd-west"].queued["pd-decode"] == 2

    def test_the_second_pd_cluster_records_its_own_requests_at_its_pairs_t(self):
        service = fleet_service()
        service.start_longterm(LongTermSettings())
        service.pairs[H100_WEST].controller.override(0.0, 5_000)
        decision = service.decide(RouteInput(60_000, 60_016, {}), set(), 0.0, "pd-west")
        service.finish(service.begin(_request(60_000), decision, 0.0, 0))
        assert len(service.longterm["pd-west"]._routed) == 1 and len(service.longterm["pd-east"]._routed) == 0
        assert service.pd_threshold_tokens("pd-west") == 5_000  # its pairs' lowest: the second pair's here
        assert service.pd_threshold_tokens("pd-east") == service.pairs[H200_EAST].controller.threshold_tokens

    def test_a_pd_cluster_fed_by_two_prfaas_clusters_is_planned_from_both(self):
        """Its controller's model pools the PrfaaS side of both pairs: at any t and split, Theta_prfaas is the
        sum of each pair's, and Lambda_max is the fleet model's linear program for that PD cluster alone."""
        pytest.importorskip("scipy")
        from prfaas_sglang.plan import fleet_model as fm

        service = fleet_service()
        service.start_longterm(LongTermSettings())
        model = service.longterm["pd-east"].runtime
        assert set(model.pairs) == {H200_EAST, H100_EAST}
        prior = model.pairs[H200_EAST].prior
        pooled = model.evaluate_at(prior, 20_000)
        alone = [service.pairs[p].runtime.evaluate_at(prior, 20_000) for p in (H200_EAST, H100_EAST)]
        assert pooled.theta_prfaas_rps == pytest.approx(sum(a.theta_prfaas_rps for a in alone))
        assert pooled.lambda_max_rps > alone[0].lambda_max_rps  # not the first pair's model alone
        deps = {p: service.pairs[p].runtime.deployment for p in (H200_EAST, H100_EAST)}
        fleet = fm.Fleet(tuple(fm.PrfaasSite(p.prfaas, d.prfaas, d.n_prfaas) for p, d in deps.items()),
                         (fm.PdSite("pd-east", deps[H200_EAST].pd, deps[H200_EAST].n_pd),),
                         tuple(fm.FleetLink(p.prfaas, "pd-east", d.egress_bps) for p, d in deps.items()),
                         deps[H200_EAST].output_tokens)
        lp = fm.evaluate_fleet(fleet, prior, {"pd-east": fm.PdChoice(20_000, model.n_prefill)})
        assert pooled.lambda_max_rps == pytest.approx(lp.lambda_max_rps, rel=1e-6)

    def test_on_one_pair_the_cluster_model_is_the_pairs_model(self):
        service = one_pair_service()
        service.start_longterm(LongTermSettings())
        (ctl,) = service.longterm.values()
        model = service.only_pair().runtime
        assert ctl.runtime.plan_splits(model.prior, 512) == model.plan_splits(model.prior, 512)
        assert ctl.runtime.evaluate_at(model.prior, 20_000) == model.evaluate_at(model.prior, 20_000)


class TestAdoption:
    @staticmethod
    def _info(role: str, linear_state: bool) -> dict:
        return {"page_size": 512, "disaggregation_mode": role, "disable_radix_cache": False,
                "uses_mamba_radix_cache": linear_state, "max_total_num_tokens": 1_000_000}

    def test_a_worker_is_checked_against_the_cost_model_of_every_pair_its_cluster_is_in(self):
        service = fleet_service()
        for pair in (H200_WEST, H100_WEST):  # west's profile: a model without linear-attention state
            service.pairs[pair].runtime = dataclasses.replace(service.pairs[pair].runtime, state="none")
        west, east, h100 = (service.workers[n] for n in ("west-d-0", "east-d-0", "prfaas-h100-0"))
        for worker in (west, east, h100):
            worker.facts = None
        assert adopt_facts(service, west, self._info("decode", False), None) is None  # west's own pairs: none
        assert west.facts is not None
        assert "linear-attention hybrid" in adopt_facts(service, east, self._info("decode", False), None)
        assert "linear-attention" in adopt_facts(service, west, self._info("decode", True), None)
        # a PrfaaS cluster linked to both: each of its pairs' models must fit
        assert adopt_facts(service, h100, self._info("prefill", True), None) is not None
        assert adopt_facts(service, h100, self._info("prefill", False), None) is not None
        assert h100.facts is None


class TestRequestPath:
    def test_the_link_header_and_the_decode_step_are_the_requests_own_pairs(self):
        service = fleet_service()
        for pair in (H200_WEST, H100_WEST):  # west decodes at its own step
            model = service.pairs[pair].runtime
            dep = model.deployment
            slower = dataclasses.replace(dep.pd, decode=DecodeProfile(dep.pd.decode.bs_max, 2 * dep.pd.decode.step_s))
            service.pairs[pair].runtime = dataclasses.replace(model, deployment=dataclasses.replace(dep, pd=slower))
        steps = []
        service.calibration.token_gap = lambda observed_s, step_s, now_s: steps.append(step_s)
        for total in (60_000, 2_000):  # offloaded over a west link; prefilled in west
            decision = service.decide(RouteInput(total, total + 16, {}), set(), 0.0, "pd-west")
            lease = service.begin(_request(total), decision, 0.0, 0)
            assert lease.pair.pd == "pd-west"
            assert _link_header(lease) == (str(decision.pair) if decision.cluster == "prfaas" else "pd-west")
            service.token_gap(lease, 0.1, 0.0)
            service.finish(lease)
        assert decision.cluster == "pd" and _link_header(lease) == "pd-west"
        west_step = service.pairs[H200_WEST].runtime.decode.step_s
        assert steps == [west_step, west_step] and west_step != service.pairs[H200_EAST].runtime.decode.step_s

    def test_a_token_gap_is_compared_with_the_models_step_at_the_batch_its_decode_worker_runs(self):
        """The calibration's decode scale compares like with like: a gap against the profile's step at the
        decode worker's batch (what it last reported running, or the router's own leases on it if more)."""
        from prfaas_sglang.router.workers import WorkerLoad

        service = fleet_service()
        for pair in (H200_WEST, H100_WEST):
            model = service.pairs[pair].runtime
            dep = model.deployment
            grows = dataclasses.replace(dep.pd, decode=DecodeProfile(dep.pd.decode.bs_max, 0.05, ((1, 0.01), (9, 0.03))))
            service.pairs[pair].runtime = dataclasses.replace(model, deployment=dataclasses.replace(dep, pd=grows))
        steps = []
        service.calibration.token_gap = lambda observed_s, step_s, now_s: steps.append(step_s)
        decision = service.decide(RouteInput(2_000, 2_016, {}), set(), 0.0, "pd-west")
        lease = service.begin(_request(2_000), decision, 0.0, 0)
        service.token_gap(lease, 0.1, 0.0)  # nothing reported yet: its one lease
        service.workers[decision.decode].load = WorkerLoad(running=5, waiting=0, used_tokens=0, max_total_tokens=None)
        service.token_gap(lease, 0.1, 0.0)  # five running, as it reported
        service.finish(lease)
        assert steps == [pytest.approx(0.01), pytest.approx(0.02)]

    def test_a_decision_without_its_pair_is_refused(self):
        service = fleet_service()
        decision = service.decide(RouteInput(2_000, 2_016, {}), set(), 0.0, "pd-west")
        with pytest.raises(ValueError, match="decide"):
            service.begin(_request(2_000), dataclasses.replace(decision, pair=None), 0.0, 0)


def test_auto_bandwidth_mode_is_chosen_per_pair_from_its_links_measured_capacity():
    """``--bandwidth-mode auto``: a pair is routed in abundant mode while the plan's KV at Lambda_max fills at most
    half its link's measured capacity, in scarce mode once telemetry has its link lower, and only that pair
    changes; a fixed mode is what it says."""
    from prfaas_sglang.router.policy import ABUNDANT_MAX_UTILIZATION, BandwidthMode, mode_from_link

    assert mode_from_link(ABUNDANT_MAX_UTILIZATION) is BandwidthMode.ABUNDANT
    assert mode_from_link(1.01 * ABUNDANT_MAX_UTILIZATION) is BandwidthMode.SCARCE
    service = fleet_service(RouterConfig(auto_mode=True))
    modes = {pair: ps.mode(service.config) for pair, ps in service.pairs.items()}
    utilization = {pair: ps.runtime.operating_point(ps.controller.capacity_est_bps).egress_utilization
                   for pair, ps in service.pairs.items()}
    assert modes == {pair: mode_from_link(u) for pair, u in utilization.items()}
    roomy = next(pair for pair, mode in modes.items() if mode is BandwidthMode.ABUNDANT)
    ps = service.pairs[roomy]
    ps.controller.capacity_est_bps = ps.controller.nominal_bps * utilization[roomy] / (1.5 * ABUNDANT_MAX_UTILIZATION) / 2
    assert ps.mode(service.config) is BandwidthMode.SCARCE
    assert {pair: p.mode(service.config) for pair, p in service.pairs.items() if pair != roomy} == \
        {pair: mode for pair, mode in modes.items() if pair != roomy}
    assert service.pair_status(ps, 0.0)["bandwidth_mode"] == "scarce" and service.status(0.0)["bandwidth_mode"] == "auto"
    assert fleet_service(RouterConfig(mode=BandwidthMode.ABUNDANT)).pairs[roomy].mode(RouterConfig(mode=BandwidthMode.ABUNDANT)) \
        is BandwidthMode.ABUNDANT
