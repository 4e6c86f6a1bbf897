"""Goodput of the PrfaaS router vs sglang-router (PD mode, cache_aware) on the same workers and arrivals.

One emulated deployment on loopback, the demo's topology
(``demo.cluster.demo_topology``): a PrfaaS prefill worker (8xH200 profile), a
PD-P and a PD-D worker (8xH20 profile), every node started through the
launcher, so our router's ``t`` is the runtime model's for that topology, as
the demo's is. The same seeded arrivals (text prompts, tokenized by the
shipped tokenizer) are replayed twice, through each router in turn; worker
caches are flushed in between. sglang-router's prefill pool is PrfaaS + PD-P, as the issue
specifies. A request counts toward goodput when its TTFT meets the SLO and
its mean time between tokens meets 1 / ``tbt_tokens_per_s`` (both in emulated
time, i.e. wall x speedup). Keep the speedup modest (default 5): client-side
timing jitter is multiplied by it, and at 20 a millisecond of SSE jitter
already breaks a 25 ms TBT budget.
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
import urllib.request
from pathlib import Path

from prfaas_sglang.demo import workloads
from prfaas_sglang.demo.client import replay
from prfaas_sglang.demo.cluster import (
    ProcessGroup,
    demo_topology,
    free_port,
    get_json,
    scrape_metric,
    start_deployment,
)
from prfaas_sglang.tokenizer import SHIPPED, PromptTokenizer

SERVED_NAME = "prfaas-compare"
MAX_INPUT_TOKENS = 65_536


def compare_topology(workload: str, output_tokens: int, speedup: float, kv_scale: float, tokenizer: str | None) -> dict:
    """The deployment both routers serve: the demo's."""
    return demo_topology(workloads.prior(workload, MAX_INPUT_TOKENS), speedup=speedup, kv_scale=kv_scale,
                         output_tokens=output_tokens, tokenizer=tokenizer, served_name=SERVED_NAME)


def _summary(results: list, wall_s: float, window_s: float, speedup: float, kv_scale: float, ttft_slo_s: float,
             tbt_tokens_per_s: float, offloaded: float, egress_bytes: float) -> dict:
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
        # modelled: the real KV bytes (on the wire: kv_scale of them) per emulated second
        "egress_gbps": egress_bytes / kv_scale * 8 / (wall_s * speedup) / 1e9,
        "wall_s": wall_s,
    }


def run(workload: str = "case-study", duration_s: float = 30.0, rate: float = 1.5, output_tokens: int = 64,
        speedup: float = 5.0, ttft_slo_s: float = 5.0, tbt_tokens_per_s: float = 40.0, seed: int = 0,
        kv_scale: float = 0.01, tokenizer: str | None = SHIPPED, log_dir: Path | None = None) -> dict:
    text = workloads.TextSource(PromptTokenizer.load(tokenizer)) if tokenizer else None
    arrivals = workloads.arrivals(workload, duration_s, rate, output_tokens, MAX_INPUT_TOKENS, seed, speedup, text,
                                  model=SERVED_NAME)
    topology = compare_topology(workload, output_tokens, speedup, kv_scale, tokenizer)
    log_dir = log_dir or Path(tempfile.mkdtemp(prefix="prfaas-compare-"))
    group = ProcessGroup(log_dir)
    try:
        context = ("--context-tokens", str(2 * MAX_INPUT_TOKENS + output_tokens))
        deployment = start_deployment(group, topology, engine_args={r: context for r in ("prfaas", "pd-prefill", "pd-decode")})
        p0, pp0, d0 = deployment.worker("prfaas"), deployment.worker("pd-prefill"), deployment.worker("pd-decode")
        threshold = get_json(deployment.router.url + "/status")["threshold_tokens"]
        peer_port = free_port()
        routers = {
            "prfaas": (deployment.router.url, None),
            "sglang-router": (f"http://127.0.0.1:{peer_port}",
                              [sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation",
                               "--prefill", p0.url, str(p0.bootstrap_port), "--prefill", pp0.url, str(pp0.bootstrap_port),
                               "--decode", d0.url, "--prefill-policy", "cache_aware", "--host", "127.0.0.1",
                               "--port", str(peer_port), "--prometheus-port", str(free_port())]),
        }
        out = {"workload": workload, "arrivals": len(arrivals), "rate_rps_wall": rate if workload == "case-study" else None,
               "speedup": speedup, "kv_scale": kv_scale, "ttft_slo_s": ttft_slo_s, "tbt_tokens_per_s": tbt_tokens_per_s,
               "threshold_tokens": threshold, "tokenizer": tokenizer, "logs": str(log_dir)}
        for name, (url, argv) in routers.items():
            for worker in (p0, pp0, d0):
                urllib.request.urlopen(urllib.request.Request(worker.url + "/flush_cache", method="POST"), timeout=5).read()
            if argv is not None:
                proc = group.start(name, argv)
                group.wait_healthy(url + "/health", proc, timeout_s=90)
            before = (scrape_metric(p0.url, "prfaas:requests_ok_total"), scrape_metric(p0.url, "prfaas:kv_bytes_sent_total"))
            results, wall = asyncio.run(replay(url, arrivals))
            offloaded = scrape_metric(p0.url, "prfaas:requests_ok_total") - before[0]
            egress = scrape_metric(p0.url, "prfaas:kv_bytes_sent_total") - before[1]
            window = max(a.offset_s for a in arrivals) if arrivals else duration_s
            out[name] = _summary(results, wall, window, speedup, kv_scale, ttft_slo_s, tbt_tokens_per_s, offloaded, egress)
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
