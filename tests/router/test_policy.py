"""The routing policy (paper section 3.4.3) and the threshold controller, table-driven (pure)."""

from __future__ import annotations

import pytest

from prfaas_sglang.plan.model import Deployment
from prfaas_sglang.plan.profiles import TabulatedPrefill
from prfaas_sglang.plan.scenario import Catalog
from prfaas_sglang.plan.search import best_threshold_for_split
from prfaas_sglang.router.policy import BandwidthMode, Link, NoHealthyWorker, WorkerState, route
from prfaas_sglang.router.threshold import ThresholdController


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


def decide(total, by_worker, t=10_000, mode=BandwidthMode.SCARCE, workers=WORKERS, link=FAT):
    return route(total, by_worker, workers, t, mode, COST, link, KV)


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
        """PrfaaS holds 25K of a 30K prompt: with bandwidth, the prefix is moved and PD-P prefills 5K."""
        d = decide(30_000, {"p0": 25_000}, mode=BandwidthMode.ABUNDANT)
        assert d.cluster == "pd" and d.transfer is not None and d.transfer.source == "p0"
        assert d.uncached_tokens == 5_000 and "move" in d.reason

    def test_abundant_recomputes_when_the_link_is_slow(self):
        slow = Link(capacity_bps=1e6)
        d = decide(30_000, {"p0": 25_000}, mode=BandwidthMode.ABUNDANT, link=slow)
        assert d.transfer is None and d.cached_tokens == 0 and "recompute" in d.reason

    def test_queue_moves_work_to_the_idle_worker(self):
        busy = [w if w.name != "pp0" else WorkerState("pp0", "pd", "prefill", queue_s=5.0) for w in WORKERS]
        assert decide(8_000, {}, workers=busy).prefill == "pp1"

    def test_decode_by_headroom_then_load(self):
        assert decide(8_000, {}).decode == "d1"
        tight = [w for w in WORKERS if w.name != "d1"] + [WorkerState("d1", "pd", "decode", kv_free_tokens=1_000)]
        assert decide(8_000, {}, workers=tight).decode == "d0"


class TestFaults:
    def test_prfaas_down_falls_back_to_pd(self):
        down = [w if w.name != "p0" else WorkerState("p0", "prfaas", "prefill", healthy=False) for w in WORKERS]
        d = decide(50_000, {}, workers=down)
        assert d.cluster == "pd" and d.reason.startswith("fallback to pd")

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

    def test_no_decode_room(self):
        full = [w for w in WORKERS if w.role == "prefill"] + [WorkerState("d0", "pd", "decode", kv_free_tokens=100)]
        with pytest.raises(NoHealthyWorker, match="KV room"):
            decide(8_000, {}, workers=full)


def controller(**kw) -> ThresholdController:
    return ThresholdController(baseline_tokens=20_000, research=lambda bps: 20_000 * 100e9 / bps, max_tokens=131_072, **kw)


class TestThresholdController:
    def test_raises_after_sustained_saturation_and_comes_back(self):
        c = controller()
        assert c.observe(0.0, 0.95, 10e9, 0.0) is None           # not yet: needs raise_after_s
        raised = c.observe(0.6, 0.97, 10e9, 0.0)
        assert raised == 131_072                                   # the planner's t for a 10x thinner link, capped
        assert c.observe(1.0, 0.30, 100e9, 0.0) is None            # recovering: hysteresis waits
        lowered = [c.observe(1.0 + 5.0 * k, 0.30, 100e9, 0.0) for k in range(1, 12)]
        assert [x for x in lowered if x][-1] == 20_000 and c.threshold_tokens == 20_000
        assert [why.split(":")[0] for _, _, why in c.history][:2] == ["raise", "lower"]

    def test_queueing_alone_raises_by_at_least_the_factor(self):
        c = controller()
        c.observe(0.0, 0.1, 100e9, 3.0)
        assert c.observe(0.5, 0.1, 100e9, 3.0) == pytest.approx(25_000)

    def test_in_between_changes_nothing(self):
        c = controller()
        assert all(c.observe(k * 0.5, 0.75, 100e9, 1.0) is None for k in range(40))

    def test_override_and_clear(self):
        c = controller()
        assert c.override(0.0, 50_000) == 50_000 and c.threshold_tokens == 50_000
        assert c.override(1.0, None) == 20_000

    def test_bad_marks(self):
        with pytest.raises(ValueError):
            controller(low_utilization=0.95)


def test_research_with_the_planner_raises_t_on_a_thin_link():
    """The controller's research function is the planner: less egress, longer threshold."""
    case = Catalog().scenario("case-study")
    dep = case.deployment

    def research(bps: float) -> float:
        thin = Deployment(dep.prfaas, dep.n_prfaas, dep.pd, dep.n_pd, bps, dep.output_tokens)
        return best_threshold_for_split(thin, case.workload, 4, 1024).threshold_tokens

    assert research(2e9) > research(100e9)
