"""Bandwidth awareness end to end: throttle the PrfaaS link 10x mid-run, watch the router's ``t``.

Topology (this machine only): the emulated PrfaaS prefill worker runs in its
own network namespace behind a veth pair whose egress is shaped by ``tbf``;
the PD-P and PD-D workers and the router run in the root namespace. Every node
starts through the launcher from one topology (link = the nominal rate), so
the router's cost model and ``t`` are the runtime model's. Phases: ``clear``
(tbf at the nominal rate), ``throttled`` (nominal / ``factor``), ``clear``.
A Poisson load of case-study prompts (token ids) runs throughout; the router's
``/status`` is sampled every 0.25 s. Needs root and iproute2 (``ip``, ``tc``).

Figures (all from the router's own series and clock, CLOCK_MONOTONIC shared):

* ``saturation_shown_s``: first sample after the throttle in which the link is
  busy (>= 0.9) and delivers under 0.7 of the nominal rate;
* ``t_raise_s``: from then to the first raise of ``t`` (target <= 2 s);
* ``t_changes_while_throttled``: changes of ``t`` after the first settle (the
  first change followed by 5 s without one), until the link is restored (target <= 2);
* ``egress_over_capacity_fraction``: share of throttled seconds in which the
  offered egress (KV bits whose transfer was requested after the throttle,
  averaged over the trailing ``offered_window_s`` = 5 s) exceeded the throttled
  capacity (target < 0.1). Demand requested before the throttle is backlog no
  controller can take back; ``..._with_prior_demand`` counts it too. At the throttled rate one long request's KV takes 1-3 s to
  cross, so a window shorter than about two transfers counts single transfers
  (any link below 100% but above ~30% utilisation has some), not overload;
  the 2 s figure is reported beside it (``..._2s``), and the mean offered load;
  ``..._settled`` counts only the seconds after the first settle plus one window;
* ``t_recovery_s``: from restoring the link to ``t`` back at the healthy-link
  baseline the controller reports then (it tracks the routed lengths, so it
  may differ slightly from the pre-throttle ``t``; target <= 10 s);
* ``requests_failed`` (target 0): answers other than 200 that are not refusals;
  ``requests_refused`` counts, by cause, the requests admission refused up front
  (429/503 with Retry-After, before any work: early rejection when the predicted
  TTFT exceeds the topology's SLO), which is the product's overload behaviour.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import tempfile
import time
from collections import Counter
from pathlib import Path

import aiohttp

from prfaas_sglang.bench.subcommands import CommaList, Invocation, Subcommand
from prfaas_sglang.demo.cluster import ProcessGroup, local_topology, start_deployment
from prfaas_sglang.demo.netns import Netns
from prfaas_sglang.plan.workload import case_study_lengths

LENGTHS = case_study_lengths(65_536)  # the case study's, capped at 64K tokens
PRIOR = LENGTHS.config()


async def _load(url: str, rate: float, until: float, rng: random.Random, t0: float, results: list) -> None:
    lengths = LENGTHS
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
        tasks = []
        while time.monotonic() < until:
            await asyncio.sleep(rng.expovariate(rate))
            n = int(lengths.sample(rng, 1)[0])
            body = {"input_ids": [rng.randrange(32_000) for _ in range(n)], "sampling_params": {"max_new_tokens": 4}}

            sent = time.monotonic()

            async def one(body=body, sent=sent):
                try:
                    async with session.post(url + "/generate", json=body) as resp:
                        payload = await resp.read()
                        results.append({"t_s": sent - t0, "status": resp.status, "route": resp.headers.get("x-prfaas-route", ""),
                                        "refused": _refusal(resp.status, resp.headers, payload)})
                except (aiohttp.ClientError, asyncio.TimeoutError) as err:
                    results.append({"t_s": sent - t0, "status": None, "route": "", "error": str(err)})

            tasks.append(asyncio.create_task(one()))
        await asyncio.gather(*tasks)


def _refusal(status: int, headers, payload: bytes) -> str | None:
    """The router's reason for refusing a request before any work (429/503 with Retry-After), else None."""
    if status not in (429, 503) or "Retry-After" not in headers:
        return None
    try:
        return json.loads(payload)["error"].get("type") or "refused"
    except (ValueError, KeyError, TypeError, AttributeError):
        return "refused"


async def _sample(url: str, until: float, t0: float, series: list) -> None:
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < until:
            async with session.get(url + "/status") as resp:
                status = await resp.json()
            link = status["link"] or {}
            series.append({"t_s": time.monotonic() - t0, "threshold_tokens": status["threshold_tokens"],
                           "baseline_tokens": status["controller"]["baseline_tokens"],
                           "capacity_est_mbps": status["controller"]["capacity_est_bps"] / 1e6,
                           "busy": link.get("busy_fraction"), "capacity_mbps": (link.get("capacity_bps") or 0) / 1e6
                           if link.get("capacity_bps") is not None else None,
                           "egress_mbps": (link.get("egress_bps") or 0) / 1e6, "offered_mbps": (link.get("offered_bps") or 0) / 1e6,
                           "backlog_mb": (link.get("backlog_bytes") or 0) / 1e6,
                           "queue_prfaas_s": status["queues_s"]["prfaas_s"], "queue_pd_s": status["queues_s"]["pd_s"]})
            await asyncio.sleep(0.25)


def run(nominal_mbit: float = 400.0, factor: float = 10.0, load_rps: float = 2.0,
        phases_s: tuple[float, float, float] = (15.0, 60.0, 20.0), speedup: float = 10.0, kv_scale: float = 0.01,
        seed: int = 0, offered_window_s: float = 5.0, log_dir: Path | None = None) -> dict:
    log_dir = log_dir or Path(tempfile.mkdtemp(prefix="prfaas-bw-"))
    group = ProcessGroup(log_dir)
    with Netns() as net:
        try:
            net.throttle(nominal_mbit)
            doc = local_topology(hosts={"prfaas": net.inner_ip}, host=net.outer_ip, link_gbps=nominal_mbit / 1000,
                                 speedup=speedup, kv_scale=kv_scale, workload=PRIOR, output_tokens=4,
                                 accelerators=("h200x8", "h20x8"))
            deployment = start_deployment(group, doc, wrap={"prfaas": net.wrap},
                                          engine_args={"prfaas": ("--context-tokens", "70000"),
                                                       "pd-prefill": ("--context-tokens", "70000"),
                                                       "pd-decode": ("--context-tokens", "70000")})
            result = asyncio.run(_experiment(deployment.router.url, net, nominal_mbit, factor, load_rps, phases_s, seed,
                                             offered_window_s))
            result["logs"] = str(log_dir)
            return result
        finally:
            group.stop()


async def _experiment(url, net: Netns, nominal_mbit, factor, load_rps, phases_s, seed, offered_window_s) -> dict:
    t0 = time.monotonic()
    end = t0 + sum(phases_s)
    series: list = []
    results: list = []
    load = asyncio.create_task(_load(url, load_rps, end, random.Random(seed), t0, results))
    sampler = asyncio.create_task(_sample(url, end + 3, t0, series))
    await asyncio.sleep(phases_s[0])
    throttled_at = time.monotonic() - t0
    await asyncio.to_thread(net.throttle, nominal_mbit / factor)
    await asyncio.sleep(phases_s[1])
    cleared_at = time.monotonic() - t0
    await asyncio.to_thread(net.throttle, nominal_mbit)
    await asyncio.gather(load, sampler)
    async with aiohttp.ClientSession() as session:
        async with session.get(url + "/status") as resp:
            final = await resp.json()
    history = [{"t_s": h["t_s"] - t0, "threshold_tokens": h["threshold_tokens"], "why": h["why"]} for h in final["threshold_history"]]
    return analyse(series, history, results, throttled_at, cleared_at, nominal_mbit, factor, offered_window_s) | {
        "nominal_mbit": nominal_mbit, "throttled_mbit": nominal_mbit / factor, "load_rps": load_rps, "phases_s": phases_s,
        "series": series, "history": history, "requests_log": results}


def analyse(series: list[dict], history: list[dict], results: list[dict], throttled_at: float, cleared_at: float,
            nominal_mbit: float, factor: float, offered_window_s: float, settle_s: float = 5.0) -> dict:
    """The figures of the module docstring from a sampled series and the controller's history (pure)."""
    capacity = nominal_mbit / factor
    before = [s for s in series if s["t_s"] < throttled_at]
    baseline = before[-1]["threshold_tokens"] if before else None
    shown = next((s["t_s"] for s in series if s["t_s"] >= throttled_at and (s["busy"] or 0) >= 0.9
                  and s["capacity_mbps"] is not None and s["capacity_mbps"] < 0.7 * nominal_mbit), None)
    raises = [h for h in history if throttled_at <= h["t_s"] < cleared_at and baseline is not None
              and h["threshold_tokens"] > baseline]
    raised = raises[0]["t_s"] if raises else None
    during = [h for h in history if throttled_at <= h["t_s"] < cleared_at]
    settle = None
    for i, h in enumerate(during):
        nxt = during[i + 1]["t_s"] if i + 1 < len(during) else cleared_at
        if nxt - h["t_s"] >= settle_s:
            settle = h["t_s"]
            break
    changes_after_settle = sum(1 for h in during if settle is not None and h["t_s"] > settle)
    seconds = range(int(throttled_at) + 1, int(cleared_at) + 1)

    def over_seconds(window_s: float, after_throttle: bool = True) -> list[int]:
        # after_throttle: only demand requested once the link was throttled (samples whose 1 s telemetry
        # window lies after it); demand from before is backlog no controller can take back
        first = throttled_at + 1.0 if after_throttle else float("-inf")
        out = []
        for sec in seconds:
            window = [s["offered_mbps"] for s in series if max(sec - window_s, first) <= s["t_s"] < sec]
            if window and sum(window) / len(window) > capacity:
                out.append(sec)
        return out

    def over_fraction(window_s: float, lo: float = 0.0, after_throttle: bool = True) -> float | None:
        span = [sec for sec in seconds if sec >= lo]
        return sum(1 for sec in over_seconds(window_s, after_throttle) if sec >= lo) / len(span) if span else None

    # back at the healthy-link baseline the controller reports at that moment (it follows the routed
    # lengths, so it may differ a little from the pre-throttle t)
    back = next((s["t_s"] for s in series if s["t_s"] >= cleared_at and s["threshold_tokens"] == s["baseline_tokens"]), None)
    throttled_series = [s for s in series if throttled_at + 5 <= s["t_s"] < cleared_at]
    offloaded = lambda lo, hi: _share([r for r in results if lo <= r["t_s"] < hi])  # noqa: E731
    return {
        "baseline_threshold_tokens": baseline,
        "throttled_at_s": throttled_at, "cleared_at_s": cleared_at,
        "saturation_shown_s": shown, "t_raised_at_s": raised,
        "t_raise_s": (raised - shown) if raised is not None and shown is not None else None,
        "t_first_settle_s": settle, "t_settled_tokens": next((h["threshold_tokens"] for h in during if h["t_s"] == settle), None),
        "t_changes_while_throttled": changes_after_settle if settle is not None else None,
        "t_changes_total_throttled": len(during),
        "egress_over_capacity_fraction": over_fraction(offered_window_s),
        "offered_window_s": offered_window_s,
        "egress_over_capacity_fraction_2s": over_fraction(2.0),
        "egress_over_capacity_fraction_with_prior_demand": over_fraction(offered_window_s, after_throttle=False),
        # the same, counted only once t has settled and the window no longer holds pre-settle demand
        "egress_over_capacity_fraction_settled": over_fraction(offered_window_s, (settle or cleared_at) + offered_window_s),
        "over_capacity_seconds_after_throttle": [round(sec - throttled_at) for sec in over_seconds(offered_window_s)],
        "t_recovered_at_s": back, "t_recovery_s": (back - cleared_at) if back is not None else None,
        "requests": len(results), "requests_failed": sum(r["status"] != 200 and not r.get("refused") for r in results),
        # refused up front by admission (early rejection: predicted TTFT over the SLO), by cause
        "requests_refused": dict(Counter(r["refused"] for r in results if r.get("refused"))),
        "offloaded_clear": offloaded(0, throttled_at), "offloaded_throttled": offloaded(throttled_at + 5, cleared_at),
        "offloaded_recovered": offloaded(cleared_at + 10, float("inf")),
        "egress_mbps_throttled": _mean([s["egress_mbps"] for s in throttled_series]),
        "offered_mbps_throttled": _mean([s["offered_mbps"] for s in throttled_series]),
        "offered_utilization_throttled": (_mean([s["offered_mbps"] for s in throttled_series]) or 0.0) / capacity,
        "capacity_est_mbps_throttled": _mean([s["capacity_est_mbps"] for s in throttled_series]),
    }


def _mean(values):
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def _share(window: list[dict]) -> float | None:
    ok = [r for r in window if r["status"] == 200]
    return sum(r["route"].startswith("prfaas") for r in ok) / len(ok) if ok else None


def plot(result: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = result["series"]
    ts = [x["t_s"] for x in s]
    fig, (a, b) = plt.subplots(2, 1, figsize=(8, 5.5), sharex=True)
    a.step(ts, [x["threshold_tokens"] / 1000 for x in s], where="post", label="threshold t")
    a.plot(ts, [x["baseline_tokens"] / 1000 for x in s], ls=":", color="gray", label="healthy-link baseline")
    a.set_ylabel("K tokens")
    b.plot(ts, [x["offered_mbps"] for x in s], label="offered egress (Mbit/s, 1 s window)", alpha=0.7)
    b.plot(ts, [x["egress_mbps"] for x in s], label="delivered egress (Mbit/s)", alpha=0.7)
    b.plot(ts, [x["capacity_est_mbps"] for x in s], label="router's capacity estimate", color="k", lw=1)
    b.set_yscale("symlog", linthresh=10)
    b.set_ylabel("Mbit/s")
    b.set_xlabel("seconds")
    for ax in (a, b):
        ax.axvspan(result["throttled_at_s"], result["cleared_at_s"], color="orange", alpha=0.15, label="tbf throttle")
        ax.legend(fontsize=7, loc="upper right")
    a.set_title(f"PrfaaS link {result['nominal_mbit']:g} -> {result['throttled_mbit']:g} Mbit/s mid-run")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nominal-mbit", type=float, default=400.0, help="the link's rate (tbf) before and after the throttle")
    parser.add_argument("--factor", type=float, default=10.0, help="throttled rate = nominal / factor")
    parser.add_argument("--load-rps", type=float, default=2.0,
                        help="Poisson arrivals/s; at 2 the old t overloads the throttled link 1.34x, at 3 2x")
    parser.add_argument("--phases", type=CommaList(float), default="15,60,20", help="seconds clear, throttled, clear")
    parser.add_argument("--speedup", type=float, default=10.0,
                        help="the emulated engines divide every duration by this")
    parser.add_argument("--seed", type=int, default=0,
                        help="random seed for arrivals and prompt lengths")
    parser.add_argument("--plot", type=Path, default=None, help="write the time series as a PNG here")
    parser.add_argument("--series", type=Path, default=None,
                        help="write the sampled /status series and the requests as JSON here")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")


def cli(args: argparse.Namespace, inv: Invocation) -> int:
    phases = args.phases
    if len(phases) != 3 or min(phases) <= 0 or args.factor <= 1:
        inv.error("--phases needs three positive numbers and --factor must be > 1")
    result = run(args.nominal_mbit, args.factor, args.load_rps, phases, args.speedup, seed=args.seed)
    if args.plot:
        plot(result, args.plot)
    if args.series:
        args.series.write_text(json.dumps({k: result[k] for k in ("series", "history", "requests_log")}))
    result = {k: v for k, v in result.items() if k not in ("series", "history", "requests_log")} | {"history": result["history"]}
    return inv.report(args, result, None, lambda r: json.dumps(r, indent=2))  # no table: the summary as JSON


SUBCOMMANDS = {"bandwidth": Subcommand(add_arguments, cli)}
