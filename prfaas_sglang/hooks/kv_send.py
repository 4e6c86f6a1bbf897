"""Hooks: a PrfaaS prefill worker ships each chunk's KV without waiting on it, and never spins.

SGLang 0.5.15's Mooncake transfer worker sends each chunked-prefill chunk as one
synchronous batch (``batch_transfer_sync_write``, which busy-waits with the GIL
released) and starts the next chunk's batch only when it returns. Over a WAN the
lanes then idle at every chunk's tail (the last requests, then an RTT for their
acknowledgement), and a core spins per transfer thread. In a process started with
``PRFAAS_KV_ASYNC_SEND=1`` (the launcher sets it for the prfaas role), a prefill
manager gets an :class:`AsyncKvSender` and three hooks change how it sends:

* ``kv-send-start`` (AFTER ``MooncakeKVManager.__init__``): attach the sender;
* ``kv-send`` (AROUND ``_transfer_data``): a chunk's entries, adjacent ones merged
  (:func:`~prfaas_sglang.transport.kv_send.coalesce`), become single-entry asynchronous
  writes and the call returns 0 at once; at most :data:`MAX_BATCHES_IN_FLIGHT` chunks
  per decode session are in flight (a new one waits, sleeping). The call returns -1 when
  a write to that session already failed, so SGLang fails the room and blacklists the
  session as it does for a failed synchronous batch. Without a sender (or inside the aux
  barrier below) the original synchronous batch runs, metered as before;
* ``kv-send-aux-barrier`` (AROUND ``send_aux``, the last chunk's, after any linear or SWA
  state): first wait, sleeping, until no write to that session is in flight; when one of
  them failed, or the room was in flight on a session when a write to it failed, return
  -1 before sending the aux, so the decode never hears Success for KV that did not land.

A failed write is found by polling (``transfer_check_status``: 1 done, 0 pending, -1
failed, -2 timed out; Mooncake's stall bound ends a stuck write). It taints every room then
in flight on that session (SGLang's ``transfer_infos``) and blacklists the session in
SGLang's ``failed_sessions`` at once, which is what SGLang does after one failed batch;
SGLang's probe (on in the PrfaaS profile) takes it back.

Known hazard, shared with upstream: a write may land after its room was reported failed or
aborted, into decode pages SGLang then frees. SGLang acknowledges a decode's abort at once, and
Mooncake 0.3.13 cannot cancel a request: when a lane times out, the writes queued behind it are
sent again on a new connection once the link returns, seconds later
(tests/transport/test_sglang_session_recovery.py shows it with SGLang's synchronous batches).
Upstream, one chunk's batch is exposed; here up to :data:`MAX_BATCHES_IN_FLIGHT` chunks.
``PRFAAS_KV_ASYNC_SEND=0`` restores SGLang's sending.
"""

from __future__ import annotations

import logging
import os
import threading
import time

from prfaas_sglang.envs import envs
from prfaas_sglang.hooks import layerwise
from prfaas_sglang.hooks.kv_telemetry import meter_transfer
from prfaas_sglang.transport.kv_send import Ended, SendLedger, coalesce

logger = logging.getLogger(__name__)
_ATTR = "_prfaas_sender"
MAX_BATCHES_IN_FLIGHT = 2  # chunks per decode session on the wire at once
POLL_MIN_S, POLL_MAX_S = 0.0002, 0.005


class AsyncKvSender:
    """One prefill manager's asynchronous writes. Thread-safe (one lock around the ledger);
    every wait sleeps. ``engine`` is Mooncake's ``TransferEngine``; ``manager`` the SGLang
    ``MooncakeKVManager`` whose ``transfer_infos``, ``failed_sessions`` and ``session_lock``
    it reads and (on a failure) writes."""

    def __init__(self, manager, engine, wait_bound_s: float):
        self.manager = manager
        self.engine = engine
        self.wait_bound_s = wait_bound_s
        self.ledger = SendLedger()
        self._lock = threading.Lock()
        self._tainted: dict[str, set[int]] = {}  # session -> rooms to fail at their next chunk or aux
        self._sync = threading.local()  # inside the aux barrier: _transfer_data runs synchronously
        self.writes_submitted = 0
        self.writes_failed = 0
        self.batches_submitted = 0

    # --- called from SGLang's transfer threads -----------------------------------------------

    def submit(self, session: str, blocks, streamer=None) -> int:
        """Submit one chunk's entries to ``session``; 0, or -1 once a write to it failed. Like SGLang's
        synchronous batch, which fails as soon as one of its writes does, this does not wait for the
        session's other writes: Mooncake cannot cancel them (see the module's hazard note). With a
        layer ``streamer``, blocks it already sent are dropped first."""
        if streamer is not None:
            with self._lock:
                blocks = streamer.settle(session, blocks)
                if not blocks:  # every layer streamed: report a failure among them, else done
                    self._reap(session)
                    return self._report(session) if self.ledger.failed(session) else 0
        entries = coalesce(blocks)
        if not entries:
            return 0
        if not self._wait(session, lambda: self.ledger.failed(session)
                          or self.ledger.in_flight(session) < MAX_BATCHES_IN_FLIGHT):
            return -1
        with self._lock:
            if self.ledger.failed(session):
                return self._report(session)
        writes, meter_id = self._write(session, entries)
        with self._lock:
            if self._record_batch(session, entries, writes, meter_id):
                return 0
            self._note_failure(session)
            return self._report(session)

    def submit_locked(self, session: str, blocks) -> None:
        """Submit streamed blocks to ``session`` now, outside the per-session window (the caller holds
        ``self._lock``). Nothing goes to a session whose write already failed; a refused submission
        marks it failed, reported at its next chunk or aux."""
        if self.ledger.failed(session):
            return
        entries = coalesce(blocks)
        if not entries:
            return
        writes, meter_id = self._write(session, entries)
        if not self._record_batch(session, entries, writes, meter_id):
            self.ledger.fail(session)
            self._note_failure(session)

    def _write(self, session: str, entries: list[tuple[int, int, int]]) -> tuple[dict[int, int], int | None]:
        """Submit ``entries`` as single asynchronous writes, stopping at the first the engine refuses
        (id 0: unknown session, no route); the engine ids submitted (-> bytes) and the meter handle."""
        telemetry = getattr(self.manager, "_prfaas_link", None)
        meter_id = telemetry.begin(sum(n for _, _, n in entries), session) if telemetry is not None else None
        writes: dict[int, int] = {}
        for src, dst, length in entries:
            write_id = self.engine.transfer_submit_write(session, src, dst, length)
            if not write_id:
                break
            writes[write_id] = length
        return writes, meter_id

    def _record_batch(self, session: str, entries, writes: dict[int, int], meter_id: int | None) -> bool:
        """Under ``self._lock``: put what was submitted in the ledger (one batch); whether all of it was."""
        self.writes_submitted += len(writes)
        self.batches_submitted += 1
        if writes:
            self.ledger.add(session, writes, meter_id)
        elif meter_id is not None:
            self.manager._prfaas_link.end(meter_id, False)
        return len(writes) == len(entries)

    def barrier(self, session: str, room: int) -> bool:
        """Wait, sleeping, until nothing is in flight to ``session`` or a write to it failed; False if
        one failed while ``room`` was in flight there, or the wait ran past its bound."""
        if not self._wait(session, lambda: self.ledger.failed(session)):
            return False
        with self._lock:
            if self.ledger.failed(session):
                self._report(session)
            rooms = self._tainted.get(session)
            if rooms and room in rooms:
                rooms.discard(room)
                return False
            return True

    def _wait(self, session: str | None, done, bound_s: float | None = None) -> bool:
        """Sleep until nothing awaited is in flight to ``session`` (None: nothing at all, abandoned
        writes included) or ``done()`` (read under the lock); False if the bound passed first."""
        bound_s = self.wait_bound_s if bound_s is None else bound_s
        deadline = time.monotonic() + bound_s
        delay = POLL_MIN_S
        while True:
            with self._lock:
                self._reap(None)
                idle = not self.ledger.batches if session is None else not self.ledger.pending(session)
                if idle or done():
                    return True
            if time.monotonic() > deadline:
                logger.error("prfaas_sglang: KV writes to %s still in flight after %.0f s", session or "any peer", bound_s)
                return False
            time.sleep(delay)
            delay = min(2 * delay, POLL_MAX_S)

    def settle(self, timeout_s: float) -> bool:
        """Wait, sleeping, until no write to any session is in flight (shutdown, tests); False on timeout."""
        return self._wait(None, lambda: False, timeout_s)

    @property
    def synchronous(self) -> bool:
        return getattr(self._sync, "on", False)

    def set_synchronous(self, on: bool) -> None:
        self._sync.on = on

    # --- under self._lock ---------------------------------------------------------------------

    def _reap(self, session: str | None) -> None:
        ended = self.ledger.reap(self.engine.transfer_check_status, session)
        telemetry = getattr(self.manager, "_prfaas_link", None)
        for e in ended:
            self._record(e, telemetry)
        for session in {e.batch.session for e in ended if e.delivered_bytes == 0 and not e.batch.abandoned}:
            self._note_failure(session)

    def _record(self, e: Ended, telemetry) -> None:
        """Meter a write's end: its bytes; the batch (one chunk, one metered transfer) ends at its
        first failed write, as a synchronous batch would, or when its last write lands."""
        if e.delivered_bytes == 0:
            self.writes_failed += 1
        if telemetry is None or e.batch.meter_id is None or e.batch.reported:
            return
        if e.delivered_bytes:
            telemetry.progress(e.batch.meter_id, e.delivered_bytes)
        if e.batch.failed or e.batch_done:
            e.batch.reported = True
            telemetry.end(e.batch.meter_id, not e.batch.failed)

    def _note_failure(self, session: str) -> None:
        """A write to ``session`` failed: taint the rooms in flight there now (each fails at its
        next chunk or its aux); the session's next call reports it."""
        rooms = _rooms_on(self.manager.transfer_infos, session)
        known = self._tainted.setdefault(session, set())
        known.intersection_update(self.manager.request_status.keys())  # forget rooms SGLang is done with
        known.update(rooms)

    def _report(self, session: str) -> int:
        """Hand ``session``'s failure to SGLang (it blacklists the session on -1) and start afresh: the
        batches then in flight belong to failed rooms and hold up no later room."""
        self.ledger.forget(session)
        with self.manager.session_lock:
            self.manager.failed_sessions.add(session)
        return -1


def _rooms_on(transfer_infos: dict, session: str) -> set[int]:
    """Rooms with ``session`` among their destinations. ``dict()`` copies in one step under the GIL,
    so SGLang's bootstrap thread adding a room meanwhile cannot break the iteration."""
    return {room for room, infos in dict(transfer_infos).items() if session in infos}


def mooncake_wait_bound_s() -> float:
    """How long a barrier or a full window may wait: Mooncake's total bound for a synchronous
    call (the PrfaaS profile scales it to the link); its stall bound ends a stuck write sooner."""
    try:
        return max(5.0, float(os.environ.get("MC_TRANSFER_TIMEOUT", "30")))
    except ValueError:
        return 30.0


def start_async_sender(result, manager, args, disaggregation_mode, server_args, is_mla_backend=False):
    """AFTER hook on ``MooncakeKVManager.__init__``: a prefill manager in a process with
    ``PRFAAS_KV_ASYNC_SEND`` set sends asynchronously."""
    if not envs.KV_ASYNC_SEND.get() or getattr(disaggregation_mode, "value", None) != "prefill":
        return None
    engine = getattr(getattr(manager, "engine", None), "engine", None)
    if engine is None or not hasattr(engine, "transfer_submit_write") or not hasattr(engine, "transfer_check_status"):
        logger.warning("prfaas_sglang: PRFAAS_KV_ASYNC_SEND set but the transfer engine has no asynchronous "
                       "single writes; sending synchronously")
        return None
    sender = AsyncKvSender(manager, engine, mooncake_wait_bound_s())
    setattr(manager, _ATTR, sender)
    if envs.KV_LAYERWISE.get():
        layerwise.attach(manager, sender)
    logger.info("prfaas_sglang: KV sent asynchronously (at most %d chunks in flight per decode session)",
                MAX_BATCHES_IN_FLIGHT)
    return None


def send_transfer(original, manager, mooncake_session_id, transfer_blocks):
    """AROUND hook on ``MooncakeKVManager._transfer_data``: asynchronous with a sender (outside the
    aux barrier), else SGLang's synchronous batch, metered."""
    sender = getattr(manager, _ATTR, None)
    if sender is None or sender.synchronous or not transfer_blocks:
        return meter_transfer(original, manager, mooncake_session_id, transfer_blocks)
    try:
        return sender.submit(str(mooncake_session_id), transfer_blocks, layerwise.streamer_of(manager))
    except Exception:  # noqa: BLE001 - SGLang's transfer thread dies on an exception; fail the chunk instead
        logger.exception("prfaas_sglang: asynchronous KV submit failed")
        return -1


def aux_barrier(original, manager, req, prefill_aux_index, dst_aux_ptrs):
    """AROUND hook on ``MooncakeKVManager.send_aux``: the room's KV has landed before its aux goes."""
    sender = getattr(manager, _ATTR, None)
    if sender is None:
        return original(manager, req, prefill_aux_index, dst_aux_ptrs)
    try:
        landed = sender.barrier(str(req.mooncake_session_id), req.room)
    except Exception:  # noqa: BLE001
        logger.exception("prfaas_sglang: waiting for KV writes failed")
        landed = False
    if not landed:
        return -1
    sender.set_synchronous(True)
    try:
        return original(manager, req, prefill_aux_index, dst_aux_ptrs)
    finally:
        sender.set_synchronous(False)
