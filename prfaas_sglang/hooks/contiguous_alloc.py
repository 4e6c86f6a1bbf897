"""A decode worker takes each prompt's KV pages in one contiguous run where the pool has one.

SGLang's Mooncake sender writes one request per layer per run of pages contiguous on both sides,
and a Mooncake TCP lane carries one request at a time, an RTT apiece. SGLang's allocator hands a
prompt the first free pages of its sorted free list; once the pool has turned over, those are the
holes interleaved decode steps left, so a transfer splits into hundreds of requests per layer
(``bench kv-runs``). Here the decode's pre-allocation of a prompt takes the smallest run of
consecutive free pages that holds it (best fit), and only when there is none SGLang's own choice.

:func:`take_contiguous` is the choice on the free list (torch, no SGLang), used by the hook and by
``bench kv-runs`` alike.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)


def take_contiguous(free_pages, num_pages: int):
    """Best fit on a *sorted* 1-D tensor of free page ids: ``(taken, rest)`` where ``taken`` is the
    first ``num_pages`` pages of the shortest run of consecutive ids that holds them and ``rest`` the
    free list without them (still sorted), or None when no run is long enough (or ``num_pages < 2``,
    where any page will do). Allocates new tensors; the caller owns both and replaces its free list.

        free_pages  [3 4 | 9 10 11 12 | 20 21 22]   num_pages 3
        runs        len 2   len 4        len 3      -> the run at 20 (shortest that fits)
        taken       [20 21 22]   rest [3 4 9 10 11 12]
    """
    import torch

    count = int(free_pages.numel())
    if num_pages < 2 or count < num_pages:
        return None
    breaks = torch.nonzero(free_pages[1:] - free_pages[:-1] != 1).flatten() + 1
    edges = torch.cat([breaks.new_zeros(1), breaks, breaks.new_full((1,), count)])
    starts, lengths = edges[:-1], edges[1:] - edges[:-1]
    fits = lengths >= num_pages
    if not bool(fits.any()):
        return None
    best = int(torch.argmin(torch.where(fits, lengths, lengths.new_full((1,), count + 1))))
    start = int(starts[best])
    taken = free_pages[start:start + num_pages].clone()
    rest = torch.cat([free_pages[:start], free_pages[start + num_pages:]])
    return taken, rest


def alloc_contiguous(allocator, need_tokens: int, fallback=None):
    """``allocator.alloc(need_tokens)`` (SGLang's ``TokenToKVPoolAllocator`` or
    ``PagedTokenToKVPoolAllocator``, page-aligned ``need_tokens``), but from one run of consecutive
    free pages where there is one: first among the pages already sorted, then after SGLang's own
    ``merge_and_sort_free``; otherwise SGLang's choice. Same contract as ``alloc``: token indices, or
    None when the pool lacks room. Only for an allocator that keeps its free list sorted
    (``need_sort``, as SGLang sets for disaggregation); any other gets SGLang's choice.
    ``fallback`` is SGLang's choice (default ``allocator.alloc``)."""
    fallback = fallback or allocator.alloc
    page_size = allocator.page_size
    num_pages = need_tokens // page_size
    if not getattr(allocator, "need_sort", False) or need_tokens % page_size or num_pages < 2:
        return fallback(need_tokens)
    picked = take_contiguous(allocator.free_pages, num_pages)
    if picked is None and len(allocator.release_pages) > 0:
        allocator.merge_and_sort_free()
        picked = take_contiguous(allocator.free_pages, num_pages)
    if picked is None:
        return fallback(need_tokens)
    pages, allocator.free_pages = picked
    if page_size == 1:
        return pages
    import torch

    return (pages[:, None] * page_size + torch.arange(page_size, device=pages.device)).reshape(-1)


def contiguous_prealloc(original, self, req, *args, **kwargs):
    """AROUND ``DecodePreallocQueue._pre_alloc``: with ``PRFAAS_DECODE_CONTIGUOUS_KV`` on (the launcher's
    decode profile) and SGLang's page-1 token allocator keeping a sorted free list, the one ``alloc`` the
    pre-allocation makes for the prompt's KV goes through :func:`alloc_contiguous`; everything else
    (page sizes above 1, which pre-allocate with ``alloc_extend``; SWA, HiSparse) runs unchanged.

    For the call's duration the allocator's ``alloc`` is an instance attribute over the class method
    (the scheduler thread is the allocator's only user); it is removed on every exit path."""
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator

    from prfaas_sglang.envs import envs

    allocator = self.token_to_kv_pool_allocator
    if (not envs.DECODE_CONTIGUOUS_KV.get() or not isinstance(allocator, TokenToKVPoolAllocator)
            or allocator.page_size != 1 or not allocator.need_sort or "alloc" in vars(allocator)
            or getattr(self.scheduler, "enable_hisparse", False)):
        return original(self, req, *args, **kwargs)
    sglangs_alloc = type(allocator).alloc.__get__(allocator)
    allocator.alloc = lambda need_size: alloc_contiguous(allocator, need_size, fallback=sglangs_alloc)
    try:
        return original(self, req, *args, **kwargs)
    finally:
        del allocator.alloc
