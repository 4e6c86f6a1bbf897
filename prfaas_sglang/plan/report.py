"""A plan: the optimum, the baselines, the gains, and the paper's figures beside ours (pure)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from prfaas_sglang.plan.fleet_model import (
    Fleet,
    FleetPoint,
    Partition,
    best_partition,
    partition_with,
    search_fleet,
)
from prfaas_sglang.plan.model import OperatingPoint
from prfaas_sglang.plan.scenario import Scenario
from prfaas_sglang.plan.search import (
    SearchResult,
    best_split_at,
    homogeneous_baseline,
    naive_baseline,
    search,
)
from prfaas_sglang.plan.workload import Workload


@dataclass(frozen=True)
class Plan:
    scenario: Scenario
    best: OperatingPoint
    homogeneous: OperatingPoint
    naive: OperatingPoint
    search: SearchResult | None  # None when the threshold was fixed

    @property
    def gain_vs_homogeneous(self) -> float:
        return _ratio(self.best.lambda_max_rps, self.homogeneous.lambda_max_rps)

    @property
    def gain_vs_naive(self) -> float:
        return _ratio(self.best.lambda_max_rps, self.naive.lambda_max_rps)

    def to_json(self) -> dict:
        b, dep = self.best, self.scenario.deployment
        return {
            "scenario": self.scenario.name,
            "model": self.scenario.model_name,
            "threshold_tokens": b.threshold_tokens,
            "threshold_searched": self.search is not None,
            "n_prefill": b.n_prefill,
            "n_decode": b.n_decode,
            "n_prfaas": dep.n_prfaas,
            "offload_fraction": b.offload_fraction,
            "mean_long_tokens": b.mean_long_tokens,
            "mean_short_tokens": b.mean_short_tokens,
            "mean_tokens": self.scenario.workload.mean_tokens,
            "lambda_max_rps": b.lambda_max_rps,
            "binding_stage": b.binding_stage,
            "egress_gbps": b.egress_gbps,
            "egress_utilization": b.egress_utilization,
            "link_gbps": dep.egress_bps / 1e9,
            "theta_prfaas_rps": b.theta_prfaas_rps,
            "theta_pd_prefill_rps": b.theta_pd_prefill_rps,
            "theta_pd_decode_rps": b.theta_pd_decode_rps,
            "homogeneous": _point_json(self.homogeneous) | {"instances": self.homogeneous.n_prefill + self.homogeneous.n_decode},
            "naive": _point_json(self.naive),
            "gain_vs_homogeneous": self.gain_vs_homogeneous,
            "gain_vs_naive": self.gain_vs_naive,
            "naive_vs_homogeneous": _ratio(self.naive.lambda_max_rps, self.homogeneous.lambda_max_rps),
            "decode_bs_max": dep.pd.decode.bs_max,
            "paper": self.scenario.paper,
        }


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else math.inf


def _point_json(point: OperatingPoint) -> dict:
    keep = ("n_prefill", "n_decode", "lambda_max_rps", "binding_stage", "egress_gbps")
    return {k: v for k, v in asdict(point).items() if k in keep}


def make_plan(scenario: Scenario, threshold_tokens: float | None = None, progress=None) -> Plan:
    """Search (or evaluate ``threshold_tokens``) and compute both baselines."""
    dep, workload = scenario.deployment, scenario.workload
    result = None
    if threshold_tokens is None:
        result = search(dep, workload, scenario.step_tokens, progress)
        best = result.best
    else:
        best = best_split_at(dep, workload.split(threshold_tokens))
    homogeneous = homogeneous_baseline(dep.pd, scenario.homogeneous_instances, workload, dep.output_tokens, dep.egress_bps)
    return Plan(scenario, best, homogeneous, naive_baseline(dep, workload), result)


def _k(tokens: float | None) -> str:
    return "-" if tokens is None else f"{tokens / 1000:.1f}K"


def render_table(plan: Plan) -> str:
    """The human report: ours, and the paper's figure where the scenario records one."""
    j, paper = plan.to_json(), plan.scenario.paper
    rows = [
        ("threshold t", _k(j["threshold_tokens"]) + ("" if j["threshold_searched"] else " (fixed)"), _k(paper.get("threshold_tokens"))),
        ("PD split", f"{j['n_prefill']}P/{j['n_decode']}D", _split(paper, "n_prefill", "n_decode")),
        ("offload fraction p", f"{j['offload_fraction']:.3f}", _fmt(paper.get("offload_fraction"), ".3f")),
        ("E[L | L > t]", _k(j["mean_long_tokens"]), _k(paper.get("mean_long_tokens"))),
        ("E[L | L <= t]", _k(j["mean_short_tokens"]), "-"),
        ("E[L]", _k(j["mean_tokens"]), _k(paper.get("mean_tokens"))),
        ("Lambda_max (req/s)", f"{j['lambda_max_rps']:.3f}", "-"),
        ("binding stage", j["binding_stage"], "-"),
        ("PrfaaS egress", f"{j['egress_gbps']:.1f} Gbps of {j['link_gbps']:g} ({100 * j['egress_utilization']:.0f}%)", _fmt(paper.get("egress_gbps"), ".0f", " Gbps")),
        ("homogeneous", f"{j['homogeneous']['n_prefill']}P/{j['homogeneous']['n_decode']}D, {j['homogeneous']['lambda_max_rps']:.3f} req/s",
         _split(paper, "homogeneous_n_prefill", "homogeneous_n_decode")),
        ("naive heterogeneous", f"{j['naive']['lambda_max_rps']:.3f} req/s ({j['naive']['binding_stage']})", "-"),
        ("gain vs homogeneous", f"{j['gain_vs_homogeneous']:.2f}x", _fmt(paper.get("gain_vs_homogeneous"), ".2f", "x")),
        ("gain vs naive", f"{j['gain_vs_naive']:.2f}x", _fmt(paper.get("gain_vs_naive"), ".2f", "x")),
        ("naive vs homogeneous", f"{j['naive_vs_homogeneous']:.2f}x", _fmt(paper.get("naive_vs_homogeneous"), ".2f", "x")),
    ]
    width = max(len(r[0]) for r in rows)
    ours_w = max(len(r[1]) for r in rows)
    header = f"scenario {j['scenario']} (model {j['model']}, {j['n_prfaas']} PrfaaS + {j['n_prefill'] + j['n_decode']} PD instances)"
    lines = [header, f"{'':<{width}}  {'ours':<{ours_w}}  paper"]
    lines += [f"{a:<{width}}  {b:<{ours_w}}  {c}" for a, b, c in rows]
    return "\n".join(lines)


def _fmt(value, spec: str, suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def _split(paper: dict, p_key: str, d_key: str) -> str:
    return f"{paper[p_key]}P/{paper[d_key]}D" if p_key in paper and d_key in paper else "-"


# --- a fleet: several PrfaaS and PD clusters (plan/fleet_model.py) -------------------------------------


@dataclass(frozen=True)
class FleetPlan:
    """The joint plan of a fleet, and the per-region partition beside it."""

    fleet: Fleet
    best: FleetPoint
    partition: Partition  # the best per-region partition
    planned_partition: Partition | None = None  # a what-if: the split planned for the fleet as it was, kept

    @property
    def partition_rps(self) -> float:
        return self.partition.capacity_rps

    def to_json(self) -> dict:
        b = self.best
        return {
            "entry": "regional" if self.fleet.regional else "global",
            "lambda_max_rps": b.lambda_max_rps,
            "binding": list(b.binding),
            "egress_gbps": b.egress_gbps,
            "pd": [{"cluster": s.name, "instances": s.instances, "class": s.instance.name,
                    "entry_share": s.entry_share, "threshold_tokens": b.choices[s.name].threshold_tokens,
                    "n_prefill": b.choices[s.name].n_prefill, "n_decode": s.instances - b.choices[s.name].n_prefill,
                    "offload_fraction": b.splits[s.name].offload_fraction, "decode_rps": b.decode_rps[s.name]}
                   for s in self.fleet.pd],
            "prfaas": [{"cluster": s.name, "instances": s.instances, "class": s.instance.name,
                        "utilization": b.prfaas_utilization[s.name]} for s in self.fleet.prfaas],
            "links": [{"prfaas": link.prfaas, "pd": link.pd, "gbps": link.bps / 1e9,
                       "rps": b.link_rps[(link.prfaas, link.pd)],
                       "utilization": b.link_utilization[(link.prfaas, link.pd)]} for link in self.fleet.links],
            "partition": {"lambda_max_rps": self.partition_rps,
                          "regions": {name: {"prfaas": {s.name: s.instances for s in self.partition.fleets[name].prfaas},
                                             "lambda_max_rps": p.lambda_max_rps,
                                             "threshold_tokens": p.choices[name].threshold_tokens,
                                             "n_prefill": p.choices[name].n_prefill}
                                      for name, p in self.partition.regions.items()}},
            "gain_vs_partition": _ratio(b.lambda_max_rps, self.partition_rps),
        } | ({} if self.planned_partition is None else {
            "planned_partition": {"lambda_max_rps": self.planned_partition.capacity_rps,
                                  "instances": self.planned_partition.instances},
            "gain_vs_planned_partition": _ratio(b.lambda_max_rps, self.planned_partition.capacity_rps)})


def make_fleet_plan(fleet: Fleet, workload: Workload, step_tokens: float, planned_for: Fleet | None = None) -> FleetPlan:
    """The joint search, and the best per-region partition beside it. ``planned_for``: the fleet as it
    was (before a what-if); its best partition's split is also evaluated here, kept as planned."""
    partition = best_partition(fleet, workload, step_tokens)
    planned = None
    if planned_for is not None:
        planned = partition_with(fleet, workload, best_partition(planned_for, workload, step_tokens).instances, step_tokens)
    return FleetPlan(fleet, search_fleet(fleet, workload, step_tokens, alone=partition.regions), partition, planned)


def render_fleet(plan: FleetPlan) -> str:
    """The fleet's plan per PD cluster, per PrfaaS cluster and per link."""
    j = plan.to_json()
    lines = [f"fleet: {len(j['prfaas'])} PrfaaS + {len(j['pd'])} PD clusters, {j['entry']} entry; "
             f"Lambda_max {j['lambda_max_rps']:.3f} req/s (binding: {', '.join(j['binding']) or '-'})",
             "", f"{'pd cluster':<16} {'class':<8} {'split':>6} {'t':>7} {'offload':>8} {'entry':>6} {'decodes req/s':>14}"]
    for r in j["pd"]:
        entry = "-" if r["entry_share"] is None else f"{r['entry_share']:.2f}"
        lines.append(f"{r['cluster']:<16} {r['class']:<8} {r['n_prefill']}P/{r['n_decode']}D".ljust(32)
                     + f" {_k(r['threshold_tokens']):>7} {r['offload_fraction']:>8.3f} {entry:>6} {r['decode_rps']:>14.3f}")
    lines += ["", f"{'prfaas cluster':<16} {'class':<8} {'instances':>9} {'busy':>6}"]
    lines += [f"{r['cluster']:<16} {r['class']:<8} {r['instances']:>9} {100 * r['utilization']:>5.0f}%" for r in j["prfaas"]]
    lines += ["", f"{'link':<30} {'Gbps':>6} {'req/s':>7} {'used':>6}"]
    lines += [f"{r['prfaas'] + ' -> ' + r['pd']:<30} {r['gbps']:>6g} {r['rps']:>7.3f} {100 * r['utilization']:>5.0f}%" for r in j["links"]]
    part = j["partition"]
    lines += ["", f"per-region partition (the PrfaaS instances split among regions, the best static split): "
              f"{part['lambda_max_rps']:.3f} req/s; joint / partition = {j['gain_vs_partition']:.2f}x"]
    lines += [f"  {name}: {', '.join(f'{n}x{k}' for k, n in r['prfaas'].items()) or 'no PrfaaS'}, {r['lambda_max_rps']:.3f} req/s "
              f"(t {_k(r['threshold_tokens'])}, {r['n_prefill']}P)" for name, r in part["regions"].items()]
    if "planned_partition" in j:
        lines.append(f"the split planned before the what-if, kept (each region re-plans alone): "
                     f"{j['planned_partition']['lambda_max_rps']:.3f} req/s; joint / it = {j['gain_vs_planned_partition']:.2f}x")
    return "\n".join(lines)
