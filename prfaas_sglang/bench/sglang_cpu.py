"""SGLang's real hybrid-model pools and a Mamba radix cache over them, on CPU (benchmarks and tests).

A tiny layout: layer 0 linear attention (its conv and temporal state in the request pool's Mamba
pool), layer 1 full attention (KV buffers, when asked for). CPU workarounds as in
``../shared/notes/sglang-0.5.15-internals.md`` section 4: ``device="cpu"``, the Mamba chunk size
set on the global server args, page 1 without SGLang's extra buffer, larger pages with it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class CpuHybridCache:
    cache: Any  # the radix cache (cache_cls)
    kv: Any  # the token-to-KV allocator
    req_pool: Any  # HybridReqToTokenPool (its mamba_allocator hands out state slots)
    kv_pool: Any | None  # HybridLinearKVPool, or None without KV buffers
    params: Any  # the CacheInitParams the cache was built with
    page_size: int


def set_global_server_args(page_size: int) -> None:
    """What SGLang's cache code reads from the scheduler's global server args."""
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

    args = ServerArgs(model_path="dummy", device="cpu")
    args._mamba_cache_chunk_size = 64  # else MambaRadixCache reads it from the model's HF config
    args.page_size = page_size  # release_kv_cache reads it
    set_global_server_args_for_scheduler(args)


def tiny_mamba_params():
    """SGLang's ``Mamba2CacheParams`` for the tiny layout: one linear-attention layer (layer 0)."""
    from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateShape

    shape = Mamba2StateShape.create(tp_world_size=1, intermediate_size=32, n_groups=1, num_heads=2, head_dim=4,
                                    state_size=4, conv_kernel=4)
    return Mamba2CacheParams(shape=shape, layers=[0])


def _hybrid_pools(page_size: int, kv_tokens: int, mamba_slots: int, events: bool, kv_buffers: bool) -> CpuHybridCache:
    """Fresh hybrid pools and the ``CacheInitParams`` a tree over them is built from (``cache`` None):
    ``kv_tokens`` tokens, ``mamba_slots`` state slots, SGLang's extra buffer for pages above 1."""
    import torch
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.memory_pool import HybridLinearKVPool, HybridReqToTokenPool

    set_global_server_args(page_size)
    extra = page_size > 1
    req_pool = HybridReqToTokenPool(
        size=4, mamba_size=mamba_slots, mamba_spec_state_size=4, max_context_len=kv_tokens, device="cpu",
        enable_memory_saver=False, cache_params=tiny_mamba_params(), mamba_layer_ids=[0],
        enable_mamba_extra_buffer=extra, speculative_num_draft_tokens=None)
    kv_pool = HybridLinearKVPool(size=kv_tokens, dtype=torch.bfloat16, page_size=page_size, head_num=2, head_dim=8,
                                 full_attention_layer_ids=[1], device="cpu",
                                 mamba_pool=req_pool.mamba_pool) if kv_buffers else None
    if extra:
        kv = PagedTokenToKVPoolAllocator(size=kv_tokens, page_size=page_size, dtype=torch.bfloat16, device="cpu",
                                         kvcache=kv_pool, need_sort=False)
    else:
        kv = TokenToKVPoolAllocator(size=kv_tokens, dtype=torch.bfloat16, device="cpu", kvcache=kv_pool, need_sort=False)
    params = CacheInitParams(disable=False, req_to_token_pool=req_pool, token_to_kv_pool_allocator=kv,
                             page_size=page_size, enable_kv_cache_events=events, enable_mamba_extra_buffer=extra)
    return CpuHybridCache(None, kv, req_pool, kv_pool, params, page_size)


def cpu_hybrid_cache(cache_cls, page_size: int, kv_tokens: int, mamba_slots: int, events: bool = True,
                     kv_buffers: bool = True) -> CpuHybridCache:
    """``cache_cls`` (``MambaRadixCache`` or a subclass) over fresh pools of ``kv_tokens`` tokens and
    ``mamba_slots`` state slots; ``kv_buffers`` adds the full-attention layer's KV buffers."""
    built = _hybrid_pools(page_size, kv_tokens, mamba_slots, events, kv_buffers)
    built.cache = cache_cls(built.params)
    return built


def cpu_unified_hybrid_cache(page_size: int, kv_tokens: int, mamba_slots: int, events: bool = True,
                             admission=None, chunk_checkpoints: bool = True) -> CpuHybridCache:
    """SGLang 0.5.23's unified tree for the same tiny hybrid layout, as the ``prfaas-hybrid`` backend
    builds it (:class:`~prfaas_sglang.hooks.unified_cache.PrfaasUnifiedRadixCache`, a full-attention
    and a state-reporting Mamba component) over fresh pools; page 1 without SGLang's extra buffer,
    larger pages with it."""
    from sglang.srt.mem_cache.unified_cache.components import ComponentType

    from prfaas_sglang.hooks.unified_cache import PrfaasUnifiedRadixCache, StateEventsMambaComponent

    built = _hybrid_pools(page_size, kv_tokens, mamba_slots, events, kv_buffers=True)
    built.params.tree_components = (ComponentType.FULL, ComponentType.MAMBA)  # as create_unified_radix_cache sets them
    built.params.component_registry_override = {ComponentType.MAMBA: StateEventsMambaComponent}
    built.cache = PrfaasUnifiedRadixCache(built.params, admission, chunk_checkpoints)
    return built


def cpu_decode_hybrid_cache(cache_cls, kv_tokens: int, max_running: int, pre_alloc: int,
                            events: bool = True) -> CpuHybridCache:
    """A decode worker's pools for a hybrid model (page 1, ``no_buffer``): SGLang's
    ``HybridMambaDecodeReqToTokenPool`` with ``max_running`` request slots plus ``pre_alloc`` for
    requests receiving KV (one state slot each, the decode pool's own sizing), a
    ``HybridLinearKVPool`` of ``kv_tokens`` with KV buffers, and ``cache_cls`` over them."""
    import torch
    from sglang.srt.disaggregation.decode import HybridMambaDecodeReqToTokenPool
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.memory_pool import HybridLinearKVPool

    set_global_server_args(1)
    req_pool = HybridMambaDecodeReqToTokenPool(
        size=max_running, max_context_len=kv_tokens, device="cpu", enable_memory_saver=False,
        cache_params=tiny_mamba_params(), mamba_layer_ids=[0], speculative_num_draft_tokens=None,
        enable_mamba_extra_buffer=False, pre_alloc_size=pre_alloc, enable_overlap_schedule=False)
    kv_pool = HybridLinearKVPool(size=kv_tokens, dtype=torch.bfloat16, page_size=1, head_num=2, head_dim=8,
                                 full_attention_layer_ids=[1], device="cpu", mamba_pool=req_pool.mamba_pool)
    kv = TokenToKVPoolAllocator(size=kv_tokens, dtype=torch.bfloat16, device="cpu", kvcache=kv_pool, need_sort=False)
    params = CacheInitParams(disable=False, req_to_token_pool=req_pool, token_to_kv_pool_allocator=kv,
                             page_size=1, enable_kv_cache_events=events, enable_mamba_extra_buffer=False)
    return CpuHybridCache(cache_cls(params), kv, req_pool, kv_pool, params, 1)


def cpu_radix_cache(cache_cls, page_size: int, kv_tokens: int, events: bool = True,
                    kv_buffers: bool = False) -> CpuHybridCache:
    """``cache_cls`` (``RadixCache`` or a subclass: a full-attention model's cache) over a fresh
    request pool and a token allocator of ``kv_tokens`` tokens; ``kv_buffers`` adds an
    ``MHATokenToKVPool`` of two layers (else ``kv_pool`` is None)."""
    import torch
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool

    set_global_server_args(page_size)
    req_pool = ReqToTokenPool(size=4, max_context_len=kv_tokens, device="cpu", enable_memory_saver=False)
    kv_pool = MHATokenToKVPool(size=kv_tokens, page_size=page_size, dtype=torch.bfloat16, head_num=2, head_dim=8,
                               layer_num=2, device="cpu", enable_memory_saver=False) if kv_buffers else None
    if page_size > 1:
        kv = PagedTokenToKVPoolAllocator(size=kv_tokens, page_size=page_size, dtype=torch.bfloat16, device="cpu",
                                         kvcache=kv_pool, need_sort=False)
    else:
        kv = TokenToKVPoolAllocator(size=kv_tokens, dtype=torch.bfloat16, device="cpu", kvcache=kv_pool, need_sort=False)
    params = CacheInitParams(disable=False, req_to_token_pool=req_pool, token_to_kv_pool_allocator=kv,
                             page_size=page_size, enable_kv_cache_events=events)
    return CpuHybridCache(cache_cls(params), kv, req_pool, kv_pool, params, page_size)


def cpu_swa_cache(cache_cls, page_size: int, full_tokens: int, swa_tokens: int, window_tokens: int,
                  events: bool = True, req_slots: int = 4, max_context_len: int = 256) -> CpuHybridCache:
    """``cache_cls`` (``SWARadixCache`` or a subclass: a sliding-window model's cache) over SGLang's
    SWA pools: ``full_tokens`` of full-attention KV (layer 2), ``swa_tokens`` of sliding-window KV
    (layers 0 and 1), a ``window_tokens`` window. ``kv`` is the ``SWATokenToKVPoolAllocator``."""
    import torch
    from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
    from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool

    set_global_server_args(page_size)
    pool = SWAKVPool(size=full_tokens, size_swa=swa_tokens, page_size=page_size, dtype=torch.bfloat16, head_num=1,
                     head_dim=4, swa_attention_layer_ids=[0, 1], full_attention_layer_ids=[2], device="cpu")
    kv = SWATokenToKVPoolAllocator(size=full_tokens, size_swa=swa_tokens, page_size=page_size, dtype=torch.bfloat16,
                                   device="cpu", kvcache=pool, need_sort=False)
    req_pool = ReqToTokenPool(size=req_slots, max_context_len=max_context_len, device="cpu", enable_memory_saver=False)
    params = CacheInitParams(disable=False, req_to_token_pool=req_pool, token_to_kv_pool_allocator=kv,
                             page_size=page_size, enable_kv_cache_events=events, sliding_window_size=window_tokens)
    return CpuHybridCache(cache_cls(params), kv, req_pool, pool, params, page_size)


def cpu_full_cache(page_size: int, kv_tokens: int, events: bool = True, kv_buffers: bool = False) -> CpuHybridCache:
    """The installed SGLang's prefix cache for a full-attention model over :func:`cpu_radix_cache`'s
    pools: its ``RadixCache`` where it has a tree per model kind (0.5.15), else its unified tree with
    one full-attention component (0.5.23; what ``create_unified_radix_cache`` builds for such a model,
    on SGLang's default tree core)."""
    from prfaas_sglang._compat import TreeKind, tree_kind

    if tree_kind() is TreeKind.PER_KIND:
        from sglang.srt.mem_cache.radix_cache import RadixCache

        return cpu_radix_cache(RadixCache, page_size, kv_tokens, events, kv_buffers)
    from sglang.srt.mem_cache.unified_cache.components import ComponentType
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    built = cpu_radix_cache(lambda params: None, page_size, kv_tokens, events, kv_buffers)
    built.params.tree_components = (ComponentType.FULL,)
    built.cache = UnifiedRadixCache(built.params)
    return built


def cpu_prefill_hybrid_cache(page_size: int, kv_tokens: int, mamba_slots: int, events: bool = True) -> CpuHybridCache:
    """The ``prfaas-hybrid`` prefill tree of the installed SGLang for the tiny hybrid layout, with KV
    buffers: the state-reporting ``MambaRadixCache`` (0.5.15) or :func:`cpu_unified_hybrid_cache` (0.5.23)."""
    from prfaas_sglang._compat import TreeKind, tree_kind

    if tree_kind() is TreeKind.PER_KIND:
        from prfaas_sglang.hooks.hybrid_cache import StateEventsMambaRadixCache

        return cpu_hybrid_cache(StateEventsMambaRadixCache, page_size, kv_tokens, mamba_slots, events)
    return cpu_unified_hybrid_cache(page_size, kv_tokens, mamba_slots, events)


def random_prefix_transfer(cache, tokens: list[int], gen):
    """A cache-move message of ``tokens`` shaped for ``cache``'s pools, with random KV rows and state
    drawn from the ``torch.Generator`` ``gen``: what a finished prefill leaves, for seeding a tree
    through ``import_prefix``."""
    import torch

    from prfaas_sglang.hooks.cache_import import _blob, _kv_buffers, _state_buffers
    from prfaas_sglang.wire.prefix_transfer import PREFIX_TRANSFER_VERSION, PrefixTransfer

    def rand(shape, like):
        return torch.randn(shape, generator=gen).to(like.dtype)

    n = len(tokens)
    kv = [_blob(name, rand((n, *buf.shape[1:]), buf)) for name, buf in _kv_buffers(cache)]
    state = [_blob(name, rand((buf.shape[0], *buf.shape[2:]), buf)) for name, buf in _state_buffers(cache)]
    return PrefixTransfer(PREFIX_TRANSFER_VERSION, list(tokens), cache.page_size, kv, state)

