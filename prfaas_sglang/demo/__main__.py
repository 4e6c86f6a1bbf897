"""``python -m prfaas_sglang.demo``: a PrfaaS-PD deployment on loopback, under load, then a summary.

Starts three emulated workers (a PrfaaS prefill worker on the H200 profile,
a PD-P and a PD-D worker on the H20 profile; real Mooncake TCP KV bytes
between them, KV events and link telemetry over ZMQ) and the PrfaaS router
in front of them with the planner's threshold for this deployment, replays a
workload through the router for ``--duration`` seconds, prints a summary and
stops every child process.

    python -m prfaas_sglang.demo                          # case-study lengths, 20 s, speedup 20
    python -m prfaas_sglang.demo --workload trace:../shared/data/mooncake_conversation_trace.jsonl --json

Exit: 0 when every request succeeded, 1 when some failed, 2 on bad input.
Times in the summary are wall-clock (emulated time = wall x speedup).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
from pathlib import Path

from prfaas_sglang.demo.client import RequestResult, replay
from prfaas_sglang.demo.cluster import (
    ProcessGroup,
    Worker,
    scrape_metric,
    start_mock_worker,
    start_router,
)
from prfaas_sglang.errors import ConfigError, PrfaasError
from prfaas_sglang.plan.analytic import AnalyticPrefill, analytic_decode
from prfaas_sglang.plan.model import Deployment
from prfaas_sglang.plan.profiles import InstanceClass
from prfaas_sglang.plan.scenario import Catalog
from prfaas_sglang.plan.search import best_threshold_for_split
from prfaas_sglang.plan.workload import (
    EmpiricalLengths,
    TruncatedLogNormal,
    UnboundedCache,
    incremental_lengths,
)

MODEL = "kimi-linear-1t-hybrid"
VOCAB = 32_000


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m prfaas_sglang.demo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration", type=float, default=20.0, help="seconds of arrivals (wall clock)")
    p.add_argument("--workload", default="case-study", help="case-study (log-normal lengths) | trace:PATH (Mooncake format)")
    p.add_argument("--rate", type=float, default=1.0, help="case-study: Poisson arrivals per second")
    p.add_argument("--output-tokens", type=int, default=64, help="tokens generated per request (trace: capped at this)")
    p.add_argument("--max-input-tokens", type=int, default=65_536, help="longer prompts are truncated")
    p.add_argument("--speedup", type=float, default=20.0)
    p.add_argument("--kv-scale", type=float, default=0.01)
    p.add_argument("--max-requests", type=int, default=2_000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true")
    p.add_argument("--keep-logs", type=Path, default=None, help="write worker logs here (default: a temp dir)")
    return p


def plan_threshold(lengths: list[float] | None, output_tokens: int) -> float:
    """The planner's threshold for this deployment: 1 PrfaaS (8xH200), 1 PD-P + 1 PD-D (8xH20)."""
    catalog = Catalog()
    model = catalog.model(MODEL)
    h200, h20 = catalog.accelerator("h200x8", "h200x8"), catalog.accelerator("h20x8", "h20x8")
    workload = EmpiricalLengths(lengths) if lengths else TruncatedLogNormal(9.90, 1.00, 128, 131_072)
    decode = analytic_decode(model, h20, workload.mean_tokens, output_tokens, 40)
    dep = Deployment(InstanceClass("h200x8", 8, AnalyticPrefill(model, h200)), 1,
                     InstanceClass("h20x8", 8, AnalyticPrefill(model, h20), decode), 2, 100e9, output_tokens)
    return best_threshold_for_split(dep, workload, 1, 512).threshold_tokens


def case_study_requests(args, rng: random.Random):
    """(arrival offset s, token ids, max_new_tokens) with Poisson arrivals and case-study lengths."""
    dist = TruncatedLogNormal(9.90, 1.00, 128, 131_072)
    t = 0.0
    for _ in range(args.max_requests):
        t += rng.expovariate(args.rate)
        if t > args.duration:
            return
        n = min(int(dist.sample(rng, 1)[0]), args.max_input_tokens)
        yield t, [rng.randrange(VOCAB) for _ in range(n)], args.output_tokens


def trace_records(path: str):
    from prfaas_sglang.plan.workload import parse_trace_record

    p = Path(path)
    if not p.is_file():
        raise ConfigError("--workload", f"trace file {path} not found")
    for lineno, line in enumerate(p.read_text().splitlines(), 1):
        if line.strip():
            try:
                yield parse_trace_record(json.loads(line), f"{path}:{lineno}")
            except json.JSONDecodeError as err:
                raise ConfigError(f"{path}:{lineno}", f"not JSON: {err.msg}") from None


def trace_requests(args, records):
    """Trace arrivals compressed by ``speedup``; 512-token blocks become deterministic token runs."""
    for count, rec in enumerate(records):
        offset = rec.timestamp_ms / 1000.0 / args.speedup
        if offset > args.duration or count >= args.max_requests:
            return
        tokens = [(h * 7919 + i) % VOCAB for h in rec.hash_ids for i in range(512)][: min(rec.input_length, args.max_input_tokens)]
        yield offset, tokens, max(1, min(rec.output_length, args.output_tokens))


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)]


def demo_topology(workers: dict[str, Worker]) -> dict:
    """The topology the router reads: one PrfaaS cluster, one PD cluster, a 100 Gbps link."""
    p, pp, d = workers["prfaas"], workers["pd-prefill"], workers["pd-decode"]
    return {"version": 1, "clusters": {
        "prfaas": {"kind": "prfaas", "nodes": [{"name": "prfaas-0", "role": "prfaas", "port": p.port, "bootstrap_port": p.bootstrap_port,
                                                 "kv_events_port": p.kv_events_port, "telemetry_port": p.telemetry_port}]},
        "pd": {"kind": "pd", "nodes": [
            {"name": "pd-prefill-0", "role": "pd-prefill", "port": pp.port, "bootstrap_port": pp.bootstrap_port,
             "kv_events_port": pp.kv_events_port},
            {"name": "pd-decode-0", "role": "pd-decode", "port": d.port}]}},
        "links": [{"from": "prfaas", "to": "pd", "bandwidth_gbps": 100}]}


def summarize(args, results: list[RequestResult], wall_s: float, egress_bytes: float, threshold: float) -> dict:
    ok = [r for r in results if r.ok]
    gaps = [g for r in ok for g in r.token_gaps_s]
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    tokens = sum(r.output_tokens for r in ok)
    return {
        "workload": args.workload,
        "threshold_tokens": threshold,
        "speedup": args.speedup,
        "kv_scale": args.kv_scale,
        "wall_s": wall_s,
        "requests_ok": len(ok),
        "requests_failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if r.error})[:5],
        "offload_fraction": sum(r.route.startswith("prfaas/") for r in ok) / len(ok) if ok else 0.0,
        "egress_gbps": egress_bytes * 8 / wall_s / 1e9 if wall_s else 0.0,
        "egress_gbps_modelled": egress_bytes / args.kv_scale * 8 / (wall_s * args.speedup) / 1e9 if wall_s else 0.0,
        "ttft_p50_s": percentile(ttfts, 0.50),
        "ttft_p90_s": percentile(ttfts, 0.90),
        "ttft_p99_s": percentile(ttfts, 0.99),
        "tbt_p50_s": percentile(gaps, 0.50),
        "tbt_p99_s": percentile(gaps, 0.99),
        "output_tokens_per_s": tokens / wall_s if wall_s else 0.0,
        "mean_input_tokens": statistics.fmean(r.input_tokens for r in ok) if ok else 0.0,
    }


def render(summary: dict) -> str:
    def f(v, unit=""):
        return "-" if v is None else (f"{v:.3f}{unit}" if isinstance(v, float) else f"{v}{unit}")

    rows = [
        ("workload", summary["workload"]), ("threshold t (planner)", f"{summary['threshold_tokens'] / 1000:.1f}K tokens"),
        ("requests ok / failed", f"{summary['requests_ok']} / {summary['requests_failed']}"),
        ("offload fraction", f(summary["offload_fraction"])),
        ("PrfaaS egress", f"{f(summary['egress_gbps'])} Gbps on the wire ({f(summary['egress_gbps_modelled'])} Gbps modelled)"),
        ("TTFT p50 / p90 / p99", f"{f(summary['ttft_p50_s'], ' s')} / {f(summary['ttft_p90_s'], ' s')} / {f(summary['ttft_p99_s'], ' s')}"),
        ("TBT p50 / p99", f"{f(summary['tbt_p50_s'], ' s')} / {f(summary['tbt_p99_s'], ' s')}"),
        ("output tokens/s", f(summary["output_tokens_per_s"])),
        ("wall / speedup", f"{summary['wall_s']:.1f} s / {summary['speedup']:g}x"),
    ]
    width = max(len(a) for a, _ in rows)
    lines = [f"{a:<{width}}  {b}" for a, b in rows]
    lines += [f"error: {e}" for e in summary["errors"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    group = None
    try:
        for flag, value in (("--duration", args.duration), ("--rate", args.rate), ("--speedup", args.speedup)):
            if not value > 0:
                raise ConfigError(flag, f"must be > 0, got {value}")
        if args.output_tokens < 1 or args.max_requests < 1:
            raise ConfigError("--output-tokens", "--output-tokens and --max-requests must be >= 1")
        rng = random.Random(args.seed)
        if args.workload == "case-study":
            lengths = None
            requests = case_study_requests(args, rng)
        elif args.workload.startswith("trace:"):
            records = list(trace_records(args.workload[len("trace:"):]))
            lengths = incremental_lengths(records, UnboundedCache())
            requests = trace_requests(args, records)
        else:
            raise ConfigError("--workload", f"expected case-study or trace:PATH, got {args.workload!r}")
        threshold = plan_threshold(lengths, args.output_tokens)
        log_dir = args.keep_logs or Path(tempfile.mkdtemp(prefix="prfaas-demo-"))
        group = ProcessGroup(log_dir)
        common = ["--speedup", str(args.speedup), "--kv-scale", str(args.kv_scale), "--context-tokens", str(args.max_input_tokens + args.output_tokens + 1)]
        workers = {
            "prfaas": start_mock_worker(group, "prfaas-0", "prfaas", f"{MODEL}@h200x8", common, events=True, telemetry=True),
            "pd-prefill": start_mock_worker(group, "pd-prefill-0", "pd-prefill", f"{MODEL}@h20x8", common, events=True),
            "pd-decode": start_mock_worker(group, "pd-decode-0", "pd-decode", f"{MODEL}@h20x8", common),
        }
        router = start_router(group, demo_topology(workers), "--threshold", str(threshold))
        results, wall_s = asyncio.run(replay(router.url, list(requests)))
        summary = summarize(args, results, wall_s, scrape_metric(workers["prfaas"].url, "prfaas:kv_bytes_sent_total"), threshold)
    except PrfaasError as err:
        print(f"error: {err}", file=sys.stderr)
        return err.exit_code
    finally:
        if group is not None:
            group.stop()
    print(json.dumps(summary, indent=2) if args.json else render(summary))
    return 0 if summary["requests_failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
