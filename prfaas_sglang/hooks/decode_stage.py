"""A decode worker receives a scattered prompt's KV in one run of reserve pages, then copies it home.

The decode side of coalescing beyond adjacent entries (the PrfaaS side gathers: ``transport/kv_stager.py``).
With ``PRFAAS_DECODE_STAGING_TOKENS`` > 0 (the launcher's pd-decode profile) a decode worker sets a run
of KV pages aside at startup, its *reserve* (:class:`DecodeStaging`, hook ``decode-staging-start``,
AFTER ``DecodePreallocQueue.__init__``: the pool's top pages, still free then; the allocator and the
scheduler's total shrink by them, so SGLang's admission, usage and leak check count a smaller pool).
When a prompt's pages are scattered (its pool had no free run long enough: the ``decode-contiguous-kv``
hook's fallback), the receiver tells the prefill reserve pages instead of the prompt's own (hook
``decode-staging-redirect``, AROUND ``MooncakeKVReceiver.send_metadata``), so the prefill writes one
request per KV buffer where it would have written one per run. Once the room's transfer has succeeded,
the next poll copies the reserve pages to the prompt's own, for every KV buffer, and gives the reserve
pages back (hook ``decode-staging-land``, AROUND ``MooncakeKVReceiver.poll``). SGLang's own state never
sees the reserve: the request's ``req_to_token`` holds its own pages throughout, and linear, SWA and
other state indices are sent as SGLang computed them.

Contract. :meth:`DecodeStaging.redirect` answers the pages to tell the prefill (the reserve's, or the
given ones when not worth it or when the reserve has no room: it never waits). :meth:`DecodeStaging.land`
copies a room's KV home and frees its reserve pages; the copy runs on the calling thread's stream and
is waited for before the pages are freed (a later room's KV may be written there at once).
:meth:`DecodeStaging.retire` is for a room that failed: its reserve pages are freed only after
``quarantine_s`` (the prefill may still be writing there: Mooncake cannot cancel a write; the WAN
profile's stall bound ends one within that). Thread-safe.

The reserve is outside what the decode admits (SGLang's allocator never hands those pages out), so it
costs the pool ``PRFAAS_DECODE_STAGING_TOKENS``. Only SGLang's page-1 and paged allocators are shrunk
this way; with any other (SWA, HiSparse) the decode runs without a reserve. A room that is never polled to its end keeps its
reserve pages (SGLang polls every room it holds until it concludes).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque

import numpy as np

from prfaas_sglang.transport.kv_stage import StagingArena, worth_redirecting

logger = logging.getLogger(__name__)
_ATTR = "_prfaas_decode_staging"
MAX_RESERVE_SHARE = 8  # the reserve takes at most an eighth of the decode's pool
COPY_PAGES = 4096  # pages copied home per step (the temporary: 4096 x one page of one buffer)


class DecodeStaging:
    """The reserve of one decode manager: pages ``[first_page, first_page + num_pages)`` of every KV buffer
    in ``buffers`` (``(ptr, length, page_bytes)``: SGLang's ``kv_args`` ``kv_data_ptrs``, ``kv_data_lens``,
    ``kv_item_lens``, where a page id times ``page_bytes`` is the page's offset), on ``device``."""

    def __init__(self, buffers, first_page: int, num_pages: int, device: str, quarantine_s: float = 30.0,
                 clock=time.monotonic):
        import torch

        if first_page < 0 or num_pages < 1:
            raise ValueError("need first_page >= 0 and num_pages >= 1")
        self._torch = torch
        self.device = torch.device(device)
        self.buffers = [(int(p), int(n), int(item)) for p, n, item in buffers]
        self.first_page, self.num_pages = first_page, num_pages
        self.quarantine_s = quarantine_s
        self._clock = clock
        self.arena = StagingArena(num_pages, align_bytes=1)  # in pages
        self._rooms: dict[int, tuple[int, np.ndarray]] = {}  # room -> (arena offset, the request's own pages)
        self._retired: deque[tuple[float, int]] = deque()  # (free after, arena offset)
        self._views: list | None = None
        self._lock = threading.Lock()
        self.redirected_rooms = self.redirected_pages = self.landed_rooms = self.no_room = self.retired_rooms = 0

    def redirect(self, room: int, pages) -> np.ndarray:
        """The pages to tell the prefill for ``room`` whose own pages are ``pages`` (page ids, in order)."""
        pages = np.asarray(pages)
        page_bytes = max(item for _, _, item in self.buffers) if self.buffers else 0
        if len(pages) == 0 or not worth_redirecting(pages, page_bytes):
            return pages
        with self._lock:
            self._expire()
            if room in self._rooms:  # told twice (SGLang does not): keep the first reserve pages
                offset, _ = self._rooms[room]
            else:
                offset = self.arena.alloc(len(pages))
                if offset is None:
                    self.no_room += 1
                    return pages
                self._rooms[room] = (offset, pages.copy())
                self.redirected_rooms += 1
                self.redirected_pages += len(pages)
        return np.arange(self.first_page + offset, self.first_page + offset + len(pages), dtype=pages.dtype)

    def land(self, room: int) -> bool:
        """``room``'s transfer succeeded: copy its KV from the reserve to its own pages and free the reserve
        pages. False when the room was not redirected (nothing to do)."""
        with self._lock:
            held = self._rooms.pop(room, None)
        if held is None:
            return False
        offset, own = held
        try:
            self._copy_home(offset, own)
        except Exception:
            self._retire(offset)
            raise
        with self._lock:
            self.arena.free(offset)
            self.landed_rooms += 1
        return True

    def retire(self, room: int) -> None:
        """``room`` failed or was aborted: its reserve pages are freed after the quarantine."""
        with self._lock:
            held = self._rooms.pop(room, None)
        if held is not None:
            self._retire(held[0])

    def counters(self) -> dict[str, int]:
        with self._lock:
            return {"redirected_rooms": self.redirected_rooms, "redirected_pages": self.redirected_pages,
                    "landed_rooms": self.landed_rooms, "no_room": self.no_room, "retired_rooms": self.retired_rooms,
                    "rooms_held": len(self._rooms), "free_pages": self.arena.free_bytes}

    # --- internals -----------------------------------------------------------------------------

    def _retire(self, offset: int) -> None:
        with self._lock:
            self._retired.append((self._clock() + self.quarantine_s, offset))
            self.retired_rooms += 1

    def _expire(self) -> None:
        """Under the lock: free the retired regions whose quarantine has passed."""
        now = self._clock()
        while self._retired and self._retired[0][0] <= now:
            self.arena.free(self._retired.popleft()[1])

    def _buffer_views(self) -> list:
        """Each KV buffer as rows of one page (no copy), made once."""
        if self._views is None:
            import ctypes

            from prfaas_sglang.transport.kv_stager import _CudaBytes

            torch, views = self._torch, []
            for ptr, length, item in self.buffers:
                if self.device.type == "cuda":
                    flat = torch.as_tensor(_CudaBytes(ptr, length), device=self.device)
                else:
                    flat = torch.frombuffer((ctypes.c_uint8 * length).from_address(ptr), dtype=torch.uint8)
                views.append(flat[: length // item * item].view(-1, item))
            self._views = views
        return self._views

    def _copy_home(self, offset: int, own: np.ndarray) -> None:
        """Every buffer's reserve pages ``[offset, offset + len(own))`` onto ``own``, through a temporary
        of at most :data:`COPY_PAGES` pages (a buffer cannot be copied into itself in one call)."""
        torch = self._torch
        start = self.first_page + offset
        home = torch.from_numpy(own.astype(np.int64)).to(self.device)
        for rows in self._buffer_views():
            for lo in range(0, len(own), COPY_PAGES):
                hi = min(lo + COPY_PAGES, len(own))
                rows.index_copy_(0, home[lo:hi], rows[start + lo:start + hi].clone())
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()


def staging_of(manager) -> DecodeStaging | None:
    return getattr(manager, _ATTR, None)


def attach(manager, staging: DecodeStaging) -> None:
    setattr(manager, _ATTR, staging)


def staging_tokens_from_env() -> int:
    """``PRFAAS_DECODE_STAGING_TOKENS`` parsed (0 when unset). Raises ConfigError when malformed or negative."""
    from prfaas_sglang.envs import envs, non_negative_int

    return envs.DECODE_STAGING_TOKENS.parse(non_negative_int) or 0


def reserve_pages(allocator, num_tokens: int) -> tuple[int, int] | None:
    """Set the top ``num_tokens`` of SGLang's allocator (rounded down to whole pages) aside for good:
    ``(first_page, num_pages)``, or None (nothing changed) when the allocator is not SGLang's page-1 or
    paged one or those pages are not all free. The allocator shrinks: its ``size`` (and ``num_pages``)
    no longer count them, so ``clear()`` never hands them out again and SGLang's pool accounting stays
    whole once the caller takes them off the scheduler's total too (:func:`start_decode_staging`)."""
    import torch

    if type(allocator).__name__ not in ("TokenToKVPoolAllocator", "PagedTokenToKVPoolAllocator"):
        return None
    from prfaas_sglang._compat.accessors import staged_pages

    if staged_pages(allocator):  # 0.5.23's pages set aside for a later release: not all free
        return None
    page_size = int(getattr(allocator, "page_size", 1) or 1)
    num_pages = num_tokens // page_size
    total_pages = int(allocator.size) // page_size
    if num_pages < 1 or num_pages >= total_pages:
        return None
    first = total_pages - num_pages + 1  # page ids run 1..total_pages (page 0 is SGLang's padding)
    free = allocator.free_pages
    released = getattr(allocator, "release_pages", None)
    pooled = torch.cat([free, released]) if released is not None and len(released) else free
    if int((pooled >= first).sum()) != num_pages:  # some of them are in use
        return None
    allocator.free_pages = free[free < first]
    if released is not None and len(released):
        allocator.release_pages = released[released < first]
    allocator.size -= num_pages * page_size
    if hasattr(allocator, "num_pages"):
        allocator.num_pages -= num_pages
    return first, num_pages


def start_decode_staging(result, queue, *args, **kwargs):
    """AFTER hook on ``DecodePreallocQueue.__init__``: with ``PRFAAS_DECODE_STAGING_TOKENS`` > 0 and a
    Mooncake KV manager, take the reserve from the (fresh) pool and attach a :class:`DecodeStaging` to
    the manager. A malformed value stops startup; a pool that cannot give one run is logged and runs
    without (nothing taken)."""
    tokens = staging_tokens_from_env()
    manager = getattr(queue, "kv_manager", None)
    if tokens == 0 or manager is None or not hasattr(manager, "kv_args"):
        return None
    if type(manager).__name__ != "MooncakeKVManager":
        logger.warning("prfaas_sglang: PRFAAS_DECODE_STAGING_TOKENS set but the KV backend is %s; no reserve",
                       type(manager).__name__)
        return None
    pool_tokens = int(getattr(queue, "max_total_num_tokens", 0) or 0)
    if pool_tokens and tokens > pool_tokens // MAX_RESERVE_SHARE:
        logger.warning("prfaas_sglang: PRFAAS_DECODE_STAGING_TOKENS=%d capped at an eighth of the %d-token pool",
                       tokens, pool_tokens)
        tokens = pool_tokens // MAX_RESERVE_SHARE
    reserve = reserve_pages(queue.token_to_kv_pool_allocator, tokens)
    if reserve is None:
        logger.warning("prfaas_sglang: the decode pool (%s) could not set its top %d tokens aside; no KV reserve",
                       type(queue.token_to_kv_pool_allocator).__name__, tokens)
        return None
    taken = reserve[1] * int(getattr(queue.token_to_kv_pool_allocator, "page_size", 1) or 1)
    # the pool is smaller by the reserve for everything SGLang counts: admission, usage, its leak check
    queue.max_total_num_tokens -= taken
    scheduler = getattr(queue, "scheduler", None)
    if scheduler is not None and hasattr(scheduler, "max_total_num_tokens"):
        scheduler.max_total_num_tokens -= taken
    from prfaas_sglang.hooks.kv_send_hook import kv_device
    from prfaas_sglang.transport.kv_sender import mooncake_wait_bound_s

    args = manager.kv_args
    staging = DecodeStaging(zip(args.kv_data_ptrs, args.kv_data_lens, args.kv_item_lens, strict=True), *reserve,
                            kv_device(manager, getattr(queue.scheduler, "server_args", None)),
                            quarantine_s=mooncake_wait_bound_s())
    attach(manager, staging)
    logger.info("prfaas_sglang: decode KV reserve of %d pages from page %d: scattered prompts receive their KV "
                "in one run", reserve[1], reserve[0])
    return None


def redirect_metadata(original, receiver, kv_indices, *args, **kwargs):
    """AROUND hook on ``MooncakeKVReceiver.send_metadata``: tell the prefill reserve pages for a scattered
    prompt (see the module). Every other argument passes through as given; KV sent anywhere but the
    device pages (a newer SGLang's ``destination``: host staging; or with ``device_kv_indices``) is not
    redirected."""
    staging = staging_of(receiver.kv_mgr)
    to_device = kwargs.get("destination", "device") == "device" and kwargs.get("device_kv_indices") is None
    if to_device and staging is not None and kv_indices is not None and receiver.bootstrap_room is not None:
        try:
            kv_indices = staging.redirect(int(receiver.bootstrap_room), kv_indices)
        except Exception:  # noqa: BLE001 - the prompt's own pages always work
            logger.exception("prfaas_sglang: redirecting a room's KV into the reserve failed; using its own pages")
    return original(receiver, kv_indices, *args, **kwargs)


def land_on_poll(original, receiver):
    """AROUND hook on ``MooncakeKVReceiver.poll``: on a redirected room's Success, copy its KV home first;
    on Failed, retire its reserve pages. A copy that fails fails the room."""
    status = original(receiver)
    staging = staging_of(receiver.kv_mgr)
    if staging is None or receiver.bootstrap_room is None:
        return status
    from sglang.srt.disaggregation.base.conn import KVPoll

    room = int(receiver.bootstrap_room)
    if status == KVPoll.Success:
        try:
            staging.land(room)
        except Exception as err:  # noqa: BLE001
            logger.exception("prfaas_sglang: copying room %d's KV from the reserve failed", room)
            receiver.kv_mgr.record_failure(room, f"KV reserve copy failed: {err}")
            receiver.kv_mgr.update_status(room, KVPoll.Failed)
            receiver.conclude_state = KVPoll.Failed
            return KVPoll.Failed
    elif status == KVPoll.Failed:
        staging.retire(room)
    return status
