"""Real KV bytes over the Mooncake transfer engine, TCP transport (I/O adapter).

Each worker owns one ``TransferEngine`` (``P2PHANDSHAKE`` metadata, so peers
address each other as ``ip:rpc_port``) and one registered host buffer:

* prefill: a *source* region of ``source_bytes`` filled with ``PATTERN``;
* decode: a *landing* arena from which per-request regions are carved (first
  fit, page granular). A region belongs to its request only until the bytes
  have been checked (``MockEngine.decode`` frees it then); what the request
  holds afterwards is accounted in tokens, like a GPU KV pool.

A transfer goes one of two ways:

* ``async_send`` (a PrfaaS worker's default, as the launcher gives SGLang's; ``PRFAAS_KV_ASYNC_SEND``
  decides where set): through the kv-send hooks' own sender, the one a PrfaaS SGLang worker runs
  (:func:`~prfaas_sglang.transport.kv_sender.detached_sender`: lanes, lane pacing and the wait bound from
  this process's ``MC_*`` / ``PRFAAS_*`` environment, connections to the peers reset on close). The
  region goes as near-equal writes, a multiple of the lanes
  (:func:`~prfaas_sglang.transport.kv_send.split_even`), each about 0.1 s of a lane's share of the
  link the launcher stated (``PRFAAS_KV_LANE_PACING``; 1 MiB when none is stated), so that the
  link telemetry's meter, which counts a write when it lands, still sees the link several times a
  second (:func:`~prfaas_sglang.transport.kv_send.timed_write_bytes`). No thread waits on a
  transfer; each write's bytes reach ``on_progress`` on the event loop as it lands;
* otherwise in ``SLICE_BYTES`` slices, one synchronous batch each, on a small thread pool
  (Mooncake's sync calls busy-spin and release the GIL), each delivered slice reported to
  ``on_progress``: SGLang's own way of sending, for the in-cluster roles.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from prfaas_sglang.transport.kv_send import split_even, timed_write_bytes

PATTERN = 0xA5
SLICE_BYTES = 1 << 20
_ALIGN = 4096


class KvTransferError(RuntimeError):
    """A Mooncake transfer failed (non-zero return)."""


class KvArena:
    """First-fit allocator over ``[start, start + size)`` (pure); offsets are ``_ALIGN``-aligned
    relative to ``start`` (pass an aligned ``start``)."""

    def __init__(self, size: int, start: int = 0):
        self.size = size
        self._free: list[tuple[int, int]] = [(start, size)] if size > 0 else []  # (offset, length), sorted

    @staticmethod
    def aligned(length: int) -> int:
        return -(-length // _ALIGN) * _ALIGN

    def alloc(self, length: int) -> int | None:
        length = self.aligned(length)
        for i, (off, free_len) in enumerate(self._free):
            if free_len >= length:
                if free_len == length:
                    self._free.pop(i)
                else:
                    self._free[i] = (off + length, free_len - length)
                return off
        return None

    def free(self, offset: int, length: int) -> None:
        length = self.aligned(length)
        self._free.append((offset, length))
        self._free.sort()
        merged: list[tuple[int, int]] = []
        for off, ln in self._free:
            if merged and merged[-1][0] + merged[-1][1] == off:
                merged[-1] = (merged[-1][0], merged[-1][1] + ln)
            else:
                merged.append((off, ln))
        self._free = merged

    @property
    def free_bytes(self) -> int:
        return sum(ln for _, ln in self._free)


class KvEndpoint:
    """One worker's Mooncake engine and registered buffer: ``source_bytes`` filled with ``PATTERN``
    (what this worker sends), then ``landing_bytes`` of zeros carved by ``arena`` (what it receives:
    a decode worker's KV, a prefill worker's imported prefixes)."""

    def __init__(self, hostname: str, source_bytes: int, landing_bytes: int, async_send: bool = False):
        os.environ.setdefault("MC_FORCE_TCP", "1")
        from mooncake.engine import TransferEngine

        self.engine = TransferEngine()
        rc = self.engine.initialize(hostname, "P2PHANDSHAKE", "tcp", "")
        if rc != 0:
            raise KvTransferError(f"mooncake initialize({hostname}) returned {rc}")
        self.session = f"{hostname}:{self.engine.get_rpc_port()}"
        source_bytes = KvArena.aligned(source_bytes)
        self.buffer = np.zeros(source_bytes + landing_bytes, dtype=np.uint8)
        self.buffer[:source_bytes] = PATTERN
        self.base = self.buffer.ctypes.data
        rc = self.engine.register_memory(self.base, self.buffer.nbytes)
        if rc != 0:
            raise KvTransferError(f"mooncake register_memory returned {rc}")
        self.arena = KvArena(landing_bytes, start=source_bytes)
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="kv")
        self.sender = None
        self.write_bytes = SLICE_BYTES
        if async_send:
            from prfaas_sglang.transport.kv_sender import detached_sender

            self.sender = detached_sender(self.engine)
            rate_bps = self.sender.pacing.rate_bps if self.sender.pacing is not None else None
            self.write_bytes = timed_write_bytes(rate_bps, self.sender.lanes)

    def _write_sync(self, peer_session: str, peer_addr: int, length: int, report: Callable[[int], None]) -> None:
        for off in range(0, length, SLICE_BYTES):
            n = min(SLICE_BYTES, length - off)
            rc = self.engine.batch_transfer_sync_write(peer_session, [self.base + off], [peer_addr + off], [n])
            if rc != 0:
                raise KvTransferError(f"transfer of {length} bytes to {peer_session} returned {rc} at offset {off}")
            report(n)

    async def write(self, peer_session: str, peer_addr: int, length: int,
                    on_progress: Callable[[int, float | None], None]) -> None:
        """Copy ``length`` bytes of the source buffer to ``peer_addr``; ``on_progress(n, started_s)`` runs on
        the loop after each delivered write (``started_s``: when it went to the engine, on
        ``time.monotonic()``) or slice (None: one slice after another). Raises KvTransferError when a write fails (with the
        sender: within its stall bound, or when the sender's wait bound passes first)."""
        loop = asyncio.get_running_loop()

        if self.sender is None:
            def report(n: int) -> None:
                loop.call_soon_threadsafe(on_progress, n, None)

            await loop.run_in_executor(self._pool, self._write_sync, peer_session, peer_addr, length, report)
            return
        listener = _Landing(loop, on_progress)
        entries = split_even(self.base, peer_addr, length, self.sender.lanes, max_write_bytes=self.write_bytes)
        try:
            await loop.run_in_executor(self._pool, self.sender.send, peer_session, entries, listener)
        except (TimeoutError, RuntimeError) as err:
            raise KvTransferError(f"transfer of {length} bytes to {peer_session}: {err}") from None
        # Mooncake fails a stalled write within its stall bound; this is the last resort behind it: the
        # wait bound (Mooncake's total bound for one request) per round of writes, and one round ahead.
        bound_s = self.sender.wait_bound_s * (1 + -(-len(entries) // self.sender.lanes))
        try:
            ok = await asyncio.wait_for(listener.outcome, bound_s)
        except asyncio.TimeoutError:
            raise KvTransferError(f"transfer of {length} bytes to {peer_session} still in flight after "
                                  f"{bound_s:.0f} s") from None
        if not ok:
            raise KvTransferError(f"transfer of {length} bytes to {peer_session} failed "
                                  f"({len(entries)} writes; the session's writes fail together)")

    def region(self, offset: int, length: int) -> np.ndarray:
        return self.buffer[offset : offset + length]

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()
        self._pool.shutdown(wait=False, cancel_futures=True)


class _Landing:
    """A batch's listener (:meth:`AsyncKvSender.send`): runs on the sender's pump thread and only hands
    off to the event loop, bytes to ``report`` as each write lands, the outcome to ``outcome``."""

    def __init__(self, loop: asyncio.AbstractEventLoop, report: Callable[[int, float | None], None]):
        self.loop, self.report = loop, report
        self.outcome: asyncio.Future[bool] = loop.create_future()

    def delivered(self, nbytes: int, started_s: float | None = None) -> None:
        self._post(self.report, nbytes, started_s)

    def ended(self, ok: bool) -> None:
        self._post(self._settle, ok)

    def _post(self, fn, *args) -> None:
        try:
            self.loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop has closed: nobody waits any more
            pass

    def _settle(self, ok: bool) -> None:
        if not self.outcome.done():
            self.outcome.set_result(ok)
