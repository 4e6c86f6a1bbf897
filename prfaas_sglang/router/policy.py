"""Where a request prefills and decodes: the paper's routing rule (section 3.4.3), pure.

Inputs are snapshots (no clocks, no sockets): the prompt length, the KV
index's answer, each worker's state, the threshold, the bandwidth mode, the
link and the cost profiles. The output is a :class:`RouteDecision`.

    l = l_total - l_cached                                   incremental length
    bandwidth scarce:   each cluster's cache judged alone:
                        l_total - l_pd <= t  -> PD-P, else PrfaaS
    bandwidth abundant: l_prefix = max(l_prfaas, l_pd):
                        l_total - l_prefix <= t -> PD-P, else PrfaaS;
                        if the longer cache sits in the other cluster, move it
                        across when the transfer is cheaper than recomputing
                        the extra tokens (cost model below), else recompute.

Within the chosen cluster the prefill worker with the lowest estimated TTFT
wins: ``queue_s + T_prefill(l_total - cached_on_that_worker) + transfer``
(Mooncake's TTFT estimate). Decode: the healthy decode worker with the most
KV headroom, then the fewest running requests. When the chosen cluster has
no healthy prefill worker the request falls back to the other one (the
reason says so); with none anywhere, :class:`NoHealthyWorker`.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from prfaas_sglang.errors import PrfaasError
from prfaas_sglang.plan.profiles import PrefillProfile

PRFAAS, PD = "prfaas", "pd"


class NoHealthyWorker(PrfaasError):
    """No worker can take this request (all unhealthy, draining or full)."""

    exit_code = 1


class BandwidthMode(str, enum.Enum):
    SCARCE = "scarce"
    ABUNDANT = "abundant"


@dataclass(frozen=True)
class WorkerState:
    name: str
    cluster: str  # "prfaas" | "pd"
    role: str  # "prefill" | "decode"
    healthy: bool = True
    draining: bool = False
    queue_s: float = 0.0  # estimated prefill work queued ahead, seconds
    running: int = 0
    kv_free_tokens: int | None = None  # decode: room for more KV (None: unknown)

    @property
    def usable(self) -> bool:
        return self.healthy and not self.draining


@dataclass(frozen=True)
class Link:
    """The PrfaaS -> PD link as telemetry sees it now."""

    capacity_bps: float
    used_bps: float = 0.0
    rtt_s: float = 0.0

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
class RouteDecision:
    prefill: str
    decode: str
    cluster: str
    cached_tokens: int
    uncached_tokens: int
    estimated_ttft_s: float
    transfer: CacheTransfer | None
    reason: str


def transfer_s(kv_bytes: float, link: Link) -> float | None:
    """Seconds to move ``kv_bytes`` over the link's spare capacity (None: no spare capacity)."""
    if link.spare_bps <= 0:
        return None
    return link.rtt_s + 8.0 * kv_bytes / link.spare_bps


def choose_cluster(total_tokens: int, by_cluster: Mapping[str, int], threshold_tokens: float, mode: BandwidthMode) -> tuple[str, int, str]:
    """(cluster, prefix length the rule credits, reason) by the paper's rule."""
    l_pd, l_prfaas = by_cluster.get(PD, 0), by_cluster.get(PRFAAS, 0)
    if mode is BandwidthMode.SCARCE:
        if total_tokens - l_pd <= threshold_tokens:
            return PD, l_pd, f"uncached on PD {total_tokens - l_pd} <= t {threshold_tokens:g}"
        return PRFAAS, l_prfaas, f"uncached on PD {total_tokens - l_pd} > t {threshold_tokens:g}"
    prefix = max(l_pd, l_prfaas)
    cluster = PD if total_tokens - prefix <= threshold_tokens else PRFAAS
    op = "<=" if cluster == PD else ">"
    return cluster, prefix, f"uncached after the best cache {total_tokens - prefix} {op} t {threshold_tokens:g}"


def route(
    total_tokens: int,
    by_worker: Mapping[str, int],
    workers: Sequence[WorkerState],
    threshold_tokens: float,
    mode: BandwidthMode,
    prefill_cost: Mapping[str, PrefillProfile],
    link: Link,
    kv_bytes: Callable[[float], float],
) -> RouteDecision:
    """Choose prefill worker, decode worker and any cross-cluster cache transfer. Pure."""
    prefills = [w for w in workers if w.role == "prefill" and w.usable]
    decodes = [w for w in workers if w.role == "decode" and w.usable]
    if not prefills or not decodes:
        missing = "prefill" if not prefills else "decode"
        raise NoHealthyWorker(f"no healthy {missing} worker")
    by_cluster: dict[str, int] = {}
    cluster_of = {w.name: w.cluster for w in workers}
    for name, n in by_worker.items():
        c = cluster_of.get(name)
        if c is not None:
            by_cluster[c] = max(by_cluster.get(c, 0), n)

    cluster, credited, reason = choose_cluster(total_tokens, by_cluster, threshold_tokens, mode)
    in_cluster = [w for w in prefills if w.cluster == cluster]
    if not in_cluster:
        other = PD if cluster == PRFAAS else PRFAAS
        in_cluster = [w for w in prefills if w.cluster == other]
        reason = f"fallback to {other}: no healthy {cluster} prefill worker ({reason})"
        cluster = other

    transfer = None
    own_best = max((by_worker.get(w.name, 0) for w in in_cluster), default=0)
    if mode is BandwidthMode.ABUNDANT and credited > own_best:
        source = max((w for w in workers if w.cluster != cluster), key=lambda w: by_worker.get(w.name, 0), default=None)
        moved = credited - own_best
        cost = transfer_s(kv_bytes(credited), link)
        profile = prefill_cost[cluster]
        saved = profile.prefill_s(total_tokens - own_best) - profile.prefill_s(total_tokens - credited)
        if source is not None and cost is not None and cost < saved:
            transfer = CacheTransfer(source.name, credited, cost)
            reason += f"; move {moved} cached tokens from {source.name} ({cost:.3f} s < recompute {saved:.3f} s)"
        else:
            reason += "; recompute instead of moving the other cluster's cache"

    def ttft(w: WorkerState) -> float:
        cached = credited if transfer else by_worker.get(w.name, 0)
        return w.queue_s + prefill_cost[cluster].prefill_s(max(total_tokens - cached, 1)) + (transfer.estimated_s if transfer else 0.0)

    prefill = min(in_cluster, key=lambda w: (ttft(w), w.name))
    cached = credited if transfer else by_worker.get(prefill.name, 0)
    roomy = [w for w in decodes if w.kv_free_tokens is None or w.kv_free_tokens >= total_tokens]
    if not roomy:
        raise NoHealthyWorker(f"no decode worker has KV room for {total_tokens} tokens")
    decode = max(roomy, key=lambda w: (w.kv_free_tokens if w.kv_free_tokens is not None else 0, -w.running, w.name))
    return RouteDecision(prefill.name, decode.name, cluster, cached, total_tokens - cached, ttft(prefill), transfer, reason)
