"""The router's counters and histograms, and their Prometheus text (pure).

Causes are labels: ``rejected{cause}`` counts requests refused before any
worker ran them (no worker, no decode room in time, queue full, estimated
TTFT over the limit, bad request); ``failed{cause}`` requests that a worker
took and that still ended in an error.
"""

from __future__ import annotations

import bisect
import collections
from dataclasses import dataclass, field

# Causes exported at 0 before they first happen (a dashboard's rate() then has a series to read)
REJECT_CAUSES = ("bad_request", "no_decode_room", "no_worker", "queue_full", "too_large", "ttft_estimate",
                 "unknown_model", "worker_4xx")
FAIL_CAUSES = ("decode", "prefill")
LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


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

    def render(self, name: str, labels: str = "") -> str:
        lines = [f"# TYPE {name} histogram"]
        cumulative = 0
        sep = "," if labels else ""
        for bound, count in zip((*self.buckets, float("inf")), self.counts, strict=True):
            cumulative += count
            le = "+Inf" if bound == float("inf") else f"{bound:g}"
            lines.append(f'{name}_bucket{{{labels}{sep}le="{le}"}} {cumulative}')
        lines.append(f"{name}_sum{{{labels}}} {self.total}" if labels else f"{name}_sum {self.total}")
        lines.append(f"{name}_count{{{labels}}} {self.n}" if labels else f"{name}_count {self.n}")
        return "\n".join(lines) + "\n"


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
    tbt: Histogram = field(default_factory=Histogram)  # streamed requests: gaps between chunks
    e2e: Histogram = field(default_factory=Histogram)  # every successful request
    queue_wait: Histogram = field(default_factory=Histogram)  # waiting in the router for decode room
    cache_moves: collections.Counter = field(default_factory=collections.Counter)  # outcome -> moves of a cached prefix
    cache_move: Histogram = field(default_factory=Histogram)  # seconds a successful move took

    def render(self, gauges: list[tuple[str, str, float]]) -> str:
        """Prometheus text: ``gauges`` as (name, labels, value), then every counter and histogram."""
        rows = [(n, "gauge", labels, v) for n, labels, v in gauges]
        rows += [("prfaas_router_routed_total", "counter", f'{{cluster="{c}"}}', n) for c, n in self.routed.items()]
        rows += [("prfaas_router_redispatched_total", "counter", "", self.redispatched),
                 ("prfaas_router_restored_blocks_total", "counter", "", self.restored_blocks),
                 ("prfaas_router_spilled_total", "counter", "", self.spilled),
                 ("prfaas_router_probes_total", "counter", "", self.probes),
                 ("prfaas_router_checkpoint_hints_total", "counter", "", self.checkpoint_hints),
                 ("prfaas_router_decode_held_tokens_total", "counter", "", self.decode_held_tokens)]
        rows += [("prfaas_router_rejected_total", "counter", f'{{cause="{c}"}}', self.rejected[c])
                 for c in sorted(set(REJECT_CAUSES) | set(self.rejected))]
        rows += [("prfaas_router_failed_total", "counter", f'{{cause="{c}"}}', self.failed[c])
                 for c in sorted(set(FAIL_CAUSES) | set(self.failed))]
        rows += [("prfaas_router_cache_moves_total", "counter", f'{{outcome="{c}"}}', n)
                 for c, n in sorted(self.cache_moves.items())]
        text, typed = [], set()
        for name, kind, labels, value in rows:
            if name not in typed:
                text.append(f"# TYPE {name} {kind}\n")
                typed.add(name)
            text.append(f"{name}{labels} {value}\n")
        return ("".join(text) + self.ttft.render("prfaas_router_ttft_seconds") + self.tbt.render("prfaas_router_tbt_seconds")
                + self.e2e.render("prfaas_router_request_seconds") + self.queue_wait.render("prfaas_router_queue_wait_seconds")
                + self.cache_move.render("prfaas_router_cache_move_seconds"))
