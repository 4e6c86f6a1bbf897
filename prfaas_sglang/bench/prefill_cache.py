"""What a PrfaaS worker's prefix cache keeps, and what it gains: the admission modes on a trace.

The Mooncake conversation trace's requests with at least ``min_tokens`` prompt tokens (what a
length threshold sends to the PrfaaS cluster), in order, through one PrfaaS worker's prefix
cache: the emulated engine's :class:`~prfaas_sglang.engine.mock.prefix_cache.PrefixCache`
(512-token pages, LRU, a hybrid model's state checkpoints at every 8192-token chunk and at the
prompt's end) deciding with :class:`~prfaas_sglang.kvindex.admission.PrefixAdmission` exactly as
the emulated engine and the SGLang cache backend do: match, decide, insert only what is kept.
Prompts are built from ``hash_ids`` (512 tokens per id, so shared ids share tokens).

Per mode (``all``: SGLang's behaviour; ``shared``: the prfaas role's default; ``none``) and cache
capacity: prefill tokens saved by hits, tokens inserted (what the tree had to hold), blocks
evicted, and the cache's mean occupancy. Simplification: one PrfaaS worker sees every long
request (a cache-aware router may send a follow-up turn to where its prefix is cached).
"""

from __future__ import annotations

import argparse

from prfaas_sglang.bench.state_events import BLOCK_TOKENS, prompt_from_hash_ids
from prfaas_sglang.bench.subcommands import CommaList, Invocation, Subcommand, trace_path

MODES = ("all", "shared", "auto", "none")


def run(trace_path: str, min_tokens: int = 16_384, cache_tokens: tuple[int, ...] = (262_144, 1_048_576, 4_194_304, 16_777_216),
        requests: int | None = None, min_shared_tokens: int = 1024) -> dict:
    from prfaas_sglang.engine.mock.prefix_cache import PrefixCache
    from prfaas_sglang.kvindex.admission import PrefixAdmission
    from prfaas_sglang.plan.workload import read_trace
    from prfaas_sglang.wire.kv_events import BlockRemoved

    cells = {(mode, cap): {"cache": PrefixCache(BLOCK_TOKENS, max(cap // BLOCK_TOKENS, 1), hybrid=True),
                           "admission": PrefixAdmission(mode, min_shared_tokens, capacity_tokens=cap),
                           "hit_tokens": 0, "inserted_tokens": 0, "evicted_blocks": 0, "occupancy_sum": 0}
             for mode in MODES for cap in cache_tokens}
    seen = prompt_tokens = 0
    for rec in read_trace(trace_path, "--trace"):
        if rec.input_length < min_tokens:
            continue
        tokens = prompt_from_hash_ids(rec.hash_ids, rec.input_length)
        seen += 1
        prompt_tokens += len(tokens)
        for cell in cells.values():
            cache = cell["cache"]
            hit = cache.match(tokens[:-1]).cached_tokens  # the last token is always computed
            cell["hit_tokens"] += hit
            if cell["admission"].decide(tokens, hit).keep:
                before = len(cache)
                events = cache.insert(tokens)
                removed = sum(len(e.block_hashes) for e in events if isinstance(e, BlockRemoved))
                cell["evicted_blocks"] += removed
                cell["inserted_tokens"] += (len(cache) - before + removed) * BLOCK_TOKENS
            cell["occupancy_sum"] += len(cache) * BLOCK_TOKENS / (cache.capacity_blocks * BLOCK_TOKENS)
        if requests is not None and seen >= requests:
            break
    if seen == 0:
        raise ValueError(f"no request of the trace has >= {min_tokens} prompt tokens")
    rows = []
    for (mode, cap), cell in cells.items():
        stats = cell["admission"].stats
        rows.append({"mode": mode, "cache_tokens": cap, "requests": seen,
                     "hit_fraction": cell["hit_tokens"] / prompt_tokens,
                     "kept_requests": stats.kept_requests,
                     "inserted_tokens_per_request": cell["inserted_tokens"] / seen,
                     "evicted_blocks": cell["evicted_blocks"],
                     "occupancy_mean": cell["occupancy_sum"] / seen})
    return {"trace": trace_path, "min_tokens": min_tokens, "requests": seen, "prompt_tokens": prompt_tokens,
            "min_shared_tokens": min_shared_tokens, "rows": rows}


def render_markdown(result: dict) -> str:
    lines = [f"Trace requests with >= {result['min_tokens']} prompt tokens: {result['requests']} "
             f"({result['prompt_tokens'] / 1e6:.1f} M prompt tokens); `shared` counts a prefix of "
             f">= {result['min_shared_tokens']} tokens.", "",
             "| cache (tokens) | mode | prefill tokens saved | requests kept | tokens inserted / request | "
             "blocks evicted | mean occupancy |",
             "|---:|---|---:|---:|---:|---:|---:|"]
    for row in sorted(result["rows"], key=lambda r: (r["cache_tokens"], MODES.index(r["mode"]))):
        lines.append(f"| {row['cache_tokens']:,} | `{row['mode']}` | {row['hit_fraction']:.1%} | "
                     f"{row['kept_requests']} / {row['requests']} | {row['inserted_tokens_per_request']:,.0f} | "
                     f"{row['evicted_blocks']:,} | {row['occupancy_mean']:.0%} |")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trace", default=None, help="Mooncake trace JSONL (default: PRFAAS_TRACE_PATH or ../shared/data)")
    parser.add_argument("--min-tokens", type=int, default=16_384, help="the requests a length threshold sends to PrfaaS")
    parser.add_argument("--cache-tokens", type=CommaList(int), default="262144,1048576,4194304,16777216", help="comma list of capacities, tokens")
    parser.add_argument("--requests", type=int, default=None, help="stop after this many long requests")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")


def cli(args: argparse.Namespace, inv: Invocation) -> int:
    caps = args.cache_tokens
    if args.min_tokens < 1 or any(c < 512 for c in caps) or (args.requests is not None and args.requests < 1):
        inv.error("--min-tokens and --requests must be >= 1 and every capacity >= 512")
    try:
        result = run(trace_path(args.trace), args.min_tokens, caps, args.requests)
    except ValueError as err:
        inv.error(str(err))
    return inv.report(args, result, None, render_markdown)


SUBCOMMANDS = {"prefill-cache": Subcommand(add_arguments, cli)}
