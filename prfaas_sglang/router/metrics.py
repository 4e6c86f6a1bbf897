"""The router's counters and histograms, as Prometheus metric families (pure).

Causes are labels: ``rejected{cause}`` counts requests refused before any
worker ran them (no worker, no decode room in time, queue full, estimated
TTFT over the limit, bad request); ``failed{cause}`` requests that a worker
took and that still ended in an error.

The values live here; ``prometheus_client`` only formats them: :meth:`RouterCounters.families`
builds the families from the values at the moment of a scrape (a collector's ``collect``), and
the router's app owns the registry that ``/metrics`` serves (``router/server.py``).
"""

from __future__ import annotations

import bisect
import collections
from collections.abc import Iterable
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

# Causes exported at 0 before they first happen (a dashboard's rate() then has a series to read)
REJECT_CAUSES = ("bad_request", "no_decode_room", "no_worker", "queue_full", "too_large", "ttft_estimate",
                 "unknown_model", "worker_4xx")
FAIL_CAUSES = ("decode", "prefill")
LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

# A gauge as RouterService.metrics_gauges gives it: (name, labels, value)
GaugeSample = tuple[str, dict[str, str], float]

GAUGE_HELP = {
    "prfaas_router_threshold_tokens": "Prompt length from which a request is offloaded to the PrfaaS cluster",
    "prfaas_router_baseline_threshold_tokens": "The threshold the controller returns to when the link is not the limit",
    "prfaas_router_link_capacity_estimate_bps": "The controller's estimate of the cross-cluster link's capacity",
    "prfaas_router_offload_fraction": "Fraction of routed requests sent to the PrfaaS cluster",
    "prfaas_router_queue_seconds": "Estimated prefill seconds queued per cluster",
    "prfaas_router_waiting_requests": "Requests waiting in the router for decode room",
    "prfaas_router_egress_utilization": "Busy fraction of the PrfaaS workers' KV egress",
    "prfaas_router_egress_bps": "KV egress of the PrfaaS workers",
    "prfaas_router_offered_bps": "KV bits requested for transfer per second (the demand on the link)",
    "prfaas_router_link_congested": "1 while a PrfaaS worker reports its KV connections congested",
    "prfaas_router_link_transfers_failed": "KV transfers that failed in the last telemetry window",
    "prfaas_router_worker_healthy": "1 while the worker answers its health checks",
    "prfaas_router_link_down": "1 while a PrfaaS worker's telemetry is silent with work in flight",
    "prfaas_router_telemetry_discarded_late": "Telemetry samples discarded as too late",
    "prfaas_router_prefill_scale": "Online calibration of the prefill cost model per cluster",
    "prfaas_router_decode_scale": "Online calibration of the decode cost model",
    "prfaas_router_link_backlog_bytes": "KV bytes requested and not yet delivered over the link",
    "prfaas_router_kv_free_tokens": "A decode worker's free KV, as the router accounts it",
    "prfaas_router_kv_index_blocks": "Blocks the router's KV index holds for a worker",
}


class _Families:
    """A collector of families already built (for :func:`exposition`)."""

    def __init__(self, families: Iterable[Metric]):
        self._families = list(families)

    def collect(self) -> list[Metric]:
        return self._families


def exposition(families: Iterable[Metric]) -> str:
    """``families`` in the Prometheus text format, as ``/metrics`` serves them (a private registry)."""
    registry = CollectorRegistry()
    registry.register(_Families(families))
    return generate_latest(registry).decode()


@dataclass
class Histogram:
    buckets: tuple[float, ...] = LATENCY_BUCKETS_S
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    n: int = 0

    def __post_init__(self):
        self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value
        self.n += 1

    def family(self, name: str, doc: str, labels: dict[str, str] | None = None) -> HistogramMetricFamily:
        """This histogram as the family ``name`` (cumulative buckets, ``le`` as ``%g``, then +Inf)."""
        labels = labels or {}
        family = HistogramMetricFamily(name, doc, labels=list(labels))
        cumulative, buckets = 0, []
        for bound, count in zip((*self.buckets, float("inf")), self.counts, strict=True):
            cumulative += count
            buckets.append(("+Inf" if bound == float("inf") else f"{bound:g}", cumulative))
        family.add_metric(list(labels.values()), buckets, self.total)
        return family

    def render(self, name: str, labels: dict[str, str] | None = None) -> str:
        """This histogram alone in the Prometheus text format."""
        return exposition([self.family(name, name, labels)])


@dataclass
class RouterCounters:
    routed: dict[str, int] = field(default_factory=lambda: {"prfaas": 0, "pd": 0})
    redispatched: int = 0  # a prefill leg failed, or the decode worker was unreachable, before anything streamed
    restored_blocks: int = 0  # blocks taken from the kv-index service's snapshot at start-up
    spilled: int = 0  # the rule's cluster had no usable prefill worker
    probes: int = 0
    checkpoint_hints: int = 0  # prefill legs asked for a state checkpoint (policy.checkpoint_at)
    decode_held_tokens: int = 0  # prompt tokens the chosen decode workers' own caches held (not shipped)
    rejected: collections.Counter = field(default_factory=collections.Counter)
    failed: collections.Counter = field(default_factory=collections.Counter)
    ttft: Histogram = field(default_factory=Histogram)  # streamed requests: time to the first byte
    tbt: Histogram = field(default_factory=Histogram)  # streamed requests: a chunk's gap over the worker's stream interval
    e2e: Histogram = field(default_factory=Histogram)  # every successful request
    queue_wait: Histogram = field(default_factory=Histogram)  # waiting in the router for decode room
    cache_moves: collections.Counter = field(default_factory=collections.Counter)  # outcome -> moves of a cached prefix
    cache_move: Histogram = field(default_factory=Histogram)  # seconds a successful move took

    def families(self, gauges: Iterable[GaugeSample]) -> list[Metric]:
        """``gauges`` (one family per name, in order of first appearance; a name's labels are the same
        keys in every row), then every counter and histogram, as Prometheus metric families."""
        out: dict[str, GaugeMetricFamily] = {}
        for name, labels, value in gauges:
            if name not in out:
                out[name] = GaugeMetricFamily(name, GAUGE_HELP.get(name, name), labels=list(labels))
            out[name].add_metric(list(labels.values()), value)
        families: list[Metric] = list(out.values())

        def counter(name: str, doc: str, label: str | None = None, values: Iterable[tuple[str, float]] = ()) -> None:
            family = CounterMetricFamily(name, doc, labels=[label] if label else None)
            for key, value in values:
                family.add_metric([key], value)
            families.append(family)

        def total(name: str, doc: str, value: float) -> None:
            families.append(CounterMetricFamily(name, doc, value=value))

        counter("prfaas_router_routed_total", "Requests routed, per cluster", "cluster", self.routed.items())
        total("prfaas_router_redispatched_total", "Requests routed again after a failure before anything streamed",
              self.redispatched)
        total("prfaas_router_restored_blocks_total", "Blocks taken from the kv-index service's snapshot at start-up",
              self.restored_blocks)
        total("prfaas_router_spilled_total", "Requests whose cluster had no usable prefill worker", self.spilled)
        total("prfaas_router_probes_total", "Requests routed as the controller's probes", self.probes)
        total("prfaas_router_checkpoint_hints_total", "Prefill legs asked for a state checkpoint", self.checkpoint_hints)
        total("prfaas_router_decode_held_tokens_total", "Prompt tokens the chosen decode workers' caches held",
              self.decode_held_tokens)
        counter("prfaas_router_rejected_total", "Requests refused before any worker ran them, per cause", "cause",
                ((c, self.rejected[c]) for c in sorted(set(REJECT_CAUSES) | set(self.rejected))))
        counter("prfaas_router_failed_total", "Requests a worker took that ended in an error, per cause", "cause",
                ((c, self.failed[c]) for c in sorted(set(FAIL_CAUSES) | set(self.failed))))
        counter("prfaas_router_cache_moves_total", "Moves of a cached prefix between clusters, per outcome", "outcome",
                sorted(self.cache_moves.items()))
        families += [self.ttft.family("prfaas_router_ttft_seconds", "Streamed requests: time to the first byte"),
                     self.tbt.family("prfaas_router_tbt_seconds", "Streamed requests: gaps between tokens (a chunk's gap over the decode worker's stream interval)"),
                     self.e2e.family("prfaas_router_request_seconds", "Successful requests: time to the last byte"),
                     self.queue_wait.family("prfaas_router_queue_wait_seconds", "Time waiting in the router for decode room"),
                     self.cache_move.family("prfaas_router_cache_move_seconds", "Time a successful cache move took")]
        return families

    def render(self, gauges: Iterable[GaugeSample]) -> str:
        """:meth:`families` in the Prometheus text format."""
        return exposition(self.families(gauges))
