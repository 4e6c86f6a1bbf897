"""The global scheduler against the per-region baselines, in the simulator (``bench sim --study fleet``).

The fleet is ``launch/multi-cluster.yaml`` (2 PrfaaS clusters, 2 PD regions, a link per pair, users
entering 70/30). Three systems, the same nodes, the same router code, the same arrivals:

    global       one router over every pair (the product): a region's long prompt goes to whichever
                 PrfaaS cluster, over whichever of its links, serves it first
    regional     a router per region over that region's pairs only, the PrfaaS clusters shared: each
                 sees its own work on a PrfaaS worker, not the other region's
    partition    each PrfaaS cluster's instances split among the regions (the best static split for
                 the planned 70/30, ``plan.fleet_model.best_partition``), a router per region over its
                 own slice: nothing shared, nothing balanced

Conditions: as planned; the load moved (50/50 entering, the partition kept as planned); a link
dropping 4x for 60 s (the busiest, prfaas-h200 -> pd-east). Per system and condition the capacity
at 90% SLO attainment over all arrivals (TTFT <= the SLO and 40 tok/s; a refusal is a miss), by
bisection on the arrival rate, pooled over seeds. Every router runs the product's defaults (early
rejection and placement at the TTFT SLO).
"""

from __future__ import annotations

import copy
import statistics
from pathlib import Path

import yaml

from prfaas_sglang.bench.slo import CapacitySearch
from prfaas_sglang.plan.fleet_model import best_partition
from prfaas_sglang.runtime import fleet_from_topology
from prfaas_sglang.sim import arrivals
from prfaas_sglang.sim.fleet import SimSettings, Simulation
from prfaas_sglang.sim.summary import meets_slo
from prfaas_sglang.topology import parse_topology

FLEET_FILE = Path(__file__).resolve().parents[2] / "launch" / "multi-cluster.yaml"
TTFT_SLO_S = 10.0
SYSTEMS = ("global", "regional", "partition")
CONDITIONS = {"as planned": {"shares": None, "drop": ()},
              "load moved to 50/50": {"shares": {"pd-east": 0.5, "pd-west": 0.5}, "drop": ()},
              "link h200->east 4x down for 60 s": {"shares": None, "drop": ((300.0, "prfaas-h200->pd-east", 4.0, 60.0),)}}


def partitioned(doc: dict, instances: dict[str, dict[str, int]]) -> dict:
    """``doc`` with each PrfaaS cluster split into one cluster per PD cluster it serves
    (``{prfaas}@{pd}``: the first ``instances[prfaas][pd]`` of its remaining nodes, linked to that PD
    cluster only, at the link's capacity): a router per region then sees its own slice alone."""
    out = copy.deepcopy(doc)
    links = {(link["from"], link["to"]): link for link in doc["links"]}
    new_links = []
    for name, cluster in doc["clusters"].items():
        if cluster["kind"] != "prfaas":
            continue
        del out["clusters"][name]
        nodes = list(cluster["nodes"])
        for pd, count in instances.get(name, {}).items():
            if count <= 0:
                continue
            slice_, nodes = nodes[:count], nodes[count:]
            out["clusters"][f"{name}@{pd}"] = {**{k: v for k, v in cluster.items() if k != "nodes"}, "nodes": slice_}
            link = links.get((name, pd)) or links[(pd, name)]
            new_links.append({**link, "from": f"{name}@{pd}", "to": pd})
    out["links"] = new_links + [link for link in doc["links"]
                                if doc["clusters"][link["from"]]["kind"] != "prfaas"
                                and doc["clusters"][link["to"]]["kind"] != "prfaas"]
    return out


def attainment(doc: dict, system: str, shares: dict[str, float], drop: tuple, rate_rps: float, seed: int,
               duration_s: float, warmup_s: float) -> float:
    """Share of the arrivals in [warm-up, duration) meeting both SLOs."""
    schedule = []
    for at_s, link, factor, for_s in drop:
        name = link
        if system == "partition":  # the dropped link is the slice's own
            prfaas, pd = link.split("->")
            name = f"{prfaas}@{pd}->{pd}"
        gbps = _link_gbps(doc, name)
        schedule += [(at_s, gbps / factor, name), (at_s + for_s, gbps, name)]
    sim = Simulation(doc, SimSettings(max_ttft_s=TTFT_SLO_S, ttft_target_s=TTFT_SLO_S, seed=seed, link_schedule=tuple(schedule),
                                      routers="global" if system == "global" else "regional"))
    requests = arrivals.entering(list(arrivals.poisson(rate_rps, duration_s, seed, sim.targets.output_tokens)), shares, seed)
    sim.run(requests, duration_s + 600)
    window = [r for r in sim.requests if warmup_s <= r.arrival_s < duration_s]
    return sum(meets_slo(r, TTFT_SLO_S, sim.targets.slo_tokens_per_s) for r in window) / len(window) if window else 0.0


def _link_gbps(doc: dict, name: str) -> float:
    prfaas, pd = name.split("->")
    link = next(link for link in doc["links"] if {link["from"], link["to"]} == {prfaas, pd})
    return link["bandwidth_gbps"]


def study(seeds: int, rounds: int = 6, duration_s: float = 900.0, warmup_s: float = 120.0,
          fleet_file: Path = FLEET_FILE, conditions: tuple[str, ...] = tuple(CONDITIONS)) -> dict:
    """Capacity at 90% per (condition, system), bisected from the joint plan's capacity."""
    doc = yaml.safe_load(fleet_file.read_text())
    topology = parse_topology(doc, str(fleet_file), fleet_file.parent)
    fleet, workload, step = fleet_from_topology(topology)
    split = best_partition(fleet, workload, step)
    planned_shares = {name: c.entry_share for name, c in topology.clusters.items() if c.kind == "pd" and c.entry_share}
    docs = {"global": doc, "regional": doc, "partition": partitioned(doc, split.instances)}
    rows = []
    for condition in conditions:
        spec = CONDITIONS[condition]
        shares = spec["shares"] or planned_shares
        for system in SYSTEMS:
            search = CapacitySearch(start=0.8 * split.capacity_rps, resolution=0.05, floor=0.05 * split.capacity_rps,
                                    ceiling=4 * split.capacity_rps, targets=(0.9,))
            per_seed: dict[int, dict[float, float]] = {}
            for _ in range(rounds):
                load = search.next_load()
                if load is None:
                    break
                seeds_att = [attainment(docs[system], system, shares, spec["drop"], load, seed, duration_s, warmup_s)
                             for seed in range(seeds)]
                for seed, a in enumerate(seeds_att):
                    per_seed.setdefault(seed, {})[load] = a
                search.record(load, statistics.fmean(seeds_att))
            rows.append({"condition": condition, "system": system, "capacity_rps": search.capacity(0.9),
                         "per_seed_attainment": {str(k): v for k, v in per_seed.items()}, **search.describe()})
    return {"fleet": str(fleet_file), "partition": split.instances, "partition_planned_rps": split.capacity_rps,
            "ttft_slo_s": TTFT_SLO_S, "duration_s": duration_s, "warmup_s": warmup_s, "rows": rows}


def render_markdown(data: dict) -> list[str]:
    lines = [f"Fleet {data['fleet']}; the partition (planned for the file's entry shares): "
             + "; ".join(f"{p}: " + ", ".join(f"{n} to {pd}" for pd, n in split.items()) for p, split in data["partition"].items())
             + f" ({data['partition_planned_rps']:.3f} req/s planned). TTFT SLO {data['ttft_slo_s']:g} s, 40 tok/s; "
             f"{data['duration_s']:g} s runs, the first {data['warmup_s']:g} s not scored.", "",
             "| condition | system | capacity @90% (req/s) | bracket | / global |", "|---|---|---|---|---|"]
    by = {(r["condition"], r["system"]): r for r in data["rows"]}
    for r in data["rows"]:
        lo, hi = r["brackets"]["0.9"]["lo"], r["brackets"]["0.9"]["hi"]
        ours = by[(r["condition"], "global")]["capacity_rps"]
        rel = f"{r['capacity_rps'] / ours:.2f}" if ours else "n/a"
        lines.append(f"| {r['condition']} | {r['system']} | {r['capacity_rps']:.3f} | [{lo or 0:.3f}, "
                     f"{hi or float('inf'):.3f}) | {rel} |")
    return lines
