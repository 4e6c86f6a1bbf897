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
from prfaas_sglang.demo.client import RequestResult, generate_ids, replay
from prfaas_sglang.demo.cluster import ProcessGroup, local_topology, start_deployment
from prfaas_sglang.plan.workload import case_study_lengths
from prfaas_sglang.router.threshold import ControllerSettings
from prfaas_sglang.sim import arrivals
from prfaas_sglang.sim.fleet import FleetSpec, SimSettings, Simulation
from prfaas_sglang.sim.nodes import SimRequest
from prfaas_sglang.sim.summary import summarize
from prfaas_sglang.stats import percentile

PRIOR = case_study_lengths(65_536).config()  # the case study's lengths, capped at 64K tokens
VOCAB = 32_000
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
        sim.service.only_pair().controller.override(0.0, pin_tokens)
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


# --- a fleet of several clusters --------------------------------------------------------------------

FLEET_FILE = Path(__file__).resolve().parents[2] / "launch" / "multi-cluster.yaml"


def fleet_docs(raw: dict, output_tokens: int, nodes_per_role: int = 1) -> dict:
    """The fleet ``raw`` cut to ``nodes_per_role`` nodes of each role per cluster, in model units (what
    the simulator runs; the emulated side is :func:`prfaas_sglang.demo.fleet.local_fleet` of it)."""
    import copy

    doc = copy.deepcopy(raw)
    for cluster in doc["clusters"].values():
        seen: dict[str, int] = {}
        kept = []
        for node in cluster["nodes"]:
            seen[node["role"]] = seen.get(node["role"], 0) + 1
            if seen[node["role"]] <= nodes_per_role or cluster["kind"] == "control":
                kept.append(node)
        cluster["nodes"] = kept
    doc["scheduler"] = {**doc.get("scheduler", {}), "workload": PRIOR, "output_tokens": output_tokens}
    return doc


def _entries(plan: list[tuple[float, int]], shares: dict[str, float], seed: int) -> list[str]:
    rng = random.Random(seed * 7919 + 1)
    return [rng.choices(list(shares), list(shares.values()))[0] for _ in plan]


def simulate_fleet(doc: dict, plan: list[tuple[float, int]], entries: list[str], duration_s: float, warmup_s: float,
                   speedup: float, ttft_slo_s: float, slo_tokens_per_s: float) -> dict:
    interval_s, controller = emulated_cadence(speedup)
    sim = Simulation(doc, SimSettings(admission_timeout_s=ADMISSION_TIMEOUT_S, control_interval_s=interval_s,
                                      threshold=controller, ttft_target_s=ttft_slo_s))
    output_tokens = doc["scheduler"]["output_tokens"]
    blocks, requests = 0, []
    for i, ((t, n), entry) in enumerate(zip(plan, entries, strict=True)):
        count = n // 512 + 1
        requests.append(SimRequest(f"r{i}", t, n, output_tokens, tuple(range(blocks, blocks + count)), entry=entry))
        blocks += count
    sim.run(requests, duration_s + 600)
    window = [r for r in sim.requests if warmup_s <= r.arrival_s < duration_s]
    done = [r for r in window if r.finish_s is not None]
    ttft = [r.ttft_s for r in done if r.ttft_s is not None]
    from prfaas_sglang.sim.summary import meets_slo

    links: dict[str, int] = {}
    for r in done:
        if r.cluster == "prfaas":
            links[str(r.lease.pair)] = links.get(str(r.lease.pair), 0) + 1
    return {"goodput_rps": sum(meets_slo(r, ttft_slo_s, slo_tokens_per_s) for r in done) / (duration_s - warmup_s),
            "ttft_p50_s": round(percentile(ttft, 0.5), 3) if ttft else None,
            "ttft_p90_s": round(percentile(ttft, 0.9), 3) if ttft else None,
            "offload": sum(r.cluster == "prfaas" for r in done) / len(done) if done else None,
            "finished": len(done), "arrived": len(window), "links": links,
            "decoded_elsewhere": sum(sim.service.workers[r.decode_node].site != r.entry for r in done)}


def run_fleet(seeds: int = 1, load_rps: float = 3.0, duration_s: float = 300.0, warmup_s: float = 30.0,
              speedup: float = 5.0, kv_scale: float = 0.01, output_tokens: int = 64, log_dir: Path | None = None,
              fleet_file: Path = FLEET_FILE) -> dict:
    """The fleet of ``fleet_file`` (one node per role per cluster) emulated (``demo/fleet.py``: a namespace
    per PrfaaS cluster, a shaped link per pair) and simulated, on the same arrivals entering per the
    file's ``entry_share``; the threshold controllers run on both."""
    import yaml

    from prfaas_sglang.demo.fleet import FleetNet, fleet_sites, links_mbit, local_fleet
    from prfaas_sglang.topology import parse_topology

    raw = yaml.safe_load(fleet_file.read_text())
    doc = fleet_docs(raw, output_tokens)
    topology = parse_topology(doc, str(fleet_file), fleet_file.parent)
    shares = {n: c.entry_share for n, c in topology.clusters.items() if c.kind == "pd" and c.entry_share}
    slo_s, slo_tps = topology.scheduler.ttft_slo_s or 10.0, topology.scheduler.slo_tokens_per_s or 40.0
    log_dir = log_dir or Path(tempfile.mkdtemp(prefix="prfaas-sim-vs-emu-fleet-"))
    prfaas, pd = fleet_sites(doc)
    rows = []
    for seed in range(seeds):
        plan = poisson_arrivals(load_rps, duration_s, 1000 * seed + 7, output_tokens)
        entries = _entries(plan, shares, seed)
        sim = simulate_fleet(doc, plan, entries, duration_s, warmup_s, speedup, slo_s, slo_tps)
        group = ProcessGroup(log_dir / f"seed-{seed}")
        try:
            with FleetNet(pd, prfaas, links_mbit(doc, speedup, kv_scale)) as net:
                local = local_fleet(doc, net, speedup=speedup, kv_scale=kv_scale, nodes_per_role=None)
                wrap = {n["name"]: net.nets[site].wrap for site in prfaas for n in local["clusters"][site]["nodes"]}
                context = ("--context-tokens", str(PRIOR["max_tokens"] + output_tokens + 16))
                dep = start_deployment(group, local, "--no-early-rejection", "--admission-timeout-s",
                                       f"{ADMISSION_TIMEOUT_S / speedup:g}", wrap=wrap,
                                       engine_args={r: context for r in ("prfaas", "pd-prefill", "pd-decode")})
                rng = random.Random(seed)
                arrivals_ = [dataclasses.replace(generate_ids(t / speedup, [rng.randrange(VOCAB) for _ in range(n)],
                                                              output_tokens), headers={"x-prfaas-entry": entry})
                             for (t, n), entry in zip(plan, entries, strict=True)]
                results, _ = asyncio.run(replay(dep.router.url, arrivals_, timeout_s=600))
        finally:
            group.stop()
        emu = measure(results, plan, speedup, slo_s, slo_tps, duration_s, warmup_s)
        window = [r for r, (t, _) in zip(results, plan, strict=True) if warmup_s <= t < duration_s and r.ok]
        emu["links"] = {}
        for r in window:
            if r.route.startswith("prfaas/"):
                emu["links"][r.link] = emu["links"].get(r.link, 0) + 1
        rows.append({"seed": seed, "sim": sim, "emulator": emu,
                     "ratio": {k: (sim[k] / emu[k] if sim[k] is not None and emu[k] else None)
                               for k in ("goodput_rps", "ttft_p50_s", "ttft_p90_s", "offload")}})
    return {"fleet": f"{fleet_file.name}, one node per role per cluster", "load_rps": load_rps, "speedup": speedup,
            "duration_s": duration_s, "warmup_s": warmup_s, "output_tokens": output_tokens, "rows": rows,
            "logs": str(log_dir)}
