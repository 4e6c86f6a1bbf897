"""Emulated-engine fidelity under load: measured stage throughput vs the planner's equations 3-6.

One small deployment from one topology (the comparison's hetero one: 1 PrfaaS
8xH200, PD 8xH20 at the split the planner picks for two PD instances), every
node started through the launcher, on loopback (the link is not the subject
here; ``bench compare --link scarce`` shapes it). Each stage is saturated on
its own with a closed loop of requests sent as a router would (the same body,
with bootstrap fields, to a prefill and a decode worker):

* ``Theta_prfaas``: prompts drawn from the workload above ``t`` to the PrfaaS worker;
* ``Theta_pd_p``: prompts at or below ``t`` to the PD-P worker;
* ``Theta_pd_d``: 16-token prompts on PD-P, ``L_out`` output tokens, more
  concurrent requests than the decode batch limit;

each measured as completions per second between the first and last
completion after a warm-up, in model time (wall x speedup). Then our router
gets Poisson arrivals at 50% and 80% of the measured ``Lambda_max`` (min over
stages of Theta / share of requests, eq. 6 with the measured Thetas) and the
benchmark reports TTFT p50/p90.

The planner evaluates ``T_prefill`` at the *mean* length of each side of
``t`` (eq. 3-4); the engine pays ``T_prefill(l)`` per request, and ``T`` is
convex in ``l`` (attention), so ``E[T(l)] > T(E[l])`` and the measured Theta
sits below the planner's by that gap. The report shows both the planner's
figure and the figure with ``E[T(l)]`` over the same samples, so the two
causes (model simplification vs emulator error) are apart.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import random
import statistics
import tempfile
import time
from pathlib import Path

import aiohttp

from prfaas_sglang import runtime
from prfaas_sglang.bench.subcommands import Invocation
from prfaas_sglang.demo.client import RequestResult, generate_ids, replay
from prfaas_sglang.demo.cluster import ProcessGroup, local_topology, start_deployment
from prfaas_sglang.plan.model import evaluate
from prfaas_sglang.plan.search import search
from prfaas_sglang.plan.workload import case_study_lengths
from prfaas_sglang.stats import percentile
from prfaas_sglang.topology import parse_topology

LENGTHS = case_study_lengths(65_536)  # the case study's, capped at 64K tokens
PRIOR = LENGTHS.config()
VOCAB = 32_000


def topology(speedup: float, kv_scale: float, output_tokens: int, n_prefill: int = 1, n_decode: int = 1) -> dict:
    return local_topology(pd_prefill=n_prefill, pd_decode=n_decode, speedup=speedup, kv_scale=kv_scale, workload=PRIOR,
                          output_tokens=output_tokens, accelerators=("h200x8", "h20x8"), link_gbps=100.0)


def planned_split(speedup: float, kv_scale: float, output_tokens: int) -> tuple[int, int]:
    """The planner's best PD split for two PD instances (and its t)."""
    model = runtime.from_topology(parse_topology(topology(speedup, kv_scale, output_tokens)))
    best = search(model.deployment, model.prior, model.step_tokens).best
    return best.n_prefill, best.n_decode


def _lengths(rng: random.Random, n: int, above: float | None = None, at_most: float | None = None) -> list[int]:
    out = []
    while len(out) < n:
        length = int(LENGTHS.sample(rng, 1)[0])
        if (above is None or length > above) and (at_most is None or length <= at_most):
            out.append(length)
    return out


async def _closed_loop(prefill, decode, lengths: list[int], output_tokens: int, concurrency: int, rng: random.Random) -> list[float]:
    """Send ``lengths`` through one PD pair, ``concurrency`` at a time; returns completion times."""
    done: list[float] = []
    queue = list(lengths)

    async def worker(session):
        while queue:
            n = queue.pop()
            body = {"input_ids": [rng.randrange(VOCAB) for _ in range(n)], "sampling_params": {"max_new_tokens": output_tokens},
                    "bootstrap_host": prefill.url.split("//")[1].split(":")[0], "bootstrap_port": prefill.bootstrap_port,
                    "bootstrap_room": rng.getrandbits(63)}

            async def post(url, body=body):
                async with session.post(url + "/generate", json=body) as resp:
                    await resp.read()
                    return resp.status

            if await asyncio.gather(post(prefill.url), post(decode.url)) == [200, 200]:
                done.append(time.monotonic())

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600),
                                     connector=aiohttp.TCPConnector(limit=concurrency * 2 + 8)) as session:
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))
    return sorted(done)


def _rate(done: list[float], warmup: int) -> float | None:
    steady = done[warmup:]
    if len(steady) < 3 or steady[-1] <= steady[0]:
        return None
    return (len(steady) - 1) / (steady[-1] - steady[0])



def run(speedup: float = 5.0, kv_scale: float = 0.01, output_tokens: int = 64, requests_per_stage: int = 40,
        ttft_window_s: float = 20.0, seed: int = 0, log_dir: Path | None = None) -> dict:
    n_p, n_d = planned_split(speedup, kv_scale, output_tokens)
    doc = topology(speedup, kv_scale, output_tokens, n_p, n_d)
    model = runtime.from_topology(parse_topology(doc))
    t = model.baseline_threshold_tokens
    point = evaluate(model.deployment, model.prior.split(t), n_p, n_d)
    rng = random.Random(seed)
    log_dir = log_dir or Path(tempfile.mkdtemp(prefix="prfaas-fidelity-load-"))
    group = ProcessGroup(log_dir)
    try:
        context = ("--context-tokens", str(PRIOR["max_tokens"] + output_tokens + 16))
        dep = start_deployment(group, doc, engine_args={r: context for r in ("prfaas", "pd-prefill", "pd-decode")})
        p0, pp0, d0 = dep.worker("prfaas"), dep.worker("pd-prefill"), dep.worker("pd-decode")
        long, short = _lengths(rng, requests_per_stage, above=t), _lengths(rng, requests_per_stage, at_most=t)
        batch = int(model.decode.bs_max)
        measured_wall = {
            "prfaas": _rate(asyncio.run(_closed_loop(p0, d0, long, 1, 4, rng)), 4),
            "pd_prefill": _rate(asyncio.run(_closed_loop(pp0, d0, short, 1, 4, rng)), 4),
            "pd_decode": _rate(asyncio.run(_closed_loop(pp0, d0, [16] * (3 * batch), output_tokens, batch + batch // 4, rng)), batch),
        }
        measured = {k: (v / speedup if v else None) for k, v in measured_wall.items()}  # model requests/s
        prof = {"prfaas": model.costs["prfaas"].instance.prefill, "pd_prefill": model.costs["pd"].instance.prefill}
        jensen = {"prfaas": 1 / statistics.fmean(prof["prfaas"].prefill_s(n) for n in long),
                  "pd_prefill": n_p / statistics.fmean(prof["pd_prefill"].prefill_s(n) for n in short)}
        # the runtime model is in observed (wall) units: model requests/s = observed / speedup
        planner = {"prfaas": point.theta_prfaas_rps / speedup, "pd_prefill": point.theta_pd_prefill_rps / speedup,
                   "pd_decode": point.theta_pd_decode_rps / speedup}
        p = point.offload_fraction
        lam_measured = min(measured["prfaas"] / p if p else float("inf"),
                           measured["pd_prefill"] / (1 - p) if p < 1 else float("inf"), measured["pd_decode"])
        ttft = {}
        for share in (0.5, 0.8):
            wall_rate = share * lam_measured * speedup
            arrivals, clock = [], 0.0
            while True:
                clock += rng.expovariate(wall_rate)
                if clock > ttft_window_s:
                    break
                n = _lengths(rng, 1)[0]
                arrivals.append(generate_ids(clock, [rng.randrange(VOCAB) for _ in range(n)], output_tokens))
            results, _ = asyncio.run(replay(dep.router.url, arrivals))
            ok: list[RequestResult] = [r for r in results if r.ok]
            ttft[f"{share:g}"] = {"offered_rps": share * lam_measured, "requests": len(results), "ok": len(ok),
                                  "ttft_p50_s": percentile([r.ttft_s * speedup for r in ok], 0.5),
                                  "ttft_p90_s": percentile([r.ttft_s * speedup for r in ok], 0.9)}
    finally:
        group.stop()
    stages = {k: {"measured_rps": measured[k], "planner_rps": planner[k],
                  "measured_over_planner": measured[k] / planner[k] if measured[k] else None,
                  "planner_with_mean_T_rps": jensen.get(k),
                  "measured_over_mean_T": measured[k] / jensen[k] if k in jensen and measured[k] else None}
              for k in planner}
    return {"split": {"n_prefill": n_p, "n_decode": n_d}, "threshold_tokens": t, "offload_fraction": p,
            "speedup": speedup, "output_tokens": output_tokens, "decode_batch": batch, "stages": stages,
            "lambda_max": {"planner_rps": point.lambda_max_rps / speedup, "measured_rps": lam_measured,
                           "measured_over_planner": lam_measured / (point.lambda_max_rps / speedup),
                           "binding_stage_planner": point.binding_stage},
            "ttft": ttft, "logs": str(log_dir), "settings": dataclasses.asdict(model.emulation)}


def render_markdown(r: dict) -> str:
    lines = [f"split {r['split']['n_prefill']}P{r['split']['n_decode']}D, t = {r['threshold_tokens']:.0f}, "
             f"offload {r['offload_fraction']:.2f}; model requests/s", "",
             "| stage | planner (eq. 3-5) | with E[T(l)] | measured | measured / planner | measured / E[T] |", "|---|---|---|---|---|---|"]
    for k, s in r["stages"].items():
        def f(x, fmt="{:.3f}"):
            return "n/a" if x is None else fmt.format(x)
        lines.append(f"| {k} | {f(s['planner_rps'])} | {f(s['planner_with_mean_T_rps'])} | {f(s['measured_rps'])} | "
                     f"{f(s['measured_over_planner'], '{:.2f}')} | {f(s['measured_over_mean_T'], '{:.2f}')} |")
    lam = r["lambda_max"]
    lines.append(f"| Lambda_max (eq. 6) | {lam['planner_rps']:.3f} | | {lam['measured_rps']:.3f} | {lam['measured_over_planner']:.2f} | |")
    lines += ["", "| load (x measured Lambda_max) | offered req/s | ok / sent | TTFT p50 (s) | TTFT p90 (s) |", "|---|---|---|---|---|"]
    for share, x in r["ttft"].items():
        lines.append(f"| {share} | {x['offered_rps']:.3f} | {x['ok']} / {x['requests']} | {x['ttft_p50_s']:.2f} | {x['ttft_p90_s']:.2f} |")
    return "\n".join(lines)


def cli(args: argparse.Namespace, inv: Invocation) -> int:
    """``mock-fidelity --load`` (its flags added and checked by :mod:`prfaas_sglang.bench.mock`)."""
    speedup = args.speedup if args.speedup != 1.0 else 5.0
    result = run(speedup, args.kv_scale)
    header = f"<!-- python -m prfaas_sglang.bench mock-fidelity --load --speedup {speedup:g}; {inv.stamp} -->"
    return inv.report(args, result, header, render_markdown)
