"""Arrivals for the simulator: Poisson with the case study's lengths (optionally shifting), or a
Mooncake-format trace (timestamps, lengths, prefix blocks), replicated to scale its load."""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from pathlib import Path

from prfaas_sglang.errors import ConfigError
from prfaas_sglang.plan.workload import CASE_STUDY_LENGTHS, TruncatedLogNormal, read_trace
from prfaas_sglang.sim.nodes import SimRequest

CASE_STUDY = CASE_STUDY_LENGTHS.config()  # a phase's lengths as a ``workload:`` mapping


def lognormal(params: dict) -> TruncatedLogNormal:
    """The log-normal of a ``workload:`` mapping (``mu``, ``sigma``, ``min_tokens``, ``max_tokens``)."""
    return TruncatedLogNormal(params["mu"], params["sigma"], params["min_tokens"], params["max_tokens"])


def poisson(rate_rps: float, duration_s: float, seed: int, output_tokens: int = 1024,
            phases: tuple[tuple[float, dict], ...] = ((0.0, CASE_STUDY),)) -> Iterator[SimRequest]:
    """Poisson arrivals at ``rate_rps`` for ``duration_s``; lengths from the log-normal of the phase in
    force (``phases``: (from_s, params) in time order), every request ``output_tokens`` long."""
    if not rate_rps > 0 or not duration_s > 0:
        raise ConfigError("--rate", f"rate and duration must be > 0, got {rate_rps!r}, {duration_s!r}")
    rng = random.Random(seed)
    dists = [(start, lognormal(p)) for start, p in phases]
    t, i = 0.0, 0
    while True:
        t += rng.expovariate(rate_rps)
        if t >= duration_s:
            return
        dist = [d for start, d in dists if start <= t][-1]
        yield SimRequest(f"r{i}", t, max(int(dist.sample(rng, 1)[0]), 1), output_tokens)
        i += 1


def trace(path: Path, copies: int = 1, limit: int | None = None, time_scale: float = 1.0) -> list[SimRequest]:
    """A Mooncake trace (``timestamp`` ms, ``input_length``, ``output_length``, ``hash_ids``).

    ``copies`` > 1 replays the trace that many times at once, each copy with its own block ids
    (distinct users: the same reuse structure, ``copies`` times the load); ``time_scale`` < 1
    compresses time (more load, same requests)."""
    if copies < 1 or not time_scale > 0:
        raise ConfigError("--copies", f"copies must be >= 1 and time_scale > 0, got {copies}, {time_scale}")
    records = list(read_trace(path, "--trace", limit))
    if not records:
        raise ConfigError(str(path), "trace has no records")
    span = max(h for r in records for h in r.hash_ids) + 1 if any(r.hash_ids for r in records) else 0
    out = []
    for copy in range(copies):
        offset = copy * span
        jitter = copy * 1e-3  # copies do not arrive in the same instant
        for i, r in enumerate(records):
            out.append(SimRequest(f"c{copy}-{i}", r.timestamp_ms / 1e3 * time_scale + jitter, r.input_length,
                                  max(r.output_length, 1), tuple(h + offset for h in r.hash_ids)))
    out.sort(key=lambda r: r.arrival_s)
    return out


def entering(requests: list[SimRequest], shares: dict[str, float], seed: int) -> list[SimRequest]:
    """``requests``, each entering at a PD cluster drawn by ``shares`` (cluster -> share of arrivals; a
    fleet's ``entry_share``); empty ``shares``: one global entry (unchanged)."""
    if not shares:
        return requests
    rng = random.Random(seed * 7919 + 1)
    names, weights = list(shares), list(shares.values())
    for req in requests:
        req.entry = rng.choices(names, weights)[0]
    return requests


def median_shift_phases(at_s: float, factor: float = 2.0) -> tuple[tuple[float, dict], ...]:
    """The case study's lengths, then from ``at_s`` the same with the median times ``factor``."""
    shifted = dict(CASE_STUDY, mu=CASE_STUDY["mu"] + math.log(factor))
    return ((0.0, CASE_STUDY), (at_s, shifted))
