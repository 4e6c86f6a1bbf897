"""The router's state and decisions, without I/O: the HTTP front end and its loops call in with ``now_s``.

One request, top to bottom (``server.dispatch``, the HTTP handler, drives it)::

    ids      = tokenizer(body)                   protocol.parse_request (SGLang's paths)
    check    = fits the context and some decode pool, or 400 now
    decision = decide(route_input(ids))          KvIndex.match (once per attempt) -> fleet.route_fleet(RouteInput,
                                                 a snapshot per pair) -> policy.route in each pair
                                                 NoDecodeRoom: the caller waits for room (start_waiting
                                                 at its entry), then 503/429
    lease    = begin(decision)                   ledgers in: prefill seconds, decode tokens
    ...legs run...
    prefill_done(lease)                          prefill seconds out (the queue signal)
    finish(lease)                                decode tokens out

Every ``control_interval_s`` the loop calls :meth:`control_tick`: each link's view
(telemetry) and queues (ledgers) go to that link's threshold controller.

The service holds a :class:`PairState` per pair of the topology (``Topology.pairs``: a PD cluster
and a PrfaaS cluster linked to it): the pair's one-pair model, its link's controller, telemetry
and KV backlog. A one-pair deployment has one; a fleet has one per link, and the global scheduler
(``router/fleet.py``) chooses among them per request. Workers belong to a *site* (their topology
cluster); the calibration learns each site's scale. Nothing here stands for "the" pair: every method
names its pair or its PD cluster, and what only a one-pair deployment has (``/status``'s top-level
threshold, link and model) is a view of :meth:`RouterService.only_pair`. The long-term controller runs
per PD cluster, on the model of all its pairs (``runtime.PdClusterModel``).
"""

from __future__ import annotations

import collections
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from prfaas_sglang.kvindex.index import KvIndex
from prfaas_sglang.plan.overlap import STREAM_GROUPS
from prfaas_sglang.plan.profiles import ScaledPrefill
from prfaas_sglang.protocol import BadRequest, EngineRequest
from prfaas_sglang.router.calibration import CalibrationSettings, OnlineCalibration
from prfaas_sglang.router.fleet import route_fleet
from prfaas_sglang.router.link import LinkAggregator, link_share
from prfaas_sglang.router.longterm import (
    ClusterSample,
    LongTermController,
    LongTermSettings,
    Replan,
    StageMeter,
    StageSample,
)
from prfaas_sglang.router.metrics import GaugeSample, RouterCounters
from prfaas_sglang.router.policy import (
    PD,
    PRFAAS,
    BandwidthMode,
    ClusterSnapshot,
    Link,
    RouteDecision,
    RouteInput,
    checkpoint_at,
    mode_from_link,
)
from prfaas_sglang.router.threshold import ControllerSettings, QueueView, ThresholdController
from prfaas_sglang.router.workers import WorkerFacts, WorkerRecord, facts_problem
from prfaas_sglang.runtime import PdClusterModel, RuntimeModel, pd_cluster_models
from prfaas_sglang.topology import Emulation, SitePair
from prfaas_sglang.wire.blocks import PageIdMemo
from prfaas_sglang.wire.telemetry import LinkSample


class NotOnePair(RuntimeError):
    """Asked for the only pair of a deployment that has several (a fleet): name the pair instead."""


MIN_BODY_BYTES = 4 << 20
MAX_BODY_BYTES = 64 << 20  # the HTTP server's own cap, whatever the context
BODY_BYTES_PER_TOKEN = 64  # an id is at most 11 bytes of JSON; a token of text rarely 16 chars, 6 bytes each escaped


@dataclass(frozen=True)
class RouterConfig:
    mode: BandwidthMode = BandwidthMode.SCARCE
    auto_mode: bool = False  # --bandwidth-mode auto: each pair's mode from its link's measured capacity (mode_from_link)
    phase_timeout_s: float = 600.0
    health_interval_s: float = 2.0
    # SGLang's /health runs a one-token generate and answers on a 1 s poll once the scheduler has
    # answered anything, so a busy worker takes a forward plus up to a second: a timeout this long,
    # and this many in a row, before a worker that answers nothing is taken out (a refusal, a non-200
    # answer or a failed leg takes it out at once)
    health_timeout_s: float = 5.0
    health_misses_to_down: int = 2
    load_interval_s: float = 0.5
    control_interval_s: float = 0.25
    telemetry_stale_s: float = 2.0
    max_ttft_s: float | None = None  # early rejection: refuse when the best route's estimate exceeds it
    # Placement by expected TTFT (policy.route): a request whose rule-chosen cluster predicts a TTFT beyond
    # this goes to the other cluster when that one's prediction is lower; None: the paper's rule alone.
    ttft_target_s: float | None = None
    remote_queue_cap: int | None = None  # conditional placement (policy.ClusterSnapshot): the Dynamo-like baseline
    calibration: CalibrationSettings = field(default_factory=CalibrationSettings)
    # Re-solve t when a calibrated prefill scale moves this far (relative) from the one t was solved with.
    replan_on_calibration: float = 0.15
    admission_timeout_s: float = 60.0  # how long a request may wait in the router for decode room
    # A worker converted to prefill stays out of routing this long: a decode notices that a prefill rebuilt
    # its KV manager at its next heartbeat (SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL, 5 s by default; hook
    # decode-peer-rebootstrap), and until then it would send that prefill's requests to the old endpoint.
    prefill_rejoin_s: float = 6.0
    max_waiting: int = 1024  # requests waiting for decode room; more are refused at once (429)
    served_models: frozenset[str] = frozenset()  # empty: the workers' name(s)
    threshold_tokens: float | None = None  # the operator's baseline t (overrides the topology's)
    # Moving a cached prefix across clusters (abundant mode): "auto" where every prefill worker can
    # import one, the cost model deciding; "off"; "always" / "never" move whenever possible / never
    # (benchmarks and ablations: the same routing, the move forced either way).
    cache_transfer: str = "auto"
    # Hybrid models: ask the prefill worker for a state checkpoint at the end of a prefix other
    # requests computed (policy.checkpoint_at) when it adds at least this many tokens of reuse; None: never.
    checkpoint_min_tokens: int | None = 1024
    # A decode worker whose own cache holds the prompt's prefix (SGLang's decode radix cache, its
    # events in the index) wins while its free KV is at least (1 - this) of the roomiest's; None: off.
    decode_affinity_slack: float | None = 0.1
    # The KV index's page-id memo (block ids of prompts already hashed; what page size 1 needs): its
    # memory bound, in bytes. 0: nothing kept, every prompt hashed afresh.
    kv_memo_bytes: int = 64 << 20
    controller: ControllerSettings = field(default_factory=ControllerSettings)


@dataclass
class PairState:
    """One pair's share of the router: its one-pair model (that link, those two clusters), its link's
    threshold controller and telemetry, and the KV routed toward its link and not yet delivered."""

    pair: SitePair
    runtime: RuntimeModel
    controller: ThresholdController
    link: LinkAggregator
    backlog_bytes: float = 0.0
    planned_scales: dict[str, float] = field(default_factory=lambda: {PRFAAS: 1.0, PD: 1.0})  # t was solved with these
    routed: collections.Counter = field(default_factory=collections.Counter)  # cluster kind -> requests
    suspended: dict[str, float] = field(default_factory=dict)  # worker -> until when a failed leg keeps it off this link
    auto_mode: tuple[float, BandwidthMode] | None = None  # (the capacity estimate it was chosen at, the mode)

    def mode(self, config: RouterConfig) -> BandwidthMode:
        """The mode the policy routes this pair in: the configured one, or (``auto``) the one its link's measured
        capacity gives, chosen again whenever the estimate changes."""
        if not config.auto_mode:
            return config.mode
        capacity_bps = self.controller.capacity_est_bps
        if self.auto_mode is None or self.auto_mode[0] != capacity_bps:
            utilization = self.runtime.operating_point(capacity_bps).egress_utilization
            self.auto_mode = (capacity_bps, mode_from_link(utilization))
        return self.auto_mode[1]

    def site(self, kind: str) -> str | None:
        """The pair's cluster of ``kind`` (prfaas | pd)."""
        return self.pair.prfaas if kind == PRFAAS else self.pair.pd

    def holds(self, worker: WorkerRecord) -> bool:
        return worker.site in (self.pair.pd, self.pair.prfaas)


def new_pair(pair: SitePair, runtime: RuntimeModel, config: RouterConfig, stale_after_s: float) -> PairState:
    """A pair's state with its model's controller (the operator's baseline: ``config``'s, else the topology's)."""
    baseline = config.threshold_tokens if config.threshold_tokens is not None else runtime.operator_threshold_tokens
    controller = ThresholdController(runtime.research, runtime.prior, runtime.link_bps, runtime.step_tokens, baseline,
                                     config.controller)
    return PairState(pair, runtime, controller, LinkAggregator(stale_after_s))


@dataclass
class Lease:
    """What one dispatched request holds in the ledgers until it ends."""

    rid: str
    decision: RouteDecision
    pair: SitePair  # the pair it was routed in (its link holds link_bytes; its PD cluster decodes it)
    prefill_site: str  # the cluster that prefills it (whose calibration its first token teaches)
    decode_tokens: int
    decode_ticket: int  # the decode worker's reservation (WorkerRecord.reserve)
    prefill_open: bool = True
    decode_open: bool = True
    prefill_model_s: float = 0.0  # its prefill in the ledger: the model's seconds before calibration
    link_bytes: float = 0.0  # its KV in the link's ledger (PrfaaS legs), until the prefill leg ends
    compute_model_s: float = 0.0  # queue + prefill at dispatch, before calibration (what calibration compares)
    first_token_seen: bool = False

    @property
    def link_s(self) -> float:
        """Of the predicted TTFT, the part on the link (KV shipped, a cache moved): not calibrated."""
        d = self.decision
        return max(d.estimated_ttft_s - d.estimated_queue_s - d.estimated_prefill_s, 0.0)


class RouterService:
    def __init__(self, config: RouterConfig, pairs: dict[SitePair, PairState], workers: dict[str, WorkerRecord],
                 index: KvIndex, tokenizer=None, emulation_spec: Emulation | None = None):
        if not pairs:
            raise ValueError("a router needs at least one pair")
        self.config, self.pairs, self.workers = config, pairs, workers
        self.emulation_spec = emulation_spec  # the topology's emulation: section, what emulated workers must match
        self.index, self.tokenizer = index, tokenizer
        self.counters = RouterCounters()
        self.recent: collections.deque = collections.deque(maxlen=50)
        self.waiting_by_entry: collections.Counter = collections.Counter()  # entry (None: any) -> requests waiting for decode room
        # The long-term scheduler, when it runs (--long-term): one controller per PD cluster (start_longterm).
        self.longterm: dict[str, LongTermController] = {}
        self.stage_meter = StageMeter()
        self.calibration = OnlineCalibration(config.calibration, self.site_kinds())

    # --- pairs ------------------------------------------------------------------------

    def site_kinds(self) -> dict[str, str]:
        """Every cluster of the pairs -> its kind (prfaas | pd)."""
        out = {}
        for pair in self.pairs:
            out[pair.pd] = PD
            if pair.prfaas is not None:
                out[pair.prfaas] = PRFAAS
        return out

    def only_pair(self) -> PairState:
        """The pair of a one-pair deployment; :class:`NotOnePair` on a fleet (whose callers name a pair)."""
        if len(self.pairs) != 1:
            raise NotOnePair(f"this deployment has {len(self.pairs)} pairs ({', '.join(map(str, self.pairs))}); name one")
        return next(iter(self.pairs.values()))

    def pairs_of(self, pd: str) -> list[PairState]:
        """The pairs of PD cluster ``pd`` (each PrfaaS cluster linked to it; a homogeneous one: its own)."""
        return [ps for ps in self.pairs.values() if ps.pair.pd == pd]

    def pd_sites(self) -> list[str]:
        """The PD clusters, in the pairs' order."""
        return list(dict.fromkeys(pair.pd for pair in self.pairs))

    @property
    def link_backlog_bytes(self) -> float:
        """KV of open PrfaaS legs, every link together: routed toward a link, not yet delivered."""
        return sum(ps.backlog_bytes for ps in self.pairs.values())

    def take_telemetry(self, worker: str, sample: LinkSample, now_s: float, wall_s: float | None = None) -> None:
        """A link sample from PrfaaS worker ``worker``: each of its site's pairs takes the share of it that
        crossed that pair's link (the transfers to that PD cluster's decode workers, by host)."""
        record = self.workers.get(worker)
        pairs = [ps for ps in self.pairs.values() if record is not None and ps.pair.prfaas == record.site]
        for ps in pairs:
            share = sample if len(pairs) == 1 else link_share(sample, self._peer_in(ps.pair.pd))
            ps.link.update(worker, share, now_s, wall_s)

    def _peer_in(self, pd_site: str):
        hosts = {w.host for w in self.workers.values() if w.site == pd_site and w.role == "decode"}
        return lambda peer: peer.rsplit(":", 1)[0] in hosts

    def forget_worker(self, name: str) -> None:
        """A worker left: its telemetry leaves every link's view."""
        for ps in self.pairs.values():
            ps.link.forget(name)

    # --- names ----------------------------------------------------------------------

    def model_names(self) -> list[str]:
        """``--served-model-name``, else what the adopted workers report (the first such name)."""
        if self.config.served_models:
            return sorted(self.config.served_models)
        reported = next((w.facts.served_model_name for w in self.workers.values()
                         if w.facts is not None and w.facts.served_model_name), None)
        return [reported or "default"]

    def facts_problem(self, worker: WorkerRecord, facts: WorkerFacts) -> str | None:
        """Why ``facts`` cannot be right for ``worker`` (None: they can): ``workers.facts_problem`` against its
        peers, the topology's emulation and the cost model of every pair that holds its cluster."""
        return facts_problem(worker, facts, list(self.workers.values()), self.emulation_spec,
                             {pair: ps.runtime.state for pair, ps in self.pairs.items()})

    def check_model(self, model: str | None) -> None:
        """404 for a model this deployment does not serve (no model field: accepted)."""
        if model is not None and model not in self.model_names():
            raise BadRequest(404, f"model {model!r} not found (served: {', '.join(self.model_names())})")

    # --- per request ----------------------------------------------------------------

    def max_body_bytes(self) -> int:
        """The largest request body accepted: ``BODY_BYTES_PER_TOKEN`` per token of the largest
        context a worker reports (a prompt of that many tokens, as ids or as JSON-escaped text,
        fits easily), at least ``MIN_BODY_BYTES``; ``MAX_BODY_BYTES`` before any worker reported."""
        contexts = self._contexts()
        if not contexts:
            return MAX_BODY_BYTES
        return min(MAX_BODY_BYTES, max(MIN_BODY_BYTES, BODY_BYTES_PER_TOKEN * max(contexts)))

    def _contexts(self) -> list[int]:
        return [w.facts.context_length for w in self.workers.values() if w.facts and w.facts.context_length]

    def context_tokens(self) -> int | None:
        """The smallest context length a worker reports (what every route can take); None before any."""
        contexts = self._contexts()
        return min(contexts) if contexts else None

    def check_fits(self, req: EngineRequest) -> None:
        """400 now for a request no worker could ever take (the context, the largest decode pool)."""
        context = self.context_tokens()
        if context is not None and req.kv_tokens > context:
            raise BadRequest(400, f"prompt ({len(req.input_ids)}) + max_new_tokens ({req.max_new_tokens}) = "
                                  f"{req.kv_tokens} exceeds the context length {context}")
        pools = [w.facts.max_total_tokens for w in self.workers.values()
                 if w.role == "decode" and w.facts and w.facts.max_total_tokens]
        if pools and req.kv_tokens > max(pools):
            raise BadRequest(400, f"prompt + max_new_tokens ({req.kv_tokens}) exceeds every decode worker's KV pool "
                                  f"(largest: {max(pools)} tokens)")

    def link_down(self, now_s: float, ps: PairState | None = None) -> frozenset[str]:
        """PrfaaS workers whose telemetry went silent on ``ps``'s link (every link: None) while they had work
        in flight (the link to them is presumed down until they are heard again): routed around."""
        down: set[str] = set()
        for pair_state in [ps] if ps is not None else self.pairs.values():
            for w in self.workers.values():
                if w.site == pair_state.pair.prfaas and w.telemetry_endpoint:
                    pair_state.link.note_silence(w.name, now_s, busy=w.outstanding_prefill_s > 0)
            down |= pair_state.link.down()
        return frozenset(down)

    def prefill_cost(self, ps: PairState, kind: str):
        """``T_prefill`` / ``S_kv`` of the pair's cluster of ``kind`` as the router predicts it now: the model, calibrated."""
        site = ps.site(kind)
        profile = ps.runtime.prefill_cost(kind)
        if site is None:
            return profile
        scale, offset_s = self.calibration.prefill_scale(site), self.calibration.prefill_offset_s(site)
        return profile if scale == 1.0 and offset_s == 0.0 else ScaledPrefill(profile, scale, offset_s=offset_s)

    def _worker_state(self, w: WorkerRecord):
        """The worker as the policy sees it: its ledger's queue in calibrated seconds."""
        state = w.snapshot()
        scale = self.calibration.prefill_scale(w.site) if w.role == "prefill" else 1.0
        return state if scale == 1.0 else replace(state, queue_s=state.queue_s * scale)

    def snapshot(self, exclude: set[str], now_s: float, ps: PairState) -> ClusterSnapshot:
        """What the policy sees of pair ``ps``: its workers, its link, its threshold."""
        view = ps.link.view(now_s)
        link = Link(ps.controller.capacity_est_bps, view.egress_bps if view else 0.0, 0.0, ps.backlog_bytes)
        exclude = exclude | self.link_down(now_s, ps) | {w for w, until in ps.suspended.items() if until > now_s}
        return ClusterSnapshot(
            workers=[self._worker_state(w) for w in self.workers.values() if ps.holds(w) and w.name not in exclude],
            threshold_tokens=ps.controller.threshold_tokens, mode=ps.mode(self.config),
            prefill_cost={PRFAAS: self.prefill_cost(ps, PRFAAS), PD: self.prefill_cost(ps, PD)},
            link=link, kv_bytes=ps.runtime.kv_bytes, transfer_supported=self.transfer_supported(),
            transfer_override={"always": True, "never": False}.get(self.config.cache_transfer),
            probe_budget_bytes=ps.controller.probe_budget_bytes(now_s), max_ttft_s=self.config.max_ttft_s,
            ttft_target_s=self.config.ttft_target_s, remote_queue_cap=self.config.remote_queue_cap,
            decode_affinity_slack=self.config.decode_affinity_slack,
            kv_stream_groups=STREAM_GROUPS if ps.runtime.layerwise else None)

    def transfer_supported(self) -> bool:
        """Whether a cached prefix can move: not turned off, and every prefill worker serves the moves
        (the emulated engine; an SGLang prefill server with the cache-move hooks and one scheduler)."""
        prefills = [w for w in self.workers.values() if w.role == "prefill"]
        return (self.config.cache_transfer != "off" and bool(prefills)
                and all(w.facts is not None and w.facts.cache_import for w in prefills))

    def route_input(self, req: EngineRequest) -> RouteInput:
        """The request as the policy sees it: its lengths and the KV index's prefix match (hashes the prompt)."""
        match = self.index.match(req.input_ids)
        return RouteInput(len(req.input_ids), req.kv_tokens, match.by_worker, match.shared_tokens, match.held_by_worker)

    def decide(self, request: RouteInput, exclude: set[str], now_s: float, entry: str | None = None) -> RouteDecision:
        """Raises ``NoHealthyWorker`` / ``NoDecodeRoom`` (policy) when nothing can take it now, and
        ``fleet.UnknownEntry`` for an ``entry`` (the PD cluster the request entered at; None: any) that
        is none of the fleet's. Cheap: a request waiting for decode room calls it again on every
        wake-up with the same ``request``. The decision names its pair (``pair``). For a hybrid
        model, it may ask for a state checkpoint (``checkpoint_tokens``)."""
        snapshots = {pair: self.snapshot(exclude, now_s, ps) for pair, ps in self.pairs.items()
                     if entry is None or pair.pd == entry}
        chosen = route_fleet(request, snapshots, entry)
        decision = replace(chosen.decision, pair=chosen.pair)
        min_tokens = self.config.checkpoint_min_tokens
        if min_tokens is not None and self.index.hybrid:
            at = checkpoint_at(request.total_tokens, request.shared_tokens, decision.cached_tokens, min_tokens)
            if at is not None:
                decision = replace(decision, checkpoint_tokens=at)
        return decision

    def begin(self, req: EngineRequest, decision: RouteDecision, now_s: float, attempt: int) -> Lease:
        """Dispatch ``decision`` (one of :meth:`decide`'s, which name their pair): its work enters the ledgers of
        its workers, its pair's link and routed counts, and (first attempt) the controllers of its PD cluster."""
        if decision.pair not in self.pairs:
            raise ValueError(f"a decision of pair {decision.pair} (decide() names one of {', '.join(map(str, self.pairs))})")
        ps = self.pairs[decision.pair]
        prefill, decode = self.workers[decision.prefill], self.workers[decision.decode]
        site = ps.site(decision.cluster)
        scale, offset_s = self.calibration.prefill_scale(site), self.calibration.prefill_offset_s(site)
        prefill_model_s = max(decision.estimated_prefill_s - offset_s, 0.0) / scale  # the ledger keeps the model's seconds
        prefill.outstanding_prefill_s += prefill_model_s
        prefill.prefill_requests += 1
        ticket = decode.reserve(req.kv_tokens)
        self.counters.decode_held_tokens += decision.decode_held_tokens
        self.counters.routed[decision.cluster] += 1
        ps.routed[decision.cluster] += 1
        if decision.probe:
            self.counters.probes += 1
            ps.controller.note_probe(now_s)
        if decision.reason.startswith("spill"):
            self.counters.spilled += 1
        if attempt == 0:
            for other in self.pairs.values():  # every link of the PD cluster sees what its requests are
                if other.pair.pd == ps.pair.pd:
                    other.controller.record(now_s, decision.uncached_tokens)
            if (ctl := self.longterm.get(ps.pair.pd)) is not None:
                ctl.record(now_s, decision.uncached_tokens, req.kv_tokens - len(req.input_ids), decision.cluster)
        self.recent.append({"rid": req.rid, "cluster": decision.cluster, "prefill": decision.prefill,
                            "decode": decision.decode, "cached_tokens": decision.cached_tokens,
                            "tokens": len(req.input_ids), "reason": decision.reason, "attempt": attempt,
                            "decode_held_tokens": decision.decode_held_tokens, "link": str(ps.pair)})
        link_bytes = ps.runtime.kv_bytes(len(req.input_ids)) if decision.cluster == PRFAAS else 0.0
        ps.backlog_bytes += link_bytes
        return Lease(req.rid, decision, ps.pair, site, req.kv_tokens, ticket, prefill_model_s=prefill_model_s,
                     link_bytes=link_bytes,
                     compute_model_s=max(decision.estimated_queue_s + decision.estimated_prefill_s - offset_s, 0.0) / scale)

    def first_token(self, lease: Lease, observed_s: float, now_s: float) -> None:
        """The request's first token reached the router at ``now_s``, ``observed_s`` after its legs were
        dispatched: a sample for the calibration (once per lease)."""
        if not lease.first_token_seen:
            lease.first_token_seen = True
            self.calibration.first_token(lease.prefill_site, lease.compute_model_s, lease.link_s, observed_s,
                                         lease.decision.estimated_ttft_s, now_s)

    def token_gap(self, lease: Lease, observed_s: float, now_s: float) -> None:
        """Two tokens of ``lease``'s decode stream ``observed_s`` apart, the second at ``now_s``. The model's step:
        the decode profile of its pair's PD cluster at the batch its decode worker runs (what the worker last
        reported running, or the router's own leases on it if more), so the learned scale compares like with
        like: at its flat ``step_s`` (the step at ``BS_max``), a worker decoding 4 at a time read 0.3x
        (2026-12-02)."""
        worker = self.workers.get(lease.decision.decode)
        running = max(worker.running_requests if worker is not None else 0, 1)
        self.calibration.token_gap(observed_s, self.pairs[lease.pair].runtime.decode.step_at(running), now_s)

    def prefill_done(self, lease: Lease) -> None:
        """The prefill leg ended (its KV shipped, or it failed): its work leaves the queue signal."""
        if lease.prefill_open:
            lease.prefill_open = False
            ps = self.pairs.get(lease.pair)
            if ps is not None:
                ps.backlog_bytes = max(ps.backlog_bytes - lease.link_bytes, 0.0)
            worker = self.workers.get(lease.decision.prefill)
            if worker is not None:
                worker.outstanding_prefill_s = max(worker.outstanding_prefill_s - lease.prefill_model_s, 0.0)
                worker.prefill_requests = max(worker.prefill_requests - 1, 0)
            self.stage_meter.complete("prfaas" if lease.decision.cluster == PRFAAS else "pd-prefill", lease.prefill_site,
                                      lease.pair.pd)

    def leg_failed(self, decision: RouteDecision, leg: str, now_s: float) -> str:
        """A leg of ``decision`` failed (``prefill`` | ``decode``); returns the worker it ran on (not to be
        tried again for this request). The worker is out of service until its next health check answers;
        except a PrfaaS worker that serves several links, whose failed prefill leg may be its link's
        fault: it is kept off that pair only, for as long as a health check takes to take a worker out,
        and keeps serving the other links."""
        name = decision.prefill if leg == "prefill" else decision.decode
        worker = self.workers.get(name)
        if worker is None:
            return name
        worker.failures += 1
        ps = self.pairs.get(decision.pair)
        links = sum(1 for pair in self.pairs if pair.prfaas == worker.site)
        if leg == "prefill" and decision.cluster == PRFAAS and ps is not None and links > 1:
            ps.suspended[name] = now_s + self.config.health_interval_s * self.config.health_misses_to_down
        else:
            worker.healthy = False
        return name

    def finish(self, lease: Lease) -> None:
        """The request ended, whatever the outcome: everything it held is released."""
        self.prefill_done(lease)
        if lease.decode_open:
            lease.decode_open = False
            worker = self.workers.get(lease.decision.decode)
            if worker is not None:
                worker.release(lease.decode_ticket)
            self.stage_meter.complete("pd-decode", lease.pair.pd, lease.pair.pd)

    # --- waiting for decode room (the front end holds such a request; router/server.py) ---

    @property
    def waiting(self) -> int:
        """Requests waiting in the router for decode room now."""
        return sum(self.waiting_by_entry.values())

    def start_waiting(self, entry: str | None) -> None:
        """A request that entered at PD cluster ``entry`` (None: any) waits for decode room."""
        self.waiting_by_entry[entry] += 1

    def stop_waiting(self, entry: str | None) -> None:
        """That request waits no more (routed, or refused)."""
        self.waiting_by_entry[entry] -= 1

    def waiting_at(self) -> collections.Counter:
        """PD cluster -> requests waiting for its decode room: those that entered there, and every request
        without an entry at each PD cluster (any of them would do)."""
        out = collections.Counter()
        for entry, n in self.waiting_by_entry.items():
            for pd in [entry] if entry is not None else self.pd_sites():
                out[pd] += n
        return out

    # --- P/D conversion (the long-term scheduler's actuator; router/conversion.py drives it) ---

    def open_legs(self, name: str) -> int:
        """Requests whose prefill or decode leg on worker ``name`` has not ended."""
        worker = self.workers[name]
        return worker.prefill_requests + worker.reserved_requests

    def pd_split(self, site: str) -> tuple[int, int]:
        """(PD prefill, PD decode) workers of PD cluster ``site`` in service or about to be (draining ones
        count where they are)."""
        pd = [w for w in self.workers.values() if w.site == site and w.cluster == PD]
        return sum(w.role == "prefill" for w in pd), sum(w.role == "decode" for w in pd)

    def stage_of(self, worker: WorkerRecord) -> str:
        return "pd-decode" if worker.role == "decode" else ("prfaas" if worker.cluster == PRFAAS else "pd-prefill")

    def poll_stages(self, now_s: float) -> None:
        """Feed the stage meter the loads just polled (routable workers only)."""
        self.stage_meter.poll(now_s, [(self.stage_of(w), w.site, w.load.running, w.load.waiting,
                                       w.facts.max_running_requests if w.facts else None)
                                      for w in self.workers.values() if w.routable and w.load is not None])

    def stage_samples(self, now_s: float) -> dict[str, StageSample]:
        """What each stage did since the previous call, as each long-term controller's PD cluster sees it
        (:meth:`pd_views`); requests waiting in the router for decode room queue at the PD clusters they wait
        for (:meth:`waiting_at`)."""
        queued, instances = collections.Counter(), collections.Counter()
        for w in self.workers.values():
            if w.routable:
                instances[self.stage_of(w), w.site] += 1
                queued[self.stage_of(w), w.site] += w.load.waiting if w.load else 0
        for pd, n in self.waiting_at().items():
            queued["pd-decode", pd] += n
        return self.pd_views(self.stage_meter.sample(now_s, queued, instances))

    def pd_views(self, sample: ClusterSample) -> dict[str, StageSample]:
        """Each long-term controller's PD cluster's view of ``sample`` (``ClusterSample.for_pd``)."""
        links = self.prfaas_links()
        return {pd: sample.for_pd(pd, links) for pd in self.longterm}

    def observe_longterm(self, now_s: float, samples: Mapping[str, StageSample]) -> dict[str, Replan]:
        """Each PD cluster's long-term controller takes its sample (``samples``: :meth:`stage_samples`, or the
        simulator's) at the ``t`` its cluster ran (:meth:`pd_threshold_tokens`); the decisions, per PD cluster."""
        decisions = {pd: self.longterm[pd].observe(now_s, sample, self.pd_threshold_tokens(pd))
                     for pd, sample in samples.items()}
        return {pd: replan for pd, replan in decisions.items() if replan is not None}

    def pd_threshold_tokens(self, pd: str) -> float:
        """The ``t`` PD cluster ``pd`` runs, as its long-term controller models it (one per cluster): its pairs'
        lowest (a request longer than that may be offloaded over some link); one pair: that pair's."""
        return min(ps.controller.threshold_tokens for ps in self.pairs_of(pd))

    def prfaas_links(self) -> dict[str, list[str]]:
        """PrfaaS cluster -> the PD clusters it has a link to."""
        out: dict[str, list[str]] = {}
        for pair in self.pairs:
            if pair.prfaas is not None:
                out.setdefault(pair.prfaas, []).append(pair.pd)
        return out

    def start_longterm(self, settings: LongTermSettings) -> None:
        """One long-term controller per PD cluster, on the model of all its pairs (``runtime.PdClusterModel``:
        its PD split, and every PrfaaS cluster linked to it as the offload it plans for)."""
        models = pd_cluster_models({pair: ps.runtime for pair, ps in self.pairs.items()})
        self.longterm = {pd: LongTermController(model, settings) for pd, model in models.items()}

    def converted(self, name: str, new_role: str, now_s: float, runtime: PdClusterModel | None = None,
                  why: str | None = None) -> dict[SitePair, float]:
        """Worker ``name`` now serves ``new_role``: its record follows (facts forgotten: the caller
        re-reads them and re-subscribes its events; its blocks leave the KV index), it is back in
        service, and every pair of its PD cluster moves to the new split (:meth:`follow_split`;
        ``runtime``: the long-term controller's calibrated model of the cluster). Returns the pairs
        whose ``t`` the re-solve moved, with the new ``t``."""
        worker = self.workers[name]
        worker.role, worker.facts, worker.load, worker.draining = new_role, None, None, False
        worker.epoch += 1  # polls in flight describe the old role: the loops drop their answers
        worker.outstanding_prefill_s, worker.prefill_requests = 0.0, 0
        worker.forget_reservations()
        if name in self.index.workers():
            self.index.remove_worker(name)
        n_prefill, n_decode = self.pd_split(worker.site)
        self.sync_longterm()
        if runtime is None and not self._modelled_split(worker.site):
            return {}  # workers registered beyond the topology: the model's split stays
        return self.follow_split(worker.site, n_prefill, now_s, runtime,
                                 why or f"{name} -> {new_role} ({n_prefill}P/{n_decode}D)")

    def follow_split(self, pd: str, n_prefill: int, now_s: float, runtime: PdClusterModel | None, why: str) -> dict[SitePair, float]:
        """Every pair of PD cluster ``pd`` moves to ``n_prefill`` PD-P instances (``runtime``: the calibrated
        model of the cluster at its new split, each pair's own model in it; None: each pair's present model
        ``with_split``) and re-solves its ``t``. Returns the pairs whose ``t`` moved, with the new ``t``."""
        moved = {}
        for ps in self.pairs_of(pd):
            ps.runtime = runtime.pairs[ps.pair] if runtime is not None else ps.runtime.with_split(n_prefill)
            t = ps.controller.replan(now_s, ps.runtime.research, why)
            if t is not None:
                moved[ps.pair] = t
        return moved

    def _modelled_split(self, pd: str) -> bool:
        """Whether the workers' roles in PD cluster ``pd`` are a split its model can hold (its PD instance
        count, one per role at least)."""
        n_prefill, n_decode = self.pd_split(pd)
        (n_pd,) = {ps.runtime.deployment.n_pd for ps in self.pairs_of(pd)}  # the cluster's size: every pair's
        return n_prefill + n_decode == n_pd and min(n_prefill, n_decode) >= 1

    def sync_longterm(self) -> None:
        """Put each long-term controller on the split its PD cluster really serves (after any conversion, an
        operator's too, or one of its own that failed)."""
        for pd, ctl in self.longterm.items():
            if self._modelled_split(pd):
                n_prefill = self.pd_split(pd)[0]
                if n_prefill != ctl.runtime.n_prefill:
                    ctl.runtime = ctl.runtime.with_split(n_prefill)

    # --- control ----------------------------------------------------------------------

    def site_queue_s(self, site: str | None) -> float:
        """Outstanding prefill seconds per routable prefill instance of cluster ``site``, calibrated."""
        ws = [w for w in self.workers.values() if w.site == site and w.role == "prefill" and w.routable]
        scale = self.calibration.prefill_scale(site) if ws else 1.0
        return scale * sum(w.outstanding_prefill_s for w in ws) / len(ws) if ws else 0.0

    def queues(self, ps: PairState) -> QueueView:
        """Outstanding prefill seconds per instance of pair ``ps``'s clusters, calibrated."""
        return QueueView(self.site_queue_s(ps.pair.prfaas), self.site_queue_s(ps.pair.pd))

    def control_tick(self, now_s: float) -> dict[SitePair, float]:
        """One step of every link's controller on its view and queues; returns the pairs whose ``t`` changed,
        with the new ``t``. A calibrated prefill scale of a pair's clusters that moved
        ``replan_on_calibration`` from the one its ``t`` was solved with re-solves that ``t`` on the
        calibrated model first. A calibration quiet for its ``max_age_s`` forgets first."""
        self.calibration.forget_quiet(now_s)
        changed = {}
        for pair, ps in self.pairs.items():
            scales = {c: self.calibration.prefill_scale(site) if (site := ps.site(c)) is not None else 1.0
                      for c in (PRFAAS, PD)}
            moved = max(abs(scales[c] / ps.planned_scales[c] - 1.0) for c in scales)
            if moved > self.config.replan_on_calibration and ps.controller.override_tokens is None:
                ps.planned_scales = scales
                model = ps.runtime.calibrated({"prfaas": 1.0 / scales[PRFAAS], "pd-prefill": 1.0 / scales[PD]})
                ps.controller.replan(now_s, model.research, "calibrated prefill scales " +
                                     ", ".join(f"{c} {v:.2f}" for c, v in scales.items()))
            new_t = ps.controller.observe(now_s, ps.link.view(now_s), self.queues(ps))
            if new_t is not None:
                changed[pair] = new_t
        return changed

    def _link_status(self, ps: PairState, now_s: float) -> dict | None:
        view = ps.link.view(now_s)
        return None if view is None else {"capacity_bps": view.capacity_bps, "busy_fraction": view.busy_fraction,
                                          "egress_bps": view.egress_bps, "offered_bps": view.offered_bps,
                                          "backlog_bytes": view.backlog_bytes, "congested": view.congested,
                                          "transfers_completed": view.completed, "transfers_failed": view.failed}

    def pair_status(self, ps: PairState, now_s: float) -> dict:
        """Pair ``ps``: its threshold, controller and the threshold's history, its link as telemetry shows it,
        its queues, the KV routed toward it, what it routed, its model."""
        return {"prfaas": ps.pair.prfaas, "pd": ps.pair.pd, "threshold_tokens": ps.controller.threshold_tokens,
                "bandwidth_mode": ps.mode(self.config).value,
                "controller": ps.controller.describe(),
                "threshold_history": [{"t_s": t, "threshold_tokens": v, "why": why} for t, v, why in ps.controller.history],
                "link": self._link_status(ps, now_s), "link_down_workers": sorted(self.link_down(now_s, ps)),
                "queues_s": vars(self.queues(ps)), "backlog_bytes": ps.backlog_bytes, "routed": dict(ps.routed),
                "model": ps.runtime.describe()}

    def status(self, now_s: float) -> dict:
        """The router's state: ``pairs`` has every pair's (:meth:`pair_status`, by ``prfaas->pd``). A one-pair
        deployment also shows its pair's threshold, controller, history, model, link and queues at the top."""
        body = {
            "bandwidth_mode": "auto" if self.config.auto_mode else self.config.mode.value,
            "served_models": self.model_names(),
            "tokenizer": getattr(self.tokenizer, "source", None),
            "link_down_workers": sorted(self.link_down(now_s)),
            "telemetry_discarded_late": sum(ps.link.discarded for ps in self.pairs.values()),
            "routed": dict(self.counters.routed),
            "redispatched": self.counters.redispatched,
            "spilled": self.counters.spilled,
            "probes": self.counters.probes,
            "rejected": dict(self.counters.rejected),
            "failed": dict(self.counters.failed),
            "waiting_for_decode_room": self.waiting,
            "pairs": {str(pair): self.pair_status(ps, now_s) for pair, ps in self.pairs.items()},
            "workers": {w.name: {
                "cluster": w.cluster, "site": w.site, "role": w.role, "healthy": w.healthy, "draining": w.draining, "refused": w.refused,
                "page_size": w.facts.page_size if w.facts else None,
                "outstanding_prefill_s": w.outstanding_prefill_s, "reserved_tokens": w.reserved_tokens,
                "open_legs": self.open_legs(w.name), "switchable": w.switch_url is not None,
                "kv_free_tokens": w.kv_free_tokens if w.role == "decode" else None,
                "running": w.load.running if w.load else None,
                "index_blocks": self.index.block_count(w.name) if w.name in self.index.workers() else None,
            } for w in self.workers.values()},
            "recent": list(self.recent)[-10:],
            "long_term": {pd: {"links": [str(pair) for pair in ctl.runtime.pairs], **ctl.describe()}
                          for pd, ctl in self.longterm.items()} or None,
            "calibration": self.calibration.describe(),
        }
        if len(self.pairs) == 1:
            (only,) = body["pairs"].values()
            body.update({k: only[k] for k in ("threshold_tokens", "controller", "threshold_history", "model", "link", "queues_s")})
        return body

    def metrics_gauges(self, now_s: float) -> list[GaugeSample]:
        """The router's gauges now, as (name, labels, value) (``router/metrics.py`` exports them): a link's
        carry its pair (``link="prfaas->pd"``), a cluster's its kind and site."""
        routed = sum(self.counters.routed.values())
        gauges = [("prfaas_router_offload_fraction", {}, self.counters.routed.get(PRFAAS, 0) / routed if routed else 0.0),
                  ("prfaas_router_waiting_requests", {}, self.waiting)]
        for pair, ps in self.pairs.items():
            link = {"link": str(pair)}
            gauges += [("prfaas_router_threshold_tokens", link, ps.controller.threshold_tokens),
                       ("prfaas_router_baseline_threshold_tokens", link, ps.controller.baseline_tokens),
                       ("prfaas_router_link_capacity_estimate_bps", link, ps.controller.capacity_est_bps),
                       ("prfaas_router_link_backlog_bytes", link, ps.backlog_bytes),
                       ("prfaas_router_telemetry_discarded_late", link, ps.link.discarded)]
            view = ps.link.view(now_s)
            if view is not None:
                gauges += [("prfaas_router_egress_utilization", link, view.busy_fraction),
                           ("prfaas_router_egress_bps", link, view.egress_bps),
                           ("prfaas_router_offered_bps", link, view.offered_bps),
                           ("prfaas_router_link_congested", link, int(view.congested)),
                           ("prfaas_router_link_transfers_failed", link, view.failed)]
            down = self.link_down(now_s, ps)
            gauges += [("prfaas_router_link_down", {"worker": w.name, **link}, int(w.name in down))
                       for w in self.workers.values() if w.site == pair.prfaas and w.telemetry_endpoint]
        for site, kind in self.site_kinds().items():
            where = {"cluster": kind, "site": site}
            gauges += [("prfaas_router_queue_seconds", where, self.site_queue_s(site)),
                       ("prfaas_router_prefill_scale", where, self.calibration.prefill_scale(site))]
        gauges += [("prfaas_router_worker_healthy", {"worker": w.name}, int(w.healthy)) for w in self.workers.values()]
        gauges.append(("prfaas_router_decode_scale", {}, self.calibration.decode_scale()))
        gauges += [("prfaas_router_kv_free_tokens", {"worker": w.name}, w.kv_free_tokens or 0)
                   for w in self.workers.values() if w.role == "decode"]
        gauges += [("prfaas_router_kv_index_blocks", {"worker": w}, self.index.block_count(w))
                   for w in sorted(self.index.workers())]
        return gauges


def new_service(config: RouterConfig, models: RuntimeModel | dict[SitePair, RuntimeModel], workers: dict[str, WorkerRecord],
                tokenizer=None, emulation_spec: Emulation | None = None) -> RouterService:
    """Build the service: a :class:`PairState` per pair of ``models`` (``runtime.pair_models``; one
    ``RuntimeModel``: the pair of the workers' clusters) and a KV index for its workers."""
    if isinstance(models, RuntimeModel):
        sites = {kind: sorted({w.site for w in workers.values() if w.cluster == kind}) for kind in (PRFAAS, PD)}
        if len(sites[PD]) != 1 or len(sites[PRFAAS]) > 1:
            raise ValueError(f"one model, one pair: the workers are in clusters {sites}")
        models = {SitePair(sites[PD][0], sites[PRFAAS][0] if sites[PRFAAS] else None): models}
    pairs = {pair: new_pair(pair, model, config, config.telemetry_stale_s) for pair, model in models.items()}
    hybrid = any(model.hybrid for model in models.values())  # one index: reuse stops at states if any pair's model has them
    index = KvIndex(hybrid=hybrid, memo=PageIdMemo(max_segments=None, max_bytes=config.kv_memo_bytes))
    return RouterService(config, pairs, workers, index, tokenizer, emulation_spec)
