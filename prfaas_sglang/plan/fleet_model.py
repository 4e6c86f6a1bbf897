"""The throughput model of a fleet: several PrfaaS and several PD clusters, a link per pair (pure).

Equations (1)-(6) of :mod:`prfaas_sglang.plan.model` describe one PrfaaS cluster, one PD cluster and
one link. A fleet has PrfaaS clusters ``i`` (``N_i`` instances of class ``C_i``), PD clusters ``j``
(``n_j`` instances of class ``D_j``, split into ``N_p_j`` prefill and ``N_d_j`` decode) and a link
``(i, j)`` of ``B_ij`` bits/s for each pair that moves KV (no link: no KV crosses). Each PD cluster
``j`` has its own threshold ``t_j``; requests it decodes that are longer than ``t_j`` are prefilled
on some PrfaaS cluster, in shares the scheduler chooses. Arrivals enter either through one global
entry (the scheduler also chooses where each request is decoded) or per region: ``w_j`` of them
enter at PD cluster ``j`` and are decoded there.

With ``z_j`` the arrival rate decoded at ``j`` and ``y_ij`` the rate prefilled on ``i`` for ``j``,
at thresholds and splits fixed, the capacity is a linear program::

    max  Lambda
    s.t. z_j = w_j Lambda (regional)  or  sum_j z_j = Lambda (global)
         sum_i y_ij = p_j z_j                                  offload of j, p_j = P(L > t_j)
         (1 - p_j) T_Dj(l_short_j) z_j <= N_p_j                (4) per PD cluster
         z_j <= N_d_j BS_max_j / (T_decode_j L_out)            (5) per PD cluster
         sum_j T_Ci(l_long_j) y_ij <= N_i                      (3) compute, per PrfaaS cluster
         8 S_Ci(l_long_j) y_ij <= B_ij                         (3) bandwidth, per link

On one PrfaaS cluster, one PD cluster and one link it is equation (6) exactly, and
:func:`search_fleet`, which chooses every ``(t_j, N_p_j)`` jointly, returns what
:func:`prfaas_sglang.plan.search.search` returns (``tests/plan/test_fleet.py`` pins both).
:func:`best_partition` is the baseline a fleet is judged against: each region planned alone, with
the PrfaaS instances split among regions as well as a static split can.

The LP is solved by SciPy's HiGHS (the ``fleet`` extra); the one-pair planner needs none of it.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping
from dataclasses import dataclass

from prfaas_sglang.errors import ConfigError
from prfaas_sglang.plan.model import Deployment, theta_pd_decode, theta_pd_prefill, theta_prfaas
from prfaas_sglang.plan.profiles import InstanceClass
from prfaas_sglang.plan.search import threshold_grid
from prfaas_sglang.plan.workload import Split, Workload
from prfaas_sglang.topology import check_entry_shares

REL_TOL = 1e-9  # the LP solver's accuracy: capacities closer than this are a tie


@dataclass(frozen=True)
class PrfaasSite:
    name: str
    instance: InstanceClass
    instances: int


@dataclass(frozen=True)
class PdSite:
    name: str
    instance: InstanceClass  # needs a decode profile
    instances: int  # N_p + N_d, the split is searched
    entry_share: float | None = None  # w_j: share of all arrivals entering here; None: one global entry


@dataclass(frozen=True)
class FleetLink:
    prfaas: str
    pd: str
    bps: float
    rtt_s: float | None = None


@dataclass(frozen=True)
class Fleet:
    """Fixed hardware: every cluster with its class and size, every link, ``L_out``."""

    prfaas: tuple[PrfaasSite, ...]
    pd: tuple[PdSite, ...]
    links: tuple[FleetLink, ...]
    output_tokens: float

    def __post_init__(self):
        names = [s.name for s in self.prfaas + self.pd]
        if dup := sorted({n for n in names if names.count(n) > 1}):
            raise ConfigError("clusters", f"cluster names must be unique: {dup}")
        if not self.pd:
            raise ConfigError("clusters", "a fleet needs at least one pd cluster")
        for s in self.pd:
            if s.instances < 1:
                raise ConfigError(f"clusters.{s.name}", f"a pd cluster needs >= 1 instance, got {s.instances}")
            if s.instance.decode is None:
                raise ConfigError(f"clusters.{s.name}", "the PD instance class needs a decode profile")
        for s in self.prfaas:
            if s.instances < 0:
                raise ConfigError(f"clusters.{s.name}", f"must have >= 0 instances, got {s.instances}")
        self._check_links()
        self._check_entry()
        if not self.output_tokens > 0:
            raise ConfigError("output_tokens", f"must be > 0, got {self.output_tokens!r}")

    def _check_links(self) -> None:
        prfaas, pd = {s.name for s in self.prfaas}, {s.name for s in self.pd}
        seen = set()
        for k, link in enumerate(self.links):
            if link.prfaas not in prfaas or link.pd not in pd:
                raise ConfigError(f"links[{k}]", f"joins a prfaas cluster to a pd cluster; got {link.prfaas!r} -> {link.pd!r}")
            if (link.prfaas, link.pd) in seen:
                raise ConfigError(f"links[{k}]", f"a second link {link.prfaas} -> {link.pd}")
            if not link.bps > 0:
                raise ConfigError(f"links[{k}].bandwidth_gbps", f"must be > 0, got {link.bps / 1e9!r}")
            seen.add((link.prfaas, link.pd))

    def _check_entry(self) -> None:
        check_entry_shares({s.name: s.entry_share for s in self.pd})

    @property
    def regional(self) -> bool:
        """Arrivals enter per PD cluster (``entry_share``), not through one global entry."""
        return self.pd[0].entry_share is not None

    @classmethod
    def one_pair(cls, dep: Deployment) -> Fleet:
        """The planner's one-pair deployment as a fleet (the case equations (1)-(6) describe)."""
        return cls((PrfaasSite("prfaas", dep.prfaas, dep.n_prfaas),), (PdSite("pd", dep.pd, dep.n_pd),),
                   (FleetLink("prfaas", "pd", dep.egress_bps),), dep.output_tokens)


@dataclass(frozen=True)
class PdChoice:
    """What the planner chooses per PD cluster: the threshold and the prefill instances."""

    threshold_tokens: float
    n_prefill: int


@dataclass(frozen=True)
class FleetPoint:
    """The capacity of a fleet at one choice per PD cluster, and where its traffic goes at that capacity."""

    lambda_max_rps: float
    binding: tuple[str, ...]  # the constraints at their limit: "pd-prefill:<pd>", "prfaas-compute:<prfaas>", ...
    choices: dict[str, PdChoice]
    splits: dict[str, Split]
    decode_rps: dict[str, float]  # z_j
    link_rps: dict[tuple[str, str], float]  # y_ij
    link_utilization: dict[tuple[str, str], float]
    prfaas_utilization: dict[str, float]
    egress_gbps: float = 0.0  # over every link, at Lambda_max


class _Lp:
    """The linear program of one choice, over ``[Lambda, z_j..., y_ij...]``; ``names[k]`` labels
    inequality row ``k`` (the binding constraints are reported by these names)."""

    def __init__(self, fleet: Fleet):
        self.z = {s.name: 1 + k for k, s in enumerate(fleet.pd)}
        self.y = {(link.prfaas, link.pd): 1 + len(fleet.pd) + k for k, link in enumerate(fleet.links)}
        self.width = 1 + len(self.z) + len(self.y)
        self.c = [-1.0] + [0.0] * (self.width - 1)  # maximise Lambda
        self.a_ub, self.b_ub, self.names, self.a_eq, self.b_eq = [], [], [], [], []

    def _row(self, coeffs: Mapping[int, float]) -> list[float]:
        row = [0.0] * self.width
        for k, v in coeffs.items():
            row[k] += v
        return row

    def eq(self, coeffs: Mapping[int, float]) -> None:
        """``sum coeffs . x == 0``."""
        self.a_eq.append(self._row(coeffs))
        self.b_eq.append(0.0)

    def ub(self, name: str, coeffs: Mapping[int, float], bound: float) -> None:
        """``sum coeffs . x <= bound``."""
        self.a_ub.append(self._row(coeffs))
        self.b_ub.append(float(bound))
        self.names.append(name)


def _build_lp(fleet: Fleet, splits: Mapping[str, Split], choices: Mapping[str, PdChoice], decode: bool) -> _Lp:
    """The LP of the module docstring; ``decode=False`` leaves out the decode rows (the prefill side alone)."""
    lp = _Lp(fleet)
    if fleet.regional:
        for s in fleet.pd:
            lp.eq({lp.z[s.name]: 1.0, 0: -s.entry_share})
    else:
        lp.eq({0: -1.0} | {lp.z[s.name]: 1.0 for s in fleet.pd})
    for s in fleet.pd:
        split, z = splits[s.name], lp.z[s.name]
        lp.eq({z: -split.offload_fraction} | {k: 1.0 for (_, j), k in lp.y.items() if j == s.name})
        if split.offload_fraction < 1:
            per_request_s = (1 - split.offload_fraction) * s.instance.prefill.prefill_s(split.mean_short_tokens)
            lp.ub(f"pd-prefill:{s.name}", {z: per_request_s}, choices[s.name].n_prefill)
        if decode:
            lp.ub(f"pd-decode:{s.name}", {z: 1.0}, decode_rps(s, s.instances - choices[s.name].n_prefill, fleet.output_tokens))
    sites = {s.name: s for s in fleet.prfaas}
    for site in fleet.prfaas:
        busy = {k: site.instance.prefill.prefill_s(splits[j].mean_long_tokens)
                for (i, j), k in lp.y.items() if i == site.name and splits[j].mean_long_tokens is not None}
        lp.ub(f"prfaas-compute:{site.name}", busy, site.instances)
    for link in fleet.links:
        bits = _link_bits(sites[link.prfaas], splits[link.pd])
        lp.ub(f"link:{link.prfaas}->{link.pd}", {lp.y[(link.prfaas, link.pd)]: bits}, link.bps)
    return lp


def decode_rps(site: PdSite, n_decode: int, output_tokens: float) -> float:
    """Equation (5) for one PD cluster."""
    return theta_pd_decode(n_decode, site.instance, output_tokens)


def _solve(lp: _Lp):
    try:
        from scipy.optimize import linprog  # the planner's one LP solver (HiGHS)
    except ImportError as err:
        raise ConfigError("clusters", "planning a fleet needs SciPy: pip install 'prfaas-sglang[fleet]'") from err

    return linprog(lp.c, A_ub=lp.a_ub or None, b_ub=lp.b_ub or None, A_eq=lp.a_eq, b_eq=lp.b_eq,
                   bounds=[(0, None)] * len(lp.c), method="highs")


def evaluate_fleet(fleet: Fleet, workload: Workload | None, choices: Mapping[str, PdChoice],
                   splits: Mapping[str, Split] | None = None) -> FleetPoint:
    """The fleet's capacity at one choice per PD cluster (the LP above) and the flows at it.
    ``splits``: each PD cluster's split at its threshold, when the caller has them (else from ``workload``)."""
    for s in fleet.pd:
        if not 0 <= choices[s.name].n_prefill < s.instances:
            raise ConfigError(f"clusters.{s.name}", f"n_prefill must be in 0..{s.instances - 1}, got {choices[s.name].n_prefill}")
    splits = splits or {s.name: workload.split(choices[s.name].threshold_tokens) for s in fleet.pd}
    lp = _build_lp(fleet, splits, choices, decode=True)
    res = _solve(lp)
    if res.status != 0:
        raise ArithmeticError(f"the fleet's LP did not solve: {res.message}")
    rows = {name: (bound, float(slack)) for name, bound, slack in zip(lp.names, lp.b_ub, res.ineqlin.residual, strict=True)}
    binding = tuple(name for name, (bound, slack) in rows.items() if slack <= REL_TOL * max(bound, 1.0))

    def used(name: str) -> float:  # a row's share of its bound in use
        bound, slack = rows[name]
        return (bound - slack) / bound if bound > 0 else 0.0

    y = {key: max(float(res.x[k]), 0.0) + 0.0 for key, k in lp.y.items()}  # the solver may return -0.0
    sites = {s.name: s for s in fleet.prfaas}
    egress_bps = sum(y[(i, j)] * _link_bits(sites[i], splits[j]) for (i, j) in y)
    return FleetPoint(float(res.x[0]), binding, dict(choices), dict(splits),
                      {name: max(float(res.x[k]), 0.0) + 0.0 for name, k in lp.z.items()}, y,
                      {(i, j): used(f"link:{i}->{j}") for (i, j) in y},
                      {s.name: used(f"prfaas-compute:{s.name}") for s in fleet.prfaas}, egress_bps / 1e9)


def _link_bits(site: PrfaasSite, split: Split) -> float:
    return 8.0 * site.instance.prefill.kv_bytes(split.mean_long_tokens) if split.mean_long_tokens is not None else 0.0


def _pair_rps(site: PrfaasSite, link: FleetLink, split: Split) -> float:
    """Long requests/s of ``split`` that one PrfaasSite and its link to one PD cluster carry, alone:
    equation (3) for that pair."""
    return min(theta_prfaas(site.instances, site.instance.prefill, split.mean_long_tokens, link.bps))


def _local_rps(site: PdSite, split: Split, n_prefill: int) -> float:
    """Requests/s (all lengths) ``n_prefill`` PD-P instances carry when they prefill the short share:
    equation (4) over ``1 - p``; infinite when nothing stays local."""
    p = split.offload_fraction
    return theta_pd_prefill(n_prefill, site.instance.prefill, split.mean_short_tokens) / (1 - p) if p < 1 else math.inf


def prefill_capacity_rps(fleet: Fleet, choices: Mapping[str, PdChoice], splits: Mapping[str, Split]) -> float:
    """The LP without the decode rows: what the prefill side alone sustains (the tie-break of
    :func:`prfaas_sglang.plan.search.prefill_capacity_rps`, equation (7))."""
    res = _solve(_build_lp(fleet, splits, choices, decode=False))
    return math.inf if res.status == 3 else float(res.x[0])


# --- the search ----------------------------------------------------------------------------------


def search_fleet(fleet: Fleet, workload: Workload, step_tokens: float = 128, passes: int = 8,
                 alone: Mapping[str, FleetPoint] | None = None) -> FleetPoint:
    """Every PD cluster's ``(t_j, N_p_j)`` chosen jointly, in two steps.

    1. *Bisection on Lambda.* At a trial Lambda each PD cluster's arrival rate is fixed, so its best
       choice needs no knowledge of the others: the most prefill instances whose decode still carries
       the rate, then among the thresholds its PD-P and its own links can carry, the one that asks
       least of the shared PrfaaS clusters (with one PrfaaS cluster, the least PrfaaS compute: exact;
       with several, the fewest offloaded requests). The LP says whether the PrfaaS side carries it.
       With one global entry, where requests decode is itself chosen, the bisection runs at each
       share vector of a grid (:data:`SHARE_STEP`) and the best is kept.
    2. *Coordinate polish.* Each PD cluster in turn tries every ``(t, N_p)`` of its grid with the
       others fixed (the LP evaluates each), until a pass changes nothing. Ties are broken as the
       one-pair search breaks them: the larger prefill-side capacity, then less egress, then the
       lower threshold. On a single pair this pass alone is the one-pair search.

    With several PD clusters the polish also starts from each region's own plan in the best
    partition (:func:`best_partition`; ``alone``: those plans, when the caller has them), and the
    better end wins: the joint plan is never below the partition, whose flows it may use.
    """
    search = _Search(fleet, threshold_grid(workload, step_tokens), workload)
    starts = [search.bisect()]
    if len(fleet.pd) > 1:
        alone = alone or best_partition(fleet, workload, step_tokens, passes).regions
        starts.append({name: point.choices[name] for name, point in alone.items()})
    ends = [search.polish(choices, passes) for choices in starts]
    return max(ends, key=lambda point: point.lambda_max_rps)


SHARE_STEP = 0.1  # one global entry: the decode shares the bisection tries, on this simplex grid ...
SHARE_GRID_MAX_PD = 4  # ... up to this many PD clusters (84 share vectors at 4)


class _Search:
    """One search over one fleet: its threshold grid, the split at each threshold, and every LP it
    has solved (a polish pass revisits points; each LP is the cost)."""

    def __init__(self, fleet: Fleet, grid: list[float], workload: Workload):
        self.fleet, self.grid = fleet, grid
        self.splits = {t: workload.split(t) for t in grid}
        self.sites = {s.name: s for s in fleet.prfaas}
        self._points: dict[tuple, FleetPoint] = {}
        self._ties: dict[tuple, tuple[float, float]] = {}

    # --- the LP, cached ------------------------------------------------------------------------

    def evaluate(self, choices: Mapping[str, PdChoice]) -> FleetPoint:
        key = tuple(sorted(choices.items()))
        if key not in self._points:
            self._points[key] = evaluate_fleet(self.fleet, None, choices,
                                               {j: self.splits[c.threshold_tokens] for j, c in choices.items()})
        return self._points[key]

    def tie(self, point: FleetPoint) -> tuple[float, float]:
        """(prefill-side capacity, egress): the one-pair search's tie-breaks, in that order."""
        key = tuple(sorted(point.choices.items()))
        if key not in self._ties:
            self._ties[key] = (prefill_capacity_rps(self.fleet, point.choices, point.splits), point.egress_gbps)
        return self._ties[key]

    # --- step 1: bisection ---------------------------------------------------------------------

    def bisect(self) -> dict[str, PdChoice]:
        fleet = self.fleet
        if fleet.regional or len(fleet.pd) == 1:
            return self._bisect_at(_shares(fleet))[1]
        candidates = [_shares(fleet)]
        if len(fleet.pd) <= SHARE_GRID_MAX_PD:
            candidates += _share_grid([s.name for s in fleet.pd])
        return max((self._bisect_at(w) for w in candidates), key=lambda found: found[0])[1]

    def _bisect_at(self, shares: dict[str, float]) -> tuple[float, dict[str, PdChoice]]:
        """The highest Lambda at which every PD cluster, taking ``shares`` of it, finds a choice the
        PrfaaS side carries; (its capacity by the LP, the choices)."""
        fleet = self.fleet
        hi = min(decode_rps(s, s.instances, fleet.output_tokens) / shares[s.name] for s in fleet.pd if shares[s.name] > 0)
        lo, found = 0.0, None
        while hi - lo > REL_TOL * hi:
            mid = (lo + hi) / 2
            choices = self._greedy({j: w * mid for j, w in shares.items()})
            if choices is not None and self.evaluate(choices).lambda_max_rps >= mid * (1 - REL_TOL):
                lo, found = mid, choices
            else:
                hi = mid
        found = found or self._greedy({j: 0.0 for j in shares})
        return self.evaluate(found).lambda_max_rps, found

    def _greedy(self, rates: dict[str, float]) -> dict[str, PdChoice] | None:
        """Each PD cluster's own best choice at its arrival rate, or None if one cannot carry it."""
        out = {}
        for site in self.fleet.pd:
            if (choice := self._cluster_choice(site, rates[site.name])) is None:
                return None
            out[site.name] = choice
        return out

    def _cluster_choice(self, site: PdSite, rate: float) -> PdChoice | None:
        links = [link for link in self.fleet.links if link.pd == site.name]
        for n_p in range(site.instances - 1, -1, -1):
            if decode_rps(site, site.instances - n_p, self.fleet.output_tokens) < rate * (1 - REL_TOL):
                continue
            best, best_cost = None, math.inf
            for t in self.grid:
                split = self.splits[t]
                p = split.offload_fraction
                if _local_rps(site, split, n_p) * (1 + REL_TOL) < rate:
                    break  # PD-P's load grows with t: every larger t is out as well
                if p > 0 and rate > 0 and sum(_pair_rps(self.sites[link.prfaas], link, split) for link in links) < p * rate * (1 - REL_TOL):
                    continue  # its links and PrfaaS clusters cannot carry the offload even alone
                if (cost := self._prfaas_cost(split)) <= best_cost:
                    best, best_cost = t, cost
            if best is not None:
                return PdChoice(best, n_p)
        return None

    def _prfaas_cost(self, split: Split) -> float:
        """What one request of this split asks of the shared PrfaaS side (lower is better)."""
        if split.offload_fraction == 0:
            return 0.0
        if len(self.fleet.prfaas) == 1:
            return split.offload_fraction * self.fleet.prfaas[0].instance.prefill.prefill_s(split.mean_long_tokens)
        return split.offload_fraction

    # --- step 2: coordinate polish -------------------------------------------------------------

    def polish(self, choices: dict[str, PdChoice], passes: int) -> FleetPoint:
        best = self.evaluate(choices)
        for _ in range(passes):
            changed = False
            for site in self.fleet.pd:
                point = self._best_for(site, best)
                if point.choices != best.choices:
                    best, changed = point, True
            if not changed:
                break
        return best

    def _best_for(self, site: PdSite, start: FleetPoint) -> FleetPoint:
        """The best point over ``site``'s whole grid, every other PD cluster as in ``start``. The order is
        :func:`prfaas_sglang.plan.search._better`'s: higher Lambda; on a tie the larger prefill-side
        capacity (an LP of its own, computed for ties only), then less egress; on a full tie the
        incumbent stays. ``start`` is the first incumbent, so a candidate whose bound is below it
        costs no LP."""
        best = start
        for t in self.grid:
            for n_p in range(site.instances):
                if PdChoice(t, n_p) == start.choices[site.name]:
                    continue
                if self._upper_bound(site, self.splits[t], n_p, start) < best.lambda_max_rps * (1 - REL_TOL):
                    continue
                point = self.evaluate({**start.choices, site.name: PdChoice(t, n_p)})
                if not math.isclose(point.lambda_max_rps, best.lambda_max_rps, rel_tol=REL_TOL):
                    if point.lambda_max_rps > best.lambda_max_rps:
                        best = point
                elif _wins_tie(self.tie(point), self.tie(best)):
                    best = point
        return best

    def _upper_bound(self, site: PdSite, split: Split, n_p: int, start: FleetPoint) -> float:
        """A cheap bound on Lambda at ``site``'s candidate (its own PD-P, decode and links alone)."""
        fleet, p = self.fleet, split.offload_fraction
        local = min(decode_rps(site, site.instances - n_p, fleet.output_tokens), _local_rps(site, split, n_p))
        if p > 0:
            carried = sum(_pair_rps(self.sites[link.prfaas], link, split) for link in fleet.links if link.pd == site.name)
            local = min(local, carried / p)
        if fleet.regional:
            return local / site.entry_share if site.entry_share > 0 else math.inf
        others = sum(decode_rps(s, s.instances - start.choices[s.name].n_prefill, fleet.output_tokens)
                     for s in fleet.pd if s.name != site.name)
        return local + others


def _shares(fleet: Fleet) -> dict[str, float]:
    if fleet.regional:
        return {s.name: s.entry_share for s in fleet.pd}
    total = sum(decode_rps(s, s.instances, fleet.output_tokens) for s in fleet.pd)
    return {s.name: decode_rps(s, s.instances, fleet.output_tokens) / total for s in fleet.pd}


def _share_grid(names: list[str]) -> list[dict[str, float]]:
    """Every split of 1 into ``len(names)`` positive multiples of :data:`SHARE_STEP`."""
    steps = round(1 / SHARE_STEP)
    return [dict(zip(names, (k * SHARE_STEP for k in combo), strict=True))
            for combo in itertools.product(range(1, steps), repeat=len(names)) if sum(combo) == steps]


def _wins_tie(a: tuple[float, float], b: tuple[float, float]) -> bool:
    if not math.isclose(a[0], b[0], rel_tol=REL_TOL):
        return a[0] > b[0]
    return a[1] < b[1] and not math.isclose(a[1], b[1], rel_tol=REL_TOL)


@dataclass(frozen=True)
class Partition:
    """The per-region baseline at its best: the PrfaaS instances are split among the regions their
    clusters have links to, and each region is planned alone with what it was given (a router per
    region that sees only its own clusters). Of every such split, the one with the highest capacity."""

    instances: dict[str, dict[str, int]]  # PrfaaS cluster -> PD cluster -> instances it serves there
    fleets: dict[str, Fleet]  # PD cluster -> its region as a fleet of its own
    regions: dict[str, FleetPoint]  # PD cluster -> its region's own plan
    capacity_rps: float


PARTITION_PARTS = 8  # a PrfaaS cluster is split among regions in steps of 1/8 of it at the finest


def best_partition(fleet: Fleet, workload: Workload, step_tokens: float = 128, passes: int = 8) -> Partition:
    """Every split of each PrfaaS cluster's instances among the PD clusters it has links to (in steps of
    ``ceil(N / PARTITION_PARTS)`` instances) is tried, each region's plan computed once per what it is
    given; the best split is returned."""
    options = [_splits_of(site, [link.pd for link in fleet.links if link.prfaas == site.name]) for site in fleet.prfaas]
    plans: dict[tuple, tuple[Fleet, FleetPoint]] = {}
    best = None
    for combo in itertools.product(*options):
        given = {site.name: split for site, split in zip(fleet.prfaas, combo, strict=True)}
        part = partition_with(fleet, workload, given, step_tokens, passes, plans)
        if best is None or part.capacity_rps > best.capacity_rps * (1 + REL_TOL):
            best = part
    return best


def partition_with(fleet: Fleet, workload: Workload, instances: Mapping[str, Mapping[str, int]],
                   step_tokens: float = 128, passes: int = 8, plans: dict | None = None) -> Partition:
    """The partition that gives each region ``instances[prfaas][pd]`` instances of each PrfaaS cluster,
    each region planned alone (``plans``: region plans already computed, reused and added to). A split
    planned for one fleet, evaluated on another (a link dropped), is what a static partition keeps."""
    plans = {} if plans is None else plans
    fleets, regions = {}, {}
    for pd in fleet.pd:
        mine = tuple((name, split.get(pd.name, 0)) for name, split in instances.items() if split.get(pd.name, 0) > 0)
        if (pd.name, mine) not in plans:
            sub = _region(fleet, pd, dict(mine))
            plans[(pd.name, mine)] = (sub, search_fleet(sub, workload, step_tokens, passes))
        fleets[pd.name], regions[pd.name] = plans[(pd.name, mine)]
    return Partition({name: dict(split) for name, split in instances.items()}, fleets, regions,
                     partition_capacity_rps(fleet, regions))


def _splits_of(site: PrfaasSite, pds: list[str]) -> list[dict[str, int]]:
    """Every way to give ``site``'s instances to ``pds`` (all of them, in whole steps)."""
    if not pds:
        return [{}]
    unit = max(1, -(-site.instances // PARTITION_PARTS))
    parts = site.instances // unit
    out = []
    for combo in itertools.product(range(parts + 1), repeat=len(pds)):
        if sum(combo) == parts:
            counts = [k * unit for k in combo]
            counts[-1] += site.instances - parts * unit  # the remainder of an uneven step
            out.append(dict(zip(pds, counts, strict=True)))
    return out


def _region(fleet: Fleet, pd: PdSite, given: dict[str, int]) -> Fleet:
    mine = tuple(PrfaasSite(s.name, s.instance, given[s.name]) for s in fleet.prfaas if s.name in given)
    links = tuple(link for link in fleet.links if link.pd == pd.name and link.prfaas in given)
    return Fleet(mine, (PdSite(pd.name, pd.instance, pd.instances),), links, fleet.output_tokens)


def partition_capacity_rps(fleet: Fleet, regions: Mapping[str, FleetPoint]) -> float:
    """The partitioned fleet's capacity: with regional entry the region that saturates first decides
    (``min_j Lambda_j / w_j``); with one global entry the regions' capacities add."""
    if fleet.regional:
        return min(regions[s.name].lambda_max_rps / s.entry_share for s in fleet.pd if s.entry_share > 0)
    return sum(point.lambda_max_rps for point in regions.values())
