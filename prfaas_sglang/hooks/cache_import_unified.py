"""Cache moves on SGLang's unified radix tree (SGLang 0.5.23): export a cached prefix, import one.

The contract of :mod:`prfaas_sglang.hooks.cache_import`, which calls these functions where the upstream
adapter says the installed SGLang has the unified tree (``_compat.accessors.cache_move_backend``; 0.5.15's
per-kind trees: :mod:`prfaas_sglang.hooks.cache_import_radix`). What differs on this tree:

* A match names its last node by id (``last_device_node``, an int) and its length
  (``device_prefix_len``); the node's pages come from ``path_device_indices``, and its Mamba state
  slot from the tree core (``get_component_device_value``). Only cache-level calls: a full-attention
  model's tree runs on SGLang's Rust core, whose nodes are not Python objects.
* A node is pinned with ``lock`` / ``unlock`` (a receipt per lock).
* Allocator ids are translated to buffer rows (``translate_kv_indices_for_transfer``,
  ``translate_mamba_indices``): the identity on static pools, virtual to physical under
  ``--enable-unified-memory``. Used at once, on the scheduler's thread.
* ``insert`` frees the pages the tree already held itself, for every component: the caller frees
  nothing but a state slot the tree did not take (``mamba_exist``).
* Room is made with ``evict_for_alloc`` (the shortfall), as SGLang's own allocation does.

Refused (:class:`UnsupportedTree`): a tree with a sliding-window component (a move carries
full-attention KV and Mamba state only), int8 Mamba checkpoints (the tree's states are then slots
of another pool), and ``--enable-linear-replayssm`` (per-slot tensors a move leaves out).
"""

from __future__ import annotations

from typing import Any

import torch
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
from sglang.srt.mem_cache.unified_cache.components import ComponentType

from prfaas_sglang.hooks.cache_import import (
    NoRoomError,
    UnsupportedTree,
    _blob,
    _decoded,
    _kv_buffers,
    _state_buffers,
    request_key,
)
from prfaas_sglang.wire.prefix_transfer import (
    PREFIX_TRANSFER_VERSION,
    PrefixTransfer,
)

REPLAYSSM_STATE = ("replayssm_d", "replayssm_k", "replayssm_g", "replayssm_rawv")


def unsupported(cache: Any) -> str | None:
    """Why prefixes cannot move in or out of ``cache``, or None."""
    if ComponentType.SWA in cache.components:
        return "a sliding-window tree: a cache move carries full-attention KV and Mamba state only"
    pool = cache.req_to_token_pool
    if getattr(pool, "mamba_ckpt_pool", None) is not None:
        return "int8 Mamba checkpoints: the tree's states are slots of another pool, which a move does not carry"
    state = getattr(getattr(pool, "mamba_pool", None), "mamba_cache", None)
    if any(getattr(state, name, None) is not None for name in REPLAYSSM_STATE):
        return "--enable-linear-replayssm: its per-slot tensors are not part of a move"
    return None


def _refuse_unsupported(cache: Any) -> None:
    if (why := unsupported(cache)) is not None:
        raise UnsupportedTree(why)


def _kv_rows(cache: Any, indices: torch.Tensor) -> torch.Tensor:
    return cache.token_to_kv_pool_allocator.translate_kv_indices_for_transfer(indices)


def _state_row(cache: Any, slot: torch.Tensor) -> int:
    return int(cache.req_to_token_pool.translate_mamba_indices(slot.view(-1)[:1])[0])


def usable_prefix_tokens(cache: Any, token_ids: list[int]) -> int:
    """Tokens of ``token_ids`` this cache would reuse now (its own match: for a hybrid model, up to
    the last state checkpoint). Moves the match to the front of the LRU, nothing else."""
    return cache.match_prefix(MatchPrefixParams(key=request_key(token_ids))).device_prefix_len


def export_prefix(cache: Any, token_ids: list[int]) -> PrefixTransfer | None:
    """The longest prefix of ``token_ids`` this cache can resume from, as a message; None when
    nothing is cached. Raises :class:`UnsupportedTree`."""
    _refuse_unsupported(cache)
    match = cache.match_prefix(MatchPrefixParams(key=request_key(token_ids)))
    num_tokens, node = match.device_prefix_len, match.last_device_node
    if num_tokens == 0:
        return None
    state_buffers = _state_buffers(cache)
    lock = cache.lock(node)
    try:
        rows = _kv_rows(cache, cache.path_device_indices(node))
        kv = [_blob(name, buf[rows]) for name, buf in _kv_buffers(cache)]
        slot = cache.tree_core.get_component_device_value(node, ComponentType.MAMBA) if state_buffers else None
        if state_buffers and slot is None:  # a device match always ends on a state; refuse rather than guess
            return None
        state = [_blob(name, buf[:, _state_row(cache, slot)]) for name, buf in state_buffers]
    finally:
        cache.unlock(lock)
    return PrefixTransfer(PREFIX_TRANSFER_VERSION, list(token_ids[:num_tokens]), cache.page_size, kv, state)


def import_prefix(cache: Any, transfer: PrefixTransfer) -> int:
    """Insert ``transfer``'s prefix as a prefix-cache entry; returns the tokens this cache did not
    hold before (0: it already reused the whole prefix). Raises PrefixTransferError when the message
    does not fit this worker's pools, :class:`NoRoomError` when nothing can be evicted for it."""
    _refuse_unsupported(cache)
    num_tokens, kv_buffers, state_buffers, kv, state = _decoded(cache, transfer)
    held = usable_prefix_tokens(cache, transfer.token_ids)
    if held >= num_tokens:
        return 0
    allocator = cache.token_to_kv_pool_allocator
    if allocator.available_size() < num_tokens:
        cache.evict_for_alloc(EvictParams(num_tokens=num_tokens - allocator.available_size()))
    indices = allocator.alloc(num_tokens)
    if indices is None:
        raise NoRoomError(f"no room for {num_tokens} tokens of KV")
    rows = _kv_rows(cache, indices)
    for tensor, (_, buf) in zip(kv, kv_buffers, strict=True):
        buf[rows] = tensor
    key = request_key(transfer.token_ids)
    if not state_buffers:
        cache.insert(InsertParams(key=key, value=indices))  # frees the pages it already held itself
        return num_tokens - held
    mamba = cache.req_to_token_pool.mamba_allocator
    slot = mamba.alloc(1)
    if slot is None:
        cache.evict_for_alloc(EvictParams(mamba_num=1))
        slot = mamba.alloc(1)
    if slot is None:
        allocator.free(indices)
        raise NoRoomError("no free state slot")
    row = _state_row(cache, slot)
    for tensor, (_, buf) in zip(state, state_buffers, strict=True):
        buf[:, row] = tensor
    if cache.insert(InsertParams(key=key, value=indices, mamba_value=slot)).mamba_exist:
        mamba.free(slot)  # the node held a state already: ours was not taken
    return num_tokens - held
