"""The PrfaaS -> PD link as one view, from every PrfaaS worker's telemetry (pure).

Each PrfaaS prefill worker publishes :class:`~prfaas_sglang.wire.telemetry.LinkSample`
for its own KV egress; they share the link, so the view sums egress, offered
load and backlog, takes the busiest worker's busy fraction, and credits the
link with the capacities delivered while busy (each weighted by its busy
share), and sums what the transfers came to (completed, failed; congested if any worker says
so). A worker silent for ``stale_after_s`` drops out; with nobody fresh the
view is ``None`` (unknown), never a stale utilisation.

Two more things silence and delay tell (telemetry crosses the same network as the KV):

* **Silent while busy is down.** A worker that has published before and goes silent for
  ``stale_after_s`` while the router has work in flight on it (:meth:`note_silence`) is marked
  down: the router routes around it until any sample from it arrives again.
* **Late is stale.** Samples held in a send queue during an outage arrive in a burst when the
  link returns. Each sample's delay (receiver's wall clock less the sender's ``ts``) is compared
  with the smallest delay seen from that worker over ``delay_window_s`` (which absorbs a constant
  clock offset, and v1's monotonic ``ts``); one delayed by more than ``stale_after_s`` beyond it
  is discarded (counted in ``discarded``), not replayed into the controller.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Callable, Sequence

from prfaas_sglang.router.threshold import LinkView
from prfaas_sglang.wire.telemetry import LinkSample


def shared_capacity_bps(parts: Sequence[tuple[float | None, float]]) -> float | None:
    """The capacity of a link that senders (or one sender's peers) share, from each part's
    ``(capacity_bps, busy_fraction)``: each measured capacity weighted by its busy share, over the
    busiest's share (two senders each busy half the time at 20 Mbps made 30 Mbps of it); None when
    no part measured one."""
    measured = [(c, b) for c, b in parts if c is not None]
    if not measured:
        return None
    weight = max(b for _, b in measured)
    return sum(c * b for c, b in measured) / weight if weight > 0 else max(c for c, _ in measured)


def link_share(sample: LinkSample, on_link: Callable[[str], bool]) -> LinkSample:
    """What ``sample`` says of one link: its transfers to the decode peers ``on_link`` accepts (the
    peers of one PD cluster), summed as :class:`LinkAggregator` sums workers. A sample all of whose
    peers are on the link is returned as it is; one without a peer list (v1-v3, or a sender that does
    not name peers) cannot be split and is returned as it is too, for the caller to decide. Of a
    split sample the kernel's TCP view and the latencies are dropped (they cover every peer), and
    ``congested`` is kept only when every peer is on the link."""
    if not sample.peers or all(on_link(p) for p in sample.peers):
        return sample
    mine = [v for p, v in sample.peers.items() if on_link(p)]
    return dataclasses.replace(
        sample, egress_bps=sum(v.egress_bps for v in mine), offered_bps=sum(v.offered_bps for v in mine),
        busy_fraction=max((v.busy_fraction for v in mine), default=0.0),
        capacity_bps=shared_capacity_bps([(v.capacity_bps, v.busy_fraction) for v in mine]),
        inflight=sum(v.inflight for v in mine), backlog_bytes=sum(v.backlog_bytes for v in mine),
        completed=sum(v.completed for v in mine), failed=sum(v.failed for v in mine), tcp=None, congested=False,
        latency_p50_s=None, latency_max_s=None, peers={p: v for p, v in sample.peers.items() if on_link(p)} or None)


class LinkAggregator:
    def __init__(self, stale_after_s: float = 2.0, delay_window_s: float = 120.0):
        self.stale_after_s = stale_after_s
        self.delay_window_s = delay_window_s
        self._latest: dict[str, tuple[float, LinkSample]] = {}
        self._delays: dict[str, deque[tuple[float, float]]] = {}  # worker -> (received wall s, delay s)
        self._down: set[str] = set()
        self.discarded = 0

    def update(self, worker: str, sample: LinkSample, now_s: float, wall_s: float | None = None) -> bool:
        """Take ``sample`` from ``worker``, received at ``now_s`` (monotonic) and ``wall_s`` (the
        receiver's wall clock; None skips the lateness test). Any sample clears ``worker``'s down
        mark (it is heard again); a late one is then discarded. Returns whether it was taken."""
        self._down.discard(worker)
        if wall_s is not None:
            delay = wall_s - sample.ts
            seen = self._delays.setdefault(worker, deque())
            seen.append((wall_s, delay))
            while seen and seen[0][0] < wall_s - self.delay_window_s:
                seen.popleft()
            if delay - min(d for _, d in seen) > self.stale_after_s:
                self.discarded += 1
                return False
        self._latest[worker] = (now_s, sample)
        return True

    def note_silence(self, worker: str, now_s: float, busy: bool) -> None:
        """Mark ``worker`` down if it has published before, is silent past ``stale_after_s`` and the
        router has work in flight on it (``busy``)."""
        heard = self._latest.get(worker)
        if busy and heard is not None and now_s - heard[0] > self.stale_after_s:
            self._down.add(worker)

    def down(self) -> frozenset[str]:
        """Workers silent while busy, not heard from since."""
        return frozenset(self._down)

    def forget(self, worker: str) -> None:
        self._latest.pop(worker, None)
        self._delays.pop(worker, None)
        self._down.discard(worker)

    def fresh(self, now_s: float) -> dict[str, LinkSample]:
        return {w: s for w, (t, s) in self._latest.items() if now_s - t <= self.stale_after_s}

    def view(self, now_s: float) -> LinkView | None:
        samples = list(self.fresh(now_s).values())
        if not samples:
            return None
        busy = max(s.busy_fraction for s in samples)
        capacity = shared_capacity_bps([(s.capacity_bps, s.busy_fraction) for s in samples])
        return LinkView(capacity, busy, sum(s.egress_bps for s in samples), sum(s.offered_bps for s in samples),
                        sum(s.backlog_bytes for s in samples), any(s.congested for s in samples),
                        sum(s.completed for s in samples), sum(s.failed for s in samples))
