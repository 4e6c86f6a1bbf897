"""Emulated-engine fidelity: measured TTFT vs profile prefill time / speedup + measured KV transfer.

Isolated requests (one at a time) through one emulated prefill + decode pair
on loopback; each prompt is sent twice, so the second TTFT shows the cached
prefix (prefill of the uncached part only).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import tempfile
import time
from pathlib import Path

import aiohttp

from prfaas_sglang.bench.subcommands import Invocation, Subcommand
from prfaas_sglang.demo.cluster import ProcessGroup, start_mock_worker
from prfaas_sglang.engine.mock.timing import load_timing

PROFILE = "kimi-linear-1t-hybrid@h20x8"
LENGTHS = (1_024, 4_096, 16_384, 32_768, 65_536)


async def _one(session: aiohttp.ClientSession, prefill, decode, tokens: list[int], room: int) -> dict:
    body = {"input_ids": tokens, "sampling_params": {"max_new_tokens": 2}, "stream": True,
            "bootstrap_host": "127.0.0.1", "bootstrap_port": prefill.bootstrap_port, "bootstrap_room": room}
    start = time.perf_counter()

    async def post_prefill():
        async with session.post(prefill.url + "/generate", json={**body, "stream": False}) as resp:
            return resp.status, await resp.json()

    task = asyncio.create_task(post_prefill())
    ttft = None
    meta = None
    async with session.post(decode.url + "/generate", json=body) as resp:
        async for raw in resp.content:
            line = raw.decode().strip()
            if line.startswith("data: {"):
                if ttft is None:
                    ttft = time.perf_counter() - start
                meta = json.loads(line[6:])["meta_info"]
    status, prefill_body = await task
    if status != 200 or ttft is None:
        raise RuntimeError(f"request of {len(tokens)} tokens failed: {status} {prefill_body}")
    return {"ttft_s": ttft, "cached_tokens": prefill_body["meta_info"]["cached_tokens"],
            "kv_bytes": meta["prfaas"]["kv_bytes"], "kv_transfer_s": prefill_body["meta_info"]["prfaas"]["kv_transfer_s"]}


async def _run(speedup: float, kv_scale: float, lengths: tuple[int, ...], log_dir: Path) -> list[dict]:
    timing = load_timing(PROFILE, speedup, kv_scale, None)
    group = ProcessGroup(log_dir)
    rows = []
    try:
        extra = ["--speedup", str(speedup), "--kv-scale", str(kv_scale), "--context-tokens", str(max(lengths) + 16)]
        prefill = await asyncio.to_thread(start_mock_worker, group, "pd-prefill", "pd-prefill", PROFILE, extra)
        decode = await asyncio.to_thread(start_mock_worker, group, "pd-decode", "pd-decode", PROFILE, extra)
        rng = random.Random(7)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
            await _one(session, prefill, decode, [1] * 600, rng.getrandbits(63))  # warm the Mooncake lanes
            for n in lengths:
                tokens = [rng.randrange(32_000) for _ in range(n)]
                for attempt in ("cold", "repeat"):
                    got = await _one(session, prefill, decode, tokens, rng.getrandbits(63))
                    predicted = timing.prefill_s(n - got["cached_tokens"]) + got["kv_transfer_s"]
                    rows.append({"tokens": n, "attempt": attempt, **got, "predicted_ttft_s": predicted,
                                 "ratio": got["ttft_s"] / predicted})
    finally:
        group.stop()
    return rows


def run(speedup: float = 1.0, kv_scale: float = 0.01, lengths: tuple[int, ...] = LENGTHS) -> list[dict]:
    with tempfile.TemporaryDirectory(prefix="prfaas-fidelity-") as tmp:
        return asyncio.run(_run(speedup, kv_scale, lengths, Path(tmp)))


def render_markdown(rows: list[dict]) -> str:
    lines = ["| prompt tokens | request | cached tokens | KV bytes | KV transfer | predicted TTFT | measured TTFT | measured / predicted |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['tokens']:,} | {r['attempt']} | {r['cached_tokens']:,} | {r['kv_bytes']:,} | {r['kv_transfer_s'] * 1e3:.1f} ms | "
                     f"{r['predicted_ttft_s'] * 1e3:.1f} ms | {r['ttft_s'] * 1e3:.1f} ms | {r['ratio']:.3f} |")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--speedup", type=float, default=1.0,
                        help="the workers divide every emulated duration by this")
    parser.add_argument("--kv-scale", type=float, default=0.01,
                        help="fraction of a request's modelled KV bytes really sent, in (0, 1]")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")


def cli(args: argparse.Namespace, inv: Invocation) -> int:
    if not args.speedup > 0 or not 0 < args.kv_scale <= 1:
        inv.error("--speedup must be > 0 and --kv-scale in (0, 1]")
    result = run(args.speedup, args.kv_scale)
    return inv.report(args, result, None, render_markdown)


SUBCOMMANDS = {"mock-fidelity": Subcommand(add_arguments, cli)}
