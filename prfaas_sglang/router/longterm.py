"""Long-term control of the PD split (paper section 3.4.3, "long term"), pure: time comes in as ``now_s``.

The threshold controller (``threshold.py``) moves ``t`` every few seconds on a fixed split. This
one works in minutes: it watches what each stage delivered and converts PD nodes between prefill
and decode when the split no longer fits the load. One decision, every ``interval_s``::

    workload  = incremental and output lengths the router routed over ``window_s``
    measured  = per stage, requests finished / instance-seconds busy     (a busy instance's rate)
    modelled  = the same rate by equations (3)-(5), on the lengths each stage really got
    scale     = clamp(measured / modelled)       only for a stage busy enough to tell (else kept)
    plans     = runtime.calibrated(scale).plan_splits(workload, L_out)   every split's best t
    target    = the split with the highest Lambda_max (ties: the one nearest to now)

    convert when all of these hold
      gain = Lambda(target) / Lambda(now) - 1 >= min_gain     the model says it pays
      some stage is saturated (busy >= busy_high, or its     the load says it matters now:
        queue grew by more than one request per instance)    an idle fleet is not re-split
      the same direction for ``confirm`` decisions running   hysteresis against one noisy window
      (undoing the last conversion within 2 x min_dwell_s:    no flapping between two splits)
       ``reversal_gain_factor`` x the gain)
      not undoing the last conversion while PD-P and PD-D    a cluster saturated on both sides
        are both saturated                                   gains nothing by moving a node back
      now - last conversion >= min_dwell_s                   a conversion drains and restarts nodes
    and move at most ``max_step`` nodes toward the target, never below one node per role.

Far above capacity every stage is saturated, and the model's best split follows each window's
lengths: a 3-node cluster (one conversion moves a third of it) alternated 1P/2D <-> 2P/1D every
dwell period, each reversal clearing even twice ``min_gain`` (BENCHMARKS, the long-term controller
per PD cluster, load 0.8). Whichever way a node moves there, the other stage is still saturated:
so the conversion stands until one side has room again.

The model is the PD cluster's (:class:`~prfaas_sglang.runtime.PdClusterModel`): the cluster and every
PrfaaS cluster linked to it, their capacities pooled, so a PD cluster fed by several PrfaaS clusters is
planned from all its pairs; on one pair, that pair's model.

The paper's drift, ``Theta_prfaas + Theta_pd_p`` against ``Theta_pd_d``, is in every
:class:`Replan` (``drift``: their ratio at the split that ran; 1 is balanced) and in
:meth:`describe`. With a conversion comes the threshold for the new split: the caller hands
each of its pairs' model in ``replan.runtime.pairs`` (its ``research``) to that pair's threshold
controller (:meth:`ThresholdController.replan`).

Who applies a decision: the router (emulated deployment: the engine's role-switch endpoint;
SGLang 0.5.15: drain and restart through the launcher) and the simulator (its own nodes). A node
being converted is drained first, so the caller reports it in neither role's ``instances`` until
it serves again; :func:`pick_nodes` chooses which ones (the least loaded).
"""

from __future__ import annotations

import collections
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from prfaas_sglang.plan.workload import EmpiricalLengths
from prfaas_sglang.runtime import PdClusterModel

STAGES = ("prfaas", "pd-prefill", "pd-decode")


@dataclass(frozen=True)
class LongTermSettings:
    interval_s: float = 60.0  # decide at most this often (model seconds)
    window_s: float = 300.0  # what a decision looks at
    min_dwell_s: float = 300.0  # no conversion sooner than this after the last one
    min_gain: float = 0.05  # Lambda_max gain the model must predict (a fraction of the split's own best)
    # Undoing the last conversion within 2 x min_dwell_s needs this many times min_gain (hysteresis).
    reversal_gain_factor: float = 2.0
    confirm: int = 2  # consecutive decisions wanting the same direction
    busy_high: float = 0.85  # a stage this busy is saturated (and decode's rate can be measured)
    min_busy: float = 0.2  # a prefill stage less busy than this tells nothing about its rate
    max_step: int | None = None  # nodes per conversion; None: max(1, n_pd // 4)
    min_requests: int = 100  # routed requests in the window before any decision
    scale_bounds: tuple[float, float] = (0.5, 2.0)  # measured / modelled, clamped

    def __post_init__(self):
        if not 0 < self.interval_s <= self.window_s:
            raise ValueError("need 0 < interval_s <= window_s")
        if self.min_dwell_s < 0 or self.min_gain < 0 or self.confirm < 1 or self.min_requests < 1:
            raise ValueError("need min_dwell_s >= 0, min_gain >= 0, confirm >= 1, min_requests >= 1")
        if self.reversal_gain_factor < 1:
            raise ValueError("need reversal_gain_factor >= 1")
        if not 0 < self.min_busy < self.busy_high <= 1:
            raise ValueError("need 0 < min_busy < busy_high <= 1")
        if self.max_step is not None and self.max_step < 1:
            raise ValueError("max_step must be >= 1 or None")
        lo, hi = self.scale_bounds
        if not 0 < lo <= 1 <= hi:
            raise ValueError("need 0 < scale_bounds[0] <= 1 <= scale_bounds[1]")


@dataclass(frozen=True)
class StageSample:
    """What the stages did since the previous sample (the caller's counters, differenced).

    ``busy_s``: instance-seconds busy. Prefill: a forward running. Decode: occupancy, the running
    batch over the batch limit, integrated (a full batch for one second is one busy second).
    ``queued``: requests waiting at the stage now. ``instances``: nodes serving the stage now.
    """

    interval_s: float
    completed: Mapping[str, int]
    busy_s: Mapping[str, float]
    queued: Mapping[str, int]
    instances: Mapping[str, int]


@dataclass(frozen=True)
class Replan:
    """A decision. ``convert`` > 0: that many decode nodes become prefill; < 0: prefill become decode."""

    now_s: float
    convert: int
    n_prefill: int  # the split after the conversion
    n_decode: int
    threshold_tokens: float  # the planner's t for the new split (calibrated model, window's lengths and L_out)
    current_rps: float  # Lambda_max of the split that ran, calibrated
    target_rps: float  # Lambda_max of the split the controller moves toward (maybe several steps away)
    drift: float  # (Theta_prfaas + Theta_pd_p) / Theta_pd_d at the split that ran
    scales: Mapping[str, float]
    runtime: PdClusterModel  # the calibrated model at the new split (each pair's ``research`` gives its t)
    reason: str


@dataclass
class LongTermController:
    runtime: PdClusterModel  # the split in force now (model units as the router observes them)
    settings: LongTermSettings = field(default_factory=LongTermSettings)

    scales: dict[str, float] = field(init=False)
    history: collections.deque = field(init=False)

    def __post_init__(self):
        self.scales = {s: 1.0 for s in STAGES}
        self.history = collections.deque(maxlen=100)
        self._routed: collections.deque[tuple[float, int, int, str | None]] = collections.deque()
        self._samples: collections.deque[tuple[float, StageSample]] = collections.deque()
        self._last_decision_s = -math.inf
        self._last_change_s = -math.inf
        self._streak = 0  # signed: consecutive decisions wanting more prefill (> 0) or more decode (< 0)
        self._last: dict = {}
        self._last_direction = 0

    # --- inputs ------------------------------------------------------------------------

    def record(self, now_s: float, uncached_tokens: int, output_tokens: int, cluster: str | None = None) -> None:
        """One routed request: its incremental length, the output it may produce, where it prefills."""
        self._routed.append((now_s, max(uncached_tokens, 1), max(output_tokens, 1), cluster))

    def observe(self, now_s: float, sample: StageSample, threshold_tokens: float) -> Replan | None:
        """Take one sample (``threshold_tokens``: the ``t`` that ran, the PD cluster's one: its pairs'
        lowest); returns a conversion or None."""
        s = self.settings
        self._samples.append((now_s, sample))
        self._trim(now_s)
        if now_s - self._last_decision_s < s.interval_s:
            return None
        self._last_decision_s = now_s
        if len(self._routed) < s.min_requests:
            self._last = {"decision": f"waiting for {s.min_requests} routed requests ({len(self._routed)})"}
            return None

        workload = EmpiricalLengths([r[1] for r in self._routed], "long-term window")
        out_tokens = sum(r[2] for r in self._routed) / len(self._routed)
        busy = self._busy_fractions()
        self._calibrate(out_tokens, busy)
        model = self.runtime.calibrated(self.scales)
        plans = {n: p for n, p in model.plan_splits(workload, out_tokens).items() if n >= 1}
        now_point = model.evaluate_at(workload, threshold_tokens, out_tokens)
        current_rps = now_point.lambda_max_rps
        n_now = self.runtime.n_prefill
        best = max(plans, key=lambda n: (round(plans[n].lambda_max_rps, 9), -abs(n - n_now)))
        # Gain against the best this split can do (its own best t), not against the t that ran:
        # the threshold controller fixes t in seconds; a conversion is for what t cannot fix.
        here = plans[n_now].lambda_max_rps if n_now in plans else current_rps
        gain = plans[best].lambda_max_rps / here - 1 if here > 0 else math.inf
        drift = (now_point.theta_prfaas_rps + now_point.theta_pd_prefill_rps) / now_point.theta_pd_decode_rps
        saturated = self._saturated(busy)

        direction = (best > n_now) - (best < n_now)
        undo = direction != 0 and direction == -self._last_direction
        # Undoing the last conversion soon after it needs more gain: no flapping between two splits.
        reversal = undo and now_s - self._last_change_s < 2 * s.min_dwell_s
        # With both PD stages saturated a node moved back leaves the other side saturated: nothing gained.
        undo_saturated = undo and {"pd-prefill", "pd-decode"} <= set(saturated)
        needed = s.min_gain * (s.reversal_gain_factor if reversal else 1)
        wants = direction != 0 and gain >= needed and bool(saturated) and not undo_saturated
        self._streak = (self._streak + direction if self._streak * direction > 0 else direction) if wants else 0
        self._last = {"target_n_prefill": best, "gain": gain, "drift": drift, "saturated": saturated,
                      "busy": busy, "streak": self._streak, "current_rps": current_rps,
                      "target_rps": plans[best].lambda_max_rps}
        why = (f"split {n_now}P/{self.runtime.n_decode}D -> best {best}P/{self.runtime.n_pd - best}D "
               f"(+{gain:.0%} Lambda_max), drift {drift:.2f}, saturated: {', '.join(saturated) or 'none'}")
        if undo_saturated:
            self._last["decision"] = f"stay (PD-P and PD-D both saturated: no undoing the last conversion): {why}"
            return None
        if not wants:
            self._last["decision"] = f"stay: {why}"
            return None
        if abs(self._streak) < s.confirm:
            self._last["decision"] = f"wait for confirmation ({abs(self._streak)}/{s.confirm}): {why}"
            return None
        if now_s - self._last_change_s < s.min_dwell_s:
            self._last["decision"] = f"dwell ({now_s - self._last_change_s:.0f} s < {s.min_dwell_s:.0f} s): {why}"
            return None

        n_pd = self.runtime.n_pd
        step = s.max_step or max(1, n_pd // 4)
        n_new = min(max(n_now + max(-step, min(step, best - n_now)), 1), n_pd - 1)
        if n_new == n_now:
            return None
        new_model = model.with_split(n_new)
        replan = Replan(now_s, n_new - n_now, n_new, n_pd - n_new, plans[n_new].threshold_tokens,
                        current_rps, plans[best].lambda_max_rps, drift, dict(self.scales), new_model, why)
        self.runtime = self.runtime.with_split(n_new)
        self._last_change_s, self._streak, self._last_direction = now_s, 0, direction
        self._samples.clear()  # what the old split did says little about the new one
        self.history.append(replan)
        self._last["decision"] = f"convert {replan.convert:+d}: {why}"
        return replan

    def describe(self) -> dict:
        return {"n_prefill": self.runtime.n_prefill, "n_decode": self.runtime.n_decode, "scales": dict(self.scales),
                "window_requests": len(self._routed), "conversions": len(self.history), **self._last}

    # --- internals ---------------------------------------------------------------------

    def _trim(self, now_s: float) -> None:
        horizon = now_s - self.settings.window_s
        while self._routed and self._routed[0][0] < horizon:
            self._routed.popleft()
        while self._samples and self._samples[0][0] < horizon:
            self._samples.popleft()

    def _busy_fractions(self) -> dict[str, float]:
        """Per stage, busy instance-seconds over available instance-seconds in the window."""
        out = {}
        for stage in STAGES:
            avail = sum(smp.interval_s * smp.instances.get(stage, 0) for _, smp in self._samples)
            if avail > 0:
                out[stage] = min(sum(smp.busy_s.get(stage, 0.0) for _, smp in self._samples) / avail, 1.0)
        return out

    def _saturated(self, busy: Mapping[str, float]) -> list[str]:
        """Stages busy past ``busy_high`` or whose queue grew by more than one request per instance."""
        out = [stage for stage, b in busy.items() if b >= self.settings.busy_high]
        if len(self._samples) >= 2:
            first, last = self._samples[0][1], self._samples[-1][1]
            for stage in STAGES:
                grew = last.queued.get(stage, 0) - first.queued.get(stage, 0)
                if stage not in out and grew > max(last.instances.get(stage, 0), 1):
                    out.append(stage)
        return out

    def _calibrate(self, out_tokens: float, busy: Mapping[str, float]) -> None:
        """``scales[stage]`` = measured / modelled per-instance rate, for stages busy enough to tell.

        Modelled as the equations do it, on what the stage really got: prefill ``1 / T(mean uncached
        length routed there)``, decode ``BS_max / (T_decode * mean L_out)``. So a scale holds the
        model's error (``E[T(l)]`` against ``T(E[l])``, a profile that is off), not a change of ``t``."""
        modelled: dict[str, float | None] = {"pd-decode": self.runtime.decode_rate(out_tokens)}
        for stage, cluster in (("prfaas", "prfaas"), ("pd-prefill", "pd")):
            lens = [r[1] for r in self._routed if r[3] == cluster]
            modelled[stage] = self.runtime.prefill_rate(cluster, sum(lens) / len(lens)) if lens else None
        lo, hi = self.settings.scale_bounds
        for stage in STAGES:
            busy_s = sum(smp.busy_s.get(stage, 0.0) for _, smp in self._samples)
            done = sum(smp.completed.get(stage, 0) for _, smp in self._samples)
            # A decode node below a full batch steps faster than T_decode (the SLO's step at BS_max), so
            # its rate per occupied slot overstates its capacity: decode is calibrated only when saturated.
            floor = self.settings.busy_high if stage == "pd-decode" else self.settings.min_busy
            if busy.get(stage, 0.0) < floor or busy_s <= 0 or done < 10 or not modelled[stage]:
                continue
            self.scales[stage] = min(max((done / busy_s) / modelled[stage], lo), hi)


ClusterKey = tuple[str, str]  # (stage, the cluster it runs at)


@dataclass(frozen=True)
class ClusterSample:
    """What every stage of every cluster did since the previous sample: :class:`StageSample`'s fields keyed
    by ``(stage, cluster)``, and ``completed`` by ``(stage, cluster, the PD cluster that decodes the
    request)``. :meth:`for_pd` is one PD cluster's view, :meth:`totals` the whole fleet's; on a one-pair
    deployment both are the one :class:`StageSample`."""

    interval_s: float
    completed: Mapping[tuple[str, str, str], int]
    busy_s: Mapping[ClusterKey, float]
    queued: Mapping[ClusterKey, int]
    instances: Mapping[ClusterKey, int]

    def totals(self) -> StageSample:
        """Every cluster of a stage together."""
        def by_stage(m: Mapping) -> dict:
            out = dict.fromkeys(STAGES, 0)
            for key, v in m.items():
                out[key[0]] += v
            return out
        return StageSample(self.interval_s, by_stage(self.completed), by_stage(self.busy_s), by_stage(self.queued),
                           by_stage(self.instances))

    def for_pd(self, pd: str, links: Mapping[str, Sequence[str]]) -> StageSample:
        """PD cluster ``pd``'s stages, and of each PrfaaS cluster linked to it (``links``: PrfaaS cluster ->
        the PD clusters it serves) the share that worked for ``pd``: its busy time, queue and instances
        times the share of its prefills completed in the interval that ``pd`` decodes (no prefill
        completed: an equal share per PD cluster it serves). So a PrfaaS cluster's rate, completed over
        busy, is the same in every PD cluster's view, and the shares of all its PD clusters add up to it."""
        completed, busy, queued, instances = dict.fromkeys(STAGES, 0), dict.fromkeys(STAGES, 0.0), dict.fromkeys(STAGES, 0), \
            dict.fromkeys(STAGES, 0.0)
        for stage in ("pd-prefill", "pd-decode"):
            completed[stage] = sum(n for (st, _, to), n in self.completed.items() if st == stage and to == pd)
            busy[stage] = self.busy_s.get((stage, pd), 0.0)
            queued[stage] = self.queued.get((stage, pd), 0)
            instances[stage] = self.instances.get((stage, pd), 0)
        for prfaas, served in links.items():
            if pd not in served:
                continue
            done = {to: n for (st, at, to), n in self.completed.items() if st == "prfaas" and at == prfaas}
            share = done.get(pd, 0) / sum(done.values()) if sum(done.values()) else 1.0 / len(served)
            completed["prfaas"] += done.get(pd, 0)
            busy["prfaas"] += share * self.busy_s.get(("prfaas", prfaas), 0.0)
            queued["prfaas"] += round(share * self.queued.get(("prfaas", prfaas), 0))
            instances["prfaas"] += share * self.instances.get(("prfaas", prfaas), 0)
        return StageSample(self.interval_s, completed, busy, queued, instances)


class StageMeter:
    """:class:`ClusterSample` from what a live router sees (the simulator measures its nodes directly).

    ``poll`` integrates each worker's load answer over the time since the previous poll: a prefill
    worker with anything running or waiting is busy; a decode worker is busy by its occupancy,
    running over its batch limit. ``complete`` counts a leg that ended at a stage. ``sample``
    differences both since the previous sample. Accuracy is the load poll's (0.5 s by default):
    enough for a controller that decides in minutes.
    """

    MAX_POLL_GAP_S = 5.0  # a longer gap (the loop stalled) is not integrated as if the load held

    def __init__(self) -> None:
        self._busy_s: collections.Counter = collections.Counter()
        self._completed: collections.Counter = collections.Counter()
        self._last_poll_s: float | None = None
        self._taken: tuple[collections.Counter, collections.Counter] = (collections.Counter(), collections.Counter())
        self._last_sample_s: float | None = None

    def poll(self, now_s: float, loads) -> None:
        """``loads``: ``(stage, cluster, running, waiting, max_running | None)`` per worker serving a stage now."""
        dt = 0.0 if self._last_poll_s is None else min(max(now_s - self._last_poll_s, 0.0), self.MAX_POLL_GAP_S)
        self._last_poll_s = now_s
        for stage, cluster, running, waiting, max_running in loads:
            if stage == "pd-decode":
                self._busy_s[stage, cluster] += dt * (min(running / max_running, 1.0) if max_running else float(running > 0))
            elif running or waiting:
                self._busy_s[stage, cluster] += dt

    def complete(self, stage: str, cluster: str, pd: str) -> None:
        """A leg ended at ``stage`` of ``cluster``, for a request PD cluster ``pd`` decodes."""
        self._completed[stage, cluster, pd] += 1

    def sample(self, now_s: float, queued: Mapping[ClusterKey, int], instances: Mapping[ClusterKey, int]) -> ClusterSample:
        busy, done = self._taken
        interval = 0.0 if self._last_sample_s is None else now_s - self._last_sample_s
        out = ClusterSample(interval, {k: n for k in self._completed if (n := self._completed[k] - done[k])},
                            {k: self._busy_s[k] - busy[k] for k in self._busy_s}, dict(queued), dict(instances))
        self._taken, self._last_sample_s = (collections.Counter(self._busy_s), collections.Counter(self._completed)), now_s
        return out


def pick_nodes(candidates: Sequence[tuple[str, float]], count: int) -> list[str]:
    """The ``count`` least loaded of ``(name, load)`` (ties by name): the ones that drain soonest."""
    return [name for name, _ in sorted(candidates, key=lambda c: (c[1], c[0]))[:max(count, 0)]]
