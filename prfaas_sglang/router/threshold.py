"""Short-term threshold control (paper section 3.4.3), pure: time comes in as ``now_s``.

The router feeds link telemetry (PrfaaS egress utilisation) and PrfaaS queueing
into :meth:`ThresholdController.observe`. When either stays above its high
mark for ``raise_after_s``, the controller re-searches ``t`` with the planner
on the recent incremental-length distribution, with the egress capacity the
link actually shows, and raises ``t`` to at least ``raise_factor`` x its
current value. When both stay below their low marks for ``lower_after_s``
(hysteresis: the low marks sit below the high ones, and lowering waits
longer than raising), ``t`` returns to the baseline (the planner's or the
operator's t for a healthy link).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class ThresholdController:
    baseline_tokens: float  # the planner's t for a healthy link
    research: Callable[[float], float]  # egress capacity (bits/s) -> planner's t for it
    max_tokens: float  # never route less than this would (the workload's longest request)
    high_utilization: float = 0.9
    low_utilization: float = 0.6
    high_queue_s: float = 2.0
    low_queue_s: float = 0.5
    raise_after_s: float = 0.5
    lower_after_s: float = 5.0
    raise_factor: float = 1.25
    threshold_tokens: float = field(init=False)
    _over_since: float | None = field(default=None, init=False)
    _under_since: float | None = field(default=None, init=False)
    history: list[tuple[float, float, str]] = field(default_factory=list, init=False)

    def __post_init__(self):
        if not 0 < self.low_utilization < self.high_utilization:
            raise ValueError("need 0 < low_utilization < high_utilization")
        self.threshold_tokens = self.baseline_tokens

    def observe(self, now_s: float, egress_utilization: float, capacity_bps: float, prfaas_queue_s: float) -> float | None:
        """Feed one telemetry sample; returns the new threshold when it changes, else None."""
        over = egress_utilization >= self.high_utilization or prfaas_queue_s >= self.high_queue_s
        under = egress_utilization <= self.low_utilization and prfaas_queue_s <= self.low_queue_s
        self._over_since = (self._over_since if self._over_since is not None else now_s) if over else None
        self._under_since = (self._under_since if self._under_since is not None else now_s) if under else None

        if over and now_s - self._over_since >= self.raise_after_s:
            searched = self.research(capacity_bps)
            new = min(max(searched, self.threshold_tokens * self.raise_factor), self.max_tokens)
            self._over_since = now_s  # the next raise needs another full window of overload
            return self._set(now_s, new, f"raise: utilization {egress_utilization:.2f}, queue {prfaas_queue_s:.2f} s")
        if under and self.threshold_tokens > self.baseline_tokens and now_s - self._under_since >= self.lower_after_s:
            # Back to the baseline: with little offloaded the link cannot show its capacity,
            # and if it is still short the next saturation raises t again within raise_after_s.
            new = self.baseline_tokens
            self._under_since = now_s
            return self._set(now_s, new, f"lower: utilization {egress_utilization:.2f}, queue {prfaas_queue_s:.2f} s")
        return None

    def override(self, now_s: float, tokens: float | None) -> float:
        """Admin override; ``None`` returns to the baseline."""
        return self._set(now_s, self.baseline_tokens if tokens is None else tokens, "override") or self.threshold_tokens

    def _set(self, now_s: float, tokens: float, why: str) -> float | None:
        if tokens == self.threshold_tokens:
            return None
        self.threshold_tokens = tokens
        self.history.append((now_s, tokens, why))
        return tokens
