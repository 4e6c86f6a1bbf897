"""What a prefill worker's KV egress looks like, measured from its own transfers (pure).

A :class:`LinkMeter` records, per transfer, when it was requested and how many
bytes, each delivered slice (``progress``), and its end. Times are arguments,
never read from a clock here. ``sample`` summarises a sliding window::

    window           [now - window_s, now]
    busy_fraction    share of the window with at least one transfer in flight
    egress_bps       bits delivered in the window / window_s (a slice's bits are spread
                     over the time since its transfer's previous delivery, or since
                     its own write started where the sender says (writes of one
                     transfer on parallel lanes), and only the part inside the
                     window counts)
    offered_bps      bits of transfers *requested* in the window / window_s (demand)
    capacity_bps     bits delivered in the window / busy time that led to them
                     (each transfer's busy time counts up to its last delivery,
                     so a slice still on the wire does not dilute the rate);
                     0.0 when the link was busy most of the window and delivered
                     nothing (a stall); None when too little was measured
    backlog_bytes    requested, not yet delivered
    completed/failed transfers that ended in the window, delivered or not (``end(ok=)``)
    latency_*_s      request to end of the completed ones
    peers            the same per decode peer (``start(peer=)``): egress, demand,
                     in flight, completed, failed, and (v5) busy fraction, capacity and
                     backlog of that peer's transfers alone: a worker whose KV goes to
                     decode peers in several PD clusters crosses a link per cluster

A saturated or throttled link is busy ~100% of the time whatever its nominal
capacity, and delivers ``capacity_bps`` while busy: that pair is what the
router's threshold controller reads. Senders that report progress per write
(the emulated engine's writes last about 0.1 s at a lane's share of the link)
make a drop visible within one write instead of one whole transfer.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, replace

from prfaas_sglang.transport.tcpstate import TcpInterval
from prfaas_sglang.wire.telemetry import LinkSample, PeerView


@dataclass
class _Transfer:
    start_s: float
    total_bytes: int
    peer: str | None = None
    delivered_bytes: int = 0
    last_progress_s: float | None = None


class LinkMeter:
    def __init__(self, window_s: float = 1.0, min_busy_s: float = 0.02):
        if not window_s > 0 or min_busy_s < 0:
            raise ValueError("window_s must be > 0 and min_busy_s >= 0")
        self.window_s = window_s
        self.min_busy_s = min_busy_s
        self._inflight: dict[int, _Transfer] = {}
        self._requested: deque[tuple[float, int, str | None]] = deque()  # (t, bytes, peer)
        self._delivered: deque[tuple[float, float, int, str | None]] = deque()  # (since, t, bytes, peer): over [since, t]
        self._busy: deque[tuple[float, float, str | None]] = deque()  # finished transfers: (start, last delivery, peer)
        self._spans: deque[tuple[float, float, str | None]] = deque()  # finished transfers: (start, end, peer), for busy_fraction
        self._ended: deque[tuple[float, float, str | None, bool]] = deque()  # (end, latency, peer, ok)

    def start(self, transfer_id: int, now_s: float, nbytes: int, peer: str | None = None) -> None:
        """A transfer of ``nbytes`` to ``peer`` (a decode's Mooncake session) was requested (it may
        queue behind others)."""
        self._inflight[transfer_id] = _Transfer(now_s, nbytes, peer)
        self._requested.append((now_s, nbytes, peer))

    def progress(self, transfer_id: int, now_s: float, nbytes: int, since_s: float | None = None) -> None:
        """``nbytes`` more of the transfer reached the peer; ``since_s``: when the write that carried
        them started (its bits are spread over [since_s, now_s]); None: since the transfer's previous
        delivery, as for one write after another. A transfer's writes on parallel lanes land close
        together, each after its own whole duration: without ``since_s`` the later ones would count as
        sent in the moment after the first, and overstate the rate."""
        transfer = self._inflight.get(transfer_id)
        if transfer is None or nbytes <= 0:
            return
        if since_s is not None:
            since = min(max(since_s, transfer.start_s), now_s)
        else:
            since = transfer.last_progress_s if transfer.last_progress_s is not None else transfer.start_s
        transfer.delivered_bytes += nbytes
        transfer.last_progress_s = now_s
        self._delivered.append((since, now_s, nbytes, transfer.peer))

    def end(self, transfer_id: int, now_s: float, ok: bool = True) -> None:
        """The transfer finished, delivered (``ok``) or failed; what it did not deliver leaves the backlog."""
        transfer = self._inflight.pop(transfer_id, None)
        if transfer is None:
            return
        self._ended.append((now_s, now_s - transfer.start_s, transfer.peer, ok))
        self._spans.append((transfer.start_s, now_s, transfer.peer))
        if transfer.last_progress_s is not None:
            self._busy.append((transfer.start_s, transfer.last_progress_s, transfer.peer))

    def sample(self, worker: str, now_s: float, wall_s: float, queue: int = 0) -> LinkSample:
        lo = now_s - self.window_s
        while self._requested and self._requested[0][0] < lo:
            self._requested.popleft()
        while self._delivered and self._delivered[0][1] < lo:
            self._delivered.popleft()
        for q in (self._busy, self._spans):
            while q and q[0][1] < lo:
                q.popleft()
        while self._ended and self._ended[0][0] < lo:
            self._ended.popleft()
        inflight = list(self._inflight.values())
        delivered = _delivered_bits(self._delivered, lo)
        busy_fraction, capacity = self._busy_and_capacity(lo, now_s, sum(delivered.values()), inflight, None)
        latencies = sorted(latency for _, latency, _, ok in self._ended if ok)
        return LinkSample(
            worker=worker, ts=wall_s, egress_bps=sum(delivered.values()) / self.window_s,
            busy_fraction=busy_fraction, capacity_bps=capacity, inflight=len(inflight), queue=queue,
            window_s=self.window_s, offered_bps=8.0 * sum(b for _, b, _ in self._requested) / self.window_s,
            backlog_bytes=sum(max(t.total_bytes - t.delivered_bytes, 0) for t in inflight),
            completed=len(latencies), failed=sum(not ok for *_, ok in self._ended),
            latency_p50_s=latencies[(len(latencies) - 1) // 2] if latencies else None,
            latency_max_s=latencies[-1] if latencies else None,
            peers=self._peers(lo, now_s, delivered, inflight) or None)

    def _busy_and_capacity(self, lo: float, now_s: float, delivered_bits: float, inflight: list[_Transfer],
                           peer: str | None) -> tuple[float, float | None]:
        """(busy fraction, capacity) over the window of every transfer (``peer`` None) or of one peer's."""
        def mine(p: str | None) -> bool:
            return peer is None or p == peer

        mine_inflight = [t for t in inflight if mine(t.peer)]
        busy = _covered(lo, [(s, e) for s, e, p in self._spans if mine(p)] + [(t.start_s, now_s) for t in mine_inflight])
        useful_busy = _covered(lo, [(s, e) for s, e, p in self._busy if mine(p)]
                               + [(t.start_s, t.last_progress_s) for t in mine_inflight if t.last_progress_s is not None])
        if useful_busy >= self.min_busy_s and delivered_bits > 0:
            capacity = delivered_bits / useful_busy
        elif busy >= 0.5 * self.window_s and delivered_bits == 0:
            capacity = 0.0  # busy and nothing delivered: stalled
        else:
            capacity = None
        return min(busy / self.window_s, 1.0), capacity

    def _peers(self, lo: float, now_s: float, delivered: dict[str | None, float],
               inflight: list[_Transfer]) -> dict[str, PeerView]:
        names = {p for _, _, p in self._requested} | {p for *_, p, _ in self._ended} | {t.peer for t in inflight}
        names |= set(delivered)
        names.discard(None)
        out = {}
        for name in sorted(names):
            busy_fraction, capacity = self._busy_and_capacity(lo, now_s, delivered.get(name, 0.0), inflight, name)
            out[name] = PeerView(
                egress_bps=delivered.get(name, 0.0) / self.window_s,
                offered_bps=8.0 * sum(b for _, b, p in self._requested if p == name) / self.window_s,
                inflight=sum(t.peer == name for t in inflight),
                completed=sum(p == name and ok for *_, p, ok in self._ended),
                failed=sum(p == name and not ok for *_, p, ok in self._ended),
                busy_fraction=busy_fraction, capacity_bps=capacity,
                backlog_bytes=sum(max(t.total_bytes - t.delivered_bytes, 0) for t in inflight if t.peer == name))
        return out


def _delivered_bits(delivered, lo: float) -> dict[str | None, float]:
    """Bits delivered inside ``[lo, ...)`` per peer: a slice's bits are spread over the time since
    its transfer's previous delivery, and only the part inside the window counts."""
    out: dict[str | None, float] = {}
    for since, t, b, peer in delivered:
        if t > lo or t == since == lo:
            out[peer] = out.get(peer, 0.0) + 8.0 * (b * (t - max(since, lo)) / (t - since) if t > since else b)
    return out


def _covered(lo: float, intervals: list[tuple[float, float]]) -> float:
    """Length of the union of ``intervals`` clipped to ``[lo, +inf)``."""
    total, cursor = 0.0, lo
    for s, e in sorted((max(s, lo), e) for s, e in intervals):
        s = max(s, cursor)
        if e > s:
            total += e - s
            cursor = e
    return total


def with_tcp_view(sample: LinkSample, interval: TcpInterval | None) -> LinkSample:
    """``sample`` with the kernel's view of its last interval (wire v3): ``tcp`` and ``congested``,
    and, when the connections were backlogged through the interval, their goodput as
    ``capacity_bps`` (the link's rate as this sender sees it, one interval after a change, where the
    transfer-level meter waits for slices to finish)."""
    if interval is None:
        return sample
    capacity = interval.goodput_bps if interval.backlogged and interval.goodput_bps > 0 else sample.capacity_bps
    return replace(sample, tcp=interval.view(), congested=interval.congested, capacity_bps=capacity)
