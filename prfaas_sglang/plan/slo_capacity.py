"""Capacity at a TTFT SLO for a planned operating point: a queueing approximation per stage (pure).

Lambda_max (equation 6, ``model.py``) is a throughput bound: every stage busy all the time, so waits grow
without limit there and almost nothing meets a TTFT SLO at it. Users size deployments by the highest
arrival rate at which ``target`` (0.90) of arrivals meet the SLO; this module estimates that rate:

    stage         arrivals            servers          service
    PrfaaS        lambda x p          N_prfaas         T_prfaas(l), l > t
    the link      lambda x p          1 (a pipe)       8 S_kv(l) / B_out
    PD-P          lambda x (1 - p)    N_p              T_pd(l), l <= t
    PD-D          TBT met while lambda <= Theta_pd_d (equation 5), none above it

Each queue is M/G/c: the probability of waiting is Erlang C at utilisation rho, and a wait, when there is
one, is exponential with the Allen-Cunneen mean ``E[S] (1 + cs^2) / 2 / (c (1 - rho))`` (cs: the service
time's coefficient of variation). A long prompt's TTFT is the PrfaaS wait, its prefill, the link's wait and
its transfer (the two waits independent; with ``layerwise``, prefill and transfer overlap as
``plan.overlap.kv_finish_s`` says instead of adding up); a short one's the PD-P wait and its prefill. Attainment at rate
lambda averages ``P(TTFT <= SLO)`` over lengths drawn from the workload (``rng`` draws them: pure), and the
capacity is found by bisection on lambda (attainment falls with it). The approximation ignores early
rejection, placement by expected TTFT and chunked prefill's interleaving, which the router and the
engines add: BENCHMARKS.md compares it with the simulator and the emulated deployment.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import numpy as np

from prfaas_sglang.plan.model import Deployment, evaluate
from prfaas_sglang.plan.overlap import STREAM_GROUPS, kv_finish_s
from prfaas_sglang.plan.workload import Workload

TARGET = 0.90
LENGTH_SAMPLES = 4000  # lengths drawn per estimate: the attainment's Monte Carlo error is under 1%
BISECT_ITERATIONS = 40


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


def queue(rate_rps: float, servers: int, service_s: np.ndarray) -> Queue:
    """The M/G/c approximation for ``rate_rps`` arrivals on ``servers`` servers with these service times."""
    if rate_rps <= 0 or service_s.size == 0:
        return Queue(0.0, None, True)
    mean = float(service_s.mean())
    offered = rate_rps * mean
    if offered >= servers:
        return Queue(1.0, None, False)
    cs2 = float(service_s.var()) / mean**2 if mean > 0 else 0.0
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


class SloModel:
    """Attainment and capacity at a TTFT SLO for ``dep`` on ``workload`` (lengths drawn once, from ``rng``)."""

    def __init__(self, dep: Deployment, workload: Workload, ttft_slo_s: float, rng: random.Random,
                 target: float = TARGET, samples: int = LENGTH_SAMPLES, layerwise: bool = False):
        if not ttft_slo_s > 0 or not 0 < target < 1:
            raise ValueError("need ttft_slo_s > 0 and 0 < target < 1")
        self.dep, self.workload, self.ttft_slo_s, self.target = dep, workload, ttft_slo_s, target
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
        """What every rate at one operating point shares, computed once (the bisection asks for it 41 times)."""
        key = (threshold_tokens, n_prefill, n_decode)
        if key not in self._points:
            op = evaluate(self.dep, self.workload.split(threshold_tokens), n_prefill, n_decode)
            long = (self.lengths > threshold_tokens) & (self.dep.n_prfaas > 0)
            self._points[key] = _Point(op.lambda_max_rps, op.theta_pd_decode_rps, float(long.mean()), n_prefill,
                                       self._t_prfaas[long], self._x_link[long], self._done[long], self._t_pd[~long])
        return self._points[key]

    def attainment(self, rate_rps: float, threshold_tokens: float, n_prefill: int, n_decode: int) -> float:
        """The share of arrivals at ``rate_rps`` whose TTFT meets the SLO (none once decode is past equation 5)."""
        pt = self._point(threshold_tokens, n_prefill, n_decode)
        if rate_rps > pt.decode_rps:
            return 0.0
        remote = queue(rate_rps * pt.share, self.dep.n_prfaas, pt.t_long)
        link = queue(rate_rps * pt.share, 1, pt.x_long)
        local = queue(rate_rps * (1 - pt.share), pt.n_prefill, pt.t_short)
        met_long = p_within(self.ttft_slo_s - pt.done_long, remote, link)
        met_short = p_within(self.ttft_slo_s - pt.t_short, local)
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
        bound = self._point(threshold_tokens, n_prefill, n_decode).lambda_max_rps
        lo, hi = 0.0, bound
        if self.attainment(1e-9 * bound, threshold_tokens, n_prefill, n_decode) < self.target:
            hi = 0.0
        for _ in range(BISECT_ITERATIONS if hi > 0 else 0):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if self.attainment(mid, threshold_tokens, n_prefill, n_decode) >= self.target else (lo, mid)
        return SloPoint(threshold_tokens, n_prefill, n_decode, bound, lo, self.ttft_slo_s, self.target)

    def best(self, thresholds: list[float]) -> SloPoint:
        """The (threshold, split) with the highest capacity at the SLO, over ``thresholds`` and every split."""
        return max((self.capacity(t, n_p, self.dep.n_pd - n_p) for t in thresholds for n_p in range(1, self.dep.n_pd)),
                   key=lambda point: point.capacity_rps)
