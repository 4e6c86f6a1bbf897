"""What SGLang's own pools hold, read from its ``CacheInitParams`` (every supported release): a
tree's capacity for prefill admission, and the bytes one token and one request occupy, which a
PrfaaS worker reports at start-up (``PRFAAS_POOL_REPORT``) for the cost model."""

from __future__ import annotations

from typing import Any


def cache_capacity(params: Any) -> tuple[int, int | None]:
    """(KV tokens, state slots or None) a tree built from SGLang's ``CacheInitParams`` can fill:
    the token allocator's size (full-attention KV for a sliding-window model: a resumable prefix
    needs only a window of the other), and the Mamba state pool's slots for a hybrid model."""
    allocator = params.token_to_kv_pool_allocator
    mamba_pool = getattr(params.req_to_token_pool, "mamba_pool", None)
    return int(getattr(allocator, "size_full", allocator.size)), None if mamba_pool is None else int(mamba_pool.size)


def _slot_bytes(tensor: Any, slot_dim: int) -> int:
    """Bytes of one slot of ``tensor`` along ``slot_dim`` (all other dimensions)."""
    return tensor.numel() // max(int(tensor.shape[slot_dim]), 1) * tensor.element_size()


def pool_geometry(params: Any) -> dict:
    """What one token and one request occupy in SGLang's own pools (``CacheInitParams``): the
    full-attention KV of one token slot summed over layers (the token pool's K and V buffers, or an
    MLA pool's latent buffer; a hybrid linear pool's full-attention part), and one request's
    linear-attention state (every tensor of the Mamba pool's state, one slot of each), 0 without
    one. What a PrfaaS worker ships for ``l`` tokens is ``l * kv_bytes_per_token + state_bytes_per_request``."""
    kv = params.token_to_kv_pool_allocator.get_kvcache()
    kv = getattr(kv, "full_kv_pool", None) or kv
    buffers = [*(getattr(kv, "k_buffer", None) or ()), *(getattr(kv, "v_buffer", None) or ())] \
        or list(getattr(kv, "kv_buffer", None) or ())
    state_bytes, state_slots = 0, None
    mamba_pool = getattr(params.req_to_token_pool, "mamba_pool", None)
    if mamba_pool is not None:
        cache, state_slots = mamba_pool.mamba_cache, int(mamba_pool.size)
        for name in ("conv", "temporal"):  # [layers, slots, ...] each (conv: a list of them)
            value = getattr(cache, name, None)
            for tensor in (value if isinstance(value, (list, tuple)) else [value] if value is not None else []):
                state_bytes += _slot_bytes(tensor, 1)
    return {"kv_bytes_per_token": sum(_slot_bytes(b, 0) for b in buffers), "full_attention_layers": len(buffers) // 2
            if getattr(kv, "k_buffer", None) else len(buffers), "kv_pool_tokens": int(cache_capacity(params)[0]),
            "state_bytes_per_request": state_bytes, "state_slots": state_slots, "kv_pool": type(kv).__name__}


def report_pool_geometry(params: Any) -> None:
    """Append :func:`pool_geometry` as one JSON line to ``PRFAAS_POOL_REPORT`` when it is set. A
    pool this does not know is reported as an error line, and the server starts regardless."""
    import json
    import os

    from prfaas_sglang.envs import envs as prfaas_envs

    path = prfaas_envs.POOL_REPORT.get()
    if not path:
        return
    try:
        line = {"pid": os.getpid(), **pool_geometry(params)}
    except Exception as err:  # noqa: BLE001 - a report, never a reason to stop serving
        line = {"pid": os.getpid(), "error": f"{type(err).__name__}: {err}"}
    with open(path, "a") as fh:
        fh.write(json.dumps(line) + "\n")
