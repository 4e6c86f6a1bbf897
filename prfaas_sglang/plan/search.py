"""Grid search over the threshold and the PD split (7)(8), and the two baselines (pure).

The optimum of Lambda_max over ``t`` (on a token grid) and ``N_p`` (with
``N_p + N_d = n_pd``, ``N_d >= 1``) is found exhaustively: the grid is small
(~1000 thresholds x a handful of splits) and an exhaustive search returns
the whole surface, which the plots and the router's re-search both use.
Equations (7) and (8) are then *reported* (how far the optimum is from
balance), not solved.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from prfaas_sglang.errors import ConfigError
from prfaas_sglang.plan.model import Deployment, OperatingPoint, evaluate, evaluate_pooled
from prfaas_sglang.plan.profiles import InstanceClass
from prfaas_sglang.plan.workload import Split, Workload

Progress = Callable[[int, int], None]  # (done, total)


@dataclass(frozen=True)
class SearchResult:
    """``surface[i][j]`` is Lambda_max at ``thresholds[i]`` and ``n_prefill_options[j]``;
    ``best_by_split[j]`` the best point of column ``j`` (that split's best threshold)."""

    best: OperatingPoint
    thresholds: tuple[float, ...]
    n_prefill_options: tuple[int, ...]
    surface: tuple[tuple[float, ...], ...]
    best_by_split: tuple[OperatingPoint, ...] = ()

    def best_on_grid(self) -> float:
        return max(max(row) for row in self.surface)


def threshold_grid(workload: Workload, step_tokens: float) -> list[float]:
    """``step, 2*step, ...`` up to the first multiple at or above the longest request.

    The first point at or below the shortest request offloads everything, the
    last keeps everything local, so both extremes are on the grid.
    """
    if not step_tokens > 0:
        raise ConfigError("search.threshold_step_tokens", f"must be > 0, got {step_tokens!r}")
    count = math.ceil(workload.max_tokens / step_tokens)
    if count > 2_000_000:
        raise ConfigError("search.threshold_step_tokens", f"{step_tokens:g} gives {count} thresholds; use a coarser step")
    return [step_tokens * k for k in range(1, count + 1)]


def prefill_capacity_rps(point: OperatingPoint) -> float:
    """Requests/s the prefill side alone sustains: ``min(Theta_prfaas / p, Theta_pd_p / (1 - p))``.

    Equation (7) balances exactly these two terms; when decode binds Lambda_max
    over a range of thresholds, this is what tells them apart.
    """
    p = point.offload_fraction
    prfaas = point.theta_prfaas_rps / p if p > 0 else math.inf
    local = point.theta_pd_prefill_rps / (1 - p) if p < 1 else math.inf
    return min(prfaas, local)


def _better(a: OperatingPoint, b: OperatingPoint | None) -> bool:
    """Higher throughput wins; on a tie (decode binds), the better-balanced prefill side
    (equation (7)), then less egress, then the lower threshold (stable)."""
    if b is None:
        return True
    if not math.isclose(a.lambda_max_rps, b.lambda_max_rps, rel_tol=1e-12):
        return a.lambda_max_rps > b.lambda_max_rps
    pa, pb = prefill_capacity_rps(a), prefill_capacity_rps(b)
    if not math.isclose(pa, pb, rel_tol=1e-9):
        return pa > pb
    return a.egress_gbps < b.egress_gbps


def _splits(dep: Deployment) -> list[int]:
    return list(range(0, dep.n_pd))  # N_p = 0 .. n_pd-1, so N_d >= 1


def search(dep: Deployment, workload: Workload, step_tokens: float = 128, progress: Progress | None = None) -> SearchResult:
    """Exhaustive 2-D search; ``progress(done, total)`` is called once per threshold."""
    return search_pooled((dep,), workload, step_tokens, progress)


def search_pooled(deps: Sequence[Deployment], workload: Workload, step_tokens: float = 128,
                  progress: Progress | None = None) -> SearchResult:
    """:func:`search` for one PD cluster fed by several PrfaaS clusters (``deps``: one deployment per pair,
    :func:`~prfaas_sglang.plan.model.evaluate_pooled`); on one pair, :func:`search`."""
    n_pd = deps[0].n_pd
    thresholds = threshold_grid(workload, step_tokens)
    splits = _splits(deps[0])
    surface: list[tuple[float, ...]] = []
    best: OperatingPoint | None = None
    by_split: list[OperatingPoint | None] = [None] * len(splits)
    for i, t in enumerate(thresholds):
        split = workload.split(t)
        row = []
        for j, n_p in enumerate(splits):
            point = evaluate_pooled(deps, split, n_p, n_pd - n_p)
            row.append(point.lambda_max_rps)
            if _better(point, best):
                best = point
            if _better(point, by_split[j]):
                by_split[j] = point
        surface.append(tuple(row))
        if progress:
            progress(i + 1, len(thresholds))
    return SearchResult(best, tuple(thresholds), tuple(splits), tuple(surface), tuple(by_split))


def best_threshold_for_split(dep: Deployment, workload: Workload, n_prefill: int, step_tokens: float = 128) -> OperatingPoint:
    """Best threshold when the PD split is fixed (the router re-searches t this way at run time)."""
    if not 0 <= n_prefill < dep.n_pd:
        raise ConfigError("n_prefill", f"must be in 0..{dep.n_pd - 1}, got {n_prefill}")
    best = None
    for t in threshold_grid(workload, step_tokens):
        point = evaluate(dep, workload.split(t), n_prefill, dep.n_pd - n_prefill)
        if _better(point, best):
            best = point
    return best


def best_split_at(dep: Deployment, split: Split) -> OperatingPoint:
    """Best PD split for one fixed threshold (``--threshold``)."""
    best = None
    for n_p in _splits(dep):
        point = evaluate(dep, split, n_p, dep.n_pd - n_p)
        if _better(point, best):
            best = point
    return best


def homogeneous_baseline(pd: InstanceClass, n_instances: int, workload: Workload, output_tokens: float, egress_bps: float) -> OperatingPoint:
    """All ``n_instances`` of one class in one PD cluster, best P/D split, no PrfaaS (p = 0)."""
    dep = Deployment(pd, 0, pd, n_instances, egress_bps, output_tokens)
    everything_local = Split(math.inf, 0.0, None, workload.mean_tokens)
    return replace(best_split_at(dep, everything_local), threshold_tokens=None)


def naive_baseline(dep: Deployment, workload: Workload) -> OperatingPoint:
    """All prefill on the PrfaaS class, all decode on the PD class, no threshold (p = 1)."""
    everything_offloaded = Split(0.0, 1.0, workload.mean_tokens, None)
    return replace(evaluate(dep, everything_offloaded, 0, dep.n_pd), threshold_tokens=None)

