"""``python -m prfaas_sglang.sim --scenario case-study|shift|trace [--json] [--plot DIR]``.

* ``case-study``: the paper's fleet (4 x 8xH200 PrfaaS, 8 x 8xH20 PD at the planner's split, 100
  Gbit/s), Poisson arrivals of its log-normal lengths at ``--load`` x the planner's Lambda_max.
* ``shift``: the same, the median input doubling at ``--shift-at-s``; the long-term controller on
  (``--fixed-split`` turns it off).
* ``trace``: a Mooncake-format trace (``--trace``; prefix reuse through the KV index), ``--copies``
  replicas of it at once.

Fleet size: ``--prfaas N --pd-prefill N --pd-decode N`` (instances of 8 GPUs); ``--link-gbps``;
``--link-drop AT_S:GBPS`` (repeatable) changes the link's capacity mid-run.

A fleet of several clusters: ``--topology FILE`` (e.g. ``launch/fleet-scale.yaml``: 3 PD regions, 2
PrfaaS sites, 1,024 GPUs); every cluster and link as the file says, arrivals entering per region by
``entry_share``, ``--load`` x the fleet's planned capacity as deployed (``runtime.planned_capacity_rps``:
the fleet model's linear program at each PD cluster's split, a PrfaaS cluster shared by several PD
clusters counted once); ``--link-drop AT_S:GBPS:PRFAAS->PD`` names the link; ``--scenario shift`` runs a
long-term controller per PD cluster, planning on all the cluster's pairs.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from prfaas_sglang.errors import ConfigError
from prfaas_sglang.router.longterm import LongTermSettings
from prfaas_sglang.runtime import planned_capacity_rps
from prfaas_sglang.sim import arrivals
from prfaas_sglang.sim.fleet import FleetSpec, SimSettings, Simulation
from prfaas_sglang.sim.summary import plot, summarize


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m prfaas_sglang.sim", description=__doc__.split("\n\n")[0])
    p.add_argument("--scenario", choices=("case-study", "shift", "trace"), default="case-study",
                   help="case-study: Poisson arrivals of the paper's lengths; shift: the same, the "
                        "median input doubling at --shift-at-s; trace: replay --trace")
    p.add_argument("--prfaas", type=int, default=4, help="PrfaaS prefill instances (8 GPUs each)")
    p.add_argument("--pd-prefill", type=int, default=None, help="default: the planner's split of --pd")
    p.add_argument("--pd", type=int, default=8, help="PD instances (split by the planner unless --pd-prefill)")
    p.add_argument("--link-gbps", type=float, default=100.0,
                   help="PrfaaS-to-PD link capacity, Gbit/s")
    p.add_argument("--link-drop", action="append", default=[], metavar="AT_S:GBPS",
                   help="at AT_S seconds set the link to GBPS Gbit/s (repeatable; with --topology "
                        "AT_S:GBPS:PRFAAS->PD names the link)")
    p.add_argument("--load", type=float, default=0.8, help="arrival rate as a fraction of the planner's Lambda_max")
    p.add_argument("--rate", type=float, default=None, help="arrival rate (req/s), instead of --load")
    p.add_argument("--duration-s", type=float, default=1800.0,
                   help="arrivals for this long, simulated seconds (not with trace)")
    p.add_argument("--warmup-s", type=float, default=600.0, help="excluded from the summary")
    p.add_argument("--shift-at-s", type=float, default=600.0,
                   help="shift: when the median input doubles, simulated seconds")
    p.add_argument("--fixed-split", action="store_true", help="no long-term controller")
    p.add_argument("--trace", type=Path, default=None,
                   help="trace: the Mooncake-format trace file to replay")
    p.add_argument("--copies", type=int, default=1,
                   help="trace: replay this many copies at once, each with its own block ids")
    p.add_argument("--seed", type=int, default=0, help="random seed for arrivals and lengths")
    p.add_argument("--topology", type=Path, default=None, help="a fleet of several clusters (case-study or trace "
                   "arrivals; the fleet-size flags do not apply)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--plot", type=Path, default=None, metavar="DIR",
                   help="write time-series PNGs (thresholds, egress, utilisation) into DIR")
    return p.parse_args(argv)


def _schedule(args: argparse.Namespace) -> list[tuple]:
    schedule = []
    for item in args.link_drop:
        parts = item.split(":", 2)
        try:
            at_s, gbps = float(parts[0]), float(parts[1])
        except (ValueError, IndexError):
            raise ConfigError("--link-drop", f"expected AT_S:GBPS[:PRFAAS->PD], got {item!r}") from None
        schedule.append((at_s, gbps, *parts[2:]))
    return schedule


def build_topology(args: argparse.Namespace) -> tuple[Simulation, list, float]:
    """``--topology``: the fleet of the file, arrivals entering per ``entry_share``."""
    import yaml

    from prfaas_sglang.topology import parse_topology

    try:
        doc = yaml.safe_load(args.topology.read_text())
    except (OSError, yaml.YAMLError) as err:
        raise ConfigError("--topology", f"cannot read {args.topology}: {err}") from None
    topology = parse_topology(doc, str(args.topology), args.topology.parent)
    longterm = LongTermSettings() if args.scenario == "shift" and not args.fixed_split else None  # one per PD cluster
    try:
        sim = Simulation(doc, SimSettings(longterm=longterm, link_schedule=tuple(_schedule(args))))
    except ValueError as err:
        raise ConfigError("--link-drop", str(err)) from None
    shares = {name: c.entry_share for name, c in topology.clusters.items() if c.kind == "pd" and c.entry_share}
    if args.scenario == "trace":
        if args.trace is None:
            raise ConfigError("--trace", "the trace scenario needs a Mooncake-format trace file")
        requests = arrivals.entering(arrivals.trace(args.trace, args.copies), shares, args.seed)
        return sim, requests, max(r.arrival_s for r in requests)
    rate = args.rate if args.rate is not None else args.load * planned_capacity_rps(sim.topology)
    phases = arrivals.median_shift_phases(args.shift_at_s) if args.scenario == "shift" else ((0.0, arrivals.CASE_STUDY),)
    requests = list(arrivals.poisson(rate, args.duration_s, args.seed, sim.targets.output_tokens, phases))
    return sim, arrivals.entering(requests, shares, args.seed), args.duration_s


def build(args: argparse.Namespace) -> tuple[Simulation, list, float]:
    """The simulation, its arrivals and the measured window's end."""
    if args.topology is not None:
        return build_topology(args)
    n_prefill = args.pd_prefill
    if n_prefill is None:
        n_prefill = FleetSpec(args.prfaas, 1, args.pd - 1, args.link_gbps).planner_split().n_prefill
    if not 1 <= n_prefill < args.pd:
        raise ConfigError("--pd-prefill", f"must be in 1..{args.pd - 1}, got {n_prefill}")
    fleet = FleetSpec(args.prfaas, n_prefill, args.pd - n_prefill, args.link_gbps)
    schedule = _schedule(args)
    if any(len(change) > 2 for change in schedule):
        raise ConfigError("--link-drop", "a one-pair fleet has one link: AT_S:GBPS")
    longterm = LongTermSettings() if args.scenario == "shift" and not args.fixed_split else None
    try:
        sim = Simulation(fleet, SimSettings(longterm=longterm, link_schedule=tuple(schedule)))
    except ValueError as err:  # a link change on a fleet without a PrfaaS cluster
        raise ConfigError("--link-drop", str(err)) from None
    if args.scenario == "trace":
        if args.trace is None:
            raise ConfigError("--trace", "the trace scenario needs a Mooncake-format trace file")
        requests = arrivals.trace(args.trace, args.copies)
        return sim, requests, max(r.arrival_s for r in requests)
    rate = args.rate if args.rate is not None else args.load * sim.runtime.capacity_rps()
    phases = arrivals.median_shift_phases(args.shift_at_s) if args.scenario == "shift" else ((0.0, arrivals.CASE_STUDY),)
    return sim, list(arrivals.poisson(rate, args.duration_s, args.seed, sim.runtime.output_tokens, phases)), args.duration_s


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        sim, requests, end_s = build(args)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    started = time.perf_counter()
    sim.run(requests, end_s + 600.0)  # room for the last arrivals to finish
    wall_s = time.perf_counter() - started
    warmup = min(args.warmup_s, end_s / 2)
    summary = summarize(sim, warmup, end_s)
    links = sim.series[-1]["links"] if sim.series else {}
    thresholds = {str(pair): ps.controller.threshold_tokens for router in sim.routers.values() for pair, ps in router.pairs.items()}
    fleet = ({"prfaas": sim.fleet.n_prfaas, "pd_prefill": sim.fleet.n_prefill, "pd_decode": sim.fleet.n_decode,
              "link_gbps": sim.fleet.link_gbps} if sim.fleet is not None else {"topology": str(args.topology), "links": links})
    summary.update({"scenario": args.scenario, "gpus": sim.gpus, "requests": len(requests),
                    "wall_s": round(wall_s, 2), "fleet": fleet,
                    "planner_lambda_max_rps": planned_capacity_rps(sim.topology),
                    "final_thresholds": thresholds,  # each link's t at the end
                    **({"final_threshold_tokens": next(iter(thresholds.values()))} if len(thresholds) == 1 else {}),
                    "events": [[round(t, 1), what] for t, what in sim.events]})
    if args.plot is not None:
        summary["plots"] = [str(p) for p in plot(sim, args.plot)]
    if args.json:
        print(json.dumps(summary, indent=1, default=str))
    else:
        print(f"{args.scenario}: {sim.gpus} GPUs, {len(requests)} requests, simulated in {wall_s:.1f} s")
        print(f"  goodput {summary['goodput_rps']:.3f} req/s of {summary['offered_rps']:.3f} offered "
              f"(SLO attainment {summary['slo_attainment']:.1%}); TTFT p50/p90 {summary['ttft_s']['p50']}/{summary['ttft_s']['p90']} s; "
              f"TBT p50/p90 {summary['tbt_ms']['p50']}/{summary['tbt_ms']['p90']} ms")
        print(f"  offload {summary['offload_fraction']:.1%}, egress {summary['egress_gbps_mean']:.1f} Gbit/s, "
              f"busy {', '.join(f'{k} {v:.0%}' for k, v in summary['utilisation'].items() if v is not None)}")
        for t, what in sim.events:
            print(f"  {t:8.0f} s  {what}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
