"""Engine side of a cross-cluster cache move: export a cached prefix, import it as prefix cache.

What every tree shares lives here: SGLang's own pools (the token-to-KV pool behind the allocator,
the request pool's Mamba state pool) as named buffers, a message's blobs checked against them, the
key a request's tokens get, the errors. The three functions a move calls -- :func:`usable_prefix_tokens`,
:func:`export_prefix`, :func:`import_prefix` -- run on the installed SGLang's tree, whose module the
upstream adapter chooses (``_compat.accessors.cache_move_backend``):
:mod:`prfaas_sglang.hooks.cache_import_radix` for 0.5.15's radix trees per model kind,
:mod:`prfaas_sglang.hooks.cache_import_unified` for 0.5.23's unified tree. Wire format:
:mod:`prfaas_sglang.wire.prefix_transfer`; served in an SGLang server by
:mod:`prfaas_sglang.hooks.cache_move_hook`.

Contract, both sides: called on the scheduler's thread, between forward passes (the cache and
the pools are the scheduler's). ``export_prefix`` holds a lock on the matched node while it
copies and leaves the tree as it found it (apart from LRU order and a split at the match
end, as any ``match_prefix``). ``import_prefix`` owns what it allocates until the insert: the
tree then owns the pages and the state slot (duplicates of pages or a state the tree already
had are freed, as SGLang's insert does); on a refused message nothing is allocated.
"""

from __future__ import annotations

from array import array
from typing import Any

import torch
from sglang.srt.mem_cache.radix_cache import RadixKey

from prfaas_sglang._compat.accessors import cache_move_backend
from prfaas_sglang.wire.prefix_transfer import PrefixTransfer, PrefixTransferError, TensorBlob


class NoRoomError(PrefixTransferError):
    """The receiver has no room for the prefix (KV pages or a state slot) even after evicting."""


class UnsupportedTree(PrefixTransferError):
    """This worker's tree holds what a move does not carry (SGLang 0.5.23: a sliding-window component,
    int8 Mamba checkpoints, replayed-SSM tensors): no move in or out of it."""


def request_key(token_ids: list[int]) -> RadixKey:
    """The key SGLang gives a request's tokens (an ``array('q')``, on 0.5.15 and 0.5.23 alike): a tree's
    match asserts that both keys have one type, so a list key fails against what a server inserted."""
    return RadixKey(array("q", token_ids))


def _kv_buffers(cache: Any) -> list[tuple[str, torch.Tensor]]:
    """(name, token-major buffer) per full-attention layer, keys then values."""
    kvcache = cache.token_to_kv_pool_allocator.get_kvcache()
    full = getattr(kvcache, "full_kv_pool", kvcache)  # HybridLinearKVPool wraps an MHA pool
    out = []
    for i, (k, v) in enumerate(zip(full.k_buffer, full.v_buffer, strict=True)):
        out += [(f"k{i}", k), (f"v{i}", v)]
    return out


def _state_buffers(cache: Any) -> list[tuple[str, torch.Tensor]]:
    """(name, buffer with the slot on dim 1) for each Mamba state tensor; none for a
    full-attention model's cache (no state: any page-aligned prefix resumes)."""
    mamba_pool = getattr(cache.req_to_token_pool, "mamba_pool", None)
    if mamba_pool is None:
        return []
    state = mamba_pool.mamba_cache
    return [(f"conv{i}", t) for i, t in enumerate(state.conv)] + [("temporal", state.temporal)]


# msgpack framing: per message, its header and up to 5 bytes per token id; per blob, its name,
# dtype, shape (up to 8 ints) and the bin header. Generous: the bound sizes a landing buffer.
_MESSAGE_OVERHEAD_BYTES, _TOKEN_ID_BYTES, _BLOB_OVERHEAD_BYTES = 64, 5, 160


def message_bound_bytes(cache: Any, num_tokens: int) -> int:
    """The most bytes an encoded :class:`PrefixTransfer` of ``num_tokens`` tokens exported by a
    worker with this cache's layout can take (the landing buffer an importer offers)."""
    kv, state = _kv_buffers(cache), _state_buffers(cache)
    kv_bytes = sum(num_tokens * buf[0].numel() * buf.element_size() for _, buf in kv)
    state_bytes = sum(buf[:, 0].numel() * buf.element_size() for _, buf in state)
    framing = _MESSAGE_OVERHEAD_BYTES + _TOKEN_ID_BYTES * num_tokens + _BLOB_OVERHEAD_BYTES * (len(kv) + len(state))
    return kv_bytes + state_bytes + framing


def _blob(name: str, tensor: torch.Tensor) -> TensorBlob:
    tensor = tensor.detach().to("cpu").contiguous()
    raw = tensor.view(torch.uint8) if tensor.dim() else tensor.reshape(1).view(torch.uint8)
    return TensorBlob(name, str(tensor.dtype).removeprefix("torch."), list(tensor.shape), raw.numpy().tobytes())


def _tensor(blob: TensorBlob, like: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    dtype = str(like.dtype).removeprefix("torch.")
    if blob.dtype != dtype or tuple(blob.shape) != shape:
        raise PrefixTransferError(f"{blob.name}: {blob.dtype}{blob.shape} does not fit this worker's {dtype}{list(shape)}")
    expected = like.element_size() * int(torch.Size(shape).numel())
    if len(blob.data) != expected:
        raise PrefixTransferError(f"{blob.name}: {len(blob.data)} bytes, {expected} expected")
    flat = torch.frombuffer(bytearray(blob.data), dtype=torch.uint8) if blob.data else torch.empty(0, dtype=torch.uint8)
    return flat.view(like.dtype).reshape(shape).to(like.device)


def _decoded(cache: Any, transfer: PrefixTransfer) -> tuple[int, list, list, list[torch.Tensor], list[torch.Tensor]]:
    """(tokens, this cache's KV buffers, its state buffers, the message's KV rows, its state), each
    tensor checked against this worker's layout; raises PrefixTransferError when it does not fit."""
    n = len(transfer.token_ids)
    if transfer.page_size != cache.page_size:
        raise PrefixTransferError(f"page size {transfer.page_size}, this worker's is {cache.page_size}")
    kv_buffers, state_buffers = _kv_buffers(cache), _state_buffers(cache)
    if [b.name for b in transfer.kv] != [name for name, _ in kv_buffers]:
        raise PrefixTransferError(f"KV layers {[b.name for b in transfer.kv]} do not match {[n for n, _ in kv_buffers]}")
    if [b.name for b in transfer.state] != [name for name, _ in state_buffers]:
        raise PrefixTransferError(f"state tensors {[b.name for b in transfer.state]} do not match "
                                  f"{[n for n, _ in state_buffers]}")
    kv = [_tensor(blob, buf, (n, *buf.shape[1:])) for blob, (_, buf) in zip(transfer.kv, kv_buffers, strict=True)]
    state = [_tensor(blob, buf, (buf.shape[0], *buf.shape[2:])) for blob, (_, buf) in zip(transfer.state, state_buffers, strict=True)]
    return n, kv_buffers, state_buffers, kv, state


def usable_prefix_tokens(cache: Any, token_ids: list[int]) -> int:
    """Tokens of ``token_ids`` this cache would reuse now (its own match: for a hybrid model, up to the
    last state checkpoint). Moves the match to the front of the LRU, nothing else."""
    return cache_move_backend().usable_prefix_tokens(cache, token_ids)


def export_prefix(cache: Any, token_ids: list[int]) -> PrefixTransfer | None:
    """The longest prefix of ``token_ids`` this cache can resume from (full-attention pages up to a state
    checkpoint), as a message; None when nothing is cached. Raises :class:`UnsupportedTree` where the
    tree holds what a move does not carry."""
    return cache_move_backend().export_prefix(cache, token_ids)


def import_prefix(cache: Any, transfer: PrefixTransfer) -> int:
    """Insert ``transfer``'s prefix as a prefix-cache entry; returns the tokens this cache did not hold
    before (0: it already reused the whole prefix). Raises PrefixTransferError when the message does not
    fit this worker's pools (page size, layers, dtypes, shapes), :class:`NoRoomError` when nothing can be
    evicted for it, :class:`UnsupportedTree` as :func:`export_prefix`."""
    return cache_move_backend().import_prefix(cache, transfer)
