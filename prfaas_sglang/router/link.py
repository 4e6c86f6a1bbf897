"""The PrfaaS -> PD link as one view, from every PrfaaS worker's telemetry (pure).

Each PrfaaS prefill worker publishes :class:`~prfaas_sglang.wire.telemetry.LinkSample`
for its own KV egress; they share the link, so the view sums egress, offered
load and backlog, takes the busiest worker's busy fraction, and credits the
link with the capacities delivered while busy (each weighted by its busy
share), and sums what the transfers came to (completed, failed; congested if any worker says
so). A worker silent for ``stale_after_s`` drops out; with nobody fresh the
view is ``None`` (unknown), never a stale utilisation.
"""

from __future__ import annotations

from prfaas_sglang.router.threshold import LinkView
from prfaas_sglang.wire.telemetry import LinkSample


class LinkAggregator:
    def __init__(self, stale_after_s: float = 2.0):
        self.stale_after_s = stale_after_s
        self._latest: dict[str, tuple[float, LinkSample]] = {}

    def update(self, worker: str, sample: LinkSample, now_s: float) -> None:
        self._latest[worker] = (now_s, sample)

    def forget(self, worker: str) -> None:
        self._latest.pop(worker, None)

    def fresh(self, now_s: float) -> dict[str, LinkSample]:
        return {w: s for w, (t, s) in self._latest.items() if now_s - t <= self.stale_after_s}

    def view(self, now_s: float) -> LinkView | None:
        samples = list(self.fresh(now_s).values())
        if not samples:
            return None
        busy = max(s.busy_fraction for s in samples)
        measured = [s for s in samples if s.capacity_bps is not None]
        capacity = None
        if measured:
            weight = max(s.busy_fraction for s in measured)
            capacity = (sum(s.capacity_bps * s.busy_fraction for s in measured) / weight) if weight > 0 \
                else max(s.capacity_bps for s in measured)
        return LinkView(capacity, busy, sum(s.egress_bps for s in samples), sum(s.offered_bps for s in samples),
                        sum(s.backlog_bytes for s in samples), any(s.congested for s in samples),
                        sum(s.completed for s in samples), sum(s.failed for s in samples))
