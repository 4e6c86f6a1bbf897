"""Real KV bytes over the Mooncake transfer engine, TCP transport (I/O adapter).

Each worker owns one ``TransferEngine`` (``P2PHANDSHAKE`` metadata, so peers
address each other as ``ip:rpc_port``) and one registered host buffer:

* prefill: a *source* region of ``source_bytes`` filled with ``PATTERN``;
* decode: a *receive* arena from which per-request regions are carved
  (first fit, page granular). A region belongs to its request until
  ``free`` (the decode handler frees it in a ``finally``).

Mooncake's sync calls busy-spin and release the GIL, so they run on a small
thread pool, never on the event loop. A transfer is split into entries of
``CHUNK_BYTES`` submitted as one batch, which spreads it over the TCP lanes.
"""

from __future__ import annotations

import asyncio
import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np

PATTERN = 0xA5
CHUNK_BYTES = 4 << 20
_ALIGN = 4096


class KvTransferError(RuntimeError):
    """A Mooncake transfer failed (non-zero return)."""


class KvArena:
    """First-fit allocator over ``[0, size)`` (pure); offsets are ``_ALIGN``-aligned."""

    def __init__(self, size: int):
        self.size = size
        self._free: list[tuple[int, int]] = [(0, size)]  # (offset, length), sorted

    def alloc(self, length: int) -> int | None:
        length = -(-length // _ALIGN) * _ALIGN
        for i, (off, free_len) in enumerate(self._free):
            if free_len >= length:
                if free_len == length:
                    self._free.pop(i)
                else:
                    self._free[i] = (off + length, free_len - length)
                return off
        return None

    def free(self, offset: int, length: int) -> None:
        length = -(-length // _ALIGN) * _ALIGN
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
    """One worker's Mooncake engine and registered buffer."""

    def __init__(self, hostname: str, buffer_bytes: int, fill: bool):
        os.environ.setdefault("MC_FORCE_TCP", "1")
        from mooncake.engine import TransferEngine

        self.engine = TransferEngine()
        rc = self.engine.initialize(hostname, "P2PHANDSHAKE", "tcp", "")
        if rc != 0:
            raise KvTransferError(f"mooncake initialize({hostname}) returned {rc}")
        self.session = f"{hostname}:{self.engine.get_rpc_port()}"
        self.buffer = np.full(buffer_bytes, PATTERN, dtype=np.uint8) if fill else np.zeros(buffer_bytes, dtype=np.uint8)
        self.base = self.buffer.ctypes.data
        rc = self.engine.register_memory(self.base, buffer_bytes)
        if rc != 0:
            raise KvTransferError(f"mooncake register_memory returned {rc}")
        self.arena = KvArena(buffer_bytes)
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="kv")

    def write_sync(self, peer_session: str, peer_addr: int, length: int) -> None:
        """Copy ``length`` bytes of the source buffer to ``peer_addr`` on ``peer_session``."""
        srcs, dsts, lens = [], [], []
        for off in range(0, length, CHUNK_BYTES):
            n = min(CHUNK_BYTES, length - off)
            srcs.append(self.base + off)
            dsts.append(peer_addr + off)
            lens.append(n)
        rc = self.engine.batch_transfer_sync_write(peer_session, srcs, dsts, lens)
        if rc != 0:
            raise KvTransferError(f"transfer of {length} bytes to {peer_session} returned {rc}")

    async def write(self, peer_session: str, peer_addr: int, length: int) -> None:
        await asyncio.get_running_loop().run_in_executor(self._pool, self.write_sync, peer_session, peer_addr, length)

    def region(self, offset: int, length: int) -> np.ndarray:
        return self.buffer[offset : offset + length]

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
