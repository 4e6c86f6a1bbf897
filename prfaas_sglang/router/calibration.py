"""The router's cost model, calibrated online from what it observes (pure: time comes in as arguments).

The topology's profiles are a prior. A real deployment runs faster or slower than
they predict, and the router learns by how much from what every request shows it,
the same signals whatever the engine (SGLang or the emulated one): the time from
dispatching a request's legs to its first token, and the gaps between its tokens.
Nothing is read from an engine's configuration.

Prefill, per cluster. At dispatch the router predicts::

    TTFT = s x (queue_u + prefill_u) + link_s

where ``queue_u`` and ``prefill_u`` are the model's seconds before calibration (the
worker's outstanding prefill work and this request's), ``link_s`` the KV's time on
the link (telemetry measures the link, so it is not calibrated here) and ``s`` the
cluster's scale. When the first token comes after ``y`` seconds, the sample says
``y - link_s`` seconds of compute were ``queue_u + prefill_u`` in the model. The
scale is the ratio of sums ``r`` over the cluster's last ``window`` samples (``n`` of them),
shrunk toward the prior scale ``s0`` (1, or what the operator measured: ``prior_scales``) by
``prior_samples`` pseudo-samples (few samples move it little), clamped to
``[min_scale, max_scale]``::

    r = sum(y - link_s) / sum(queue_u + prefill_u)
    s = (n * r + prior_samples * s0) / (n + prior_samples)

The prior's strength is counted in samples, not in seconds, so the scale learns as fast on a
fast engine as on a slow one. A prior of 2 model-seconds (as this was until 2026-11-30) outweighed
about 30 requests of the tiny hybrid on a lent H200 (each modelled at tens of milliseconds), and
calibration from a profile 2x off still erred by 86% after 20 requests there; on CPU, where one
prefill is modelled at seconds, the same 2 s was about one sample.

A real engine also spends time per request that no prefill profile holds: with SGLang's PD
disaggregation, the bootstrap handshake, the KV's hand-over to the decode worker and its first
step (on a lent H200, 2026-11-27, tens of milliseconds against a 24 ms prefill of 8K tokens). A
scale alone cannot fit both a short and a long prompt then. So each cluster also learns an offset
``a``, the intercept of the least-squares line of ``y - link_s`` on ``queue_u + prefill_u`` over the
window, shrunk toward 0 by ``offset_prior_samples`` pseudo-samples and kept within
``[0, the smallest y - link_s seen]``; the scale is then the ratio of sums above of ``y - link_s - a``.
With every sample at one modelled length (no spread) the offset is 0: the ratio alone. The
prediction is::

    TTFT = a + s x (queue_u + prefill_u) + link_s

The queue term is the router's own ledger (every open leg's whole estimate), which
over-counts the work left on a busy worker; fitting ``s`` on the same signal makes
the *prediction* unbiased on average, which is what routing and admission use.

Decode. Each gap between two tokens of a stream, over the gap the model predicts
for the decode worker's batch at that moment, gives the decode scale (ratio of
sums, the same shrinkage).

A cluster gone quiet is believed as its prior again: when no sample came for ``max_age_s``,
:meth:`OnlineCalibration.forget_quiet` (the router's control tick) drops what it learnt. Without
this a few slow first tokens could shun a cluster for good: placement by expected TTFT sends
every request elsewhere once the learnt offset alone exceeds the target, and a cluster that gets
no requests gives no sample to unlearn it. CI's chaos run of 2026-11-27 most likely failed so:
after a router restart behind its front (which resends the backlog at once), its recovery probes
saw no long prompt reach PrfaaS for three minutes. By hand, six late first tokens on the chaos
topology taught a 0.24 s offset against its 0.2 s target; the test replays that on the simulator's
fleet (``tests/router/test_calibration.py``). Sparse traffic keeps its window: only a whole
``max_age_s`` without a sample forgets.

Each first token also records the as-routed prediction's relative error
``|predicted - observed| / observed``, in completion order: :meth:`describe` reports
it in consecutive groups, so the error can be seen falling as requests complete.
"""

from __future__ import annotations

import collections
import statistics
from dataclasses import dataclass

CLUSTERS = ("prfaas", "pd")


@dataclass(frozen=True)
class CalibrationSettings:
    enabled: bool = True  # False: scales stay at the prior (the model as given), errors are still recorded
    prior_scales: tuple[tuple[str, float], ...] = ()  # (cluster, scale) measured beforehand; others 1
    window: int = 64  # recent samples per cluster (and of decode gaps, x 16)
    prior_samples: float = 2.0  # pseudo-samples at the prior scale, per cluster (decode gaps: the same)
    min_scale: float = 0.25
    max_scale: float = 4.0
    offset: bool = True  # learn a per-request offset beside the scale (False: the scale alone)
    offset_prior_samples: float = 4.0  # pseudo-samples at offset 0
    max_age_s: float | None = 30.0  # no sample for this long: back to the prior (None: never)
    error_group: int = 25  # requests per group of the error series

    def __post_init__(self) -> None:
        if self.window < 1 or self.error_group < 1:
            raise ValueError("window and error_group must be >= 1")
        if self.max_age_s is not None and self.max_age_s <= 0:
            raise ValueError("max_age_s must be > 0 (or None)")
        if not 0 < self.min_scale <= 1 <= self.max_scale:
            raise ValueError("need 0 < min_scale <= 1 <= max_scale")
        if self.prior_samples < 0:
            raise ValueError("prior_samples must be >= 0")
        for cluster, scale in self.prior_scales:
            if not cluster or not self.min_scale <= scale <= self.max_scale:
                raise ValueError(f"prior scale {cluster}={scale}: a cluster (its name, or prfaas | pd for every "
                                 f"cluster of that kind), scale in [{self.min_scale:g}, {self.max_scale:g}]")


class _Ratio:
    """Ratio of sums over the last ``window`` (observed, modelled) pairs, shrunk toward ``prior_value``
    by ``prior_samples`` pseudo-samples."""

    def __init__(self, window: int, prior_samples: float, prior_value: float = 1.0):
        self.pairs: collections.deque[tuple[float, float]] = collections.deque(maxlen=window)
        self.newest_s: float | None = None  # when the newest pair was added
        self.prior_samples, self.prior_value = prior_samples, prior_value
        self.observed_sum = self.modelled_sum = 0.0

    def add(self, observed: float, modelled: float, now_s: float) -> None:
        if len(self.pairs) == self.pairs.maxlen:
            old_o, old_m = self.pairs[0]
            self.observed_sum -= old_o
            self.modelled_sum -= old_m
        self.pairs.append((observed, modelled))
        self.newest_s = now_s
        self.observed_sum += observed
        self.modelled_sum += modelled

    def forget_if_quiet_since(self, cutoff_s: float) -> bool:
        """Drop every pair when the newest was added before ``cutoff_s``; True when any went."""
        if self.newest_s is None or self.newest_s >= cutoff_s:
            return False
        self.pairs.clear()
        self.newest_s = None
        self.observed_sum = self.modelled_sum = 0.0
        return True

    def _shrunk(self, observed_sum: float) -> float:
        n = len(self.pairs)
        if n == 0 or self.modelled_sum <= 0:
            return self.prior_value
        return (n * observed_sum / self.modelled_sum + self.prior_samples * self.prior_value) / (n + self.prior_samples)

    def value(self) -> float:
        return self._shrunk(self.observed_sum)

    def __len__(self) -> int:
        return len(self.pairs)


class _OffsetRatio(_Ratio):
    """:class:`_Ratio` of ``observed - a`` over ``modelled``, where ``a`` is the least-squares intercept
    of observed on modelled over the window, shrunk toward 0 (module docstring)."""

    def __init__(self, window: int, prior_samples: float, prior_value: float, offset_prior_samples: float):
        super().__init__(window, prior_samples, prior_value)
        self.offset_prior_samples = offset_prior_samples
        self._offset = 0.0  # refitted on each sample: read on every routing decision

    def add(self, observed: float, modelled: float, now_s: float) -> None:
        super().add(observed, modelled, now_s)
        self._offset = self._fit_offset()

    def forget_if_quiet_since(self, cutoff_s: float) -> bool:
        dropped = super().forget_if_quiet_since(cutoff_s)
        if dropped:
            self._offset = 0.0
        return dropped

    def offset(self) -> float:
        return self._offset

    def _fit_offset(self) -> float:
        n = len(self.pairs)
        if n < 3:
            return 0.0
        mean_y, mean_x = self.observed_sum / n, self.modelled_sum / n
        sxx = sum((x - mean_x) ** 2 for _, x in self.pairs)
        if sxx <= 1e-12 * max(mean_x * mean_x, 1e-30) * n:
            return 0.0  # one modelled length: the intercept is not identifiable
        slope = sum((x - mean_x) * (y - mean_y) for y, x in self.pairs) / sxx
        intercept = (mean_y - slope * mean_x) * n / (n + self.offset_prior_samples)
        return min(max(intercept, 0.0), min(y for y, _ in self.pairs))

    def value(self) -> float:
        return self._shrunk(self.observed_sum - len(self.pairs) * self.offset())


class OnlineCalibration:
    """Scales of the prefill cost per cluster and of the decode step, learned online. ``clusters``: each
    cluster's name -> its kind (prfaas | pd; default: one of each, named by kind). A prior scale names a
    cluster or a kind (then every cluster of it); a name that is neither raises ValueError."""

    def __init__(self, settings: CalibrationSettings | None = None, clusters: dict[str, str] | None = None):
        self.settings = s = settings or CalibrationSettings()
        clusters = clusters or {c: c for c in CLUSTERS}
        prior = dict(s.prior_scales)
        if unknown := sorted(set(prior) - set(clusters) - set(clusters.values())):
            raise ValueError(f"prior scale for {', '.join(unknown)}: no such cluster (clusters: {', '.join(clusters)}; "
                             f"kinds: {', '.join(sorted(set(clusters.values())))})")

        def start(c: str) -> float:
            return prior.get(c, prior.get(clusters[c], 1.0))

        self._prefill = {c: _OffsetRatio(s.window, s.prior_samples, start(c), s.offset_prior_samples)
                         if s.offset else _Ratio(s.window, s.prior_samples, start(c)) for c in clusters}
        self._decode = _Ratio(s.window * 16, s.prior_samples)
        self.errors: list[float] = []  # relative TTFT prediction error, in completion order
        self.samples = dict.fromkeys(clusters, 0)

    def _clamp(self, value: float) -> float:
        return min(max(value, self.settings.min_scale), self.settings.max_scale)

    def prefill_scale(self, cluster: str) -> float:
        """What the model's prefill seconds in ``cluster`` take, times (the prior while disabled)."""
        ratio = self._prefill[cluster]
        return self._clamp(ratio.value() if self.settings.enabled else ratio.prior_value)

    def prefill_offset_s(self, cluster: str) -> float:
        """Seconds every request in ``cluster`` takes beyond its scaled compute (0 while disabled or
        without ``offset``)."""
        ratio = self._prefill[cluster]
        return ratio.offset() if self.settings.enabled and isinstance(ratio, _OffsetRatio) else 0.0

    def decode_scale(self) -> float:
        """What the model's decode step takes, times (1.0 while disabled)."""
        return self._clamp(self._decode.value()) if self.settings.enabled else 1.0

    def first_token(self, cluster: str, modelled_compute_s: float, link_s: float, observed_s: float,
                    predicted_s: float, now_s: float) -> None:
        """A request's first token came ``observed_s`` after dispatch, at ``now_s``. ``modelled_compute_s``: its queue
        and prefill before calibration (without the offset); ``link_s``: the KV's predicted time on the link; ``predicted_s``:
        the TTFT predicted when it was routed (for the error series)."""
        if observed_s <= 0 or cluster not in self._prefill:
            return
        self.errors.append(abs(predicted_s - observed_s) / observed_s)
        if modelled_compute_s > 0:
            self._prefill[cluster].add(max(observed_s - link_s, 0.0), modelled_compute_s, now_s)
            self.samples[cluster] += 1

    def token_gap(self, observed_s: float, modelled_step_s: float, now_s: float) -> None:
        """Two tokens of a stream ``observed_s`` apart (the second at ``now_s``), where the model predicts ``modelled_step_s``."""
        if observed_s > 0 and modelled_step_s > 0:
            self._decode.add(observed_s, modelled_step_s, now_s)

    def forget_quiet(self, now_s: float) -> None:
        """Each cluster's prefill samples, and the decode gaps, with none newer than ``max_age_s`` at
        ``now_s`` are dropped: the prior holds again (nothing when ``max_age_s`` is None)."""
        if self.settings.max_age_s is not None:
            for ratio in (*self._prefill.values(), self._decode):
                ratio.forget_if_quiet_since(now_s - self.settings.max_age_s)

    def error_series(self) -> list[dict]:
        """The relative TTFT error ``|predicted - observed| / observed`` per consecutive group of
        ``error_group`` completed requests: its median (what a typical request sees; a few requests
        caught in a slow period do not move it) and its mean."""
        g = self.settings.error_group
        return [{"requests": f"{i + 1}-{i + len(chunk)}", "median_relative_error": statistics.median(chunk),
                 "mean_relative_error": sum(chunk) / len(chunk)}
                for i in range(0, len(self.errors), g) for chunk in [self.errors[i:i + g]]]

    def describe(self) -> dict:
        return {"enabled": self.settings.enabled,
                "prefill_scale": {c: self.prefill_scale(c) for c in self._prefill},
                "prefill_offset_s": {c: self.prefill_offset_s(c) for c in self._prefill},
                "decode_scale": self.decode_scale(),
                "samples": dict(self.samples), "decode_samples": len(self._decode),
                "ttft_error_series": self.error_series()}
