"""The simulator against the emulated deployment, on the same arrivals (issue #18, "validated both ways").

One small fleet, described once: 1 PrfaaS (8xH200) + PD (8xH20) at the planner's split for two PD
instances, the case study's length prior, ``L_out`` output tokens, the SLOs of the topology. It runs

* emulated: every node started through the launcher (``--engine mock``, durations / ``speedup``),
  our router in front (early rejection off, as in the simulator; admission timeout the simulator's,
  in wall seconds), each request streamed by the demo client;
* simulated: :class:`~prfaas_sglang.sim.fleet.Simulation` of the same fleet (model seconds),

on one list of Poisson arrivals per seed and load (model seconds; the emulator gets them / speedup),
with lengths drawn from the prior and no shared prefixes (random ids; distinct block hashes). Each
side reports, over the requests that arrived after a warm-up: goodput (requests meeting the TTFT SLO
and the TBT SLO, per model second), TTFT p50 / p90 (model seconds), the offload fraction.

The simulator runs the live router's controller cadence (``emulated_cadence``): the router's
threshold controller keeps its clocks in wall seconds (one bias step per second at most), which at
``speedup`` 5 is one step per 5 model seconds; at its own default (1 s model) the simulated controller
chases the PD-P queue five times as fast and offloads more under load (0.8 x Lambda_max: offload
+15%, TTFT p50 -24% before this was matched). Where they still differ, by construction: the
emulator's TTFT includes the router's HTTP hops and the client's stream (milliseconds of wall, times
``speedup``), and its decode steps run on asyncio timers. The loads stay below
``Lambda_max`` (0.5 and 0.8 of the planner's): a comparison at overload measures queue blow-up, where
both sides' numbers grow without bound.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import random
import statistics
import tempfile
from pathlib import Path

from prfaas_sglang.adapters import http_sync
from prfaas_sglang.bench.fidelity import PRIOR, VOCAB
from prfaas_sglang.demo.client import RequestResult, generate_ids, replay
from prfaas_sglang.demo.cluster import ProcessGroup, local_topology, start_deployment
from prfaas_sglang.router.threshold import ControllerSettings
from prfaas_sglang.sim import arrivals
from prfaas_sglang.sim.fleet import FleetSpec, SimSettings, Simulation
from prfaas_sglang.sim.nodes import SimRequest
from prfaas_sglang.sim.summary import summarize
from prfaas_sglang.stats import percentile

ADMIN_TOKEN = "sim-vs-emulator"
ADMISSION_TIMEOUT_S = 60.0  # model seconds, both sides


def fleet(output_tokens: int) -> FleetSpec:
    """The fleet both sides run: the planner's split of two PD instances."""
    probe = FleetSpec(1, 1, 1, accelerators=("h200x8", "h20x8"), workload_prior=PRIOR, output_tokens=output_tokens)
    point = probe.planner_split()
    return FleetSpec(1, point.n_prefill, point.n_decode, accelerators=probe.accelerators, workload_prior=PRIOR,
                     output_tokens=output_tokens)


def poisson_arrivals(rate_rps: float, duration_s: float, seed: int, output_tokens: int) -> list[tuple[float, int]]:
    """(arrival model s, prompt tokens): the simulator's Poisson arrivals with the prior's lengths."""
    return [(r.arrival_s, r.input_tokens) for r in arrivals.poisson(rate_rps, duration_s, seed, output_tokens,
                                                                      ((0.0, PRIOR),))]


def emulated_cadence(speedup: float) -> tuple[float, ControllerSettings]:
    """(control interval, threshold-controller settings) of the live router in front of an emulated
    deployment, in model seconds: its loop ticks every 0.25 s of wall and its controller's own clocks
    (one bias step per ``adjust_every_s``, re-search every ``research_every_s``, ...) run on wall time;
    only the queue marks are model seconds (``time_scale``). At ``speedup`` 5 the live controller
    steps at most every 5 model seconds: the simulator of that deployment must too."""
    d = ControllerSettings()
    scaled = {k: getattr(d, k) * speedup for k in ("confirm_s", "adjust_every_s", "idle_decay_s", "research_every_s",
                                                   "window_s", "probe_interval_s", "probe_max_s")}
    return 0.25 * speedup, dataclasses.replace(d, **scaled)


def simulate(spec: FleetSpec, plan: list[tuple[float, int]], duration_s: float, warmup_s: float, speedup: float,
             pin_tokens: float | None = None) -> dict:
    interval_s, controller = emulated_cadence(speedup)
    # The live router's placement: the rule's cluster while its expected TTFT is within the SLO (its default).
    sim = Simulation(spec, SimSettings(admission_timeout_s=ADMISSION_TIMEOUT_S, control_interval_s=interval_s,
                                       threshold=controller, ttft_target_s=spec.ttft_slo_s))
    if pin_tokens is not None:
        sim.service.controller.override(0.0, pin_tokens)
    blocks = 0
    requests = []
    for i, (t, n) in enumerate(plan):
        count = n // 512 + 1
        requests.append(SimRequest(f"r{i}", t, n, spec.output_tokens, tuple(range(blocks, blocks + count))))
        blocks += count  # distinct blocks: no prefix is shared, as with the emulator's random ids
    sim.run(requests, duration_s + 600)
    s = summarize(sim, warmup_s, duration_s)
    return {"goodput_rps": s["goodput_rps"], "ttft_p50_s": s["ttft_s"]["p50"], "ttft_p90_s": s["ttft_s"]["p90"],
            "offload": s["offload_fraction"], "finished": s["finished"], "arrived": s["arrived"]}


def measure(results: list[RequestResult], plan: list[tuple[float, int]], speedup: float, ttft_slo_s: float,
            slo_tokens_per_s: float, duration_s: float, warmup_s: float) -> dict:
    """The emulated run's figures in model units (wall x speedup), over arrivals in [warm-up, duration)."""
    window = [r for r, (t, _) in zip(results, plan, strict=True) if warmup_s <= t < duration_s]
    ok = [r for r in window if r.ok]
    ttft = [r.ttft_s * speedup for r in ok]
    good = [r for r in ok if r.ttft_s * speedup <= ttft_slo_s and (r.mean_tbt_s * speedup <= 1.0 / slo_tokens_per_s)]
    routed = [r for r in ok if r.route]
    return {"goodput_rps": len(good) / (duration_s - warmup_s),
            "ttft_p50_s": round(percentile(ttft, 0.5), 3) if ttft else None,
            "ttft_p90_s": round(percentile(ttft, 0.9), 3) if ttft else None,
            "offload": sum(r.route.startswith("prfaas/") for r in routed) / len(routed) if routed else None,
            "finished": len(ok), "arrived": len(window),
            "errors": sorted({f"{r.status}: {(r.error or '')[:80]}" for r in window if not r.ok})[:5]}


MODES = ("t pinned", "controller")


def _emulate(doc: dict, log_dir: Path, plan: list[tuple[float, int]], pin_tokens: float | None, speedup: float,
             output_tokens: int, seed: int) -> list[RequestResult]:
    """One run on a fresh deployment (no router state, cache or queue carried over from another run)."""
    group = ProcessGroup(log_dir)
    try:
        context = ("--context-tokens", str(PRIOR["max_tokens"] + output_tokens + 16))
        dep = start_deployment(group, doc, "--no-early-rejection", "--admission-timeout-s", f"{ADMISSION_TIMEOUT_S / speedup:g}",
                               engine_args={r: context for r in ("prfaas", "pd-prefill", "pd-decode")},
                               router_env={"PRFAAS_ADMIN_TOKEN": ADMIN_TOKEN})
        if pin_tokens is not None:
            http_sync.post_json(dep.router.url + "/admin/threshold", {"threshold_tokens": pin_tokens}, timeout_s=10,
                                headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
        rng = random.Random(seed)
        arrivals_ = [generate_ids(t / speedup, [rng.randrange(VOCAB) for _ in range(n)], output_tokens) for t, n in plan]
        results, _ = asyncio.run(replay(dep.router.url, arrivals_, timeout_s=600))
        return results
    finally:
        group.stop()


def run(seeds: int = 2, loads: tuple[float, ...] = (0.5, 0.8), duration_s: float = 300.0, warmup_s: float = 30.0,
        speedup: float = 5.0, kv_scale: float = 0.01, output_tokens: int = 64, log_dir: Path | None = None,
        modes: tuple[str, ...] = MODES) -> dict:
    """Every (mode, load, seed): one arrival list, simulated and emulated. ``t pinned``: both routers
    hold the planner's ``t`` (an admin override), so the comparison is of the fleets' timing alone;
    ``controller``: the threshold controller runs on both, a feedback loop whose path depends on
    timing (the emulator's own run-to-run spread on identical arrivals is of the same order)."""
    spec = fleet(output_tokens)
    runtime = spec.runtime()
    lam = runtime.operating_point().lambda_max_rps
    t = runtime.baseline_threshold_tokens
    doc = local_topology(prfaas=1, pd_prefill=spec.n_prefill, pd_decode=spec.n_decode, speedup=speedup, kv_scale=kv_scale,
                         workload=PRIOR, output_tokens=output_tokens, accelerators=spec.accelerators,
                         link_gbps=spec.link_gbps, slo_tokens_per_s=spec.slo_tokens_per_s, ttft_slo_s=spec.ttft_slo_s)
    log_dir = log_dir or Path(tempfile.mkdtemp(prefix="prfaas-sim-vs-emu-"))
    rows = []
    for mode in modes:
        pin = t if mode == "t pinned" else None
        for load in loads:
            for seed in range(seeds):
                plan = poisson_arrivals(load * lam, duration_s, 1000 * seed + int(100 * load), output_tokens)
                sim = simulate(spec, plan, duration_s, warmup_s, speedup, pin)
                results = _emulate(doc, log_dir / f"{mode.replace(' ', '-')}-{load:g}-{seed}", plan, pin, speedup,
                                   output_tokens, seed)
                emu = measure(results, plan, speedup, spec.ttft_slo_s, spec.slo_tokens_per_s, duration_s, warmup_s)
                rows.append({"mode": mode, "load": load, "seed": seed, "offered_rps": load * lam, "sim": sim, "emulator": emu,
                             "ratio": {k: (sim[k] / emu[k] if sim[k] is not None and emu[k] else None)
                                       for k in ("goodput_rps", "ttft_p50_s", "ttft_p90_s", "offload")}})
    return {"fleet": f"1 PrfaaS + {spec.n_prefill}P/{spec.n_decode}D", "lambda_max_rps": lam,
            "threshold_tokens": t, "speedup": speedup, "duration_s": duration_s,
            "warmup_s": warmup_s, "output_tokens": output_tokens, "rows": rows, "logs": str(log_dir)}


def _spread(values: list[float]) -> str:
    values = [v for v in values if v is not None and math.isfinite(v)]
    if not values:
        return "n/a"
    return f"{statistics.fmean(values):.3f} ({min(values):.3f}-{max(values):.3f})"


def render_markdown(data: dict) -> list[str]:
    lines = [f"{data['fleet']}, t = {data['threshold_tokens']:.0f}, planner Lambda_max {data['lambda_max_rps']:.3f} req/s "
             f"(model), L_out {data['output_tokens']}, {data['duration_s']:g} model s per run after a "
             f"{data['warmup_s']:g} s warm-up, emulator at speedup {data['speedup']:g}; mean (min-max) over seeds", "",
             "| t | load | metric | emulated | simulated | sim / emulated |", "|---|---|---|---|---|---|"]
    groups: dict[tuple[str, float], list[dict]] = {}
    for row in data["rows"]:
        groups.setdefault((row["mode"], row["load"]), []).append(row)
    for (mode, load), rows in groups.items():
        for key, name in (("goodput_rps", "goodput (req/s)"), ("ttft_p50_s", "TTFT p50 (s)"), ("ttft_p90_s", "TTFT p90 (s)"),
                          ("offload", "offload")):
            lines.append(f"| {mode} | {load:g} x Lambda_max | {name} | {_spread([r['emulator'][key] for r in rows])} | "
                         f"{_spread([r['sim'][key] for r in rows])} | {_spread([r['ratio'][key] for r in rows])} |")
        lines.append(f"| {mode} | {load:g} x Lambda_max | finished / arrived | "
                     f"{', '.join(str(r['emulator']['finished']) + '/' + str(r['emulator']['arrived']) for r in rows)} | "
                     f"{', '.join(str(r['sim']['finished']) + '/' + str(r['sim']['arrived']) for r in rows)} | |")
    return lines
