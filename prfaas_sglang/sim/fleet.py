"""A simulated PrfaaS-PD deployment, or a fleet of several clusters, driven by the product's own
policy objects.

The router here *is* the router's pure core: a :class:`~prfaas_sglang.router.service.RouterService`
built by ``new_service`` from a topology document (``runtime.pair_models``, the one place a
deployment model is built), so every request is placed by ``fleet.route_fleet`` / ``policy.route``
on the same snapshots the live router takes, each link's threshold controller gets the same link
view (a :class:`~prfaas_sglang.wire.telemetry.LinkSample` from that simulated link) and queue
ledgers, the KV index gets the events a worker publishes, and the long-term controllers
(``router.longterm``, one per PD cluster) convert nodes. Only the I/O differs: SimPy events
instead of HTTP, ZMQ and Mooncake. A fleet (``Simulation(topology_doc)``) has a processor-shared
link per PrfaaS -> PD pair and a node timing per cluster (its own accelerator or profile).

One request::

    arrive -> service.decide (NoDecodeRoom: wait in the router, as the live one does, until room
              or ``admission_timeout_s``) -> service.begin -> prefill node (chunked prefill,
              uncached = what that node's cache really holds) -> service.prefill_done ->
              PrfaaS: the shared link carries S_kv(l); PD-P: RDMA, free -> decode node
              (continuous batching) -> service.finish

A conversion (:class:`~prfaas_sglang.router.longterm.Replan`): the chosen nodes are drained
(routed around; they finish what they hold), go down for ``switch_s`` (SGLang 0.5.15: a restart
through the launcher; 0.5.23's ``/pd_role_switch`` rebuilds in place), and come back in the new
role with an empty cache. The router's runtime model and ``t`` move to the new split at once.
"""

from __future__ import annotations

import collections
import zlib
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

import simpy

from prfaas_sglang.engine.mock.timing import EngineTiming, load_timing
from prfaas_sglang.engine.mock.truth import ServiceTruth
from prfaas_sglang.plan.model import OperatingPoint
from prfaas_sglang.plan.workload import MOONCAKE_BLOCK_TOKENS, Workload
from prfaas_sglang.router.calibration import CalibrationSettings
from prfaas_sglang.router.longterm import (
    ClusterSample,
    LongTermController,
    LongTermSettings,
    Replan,
    StageSample,
    pick_nodes,
)
from prfaas_sglang.router.policy import (
    PD,
    PRFAAS,
    BandwidthMode,
    NoDecodeRoom,
    NoHealthyWorker,
    RouteInput,
    refuse_early,
)
from prfaas_sglang.router.service import NotOnePair, RouterConfig, RouterService, new_service
from prfaas_sglang.router.threshold import ControllerSettings
from prfaas_sglang.router.workers import (
    WorkerFacts,
    WorkerLoad,
    WorkerRecord,
    workers_from_topology,
)
from prfaas_sglang.runtime import (
    RuntimeModel,
    ServiceTargets,
    from_topology,
    pair_models,
    service_targets,
)
from prfaas_sglang.sim.nodes import DecodeNode, PrefillNode, SharedLink, SimRequest
from prfaas_sglang.topology import SitePair, parse_topology
from prfaas_sglang.wire.blocks import HASH_SCHEME
from prfaas_sglang.wire.kv_events import BlockRemoved, BlockStored, StateStored
from prfaas_sglang.wire.telemetry import LinkSample

BLOCK = MOONCAKE_BLOCK_TOKENS


@dataclass(frozen=True)
class FleetSpec:
    """Hardware and model: instance counts (8-GPU instances by default), the link, the cost model."""

    n_prfaas: int
    n_prefill: int
    n_decode: int
    link_gbps: float = 100.0
    model: str = "kimi-linear-1t-hybrid"
    accelerators: tuple[str, str] = ("h200x8", "h20x8")
    workload_prior: dict | None = None  # scheduler.workload (None: the case study's log-normal)
    output_tokens: int = 1024  # L_out the planner assumes
    slo_tokens_per_s: float = 40.0
    ttft_slo_s: float = 10.0
    threshold_tokens: float | None = None  # the operator's fixed baseline t; None: the planner's

    @property
    def gpus(self) -> int:
        return 8 * (self.n_prfaas + self.n_prefill + self.n_decode)

    def topology(self) -> dict:
        """The topology document a real deployment of this fleet would have (ports are names here)."""
        ports = iter(range(20_000, 60_000))

        def node(role: str, i: int) -> dict:
            n = {"name": f"{role}-{i}", "role": role, "host": "127.0.0.1", "port": next(ports)}
            if role != "pd-decode":
                n["bootstrap_port"] = next(ports)
            return n

        clusters = {"pd": {"kind": "pd", "accelerator": self.accelerators[1],
                           "nodes": [node("pd-prefill", i) for i in range(self.n_prefill)]
                           + [node("pd-decode", i) for i in range(self.n_decode)]}}
        links = []
        if self.n_prfaas:
            clusters = {"prfaas": {"kind": "prfaas", "accelerator": self.accelerators[0],
                                   "nodes": [node("prfaas", i) for i in range(self.n_prfaas)]}, **clusters}
            links.append({"from": "prfaas", "to": "pd", "bandwidth_gbps": self.link_gbps})
        scheduler = {"output_tokens": self.output_tokens, "slo_tokens_per_s": self.slo_tokens_per_s,
                     "ttft_slo_s": self.ttft_slo_s}
        if self.workload_prior is not None:
            scheduler["workload"] = self.workload_prior
        if self.threshold_tokens is not None:
            scheduler["threshold_tokens"] = self.threshold_tokens
        return {"version": 1, "clusters": clusters, "links": links, "model": {"cost_model": self.model},
                "scheduler": scheduler}

    def runtime(self) -> RuntimeModel:
        """The runtime model of this fleet, built as the router builds it (model units: no emulation)."""
        return from_topology(parse_topology(self.topology(), "simulated fleet"), emulated=False)

    def planner_split(self, workload: Workload | None = None) -> OperatingPoint:
        """The planner's best operating point over every split with at least one PD-P instance
        (on ``workload``, default the fleet's prior)."""
        runtime = self.runtime()
        plans = runtime.plan_splits(workload or runtime.prior)
        return max((p for n, p in plans.items() if n >= 1), key=lambda p: p.lambda_max_rps)


@dataclass(frozen=True)
class SimSettings:
    chunk_tokens: int | None = 8192  # SGLang's --chunked-prefill-size (the emulated engine's default)
    control_interval_s: float = 1.0  # threshold controller ticks (the live router: 0.25 s)
    sample_interval_s: float = 10.0  # time series and long-term samples
    longterm: LongTermSettings | None = None  # None: the split stays fixed
    switch_s: float = 60.0  # a drained node is down this long while it changes role
    # (at_s, gbps) or (at_s, gbps, "prfaas->pd"): a link's capacity changes (two fields: a one-link fleet's link)
    link_schedule: tuple[tuple, ...] = ()
    mode: BandwidthMode = BandwidthMode.SCARCE
    admission_timeout_s: float = 60.0
    threshold: ControllerSettings = field(default_factory=ControllerSettings)
    prefix_cache_tokens: int = 2_097_152  # per prefill node (the emulated engine's --cache-tokens)
    # The router: early rejection's bound and placement by expected TTFT (model seconds; None: off,
    # as the live router's --no-early-rejection / --placement threshold), its online calibration.
    max_ttft_s: float | None = None
    ttft_target_s: float | None = None
    calibration: CalibrationSettings = field(default_factory=CalibrationSettings)
    # The nodes' truth apart from the router's model (engine/mock/truth.py): per cluster kind
    # (prfaas | pd) the mean prefill and decode factors, and the per-request prefill noise.
    prefill_bias: tuple[tuple[str, float], ...] = ()
    decode_bias: float = 1.0
    noise_sigma: float = 0.0
    seed: int = 0
    # A fleet's routing: "global", one router over every pair (ours); "regional", a router per PD cluster
    # over that cluster's pairs only, each keeping its own ledger of the PrfaaS workers they share (a
    # baseline: uncoordinated regions). A request goes to its entry's router.
    routers: str = "global"


class Simulation:
    def __init__(self, fleet: FleetSpec | dict, settings: SimSettings | None = None):
        """``fleet``: a one-pair :class:`FleetSpec`, or the topology document of any fleet (model units:
        its ``emulation:`` section is ignored)."""
        self.settings = settings or SimSettings()
        self.fleet = fleet if isinstance(fleet, FleetSpec) else None
        self.env = simpy.Environment()
        topology = parse_topology(fleet.topology() if isinstance(fleet, FleetSpec) else fleet, "simulated fleet")
        self.topology = topology
        self.models: dict[SitePair, RuntimeModel] = (models := pair_models(topology, emulated=False))
        self.targets: ServiceTargets = service_targets(topology)  # L_out and the SLOs, every pair's
        self.hybrid = any(model.hybrid for model in models.values())  # the served model's prefix reuse stops at states
        self.timing = {}
        for pair, model in models.items():
            for kind, site in ((PD, pair.pd), (PRFAAS, pair.prfaas)):
                if site is not None and site not in self.timing:
                    self.timing[site] = load_timing(model.costs[kind].engine_profile, 1.0, 1.0, int(model.decode.bs_max))
        s = self.settings
        config = RouterConfig(mode=s.mode, admission_timeout_s=s.admission_timeout_s, controller=s.threshold,
                              max_ttft_s=s.max_ttft_s, ttft_target_s=s.ttft_target_s, calibration=s.calibration)
        if s.routers not in ("global", "regional"):
            raise ValueError(f"routers must be global or regional, got {s.routers!r}")
        self.routers: dict[str | None, RouterService] = {}
        if s.routers == "regional":
            for pd in dict.fromkeys(pair.pd for pair in models):
                mine = {pair: m for pair, m in models.items() if pair.pd == pd}
                sites = {pd} | {pair.prfaas for pair in mine}
                records = {n: r for n, r in workers_from_topology(topology).items() if r.site in sites}
                self.routers[pd] = new_service(config, mine, records)
        else:
            self.routers[None] = new_service(config, models, workers_from_topology(topology))
        if s.longterm:  # each router runs a controller per PD cluster it routes for, as the live one does
            for router in self.routers.values():
                router.start_longterm(s.longterm)
        self.links = {pair: SharedLink(self.env, model.link_bps) for pair, model in models.items() if pair.prfaas}
        for change in s.link_schedule:  # a link the fleet does not have: refused now, not mid-run
            if len(change) > 2:
                self._pair_named(change[2])
            else:
                self._only_link()
        self.nodes: dict[str, PrefillNode | DecodeNode] = {}
        self.requests: list[SimRequest] = []
        self.blocked: deque[SimRequest] = deque()
        self.series: list[dict] = []
        self.events: list[tuple[float, str]] = []
        self._retired_busy: collections.Counter = collections.Counter()  # (stage, cluster) -> busy s of retired nodes
        self._completed: collections.Counter = collections.Counter()  # (stage, cluster, decoding PD cluster) -> legs
        self._seq: dict[str, int] = {}
        for record in {n: r for router in self.routers.values() for n, r in router.workers.items()}.values():
            self._bring_up(record, record.role)

    @property
    def runtime(self) -> RuntimeModel:
        """The model of a one-pair simulation; :class:`NotOnePair` on a fleet (each pair's: ``models``)."""
        if len(self.models) != 1:
            raise NotOnePair(f"a fleet of {len(self.models)} pairs has a model per pair (sim.models)")
        return next(iter(self.models.values()))

    @property
    def service(self) -> RouterService:
        """The router (one global router over every pair); regional routers: ``routers``, by PD cluster."""
        if None not in self.routers:
            raise ValueError("regional routers: sim.routers[pd] is each PD cluster's")
        return self.routers[None]

    @property
    def longterm(self) -> dict[str, LongTermController]:
        """Every router's long-term controllers, by PD cluster (empty: the split stays fixed)."""
        return {pd: ctl for router in self.routers.values() for pd, ctl in router.longterm.items()}

    @property
    def gpus(self) -> int:
        """GPUs of every engine node (tp_size, 8 where the topology says none)."""
        return sum(n.tp_size or 8 for n in self.topology.nodes if n.cluster in self.timing)

    # --- nodes ---------------------------------------------------------------------------

    def _timing(self, record: WorkerRecord) -> EngineTiming:
        return self.timing[record.site]

    def _holding(self, name: str) -> list[RouterService]:
        """The routers that know worker ``name`` (regional routers share the PrfaaS workers)."""
        return [router for router in self.routers.values() if name in router.workers]

    def _bring_up(self, record: WorkerRecord, role: str) -> None:
        timing = self._timing(record)
        s = self.settings
        if role == "prefill":
            truth = ServiceTruth(dict(s.prefill_bias).get(record.cluster, 1.0), s.decode_bias, s.noise_sigma,
                                 s.seed * 1_000_003 + zlib.crc32(record.name.encode()))
            node = PrefillNode(self.env, record.name, record.cluster, timing, self.settings.chunk_tokens,
                               self._prefill_done, self.settings.prefix_cache_tokens // BLOCK, truth)
            pool = None
        else:
            node = DecodeNode(self.env, record.name, timing, timing.max_batch, timing.kv_pool_tokens, self._decode_done,
                              s.decode_bias)
            pool = timing.kv_pool_tokens
        self.nodes[record.name] = node
        for router in self._holding(record.name):  # each router's own record of it
            mine = router.workers[record.name]
            if role == "prefill":
                router.index.add_worker(mine.name, mine.cluster, BLOCK)
            else:
                router.index.remove_worker(mine.name)
            mine.role = role
            mine.facts = WorkerFacts("sim", BLOCK, role, pool, timing.max_batch, None, None, HASH_SCHEME, None, None, None)
            mine.load = WorkerLoad(0, 0, 0, pool)
            mine.healthy, mine.draining = True, False
        self._seq[record.name] = 0

    def stage_of(self, name: str) -> str:
        router = self._holding(name)[0]
        return router.stage_of(router.workers[name])

    def _router(self, req: SimRequest) -> RouterService:
        return self.routers[req.entry] if None not in self.routers else self.routers[None]

    # --- requests ------------------------------------------------------------------------

    def _arrivals(self, requests: Iterable[SimRequest]):
        for req in requests:
            if req.arrival_s > self.env.now:
                yield self.env.timeout(req.arrival_s - self.env.now)
            self.requests.append(req)
            if not self._dispatch(req):
                self.blocked.append(req)
                self._router(req).start_waiting(req.entry)  # what the long-term controllers see queue

    def _dispatch(self, req: SimRequest) -> bool:
        """Route and start ``req``; False when it must wait for decode room (the caller queues it)."""
        blocks = req.hash_ids[:(req.input_tokens - 1) // BLOCK]
        router = self._router(req)
        request = RouteInput(req.input_tokens, req.kv_tokens,
                             router.index.match(req.input_ids, {BLOCK: blocks}).by_worker if blocks else {})
        try:
            decision = router.decide(request, set(), self.env.now, req.entry)
        except NoDecodeRoom:
            return False
        except NoHealthyWorker as err:
            req.rejected = f"no worker: {err}"
            return True
        if refuse_early(decision, router.config.max_ttft_s):
            req.rejected = f"estimated TTFT {decision.estimated_ttft_s:.1f} s"
            return True
        req.lease = router.begin(req, decision, self.env.now, 0)
        req.dispatched_s = self.env.now
        node = self.nodes[decision.prefill]
        held = node.cache.match(blocks, self.hybrid) * BLOCK
        req.cluster, req.prefill_node, req.decode_node = decision.cluster, decision.prefill, decision.decode
        req.uncached_tokens = req.input_tokens - min(held, req.input_tokens - 1)
        node.submit(req, req.uncached_tokens)
        return True

    def _prefill_done(self, node: PrefillNode, req: SimRequest) -> None:
        req.prefill_done_s = self.env.now
        self._completed["prfaas" if node.cluster == PRFAAS else "pd-prefill", req.lease.prefill_site, req.lease.pair.pd] += 1
        self._publish(node, req)
        if node.cluster == PRFAAS:  # the prefill leg ends when its KV has shipped, as SGLang's (and the router sees)
            pair = req.lease.pair
            req.kv_bytes = self._router(req).pairs[pair].runtime.kv_bytes(req.input_tokens)
            self.links[pair].send(req, req.kv_bytes, self._kv_arrived)
        else:
            self._router(req).prefill_done(req.lease)
            self._kv_arrived(req)

    def _publish(self, node: PrefillNode, req: SimRequest) -> None:
        """The KV events a worker publishes for this prompt's blocks (prefix cache on)."""
        blocks = req.hash_ids[:req.input_tokens // BLOCK]
        if not blocks:
            return
        new, parent, evicted = node.cache.insert(blocks)
        events = []
        if evicted:
            events.append(BlockRemoved(block_hashes=evicted))
        if new:
            events.append(BlockStored(block_hashes=new, parent_block_hash=parent, token_ids=[], block_size=BLOCK,
                                      lora_id=None))
        states = [StateStored(block_hash=blocks[-1], num_tokens=len(blocks) * BLOCK)] if self.hybrid else None
        self._seq[node.name] += 1
        for router in self._holding(node.name):  # every router subscribes to the worker's events
            router.index.apply(node.name, self._seq[node.name], events, states)

    def _kv_arrived(self, req: SimRequest) -> None:
        if req.cluster == PRFAAS:
            self._router(req).prefill_done(req.lease)
        req.kv_arrived_s = self.env.now
        self.nodes[req.decode_node].arrive(req)

    def _decode_done(self, node: DecodeNode, req: SimRequest) -> None:
        self._completed["pd-decode", req.lease.pair.pd, req.lease.pair.pd] += 1
        if req.first_token_s is not None:  # the router learns from it at the end (the live one: at the first token)
            self._router(req).first_token(req.lease, req.first_token_s - req.dispatched_s, self.env.now)
        self._router(req).finish(req.lease)
        self._retry_blocked()

    def _retry_blocked(self) -> None:
        while self.blocked:
            req = self.blocked[0]
            if self.env.now - req.arrival_s > self.settings.admission_timeout_s:
                req.rejected = "no decode room within the admission timeout"
            elif not self._dispatch(req):
                return
            self.blocked.popleft()
            self._router(req).stop_waiting(req.entry)

    # --- control loops ---------------------------------------------------------------------

    def _control(self):
        interval = self.settings.control_interval_s
        last = {pair: (0.0, 0.0, 0.0) for pair in self.links}  # delivered bytes, busy s, offered bytes at the previous tick
        while True:
            yield self.env.timeout(interval)
            for pair, link in self.links.items():
                link._advance()
                delivered, busy, offered = (link.delivered_bytes - last[pair][0], link.busy_s - last[pair][1],
                                            link.offered_bytes - last[pair][2])
                last[pair] = (link.delivered_bytes, link.busy_s, link.offered_bytes)
                for router in (r for r in self.routers.values() if pair in r.pairs):
                    prfaas = [n for n, r in router.workers.items() if r.site == pair.prfaas and r.role == "prefill"]
                    if prfaas:  # the link's telemetry, as its PrfaaS workers' samples split by peer give it
                        sample = LinkSample(prfaas[0], self.env.now, 8 * delivered / interval, min(busy / interval, 1.0),
                                            8 * delivered / busy if busy > 0.05 * interval and delivered > 0 else None,
                                            len(link.flows), 0, interval, 8 * offered / interval, int(link.backlog_bytes()))
                        router.pairs[pair].link.update(prfaas[0], sample, self.env.now)
            for router in self.routers.values():
                router.control_tick(self.env.now)
            self._retry_blocked()

    def _capacity_changes(self):
        for change in sorted(self.settings.link_schedule, key=lambda c: c[0]):
            at_s, gbps = change[0], change[1]
            link = self.links[self._pair_named(change[2]) if len(change) > 2 else self._only_link()]
            if at_s > self.env.now:
                yield self.env.timeout(at_s - self.env.now)
            link.set_capacity(gbps * 1e9)
            named = f"link {change[2]}" if len(change) > 2 else "link"
            self.events.append((self.env.now, f"{named} capacity {gbps:g} Gbit/s"))

    def _only_link(self) -> SitePair:
        """The link of a fleet that has one (a capacity change that names none is its)."""
        if len(self.links) != 1:
            raise ValueError(f"the fleet has {len(self.links)} links: a link change names one (AT_S:GBPS:PRFAAS->PD)")
        return next(iter(self.links))

    def _pair_named(self, name: str) -> SitePair:
        pair = next((p for p in self.links if str(p) == name), None)
        if pair is None:
            raise ValueError(f"no link {name!r} (links: {', '.join(str(p) for p in self.links)})")
        return pair

    def _stage_totals(self) -> tuple[collections.Counter, collections.Counter, collections.Counter]:
        """Busy seconds so far, queued and in-service nodes now, each by (stage, cluster)."""
        busy, queued, instances = collections.Counter(self._retired_busy), collections.Counter(), collections.Counter()
        for name, node in self.nodes.items():
            record = self._holding(name)[0].workers[name]
            key = (self.stage_of(name), record.site)
            if isinstance(node, DecodeNode):
                node._advance()
                queued[key] += len(node.waiting)
            else:
                queued[key] += node.queue.waiting_jobs
            busy[key] += node.busy_s
            if record.healthy and not record.draining:
                instances[key] += 1
        for router in self.routers.values():  # requests waiting in the router for decode room
            for pd, n in router.waiting_at().items():
                queued["pd-decode", pd] += n
        return busy, queued, instances

    def _sampler(self):
        interval = self.settings.sample_interval_s
        last_busy, last_done = self._stage_totals()[0], collections.Counter(self._completed)
        while True:
            yield self.env.timeout(interval)
            busy, queued, instances = self._stage_totals()
            sample = ClusterSample(interval, dict(self._completed - last_done), {k: busy[k] - last_busy[k] for k in busy},
                                   queued, instances)
            last_busy, last_done = busy, collections.Counter(self._completed)
            self._record_series(sample.totals())
            for router in self.routers.values():
                for pd, replan in router.observe_longterm(self.env.now, router.pd_views(sample)).items():
                    self._apply(router, pd, replan)

    def _record_series(self, sample: StageSample) -> None:
        routed = collections.Counter()
        for router in self.routers.values():
            routed.update(router.counters.routed)
        total = sum(routed.values())
        workers = {n: r for router in self.routers.values() for n, r in router.workers.items()}
        pairs = [ps for router in self.routers.values() for ps in router.pairs.values()]
        links = {str(ps.pair): {"threshold_tokens": ps.controller.threshold_tokens,
                                "capacity_est_gbps": ps.controller.capacity_est_bps / 1e9,
                                "link_capacity_gbps": self.links[ps.pair].capacity_bps / 1e9 if ps.pair in self.links else None,
                                "egress_gbps": view.egress_bps / 1e9 if (view := ps.link.view(self.env.now)) is not None else 0.0,
                                "routed": dict(ps.routed)} for ps in pairs}
        one = {}  # a one-pair fleet's link, at the top as well
        if len(pairs) == 1:
            only = links[str(pairs[0].pair)]
            one = {"threshold_tokens": only["threshold_tokens"], "capacity_est_gbps": only["capacity_est_gbps"],
                   "link_capacity_gbps": only["link_capacity_gbps"] or pairs[0].runtime.link_bps / 1e9}
        self.series.append({
            "t_s": self.env.now,
            "n_prefill": sum(1 for r in workers.values() if r.cluster == PD and r.role == "prefill"),
            "n_decode": sum(1 for r in workers.values() if r.role == "decode"),
            "offload_fraction": routed.get(PRFAAS, 0) / total if total else 0.0,
            "egress_gbps": sum(link["egress_gbps"] for link in links.values()),  # every link's
            **one,
            "links": links,
            "busy": {k: (sample.busy_s[k] / (sample.interval_s * sample.instances[k]) if sample.instances[k] else 0.0)
                     for k in sample.busy_s},
            "queued": dict(sample.queued),
            "completed": sum(sample.completed.get(k, 0) for k in ("pd-decode",)),
        })

    # --- conversions ---------------------------------------------------------------------

    def _apply(self, router: RouterService, pd: str, replan: Replan) -> None:
        """Drain the chosen nodes of PD cluster ``pd`` toward their new role; the router's models of that
        cluster's pairs move to the new split at once (the controller's calibrated model of each)."""
        from_role, to_role = ("decode", "prefill") if replan.convert > 0 else ("prefill", "decode")
        candidates = [(name, self._load(name)) for name, r in router.workers.items()
                      if r.cluster == PD and r.site == pd and r.role == from_role and r.healthy and not r.draining]
        chosen = pick_nodes(candidates, abs(replan.convert))
        for name in chosen:
            router.workers[name].draining = True
            self.env.process(self._convert(name, to_role))
        router.follow_split(pd, replan.n_prefill, self.env.now, replan.runtime, replan.reason)
        where = f" of {pd}" if len(router.pairs) > 1 else ""
        pairs = router.pairs_of(pd)
        t = (f"{pairs[0].controller.threshold_tokens:.0f}" if len(pairs) == 1 else
             ", ".join(f"{ps.controller.threshold_tokens:.0f} on {ps.pair}" for ps in pairs))
        self.events.append((self.env.now, f"convert {', '.join(chosen)}{where} to {to_role}; t -> {t} ({replan.reason})"))

    def _load(self, name: str) -> float:
        node = self.nodes[name]
        if isinstance(node, DecodeNode):
            return len(node.running) + len(node.waiting) + self._holding(name)[0].workers[name].reserved_requests
        return node.queue.remaining_tokens

    def _convert(self, name: str, role: str):
        record = self._holding(name)[0].workers[name]
        while True:
            node = self.nodes[name]
            leases_open = record.reserved_requests if record.role == "decode" else 0
            if node.idle and leases_open == 0:
                break
            yield self.env.timeout(1.0)
        node = self.nodes[name]
        node._advance() if isinstance(node, DecodeNode) else None
        self._retired_busy[self.stage_of(name), record.site] += node.busy_s
        node.retired = True
        if not node._wake.triggered:
            node._wake.succeed()
        del self.nodes[name]
        record.healthy = False
        for router in self._holding(name):
            router.index.remove_worker(name)
        yield self.env.timeout(self.settings.switch_s)
        self._bring_up(record, role)
        self.events.append((self.env.now, f"{name} serves as {role}"))

    # --- run -----------------------------------------------------------------------------

    def run(self, requests: Iterable[SimRequest], until_s: float) -> None:
        self.env.process(self._arrivals(requests))
        self.env.process(self._control())
        self.env.process(self._sampler())
        if self.settings.link_schedule:
            self.env.process(self._capacity_changes())
        self.env.run(until=until_s)

