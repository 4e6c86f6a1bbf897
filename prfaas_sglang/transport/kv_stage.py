"""Coalescing beyond adjacent entries: a chunk's scattered source pages gathered into one staging
region per destination run (pure).

SGLang's Mooncake sender hands us a chunk's KV as ``(src, dst, length)`` blocks, one per layer (K and
V apart) per run of pages contiguous on *both* sides. :func:`~prfaas_sglang.transport.kv_send.coalesce`
merges blocks that continue each other on both sides, so the requests follow the more fragmented of
the two pools. The decode side takes each prompt's pages in one run where it can (the
``decode-contiguous-kv`` hook); the PrfaaS side's pages are wherever its allocator found them. Here
the blocks are grouped by *destination* runs alone::

    blocks (one layer)   src  [p7]  [p2 p3]  [p9]        dst  [d40] [d41 d42] [d43]
    destination run      dst  [d40 d41 d42 d43]           sources (p7) (p2 p3) (p9), in that order
    staged               staging [p7 p2 p3 p9] -> one write to d40..d43

A run of several small sources is copied, in order, into a region of a registered staging buffer
and written as one request; a run of one source, or of sources already large
(:data:`STAGE_BELOW_BYTES` on average), goes as it is. The sender's stager (``transport/kv_stager.py``) does the
copying and holds each region until every write of its batch has ended, then frees it here
(:class:`StagingArena`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

Entry = tuple[int, int, int]  # (src, dst, length)

STAGE_BELOW_BYTES = 4 << 20  # a run whose sources average this much is already in large requests (the knee at 20 ms)
MIN_ROW_BYTES = 64  # a run whose sources share no coarser granule than this is left as it is (the copy would crawl)


@dataclass(frozen=True)
class DestinationRun:
    """A stretch of the destination written by blocks that continue each other there: ``[dst, dst +
    length)`` is the concatenation of ``sources`` (``(src, length)``, in destination order)."""

    dst: int
    length: int
    sources: tuple[tuple[int, int], ...]

    def direct(self) -> list[Entry]:
        """The run as its blocks, those that continue each other on both sides merged (no staging)."""
        out: list[Entry] = []
        dst = self.dst
        for src, n in self.sources:
            if out and out[-1][0] + out[-1][2] == src:
                out[-1] = (out[-1][0], out[-1][1], out[-1][2] + n)
            else:
                out.append((src, dst, n))
            dst += n
        return out

    def worth_staging(self, stage_below_bytes: int = STAGE_BELOW_BYTES) -> bool:
        """Whether gathering pays: more than one request as it stands, and those small on average."""
        requests = len(self.direct())
        return requests > 1 and self.length / requests < stage_below_bytes


def runs_by_destination(blocks: Iterable[tuple[int, int, int]]) -> list[DestinationRun]:
    """``blocks`` grouped into runs, each block joining the previous run when its ``dst`` continues it;
    order kept, zero-length blocks dropped. Every byte of every block is in exactly one run."""
    runs: list[tuple[int, int, list[tuple[int, int]]]] = []
    for src, dst, length in blocks:
        src, dst, length = int(src), int(dst), int(length)
        if length <= 0:
            continue
        if runs and runs[-1][0] + runs[-1][1] == dst:
            start, n, sources = runs[-1]
            runs[-1] = (start, n + length, sources)
            sources.append((src, length))
        else:
            runs.append((dst, length, [(src, length)]))
    return [DestinationRun(dst, n, tuple(sources)) for dst, n, sources in runs]


def row_bytes(run: DestinationRun, base: int) -> int | None:
    """The largest granule every source of ``run`` (offsets from ``base``, the start of the buffer they all
    lie in) and every length is a multiple of: the row size a gather of whole rows can use (SGLang's
    blocks are whole pages, so it is the page's bytes or a multiple). None below :data:`MIN_ROW_BYTES`."""
    g = 0
    for src, n in run.sources:
        g = math.gcd(g, math.gcd(src - base, n))
    return g if g >= MIN_ROW_BYTES else None


class StagingArena:
    """Offsets into one staging buffer of ``capacity_bytes``: first fit, regions aligned to ``align_bytes``,
    neighbours merged on free. Not thread-safe (the sender calls it under its lock or from one thread)."""

    def __init__(self, capacity_bytes: int, align_bytes: int = 256):
        if capacity_bytes < 1 or align_bytes < 1:
            raise ValueError("need capacity_bytes >= 1 and align_bytes >= 1")
        self.capacity_bytes = capacity_bytes
        self.align_bytes = align_bytes
        self._free: list[tuple[int, int]] = [(0, capacity_bytes)]  # (offset, length), sorted, never adjacent
        self._taken: dict[int, int] = {}  # offset -> length

    def alloc(self, length: int) -> int | None:
        """The offset of a region of at least ``length`` bytes, or None when no free stretch holds it."""
        if length < 1:
            raise ValueError("length must be at least 1")
        need = -(-length // self.align_bytes) * self.align_bytes
        for i, (off, n) in enumerate(self._free):
            if n >= need:
                if n == need:
                    del self._free[i]
                else:
                    self._free[i] = (off + need, n - need)
                self._taken[off] = need
                return off
        return None

    def free(self, offset: int) -> None:
        """Give back the region at ``offset`` (from :meth:`alloc`); KeyError if it is not taken."""
        n = self._taken.pop(offset)
        spans = sorted([*self._free, (offset, n)])
        merged: list[tuple[int, int]] = []
        for off, length in spans:
            if merged and merged[-1][0] + merged[-1][1] == off:
                merged[-1] = (merged[-1][0], merged[-1][1] + length)
            else:
                merged.append((off, length))
        self._free = merged

    @property
    def free_bytes(self) -> int:
        return sum(n for _, n in self._free)

    @property
    def regions_taken(self) -> int:
        return len(self._taken)


# --- the decode side -----------------------------------------------------------------------------------
#
# A decode whose pool has no free run long enough for a prompt takes its pages scattered, and the
# prefill then writes a request per run. With a reserve (a run of pages set aside at startup), the
# decode tells the prefill reserve pages instead, receives the KV there in one run, and copies it to
# the request's own pages once it has landed:
#
#     request's pages    [p9] [p40 p41] [p3] [p77]          (4 runs: 4 requests per layer on the wire)
#     told the prefill   reserve [r0 r1 r2 r3 r4]           (1 run: 1 request per layer)
#     once landed        p9 <- r0, p40 <- r1, p41 <- r2, p3 <- r3, p77 <- r4   (per KV buffer)


def page_runs(pages) -> int:
    """How many maximal runs of consecutive ids ``pages`` (in order) has; 0 when empty."""
    runs, last = 0, None
    for page in pages:
        page = int(page)
        if last is None or page != last + 1:
            runs += 1
        last = page
    return runs


def worth_redirecting(pages, page_bytes: int, stage_below_bytes: int = STAGE_BELOW_BYTES) -> bool:
    """Whether receiving ``pages`` through the reserve pays: more than one run, and those small on
    average (``page_bytes``: one page of one KV buffer)."""
    runs = page_runs(pages)
    return runs > 1 and len(pages) * page_bytes / runs < stage_below_bytes
