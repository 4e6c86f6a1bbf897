"""``python -m prfaas_sglang.bench dashboard``: the Grafana dashboard rendered from a real run.

An emulated deployment (the demo's: 1 PrfaaS + 1 PD-P + 1 PD-D, the router, plus a kv-index)
takes case-study traffic at ``rate`` for the first half of ``duration_s`` and at 3x that for the
second (overload: the router's early rejection and its threshold show). Every process's
``/metrics`` is scraped once a second, as Prometheus would (labels ``job`` and ``pod``), and the
dashboard of :mod:`prfaas_sglang.launch.dashboard` is evaluated on the scrapes
(:mod:`prfaas_sglang.bench.promql_lite`) and drawn to a PNG. No Prometheus or Grafana runs here.
"""

from __future__ import annotations

import asyncio
import dataclasses
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from prfaas_sglang.bench.dashboard_png import render_dashboard
from prfaas_sglang.bench.promql_lite import Store, parse_exposition
from prfaas_sglang.demo import workloads
from prfaas_sglang.demo.client import replay
from prfaas_sglang.demo.cluster import (
    ProcessGroup,
    demo_topology,
    free_port,
    start_deployment,
    start_node,
)
from prfaas_sglang.launch import dashboard
from prfaas_sglang.tokenizer import SHIPPED, PromptTokenizer

SPEEDUP, KV_SCALE, OUTPUT_TOKENS, MAX_INPUT_TOKENS = 20.0, 0.01, 64, 65_536


def _scrape_loop(targets: dict[str, tuple[str, str]], store: Store, times_s: list[float], stop: threading.Event,
                 interval_s: float) -> None:
    start = time.monotonic()
    while not stop.is_set():
        now = time.monotonic() - start
        for pod, (job, url) in targets.items():
            try:
                with urllib.request.urlopen(url + "/metrics", timeout=2) as resp:
                    store.add(now, parse_exposition(resp.read().decode()), {"job": job, "pod": pod})
            except OSError:
                pass  # a missed scrape is a gap, as in Prometheus
        times_s.append(now)
        stop.wait(interval_s)


def run(duration_s: float, rate: float, out_png: Path, seed: int = 0, interval_s: float = 1.0) -> dict:
    text = workloads.TextSource(PromptTokenizer.load(SHIPPED))
    half = duration_s / 2
    arrivals = workloads.arrivals("case-study", half, rate, OUTPUT_TOKENS, MAX_INPUT_TOKENS, seed, SPEEDUP, text,
                                  model="prfaas-demo")
    burst = workloads.arrivals("case-study", half, 3 * rate, OUTPUT_TOKENS, MAX_INPUT_TOKENS, seed + 1, SPEEDUP, text,
                               model="prfaas-demo")
    burst = [dataclasses.replace(a, offset_s=a.offset_s + half) for a in burst]
    doc = demo_topology(workloads.prior("case-study", MAX_INPUT_TOKENS), speedup=SPEEDUP, kv_scale=KV_SCALE,
                        output_tokens=OUTPUT_TOKENS, tokenizer=SHIPPED, served_name="prfaas-demo")
    doc["clusters"]["control"]["nodes"].append({"name": "kv-index", "role": "kv-index", "host": "127.0.0.1",
                                                "port": free_port()})
    store, times_s, stop = Store(), [], threading.Event()
    group = ProcessGroup(Path(tempfile.mkdtemp(prefix="prfaas-dashboard-")))
    try:
        context = ("--context-tokens", str(2 * MAX_INPUT_TOKENS + OUTPUT_TOKENS))
        dep = start_deployment(group, doc, engine_args={r: context for r in ("prfaas", "pd-prefill", "pd-decode")})
        kv_port = doc["clusters"]["control"]["nodes"][-1]["port"]
        group.wait_healthy(f"http://127.0.0.1:{kv_port}/health", start_node(group, dep.config, "kv-index"), timeout_s=60)
        targets = {"router-0": ("router", dep.router.url), "kv-index-0": ("kv-index", f"http://127.0.0.1:{kv_port}")}
        targets |= {name: (name.rsplit("-", 1)[0], w.url) for name, w in dep.workers.items()}
        scraper = threading.Thread(target=_scrape_loop, args=(targets, store, times_s, stop, interval_s), daemon=True)
        scraper.start()
        results, wall_s = asyncio.run(replay(dep.router.url, arrivals + burst))
        time.sleep(2 * interval_s)
    finally:
        stop.set()
        group.stop()
    board = dashboard.build()
    out_png.parent.mkdir(parents=True, exist_ok=True)
    render_dashboard(board, store, times_s, out_png)
    from PIL import Image

    with Image.open(out_png) as img:  # a 256-colour palette: a third of the bytes, the same flat colours
        img.convert("RGB").quantize(256).save(out_png, optimize=True)
    return {"png": str(out_png), "duration_s": duration_s, "rate_rps": rate, "seed": seed, "scrapes": len(times_s),
            "requests": len(results), "ok": sum(r.ok for r in results), "rejected": sum(r.rejected for r in results),
            "failed": sum(not r.ok and not r.rejected for r in results), "wall_s": wall_s,
            "offloaded": sum(r.ok and r.route.startswith("prfaas/") for r in results)}
