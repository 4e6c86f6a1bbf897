"""Capacity at an SLO, measured as a serving expert measures it (pure: no clocks, no I/O).

Every arrival ends in one :class:`Outcome`, in model seconds. It *meets the SLO* when it
was served, its first token came within ``ttft_slo_s`` and its mean time between tokens
within ``tbt_slo_s``. A refusal (429/503 before any work), a failure, or a request whose
first token never came before the harness gave up on it is a **miss**: attainment is
over all arrivals, so refusing work is never throughput.

:func:`score` summarises one probe (one offered load, arrivals pooled over seeds)::

    attainment        met / arrivals
    ttft_p50/90/99_s  over all arrivals, a request never served counted as infinite
    goodput_rps       met / the arrival window
    token_goodput     prompt tokens of the requests that met the SLO / the arrival window
    refused_by_bucket refusals per prompt-length bucket (long prompts refused show here)
    missed_by_bucket  misses of either kind (refused, failed, late) per prompt-length bucket: where the
                      attainment is lost

:class:`CapacitySearch` finds, per attainment target (0.90 and 0.99), the highest offered
load that meets it, by expanding and then bisecting (geometric midpoints) until the
bracket ``[lo, hi]`` satisfies ``hi / lo <= 1 + resolution``: ``lo`` passed, ``hi`` failed.
Attainment is assumed to fall with load; a pass above a recorded failure is not credited
(the bracket stays conservative). One probe informs every target.

:func:`capacity_interval` estimates the same capacity with a confidence interval from a fixed grid
of loads around the crossing (every load's arrivals, in arrival order, per run): attainment fitted
non-increasing in load (isotonic, weighted by arrivals), the crossing of ``target`` interpolated in
log load between the two grid loads that bracket it, and a percentile interval from a bootstrap over
seeds, then over each taken seed's runs at a load, then over each taken run's arrivals (in blocks, since
a run's neighbouring arrivals share a queue). On synthetic curves of several shapes and a 9-load grid
5-10% apart it covers the true crossing in 92-96 of 100 trials (tests/bench/test_slo.py). Resampling arrivals alone misses what varies from run
to run (a seed's slow periods move its whole curve): with three seeds whose crossings spread by 5%, that
interval covered 69 of 100, resampling seeds too 84 (fewer seeds than the spread needs still cover short).
A row's runs are pooled wherever they were made (the bisection's probes beside the grid): with seeds and
runs each stretching the curve by 5%, 3 seeds and a 5-load grid placed within 10% of the crossing, the grid
alone was censored in 12 of 60 trials and covered 44; pooled with three probes, censored in 2 and covered
51 (short of 95%: three seeds are few).
:func:`ratio_interval` divides two such estimates replicate by replicate, paired by seed.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from prfaas_sglang.stats import percentile

TARGETS = (0.90, 0.99)
LENGTH_BUCKETS = ((0, 4096, "<4K"), (4096, 16384, "4K-16K"), (16384, 32768, "16K-32K"), (32768, math.inf, ">=32K"))


@dataclass(frozen=True)
class Outcome:
    """One arrival, in model seconds. ``ttft_s`` None: no first token (refused, failed, or given up on)."""

    input_tokens: int
    ttft_s: float | None
    mean_tbt_s: float | None = None
    refused: bool = False
    failed: bool = False

    def meets(self, ttft_slo_s: float, tbt_slo_s: float) -> bool:
        return (not self.refused and not self.failed and self.ttft_s is not None and self.ttft_s <= ttft_slo_s
                and (self.mean_tbt_s or 0.0) <= tbt_slo_s)


def bucket_of(input_tokens: int) -> str:
    return next(name for lo, hi, name in LENGTH_BUCKETS if lo <= input_tokens < hi)


@dataclass(frozen=True)
class ProbeScore:
    arrivals: int
    met: int
    refused: int
    failed: int
    unserved: int  # neither refused nor failed, and no first token before the harness gave up
    attainment: float
    ttft_p50_s: float
    ttft_p90_s: float
    ttft_p99_s: float
    goodput_rps: float
    token_goodput_tps: float
    refused_by_bucket: dict[str, list[int]]  # bucket -> [refused, arrivals]
    missed_by_bucket: dict[str, list[int]] = field(default_factory=dict)  # bucket -> [missed, arrivals]
    late_first_token: int = 0  # served, its first token after the TTFT SLO
    slow_stream_only: int = 0  # its first token in time, its mean time between tokens over the TBT SLO

    def as_dict(self) -> dict:
        return {k: (None if isinstance(v, float) and math.isinf(v) else v) for k, v in vars(self).items()}


def score(outcomes: Sequence[Outcome], window_s: float, ttft_slo_s: float, tbt_slo_s: float) -> ProbeScore:
    """One probe's figures over ``outcomes`` (every scored arrival) in an arrival window of ``window_s``.
    An infinite percentile is written ``None`` by :meth:`ProbeScore.as_dict` (JSON has no infinity)."""
    if not outcomes:
        raise ValueError("a probe needs at least one arrival")
    met = [o for o in outcomes if o.meets(ttft_slo_s, tbt_slo_s)]
    ttfts = [math.inf if o.ttft_s is None or o.refused or o.failed else o.ttft_s for o in outcomes]
    by_bucket: dict[str, list[int]] = {name: [0, 0] for _, _, name in LENGTH_BUCKETS}
    missed_by: dict[str, list[int]] = {name: [0, 0] for _, _, name in LENGTH_BUCKETS}
    for o in outcomes:
        name = bucket_of(o.input_tokens)
        by_bucket[name][0] += o.refused
        by_bucket[name][1] += 1
        missed_by[name][0] += not o.meets(ttft_slo_s, tbt_slo_s)
        missed_by[name][1] += 1
    refused = sum(o.refused for o in outcomes)
    failed = sum(o.failed and not o.refused for o in outcomes)
    served = [o for o in outcomes if not o.refused and not o.failed and o.ttft_s is not None]
    return ProbeScore(
        arrivals=len(outcomes), met=len(met), refused=refused, failed=failed,
        unserved=sum(o.ttft_s is None and not o.refused and not o.failed for o in outcomes),
        attainment=len(met) / len(outcomes),
        ttft_p50_s=percentile(ttfts, 0.50), ttft_p90_s=percentile(ttfts, 0.90), ttft_p99_s=percentile(ttfts, 0.99),
        goodput_rps=len(met) / window_s, token_goodput_tps=sum(o.input_tokens for o in met) / window_s,
        refused_by_bucket={k: v for k, v in by_bucket.items() if v[1]},
        late_first_token=sum(o.ttft_s > ttft_slo_s for o in served),
        slow_stream_only=sum(o.ttft_s <= ttft_slo_s and (o.mean_tbt_s or 0.0) > tbt_slo_s for o in served),
        missed_by_bucket={k: v for k, v in missed_by.items() if v[1]})


@dataclass
class CapacitySearch:
    """Bisection on offered load for each attainment target. ``start``: the first load probed;
    ``resolution``: done when ``hi / lo <= 1 + resolution`` (``coarse``: the same for the targets
    above ``coarse_above``, whose probes cost as much for a figure read less finely); loads stay in ``[floor, ceiling]`` (a
    target whose bracket would leave it is resolved there: capacity below ``floor`` reads 0, above
    ``ceiling`` reads ``ceiling``); ``expand``: the factor of each step while not yet bracketed."""

    start: float
    resolution: float = 0.10
    floor: float = 0.05
    ceiling: float = 8.0
    expand: float = 1.5
    targets: tuple[float, ...] = TARGETS
    coarse: float | None = None
    coarse_above: float = 0.95
    probes: dict[float, float] = field(default_factory=dict)  # load -> attainment

    def resolution_of(self, target: float) -> float:
        return self.coarse if self.coarse is not None and target > self.coarse_above else self.resolution

    def __post_init__(self) -> None:
        if not 0 < self.floor <= self.start <= self.ceiling:
            raise ValueError(f"need 0 < floor <= start <= ceiling, got {self.floor}, {self.start}, {self.ceiling}")
        if self.resolution <= 0 or self.expand <= 1:
            raise ValueError("resolution must be > 0 and expand > 1")

    def record(self, load: float, attainment: float) -> float:
        """Record a probe; returns the load as the search names it (in its brackets)."""
        key = round(load, 9)
        self.probes[key] = attainment
        return key

    def bracket(self, target: float) -> tuple[float | None, float | None]:
        """(lo, hi): the lowest failing load ``hi`` and the highest passing load below it ``lo``."""
        fails = [load for load, a in self.probes.items() if a < target]
        hi = min(fails) if fails else None
        passes = [load for load, a in self.probes.items() if a >= target and (hi is None or load < hi)]
        return (max(passes) if passes else None), hi

    def _next_for(self, target: float) -> float | None:
        lo, hi = self.bracket(target)
        if lo is None and hi is None:
            return self.start
        # A probe's load is recorded rounded to 9 digits (``record``), which may put the floor a hair
        # above itself: the ends are compared with a margin far above that and far below any step.
        if lo is None:
            nxt = hi / self.expand
            return None if hi <= self.floor * (1 + 1e-6) else max(nxt, self.floor)
        if hi is None:
            return None if lo >= self.ceiling * (1 - 1e-6) else min(lo * self.expand, self.ceiling)
        if hi / lo <= 1 + self.resolution_of(target):
            return None
        return math.sqrt(lo * hi)

    def next_load(self) -> float | None:
        """The next load to probe (the first unresolved target's), or None when every target is resolved."""
        for target in self.targets:
            nxt = self._next_for(target)
            if nxt is not None:
                return nxt
        return None

    def capacity(self, target: float) -> float:
        """The highest load shown to meet ``target`` (0.0 if none did)."""
        lo, _ = self.bracket(target)
        return lo or 0.0

    def describe(self) -> dict:
        return {"probes": [{"load": load, "attainment": a} for load, a in sorted(self.probes.items())],
                "resolution": {f"{t:g}": self.resolution_of(t) for t in self.targets},
                "brackets": {f"{t:g}": dict(zip(("lo", "hi"), self.bracket(t), strict=True)) for t in self.targets}}


def per_seed_capacity(attainment_by_load: Mapping[float, float], target: float) -> float:
    """One seed's capacity on the probed loads: the highest load such that every probed load up to it
    met ``target`` (0.0 when the lowest probe missed)."""
    capacity = 0.0
    for load in sorted(attainment_by_load):
        if attainment_by_load[load] < target:
            break
        capacity = load
    return capacity


def spread(values: Iterable[float]) -> dict | None:
    """Median, min and max (None for no values)."""
    vs = [v for v in values if v is not None]
    return {"median": statistics.median(vs), "min": min(vs), "max": max(vs)} if vs else None


@dataclass(frozen=True)
class CapacityInterval:
    """Capacity at ``target`` attainment (a load, in the grid's unit) with its ``confidence`` interval
    ``[low, high]``. ``censored``: ``"below-grid"`` when the fit misses ``target`` already at the lowest
    load (capacity is at most that load, reported as it), ``"above-grid"`` when it meets it at the
    highest (at least that load); None when the grid brackets the crossing. ``samples``: the bootstrap
    replicates' capacities (what :func:`ratio_interval` divides)."""

    target: float
    capacity: float
    low: float
    high: float
    confidence: float
    censored: str | None
    samples: tuple[float, ...] = field(repr=False, compare=False)

    def as_dict(self) -> dict:
        return {"target": self.target, "capacity": self.capacity, "low": self.low, "high": self.high,
                "confidence": self.confidence, "censored": self.censored, "resamples": len(self.samples)}


def fitted_crossing(loads: np.ndarray, met: np.ndarray, arrivals: np.ndarray, target: float) -> tuple[float, str | None]:
    """Where attainment, fitted non-increasing in load, crosses ``target``: interpolated in log load
    between the last grid load at or above it and the first below it; the end load and how it is
    censored when the fit never crosses. ``loads`` ascending; ``met`` and ``arrivals`` per load."""
    from scipy.optimize import isotonic_regression

    fit = isotonic_regression(met / arrivals, weights=arrivals, increasing=False).x
    below = np.flatnonzero(fit < target)
    if below.size == 0:
        return float(loads[-1]), "above-grid"
    i = int(below[0])
    if i == 0:
        return float(loads[0]), "below-grid"
    share = (fit[i - 1] - target) / (fit[i - 1] - fit[i])
    return float(np.exp(np.log(loads[i - 1]) + share * (np.log(loads[i]) - np.log(loads[i - 1])))), None


def _resampled_met(run: np.ndarray, rng: np.random.Generator, resamples: int, block_arrivals: int) -> np.ndarray:
    """Met arrivals of ``resamples`` block-bootstrap copies of one run (circular blocks of ``block_arrivals``)."""
    k = run.size
    blocks = -(-k // block_arrivals)
    starts = rng.integers(0, k, (resamples, blocks))
    index = (starts[:, :, None] + np.arange(block_arrivals)).reshape(resamples, -1)[:, :k] % k
    return run[index].sum(axis=1)


def seed_draws(rng: np.random.Generator, seeds: int, resamples: int = 1000) -> np.ndarray:
    """Which seeds each bootstrap replicate takes, with replacement: ``(resamples, seeds)`` indices. Pass
    the same draws to every row of one grid so that its rows' replicates are paired seed by seed (rows run
    on one seed share its arrivals and the engines' slow periods: the ratio's interval sees that)."""
    if seeds < 1 or resamples < 1:
        raise ValueError("need seeds >= 1 and resamples >= 1")
    return rng.integers(0, seeds, (resamples, seeds))


def capacity_interval(runs_by_load: Mapping[float, Sequence[Sequence[Sequence[bool]]]], target: float,
                      rng: np.random.Generator, *, resamples: int = 1000, confidence: float = 0.95,
                      block_arrivals: int = 10, draws: np.ndarray | None = None) -> CapacityInterval:
    """Capacity at ``target`` from runs at several loads (see the module). ``runs_by_load[load][i]`` holds seed
    ``i``'s runs at that load (none, one, or several: a bisection's probe and a grid's run at one load), each
    run the arrivals' met-or-not in arrival order. Every load lists the same seeds; needs two loads or more,
    every one with arrivals. The bootstrap has three stages: each replicate takes the seeds ``draws`` names
    (:func:`seed_draws`; drawn here when None), the same seeds at every load (a seed's runs share its arrivals
    and slow periods, so what it does moves its whole curve); at each load it takes as many of each taken
    seed's runs there as it has, with replacement (runs of one seed and load differ too: a 2% change in load
    moved one seed from 0.97 to 0.76); then it resamples each taken run's arrivals in blocks. With one seed and
    one run per load only the last stage varies. ``rng`` (numpy's) draws the bootstrap; the result is a
    function of it and the data."""
    loads = np.array(sorted(runs_by_load), dtype=float)
    if loads.size < 2 or not 0 < target < 1 or not 0 < confidence < 1 or resamples < 1 or block_arrivals < 1:
        raise ValueError("need two loads or more, 0 < target < 1, 0 < confidence < 1, resamples >= 1, block >= 1")
    runs = [[[np.asarray(run, dtype=bool) for run in seed_runs] for seed_runs in runs_by_load[load]] for load in loads]
    seeds = len(runs[0])
    if any(len(by_seed) != seeds for by_seed in runs) or any(not any(r.size for rs in by_seed for r in rs) for by_seed in runs):
        raise ValueError("every load needs arrivals, and the same seeds at every load")
    draws = seed_draws(rng, seeds, resamples) if draws is None else np.asarray(draws)
    if draws.shape != (resamples, seeds) or draws.min() < 0 or draws.max() >= seeds:
        raise ValueError(f"draws must be ({resamples}, {seeds}) seed indices")
    arrivals = np.array([sum(r.size for rs in by_seed for r in rs) for by_seed in runs], dtype=float)
    met = np.array([sum(int(r.sum()) for rs in by_seed for r in rs) for by_seed in runs], dtype=float)
    capacity, censored = fitted_crossing(loads, met, arrivals, target)
    met_by_copy, arrivals_by_copy = np.zeros((resamples, loads.size)), np.zeros((resamples, loads.size))
    for i, by_seed in enumerate(runs):
        for slot in range(seeds):  # each slot's runs resampled afresh: a seed taken twice is two copies
            taken = draws[:, slot]
            for seed, seed_runs in enumerate(by_seed):
                m, n = _resampled_runs(seed_runs, rng, resamples, block_arrivals)
                met_by_copy[:, i] += np.where(taken == seed, m, 0.0)
                arrivals_by_copy[:, i] += np.where(taken == seed, n, 0.0)
    samples = [fitted_crossing(loads, m, np.maximum(a, 1.0), target)[0] for m, a in zip(met_by_copy, arrivals_by_copy, strict=True)]
    tail = (1 - confidence) / 2
    low, high = np.quantile(samples, [tail, 1 - tail])
    return CapacityInterval(target, capacity, float(low), float(high), confidence, censored, tuple(samples))


def _resampled_runs(seed_runs: Sequence[np.ndarray], rng: np.random.Generator, resamples: int,
                    block_arrivals: int) -> tuple[np.ndarray, np.ndarray]:
    """Met arrivals and arrivals of ``resamples`` copies of one seed's runs at one load: as many runs as it has,
    drawn with replacement, each taken run's arrivals block-resampled (zeros for a seed with no run there)."""
    if not seed_runs:
        return np.zeros(resamples), np.zeros(resamples)
    copies = np.stack([_resampled_met(r, rng, resamples, min(block_arrivals, r.size)) if r.size else np.zeros(resamples)
                       for r in seed_runs])
    sizes = np.array([r.size for r in seed_runs], dtype=float)
    picks = rng.integers(0, len(seed_runs), (len(seed_runs), resamples))
    rows = np.arange(resamples)
    return copies[picks, rows].sum(axis=0), sizes[picks].sum(axis=0)


def ratio_interval(ours: CapacityInterval, theirs: CapacityInterval) -> dict:
    """``ours / theirs`` with the interval of the replicates' ratios, replicate by replicate: paired seed by
    seed when the two estimates took the same ``draws`` (:func:`capacity_interval`; a grid passes one to
    every row), so what a seed does to both rows (its arrivals, the engines' slow periods) divides out, as
    it does in the ratio itself. At the smaller of the two confidences. A censored estimate bounds the ratio on
    one side only: where ours is at least its grid's top (``above-grid``) or theirs at most its grid's bottom
    (``below-grid``), the ratio may be higher (``high`` None); where ours is at most its bottom or theirs at
    least its top, lower (``low`` None). ``ahead``: a lower bound that exceeds 1. Ratios are None where a
    capacity is 0."""
    if len(ours.samples) != len(theirs.samples):
        raise ValueError("the two estimates need the same number of bootstrap replicates")
    confidence = min(ours.confidence, theirs.confidence)
    a, b = np.array(ours.samples), np.array(theirs.samples)
    if theirs.capacity <= 0 or (b <= 0).any():
        return {"ratio": None, "low": None, "high": None, "confidence": confidence, "ahead": False}
    tail = (1 - confidence) / 2
    low, high = (float(q) for q in np.quantile(a / b, [tail, 1 - tail]))
    low_holds = ours.censored != "below-grid" and theirs.censored != "above-grid"
    high_holds = ours.censored != "above-grid" and theirs.censored != "below-grid"
    return {"ratio": ours.capacity / theirs.capacity, "low": low if low_holds else None,
            "high": high if high_holds else None, "confidence": confidence, "ahead": low_holds and low > 1}


def row_points(row: dict) -> list[tuple[float, float, int]]:
    """(load, attainment, arrivals) of every measurement of one capacity row (a ``bench compare --capacity`` row),
    by load: the bisection's probes and the grid's loads (the grid's where both measured one load)."""
    points = {p["load_rps"]: (p["attainment"], p["arrivals"]) for p in row.get("probes", []) if p.get("arrivals")}
    points |= {g["load_rps"]: (g["attainment"], g["arrivals"]) for g in (row.get("interval") or {}).get("grid", [])}
    return [(load, att, n) for load, (att, n) in sorted(points.items())]


def wilson_band(attainment: float, arrivals: int) -> tuple[float, float]:
    """The 95% Wilson interval of an attainment measured over ``arrivals`` (SciPy's ``binomtest``, imported here:
    ImportError without it)."""
    from scipy.stats import binomtest

    band = binomtest(round(attainment * arrivals), arrivals).proportion_ci(0.95, method="wilson")
    return band.low, band.high
