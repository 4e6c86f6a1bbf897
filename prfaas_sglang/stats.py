"""Small statistics shared by the benchmarks and the simulator (pure)."""

from __future__ import annotations

from collections.abc import Iterable


def percentile(values: Iterable[float | None], q: float) -> float | None:
    """The nearest-rank ``q`` quantile (0 <= q <= 1) of the values that are not None; None if there are none."""
    ordered = sorted(v for v in values if v is not None)
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)] if ordered else None
