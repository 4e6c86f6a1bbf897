"""Capacity at an SLO: our router against every peer at its best (``bench compare --capacity``).

The yardstick is a serving expert's: per row, the highest arrival rate at which >= 90% (and,
separately, >= 99%) of *all* arrivals meet both SLOs (TTFT, and mean time between tokens); a
refusal, a failure or a request never served is a miss (``bench/slo.py``). Method:

* **Engines apart from the router's model.** Every emulated engine runs with per-request
  log-normal noise (sigma 0.2, mean one) and, in the bias study, a per-deployment bias
  (``engine/mock/truth.py``); the router learns only from what it observes.
* **Each peer at its best.** A short sweep (one seed, two loads) over each family's grid
  (``bench/capacity_rows.py``: policies, load signals, balance and admission knobs; both
  homogeneous splits) ranks the configurations by mean attainment; only each family's best
  is bisected. The sweep is in the result.
* **Bisection on offered load** (``slo.CapacitySearch``): expand by 1.5x until bracketed, then
  geometric midpoints until ``hi / lo <= 1 + resolution``. Each probe pools ``seeds`` seeds of
  ``scored_per_seed`` scored arrivals (>= 200 per row and probe at the defaults), after a
  warm-up that is not scored (as long as the cool-down unless ``warmup_s`` is given) and followed
  by a cool-down that keeps the load on until the last scored request is done. Rows are
  interleaved per probe and seed in a random order; before each run the deployment is idle and its caches flushed, and the row's router is
  started afresh (nothing carries over between runs).
* **Identical arrivals.** A seed is one stream of prompts at unit rate; a probe at rate
  ``lambda`` plays it with every offset divided by ``lambda``, so rows and loads see the same
  prompts in the same order.

Units: rates and SLOs are in emulated (model) seconds; engines run ``speedup`` times faster
than wall time and ship ``kv_scale`` of the KV bytes over a link shaped to
``capacity x kv_scale x speedup``.

Workloads: ``case-study`` (the paper's log-normal, <= 64K tokens); ``shift`` (the same, every
prompt twice as long from the middle of the scored window on: the median doubles);
``trace:PATH`` (a Mooncake trace: its lengths, prefix reuse and burstiness, time-compressed).
Condition ``link_drop``: the link's capacity falls 4x for ``drop_s`` emulated seconds from the
start of the scored window.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import random
import re
import statistics
import sys
import tempfile
import time
import zlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import numpy as np

from prfaas_sglang import runtime
from prfaas_sglang.adapters import http_sync
from prfaas_sglang.bench import capacity_rows as rows_mod
from prfaas_sglang.bench import compare, slo
from prfaas_sglang.bench.capacity_rows import (
    DEPLOYMENTS,
    LAYERWISE,
    SHAPED,
    Row,
    emulated_knobs,
    peer_args,
)
from prfaas_sglang.bench.compare import ACCELERATORS, LINKS_GBPS, MAX_INPUT_TOKENS, LinkThread
from prfaas_sglang.bench.slo import CapacitySearch, Outcome, per_seed_capacity, score, spread
from prfaas_sglang.bench.subcommands import Invocation, Subcommand
from prfaas_sglang.bench.zygote import Zygotes
from prfaas_sglang.demo import workloads
from prfaas_sglang.demo.client import Arrival, RequestResult, completion_text, stream_request
from prfaas_sglang.demo.cluster import (
    CONTROL_REQUEST_TIMEOUT_S,
    LocalDeployment,
    ProcessGroup,
    StartupError,
    local_topology,
    scrape_metric,
    start_deployment,
    start_peer_router,
    start_router,
)
from prfaas_sglang.demo.netns import Netns
from prfaas_sglang.errors import ConfigError
from prfaas_sglang.plan.workload import case_study_lengths, read_trace
from prfaas_sglang.tokenizer import SHIPPED, PromptTokenizer
from prfaas_sglang.topology import parse_topology

SERVED_NAME = "prfaas-capacity"
# The TTFT SLO per link (emulated s): on an idle deployment every prompt (<= 64K tokens) can meet it.
# At 2 Gbps a 64K prompt's KV alone takes 5.2 s on the wire (and 8.7 s to prefill on PD-P): a 5 s SLO
# would be missed by ~14% of requests at any load, so no row could reach 90%.
TTFT_SLO_S = {"abundant": 5.0, "scarce": 10.0}
# The paper's case study: 1024 output tokens at a 40 tok/s TBT SLO, so decode capacity (equation 5) is part of
# every comparison. 64-token outputs are a named secondary condition ("out-64"; the quick smoke's).
CASE_STUDY_OUTPUT_TOKENS = 1024
SWEEP_LOADS = (0.4, 0.7)  # x the planned capacity of the hetero deployment
MAX_CLOSE = 2  # configurations bisected beside a family's best when the sweep cannot tell them apart
# The lowest load probed, x planned: a capacity below it reads 0 (a probe's scored window grows as 1 / load:
# at 0.2x, 67 arrivals take 4 emulated minutes).
FLOOR = 0.2
# The bisection's step while a row is not yet bracketed: two geometric midpoints of a 1.44 bracket reach
# 1.095 (<= 1 + resolution at the default 0.10), so a row started near its capacity resolves in four rounds;
# from a 1.5 bracket two midpoints leave 1.107 and a fifth round is needed.
EXPAND = 1.44


@dataclass(frozen=True)
class CapacitySetting:
    workload: str = "case-study"
    link: str = "abundant"
    link_drop: bool = False
    speedup: float = 4.0
    kv_scale: float = 0.01
    output_tokens: int = CASE_STUDY_OUTPUT_TOKENS
    ttft_slo_s: float | None = None  # emulated; None: TTFT_SLO_S[link]
    tbt_tokens_per_s: float = 40.0
    seeds: int = 3
    scored_per_seed: int = 70
    # Emulated seconds of unscored arrivals before the scored ones; None: as long as the cool-down (the longest a
    # scored request may take), so that the first scored arrival meets queues and a decode batch already at
    # their steady population. A fixed 15 s, with 1024-token outputs (25.6 s of decode each), made the first 70
    # scored arrivals meet the SLO 0.045 more often than the next 230 (3 seeds at 0.293 req/s); with 60 s,
    # 0.011 (issue #59, 2026-11-30).
    warmup_s: float | None = None
    prefill_bias: float = 1.0
    decode_bias: float = 1.0
    noise_sigma: float = 0.2
    # The engines' service-time truth (engine/mock/truth.py): "batched", a form the router's roofline does not
    # have (per-forward and per-request costs, a decode step rising with the batch, slow periods), so placement
    # and admission are judged where the router's prediction is not exact; "profile", the roofline's own form.
    truth_model: str = "batched"
    prior: str | None = None  # the router's workload prior (case-study or trace:PATH); None: the case study
    decode_radix_cache: bool = True  # decode workers keep a radix cache of what they decoded (every row's engines)
    # SGLang's --stream-interval on every engine: a stream's chunk every Nth token. With 1024-token outputs at speedup
    # 4, one chunk per token (written by the engine, relayed by a router, parsed by the client) is work on the same
    # 2 cores as the emulated decode, which ran late by it; the client counts a chunk's tokens, not its chunks.
    stream_interval: int = 1
    layerwise: bool = False  # the link streams KV by layer (links[].layerwise): every row's PrfaaS engines, our router's estimate
    resolution: float = 0.10  # of the 90% capacity: hi / lo <= 1.10
    resolution_99: float = 0.20  # of the 99% capacity
    give_up_slos: float = 2.5  # no first token by arrival + this x the TTFT SLO: the request is a miss
    drop_s: float = 60.0  # emulated, with link_drop
    sweep_scored: int = 50  # scored arrivals per sweep run
    sweep_seeds: int = 2  # seeds each configuration of a sweep runs
    max_rounds: int = 8
    # The interval (bench/slo.py capacity_interval): after the bisection, each reported row on grid_loads loads
    # grid_step apart in its bisection's 90% bracket (grid_centre), every seed, pooled with the bisection's own
    # runs; 0 loads: no interval.
    grid_loads: int = 7
    grid_step: float = 1.06
    grid_resamples: int = 1000
    grid_extensions: int = 2  # loads a censored estimate may add beyond its runs, one at a time (bench/capacity.py grid)

    @property
    def ttft_slo(self) -> float:
        """The TTFT SLO (emulated s). With a bias, every SLO is in the biased hardware's time (x bias)."""
        return (self.ttft_slo_s or TTFT_SLO_S[self.link]) * self.prefill_bias

    @property
    def tbt_slo(self) -> float:
        return self.decode_bias / self.tbt_tokens_per_s

    @property
    def cooldown(self) -> float:
        """Emulated seconds the load stays on after the last scored arrival: until it must be done."""
        return self.give_up_slos * self.ttft_slo + self.output_tokens * self.tbt_slo * 2

    @property
    def warmup(self) -> float:
        """Emulated seconds of unscored arrivals before the scored ones (``warmup_s``, else the cool-down)."""
        return self.cooldown if self.warmup_s is None else self.warmup_s

    @property
    def wire_mbit(self) -> float:
        return LINKS_GBPS[self.link] * 1e3 * self.kv_scale * self.speedup

    @property
    def condition(self) -> str:
        parts = [self.workload.split("/")[-1] if self.workload.startswith("trace:") else self.workload, self.link]
        if self.link_drop:
            parts.append("link-drop")
        if self.ttft_slo_s is not None and self.ttft_slo_s != TTFT_SLO_S[self.link]:
            parts.append(f"ttft-{self.ttft_slo_s:g}s")
        if self.prefill_bias != 1.0 or self.decode_bias != 1.0:
            parts.append(f"bias-{self.prefill_bias:g}")
        if self.output_tokens != CASE_STUDY_OUTPUT_TOKENS:
            parts.append(f"out-{self.output_tokens}")
        if self.prior is not None:
            parts.append(f"prior-{self.prior.split('/')[-1]}")
        if self.layerwise:
            parts.append("layerwise")
        return "/".join(parts)


# --- arrivals ------------------------------------------------------------------------------------


def prior_workload(setting: CapacitySetting) -> str:
    """What the router is told to plan for: ``setting.prior`` where given, else the case study. Never the trace
    being evaluated unless asked for by name: a router handed the answer is judged on nothing it learnt (the
    shift's second half is not in the case study either)."""
    return setting.prior or "case-study"


def prior(setting: CapacitySetting) -> dict:
    """The topology's ``scheduler.workload`` (:func:`prior_workload`'s)."""
    return workloads.prior(prior_workload(setting), MAX_INPUT_TOKENS)


class Stream:
    """One seed's prompts at unit rate: ``(unit_offset, n_tokens, body factory)``. Lengths and text
    are drawn once; a probe at rate ``lam`` divides the offsets by ``lam``."""

    def __init__(self, setting: CapacitySetting, seed: int, text: workloads.TextSource):
        self.setting, self.seed, self.text = setting, seed, text
        self._items: list[tuple[float, int, tuple[int, ...]]] = []  # unit offset, base tokens, trace blocks
        self._texts: dict[tuple[int, int], str] = {}
        self._rng = random.Random(seed)
        self._t = 0.0
        if setting.workload.startswith("trace:"):
            self._load_trace(setting.workload[len("trace:"):], seed)

    def _load_trace(self, path: str, seed: int) -> None:
        records = list(read_trace(path, "--workload"))
        start = (seed * 997) % max(len(records) - 1, 1)
        chosen = records[start:] + records[:start]
        span_s = max((chosen[min(len(chosen) - 1, 400)].timestamp_ms - chosen[0].timestamp_ms) / 1e3, 1e-3)
        rate = min(len(chosen) - 1, 400) / span_s  # the trace's own mean rate over the part a run uses
        t0 = chosen[0].timestamp_ms
        for rec in chosen:
            offset = (rec.timestamp_ms - t0) / 1e3 * rate
            if rec.timestamp_ms < t0:  # wrapped around: continue after the last
                break
            self._items.append((offset, min(rec.input_length, MAX_INPUT_TOKENS), tuple(rec.hash_ids)))

    def _grow(self, count: int) -> None:
        dist = case_study_lengths(MAX_INPUT_TOKENS)
        while len(self._items) < count:
            self._t += self._rng.expovariate(1.0)
            self._items.append((self._t, int(dist.sample(self._rng, 1)[0]), ()))

    def arrivals(self, lam: float, until_s: float) -> list[tuple[float, Arrival]]:
        """(emulated offset, arrival) for every prompt before ``until_s`` emulated seconds at rate ``lam``."""
        if not self.setting.workload.startswith("trace:"):
            self._grow(int(lam * until_s * 1.5) + 50)
        out = []
        for i, (unit, n, blocks) in enumerate(self._items):
            offset = unit / lam
            if offset >= until_s:
                break
            out.append((offset, self._arrival(i, offset, n, blocks, lam)))
        if out and out[-1][0] < until_s * 0.9 and self.setting.workload.startswith("trace:"):
            raise ValueError(f"the trace segment ends at {out[-1][0]:.0f} s of the {until_s:.0f} s a probe needs")
        return out

    def _arrival(self, i: int, offset: float, n: int, blocks: tuple[int, ...], lam: float) -> Arrival:
        s = self.setting
        if s.workload == "shift" and offset >= s.warmup + s.scored_per_seed / lam / 2:
            n = min(2 * n, MAX_INPUT_TOKENS)  # from the middle of the scored window: the median doubles
        key = (i, n)
        if key not in self._texts:
            if blocks:  # a trace: the same text wherever a block id appears (prefix reuse)
                used = blocks[: -(-n // workloads.BLOCK_TOKENS)]
                self._texts[key] = "".join(self.text.text(random.Random(h), workloads.BLOCK_TOKENS) for h in used)
            else:
                self._texts[key] = self.text.text(random.Random(self.seed * 1_000_003 + i), n)
        out_tokens = s.output_tokens
        arrival = completion_text(offset / s.speedup, self._texts[key], out_tokens, SERVED_NAME)
        return dataclasses.replace(arrival, input_tokens=n)


def schedule(stream: Stream, setting: CapacitySetting, lam: float, scored: int) -> tuple[list[Arrival], range]:
    """A run's arrivals (wall offsets) and which of them are scored: the warm-up, ``scored`` arrivals, and a
    cool-down that keeps the load on until the last scored request must be done."""
    window_s, warmup_s, cooldown_s = scored / lam, setting.warmup, setting.cooldown
    timed = stream.arrivals(lam, warmup_s + window_s * 1.6 + cooldown_s + 10)
    first = next((i for i, (t, _) in enumerate(timed) if t >= warmup_s), len(timed))
    last = min(first + scored, len(timed))
    end_s = (timed[last - 1][0] if last > first else warmup_s) + cooldown_s
    arrivals = [a for t, a in timed if t <= end_s]
    return arrivals, range(first, last)


# --- deployments ---------------------------------------------------------------------------------


def topology(setting: CapacitySetting, kind: str, net: Netns | None = None) -> dict:
    n_prfaas, n_p, n_d = DEPLOYMENTS[kind]
    doc = local_topology(prfaas=n_prfaas, pd_prefill=n_p, pd_decode=n_d, speedup=setting.speedup, kv_scale=setting.kv_scale,
                         output_tokens=setting.output_tokens, workload=prior(setting), tokenizer=SHIPPED,
                         served_name=SERVED_NAME, accelerators=ACCELERATORS, link_gbps=setting.wire_mbit / 1e3,
                         ttft_slo_s=setting.ttft_slo, router=False,
                         **({"hosts": {"prfaas": net.inner_ip}, "host": net.outer_ip} if net is not None else {}))
    for link in doc["links"]:
        link["layerwise"] = setting.layerwise or kind in LAYERWISE
    return doc


def planned_capacity(setting: CapacitySetting) -> float:
    """The hetero deployment's Lambda_max (eq. 6 at its planned t), emulated requests/s."""
    model = runtime.from_topology(parse_topology(topology(setting, "hetero")))
    return model.capacity_rps() / setting.speedup


@dataclass
class Up:
    """A deployment that is up: its processes, its namespace (shaped ones) and its topology document."""

    kind: str
    group: ProcessGroup
    deployment: LocalDeployment
    doc: dict
    net: Netns | None

    def workers(self, role_prefix: str) -> list:
        return [w for n, w in self.deployment.workers.items() if n.startswith(role_prefix)]


class Fleet:
    """The deployments a phase needs, started through the launcher and kept up between runs."""

    def __init__(self, setting: CapacitySetting, log_dir: Path):
        self.setting, self.log_dir = setting, log_dir
        self.up: dict[str, Up] = {}

    def get(self, kind: str) -> Up:
        if kind not in self.up:
            self.up[kind] = self._start(kind)
        return self.up[kind]

    def keep_only(self, kinds: set[str]) -> None:
        for kind in list(self.up):
            if kind not in kinds:
                self._stop(self.up.pop(kind))

    def close(self) -> None:
        self.keep_only(set())

    def _start(self, kind: str) -> Up:
        s = self.setting
        group = ProcessGroup(self.log_dir / kind)
        net = None
        if kind in SHAPED:
            net = Netns().__enter__()
            net.throttle(s.wire_mbit)
        try:
            doc = topology(s, kind, net)
            args = {role: self._engine_args(role, i) for i, role in enumerate(("prfaas", "pd-prefill", "pd-decode"))}
            dep = start_deployment(group, doc, engine_args=args, wrap={"prfaas": net.wrap} if net else None, name=kind)
        except BaseException:
            group.stop()
            if net is not None:
                net.__exit__(None, None, None)
            raise
        return Up(kind, group, dep, doc, net)

    def _engine_args(self, role: str, index: int) -> tuple[str, ...]:
        s = self.setting
        return ("--context-tokens", str(2 * MAX_INPUT_TOKENS + s.output_tokens), "--prefill-bias", f"{s.prefill_bias:g}",
                "--decode-bias", f"{s.decode_bias:g}", "--noise-sigma", f"{s.noise_sigma:g}", "--noise-seed", str(index),
                "--truth-model", s.truth_model, "--stream-interval", str(s.stream_interval),
                *(("--disaggregation-decode-enable-radix-cache",) if s.decode_radix_cache and role == "pd-decode" else ()))

    @staticmethod
    def _stop(up: Up) -> None:
        up.group.stop()
        if up.net is not None:
            up.net.__exit__(None, None, None)


def wait_idle(up: Up, timeout_s: float = 60.0) -> bool:
    """Every worker reports nothing running, waiting or holding KV (True), or ``timeout_s`` passed (False)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            loads = [http_sync.get_json(w.url + "/v1/loads", timeout_s=CONTROL_REQUEST_TIMEOUT_S)["loads"][0] for w in up.deployment.workers.values()]
        except OSError:
            loads = None
        if loads and all(x["num_running_reqs"] == 0 and x["num_waiting_reqs"] == 0 and x["num_used_tokens"] == 0
                         for x in loads):
            return True
        time.sleep(0.25)
    return False


def flush(up: Up) -> None:
    """Every worker's caches emptied (:func:`compare.flush_caches`)."""
    compare.flush_caches(up.deployment.workers.values())


def restart_slow_periods(up: Up, seed: int) -> None:
    """Every engine's slow periods start afresh, each from a seed of ``seed`` and its name: every row run on
    ``seed`` meets the same slow spells at the same emulated offsets from its start (common random numbers),
    whatever ran on the engines before. Without this a spell's phase was each engine's elapsed time, which
    the rows' order and their runs' lengths decided: two runs of one row on one seed differed by up to 0.25
    in capacity (issue #59, 2026-11-29)."""
    for name, w in sorted(up.deployment.workers.items()):
        period_seed = zlib.crc32(f"{seed}/{name}".encode())
        http_sync.post(w.url + "/prfaas/truth", json_body={"period_seed": period_seed}, timeout_s=CONTROL_REQUEST_TIMEOUT_S).raise_for_status()


BUCKET_ORDER_TRIES = 6


def start_row_router(row: Row, up: Up, group: ProcessGroup) -> str:
    """A fresh router process for ``row`` over ``up``; returns its URL. A peer's ``bucket`` policy gives its
    first registered prefill worker the shortest prompts, and the peers register workers in no fixed order
    (sglang-router: a random id's; smg: its job queue's): the router is started again until its log shows
    the PD-P worker first. A peer's time-valued knobs reach it in wall time at the deployment's speedup
    (:func:`~prfaas_sglang.bench.capacity_rows.peer_args`)."""
    args = peer_args(row.args, up.doc["emulation"]["speedup"])
    if row.router == "prfaas":
        return start_router(group, up.doc, *args, name=row.name).url
    prfaas, pd_p, pd_d = up.workers("prfaas"), up.workers("pd-prefill"), up.workers("pd-decode")
    prefill = prfaas if row.prefill == "prfaas" else pd_p + prfaas  # PD-P first: the short bucket
    log = group.log_dir / f"{row.name}.log"
    for _ in range(BUCKET_ORDER_TRIES):
        offset = log.stat().st_size if log.exists() else 0
        url = start_peer_router(group, row.router, prefill, pd_d, prefill_policy=row.prefill_policy,
                                decode_policy=row.decode_policy, name=row.name, extra_args=args)
        if row.prefill_policy != "bucket" or len(prefill) < 2 or bucket_first(log, offset, len(prefill)) == prefill[0].url:
            return url
        group.stop(grace_s=1.0)
        group.procs.clear()
    raise StartupError(f"{row.name}: the PD-P worker never came first in the bucket order ({BUCKET_ORDER_TRIES} starts)")


BOUNDARY = re.compile(r'Init boundary:\[(.*)\]')
BOUNDARY_URL = re.compile(r'url: "([^"]+)"')


def bucket_first(log: Path, offset: int, workers: int, timeout_s: float = 10.0) -> str | None:
    """The worker a peer's bucket policy gives the shortest prompts: the first url of the last ``Init boundary``
    line naming ``workers`` workers written after ``offset`` (None if none within ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with log.open("rb") as fh:
            fh.seek(offset)
            text = fh.read().decode(errors="replace")
        lines = [BOUNDARY_URL.findall(m.group(1)) for m in BOUNDARY.finditer(text)]
        full = [urls for urls in lines if len(urls) == workers]
        if full:
            return full[-1][0]
        time.sleep(0.2)
    return None


# --- one run -------------------------------------------------------------------------------------


async def replay_scored(url: str | Callable[[Arrival], str], arrivals: list[Arrival], scored: range, give_up_s: float,
                        finish_s: float) -> list[RequestResult]:
    """Send ``arrivals`` on schedule (wall offsets) to ``url`` (or to ``url(arrival)``: a router per region);
    return the scored ones' results. A scored request without a first token ``give_up_s`` after it was
    sent is abandoned (a miss); one with a first token gets up to ``finish_s`` more to finish. Unscored
    requests are cancelled once every scored one is done."""
    results = [RequestResult(a.input_tokens or 0) for a in arrivals]
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None), connector=connector) as session:
        start = time.perf_counter()
        tasks: list[asyncio.Task] = []
        for arrival, result in zip(arrivals, results, strict=True):
            delay = start + arrival.offset_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            result.sent_s = time.perf_counter() - start
            target = url if isinstance(url, str) else url(arrival)
            tasks.append(asyncio.create_task(stream_request(session, target, arrival, result)))
        for i in scored:
            task, result = tasks[i], results[i]
            while not task.done():
                now = time.perf_counter() - start
                limit = result.sent_s + give_up_s + (finish_s if result.ttft_s is not None else 0.0)
                if now >= limit:
                    task.cancel()
                    break
                await asyncio.wait([task], timeout=min(limit - now, 0.5))
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return [results[i] for i in scored]


REFUSAL_STATUSES = (408, 429, 503)  # a router's load shedding (sglang-router's queue timeout is a 408)


def outcome(result: RequestResult, speedup: float) -> Outcome:
    """A client's result as an :class:`Outcome` in model seconds. No first token: refused (a shedding status),
    failed (any other answer), or unserved (no answer before the harness gave up). A stream that did not end
    cleanly, or not in time, has an infinite mean TBT."""
    if result.ttft_s is None:
        refused = result.status in REFUSAL_STATUSES
        return Outcome(result.input_tokens, None, None, refused, not refused and result.status is not None)
    complete = result.ok and result.output_tokens > 0  # output_tokens is set when the stream ends
    return Outcome(result.input_tokens, result.ttft_s * speedup, result.mean_tbt_s * speedup if complete else math.inf)


def engine_timing(url: str) -> tuple[float, float]:
    """(intended, actual) wall seconds of an emulated engine's forwards and decode steps so far."""
    return (scrape_metric(url, "prfaas:forward_intended_seconds_total"),
            scrape_metric(url, "prfaas:forward_actual_seconds_total"))


class LinkDrop(LinkThread):
    """The link's capacity / 4 from ``at_s`` for ``for_s`` (wall), then back (a thread)."""

    def __init__(self, net: Netns | None, rate_mbit: float, at_s: float, for_s: float):
        super().__init__(net)
        self.rate_mbit, self.at_s, self.for_s = rate_mbit, at_s, for_s

    def _run(self) -> None:
        if self._stop.wait(self.at_s):
            return
        self.net.set_rate(self.rate_mbit / 4)
        self._stop.wait(self.for_s)
        self.net.set_rate(self.rate_mbit)

    def __exit__(self, *exc) -> None:
        super().__exit__(*exc)
        if self.net is not None:
            self.net.set_rate(self.rate_mbit)


class RowFailed(Exception):
    """A row's router would not start (twice): the row is out of the comparison, and the reason recorded."""


class Runner:
    """Runs one row at one load on one seed's stream, from an idle, flushed deployment and a fresh router."""

    def __init__(self, setting: CapacitySetting, fleet: Fleet, log_dir: Path, log=print):
        self.setting, self.fleet, self.log_dir, self.log = setting, fleet, log_dir, log
        self.text = workloads.TextSource(PromptTokenizer.load(SHIPPED))
        self.streams: dict[int, Stream] = {}
        self.zygotes = Zygotes()  # what each run's fresh peer router is forked from (close() stops them)

    def close(self) -> None:
        self.zygotes.stop()

    def stream(self, seed: int) -> Stream:
        if seed not in self.streams:
            self.streams[seed] = Stream(self.setting, seed, self.text)
        return self.streams[seed]

    def run(self, row: Row, lam: float, seed: int, scored: int) -> dict:
        s = self.setting
        up = self.fleet.get(row.deployment)
        arrivals, scored_range = schedule(self.stream(seed), s, lam, scored)
        phases = {"begin": time.monotonic()}
        clean = wait_idle(up)
        flush(up)
        restart_slow_periods(up, seed)
        phases["idle"] = time.monotonic()
        group = ProcessGroup(self.log_dir / "routers", zygotes=self.zygotes)
        prfaas = up.workers("prfaas")
        prefills = prfaas + up.workers("pd-prefill")
        engines = list(up.deployment.workers.values())
        try:
            url = self._start_router(row, up, group)
            phases["router_up"] = time.monotonic()
            before = [scrape_metric(w.url, "prfaas:requests_ok_total") for w in prefills]
            kv_before = sum(scrape_metric(w.url, "prfaas:kv_bytes_sent_total") for w in prfaas)
            timing_before = [engine_timing(w.url) for w in engines]
            replay_began = time.monotonic()
            drop_at = (arrivals[scored_range.start].offset_s if s.link_drop and len(scored_range) else math.inf)
            give_up = s.give_up_slos * s.ttft_slo / s.speedup
            with LinkDrop(up.net if s.link_drop else None, s.wire_mbit, drop_at, s.drop_s / s.speedup):
                results = asyncio.run(replay_scored(url, arrivals, scored_range, give_up,
                                                    s.output_tokens * s.tbt_slo * 4 / s.speedup))
            phases["replayed"] = time.monotonic()
            kv_sent = sum(scrape_metric(w.url, "prfaas:kv_bytes_sent_total") for w in prfaas) - kv_before
            replay_s = phases["replayed"] - replay_began
            status = http_sync.get_json(url + "/status", timeout_s=CONTROL_REQUEST_TIMEOUT_S) if row.router == "prfaas" else None
            done = [scrape_metric(w.url, "prfaas:requests_ok_total") - b for w, b in zip(prefills, before, strict=True)]
            timing = [(w.name.startswith("pd-decode"),) + tuple(a - b for a, b in zip(engine_timing(w.url), tb, strict=True))
                      for w, tb in zip(engines, timing_before, strict=True)]
        finally:
            group.stop(grace_s=1.0)
        phases["end"] = time.monotonic()
        phases = {k: round(v - phases["begin"], 2) for k, v in phases.items() if k != "begin"}
        outcomes = [outcome(r, s.speedup) for r in results]
        remote = sum(done[: len(prfaas)])
        return {"row": row.name, "load": lam, "seed": seed, "outcomes": outcomes, "clean_start": clean,
                "window_s": len(scored_range) / lam, "offload_fraction": remote / sum(done) if sum(done) else 0.0,
                # the PrfaaS link's mean utilisation over the replay: KV bytes its workers sent / the shaped rate
                "link_utilization": 8 * kv_sent / (replay_s * s.wire_mbit * 1e6) if prfaas and replay_s > 0 else None,
                "calibration": (status or {}).get("calibration"), "routed": (status or {}).get("routed"),
                "engine_timing_s": {stage: [sum(t[i] for t in timing if t[0] == decode) for i in (1, 2)]
                                    for stage, decode in (("prefill", False), ("decode", True))},
                "phases_s": phases}

    def _start_router(self, row: Row, up: Up, group: ProcessGroup) -> str:
        """The row's router, started afresh; a start that fails is tried once more (a port taken meanwhile),
        then :class:`RowFailed`."""
        try:
            return start_row_router(row, up, group)
        except StartupError as err:
            self.log(f"{row.name}: router did not start ({err}); again")
            group.stop()
            group.procs.clear()
            try:
                return start_row_router(row, up, group)
            except StartupError as again:
                raise RowFailed(f"{row.name}: {again}") from None


# --- the search ----------------------------------------------------------------------------------


def met_string(met: Iterable[bool]) -> str:
    """Arrivals met or not, in order, as the JSON keeps them: "1" met, "0" not."""
    return "".join("1" if m else "0" for m in met)


def met_of(kept: str) -> list[bool]:
    """The arrivals a :func:`met_string` keeps."""
    return [c == "1" for c in kept]


def probe_summary(runs: list[dict], setting: CapacitySetting) -> dict:
    """One row at one load: the pooled score over its seeds, and each seed's attainment."""
    pooled = [o for r in runs for o in r["outcomes"]]
    window = sum(r["window_s"] for r in runs)
    summary = score(pooled, window, setting.ttft_slo, setting.tbt_slo).as_dict()
    summary["per_seed_attainment"] = {str(r["seed"]): score(r["outcomes"], r["window_s"], setting.ttft_slo,
                                                            setting.tbt_slo).attainment for r in runs}
    # each scored arrival, in arrival order: "1" met, "0" not (a refusal is a miss): whether attainment drifts
    # within a run (queues still growing at its end), which the pooled figure cannot show
    summary["met_in_arrival_order"] = {str(r["seed"]): met_string(o.meets(setting.ttft_slo, setting.tbt_slo)
                                                                  for o in r["outcomes"]) for r in runs}
    summary["offload_fraction"] = statistics.fmean(r["offload_fraction"] for r in runs)
    utilization = [r["link_utilization"] for r in runs if r.get("link_utilization") is not None]
    summary["link_utilization"] = statistics.fmean(utilization) if utilization else None
    summary["dirty_starts"] = sum(not r["clean_start"] for r in runs)
    summary["engine_timing_error"] = timing_error(runs)
    calib = [r["calibration"] for r in runs if r.get("calibration")]
    if calib:
        summary["calibration"] = calib
    return summary


def timing_error(runs: list[dict]) -> dict:
    """Per stage (prefill forwards, decode steps): actual / intended wall time - 1, over ``runs``."""
    out = {}
    for stage in ("prefill", "decode"):
        intended = sum(r["engine_timing_s"][stage][0] for r in runs)
        out[stage] = sum(r["engine_timing_s"][stage][1] for r in runs) / intended - 1 if intended else None
    return out


def sweep(runner: Runner, setting: CapacitySetting, planned: float, families: tuple[str, ...], log,
          quick: bool = False, checkpoint: Callable[[dict], None] | None = None) -> dict:
    """Each family's grid at ``SWEEP_LOADS`` x planned on ``setting.sweep_seeds`` seeds; the best by mean attainment
    (pooled over seeds, averaged over the loads) with its standard error, and ``close``: the configurations (at most
    :data:`MAX_CLOSE`) whose mean is within the two standard errors combined of the best's, bisected beside it (a
    grid of one configuration is not run: it is the best). ``checkpoint``: called after each configuration with
    the sweep so far (the families done, and the current one's ``grid``), so a run cut short keeps it."""
    out = {}
    for family in families:
        grid = rows_mod.family_rows(family)[:1] if quick else rows_mod.family_rows(family)
        if len(grid) == 1:
            out[family] = {"grid": [{"row": grid[0].name, "attainment": {}, "mean": None, "why": grid[0].why,
                                     "emulated_knobs": emulated_knobs(grid[0].args, setting.speedup)}],
                           "best": grid[0].name, "close": [], "loads_x_planned": [], "seeds": 0}
            continue
        table = []
        for deployment in dict.fromkeys(r.deployment for r in grid):
            runner.fleet.keep_only({deployment})
            for row in (r for r in grid if r.deployment == deployment):
                entry = {"row": row.name, "why": row.why, "emulated_knobs": emulated_knobs(row.args, setting.speedup)}
                try:
                    met = {f"{frac:g}": [0, 0] for frac in SWEEP_LOADS}  # load -> [met, arrivals] over seeds
                    for seed in range(setting.sweep_seeds):
                        for frac in SWEEP_LOADS:
                            run = runner.run(row, frac * planned, seed, setting.sweep_scored)
                            got = score(run["outcomes"], run["window_s"], setting.ttft_slo, setting.tbt_slo)
                            met[f"{frac:g}"][0] += got.met
                            met[f"{frac:g}"][1] += got.arrivals
                except RowFailed as err:
                    table.append({**entry, "attainment": {}, "mean": -1.0, "stderr": None, "error": str(err)})
                    log(f"sweep {family} {row.name}: FAILED {err}")
                else:
                    att = {k: m / n for k, (m, n) in met.items()}
                    stderr = math.sqrt(sum(a * (1 - a) / met[k][1] for k, a in att.items())) / len(att)
                    table.append({**entry, "attainment": att, "mean": statistics.fmean(att.values()), "stderr": stderr})
                    log(f"sweep {family} {row.name}: {att} (+- {stderr:.3f})")
                if checkpoint is not None:
                    checkpoint({**out, family: {"grid": table, "partial": True}})
        best = max(table, key=lambda x: (x["mean"], -len(x["row"])))
        close = sorted((x for x in table if x is not best and x["stderr"] is not None and best["stderr"] is not None
                        and best["mean"] - x["mean"] < math.hypot(best["stderr"], x["stderr"])),
                       key=lambda x: -x["mean"])[:MAX_CLOSE]
        out[family] = {"grid": table, "best": best["row"], "close": [x["row"] for x in close],
                       "loads_x_planned": list(SWEEP_LOADS), "seeds": setting.sweep_seeds}
    return out


def start_from_sweep(family: dict, row: str | None = None) -> float:
    """Where the bisection of a family's ``row`` (default: its best) starts (x planned): just above the highest sweep
    load it met 90% at (0.9 without a sweep)."""
    best = next(x for x in family["grid"] if x["row"] == (row or family["best"]))
    if not best["attainment"]:
        return 0.9
    passed = [float(k) for k, a in best["attainment"].items() if a >= 0.9]
    return 1.2 * max(passed) if passed else 0.7 * min(float(k) for k in best["attainment"])


def final_best(swept: dict, capacity: dict) -> dict[str, str]:
    """Each family's configuration with the highest bisected 90% capacity among the sweep's best and the ones the
    sweep could not tell from it (``close``); the sweep's best on a tie or where none was bisected."""
    def cap90(name: str) -> float:
        return (capacity.get(name) or {}).get("capacity_rps", {}).get("0.9", -1.0)

    return {fam: max([x["best"], *x.get("close", [])], key=cap90) for fam, x in swept.items()}


def bisect(runner: Runner, setting: CapacitySetting, planned: float, rows: list[Row], log, seed_rng: random.Random,
           starts: dict[str, float] | None = None, checkpoint=None) -> dict:
    """Capacity of each row: rounds of one probe per unresolved row, seeds and rows interleaved at random.
    ``starts``: a row's first load, x planned (default 0.9); ``checkpoint(rows)`` is called after each round.
    A row whose router will not start is dropped (``failed``)."""
    starts = starts or {}
    searches = {r.name: CapacitySearch(start=starts.get(r.name, 0.9) * planned, resolution=setting.resolution,
                                       coarse=setting.resolution_99, floor=FLOOR * planned, ceiling=4.0 * planned,
                                       expand=EXPAND)
                for r in rows}
    probes: dict[str, list[dict]] = {r.name: [] for r in rows}
    failed: dict[str, str] = {}
    runner.fleet.keep_only({r.deployment for r in rows})
    for round_no in range(setting.max_rounds):
        loads = {r.name: None if r.name in failed else searches[r.name].next_load() for r in rows}
        active = [r for r in rows if loads[r.name] is not None]
        if not active:
            break
        runs: dict[str, list[dict]] = {r.name: [] for r in active}
        seeds = list(range(setting.seeds))
        seed_rng.shuffle(seeds)
        for seed in seeds:
            order = list(active)
            seed_rng.shuffle(order)
            for row in order:
                if row.name in failed:
                    continue
                try:
                    runs[row.name].append(runner.run(row, loads[row.name], seed, setting.scored_per_seed))
                except RowFailed as err:
                    failed[row.name] = str(err)
                    log(f"round {round_no} {row.name}: FAILED {err}")
        for row in (r for r in active if r.name not in failed):
            summary = probe_summary(runs[row.name], setting)
            summary["load_rps"] = searches[row.name].record(loads[row.name], summary["attainment"])  # as its brackets name it
            summary["round"] = round_no
            probes[row.name].append(summary)
            log(f"round {round_no} {row.name} @ {loads[row.name]:.3f}: attainment {summary['attainment']:.3f} "
                f"(refused {summary['refused']}, unserved {summary['unserved']})")
        if checkpoint is not None:
            checkpoint({r.name: row_result(searches[r.name], probes[r.name], setting) for r in rows})
    out = {r.name: row_result(searches[r.name], probes[r.name], setting) for r in rows}
    for name, why in failed.items():
        out[name]["failed"] = why
    return out


def grid_centre(result: dict, setting: CapacitySetting, floor_rps: float) -> float:
    """Where a row's grid is centred: the middle (geometric) of its bisection's 90% bracket, where the crossing
    is likeliest; at the bracket's resolution that is about its bisected capacity. Until 2026-12-01 it was the
    bisected capacity (the highest load that passed): a bracket cut wide by ``--rounds`` (0.244-0.352 req/s in
    the first abundant piece) got a grid below its crossing, every load of it passing. A row with no passing
    load but a failing one (its bisection cut short, or failing at the floor) gets the grid below that load,
    its top load there; a row with a passing load and none failing, the grid above it, its bottom load there.
    A row never probed gets ``floor_rps``."""
    bracket = result["search"]["brackets"]["0.9"]
    lo, hi = bracket["lo"], bracket["hi"]
    half_span = setting.grid_step ** ((setting.grid_loads - 1) / 2)
    if lo is not None and hi is not None:
        return math.sqrt(lo * hi)
    if hi is not None:
        return hi / half_span
    if lo is not None:
        return lo * half_span
    return floor_rps


# Arrivals a bootstrap block holds: a run's neighbouring arrivals share a queue, so they are resampled together.
GRID_BLOCK_ARRIVALS = 10

RunsByLoad = dict[float, dict[int, list[list[bool]]]]  # load -> seed -> that seed's runs there (arrivals met, in order)


def probe_runs(result: dict) -> RunsByLoad:
    """The bisection's runs of one row (``row_result``'s probes, each seed's arrivals in ``met_in_arrival_order``):
    they are measurements of the same curve as the grid's, and the interval pools them. A probe recorded
    before arrivals were kept (no ``met_in_arrival_order``) is left out."""
    return pooled(*(kept_runs({repr(p["load_rps"]): p.get("met_in_arrival_order") or {}}) for p in result.get("probes", [])))


def kept_runs(kept: Mapping[str, Mapping[str, str]]) -> RunsByLoad:
    """Runs as a document keeps them (load -> seed -> :func:`met_string`, as ``grid_runs`` holds each row's) as
    :data:`RunsByLoad`, one run each."""
    return {round(float(load), 9): {int(seed): [met_of(met)] for seed, met in by_seed.items()}
            for load, by_seed in kept.items() if by_seed}


def pooled(*sources: RunsByLoad) -> RunsByLoad:
    """Every run of ``sources``, by load and seed (a seed measured at one load twice has two runs there)."""
    out: RunsByLoad = {}
    for runs in sources:
        for load, by_seed in runs.items():
            for seed, rs in by_seed.items():
                out.setdefault(load, {}).setdefault(seed, []).extend(rs)
    return out


def estimate(runs: RunsByLoad, seeds: int, rng: np.random.Generator, draws: np.ndarray,
             setting: CapacitySetting) -> tuple[slo.CapacityInterval, list[dict]]:
    """A row's 90% capacity with its interval from every run it has (:func:`slo.capacity_interval`, seeds ``0 ..
    seeds - 1`` in ``draws``' order), and the table it was fitted to: per load, the pooled attainment, its
    arrivals and runs."""
    by_load = {load: [runs[load].get(seed, []) for seed in range(seeds)] for load in sorted(runs)}
    est = slo.capacity_interval(by_load, slo.TARGETS[0], rng, resamples=setting.grid_resamples,
                                block_arrivals=GRID_BLOCK_ARRIVALS, draws=draws)
    table = []
    for load, by_seed in by_load.items():
        taken = [run for rs in by_seed for run in rs]
        arrivals = sum(map(len, taken))
        table.append({"load_rps": load, "attainment": sum(map(sum, taken)) / max(arrivals, 1), "arrivals": arrivals,
                      "runs": len(taken)})
    return est, table


def grid(probe: Callable[[Row, float, int], list[bool]], setting: CapacitySetting, rows: list[Row],
         centres: dict[str, float], seed_rng: random.Random, log,
         checkpoint: Callable[[dict], None] | None = None,
         prior: dict[str, RunsByLoad] | None = None) -> dict[str, tuple[slo.CapacityInterval, list[dict]]]:
    """Each row's 90% capacity with its interval: ``probe(row, load, seed)`` (each arrival met or not, in arrival
    order) on ``setting.grid_loads`` loads ``setting.grid_step`` apart centred on ``centres[row]``
    (:func:`grid_centre`: in its bisection's bracket), every seed, rows, loads and seeds interleaved at random.
    The estimate (:func:`estimate`) pools these runs with ``prior[row]``, the row's bisection runs
    (:func:`probe_runs`): one curve, measured twice. Where it is censored (the fit never crosses 90%, or crosses
    before its lowest load), the row gets one more load a step beyond its runs on that side, every seed, up to
    ``setting.grid_extensions`` times. Every row's bootstrap takes the same seeds (its ratios paired by seed). A
    row whose router will not start (:class:`RowFailed`) is left out. ``checkpoint(runs)`` gets every grid run so
    far after each (row -> load -> seed -> its arrivals met, "1" or "0" each, in arrival order). Returns row ->
    (the estimate, the table it was fitted to)."""
    n, step = setting.grid_loads, setting.grid_step
    prior = prior or {}
    mine: dict[str, RunsByLoad] = {r.name: {} for r in rows}  # the grid's own runs, one per load and seed
    failed: set[str] = set()

    def measure(todo: list[tuple[Row, float]]) -> None:  # every seed at each (row, load), interleaved at random
        seeds = list(range(setting.seeds))
        seed_rng.shuffle(seeds)
        for seed in seeds:
            order = list(todo)
            seed_rng.shuffle(order)
            for row, load in order:
                if row.name in failed:
                    continue
                try:
                    met = probe(row, load, seed)
                except RowFailed as err:
                    failed.add(row.name)
                    log(f"grid {row.name}: FAILED {err}")
                    continue
                mine[row.name].setdefault(load, {})[seed] = [met]
                log(f"grid {row.name} @ {load:.3f} seed {seed}: attainment {sum(met) / max(len(met), 1):.3f}")
                if checkpoint is not None:
                    checkpoint({name: {f"{ld:g}": {str(sd): met_string(rs[0]) for sd, rs in by_seed.items()}
                                       for ld, by_seed in by_load.items()} for name, by_load in mine.items()})

    measure([(r, round(centres[r.name] * step ** (k - (n - 1) / 2), 9)) for r in rows for k in range(n)])
    rng = np.random.default_rng(seed_rng.randrange(2**32))
    draws = slo.seed_draws(rng, setting.seeds, setting.grid_resamples)  # every row the same seeds: ratios paired
    out: dict[str, tuple[slo.CapacityInterval, list[dict]]] = {}
    for extension in range(setting.grid_extensions + 1):
        runs = {r.name: pooled(prior.get(r.name, {}), mine[r.name]) for r in rows if r.name not in failed}
        out = {name: estimate(rs, setting.seeds, rng, draws, setting) for name, rs in runs.items()}
        censored = [(r, out[r.name][0].censored) for r in rows if r.name in out and out[r.name][0].censored]
        if not censored or extension == setting.grid_extensions:
            break
        todo = [(r, round(max(runs[r.name]) * step if side == "above-grid" else min(runs[r.name]) / step, 9))
                for r, side in censored]
        log("grid: censored, one more load: " + ", ".join(f"{r.name} @ {load:.3f}" for r, load in todo))
        measure(todo)
    return out


def row_result(search: CapacitySearch, probes: list[dict], setting: CapacitySetting) -> dict:
    by_seed: dict[str, dict[float, float]] = {}
    for p in probes:
        for seed, att in p["per_seed_attainment"].items():
            by_seed.setdefault(seed, {})[p["load_rps"]] = att
    out = {"capacity_rps": {}, "per_seed_capacity_rps": {}, "search": search.describe(), "probes": probes}
    for target in search.targets:
        key = f"{target:g}"
        out["capacity_rps"][key] = search.capacity(target)
        out["per_seed_capacity_rps"][key] = {seed: per_seed_capacity(att, target) for seed, att in by_seed.items()}
    at = nearest_probe(probes, search.capacity(0.9))
    if at is None and probes:  # below every probe: the lowest one shows why
        at = min(probes, key=lambda p: p["load_rps"])
    if at is not None:
        out["at_capacity"] = {k: at[k] for k in ("load_rps", "attainment", "ttft_p50_s", "ttft_p90_s", "ttft_p99_s",
                                                 "goodput_rps", "token_goodput_tps", "refused", "refused_by_bucket",
                                                 "missed_by_bucket", "late_first_token", "slow_stream_only",
                                                 "offload_fraction", "link_utilization", "arrivals")
                              if k in at}
    return out


def nearest_probe(probes: list[dict], load: float) -> dict | None:
    passing = [p for p in probes if abs(p["load_rps"] - load) < 1e-9]
    return passing[0] if passing else None


def ratios(rows: dict, families: dict[str, str], intervals: dict[str, slo.CapacityInterval] | None = None) -> dict:
    """Ours over each family's best, pooled and per seed; ``capacity_ratio_vs_best`` against the best of all;
    ``ablations``: ours over each of our other rows that ran (an ablation, or the model as given), the same
    way. With ``intervals`` (the grid's estimates, by row), each 90% ratio also gets ``interval``: the ratio of the
    two estimates with its confidence interval and ``ahead`` (its lower bound above 1)."""
    intervals = intervals or {}
    if "prfaas" not in rows:
        return {}
    ablations = [name for name in rows if name != "prfaas" and rows_mod.is_ours(name)]
    out = {}
    for target in ("0.9", "0.99"):
        per_family = {fam: {"row": name, **_versus(rows, name, target, intervals)}
                      for fam, name in families.items() if name in rows}
        per_ablation = {name: _versus(rows, name, target, intervals) for name in ablations}
        x = {"ablations": per_ablation} if per_ablation else {}
        if per_family:
            best_family = max(per_family, key=lambda f: rows[per_family[f]["row"]]["capacity_rps"][target])
            x |= {"vs": per_family, "best_other": families[best_family],
                  "capacity_ratio_vs_best": per_family[best_family]["ratio"],
                  "capacity_ratio_vs_best_per_seed": per_family[best_family]["per_seed"]}
        if x:
            out[target] = x
    return out


def _versus(rows: dict, name: str, target: str, intervals: dict[str, slo.CapacityInterval]) -> dict:
    """Ours (row ``prfaas``) over row ``name`` at ``target``: pooled, its spread over seeds (a seed where that row
    met the target at no probed load has no finite ratio and is left out) and, at 90% where the grid estimated
    both, the paired interval."""
    ours, theirs = rows["prfaas"], rows[name]
    pooled = theirs["capacity_rps"][target]
    their_seeds = theirs["per_seed_capacity_rps"][target]
    per_seed = [v / their_seeds[k] for k, v in ours["per_seed_capacity_rps"][target].items() if their_seeds.get(k)]
    out = {"ratio": ours["capacity_rps"][target] / pooled if pooled else None, "per_seed": spread(per_seed)}
    if float(target) == slo.TARGETS[0] and "prfaas" in intervals and name in intervals:
        out["interval"] = slo.ratio_interval(intervals["prfaas"], intervals[name])
    return out


def run(setting: CapacitySetting, families: tuple[str, ...] = rows_mod.FAMILIES, ours: tuple[str, ...] | None = None,
        log_dir: Path | None = None, seed: int = 0, log=print, quick: bool = False,
        peers: tuple[str, ...] | None = None, partial: Path | None = None, starts: dict[str, float] | None = None) -> dict:
    """The sweep, then the bisection of ours and each family's best; the result document. ``quick``: each
    family's grid is its first configuration alone (no sweep runs). ``peers``: these peer rows are bisected
    as each family's best, without a sweep (the best found in another condition's sweep). ``partial``: the
    document so far is written there after the sweep, after each round and after each grid run (a run cut short keeps them).
    ``starts``: where these rows' bisections start, x planned (over the sweep's)."""
    log_dir = log_dir or Path(tempfile.mkdtemp(prefix="prfaas-capacity-"))
    planned = planned_capacity(setting)
    fleet = Fleet(setting, log_dir)
    runner = Runner(setting, fleet, log_dir, log)
    started = time.monotonic()
    ours_rows = [rows_mod.row_named(n) for n in (ours if ours is not None else [r.name for r in rows_mod.OURS])]
    head = {"condition": setting.condition, "setting": dataclasses.asdict(setting), "ttft_slo_s": setting.ttft_slo,
            "tbt_slo_s": setting.tbt_slo, "planned_capacity_rps": planned, "wire_mbit": setting.wire_mbit,
            "logs": str(log_dir)}

    def write_partial(doc: dict) -> None:  # the document so far, where a run cut short leaves it
        if partial is not None:
            partial.write_text(json.dumps({**head, **doc, "partial": True, "wall_s": time.monotonic() - started}, indent=1))

    def checkpoint(rows: dict, grid_runs: dict | None = None) -> None:
        write_partial({"rows": rows, **({"grid_runs": grid_runs} if grid_runs else {})})

    try:
        if peers is not None:
            families = tuple(dict.fromkeys(rows_mod.ALL[p].family for p in peers))
            swept = {rows_mod.ALL[p].family: {"grid": [{"row": p, "attainment": {}, "mean": None, "why": "given (--peers)"}],
                                               "best": p, "close": [], "loads_x_planned": []} for p in peers}
        else:
            swept = sweep(runner, setting, planned, families, log, quick,
                          checkpoint=lambda so_far: write_partial({"sweep": so_far, "rows": {}}))
        candidates = {name: fam for fam in families for name in (swept[fam]["best"], *swept[fam].get("close", []))}
        starts = {name: start_from_sweep(swept[fam], name) for name, fam in candidates.items()} | (starts or {})
        head["sweep"] = swept
        checkpoint({})
        seed_rng = random.Random(seed)
        capacity = bisect(runner, setting, planned, ours_rows + [rows_mod.ALL[n] for n in candidates], log, seed_rng,
                          starts, checkpoint)
        best = final_best({fam: swept[fam] for fam in families}, capacity)
        reported = ours_rows + [rows_mod.ALL[n] for n in best.values()]
        intervals = {}
        if setting.grid_loads >= 2:
            def probe(row: Row, load: float, seed_no: int) -> list[bool]:
                run_ = runner.run(row, load, seed_no, setting.scored_per_seed)
                return [o.meets(setting.ttft_slo, setting.tbt_slo) for o in run_["outcomes"]]

            alive = [r for r in reported if "failed" not in capacity[r.name]]
            centres = {r.name: grid_centre(capacity[r.name], setting, FLOOR * planned) for r in alive}
            kept: dict = {}

            def keep(runs: dict) -> None:  # a run cut short keeps the grid's runs; so does the document
                kept.update(runs)
                checkpoint(capacity, runs)

            intervals = grid(probe, setting, alive, centres, seed_rng, log, keep,
                             prior={r.name: probe_runs(capacity[r.name]) for r in alive})
            for name, (est, table) in intervals.items():
                capacity[name]["interval"] = {**est.as_dict(), "grid": table}
            head["grid_runs"] = kept
    finally:
        runner.close()
        fleet.close()
    return {**head, "best_config": best, "rows": capacity,
            "ratios": ratios(capacity, best, {k: v[0] for k, v in intervals.items()}), "wall_s": time.monotonic() - started}


def piece_of(cond: dict) -> str:
    """What one run of a condition compared: the peer families it swept (``none``) and our rows."""
    families = ",".join(cond.get("sweep") or {}) or "none"
    return f"{families}; ours {','.join(name for name in cond['rows'] if rows_mod.is_ours(name))}"


def merge(documents: list[dict]) -> dict:
    """Runs (their documents, or merged ones) into one document. A condition may run in pieces, each one family
    (``--families``) beside ours: one entry per condition and piece (:func:`piece_of`; a later run of the same
    piece replaces the earlier), each stamped ``piece`` where its condition has several, and per such condition
    ``across[condition]``: the best peer of all its pieces and ours over it as measured in that peer's own piece
    (a ratio never divides figures from two runs). The pieces of one condition must have run with one setting:
    ConfigError naming the fields that differ."""
    pieces: dict[tuple[str, str], dict] = {}
    for doc in documents:
        for cond in doc.get("conditions", [doc]):
            pieces[(cond["condition"], piece_of(cond))] = cond
    by_condition: dict[str, list[tuple[str, dict]]] = {}
    for (name, piece), cond in pieces.items():
        by_condition.setdefault(name, []).append((piece, cond))
    conditions, across = [], {}
    for name, entries in by_condition.items():
        if len(entries) == 1:
            conditions.append(entries[0][1])
            continue
        conds = [{**cond, "piece": piece} for piece, cond in entries]  # copies: the documents given stay as they are
        first = conds[0]["setting"]
        differ = sorted({key for cond in conds[1:] for key in first.keys() | cond["setting"].keys()
                         if cond["setting"].get(key) != first.get(key)})
        if differ:
            raise ConfigError("--merge", f"the pieces of {name} ran with different settings ({', '.join(differ)}): "
                                         "their capacities are not comparable")
        conditions += conds
        across[name] = best_across(conds)
    return {"conditions": conditions, **({"across": across} if across else {})}


def best_across(conds: list[dict]) -> dict | None:
    """The peer row with the highest 90% capacity over the pieces ``conds`` of one condition (each stamped with its
    ``piece``), and ours over it from its own piece (pooled, per seed, the grid's interval where it ran); None
    where no piece ran a peer."""
    candidates = [(cond["rows"][v["row"]]["capacity_rps"]["0.9"], family, v, cond)
                  for cond in conds for family, v in cond.get("ratios", {}).get("0.9", {}).get("vs", {}).items()]
    if not candidates:
        return None
    capacity, family, versus, cond = max(candidates, key=lambda c: c[0])
    return {"best_other": versus["row"], "family": family, "piece": cond["piece"], "capacity_rps": capacity,
            "ours_rps": cond["rows"]["prfaas"]["capacity_rps"]["0.9"], "ratio": versus["ratio"],
            "per_seed": versus["per_seed"], "interval": versus.get("interval")}


def refit(cond: dict, seed: int = 0) -> dict:
    """One condition (a run's document, or its ``.partial.json``) with its intervals and ratios estimated again
    from the runs it keeps (``grid_runs`` and each row's probes, :func:`estimate`), by today's estimator: a run
    made before the estimator changed is read by the same method as one made after. ``seed`` draws the
    bootstrap. A condition that kept no grid runs is returned as it is; one whose grid runs name rows it lacks, or
    with no setting, is a ConfigError."""
    if not cond.get("grid_runs"):
        return cond
    if not isinstance(cond.get("setting"), dict) or set(cond["grid_runs"]) - set(cond.get("rows") or {}):
        raise ConfigError("--refit", f"{cond.get('condition', 'a condition')}: its grid runs name rows it does not have, "
                                     "or it has no setting: not a document bench compare --capacity wrote")
    names = {f.name for f in dataclasses.fields(CapacitySetting)}
    setting = CapacitySetting(**{k: v for k, v in cond["setting"].items() if k in names})
    rng = np.random.default_rng(seed)
    draws = slo.seed_draws(rng, setting.seeds, setting.grid_resamples)
    rows, intervals = dict(cond["rows"]), {}
    for name, kept in cond["grid_runs"].items():
        est, table = estimate(pooled(probe_runs(rows[name]), kept_runs(kept)), setting.seeds, rng, draws, setting)
        rows[name] = {**rows[name], "interval": {**est.as_dict(), "grid": table}}
        intervals[name] = est
    best = cond.get("best_config") or final_best(cond.get("sweep") or {}, rows)
    return {**cond, "rows": rows, "best_config": best, "ratios": ratios(rows, best, intervals), "refit": True}


def load(path: Path) -> dict:
    doc = json.loads(Path(path).read_text())
    return doc.get("result", doc)


# --- the report ----------------------------------------------------------------------------------


def _f(x, fmt="{:.3f}") -> str:
    return "n/a" if x is None else ("inf" if isinstance(x, float) and math.isinf(x) else fmt.format(x))


def render_markdown(result: dict) -> str:
    """Per condition (and piece): the capacity table, the ratios, the sweep; then, per condition run in pieces,
    ours over the best peer of them all (:func:`best_across`)."""
    return "\n\n".join([_render_condition(c) for c in result.get("conditions", [result])] + _render_across(result))


def _render_across(result: dict) -> list[str]:
    """A line per condition run in pieces: its best peer of all pieces and ours over it from that piece."""
    return [f"{name}, across its pieces: " + ("no piece ran a peer" if best is None else
            f"the best peer is {best['best_other']} ({best['family']}, {_f(best['capacity_rps'])} req/s, in piece "
            f"{best['piece']}); ours / it, from that piece: {_f(best['ratio'], '{:.2f}')}"
            f"{_ratio_interval_text(best.get('interval'))}") for name, best in (result.get("across") or {}).items()]


def _render_misses(r: dict) -> list[str]:
    """Where each row loses its attainment at its capacity probe (the lowest probe where none passed): misses
    (refused, failed or late) / arrivals per prompt-length bucket. Empty for results recorded before it was."""
    rows = [(name, row.get("at_capacity") or {}) for name, row in r["rows"].items()]
    if not any(at.get("missed_by_bucket") for _, at in rows):
        return []
    out = ["", "Misses (refused, failed or late) / arrivals by prompt length, the served misses by the SLO they broke, "
           "and the PrfaaS link's mean utilisation, at each row's capacity probe:", ""]
    for name, at in rows:
        if by := at.get("missed_by_bucket"):
            link = at.get("link_utilization")
            kinds = ("" if at.get("late_first_token") is None
                     else f"; first token late {at['late_first_token']}, stream slow only {at['slow_stream_only']}")
            out.append(f"- {name}: " + ", ".join(f"{k} {v[0]}/{v[1]}" for k, v in by.items()) + kinds
                       + ("" if link is None else f"; link {link:.0%} busy"))
    return out


def _render_condition(r: dict) -> str:
    planned = r["planned_capacity_rps"]
    setting = r["setting"]
    lines = [f"**{r['condition']}**{f' (piece: {p})' if (p := r.get('piece')) else ''}: TTFT SLO {r['ttft_slo_s']:g} s, mean TBT <= {1e3 * r['tbt_slo_s']:g} ms (emulated); "
             f"planned capacity of the {r.get('deployment', 'hetero')} deployment {planned:.3f} req/s; {setting['seeds']} seeds x "
             f"{setting['scored_per_seed']} scored arrivals per probe; resolution hi/lo <= {1 + setting['resolution']:g} "
             f"(90%), {1 + setting['resolution_99']:g} (99%); speedup {setting['speedup']:g}, engine noise sigma "
             f"{setting['noise_sigma']:g}, engine truth {setting.get('truth_model', 'profile')}, decode radix cache "
             f"{'on' if setting.get('decode_radix_cache') else 'off'}; the router's prior "
             f"{setting.get('prior') or 'case-study'}; outputs "
             f"{setting['output_tokens']} tokens, streamed every {setting.get('stream_interval', 1)} token(s); "
             f"{r['wall_s'] / 60:.0f} min", "",
             "| row | capacity @90% (req/s) | x planned | per seed [min, max] | @99% | attainment | TTFT p50 / p90 / p99 (s, all arrivals) "
             "| goodput (req/s) | prompt tok/s in SLO | refused (of which >=16K) | offload | engine timing error (prefill / decode) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, row in r["rows"].items():
        c90, c99 = row["capacity_rps"]["0.9"], row["capacity_rps"]["0.99"]
        seeds = list(row["per_seed_capacity_rps"]["0.9"].values())
        at = row.get("at_capacity") or {}
        refused_long = sum(v[0] for k, v in (at.get("refused_by_bucket") or {}).items() if k in ("16K-32K", ">=32K"))
        timing = next((p.get("engine_timing_error") for p in row["probes"] if p.get("engine_timing_error")), {}) or {}
        low = min((p["load_rps"] for p in row["probes"]), default=0.0)
        cap90 = f"{c90:.3f}" if c90 else f"< {low:.3f}"
        cap99 = f"{c99:.3f}" if c99 else f"< {min(low, c90 or low):.3f}"
        lines.append(
            f"| {name} | {cap90} | {c90 / planned:.2f} | [{_f(min(seeds, default=None))}, {_f(max(seeds, default=None))}] "
            f"| {cap99} | {_f(at.get('attainment'))} | {_f(at.get('ttft_p50_s'), '{:.2f}')} / {_f(at.get('ttft_p90_s'), '{:.2f}')} / "
            f"{_f(at.get('ttft_p99_s'), '{:.2f}')} | {_f(at.get('goodput_rps'))} | {_f(at.get('token_goodput_tps'), '{:.0f}')} | "
            f"{at.get('refused', 'n/a')} ({refused_long}) | {_f(at.get('offload_fraction'), '{:.2f}')} | "
            f"{_f(timing.get('prefill'), '{:.3f}')} / {_f(timing.get('decode'), '{:.2f}')} |")
    lines += _render_misses(r)
    lines += _render_intervals(r)
    for target, x in r.get("ratios", {}).items():
        lines += _render_ratios(target, x)
    lines += _render_calibration(r)
    if "global_over" in r:  # a fleet (bench/capacity_fleet.py)
        lines += ["", f"Entry shares {r['entry_shares']}; the partition (planned for the file's shares): {r['partition']} "
                      f"({r['partition_planned_rps']:.3f} req/s planned). Global / "
                      + ", ".join(f"{k} {_f(v, '{:.2f}')}" for k, v in r["global_over"].items())]
    sweep_rows = [(fam, g) for fam, x in r.get("sweep", {}).items() for g in x["grid"] if g["attainment"] or g.get("error")]
    if sweep_rows:
        loads = next(x["loads_x_planned"] for x in r["sweep"].values() if x["loads_x_planned"])
        seeds = max((x.get("seeds", 1) for x in r["sweep"].values()), default=1)
        lines += ["", f"Sweep ({seeds} seed(s) pooled; attainment at " + ", ".join(f"{x:g}x" for x in loads)
                  + " planned, their mean's standard error):", "",
                  "| family | configuration | " + " | ".join(f"{x:g}x" for x in loads) + " | +- | chosen | why |",
                  "|---|---|" + "---|" * len(loads) + "---|---|---|"]
        for fam, g in sweep_rows:
            swept_fam = r["sweep"][fam]
            chosen = ("**best**" if swept_fam["best"] == g["row"] else
                      "close: bisected too" if g["row"] in swept_fam.get("close", []) else "")
            lines.append(f"| {fam} | {g['row']} | " + " | ".join(_f(g["attainment"].get(f"{x:g}")) for x in loads)
                         + f" | {_f(g.get('stderr'))} | {chosen} | {g.get('error') or g['why']} |")
    return "\n".join(lines)


def _render_ratios(target: str, x: dict) -> list[str]:
    """One target's ratios (:func:`ratios`): against the best peer and each family's best, then each ablation."""
    def spread_text(per_seed: dict | None) -> str:
        return f" (per seed: median {per_seed['median']:.2f}, [{per_seed['min']:.2f}, {per_seed['max']:.2f}])" if per_seed else ""

    def each(pairs) -> str:
        return ", ".join(f"{label} {_f(v['ratio'], '{:.2f}')}{_ratio_interval_text(v.get('interval'))}" for label, v in pairs)

    lines = []
    if "vs" in x:
        lines.append(f"\ncapacity_ratio_vs_best @{float(target):.0%}: **{_f(x['capacity_ratio_vs_best'], '{:.2f}')}** "
                     f"vs {x['best_other']}{spread_text(x['capacity_ratio_vs_best_per_seed'])}; ours / each family's best: "
                     + each((f"{fam} ({v['row']})", v) for fam, v in x["vs"].items()))
    if x.get("ablations"):
        lines.append(f"\nours (prfaas) / each of our other rows @{float(target):.0%}: "
                     + each(((f"{name}{spread_text(v['per_seed'])}", v) for name, v in x["ablations"].items())))
    return lines


def _render_intervals(r: dict) -> list[str]:
    """Each row's 90% capacity from the load grid, with its interval (bench/slo.py ``capacity_interval``)."""
    rows = [(name, row["interval"]) for name, row in r["rows"].items() if row.get("interval")]
    if not rows:
        return []
    first = rows[0][1]
    out = ["", "Capacity @90% fitted to every run of the row, a grid of loads in its bisection's bracket and the "
               f"bisection's own probes, every seed ({first['confidence']:.0%} interval, bootstrap over seeds, runs and "
               f"blocks of arrivals, {first['resamples']} resamples):", ""]
    for name, iv in rows:
        censored = f" ({iv['censored']})" if iv["censored"] else ""
        out.append(f"- {name}: {iv['capacity']:.3f} [{iv['low']:.3f}, {iv['high']:.3f}]{censored}; attainment by load: "
                   + ", ".join(f"{g['load_rps']:.3f}: {g['attainment']:.3f}" + (f" ({g['runs']} runs)" if g.get("runs") else "")
                               for g in iv["grid"]))
    return out


def _ratio_interval_text(iv: dict | None) -> str:
    if not iv or iv.get("ratio") is None:
        return ""
    def bound(x: float | None) -> str:  # None: a censored estimate leaves that side open (slo.ratio_interval)
        return "?" if x is None else f"{x:.2f}"

    return f" (grid {iv['ratio']:.2f} [{bound(iv['low'])}, {bound(iv['high'])}]{', ahead' if iv['ahead'] else ''})"


def _render_calibration(r: dict) -> list[str]:
    """Our rows at their 90% capacity probe: the learned prefill scales and the TTFT prediction error per 25
    completed requests of a run (the router starts afresh each run), median over seeds."""
    out = []
    for name, row in r["rows"].items():
        at = nearest_probe(row["probes"], row["capacity_rps"]["0.9"]) or (row["probes"][0] if row["probes"] else None)
        runs = (at or {}).get("calibration") or []
        if not runs:
            continue
        scales = {c: statistics.median(x["prefill_scale"][c] for x in runs) for c in ("prfaas", "pd")}
        groups = min(len(x["ttft_error_series"]) for x in runs)
        # the window's median error; a run recorded before the series carried it, its mean (so labelled)
        key = "median_relative_error" if all("median_relative_error" in g for x in runs for g in x["ttft_error_series"]) \
            else "mean_relative_error"
        series = [statistics.median(x["ttft_error_series"][i][key] for x in runs) for i in range(groups)]
        if not out:
            out += ["", "Our router at its capacity probe (median over seeds): learned prefill scales, and the TTFT "
                        "prediction error |predicted - observed| / observed per 25 completed requests of a run:", ""]
        out.append(f"- {name} @ {at['load_rps']:.3f} req/s: scale prfaas {scales['prfaas']:.2f}, pd {scales['pd']:.2f}; "
                   f"error ({key.split('_')[0]} of a window) " + " -> ".join(f"{e:.2f}" for e in series))
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``compare`` subcommand: :func:`prfaas_sglang.bench.compare.add_arguments`, then ``--capacity``'s flags."""
    compare.add_arguments(parser)
    cap = parser.add_argument_group("capacity at an SLO (--capacity; bench/capacity.py)")
    cap.add_argument("--capacity", action="store_true", help="capacity at >= 90%% and >= 99%% attainment, every row")
    cap.add_argument("--quick", action="store_true", help="a smoke run: one seed, few arrivals, coarse bisection, "
                                                          "ours and sglang-router's default only (under 10 min)")
    cap.add_argument("--families", default=None,
                     help=f"peer families swept and bisected: comma list of {', '.join(rows_mod.FAMILIES)}, "
                          "or none (default: all)")
    cap.add_argument("--ours", default=None, help="our rows (default: prfaas and its ablations)")
    cap.add_argument("--peers", default=None,
                     help="peer rows to bisect as given, one per family, without a sweep (e.g. the best another "
                          "condition's sweep found)")
    cap.add_argument("--start", action="append", default=[], metavar="ROW=X",
                     help="where ROW's bisection starts, x the planned capacity (repeatable; default: above the "
                          "sweep's best load that met 90%%, 0.9 without one), e.g. a capacity another run found")
    cap.add_argument("--link-drop", action="store_true", help="the link's capacity / 4 for one emulated minute")
    cap.add_argument("--layerwise", action="store_true",
                     help="the PrfaaS engines stream KV by layer group while they prefill (the topology's "
                          "links[].layerwise, every row) and our router's estimate overlaps it; named in the condition")
    cap.add_argument("--prior", default=None, metavar="WORKLOAD",
                     help="the router's workload prior (case-study or trace:PATH); default: the case study, whatever the "
                          "workload evaluated (a trace condition's router does not start from the trace)")
    cap.add_argument("--output-tokens", type=int, default=None,
                     help=f"tokens each request generates (default {CASE_STUDY_OUTPUT_TOKENS}, the paper's case study; "
                          "--quick: 64); another length is named in the condition (out-N)")
    cap.add_argument("--stream-interval", type=int, default=None, metavar="N",
                     help="every engine streams every Nth token (SGLang's --stream-interval; default 1); the client "
                          "counts tokens from each chunk's usage")
    cap.add_argument("--bias", type=float, default=None,
                     help="the engines' prefill and decode take this x the profile (the study: ours with calibration "
                          "on, off, and with the true scale given; no peers)")
    cap.add_argument("--rounds", type=int, default=None,
                     help="stop after this many bisection rounds (default 8); the brackets reached are the result")
    cap.add_argument("--scored", type=int, default=None, metavar="N",
                     help="scored arrivals per seed and probe (default 70); more for a long look at one load, such "
                          "as the calibration's error after 100 completed requests")
    cap.add_argument("--warmup-s", type=float, default=None, metavar="S",
                     help="emulated seconds of unscored arrivals before each probe's scored ones (default: as long as the "
                          "cool-down, the longest a scored request may take: 63.7 s for the case study)")
    cap.add_argument("--grid-loads", type=int, default=None, metavar="N",
                     help="loads of the grid in each bisection's bracket (default 7); 0: no grid, the bisection's "
                          "bracket is the result and no interval is given")
    cap.add_argument("--topology", type=Path, default=None,
                     help="a fleet of several clusters (bench/capacity_fleet.py): the global scheduler against a "
                          "router per region and the best static partition, on one emulated deployment of the file")
    cap.add_argument("--entry", default=None, metavar="PD=SHARE,...",
                     help="--topology: arrivals enter at these shares (the partition stays planned for the file's)")
    cap.add_argument("--drop-link", default=None, metavar="PRFAAS->PD",
                     help="--topology: this link's capacity / 4 for one emulated minute")
    cap.add_argument("--nodes-per-role", type=int, default=None,
                     help="--topology: keep this many nodes of each role per cluster (default: all)")
    cap.add_argument("--out", type=Path, default=None, help="also write the JSON result here (a piece to --merge)")
    cap.add_argument("--merge", type=Path, nargs="+", default=None,
                     help="merge runs written with --out (no run) and print them; a condition may run in pieces, "
                          "each one peer family (--families) beside ours")
    cap.add_argument("--refit", action="store_true",
                     help="with --merge: each run's intervals and ratios estimated again from the runs it kept "
                          "(its grid's and its bisection's), by today's estimator (a .partial.json too)")
    cap.add_argument("--plot", type=Path, default=None, metavar="DIR",
                     help="also write attainment against offered load, one PNG per condition (bench/capacity_plots.py)")


def cli(args: argparse.Namespace, inv: Invocation) -> int:
    """``compare``: with ``--capacity`` (or ``--merge``) the capacity at an SLO, else
    :func:`prfaas_sglang.bench.compare.cli`."""
    if not (args.capacity or args.merge):
        return compare.cli(args, inv)
    result, header = _capacity_run(args, inv)
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1))
    if args.plot is not None:
        from prfaas_sglang.bench.capacity_plots import write_attainment_plots

        try:
            for path in write_attainment_plots(result, args.plot):
                print(f"wrote {path}", file=sys.stderr)
        except ConfigError as err:
            inv.error(str(err))
    return inv.report(args, result, header, render_markdown)


def _capacity_run(args: argparse.Namespace, inv: Invocation) -> tuple[dict, str]:
    """``compare --capacity`` (or ``--merge``): the setting from the flags, the run, its header line."""
    if args.out is not None and not args.out.parent.is_dir():  # refused before anything starts, not at the first checkpoint
        inv.error(f"--out: no directory {args.out.parent}")
    if args.merge:
        try:
            docs = [load(p) for p in args.merge]
            if args.refit:
                docs = [{**d, "conditions": [refit(c) for c in d["conditions"]]} if "conditions" in d else refit(d)
                        for d in docs]
            return merge(docs), f"<!-- merged {len(args.merge)} pieces{', refitted' if args.refit else ''}; {inv.stamp} -->"
        except ConfigError as err:  # pieces of one condition run with different settings
            inv.error(str(err))
    from prfaas_sglang.demo.netns import available

    if (why := available()) is not None:
        inv.error(f"the shaped PrfaaS link {why}")
    if args.workload not in ("case-study", "shift") and not args.workload.startswith("trace:"):
        inv.error("--workload: case-study, shift or trace:PATH")
    if args.topology is not None:
        return _fleet_run(args, inv)
    families = rows_mod.FAMILIES if args.families is None else tuple(f for f in args.families.split(",") if f != "none")
    if unknown := set(families) - set(rows_mod.FAMILIES):
        inv.error(f"unknown families {sorted(unknown)}")
    ours = tuple(args.ours.split(",")) if args.ours else None
    if args.ttft_slo_s is not None and not args.ttft_slo_s > 0:
        inv.error("--ttft-slo-s must be > 0")
    setting = CapacitySetting(workload=args.workload, link=args.link, link_drop=args.link_drop,
                              speedup=args.speedup or 4.0, ttft_slo_s=args.ttft_slo_s, layerwise=args.layerwise)
    if args.seeds is not None:
        setting = dataclasses.replace(setting, seeds=args.seeds)
    if args.output_tokens is not None:
        if not 1 <= args.output_tokens <= 8192:
            inv.error("--output-tokens must be in [1, 8192]")
        setting = dataclasses.replace(setting, output_tokens=args.output_tokens)
    if args.prior is not None:
        try:
            workloads.prior(args.prior, MAX_INPUT_TOKENS)
        except ConfigError as err:
            inv.error(f"--prior: {err.problem}")
        setting = dataclasses.replace(setting, prior=args.prior)
    if args.rounds is not None:
        if args.rounds < 1:
            inv.error("--rounds must be >= 1")
        setting = dataclasses.replace(setting, max_rounds=args.rounds)
    if args.scored is not None:
        if not 10 <= args.scored <= 2000:
            inv.error("--scored must be in [10, 2000]")
        setting = dataclasses.replace(setting, scored_per_seed=args.scored)
    if args.warmup_s is not None:
        if not 0 <= args.warmup_s <= 600:
            inv.error("--warmup-s must be in [0, 600]")
        setting = dataclasses.replace(setting, warmup_s=args.warmup_s)
    if args.grid_loads is not None:
        if args.grid_loads == 1 or not 0 <= args.grid_loads <= 15:
            inv.error("--grid-loads must be 0 (no grid) or in [2, 15]")
        setting = dataclasses.replace(setting, grid_loads=args.grid_loads)
    if args.stream_interval is not None:
        if not 1 <= args.stream_interval <= 64:
            inv.error("--stream-interval must be in [1, 64]")
        setting = dataclasses.replace(setting, stream_interval=args.stream_interval)
    if args.bias is not None:
        if not 0.1 <= args.bias <= 10:
            inv.error("--bias must be in [0.1, 10]")
        setting = dataclasses.replace(setting, prefill_bias=args.bias, decode_bias=args.bias)
        families = ()
        ours = ours or ("prfaas", "prfaas-no-calibration", rows_mod.oracle_row(args.bias).name)
    if args.quick:  # the CI smoke: the method end to end at its smallest (its figures mean nothing)
        setting = dataclasses.replace(setting, seeds=1, scored_per_seed=12, sweep_scored=8, warmup_s=5.0,
                                      resolution=0.5, resolution_99=1.0, max_rounds=3, speedup=args.speedup or 8.0,
                                      output_tokens=args.output_tokens or 64, grid_loads=2, grid_step=1.5, grid_extensions=0,
                                      grid_resamples=200, sweep_seeds=1)
        families = tuple(f for f in families if f == "sglang-router")[:1]
        ours = ours or ("prfaas",)
    if ours and (unknown := [n for n in ours if not _known_row(n)]):
        inv.error(f"unknown rows {unknown}")
    peers = tuple(args.peers.split(",")) if args.peers else None
    if peers and (unknown := [n for n in peers if n not in rows_mod.ALL or rows_mod.ALL[n].family == "ours"]):
        inv.error(f"unknown peer rows {unknown}")
    swept = [r for f in families for r in (rows_mod.family_rows(f)[:1] if args.quick else rows_mod.family_rows(f))]
    for row in swept + [rows_mod.ALL[n] for n in peers or ()]:
        try:  # every peer knob the run may start, at this speedup: refused before any deployment starts
            peer_args(row.args, setting.speedup)
        except rows_mod.KnobClockError as err:
            inv.error(f"{row.name}: {err}")
    starts = {}
    for item in args.start:
        name, _, value = item.partition("=")
        try:
            starts[name] = float(value)
        except ValueError:
            inv.error(f"--start: expected ROW=X, got {item!r}")
        if not _known_row(name) or not 0 < starts[name] <= 4:
            inv.error(f"--start {item!r}: a known row and 0 < X <= 4")
    result = run(setting, families, ours, quick=args.quick, peers=peers, starts=starts,
                 partial=args.out.with_suffix(".partial.json") if args.out else None,
                 log=lambda m: print(m, file=sys.stderr, flush=True))
    header = (f"<!-- python -m prfaas_sglang.bench compare --capacity --workload {args.workload} --link {args.link}"
              f"{' --link-drop' if args.link_drop else ''}{' --layerwise' if args.layerwise else ''}"
              f"{f' --bias {args.bias:g}' if args.bias else ''}"
              f"{f' --stream-interval {setting.stream_interval}' if setting.stream_interval != 1 else ''}"
              f"{f' --ttft-slo-s {args.ttft_slo_s:g}' if args.ttft_slo_s else ''} --output-tokens {setting.output_tokens}"
              f"{f' --prior {args.prior}' if args.prior else ''}"
              f"{f' --rounds {args.rounds}' if args.rounds else ''}{f' --scored {args.scored}' if args.scored else ''}"
              f"{f' --warmup-s {args.warmup_s:g}' if args.warmup_s is not None else ''}"
              f"{f' --grid-loads {args.grid_loads}' if args.grid_loads is not None else ''}{' --quick' if args.quick else ''}{f' --peers {args.peers}' if args.peers else ''}"
              f"{f' --ours {args.ours}' if args.ours else ''}{''.join(f' --start {x}' for x in args.start)} "
              f"--seeds {setting.seeds} --speedup {setting.speedup:g}; {inv.stamp} -->")
    return result, header


def _fleet_run(args: argparse.Namespace, inv: Invocation) -> tuple[dict, str]:
    """``--capacity --topology FILE``: bench/capacity_fleet.py on that fleet."""
    from prfaas_sglang.bench import capacity_fleet

    if not args.topology.is_file():
        inv.error(f"--topology: no file {args.topology}")
    shares = None
    if args.entry:
        try:
            shares = {k.strip(): float(v) for k, v in (item.split("=") for item in args.entry.split(","))}
        except ValueError:
            inv.error(f"--entry: expected PD=SHARE,..., got {args.entry!r}")
        if abs(sum(shares.values()) - 1) > 1e-6 or min(shares.values()) < 0:
            inv.error("--entry: shares must be >= 0 and sum to 1")
    if args.nodes_per_role is not None and args.nodes_per_role < 1:
        inv.error("--nodes-per-role must be >= 1")
    if args.output_tokens is not None and not 1 <= args.output_tokens <= 8192:
        inv.error("--output-tokens must be in [1, 8192]")
    setting = CapacitySetting(workload=args.workload, speedup=args.speedup or 4.0, ttft_slo_s=args.ttft_slo_s or 10.0,
                              seeds=args.seeds or 3, max_rounds=args.rounds or 8,
                              output_tokens=args.output_tokens or (64 if args.quick else CASE_STUDY_OUTPUT_TOKENS))
    if args.quick:
        setting = dataclasses.replace(setting, seeds=1, scored_per_seed=20, warmup_s=10.0, resolution=0.5,
                                      resolution_99=1.0, max_rounds=3)
    condition = capacity_fleet.FleetCondition(args.topology, args.nodes_per_role, shares, args.drop_link)
    try:
        result = capacity_fleet.run(setting, condition, log=lambda m: print(m, file=sys.stderr, flush=True),
                                    partial=args.out.with_suffix(".partial.json") if args.out else None)
    except (ConfigError, KeyError) as err:
        inv.error(f"--topology: {err}")
    header = (f"<!-- python -m prfaas_sglang.bench compare --capacity --topology {args.topology}"
              f"{f' --entry {args.entry}' if args.entry else ''}{f' --drop-link {args.drop_link}' if args.drop_link else ''}"
              f"{f' --nodes-per-role {args.nodes_per_role}' if args.nodes_per_role else ''} --seeds {setting.seeds} "
              f"--speedup {setting.speedup:g}; {inv.stamp} -->")
    return result, header


def _known_row(name: str) -> bool:
    try:
        rows_mod.row_named(name)
    except (KeyError, ValueError):
        return False
    return True


SUBCOMMANDS = {"compare": Subcommand(add_arguments, cli)}
