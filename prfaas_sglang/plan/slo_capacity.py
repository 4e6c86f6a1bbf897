"""Capacity at a TTFT SLO for a planned operating point: a queueing approximation per stage (pure).

Lambda_max (equation 6, ``model.py``) is a throughput bound: every stage busy all the time, so waits grow
without limit there and almost nothing meets a TTFT SLO at it. Users size deployments by the highest
arrival rate at which ``target`` (0.90) of arrivals meet the SLO; this module estimates that rate:

    stage         arrivals            servers          service
    PrfaaS        lambda x p          N_prfaas         T_prfaas(l), l > t
    the link      lambda x p          1 (a pipe)       8 S_kv(l) / B_out
    PD-P          lambda x (1 - p)    N_p              T_pd(l), l <= t
    PD-D          lambda / N_d each    a batch (M/G/inf)  L_out steps of step(batch)

Each queue is M/G/c: the probability of waiting is Erlang C at utilisation rho, and a wait, when there is
one, is exponential with the Allen-Cunneen mean ``E[S] (1 + cs^2) / 2 / (c (1 - rho))`` (cs: the service
time's coefficient of variation). A long prompt's TTFT is the PrfaaS wait, its prefill, the link's wait and
its transfer (the two waits independent; with ``layerwise``, prefill and transfer overlap as
``plan.overlap.kv_finish_s`` says instead of adding up); a short one's the PD-P wait and its prefill. Attainment at rate
lambda averages ``P(TTFT <= SLO)`` over lengths drawn from the workload (``rng`` draws them: pure), and the
capacity is found by bisection on lambda (attainment falls with it).

Decode (:func:`decode_stage`) is continuous batching: each of the ``N_d`` instances runs every request it
holds in one batch, so no request waits for a server, and the number running on one instance is that of an
M/G/infinity queue, Poisson with mean ``a = (lambda / N_d) L_out E[step]``. A request meets the TBT SLO when a
step of the batch it joins (itself and a Poisson(a) others) takes no longer than the SLO's time between
tokens and the batch fits ``BS_max``. ``step(batch)`` is the profile's curve (``DecodeProfile.batch_steps``),
times ``1 + growth x batch`` (``decode_growth_per_seq``: the step's rise per running sequence beyond the
roofline, as measured on a real engine); ``E[step]`` depends on ``a``, so ``a`` is their fixed point, and
where none exists the stage is unstable. TTFT and TBT are taken as independent: attainment is their product.

Early rejection (``SloModel(early_rejection=True)``) refuses on arrival what would miss: on idle servers, and
where the wait it would find leaves too little of the SLO (:func:`balking`: the joined rate is the fixed point
of the arrivals that the queue at that rate admits, and only what is admitted decodes). It takes the router's
estimate as true. The approximation ignores placement by expected TTFT and chunked prefill's interleaving,
which the router and the engines add: BENCHMARKS.md compares it with the simulator and the emulated deployment.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from scipy.special import gammaln

from prfaas_sglang.plan.model import Deployment, evaluate, theta_pd_decode
from prfaas_sglang.plan.overlap import STREAM_GROUPS, kv_finish_s
from prfaas_sglang.plan.profiles import DecodeProfile
from prfaas_sglang.plan.workload import Workload

TARGET = 0.90
LENGTH_SAMPLES = 4000  # lengths drawn per estimate: the attainment's Monte Carlo error is under 1%
BISECT_ITERATIONS = 24  # the capacity to 6e-8 of Lambda_max


@dataclass(frozen=True)
class Queue:
    """An M/G/c stage at one arrival rate: ``waits`` is P(wait > 0), ``rate_per_s`` the rate of the wait's
    exponential tail (None: no wait ever, or an unstable queue, ``stable`` False)."""

    waits: float
    rate_per_s: float | None
    stable: bool


def erlang_c(servers: int, offered: float) -> float:
    """P(an arrival waits) in M/M/c with ``offered`` = lambda / mu Erlangs (< servers)."""
    term, total = 1.0, 1.0  # a^k / k! summed for k < c
    for k in range(1, servers):
        term *= offered / k
        total += term
    last = term * offered / servers / (1 - offered / servers)  # a^c / c! / (1 - rho)
    return last / (total + last)


def queue(rate_rps: float, servers: int, service_s: np.ndarray, weights: np.ndarray | None = None) -> Queue:
    """The M/G/c approximation for ``rate_rps`` arrivals on ``servers`` servers with these service times
    (``weights``: how much of each joins, as a share; None or all zero: every one alike)."""
    if rate_rps <= 0 or service_s.size == 0:
        return Queue(0.0, None, True)
    total = float(weights.sum()) if weights is not None else 0.0
    if total > 0:
        mean, square = float(weights @ service_s) / total, float(weights @ service_s**2) / total
    else:
        mean, square = float(service_s.mean()), float(service_s @ service_s) / service_s.size
    offered = rate_rps * mean
    if offered >= servers:
        return Queue(1.0, None, False)
    cs2 = max(square - mean**2, 0.0) / mean**2 if mean > 0 else 0.0
    mean_wait_if_waiting = mean * (1 + cs2) / 2 / (servers - offered)
    return Queue(erlang_c(servers, offered), 1 / mean_wait_if_waiting, True)


def p_within(budget_s: np.ndarray, *queues: Queue) -> np.ndarray:
    """P(the sum of the queues' independent waits <= budget), per budget (0 where the budget is negative)."""
    budget = np.maximum(budget_s, 0.0)
    waiting = [q for q in queues if q.waits > 0]
    if len(waiting) > 2:
        raise ValueError("at most two waiting stages in series")
    if any(not q.stable for q in waiting):
        return np.zeros_like(budget)
    if not waiting:
        return np.where(budget_s >= 0, 1.0, 0.0)
    if len(waiting) == 1:
        (q,) = waiting
        return np.where(budget_s >= 0, 1 - q.waits * np.exp(-q.rate_per_s * budget), 0.0)
    (a, b) = waiting
    ra, rb = a.rate_per_s, b.rate_per_s
    if math.isclose(ra, rb, rel_tol=1e-9):
        both = 1 - np.exp(-ra * budget) * (1 + ra * budget)
    else:
        both = 1 - (rb * np.exp(-ra * budget) - ra * np.exp(-rb * budget)) / (rb - ra)
    p = ((1 - a.waits) * (1 - b.waits) + (1 - a.waits) * b.waits * (1 - np.exp(-rb * budget))
         + a.waits * (1 - b.waits) * (1 - np.exp(-ra * budget)) + a.waits * b.waits * both)
    return np.where(budget_s >= 0, p, 0.0)


BALK_ITERATIONS, BALK_TOLERANCE = 60, 1e-4  # the admissions' fixed point: at most, and the largest step left


def balking(rate_rps: float, budget_s: np.ndarray, queues_at: Callable[[float, np.ndarray | None], tuple[Queue, ...]]
            ) -> np.ndarray:
    """Per arrival of a stage that refuses whoever would wait past its budget (the router's early rejection with
    a true estimate: what is admitted meets the SLO, what is refused misses), P(admitted), which is P(met).

    ``rate_rps`` arrivals, each with its ``budget_s`` (the SLO less its own service); ``queues_at(x, weights)``
    builds the stage's queues for ``x`` joined arrivals a second whose service times count by ``weights``. The
    admissions ``a`` are a fixed point: each ``a_i = P(wait <= budget_i)`` at the queues that ``rate_rps *
    mean(a)`` arrivals make, with service times weighted by ``a`` (a long service has the smaller budget and
    is refused first). Damped iteration from the idle queues' admissions. No stage is unstable: past its bound
    the refusals hold the joined rate under it.

    Conservative: the waits keep the exponential tail of a queue nobody leaves, while refusals cut off every
    wait longer than the longest budget. Against an exact simulation of FCFS M/G/1 and M/G/4 refusing with a
    true estimate (tests/plan/test_slo_capacity.py) it is under the simulated share, by up to 0.07 at 0.9 of the
    stage's bound and 0.15 at 1.3x. Taking the wait as truncated there (``P(wait <= b) / P(wait <= max
    budget)``, exact for M/M/1 refusing at one level) came closer to that simulation but put the case study's
    1P/1D 34% over the emulated deployment's capacity, where the router's estimates are not exact: not taken."""
    admitted = (budget_s >= 0).astype(float)
    if rate_rps <= 0 or budget_s.size == 0 or not admitted.any():
        return admitted
    for _ in range(BALK_ITERATIONS):
        following = p_within(budget_s, *queues_at(rate_rps * float(admitted.mean()), admitted))
        converged = float(np.abs(following - admitted).max()) <= BALK_TOLERANCE
        admitted = (admitted + following) / 2
        if converged:
            break
    return admitted


DECODE_FIXED_POINT_ITERATIONS = 200


@dataclass(frozen=True)
class DecodeStage:
    """The decode stage at one arrival rate: ``tbt_met`` the share of requests whose steps meet the TBT SLO,
    ``mean_batch`` the mean number running on one instance (None where the batch grows without bound)."""

    tbt_met: float
    mean_batch: float | None


def step_curve(decode: DecodeProfile, growth_per_seq: float = 0.0) -> np.ndarray:
    """``curve[b - 1]``: one step's seconds with ``b`` running, for ``b`` from 1 to ten times the largest batch
    the profile names (far past any batch that meets an SLO)."""
    top = int(10 * max(decode.bs_max, *(b for b, _ in decode.batch_steps), 1.0))
    batches = np.arange(1, top + 1, dtype=float)
    return np.array([decode.step_at(b) for b in batches]) * (1 + growth_per_seq * batches)


def decode_stage(rate_rps: float, n_decode: int, decode: DecodeProfile, output_tokens: float, tbt_slo_s: float,
                 growth_per_seq: float = 0.0, curve: np.ndarray | None = None) -> DecodeStage:
    """The module docstring's decode stage for ``rate_rps`` arrivals spread evenly over ``n_decode`` instances
    (``curve``: :func:`step_curve` of ``decode`` and ``growth_per_seq``, computed once by a caller that asks often)."""
    if n_decode < 1:
        return DecodeStage(0.0, None)
    curve = step_curve(decode, growth_per_seq) if curve is None else curve
    work_s = rate_rps / n_decode * output_tokens  # the mean batch per second of step

    def pmf(mean: float) -> np.ndarray:  # Poisson(mean) over the others a request finds, 0 past 12 sigma
        others = np.arange(min(curve.size, int(mean + 12 * math.sqrt(mean) + 12)))
        return np.exp(others * math.log(mean) - mean - gammaln(others + 1.0)) if mean > 0 \
            else (others == 0).astype(float)

    mean = work_s * float(curve[0])
    for _ in range(DECODE_FIXED_POINT_ITERATIONS):
        weights = pmf(mean)
        following = work_s * float(weights @ curve[:weights.size])
        if following > curve.size / 2:  # no fixed point short of the curve's end: the batch grows for good
            return DecodeStage(0.0, None)
        converged = abs(following - mean) <= 1e-6 * max(mean, 1e-12)
        mean = following
        if converged:
            break
    weights = pmf(mean)
    met = (curve[:weights.size] <= tbt_slo_s) & (np.arange(weights.size) + 1 <= decode.bs_max)
    return DecodeStage(float(weights[met].sum()), mean)


@dataclass(frozen=True)
class SloPoint:
    """An operating point judged at an SLO: its throughput bound and its capacity at ``target`` attainment."""

    threshold_tokens: float
    n_prefill: int
    n_decode: int
    lambda_max_rps: float
    capacity_rps: float
    ttft_slo_s: float
    target: float
    tbt_met: float | None = None  # at the capacity: the share whose steps meet the TBT SLO (None: no TBT SLO)
    decode_mean_batch: float | None = None  # at the capacity: the mean number running on one decode instance

    def to_json(self) -> dict:
        return dict(vars(self))


@dataclass(frozen=True)
class _Point:
    """An operating point's bounds and its arrivals split by stage: prefill times and transfer times of the
    lengths above the threshold (PrfaaS), prefill times of the rest (PD-P)."""

    lambda_max_rps: float
    decode_rps: float
    share: float  # of arrivals above the threshold
    n_prefill: int
    t_long: np.ndarray
    x_long: np.ndarray  # the link's service time (all the KV)
    done_long: np.ndarray  # prefill and transfer without waiting: their sum, or their overlap (layerwise)
    t_short: np.ndarray
    # What joins the queues (all, or what early rejection admits): its service times and its share of the stage
    t_long_queued: np.ndarray
    x_long_queued: np.ndarray
    done_long_queued: np.ndarray
    long_admitted: float
    t_short_queued: np.ndarray
    short_admitted: float


class SloModel:
    """Attainment and capacity at a TTFT SLO for ``dep`` on ``workload`` (lengths drawn once, from ``rng``).

    ``tbt_slo_s`` None: a request's TBT is met while the rate is under equation 5's bound, none above it (the
    throughput model's view); given: the decode stage of the module docstring judges it, its step growing by
    ``decode_growth_per_seq`` per running sequence beyond the profile.

    ``early_rejection``: a request that would miss the TTFT SLO, on idle servers or behind the wait it finds,
    is refused on arrival, as the router's early rejection refuses what its estimate says will be late: a miss,
    but no work in any queue and no decode (:func:`balking`)."""

    def __init__(self, dep: Deployment, workload: Workload, ttft_slo_s: float, rng: random.Random,
                 target: float = TARGET, samples: int = LENGTH_SAMPLES, layerwise: bool = False,
                 tbt_slo_s: float | None = None, decode_growth_per_seq: float = 0.0, early_rejection: bool = False):
        if not ttft_slo_s > 0 or not 0 < target < 1:
            raise ValueError("need ttft_slo_s > 0 and 0 < target < 1")
        if tbt_slo_s is not None and not tbt_slo_s > 0 or not decode_growth_per_seq >= 0:
            raise ValueError("need tbt_slo_s > 0 (or None) and decode_growth_per_seq >= 0")
        self.dep, self.workload, self.ttft_slo_s, self.target = dep, workload, ttft_slo_s, target
        self.tbt_slo_s, self.decode_growth_per_seq = tbt_slo_s, decode_growth_per_seq
        self.early_rejection = early_rejection
        self._curve = step_curve(dep.pd.decode, decode_growth_per_seq)
        self.lengths = np.array(workload.sample(rng, samples), dtype=float)
        prfaas, pd = dep.prfaas.prefill, dep.pd.prefill
        self._t_prfaas = np.array([prfaas.prefill_s(n) for n in self.lengths])
        self._t_pd = np.array([pd.prefill_s(n) for n in self.lengths])
        self._x_link = np.array([8.0 * prfaas.kv_bytes(n) / dep.egress_bps for n in self.lengths])
        state_s, groups = 8.0 * prfaas.kv_bytes(0) / dep.egress_bps, STREAM_GROUPS if layerwise else None
        self._done = np.array([kv_finish_s(t, x - min(state_s, x), min(state_s, x), groups)
                               for t, x in zip(self._t_prfaas, self._x_link, strict=True)])
        self._points: dict[tuple[float, int, int], _Point] = {}

    def _point(self, threshold_tokens: float, n_prefill: int, n_decode: int) -> _Point:
        """What every rate at one operating point shares, computed once (the bisection asks for it 25 times)."""
        key = (threshold_tokens, n_prefill, n_decode)
        if key not in self._points:
            op = evaluate(self.dep, self.workload.split(threshold_tokens), n_prefill, n_decode)
            long = (self.lengths > threshold_tokens) & (self.dep.n_prfaas > 0)
            done_long, t_short = self._done[long], self._t_pd[~long]
            queued_long, queued_short = ((done_long <= self.ttft_slo_s, t_short <= self.ttft_slo_s) if self.early_rejection
                                         else (np.ones(done_long.size, bool), np.ones(t_short.size, bool)))
            t_long, x_long = self._t_prfaas[long], self._x_link[long]
            self._points[key] = _Point(op.lambda_max_rps, op.theta_pd_decode_rps, float(long.mean()), n_prefill,
                                       t_long, x_long, done_long, t_short, t_long[queued_long], x_long[queued_long],
                                       done_long[queued_long], float(queued_long.mean()) if queued_long.size else 0.0,
                                       t_short[queued_short],
                                       float(queued_short.mean()) if queued_short.size else 0.0)
        return self._points[key]

    def decode(self, rate_rps: float, n_decode: int) -> DecodeStage:
        """The decode stage at ``rate_rps`` (equation 5's all-or-nothing where no TBT SLO was given)."""
        if self.tbt_slo_s is None:
            return DecodeStage(1.0 if rate_rps <= theta_pd_decode(n_decode, self.dep.pd, self.dep.output_tokens) else 0.0, None)
        return decode_stage(rate_rps, n_decode, self.dep.pd.decode, self.dep.output_tokens, self.tbt_slo_s,
                            self.decode_growth_per_seq, self._curve)

    def attainment(self, rate_rps: float, threshold_tokens: float, n_prefill: int, n_decode: int) -> float:
        """The share of arrivals at ``rate_rps`` whose TTFT meets its SLO and whose decode meets the TBT's."""
        ttft_met = self._ttft_met(rate_rps, self._point(threshold_tokens, n_prefill, n_decode))
        return self.decode(self._decoding_rps(rate_rps, ttft_met), n_decode).tbt_met * ttft_met

    def _decoding_rps(self, rate_rps: float, ttft_met: float) -> float:
        """What reaches decode: every arrival, or, with early rejection, what was admitted (the refused never
        decode; what is admitted meets its TTFT)."""
        return rate_rps * ttft_met if self.early_rejection else rate_rps

    def _ttft_met(self, rate_rps: float, pt: _Point) -> float:
        """The share of arrivals at ``rate_rps`` whose TTFT meets its SLO at the operating point ``pt``."""
        long_rps, short_rps = rate_rps * pt.share * pt.long_admitted, rate_rps * (1 - pt.share) * pt.short_admitted

        def long_queues(joined_rps: float, weights: np.ndarray | None = None) -> tuple[Queue, Queue]:
            return (queue(joined_rps, self.dep.n_prfaas, pt.t_long_queued, weights),
                    queue(joined_rps, 1, pt.x_long_queued, weights))

        def short_queues(joined_rps: float, weights: np.ndarray | None = None) -> tuple[Queue]:
            return (queue(joined_rps, pt.n_prefill, pt.t_short_queued, weights),)

        long_budget_s = self.ttft_slo_s - (pt.done_long_queued if self.early_rejection else pt.done_long)
        short_budget_s = self.ttft_slo_s - (pt.t_short_queued if self.early_rejection else pt.t_short)
        if self.early_rejection:  # what queueing would make late is refused too, and joins no queue
            met_long, met_short = balking(long_rps, long_budget_s, long_queues), balking(short_rps, short_budget_s, short_queues)
        else:
            met_long, met_short = p_within(long_budget_s, *long_queues(long_rps)), p_within(short_budget_s, *short_queues(short_rps))
        return float((met_long.sum() + met_short.sum()) / self.lengths.size)

    def stability_limit_rps(self, threshold_tokens: float, n_prefill: int, n_decode: int) -> float:
        """The rate past which some stage's queue grows without bound: each stage's servers over its share's mean
        service time (equation 6 takes the service time at the mean length instead, which for a prefill cost
        that grows faster than linearly is the smaller: Lambda_max can exceed this), and equation 5."""
        pt = self._point(threshold_tokens, n_prefill, n_decode)
        limits = [pt.decode_rps]
        if pt.share > 0:
            limits += [self.dep.n_prfaas / (pt.share * pt.t_long.mean()), 1 / (pt.share * pt.x_long.mean())]
        if pt.share < 1:
            limits.append(n_prefill / ((1 - pt.share) * pt.t_short.mean()))
        return min(limits)

    def capacity(self, threshold_tokens: float, n_prefill: int, n_decode: int) -> SloPoint:
        """The highest arrival rate meeting ``target`` at this point (0 when even an idle deployment misses it)."""
        pt = self._point(threshold_tokens, n_prefill, n_decode)
        bound = pt.lambda_max_rps
        lo, hi = 0.0, bound
        if self.attainment(1e-9 * bound, threshold_tokens, n_prefill, n_decode) < self.target:
            hi = 0.0
        for _ in range(BISECT_ITERATIONS if hi > 0 else 0):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if self.attainment(mid, threshold_tokens, n_prefill, n_decode) >= self.target else (lo, mid)
        stage = self.decode(self._decoding_rps(lo, self._ttft_met(lo, pt)), n_decode) if self.tbt_slo_s is not None else None
        return SloPoint(threshold_tokens, n_prefill, n_decode, bound, lo, self.ttft_slo_s, self.target,
                        stage and stage.tbt_met, stage and stage.mean_batch)

    def best(self, thresholds: list[float]) -> SloPoint:
        """The (threshold, split) with the highest capacity at the SLO, over ``thresholds`` and every split; with
        a PrfaaS cluster, the naive split too: every prefill on it (threshold 0), every PD instance decoding.
        A point's capacity never exceeds its Lambda_max (the bisection's top), so the points are tried from the
        highest bound down, and those whose bound is no higher than the best capacity found are not bisected."""
        points = [(t, n_p, self.dep.n_pd - n_p) for t in thresholds for n_p in range(1, self.dep.n_pd)]
        points += [(0.0, 0, self.dep.n_pd)] if self.dep.n_prfaas > 0 else []
        points.sort(key=lambda point: -self._point(*point).lambda_max_rps)
        best = self.capacity(*points[0])
        for point in points[1:]:
            if self._point(*point).lambda_max_rps <= best.capacity_rps:
                break
            best = max(best, self.capacity(*point), key=lambda found: found.capacity_rps)
        return best
