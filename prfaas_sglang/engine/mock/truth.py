"""What an emulated engine really takes, apart from the topology's cost model (pure).

The topology's profile is what the *router* believes (``runtime.from_topology``). A
real engine never runs exactly at its profile: a deployment is faster or slower
than the model predicts (kernels, clocks, the model's own approximations), and
each request varies around that. :class:`ServiceTruth` gives the emulated engine
such a truth, so that a router is judged on what it learns from what workers
report, never on an oracle::

    prefill piece   = profile cost x prefill_bias x noise(request)
    decode step     = profile step x decode_bias  x noise(step)
    noise           = exp(N(-sigma^2 / 2, sigma^2))        log-normal, mean 1

The noise has mean one, so ``*_bias`` is the mean factor. Draws come from one
``random.Random(seed)`` per engine, in the order requests and steps occur.

That truth (``model="profile"``) has the router's own form: chunked prefill sums
exactly to the profile's ``T(l)``, and a scale is all calibration must learn.
``model="batched"`` gives the engine a form the router's roofline does not have,
shaped as real engines behave (the measured H200 profile in
``plan/data/profiles/``: a fixed cost near 31 ms up to 16K tokens, then growth;
SGLang on CPU: a per-request cost that does not scale with length)::

    forward     = forward_floor + sum(piece costs)
                  + (request_overhead - profile_floor) x (requests started in it)
                  forward_floor: what every forward pays once (the weights read
                  from HBM: parameters x bytes / the instance's bandwidth; a
                  measured profile's T(1), which already holds it, if larger);
                  profile_floor = T(1), the part of a request's profile cost that
                  is that floor (about 0 on the analytic roofline). So a batch of
                  short prefills costs less than the sum of its parts, a long one
                  about as much (compute dominates past the knee), and each
                  further chunk of a chunked prompt pays the floor again (its
                  chunks no longer sum to the profile's T(l))
    request_overhead = REQUEST_OVERHEAD_S (emulated): scheduling, allocation, the
                  first token's sampling; not proportional to length
    decode step = profile step x (1 + DECODE_PER_SEQ_SHARE x batch)
                  (per-sequence sampling and bookkeeping: rises with the batch
                  beyond the roofline's weights-and-KV reads)
    slow periods: every duration x SLOW_FACTOR while slow; slow and normal
                  periods alternate, their lengths exponential with means
                  SLOW_MEAN_S and NORMAL_MEAN_S (emulated s): noise that is not
                  i.i.d. (a neighbour's job, thermal limits, a GC pause)

Biases and the log-normal noise apply on top, as for ``profile``.

The truth lives here, in the emulated engine's package, and reaches an engine
only through its command line (``--prefill-bias``, ``--decode-bias``,
``--noise-sigma``, ``--noise-seed``). The engine does not report it (not in
``/server_info``, not in ``/metrics``), and the router never imports the
engine (``tests/unit/test_layering.py``).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

from prfaas_sglang.errors import ConfigError

MAX_BIAS = 10.0
TRUTH_MODELS = ("profile", "batched")
REQUEST_OVERHEAD_S = 0.010  # a request's fixed cost beyond its tokens, emulated s (model="batched")
DECODE_PER_SEQ_SHARE = 0.01  # a decode step's growth per running sequence, beyond the profile's (model="batched")
SLOW_FACTOR = 1.6  # durations in a slow period (model="batched")
SLOW_MEAN_S, NORMAL_MEAN_S = 15.0, 120.0  # mean lengths of slow and normal periods, emulated s (model="batched")


@dataclass(frozen=True)
class ForwardCosts:
    """The fixed costs of a prefill forward under ``model="batched"``, in the engine's seconds (see the module)."""

    profile_floor_s: float
    forward_floor_s: float
    request_overhead_s: float


def forward_costs(timing) -> ForwardCosts:
    """:class:`ForwardCosts` for an engine's :class:`~prfaas_sglang.engine.mock.timing.EngineTiming` (its speedup
    applied): the weights read once per forward where the profile is analytic, its ``T(1)`` if larger."""
    profile_floor_s = timing.prefill_s(1)
    weights_s = 0.0
    if timing.model is not None and timing.accel is not None:
        weight_bytes = timing.model.total_params_b * 1e9 * timing.model.weight_bytes_per_param
        weights_s = weight_bytes / (timing.accel.gpus * timing.accel.hbm_tb_s * 1e12) / timing.speedup
    return ForwardCosts(profile_floor_s, max(profile_floor_s, weights_s), REQUEST_OVERHEAD_S / timing.speedup)


@dataclass
class ServiceTruth:
    prefill_bias: float = 1.0
    decode_bias: float = 1.0
    noise_sigma: float = 0.0
    seed: int = 0
    model: str = "profile"  # one of TRUTH_MODELS (see the module)
    _rng: random.Random = field(init=False, repr=False)
    _periods: random.Random = field(init=False, repr=False)  # slow periods: a stream of their own
    _slow: bool = field(default=False, init=False, repr=False)
    _period_ends_s: float = field(default=0.0, init=False, repr=False)
    _origin_s: float | None = field(default=None, init=False, repr=False)  # the clock at the first slowdown() call

    def __post_init__(self) -> None:
        for name, value in (("--prefill-bias", self.prefill_bias), ("--decode-bias", self.decode_bias)):
            if not 1.0 / MAX_BIAS <= value <= MAX_BIAS:
                raise ConfigError(name, f"must be in [{1 / MAX_BIAS:g}, {MAX_BIAS:g}], got {value!r}")
        if not 0.0 <= self.noise_sigma <= 2.0:
            raise ConfigError("--noise-sigma", f"must be in [0, 2], got {self.noise_sigma!r}")
        if self.model not in TRUTH_MODELS:
            raise ConfigError("--truth-model", f"must be one of {', '.join(TRUTH_MODELS)}, got {self.model!r}")
        self._rng = random.Random(self.seed)
        self.restart_periods(self.seed + 1)

    def restart_periods(self, period_seed: int) -> None:
        """Start the slow periods afresh from ``period_seed``, counted from the next :meth:`slowdown` call (a
        normal period first). A benchmark that restarts every engine's periods with the same seed at the start of
        each run gives every row it compares the same slow spells at the same offsets (common random numbers),
        however long the engines ran before."""
        self._periods = random.Random(period_seed)
        self._slow, self._origin_s = False, None
        self._period_ends_s = self._periods.expovariate(1 / NORMAL_MEAN_S)

    @property
    def exact(self) -> bool:
        """The engine runs exactly at its profile (no bias, no noise, the profile's form)."""
        return self.prefill_bias == 1.0 and self.decode_bias == 1.0 and self.noise_sigma == 0.0 and self.model == "profile"

    def forward_s(self, pieces: list[tuple[float, bool]], costs: ForwardCosts) -> float:
        """A prefill forward's duration from its pieces' profile costs (each ``(cost_s, starts_a_request)``,
        cost factors applied): their sum for ``profile``; for ``batched``, the forward's floor once and each
        started request's fixed overhead (see the module)."""
        total = sum(cost for cost, _ in pieces)
        if self.model == "profile":
            return total
        started = sum(starts for _, starts in pieces)
        return costs.forward_floor_s + total + (costs.request_overhead_s - costs.profile_floor_s) * started

    def decode_step_s(self, profile_step_s: float, batch: int) -> float:
        """One decode step of ``batch`` sequences from the profile's step (the decode factor applied after)."""
        return profile_step_s * (1 + DECODE_PER_SEQ_SHARE * batch) if self.model == "batched" else profile_step_s

    def slowdown(self, now_s: float) -> float:
        """The factor of every duration that starts at emulated time ``now_s`` (any origin; non-decreasing across
        calls): ``SLOW_FACTOR`` inside a slow period, else 1; always 1 for ``profile``."""
        if self.model != "batched":
            return 1.0
        if self._origin_s is None:  # periods counted from the first call (a normal one first)
            self._origin_s = now_s
        now_s -= self._origin_s
        while now_s >= self._period_ends_s:
            self._slow = not self._slow
            self._period_ends_s += self._periods.expovariate(1 / (SLOW_MEAN_S if self._slow else NORMAL_MEAN_S))
        return SLOW_FACTOR if self._slow else 1.0

    def _noise(self) -> float:
        if self.noise_sigma == 0.0:
            return 1.0
        sigma = self.noise_sigma
        return math.exp(self._rng.gauss(-sigma * sigma / 2.0, sigma))

    def prefill_factor(self) -> float:
        """The factor of one request's prefill cost (drawn once per request)."""
        return self.prefill_bias * self._noise()

    def decode_factor(self) -> float:
        """The factor of one decode step (drawn once per step)."""
        return self.decode_bias * self._noise()
