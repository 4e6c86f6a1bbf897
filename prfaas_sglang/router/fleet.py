"""The global scheduler over a fleet of clusters (paper section 3.1, Figure 3), pure.

A fleet is a set of *pairs* (:class:`~prfaas_sglang.topology.SitePair`): a PD cluster and one
PrfaaS cluster linked to it. Each pair has its own :class:`~prfaas_sglang.router.policy.ClusterSnapshot`:
the workers of its two clusters, the telemetry and KV backlog of *its* link, the threshold of
*its* link's controller, each cluster's calibrated cost. :func:`policy.route` decides inside a pair
exactly as it does for a one-pair deployment; this module chooses among pairs::

    decode cluster   the request's entry cluster (regional entry); with one global entry, every PD
                     cluster is a candidate
    per candidate j  route(request, snapshot of (i, j)) for every PrfaaS cluster i linked to j:
                     prefill on j's PD-P, or on i with its KV over the link i -> j
    within j         a decision early rejection would not refuse beats one it would; then an
                     offload (the pair's threshold, placement or SLO spill chose its PrfaaS cluster)
                     beats prefilling on j; then the lower expected TTFT
    among clusters   (global entry) a decision early rejection would not refuse first, then the
                     lower expected TTFT, then the most free KV on the decode worker

So a long prompt goes to the PrfaaS cluster whose link and queue serve it first, among those whose
link's threshold its uncached length exceeds; a link that is congested (its backlog in the expected
TTFT, its threshold raised by its own controller) or dead (its workers excluded from that pair's
snapshot) loses requests to the other links or to local prefill, and no other pair's decision
changes. On a fleet of one pair, :func:`route_fleet` is :func:`policy.route`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from prfaas_sglang.router.policy import (
    PRFAAS,
    ClusterSnapshot,
    NoDecodeRoom,
    NoHealthyWorker,
    RouteDecision,
    RouteInput,
    refuse_early,
    route,
)
from prfaas_sglang.topology import SitePair


class UnknownEntry(ValueError):
    """The request names an entry cluster that is not a PD cluster of this fleet."""


@dataclass(frozen=True)
class FleetDecision:
    """A pair's decision: which link (and so which PrfaaS and PD cluster) ``decision`` is about."""

    pair: SitePair
    decision: RouteDecision

    @property
    def prefill_site(self) -> str:
        """The cluster that prefills: the pair's PrfaaS cluster when the decision offloads, else its PD cluster."""
        return self.pair.prfaas if self.decision.cluster == PRFAAS and self.pair.prfaas else self.pair.pd


def route_fleet(request: RouteInput, snapshots: Mapping[SitePair, ClusterSnapshot], entry: str | None = None) -> FleetDecision:
    """Where ``request`` prefills and decodes, over every pair in ``snapshots``. ``entry``: the PD
    cluster the request entered at (it decodes there); None: any. Raises :class:`UnknownEntry`, or
    ``NoDecodeRoom`` / ``NoHealthyWorker`` when no candidate cluster can take it now (room first:
    a request the caller may hold until room frees)."""
    if entry is not None and all(pair.pd != entry for pair in snapshots):
        raise UnknownEntry(f"unknown entry cluster {entry!r} (PD clusters: {', '.join(dict.fromkeys(p.pd for p in snapshots))})")
    by_pd: dict[str, list[FleetDecision]] = {}
    errors: dict[str, list[NoHealthyWorker]] = {}
    for pair, snap in snapshots.items():
        if entry is None or pair.pd == entry:
            try:
                decided = FleetDecision(pair, route(request, snap))
            except NoHealthyWorker as err:
                errors.setdefault(pair.pd, []).append(err)
                continue
            by_pd.setdefault(pair.pd, []).append(decided)
    chosen = [min(decided, key=lambda fd: _within(fd, snapshots)) for decided in by_pd.values()]
    if not chosen:
        raise _first_of(_first_of(errs) for errs in errors.values())
    return min(chosen, key=lambda fd: _across(fd, snapshots))


def _within(fd: FleetDecision, snapshots: Mapping[SitePair, ClusterSnapshot]) -> tuple:
    """The order of one PD cluster's decisions over its pairs (the module docstring)."""
    d = fd.decision
    return refuse_early(d, snapshots[fd.pair].max_ttft_s), d.cluster != PRFAAS, d.estimated_ttft_s, str(fd.pair)


def _across(fd: FleetDecision, snapshots: Mapping[SitePair, ClusterSnapshot]) -> tuple:
    """The order of the PD clusters' chosen decisions (the module docstring)."""
    snap = snapshots[fd.pair]
    return refuse_early(fd.decision, snap.max_ttft_s), fd.decision.estimated_ttft_s, -_decode_free(fd, snap), str(fd.pair)


def _first_of(errors) -> NoHealthyWorker:
    """A ``NoDecodeRoom`` among ``errors`` (a request may wait for room), else the first."""
    errors = list(errors)
    return next((e for e in errors if isinstance(e, NoDecodeRoom)), errors[0])


def _decode_free(fd: FleetDecision, snap: ClusterSnapshot) -> int:
    return next((w.kv_free_tokens or 0 for w in snap.workers if w.name == fd.decision.decode), 0)
