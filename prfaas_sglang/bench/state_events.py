"""What state events cost: SGLang's MambaRadixCache (or SWARadixCache) vs ours (``hooks/hybrid_cache.py``) on one stream.

``cache="swa"``: SGLang's ``SWARadixCache`` and ours (``"swa"`` events, one per page whose window
KV comes or goes) on SWA pools whose window pool is ``swa_ratio`` of the full pool (SGLang's
``--swa-full-tokens-ratio`` default), a ``window_tokens`` window; window KV is evicted when short,
as the scheduler does. Everything else as below.

The Mooncake conversation trace's first ``requests`` requests, in order, each prompt built from
its ``hash_ids`` (512 tokens per id, so shared ids share tokens) and clipped to its
``input_length``: per request the scheduler's two cache calls, ``match_prefix`` then ``insert``
(evicting full KV or Mamba slots first when the pools are short, as the scheduler does), then one
published batch. Two caches on identical pools take the same stream, interleaved request by
request: SGLang's own ``MambaRadixCache`` whose batch SGLang's ``zmq`` publisher would write,
and our subclass whose batch the ``prfaas-zmq`` publisher writes (wire v2), taking turns at
going first, with the garbage collector run between steps and paused within them. Reported: events and
bytes per request and per second of the trace's own clock, the state events' share, the CPU time
of the cache calls and of encoding, ours over stock, and whether both caches matched alike.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

from prfaas_sglang.bench.subcommands import CommaList, Invocation, Subcommand, trace_path

BLOCK_TOKENS = 512
VOCAB = 32_000


def prompt_from_hash_ids(hash_ids, input_length: int) -> list[int]:
    tokens: list[int] = []
    for h in hash_ids:
        tokens += [(h * 7919 + i * 31) % VOCAB for i in range(BLOCK_TOKENS)]
        if len(tokens) >= input_length:
            break
    return tokens[:input_length]


def _side(cache_cls, page_size: int, kv_tokens: int, mamba_slots: int):
    from prfaas_sglang.bench.sglang_cpu import cpu_hybrid_cache

    built = cpu_hybrid_cache(cache_cls, page_size, kv_tokens, mamba_slots, kv_buffers=False)
    return built.cache, built.kv, built.req_pool


def _step(side, tokens: list[int]) -> tuple[int, float]:
    """match_prefix then insert, as a finished request goes through the scheduler: (hit, seconds)."""
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    cache, kv, req_pool = side
    t0 = time.perf_counter()
    hit = len(cache.match_prefix(MatchPrefixParams(key=RadixKey(tokens))).device_indices)
    if kv.available_size() < len(tokens):
        cache.evict(EvictParams(num_tokens=len(tokens) - kv.available_size()))
    value = kv.alloc(len(tokens))
    slot = req_pool.mamba_allocator.alloc(1)
    if slot is None:
        cache.evict(EvictParams(num_tokens=0, mamba_num=1))
        slot = req_pool.mamba_allocator.alloc(1)
    if value is not None and slot is not None:
        result = cache.insert(InsertParams(key=RadixKey(tokens), value=value, mamba_value=slot))
        if result.mamba_exist:
            req_pool.mamba_allocator.free(slot)
    return hit, time.perf_counter() - t0


SWA_RATIO = 0.8  # SGLang's --swa-full-tokens-ratio default


def _swa_side(cache_cls, page_size: int, kv_tokens: int, window_tokens: int):
    import torch
    from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
    from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool

    swa_tokens = int(kv_tokens * SWA_RATIO) // page_size * page_size
    pool = SWAKVPool(size=kv_tokens, size_swa=swa_tokens, page_size=page_size, dtype=torch.bfloat16, head_num=1,
                     head_dim=1, swa_attention_layer_ids=[0], full_attention_layer_ids=[1], device="cpu")
    alloc = SWATokenToKVPoolAllocator(size=kv_tokens, size_swa=swa_tokens, page_size=page_size, dtype=torch.bfloat16,
                                      device="cpu", kvcache=pool, need_sort=False)
    params = CacheInitParams(disable=False, req_to_token_pool=ReqToTokenPool(4, 1 << 18, "cpu", False),
                             token_to_kv_pool_allocator=alloc, page_size=page_size, enable_kv_cache_events=True,
                             sliding_window_size=window_tokens)
    return cache_cls(params=params), alloc, None


def _swa_step(side, tokens: list[int]) -> tuple[int, float]:
    """match_prefix, evict full and window KV when short, insert: (hit, seconds)."""
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    cache, alloc, _ = side
    n = len(tokens)
    t0 = time.perf_counter()
    hit = len(cache.match_prefix(MatchPrefixParams(key=RadixKey(tokens))).device_indices)
    if alloc.full_available_size() < n:
        cache.evict(EvictParams(num_tokens=n - alloc.full_available_size()))
    if alloc.swa_available_size() < n:
        cache.evict(EvictParams(num_tokens=0, swa_num_tokens=n - alloc.swa_available_size()))
    if cache.page_size == 1:
        value = alloc.alloc(n)
    else:  # SWATokenToKVPoolAllocator.alloc is page-1 only: both pools, then the mapping, as alloc_extend does
        value = alloc.full_attn_allocator.alloc(n)
        swa = alloc.swa_attn_allocator.alloc(n) if value is not None else None
        if swa is not None:
            alloc.set_full_to_swa_mapping(value, swa)
        else:
            value = None
    if value is not None:
        cache.insert(InsertParams(key=RadixKey(tokens), value=value))
    return hit, time.perf_counter() - t0


def run(trace_path: str, requests: int = 200, page_sizes: tuple[int, ...] = (1, 64), kv_tokens: int = 1 << 20,
        mamba_slots: int = 256, cache: str = "mamba", window_tokens: int = 4096) -> dict:
    import msgspec
    from sglang.srt.disaggregation.kv_events import KVEventBatch as SglangBatch
    from sglang.srt.mem_cache.mamba_radix_cache import MambaRadixCache
    from sglang.srt.mem_cache.swa_radix_cache import SWARadixCache

    from prfaas_sglang.hooks.event_publisher import to_wire_batch
    from prfaas_sglang.hooks.hybrid_cache import (
        StateEventsMambaRadixCache,
        StateEventsSWARadixCache,
    )
    from prfaas_sglang.plan.workload import read_trace
    from prfaas_sglang.wire.kv_events import StateRemoved

    if cache not in ("mamba", "swa"):
        raise ValueError(f"cache must be mamba or swa, got {cache!r}")

    records = list(read_trace(trace_path, "--trace", requests))
    span_s = max((records[-1].timestamp_ms - records[0].timestamp_ms) / 1e3, 1e-9)
    encoder = msgspec.msgpack.Encoder()
    rows = []
    for page in page_sizes:
        if cache == "swa":
            stock, ours = (_swa_side(SWARadixCache, page, kv_tokens, window_tokens),
                           _swa_side(StateEventsSWARadixCache, page, kv_tokens, window_tokens))
            step = _swa_step
        else:
            stock, ours = _side(MambaRadixCache, page, kv_tokens, mamba_slots), _side(StateEventsMambaRadixCache, page,
                                                                                     kv_tokens, mamba_slots)
            step = _step
        totals = {"stock": [0, 0, 0.0, 0.0], "ours": [0, 0, 0.0, 0.0]}  # events, bytes, cache s, encode s
        states = {"stored": 0, "removed": 0}
        ratios, hits_equal, hit_tokens = [], True, 0
        for i, rec in enumerate(records):
            tokens = prompt_from_hash_ids(rec.hash_ids, rec.input_length)
            tokens = tokens[: len(tokens) // page * page]
            if not tokens:
                continue
            per = {}
            order = (("stock", stock), ("ours", ours))
            for name, side in order if i % 2 else order[::-1]:  # alternate who goes first (warm caches)
                gc.collect()  # a collection lands on whichever side allocates when it triggers: not in the timings
                gc.disable()
                try:
                    hit, cache_s = step(side, tokens)
                    events = side[0].take_events()
                    t0 = time.perf_counter()
                    batch = SglangBatch(ts=time.time(), events=events)
                    payload = encoder.encode(to_wire_batch(batch) if name == "ours" else batch)
                    encode_s = time.perf_counter() - t0
                finally:
                    gc.enable()
                n = len(events) + len(getattr(events, "state_events", ()))
                if name == "ours":
                    for e in events.state_events:
                        states["removed" if isinstance(e, StateRemoved) else "stored"] += 1
                t = totals[name]
                t[0] += n
                t[1] += len(payload)
                t[2] += cache_s
                t[3] += encode_s
                per[name] = (hit, cache_s + encode_s)
            hits_equal &= per["stock"][0] == per["ours"][0]
            hit_tokens += per["ours"][0]
            ratios.append(per["ours"][1] / per["stock"][1])
        n_req = len(ratios)
        rows.append({
            "page_size": page,
            "requests": n_req,
            "prompt_tokens_mean": sum(min(r.input_length, len(r.hash_ids) * BLOCK_TOKENS) for r in records) / len(records),
            "hit_tokens": hit_tokens,
            "hits_equal": hits_equal,
            "state_events_stored": states["stored"],
            "state_events_removed": states["removed"],
            **{f"{name}_{key}": value for name, t in totals.items() for key, value in (
                ("events", t[0]), ("bytes", t[1]), ("events_per_s", t[0] / span_s), ("bytes_per_s", t[1] / span_s),
                ("cache_ms_per_request", t[2] / n_req * 1e3), ("encode_ms_per_request", t[3] / n_req * 1e3))},
            "time_ratio_median": statistics.median(ratios),
            "time_ratio_total": (totals["ours"][2] + totals["ours"][3]) / (totals["stock"][2] + totals["stock"][3]),
        })
    return {"trace_span_s": span_s, "kv_tokens": kv_tokens, "mamba_slots": mamba_slots, "cache": cache,
            "window_tokens": window_tokens if cache == "swa" else None, "rows": rows}


def render_markdown(result: dict) -> str:
    pools = (f"{result['mamba_slots']} Mamba slots" if result.get("cache", "mamba") == "mamba" else
             f"a window pool of {SWA_RATIO:g} x that, a {result['window_tokens']}-token window (SWARadixCache)")
    lines = [
        f"Trace span {result['trace_span_s']:.0f} s; pools: {result['kv_tokens']} KV tokens, {pools}.",
        "",
        "| page | requests | hits equal | events stock / ours | state events (stored / removed) | bytes stock / ours "
        "| hit tokens | state events/s, bytes/s | KB/s stock / ours | cache + encode ms per request stock / ours "
        "| ours / stock time (median per request, total) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['page_size']} | {r['requests']} | {r['hits_equal']} | {r['stock_events']} / {r['ours_events']} | "
            f"{r['state_events_stored']} / {r['state_events_removed']} | {r['stock_bytes']} / {r['ours_bytes']} | "
            f"{r['hit_tokens']} | {(r['ours_events'] - r['stock_events']) / result['trace_span_s']:.1f}, "
            f"{(r['ours_bytes'] - r['stock_bytes']) / result['trace_span_s']:.0f} | "
            f"{r['stock_bytes_per_s'] / 1e3:.1f} / {r['ours_bytes_per_s'] / 1e3:.1f} | "
            f"{r['stock_cache_ms_per_request'] + r['stock_encode_ms_per_request']:.2f} / "
            f"{r['ours_cache_ms_per_request'] + r['ours_encode_ms_per_request']:.2f} | "
            f"{r['time_ratio_median']:.3f}, {r['time_ratio_total']:.3f} |")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trace", default=None, help="Mooncake trace JSONL (default: PRFAAS_TRACE_PATH or ../shared/data)")
    parser.add_argument("--requests", type=int, default=200,
                        help="replay the trace's first N requests, in order")
    parser.add_argument("--page-sizes", type=CommaList(int), default="1,64", help="comma list (1: no_buffer; > 1: extra_buffer)")
    parser.add_argument("--cache", choices=("mamba", "swa"), default="mamba",
                        help="mamba: MambaRadixCache vs ours; swa: SWARadixCache vs ours (per-page window events)")
    parser.add_argument("--window-tokens", type=int, default=4096, help="--cache swa: the sliding window")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")


def cli(args: argparse.Namespace, inv: Invocation) -> int:
    trace = trace_path(args.trace)
    pages = args.page_sizes
    if args.requests < 1 or any(p < 1 for p in pages):
        inv.error("--requests and every page size must be >= 1")
    if args.window_tokens < 1:
        inv.error("--window-tokens must be >= 1")
    result = run(trace, args.requests, pages, cache=args.cache, window_tokens=args.window_tokens)
    return inv.report(args, result, None, render_markdown)


SUBCOMMANDS = {"state-events": Subcommand(add_arguments, cli)}
