"""Router overhead: latency added by the PrfaaS router vs dispatching to the workers directly.

Both modes send the same tiny requests at a fixed rate to one emulated PD-P +
PD-D pair (speedup 1000, so worker time is small): ``direct`` does the PD
dispatch itself (same body with bootstrap fields to both workers, as a router
would), ``router`` sends to our router. Added latency = router - direct, per
percentile, from the same run.
"""

from __future__ import annotations

import asyncio
import random
import tempfile
import time
from pathlib import Path

import aiohttp

from prfaas_sglang.demo.cluster import ProcessGroup, start_mock_worker, start_router

PROFILE = "kimi-linear-1t-hybrid@h20x8"


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)]


async def _drive(rate: float, duration_s: float, send) -> tuple[list[float], int]:
    latencies: list[float] = []
    failures = 0

    async def one(i: int):
        nonlocal failures
        start = time.perf_counter()
        ok = await send(i)
        if ok:
            latencies.append(time.perf_counter() - start)
        else:
            failures += 1

    tasks = []
    start = time.perf_counter()
    i = 0
    while time.perf_counter() - start < duration_s:
        tasks.append(asyncio.create_task(one(i)))
        i += 1
        await asyncio.sleep(max(0.0, start + i / rate - time.perf_counter()))
    await asyncio.gather(*tasks)
    return latencies, failures


async def _run(rate: float, duration_s: float, log_dir: Path) -> dict:
    group = ProcessGroup(log_dir)
    try:
        extra = ["--speedup", "1000", "--kv-scale", "0.0005"]
        pp = await asyncio.to_thread(start_mock_worker, group, "pd-prefill", "pd-prefill", PROFILE, extra)
        dd = await asyncio.to_thread(start_mock_worker, group, "pd-decode", "pd-decode", PROFILE, extra)
        topology = {"version": 1, "emulation": {"speedup": 1000, "kv_scale": 0.0005}, "clusters": {"a": {"kind": "pd", "nodes": [
            {"name": "pp", "role": "pd-prefill", "port": pp.port, "bootstrap_port": pp.bootstrap_port},
            {"name": "dd", "role": "pd-decode", "port": dd.port}]}}}
        router_url = (await asyncio.to_thread(start_router, group, topology, "--threshold", "1000000")).url
        body = {"input_ids": list(range(16)), "sampling_params": {"max_new_tokens": 1}}
        rooms = random.Random(7)
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=512)) as session:

            async def direct(i: int) -> bool:
                out = {**body, "bootstrap_host": "127.0.0.1", "bootstrap_port": pp.bootstrap_port, "bootstrap_room": rooms.getrandbits(63)}

                async def post(url):
                    async with session.post(url, json=out) as resp:
                        await resp.read()
                        return resp.status

                statuses = await asyncio.gather(post(pp.url + "/generate"), post(dd.url + "/generate"))
                return statuses == [200, 200]

            async def via_router(i: int) -> bool:
                async with session.post(router_url + "/generate", json=body) as resp:
                    await resp.read()
                    return resp.status == 200

            await _drive(rate, 1.0, direct)  # warm both paths
            await _drive(rate, 1.0, via_router)
            d_lat, d_fail = await _drive(rate, duration_s, direct)
            r_lat, r_fail = await _drive(rate, duration_s, via_router)
    finally:
        group.stop()
    return {
        "rate_rps": rate, "duration_s": duration_s,
        "direct": {"requests": len(d_lat), "failed": d_fail, "p50_ms": _pct(d_lat, 0.5) * 1e3, "p99_ms": _pct(d_lat, 0.99) * 1e3},
        "router": {"requests": len(r_lat), "failed": r_fail, "p50_ms": _pct(r_lat, 0.5) * 1e3, "p99_ms": _pct(r_lat, 0.99) * 1e3},
        "added_p50_ms": (_pct(r_lat, 0.5) - _pct(d_lat, 0.5)) * 1e3,
        "added_p99_ms": (_pct(r_lat, 0.99) - _pct(d_lat, 0.99)) * 1e3,
    }


def run(rate: float = 200.0, duration_s: float = 10.0) -> dict:
    with tempfile.TemporaryDirectory(prefix="prfaas-overhead-") as tmp:
        return asyncio.run(_run(rate, duration_s, Path(tmp)))


def render_markdown(r: dict) -> str:
    d, o = r["direct"], r["router"]
    return "\n".join([
        "| path | requests | failed | p50 | p99 |", "|---|---|---|---|---|",
        f"| direct (client does PD dispatch) | {d['requests']} | {d['failed']} | {d['p50_ms']:.2f} ms | {d['p99_ms']:.2f} ms |",
        f"| through the PrfaaS router | {o['requests']} | {o['failed']} | {o['p50_ms']:.2f} ms | {o['p99_ms']:.2f} ms |",
        f"| **added by the router** | | | **{r['added_p50_ms']:.2f} ms** | **{r['added_p99_ms']:.2f} ms** |",
    ])
