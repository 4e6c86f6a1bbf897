"""The long-term controller (router/longterm.py): when it converts, how far, and when it holds still."""

from __future__ import annotations

import dataclasses
import random

import pytest

from prfaas_sglang.plan.workload import TruncatedLogNormal
from prfaas_sglang.router.longterm import (
    LongTermController,
    LongTermSettings,
    StageSample,
    pick_nodes,
)
from prfaas_sglang.router.threshold import ThresholdController
from prfaas_sglang.runtime import PdClusterModel
from prfaas_sglang.sim.fleet import FleetSpec
from prfaas_sglang.topology import SitePair

SETTINGS = LongTermSettings(interval_s=60, window_s=300, min_dwell_s=300, confirm=2, min_requests=50)


@pytest.fixture(scope="module")
def runtime():
    """The case study's deployment (4 PrfaaS, 8 PD) built the product's way, at 3P/5D."""
    return FleetSpec(4, 3, 5).runtime()


def cluster(runtime):
    """The PD cluster's model the long-term controller plans on: here its one pair's (FleetSpec names them)."""
    return PdClusterModel({SitePair("pd", "prfaas"): runtime})


def lengths(median_factor: float, n: int, seed: int = 0) -> list[int]:
    import math

    dist = TruncatedLogNormal(9.90 + math.log(median_factor), 1.0, 128, 131_072)
    return [int(x) for x in dist.sample(random.Random(seed), n)]


def sample(busy: dict[str, float], n_prefill: int, n_decode: int, queued: dict[str, int] | None = None,
           done_per_busy_s: dict[str, float] | None = None, interval_s: float = 10.0) -> StageSample:
    instances = {"prfaas": 4, "pd-prefill": n_prefill, "pd-decode": n_decode}
    busy_s = {k: busy[k] * interval_s * instances[k] for k in busy}
    rates = done_per_busy_s or {}
    completed = {k: int(busy_s[k] * rates.get(k, 0.0)) for k in busy}
    return StageSample(interval_s, completed, busy_s, queued or {}, instances)


def feed(ctl: LongTermController, start_s: float, end_s: float, lens: list[int], smp: StageSample, t: float = 24_000):
    """Record ``lens`` spread over [start, end) and sample every 10 s; returns the decisions."""
    step = (end_s - start_s) / len(lens)
    for i, n in enumerate(lens):
        ctl.record(start_s + i * step, n, 1024)
    out = []
    now = start_s + 10
    while now <= end_s:
        d = ctl.observe(now, smp, t)
        if d is not None:
            out.append(d)
        now += 10
    return out


def test_longer_prompts_on_a_saturated_prefill_side_convert_decode_nodes(runtime):
    ctl = LongTermController(cluster(runtime), SETTINGS)
    saturated = sample({"prfaas": 1.0, "pd-prefill": 1.0, "pd-decode": 0.3}, 3, 5)
    decisions = feed(ctl, 0, 600, lengths(2.0, 600), saturated)
    assert decisions, ctl.describe()
    first = decisions[0]
    assert first.convert > 0 and first.n_prefill == 3 + first.convert and first.n_prefill + first.n_decode == 8
    assert first.convert <= max(1, 8 // 4)  # max_step
    assert first.target_rps >= (1 + SETTINGS.min_gain) * first.current_rps
    assert first.runtime.n_prefill == first.n_prefill
    # the threshold for the new split: more PD-P nodes take longer prompts locally than 3P did
    assert first.threshold_tokens > runtime.baseline_threshold_tokens
    # a second conversion waits out the dwell time
    times = [d.now_s for d in decisions]
    assert all(b - a >= SETTINGS.min_dwell_s for a, b in zip(times, times[1:], strict=False))


def test_confirmation_is_needed(runtime):
    ctl = LongTermController(cluster(runtime), SETTINGS)
    saturated = sample({"prfaas": 1.0, "pd-prefill": 1.0, "pd-decode": 0.3}, 3, 5)
    for i, n in enumerate(lengths(2.0, 300)):
        ctl.record(i * 0.2, n, 1024)
    assert ctl.observe(60, saturated, 24_000) is None  # first decision wanting it
    assert "confirmation" in ctl.describe()["decision"]
    assert ctl.observe(120, saturated, 24_000) is not None  # second in a row


@pytest.mark.slow
def test_an_idle_fleet_is_not_resplit(runtime):
    """The model would gain, but no stage is busy and no queue grows: nothing to win now."""
    ctl = LongTermController(cluster(runtime), SETTINGS)
    idle = sample({"prfaas": 0.3, "pd-prefill": 0.3, "pd-decode": 0.1}, 3, 5)
    assert feed(ctl, 0, 900, lengths(2.0, 600), idle) == []
    assert ctl.describe()["decision"].startswith("stay") and ctl.describe()["gain"] > SETTINGS.min_gain


@pytest.mark.slow
def test_a_growing_queue_counts_as_saturation(runtime):
    ctl = LongTermController(cluster(runtime), SETTINGS)
    for i, n in enumerate(lengths(2.0, 600)):
        ctl.record(i, n, 1024)
    decisions = []
    for k in range(1, 61):
        smp = sample({"prfaas": 0.7, "pd-prefill": 0.7, "pd-decode": 0.2}, 3, 5, queued={"pd-prefill": 2 * k})
        d = ctl.observe(k * 10, smp, 24_000)
        decisions += [d] if d else []
    assert decisions and decisions[0].convert > 0


def test_short_prompts_move_nodes_to_decode_and_never_below_one_per_role(runtime):
    """Short prompts with long outputs: decode binds; the controller moves prefill nodes to decode, at
    most down to one PD-P node."""
    ctl = LongTermController(cluster(runtime.with_split(6)), dataclasses.replace(SETTINGS, min_dwell_s=0, confirm=1, max_step=8))
    smp = sample({"prfaas": 0.2, "pd-prefill": 0.3, "pd-decode": 1.0}, 6, 2)
    lens = [random.Random(i).randint(200, 600) for i in range(600)]
    for i, n in enumerate(lens):
        ctl.record(i, n, 4096)
    decisions = []
    for k in range(1, 30):
        d = ctl.observe(k * 60.0, smp, 24_000)
        decisions += [d] if d else []
    assert decisions and decisions[0].convert < 0
    assert min(d.n_prefill for d in decisions) >= 1 and all(d.n_decode >= 1 for d in decisions)


def test_calibration_follows_a_slow_prefill_stage_but_not_an_underfull_decode(runtime):
    ctl = LongTermController(cluster(runtime), SETTINGS)
    lens = lengths(1.0, 400)
    pd_rate = 1 / runtime.deployment.pd.prefill.prefill_s(sum(lens) / len(lens))
    decode_rate = runtime.decode.bs_max / (runtime.decode.step_s * 1024)
    smp = sample({"prfaas": 0.5, "pd-prefill": 0.6, "pd-decode": 0.5}, 3, 5,
                 done_per_busy_s={"pd-prefill": 0.6 * pd_rate, "pd-decode": 1.5 * decode_rate, "prfaas": 1.0}, interval_s=60)
    for i, n in enumerate(lens):
        ctl.record(i * 0.5, n, 1024, "pd")
    ctl.observe(60, smp, 24_000)
    assert ctl.scales["pd-prefill"] == pytest.approx(0.6, rel=0.05)
    assert ctl.scales["pd-decode"] == 1.0  # half-full decode batches step faster than T_decode: not its capacity


def test_replan_moves_the_threshold_to_the_new_split(runtime):
    ctl = ThresholdController(runtime.research, runtime.prior, runtime.link_bps, runtime.step_tokens)
    before = ctl.threshold_tokens
    other = runtime.with_split(5)
    new = ctl.replan(100.0, other.research, "test")
    assert new == ctl.threshold_tokens == other.research(runtime.link_bps, runtime.prior)
    assert new != before and ctl.history[-1][2].startswith("replan")
    ctl.override(101.0, 9_000)
    assert ctl.replan(102.0, runtime.research, "again") is None and ctl.threshold_tokens == 9_000


def test_with_split_refuses_an_empty_role(runtime):
    from prfaas_sglang.errors import ConfigError

    with pytest.raises(ConfigError):
        runtime.with_split(0)
    with pytest.raises(ConfigError):
        runtime.with_split(8)


def test_pick_nodes_takes_the_least_loaded():
    assert pick_nodes([("a", 3.0), ("b", 0.0), ("c", 1.0)], 2) == ["b", "c"]
    assert pick_nodes([("a", 1.0)], 0) == []


def test_settings_are_checked():
    with pytest.raises(ValueError):
        LongTermSettings(interval_s=600, window_s=60)
    with pytest.raises(ValueError):
        LongTermSettings(min_busy=0.9, busy_high=0.5)


def test_stage_meter_integrates_load_polls_and_counts_completions():
    from prfaas_sglang.router.longterm import StageMeter

    meter = StageMeter()
    meter.sample(0.0, {}, {})
    meter.poll(0.0, [("pd-prefill", "pd", 1, 0, None), ("pd-decode", "pd", 32, 0, 64)])
    meter.poll(0.5, [("pd-prefill", "pd", 0, 2, None), ("pd-decode", "pd", 64, 3, 64), ("prfaas", "prfaas", 0, 0, None)])
    meter.poll(1.0, [("pd-prefill", "pd", 0, 0, None), ("pd-decode", "pd", 16, 0, 64)])
    meter.poll(100.0, [("pd-prefill", "pd", 1, 0, None)])  # a stalled loop: at most MAX_POLL_GAP_S integrated
    for stage in ("pd-prefill", "pd-prefill", "pd-decode"):
        meter.complete(stage, "pd", "pd")
    sample = meter.sample(100.0, {("pd-decode", "pd"): 3},
                          {("prfaas", "prfaas"): 1, ("pd-prefill", "pd"): 1, ("pd-decode", "pd"): 1}).totals()
    assert sample.interval_s == 100.0
    assert sample.busy_s["pd-prefill"] == pytest.approx(0.5 + StageMeter.MAX_POLL_GAP_S)  # busy, busy, idle, busy
    assert sample.busy_s["pd-decode"] == pytest.approx(0.5 * 1.0 + 0.5 * 0.25)  # occupancy 1 then 1/4
    assert sample.busy_s["prfaas"] == 0.0
    assert dict(sample.completed) == {"prfaas": 0, "pd-prefill": 2, "pd-decode": 1}
    nothing = meter.sample(110.0, {}, {}).totals()  # differenced: nothing new since
    assert sum(nothing.busy_s.values()) == 0 and sum(nothing.completed.values()) == 0 and nothing.interval_s == 10.0


def test_each_pd_cluster_sees_its_own_stages_and_its_share_of_a_shared_prfaas_cluster():
    """Two PD clusters, east and west; PrfaaS site "a" serves both, "b" only west. East's view holds a's
    busy time, queue and instances by the share of a's completed prefills that east decodes, so a's rate
    (completed over busy) is the same in both views and the two shares add up to a's totals."""
    from prfaas_sglang.router.longterm import ClusterSample

    sample = ClusterSample(10.0,
                           {("prfaas", "a", "east"): 3, ("prfaas", "a", "west"): 1, ("prfaas", "b", "west"): 5,
                            ("pd-prefill", "east", "east"): 7, ("pd-decode", "east", "east"): 9, ("pd-decode", "west", "west"): 2},
                           {("prfaas", "a"): 8.0, ("prfaas", "b"): 4.0, ("pd-prefill", "east"): 6.0, ("pd-prefill", "west"): 1.0,
                            ("pd-decode", "east"): 5.0},
                           {("prfaas", "a"): 4, ("pd-decode", "west"): 3},
                           {("prfaas", "a"): 2, ("prfaas", "b"): 1, ("pd-prefill", "east"): 1, ("pd-decode", "east"): 2,
                            ("pd-prefill", "west"): 1, ("pd-decode", "west"): 1})
    links = {"a": ["east", "west"], "b": ["west"]}
    east, west = sample.for_pd("east", links), sample.for_pd("west", links)
    assert east.completed == {"prfaas": 3, "pd-prefill": 7, "pd-decode": 9}
    assert east.busy_s["prfaas"] == pytest.approx(8.0 * 3 / 4) and east.instances["prfaas"] == pytest.approx(1.5)
    assert east.queued["prfaas"] == 3 and east.busy_s["pd-prefill"] == 6.0 and east.instances["pd-decode"] == 2
    assert west.completed["prfaas"] == 6 and west.busy_s["prfaas"] == pytest.approx(8.0 / 4 + 4.0)
    assert west.instances["prfaas"] == pytest.approx(0.5 + 1) and west.queued == {"prfaas": 1, "pd-prefill": 0, "pd-decode": 3}
    assert east.busy_s["prfaas"] + west.busy_s["prfaas"] == pytest.approx(12.0)
    idle = ClusterSample(10.0, {}, {("prfaas", "a"): 1.0}, {}, {("prfaas", "a"): 2})  # nothing completed: an equal share
    assert idle.for_pd("east", links).instances["prfaas"] == 1.0
    one_pair = ClusterSample(10.0, {("prfaas", "a", "east"): 2, ("pd-decode", "east", "east"): 1},
                             {("prfaas", "a"): 3.0}, {("pd-decode", "east"): 1}, {("prfaas", "a"): 1, ("pd-decode", "east"): 1})
    assert one_pair.for_pd("east", {"a": ["east"]}) == one_pair.totals()  # one pair: its one view is the whole


def region(*phases: tuple[float, float], busy, settings: LongTermSettings = SETTINGS) -> tuple[LongTermController, list]:
    """A 3-node PD region (1P/2D; one conversion moves a third of it), one request a second for each
    ``(duration_s, median factor)`` phase, a sample every 10 s at the controller's split with the stages
    busy as ``busy(n_prefill)`` says and the queue of each fully busy one growing; returns the controller
    and its decisions."""
    three = FleetSpec(1, 1, 2).runtime()
    ctl = LongTermController(cluster(three), settings)
    decisions, now = [], 0.0
    for seed, (duration_s, factor) in enumerate(phases):
        lens = lengths(factor, int(duration_s), seed)
        for k in range(0, len(lens), 10):
            for i, n in enumerate(lens[k:k + 10]):
                ctl.record(now + i, n, 1024)
            now += 10
            n_p, n_d = ctl.runtime.n_prefill, ctl.runtime.n_decode
            stages = busy(n_p)
            smp = sample(stages, n_p, n_d, queued={k: int(now // 10) for k, b in stages.items() if b >= 1.0})
            d = ctl.observe(now, smp, three.baseline_threshold_tokens)
            decisions += [d] if d else []
    return ctl, decisions


# Long prompts (median x2) make 2P/1D the model's best split of the 3-node region, short ones (x0.5) 1P/2D,
# each by far more than twice min_gain (+28%, +60%): the windows' lengths alone flip the target.
ALTERNATING = [(900.0, 2.0), (900.0, 0.5), (900.0, 2.0), (900.0, 0.5)]


def test_a_3_node_region_far_above_capacity_does_not_flap_between_1p2d_and_2p1d():
    """Issue #59: far above capacity every stage is saturated; the region converted 1P/2D -> 2P/1D and
    back every dwell period as the window's lengths moved the model's best split. With both PD stages
    saturated a node moved back leaves the other side saturated: the first conversion stands."""
    ctl, decisions = region(*ALTERNATING, busy=lambda n_p: {"prfaas": 1.0, "pd-prefill": 1.0, "pd-decode": 1.0})
    assert [(d.n_prefill, d.n_decode) for d in decisions] == [(2, 1)], [d.reason for d in decisions]
    assert ctl.runtime.n_prefill == 2
    assert ctl.describe()["target_n_prefill"] == 1 and "both saturated" in ctl.describe()["decision"]


def test_a_3_node_region_with_a_real_imbalance_converts_once_and_can_still_undo_it():
    """Prefill saturated, decode with room: one conversion to 2P/1D, held over many dwell periods while
    the lengths keep it best. Once decode is the saturated side and prefill has room, short prompts undo it:
    only a cluster saturated on both sides keeps its split."""
    def prefill_bound(n_p):
        return {"prfaas": 1.0, "pd-prefill": 1.0, "pd-decode": 0.3}

    _, decisions = region((3600.0, 2.0), busy=prefill_bound)
    assert [(d.n_prefill, d.n_decode) for d in decisions] == [(2, 1)]

    def decode_bound_after(n_p):  # at 2P/1D the one decode node is the bottleneck, prefill idles
        return prefill_bound(n_p) if n_p == 1 else {"prfaas": 0.5, "pd-prefill": 0.4, "pd-decode": 1.0}

    _, decisions = region((900.0, 2.0), (1800.0, 0.5), busy=decode_bound_after)
    assert [(d.n_prefill, d.n_decode) for d in decisions] == [(2, 1), (1, 2)]


def test_reversal_gain_factor_is_checked():
    with pytest.raises(ValueError, match="reversal_gain_factor"):
        LongTermSettings(reversal_gain_factor=0.5)
