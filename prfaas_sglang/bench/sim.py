"""The simulator's benchmarks: agreement with the analytic model, with the emulated deployment
(``bench/sim_vs_emulator.py``), the paper's case study, a workload shift under the long-term
controller, the simulator's own cost at scale, the router's calibration against a biased truth, and
a fleet's global scheduler against the per-region baselines (``bench/sim_fleet.py``).

Every study runs seeded Poisson arrivals through :class:`~prfaas_sglang.sim.fleet.Simulation`
(the product's routing policy, controllers and KV index) and reports per seed and the spread.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
import time
from pathlib import Path

from prfaas_sglang.bench.capacity import TTFT_SLO_S
from prfaas_sglang.bench.compare import LINKS_GBPS, MAX_INPUT_TOKENS
from prfaas_sglang.bench.slo import CapacitySearch
from prfaas_sglang.bench.subcommands import Invocation, Subcommand
from prfaas_sglang.router.calibration import CalibrationSettings
from prfaas_sglang.router.longterm import LongTermSettings
from prfaas_sglang.router.policy import BandwidthMode
from prfaas_sglang.sim import arrivals
from prfaas_sglang.sim.fleet import FleetSpec, SimSettings, Simulation
from prfaas_sglang.sim.summary import meets_slo, summarize

CASE_STUDY = FleetSpec(4, 3, 5)


def best_split(fleet: FleetSpec, workload=None) -> tuple[int, float, float]:
    """(N_p, t, Lambda_max) the planner picks for ``fleet``'s PD instances (N_p >= 1)."""
    point = fleet.planner_split(workload)
    return point.n_prefill, point.threshold_tokens, point.lambda_max_rps


def _mean_prefill_s(sim: Simulation, lengths: list[int], kind: str) -> float:
    return statistics.fmean(sim.timing[kind].prefill_s(n) for n in lengths)


def saturated(fleet: FleetSpec, seed: int, load: float = 1.25, duration_s: float = 2400.0, warmup_s: float = 1200.0) -> dict:
    """Offer ``load`` x Lambda_max with ``t`` fixed at the planner's and nothing shed; the completion
    rate after ``warmup_s`` is the simulated Lambda_max. Also the model with ``E[T(l)]`` for ``T(E[l])``
    (the convexity of T_prefill), over the same arrivals, to tell that gap from simulator error."""
    sim = Simulation(fleet, SimSettings(admission_timeout_s=math.inf))
    t = sim.runtime.baseline_threshold_tokens
    sim.service.only_pair().controller.override(0.0, t)  # t pinned: the queue bias would move it under overload
    point = sim.runtime.operating_point()
    lengths = fleet.workload_prior or arrivals.CASE_STUDY
    requests = list(arrivals.poisson(load * point.lambda_max_rps, duration_s, seed, sim.runtime.output_tokens,
                                      ((0.0, lengths),)))
    sim.run(requests, duration_s)
    done = sum(1 for r in sim.requests if r.finish_s is not None and warmup_s <= r.finish_s < duration_s)
    measured = done / (duration_s - warmup_s)
    long_ = [r.input_tokens for r in requests if r.input_tokens > t]
    short = [r.input_tokens for r in requests if r.input_tokens <= t]
    p = len(long_) / len(requests)
    terms = [point.theta_pd_decode_rps]
    if long_ and fleet.n_prfaas:
        terms.append(min(fleet.n_prfaas / _mean_prefill_s(sim, long_, "prfaas"), point.prfaas_bandwidth_rps) / p)
    if short:
        terms.append(fleet.n_prefill / _mean_prefill_s(sim, short, "pd") / (1 - p))
    narrow = f", lengths sigma {lengths['sigma']:g}" if fleet.workload_prior else ""
    return {"fleet": f"{fleet.n_prfaas} PrfaaS + {fleet.n_prefill}P/{fleet.n_decode}D, {fleet.link_gbps:g} Gbit/s{narrow}",
            "binding": point.binding_stage, "t": t, "seed": seed, "lambda_max_rps": point.lambda_max_rps,
            "lambda_e_t_rps": min(terms), "measured_rps": measured, "ratio": measured / point.lambda_max_rps,
            "ratio_e_t": measured / min(terms)}


def study_analytic(seeds: int) -> list[dict]:
    """Prefill-bound (the case study), decode-bound, bandwidth-bound, and prefill-bound with narrow lengths."""
    fleets = [CASE_STUDY, FleetSpec(4, 6, 2), FleetSpec(4, 3, 5, link_gbps=5.0),
              FleetSpec(4, 3, 5, workload_prior=dict(arrivals.CASE_STUDY, kind="lognormal", sigma=0.25))]
    return [saturated(fleet, seed) for fleet in fleets for seed in range(seeds)]


def max_rate(fleet: FleetSpec, seed: int, lo: float, hi: float, attainment: float = 0.9, duration_s: float = 1500.0,
             warmup_s: float = 300.0, iters: int = 7) -> tuple[float, dict]:
    """The highest Poisson rate in [lo, hi] at which ``attainment`` of requests meet both SLOs (bisection)."""
    best = (lo, {})
    for _ in range(iters):
        mid = (lo + hi) / 2
        sim = Simulation(fleet)
        sim.run(arrivals.poisson(mid, duration_s, seed, sim.runtime.output_tokens), duration_s + 300)
        s = summarize(sim, warmup_s, duration_s)
        if (s["slo_attainment"] or 0) >= attainment:
            lo, best = mid, (mid, s)
        else:
            hi = mid
    return best


def _splits(fleet: FleetSpec, around: int, width: int) -> list[FleetSpec]:
    """``fleet`` at every split within ``width`` of ``around`` PD-P instances (>= 1 per role)."""
    n_pd = fleet.n_prefill + fleet.n_decode
    return [dataclasses.replace(fleet, n_prefill=n, n_decode=n_pd - n)
            for n in range(max(1, around - width), min(n_pd - 1, around + width) + 1)]


def study_paper(seeds: int, sweep: int = 2, common_duration_s: float = 1500.0, duration_s: float = 1500.0,
                iters: int = 7) -> dict:
    """PrfaaS-PD vs homogeneous (12 x 8xH20) vs naive heterogeneous (4 x 8xH200 prefill-only + 8 x 8xH20
    decode-only). Each PD system at every split within ``sweep`` of its planner's (a baseline's
    strongest configuration is measured, not assumed): the highest rate meeting the SLOs for 90% of
    requests. Then all three, each at its best split, at one common load (the homogeneous system's
    best rate, the paper's way to compare TTFT p90)."""
    n_p, _, _ = best_split(CASE_STUDY)
    h_p, _, _ = best_split(FleetSpec(0, 1, 11))
    candidates = {"prfaas-pd": _splits(CASE_STUDY, n_p, sweep), "homogeneous": _splits(FleetSpec(0, h_p, 12 - h_p), h_p, sweep),
                  "naive-heterogeneous": [FleetSpec(4, 0, 8, threshold_tokens=1.0)]}
    planner = {"prfaas-pd": n_p, "homogeneous": h_p, "naive-heterogeneous": 0}
    sweep_rows, rows = [], []
    for seed in range(seeds):
        for name, fleets in candidates.items():
            tried = []
            for fleet in fleets:
                rate, s = max_rate(fleet, seed, 0.3, 6.0, duration_s=duration_s, warmup_s=min(300.0, duration_s / 5),
                                   iters=iters)
                tried.append((rate, fleet, s))
                sweep_rows.append({"config": name, "seed": seed, "split": f"{fleet.n_prefill}P/{fleet.n_decode}D",
                                   "planner": fleet.n_prefill == planner[name], "max_rate_rps": rate})
            rate, fleet, s = max(tried, key=lambda x: x[0])
            rows.append({"config": name, "seed": seed, "split": f"{fleet.n_prefill}P/{fleet.n_decode}D", "fleet": fleet,
                         "max_rate_rps": rate, "ttft_p90_s": s.get("ttft_s", {}).get("p90"),
                         "egress_gbps": s.get("egress_gbps_mean"), "offload": s.get("offload_fraction")})
    common_rps = statistics.fmean(r["max_rate_rps"] for r in rows if r["config"] == "homogeneous")
    common = []
    for row in rows:
        sim = Simulation(row["fleet"])
        sim.run(arrivals.poisson(common_rps, common_duration_s, row["seed"], sim.runtime.output_tokens),
                common_duration_s + 300)
        s = summarize(sim, 300.0, common_duration_s)
        common.append({"config": row["config"], "seed": row["seed"], "split": row["split"], "rate_rps": common_rps,
                       "ttft_p50_s": s["ttft_s"]["p50"], "ttft_p90_s": s["ttft_s"]["p90"],
                       "slo_attainment": s["slo_attainment"], "egress_gbps": s["egress_gbps_mean"]})
    for row in rows:
        del row["fleet"]
    return {"rows": rows, "sweep": sweep_rows, "common": common, "common_rps": common_rps}


def shift_run(fleet: FleetSpec, seed: int, rate: float, longterm: LongTermSettings | None, shift_at_s: float = 600.0,
              duration_s: float = 1800.0) -> dict:
    sim = Simulation(fleet, SimSettings(longterm=longterm))
    phases = arrivals.median_shift_phases(shift_at_s)
    sim.run(arrivals.poisson(rate, duration_s, seed, sim.runtime.output_tokens, phases), duration_s + 300)
    s = summarize(sim, duration_s - 600, duration_s)
    return {"goodput_rps": s["goodput_rps"], "ttft_p90_s": s["ttft_s"]["p90"], "conversions": sum(len(c.history) for c in sim.longterm.values()),
            "final_split": f"{sum(r.role == 'prefill' and r.cluster == 'pd' for r in sim.service.workers.values())}P/"
                           f"{sum(r.role == 'decode' for r in sim.service.workers.values())}D",
            "events": [(round(t), e[:120]) for t, e in sim.events]}


def study_shift(seeds: int) -> dict:
    """Median input doubles at minute 10 of 30; the last 10 minutes' goodput: the old split fixed, the
    long-term controller, and the planner's optimum split for the new lengths fixed from the start.
    Arrivals at 90% of that optimum's Lambda_max (above what the old split sustains)."""
    new = arrivals.lognormal(arrivals.median_shift_phases(0)[1][1])
    n_new, _, lam_new = best_split(CASE_STUDY, new)
    n_old, _, _ = best_split(CASE_STUDY)
    lam_old_split = CASE_STUDY.runtime().plan_splits(new)[n_old].lambda_max_rps
    rate = 0.9 * lam_new
    rows = []
    for seed in range(seeds):
        for name, fleet, lt in (("fixed old split", dataclasses.replace(CASE_STUDY, n_prefill=n_old, n_decode=8 - n_old), None),
                                ("long-term controller", dataclasses.replace(CASE_STUDY, n_prefill=n_old, n_decode=8 - n_old), LongTermSettings()),
                                ("optimum for new lengths", dataclasses.replace(CASE_STUDY, n_prefill=n_new, n_decode=8 - n_new), None)):
            rows.append({"run": name, "seed": seed, **shift_run(fleet, seed, rate, lt)})
    return {"rate_rps": rate, "old_split": n_old, "new_split": n_new, "planner_lambda_new_rps": lam_new,
            "planner_lambda_old_split_new_lengths_rps": lam_old_split, "rows": rows}


def study_scale(trace: Path) -> list[dict]:
    """Wall time of one hour of the trace vs fleet size, and vs request count (copies) at 512 GPUs."""
    rows = []
    for gpus, copies in ((64, 1), (128, 1), (256, 1), (512, 1), (512, 2), (512, 4)):
        instances = gpus // 8
        n_prfaas = instances // 4
        n_pd = instances - n_prfaas
        fleet = FleetSpec(n_prfaas, max(n_pd // 2, 1), n_pd - max(n_pd // 2, 1))
        requests = arrivals.trace(trace, copies)
        sim = Simulation(fleet)
        started = time.perf_counter()
        sim.run(requests, max(r.arrival_s for r in requests) + 600)
        wall = time.perf_counter() - started
        s = summarize(sim, 0, max(r.arrival_s for r in requests))
        rows.append({"gpus": gpus, "requests": len(requests), "wall_s": wall, "goodput_rps": s["goodput_rps"],
                     "offered_rps": s["offered_rps"], "offload": s["offload_fraction"]})
    return rows


BIAS_FLEET = FleetSpec(1, 1, 1, LINKS_GBPS["abundant"])  # the emulated capacity benchmark's hetero deployment


def bias_attainment(bias: float, calibration: CalibrationSettings, rate_rps: float, seed: int,
                    duration_s: float = 900.0, warmup_s: float = 120.0, noise_sigma: float = 0.2) -> float:
    """Share of the arrivals in [warm-up, duration) that meet both SLOs, with the nodes' prefill and decode
    ``bias`` x the router's model (per-request noise ``noise_sigma``) and both SLOs ``bias`` x (the same
    fleet, ``bias`` times slower: an unbiased router would lose nothing). Refusals and requests never
    finished are misses."""
    slo_s = TTFT_SLO_S["abundant"] * bias
    sim = Simulation(BIAS_FLEET, SimSettings(mode=BandwidthMode.ABUNDANT, max_ttft_s=slo_s, ttft_target_s=slo_s,
                                             calibration=calibration, noise_sigma=noise_sigma, seed=seed,
                                             prefill_bias=(("prfaas", bias), ("pd", bias)), decode_bias=bias))
    lengths = dict(arrivals.CASE_STUDY, max_tokens=MAX_INPUT_TOKENS)  # the emulated benchmark's prompt cap
    sim.run(arrivals.poisson(rate_rps, duration_s, seed, sim.runtime.output_tokens, ((0.0, lengths),)), duration_s + 600)
    window = [r for r in sim.requests if warmup_s <= r.arrival_s < duration_s]
    met = [r for r in window if meets_slo(r, slo_s, sim.runtime.slo_tokens_per_s / bias)]
    return len(met) / len(window) if window else 0.0


def study_bias(seeds: int, biases: tuple[float, ...] = (1.0, 1.4, 0.7), rounds: int = 7) -> list[dict]:
    """Capacity at 90% (pooled over ``seeds``) per bias: the router's calibration on, off, and given the true
    scale beforehand (``--prefill-scale``: the oracle). ``x bias`` is capacity x bias, comparable across biases."""
    rows = []
    lam = BIAS_FLEET.runtime().capacity_rps()
    for bias in biases:
        for name, cal in (("calibration on", CalibrationSettings()),
                          ("calibration off", CalibrationSettings(enabled=False)),
                          ("true scale given, calibration off",
                           CalibrationSettings(enabled=False, prior_scales=(("prfaas", bias), ("pd", bias))))):
            search = CapacitySearch(start=0.8 * lam / bias, resolution=0.05, floor=0.05 * lam / bias,
                                    ceiling=4 * lam / bias, targets=(0.9,))
            for _ in range(rounds):
                load = search.next_load()
                if load is None:
                    break
                search.record(load, statistics.fmean(bias_attainment(bias, cal, load, seed) for seed in range(seeds)))
            rows.append({"bias": bias, "router": name, "capacity_rps": search.capacity(0.9),
                         "capacity_x_bias": search.capacity(0.9) * bias, **search.describe()})
    return rows


def spread(values: list[float]) -> str:
    return f"{statistics.fmean(values):.3f} (min {min(values):.3f}, max {max(values):.3f})"


def run(study: str, seeds: int, trace: Path | None = None) -> dict:
    started = time.perf_counter()
    if study == "analytic":
        data = study_analytic(seeds)
    elif study == "paper":
        data = study_paper(seeds)
    elif study == "shift":
        data = study_shift(seeds)
    elif study == "emulator":
        from prfaas_sglang.bench import sim_vs_emulator

        data = sim_vs_emulator.run(seeds)
    elif study == "bias":
        data = study_bias(seeds)
    elif study == "fleet":
        from prfaas_sglang.bench import sim_fleet

        data = sim_fleet.study(seeds)
    else:
        data = study_scale(trace)
    return {"study": study, "seeds": seeds, "data": data, "wall_s": time.perf_counter() - started}


def _groups(rows: list[dict], key: str) -> dict[str, list[dict]]:
    """Rows by ``row[key]``, in first-seen order (one table line per group, its seeds inside)."""
    out: dict[str, list[dict]] = {}
    for row in rows:
        out.setdefault(row[key], []).append(row)
    return out


def render_markdown(result: dict) -> str:
    study, data = result["study"], result["data"]
    lines = []
    if study == "analytic":
        lines += ["| fleet | binding | Lambda_max (eq. 6) | with E[T(l)] | simulated | sim / eq. 6 | sim / E[T(l)] |",
                  "|---|---|---|---|---|---|---|"]
        for fleet, rows in _groups(data, "fleet").items():
            lines.append(f"| {fleet} | {rows[0]['binding']} | {rows[0]['lambda_max_rps']:.3f} | "
                         f"{spread([r['lambda_e_t_rps'] for r in rows])} | {spread([r['measured_rps'] for r in rows])} | "
                         f"{spread([r['ratio'] for r in rows])} | {spread([r['ratio_e_t'] for r in rows])} |")
    elif study == "paper":
        lines += ["Each system at its best split of those swept (planner's +-2):", "",
                  "| config | best split (per seed) | max rate at 90% SLO attainment (req/s) | TTFT p90 there (s) | "
                  "egress (Gbit/s) | offload |", "|---|---|---|---|---|---|"]
        groups = _groups(data["rows"], "config")
        for name, rows in groups.items():
            lines.append(f"| {name} | {', '.join(r['split'] for r in rows)} | {spread([r['max_rate_rps'] for r in rows])} | "
                         f"{spread([r['ttft_p90_s'] or 0 for r in rows])} | {spread([r['egress_gbps'] or 0 for r in rows])} | "
                         f"{spread([r['offload'] or 0 for r in rows])} |")
        by = {n: statistics.fmean(r["max_rate_rps"] for r in rows) for n, rows in groups.items()}
        lines.append(f"\nprfaas-pd / homogeneous {by['prfaas-pd'] / by['homogeneous']:.2f}x, prfaas-pd / naive "
                     f"{by['prfaas-pd'] / by['naive-heterogeneous']:.2f}x, naive / homogeneous "
                     f"{by['naive-heterogeneous'] / by['homogeneous']:.2f}x")
        lines += ["", "Every split swept (max rate, req/s; * the planner's split):", "",
                  "| config | split | max rate |", "|---|---|---|"]
        for (name, split), rows in _groups([dict(r, key=(r["config"], r["split"])) for r in data["sweep"]], "key").items():
            lines.append(f"| {name} | {split}{' *' if rows[0]['planner'] else ''} | {spread([r['max_rate_rps'] for r in rows])} |")
        lines += ["", f"All three at one common load, {data['common_rps']:.3f} req/s (the homogeneous system's best "
                      "rate), each at its best split:", "",
                  "| config | TTFT p50 (s) | TTFT p90 (s) | SLO attainment | egress (Gbit/s) |", "|---|---|---|---|---|"]
        common = _groups(data["common"], "config")
        for name, rows in common.items():
            lines.append(f"| {name} | {spread([r['ttft_p50_s'] for r in rows])} | {spread([r['ttft_p90_s'] for r in rows])} | "
                         f"{spread([r['slo_attainment'] for r in rows])} | {spread([r['egress_gbps'] for r in rows])} |")
        p90 = {n: statistics.fmean(r["ttft_p90_s"] for r in rows) for n, rows in common.items()}
        lines.append(f"\nTTFT p90 at the common load: prfaas-pd {1 - p90['prfaas-pd'] / p90['homogeneous']:.0%} lower "
                     "than homogeneous")
    elif study == "shift":
        lines += [f"arrivals {data['rate_rps']:.3f} req/s; planner Lambda_max for the new lengths: optimum "
                  f"{data['new_split']}P {data['planner_lambda_new_rps']:.3f}, old split {data['old_split']}P "
                  f"{data['planner_lambda_old_split_new_lengths_rps']:.3f}", "",
                  "| run | goodput, last 10 min (req/s) | TTFT p90 (s) | conversions | final split |", "|---|---|---|---|---|"]
        for name, rows in _groups(data["rows"], "run").items():
            lines.append(f"| {name} | {spread([r['goodput_rps'] for r in rows])} | {spread([r['ttft_p90_s'] or 0 for r in rows])} | "
                         f"{', '.join(str(r['conversions']) for r in rows)} | {', '.join(r['final_split'] for r in rows)} |")
        opt = {r["seed"]: r["goodput_rps"] for r in data["rows"] if r["run"] == "optimum for new lengths"}
        ratios = [r["goodput_rps"] / opt[r["seed"]] for r in data["rows"] if r["run"] == "long-term controller" and opt[r["seed"]]]
        if ratios:
            lines.append(f"\nlong-term / optimum, per seed: {', '.join(f'{x:.2f}' for x in ratios)}")
    elif study == "emulator":
        from prfaas_sglang.bench import sim_vs_emulator

        lines += sim_vs_emulator.render_markdown(data)
    elif study == "fleet":
        from prfaas_sglang.bench import sim_fleet

        lines += sim_fleet.render_markdown(data)
    elif study == "bias":
        unbiased = {r["router"]: r["capacity_x_bias"] for r in data if r["bias"] == 1.0}
        lines += ["| bias | router | capacity @90% (req/s) | x bias | / unbiased, same router | bracket |",
                  "|---|---|---|---|---|---|"]
        for r in data:
            lo, hi = r["brackets"]["0.9"]["lo"], r["brackets"]["0.9"]["hi"]
            base = unbiased.get(r["router"])
            rel = f"{r['capacity_x_bias'] / base:.2f}" if base else "n/a"
            lines.append(f"| {r['bias']:g} | {r['router']} | {r['capacity_rps']:.3f} | {r['capacity_x_bias']:.3f} | {rel} | "
                         f"[{lo or 0:.3f}, {hi or float('inf'):.3f}) |")
    else:
        lines += ["| GPUs | requests | wall (s) | offered (req/s) | goodput (req/s) | offload |", "|---|---|---|---|---|---|"]
        lines += [f"| {r['gpus']} | {r['requests']} | {r['wall_s']:.1f} | {r['offered_rps']:.2f} | {r['goodput_rps']:.2f} | "
                  f"{r['offload']:.2f} |" for r in data]
    lines.append(f"\n(wall {result['wall_s']:.0f} s)")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--study", required=True,
                        choices=("analytic", "emulator", "paper", "shift", "scale", "bias",
                                 "fleet"),
                        help="analytic: vs the analytic model; emulator: vs the emulated "
                             "deployment; paper: the case study; shift: a workload shift under "
                             "the long-term controller; scale: the simulator's cost on --trace; "
                             "bias: calibration against a biased truth; fleet: a fleet's global "
                             "scheduler vs per-region baselines")
    parser.add_argument("--seeds", type=int, default=3,
                        help="seeds 0..N-1 per setting (not used by scale)")
    parser.add_argument("--trace", type=Path, default=None, help="scale: a Mooncake-format trace (one hour)")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")


def cli(args: argparse.Namespace, inv: Invocation) -> int:
    if args.seeds < 1:
        inv.error("--seeds must be >= 1")
    if args.study == "scale" and (args.trace is None or not args.trace.is_file()):
        inv.error("--study scale needs --trace FILE (a Mooncake-format trace)")
    result = run(args.study, args.seeds, args.trace)
    return inv.report(args, result, None, render_markdown)


SUBCOMMANDS = {"sim": Subcommand(add_arguments, cli)}
