"""Goodput of the PrfaaS router vs sglang-router (PD mode, cache_aware) on the same workers and arrivals.

One emulated deployment on loopback: a PrfaaS prefill worker (8xH200
profile), a PD-P and a PD-D worker (8xH20 profile). The same seeded arrivals
are replayed twice, through each router in turn; worker caches are flushed
in between. sglang-router's prefill pool is PrfaaS + PD-P, as the issue
specifies. A request counts toward goodput when its TTFT meets the SLO and
its mean time between tokens meets 1 / ``tbt_tokens_per_s`` (both in emulated
time, i.e. wall x speedup). Keep the speedup modest (default 5): client-side
timing jitter is multiplied by it, and at 20 a millisecond of SSE jitter
already breaks a 25 ms TBT budget.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
import urllib.request
from pathlib import Path

import yaml

from prfaas_sglang.demo.__main__ import (
    case_study_requests,
    plan_threshold,
    trace_records,
    trace_requests,
)
from prfaas_sglang.demo.client import replay
from prfaas_sglang.demo.cluster import ProcessGroup, free_port, scrape_metric, start_mock_worker
from prfaas_sglang.plan.workload import UnboundedCache, incremental_lengths

MODEL = "kimi-linear-1t-hybrid"


def _summary(results: list, wall_s: float, window_s: float, speedup: float, ttft_slo_s: float, tbt_tokens_per_s: float,
             offloaded: float, egress_bytes: float) -> dict:
    """``goodput_rps``: requests within both SLOs per second of the arrival window (the same for both routers)."""
    ok = [r for r in results if r.ok]
    good = [r for r in ok if r.ttft_s * speedup <= ttft_slo_s and r.mean_tbt_s * speedup <= 1.0 / tbt_tokens_per_s]

    def pct(values, q):
        ordered = sorted(values)
        return ordered[min(int(q * len(ordered)), len(ordered) - 1)] if ordered else None

    return {
        "requests": len(results), "requests_ok": len(ok), "requests_failed": len(results) - len(ok),
        "slo_met": len(good), "goodput_rps": len(good) / window_s,
        "ttft_slo_met": sum(r.ttft_s * speedup <= ttft_slo_s for r in ok),
        "ttft_p50_s": pct([r.ttft_s * speedup for r in ok], 0.5), "ttft_p90_s": pct([r.ttft_s * speedup for r in ok], 0.9),
        "tbt_p99_s": pct([r.mean_tbt_s * speedup for r in ok], 0.99),
        "offload_fraction": offloaded / len(ok) if ok else 0.0,
        "egress_gbps": egress_bytes * 8 / (wall_s * speedup) / 1e9,
        "wall_s": wall_s,
    }


def _arrivals(workload: str, duration_s: float, rate: float, output_tokens: int, speedup: float, seed: int):
    args = argparse.Namespace(duration=duration_s, rate=rate, output_tokens=output_tokens, max_input_tokens=65_536,
                              max_requests=100_000, speedup=speedup, workload=workload)
    if workload == "case-study":
        return list(case_study_requests(args, random.Random(seed))), None
    records = list(trace_records(workload[len("trace:"):]))
    return list(trace_requests(args, records)), incremental_lengths(records, UnboundedCache())


def run(workload: str = "case-study", duration_s: float = 30.0, rate: float = 1.5, output_tokens: int = 64,
        speedup: float = 5.0, ttft_slo_s: float = 5.0, tbt_tokens_per_s: float = 40.0, seed: int = 0) -> dict:
    arrivals, lengths = _arrivals(workload, duration_s, rate, output_tokens, speedup, seed)
    threshold = plan_threshold(lengths, output_tokens)
    log_dir = Path(tempfile.mkdtemp(prefix="prfaas-compare-"))
    group = ProcessGroup(log_dir)
    try:
        extra = ["--speedup", str(speedup), "--kv-scale", "0.01", "--context-tokens", str(65_536 + output_tokens + 1)]
        p0 = start_mock_worker(group, "prfaas", "prfaas", f"{MODEL}@h200x8", extra, events=True)
        pp0 = start_mock_worker(group, "pd-prefill", "pd-prefill", f"{MODEL}@h20x8", extra, events=True)
        d0 = start_mock_worker(group, "pd-decode", "pd-decode", f"{MODEL}@h20x8", extra)
        topology = {"version": 1, "clusters": {
            "b": {"kind": "prfaas", "nodes": [{"name": "prfaas", "role": "prfaas", "port": p0.port, "bootstrap_port": p0.bootstrap_port,
                                               "kv_events_port": p0.kv_events_port}]},
            "a": {"kind": "pd", "nodes": [
                {"name": "pd-prefill", "role": "pd-prefill", "port": pp0.port, "bootstrap_port": pp0.bootstrap_port,
                 "kv_events_port": pp0.kv_events_port},
                {"name": "pd-decode", "role": "pd-decode", "port": d0.port}]}},
            "links": [{"from": "b", "to": "a", "bandwidth_gbps": 100}]}
        config = log_dir / "topology.yaml"
        config.write_text(yaml.safe_dump(topology))
        routers = {
            "prfaas": [sys.executable, "-m", "prfaas_sglang.router", "--config", str(config), "--threshold", str(threshold)],
            "sglang-router": [sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation",
                              "--prefill", p0.url, str(p0.bootstrap_port), "--prefill", pp0.url, str(pp0.bootstrap_port),
                              "--decode", d0.url, "--prefill-policy", "cache_aware", "--host", "127.0.0.1"],
        }
        out = {"workload": workload, "arrivals": len(arrivals), "rate_rps_wall": rate if workload == "case-study" else None,
               "speedup": speedup, "ttft_slo_s": ttft_slo_s, "tbt_tokens_per_s": tbt_tokens_per_s, "threshold_tokens": threshold}
        for name, argv in routers.items():
            for worker in (p0, pp0, d0):
                urllib.request.urlopen(urllib.request.Request(worker.url + "/flush_cache", method="POST"), timeout=5).read()
            port = free_port()
            argv = argv + ["--port", str(port)] + (["--prometheus-port", str(free_port())] if name == "sglang-router" else [])
            proc = group.start(name, argv)
            url = f"http://127.0.0.1:{port}"
            group.wait_healthy(url + "/health", proc, timeout_s=90)
            before = (scrape_metric(p0.url, "prfaas:requests_ok_total"), scrape_metric(p0.url, "prfaas:kv_bytes_sent_total"))
            results, wall = asyncio.run(replay(url, arrivals))
            offloaded = scrape_metric(p0.url, "prfaas:requests_ok_total") - before[0]
            egress = scrape_metric(p0.url, "prfaas:kv_bytes_sent_total") - before[1]
            window = max(offset for offset, _, _ in arrivals) if arrivals else duration_s
            out[name] = _summary(results, wall, window, speedup, ttft_slo_s, tbt_tokens_per_s, offloaded, egress)
            proc.terminate()
            proc.wait(timeout=10)
        ours, theirs = out["prfaas"]["goodput_rps"], out["sglang-router"]["goodput_rps"]
        out["goodput_ratio"] = ours / theirs if theirs else None
        return out
    finally:
        group.stop()


def render_markdown(r: dict) -> str:
    rows = ["| router | requests ok / failed | SLO met | goodput (req/s over the arrival window) | TTFT p50 / p90 (emulated s) | TBT p99 (s) | offload | egress (Gbps, modelled) |",
            "|---|---|---|---|---|---|---|---|"]
    for name in ("prfaas", "sglang-router"):
        x = r[name]
        rows.append(f"| {name} | {x['requests_ok']} / {x['requests_failed']} | {x['slo_met']} | {x['goodput_rps']:.2f} | "
                    f"{x['ttft_p50_s']:.2f} / {x['ttft_p90_s']:.2f} | {x['tbt_p99_s']:.4f} | {x['offload_fraction']:.2f} | {x['egress_gbps']:.2f} |")
    rows.append(f"\ngoodput_ratio (prfaas / sglang-router): **{r['goodput_ratio']:.2f}**" if r["goodput_ratio"] else "\ngoodput_ratio: n/a")
    return "\n".join(rows)
