"""Request-length workloads for the throughput model (pure).

A workload answers, for a routing threshold ``t`` on the *incremental*
(uncached) prefill length ``L``::

    p(t)       = P(L > t)            fraction offloaded to PrfaaS
    l_long(t)  = E[L | L > t]        representative PrfaaS request
    l_short(t) = E[L | L <= t]       representative PD-P request

``None`` stands for an empty side (p = 0 or p = 1); never a sentinel number.

Three kinds: :class:`TruncatedLogNormal` (closed form; :data:`CASE_STUDY_LENGTHS`
is the paper's case study), :class:`EmpiricalLengths` (any list of lengths), and
:func:`incremental_lengths` which turns a Mooncake-format trace into
empirical incremental lengths under a cache model.

Mooncake traces are read here and nowhere else (:func:`read_trace`): the planner,
the simulator, the demo and the benchmarks take their records from it. That file
read is this module's only I/O.
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import math
import random
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from statistics import NormalDist

from prfaas_sglang.errors import ConfigError

_STD_NORMAL = NormalDist()
SPLIT_CACHE_ENTRIES = 65_536  # thresholds a log-normal remembers its split at (a grid of 128-token steps holds ~1K)
MOONCAKE_BLOCK_TOKENS = 512
NEGLIGIBLE_MASS = 1e-12


@dataclass(frozen=True)
class Split:
    """The workload seen through threshold ``t`` (lengths in tokens)."""

    threshold_tokens: float
    offload_fraction: float  # p = P(L > t)
    mean_long_tokens: float | None  # E[L | L > t]; None when p == 0
    mean_short_tokens: float | None  # E[L | L <= t]; None when p == 1


class Workload:
    """Interface: ``split(t)``, ``mean_tokens``, ``min_tokens``/``max_tokens``."""

    name: str
    min_tokens: float
    max_tokens: float
    mean_tokens: float

    def split(self, threshold_tokens: float) -> Split:  # pragma: no cover - interface
        raise NotImplementedError


@dataclass(frozen=True)
class TruncatedLogNormal(Workload):
    """ln L ~ N(mu, sigma²), conditioned on ``lo <= L <= hi``. Closed form, no sampling.

    Uses the partial expectation of a log-normal::

        E[L ; a < L <= b] = exp(mu + sigma²/2) * (Phi(zb - sigma) - Phi(za - sigma)),
        za = (ln a - mu) / sigma
    """

    mu: float
    sigma: float
    lo: float
    hi: float
    name: str = "lognormal"
    # split(t) by t: a fixed prior is split on the same threshold grid at every re-search of every link
    _splits: dict = field(default_factory=dict, init=False, repr=False, compare=False, hash=False)

    def __post_init__(self):
        if not self.sigma > 0:
            raise ConfigError("workload.sigma", f"must be > 0, got {self.sigma!r}")
        if not 0 < self.lo < self.hi:
            raise ConfigError("workload.min_tokens", f"need 0 < min_tokens < max_tokens, got {self.lo!r}, {self.hi!r}")

    def _z(self, x: float) -> float:
        return (math.log(x) - self.mu) / self.sigma

    def _mass(self, a: float, b: float) -> float:
        return _STD_NORMAL.cdf(self._z(b)) - _STD_NORMAL.cdf(self._z(a))

    def _partial_mean(self, a: float, b: float) -> float:
        scale = math.exp(self.mu + self.sigma**2 / 2)
        return scale * (_STD_NORMAL.cdf(self._z(b) - self.sigma) - _STD_NORMAL.cdf(self._z(a) - self.sigma))

    @property
    def min_tokens(self) -> float:  # type: ignore[override]
        return self.lo

    @property
    def max_tokens(self) -> float:  # type: ignore[override]
        return self.hi

    @property
    def mean_tokens(self) -> float:  # type: ignore[override]
        return self._partial_mean(self.lo, self.hi) / self._mass(self.lo, self.hi)

    def split(self, threshold_tokens: float) -> Split:
        done = self._splits.get(threshold_tokens)
        if done is None:
            done = self._split(threshold_tokens)
            if len(self._splits) < SPLIT_CACHE_ENTRIES:
                self._splits[threshold_tokens] = done
        return done

    def _split(self, threshold_tokens: float) -> Split:
        t = min(max(threshold_tokens, self.lo), self.hi)
        total = self._mass(self.lo, self.hi)
        # A side whose mass is below NEGLIGIBLE_MASS of the total is empty: its
        # partial mean would be a difference of two equal floats (0/0-ish).
        upper = self._mass(t, self.hi) / total
        lower = self._mass(self.lo, t) / total
        if upper < NEGLIGIBLE_MASS:
            return Split(threshold_tokens, 0.0, None, self.mean_tokens)
        if lower < NEGLIGIBLE_MASS:
            return Split(threshold_tokens, 1.0, self.mean_tokens, None)
        long_mean = self._partial_mean(t, self.hi) / (upper * total)
        short_mean = self._partial_mean(self.lo, t) / (lower * total)
        return Split(threshold_tokens, upper, min(max(long_mean, t), self.hi), min(max(short_mean, self.lo), t))

    def sample(self, rng: random.Random, n: int) -> list[float]:
        """``n`` lengths by inverse-CDF sampling inside the truncation (workload generators)."""
        lo_u, hi_u = _STD_NORMAL.cdf(self._z(self.lo)), _STD_NORMAL.cdf(self._z(self.hi))
        return [
            math.exp(self.mu + self.sigma * _STD_NORMAL.inv_cdf(lo_u + (hi_u - lo_u) * rng.random()))
            for _ in range(n)
        ]

    def config(self) -> dict:
        """This distribution as a ``workload:`` mapping (a topology's ``scheduler.workload``, a
        scenario's ``workload``), which :func:`~prfaas_sglang.plan.scenario.parse_workload` reads back."""
        return {"kind": "lognormal", "mu": self.mu, "sigma": self.sigma, "min_tokens": self.lo, "max_tokens": self.hi}


# The paper's case-study prompt lengths: ln L ~ N(9.90, 1.00), truncated to [128, 128K] tokens. Every other
# use of them (the router's default prior, the simulator, the demo, the benchmarks) derives from this one.
CASE_STUDY_LENGTHS = TruncatedLogNormal(mu=9.90, sigma=1.00, lo=128, hi=131_072, name="case-study")


def case_study_lengths(max_tokens: float | None = None) -> TruncatedLogNormal:
    """:data:`CASE_STUDY_LENGTHS`, truncated at ``max_tokens`` instead of 128K where given (a benchmark's
    prompt cap); raises :class:`ConfigError` for a cap not above the 128-token minimum."""
    if max_tokens is None:
        return CASE_STUDY_LENGTHS
    return dataclasses.replace(CASE_STUDY_LENGTHS, hi=max_tokens)


class EmpiricalLengths(Workload):
    """A finite list of lengths; ``split`` is exact for it (O(log n) per threshold)."""

    def __init__(self, lengths: Iterable[float], name: str = "empirical"):
        values = sorted(float(x) for x in lengths)
        if not values:
            raise ConfigError("workload.lengths", "is empty")
        if values[0] < 0:
            raise ConfigError("workload.lengths", f"lengths must be >= 0, got {values[0]!r}")
        self.name = name
        self._values = values
        self._prefix = [0.0]
        for v in values:
            self._prefix.append(self._prefix[-1] + v)

    @property
    def min_tokens(self) -> float:  # type: ignore[override]
        return self._values[0]

    @property
    def max_tokens(self) -> float:  # type: ignore[override]
        return self._values[-1]

    @property
    def mean_tokens(self) -> float:  # type: ignore[override]
        return self._prefix[-1] / len(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def split(self, threshold_tokens: float) -> Split:
        n = len(self._values)
        k = bisect.bisect_right(self._values, threshold_tokens)  # values[:k] <= t
        short_sum, long_sum = self._prefix[k], self._prefix[n] - self._prefix[k]
        return Split(
            threshold_tokens,
            (n - k) / n,
            long_sum / (n - k) if k < n else None,
            short_sum / k if k > 0 else None,
        )


class BlendedWorkload(Workload):
    """A prior and observed lengths, mixed by pseudo-counts (pure).

    The observed lengths weigh ``n / (n + prior_weight)``: with few
    observations the prior dominates, with many the observations do. ``split``
    mixes the two sides' masses and conditional means::

        p        = (1 - w) p_prior + w p_obs
        E[L|L>t] = ((1 - w) p_prior l_long_prior + w p_obs l_long_obs) / p
        E[L|L<=t] likewise with 1 - p
    """

    def __init__(self, prior: Workload, observed: Sequence[float], prior_weight: float, name: str = "blended"):
        if prior_weight < 0:
            raise ConfigError("prior_weight", f"must be >= 0, got {prior_weight!r}")
        self.prior = prior
        self.observed = EmpiricalLengths(observed, "observed") if len(observed) else None
        n = len(observed)
        self.weight = n / (n + prior_weight) if n + prior_weight > 0 else 0.0
        self.name = name

    def _parts(self) -> list[tuple[float, Workload]]:
        parts = [(1.0 - self.weight, self.prior)]
        if self.observed is not None and self.weight > 0:
            parts.append((self.weight, self.observed))
        return [(w, x) for w, x in parts if w > 0]

    @property
    def min_tokens(self) -> float:  # type: ignore[override]
        return min(x.min_tokens for _, x in self._parts())

    @property
    def max_tokens(self) -> float:  # type: ignore[override]
        return max(x.max_tokens for _, x in self._parts())

    @property
    def mean_tokens(self) -> float:  # type: ignore[override]
        return sum(w * x.mean_tokens for w, x in self._parts())

    def split(self, threshold_tokens: float) -> Split:
        p = long_sum = short_sum = 0.0
        for w, x in self._parts():
            s = x.split(threshold_tokens)
            p += w * s.offload_fraction
            if s.mean_long_tokens is not None:
                long_sum += w * s.offload_fraction * s.mean_long_tokens
            if s.mean_short_tokens is not None:
                short_sum += w * (1.0 - s.offload_fraction) * s.mean_short_tokens
        q = 1.0 - p
        # A side below NEGLIGIBLE_MASS is empty, and says so in both fields (the model reads p > 0
        # as "there are long requests" and needs their mean then).
        if p <= NEGLIGIBLE_MASS:
            return Split(threshold_tokens, 0.0, None, short_sum / q)
        if q <= NEGLIGIBLE_MASS:
            return Split(threshold_tokens, 1.0, long_sum / p, None)
        return Split(threshold_tokens, p, long_sum / p, short_sum / q)


# --- Mooncake traces -> incremental lengths -------------------------------------------


@dataclass(frozen=True)
class TraceRecord:
    """One Mooncake FAST'25 trace line: ``hash_ids`` name 512-token prefix blocks."""

    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def parse_trace_record(obj: dict, where: str) -> TraceRecord:
    """One decoded trace line as a record; raises :class:`ConfigError` naming ``where`` when it is not one
    (a field missing or of the wrong type, ``input_length`` <= 0 or ``output_length`` < 0)."""
    try:
        record = TraceRecord(
            float(obj["timestamp"]),
            int(obj["input_length"]),
            int(obj["output_length"]),
            tuple(int(h) for h in obj["hash_ids"]),
        )
    except (KeyError, TypeError, ValueError) as err:
        raise ConfigError(where, f"not a Mooncake trace record ({err!r})") from None
    if record.input_length <= 0 or record.output_length < 0:
        raise ConfigError(where, "input_length must be > 0 and output_length >= 0")
    return record


def read_trace(path: str | Path, field: str, limit: int | None = None) -> Iterator[TraceRecord]:
    """The records of the Mooncake-format trace at ``path`` (JSON lines, blank lines skipped), in file
    order, at most ``limit`` (None: all).

    Lazy: the file is read as records are taken, so a caller that stops early reads no further. Raises
    :class:`ConfigError`: naming ``field`` (the flag or config field that gave ``path``) when there is no
    such file; naming ``path:line`` for a line that is not JSON or not a trace record."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(field, f"no trace file {path}: not found")
    taken = 0
    with path.open() as fh:
        for lineno, line in enumerate(fh, 1):
            if limit is not None and taken >= limit:
                return
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as err:
                raise ConfigError(f"{path}:{lineno}", f"not JSON: {err.msg}") from None
            yield parse_trace_record(obj, f"{path}:{lineno}")
            taken += 1


def leading_matches(hash_ids: Sequence[int], cached) -> int:
    """How many of ``hash_ids``, from the first, are in ``cached`` (a prefix match)."""
    matched = 0
    for h in hash_ids:
        if h not in cached:
            break
        matched += 1
    return matched


class UnboundedCache:
    """Every block ever seen stays cached (the trace's reuse upper bound)."""

    def __init__(self):
        self._blocks: set[int] = set()

    def match_and_insert(self, hash_ids: Sequence[int]) -> int:
        """Number of leading blocks already cached; then cache all of them."""
        matched = leading_matches(hash_ids, self._blocks)
        self._blocks.update(hash_ids)
        return matched


class LruBlockCache:
    """A cache of ``capacity_blocks`` blocks with LRU eviction (one cluster's prefix cache)."""

    def __init__(self, capacity_blocks: int):
        if capacity_blocks <= 0:
            raise ConfigError("cache.capacity_blocks", f"must be > 0, got {capacity_blocks!r}")
        self.capacity_blocks = capacity_blocks
        self._lru: OrderedDict[int, None] = OrderedDict()

    def match_and_insert(self, hash_ids: Sequence[int]) -> int:
        matched = leading_matches(hash_ids, self._lru)
        for h in hash_ids:
            self._lru[h] = None
            self._lru.move_to_end(h)
        while len(self._lru) > self.capacity_blocks:
            self._lru.popitem(last=False)
        return matched


def incremental_lengths(records: Iterable[TraceRecord], cache, block_tokens: int = MOONCAKE_BLOCK_TOKENS) -> list[int]:
    """Uncached prefill length of each record, replayed in order through ``cache``.

    ``cached = min(matched_blocks * block_tokens, input_length - 1)``: the last
    prompt token is always computed (SGLang prefills at least one token).
    """
    out = []
    for record in records:
        matched = cache.match_and_insert(record.hash_ids)
        cached = min(matched * block_tokens, record.input_length - 1)
        out.append(record.input_length - cached)
    return out
