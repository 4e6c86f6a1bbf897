"""What state events cost: SGLang's MambaRadixCache vs ours (``hooks/hybrid_cache.py``) on one stream.

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

import gc
import statistics
import time

BLOCK_TOKENS = 512
VOCAB = 32_000


def _prompt(hash_ids, input_length: int) -> list[int]:
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


def run(trace_path: str, requests: int = 200, page_sizes: tuple[int, ...] = (1, 64), kv_tokens: int = 1 << 20,
        mamba_slots: int = 256) -> dict:
    import msgspec
    from sglang.srt.disaggregation.kv_events import KVEventBatch as SglangBatch
    from sglang.srt.mem_cache.mamba_radix_cache import MambaRadixCache

    from prfaas_sglang.demo.workloads import trace_records
    from prfaas_sglang.hooks.hybrid_cache import StateEventsMambaRadixCache, to_wire_batch
    from prfaas_sglang.wire.kv_events import StateRemoved

    records = []
    for rec in trace_records(trace_path):
        records.append(rec)
        if len(records) >= requests:
            break
    span_s = max((records[-1].timestamp_ms - records[0].timestamp_ms) / 1e3, 1e-9)
    encoder = msgspec.msgpack.Encoder()
    rows = []
    for page in page_sizes:
        stock, ours = _side(MambaRadixCache, page, kv_tokens, mamba_slots), _side(StateEventsMambaRadixCache, page,
                                                                                 kv_tokens, mamba_slots)
        totals = {"stock": [0, 0, 0.0, 0.0], "ours": [0, 0, 0.0, 0.0]}  # events, bytes, cache s, encode s
        states = {"stored": 0, "removed": 0}
        ratios, hits_equal, hit_tokens = [], True, 0
        for i, rec in enumerate(records):
            tokens = _prompt(rec.hash_ids, rec.input_length)
            tokens = tokens[: len(tokens) // page * page]
            if not tokens:
                continue
            per = {}
            order = (("stock", stock), ("ours", ours))
            for name, side in order if i % 2 else order[::-1]:  # alternate who goes first (warm caches)
                gc.collect()  # a collection lands on whichever side allocates when it triggers: not in the timings
                gc.disable()
                try:
                    hit, cache_s = _step(side, tokens)
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
    return {"trace_span_s": span_s, "kv_tokens": kv_tokens, "mamba_slots": mamba_slots, "rows": rows}


def render_markdown(result: dict) -> str:
    lines = [
        f"Trace span {result['trace_span_s']:.0f} s; pools: {result['kv_tokens']} KV tokens, "
        f"{result['mamba_slots']} Mamba slots.",
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
