"""The global scheduler over several clusters (router/fleet.py, the service's pairs), without processes.

On one pair it is the one-pair rule exactly; over several it offloads to the PrfaaS cluster whose link
and queue serve a long prompt first, decodes where the request entered, and a link that is dead or
congested loses requests to the other links or to local prefill while no other pair's traffic moves.
"""

from __future__ import annotations

import dataclasses

import pytest
from helpers import REPO_ROOT

from prfaas_sglang import runtime
from prfaas_sglang.errors import ConfigError
from prfaas_sglang.plan.profiles import TabulatedPrefill
from prfaas_sglang.router.fleet import UnknownEntry, route_fleet
from prfaas_sglang.router.policy import (
    BandwidthMode,
    ClusterSnapshot,
    Link,
    NoDecodeRoom,
    RouteInput,
    WorkerState,
    route,
)
from prfaas_sglang.router.service import RouterConfig, new_service
from prfaas_sglang.router.workers import WorkerFacts, workers_from_topology
from prfaas_sglang.topology import SitePair, load_topology, parse_topology
from prfaas_sglang.wire.blocks import HASH_SCHEME
from prfaas_sglang.wire.telemetry import LinkSample, PeerView


def linear(name: str, s_per_token: float) -> TabulatedPrefill:
    return TabulatedPrefill(name, [{"tokens": 1000, "prefill_s": 1000 * s_per_token, "kv_bytes": 1e6},
                                   {"tokens": 2000, "prefill_s": 2000 * s_per_token, "kv_bytes": 2e6}])


KV = lambda tokens: 1000.0 * tokens  # noqa: E731 - 1 KB of KV per token
EAST = [WorkerState("east-p", "pd", "prefill"), WorkerState("east-d", "pd", "decode", kv_free_tokens=500_000)]
WEST = [WorkerState("west-p", "pd", "prefill"), WorkerState("west-d", "pd", "decode", kv_free_tokens=900_000)]
A, B = [WorkerState("a0", "prfaas", "prefill")], [WorkerState("b0", "prfaas", "prefill")]
FAT = Link(100e9)


def snap(workers, t=10_000, link=FAT, pd_s_per_token=4e-5, prfaas_s_per_token=1e-5, max_ttft_s=None, target=None):
    return ClusterSnapshot(workers, t, BandwidthMode.SCARCE,
                           {"prfaas": linear("fast", prfaas_s_per_token), "pd": linear("slow", pd_s_per_token)},
                           link, KV, max_ttft_s=max_ttft_s, ttft_target_s=target)


def ask(total: int, cached=None) -> RouteInput:
    return RouteInput(total, total + 16, cached or {})


@pytest.mark.parametrize("total, cached, kw", [
    (8_000, {}, {}), (30_000, {}, {}), (30_000, {"east-p": 25_000}, {}),
    (30_000, {}, {"link": Link(1e6)}), (30_000, {}, {"max_ttft_s": 0.1}), (5_000, {}, {"target": 0.0}),
])
def test_on_one_pair_the_fleet_is_the_one_pair_rule(total, cached, kw):
    one = snap(EAST + A, **kw)
    chosen = route_fleet(ask(total, cached), {SitePair("east", "a"): one})
    assert chosen.decision == route(ask(total, cached), one) and chosen.pair == SitePair("east", "a")


def fleet(a_link=FAT, b_link=FAT, a_west=FAT, a_workers=A, b_queue_s=0.0, **kw):
    b = [dataclasses.replace(B[0], queue_s=b_queue_s)]
    return {SitePair("east", "a"): snap(EAST + a_workers, link=a_link, **kw),
            SitePair("east", "b"): snap(EAST + b, link=b_link, **kw),
            SitePair("west", "a"): snap(WEST + a_workers, link=a_west, **kw)}


def test_a_long_prompt_goes_to_the_prfaas_cluster_that_serves_it_first():
    assert route_fleet(ask(8_000), fleet(), "east").decision.cluster == "pd"  # short: local, whatever the links
    chosen = route_fleet(ask(30_000), fleet(b_queue_s=2.0), "east")
    assert chosen.pair == SitePair("east", "a") and chosen.decision.prefill == "a0" and chosen.prefill_site == "a"
    queued_a = route_fleet(ask(30_000), fleet(a_workers=[dataclasses.replace(A[0], queue_s=2.0)]), "east")
    assert queued_a.pair == SitePair("east", "b") and queued_a.decision.decode == "east-d"


def test_a_congested_or_dead_link_moves_only_its_own_traffic():
    backlogged = Link(1e9, backlog_bytes=4e9)  # 32 s of KV queued on a -> east
    moved = route_fleet(ask(30_000), fleet(a_link=backlogged, b_queue_s=1.0), "east")
    assert moved.pair == SitePair("east", "b")  # b's queue costs less than a's link
    dead = fleet(b_queue_s=1.0)
    dead[SitePair("east", "a")] = snap(EAST)  # a -> east black-holed: a's workers out of that pair
    assert route_fleet(ask(30_000), dead, "east").pair == SitePair("east", "b")
    assert route_fleet(ask(30_000), dead, "west").pair == SitePair("west", "a")  # a still serves west
    both_dead = {pair: snap(EAST if pair.pd == "east" else WEST + A) for pair in dead}
    assert route_fleet(ask(30_000), both_dead, "east").decision.prefill == "east-p"  # no link left: local prefill


def test_requests_decode_where_they_entered_and_a_global_entry_takes_the_sooner_cluster():
    assert route_fleet(ask(30_000), fleet(), "west").decision.decode == "west-d"
    with pytest.raises(UnknownEntry):
        route_fleet(ask(30_000), fleet(), "north")
    busy_east = fleet()
    for pair in (SitePair("east", "a"), SitePair("east", "b")):
        s = busy_east[pair]
        busy_east[pair] = dataclasses.replace(s, workers=[dataclasses.replace(w, queue_s=5.0) for w in s.workers])
    assert route_fleet(ask(30_000), busy_east).pair.pd == "west"
    full_west = fleet()
    full_west[SitePair("west", "a")] = snap([WEST[0], dataclasses.replace(WEST[1], kv_free_tokens=10)] + A)
    assert route_fleet(ask(30_000), full_west).pair.pd == "east"  # no decode room in west: east
    with pytest.raises(NoDecodeRoom):
        route_fleet(ask(30_000), full_west, "west")


def test_an_offload_early_rejection_would_refuse_loses_to_local_prefill_it_would_not():
    slow_links = fleet(a_link=Link(1e6), b_link=Link(1e6), max_ttft_s=5.0)  # KV of 30K tokens: 240 s on the wire
    chosen = route_fleet(ask(30_000), slow_links, "east")
    assert chosen.decision.cluster == "pd" and chosen.decision.estimated_ttft_s <= 5.0


# --- the service over a topology of several clusters ----------------------------------------------


def fleet_service(doc_mutate=None):
    topology = load_topology(REPO_ROOT / "launch" / "multi-cluster.yaml")
    records = workers_from_topology(topology)
    for r in records.values():
        r.healthy = True
        r.facts = WorkerFacts("m", 512, r.role, 1_000_000, 64, 131_072, None, HASH_SCHEME, None, None, None)
        r.telemetry_endpoint = f"tcp://{r.host}:5560" if r.cluster == "prfaas" else None
    return new_service(RouterConfig(max_ttft_s=30.0), runtime.pair_models(topology, emulated=False), records), topology


def test_the_service_has_a_pair_per_link_each_planned_on_its_own_link():
    service, topology = fleet_service()
    assert [str(p) for p in service.pairs] == ["prfaas-h200->pd-east", "prfaas-h100->pd-east",
                                               "prfaas-h200->pd-west", "prfaas-h100->pd-west"]
    east_h200 = service.pairs[SitePair("pd-east", "prfaas-h200")]
    assert east_h200.runtime.link_bps == 100e9 and east_h200.runtime.deployment.n_prfaas == 4
    assert service.pairs[SitePair("pd-west", "prfaas-h200")].runtime.link_bps == 25e9
    assert set(service.calibration.describe()["prefill_scale"]) == {"prfaas-h200", "prfaas-h100", "pd-east", "pd-west"}
    status = service.status(0.0)
    assert set(status["pairs"]) == {str(p) for p in service.pairs}
    assert status["workers"]["east-d-0"]["site"] == "pd-east"


def test_the_service_routes_each_entry_to_its_own_decode_and_records_the_link():
    service, _ = fleet_service()
    request = RouteInput(60_000, 60_016, {})
    for entry in ("pd-east", "pd-west"):
        decision = service.decide(request, set(), 0.0, entry)
        assert service.workers[decision.decode].site == entry and decision.cluster == "prfaas"
        lease = service.begin(_engine_request(60_000), decision, 0.0, 0)
        assert service.pairs[decision.pair].backlog_bytes > 0 and lease.prefill_site == decision.pair.prfaas
        service.finish(lease)
        assert service.pairs[decision.pair].backlog_bytes == 0


def test_a_failed_prefill_leg_keeps_a_shared_prfaas_worker_off_that_link_only():
    service, _ = fleet_service()
    request = RouteInput(60_000, 60_016, {})
    west = service.decide(request, set(), 0.0, "pd-west")
    assert west.cluster == "prfaas"
    failed = service.leg_failed(west, "prefill", 0.0)
    assert service.workers[failed].healthy  # it still serves the other links
    after = service.decide(request, set(), 0.1, "pd-west")
    assert after.prefill != failed
    east = service.decide(request, set(), 0.1, "pd-east")
    names_east = {w.name for w in service.snapshot(set(), 0.1, service.pairs[SitePair("pd-east", west.pair.prfaas)]).workers}
    assert failed in names_east and east.cluster == "prfaas"


def test_telemetry_splits_by_the_pd_cluster_its_peers_are_in():
    service, _ = fleet_service()
    h200 = service.workers["prfaas-h200-0"]
    east_peer, west_peer = "10.2.0.20:17000", "10.3.0.20:17000"  # east-d-0's and west-d-0's hosts
    stalled = PeerView(0.0, 8e9, 1, 0, 0, busy_fraction=1.0, capacity_bps=0.0, backlog_bytes=10**9)
    flowing = PeerView(50e9, 50e9, 1, 3, 0, busy_fraction=1.0, capacity_bps=90e9, backlog_bytes=0)
    sample = LinkSample(h200.name, 0.0, 50e9, 1.0, 45e9, 2, peers={east_peer: flowing, west_peer: stalled})
    service.take_telemetry(h200.name, sample, 0.0)
    east = service.pairs[SitePair("pd-east", "prfaas-h200")].link.view(0.1)
    west = service.pairs[SitePair("pd-west", "prfaas-h200")].link.view(0.1)
    assert east.capacity_bps == pytest.approx(90e9) and west.capacity_bps == 0.0 and west.backlog_bytes == 10**9
    assert service.pairs[SitePair("pd-east", "prfaas-h100")].link.view(0.1) is None  # h100's links heard nothing


def test_bad_fleet_topologies_are_refused_by_field():
    import yaml

    doc = yaml.safe_load((REPO_ROOT / "launch" / "multi-cluster.yaml").read_text())
    no_west = dict(doc, links=[link for link in doc["links"] if link["to"] != "pd-west"])
    with pytest.raises(ConfigError, match="clusters.pd-west"):
        parse_topology(no_west)
    twice = dict(doc, links=doc["links"] + [{"from": "pd-east", "to": "prfaas-h200", "bandwidth_gbps": 5}])
    with pytest.raises(ConfigError, match=r"links\[4\]"):
        parse_topology(twice)
    unknown = dict(doc, links=doc["links"] + [{"from": "prfaas-h300", "to": "pd-east", "bandwidth_gbps": 5}])
    with pytest.raises(ConfigError, match=r"links\[4\].from"):
        parse_topology(unknown)


def test_on_a_one_pair_topology_the_pair_model_is_the_topologys():
    topology = load_topology(REPO_ROOT / "launch" / "local-two-cluster.yaml")
    (pair, model), = runtime.pair_models(topology).items()
    whole = runtime.from_topology(topology)
    assert pair == SitePair("pd-a", "prfaas-b") and model.describe() == whole.describe()
    assert model.capacity_rps() == whole.capacity_rps()


def _engine_request(n: int):
    from prfaas_sglang.protocol import EngineRequest

    return EngineRequest("generate", tuple(range(n)), 16, False, "r", None, None)


def test_a_long_term_controller_per_pd_cluster_records_its_own_requests_and_moves_its_own_pairs():
    from prfaas_sglang.router.longterm import LongTermSettings

    service, _ = fleet_service()
    service.start_longterm(LongTermSettings())
    east, west = "pd-east", "pd-west"
    assert list(service.longterm) == [east, west]  # one per PD cluster, planning on every pair of it
    assert all(set(service.longterm[pd].runtime.pairs) == {p for p in service.pairs if p.pd == pd} for pd in (east, west))
    assert service.longterm[east].runtime.n_prefill == 3 and service.longterm[west].runtime.n_prefill == 1
    for entry, n in (("pd-east", 3), ("pd-west", 1)):
        for _ in range(n):
            decision = service.decide(RouteInput(60_000, 60_016, {}), set(), 0.0, entry)
            service.finish(service.begin(_engine_request(60_000), decision, 0.0, 0))
    assert len(service.longterm[east]._routed) == 3 and len(service.longterm[west]._routed) == 1
    samples = service.stage_samples(1.0)
    assert samples[east].completed["pd-decode"] == 3 and samples[west].completed["pd-decode"] == 1
    assert samples[east].instances["pd-prefill"] == 3 and samples[west].instances["pd-decode"] == 2

    calibrated = service.longterm[west].runtime.with_split(2).calibrated({"prfaas": 1.5})
    service.converted("west-d-1", "prefill", 2.0, runtime=calibrated)
    h200_west = SitePair("pd-west", "prfaas-h200")
    assert service.pairs[h200_west].runtime is calibrated.pairs[h200_west]  # the controller's calibrated model
    h100_west = service.pairs[SitePair("pd-west", "prfaas-h100")].runtime
    assert h100_west is calibrated.pairs[SitePair("pd-west", "prfaas-h100")]  # of every pair of its cluster
    assert h100_west.n_prefill == 2 and h100_west.deployment.prfaas.name != calibrated.pairs[h200_west].deployment.prfaas.name
    assert service.longterm[west].runtime.n_prefill == 2 and service.longterm[east].runtime.n_prefill == 3
    assert service.pairs[SitePair("pd-east", "prfaas-h200")].runtime.n_prefill == 3  # the other PD cluster's pairs: untouched
    assert set(service.status(2.0)["long_term"]) == {"pd-east", "pd-west"}
