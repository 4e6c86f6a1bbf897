"""Goodput of the PrfaaS router against every baseline, on identical arrivals, per seed, over a shaped link.

Deployments (emulated engines, every node started through the launcher; the
paper's case study in miniature: 32 H200 + 64 H20 GPUs vs 96 H20 is 1 PrfaaS
instance of 8xH200 + 2 PD instances of 8xH20 vs 3 PD instances)::

    hetero        PrfaaS (8xH200, in a netns) + PD-P + PD-D (8xH20)   rows: prfaas, sglang-router,
                                                                         sglang-router-prfaas-prefill, smg
    naive         PrfaaS (8xH200, in a netns) + 2 PD-D                row:  naive (every prefill remote)
    homogeneous   3 x 8xH20 at the planner's best P/D split            row:  homogeneous

Rows: ``prfaas`` is our router with the runtime model's ``t`` and its
controllers, in the product's default configuration (early rejection on);
``prfaas-no-early-rejection`` is the same router admitting everything (an
ablation: what routing alone gives, apart from admission); ``sglang-router`` is sglang-router 0.3.2 in PD mode, prefill
pool PrfaaS + PD-P, ``cache_aware``; ``sglang-router-prfaas-prefill`` gives it
the PrfaaS worker as its only prefill (the obvious configuration of a
length-blind router: the fast worker does every prefill, PD-P idles);
``smg`` is smg 1.13 like ``sglang-router``; ``naive`` and ``homogeneous`` are
the paper's baselines, routed by sglang-router (``cache_aware`` prefill,
``power_of_two`` decode where there are two decode workers).

The link. The PrfaaS worker's egress crosses a veth whose ``tbf`` rate is the
modelled capacity on the wire: ``capacity x kv_scale x speedup`` (KV bytes are
``kv_scale`` of the real ones, emulated time runs ``speedup`` times faster),
shared by every concurrent transfer. ``abundant`` is the paper's 100 Gbps for
four PrfaaS instances, 25 Gbps per instance; ``scarce`` is 2 Gbps, below what
all-PrfaaS offload needs at its own capacity (about 4.6 Gbps per instance).
The link utilisation is read from the veth's byte counter, not from the
engines' reports.

Load. Arrivals are Poisson at ``load x Lambda_max`` of the hetero deployment
under our router's baseline ``t`` (equation 6, the runtime model), so 1.0 is
its planned capacity; a trace keeps its own inter-arrival times divided by
``load``. A request counts toward goodput when its TTFT and its mean time
between tokens meet the SLOs (emulated time: wall x speedup); failures and
rejections count as misses. ``goodput_ratio_vs_best`` is our median goodput
over the best other row's median.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
import statistics
import tempfile
import threading
import time
from pathlib import Path

from prfaas_sglang import runtime
from prfaas_sglang.adapters import http_sync
from prfaas_sglang.bench.subcommands import Invocation
from prfaas_sglang.bench.zygote import Zygotes
from prfaas_sglang.demo import workloads
from prfaas_sglang.demo.client import replay
from prfaas_sglang.demo.cluster import (
    CONTROL_REQUEST_TIMEOUT_S,
    ProcessGroup,
    local_topology,
    scrape_metric,
    start_deployment,
    start_peer_router,
    start_router,
)
from prfaas_sglang.demo.netns import TBF_BURST_BYTES, Netns
from prfaas_sglang.plan.search import homogeneous_baseline
from prfaas_sglang.stats import percentile
from prfaas_sglang.tokenizer import SHIPPED, PromptTokenizer
from prfaas_sglang.topology import parse_topology

SERVED_NAME = "prfaas-compare"
MAX_INPUT_TOKENS = 65_536
LINKS_GBPS = {"abundant": 25.0, "scarce": 2.0}  # modelled capacity per PrfaaS instance
ROWS = ("prfaas", "prfaas-no-early-rejection", "sglang-router", "sglang-router-prfaas-prefill", "smg", "naive",
        "homogeneous")
OURS = ("prfaas", "prfaas-no-early-rejection")  # the ablation is ours too: not a baseline for the ratio vs best
DEPLOYMENT_OF = {"prfaas": "hetero", "prfaas-no-early-rejection": "hetero", "sglang-router": "hetero",
                 "sglang-router-prfaas-prefill": "hetero", "smg": "hetero", "naive": "naive", "homogeneous": "homogeneous"}
ACCELERATORS = ("h200x8", "h20x8")


@dataclasses.dataclass(frozen=True)
class Setting:
    workload: str = "case-study"
    link: str = "abundant"
    load: float = 0.8
    duration_s: float = 30.0
    speedup: float = 2.0
    kv_scale: float = 0.01
    output_tokens: int = 64
    ttft_slo_s: float = 5.0
    tbt_tokens_per_s: float = 40.0
    tokenizer: str | None = SHIPPED

    @property
    def link_gbps(self) -> float:
        return LINKS_GBPS[self.link]

    @property
    def wire_mbit(self) -> float:
        """The tbf rate: the modelled capacity as bits on the wire per wall second."""
        return self.link_gbps * 1e3 * self.kv_scale * self.speedup


def topology(setting: Setting, kind: str, net: Netns | None = None) -> dict:
    """The topology document of one deployment (``hetero``, ``naive`` or ``homogeneous``)."""
    common = dict(speedup=setting.speedup, kv_scale=setting.kv_scale, output_tokens=setting.output_tokens,
                  workload=workloads.prior(setting.workload, MAX_INPUT_TOKENS), tokenizer=setting.tokenizer,
                  served_name=SERVED_NAME, accelerators=ACCELERATORS, link_gbps=setting.wire_mbit / 1e3,
                  ttft_slo_s=setting.ttft_slo_s)
    if net is not None:
        common.update(hosts={"prfaas": net.inner_ip}, host=net.outer_ip)
    if kind == "hetero":
        return local_topology(**common)
    if kind == "naive":
        return local_topology(pd_prefill=0, pd_decode=2, router=False, **common)
    if kind == "homogeneous":
        n_p, n_d = homogeneous_split(setting)
        return local_topology(prfaas=0, pd_prefill=n_p, pd_decode=n_d, router=False, **common)
    raise ValueError(kind)


@functools.lru_cache(maxsize=8)
def hetero_model(setting: Setting) -> runtime.RuntimeModel:
    """The runtime model of the hetero deployment (cached: a planner search per call otherwise)."""
    return runtime.from_topology(parse_topology(topology(setting, "hetero")))


def homogeneous_split(setting: Setting) -> tuple[int, int]:
    """The planner's best P/D split for three PD-class instances (p = 0)."""
    model = hetero_model(setting)
    dep = model.deployment
    point = homogeneous_baseline(dep.pd, dep.n_prfaas + dep.n_pd, model.prior, dep.output_tokens, dep.egress_bps)
    return point.n_prefill, point.n_decode


def offered_rps(setting: Setting) -> float:
    """Wall arrivals per second: ``load`` x the hetero deployment's planned Lambda_max (observed units)."""
    return setting.load * hetero_model(setting).capacity_rps()


def make_arrivals(setting: Setting, seed: int) -> list:
    text = workloads.TextSource(PromptTokenizer.load(setting.tokenizer)) if setting.tokenizer else None
    out = workloads.arrivals(setting.workload, setting.duration_s, offered_rps(setting), setting.output_tokens,
                             MAX_INPUT_TOKENS, seed, setting.speedup, text, model=SERVED_NAME)
    if setting.workload != "case-study":
        out = [dataclasses.replace(a, offset_s=a.offset_s / setting.load) for a in out]
    return out


class LinkThread:
    """``_run`` in a thread for the ``with`` block's duration, on a link (none: nothing runs); ``_stop``
    is set on exit and the thread joined."""

    def __init__(self, net: Netns | None):
        self.net = net
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        raise NotImplementedError

    def __enter__(self):
        if self.net is not None:
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self.net is not None:
            self._thread.join()


class LinkSampler(LinkThread):
    """Samples the veth's received bytes every ``interval_s`` in a thread (the link's egress at the wire)."""

    def __init__(self, net: Netns | None, interval_s: float = 0.5):
        super().__init__(net)
        self.interval_s, self.samples = interval_s, []

    def _run(self) -> None:
        while not self._stop.is_set():
            before = time.monotonic()
            count = self.net.rx_bytes()
            self.samples.append((before, count, time.monotonic()))  # the count lies between the two times
            self._stop.wait(self.interval_s)

    def rates_bps(self) -> list[float]:
        """Wire bits/s per interval."""
        pairs = zip(self.samples, self.samples[1:], strict=False)
        return [8 * (b1 - b0) / (t1 - t0) for (t0, b0, _), (t1, b1, _) in pairs if t1 > t0]

    def max_excess_bytes(self, rate_bps: float) -> float:
        """The most the link carried beyond ``rate_bps`` over any window between two samples, in
        bytes (conservatively timed: from the earliest the first count can be to the latest the
        second can be). A shaper with bucket B keeps this <= B."""
        excess = 0.0
        for i, (start, b0, _) in enumerate(self.samples):
            for _, b1, end in self.samples[i + 1:]:
                excess = max(excess, (b1 - b0) - rate_bps / 8 * (end - start))
        return excess



def summarise(results: list, wall_s: float, window_s: float, setting: Setting, offloaded: float,
              egress_bytes: float, link_rates_bps: list[float], link_excess_bytes: float = 0.0) -> dict:
    """One row, one seed. ``goodput_rps``: requests within both SLOs per second of the arrival window."""
    s = setting.speedup
    ok = [r for r in results if r.ok]
    good = [r for r in ok if r.ttft_s * s <= setting.ttft_slo_s and r.mean_tbt_s * s <= 1.0 / setting.tbt_tokens_per_s]
    rejected = [r for r in results if r.rejected]
    wire_capacity_bps = setting.wire_mbit * 1e6
    busy = link_rates_bps[1:-1] or link_rates_bps
    return {
        "requests": len(results), "requests_ok": len(ok), "requests_failed": len(results) - len(ok) - len(rejected),
        "requests_rejected": len(rejected), "slo_met": len(good), "goodput_rps": len(good) / window_s / s,
        "ttft_p50_s": percentile([r.ttft_s * s for r in ok], 0.5), "ttft_p90_s": percentile([r.ttft_s * s for r in ok], 0.9),
        "tbt_p99_s": percentile([r.mean_tbt_s * s for r in ok], 0.99),
        "offload_fraction": offloaded / len(ok) if ok else 0.0,
        # modelled: real KV bytes (kv_scale of them on the wire) per emulated second
        "egress_gbps": egress_bytes / setting.kv_scale * 8 / (wall_s * s) / 1e9,
        "link_utilisation": statistics.fmean(busy) / wire_capacity_bps if busy else 0.0,
        "link_peak_utilisation": max(busy) / wire_capacity_bps if busy else 0.0,
        "link_max_excess_bytes": link_excess_bytes,
        "wall_s": wall_s,
    }


def flush_caches(workers) -> None:
    """``POST /flush_cache`` to each worker (between rows: every row starts with cold caches)."""
    for w in workers:
        http_sync.post(w.url + "/flush_cache", timeout_s=CONTROL_REQUEST_TIMEOUT_S).raise_for_status()


def _replay_row(url: str, arrivals: list, setting: Setting, workers, prfaas_worker, net: Netns | None) -> dict:
    flush_caches(workers)
    metric = ("prfaas:requests_ok_total", "prfaas:kv_bytes_sent_total")
    before = [scrape_metric(prfaas_worker.url, m) for m in metric] if prfaas_worker else [0.0, 0.0]
    with LinkSampler(net) as sampler:
        results, wall = asyncio.run(replay(url, arrivals))
    after = [scrape_metric(prfaas_worker.url, m) for m in metric] if prfaas_worker else [0.0, 0.0]
    window = max((a.offset_s for a in arrivals), default=setting.duration_s) or setting.duration_s
    return summarise(results, wall, window, setting, after[0] - before[0], after[1] - before[1], sampler.rates_bps(),
                     sampler.max_excess_bytes(setting.wire_mbit * 1e6))


def _routers(kind: str, group: ProcessGroup, deployment, rows: list[str], doc: dict) -> dict[str, str]:
    """URL per row served by this deployment (peers started here)."""
    w = deployment.workers
    prfaas = [x for n, x in w.items() if n.startswith("prfaas")]
    pd_p = [x for n, x in w.items() if n.startswith("pd-prefill")]
    pd_d = [x for n, x in w.items() if n.startswith("pd-decode")]
    urls = {}
    if kind == "hetero":
        if "prfaas" in rows:
            urls["prfaas"] = deployment.router.url
        if "prfaas-no-early-rejection" in rows:
            urls["prfaas-no-early-rejection"] = start_router(group, doc, "--no-early-rejection",
                                                             name="prfaas-no-early-rejection").url
        for row, peer, prefill in (("sglang-router", "sglang-router", prfaas + pd_p), ("smg", "smg", prfaas + pd_p),
                                   ("sglang-router-prfaas-prefill", "sglang-router", prfaas)):
            if row in rows:
                urls[row] = start_peer_router(group, peer, prefill, pd_d, name=row)
    elif kind == "naive":
        urls["naive"] = start_peer_router(group, "sglang-router", prfaas, pd_d, name="naive")
    else:
        urls["homogeneous"] = start_peer_router(group, "sglang-router", pd_p, pd_d, name="homogeneous")
    return urls


def run(setting: Setting = Setting(), seeds: int = 5, rows: tuple[str, ...] = ROWS, log_dir: Path | None = None) -> dict:
    """Every row over ``seeds`` seeds; returns per-row per-seed summaries, medians and ratios."""
    log_dir = log_dir or Path(tempfile.mkdtemp(prefix="prfaas-compare-"))
    arrivals = {seed: make_arrivals(setting, seed) for seed in range(seeds)}
    per_seed: dict[str, list[dict]] = {row: [] for row in rows}
    out = {"setting": dataclasses.asdict(setting), "seeds": seeds, "logs": str(log_dir),
           "link_gbps": setting.link_gbps, "tbf_mbit": setting.wire_mbit, "tbf_burst_bytes": TBF_BURST_BYTES,
           "offered_rps": offered_rps(setting) / setting.speedup,
           "planned_capacity_rps": hetero_model(setting).capacity_rps() / setting.speedup,
           "threshold_tokens": hetero_model(setting).baseline_threshold_tokens,
           "homogeneous_split": homogeneous_split(setting), "arrivals": [len(arrivals[s]) for s in range(seeds)]}
    with Zygotes() as zygotes:  # what the peer routers of every deployment are forked from
        for kind in ("hetero", "naive", "homogeneous"):
            if any(DEPLOYMENT_OF[r] == kind for r in rows):
                _run_deployment(kind, setting, seeds, rows, log_dir, arrivals, per_seed, zygotes)
    out["rows"] = {row: aggregate(per_seed[row]) for row in rows}
    ours = out["rows"].get("prfaas", {}).get("goodput_rps", {}).get("median")
    medians = {row: r["goodput_rps"]["median"] for row, r in out["rows"].items() if row != "prfaas"}
    out["goodput_ratio"] = {row: (ours / v if v else None) for row, v in medians.items()} if ours is not None else {}
    others = {row: v for row, v in medians.items() if row not in OURS}
    best = max(others, key=others.get) if others else None
    out["best_other_row"] = best
    out["goodput_ratio_vs_best"] = (ours / others[best]) if best and others[best] and ours is not None else None
    return out


def _run_deployment(kind: str, setting: Setting, seeds: int, rows: tuple[str, ...], log_dir: Path,
                    arrivals: dict, per_seed: dict[str, list[dict]], zygotes: Zygotes) -> None:
    """Start ``kind``'s deployment (and its shaped link), replay every seed through each of its rows' routers
    into ``per_seed``, and stop it all."""
    kind_rows = [r for r in rows if DEPLOYMENT_OF[r] == kind]
    group = ProcessGroup(log_dir / kind, zygotes=zygotes)
    net = Netns() if kind != "homogeneous" else None
    try:
        if net is not None:
            net.__enter__()
            net.throttle(setting.wire_mbit)
        doc = topology(setting, kind, net)
        context = ("--context-tokens", str(2 * MAX_INPUT_TOKENS + setting.output_tokens))
        deployment = start_deployment(group, doc, engine_args={r: context for r in ("prfaas", "pd-prefill", "pd-decode")},
                                      wrap={"prfaas": net.wrap} if net else None, name=kind)
        workers = list(deployment.workers.values())
        prfaas_worker = deployment.workers.get("prfaas-0")
        for row, url in _routers(kind, group, deployment, kind_rows, doc).items():
            for seed in range(seeds):
                per_seed[row].append(_replay_row(url, arrivals[seed], setting, workers, prfaas_worker, net))
    finally:
        group.stop()
        if net is not None:
            net.__exit__(None, None, None)


SPREAD = ("goodput_rps", "ttft_p50_s", "ttft_p90_s", "tbt_p99_s", "offload_fraction", "egress_gbps", "link_utilisation",
          "link_peak_utilisation")


def aggregate(runs: list[dict]) -> dict:
    """Median, min and max over seeds of each figure; the per-seed runs beside them."""
    agg = {}
    for key in SPREAD:
        values = [r[key] for r in runs if r[key] is not None]
        agg[key] = {"median": statistics.median(values), "min": min(values), "max": max(values)} if values else None
    for key in ("requests", "requests_ok", "requests_failed", "requests_rejected", "slo_met"):
        agg[key] = sum(r[key] for r in runs)
    agg["completed_fraction"] = agg["requests_ok"] / agg["requests"] if agg["requests"] else 0.0
    agg["per_seed"] = runs
    return agg


def render_markdown(r: dict) -> str:
    """One table per load level (``{"loads": [...]}`` from a sweep, or one result)."""
    return "\n\n".join(_render_one(x) for x in r.get("loads", [r]))


def _render_one(r: dict) -> str:
    def m(x, fmt="{:.2f}"):
        return "n/a" if x is None else fmt.format(x["median"]) + " [" + fmt.format(x["min"]) + ", " + fmt.format(x["max"]) + "]"

    lines = [f"link {r['setting']['link']} ({r['link_gbps']:g} Gbps modelled; tbf {r['tbf_mbit']:g} Mbit/s), "
             f"offered {r['offered_rps']:.3f} req/s = {r['setting']['load']:g} x planned {r['planned_capacity_rps']:.3f}, "
             f"t = {r['threshold_tokens']:.0f}, {r['seeds']} seeds; median [min, max]", "",
             "| row | ok / failed / rejected | goodput (req/s) | ratio ours / row | TTFT p50 (s) | TTFT p90 (s) | TBT p99 (s) | offload | egress (Gbps) | link util. (peak) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for row, x in r["rows"].items():
        ratio = r["goodput_ratio"].get(row)
        peak = x["link_peak_utilisation"]["max"] if x["link_peak_utilisation"] else 0.0
        lines.append(f"| {row} | {x['requests_ok']} / {x['requests_failed']} / {x['requests_rejected']} | {m(x['goodput_rps'], '{:.3f}')} | "
                     f"{'—' if row == 'prfaas' else ('n/a' if ratio is None else f'{ratio:.2f}')} | {m(x['ttft_p50_s'])} | "
                     f"{m(x['ttft_p90_s'])} | {m(x['tbt_p99_s'], '{:.3f}')} | {m(x['offload_fraction'])} | {m(x['egress_gbps'])} | "
                     f"{m(x['link_utilisation'])} ({peak:.2f}) |")
    vs = r["goodput_ratio_vs_best"]
    lines.append(f"\ngoodput_ratio_vs_best (ours / {r['best_other_row']}, medians): **{vs:.2f}**" if vs else "\ngoodput_ratio_vs_best: n/a")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``compare``'s own flags (:mod:`prfaas_sglang.bench.capacity` registers the subcommand, adding ``--capacity``'s)."""
    parser.add_argument("--workload", default="case-study", help="case-study | trace:PATH (--capacity: also shift)")
    parser.add_argument("--seeds", type=int, default=None, help="seeds (default: 5; --capacity: 3)")
    parser.add_argument("--link", choices=("abundant", "scarce"), default="abundant",
                        help="modelled PrfaaS link per instance: abundant 25 Gbit/s, scarce 2")
    parser.add_argument("--load", default="0.8",
                        help="offered load as a fraction of the planned capacity; a comma list sweeps (e.g. 0.5,1,1.5,2)")
    parser.add_argument("--rows", default=None, help="comma list of rows (default: all)")
    parser.add_argument("--duration", type=float, default=30.0, help="arrival window per seed, wall seconds")
    parser.add_argument("--ttft-slo-s", type=float, default=None,
                        help="TTFT SLO, emulated seconds (default 5; --capacity: 5 on the abundant link, 10 on the scarce)")
    parser.add_argument("--speedup", type=float, default=None, help="emulated time's speedup (default 2; --capacity: 4)")
    parser.add_argument("--tokenizer", choices=("shipped", "none"), default="shipped",
                        help="without --capacity: text prompts, tokenized by the router and the engines with the "
                             "shipped tokenizer (default), or token ids (none: no process loads a tokenizer)")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")


def cli(args: argparse.Namespace, inv: Invocation) -> int:
    """``compare`` without ``--capacity``: goodput at the given loads."""
    args.seeds = args.seeds or 5
    args.speedup = args.speedup or 2.0
    args.ttft_slo_s = args.ttft_slo_s or 5.0
    try:
        loads = [float(x) for x in args.load.split(",")]
    except ValueError:
        inv.error(f"--load takes numbers, got {args.load!r}")
    rows = tuple(args.rows.split(",")) if args.rows else ROWS
    if unknown := set(rows) - set(ROWS):
        inv.error(f"unknown rows {sorted(unknown)}; choose from {', '.join(ROWS)}")
    if args.seeds < 1 or min(loads) <= 0 or args.duration <= 0:
        inv.error("--seeds must be >= 1, --load and --duration > 0")
    from prfaas_sglang.demo.netns import available

    if (why := available()) is not None and any(DEPLOYMENT_OF[r] != "homogeneous" for r in rows):
        inv.error(f"the shaped PrfaaS link {why}")
    tokenizer = SHIPPED if args.tokenizer == "shipped" else None
    runs = [run(Setting(args.workload, args.link, load, args.duration, args.speedup, ttft_slo_s=args.ttft_slo_s,
                        tokenizer=tokenizer),
                args.seeds, rows) for load in loads]
    result = runs[0] if len(runs) == 1 else {"loads": runs}
    return inv.report(args, result, None, render_markdown)
