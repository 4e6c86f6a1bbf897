"""A PrfaaS prefill worker's staging buffer: a chunk's scattered KV pages gathered into large writes.

With ``PRFAAS_KV_STAGING_MIB`` > 0 (the launcher's prfaas profile), the kv-send hooks' sender
(:class:`~prfaas_sglang.transport.kv_sender.AsyncKvSender`) gets a :class:`KvStager`. Each chunk's blocks
are grouped by destination run (:func:`~prfaas_sglang.transport.kv_stage.runs_by_destination`); a run
of several small sources is copied, in destination order, into a region of the staging buffer (one
``index_select`` of whole rows on the KV's device) and sent as one write to the run's destination.
Only the PrfaaS side changes: the decode receives the same bytes at the same addresses, so nothing on
the decode or in SGLang's protocol knows about it.

When. The sender stages a run only when the run is next to go (its batch is the session's oldest with
entries to prepare), so a region is held from just before its write starts until the write ended, and
chunks queued behind a slow link hold none. A run for which the buffer has no room *now* waits for
regions in use to come back (:meth:`KvStager.stage_run` answers None); one that could never fit, or
that is not worth staging, goes as it is. Pages are read at that moment, as Mooncake reads a queued
write's pages when it sends it: SGLang keeps a room's prefill pages until its transfer has ended.

Contract. :meth:`KvStager.stage_run` copies a run and returns its entries and region; :meth:`KvStager.ready`
waits for the copies to finish (GPU) and must be called before the entries go to the engine. The caller
holds a region until every write of its batch has ended (landed, failed, or abandoned and then ended:
Mooncake cannot cancel a write, so a region is never reused while the engine may still read it), then
hands it to :meth:`KvStager.release`. Thread-safe (a lock around the arena; each copy writes only its own
region). The buffer lives on the KV's device, registered with the transfer engine, outside SGLang's
memory accounting (size it within the headroom ``--mem-fraction-static`` leaves).
"""

from __future__ import annotations

import bisect
import ctypes
import logging
import threading

from prfaas_sglang.transport.kv_send import Entry
from prfaas_sglang.transport.kv_stage import DestinationRun, StagingArena, row_bytes

logger = logging.getLogger(__name__)


class _CudaBytes:
    """A raw device range as ``__cuda_array_interface__``, for ``torch.as_tensor`` (no copy)."""

    def __init__(self, ptr: int, length: int):
        self.__cuda_array_interface__ = {"shape": (length,), "typestr": "|u1", "data": (ptr, False), "version": 3}


class KvStager:
    """Staging for one prefill manager. ``buffers``: ``(ptr, length)`` of the KV buffers a block's source
    may lie in (SGLang's ``kv_args.kv_data_ptrs`` / ``kv_data_lens``); a run whose sources are not all in one
    of them goes as it is. ``device``: where they live (``"cpu"`` or ``"cuda:N"``); the staging buffer of
    ``capacity_bytes`` is allocated there and handed to ``register(ptr, length)`` (the transfer engine's
    ``register_memory``; a non-zero answer raises RuntimeError)."""

    def __init__(self, buffers, capacity_bytes: int, device: str, register=None):
        import torch

        self._torch = torch
        self.device = torch.device(device)
        self.buffer = torch.empty(capacity_bytes, dtype=torch.uint8, device=self.device)
        self.base_ptr = self.buffer.data_ptr()
        if register is not None:
            ret = register(self.base_ptr, capacity_bytes)
            if ret not in (0, None):
                raise RuntimeError(f"the transfer engine refused the KV staging buffer ({capacity_bytes} bytes): {ret}")
        self.arena = StagingArena(capacity_bytes)
        self._spans = sorted((int(p), int(n)) for p, n in buffers if int(n) > 0)
        self._bases = [p for p, _ in self._spans]
        self._views: dict[int, object] = {}
        self._lock = threading.Lock()
        self.staged_runs = self.staged_bytes = self.waits = self.failed_copies = 0
        self._pending_copies = False

    # --- the sender's side ---------------------------------------------------------------------

    def stage_run(self, run: DestinationRun) -> tuple[list[Entry], int | None] | None:
        """``run``'s entries and the region they read: staged, one entry from a region holding the run's
        sources in destination order; or, when it is not worth staging (one request already, large ones,
        sources not in one KV buffer or without a common granule of :data:`~prfaas_sglang.transport.kv_stage.MIN_ROW_BYTES`) or larger than
        the buffer, :meth:`DestinationRun.direct` and no region. None when it would fit but the buffer has
        no room now: call again once regions came back."""
        base = self._buffer_of(run) if run.worth_staging() and run.length <= self.arena.capacity_bytes else None
        rows = row_bytes(run, base) if base is not None else None
        if rows is None:
            return run.direct(), None
        with self._lock:
            offset = self.arena.alloc(run.length)
            if offset is None and not self.arena.regions_taken:  # alignment left it no room even empty
                return run.direct(), None
        if offset is None:
            self.waits += 1
            return None
        try:
            self._gather(run, base, rows, offset)
        except Exception:  # noqa: BLE001 - a copy that cannot run must not fail the chunk: send the run as it is
            logger.exception("prfaas_sglang: gathering KV into the staging buffer failed; sending the run unstaged")
            self.release([offset])
            self.failed_copies += 1
            return run.direct(), None
        self._pending_copies = True
        with self._lock:
            self.staged_runs += 1
            self.staged_bytes += run.length
        return [(self.base_ptr + offset, run.dst, run.length)], offset

    def ready(self) -> None:
        """Wait until the copies :meth:`stage_run` started have finished (on a GPU they are queued on the
        calling thread's stream); before their entries go to the engine."""
        if self._pending_copies and self.device.type == "cuda":
            self._torch.cuda.current_stream(self.device).synchronize()
        self._pending_copies = False

    def release(self, regions) -> None:
        """Free regions :meth:`stage` returned, once nothing reads them any more."""
        with self._lock:
            for offset in regions:
                self.arena.free(offset)

    def counters(self) -> dict[str, int]:
        with self._lock:
            return {"staged_runs": self.staged_runs, "staged_bytes": self.staged_bytes, "waits": self.waits,
                    "failed_copies": self.failed_copies, "staging_free_bytes": self.arena.free_bytes}

    # --- copying ---------------------------------------------------------------------------------

    def _buffer_of(self, run: DestinationRun) -> int | None:
        """The base of the KV buffer holding every source of ``run``; None when they are not all in one."""
        i = bisect.bisect_right(self._bases, run.sources[0][0]) - 1
        if i < 0:
            return None
        base, length = self._spans[i]
        if all(base <= src and src + n <= base + length for src, n in run.sources):
            return base
        return None

    def _view(self, base: int):
        """The whole KV buffer at ``base`` as a 1-D byte tensor (no copy), made once."""
        view = self._views.get(base)
        if view is None:
            torch = self._torch
            length = self._spans[self._bases.index(base)][1]
            if self.device.type == "cuda":
                view = torch.as_tensor(_CudaBytes(base, length), device=self.device)
            else:
                view = torch.frombuffer((ctypes.c_uint8 * length).from_address(base), dtype=torch.uint8)
            self._views[base] = view
        return view

    def _gather(self, run: DestinationRun, base: int, rows: int, offset: int) -> None:
        """``run``'s sources, in order, into ``[offset, offset + run.length)`` of the staging buffer: one
        ``index_select`` of ``rows``-byte rows::

            buffer rows   s0 s0+1 .. | s1 .. | ...        (source i: count_i rows from start_i)
            index         [s0, s0+1, .., s1, .., ...]     = arange(total) + repeat(start_i - before_i, count_i)
        """
        import numpy as np

        torch = self._torch
        starts = np.fromiter(((src - base) // rows for src, _ in run.sources), dtype=np.int64, count=len(run.sources))
        counts = np.fromiter((n // rows for _, n in run.sources), dtype=np.int64, count=len(run.sources))
        before = np.cumsum(counts) - counts
        index = np.arange(int(counts.sum()), dtype=np.int64) + np.repeat(starts - before, counts)
        view = self._view(base)
        source = view[: view.numel() // rows * rows].view(-1, rows)
        out = self.buffer[offset:offset + run.length].view(-1, rows)
        torch.index_select(source, 0, torch.from_numpy(index).to(self.device), out=out)
