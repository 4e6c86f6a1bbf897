"""Sending a chunk's KV without waiting for it: coalescing and the per-session ledger (pure).

SGLang's Mooncake sender hands us each chunk's KV as ``(src, dst, length)`` entries
(one per layer, K and V, per run of contiguous pages). :func:`coalesce` merges
entries that continue each other on both sides, so the transfer engine gets fewer,
larger requests (a TCP lane carries one request at a time and waits an RTT for its
acknowledgement). A :class:`SendLedger` then remembers, per decode session, the
asynchronous writes still in flight: each chunk is one *batch* (one metered transfer)
of single-entry writes, identified by the engine's ids. The ledger never talks to the
engine: :meth:`SendLedger.reap` takes the engine's status function as an argument, and
times come in as arguments.

Statuses (Mooncake's ``transfer_check_status``): 1 done, 0 pending, -1 failed,
-2 timed out. A status function must be called at most once per id after that id is
done, as Mooncake frees a batch once it reports its end.

Contract: ``add`` after a successful submission; ``reap`` whenever convenient (it only
reads statuses and drops what ended); ``failed`` says whether any write to a session has
failed since the last :meth:`SendLedger.forget`, which also abandons the session's batches
then in flight (their rooms fail; a later failure of theirs is not a new one); ``pending``
and ``in_flight`` count what is still awaited. The caller serialises access (one lock).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

DONE, PENDING, FAILED, TIMED_OUT = 1, 0, -1, -2


def coalesce(blocks: Iterable[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """``(src, dst, length)`` entries with each one that continues the previous on both
    sides (``src + length`` and ``dst + length`` are the next entry's) merged into it;
    order kept, lengths summed. Zero-length entries are dropped."""
    out: list[tuple[int, int, int]] = []
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


@dataclass
class Batch:
    """One chunk's writes to one session: engine ids -> bytes, and its meter handle."""

    session: str
    writes: dict[int, int]  # engine id -> bytes, still in flight
    total_bytes: int
    meter_id: int | None = None
    delivered_bytes: int = 0
    failed: bool = False
    reported: bool = False  # the caller recorded its outcome (at its first failure or its end)
    abandoned: bool = False  # its session's failure was handed on: its rooms are failed, nobody waits for it


@dataclass
class Ended:
    """What :meth:`SendLedger.reap` saw finish: bytes delivered by one write, and whether its batch ended."""

    batch: Batch
    delivered_bytes: int
    batch_done: bool


@dataclass
class SendLedger:
    batches: list[Batch] = field(default_factory=list)
    _failed_sessions: set[str] = field(default_factory=set)

    def add(self, session: str, writes: dict[int, int], meter_id: int | None = None) -> Batch:
        batch = Batch(session, dict(writes), sum(writes.values()), meter_id)
        self.batches.append(batch)
        return batch

    def reap(self, status: Callable[[int], int], session: str | None = None) -> list[Ended]:
        """Read the status of every write in flight (of ``session``, or all), drop those that
        ended, and return what ended (a failed or timed-out write marks its batch and session
        failed). Each id is read until it reports its end, never after."""
        ended: list[Ended] = []
        for batch in list(self.batches):
            if session is not None and batch.session != session:
                continue
            for write_id, nbytes in list(batch.writes.items()):
                code = status(write_id)
                if code == PENDING:
                    continue
                del batch.writes[write_id]
                ok = code == DONE
                if ok:
                    batch.delivered_bytes += nbytes
                else:
                    batch.failed = True
                    if not batch.abandoned:
                        self._failed_sessions.add(batch.session)
                ended.append(Ended(batch, nbytes if ok else 0, not batch.writes))
            if not batch.writes:
                self.batches.remove(batch)
        return ended

    def pending(self, session: str) -> bool:
        """Whether a write to ``session`` that somebody waits for is in flight (abandoned ones aside)."""
        return any(b.session == session and b.writes and not b.abandoned for b in self.batches)

    def in_flight(self, session: str) -> int:
        """Batches to ``session`` in flight, abandoned ones aside."""
        return sum(b.session == session and not b.abandoned for b in self.batches)

    def failed(self, session: str) -> bool:
        return session in self._failed_sessions

    def fail(self, session: str) -> None:
        """A write to ``session`` could not even be submitted: the session has failed."""
        self._failed_sessions.add(session)

    def forget(self, session: str) -> None:
        """Hand ``session``'s failure on: clear it and abandon its batches in flight (their rooms
        are failed; Mooncake cannot cancel their writes, which are still read until they end)."""
        self._failed_sessions.discard(session)
        for batch in self.batches:
            if batch.session == session:
                batch.abandoned = True

    def in_flight_bytes(self) -> int:
        return sum(sum(b.writes.values()) for b in self.batches)
