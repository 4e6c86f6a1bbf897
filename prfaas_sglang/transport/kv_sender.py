"""The asynchronous KV sender: a PrfaaS prefill worker ships each chunk's KV without waiting on it, and never spins.

SGLang 0.5.15's Mooncake transfer worker sends each chunked-prefill chunk as one
synchronous batch (``batch_transfer_sync_write``, which busy-waits with the GIL
released) and starts the next chunk's batch only when it returns. Over a WAN the
lanes then idle at every chunk's tail (the last requests, then an RTT for their
acknowledgement), and a core spins per transfer thread. :class:`AsyncKvSender` queues a chunk's
entries and returns at once; its thread hands the engine one write per lane at a time, as lanes
free up, and every wait sleeps. At most :data:`MAX_BATCHES_IN_FLIGHT` chunks per decode session are
queued or on the wire. The SGLang seam that gives a prefill manager its sender and sends through it
is :mod:`prfaas_sglang.hooks.kv_send_hook`; the pure ledger and merging are
:mod:`prfaas_sglang.transport.kv_send`, the staging buffer :mod:`prfaas_sglang.transport.kv_stager`.

A failed write is found by polling (``transfer_check_status``: 1 done, 0 pending, -1
failed, -2 timed out; Mooncake's stall bound ends a stuck write). It taints every room then
in flight on that session (SGLang's ``transfer_infos``) and blacklists the session in
SGLang's ``failed_sessions`` at once, which is what SGLang does after one failed batch;
SGLang's probe (on in the PrfaaS profile) takes it back. A write the engine fails within
:data:`RETRY_WITHIN_S` of taking it never had a connection (after an outage Mooncake 0.3.13
fails a peer's first requests before it connects) and is handed once more after its reconnect
cooldown.

No KV lands after its room failed. Mooncake 0.3.13 cannot cancel a request, and after an outage
it delivered a failed room's KV into decode pages SGLang had freed
(tests/transport/test_sglang_session_recovery.py, with SGLang's own sender), two ways:

* requests still queued in the engine when the link went dark are sent on a reconnected lane
  once it returns. Here the engine holds at most a write per lane (``MC_TCP_LANES_PER_PEER``),
  each of which goes straight onto a lane; the rest wait in the sender and are dropped, unsent,
  when their session fails;
* a lane the engine closes on its stall timeout leaves the request it was sending to the kernel,
  which retransmits it as an orphan socket for about 100 s; the peer's session, which never times
  out, writes what arrives. Here the sender's connections to its decode peers are reset on close
  (``SO_LINGER`` 0, :class:`~prfaas_sglang.adapters.sockopts.ResetOnClose`): nothing is retransmitted.

Lanes kept level. With ``PRFAAS_KV_LANE_PACING`` set (the launcher sets the topology's link for
the prfaas role), a batch of equal large writes that is all in flight, one per lane, has each lane
paced at an equal share of the link (:mod:`~prfaas_sglang.transport.lane_pacing`): the lanes end
together instead of the batch waiting on the flow that got the least. Otherwise the lanes are not
capped. A malformed value stops startup (:class:`~prfaas_sglang.errors.ConfigError`).

Outside SGLang. The emulated engine's PrfaaS worker and ``bench transport`` run the same sender in
front of a bare Mooncake engine (:func:`detached_sender`, :class:`DetachedManager`): a batch goes in
as given (:meth:`AsyncKvSender.send`), a listener hears each write's bytes and the batch's outcome,
and a session's failure is handed on at once.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from prfaas_sglang.adapters.prom import ProcessMetrics
from prfaas_sglang.adapters.sockopts import ResetOnClose, set_lane_pacing
from prfaas_sglang.envs import envs
from prfaas_sglang.transport.kv_send import Batch, Ended, SendLedger, coalesce
from prfaas_sglang.transport.kv_stage import runs_by_destination
from prfaas_sglang.transport.kv_stager import KvStager
from prfaas_sglang.transport.lane_pacing import LanePacing
from prfaas_sglang.transport.wan_defaults import MOONCAKE_DEFAULT_LANES, lanes_per_peer

logger = logging.getLogger(__name__)
MAX_BATCHES_IN_FLIGHT = 8  # chunks per decode session queued or on the wire at once (a bound on the queue)
POLL_MIN_S, POLL_MAX_S = 0.0002, 0.001  # the pump's sleep while writes are in flight: a lane waits this long at most
RESET_SCAN_S = 0.5
STAGED_AHEAD = 2  # entries per lane a session keeps prepared (staged) ahead of its lanes: a region is held
#                   only from shortly before its write starts
METRICS_PUBLISH_S = 1.0  # how often the pump brings its ProcessMetrics up to date while it works
# A write the engine fails this soon after taking it never had a connection (a real send fails after an
# RTT at least, a stall after the stall bound): it is handed again once, after Mooncake's 1 s reconnect
# cooldown (``SendLedger``).
RETRY_WITHIN_S, RETRY_AFTER_S = 0.25, 1.2


@dataclass(eq=False)
class HeldAck:
    """An aborted room's drained ACK, held until the batches open when it was asked for have ended."""

    room: int
    fire: Callable[[bool], None]
    batches: list[Batch]  # every batch open when it was asked for (each stays failed once it failed)


class AsyncKvSender:
    """One prefill manager's asynchronous writes. Thread-safe (one lock around the ledger); every
    wait sleeps. ``engine`` is Mooncake's ``TransferEngine``; ``manager`` the SGLang
    ``MooncakeKVManager`` whose ``transfer_infos``, ``failed_sessions`` and ``session_lock`` it reads
    and (on a failure) writes. ``lanes``: the engine's TCP lanes per peer, the most writes to one
    decode session handed to the engine at once (the rest wait in the ledger, so that none waits in
    the engine's own queue, from where it could be sent after its room failed). ``retry_within_s``:
    a write the engine fails this fast is handed once more (:class:`SendLedger`; None: never).

    A daemon thread (the pump) submits queued entries as lanes free up, reads the writes' statuses,
    and every :data:`RESET_SCAN_S` while writes are in flight gives the engine's connections to the
    decode peers a reset on close (:class:`~prfaas_sglang.adapters.sockopts.ResetOnClose`); a
    ``resets`` of None leaves them alone. With ``pacing``, it also caps the lanes' pacing rate as
    :meth:`LanePacing.cap` says for the writes in flight, whenever that answer changes (and again
    every :data:`RESET_SCAN_S` while a cap holds, for lanes opened since).

    A failed write fails its session (SGLang blacklists a session after one failed batch); SGLang's
    transfer thread hears of it at the session's next chunk or aux. With ``hand_on_failures`` (a
    sender outside SGLang, :func:`detached_sender`) it is handed on at once instead: the session's
    other batches fail with it, their listeners told, and the next batch starts afresh."""

    def __init__(self, manager, engine, wait_bound_s: float, lanes: int = MOONCAKE_DEFAULT_LANES,
                 resets: ResetOnClose | None = None, retry_within_s: float | None = RETRY_WITHIN_S,
                 pacing: LanePacing | None = None, hand_on_failures: bool = False,
                 metrics: ProcessMetrics | None = None, stager: KvStager | None = None):
        if lanes < 1:
            raise ValueError("lanes must be at least 1")
        self.manager = manager
        self.engine = engine
        self.wait_bound_s = wait_bound_s
        self.lanes = lanes
        self.resets = resets
        self.pacing = pacing
        self.hand_on_failures = hand_on_failures
        self.lane_cap: int | None = None  # the pacing cap the lanes were last given (None: none)
        self._wanted_cap: int | None = None  # the policy's answer at the pump's last step
        self.pacing_changes = 0
        self._next_pace_scan = 0.0
        self.ledger = SendLedger(retry_within_s=retry_within_s, retry_after_s=RETRY_AFTER_S)
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)  # notified when something is queued or ends
        self._tainted: dict[str, set[int]] = {}  # session -> rooms to fail at their next chunk or aux
        self._sync = threading.local()  # inside the aux barrier: _transfer_data runs synchronously
        self._peer_ips: set[str] = set()
        self._next_reset_scan = 0.0
        self.writes_submitted = 0
        self.writes_failed = 0
        self.batches_submitted = 0
        self.max_writes_in_flight = 0  # the most writes to one session the engine held at once
        self.metrics = metrics
        self.stager = stager
        self._staged: set[int] = set()  # staging regions (offsets) whose entries are queued, in flight or to retry
        self._next_publish_s = 0.0
        self._held_acks: list[HeldAck] = []  # aborted rooms whose drained ACK waits for writes in flight
        self._closed = False
        self._pump = threading.Thread(target=self._run, name="prfaas-kv-send", daemon=True)
        self._pump.start()

    # --- called from SGLang's transfer threads -----------------------------------------------

    def submit(self, session: str, blocks, streamer=None) -> int:
        """Queue one chunk's entries to ``session``; 0, or -1 once a write to it failed. Like SGLang's
        synchronous batch, which fails as soon as one of its writes does, this does not wait for the
        session's other writes: Mooncake cannot cancel those in flight (see the module's hazard note).
        With a layer ``streamer``, blocks it already sent are dropped first."""
        if streamer is not None:
            with self._lock:
                blocks = streamer.settle(session, blocks)
                if not blocks:  # every layer streamed: report a failure among them, else done
                    return self._report(session) if self.ledger.failed(session) else 0
        if not any(n > 0 for _, _, n in blocks):
            return 0
        if not self._wait(session, lambda: self.ledger.failed(session)
                          or self.ledger.in_flight(session) < MAX_BATCHES_IN_FLIGHT):
            return -1
        with self._lock:
            if self.ledger.failed(session):
                return self._report(session)
            if self.stager is None:
                self._queue(session, coalesce(blocks))
            else:  # the pump stages its runs when they are next to go (_prepare)
                self._queue(session, [], runs_by_destination(blocks))
            return 0

    def submit_locked(self, session: str, blocks) -> None:
        """Queue streamed blocks to ``session`` now, outside the per-session window (the caller holds
        ``self._lock``). Nothing goes to a session whose write already failed."""
        if self.ledger.failed(session):
            return
        entries = coalesce(blocks)
        if entries:
            self._queue(session, entries)

    def _queue(self, session: str, entries: list[tuple[int, int, int]], runs=()) -> Batch:
        """Under ``self._lock``: one chunk (one metered transfer) into the ledger, for the pump: its
        entries, or its destination runs for the pump to stage."""
        telemetry = getattr(self.manager, "_prfaas_link", None)
        nbytes = sum(n for _, _, n in entries) + sum(r.length for r in runs)
        meter_id = telemetry.begin(nbytes, session) if telemetry is not None else None
        batch = self.ledger.add(session, entries, meter_id, runs)
        self.batches_submitted += 1
        self._peer_ips.add(session.rsplit(":", 1)[0].strip("[]"))
        self._changed.notify_all()
        return batch

    # --- called by a sender outside SGLang (the emulated engine, bench transport) ----------------

    def send(self, session: str, entries: list[tuple[int, int, int]], listener=None) -> Batch:
        """Queue ``entries`` to ``session`` as one batch, as given (not merged: see
        :func:`~prfaas_sglang.transport.kv_send.split_even`), and return it. A failure of an earlier
        write to ``session``, which its own batch's listener was told, is handed on first (the session
        starts afresh). Waits, sleeping, while :data:`MAX_BATCHES_IN_FLIGHT` batches to ``session`` are
        queued or in flight; raises TimeoutError past the wait bound.

        ``listener`` (optional) is called on the pump thread, under the sender's lock, so it must only
        hand off (e.g. ``loop.call_soon_threadsafe``): ``listener.delivered(nbytes, started_s)`` as each
        write lands (``started_s``: when it was handed to the engine, on ``time.monotonic()``),
        then ``listener.ended(ok)`` exactly once, True when every write landed, False at the batch's first
        failed write, on its session's failure, or on :meth:`close`."""
        if not self._wait(session, lambda: self.ledger.failed(session)
                          or self.ledger.in_flight(session) < MAX_BATCHES_IN_FLIGHT):
            raise TimeoutError(f"{MAX_BATCHES_IN_FLIGHT} KV batches to {session} still in flight after "
                               f"{self.wait_bound_s:.0f} s")
        with self._lock:
            if self._closed:
                raise RuntimeError("the KV sender is closed")
            if self.ledger.failed(session):
                self._report(session)
            batch = self._queue(session, entries)
            batch.listener = listener
            if batch.ended:  # nothing to send: done now (the pump never sees it)
                self._end_meter(batch)
            return batch

    def counters(self) -> dict[str, int]:
        """A snapshot for metrics: writes handed to the engine, failed, and handed again; batches;
        lane-pacing changes; bytes queued or in flight now; bytes sent from the staging buffer."""
        staged = self.stager.counters() if self.stager is not None else {}
        with self._lock:
            return {"writes_submitted": self.writes_submitted, "writes_failed": self.writes_failed,
                    "writes_retried": self.ledger.retried, "batches_submitted": self.batches_submitted,
                    "pacing_changes": self.pacing_changes, "in_flight_bytes": self.ledger.in_flight_bytes(),
                    "staged_bytes": staged.get("staged_bytes", 0)}

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the pump (within ``timeout_s``). Batches not ended are failed (their listeners told);
        writes the engine still holds are left to it. Idempotent."""
        with self._lock:
            self._closed = True
            for batch in self.ledger.batches:
                if not batch.reported:
                    batch.failed = True
                    batch.drop_unsent()
                    self._end_meter(batch)
            self._changed.notify_all()
        if threading.current_thread() is not self._pump:
            self._pump.join(timeout_s)

    def barrier(self, session: str, room: int) -> bool:
        """Wait, sleeping, until nothing is queued or in flight to ``session`` or a write to it failed;
        False if one failed while ``room`` was in flight there, or the wait ran past its bound."""
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

    def hold_ack(self, room: int, fire) -> bool:
        """An aborted ``room``'s drained ACK (SGLang 0.5.23's deferred decode KV release: the decode frees the
        room's pages on it). True when it must wait: some batch is queued or in flight now (to any session,
        abandoned ones included: a batch does not name its rooms, so every one open now is waited for, and
        none opened later). The pump then calls ``fire(ok)`` once, off the lock, when all of those batches
        ended and no later hold of the same room waits (that one fires instead): ``ok`` False when one of them failed (a write the engine timed out may not be proven stopped;
        the caller poisons the ACK and the decode falls back to its release timeout). False: nothing is
        open, the caller ACKs now."""
        with self._lock:
            open_now = [b for b in self.ledger.batches if not b.ended]
            if not open_now or self._closed:
                return False
            self._held_acks.append(HeldAck(room, fire, open_now))
            self._changed.notify_all()
            return True

    def _due_acks(self) -> list[HeldAck]:
        """Under ``self._lock``: the held ACKs whose batches have all ended (taken off the list). A room held
        again since (its later chunk's writes queued after the first hold) fires from its latest hold only."""
        due = [h for h in self._held_acks if all(b.ended for b in h.batches)]
        if not due:
            return []
        self._held_acks = [h for h in self._held_acks if h not in due]
        waiting = {h.room for h in self._held_acks}
        latest = {h.room: h for h in due}  # held in order: the last one of a room is its latest
        return [h for h in due if h.room not in waiting and latest[h.room] is h]

    def _fire(self, due: list[HeldAck]) -> None:
        """Off the lock: each held ACK's callback, with whether none of its batches failed (a fault is
        logged, never stops the pump)."""
        for held in due:
            try:
                held.fire(not any(b.failed for b in held.batches))
            except Exception:  # noqa: BLE001
                logger.exception("prfaas_sglang: the drained ACK of room %s failed", held.room)

    def _wait(self, session: str | None, done, bound_s: float | None = None) -> bool:
        """Sleep until nothing awaited is queued or in flight to ``session`` (None: nothing at all,
        abandoned writes included) or ``done()`` (read under the lock); False if the bound passed first."""
        bound_s = self.wait_bound_s if bound_s is None else bound_s
        deadline = time.monotonic() + bound_s
        with self._lock:
            while True:
                idle = not self.ledger.batches if session is None else not self.ledger.pending(session)
                if idle or done():
                    return True
                left = deadline - time.monotonic()
                if left <= 0:
                    logger.error("prfaas_sglang: KV writes to %s still in flight after %.0f s", session or "any peer",
                                 bound_s)
                    return False
                self._changed.wait(left)

    def settle(self, timeout_s: float) -> bool:
        """Wait, sleeping, until no write to any session is queued or in flight (shutdown, tests);
        False on timeout."""
        return self._wait(None, lambda: False, timeout_s)

    @property
    def synchronous(self) -> bool:
        return getattr(self._sync, "on", False)

    def set_synchronous(self, on: bool) -> None:
        self._sync.on = on

    # --- the pump ------------------------------------------------------------------------------

    def _publish(self) -> None:
        """Bring :attr:`metrics` (``transport.kv_send.SENDER_METRICS`` in SGLang's /metrics) up to
        date: every METRICS_PUBLISH_S while batches are open, and at once when none is (so the last
        write's counts and an empty queue show)."""
        now_s = time.monotonic()
        if self.metrics is None or (self.ledger.batches and now_s < self._next_publish_s):
            return
        self._next_publish_s = now_s + METRICS_PUBLISH_S
        self.metrics.publish(self.counters())

    def _run(self) -> None:
        delay = POLL_MIN_S
        while True:
            try:
                self._publish()
                with self._lock:
                    while not self.ledger.batches and not self._held_acks and not self._closed:
                        self._changed.wait()
                    if self._closed:
                        return
                    progressed = self._step()
                    due = self._due_acks()
                self._fire(due)
                self._scan_resets()
                self._pace()
            except Exception:  # noqa: BLE001 - the pump must outlive one bad step
                logger.exception("prfaas_sglang: KV send pump step failed")
                progressed = False
            delay = POLL_MIN_S if progressed else min(2 * delay, POLL_MAX_S)
            time.sleep(delay)

    def _step(self) -> bool:
        """Under ``self._lock``: read the statuses, then hand the engine what the lanes can take;
        whether anything ended or was submitted."""
        ended = self._reap()
        self._prepare()
        submitted = refused = 0
        now_s = time.monotonic()
        for session in self.ledger.sessions_to_feed(now_s):
            taken = self.ledger.take(session, self.lanes, now_s)
            for i, (batch, entry, attempt) in enumerate(taken):
                write_id = self.engine.transfer_submit_write(session, *entry)
                if not write_id:  # unknown session, no route: its chunks fail as a synchronous batch would
                    logger.warning("prfaas_sglang: the transfer engine refused a KV write to %s", session)
                    self.writes_failed += 1
                    for failed in {id(b): b for b, _, _ in taken[i:]}.values():
                        self.ledger.refused(failed)
                        self._end_meter(failed)
                    self._note_failure(session)
                    refused += 1
                    break
                self.ledger.started(batch, write_id, entry, now_s, attempt)
                self.writes_submitted += 1
                submitted += 1
            self.max_writes_in_flight = max(self.max_writes_in_flight, self.ledger.writes_in_flight(session))
        if self.pacing is not None:  # what the lanes should carry now, applied by _pace outside the lock
            self._wanted_cap = self.pacing.cap([(w.length, w.started_s) for w in self.ledger.all_writes()],
                                               self.ledger.waiting())
        if ended or refused:  # a staged write can only be over once something ended or was dropped
            self._release_ended()
        if ended or submitted or refused:
            self._changed.notify_all()
        return bool(ended or submitted or refused)

    def _scan_resets(self) -> None:
        """Give new connections to the decode peers a reset on close, at most every RESET_SCAN_S, while
        writes are in flight. A lane is closed for a stall only after the stall bound (>= 5 s), so
        every lane that carried a write is seen before it can be closed with bytes unacknowledged."""
        if self.resets is None or time.monotonic() < self._next_reset_scan:
            return
        with self._lock:
            busy = bool(self.ledger.batches)
            peers = set(self._peer_ips)
        if busy:
            self.resets.scan(peers)
            self._next_reset_scan = time.monotonic() + RESET_SCAN_S

    def _pace(self) -> None:
        """Give the lanes the pacing cap the policy answered at the pump's last step (for the writes then
        in flight), when it differs from the last one given, and again every RESET_SCAN_S while a cap
        holds. Pump thread only. Where the kernel refuses the option, pacing is turned off (logged once)."""
        if self.pacing is None:
            return
        cap, now_s = self._wanted_cap, time.monotonic()
        if cap == self.lane_cap and (cap is None or now_s < self._next_pace_scan):
            return
        with self._lock:
            peers = set(self._peer_ips)
        try:
            set_lane_pacing(cap, peers)
        except OSError as err:
            logger.warning("prfaas_sglang: cannot pace the Mooncake lanes (%s); lane pacing off", err)
            self.pacing = None
            return
        if cap != self.lane_cap:
            self.pacing_changes += 1
        self.lane_cap, self._next_pace_scan = cap, now_s + RESET_SCAN_S

    # --- under self._lock ---------------------------------------------------------------------

    def _prepare(self) -> None:
        """Stage the runs that are next to go: per session, held runs in batch order, until the session has
        :data:`STAGED_AHEAD` entries per lane queued, as far as the staging buffer has room (a run that must
        wait for room stops its session there; other sessions go on). Staged or not, a run's entries join
        its batch's queue; the copies are waited for before anything is taken."""
        if self.stager is None:
            return
        queued: dict[str, int] = {}
        for batch in self.ledger.batches:
            queued[batch.session] = queued.get(batch.session, 0) + len(batch.queued)
        stopped: set[str] = set()
        for batch in self.ledger.batches:
            session = batch.session
            if not batch.held or batch.abandoned or session in stopped:
                continue
            while batch.held and queued[session] < STAGED_AHEAD * self.lanes:
                staged = self.stager.stage_run(batch.held[0])
                if staged is None:  # no room now: wait for regions in use
                    break
                entries, region = staged
                batch.held.popleft()
                batch.queued.extend(entries)
                queued[session] += len(entries)
                if region is not None:
                    self._staged.add(region)
            if batch.held:
                stopped.add(session)
        self.stager.ready()

    def _release_ended(self) -> None:
        """Free the staging regions whose write is over: landed, failed for good, or dropped unsent. A
        region stays while its entry is queued, waits to be handed again, or is held by the engine (a
        failed or abandoned batch's writes in flight included: Mooncake may still read the region)."""
        if not self._staged:
            return
        live = set()
        for batch in self.ledger.batches:
            live.update(src for src, _, _ in batch.queued)
            live.update(w.entry[0] for w in batch.writes.values())
            live.update(entry[0] for _, entry in batch.retries)
        over = [offset for offset in self._staged if self.stager.base_ptr + offset not in live]
        if over:
            self._staged.difference_update(over)
            self.stager.release(over)

    def _reap(self) -> int:
        retried = self.ledger.retried
        ended = self.ledger.reap(self.engine.transfer_check_status, time.monotonic())
        if self.ledger.retried > retried:
            logger.warning("prfaas_sglang: %d KV writes failed before they had a connection; handing them to the "
                           "engine again in %.1f s", self.ledger.retried - retried, self.ledger.retry_after_s)
        telemetry = getattr(self.manager, "_prfaas_link", None)
        for e in ended:
            self._record(e, telemetry)
        for session in {e.batch.session for e in ended if e.delivered_bytes == 0 and not e.batch.abandoned}:
            self._note_failure(session)
        return len(ended)

    def _record(self, e: Ended, telemetry) -> None:
        """Meter a write's end: its bytes; the batch (one chunk, one metered transfer) ends at its
        first failed write, as a synchronous batch would, or when its last write lands."""
        if e.delivered_bytes == 0:
            self.writes_failed += 1
        if e.batch.reported:
            return
        if e.delivered_bytes:
            if telemetry is not None and e.batch.meter_id is not None:
                telemetry.progress(e.batch.meter_id, e.delivered_bytes, e.started_s)
            self._tell(e.batch, "delivered", e.delivered_bytes, e.started_s)
        if e.batch.failed or e.batch_done:
            self._end_meter(e.batch)

    def _end_meter(self, batch) -> None:
        """The batch's outcome, once: to the meter and to its listener."""
        if batch.reported:
            return
        batch.reported = True
        telemetry = getattr(self.manager, "_prfaas_link", None)
        if telemetry is not None and batch.meter_id is not None:
            telemetry.end(batch.meter_id, not batch.failed)
        self._tell(batch, "ended", not batch.failed)

    @staticmethod
    def _tell(batch, what: str, *args) -> None:
        if batch.listener is None:
            return
        try:
            getattr(batch.listener, what)(*args)
        except Exception:  # noqa: BLE001 - a listener's fault must not stop the pump
            logger.exception("prfaas_sglang: a KV batch listener failed")

    def _note_failure(self, session: str) -> None:
        """A write to ``session`` failed: taint the rooms in flight there now (each fails at its
        next chunk or its aux); the session's next call reports it."""
        rooms = _rooms_on(self.manager.transfer_infos, session)
        known = self._tainted.setdefault(session, set())
        known.intersection_update(self.manager.request_status.keys())  # forget rooms SGLang is done with
        known.update(rooms)
        if self.hand_on_failures:
            self._report(session)

    def _report(self, session: str) -> int:
        """Hand ``session``'s failure to SGLang (it blacklists the session on -1) and start afresh: the
        batches then queued are dropped, those in flight belong to failed rooms and hold up no later room."""
        for batch in self.ledger.batches:
            if batch.session == session and not batch.abandoned:
                batch.failed = True
                self._end_meter(batch)
        self.ledger.forget(session)
        self._release_ended()
        with self.manager.session_lock:
            self.manager.failed_sessions.add(session)
        self._changed.notify_all()
        return -1


class DetachedManager:
    """What a sender outside SGLang gives :class:`AsyncKvSender` in place of SGLang's
    ``MooncakeKVManager``: no rooms (nothing to taint), a blacklist nobody reads (a failure reaches
    the batch's listener instead), and optional link ``telemetry`` (``begin``/``progress``/``end``,
    as :class:`~prfaas_sglang.hooks.kv_telemetry.LinkTelemetry`)."""

    def __init__(self, telemetry=None):
        self.transfer_infos: dict = {}
        self.request_status: dict = {}
        self.session_lock = threading.Lock()
        self.failed_sessions: set[str] = set()
        if telemetry is not None:
            self._prfaas_link = telemetry


def detached_sender(engine, telemetry=None) -> AsyncKvSender:
    """The sender a PrfaaS prefill worker runs, in front of a bare Mooncake ``engine``, configured from
    this process's environment as that worker's is (lanes, wait bound, lane pacing; connections to the
    peers reset on close). Raises ConfigError on a malformed ``PRFAAS_KV_LANE_PACING``."""
    return AsyncKvSender(DetachedManager(telemetry), engine, mooncake_wait_bound_s(), mooncake_lanes_per_peer(),
                         ResetOnClose(), pacing=lane_pacing_from_env(), hand_on_failures=True)


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


def mooncake_lanes_per_peer() -> int:
    """The lanes per peer this process's Mooncake engine opens (from its environment, as Mooncake reads it)."""
    return lanes_per_peer(os.environ)


def lane_pacing_from_env() -> LanePacing | None:
    """``PRFAAS_KV_LANE_PACING`` parsed; None when unset. Raises ConfigError when malformed."""
    return envs.KV_LANE_PACING.parse(LanePacing.parse)
