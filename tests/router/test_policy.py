"""The routing policy (paper section 3.4.3) and the threshold controller, table-driven (pure)."""

from __future__ import annotations

import dataclasses

import pytest

from prfaas_sglang.plan.profiles import TabulatedPrefill
from prfaas_sglang.plan.workload import EmpiricalLengths, TruncatedLogNormal
from prfaas_sglang.router.policy import (
    BandwidthMode,
    ClusterSnapshot,
    Link,
    NoDecodeRoom,
    NoHealthyWorker,
    RouteInput,
    WorkerState,
    checkpoint_at,
    pick_decode,
    refuse_early,
    route,
)
from prfaas_sglang.router.threshold import (
    ControllerSettings,
    LinkView,
    QueueView,
    ThresholdController,
)


def linear(name: str, s_per_token: float) -> TabulatedPrefill:
    return TabulatedPrefill(name, [{"tokens": 1000, "prefill_s": 1000 * s_per_token, "kv_bytes": 1e6},
                                   {"tokens": 2000, "prefill_s": 2000 * s_per_token, "kv_bytes": 2e6}])


COST = {"prfaas": linear("h200", 1e-5), "pd": linear("h20", 4e-5)}
WORKERS = [
    WorkerState("p0", "prfaas", "prefill"),
    WorkerState("pp0", "pd", "prefill"),
    WorkerState("pp1", "pd", "prefill"),
    WorkerState("d0", "pd", "decode", kv_free_tokens=500_000, running=3),
    WorkerState("d1", "pd", "decode", kv_free_tokens=900_000, running=5),
]
FAT = Link(capacity_bps=100e9)
KV = lambda tokens: 1000.0 * tokens  # noqa: E731 - 1 KB of KV per token


def decide(total, by_worker, t=10_000, mode=BandwidthMode.SCARCE, workers=WORKERS, link=FAT, transfer=False,
           probe=None, decode_tokens=None, max_ttft_s=None, held=None, slack=0.1, target=None):
    snap = ClusterSnapshot(workers, t, mode, COST, link, KV, transfer_supported=transfer, probe_budget_bytes=probe,
                           max_ttft_s=max_ttft_s, decode_affinity_slack=slack, ttft_target_s=target)
    return route(RouteInput(total, decode_tokens or total + 16, by_worker, held_by_worker=held), snap)


def test_conditional_placement_sends_long_prompts_to_prfaas_only_while_its_queue_is_under_the_cap():
    """The Dynamo-like baseline (``--placement conditional``): the length rule, then PD whenever PrfaaS's prefill
    workers already hold ``remote_queue_cap`` requests; short prompts stay on PD either way."""
    def conditional(running_on_p0: int, total: int = 30_000):
        workers = [dataclasses.replace(w, running=running_on_p0) if w.name == "p0" else w for w in WORKERS]
        snap = ClusterSnapshot(workers, 10_000, BandwidthMode.SCARCE, COST, FAT, KV, remote_queue_cap=2)
        return route(RouteInput(total, total + 16, {}), snap)

    assert conditional(1).cluster == "prfaas"
    held = conditional(2)
    assert held.cluster == "pd" and "conditional: PrfaaS holds 2 >= 2" in held.reason
    assert conditional(0, total=8_000).cluster == "pd"
    assert decide(30_000, {}).cluster == "prfaas"  # off by default: the rule alone


@pytest.mark.parametrize("flags", [["--placement", "conditional"], ["--remote-queue-cap", "2"],
                                   ["--placement", "conditional", "--remote-queue-cap", "0"]])
def test_the_conditional_placement_and_its_cap_go_together_and_are_refused_by_name(flags):
    from prfaas_sglang.errors import ConfigError
    from prfaas_sglang.router.__main__ import build_parser, make_service

    with pytest.raises(ConfigError, match="--remote-queue-cap"):
        make_service(build_parser().parse_args(["--config", "never-read.yaml", *flags]))


class TestThresholdRule:
    @pytest.mark.parametrize("total, cached, cluster", [
        (8_000, {}, "pd"),                      # short: local
        (30_000, {}, "prfaas"),                 # long, uncached: offloaded
        (30_000, {"pp1": 25_000}, "pd"),        # long but cached in PD: incremental 5K stays local
        (30_000, {"p0": 25_000}, "prfaas"),     # scarce: PrfaaS's cache does not count for PD
        (10_000, {}, "pd"),                     # l == t stays local
    ])
    def test_scarce(self, total, cached, cluster):
        assert decide(total, cached).cluster == cluster

    def test_cache_affinity_inside_the_cluster(self):
        d = decide(30_000, {"pp1": 25_000})
        assert d.prefill == "pp1" and d.cached_tokens == 25_000 and d.uncached_tokens == 5_000

    def test_abundant_moves_the_other_clusters_cache_when_cheaper(self):
        """PrfaaS holds 25K of a 30K prompt: with a transfer engine and bandwidth, the prefix moves and PD-P prefills 5K."""
        d = decide(30_000, {"p0": 25_000}, mode=BandwidthMode.ABUNDANT, transfer=True)
        assert d.cluster == "pd" and d.transfer is not None and d.transfer.source == "p0"
        assert d.uncached_tokens == 5_000 and "move" in d.reason

    def test_abundant_without_a_transfer_engine_credits_nothing_it_cannot_move(self):
        """No engine can move a cache yet: the other cluster's prefix is not credited, each cluster judged alone."""
        d = decide(30_000, {"p0": 25_000}, mode=BandwidthMode.ABUNDANT, transfer=False)
        assert d.transfer is None and d.cluster == "prfaas" and d.cached_tokens == 25_000
        assert "judged per cluster" in d.reason
        local = decide(30_000, {"pp0": 25_000}, mode=BandwidthMode.ABUNDANT, transfer=False)
        assert local.cluster == "pd" and local.cached_tokens == 25_000

    def test_abundant_recomputes_when_the_link_is_slow(self):
        slow = Link(capacity_bps=1e6)
        d = decide(30_000, {"p0": 25_000}, mode=BandwidthMode.ABUNDANT, link=slow, transfer=True)
        assert d.transfer is None and d.cached_tokens == 0 and "recompute" in d.reason

    def test_an_override_forces_the_move_either_way_with_the_same_routing(self):
        """Benchmarks compare moved and recomputed on the same route: ``always`` moves over a slow
        link, ``never`` recomputes over a fast one; the cluster and workers stay the rule's."""
        slow = Link(capacity_bps=1e6)
        for link, override, moved in ((slow, True, True), (FAT, False, False)):
            snap = ClusterSnapshot(WORKERS, 10_000, BandwidthMode.ABUNDANT, COST, link, KV, transfer_supported=True,
                                   transfer_override=override)
            d = route(RouteInput(30_000, 30_016, {"p0": 25_000}), snap)
            assert d.cluster == "pd" and (d.transfer is not None) == moved
            assert d.cached_tokens == (25_000 if moved else 0)

    def test_only_a_prefill_worker_is_a_moves_source(self):
        """A decode worker's prefix (a decode-side cache in the index) is not something to import from."""
        d = decide(30_000, {"d0": 28_000, "p0": 25_000}, mode=BandwidthMode.ABUNDANT, transfer=True)
        assert d.transfer is None or d.transfer.source == "p0"

    @pytest.mark.parametrize("mode", [BandwidthMode.SCARCE, BandwidthMode.ABUNDANT])
    def test_a_decode_workers_cache_credits_no_cluster(self, mode):
        """A decode worker holding 28K of a 30K prompt (its decode radix cache, in the index) saves
        shipping, not prefill: no PD prefill worker can resume from it, so the long prompt is still
        30K uncached on PD and goes to PrfaaS, as with nothing cached."""
        d = decide(30_000, {"d0": 28_000}, mode=mode, transfer=True)
        assert d.cluster == "prfaas" and d.cached_tokens == 0 and d.transfer is None
        assert d == decide(30_000, {}, mode=mode, transfer=True)

    def test_queue_moves_work_to_the_idle_worker(self):
        busy = [w if w.name != "pp0" else WorkerState("pp0", "pd", "prefill", queue_s=5.0) for w in WORKERS]
        assert decide(8_000, {}, workers=busy).prefill == "pp1"

    def test_ttft_estimate_counts_queue_prefill_and_shipping(self):
        d = decide(30_000, {}, link=Link(capacity_bps=8e6))  # 30 MB of KV over 8 Mbit/s: 30 s
        assert d.cluster == "prfaas" and d.estimated_prefill_s == pytest.approx(0.3)
        assert d.estimated_ttft_s == pytest.approx(0.3 + 30.0)

    def test_decode_by_headroom_then_load(self):
        assert decide(8_000, {}).decode == "d1"
        tight = [w for w in WORKERS if w.name != "d1"] + [WorkerState("d1", "pd", "decode", kv_free_tokens=1_000)]
        assert decide(8_000, {}, workers=tight).decode == "d0"

    def test_decode_only_where_the_whole_request_fits(self):
        """Prompt + max_new_tokens must fit: 8K prompt, 600K output does not fit d0 (500K) but fits d1."""
        assert decide(8_000, {}, decode_tokens=608_000).decode == "d1"
        with pytest.raises(NoDecodeRoom):
            decide(8_000, {}, decode_tokens=1_000_000)


class TestDecodeAffinity:
    """A decode worker holding the prompt's prefix in its own cache (SGLang's decode radix cache)
    is preferred while its free KV is within the slack of the roomiest's (pick_decode)."""

    def d(self, name, free, running=0):
        return WorkerState(name, "pd", "decode", kv_free_tokens=free, running=running)

    @pytest.mark.parametrize("frees, held, slack, expected", [
        ((900_000, 880_000), {}, 0.1, ("d0", 0)),                        # nothing held: the roomiest
        ((900_000, 880_000), {"d1": 20_000}, 0.1, ("d1", 20_000)),        # held, within 10%: affinity
        ((900_000, 500_000), {"d1": 20_000}, 0.1, ("d0", 0)),             # held but too loaded: the roomiest
        ((90_000, 80_000), {"d1": 20_000}, 0.1, ("d0", 0)),               # the same 10K gap binds when pools are full
        ((900_000, 880_000), {"d0": 4_000, "d1": 20_000}, 0.1, ("d1", 20_000)),  # the longer hold
        ((900_000, 880_000), {"d0": 20_000, "d1": 20_000}, 0.1, ("d0", 20_000)),  # equal holds: the roomier
        ((900_000, 880_000), {"d1": 20_000}, None, ("d0", 0)),            # affinity off
    ])
    def test_table(self, frees, held, slack, expected):
        workers = [self.d("d0", frees[0]), self.d("d1", frees[1])]
        chosen, tokens = pick_decode(workers, held, slack)
        assert (chosen.name, tokens) == expected

    def test_the_decision_reports_what_the_decode_worker_holds_and_the_prefill_side_is_unchanged(self):
        held = {"d0": 6_000}  # d0: 500K free vs d1's 900K: beyond the slack
        assert decide(8_000, {}, held=held).decode == "d1"
        near = [w for w in WORKERS if w.name != "d0"] + [WorkerState("d0", "pd", "decode", kv_free_tokens=850_000)]
        d = decide(8_000, {"pp1": 4_000}, workers=near, held=held)
        assert (d.decode, d.decode_held_tokens) == ("d0", 6_000)
        assert (d.prefill, d.cached_tokens) == ("pp1", 4_000)  # the prefill side does not see decode holdings
        assert decide(8_000, {"pp1": 4_000}, workers=near) == dataclasses.replace(d, decode="d1", decode_held_tokens=0)


class TestProbe:
    def test_a_local_request_probes_the_link_when_asked_and_it_fits(self):
        d = decide(8_000, {}, probe=10e6)
        assert d.cluster == "prfaas" and d.probe and d.reason.startswith("probe")

    def test_a_probe_never_carries_more_than_its_budget(self):
        d = decide(8_000, {}, probe=1e6)  # 8 MB of KV > 1 MB budget
        assert d.cluster == "pd" and not d.probe

    def test_no_probe_without_budget(self):
        assert not decide(8_000, {}).probe

    def test_a_long_prompt_the_slo_would_spill_off_a_floor_link_stays_on_it_as_the_probe(self):
        floor = Link(capacity_bps=2e5)  # a stall's estimate: 30 MB of KV would take 20 minutes
        spilled = decide(30_000, {}, link=floor, max_ttft_s=5.0)
        assert spilled.cluster == "pd" and spilled.reason.startswith("spill to pd within the TTFT SLO")
        d = decide(30_000, {}, link=floor, max_ttft_s=5.0, probe=50e6)
        assert d.cluster == "prfaas" and d.probe and d.reason.startswith("probe") and not refuse_early(d, 5.0)
        assert decide(30_000, {}, link=floor, max_ttft_s=5.0, probe=10e6).cluster == "pd"  # over budget: the SLO rules
        t = decide(30_000, {}, link=floor, target=5.0, probe=50e6)
        assert t.cluster == "prfaas" and t.probe                                   # no expected-TTFT detour either


class TestFaults:
    def test_prfaas_down_spills_to_pd(self):
        down = [w if w.name != "p0" else WorkerState("p0", "prfaas", "prefill", healthy=False) for w in WORKERS]
        d = decide(50_000, {}, workers=down)
        assert d.cluster == "pd" and d.reason.startswith("spill to pd")

    def test_draining_worker_takes_nothing(self):
        drained = [w if w.name != "pp0" else WorkerState("pp0", "pd", "prefill", draining=True) for w in WORKERS]
        assert all(decide(n, {}, workers=drained).prefill != "pp0" for n in (1_000, 5_000, 9_000))

    @pytest.mark.parametrize("keep, message", [
        ({"d0", "d1"}, "no healthy prefill worker"),
        ({"p0", "pp0"}, "no healthy decode worker"),
    ])
    def test_nobody_left(self, keep, message):
        with pytest.raises(NoHealthyWorker, match=message):
            decide(1_000, {}, workers=[w for w in WORKERS if w.name in keep])

    def test_no_decode_room_is_its_own_error(self):
        full = [w for w in WORKERS if w.role == "prefill"] + [WorkerState("d0", "pd", "decode", kv_free_tokens=100)]
        with pytest.raises(NoDecodeRoom, match="KV room"):
            decide(8_000, {}, workers=full)


# --- the threshold controller ------------------------------------------------------------------

NOMINAL = 400e6
PRIOR = TruncatedLogNormal(9.9, 1.0, 128, 65_536)


def research(capacity_bps: float, workload) -> float:
    """A stand-in planner: t grows as the link thins (10x thinner -> 2.5x longer), never past the longest request."""
    return min(20_000 * (NOMINAL / capacity_bps) ** 0.4, workload.max_tokens)


def controller(**kw) -> ThresholdController:
    settings = ControllerSettings(**kw)
    return ThresholdController(research, PRIOR, NOMINAL, 128, None, settings)


IDLE = QueueView(0.0, 0.0)


def busy_link(mbps: float) -> LinkView:
    return LinkView(mbps * 1e6, 1.0, mbps * 1e6, mbps * 1e6, 0)


def quiet_link(mbps: float | None) -> LinkView:
    return LinkView(None if mbps is None else mbps * 1e6, 0.1 if mbps else 0.0, (mbps or 0) * 1e6 / 10, 0.0, 0)


class TestThresholdController:
    def test_baseline_is_the_planners_t_for_the_nominal_link(self):
        assert controller().threshold_tokens == 20_000

    def test_a_drop_must_be_confirmed_then_t_goes_to_the_planners_t_for_it(self):
        c = controller()
        assert c.observe(0.0, busy_link(40), IDLE) is None       # seen once: not yet
        raised = c.observe(0.6, busy_link(40), IDLE)              # confirmed after confirm_s
        assert raised == pytest.approx(research(40e6, PRIOR), abs=128) and c.constrained
        assert c.history[-1][2].startswith("raise: link delivers 40.0 Mbit/s")

    def test_the_gap_between_two_slow_transfers_does_not_reset_a_pending_drop(self):
        c = controller()
        half_busy = LinkView(40e6, 0.8, 32e6, 32e6, 0)            # one transfer ended, the next began
        assert c.observe(0.0, busy_link(40), IDLE) is None
        assert c.observe(0.3, half_busy, IDLE) is None
        assert c.observe(0.6, half_busy, IDLE) is not None and c.constrained
        fresh = controller()
        assert all(fresh.observe(k * 0.3, half_busy, IDLE) is None for k in range(10))  # never saturated: no drop

    def test_a_quiet_sample_does_reset_a_pending_drop(self):
        c = controller()
        assert c.observe(0.0, busy_link(40), IDLE) is None
        assert c.observe(0.3, quiet_link(40), IDLE) is None       # busy 0.1: the link went idle
        assert c.observe(0.6, busy_link(40), IDLE) is None        # the confirmation starts over
        assert c.observe(1.2, busy_link(40), IDLE) is not None

    def test_a_slow_but_idle_link_is_not_a_drop(self):
        """A lone small transfer shows a low rate; without the link busy it says nothing about capacity."""
        c = controller()
        assert all(c.observe(k * 0.25, quiet_link(40), IDLE) is None for k in range(40))
        assert not c.constrained

    def test_under_a_sustained_throttle_t_settles_and_stays(self):
        c = controller()
        changes = [c.observe(k * 0.25, busy_link(40 + (k % 5)), IDLE) for k in range(400)]  # 100 s, noisy 40-44 Mbit/s
        assert sum(x is not None for x in changes) == 1

    def test_a_drop_taken_at_a_low_transition_sample_is_refined_by_the_busy_samples_after_it(self):
        """The confirming sample of a drop is often a transition's (writes begun at the old rate land
        late): here 30 Mbit/s on a link that then delivers 41.5 while busy, within the rise rule's 1.4x,
        so that rule never corrects it. The busy samples do, keeping bias, and t follows."""
        c = controller(min_relative_change=0.05)  # the stand-in planner moves t 10% for these 30%
        c.observe(0.0, busy_link(30), IDLE)
        dropped = c.observe(0.6, busy_link(30), IDLE)
        assert dropped is not None and c.capacity_est_bps == 30e6
        changes = [c.observe(1.0 + 0.25 * k, busy_link(41.5), IDLE) for k in range(20)]
        assert 0.9 * 41.5e6 <= c.capacity_est_bps <= 41.5e6 and c.constrained
        assert "while busy (estimate refined from" in c.history[-1][2]
        assert c.threshold_tokens < dropped and sum(x is not None for x in changes) >= 1
        settled = c.threshold_tokens
        assert all(c.observe(6.0 + 0.25 * k, busy_link(40 + k % 3), IDLE) is None for k in range(40))  # then it holds
        assert c.threshold_tokens == settled
        stepped = controller()
        stepped.observe(0.0, busy_link(30), IDLE)
        stepped.observe(0.6, busy_link(30), IDLE)
        stepped.bias = 1.25  # as if PrfaaS had backed up meanwhile: a refinement is the same link, so it stays
        for k in range(20):
            stepped.observe(1.0 + 0.25 * k, busy_link(41.5), IDLE)
        assert stepped.capacity_est_bps > 0.9 * 41.5e6 and stepped.bias == 1.25

    def test_only_busy_samples_refine_and_only_while_constrained(self):
        c = controller()
        c.observe(0.0, busy_link(30), IDLE)
        c.observe(0.6, busy_link(30), IDLE)
        for k in range(20):  # a partly idle link's rate says little about its capacity
            c.observe(1.0 + 0.25 * k, LinkView(38e6, 0.6, 20e6, 20e6, 0), IDLE)
        assert c.capacity_est_bps == 30e6
        fresh = controller()
        for k in range(20):  # a healthy link: busy samples within the band leave the nominal estimate alone
            fresh.observe(0.25 * k, busy_link(350), IDLE)
        assert fresh.capacity_est_bps == NOMINAL and not fresh.constrained
        with pytest.raises(ValueError, match="track_gain"):
            ControllerSettings(track_gain=0.0)

    def test_recovery_returns_to_the_baseline(self):
        c = controller()
        baseline = c.threshold_tokens
        c.observe(0.0, busy_link(40), IDLE)
        c.observe(0.6, busy_link(40), IDLE)
        assert c.threshold_tokens > baseline
        assert c.observe(10.0, quiet_link(300), IDLE) is None  # a fast transfer, not yet confirmed
        assert c.observe(10.6, quiet_link(300), IDLE) == baseline and not c.constrained

    def test_pd_backlog_lowers_t_when_prfaas_and_link_have_headroom(self):
        c = controller(time_scale=0.1)  # engines 10x faster than the model: marks of 10 s become 1 s
        base = c.threshold_tokens
        lowered = c.observe(0.0, quiet_link(None), QueueView(0.05, 3.0))
        assert lowered is not None and lowered < base and "PD-P queue" in c.history[-1][2]
        assert c.observe(0.5, quiet_link(None), QueueView(0.05, 3.0)) is None   # one step per adjust_every_s
        assert c.observe(1.0, quiet_link(None), QueueView(0.05, 3.0)) < lowered

    def test_no_second_step_while_the_backlog_it_answered_drains(self):
        """Anti-windup: a lower t only reroutes new arrivals; while the PD-P backlog shrinks, t holds.
        It steps again only if the backlog stops shrinking."""
        c = controller(time_scale=0.1)
        first = c.observe(0.0, quiet_link(None), QueueView(0.05, 3.0))
        assert first is not None
        for k, pd_s in enumerate((2.6, 2.2, 1.8, 1.4), start=1):  # draining, still above the mark
            assert c.observe(float(k), quiet_link(None), QueueView(0.05, pd_s)) is None
        assert c.threshold_tokens == first
        assert c.observe(5.0, quiet_link(None), QueueView(0.05, 3.2)) < first  # it grew again: step

    def test_prfaas_backlog_raises_t(self):
        c = controller(time_scale=0.1)
        assert c.observe(0.0, quiet_link(None), QueueView(3.0, 0.1)) > c.baseline_tokens

    def test_no_lowering_while_the_link_is_busy(self):
        c = controller(time_scale=0.1)
        assert c.observe(0.0, LinkView(None, 0.95), QueueView(0.05, 3.0)) is None

    def test_a_constrained_link_is_a_floor_for_t(self):
        """On a thin link, a PD-P backlog cannot pull t below the bandwidth-bound planner's t."""
        c = controller(time_scale=0.1)
        c.observe(0.0, busy_link(40), IDLE)
        floor = c.observe(0.6, busy_link(40), IDLE)
        for k in range(20):
            c.observe(1.0 + k, quiet_link(40), QueueView(0.0, 5.0))
        assert c.threshold_tokens == floor

    def test_a_capacity_change_resets_the_queue_bias(self):
        c = controller(time_scale=0.1)
        c.observe(0.0, quiet_link(None), QueueView(3.0, 0.0))
        assert c.bias > 1
        c.observe(5.0, busy_link(40), IDLE)
        c.observe(5.6, busy_link(40), IDLE)
        assert c.bias == 1.0 and c.threshold_tokens == pytest.approx(research(40e6, PRIOR), abs=128)

    def test_bias_decays_toward_1_after_idle_queues(self):
        c = controller(time_scale=0.1, idle_decay_s=30.0)
        c.observe(0.0, quiet_link(None), QueueView(0.0, 3.0))
        low = c.bias
        assert low < 1
        for k in range(1, 80):
            c.observe(float(k), quiet_link(None), IDLE)
        assert low < c.bias <= 1.0

    def test_probes_only_when_constrained_and_nothing_crosses(self):
        c = controller()
        assert c.probe_budget_bytes(0.0) is None                 # healthy link: no probe
        c.observe(0.0, busy_link(40), IDLE)
        c.observe(0.6, busy_link(40), IDLE)
        assert c.probe_budget_bytes(1.0) is None                 # traffic crossed recently
        c.observe(2.6, LinkView(None, 0.0, 0.0, 0.0, 0), IDLE)
        assert c.probe_budget_bytes(2.6) == pytest.approx(0.5 * 2.0 * 40e6 / 8)  # half the silence at the estimate
        assert c.probe_budget_bytes(4.6) == pytest.approx(0.5 * 4.0 * 40e6 / 8)  # no request fit: the budget grows
        assert c.probe_budget_bytes(60.0) == pytest.approx(0.5 * 8.0 * 40e6 / 8)  # up to probe_max_s
        c.note_probe(60.0)
        assert c.probe_budget_bytes(61.0) is None                # at most one per probe_interval_s
        assert c.probe_budget_bytes(62.0) == pytest.approx(0.5 * 2.0 * 40e6 / 8)  # and small again after one

    def test_after_a_stall_probes_are_sized_at_the_rate_before_it_and_back_off_while_nothing_crosses(self):
        """A stall (busy, nothing delivered) takes the estimate to its floor, which says nothing of the rate:
        probes carry what the link carried before, or none would fit and the floor would be for good; a
        probe that saw nothing cross doubles the wait before the next, and a crossing resets both."""
        c = controller()
        stalled = LinkView(0.0, 1.0, 0.0, 0.0, 0)
        c.observe(0.0, stalled, IDLE)
        c.observe(0.5, stalled, IDLE)
        assert c.capacity_est_bps == pytest.approx(1e-3 * NOMINAL)
        assert c.probe_budget_bytes(2.0) == pytest.approx(0.5 * 8.0 * NOMINAL / 8)  # never crossed: probe_max_s; not 1e-3 of it
        c.note_probe(2.0)
        assert c.probe_budget_bytes(4.0) == pytest.approx(0.5 * 2.0 * NOMINAL / 8)  # the first probe: no backoff yet
        c.note_probe(4.0)                                                           # the one before delivered nothing
        assert c.probe_budget_bytes(7.0) is None and c.probe_budget_bytes(8.0) is not None  # 4 s now
        c.note_probe(8.0)
        assert c.probe_budget_bytes(15.0) is None and c.probe_budget_bytes(16.0) is not None  # 8 s
        c.observe(17.0, busy_link(100), IDLE)                                       # the probe crossed at 100 Mbit/s
        c.observe(17.5, busy_link(100), IDLE)
        assert c.capacity_est_bps == pytest.approx(100e6)                            # a rate again: no stall sizing
        c.observe(19.5, LinkView(None, 0.0, 0.0, 0.0, 0), IDLE)
        assert c.probe_budget_bytes(19.5) == pytest.approx(0.5 * 2.0 * 100e6 / 8)   # and no backoff

    def test_a_measured_low_rate_sizes_probes_at_itself(self):
        c = controller()
        c.observe(0.0, busy_link(0.5), IDLE)
        c.observe(0.5, busy_link(0.5), IDLE)
        assert c.probe_budget_bytes(2.5) == pytest.approx(0.5 * 2.0 * 0.5e6 / 8)

    def test_routed_lengths_move_the_workload_estimate(self):
        seen = []
        c = ThresholdController(lambda bps, w: seen.append(w.mean_tokens) or 20_000.0, PRIOR, NOMINAL, 128, None,
                                ControllerSettings(research_every_s=1.0, prior_weight=10))
        for k in range(200):
            c.record(k * 0.01, 60_000)
        c.observe(5.0, None, IDLE)
        assert seen[-1] > PRIOR.mean_tokens * 1.5   # the window (all 60K) outweighs the prior

    def test_operator_baseline_is_kept_on_a_healthy_link_and_is_a_floor_when_thin(self):
        c = ThresholdController(research, PRIOR, NOMINAL, 128, 12_000, ControllerSettings())
        assert c.threshold_tokens == 12_000  # exact: the operator's value is not put on the grid
        c.observe(0.0, busy_link(40), IDLE)
        assert c.observe(0.6, busy_link(40), IDLE) == pytest.approx(research(40e6, PRIOR), abs=128)

    def test_an_override_of_t_still_probes_a_constrained_link(self):
        c = controller()
        c.override(0.0, 50_000)
        c.observe(0.0, busy_link(40), IDLE)
        c.observe(0.5, busy_link(40), IDLE)
        assert c.threshold_tokens == 50_000 and c.capacity_est_bps == pytest.approx(40e6)
        assert c.probe_budget_bytes(2.5) == pytest.approx(0.5 * 2.0 * 40e6 / 8)

    def test_override_and_clear(self):
        c = controller()
        assert c.override(0.0, 50_000) == 50_000 and c.threshold_tokens == 50_000
        c.observe(1.0, busy_link(40), IDLE)
        assert c.observe(1.6, busy_link(40), IDLE) is None and c.threshold_tokens == 50_000  # overridden
        assert c.override(2.0, None) == pytest.approx(research(40e6, PRIOR), abs=128)

    def test_a_lone_low_sample_of_a_lightly_used_link_does_not_take_the_estimate_to_the_floor(self):
        """Issue #59: a pending drop confirmed by one low sample of a link not saturated (busy 0.6: a gap,
        a slow start) took the estimate to that sample's rate, here the floor, where a 2,048-token request
        was predicted at 1,000x its time and early rejection refused it. Now such a sample lowers the
        estimate at most to light_drop_ratio of it; after a silence a low sample confirms nothing alone;
        saturated samples still set their level, a stall's the floor."""
        def prfaas_ttft_s(capacity_bps: float):
            d = decide(2_048, {}, t=1_024, link=Link(capacity_bps))
            assert d.cluster == "prfaas"
            return d

        nominal = prfaas_ttft_s(NOMINAL).estimated_ttft_s
        lightly_used = LinkView(0.3e6, 0.6, 0.2e6, 0.2e6, 4_000_000)  # 0.3 Mbit/s while busy 60% of the window
        for first in (busy_link(250), LinkView(0.0, 0.95, 0.0, 0.0, 4_000_000)):  # a drop pending: low, or a stall's edge
            c = controller()
            assert c.observe(0.0, first, IDLE) is None
            assert c.observe(0.5, lightly_used, IDLE) is not None and c.constrained
            assert c.capacity_est_bps == pytest.approx(c.settings.light_drop_ratio * NOMINAL)
            assert "lightly used" in c.history[-1][2]
            d = prfaas_ttft_s(c.capacity_est_bps)
            assert d.estimated_ttft_s <= nominal / c.settings.light_drop_ratio and not refuse_early(d, 1.0)
            c.observe(1.0, busy_link(40), IDLE)  # saturated samples still take it to what the link delivers
            c.observe(1.5, busy_link(40), IDLE)
            assert c.capacity_est_bps == pytest.approx(40e6)

        after_silence = controller()
        after_silence.observe(0.0, busy_link(250), IDLE)  # a drop pending, then the link idle for 10 s
        for k in range(1, 40):
            after_silence.observe(0.25 * k, LinkView(None, 0.0, 0.0, 0.0, 0), IDLE)
        assert after_silence.observe(10.0, LinkView(0.3e6, 0.95, 0.3e6, 0.3e6, 4_000_000), IDLE) is None
        assert after_silence.capacity_est_bps == NOMINAL

        stall = controller()
        stalled = LinkView(0.0, 1.0, 0.0, 0.0, 4_000_000)  # busy all window, 4 MB waiting, nothing delivered
        stall.observe(0.0, stalled, IDLE)
        stall.observe(0.25, stalled, IDLE)
        assert stall.observe(0.5, stalled, IDLE) is not None
        assert stall.capacity_est_bps == pytest.approx(1e-3 * NOMINAL)
        assert refuse_early(prfaas_ttft_s(stall.capacity_est_bps), 1.0)  # a real stall: the floor, as before
        with pytest.raises(ValueError, match="light_drop_ratio"):
            ControllerSettings(light_drop_ratio=1.0)

    def test_bad_settings(self):
        with pytest.raises(ValueError):
            ControllerSettings(drop_ratio=1.5)
        with pytest.raises(ValueError):
            ControllerSettings(queue_low_s=5, queue_high_s=1)


def test_after_a_stall_the_next_long_prompt_probes_the_link_under_an_override_and_the_slo():
    """The two together, as the CPU harness met them: ``t`` pinned by the admin, a TTFT SLO, and a
    stall that put the estimate at its floor. The next long prompt, which the SLO would spill to PD
    at the floor estimate, goes over the link as the probe once 2 s pass with nothing crossing; its
    delivery at the link's rate lifts the estimate, and the prompts after it need no probe."""
    c = controller()
    c.override(0.0, 10_000)
    c.observe(-0.5, busy_link(300), IDLE)  # the link carried KV at its rate, then stalled
    stalled = LinkView(0.0, 1.0, 0.0, 0.0, 0)
    c.observe(0.0, stalled, IDLE)
    c.observe(0.5, stalled, IDLE)

    def snap(now_s: float) -> ClusterSnapshot:
        return ClusterSnapshot(WORKERS, c.threshold_tokens, BandwidthMode.SCARCE, COST, Link(c.capacity_est_bps), KV,
                               probe_budget_bytes=c.probe_budget_bytes(now_s), max_ttft_s=5.0)

    prompt = RouteInput(30_000, 30_016, {})  # 30 MB of KV: 0.6 s at 400 Mbit/s, 10 minutes at the floor
    assert route(prompt, snap(1.0)).reason.startswith("spill to pd within the TTFT SLO")  # silence too short yet
    probe = route(prompt, snap(2.5))
    assert probe.cluster == "prfaas" and probe.probe
    c.note_probe(2.5)
    c.observe(3.0, busy_link(300), IDLE)
    c.observe(3.5, busy_link(300), IDLE)
    after = route(prompt, snap(3.6))
    assert after.cluster == "prfaas" and not after.probe and c.capacity_est_bps == pytest.approx(NOMINAL)


def test_the_runtime_models_research_raises_t_on_a_thin_link():
    """The controller's research is the planner (via the runtime model): less egress, longer threshold."""
    from prfaas_sglang import runtime
    from prfaas_sglang.demo.cluster import local_topology
    from prfaas_sglang.topology import parse_topology

    model = runtime.from_topology(parse_topology(local_topology(link_gbps=0.4, speedup=10, kv_scale=0.01)))
    assert model.research(40e6) > model.research(400e6)
    lengths = EmpiricalLengths([60_000] * 50)
    assert model.research(None, lengths) != model.research(None)


def test_settings_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        ControllerSettings().busy_high = 0.5


class TestSloFallback:
    """With early rejection on, the rule's cluster is left only for one that meets the bound."""

    def test_a_long_prompt_behind_a_slow_link_prefills_locally_when_that_meets_the_slo(self):
        slow = Link(capacity_bps=8e6)  # 30 MB of KV: 30 s to ship; PD-P computes 30K tokens in 1.2 s
        assert decide(30_000, {}, link=slow).cluster == "prfaas"                    # early rejection off: the rule
        d = decide(30_000, {}, link=slow, max_ttft_s=5.0)
        assert d.cluster == "pd" and d.reason.startswith("spill to pd within the TTFT SLO")
        assert d.estimated_ttft_s == pytest.approx(1.2)

    def test_a_busy_pd_prefill_sends_a_short_prompt_to_prfaas_when_that_meets_the_slo(self):
        busy = [w if w.cluster != "pd" or w.role != "prefill" else WorkerState(w.name, "pd", "prefill", queue_s=20.0)
                for w in WORKERS]
        d = decide(8_000, {}, workers=busy, max_ttft_s=5.0)
        assert d.cluster == "prfaas" and not d.probe and "within the TTFT SLO" in d.reason

    def test_when_neither_meets_the_slo_the_rules_choice_is_returned_for_refusal(self):
        busy = [dataclasses.replace(w, queue_s=20.0) for w in WORKERS]
        d = decide(8_000, {}, workers=busy, max_ttft_s=5.0)
        assert d.cluster == "pd" and refuse_early(d, 5.0)

    def test_no_detour_while_the_rules_choice_meets_the_slo(self):
        assert decide(30_000, {}, max_ttft_s=5.0).cluster == "prfaas"
        assert decide(8_000, {}, max_ttft_s=5.0).cluster == "pd"


class TestExpectedTtftPlacement:
    """With a TTFT target, the rule's cluster is the plan; a request it would make later than the target goes
    where its expected TTFT is lower, whatever admission does."""

    def busy_pd(self, queue_s: float) -> list[WorkerState]:
        return [w if w.cluster != "pd" or w.role != "prefill" else WorkerState(w.name, "pd", "prefill", queue_s=queue_s)
                for w in WORKERS]

    def test_the_rule_stands_while_its_cluster_is_within_the_target(self):
        d = decide(8_000, {}, workers=self.busy_pd(2.0), target=5.0)  # PD-P: 2 s queue + 0.32 s
        assert d.cluster == "pd" and d.estimated_queue_s == pytest.approx(2.0)

    def test_a_queue_beyond_the_target_moves_the_request_to_the_lower_expected_ttft(self):
        d = decide(8_000, {}, workers=self.busy_pd(6.0), target=5.0)
        assert d.cluster == "prfaas" and d.reason.startswith("to prfaas by expected TTFT")
        assert d.estimated_ttft_s == pytest.approx(0.08 + 8_000 * 1000 * 8 / 100e9)

    def test_target_zero_always_takes_the_lower(self):
        d = decide(8_000, {}, target=0.0)  # idle: PrfaaS 0.08 s + shipping beats PD-P's 0.32 s
        assert d.cluster == "prfaas"
        assert decide(8_000, {}).cluster == "pd"  # no target: the rule alone

    def test_a_long_prompt_stays_where_it_is_fastest(self):
        busy = [dataclasses.replace(w, queue_s=0.5) if w.name == "p0" else w for w in WORKERS]
        d = decide(30_000, {}, workers=busy, target=0.0)  # PrfaaS 0.5 + 0.3 s + shipping < PD-P 1.2 s
        assert d.cluster == "prfaas"

    def test_a_probe_is_not_moved(self):
        d = decide(8_000, {}, probe=1e12, target=0.0, workers=self.busy_pd(0.0))
        assert d.probe and d.cluster == "prfaas"


class TestLinkBacklog:
    """KV routed toward the link and not yet delivered delays the next PrfaaS request's KV."""

    def test_the_backlog_bounds_the_estimate_from_below(self):
        link = Link(capacity_bps=8e9, backlog_bytes=8e9 / 8 * 10)  # 10 s of KV ahead on the link
        d = decide(30_000, {}, link=link)
        assert d.cluster == "prfaas"
        assert d.estimated_ttft_s == pytest.approx(10.0 + 30_000 * 1000 * 8 / 8e9)

    def test_a_backlog_shorter_than_the_compute_costs_nothing(self):
        link = Link(capacity_bps=8e9, backlog_bytes=1e3)
        assert decide(30_000, {}, link=link).estimated_ttft_s == pytest.approx(decide(30_000, {}, link=Link(8e9)).estimated_ttft_s)

    def test_a_long_backlog_moves_a_request_to_pd_by_expected_ttft(self):
        link = Link(capacity_bps=8e9, backlog_bytes=8e9 / 8 * 10)
        assert decide(30_000, {}, link=link, target=0.0).cluster == "pd"  # PD-P: 1.2 s


class TestLayerwiseOverlap:
    """PrfaaS workers that stream their KV by layer (``kv_stream_groups``): the estimate overlaps the transfer
    with the prefill (``plan.overlap.kv_finish_s``) instead of adding them."""

    SLOW = Link(capacity_bps=0.8e9)  # 30K tokens: 0.3 s of prefill on PrfaaS, 0.3 s of KV on the link

    def streamed(self, total, link, kv=KV, groups=8, max_ttft_s=None, workers=WORKERS):
        snap = ClusterSnapshot(workers, 10_000, BandwidthMode.SCARCE, COST, link, kv, kv_stream_groups=groups,
                               max_ttft_s=max_ttft_s)
        return route(RouteInput(total, total + 16, {}), snap)

    @pytest.mark.parametrize(("groups", "expected_s"), [(None, 0.3 + 0.3), (1, 0.3 + 0.3), (8, 0.3 / 8 + 0.3)])
    def test_the_estimate_is_the_overlapped_finish(self, groups, expected_s):
        d = self.streamed(30_000, self.SLOW, groups=groups)
        assert d.cluster == "prfaas" and d.estimated_ttft_s == pytest.approx(expected_s)

    def test_the_state_goes_after_the_last_group(self):
        kv = lambda tokens: 2.0e6 + 1000.0 * tokens  # noqa: E731 - a hybrid's fixed state (20 ms here) plus 1 KB a token
        d = self.streamed(30_000, self.SLOW, kv=kv)
        assert d.estimated_ttft_s == pytest.approx(max(0.3 + 0.3 / 8, 0.3 / 8 + 0.3) + 2.0e6 * 8 / 0.8e9)

    def test_a_request_the_sequential_estimate_spills_stays_on_prfaas_when_the_kv_streams(self):
        """PrfaaS 0.3 s queued: sequentially 0.9 s, over the 0.7 s bound, so it spills to PD-P (1.2 s, its own
        prefill's length); streamed, 0.64 s, within it."""
        queued = [dataclasses.replace(w, queue_s=0.3) if w.name == "p0" else w for w in WORKERS]
        sequential = self.streamed(30_000, self.SLOW, groups=None, max_ttft_s=0.7, workers=queued)
        streamed = self.streamed(30_000, self.SLOW, max_ttft_s=0.7, workers=queued)
        assert sequential.cluster == "pd" and "within the TTFT SLO" in sequential.reason
        assert streamed.cluster == "prfaas" and streamed.estimated_ttft_s == pytest.approx(0.3 + 0.3 / 8 + 0.3)

    def test_pd_prefills_are_unchanged(self):
        assert self.streamed(8_000, self.SLOW).estimated_ttft_s == self.streamed(8_000, self.SLOW, groups=None).estimated_ttft_s


@pytest.mark.parametrize(("p", "x", "tail"), [(1.0, 0.2, 0.0), (0.2, 1.0, 0.1), (1.0, 1.0, 0.5), (0.0, 1.0, 0.0)])
def test_the_overlapped_finish_lies_between_the_slower_part_and_the_sum(p, x, tail):
    from prfaas_sglang.plan.overlap import kv_finish_s

    sequential = kv_finish_s(p, x, tail, None)
    assert sequential == pytest.approx(p + x + tail) == pytest.approx(kv_finish_s(p, x, tail, 1))
    finishes = [kv_finish_s(p, x, tail, g) for g in (2, 4, 8, 64)]
    assert all(max(p, x) + tail <= f <= sequential for f in finishes)
    assert finishes == sorted(finishes, reverse=True)  # more groups, less left over after the prefill
    with pytest.raises(ValueError):
        kv_finish_s(p, x, tail, 0)


def test_early_rejection_refuses_waiting_not_length():
    from prfaas_sglang.router.policy import RouteDecision, refuse_early

    def decision(ttft_s, prefill_s):
        return RouteDecision("p", "d", "pd", 0, 1000, ttft_s, prefill_s, None, False, "")

    assert not refuse_early(decision(9.0, 1.0), None)
    assert refuse_early(decision(6.0, 1.0), 5.0)  # 5 s of waiting: refused
    assert not refuse_early(decision(4.0, 1.0), 5.0)
    assert not refuse_early(decision(15.0, 8.0), 5.0)  # long alone, little waiting: served
    assert refuse_early(decision(17.0, 8.0), 5.0)


class TestCheckpointHint:
    """Where a hybrid model's prefill worker is asked for a state checkpoint (policy.checkpoint_at)."""

    @pytest.mark.parametrize("total, shared, cached, expected", [
        (8_000, 4_096, 0, 4_096),      # a prefix some worker holds, none reused here: ask for it
        (8_000, 4_096, 4_096, None),   # the chosen worker already resumes there
        (8_000, 4_096, 3_584, None),   # less than min_tokens of reuse to gain
        (4_600, 4_096, 0, None),       # the prompt ends within min_tokens: its end checkpoint serves
        (8_000, 0, 0, None),           # nothing shared
        (8_000, 2_048, 4_096, None),   # the worker reuses more than is shared elsewhere
    ])
    def test_table(self, total, shared, cached, expected):
        assert checkpoint_at(total, shared, cached, min_tokens=1024) == expected
