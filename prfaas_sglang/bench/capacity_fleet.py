"""Capacity at an SLO of a fleet's global scheduler against the per-region baselines, emulated
(``bench compare --capacity --topology FILE``; issue #45).

One deployment (``demo/fleet.py``: a namespace per PrfaaS cluster, a shaped link per PrfaaS -> PD
pair, emulated engines with their own service-time truth), three ways to route it, each a fresh
set of router processes per run:

    global     one router over every pair (the product), the request's region in ``x-prfaas-entry``
    regional   a router per PD cluster over that cluster's pairs only: the PrfaaS workers are shared,
               and each router knows only its own work on them (uncoordinated regions)
    partition  a router per PD cluster over its own slice of each PrfaaS cluster (the best static
               split for the planned entry shares, ``plan.fleet_model.best_partition``): nothing shared

Conditions: the planned entry shares; the load moved (``--entry PD=SHARE,...``, the partition kept
as planned); a link 4x down for one emulated minute (``--link-drop PRFAAS->PD``). Everything else is
``bench/capacity.py``'s: the same arrivals per seed (each arrival's region drawn per seed and index,
so every row and load sees the same prompts entering at the same regions), bisection on offered
load pooled over seeds, attainment over all arrivals with a refusal a miss.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import random
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from prfaas_sglang.bench import capacity
from prfaas_sglang.bench.capacity import (
    CapacitySetting,
    Stream,
    engine_timing,
    outcome,
    replay_scored,
    schedule,
)
from prfaas_sglang.bench.capacity_rows import Row
from prfaas_sglang.bench.sim_fleet import partitioned
from prfaas_sglang.bench.sim_vs_emulator import fleet_docs
from prfaas_sglang.demo import workloads
from prfaas_sglang.demo.client import completion_text
from prfaas_sglang.demo.cluster import ProcessGroup, start_deployment, start_router
from prfaas_sglang.demo.fleet import FleetNet, fleet_sites, links_mbit, local_fleet
from prfaas_sglang.errors import ConfigError
from prfaas_sglang.plan.fleet_model import best_partition, search_fleet
from prfaas_sglang.runtime import fleet_from_topology
from prfaas_sglang.tokenizer import SHIPPED, PromptTokenizer
from prfaas_sglang.topology import parse_topology

ROWS = (Row("global", "ours", "fleet", "prfaas", why="one router over every pair (the product's global scheduler)"),
        Row("regional", "regional", "fleet", "prfaas", why="a router per region over its own pairs, PrfaaS shared"),
        Row("partition", "partition", "fleet", "prfaas", why="a router per region over its static slice of PrfaaS"))


@dataclass
class FleetCondition:
    """Which fleet, how requests enter, what goes wrong. ``shares``: the entry shares arrivals follow
    (None: the file's, which the partition is planned for); ``drop``: a link ``prfaas->pd`` whose rate
    falls 4x for ``drop_s`` emulated seconds from the first scored arrival."""

    fleet_file: Path
    nodes_per_role: int | None = None
    shares: dict[str, float] | None = None
    drop: str | None = None

    def label(self) -> str:
        parts = [self.fleet_file.stem]
        if self.shares:
            parts.append("entry " + "/".join(f"{v:g}" for v in self.shares.values()))
        if self.drop:
            parts.append(f"{self.drop} 4x down")
        return "/".join(parts)


@dataclass
class FleetUp:
    """The fleet deployment while it is up: its namespaces, engines and the topologies of each row's routers."""

    net: FleetNet
    group: ProcessGroup
    deployment: object
    docs: dict[str, list[tuple[str | None, dict]]] = field(default_factory=dict)  # row -> [(entry, router topology)]
    decode: frozenset[str] = frozenset()  # the decode engines' names


def region(doc: dict, pd: str) -> dict:
    """``doc`` with PD cluster ``pd``, the PrfaaS clusters linked to it and the control plane only (a region
    the partition gives no PrfaaS instance prefills everything itself)."""
    kinds = {name: c["kind"] for name, c in doc["clusters"].items()}
    keep = {pd} | {end for link in doc["links"] if pd in (link["from"], link["to"])
                   for end in (link["from"], link["to"]) if kinds.get(end) == "prfaas"}
    keep |= {name for name, kind in kinds.items() if kind == "control"}
    out = copy.deepcopy(doc)
    out["clusters"] = {n: c for n, c in out["clusters"].items() if n in keep}
    out["links"] = [link for link in out["links"] if {link["from"], link["to"]} <= keep]
    for c in out["clusters"].values():
        c.pop("entry_share", None)
    return out


class FleetRunner:
    """``capacity.bisect``'s runner over one fleet deployment: a run starts a row's routers afresh on an
    idle, flushed deployment, replays one seed's arrivals to the router of each arrival's region."""

    def __init__(self, setting: CapacitySetting, condition: FleetCondition, log_dir: Path, log=print):
        self.setting, self.condition, self.log_dir, self.log = setting, condition, log_dir, log
        raw = yaml.safe_load(condition.fleet_file.read_text())
        self.model_doc = fleet_docs(raw, setting.output_tokens, condition.nodes_per_role or 10**6)
        topology = parse_topology(self.model_doc, str(condition.fleet_file), condition.fleet_file.parent)
        self.planned_shares = {n: c.entry_share for n, c in topology.clusters.items() if c.kind == "pd" and c.entry_share}
        self.shares = condition.shares or self.planned_shares
        pds = {p.pd for p in topology.pairs()}
        if unknown := sorted(set(self.shares) - pds):
            raise ConfigError("--entry", f"no PD cluster {', '.join(unknown)} (PD clusters: {', '.join(sorted(pds))})")
        if condition.drop is not None and tuple(condition.drop.split("->")) not in links_mbit(self.model_doc, 1, 1):
            raise ConfigError("--drop-link", f"no link {condition.drop!r} (links: "
                                             + ", ".join(f"{p}->{d}" for p, d in links_mbit(self.model_doc, 1, 1)) + ")")
        fleet, workload, step = fleet_from_topology(topology)
        self.plan = search_fleet(fleet, workload, step)
        self.partition = best_partition(fleet, workload, step)
        self.text = workloads.TextSource(PromptTokenizer.load(SHIPPED))
        self.streams: dict[int, Stream] = {}
        self.fleet = self  # what capacity.bisect calls keep_only on
        self.up: FleetUp | None = None

    def keep_only(self, deployments: set[str]) -> None:  # one deployment serves every row
        pass

    def start(self) -> FleetUp:
        s = self.setting
        prfaas, pd = fleet_sites(self.model_doc)
        net = FleetNet(pd, prfaas, links_mbit(self.model_doc, s.speedup, s.kv_scale)).__enter__()
        group = ProcessGroup(self.log_dir / "fleet")
        try:  # anything that fails from here on takes the processes and the namespaces down with it
            local = local_fleet(self.model_doc, net, speedup=s.speedup, kv_scale=s.kv_scale, nodes_per_role=None,
                                scheduler={"workload": capacity.prior(s), "output_tokens": s.output_tokens,
                                           "ttft_slo_s": s.ttft_slo},
                                model={"tokenizer": SHIPPED, "served_name": capacity.SERVED_NAME})
            wrap = {n["name"]: net.nets[site].wrap for site in prfaas for n in local["clusters"][site]["nodes"]}
            engines = [n["name"] for c in local["clusters"].values() for n in c["nodes"] if n["role"] not in ("router", "kv-index")]
            deployment = start_deployment(group, local, wrap=wrap, engine_args={name: (
                "--context-tokens", str(2 * capacity.MAX_INPUT_TOKENS + s.output_tokens), "--prefill-bias",
                f"{s.prefill_bias:g}", "--decode-bias", f"{s.decode_bias:g}", "--noise-sigma", f"{s.noise_sigma:g}",
                "--noise-seed", str(i)) for i, name in enumerate(engines)})
            split = partitioned(local, self.partition.instances)
            decode = frozenset(n["name"] for c in local["clusters"].values() for n in c["nodes"] if n["role"] == "pd-decode")
            self.up = FleetUp(net, group, deployment, {
                "global": [(None, local)],
                "regional": [(p, region(local, p)) for p in pd],
                "partition": [(p, region(split, p)) for p in pd]}, decode)
            self._warm_up(local, pd)
        except BaseException:
            self.up = None
            group.stop()
            net.__exit__(None, None, None)
            raise
        return self.up

    def _warm_up(self, local: dict, pd: list[str]) -> None:
        """Before the first scored run: a long and a short prompt entering at each region, through a router
        of their own, so every link's and every worker's first transfer (connections, lanes, buffers) is
        behind the deployment, not inside one row's first probe."""
        group = ProcessGroup(self.log_dir / "warm-up")
        try:
            url = start_router(group, local, "--no-early-rejection", name="warm-up").url
            prompts = [self.text.text(random.Random(n), n) for n in (40_000, 2_000)]
            arrivals = [completion_text(0.2 * i, prompt, 4, capacity.SERVED_NAME)
                        for i, prompt in enumerate(p for p in prompts for _ in pd)]
            arrivals = [dataclasses.replace(a, headers={"x-prfaas-entry": pd[i % len(pd)]}) for i, a in enumerate(arrivals)]
            results = asyncio.run(replay_scored(url, arrivals, range(len(arrivals)), 60.0, 60.0))
            if not all(r.ok for r in results):
                self.log(f"warm-up: {sum(not r.ok for r in results)} of {len(results)} failed: "
                         f"{sorted({r.error for r in results if r.error})[:3]}")
        finally:
            group.stop(grace_s=1.0)

    def close(self) -> None:
        if self.up is not None:
            self.up.group.stop()
            self.up.net.__exit__(None, None, None)
            self.up = None

    def stream(self, seed: int) -> Stream:
        if seed not in self.streams:
            self.streams[seed] = Stream(self.setting, seed, self.text)
        return self.streams[seed]

    def entries(self, seed: int, count: int) -> list[str]:
        """Each arrival's region, the same for every row and load of a seed."""
        rng = random.Random(seed * 7919 + 13)
        names, weights = list(self.shares), list(self.shares.values())
        return [rng.choices(names, weights)[0] for _ in range(count)]

    def run(self, row: Row, lam: float, seed: int, scored: int) -> dict:
        s, up = self.setting, self.up or self.start()
        workers = up.deployment.workers.values()
        arrivals, scored_range = schedule(self.stream(seed), s, lam, scored)
        entries = self.entries(seed, len(arrivals))
        arrivals = [dataclasses.replace(a, headers={"x-prfaas-entry": e}) for a, e in zip(arrivals, entries, strict=True)]
        clean = capacity.wait_idle(up)
        capacity.flush(up)
        capacity.restart_slow_periods(up, seed)
        group = ProcessGroup(self.log_dir / "routers")
        try:
            urls = {entry: start_router(group, doc, name=f"{row.name}-{entry or 'all'}").url for entry, doc in up.docs[row.name]}
            timing_before = [engine_timing(w.url) for w in workers]
            drop_at = arrivals[scored_range.start].offset_s if self.condition.drop and len(scored_range) else None
            with _LinkDrop(up.net, self.condition.drop, self.model_doc, s, drop_at):
                results = asyncio.run(replay_scored(lambda a: urls.get(a.headers["x-prfaas-entry"], urls.get(None)),
                                                    arrivals, scored_range, s.give_up_slos * s.ttft_slo / s.speedup,
                                                    s.output_tokens * s.tbt_slo * 4 / s.speedup))
            timing = [(w.name in up.decode,) + tuple(a - b for a, b in zip(engine_timing(w.url), tb, strict=True))
                      for w, tb in zip(workers, timing_before, strict=True)]
        finally:
            group.stop(grace_s=1.0)
        ok = [r for r in results if r.ok]
        return {"row": row.name, "load": lam, "seed": seed, "outcomes": [outcome(r, s.speedup) for r in results],
                "clean_start": clean, "window_s": len(scored_range) / lam,
                "offload_fraction": sum(r.route.startswith("prfaas/") for r in ok) / len(ok) if ok else 0.0,
                "calibration": None, "routed": None,
                "engine_timing_s": {stage: [sum(t[i] for t in timing if t[0] == decode) for i in (1, 2)]
                                    for stage, decode in (("prefill", False), ("decode", True))}}


class _LinkDrop:
    """The condition's link 4x down from ``at_s`` (wall, from now) for the setting's ``drop_s``, in a thread."""

    def __init__(self, net: FleetNet, link: str | None, doc: dict, setting: CapacitySetting, at_s: float | None):
        import threading

        self.net, self.link, self.at_s = net, link, at_s
        self.for_s = setting.drop_s / setting.speedup
        self.rate = links_mbit(doc, setting.speedup, setting.kv_scale).get(tuple(link.split("->"))) if link else None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        prfaas, pd = self.link.split("->")
        if self._stop.wait(self.at_s):
            return
        self.net.set_rate(prfaas, pd, self.rate / 4)
        self._stop.wait(self.for_s)
        self.net.set_rate(prfaas, pd, self.rate)

    def __enter__(self):
        if self.link is not None and self.at_s is not None:
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        if self.link is not None:
            prfaas, pd = self.link.split("->")
            self.net.set_rate(prfaas, pd, self.rate)


def run(setting: CapacitySetting, condition: FleetCondition, rows: tuple[str, ...] = tuple(r.name for r in ROWS),
        log=print, partial: Path | None = None, start_x_planned: float = 0.6) -> dict:
    """The bisection of every row on one deployment; the result document (``bench/capacity.py``'s shape)."""
    log_dir = Path(tempfile.mkdtemp(prefix="prfaas-capacity-fleet-"))
    runner = FleetRunner(setting, condition, log_dir, log)
    planned = runner.plan.lambda_max_rps
    started = time.monotonic()
    chosen = [r for r in ROWS if r.name in rows]
    head = {"condition": condition.label(), "setting": dataclasses.asdict(setting), "ttft_slo_s": setting.ttft_slo,
            "tbt_slo_s": setting.tbt_slo, "planned_capacity_rps": planned, "deployment": "fleet",
            "entry_shares": runner.shares, "partition": runner.partition.instances,
            "partition_planned_rps": runner.partition.capacity_rps, "sweep": {}, "best_config": {},
            "logs": str(log_dir)}

    def checkpoint(done: dict) -> None:
        if partial is not None:
            import json

            partial.write_text(json.dumps({**head, "rows": done, "partial": True, "wall_s": time.monotonic() - started}, indent=1))

    try:
        result = capacity.bisect(runner, setting, planned, chosen, log, random.Random(0),
                                 {r.name: start_x_planned for r in chosen}, checkpoint)
    finally:
        runner.close()
    ours = result["global"]["capacity_rps"]["0.9"] if "global" in result else None
    ratios = {name: (ours / row["capacity_rps"]["0.9"] if ours and row["capacity_rps"]["0.9"] else None)
              for name, row in result.items() if name != "global"}
    return {**head, "rows": result, "global_over": ratios, "wall_s": time.monotonic() - started}
