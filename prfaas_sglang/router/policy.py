"""Where a request prefills and decodes: the paper's routing rule (section 3.4.3), pure.

Inputs are a :class:`RouteInput` (the prompt's length, the KV it will hold on a
decode worker, the KV index's answer) and a :class:`ClusterSnapshot` (each
worker's state, the threshold, the bandwidth mode, the link, the cost
profiles); no clocks, no sockets. The output is a :class:`RouteDecision`::

    l = l_total - l_cached                                   incremental length
    bandwidth scarce:   each cluster's cache judged alone:
                        l_total - l_pd <= t  -> PD-P, else PrfaaS
    bandwidth abundant: l_prefix = max(l_prfaas, l_pd):
                        l_total - l_prefix <= t -> PD-P, else PrfaaS;
                        if the longer cache sits in the other cluster, move it
                        across when the transfer is cheaper than recomputing.
                        Only where the snapshot says a cache transfer can run
                        (``transfer_supported``); otherwise each cluster's
                        cache is judged alone, as in scarce mode, and the
                        reason says so: nothing is credited that nobody moves.
    probe:              with ``probe_budget_bytes`` set (the threshold
                        controller asks to re-measure a constrained link), a
                        request whose KV fits the budget goes to PrfaaS as the
                        probe, once: one bound for PD-P instead, one the rule
                        sends there anyway as it is. No TTFT detour or early
                        refusal takes a probe off the link: the estimate it
                        would be judged by is what it re-measures (a floor
                        estimate spilled every long prompt to PD for good).
    expected TTFT:      with ``ttft_target_s`` set, the rule's cluster is the
                        plan, not the last word: when its best worker's
                        expected TTFT (queue + prefill + KV over the link, from
                        the calibrated model) exceeds the target and the other
                        cluster's is lower, the request goes there. The plan's
                        threshold keeps the long prompts on PrfaaS and the
                        short ones on PD-P while both meet the SLO; a queue in
                        front of either moves only the requests it would make
                        late, whatever admission does.
    TTFT SLO:           with ``max_ttft_s`` set, a request the chosen cluster
                        would refuse (``refuse_early``) goes to the other
                        cluster when that one meets the bound (Mooncake's
                        admission takes the best instance before refusing:
                        a long prompt behind a throttled link prefills on
                        PD-P rather than being refused).

Within the chosen cluster the prefill worker with the lowest estimated TTFT
wins: ``queue_s + T_prefill(l_total - cached_on_that_worker)``, plus, for
PrfaaS, shipping ``S_kv(l_total)`` over the link (after the prefill, or, where the PrfaaS
workers stream by layer (``kv_stream_groups``), overlapping it: ``plan.overlap.kv_finish_s``),
and never less than the
link takes to drain what is routed toward it already and this request's KV
(``(backlog + S_kv) / capacity``): on a busy link the KV waits for the link. When the chosen cluster has
no usable prefill worker the request *spills* to the other one (the reason
says so); with none anywhere, :class:`NoHealthyWorker`. Decode: among usable
decode workers whose free KV holds ``decode_tokens``, the most free KV, then
the fewest running; when none has room, :class:`NoDecodeRoom` (the caller
waits or rejects; a decode leg is never sent where it cannot fit). A decode
worker that already holds the prompt's prefix in its own cache (SGLang's decode
radix cache: that KV is not shipped again) is preferred while its free KV is
within ``decode_affinity_slack`` (a fraction) of the roomiest's, as
sglang-router's ``cache_aware`` prefers a cache hit until the load is too uneven.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from prfaas_sglang.errors import PrfaasError
from prfaas_sglang.plan.overlap import kv_finish_s
from prfaas_sglang.plan.profiles import PrefillProfile
from prfaas_sglang.topology import SitePair

PRFAAS, PD = "prfaas", "pd"


class NoHealthyWorker(PrfaasError):
    """No worker can take this request (all unhealthy or draining)."""

    exit_code = 1


class NoDecodeRoom(NoHealthyWorker):
    """Decode workers are up, but none has KV room for this request now."""


class BandwidthMode(str, enum.Enum):
    SCARCE = "scarce"
    ABUNDANT = "abundant"


# ``--bandwidth-mode auto``: the link counts as abundant while the plan's KV at its Lambda_max would fill at most
# this share of the capacity telemetry measures (the link does not bind, with room for bursts).
ABUNDANT_MAX_UTILIZATION = 0.5


def mode_from_link(planned_egress_utilization: float) -> BandwidthMode:
    """The paper's mode from the link as measured: abundant while the plan's egress at Lambda_max, over the link's
    measured capacity, is at most :data:`ABUNDANT_MAX_UTILIZATION`; scarce otherwise."""
    return BandwidthMode.ABUNDANT if planned_egress_utilization <= ABUNDANT_MAX_UTILIZATION else BandwidthMode.SCARCE


@dataclass(frozen=True)
class WorkerState:
    name: str
    cluster: str  # "prfaas" | "pd"
    role: str  # "prefill" | "decode"
    healthy: bool = True
    draining: bool = False
    queue_s: float = 0.0  # outstanding prefill work, the engines' seconds
    running: int = 0
    kv_free_tokens: int | None = None  # decode: KV room now (None: not reported yet)

    @property
    def usable(self) -> bool:
        return self.healthy and not self.draining


@dataclass(frozen=True)
class Link:
    """The PrfaaS -> PD link as the router sees it now."""

    capacity_bps: float
    used_bps: float = 0.0
    rtt_s: float = 0.0
    backlog_bytes: float = 0.0  # KV routed toward the link and not yet delivered (the router's ledger)

    @property
    def spare_bps(self) -> float:
        return max(self.capacity_bps - self.used_bps, 0.0)


@dataclass(frozen=True)
class CacheTransfer:
    """Move ``tokens`` of cached prefix from ``source`` (other cluster) before prefilling."""

    source: str
    tokens: int
    estimated_s: float


@dataclass(frozen=True)
class RouteInput:
    total_tokens: int  # prompt length
    decode_tokens: int  # KV the request may hold on its decode worker (prompt + max new tokens)
    by_worker: Mapping[str, int]  # reusable prefix per worker (the KV index)
    shared_tokens: int = 0  # the longest prefix some worker holds as full-attention blocks, state or not
    held_by_worker: Mapping[str, int] | None = None  # what each decode worker's own cache supplies (not shipped)


@dataclass(frozen=True)
class ClusterSnapshot:
    workers: Sequence[WorkerState]
    threshold_tokens: float
    mode: BandwidthMode
    prefill_cost: Mapping[str, PrefillProfile]  # cluster -> T_prefill / S_kv in observed units
    link: Link
    kv_bytes: Callable[[float], float]  # bytes on the wire for a request of N tokens
    transfer_supported: bool = False  # can an engine move a cache across clusters?
    transfer_override: bool | None = None  # True: move whenever the other cluster's cache is longer; False: never
    probe_budget_bytes: float | None = None
    max_ttft_s: float | None = None  # early rejection's bound (observed seconds); None: off
    ttft_target_s: float | None = None  # placement by expected TTFT beyond this (observed seconds); None: the rule alone
    # Conditional placement (the Dynamo-like baseline): the rule's PrfaaS only while its prefill workers hold
    # fewer requests than this, else PD; None: off.
    remote_queue_cap: int | None = None
    # A decode worker holding the prefix wins while its free KV is at least (1 - slack) of the
    # roomiest's; None: the roomiest always (no decode affinity).
    decode_affinity_slack: float | None = 0.1
    # PrfaaS workers stream their KV in this many layer groups as they prefill (plan.overlap); None: it
    # leaves after the prefill.
    kv_stream_groups: int | None = None


@dataclass(frozen=True)
class RouteDecision:
    prefill: str
    decode: str
    cluster: str
    cached_tokens: int  # reusable on the chosen prefill worker (plus a transfer's, when one runs)
    uncached_tokens: int
    estimated_ttft_s: float
    estimated_prefill_s: float  # T_prefill(uncached) alone: the work the prefill worker gets
    transfer: CacheTransfer | None
    probe: bool
    reason: str
    checkpoint_tokens: int | None = None  # a state checkpoint asked of the prefill worker there (checkpoint_at)
    decode_held_tokens: int = 0  # of the prompt, what the decode worker's own cache supplies (not shipped)
    estimated_queue_s: float = 0.0  # of estimated_ttft_s, the chosen worker's queue (the rest: prefill, then the link)
    pair: SitePair | None = None  # the fleet's pair it was decided in (router/fleet.py); None: route() alone


def checkpoint_at(total_tokens: int, shared_tokens: int, cached_tokens: int, min_tokens: int) -> int | None:
    """Where to ask the prefill worker of a hybrid model for a state checkpoint, or None. Pure.

    A hybrid model resumes only where a state was saved. A prefix some worker holds as
    full-attention blocks (``shared_tokens``) was computed for an earlier request, so later ones
    are likely to share it too (a system prompt, a document, a conversation); unless the chosen
    worker already resumes there (``cached_tokens``), a state saved at its end makes the next one
    on that worker a hit. Asked only when the checkpoint adds at least ``min_tokens`` of reuse and
    the prompt goes on at least ``min_tokens`` past it (its end gets a checkpoint anyway), since
    each is a state slot (~74 MiB for Qwen3-Next-80B).

        prompt:  |<------------- total_tokens ------------->|
        reused:  |<- cached ->|
        shared:  |<------ shared_tokens ------>|
                              ^ >= min_tokens  ^ checkpoint  ^ >= min_tokens to the end
    """
    if shared_tokens - cached_tokens >= min_tokens and total_tokens - shared_tokens >= min_tokens:
        return shared_tokens
    return None


def refuse_early(decision: RouteDecision, max_ttft_s: float | None) -> bool:
    """Early rejection (Mooncake's): refuse what the load would make miss the TTFT SLO.

    A request slow on its own (a long prompt on an idle worker) is not refused for its length:
    its bound is ``max(max_ttft_s, 2 x its own prefill)``, so only waiting (queues, the link) refuses it.
    """
    if decision.probe:  # sent knowingly: its budget bounds its cost, and it re-measures the estimate judged here
        return False
    return max_ttft_s is not None and decision.estimated_ttft_s > max(max_ttft_s, 2 * decision.estimated_prefill_s)


def transfer_s(kv_bytes: float, link: Link, spare_only: bool = True) -> float | None:
    """Seconds to move ``kv_bytes`` over the link (its spare capacity by default); None: no capacity."""
    rate = link.spare_bps if spare_only else link.capacity_bps
    if rate <= 0:
        return None
    return link.rtt_s + 8.0 * kv_bytes / rate


def choose_cluster(total_tokens: int, by_cluster: Mapping[str, int], threshold_tokens: float, mode: BandwidthMode,
                   transfer_supported: bool) -> tuple[str, int, str]:
    """(cluster, prefix length the rule credits, reason) by the paper's rule."""
    l_pd, l_prfaas = by_cluster.get(PD, 0), by_cluster.get(PRFAAS, 0)
    if mode is BandwidthMode.SCARCE or not transfer_supported:
        note = "" if mode is BandwidthMode.SCARCE else " (abundant mode, but no engine can move a cache: judged per cluster)"
        if total_tokens - l_pd <= threshold_tokens:
            return PD, l_pd, f"uncached on PD {total_tokens - l_pd} <= t {threshold_tokens:g}{note}"
        return PRFAAS, l_prfaas, f"uncached on PD {total_tokens - l_pd} > t {threshold_tokens:g}{note}"
    prefix = max(l_pd, l_prfaas)
    cluster = PD if total_tokens - prefix <= threshold_tokens else PRFAAS
    op = "<=" if cluster == PD else ">"
    return cluster, prefix, f"uncached after the best cache {total_tokens - prefix} {op} t {threshold_tokens:g}"


def conditional(prefills: Sequence[WorkerState], by_cluster: Mapping[str, int], cap: int, credited: int,
                reason: str) -> tuple[str, int, str]:
    """The Dynamo-like baseline's second condition on a prompt the rule sends to PrfaaS: PD instead once PrfaaS's
    prefill workers hold ``cap`` requests (cluster, prefix credited, reason)."""
    queued = sum(w.running for w in prefills if w.cluster == PRFAAS)
    if queued < cap:
        return PRFAAS, credited, reason
    return PD, by_cluster.get(PD, 0), f"conditional: PrfaaS holds {queued} >= {cap} requests ({reason})"


def route(request: RouteInput, snap: ClusterSnapshot) -> RouteDecision:
    """Choose prefill worker, decode worker and any cross-cluster cache transfer. Pure."""
    total, by_worker = request.total_tokens, request.by_worker
    prefills = [w for w in snap.workers if w.role == "prefill" and w.usable]
    decodes = [w for w in snap.workers if w.role == "decode" and w.usable]
    if not prefills or not decodes:
        raise NoHealthyWorker(f"no healthy {'prefill' if not prefills else 'decode'} worker")
    roomy = [w for w in decodes if w.kv_free_tokens is None or w.kv_free_tokens >= request.decode_tokens]
    if not roomy:
        raise NoDecodeRoom(f"no decode worker has KV room for {request.decode_tokens} tokens now")
    # What a cluster can resume from is what its prefill workers hold: a decode worker's own cache
    # (SGLang's decode radix cache, in the index when it publishes events) saves shipping, not prefill.
    cluster_of = {w.name: w.cluster for w in snap.workers if w.role == "prefill"}
    by_cluster: dict[str, int] = {}
    for name, n in by_worker.items():
        c = cluster_of.get(name)
        if c is not None:
            by_cluster[c] = max(by_cluster.get(c, 0), n)

    cluster, credited, reason = choose_cluster(total, by_cluster, snap.threshold_tokens, snap.mode, snap.transfer_supported)
    if snap.remote_queue_cap is not None and cluster == PRFAAS:
        cluster, credited, reason = conditional(prefills, by_cluster, snap.remote_queue_cap, credited, reason)
    probe = False
    if snap.probe_budget_bytes is not None and any(w.cluster == PRFAAS for w in prefills):
        if snap.kv_bytes(total) <= snap.probe_budget_bytes:
            if cluster == PD:
                cluster, credited = PRFAAS, by_cluster.get(PRFAAS, 0)
            probe, reason = True, f"probe of the constrained link ({reason})"
    in_cluster = [w for w in prefills if w.cluster == cluster]
    if not in_cluster:
        other = PD if cluster == PRFAAS else PRFAAS
        in_cluster = [w for w in prefills if w.cluster == other]
        reason = f"spill to {other}: no usable {cluster} prefill worker ({reason})"
        cluster, probe = other, False

    decision = _place(request, snap, cluster, credited, in_cluster, roomy, probe, reason)

    def other_cluster(why: str) -> RouteDecision | None:
        """The best placement in the other cluster (a moved cache credited where one can move), or None."""
        other = PD if decision.cluster == PRFAAS else PRFAAS
        others = [w for w in prefills if w.cluster == other]
        if not others:
            return None
        movable = snap.mode is BandwidthMode.ABUNDANT and snap.transfer_supported
        alt_credited = max(by_cluster.values(), default=0) if movable else by_cluster.get(other, 0)
        return _place(request, snap, other, alt_credited, others, roomy, False,
                      f"{why}: {decision.cluster} estimated {decision.estimated_ttft_s:.2f} s ({decision.reason})")

    if snap.ttft_target_s is not None and not probe and decision.estimated_ttft_s > snap.ttft_target_s:
        alt = other_cluster(f"to {PD if decision.cluster == PRFAAS else PRFAAS} by expected TTFT")
        if alt is not None and alt.estimated_ttft_s < decision.estimated_ttft_s:
            decision = alt
    if not refuse_early(decision, snap.max_ttft_s):
        return decision
    # Mooncake's admission looks at every prefill instance before refusing: when the rule's cluster
    # would miss the SLO and the other one meets it, the request goes there instead.
    alt = other_cluster(f"spill to {PD if decision.cluster == PRFAAS else PRFAAS} within the TTFT SLO")
    if alt is not None and not refuse_early(alt, snap.max_ttft_s):
        return alt
    return decision


def _place(request: RouteInput, snap: ClusterSnapshot, cluster: str, credited: int, in_cluster: list[WorkerState],
           roomy: list[WorkerState], probe: bool, reason: str) -> RouteDecision:
    """The decision within ``cluster``: the prefill worker with the lowest estimated TTFT, any cache
    transfer worth its cost (abundant mode), and the decode worker with the most free KV."""
    total, by_worker = request.total_tokens, request.by_worker
    transfer = None
    own_best = max((by_worker.get(w.name, 0) for w in in_cluster), default=0)
    if snap.mode is BandwidthMode.ABUNDANT and snap.transfer_supported and credited > own_best:
        source = max((w for w in snap.workers if w.cluster != cluster and w.role == "prefill"),
                     key=lambda w: by_worker.get(w.name, 0), default=None)
        cost = transfer_s(snap.kv_bytes(credited), snap.link)
        profile = snap.prefill_cost[cluster]
        saved = profile.prefill_s(total - own_best) - profile.prefill_s(total - credited)
        worth = cost < saved if snap.transfer_override is None else snap.transfer_override
        if source is not None and cost is not None and worth:
            transfer = CacheTransfer(source.name, credited, cost)
            reason += f"; move {credited - own_best} cached tokens from {source.name} ({cost:.3f} s < recompute {saved:.3f} s)"
        else:
            reason += ("; recompute instead of moving the other cluster's cache"
                       + ("" if cost is None else f" ({cost:.3f} s >= recompute {saved:.3f} s)"))

    profile = snap.prefill_cost[cluster]
    own_bytes = snap.kv_bytes(total)
    # Over the link (PrfaaS only): the full-attention KV, which may stream as it is written, then the state.
    stream_s = tail_s = drain_s = 0.0
    if cluster == PRFAAS and snap.link.capacity_bps > 0:
        tail_bytes = min(snap.kv_bytes(0), own_bytes)
        stream_s = 8.0 * (own_bytes - tail_bytes) / snap.link.capacity_bps
        tail_s = snap.link.rtt_s + 8.0 * tail_bytes / snap.link.capacity_bps
        drain_s = transfer_s(snap.link.backlog_bytes + own_bytes, snap.link, spare_only=False)

    def cached_on(w: WorkerState) -> int:
        return credited if transfer else by_worker.get(w.name, 0)

    def ttft(w: WorkerState) -> float:
        start_s = w.queue_s + (transfer.estimated_s if transfer else 0.0)
        compute_s = profile.prefill_s(max(total - cached_on(w), 1))
        return max(start_s + kv_finish_s(compute_s, stream_s, tail_s, snap.kv_stream_groups), drain_s)

    prefill = min(in_cluster, key=lambda w: (ttft(w), w.name))
    cached = cached_on(prefill)
    decode, held = pick_decode(roomy, request.held_by_worker or {}, snap.decode_affinity_slack)
    return RouteDecision(prefill.name, decode.name, cluster, cached, total - cached, ttft(prefill),
                         profile.prefill_s(max(total - cached, 1)), transfer, probe, reason, decode_held_tokens=held,
                         estimated_queue_s=prefill.queue_s)


def pick_decode(roomy: Sequence[WorkerState], held_by_worker: Mapping[str, int],
                slack: float | None) -> tuple[WorkerState, int]:
    """The decode worker (and what its own cache supplies of the prompt): the one holding the most
    of the prompt, while its free KV is at least ``(1 - slack)`` of the roomiest worker's; else the
    roomiest (most free KV, then fewest running). ``roomy`` is non-empty. Pure.

    The held prefix is KV the prefill worker does not ship (over the PrfaaS link when the prefill
    was remote). It does not change the room the request takes: SGLang counts a decode tree's
    evictable KV as free, and locks the held part when the request takes it. The slack bounds the
    imbalance affinity may cause, relative to what is free, so it tightens as the pools fill."""
    def free(w: WorkerState) -> int:
        return w.kv_free_tokens if w.kv_free_tokens is not None else 0

    roomiest = max(roomy, key=lambda w: (free(w), -w.running, w.name))
    if slack is None or not held_by_worker:
        return roomiest, held_by_worker.get(roomiest.name, 0)
    holder = max(roomy, key=lambda w: (held_by_worker.get(w.name, 0), free(w), -w.running, w.name))
    if held_by_worker.get(holder.name, 0) > held_by_worker.get(roomiest.name, 0) and free(holder) >= (1 - slack) * free(roomiest):
        return holder, held_by_worker[holder.name]
    return roomiest, held_by_worker.get(roomiest.name, 0)
