"""Cache moves on SGLang's radix trees per model kind (SGLang 0.5.15): export a cached prefix, import one.

The contract of :mod:`prfaas_sglang.hooks.cache_import`, which calls these functions where the upstream
adapter says the installed SGLang has these trees (``_compat.accessors.cache_move_backend``). Works on
SGLang's own pools and the state-reporting ``MambaRadixCache`` of :mod:`prfaas_sglang.hooks.hybrid_cache`,
so an import is announced to the kv-index like any insert (``BlockStored`` per page, then
``StateStored``); or a full-attention model's ``RadixCache`` (no state: the message's state list is
empty). A match returns the node and its page indices; a node is pinned with ``inc_lock_ref``; the
caller frees the pages an insert already held. Runs on the scheduler's thread.
"""

from __future__ import annotations

from typing import Any

from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams

from prfaas_sglang.hooks.cache_import import (
    NoRoomError,
    _blob,
    _decoded,
    _kv_buffers,
    _state_buffers,
    request_key,
)
from prfaas_sglang.wire.prefix_transfer import PREFIX_TRANSFER_VERSION, PrefixTransfer


def usable_prefix_tokens(cache: Any, token_ids: list[int]) -> int:
    """Tokens of ``token_ids`` this cache would reuse now (its own ``match_prefix``: for a hybrid
    model, up to the last state checkpoint). Moves the match to the front of the LRU, nothing else."""
    return len(cache.match_prefix(MatchPrefixParams(key=request_key(token_ids))).device_indices)


def export_prefix(cache: Any, token_ids: list[int]) -> PrefixTransfer | None:
    """The longest prefix of ``token_ids`` this cache can resume from (full-attention pages up to
    a state checkpoint), as a message; None when nothing is cached."""
    match = cache.match_prefix(MatchPrefixParams(key=request_key(token_ids)))
    indices, node = match.device_indices, match.last_device_node
    state_buffers = _state_buffers(cache)
    if len(indices) == 0 or (state_buffers and node.mamba_value is None):
        return None
    cache.inc_lock_ref(node)
    try:
        kv = [_blob(name, buf[indices]) for name, buf in _kv_buffers(cache)]
        slot = int(node.mamba_value[0]) if state_buffers else None
        state = [_blob(name, buf[:, slot]) for name, buf in state_buffers]
    finally:
        cache.dec_lock_ref(node)
    return PrefixTransfer(PREFIX_TRANSFER_VERSION, list(token_ids[: len(indices)]), cache.page_size, kv, state)


def import_prefix(cache: Any, transfer: PrefixTransfer) -> int:
    """Insert ``transfer``'s prefix as a prefix-cache entry; returns the tokens this cache did not
    hold before (0: it already reused the whole prefix). Raises PrefixTransferError when the
    message does not fit this worker's pools (page size, layers, dtypes, shapes)."""
    n, kv_buffers, state_buffers, kv, state = _decoded(cache, transfer)
    key = request_key(transfer.token_ids)
    held = usable_prefix_tokens(cache, transfer.token_ids)
    if held >= n:
        return 0
    allocator = cache.token_to_kv_pool_allocator
    if allocator.available_size() < n:
        cache.evict(EvictParams(num_tokens=n - allocator.available_size()))
    indices = allocator.alloc(n)
    if indices is None:
        raise NoRoomError(f"no room for {n} tokens of KV")
    for tensor, (_, buf) in zip(kv, kv_buffers, strict=True):
        buf[indices] = tensor
    if not state_buffers:  # full attention: SGLang's RadixCache leaves the pages it already had to the caller
        result = cache.insert(InsertParams(key=key, value=indices))
        allocator.free(indices[:result.prefix_len])
        return n - held
    mamba = cache.req_to_token_pool.mamba_allocator
    slot = mamba.alloc(1)
    if slot is None:
        cache.evict(EvictParams(num_tokens=0, mamba_num=1))
        slot = mamba.alloc(1)
    if slot is None:
        allocator.free(indices)
        raise NoRoomError("no free state slot")
    for tensor, (_, buf) in zip(state, state_buffers, strict=True):
        buf[:, slot[0]] = tensor
    result = cache.insert(InsertParams(key=key, value=indices, mamba_value=slot))  # frees duplicate pages itself
    if result.mamba_exist:
        mamba.free(slot)
    return n - held
