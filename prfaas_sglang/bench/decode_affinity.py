"""``bench decode-affinity``: conversations through the router, with and without decode affinity.

A deployment of emulated hybrid workers (one PrfaaS, one PD prefill, ``decode_workers`` PD
decode workers with SGLang's decode radix cache, their KV events in the router's index) serves
``conversations`` conversations at once, each ``turns`` turns in order: a turn's prompt is the
previous prompt, its answer and a new message. The same arrivals (per seed) run twice: the
router preferring the decode worker that holds a conversation (``--decode-affinity-slack 0.1``,
the default) and choosing by free KV alone (``-1``, the strongest setting that ignores decode
caches: it spreads load best). Reported per row: the KV the decode workers received (modelled
bytes, ``kv_bytes_received`` / kv_scale), the part of it that crossed the PrfaaS link (the PrfaaS
worker's ``kv_bytes_sent``), the prompt tokens the decode caches supplied, and end-to-end latency.

The gain's mechanism is one thing only: a later turn's decode worker already holds the earlier
turns, so the prefill worker ships only the new tail (plus the linear state). Without affinity a
turn lands on its conversation's worker only as often as free KV happens to send it there.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import random
import statistics
import tempfile
import time
from pathlib import Path

from prfaas_sglang.adapters import http_sync
from prfaas_sglang.bench.subcommands import Invocation, Subcommand
from prfaas_sglang.demo.cluster import ProcessGroup, local_topology, scrape_metric, start_deployment

SPEEDUP, KV_SCALE, THRESHOLD = 20.0, 0.002, 6_000
ARGS = ("--bootstrap-timeout-s", "20", "--context-tokens", "131072")
ROWS = {"affinity": ("--decode-affinity-slack", "0.1"), "free-KV only": ("--decode-affinity-slack", "-1")}
# A linear-attention hybrid (its state ships with every transfer, held prefix or not) and a
# full-attention model (nothing ships but KV), both served with SGLang's decode radix cache.
MODELS = ("kimi-linear-1t-hybrid", "qwen3-235b-a22b")


def _lengths(seed: int, conversations: int, turns: int) -> list[list[int]]:
    """Per conversation, each turn's new tokens: a first turn of 4K-16K (log-uniform), later
    messages of 300-3,000 (the same arrivals for both rows of a seed)."""
    rng = random.Random(seed)
    return [[int(4_000 * 4 ** rng.random()) if t == 0 else int(300 * 10 ** rng.random()) for t in range(turns)]
            for _ in range(conversations)]


def _drive(url: str, lengths: list[list[int]], seed: int) -> list[float]:
    """The conversations at once, each its turns in order; returns every request's latency (s)."""
    def conversation(c: int) -> list[float]:
        history: list[int] = []
        latencies = []
        for t, n in enumerate(lengths[c]):
            fresh = [(seed * 131 + c * 7_919 + t * 104_729 + i * 31) % 30_000 for i in range(n)]
            prompt = history + fresh
            start = time.monotonic()
            reply = http_sync.post_json(url + "/generate", {"input_ids": prompt, "sampling_params": {"max_new_tokens": 16}},
                                        timeout_s=300)
            latencies.append(time.monotonic() - start)
            history = prompt + reply["output_ids"]
            time.sleep(0.3)  # the user reads the answer; the decode worker's events reach the router meanwhile
        return latencies

    with concurrent.futures.ThreadPoolExecutor(len(lengths)) as pool:
        return [x for row in pool.map(conversation, range(len(lengths))) for x in row]


def run_row(row: str, seed: int, conversations: int, turns: int, decode_workers: int, model: str) -> dict:
    group = ProcessGroup(Path(tempfile.mkdtemp(prefix="prfaas-decode-affinity-")))
    try:
        doc = local_topology(pd_prefill=1, pd_decode=decode_workers, speedup=SPEEDUP, kv_scale=KV_SCALE,
                             threshold_tokens=THRESHOLD, telemetry=False, decode_events=True)
        doc["model"] = {**doc.get("model", {}), "cost_model": model}
        engine_args = {"prfaas": ARGS, "pd-prefill": ARGS,
                       "pd-decode": ARGS + ("--disaggregation-decode-enable-radix-cache",)}
        dep = start_deployment(group, doc, *ROWS[row], engine_args=engine_args)
        latencies = _drive(dep.router.url, _lengths(seed, conversations, turns), seed)
        decodes = [w for name, w in dep.workers.items() if name.startswith("pd-decode")]
        received = sum(scrape_metric(w.url, "prfaas:kv_bytes_received_total") for w in decodes)
        held = sum(scrape_metric(w.url, "prfaas:decode_prefix_tokens_total") for w in decodes)
        wan = sum(scrape_metric(w.url, "prfaas:kv_bytes_sent_total") for n, w in dep.workers.items() if n.startswith("prfaas"))
        prompt_tokens = sum(scrape_metric(w.url, "sglang:prompt_tokens_total") for w in decodes)
    finally:
        group.stop()
    return {"model": model, "row": row, "seed": seed, "requests": len(latencies),
            "decode_kv_bytes": received / KV_SCALE, "wan_kv_bytes": wan / KV_SCALE,
            "decode_held_fraction": held / prompt_tokens if prompt_tokens else 0.0,
            "latency_p50_s": statistics.median(latencies), "latency_p90_s": _p90(latencies)}


def _p90(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(0.9 * len(xs)))]


def run(seeds: int = 3, conversations: int = 6, turns: int = 4, decode_workers: int = 2,
        models: tuple[str, ...] = MODELS) -> dict:
    results = [run_row(row, seed, conversations, turns, decode_workers, model)
               for model in models for seed in range(seeds) for row in ROWS]
    ratios = {}
    for model in models:
        pairs = [{r["row"]: r for r in results if r["model"] == model and r["seed"] == s} for s in range(seeds)]
        ratios[model] = {key: [p["affinity"][key] / p["free-KV only"][key] for p in pairs if p["free-KV only"][key]]
                         for key in ("decode_kv_bytes", "wan_kv_bytes", "latency_p50_s")}
    return {"setup": {"seeds": seeds, "conversations": conversations, "turns": turns, "decode_workers": decode_workers,
                      "speedup": SPEEDUP, "kv_scale": KV_SCALE, "threshold_tokens": THRESHOLD, "models": list(models)},
            "rows": results, "ratios_affinity_over_free_kv": ratios}


def markdown(result: dict) -> str:
    lines = ["| model | seed | row | requests | decode KV received (modelled GB) | over the PrfaaS link (GB) | "
             "prompt held by the decode worker | latency p50 / p90 (s) |", "|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['model']} | {r['seed']} | {r['row']} | {r['requests']} | {r['decode_kv_bytes'] / 1e9:.2f} | "
                     f"{r['wan_kv_bytes'] / 1e9:.2f} | {100 * r['decode_held_fraction']:.1f}% | "
                     f"{r['latency_p50_s']:.2f} / {r['latency_p90_s']:.2f} |")
    lines.append("")
    for model, ratios in result["ratios_affinity_over_free_kv"].items():
        for key, values in ratios.items():
            if values:
                lines.append(f"- {model}, affinity / free-KV only, {key}: median {statistics.median(values):.3f} "
                             f"(min {min(values):.3f}, max {max(values):.3f}) over {len(values)} seeds")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seeds", type=int, default=3,
                        help="runs per model and row, seeds 0..N-1 (each its own conversations)")
    parser.add_argument("--conversations", type=int, default=6,
                        help="conversations served at once")
    parser.add_argument("--turns", type=int, default=4,
                        help="turns per conversation, sent in order")
    parser.add_argument("--decode-workers", type=int, default=2,
                        help="PD decode workers (at least 2)")
    parser.add_argument("--models", default="kimi-linear-1t-hybrid,qwen3-235b-a22b", help="cost models, comma list")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")


def cli(args: argparse.Namespace, inv: Invocation) -> int:
    if min(args.seeds, args.conversations, args.turns) < 1 or args.decode_workers < 2:
        inv.error("--seeds, --conversations and --turns must be >= 1, --decode-workers >= 2")
    result = run(args.seeds, args.conversations, args.turns, args.decode_workers, tuple(args.models.split(",")))
    return inv.report(args, result, None, markdown)


SUBCOMMANDS = {"decode-affinity": Subcommand(add_arguments, cli)}
