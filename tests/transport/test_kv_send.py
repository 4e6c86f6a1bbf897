"""Asynchronous KV sending inside SGLang's Mooncake backend (the ``kv-send`` hooks).

Pure parts first: :func:`coalesce` and the :class:`SendLedger` (statuses from a scripted
function). Then SGLang's own Mooncake classes on CPU (``sglang_mooncake_probe.py``: bootstrap
server, prefill and decode managers over host buffers, real TCP on loopback, the plugin's
``register()``), as the launcher starts a PrfaaS worker with ``PRFAAS_KV_ASYNC_SEND=1``: the KV
of three requests in three chunks each arrives intact and every chunk was submitted
asynchronously; a request whose transfer the engine refuses fails on both sides, as with
SGLang's synchronous batches, and the next request goes through; the meter sees every byte.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import types

import pytest
from sglang_cpu import run_probe

from prfaas_sglang.adapters.sockopts import (
    KeepAlive,
    KeepAliveSettings,
    ResetOnClose,
    keepalive_of,
    linger_reset,
    mooncake_connections,
)
from prfaas_sglang.demo.cluster import PortPicker
from prfaas_sglang.transport.kv_send import (
    DONE,
    FAILED,
    PENDING,
    TIMED_OUT,
    SendLedger,
    coalesce,
    split_even,
    timed_write_bytes,
)
from prfaas_sglang.transport.kv_sender import AsyncKvSender, DetachedManager

CHUNKS, REQUESTS, BUFFERS, PAGES_PER_CHUNK = 3, 3, 8, 64


def test_coalesce_merges_only_what_continues_on_both_sides():
    blocks = [(100, 1000, 10), (110, 1010, 5), (115, 2000, 5), (120, 2006, 5), (125, 2011, 0), (125, 2011, 2),
              (300, 3000, 1)]
    # src continues at 115 but dst does not; 120 -> 125 continues on both sides past an empty entry.
    assert coalesce(blocks) == [(100, 1000, 15), (115, 2000, 5), (120, 2006, 7), (300, 3000, 1)]
    assert coalesce([]) == []
    assert coalesce([(1, 2, 3)] * 1) == [(1, 2, 3)]


MiB = 1 << 20


@pytest.mark.parametrize("length", [1, 4095, MiB - 1, MiB, 3 * MiB + 7, 4 * MiB, 17 * MiB, 64 * MiB, 64 * MiB + 1,
                                    120 * MiB, 1 << 30])
@pytest.mark.parametrize("lanes", [1, 3, 4, 16])
def test_split_even_covers_the_region_in_near_equal_writes_a_multiple_of_the_lanes(length, lanes):
    writes = split_even(1000, 5000, length, lanes, max_write_bytes=16 * MiB, min_write_bytes=MiB)
    offsets = [src - 1000 for src, _, _ in writes]
    assert [dst - src for src, dst, _ in writes] == [4000] * len(writes)  # each lands where its bytes are
    assert offsets == [sum(n for _, _, n in writes[:i]) for i in range(len(writes))]  # in order, no gap, no overlap
    assert sum(n for _, _, n in writes) == length
    sizes = [n for _, _, n in writes]
    assert max(sizes) - min(sizes) <= 1 and max(sizes) <= 16 * MiB
    if length >= lanes * MiB:  # every lane gets a write in every round
        assert len(writes) % lanes == 0 and min(sizes) >= MiB
    else:  # a small region: fewer, larger writes, none below the floor unless it is one
        assert len(writes) == max(1, length // MiB) and (len(writes) == 1 or min(sizes) >= MiB)


def test_split_even_examples_and_bad_arguments():
    assert [n for _, _, n in split_even(0, 0, 64 * MiB, 4)] == [16 * MiB] * 4  # one write per lane: pacing's shape
    assert [n for _, _, n in split_even(0, 0, 256 * MiB, 4)] == [16 * MiB] * 16
    assert len(split_even(0, 0, 65 * MiB, 4)) == 8  # two rounds rather than one write above 16 MiB
    assert split_even(0, 0, 0, 4) == []
    for bad in ({"lanes": 0}, {"lanes": 4, "min_write_bytes": 0}, {"lanes": 4, "max_write_bytes": 1, "min_write_bytes": 2}):
        with pytest.raises(ValueError):
            split_even(0, 0, MiB, **bad)


def test_a_metered_senders_writes_last_about_a_tenth_of_a_second_at_a_lanes_share():
    assert timed_write_bytes(1e9, 4) == int(1e9 / 8 / 4 * 0.1)  # ~3 MiB: 0.1 s at 250 Mbit/s
    assert timed_write_bytes(100e9, 4) == 16 * MiB  # a fast link: capped, the RTT per write weighs little there
    assert timed_write_bytes(40e6, 4) == MiB  # a slow link: the floor
    assert timed_write_bytes(None, 4) == MiB == timed_write_bytes(0.0, 4)  # no stated link


def _submit_all(ledger: SendLedger, session: str, limit: int, ids, now_s: float = 0.0) -> list[int]:
    """Take what ``limit`` allows and report each as started under the next id from ``ids``."""
    out = []
    for batch, entry, attempt in ledger.take(session, limit, now_s):
        write_id = next(ids)
        ledger.started(batch, write_id, entry, now_s, attempt)
        out.append(write_id)
    return out


class TestSendLedger:
    def test_a_write_is_read_until_it_ends_and_never_after(self):
        script = {1: [PENDING, DONE], 2: [PENDING, PENDING, FAILED], 3: [TIMED_OUT]}
        reads: list[int] = []

        def status(write_id: int) -> int:
            reads.append(write_id)
            return script[write_id].pop(0)

        ledger, ids = SendLedger(), iter(range(1, 100))
        a = ledger.add("d0", [(0, 0, 100), (100, 500, 50)])
        ledger.add("d1", [(0, 0, 10)])
        assert _submit_all(ledger, "d0", 4, ids) == [1, 2] and _submit_all(ledger, "d1", 4, ids) == [3]
        assert ledger.reap(status, 1.0, "d0") == [] and ledger.pending("d0") and ledger.pending("d1")
        ended = ledger.reap(status, 2.0)
        assert [(e.delivered_bytes, e.batch_done) for e in ended] == [(100, False), (0, True)]  # write 1; write 3 timed out
        assert ledger.failed("d1") and not ledger.failed("d0") and not ledger.pending("d1")
        ended = ledger.reap(status, 3.0)
        assert [(e.batch is a, e.delivered_bytes, e.batch_done) for e in ended] == [(True, 0, True)]
        assert a.failed and a.delivered_bytes == 100 and ledger.failed("d0") and ledger.batches == []
        assert ledger.reap(status, 4.0) == [] and reads == [1, 2, 1, 2, 3, 2]  # nothing read after its end
        ledger.forget("d0")
        assert not ledger.failed("d0") and ledger.in_flight_bytes() == 0

    def test_at_most_limit_writes_per_session_are_handed_out_oldest_chunk_first(self):
        ledger, ids = SendLedger(), iter(range(1, 100))
        first = ledger.add("d0", [(i, i, 10) for i in range(0, 30, 10)])
        second = ledger.add("d0", [(i, i, 10) for i in range(100, 130, 10)])
        ledger.add("d1", [(0, 0, 7)])
        taken = ledger.take("d0", 4, 0.0)
        assert [b for b, _, _ in taken] == [first] * 3 + [second]  # in order, across chunks, up to the limit
        for batch, entry, attempt in taken:
            ledger.started(batch, next(ids), entry, 0.0, attempt)
        assert ledger.take("d0", 4, 0.0) == [] and ledger.writes_in_flight("d0") == 4
        assert _submit_all(ledger, "d1", 4, ids) == [5]  # another session's lanes are its own
        ledger.reap(lambda i: DONE if i == 2 else PENDING, 1.0)
        assert _submit_all(ledger, "d0", 4, ids) == [6] and list(second.queued) == [(120, 120, 10)]  # one lane free
        assert ledger.in_flight_bytes() == 4 * 10 + 7 + 10  # in flight in the engine, and queued here

    def test_a_failure_stops_the_sessions_queue_and_forget_drops_it_unsent(self):
        ledger, ids = SendLedger(), iter(range(1, 100))
        a = ledger.add("d0", [(i, i, 10) for i in range(0, 60, 10)])
        b = ledger.add("d0", [(100, 100, 10)])
        assert _submit_all(ledger, "d0", 2, ids) == [1, 2]
        ended = ledger.reap(lambda i: FAILED if i == 1 else PENDING, 5.0)
        assert [(e.batch is a, e.batch_done) for e in ended] == [(True, False)]  # write 2 still on its lane
        assert ledger.failed("d0") and not a.queued and ledger.take("d0", 10, 5.0) == []  # nothing more goes out
        assert list(b.queued) == [(100, 100, 10)] and ledger.pending("d0")
        ledger.forget("d0")  # SGLang failed the rooms and blacklisted the session
        assert not b.queued and b not in ledger.batches and not ledger.pending("d0") and ledger.in_flight("d0") == 0
        assert ledger.writes_in_flight("d0") == 1 and ledger.take("d0", 2, 5.0) == []  # its lane is still taken ...
        assert ledger.in_flight_bytes() == 10  # ... and still read until it ends
        ended = ledger.reap(lambda i: DONE, 6.0)
        assert [e.delivered_bytes for e in ended] == [10] and not ledger.failed("d0") and ledger.batches == []

    def test_a_refused_entry_fails_its_chunk_and_session(self):
        ledger, ids = SendLedger(), iter(range(1, 100))
        a = ledger.add("d0", [(0, 0, 10), (10, 10, 10), (20, 20, 10)])
        batch, _, _ = ledger.take("d0", 1, 0.0)[0]
        ledger.refused(batch)
        assert a.failed and ledger.failed("d0") and a not in ledger.batches and ledger.take("d0", 4, 0.0) == []
        ledger.forget("d0")
        assert _submit_all(ledger, "d0", 4, ids) == [] and not ledger.failed("d0")
        ledger.add("d0", [(0, 0, 10)])
        assert _submit_all(ledger, "d0", 4, ids) == [1]  # the next chunk goes

    def test_a_write_that_fails_fast_is_handed_again_once_after_the_cooldown(self):
        ledger, ids = SendLedger(retry_within_s=0.25, retry_after_s=1.2), iter(range(1, 100))
        a = ledger.add("d0", [(0, 0, 10), (10, 10, 10), (20, 20, 10)])
        assert _submit_all(ledger, "d0", 2, ids, now_s=10.0) == [1, 2]
        assert ledger.reap(lambda i: FAILED if i == 1 else PENDING, 10.01) == []  # no failure yet
        assert not ledger.failed("d0") and ledger.pending("d0") and ledger.next_retry_s() == 10.01 + 1.2
        assert _submit_all(ledger, "d0", 4, ids, now_s=10.5) == [3]  # not due: the queue goes on
        assert _submit_all(ledger, "d0", 4, ids, now_s=11.3) == [4]  # due: handed again
        assert ledger.in_flight_bytes() == 30 and ledger.retried == 1
        ended = ledger.reap(lambda i: FAILED if i == 4 else DONE, 11.31)  # failed fast again: now it counts
        assert ledger.failed("d0") and a.failed and sorted(e.delivered_bytes for e in ended) == [0, 10, 10]

    def test_a_slow_failure_is_not_retried_nor_one_of_a_failed_session(self):
        ledger, ids = SendLedger(retry_within_s=0.25), iter(range(1, 100))
        ledger.add("d0", [(0, 0, 10), (10, 10, 10), (20, 20, 10)])
        assert _submit_all(ledger, "d0", 1, ids, now_s=0.0) == [1]
        ledger.reap(lambda i: PENDING, 1.0)
        assert _submit_all(ledger, "d0", 2, ids, now_s=1.0) == [2]
        ledger.reap(lambda i: FAILED, 1.1)  # write 1 stalled (slow); write 2 failed fast, on a failed session
        assert ledger.failed("d0") and ledger.retried == 0 and ledger.next_retry_s() is None


class FakeEngine:
    """Mooncake's asynchronous single writes, scripted: every write stays pending until the test ends it."""

    def __init__(self):
        self.lock = threading.Lock()
        self.status: dict[int, int] = {}
        self.submitted: list[tuple[str, int, int, int]] = []
        self.most_held: dict[str, int] = {}
        self._session_of: dict[int, str] = {}

    def transfer_submit_write(self, session, src, dst, length):
        with self.lock:
            write_id = len(self.submitted) + 1
            self.submitted.append((session, src, dst, length))
            self.status[write_id] = PENDING
            self._session_of[write_id] = session
            held = sum(self._session_of[i] == session and v == PENDING for i, v in self.status.items())
            self.most_held[session] = max(self.most_held.get(session, 0), held)
            return write_id

    def transfer_check_status(self, write_id):
        with self.lock:
            return self.status[write_id]

    def end(self, code: int, session: str | None = None) -> list[int]:
        """End every pending write (of ``session``) with ``code``; the ids ended."""
        with self.lock:
            ids = [i for i, v in self.status.items() if v == PENDING and session in (None, self._session_of[i])]
            for i in ids:
                self.status[i] = code
            return ids


def _until(predicate, timeout_s: float = 10.0) -> None:
    end = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < end, "condition not reached"
        time.sleep(0.002)


def _manager(rooms: dict[int, str]):
    return types.SimpleNamespace(transfer_infos={room: {session: object()} for room, session in rooms.items()},
                                 request_status=dict.fromkeys(rooms, 0), session_lock=threading.Lock(),
                                 failed_sessions=set())


def _blocks(base: int, n: int, size: int = 4096) -> list[tuple[int, int, int]]:
    """``n`` entries that continue each other on neither side (each stays one write)."""
    return [(base + 2 * i * size, base + 3 * i * size, size) for i in range(n)]


class TestAsyncKvSender:
    def test_the_engine_holds_at_most_a_lane_per_write_and_gets_the_rest_as_lanes_free(self):
        engine = FakeEngine()
        sender = AsyncKvSender(_manager({1: "d:1"}), engine, wait_bound_s=10.0, lanes=3)
        assert sender.submit("d:1", _blocks(0, 10)) == 0 and sender.submit("d:1", _blocks(1 << 30, 5)) == 0
        _until(lambda: len(engine.submitted) == 3)
        while len(engine.submitted) < 15:  # each completion frees a lane for the next queued write
            held = len(engine.submitted)
            engine.end(DONE)
            _until(lambda held=held: len(engine.submitted) > held)
        engine.end(DONE)
        assert sender.barrier("d:1", 1) and engine.most_held["d:1"] == 3 == sender.max_writes_in_flight
        assert [e[1:] for e in engine.submitted] == _blocks(0, 10) + _blocks(1 << 30, 5)  # every entry, in order, once
        assert sender.ledger.batches == [] and sender.writes_failed == 0

    def test_after_a_failed_write_nothing_queued_for_that_session_reaches_the_engine(self):
        engine = FakeEngine()
        manager = _manager({1: "d:1", 2: "d:2"})
        sender = AsyncKvSender(manager, engine, wait_bound_s=10.0, lanes=2, retry_within_s=None)
        assert sender.submit("d:1", _blocks(0, 8)) == 0 and sender.submit("d:2", _blocks(1 << 30, 3)) == 0
        _until(lambda: len(engine.submitted) == 4)  # two lanes each
        engine.end(FAILED, "d:1")  # the link to d:1 stalled: both its writes fail
        _until(lambda: sender.ledger.failed("d:1"))
        for _ in range(20):  # lanes are free, yet d:1's six queued entries stay unsent
            engine.end(DONE, "d:2")
            time.sleep(0.002)
        assert [e[0] for e in engine.submitted].count("d:1") == 2
        assert not sender.barrier("d:1", 1) and "d:1" in manager.failed_sessions  # the room fails, SGLang's blacklist
        assert sender.submit("d:1", _blocks(0, 1)) == 0  # the failure is handed on; a later room starts afresh ...
        _until(lambda: [e[0] for e in engine.submitted].count("d:1") == 3)  # ... with its own entry only
        engine.end(DONE)
        assert sender.settle(10.0) and sender.barrier("d:2", 2)
        assert [e[0] for e in engine.submitted].count("d:2") == 3

    def test_a_refused_write_fails_the_room_and_nothing_else_of_its_chunk_is_sent(self):
        engine = FakeEngine()
        engine.transfer_submit_write = lambda *a: 0  # unknown session
        manager = _manager({7: "gone:1"})
        sender = AsyncKvSender(manager, engine, wait_bound_s=10.0, lanes=4)
        assert sender.submit("gone:1", _blocks(0, 6)) == 0
        assert not sender.barrier("gone:1", 7) and manager.failed_sessions == {"gone:1"}
        assert sender.writes_submitted == 0 and sender.ledger.batches == []


    def test_writes_the_engine_fails_at_once_are_handed_again_and_the_room_goes_through(self):
        """As after an outage: Mooncake fails a peer's first requests before connecting (every lane
        was tried in the current round), and takes them after its reconnect cooldown."""
        engine = FakeEngine()
        sender = AsyncKvSender(_manager({1: "d:1"}), engine, wait_bound_s=10.0, lanes=4)
        assert sender.submit("d:1", _blocks(0, 6)) == 0
        _until(lambda: len(engine.submitted) == 4)
        engine.end(FAILED)  # at once
        _until(lambda: sender.ledger.retried == 4 and len(engine.submitted) == 6)  # the queue goes on meanwhile
        engine.end(DONE)
        _until(lambda: len(engine.submitted) == 10)  # the four, handed again after the cooldown
        engine.end(DONE)
        assert sender.barrier("d:1", 1) and sender.writes_failed == 0
        assert sorted(e[1:] for e in engine.submitted) == sorted(_blocks(0, 6) + _blocks(0, 4))


class AckingManager(types.SimpleNamespace):
    """SGLang 0.5.23's side of an aborted room's drained ACK, recorded: the ACKs it would send, the rooms poisoned."""

    def __init__(self, rooms: dict[int, str]):
        super().__init__(**vars(_manager(rooms)))
        self.acked: list[int] = []
        self.poisoned: list[int] = []

    def ack(self, room: int) -> None:  # the original _maybe_ack_drained_abort, as the hook is handed it
        if room not in self.poisoned:
            self.acked.append(room)

    def poison_deferred_ack_room(self, room: int) -> None:
        self.poisoned.append(room)


class TestHeldAck:
    """kv-send-ack-drain: the decode frees an aborted room's pages on its ACK, so none goes while a write
    SGLang counted done is still queued or on the wire."""

    @staticmethod
    def _hold(sender_manager, room):
        from prfaas_sglang.hooks.kv_send_hook import hold_drained_ack

        return hold_drained_ack(lambda m, r: m.ack(r), sender_manager, room)

    def test_the_ack_waits_for_the_writes_open_when_it_was_asked_for_and_no_later_ones(self):
        engine, manager = FakeEngine(), AckingManager({1: "d:1", 2: "d:2"})
        manager._prfaas_sender = AsyncKvSender(manager, engine, wait_bound_s=10.0, lanes=2)
        assert manager._prfaas_sender.submit("d:1", _blocks(0, 3)) == 0
        _until(lambda: len(engine.submitted) == 2)
        self._hold(manager, 1)  # room 1 aborted while its chunk's writes are queued and on the wire
        assert manager._prfaas_sender.submit("d:2", _blocks(1 << 30, 2)) == 0  # another room's, opened later
        time.sleep(0.05)
        assert manager.acked == []
        engine.end(DONE, "d:1")
        _until(lambda: len(engine.submitted) == 5)  # d:1's third write
        assert manager.acked == []
        engine.end(DONE, "d:1")
        _until(lambda: manager.acked == [1])  # d:2's writes are still pending: they hold nothing up
        assert any(e[0] == "d:2" for e in engine.submitted) and manager._prfaas_sender.ledger.pending("d:2")
        assert manager.poisoned == []
        engine.end(DONE)
        assert manager._prfaas_sender.settle(10.0)
        self._hold(manager, 2)  # nothing open: SGLang's own check runs at once
        assert manager.acked == [1, 2]

    def test_a_room_held_again_after_its_next_chunk_was_queued_acks_only_when_that_chunk_landed(self):
        """As SGLang does: the abort's check holds on chunk 1's writes; chunk 2, then in SGLang's hands, is
        queued, and SGLang's check after it holds again. Chunk 1 landing must not ACK."""
        engine, manager = FakeEngine(), AckingManager({1: "d:1", 2: "d:2"})
        manager._prfaas_sender = AsyncKvSender(manager, engine, wait_bound_s=10.0, lanes=1)
        assert manager._prfaas_sender.submit("d:1", _blocks(0, 1)) == 0
        _until(lambda: len(engine.submitted) == 1)
        self._hold(manager, 1)
        assert manager._prfaas_sender.submit("d:2", _blocks(1 << 30, 1)) == 0  # the room's next chunk (another rank)
        self._hold(manager, 1)
        _until(lambda: len(engine.submitted) == 2)
        engine.end(DONE, "d:1")
        time.sleep(0.05)
        assert manager.acked == []
        engine.end(DONE, "d:2")
        _until(lambda: manager.acked == [1])
        time.sleep(0.02)
        assert manager.acked == [1]  # once

    def test_a_failed_write_poisons_the_room_instead_of_acking(self):
        engine, manager = FakeEngine(), AckingManager({1: "d:1"})
        manager._prfaas_sender = AsyncKvSender(manager, engine, wait_bound_s=10.0, lanes=2, retry_within_s=None)
        assert manager._prfaas_sender.submit("d:1", _blocks(0, 2)) == 0
        _until(lambda: len(engine.submitted) == 2)
        self._hold(manager, 1)
        engine.end(FAILED)
        _until(lambda: manager.poisoned == [1])
        assert manager.acked == []  # the decode frees the pages on its release timeout instead

    def test_without_a_sender_sglangs_own_check_runs(self):
        manager = AckingManager({1: "d:1"})
        self._hold(manager, 1)
        assert manager.acked == [1]


class Heard:
    """A batch's listener: what the pump told it, in order."""

    def __init__(self):
        self.events: list[tuple[str, object]] = []

    def delivered(self, nbytes, started_s):
        assert isinstance(started_s, float)  # when the write went to the engine, for the meter
        self.events.append(("delivered", nbytes))

    def ended(self, ok):
        self.events.append(("ended", ok))

    @property
    def outcome(self):
        return [v for k, v in self.events if k == "ended"]


class TestDetachedSender:
    """The sender outside SGLang (the emulated engine, bench transport): batches as given, each with
    its own listener, a session's failure handed on at once."""

    def _sender(self, engine, lanes=2):
        return AsyncKvSender(DetachedManager(), engine, wait_bound_s=10.0, lanes=lanes, retry_within_s=None,
                             hand_on_failures=True)

    def test_each_batch_hears_its_own_bytes_and_its_end_once_without_waiting_for_the_others(self):
        engine = FakeEngine()
        sender = self._sender(engine)
        first, second = Heard(), Heard()
        sender.send("d:1", split_even(0, 1 << 30, 4 * MiB, 2), first)  # two writes, continuing each other: kept apart
        sender.send("d:1", _blocks(1 << 20, 1), second)
        _until(lambda: len(engine.submitted) == 2)
        engine.end(DONE)  # the first batch's two writes
        _until(lambda: first.outcome == [True])
        assert first.events == [("delivered", 2 * MiB), ("delivered", 2 * MiB), ("ended", True)]
        assert second.events == []  # still in flight: nobody waits for the session to go idle
        _until(lambda: len(engine.submitted) == 3)
        engine.end(DONE)
        _until(lambda: second.outcome == [True])
        assert [e[3] for e in engine.submitted] == [2 * MiB, 2 * MiB, 4096]

    def test_a_failed_write_fails_every_batch_of_its_session_at_once_and_the_next_starts_afresh(self):
        engine = FakeEngine()
        sender = self._sender(engine)
        a, b, other = Heard(), Heard(), Heard()
        sender.send("d:1", _blocks(0, 2), a)
        sender.send("d:1", _blocks(1 << 30, 3), b)  # queued behind a's two writes
        sender.send("d:2", _blocks(1 << 31, 1), other)
        _until(lambda: len(engine.submitted) == 3)
        engine.end(FAILED, "d:1")
        _until(lambda: a.outcome == [False] and b.outcome == [False])  # b's writes were never sent
        assert [e[0] for e in engine.submitted].count("d:1") == 2 and other.outcome == []
        assert not sender.ledger.failed("d:1")  # handed on already: nothing waits for a next submit
        again = Heard()
        sender.send("d:1", _blocks(0, 1), again)
        _until(lambda: len(engine.submitted) == 4)
        engine.end(DONE)
        _until(lambda: again.outcome == [True] and other.outcome == [True])
        assert sender.counters()["writes_failed"] == 2 and sender.counters()["in_flight_bytes"] == 0

    def test_close_fails_what_is_left_once_and_stops_the_pump(self):
        engine = FakeEngine()
        sender = self._sender(engine)
        left = Heard()
        sender.send("d:1", _blocks(0, 3), left)
        _until(lambda: len(engine.submitted) == 2)
        sender.close()
        assert left.outcome == [False] and not sender._pump.is_alive()
        engine.end(DONE)
        time.sleep(0.05)
        assert left.outcome == [False]  # told once
        with pytest.raises(RuntimeError):
            sender.send("d:1", _blocks(0, 1), Heard())
        sender.close()  # again: nothing happens

    def test_an_empty_batch_ends_at_once(self):
        sender = self._sender(FakeEngine())
        heard = Heard()
        sender.send("d:1", [], heard)
        assert heard.events == [("ended", True)]

    def test_a_failing_listener_does_not_stop_the_pump(self):
        engine = FakeEngine()
        sender = self._sender(engine)

        class Broken(Heard):
            def delivered(self, nbytes, started_s):
                raise ValueError("listener bug")

        broken, fine = Broken(), Heard()
        sender.send("d:1", _blocks(0, 1), broken)
        sender.send("d:2", _blocks(1 << 30, 1), fine)
        _until(lambda: len(engine.submitted) == 2)
        engine.end(DONE)
        _until(lambda: broken.outcome == [True] and fine.outcome == [True])


def _listener(tmp_ports: list[int]) -> socket.socket:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(4)
    tmp_ports.append(server.getsockname()[1])
    return server


class TestResetOnClose:
    def test_only_connections_to_the_peers_ports_get_it(self):
        ports: list[int] = []
        with _listener(ports) as kv, _listener(ports) as other:
            resets = ResetOnClose(port_range=(ports[0], ports[0]))
            with socket.create_connection(("127.0.0.1", ports[0])) as lane, \
                    socket.create_connection(("127.0.0.1", ports[1])) as elsewhere:
                assert resets.scan(set()) == 0 and not linger_reset(lane)  # not a peer of ours (yet)
                assert resets.scan({"127.0.0.1"}) == 1 and linger_reset(lane)
                assert not linger_reset(elsewhere) and not linger_reset(kv) and not linger_reset(other)
                assert resets.scan({"127.0.0.1"}) == 0 and resets.sockets_reset == 1  # once per socket

    def test_a_closed_lane_resets_and_its_unread_bytes_never_arrive(self):
        """What the option is for: bytes a lane had sent but the peer had not yet taken are dropped at
        close (a reset), where a plain close leaves them to arrive later."""
        ports: list[int] = []
        with _listener(ports) as server:
            for reset in (False, True):
                lane = socket.create_connection(("127.0.0.1", ports[0]))
                peer, _ = server.accept()
                if reset:
                    assert ResetOnClose(port_range=(ports[0], ports[0])).scan({"127.0.0.1"}) == 1
                lane.sendall(b"k" * 65536)  # unread by the peer when the lane closes
                lane.close()
                got = bytearray()
                try:
                    while chunk := peer.recv(1 << 16):
                        got += chunk
                    outcome = len(got)
                except ConnectionResetError:
                    outcome = "reset"
                peer.close()
                assert outcome == ("reset" if reset else 65536)


class TestKeepAlive:
    SETTINGS = KeepAliveSettings(idle_s=7, interval_s=3, probes=4)

    def test_connections_to_or_from_the_port_range_get_it_once(self):
        """Both ends of a Mooncake connection in one process: the lane it opened (remote port in the
        range) and the one its server accepted (local port in the range); nothing else."""
        ports: list[int] = []
        with _listener(ports) as kv, _listener(ports) as other:
            keepalive = KeepAlive(self.SETTINGS, port_range=(ports[0], ports[0]))
            with socket.create_connection(("127.0.0.1", ports[0])) as lane, \
                    socket.create_connection(("127.0.0.1", ports[1])) as elsewhere:
                accepted, _ = kv.accept()
                with accepted:
                    assert keepalive.scan() == 2
                    assert keepalive_of(lane) == keepalive_of(accepted) == self.SETTINGS
                    assert keepalive_of(elsewhere) is None and keepalive_of(kv) is None and keepalive_of(other) is None
                    assert keepalive.scan() == 0 and keepalive.sockets_set == 2  # once per socket
                    local, remote = ("127.0.0.1", lane.getsockname()[1]), ("127.0.0.1", ports[0])
                    found = mooncake_connections(port_range=(ports[0], ports[0]))
                    assert sorted(found) == sorted([(local, remote), (remote, local)])

    @pytest.mark.parametrize("text", ["", "60,10", "60,10,6,1", "60,x,6", "0,10,6", "60,10,128", "-1,10,6", "60, 10 ,six"])
    def test_a_malformed_setting_is_refused_by_name(self, text, monkeypatch):
        from prfaas_sglang.errors import ConfigError
        from prfaas_sglang.hooks.lane_keepalive import start_lane_keepalive

        with pytest.raises(ValueError, match="idle_s"):
            KeepAliveSettings.parse(text)
        monkeypatch.setenv("PRFAAS_KV_KEEPALIVE", text or ",")
        manager = types.SimpleNamespace()
        with pytest.raises(ConfigError, match="PRFAAS_KV_KEEPALIVE"):  # stops the worker's startup
            start_lane_keepalive(None, manager, None, None, None)
        assert not hasattr(manager, "_prfaas_keepalive")

    def test_the_hook_starts_a_thread_that_reaches_new_lanes(self, monkeypatch):
        from prfaas_sglang.hooks import lane_keepalive

        manager = types.SimpleNamespace()
        monkeypatch.delenv("PRFAAS_KV_KEEPALIVE", raising=False)
        lane_keepalive.start_lane_keepalive(None, manager, None, None, None)
        assert not hasattr(manager, "_prfaas_keepalive")  # unset: nothing starts
        assert KeepAliveSettings.parse(" 60, 10,6") == KeepAliveSettings(60, 10, 6)
        monkeypatch.setenv("PRFAAS_KV_KEEPALIVE", "7,3,4")
        monkeypatch.setattr(lane_keepalive, "SCAN_INTERVAL_S", 0.05)
        monkeypatch.setattr(lane_keepalive, "KeepAlive", lambda settings: KeepAlive(settings, port_range=(ports[0], ports[0])))
        ports: list[int] = []
        with _listener(ports):
            lane_keepalive.start_lane_keepalive(None, manager, None, None, None)
            keeper = manager._prfaas_keepalive
            try:
                with socket.create_connection(("127.0.0.1", ports[0])) as lane:  # opened after the hook ran
                    deadline = time.monotonic() + 5
                    while keepalive_of(lane) is None and time.monotonic() < deadline:
                        time.sleep(0.02)
                    assert keepalive_of(lane) == self.SETTINGS
            finally:
                keeper.stop()
        assert keeper.scan_errors == 0


@pytest.mark.slow
def test_with_deferred_decode_release_no_kv_lands_after_the_drained_ack_and_without_the_hook_some_does():
    """SGLang 0.5.23's own receiver aborts a room whose chunks SGLang's sender has handed to ours; its
    decode would free the pages on the prefill's drained ACK. With kv-send-ack-drain, no page changes
    after the ACK; with SGLang's own ACK check put back, pages are still written after it."""
    from prfaas_sglang.plugin import HOOKS

    spec = next(h for h in HOOKS if h.name == "kv-send-ack-drain")
    if not spec.applies():
        pytest.skip(f"kv-send-ack-drain: {spec.where()} on the installed SGLang (the release has no drained ACK)")
    env = {"PRFAAS_ROLE": "prfaas", "PRFAAS_KV_ASYNC_SEND": "1", "PROBE_ABORT": "1"}
    # The probe holds the writes until the ACK or two seconds, so the race does not depend on the machine's
    # load (without that, on loaded CI cores all writes could end before SGLang's check, 2026-11-29 and -30).
    held = run_probe(**env)
    unhooked = run_probe(**env, PROBE_UNHOOK_ACK="1")
    for out in (held, unhooked):
        assert out["deferred_release"] and out["acked"] and out["settled"], out
        assert out["batches_open_at_abort"] > 0, out  # the abort came while writes were queued or on the wire
    assert held["pages_changed_after_ack"] == 0 and held["batches_open_at_ack"] == 0, held
    assert unhooked["batches_open_at_ack"] > 0, unhooked  # SGLang's own check ACKs with writes on the wire
    assert unhooked["pages_changed_after_ack"] > 0, unhooked


@pytest.mark.slow
def test_sglang_sends_each_chunk_asynchronously_and_the_kv_lands_intact():
    out = run_probe(PRFAAS_ROLE="prfaas", PRFAAS_KV_ASYNC_SEND="1", PRFAAS_TELEMETRY_PORT=str(PortPicker()()))
    assert all(r["sender"] == r["receiver"] == out["success"] and r["kv_intact"] and r["aux_intact"]
               for r in out["requests"]), out["requests"]
    sent = out["async"]
    assert sent["batches"] == REQUESTS * CHUNKS  # every chunk asynchronously; the aux after the barrier, synchronously
    # Random pages: nothing continues on both sides, so one write per page and buffer (K and V of 4 layers).
    assert sent["writes"] == REQUESTS * CHUNKS * PAGES_PER_CHUNK * BUFFERS and sent["writes_failed"] == 0
    assert sent["in_flight_bytes"] == 0
    assert sent["max_writes_in_flight"] == sent["lanes"] == 4  # the engine got a write per lane, never more
    per_request = out["kv_bytes_per_request"] + out["aux_bytes_per_request"]
    assert out["metered_bytes"] == REQUESTS * per_request  # the meter saw every byte land
    assert out["metered_transfers"] == REQUESTS * (CHUNKS + 1)
    assert out["prefill_rooms_left"] == out["decode_rooms_left"] == out["transfer_infos_left"] == []


@pytest.mark.slow
def test_with_enable_metrics_sglangs_metrics_show_the_senders_counters(tmp_path):
    """SGLang's --enable-metrics (multiprocess prometheus_client): the scheduler-side sender's counters
    are collected from the shared directory, as the HTTP server's /metrics collects them."""
    out = run_probe(PRFAAS_ROLE="prfaas", PRFAAS_KV_ASYNC_SEND="1", PROMETHEUS_MULTIPROC_DIR=str(tmp_path),
                    PRFAAS_TELEMETRY_PORT=str(PortPicker()()))
    sent, shown = out["async"], out["metrics"]
    label = '{model_name="probe"}'
    assert shown[f"prfaas:kv_writes_submitted_total{label}"] == sent["writes"] > 0
    assert shown[f"prfaas:kv_writes_failed_total{label}"] == 0 == sent["writes_failed"]
    assert shown[f"prfaas:kv_writes_retried_total{label}"] == 0
    assert shown[f"prfaas:kv_lane_pacing_changes_total{label}"] == 0
    assert shown[f"prfaas:kv_send_in_flight_bytes{label}"] == 0
    # the link telemetry's totals too (PRFAAS_TELEMETRY_PORT given): every byte the meter saw land
    assert shown[f"prfaas:kv_bytes_sent_total{label}"] == out["metered_bytes"] > 0
    assert shown[f"prfaas:kv_transfers_total{label}"] == out["metered_transfers"]
    assert shown[f"prfaas:kv_transfers_failed_total{label}"] == 0
    assert run_probe(PRFAAS_ROLE="prfaas", PRFAAS_KV_ASYNC_SEND="1")["metrics"] is None  # metrics off: none made


def test_sender_metrics_add_what_grew_and_set_the_gauge():
    """ProcessMetrics of the sender's table in a fresh interpreter in multiprocess mode, collected as
    SGLang collects."""
    code = textwrap.dedent("""
        import json
        from prometheus_client import CollectorRegistry, generate_latest
        from prometheus_client.multiprocess import MultiProcessCollector
        from prfaas_sglang.adapters.prom import ProcessMetrics
        from prfaas_sglang.transport.kv_send import SENDER_METRICS
        m = ProcessMetrics(SENDER_METRICS, {"model_name": "m"})
        base = {"writes_submitted": 3, "writes_failed": 1, "writes_retried": 0, "pacing_changes": 0, "in_flight_bytes": 4096,
                "staged_bytes": 0}
        m.publish(base)
        m.publish({**base, "writes_submitted": 10, "in_flight_bytes": 0})
        m.publish({**base, "writes_submitted": 10, "in_flight_bytes": 0})  # nothing grew: nothing added
        registry = CollectorRegistry()
        MultiProcessCollector(registry)
        print(json.dumps([l for l in generate_latest(registry).decode().splitlines() if l.startswith("prfaas:")]))
    """)
    with tempfile.TemporaryDirectory() as directory:
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                              env={**os.environ, "PROMETHEUS_MULTIPROC_DIR": directory})
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = set(json.loads(proc.stdout.strip().splitlines()[-1]))
    assert {'prfaas:kv_writes_submitted_total{model_name="m"} 10.0', 'prfaas:kv_writes_failed_total{model_name="m"} 1.0',
            'prfaas:kv_writes_retried_total{model_name="m"} 0.0', 'prfaas:kv_send_in_flight_bytes{model_name="m"} 0.0'} <= lines


@pytest.mark.slow
def test_a_refused_transfer_fails_the_request_on_both_sides_and_the_next_one_succeeds():
    for async_send in ("1", "0"):  # the same outcome as SGLang's synchronous batches
        out = run_probe(PRFAAS_ROLE="prfaas", PRFAAS_KV_ASYNC_SEND=async_send, FAIL_ROOM="2")
        states = [(r["sender"], r["receiver"]) for r in out["requests"]]
        ok, failed = (out["success"],) * 2, (out["failed"],) * 2
        assert states == [ok, failed, ok], (async_send, out["requests"])
        assert out["requests"][2]["kv_intact"] and out["requests"][2]["aux_intact"]
        assert out["failed_sessions"] == ["127.0.0.1:1"]  # the refused session only; the real one still takes KV
        assert out["prefill_rooms_left"] == out["decode_rooms_left"] == out["transfer_infos_left"] == []
        if async_send == "1":
            assert out["async"]["in_flight_bytes"] == 0
        else:
            assert out["async"] is None
