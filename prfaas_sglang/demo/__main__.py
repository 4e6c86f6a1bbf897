"""``python -m prfaas_sglang.demo``: a PrfaaS-PD deployment on loopback, under load, then a summary.

Writes one topology (a PrfaaS prefill worker on the H200 profile, a PD-P and a
PD-D worker on the H20 profile, the router; ``emulation:`` and the
``scheduler:`` prior of the chosen workload), starts every node through the
launcher (real Mooncake TCP KV bytes between the workers, KV events and link
telemetry over ZMQ), replays the workload through the router for
``--duration`` seconds as text prompts tokenized by the shipped tokenizer,
prints a summary and stops every child process. The router's threshold comes
from that topology's runtime model, as for any deployment.

    python -m prfaas_sglang.demo                          # case-study lengths, 20 s, speedup 20
    python -m prfaas_sglang.demo --workload trace:../shared/data/mooncake_conversation_trace.jsonl --json
    python -m prfaas_sglang.demo --topology launch/multi-cluster.yaml   # a fleet: 2 PrfaaS + 2 PD clusters

With ``--topology``, the deployment is that file's fleet on this box (``demo/fleet.py``: each PrfaaS
cluster in its own network namespace, each PrfaaS -> PD link shaped on its own at its rate x
kv_scale x speedup; root and iproute2), each cluster cut to ``--nodes-per-role`` nodes of a role.
Requests enter at the PD clusters in their ``entry_share`` (header ``x-prfaas-entry``; none: one
global entry); the summary is per link and per entry.

Exit: 0 when no request failed (the router shedding load, 503 with Retry-After, is counted as
rejected, not failed), 1 when some failed, 2 on bad input.
Times in the summary are wall-clock (emulated time = wall x speedup).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import statistics
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from prfaas_sglang.adapters import http_sync
from prfaas_sglang.demo import workloads
from prfaas_sglang.demo.client import RequestResult, replay
from prfaas_sglang.demo.cluster import (
    CONTROL_REQUEST_TIMEOUT_S,
    ProcessGroup,
    demo_topology,
    scrape_metric,
    start_deployment,
)
from prfaas_sglang.errors import ConfigError, PrfaasError
from prfaas_sglang.tokenizer import SHIPPED

SERVED_NAME = "prfaas-demo"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m prfaas_sglang.demo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration", type=float, default=20.0, help="seconds of arrivals (wall clock)")
    p.add_argument("--workload", default="case-study", help="case-study (log-normal lengths) | trace:PATH (Mooncake format)")
    p.add_argument("--rate", type=float, default=1.0, help="case-study: Poisson arrivals per second")
    p.add_argument("--output-tokens", type=int, default=64, help="tokens generated per request (trace: capped at this)")
    p.add_argument("--max-input-tokens", type=int, default=65_536, help="longer prompts are truncated")
    p.add_argument("--speedup", type=float, default=20.0,
                   help="workers divide every emulated duration by this (emulated time = wall x "
                        "speedup); trace timestamps are compressed by it too")
    p.add_argument("--kv-scale", type=float, default=0.01,
                   help="fraction of each request's modelled KV bytes really sent between workers")
    p.add_argument("--tokenizer", default=SHIPPED, help="the model's tokenizer (text prompts); 'none': token ids")
    p.add_argument("--max-requests", type=int, default=2_000,
                   help="send at most this many requests")
    p.add_argument("--seed", type=int, default=0,
                   help="random seed for arrivals, lengths, prompt text and entry clusters")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--keep-logs", type=Path, default=None, help="write every process's log here (default: a temp dir)")
    p.add_argument("--topology", type=Path, default=None,
                   help="a fleet topology (several PrfaaS and PD clusters, a link each) to run on this box instead of "
                        "the one-pair demo (needs root: a namespace per PrfaaS cluster, a shaped link per pair)")
    p.add_argument("--containers", metavar="IMAGE", default=None,
                   help="run the one-pair demo from a built image, one container per node (podman), the PrfaaS container "
                        "in its own network namespace behind a shaped link (root; demo/containers.py)")
    p.add_argument("--against", metavar="URL", default=None,
                   help="send the load to this running router (a Kubernetes Service, a deployment of your own) and "
                        "start nothing; the served model's name is read from its /v1/models")
    p.add_argument("--nodes-per-role", type=int, default=1,
                   help="--topology: keep this many nodes of each role per cluster (0: all of them)")
    return p


def topology_for(args, **where) -> dict:
    """The demo's deployment (:func:`~prfaas_sglang.demo.cluster.demo_topology`) for these flags (``where``: its hosts)."""
    return demo_topology(workloads.prior(args.workload, args.max_input_tokens), speedup=args.speedup, kv_scale=args.kv_scale,
                         output_tokens=args.output_tokens, tokenizer=None if args.tokenizer == "none" else args.tokenizer,
                         served_name=SERVED_NAME, **where)


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)]


def summarize(args, results: list[RequestResult], wall_s: float, egress_bytes: float, threshold: float, log_dir: Path) -> dict:
    ok = [r for r in results if r.ok]
    rejected = sum(r.rejected for r in results)
    gaps = [g for r in ok for g in r.token_gaps_s]
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    tokens = sum(r.output_tokens for r in ok)
    return {
        "workload": args.workload,
        "threshold_tokens": threshold,
        "speedup": args.speedup,
        "kv_scale": args.kv_scale,
        "tokenizer": args.tokenizer,
        "wall_s": wall_s,
        "requests_ok": len(ok),
        "requests_rejected": rejected,
        "requests_failed": len(results) - len(ok) - rejected,
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
        "logs": str(log_dir),
    }


def render(summary: dict) -> str:
    def f(v, unit=""):
        return "-" if v is None else (f"{v:.3f}{unit}" if isinstance(v, float) else f"{v}{unit}")

    rows = [
        ("workload", summary["workload"]), ("threshold t (runtime model)", f"{summary['threshold_tokens'] / 1000:.1f}K tokens"),
        ("requests ok / rejected / failed", f"{summary['requests_ok']} / {summary['requests_rejected']} / {summary['requests_failed']}"),
        ("offload fraction", f(summary["offload_fraction"])),
        ("mean input tokens", f"{summary['mean_input_tokens']:.0f} ({summary['tokenizer']})"),
        ("PrfaaS egress", f"{f(summary['egress_gbps'])} Gbps on the wire ({f(summary['egress_gbps_modelled'])} Gbps modelled)"),
        ("TTFT p50 / p90 / p99", f"{f(summary['ttft_p50_s'], ' s')} / {f(summary['ttft_p90_s'], ' s')} / {f(summary['ttft_p99_s'], ' s')}"),
        ("TBT p50 / p99", f"{f(summary['tbt_p50_s'], ' s')} / {f(summary['tbt_p99_s'], ' s')}"),
        ("output tokens/s", f(summary["output_tokens_per_s"])),
        ("wall / speedup", f"{summary['wall_s']:.1f} s / {summary['speedup']:g}x"),
        ("logs", summary["logs"]),
    ]
    width = max(len(a) for a, _ in rows)
    lines = [f"{a:<{width}}  {b}" for a, b in rows]
    lines += [f"error: {e}" for e in summary["errors"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        summary, render_summary = run_fleet(args) if args.topology is not None else run_pair(args)
    except PrfaasError as err:
        print(f"error: {err}", file=sys.stderr)
        return err.exit_code
    print(json.dumps(summary, indent=2) if args.json else render_summary(summary))
    return 0 if summary["requests_failed"] == 0 else 1


def run_pair(args) -> tuple[dict, Callable[[dict], str]]:
    """The one-pair demo: its deployment under the workload; the summary and how to render it."""
    text = _checked(args)
    served = _served_name(args.against) if args.against else SERVED_NAME
    requests = workloads.arrivals(args.workload, args.duration, args.rate, args.output_tokens, args.max_input_tokens,
                                  args.seed, args.speedup, text, args.max_requests, served)
    log_dir = args.keep_logs or Path(tempfile.mkdtemp(prefix="prfaas-demo-"))
    if args.against:
        threshold = http_sync.get_json(args.against + "/status", timeout_s=CONTROL_REQUEST_TIMEOUT_S).get("threshold_tokens")
        results, wall_s = asyncio.run(replay(args.against, requests))
        return {**summarize(args, results, wall_s, 0.0, threshold, log_dir), "against": args.against}, render
    group = ProcessGroup(log_dir)
    if args.containers:
        return _run_containers(args, requests, group, log_dir)
    try:
        deployment = start_deployment(group, topology_for(args), engine_args=_context_args(args))
        threshold = http_sync.get_json(deployment.router.url + "/status", timeout_s=CONTROL_REQUEST_TIMEOUT_S)["threshold_tokens"]
        results, wall_s = asyncio.run(replay(deployment.router.url, requests))
        egress = scrape_metric(deployment.worker("prfaas").url, "prfaas:kv_bytes_sent_total")
    finally:
        group.stop()
    return summarize(args, results, wall_s, egress, threshold, log_dir), render


def _run_containers(args, requests, group: ProcessGroup, log_dir: Path) -> tuple[dict, Callable[[dict], str]]:
    """``--containers IMAGE``: the same deployment and load, every node a container of the image
    (``demo/containers.py``), the PrfaaS one in its own namespace behind the shaped link."""
    from prfaas_sglang.demo import containers
    from prfaas_sglang.demo.cluster import topology_nodes
    from prfaas_sglang.demo.netns import Netns, available

    containers.check(args.containers)
    if (why := available()) is not None:
        raise ConfigError("--containers", f"the PrfaaS container's namespace {why}")
    with Netns() as net:
        doc = topology_for(args, host=net.outer_ip, hosts={"prfaas": net.inner_ip})
        net.throttle(doc["links"][0]["bandwidth_gbps"] * 1e3 * args.kv_scale * args.speedup)
        pods = containers.Containers(args.containers, f"demo{net.tag}", log_dir)
        wrap = {name: pods.wrap(name, net.ns if n["role"] == "prfaas" else None) for name, n in topology_nodes(doc).items()}
        try:
            deployment = start_deployment(group, doc, engine_args=_context_args(args), wrap=wrap,
                                          python=containers.CONTAINER_PYTHON)
            threshold = http_sync.get_json(deployment.router.url + "/status", timeout_s=CONTROL_REQUEST_TIMEOUT_S)["threshold_tokens"]
            results, wall_s = asyncio.run(replay(deployment.router.url, requests))
            egress = scrape_metric(deployment.worker("prfaas").url, "prfaas:kv_bytes_sent_total")
        finally:
            group.stop()
            pods.remove()
    summary = summarize(args, results, wall_s, egress, threshold, log_dir)
    return {**summary, "containers": {"image": args.containers, "nodes": sorted(wrap), "prfaas_netns": net.ns}}, render


def _served_name(router_url: str) -> str:
    """The model a running router serves (the first of its ``/v1/models``)."""
    try:
        models = http_sync.get_json(router_url + "/v1/models", timeout_s=10)["data"]
    except (PrfaasError, KeyError, TypeError) as err:
        raise ConfigError("--against", f"no router answers at {router_url} ({err})") from None
    if not models:
        raise ConfigError("--against", f"{router_url} serves no model yet (/v1/models is empty)")
    return models[0]["id"]


def _context_args(args) -> dict[str, tuple[str, ...]]:
    """Every engine role's context: the longest prompt twice over (a cached prefix and its extension), and the output."""
    context = ("--context-tokens", str(args.max_input_tokens * 2 + args.output_tokens))
    return {role: context for role in ("prfaas", "pd-prefill", "pd-decode")}


def _checked(args) -> workloads.TextSource | None:
    for flag, value in (("--duration", args.duration), ("--rate", args.rate), ("--speedup", args.speedup)):
        if not value > 0:
            raise ConfigError(flag, f"must be > 0, got {value}")
    if args.output_tokens < 1 or args.max_requests < 1 or args.nodes_per_role < 0:
        raise ConfigError("--output-tokens", "--output-tokens and --max-requests must be >= 1, --nodes-per-role >= 0")
    if args.tokenizer == "none":
        return None
    from prfaas_sglang.tokenizer import PromptTokenizer

    return workloads.TextSource(PromptTokenizer.load(args.tokenizer))


def run_fleet(args) -> tuple[dict, Callable[[dict], str]]:
    """``--topology``: the fleet on this box under the workload; the summary per link and per entry, and how to
    render it."""
    import random

    import yaml

    from prfaas_sglang.demo.fleet import FleetNet, fleet_sites, links_mbit, local_fleet
    from prfaas_sglang.demo.netns import available
    from prfaas_sglang.topology import parse_topology

    text = _checked(args)
    try:
        raw = yaml.safe_load(args.topology.read_text())
    except (OSError, yaml.YAMLError) as err:
        raise ConfigError("--topology", f"cannot read {args.topology}: {err}") from None
    parse_topology(raw, str(args.topology), args.topology.parent)  # refused by field path before any namespace
    if (why := available()) is not None:
        raise ConfigError("--topology", f"the fleet's namespaces and shaped links {why}")
    prfaas, pd = fleet_sites(raw)
    shares = {name: raw["clusters"][name].get("entry_share") for name in pd}
    requests = workloads.arrivals(args.workload, args.duration, args.rate, args.output_tokens, args.max_input_tokens,
                                  args.seed, args.speedup, text, args.max_requests, SERVED_NAME)
    rng = random.Random(args.seed)
    if all(v is not None for v in shares.values()):
        requests = [dataclasses.replace(a, headers={"x-prfaas-entry": rng.choices(pd, [shares[n] for n in pd])[0]})
                    for a in requests]
    log_dir = args.keep_logs or Path(tempfile.mkdtemp(prefix="prfaas-fleet-"))
    group = ProcessGroup(log_dir)
    try:
        with FleetNet(pd, prfaas, links_mbit(raw, args.speedup, args.kv_scale)) as net:
            doc = local_fleet(raw, net, speedup=args.speedup, kv_scale=args.kv_scale, nodes_per_role=args.nodes_per_role or None,
                              scheduler={"workload": workloads.prior(args.workload, args.max_input_tokens),
                                         "output_tokens": args.output_tokens},
                              model={k: v for k, v in (("tokenizer", None if args.tokenizer == "none" else args.tokenizer),
                                                       ("served_name", SERVED_NAME)) if v is not None})
            wrap = {n["name"]: net.nets[site].wrap for site in prfaas for n in doc["clusters"][site]["nodes"]}
            deployment = start_deployment(group, doc, engine_args=_context_args(args), wrap=wrap)
            results, wall_s = asyncio.run(replay(deployment.router.url, requests))
            status = http_sync.get_json(deployment.router.url + "/status", timeout_s=CONTROL_REQUEST_TIMEOUT_S)
            sent = {f"{p}->{d}": net.sent_bytes(p, d) for p, d in net.links_mbit}
            namespaces = net.namespaces()
            group.stop()  # before the namespaces go
    finally:
        group.stop()
    summary = summarize_fleet(args, requests, results, wall_s, status, sent, log_dir)
    return {**summary, "namespaces": namespaces}, render_fleet


def summarize_fleet(args, requests, results: list[RequestResult], wall_s: float, status: dict, sent: dict[str, int],
                    log_dir: Path) -> dict:
    ok = [r for r in results if r.ok]
    rejected = sum(r.rejected for r in results)
    links = {}
    for name, pair in status["pairs"].items():
        mine = [r for r in ok if r.link == name]  # the requests whose KV crossed this link
        ttfts = [r.ttft_s for r in mine if r.ttft_s is not None]
        links[name] = {"offloaded": len(mine), "threshold_tokens": pair["threshold_tokens"],
                       "capacity_estimate_gbps": pair["controller"]["capacity_est_bps"] / 1e9,
                       "kv_sent_mb": sent.get(name, 0) / 1e6, "ttft_p50_s": percentile(ttfts, 0.5)}
    entries = {}
    for a, r in zip(requests, results, strict=True):
        entry = (a.headers or {}).get("x-prfaas-entry", "global")
        e = entries.setdefault(entry, {"requests": 0, "ok": 0, "local": 0, "ttfts": []})
        e["requests"] += 1
        e["ok"] += r.ok
        e["local"] += r.ok and r.route.startswith("pd/")
        if r.ok and r.ttft_s is not None:
            e["ttfts"].append(r.ttft_s)
    return {"topology": str(args.topology), "workload": args.workload, "wall_s": wall_s, "speedup": args.speedup,
            "requests_ok": len(ok), "requests_rejected": rejected, "requests_failed": len(results) - len(ok) - rejected,
            "errors": sorted({r.error for r in results if r.error})[:5],
            "offload_fraction": sum(r.route.startswith("prfaas/") for r in ok) / len(ok) if ok else 0.0,
            "links": links,
            "entries": {k: {"requests": v["requests"], "ok": v["ok"], "prefilled_locally": v["local"],
                            "ttft_p50_s": percentile(v["ttfts"], 0.5),
                            "ttft_p90_s": percentile(v["ttfts"], 0.9)} for k, v in entries.items()},
            "logs": str(log_dir)}


def render_fleet(summary: dict) -> str:
    lines = [f"fleet {summary['topology']}: {summary['requests_ok']} ok / {summary['requests_rejected']} rejected / "
             f"{summary['requests_failed']} failed in {summary['wall_s']:.1f} s (speedup {summary['speedup']:g}), "
             f"offload {summary['offload_fraction']:.2f}"]
    for name, link in summary["links"].items():
        p50 = "-" if link["ttft_p50_s"] is None else f"{link['ttft_p50_s']:.3f} s"
        lines.append(f"  link {name:<28} {link['offloaded']:4d} offloaded, t {link['threshold_tokens'] / 1000:.1f}K, "
                     f"capacity est {link['capacity_estimate_gbps']:.2f} Gbps, KV {link['kv_sent_mb']:.1f} MB, TTFT p50 {p50}")
    for name, entry in summary["entries"].items():
        p50 = "-" if entry["ttft_p50_s"] is None else f"{entry['ttft_p50_s']:.3f} s"
        lines.append(f"  entry {name:<27} {entry['ok']}/{entry['requests']} ok, {entry['prefilled_locally']} prefilled "
                     f"locally, TTFT p50 {p50}")
    lines += [f"error: {e}" for e in summary["errors"]]
    lines.append(f"logs: {summary['logs']}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
