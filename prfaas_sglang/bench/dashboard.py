"""``python -m prfaas_sglang.bench dashboard``: the Grafana dashboard rendered from a real run.

An emulated deployment (the demo's: 1 PrfaaS + 1 PD-P + 1 PD-D, the router, plus a kv-index)
takes case-study traffic at ``rate`` for the first half of ``duration_s`` and at 3x that for the
second (overload: the router's early rejection and its threshold show). A real Prometheus
(:mod:`prfaas_sglang.bench.prometheus`, Debian's binary) scrapes every process's ``/metrics`` each
``interval_s`` (labels ``job`` = role and ``pod`` = node name), every query of the dashboard of
:mod:`prfaas_sglang.launch.grafana` is evaluated by it (``/api/v1/query_range`` over the traffic,
step ``interval_s``), and the results are drawn to a PNG. No Grafana runs here.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import math
import tempfile
import time
from pathlib import Path

from prfaas_sglang.bench.dashboard_png import render_dashboard
from prfaas_sglang.bench.prometheus import Prometheus, ScrapeTarget
from prfaas_sglang.bench.subcommands import Invocation, Subcommand
from prfaas_sglang.demo import workloads
from prfaas_sglang.demo.client import replay
from prfaas_sglang.demo.cluster import (
    PortPicker,
    ProcessGroup,
    demo_topology,
    start_deployment,
    start_node,
    topology_nodes,
    topology_ports,
)
from prfaas_sglang.launch import grafana
from prfaas_sglang.tokenizer import SHIPPED, PromptTokenizer

SPEEDUP, KV_SCALE, OUTPUT_TOKENS, MAX_INPUT_TOKENS = 20.0, 0.01, 64, 65_536


def run(duration_s: float, rate: float, out_png: Path, seed: int = 0, interval_s: float = 1.0,
        tokenizer: str | None = SHIPPED) -> dict:
    """Run the traffic, draw the dashboard from Prometheus's results to ``out_png``, and return the run's
    counts, ``points`` (query_range steps drawn) and ``no_data`` (queries that returned no series).
    Text prompts through ``tokenizer``; None: token ids, and no process loads a tokenizer (the smoke's
    way: a tokenizer costs every process seconds of imports). Raises
    :class:`~prfaas_sglang.bench.prometheus.PrometheusError` if Prometheus is missing, a target is
    down, or a query is rejected; the processes' logs and Prometheus's files stay in a temp dir."""
    text = workloads.TextSource(PromptTokenizer.load(tokenizer)) if tokenizer else None
    half = duration_s / 2
    arrivals = workloads.arrivals("case-study", half, rate, OUTPUT_TOKENS, MAX_INPUT_TOKENS, seed, SPEEDUP, text,
                                  model="prfaas-demo")
    burst = workloads.arrivals("case-study", half, 3 * rate, OUTPUT_TOKENS, MAX_INPUT_TOKENS, seed + 1, SPEEDUP, text,
                               model="prfaas-demo")
    burst = [dataclasses.replace(a, offset_s=a.offset_s + half) for a in burst]
    doc = demo_topology(workloads.prior("case-study", MAX_INPUT_TOKENS), speedup=SPEEDUP, kv_scale=KV_SCALE,
                        output_tokens=OUTPUT_TOKENS, tokenizer=tokenizer, served_name="prfaas-demo")
    reserved = topology_ports(doc)  # the deployment's ports: picked, not yet bound
    pick = PortPicker(taken=reserved)
    doc["clusters"]["control"]["nodes"].append({"name": "kv-index", "role": "kv-index", "host": "127.0.0.1",
                                                "port": pick()})
    targets = [ScrapeTarget(n["role"], n["name"], f"http://{n['host']}:{n['port']}")
               for n in topology_nodes(doc).values()]
    work_dir = Path(tempfile.mkdtemp(prefix="prfaas-dashboard-"))
    group = ProcessGroup(work_dir)
    # started first: its first scrape comes ~5 s after start, while the deployment comes up
    with Prometheus.start(targets, work_dir / "prometheus", scrape_interval_s=interval_s,
                          avoid_ports=reserved) as prom:  # the kv-index's own port is a target's
        try:
            context = ("--context-tokens", str(2 * MAX_INPUT_TOKENS + OUTPUT_TOKENS))
            dep = start_deployment(group, doc, engine_args={r: context for r in ("prfaas", "pd-prefill", "pd-decode")})
            kv_port = doc["clusters"]["control"]["nodes"][-1]["port"]
            group.wait_healthy(f"http://127.0.0.1:{kv_port}/health", start_node(group, dep.config, "kv-index"),
                               timeout_s=60)
            prom.wait_scraped(time.time(), scrapes=1, timeout_s=60)  # every target up and in the TSDB
            start_s = time.time()
            results, wall_s = asyncio.run(replay(dep.router.url, arrivals + burst))
            prom.wait_scraped(time.time(), scrapes=2, timeout_s=60)  # the last requests' counts, twice (rates)
            end_s = time.time()
        finally:
            group.stop()
        times_s = [start_s + k * interval_s for k in range(math.floor((end_s - start_s) / interval_s) + 1)]
        board = grafana.build()
        out_png.parent.mkdir(parents=True, exist_ok=True)
        no_data = render_dashboard(board, lambda expr: prom.query_range(expr, times_s[0], times_s[-1], interval_s),
                                   times_s, out_png)
    from PIL import Image

    with Image.open(out_png) as img:  # a 256-colour palette: a third of the bytes, the same flat colours
        img.convert("RGB").quantize(256).save(out_png, optimize=True)
    return {"png": str(out_png), "duration_s": duration_s, "rate_rps": rate, "seed": seed, "points": len(times_s),
            "requests": len(results), "ok": sum(r.ok for r in results), "rejected": sum(r.rejected for r in results),
            "failed": sum(not r.ok and not r.rejected for r in results), "wall_s": wall_s,
            "offloaded": sum(r.ok and r.route.startswith("prfaas/") for r in results), "no_data": no_data}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals (the second half at 3x --rate)")
    parser.add_argument("--rate", type=float, default=0.6, help="case-study arrivals per second (first half)")
    parser.add_argument("--out", type=Path, default=Path("docs/dashboard.png"),
                        help="the PNG to write")
    parser.add_argument("--seed", type=int, default=0,
                        help="random seed for arrivals, lengths and prompts")
    parser.add_argument("--json", action="store_true",
                        help="print the result as JSON (it does anyway: no Markdown report)")


def cli(args: argparse.Namespace, inv: Invocation) -> int:
    if args.duration <= 0 or args.rate <= 0:
        inv.error("--duration and --rate must be > 0")
    result = run(args.duration, args.rate, args.out, seed=args.seed)
    return inv.report(args, result, None, None)  # no Markdown report: JSON


SUBCOMMANDS = {"dashboard": Subcommand(add_arguments, cli)}
