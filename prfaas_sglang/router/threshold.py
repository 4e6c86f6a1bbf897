"""Short-term control of the routing threshold ``t`` (paper section 3.4.3), pure: time comes in as ``now_s``.

``t`` is the planner's threshold for what the router *measures*, times a
queue-balance bias::

    t = clamp(model_t(capacity_est, workload_est) * bias, step, longest request)

* ``model_t`` is the planner's balance, ``Theta_prfaas / p = Theta_pd_p / (1 - p)``
  (and the bandwidth ceiling of equation (3)), searched by ``research`` on
  ``capacity_est``, the link capacity telemetry shows, and on ``workload_est``,
  the incremental lengths the router really routed (a sliding window, blended
  with the prior while it is small; re-searched every ``research_every_s``).
  With the operator's baseline set, ``model_t`` is that baseline on a healthy
  link and never below it on a constrained one.
* ``capacity_est`` starts at the nominal link. It drops to the measured
  capacity when the link is busy (>= ``busy_high``) and delivers less than
  ``drop_ratio`` of the estimate for ``confirm_s``; once a drop is pending, a
  sample still mostly busy (>= ``busy_hold``) and still low keeps it pending
  (the gap between two transfers is not a recovery); it rises when a measurement
  exceeds ``rise_ratio`` of it for ``confirm_s`` (back to nominal once within
  ``recovered_ratio`` of it). A capacity change re-searches ``model_t`` and
  resets ``bias`` to 1 (the queues it answered belonged to the old link).
  A drop confirmed by a sample of a link not saturated (busy below ``busy_high``:
  little traffic in its window, a transfer's gap or a slow start) lowers the
  estimate at most to ``light_drop_ratio`` of it: such a rate says little of
  the link, and one of them once took it to the floor, where a 2,048-token
  request was predicted 67 s and early rejection would have refused what the
  link carried. Only saturated samples take it further (a stall: the floor).
  A sample of an idle link (busy below ``busy_hold``, with or without a rate)
  ends a pending drop, so samples apart by a silence never confirm one.
  A drop is taken at the sample that confirmed it, often one of the transition
  (writes begun at the old rate land late) and low by a fifth; the rise rule
  cannot correct that. So while constrained, the busy samples that are neither a
  drop nor a rise are averaged (``track_gain`` per sample), and once that average
  is ``min_relative_change`` away from the estimate it becomes the estimate: a
  refinement of the same link, which keeps ``bias`` and moves ``t`` under the
  usual rule.
  Any other change of ``t`` smaller than ``min_relative_change`` is not made:
  ``t`` settles.
* ``bias`` (starts at 1) answers the queues: the outstanding prefill seconds per
  PD-P and per PrfaaS instance. When PD-P backs up (>= ``queue_high_s``, and
  ``imbalance`` times PrfaaS's) while the link has headroom, ``bias`` steps down
  by ``step_factor`` (more offload); when PrfaaS backs up likewise, it steps up.
  At most one step per ``adjust_every_s``, and no second step the same way
  while the queue it answered is already shrinking (a lower ``t`` only
  reroutes new arrivals; the backlog drains at its own pace, and stepping on
  it winds the bias up: t fell from 43K to 5.7K in 8 s before this rule, with
  PrfaaS then overloaded). After ``idle_decay_s`` with both
  queues empty it steps back toward 1. On a constrained link the bias is at
  least 1: the bandwidth-bound ``model_t`` is a floor.
* While the link is constrained and nothing crosses it, capacity is re-probed
  with a bounded trickle: ``probe_budget_bytes`` allows one offloaded request
  per ``probe_interval_s`` whose KV crosses, at ``capacity_est``, in half the
  time the link has been silent (capped at ``probe_max_s``). The budget grows
  with the silence because only requests below ``t`` can probe, and on a hybrid
  model even a short one carries a fixed linear-attention state: a fixed
  one-second budget admitted only prompts under ~12K tokens, so a recovered link
  went unnoticed for 13 s when none arrived (bench bandwidth, seed 1).
  A drop measured from a stall (saturated, next to nothing delivered: the estimate
  goes to its floor, ``CAPACITY_FLOOR_RATIO`` of nominal) says nothing of the rate:
  probes are then sized at the estimate the link had before the stall, or none would ever fit
  and the floor would be for good (a second or so of a real SGLang sender
  delivering nothing, on a 2-core box, kept a healthy link off for the rest of a
  run). A probe that delivered nothing
  doubles the wait before the next (up to ``probe_backoff_max`` times
  ``probe_interval_s``), so a dead link costs a few requests, not one per interval.

Queue marks are model seconds; ``time_scale`` (1 / an emulated engine's
speedup) converts them to the engines' seconds, the unit of the queue signal.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Callable
from dataclasses import dataclass, field

from prfaas_sglang.plan.workload import BlendedWorkload, Workload

CAPACITY_FLOOR_RATIO = 1e-3  # the capacity estimate's floor, as a fraction of nominal_bps (where a stall puts it)


@dataclass(frozen=True)
class ControllerSettings:
    time_scale: float = 1.0
    busy_high: float = 0.9
    busy_hold: float = 0.5
    drop_ratio: float = 0.7
    rise_ratio: float = 1.4
    recovered_ratio: float = 0.7  # = drop_ratio: one band; a single transfer rarely shows the full nominal rate
    confirm_s: float = 0.5  # three telemetry samples (0.25 s apart) must agree
    queue_high_s: float = 10.0  # model seconds of outstanding prefill per instance: a few long prompts waiting
    queue_low_s: float = 1.0
    imbalance: float = 2.0
    adjust_every_s: float = 1.0
    step_factor: float = 1.25
    min_bias: float = 1 / 16
    max_bias: float = 16.0
    idle_decay_s: float = 30.0
    research_every_s: float = 10.0
    min_relative_change: float = 0.1
    window_requests: int = 1000
    window_s: float = 600.0
    prior_weight: float = 100.0
    probe_interval_s: float = 2.0
    probe_max_s: float = 8.0
    probe_backoff_max: int = 16  # unanswered probes stretch the interval up to this factor
    track_gain: float = 0.25  # while constrained: weight of each busy sample in the refined capacity
    # A drop confirmed by a sample busy below busy_high lowers the estimate to no less than this
    # ratio of it: a lightly used link's rate is not its capacity. Half: one such sample at most
    # doubles a predicted transfer time (never 1,000x, the floor); a saturated sample still sets
    # the level it measured at once, and each further confirmed drop halves it again.
    light_drop_ratio: float = 0.5

    def __post_init__(self):
        if not 0 < self.busy_hold <= self.busy_high <= 1:
            raise ValueError("need 0 < busy_hold <= busy_high <= 1")
        if not 0 < self.drop_ratio < 1 < self.rise_ratio or not 0 < self.recovered_ratio <= 1:
            raise ValueError("need 0 < drop_ratio < 1 < rise_ratio and 0 < recovered_ratio <= 1")
        if not 0 < self.track_gain <= 1:
            raise ValueError("need 0 < track_gain <= 1")
        if not 0 < self.light_drop_ratio < 1:
            raise ValueError("need 0 < light_drop_ratio < 1")
        if not 0 < self.probe_interval_s <= self.probe_max_s or self.probe_backoff_max < 1:
            raise ValueError("need 0 < probe_interval_s <= probe_max_s and probe_backoff_max >= 1")
        if not 0 < self.queue_low_s < self.queue_high_s or self.step_factor <= 1 or self.time_scale <= 0:
            raise ValueError("need 0 < queue_low_s < queue_high_s, step_factor > 1, time_scale > 0")


@dataclass(frozen=True)
class LinkView:
    """The PrfaaS -> PD link now, aggregated over the PrfaaS workers' telemetry."""

    capacity_bps: float | None  # delivered while busy; None: not measured in the window
    busy_fraction: float
    egress_bps: float = 0.0
    offered_bps: float = 0.0
    backlog_bytes: int = 0
    congested: bool = False  # any worker's KV connections flag congestion (wire v3)
    completed: int = 0  # transfers delivered in the workers' last windows (wire v4)
    failed: int = 0  # transfers that ended undelivered in those windows (wire v4)


@dataclass(frozen=True)
class QueueView:
    """Outstanding prefill work per instance, in engine seconds (released when a prefill leg ends)."""

    prfaas_s: float
    pd_s: float


@dataclass
class ThresholdController:
    research: Callable[[float, Workload], float]  # (capacity bits/s, workload) -> the planner's t
    prior: Workload
    nominal_bps: float
    step_tokens: float
    operator_baseline_tokens: float | None = None
    settings: ControllerSettings = field(default_factory=ControllerSettings)

    threshold_tokens: float = field(init=False)
    capacity_est_bps: float = field(init=False)
    bias: float = field(init=False, default=1.0)
    override_tokens: float | None = field(init=False, default=None)
    history: collections.deque = field(init=False)

    def __post_init__(self):
        if not self.nominal_bps > 0 or not self.step_tokens > 0:
            raise ValueError("nominal_bps and step_tokens must be > 0")
        self.capacity_est_bps = self.nominal_bps
        self.history = collections.deque(maxlen=1000)
        self._lengths: collections.deque[tuple[float, int]] = collections.deque(maxlen=self.settings.window_requests)
        self._workload: Workload = self.prior
        self._capacity_reason = ""
        self._drop_since: float | None = None
        self._rise_since: float | None = None
        self._tracked_bps: float | None = None  # busy samples' average while constrained
        self._last_adjust_s = -math.inf
        self._last_step: tuple[int, float] | None = None  # (direction, the queue it answered, engine s)
        self._idle_since: float | None = None
        self._last_research_s = -math.inf
        self._last_progress_s = -math.inf
        self._last_probe_s = -math.inf
        self._probe_backoff = 1  # doubles per probe that delivered nothing
        self._stalled_from_bps: float | None = None  # the estimate before a stall took it to the floor
        self._model_cache: dict[tuple[float, int], float] = {}
        self._workload_version = 0
        self._model_t = self._model(self.capacity_est_bps)
        self.threshold_tokens = self._target(self._model_t)
        self.baseline_tokens = self.threshold_tokens

    # --- inputs ------------------------------------------------------------------------

    def record(self, now_s: float, uncached_tokens: int) -> None:
        """One routed request's incremental length (feeds ``workload_est``)."""
        self._lengths.append((now_s, uncached_tokens))

    def observe(self, now_s: float, link: LinkView | None, queues: QueueView) -> float | None:
        """Feed one sample; returns the new ``t`` when it changed, else None."""
        s = self.settings
        reasons = []
        if link is not None and link.egress_bps > 0:
            self._last_progress_s = now_s
            self._probe_backoff = 1
        capacity_changed = False
        if link is not None and link.capacity_bps is None and link.busy_fraction < s.busy_hold:
            self._drop_since = None  # an idle link: a later low sample starts a drop, never confirms one alone
        if link is not None and link.capacity_bps is not None:
            event = self._update_capacity(now_s, link)
            if event is not None:
                reasons.append(self._capacity_reason)
            if event == "changed":  # another link: the queues bias answered belonged to the old one
                capacity_changed = True
                self.bias, self._last_adjust_s, self._idle_since = 1.0, now_s, None
        if now_s - self._last_research_s >= s.research_every_s:
            self._last_research_s = now_s
            if self._refresh_workload(now_s):
                reasons.append("workload window")
        reasons += self._update_bias(now_s, link, queues)
        target = self._target(self._refresh_model())
        if self.override_tokens is not None or not reasons:
            return None
        current = self.threshold_tokens
        if abs(target - current) < s.min_relative_change * current and not capacity_changed:
            return None
        why = "; ".join(reasons)
        return self._set(now_s, target, f"{'raise' if target > current else 'lower'}: {why}")

    # --- probing -----------------------------------------------------------------------

    @property
    def constrained(self) -> bool:
        return self.capacity_est_bps < self.settings.recovered_ratio * self.nominal_bps

    def probe_budget_bytes(self, now_s: float) -> float | None:
        """KV bytes one probe may carry now, or None when no probe is due (also under an admin override
        of ``t``: the estimate still judges PrfaaS's expected TTFT, so it is still re-measured)."""
        s = self.settings
        if not self.constrained:  # an override fixes t, not the link: the estimate still gates the TTFT SLO
            return None
        silent_s = now_s - max(self._last_probe_s, self._last_progress_s)
        if silent_s < s.probe_interval_s * self._probe_backoff:
            return None
        rate_bps = self._stalled_from_bps if self._stalled_from_bps is not None else self.capacity_est_bps
        return 0.5 * min(silent_s, s.probe_max_s) * rate_bps / 8.0

    def note_probe(self, now_s: float) -> None:
        """A probe was sent now. One sent after a probe that saw nothing cross backs off."""
        unanswered = self._last_probe_s > self._last_progress_s
        self._probe_backoff = min(2 * self._probe_backoff, self.settings.probe_backoff_max) if unanswered else 1
        self._last_probe_s = now_s

    # --- admin -------------------------------------------------------------------------

    def override(self, now_s: float, tokens: float | None) -> float:
        """Fix ``t`` (admin); ``None`` hands control back to the controller."""
        self.override_tokens = tokens
        target = tokens if tokens is not None else self._target(self._model_t)
        self._set(now_s, target, "override" if tokens is not None else "override cleared")
        return self.threshold_tokens

    def replan(self, now_s: float, research: Callable[[float, Workload], float], why: str) -> float | None:
        """Take a new planner (the long-term controller changed the PD split): ``model_t`` is
        re-searched with it and ``t`` moves there at once, ``bias`` back to 1 (the queues it
        answered belonged to the old split). An admin override stays. Returns the new ``t`` or None."""
        self.research = research
        self._model_cache.clear()
        self.bias, self._last_step, self._idle_since, self._last_adjust_s = 1.0, None, None, now_s
        model_t = self._refresh_model()
        if self.override_tokens is not None:
            return None
        return self._set(now_s, self._target(model_t), f"replan: {why}")

    def describe(self) -> dict:
        return {"threshold_tokens": self.threshold_tokens, "baseline_tokens": self.baseline_tokens,
                "model_threshold_tokens": self._model_t, "bias": self.bias,
                "capacity_est_bps": self.capacity_est_bps, "nominal_bps": self.nominal_bps,
                "constrained": self.constrained, "override_tokens": self.override_tokens,
                "window_requests": len(self._lengths), "workload_mean_tokens": self._workload.mean_tokens}

    # --- internals ---------------------------------------------------------------------

    def _update_capacity(self, now_s: float, link: LinkView) -> str | None:
        """``"changed"`` (a drop or a rise confirmed), ``"refined"`` (the same constrained link, its
        estimate corrected by its busy samples), or None; ``_capacity_reason`` says why."""
        s, m, est = self.settings, link.capacity_bps, self.capacity_est_bps
        busy = link.busy_fraction >= (s.busy_high if self._drop_since is None else s.busy_hold)
        if m < s.drop_ratio * est and busy:
            self._rise_since = None
            self._drop_since = self._drop_since if self._drop_since is not None else now_s
            if now_s - self._drop_since >= s.confirm_s:
                self._drop_since = None
                floor = CAPACITY_FLOOR_RATIO * self.nominal_bps
                light = link.busy_fraction < s.busy_high  # not saturated: a bounded step down, never a stall
                level = max(m, s.light_drop_ratio * est) if light else m
                if level < floor:  # a stall: no rate measured; keep what the link carried for sizing probes
                    self._stalled_from_bps = self._stalled_from_bps or est
                else:
                    self._stalled_from_bps = None
                self.capacity_est_bps = self._tracked_bps = max(level, floor)
                self._capacity_reason = f"link delivers {m / 1e6:.1f} Mbit/s while busy {link.busy_fraction:.2f}"
                if level > m:
                    self._capacity_reason += f" (lightly used: estimate lowered only to {level / 1e6:.1f})"
                return "changed"
            return None
        self._drop_since = None
        if m > s.rise_ratio * est:
            self._rise_since = self._rise_since if self._rise_since is not None else now_s
            if now_s - self._rise_since >= s.confirm_s:
                self._rise_since = None
                self.capacity_est_bps = self.nominal_bps if m >= s.recovered_ratio * self.nominal_bps else min(m, self.nominal_bps)
                self._tracked_bps, self._stalled_from_bps = self.capacity_est_bps, None
                self._capacity_reason = f"link capacity back to {self.capacity_est_bps / 1e6:.1f} Mbit/s"
                return "changed"
            return None
        self._rise_since = None
        if not self.constrained or link.busy_fraction < s.busy_high:
            return None
        tracked = m if self._tracked_bps is None else self._tracked_bps + s.track_gain * (m - self._tracked_bps)
        self._tracked_bps = tracked
        if abs(tracked - est) < s.min_relative_change * est:
            return None
        self.capacity_est_bps, self._stalled_from_bps = min(tracked, self.nominal_bps), None
        self._capacity_reason = (f"link delivers {tracked / 1e6:.1f} Mbit/s while busy (estimate refined from "
                                 f"{est / 1e6:.1f})")
        return "refined"

    def _refresh_workload(self, now_s: float) -> bool:
        s = self.settings
        while self._lengths and now_s - self._lengths[0][0] > s.window_s:
            self._lengths.popleft()
        if not self._lengths:
            return False
        self._workload = BlendedWorkload(self.prior, [n for _, n in self._lengths], s.prior_weight, "router window")
        self._workload_version += 1
        return True

    def _update_bias(self, now_s: float, link: LinkView | None, q: QueueView) -> list[str]:
        s = self.settings
        high, low = s.queue_high_s * s.time_scale, s.queue_low_s * s.time_scale
        if self.constrained:
            if self.bias < 1.0:
                self.bias = 1.0
                return ["constrained link: no offload beyond the bandwidth-bound t"]
            return []
        if now_s - self._last_adjust_s < s.adjust_every_s:
            return []
        link_busy = link is not None and link.busy_fraction >= s.busy_high
        if q.pd_s >= high and q.pd_s > s.imbalance * q.prfaas_s and not link_busy and self.bias > s.min_bias:
            if self._responding(-1, q.pd_s):
                return []
            self._last_adjust_s, self._idle_since, self._last_step = now_s, None, (-1, q.pd_s)
            self.bias = max(self.bias / s.step_factor, s.min_bias)
            return [f"PD-P queue {q.pd_s:.2f} s vs PrfaaS {q.prfaas_s:.2f} s"]
        if q.prfaas_s >= high and q.prfaas_s > s.imbalance * q.pd_s and self.bias < s.max_bias:
            if self._responding(+1, q.prfaas_s):
                return []
            self._last_adjust_s, self._idle_since, self._last_step = now_s, None, (+1, q.prfaas_s)
            self.bias = min(self.bias * s.step_factor, s.max_bias)
            return [f"PrfaaS queue {q.prfaas_s:.2f} s vs PD-P {q.pd_s:.2f} s"]
        if q.pd_s <= low and q.prfaas_s <= low and self.bias != 1.0:
            self._idle_since = self._idle_since if self._idle_since is not None else now_s
            if now_s - self._idle_since >= s.idle_decay_s:
                self._idle_since, self._last_adjust_s = now_s, now_s
                self.bias = min(self.bias * s.step_factor, 1.0) if self.bias < 1 else max(self.bias / s.step_factor, 1.0)
                return ["queues idle: bias back toward 1"]
        else:
            self._idle_since = None
        return []

    def _refresh_model(self) -> float:
        """``model_t`` on the current estimate, and the baseline on the nominal link; returns ``model_t``."""
        self._model_t = self._model(self.capacity_est_bps)
        self.baseline_tokens = self._target(self._model(self.nominal_bps), 1.0)
        return self._model_t

    def _responding(self, direction: int, queue_s: float) -> bool:
        """The last step went this way and the queue it answered has shrunk since: let it drain."""
        return self._last_step is not None and self._last_step[0] == direction and queue_s < self._last_step[1]

    def _model(self, capacity_bps: float) -> float:
        key = (round(capacity_bps, -3), self._workload_version)
        cached = self._model_cache.get(key)
        if cached is None:
            if len(self._model_cache) > 256:
                self._model_cache.clear()
            cached = self.research(capacity_bps, self._workload)
            base = self.operator_baseline_tokens
            if base is not None:
                healthy = capacity_bps >= self.settings.recovered_ratio * self.nominal_bps
                cached = base if healthy else max(base, cached)
            self._model_cache[key] = cached
        return cached

    def _target(self, model_t: float, bias: float | None = None) -> float:
        """``model_t * bias`` within [step, longest request]; a biased value is put on the search grid,
        ``model_t`` itself (the planner's, or the operator's baseline) is kept exact."""
        bias = self.bias if bias is None else bias
        tokens = model_t if bias == 1.0 else round(model_t * bias / self.step_tokens) * self.step_tokens
        longest = math.ceil(max(self.prior.max_tokens, self._workload.max_tokens) / self.step_tokens) * self.step_tokens
        return min(max(tokens, self.step_tokens), longest)

    def _set(self, now_s: float, tokens: float, why: str) -> float | None:
        if tokens == self.threshold_tokens:
            return None
        self.threshold_tokens = tokens
        self.history.append((now_s, tokens, why))
        return tokens
