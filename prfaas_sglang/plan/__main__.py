"""``python -m prfaas_sglang.plan``: threshold and PD split for a PrfaaS-PD deployment, or for a fleet.

Examples::

    python -m prfaas_sglang.plan --scenario case-study              # the paper's section 4
    python -m prfaas_sglang.plan --scenario case-study --json
    python -m prfaas_sglang.plan --scenario case-study --threshold 19400 --json
    python -m prfaas_sglang.plan --scenario case-study --egress-gbps 5 --plot out/plan
    python -m prfaas_sglang.plan --model qwen3.5-397b-a17b --prfaas h200x8:4 --pd h20x8:8 \\
        --egress-gbps 100 --workload trace:../shared/data/mooncake_conversation_trace.jsonl \\
        --output-tokens 343 --slo 40
    python -m prfaas_sglang.plan --anchors                           # Table 3 check
    python -m prfaas_sglang.plan --topology launch/multi-cluster.yaml   # a fleet: per cluster, per link
    python -m prfaas_sglang.plan --topology launch/multi-cluster.yaml --entry pd-east=0.5,pd-west=0.5

Flags override the matching field of ``--scenario`` (a shipped name or a YAML
file; see prfaas_sglang/plan/scenario.py). Bad input exits 2 naming the field.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from pathlib import Path

import yaml

from prfaas_sglang.errors import ConfigError, PrfaasError
from prfaas_sglang.plan.anchors import ANCHORS, check_anchor
from prfaas_sglang.plan.fleet_model import Fleet
from prfaas_sglang.plan.report import make_fleet_plan, make_plan, render_fleet, render_table
from prfaas_sglang.plan.scenario import Catalog, parse_scenario

PROGRESS_MIN_THRESHOLDS = 4096


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m prfaas_sglang.plan",
        description="Search the routing threshold t and the PD prefill/decode split (PrfaaS paper, section 3.4).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("Examples::", 1)[1].split("Flags override", 1)[0],
    )
    parser.add_argument("--scenario", help="shipped scenario name (e.g. case-study) or a scenario YAML file")
    parser.add_argument("--topology", type=Path, help="plan a deployment's topology: any number of PrfaaS and PD "
                        "clusters, per cluster and per link (e.g. launch/multi-cluster.yaml)")
    parser.add_argument("--link-gbps", action="append", default=[], metavar="PRFAAS:PD=GBPS",
                        help="with --topology: what if this link had this capacity (repeatable)")
    parser.add_argument("--entry", metavar="PD=SHARE,...|global",
                        help="with --topology: what if arrivals entered in these shares (or through one global entry)")
    parser.add_argument("--model", help="shipped model name, or a model YAML file")
    parser.add_argument("--prfaas", metavar="ACCEL:N", help="PrfaaS class and instance count, e.g. h200x8:4")
    parser.add_argument("--pd", metavar="ACCEL:N", help="PD class and instance count, e.g. h20x8:8")
    parser.add_argument("--egress-gbps", type=float, help="PrfaaS egress capacity B_out")
    parser.add_argument("--workload", help="lognormal:MU,SIGMA,MIN,MAX | trace:PATH[:lru=BLOCKS] | lengths:FILE")
    parser.add_argument("--output-tokens", type=float, help="L_out")
    parser.add_argument("--slo", type=float, help="decode SLO, tokens/s per request")
    parser.add_argument("--threshold-step", type=float, help="threshold grid step, tokens (default 128)")
    parser.add_argument("--homogeneous-instances", type=int, help="size of the homogeneous baseline (default: same GPUs)")
    parser.add_argument("--threshold", type=float, help="evaluate this threshold instead of searching")
    parser.add_argument("--ttft-slo-s", type=float, metavar="S",
                        help="also the capacity at this TTFT SLO (90%% of arrivals within S s; plan/slo_capacity.py) of the "
                             "plan and of the threshold and split best for it, beside Lambda_max")
    parser.add_argument("--layerwise", action="store_true",
                        help="with --ttft-slo-s: the PrfaaS workers stream KV by layer (a topology's links[].layerwise), "
                             "so a long prompt's transfer overlaps its prefill (plan/overlap.py)")
    parser.add_argument("--prefill-scale", action="append", default=[], metavar="CLUSTER=X[+OFFSET_S]",
                        help="the model's prefill seconds in CLUSTER (prfaas or pd) take X times as long, plus OFFSET_S "
                             "a request: what the router learned of the engines (its /status calibration, prefill_scale "
                             "and prefill_offset_s), to plan the deployment as it runs (repeatable)")
    parser.add_argument("--decode-growth", type=float, default=0.0, metavar="SHARE",
                        help="with --ttft-slo-s: a decode step takes 1 + SHARE x batch times the profile's (what a real "
                             "engine adds per running sequence beyond the roofline; the measured H200 profile shows "
                             "about 0.01 at 1K context). Default 0")
    parser.add_argument("--no-early-rejection", action="store_true",
                        help="with --ttft-slo-s: plan for a router that queues every request (the router's own flag); by "
                             "default a request that would miss the SLO, on idle servers or behind the queue it finds, is "
                             "refused on arrival, as our router's early rejection does, and adds no work")
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout")
    parser.add_argument("--plot", type=Path, metavar="DIR", help="write split_search.png and threshold_search.png")
    parser.add_argument("--progress", action="store_true", help="show a progress bar (automatic for large grids)")
    parser.add_argument("--anchors", action="store_true", help="compare shipped profiles with the paper's Table 3 anchors")
    parser.add_argument("--list", action="store_true", help="list shipped models, accelerators and scenarios")
    return parser


def _class_flag(value: str, flag: str) -> dict:
    accel, sep, count = value.rpartition(":")
    if not sep or not accel:
        raise ConfigError(flag, f"expected ACCEL:N (e.g. h200x8:4), got {value!r}")
    try:
        instances = int(count)
    except ValueError:
        raise ConfigError(flag, f"instance count must be an integer, got {count!r}") from None
    return {"accelerator": accel, "instances": instances}


def _workload_flag(value: str) -> dict:
    kind, _, rest = value.partition(":")
    if kind == "lognormal":
        try:
            numbers = [float(x) for x in rest.split(",")]
        except ValueError:
            raise ConfigError("--workload", f"lognormal needs MU,SIGMA,MIN,MAX numbers, got {rest!r}") from None
        if len(numbers) != 4:
            raise ConfigError("--workload", "lognormal needs MU,SIGMA,MIN,MAX")
        mu, sigma, lo, hi = numbers
        return {"kind": "lognormal", "mu": mu, "sigma": sigma, "min_tokens": lo, "max_tokens": hi}
    if kind == "trace":
        path, _, cache = rest.partition(":lru=")
        spec: dict = {"kind": "trace", "path": path, "cache": {"kind": "unbounded"}}
        if cache:
            try:
                spec["cache"] = {"kind": "lru", "capacity_blocks": int(cache)}
            except ValueError:
                raise ConfigError("--workload", f"lru=BLOCKS must be an integer, got {cache!r}") from None
        return spec
    if kind == "lengths":
        try:
            lengths = [float(x) for x in Path(rest).read_text().split()]
        except OSError as err:
            raise ConfigError("--workload", f"cannot read {rest}: {err.strerror}") from None
        except ValueError:
            raise ConfigError("--workload", f"{rest} must hold whitespace-separated numbers") from None
        return {"kind": "lengths", "lengths": lengths}
    raise ConfigError("--workload", f"unknown workload kind {kind!r} (lognormal, trace, lengths)")


def scenario_from_args(args: argparse.Namespace, catalog: Catalog):
    overrides_given = any(v is not None for v in (args.model, args.prfaas, args.pd, args.egress_gbps, args.workload))
    raw: dict = {}
    base_dir = Path.cwd()
    if args.scenario or not overrides_given:
        path = catalog._path("scenarios", args.scenario or "case-study", "--scenario")
        base_dir = path.parent
        raw = yaml.safe_load(path.read_text()) or {}
        if not isinstance(raw, dict):
            raise ConfigError("--scenario", f"{path} is not a mapping")
    else:
        raw = {"name": "cli"}
    if args.model:
        raw["model"] = args.model
    if args.prfaas:
        raw["prfaas"] = _class_flag(args.prfaas, "--prfaas")
    if args.pd:
        raw["pd"] = _class_flag(args.pd, "--pd")
    if args.egress_gbps is not None:
        raw["link"] = {"egress_gbps": args.egress_gbps}
    if args.workload:
        raw["workload"] = _workload_flag(args.workload)
        base_dir = Path.cwd()
    if args.output_tokens is not None:
        raw["output_tokens"] = args.output_tokens
    if args.slo is not None:
        raw["slo_tokens_per_s"] = args.slo
    if args.threshold_step is not None:
        raw["search"] = {"threshold_step_tokens": args.threshold_step}
    if args.homogeneous_instances is not None:
        raw["baselines"] = {"homogeneous_instances": args.homogeneous_instances}
    if (overrides_given or args.prefill_scale) and raw.get("paper"):
        raw["paper"] = {}  # the paper's figures describe the unmodified scenario only
    scenario = parse_scenario(raw, Catalog(catalog.data_dir, base_dir))
    return dataclasses.replace(scenario, deployment=with_prefill_scales(scenario.deployment, args.prefill_scale))


def with_prefill_scales(dep, given: list[str]):
    """``dep`` with each ``CLUSTER=X[+OFFSET_S]`` of ``--prefill-scale`` applied to that cluster's prefill profile
    (:class:`~prfaas_sglang.plan.profiles.ScaledPrefill`: seconds times X, plus OFFSET_S; the KV is unchanged).
    ConfigError for an unknown cluster, a cluster given twice, or a scale or offset that is not a number > 0 (>= 0)."""
    from prfaas_sglang.plan.profiles import ScaledPrefill, parse_scale_item

    seen: set[str] = set()
    for item in given:
        try:
            cluster, scale, offset_s = parse_scale_item(item, offset=True)
        except ValueError:
            cluster, scale, offset_s = "", math.nan, math.nan
        if cluster not in ("prfaas", "pd") or cluster in seen or not scale > 0 or not offset_s >= 0 or math.isinf(scale + offset_s):
            raise ConfigError("--prefill-scale", f"expected CLUSTER=X[+OFFSET_S] with CLUSTER prfaas or pd (once each), "
                                                 f"X > 0 and OFFSET_S >= 0 seconds, got {item!r}")
        seen.add(cluster)
        cls = getattr(dep, cluster)  # the Deployment's fields are named as the clusters are
        dep = dataclasses.replace(dep, **{cluster: dataclasses.replace(cls, prefill=ScaledPrefill(cls.prefill, scale, offset_s=offset_s))})
    return dep


def _progress_bar(done: int, total: int) -> None:
    width = 30
    filled = width * done // total
    sys.stderr.write(f"\rsearching [{'#' * filled}{'.' * (width - filled)}] {done}/{total} thresholds")
    if done == total:
        sys.stderr.write("\n")
    sys.stderr.flush()


def print_anchors(catalog: Catalog, as_json: bool) -> int:
    accel = catalog.accelerator("h200x8", "accelerator")
    rows = []
    for anchor in ANCHORS:
        check = check_anchor(anchor, catalog.model(anchor.model), accel)
        rows.append({
            "model": anchor.model,
            "note": anchor.note,
            "phi_kv_32k_gbps": check.phi_kv_gbps,
            "paper_phi_kv_32k_gbps": anchor.paper_phi_kv_gbps,
            "phi_ratio": check.phi_ratio,
            "egress_512_gpus_tbps": check.egress_512_tbps,
            "paper_egress_512_gpus_tbps": anchor.paper_egress_512_tbps,
            "egress_ratio": check.egress_ratio,
            "implied_prefill_mfu": check.implied_prefill_mfu,
        })
    if as_json:
        print(json.dumps({"accelerator": accel.name, "prefill_mfu": accel.prefill_mfu, "anchors": rows}, indent=2))
        return 0
    print(f"KV throughput at 32K on {accel.name} (prefill_mfu {accel.prefill_mfu:g}) vs the paper")
    print(f"{'model':<20} {'Phi_kv Gbps':>12} {'paper':>7} {'ratio':>6} {'512-GPU Tbps':>13} {'paper':>6} {'ratio':>6} {'MFU that matches':>17}")
    for r in rows:
        def f(v, spec):
            return "-" if v is None else format(v, spec)
        print(f"{r['model']:<20} {r['phi_kv_32k_gbps']:>12.2f} {f(r['paper_phi_kv_32k_gbps'], '.2f'):>7} {f(r['phi_ratio'], '.2f'):>6} "
              f"{r['egress_512_gpus_tbps']:>13.3f} {f(r['paper_egress_512_gpus_tbps'], '.3f'):>6} {f(r['egress_ratio'], '.2f'):>6} "
              f"{f(r['implied_prefill_mfu'], '.2f'):>17}")
    return 0


def what_if(fleet: Fleet, links: list[str], entry: str | None) -> Fleet:
    """The fleet with ``--link-gbps`` and ``--entry`` applied; a bad one raises ConfigError naming it."""
    known = {(link.prfaas, link.pd): link for link in fleet.links}
    for item in links:
        pair, _, gbps = item.partition("=")
        key = tuple(pair.split(":", 1))
        if key not in known:
            raise ConfigError("--link-gbps", f"{item!r}: no link {pair} (links: {', '.join(f'{a}:{b}' for a, b in known)})")
        try:
            known[key] = dataclasses.replace(known[key], bps=float(gbps) * 1e9)
        except ValueError:
            raise ConfigError("--link-gbps", f"{item!r}: expected PRFAAS:PD=GBPS") from None
    fleet = dataclasses.replace(fleet, links=tuple(known.values()))
    if entry is None:
        return fleet
    shares: dict[str, float | None] = {s.name: None for s in fleet.pd}
    if entry != "global":
        for item in entry.split(","):
            name, _, share = item.partition("=")
            if name not in shares:
                raise ConfigError("--entry", f"{item!r}: no pd cluster {name!r} (pd clusters: {', '.join(shares)})")
            try:
                shares[name] = float(share)
            except ValueError:
                raise ConfigError("--entry", f"{item!r}: expected PD=SHARE") from None
    return dataclasses.replace(fleet, pd=tuple(dataclasses.replace(s, entry_share=shares[s.name]) for s in fleet.pd))


def print_fleet_plan(args: argparse.Namespace) -> int:
    """``--topology``: the fleet's joint plan (``--threshold-step`` applies; the other flags describe a scenario)."""
    from prfaas_sglang.runtime import fleet_from_topology
    from prfaas_sglang.topology import load_topology

    given = [flag for flag, value in (("--scenario", args.scenario), ("--model", args.model), ("--prfaas", args.prfaas),
                                      ("--pd", args.pd), ("--egress-gbps", args.egress_gbps), ("--workload", args.workload),
                                      ("--threshold", args.threshold), ("--plot", args.plot)) if value is not None]
    if given:
        raise ConfigError("--topology", f"plans the topology as it is; drop {', '.join(given)}")
    unsupported = [flag for flag, value in (("--ttft-slo-s", args.ttft_slo_s), ("--layerwise", args.layerwise or None),
                                            ("--prefill-scale", args.prefill_scale or None)) if value is not None]
    if unsupported:  # capacity at the SLO is a one-pair scenario's (plan/slo_capacity.py); a fleet has none yet
        raise ConfigError(unsupported[0], "not available with --topology yet; capacity at the SLO is planned for a "
                                          "--scenario (one PrfaaS and one PD cluster)")
    shipped, workload, step = fleet_from_topology(load_topology(args.topology))
    fleet = what_if(shipped, args.link_gbps, args.entry)
    plan = make_fleet_plan(fleet, workload, args.threshold_step or step, shipped if fleet != shipped else None)
    print(json.dumps(plan.to_json(), indent=2) if args.json else render_fleet(plan))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    catalog = Catalog()
    try:
        if args.list:
            for kind in ("scenarios", "models", "accelerators"):
                print(f"{kind}: {', '.join(catalog.names(kind))}")
            return 0
        if args.anchors:
            return print_anchors(catalog, args.json)
        if args.topology is not None:
            return print_fleet_plan(args)
        if args.link_gbps or args.entry:
            raise ConfigError("--link-gbps" if args.link_gbps else "--entry", "changes a --topology; give one")
        if args.threshold is not None and not args.threshold > 0:
            raise ConfigError("--threshold", f"must be > 0, got {args.threshold!r}")
        scenario = scenario_from_args(args, catalog)
        grid = scenario.workload.max_tokens / scenario.step_tokens
        show = args.threshold is None and (args.progress or (grid >= PROGRESS_MIN_THRESHOLDS and sys.stderr.isatty()))
        plan = make_plan(scenario, args.threshold, _progress_bar if show else None)
        if args.plot:
            if plan.search is None:
                raise ConfigError("--plot", "needs a search (drop --threshold)")
            from prfaas_sglang.plan.plots import write_plots

            paths = write_plots(plan, args.plot)
            if not args.json:
                print("wrote " + ", ".join(str(p) for p in paths))
        for flag, given in (("--layerwise", args.layerwise), ("--decode-growth", args.decode_growth),
                            ("--no-early-rejection", args.no_early_rejection)):
            if given and args.ttft_slo_s is None:
                raise ConfigError(flag, "applies with --ttft-slo-s only (Lambda_max does not depend on it)")
        slo = (slo_report(plan, args.ttft_slo_s, args.layerwise, args.decode_growth, not args.no_early_rejection)
               if args.ttft_slo_s is not None else None)
    except PrfaasError as err:
        print(f"error: {err}", file=sys.stderr)
        return err.exit_code
    if args.json:
        print(json.dumps({**plan.to_json(), **({"slo": slo} if slo else {})}, indent=2))
        return 0
    print(render_table(plan))
    if slo:
        at, best = slo["at_plan"], slo["best_for_slo"]
        streamed = ("; KV streamed by layer" if slo["layerwise"] else "") + \
            ("; early rejection of what would miss, idle or queued" if slo["early_rejection"] else "")
        print(f"\ncapacity at the TTFT SLO ({slo['ttft_slo_s']:g} s, {slo['target']:.0%} of arrivals; a queueing "
              f"approximation per stage{streamed}):\n  the plan ({at['threshold_tokens'] / 1000:.1f}K, {at['n_prefill']}P/"
              f"{at['n_decode']}D): {at['capacity_rps']:.3f} req/s of Lambda_max {at['lambda_max_rps']:.3f}\n"
              f"  best for the SLO ({best['threshold_tokens'] / 1000:.1f}K, {best['n_prefill']}P/{best['n_decode']}D): "
              f"{best['capacity_rps']:.3f} req/s (its Lambda_max {best['lambda_max_rps']:.3f})")
        for name, point in (("the plan", at), ("best for the SLO", best)):
            print(f"  decode at {name}'s capacity: {point['tbt_met']:.1%} meet the TBT SLO ({slo['tbt_slo_s'] * 1e3:g} ms "
                  f"a token; step growth {slo['decode_growth_per_seq']:g} per sequence), {point['decode_mean_batch']:.1f} "
                  "running per decode instance")
    return 0


SLO_THRESHOLDS = 24  # thresholds the SLO search tries: quantiles of the workload's lengths, and the plan's


def slo_report(plan, ttft_slo_s: float, layerwise: bool = False, decode_growth_per_seq: float = 0.0,
               early_rejection: bool = True) -> dict:
    """Capacity at ``ttft_slo_s`` and the scenario's TBT SLO of the plan's point, and the (threshold, split) best
    for it (``layerwise``: the KV streams while the prefill runs; ``decode_growth_per_seq``: a decode step's rise
    per running sequence beyond the profile; ``early_rejection``: what would miss, on idle servers or behind the queue, is refused)."""
    import random

    from prfaas_sglang.plan.slo_capacity import TARGET, SloModel

    if not ttft_slo_s > 0:
        raise ConfigError("--ttft-slo-s", f"must be > 0, got {ttft_slo_s!r}")
    if not decode_growth_per_seq >= 0:
        raise ConfigError("--decode-growth", f"must be >= 0, got {decode_growth_per_seq!r}")
    tbt_slo_s = 1.0 / plan.scenario.slo_tokens_per_s
    model = SloModel(plan.scenario.deployment, plan.scenario.workload, ttft_slo_s, random.Random(0), layerwise=layerwise,
                     tbt_slo_s=tbt_slo_s, decode_growth_per_seq=decode_growth_per_seq, early_rejection=early_rejection)
    best = plan.best
    at_plan = model.capacity(best.threshold_tokens, best.n_prefill, best.n_decode)
    ordered = sorted(model.lengths)
    thresholds = sorted({best.threshold_tokens, *(ordered[(k * len(ordered)) // SLO_THRESHOLDS]
                                                  for k in range(1, SLO_THRESHOLDS))})
    return {"ttft_slo_s": ttft_slo_s, "tbt_slo_s": tbt_slo_s, "decode_growth_per_seq": decode_growth_per_seq,
            "early_rejection": early_rejection,
            "target": TARGET, "layerwise": layerwise, "at_plan": at_plan.to_json(),
            "best_for_slo": model.best(thresholds).to_json()}


if __name__ == "__main__":
    sys.exit(main())
