"""Instance profiles: what one model instance of one accelerator class costs (pure).

An instance is ``gpus_per_instance`` GPUs serving one model replica (TP/EP
inside). The throughput model needs, per instance class:

* ``kv_bytes(l)``  ``S_kv(l)``: bytes shipped after prefilling ``l`` tokens
  (full-attention KV, which grows with ``l``, plus linear/SWA state, which
  does not);
* ``prefill_s(l)`` ``T_prefill(l)``: prefill latency of ``l`` uncached tokens;
* for decode classes, :class:`DecodeProfile`: ``BS_max`` and ``T_decode``
  under the SLO (the paper treats both as SLO-governed constants).

Two sources: :class:`TabulatedPrefill` (measured points, monotone
interpolation) and ``analytic.build_prefill`` (a roofline from a model config
and accelerator specs).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, field

from prfaas_sglang.errors import ConfigError


class PrefillProfile:
    """Interface: ``kv_bytes(tokens)`` and ``prefill_s(tokens)``, both non-decreasing."""

    name: str

    def kv_bytes(self, tokens: float) -> float:  # pragma: no cover - interface
        raise NotImplementedError

    def prefill_s(self, tokens: float) -> float:  # pragma: no cover - interface
        raise NotImplementedError

    def phi_kv_bps(self, tokens: float) -> float:
        """Equation (1): KV throughput of one instance, bits/s."""
        return 8.0 * self.kv_bytes(tokens) / self.prefill_s(tokens)


@dataclass(frozen=True)
class DecodeProfile:
    """Decode capacity of one instance under the SLO: ``BS_max`` requests at ``T_decode`` s/step.

    ``batch_steps`` (optional): ``(batch, step_s)`` points, batches increasing, of one decode step's time
    as the batch grows, at the workload's mean context (``analytic.analytic_decode`` fills them). Without
    them a step takes ``step_s`` at any batch up to ``BS_max``, as equation 5 assumes.
    """

    bs_max: float
    step_s: float
    batch_steps: tuple[tuple[float, float], ...] = ()
    # the points' batches, kept once: step_at runs for every streamed token the router relays
    _batches: tuple[float, ...] = field(default=(), init=False, repr=False, compare=False)

    def __post_init__(self):
        if not self.bs_max > 0:
            raise ConfigError("decode.bs_max", f"must be > 0, got {self.bs_max!r}")
        if not self.step_s > 0:
            raise ConfigError("decode.step_s", f"must be > 0, got {self.step_s!r}")
        batches = [b for b, _ in self.batch_steps]
        if any(not (b >= 1 and s > 0) for b, s in self.batch_steps) or batches != sorted(set(batches)):
            raise ConfigError("decode.batch_steps", "must be (batch >= 1, step_s > 0) points, batches increasing")
        object.__setattr__(self, "_batches", tuple(batches))

    def step_at(self, batch: float) -> float:
        """One step's seconds with ``batch`` running: the points interpolated linearly, flat below the first,
        extended along the last two's slope above the last; ``step_s`` where there are no points."""
        if not self.batch_steps:
            return self.step_s
        xs = self._batches
        i = bisect.bisect_right(xs, batch)
        if i == 0:
            return self.batch_steps[0][1]
        (x0, y0), (x1, y1) = self.batch_steps[max(min(i, len(xs) - 1) - 1, 0)], self.batch_steps[min(i, len(xs) - 1)]
        return y0 if x1 == x0 else y0 + (y1 - y0) * (batch - x0) / (x1 - x0)


@dataclass(frozen=True)
class InstanceClass:
    """One accelerator class in one role: its size, prefill profile and (for PD) decode profile."""

    name: str
    gpus_per_instance: int
    prefill: PrefillProfile
    decode: DecodeProfile | None = None


class MonotoneCurve:
    """Monotone piecewise-cubic (Fritsch-Carlson) interpolation through ``(x, y)``.

    Between points it never overshoots, so non-decreasing data give a
    non-decreasing curve. Outside the points it continues linearly with the end
    slopes (clamped at >= 0), so it stays non-decreasing everywhere. Below the
    first point (at ``x0 > 0``) it never falls under the line through the origin,
    ``y0 * x / x0``: a steep first slope extrapolated down would otherwise reach 0
    (a 64-token prefill priced at nothing where the profile starts at 256 tokens:
    CI's calibration test of 2026-11-29 saw a predicted TTFT of 0).
    """

    def __init__(self, xs: Sequence[float], ys: Sequence[float]):
        n = len(xs)
        self.xs, self.ys = list(xs), list(ys)
        secants = [(ys[i + 1] - ys[i]) / (xs[i + 1] - xs[i]) for i in range(n - 1)]
        slopes = [0.0] * n
        if n == 1:
            self.slopes = slopes
            return
        slopes[0], slopes[-1] = secants[0], secants[-1]
        for i in range(1, n - 1):
            a, b = secants[i - 1], secants[i]
            slopes[i] = 0.0 if a * b <= 0 else 2.0 / (1.0 / a + 1.0 / b)  # harmonic mean keeps monotonicity
        for i, d in enumerate(secants):
            if d == 0:
                slopes[i] = slopes[i + 1] = 0.0
        self.slopes = slopes

    def __call__(self, x: float) -> float:
        xs, ys, m = self.xs, self.ys, self.slopes
        if len(xs) == 1:
            return ys[0]
        if x <= xs[0]:
            linear = ys[0] + max(m[0], 0.0) * (x - xs[0])
            return max(linear, ys[0] * x / xs[0]) if xs[0] > 0 and x > 0 else linear
        if x >= xs[-1]:
            return ys[-1] + max(m[-1], 0.0) * (x - xs[-1])
        i = bisect.bisect_right(xs, x) - 1
        h = xs[i + 1] - xs[i]
        s = (x - xs[i]) / h
        h00, h10 = 2 * s**3 - 3 * s**2 + 1, s**3 - 2 * s**2 + s
        h01, h11 = -2 * s**3 + 3 * s**2, s**3 - s**2
        return h00 * ys[i] + h10 * h * m[i] + h01 * ys[i + 1] + h11 * h * m[i + 1]


class TabulatedPrefill(PrefillProfile):
    """A profile from measured points ``(tokens, prefill_s, kv_bytes)``.

    Validation names the bad point: tokens strictly increasing and positive,
    ``prefill_s`` > 0 and non-decreasing, ``kv_bytes`` >= 0 and non-decreasing.
    """

    def __init__(self, name: str, points: Sequence[dict], where: str = "profile"):
        if not points:
            raise ConfigError(f"{where}.points", "needs at least one point")
        rows = []
        for i, point in enumerate(points):
            path = f"{where}.points[{i}]"
            if not isinstance(point, dict):
                raise ConfigError(path, "must be a mapping with tokens, prefill_s, kv_bytes")
            unknown = set(point) - {"tokens", "prefill_s", "kv_bytes"}
            if unknown:
                raise ConfigError(f"{path}.{sorted(unknown)[0]}", "unknown field (expected tokens, prefill_s, kv_bytes)")
            for key in ("tokens", "prefill_s", "kv_bytes"):
                value = point.get(key)
                if isinstance(value, bool) or not isinstance(value, (int, float)):
                    raise ConfigError(f"{path}.{key}", f"must be a number, got {value!r}")
            rows.append((float(point["tokens"]), float(point["prefill_s"]), float(point["kv_bytes"])))
        for i, (tokens, prefill_s, kv_bytes) in enumerate(rows):
            path = f"{where}.points[{i}]"
            if tokens <= 0 or prefill_s <= 0 or kv_bytes < 0:
                raise ConfigError(path, "tokens and prefill_s must be > 0, kv_bytes >= 0")
            if i:
                prev = rows[i - 1]
                if tokens <= prev[0]:
                    raise ConfigError(f"{path}.tokens", f"must increase ({tokens:g} after {prev[0]:g})")
                if prefill_s < prev[1]:
                    raise ConfigError(f"{path}.prefill_s", f"must be non-decreasing in tokens ({prefill_s:g} s after {prev[1]:g} s)")
                if kv_bytes < prev[2]:
                    raise ConfigError(f"{path}.kv_bytes", f"must be non-decreasing in tokens ({kv_bytes:g} after {prev[2]:g})")
        self.name = name
        self.points = rows
        xs = [r[0] for r in rows]
        self._prefill = MonotoneCurve(xs, [r[1] for r in rows])
        self._kv = MonotoneCurve(xs, [r[2] for r in rows])

    def prefill_s(self, tokens: float) -> float:
        return max(self._prefill(tokens), 1e-9)

    def kv_bytes(self, tokens: float) -> float:
        return max(self._kv(tokens), 0.0)


def parse_scale_item(item: str, *, offset: bool = False) -> tuple[str, float, float]:
    """One ``CLUSTER=SCALE`` (with ``offset``: ``CLUSTER=SCALE[+OFFSET_S]``) of a ``--prefill-scale`` flag, the
    router's and the planner's: (cluster, scale, offset seconds; 0 without one). ValueError where a number does
    not parse or an offset is given where none is taken; the range of each is the caller's to check."""
    cluster, _, value = item.partition("=")
    scale_text, plus, offset_text = value.partition("+") if offset else (value, "", "")
    return cluster.strip(), float(scale_text), float(offset_text) if plus else 0.0


class ScaledPrefill(PrefillProfile):
    """``base`` with prefill time and KV bytes scaled (what-if studies, property tests, the router's
    calibration), and ``offset_s`` added to every prefill (a per-request cost the profile lacks)."""

    def __init__(self, base: PrefillProfile, time_scale: float = 1.0, kv_scale: float = 1.0, offset_s: float = 0.0):
        self.base, self.time_scale, self.kv_scale, self.offset_s = base, time_scale, kv_scale, offset_s
        self.name = f"{base.name}*t{time_scale:g}*kv{kv_scale:g}" + (f"+{offset_s:g}s" if offset_s else "")

    def prefill_s(self, tokens: float) -> float:
        return self.base.prefill_s(tokens) * self.time_scale + self.offset_s

    def kv_bytes(self, tokens: float) -> float:
        return self.base.kv_bytes(tokens) * self.kv_scale
