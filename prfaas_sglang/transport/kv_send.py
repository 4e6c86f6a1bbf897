"""Sending a chunk's KV without waiting for it: coalescing and the per-session ledger (pure).

SGLang's Mooncake sender hands us each chunk's KV as ``(src, dst, length)`` entries
(one per layer, K and V, per run of contiguous pages). :func:`coalesce` merges
entries that continue each other on both sides, so the transfer engine gets fewer,
larger requests (a TCP lane carries one request at a time and waits an RTT for its
acknowledgement). A :class:`SendLedger` then keeps, per decode session, each chunk as
one *batch* (one metered transfer): its entries queued here, then its single-entry
asynchronous writes in flight, identified by the engine's ids. The ledger never talks
to the engine: :meth:`SendLedger.take` says what to submit, :meth:`SendLedger.reap`
takes the engine's status function as an argument, and times come in as arguments.

Why entries wait here rather than in the engine: Mooncake 0.3.13 cannot cancel a request.
A request queued in its per-peer FIFO when the link goes dark stays queued through the
lanes' stall timeout and is sent on a reconnected lane once the link returns, seconds or
minutes after its room was failed on both sides and its decode pages freed (measured:
tests/transport/test_sglang_session_recovery.py). So the ledger hands the engine at most
``limit`` writes per session at once (``limit`` = the engine's lanes per peer: each write
then goes straight onto a lane, and none waits in the engine's queue), and a failed
session's queued entries are dropped here, never sent.

Statuses (Mooncake's ``transfer_check_status``): 1 done, 0 pending, -1 failed,
-2 timed out. A status function must be called at most once per id after that id is
done, as Mooncake frees a batch once it reports its end.

Contract: ``add`` a chunk's entries; ``take`` what may be submitted now and report each
submission with ``started`` (or ``refused``, which fails the session); ``reap`` whenever
convenient (it only reads statuses and drops what ended); ``failed`` says whether any write
to a session has failed since the last :meth:`SendLedger.forget`, which also abandons the
session's batches then queued or in flight (their rooms fail; their queued entries are
dropped; a later failure of their writes in flight is not a new one); ``pending`` and
``in_flight`` count what is still awaited. The caller serialises access (one lock).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

DONE, PENDING, FAILED, TIMED_OUT = 1, 0, -1, -2
MAX_WRITE_BYTES = 16 << 20  # split_even: a 64 MiB chunk as one write per lane on 4 lanes (bench transport's ours)
MIN_WRITE_BYTES = 1 << 20  # split_even: below this a lane's RTT of idle per write dominates (1 MiB: 0.69 of 1 Gbit/s)
WRITE_S = 0.1  # timed_write_bytes: how long one write should take at its lane's share of the link

Entry = tuple[int, int, int]  # (src, dst, length)


# The sender's counters as metrics, one table for every /metrics that shows them (the emulated
# engine's text and a real SGLang worker's prometheus_client): counters() key -> (name, type, help).
SENDER_METRICS = (
    ("writes_submitted", "prfaas:kv_writes_submitted_total", "counter", "KV writes handed to the transfer engine"),
    ("writes_failed", "prfaas:kv_writes_failed_total", "counter", "KV writes that failed or the engine refused"),
    ("writes_retried", "prfaas:kv_writes_retried_total", "counter", "KV writes handed to the engine again"),
    ("pacing_changes", "prfaas:kv_lane_pacing_changes_total", "counter", "changes of the lanes' pacing cap"),
    ("in_flight_bytes", "prfaas:kv_send_in_flight_bytes", "gauge", "KV bytes queued or on the wire now"),
    ("staged_bytes", "prfaas:kv_staged_bytes_total", "counter",
     "KV bytes gathered into the staging buffer and sent as one write per destination run"),
)


def coalesce(blocks: Iterable[tuple[int, int, int]]) -> list[Entry]:
    """``(src, dst, length)`` entries with each one that continues the previous on both
    sides (``src + length`` and ``dst + length`` are the next entry's) merged into it;
    order kept, lengths summed. Zero-length entries are dropped."""
    out: list[Entry] = []
    for src, dst, length in blocks:
        src, dst, length = int(src), int(dst), int(length)
        if length <= 0:
            continue
        if out:
            last_src, last_dst, last_len = out[-1]
            if last_src + last_len == src and last_dst + last_len == dst:
                out[-1] = (last_src, last_dst, last_len + length)
                continue
        out.append((src, dst, length))
    return out


def split_even(src: int, dst: int, length: int, lanes: int, max_write_bytes: int = MAX_WRITE_BYTES,
               min_write_bytes: int = MIN_WRITE_BYTES) -> list[Entry]:
    """One region contiguous on both sides as writes of near-equal size, in order, covering it
    exactly (lengths differ by at most one byte)::

        [src, src + length)  ->  | w0 | w1 | ... | w(n-1) |    each w_i to dst + (w_i's offset)

    n is a multiple of ``lanes`` (every lane carries a write of each round, so the lanes end
    together: :mod:`~prfaas_sglang.transport.lane_pacing` can keep them level), as few rounds as keep
    each write at most ``max_write_bytes``; a region under ``lanes * min_write_bytes`` goes as fewer
    writes of at least ``min_write_bytes`` (one when it is smaller). The writes continue each other on
    both sides: hand them to the engine as they are, not through :func:`coalesce`."""
    if lanes < 1 or min_write_bytes < 1 or max_write_bytes < min_write_bytes:
        raise ValueError("need lanes >= 1 and 1 <= min_write_bytes <= max_write_bytes")
    if length <= 0:
        return []
    per_round = max(1, min(lanes, length // min_write_bytes))
    n = per_round * -(-length // (per_round * max_write_bytes))
    size, extra = divmod(length, n)
    out: list[Entry] = []
    off = 0
    for i in range(n):
        w = size + (i < extra)
        out.append((src + off, dst + off, w))
        off += w
    return out


def timed_write_bytes(rate_bps: float | None, lanes: int, write_s: float = WRITE_S) -> int:
    """The write size for a sender whose transfer meter must see the link (the emulated engine's
    ``LinkMeter`` counts a write's bytes when it lands): what one lane carries in ``write_s`` at an
    equal share of ``rate_bps``, within [MIN_WRITE_BYTES, MAX_WRITE_BYTES]; MIN_WRITE_BYTES when the
    rate is not known. Larger writes would lose less to the RTT each costs its lane (at 1 Gbit/s,
    20 ms: 3 MiB writes idle a lane about a sixth of the time, 16 MiB ones a twenty-fifth), but
    the meter would then see nothing for longer than its window, and report a stall."""
    if rate_bps is None or rate_bps <= 0:
        return MIN_WRITE_BYTES
    share = rate_bps / 8 / max(lanes, 1) * write_s
    return int(min(MAX_WRITE_BYTES, max(MIN_WRITE_BYTES, share)))


@dataclass(frozen=True)
class Write:
    """One entry handed to the engine: what it writes, when, and how many times it was handed before."""

    entry: Entry
    started_s: float
    attempt: int = 0

    @property
    def length(self) -> int:
        return self.entry[2]


@dataclass
class Batch:
    """One chunk's writes to one session: entries not yet submitted, engine ids -> writes still in
    flight, entries to hand again later, and its meter handle. ``held``: what the sender has yet to turn
    into entries (in order, each with a ``length`` in bytes; e.g. KV runs waiting for room in a staging
    buffer); the ledger only counts it, and drops it with the unsent entries."""

    session: str
    queued: deque[Entry]
    meter_id: int | None = None
    held: deque = field(default_factory=deque)
    writes: dict[int, Write] = field(default_factory=dict)  # engine id -> write, submitted and still in flight
    retries: list[tuple[float, Entry]] = field(default_factory=list)  # (not before, entry): failed fast, handed again
    delivered_bytes: int = 0
    failed: bool = False
    reported: bool = False  # the caller recorded its outcome (at its first failure or its end)
    abandoned: bool = False  # its session's failure was handed on: its rooms are failed, nobody waits for it
    listener: object | None = None  # the submitter's, not the ledger's: told its bytes and outcome (AsyncKvSender.send)

    @property
    def ended(self) -> bool:
        return not self.writes and not self.queued and not self.retries and not self.held

    def drop_unsent(self) -> None:
        self.queued.clear()
        self.retries.clear()
        self.held.clear()


@dataclass
class Ended:
    """What :meth:`SendLedger.reap` saw finish: bytes delivered by one write, and whether its batch ended."""

    batch: Batch
    delivered_bytes: int
    batch_done: bool
    started_s: float | None = None  # when the write was handed to the engine (the caller's clock)


@dataclass
class SendLedger:
    """``retry_within_s``: a write that fails within this long of being handed to the engine is handed
    once more, ``retry_after_s`` later, before it counts as failed (None: never). A failure that fast
    is the engine's, before the write had a connection: Mooncake 0.3.13 fails every request at once
    when all of a peer's lanes have died and each was tried in the current connect round (as after an
    outage), and only starts a new round after its 1 s cooldown. Writing the same bytes to the same
    place again is harmless; the room is still live (a failed session drops its retries)."""

    retry_within_s: float | None = None
    retry_after_s: float = 1.2
    batches: list[Batch] = field(default_factory=list)
    _failed_sessions: set[str] = field(default_factory=set)
    retried: int = 0  # writes handed again

    def add(self, session: str, entries: Iterable[Entry], meter_id: int | None = None, held: Iterable = ()) -> Batch:
        """Queue one chunk's entries to ``session`` as a batch (sent in order by :meth:`take`), and what
        the sender will turn into more of them (``held``, see :class:`Batch`)."""
        batch = Batch(session, deque(entries), meter_id, deque(held))
        self.batches.append(batch)
        return batch

    def take(self, session: str, limit: int, now_s: float) -> list[tuple[Batch, Entry, int]]:
        """``(batch, entry, attempt)`` to submit now to ``session``, retries that are due first, then
        the oldest batch's entries, so that at most ``limit`` of its writes are in flight (abandoned
        ones included: they still occupy the engine's lanes). Each comes off its batch: report it with
        :meth:`started` or :meth:`refused`. Nothing goes to a session whose write failed until the
        failure is handed on (:meth:`forget`)."""
        if session in self._failed_sessions:
            return []
        mine = [b for b in self.batches if b.session == session]
        room = limit - self.writes_in_flight(session)
        out: list[tuple[Batch, Entry, int]] = []
        for batch in mine:
            for due in [r for r in batch.retries if r[0] <= now_s][:max(room, 0)]:
                batch.retries.remove(due)
                out.append((batch, due[1], 1))
                room -= 1
        for batch in mine:
            while room > 0 and batch.queued and not batch.abandoned:
                out.append((batch, batch.queued.popleft(), 0))
                room -= 1
        return out

    def next_retry_s(self) -> float | None:
        """When the earliest retry falls due (None: none waits)."""
        return min((t for b in self.batches for t, _ in b.retries), default=None)

    def started(self, batch: Batch, write_id: int, entry: Entry, now_s: float, attempt: int = 0) -> None:
        batch.writes[write_id] = Write(entry, now_s, attempt)

    def refused(self, batch: Batch) -> None:
        """The engine refused one of ``batch``'s entries (id 0: unknown session, no route): the batch
        and its session have failed, and its entries not yet sent are dropped."""
        batch.failed = True
        batch.drop_unsent()
        self._failed_sessions.add(batch.session)
        self._drop_ended()

    def sessions_to_feed(self, now_s: float) -> list[str]:
        """Sessions with entries queued or retries due."""
        return list(dict.fromkeys(b.session for b in self.batches
                                  if b.queued or any(t <= now_s for t, _ in b.retries)))

    def reap(self, status: Callable[[int], int], now_s: float, session: str | None = None) -> list[Ended]:
        """Read the status of every write in flight (of ``session``, or all) and drop those that ended;
        return what ended. A write that failed fast, the first time, waits to be handed again instead
        (see the class). Any other failed or timed-out write marks its batch and session failed and
        drops its batch's entries not yet sent; the session's other batches keep theirs, unsent, until
        :meth:`forget`. Each id is read until it reports its end, never after."""
        ended: list[Ended] = []
        for batch in list(self.batches):
            if session is not None and batch.session != session:
                continue
            for write_id, write in list(batch.writes.items()):
                code = status(write_id)
                if code == PENDING:
                    continue
                del batch.writes[write_id]
                if code == DONE:
                    batch.delivered_bytes += write.length
                    ended.append(Ended(batch, write.length, batch.ended, write.started_s))
                    continue
                fast = self.retry_within_s is not None and now_s - write.started_s <= self.retry_within_s
                if fast and write.attempt == 0 and not batch.abandoned and batch.session not in self._failed_sessions:
                    batch.retries.append((now_s + self.retry_after_s, write.entry))
                    self.retried += 1
                    continue
                batch.failed = True
                batch.drop_unsent()
                if not batch.abandoned:
                    self._failed_sessions.add(batch.session)
                ended.append(Ended(batch, 0, batch.ended))
        self._drop_ended()
        return ended

    def _drop_ended(self) -> None:
        self.batches = [b for b in self.batches if not b.ended]

    def pending(self, session: str) -> bool:
        """Whether a write to ``session`` that somebody waits for is queued or in flight (abandoned ones aside)."""
        return any(b.session == session and not b.ended and not b.abandoned for b in self.batches)

    def in_flight(self, session: str) -> int:
        """Batches to ``session`` queued or in flight, abandoned ones aside."""
        return sum(b.session == session and not b.abandoned for b in self.batches)

    def writes_in_flight(self, session: str) -> int:
        """Writes to ``session`` the engine holds now, abandoned ones included."""
        return sum(len(b.writes) for b in self.batches if b.session == session)

    def all_writes(self) -> list[Write]:
        """Every write the engine holds now, to any session, abandoned ones included."""
        return [w for b in self.batches for w in b.writes.values()]

    def waiting(self) -> bool:
        """Whether any entry, to any session, is queued here or waits to be handed again."""
        return any(b.queued or b.retries or b.held for b in self.batches)

    def failed(self, session: str) -> bool:
        return session in self._failed_sessions

    def forget(self, session: str) -> None:
        """Hand ``session``'s failure on: clear it and abandon its batches (their rooms are failed):
        entries not yet sent are dropped, never sent; writes in flight (Mooncake cannot cancel them)
        are still read until they end."""
        self._failed_sessions.discard(session)
        for batch in self.batches:
            if batch.session == session:
                batch.abandoned = True
                batch.drop_unsent()
        self._drop_ended()

    def in_flight_bytes(self) -> int:
        """Bytes held or queued here, waiting for a retry, or in flight in the engine."""
        return sum(sum(w.length for w in b.writes.values()) + sum(n for _, _, n in b.queued)
                   + sum(e[2] for _, e in b.retries) + sum(h.length for h in b.held) for b in self.batches)
