"""Prometheus text for the router: counters, gauges and fixed-bucket histograms (pure)."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

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
