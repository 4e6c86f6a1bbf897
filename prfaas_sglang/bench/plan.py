"""Planner benchmark: search time, case study vs the paper, sensitivity to the calibrated MFUs."""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

from prfaas_sglang.bench.subcommands import Invocation, Subcommand
from prfaas_sglang.plan.analytic import AnalyticPrefill, analytic_decode
from prfaas_sglang.plan.profiles import InstanceClass
from prfaas_sglang.plan.report import make_plan
from prfaas_sglang.plan.scenario import Catalog, Scenario
from prfaas_sglang.plan.search import search


def time_search(scenario: Scenario, step_tokens: float, repeat: int) -> dict:
    """Wall time of the full 2-D search (``repeat`` runs; median, min, max)."""
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        result = search(scenario.deployment, scenario.workload, step_tokens)
        times.append(time.perf_counter() - start)
    points = len(result.thresholds) * len(result.n_prefill_options)
    return {
        "step_tokens": step_tokens,
        "thresholds": len(result.thresholds),
        "splits": len(result.n_prefill_options),
        "grid_points": points,
        "median_s": statistics.median(times),
        "min_s": min(times),
        "max_s": max(times),
        "repeat": repeat,
    }


def with_mfus(scenario: Scenario, catalog: Catalog, h200_mfu: float, h20_mfu: float) -> Scenario:
    """The case study with the two calibrated prefill MFUs replaced."""
    model = catalog.model("kimi-linear-1t-hybrid")
    prfaas_acc = dataclasses.replace(catalog.accelerator("h200x8", "a"), prefill_mfu=h200_mfu)
    pd_acc = dataclasses.replace(catalog.accelerator("h20x8", "a"), prefill_mfu=h20_mfu)
    dep = scenario.deployment
    decode = analytic_decode(model, pd_acc, scenario.workload.mean_tokens, dep.output_tokens, scenario.slo_tokens_per_s)
    new_dep = dataclasses.replace(dep, prfaas=InstanceClass(prfaas_acc.name, prfaas_acc.gpus, AnalyticPrefill(model, prfaas_acc)),
                                  pd=InstanceClass(pd_acc.name, pd_acc.gpus, AnalyticPrefill(model, pd_acc), decode))
    return dataclasses.replace(scenario, deployment=new_dep)


def sensitivity(scenario: Scenario, catalog: Catalog, h200: tuple[float, ...], h20: tuple[float, ...]) -> list[dict]:
    rows = []
    for a in h200:
        for b in h20:
            plan = make_plan(with_mfus(scenario, catalog, a, b))
            rows.append({
                "h200_prefill_mfu": a,
                "h20_prefill_mfu": b,
                "threshold_tokens": plan.best.threshold_tokens,
                "split": f"{plan.best.n_prefill}P/{plan.best.n_decode}D",
                "homogeneous_split": f"{plan.homogeneous.n_prefill}P/{plan.homogeneous.n_decode}D",
                "egress_gbps": plan.best.egress_gbps,
                "gain_vs_homogeneous": plan.gain_vs_homogeneous,
                "gain_vs_naive": plan.gain_vs_naive,
            })
    return rows


def run(repeat: int) -> dict:
    catalog = Catalog()
    scenario = catalog.scenario("case-study")
    return {
        "search_128": time_search(scenario, 128, repeat),
        "search_32": time_search(scenario, 32, max(3, repeat // 4)),
        "case_study": make_plan(scenario).to_json(),
        "sensitivity": sensitivity(scenario, catalog, (0.15, 0.20, 0.26), (0.40, 0.53, 0.65)),
    }


def render_markdown(result: dict) -> str:
    s128, s32 = result["search_128"], result["search_32"]
    lines = [
        "| grid | points | median | min | max | runs |",
        "|---|---|---|---|---|---|",
    ]
    for s in (s128, s32):
        lines.append(
            f"| {s['thresholds']} thresholds ({s['step_tokens']:g}-token step) x {s['splits']} splits | {s['grid_points']} | "
            f"{s['median_s'] * 1e3:.1f} ms | {s['min_s'] * 1e3:.1f} ms | {s['max_s'] * 1e3:.1f} ms | {s['repeat']} |"
        )
    lines += ["", "| H200 prefill MFU | H20 prefill MFU | t | split | homogeneous | egress Gbps | gain vs homogeneous | gain vs naive |",
              "|---|---|---|---|---|---|---|---|"]
    for r in result["sensitivity"]:
        lines.append(
            f"| {r['h200_prefill_mfu']:.2f} | {r['h20_prefill_mfu']:.2f} | {r['threshold_tokens'] / 1000:.1f}K | {r['split']} | "
            f"{r['homogeneous_split']} | {r['egress_gbps']:.1f} | {r['gain_vs_homogeneous']:.2f}x | {r['gain_vs_naive']:.2f}x |"
        )
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--repeat", type=int, default=20,
                        help="timed runs of the search at the 128-token step (32-token step: "
                             "a quarter of that, at least 3)")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")


def cli(args: argparse.Namespace, inv: Invocation) -> int:
    if args.repeat < 1:
        inv.error("--repeat must be >= 1")
    result = run(args.repeat)
    return inv.report(args, result, None, render_markdown)


SUBCOMMANDS = {"plan": Subcommand(add_arguments, cli)}
