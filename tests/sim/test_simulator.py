"""The simulator: agreement with the analytic model when saturated, the long-term controller under a
workload shift, prefix reuse through the KV index on a trace, nothing held at the end, the CLI."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest
from helpers import REPO_ROOT, TRACE

from prfaas_sglang.bench.sim import CASE_STUDY, saturated, shift_run
from prfaas_sglang.router.longterm import LongTermSettings
from prfaas_sglang.sim import arrivals
from prfaas_sglang.sim.fleet import FleetSpec, SimSettings, Simulation
from prfaas_sglang.sim.nodes import BlockCache
from prfaas_sglang.sim.summary import summarize


@pytest.mark.slow
@pytest.mark.parametrize("fleet, binding", [
    (CASE_STUDY, "prfaas-compute"),
    (FleetSpec(4, 6, 2), "pd-decode"),
    (FleetSpec(4, 3, 5, link_gbps=5.0), "prfaas-bandwidth"),
    (FleetSpec(4, 3, 5, workload_prior={"kind": "lognormal", "mu": 9.9, "sigma": 0.25, "min_tokens": 128,
                                        "max_tokens": 131_072}), "prfaas-compute"),
], ids=["case-study", "decode-bound", "bandwidth-bound", "narrow-lengths"])
def test_saturated_steady_state_matches_lambda_max(fleet, binding):
    """Offered 1.25 x Lambda_max with t at the planner's, nothing shed: completions per second after the
    warm-up are equation (6)'s Lambda_max within 10%."""
    row = saturated(fleet, seed=0, duration_s=1800, warmup_s=900)
    assert row["binding"] == binding
    assert row["ratio"] == pytest.approx(1.0, abs=0.10), row
    assert row["ratio_e_t"] == pytest.approx(1.0, abs=0.10), row


@pytest.mark.slow
def test_workload_shift_long_term_controller_reaches_the_optimum():
    """Median input doubles at minute 10: the controller converts decode nodes to prefill and the last
    10 minutes' goodput is >= 90% of the new optimum split's (fixed from the start); the old split
    fixed does far worse."""
    from prfaas_sglang.bench.sim import best_split

    new = arrivals.lognormal(arrivals.median_shift_phases(0)[1][1])
    n_new, _, lam_new = best_split(CASE_STUDY, new)
    n_old, _, _ = best_split(CASE_STUDY)
    assert n_new > n_old
    rate = 0.9 * lam_new
    old = dataclasses.replace(CASE_STUDY, n_prefill=n_old, n_decode=8 - n_old)
    fixed = shift_run(old, 0, rate, None)
    controlled = shift_run(old, 0, rate, LongTermSettings())
    optimum = shift_run(dataclasses.replace(CASE_STUDY, n_prefill=n_new, n_decode=8 - n_new), 0, rate, None)
    assert controlled["conversions"] >= 1 and controlled["final_split"] != f"{n_old}P/{8 - n_old}D"
    assert controlled["goodput_rps"] >= 0.9 * optimum["goodput_rps"], (controlled, optimum)
    assert fixed["goodput_rps"] < 0.5 * optimum["goodput_rps"]


@pytest.mark.slow
def test_a_conversion_drains_then_switches_and_loses_nothing():
    sim = Simulation(FleetSpec(2, 2, 2), SimSettings(
        longterm=LongTermSettings(interval_s=30, window_s=120, min_dwell_s=60, confirm=1, min_requests=20),
        switch_s=20.0))
    rate = 0.6 * sim.runtime.capacity_rps()
    phases = arrivals.median_shift_phases(120, factor=3.0)
    requests = list(arrivals.poisson(rate, 900, 1, sim.runtime.output_tokens, phases))
    sim.run(requests, 900 + 1200)
    (ctl,) = sim.longterm.values()
    assert ctl.history, ctl.describe()
    converted = [e for e in sim.events if "serves as" in e[1]]
    assert converted
    assert all(r.finish_s is not None or r.rejected for r in requests)
    assert sum(r.rejected is not None for r in requests) == 0
    _assert_nothing_held(sim)


def _assert_nothing_held(sim: Simulation) -> None:
    for record in sim.service.workers.values():
        assert record.outstanding_prefill_s == pytest.approx(0.0, abs=1e-6), record.name
        assert record.reserved_tokens == 0 and record.reserved_requests == 0, record.name
    for node in sim.nodes.values():
        assert node.idle
        if hasattr(node, "pool"):
            assert node.pool.used_tokens == 0


@pytest.mark.slow
def test_trace_prefix_reuse_goes_through_the_kv_index():
    """The first 1,500 trace requests: the KV index sees the workers' events; requests routed to a
    worker holding their prefix compute only the rest, and the router's credit matches the worker's."""
    assert TRACE.is_file(), f"{TRACE} ships in shared/data beside the checkout (or set PRFAAS_TRACE_PATH)"
    requests = arrivals.trace(TRACE, limit=1500)
    sim = Simulation(FleetSpec(1, 1, 2))
    sim.run(requests, max(r.arrival_s for r in requests) + 600)
    done = [r for r in requests if r.finish_s is not None]
    assert len(done) == len(requests)
    reused = [r for r in done if r.uncached_tokens < r.input_tokens - 1]
    assert len(reused) > 0.2 * len(done)
    assert sum(sim.service.index.block_count(w) for w in sim.service.index.workers()) > 0
    _assert_nothing_held(sim)


def test_block_cache_matches_hybrid_prefixes_only_up_to_a_state():
    cache = BlockCache(capacity_blocks=4)
    new, parent, evicted = cache.insert((1, 2, 3))
    assert (new, parent, evicted) == ([1, 2, 3], None, [])
    assert cache.match((1, 2, 3, 4), hybrid=True) == 3
    assert cache.match((1, 2, 9), hybrid=True) == 0  # blocks 1, 2 held, but no state there
    assert cache.match((1, 2, 9), hybrid=False) == 2
    new, parent, evicted = cache.insert((1, 2, 5, 6))
    assert new == [5, 6] and parent == 2 and evicted == [3]
    assert cache.match((1, 2, 3), hybrid=True) == 0


@pytest.mark.slow
def test_link_capacity_drop_is_seen_by_the_threshold_controller():
    """The link drops to 2 Gbit/s at 300 s: the router's estimate follows and t rises."""
    sim = Simulation(CASE_STUDY, SimSettings(link_schedule=((300.0, 2.0),)))
    rate = 0.6 * sim.runtime.capacity_rps()
    sim.run(arrivals.poisson(rate, 900, 0, sim.runtime.output_tokens), 900)
    before = [s for s in sim.series if s["t_s"] < 300]
    after = [s for s in sim.series if s["t_s"] > 600]
    assert after[-1]["capacity_est_gbps"] < 0.5 * before[-1]["capacity_est_gbps"]
    assert after[-1]["threshold_tokens"] > before[-1]["threshold_tokens"]


def _fleet_run(schedule=()):
    """launch/multi-cluster.yaml simulated, 3 req/s for 300 s entering 70/30: per (entry, link or local,
    after 100 s) the requests routed, and the simulation."""
    import collections

    import yaml

    doc = yaml.safe_load((REPO_ROOT / "launch" / "multi-cluster.yaml").read_text())
    sim = Simulation(doc, SimSettings(link_schedule=schedule))
    requests = arrivals.entering(list(arrivals.poisson(3.0, 300, 0, 1024)), {"pd-east": 0.7, "pd-west": 0.3}, 0)
    sim.run(requests, 500)
    routed = collections.Counter((r.entry, str(r.lease.pair) if r.cluster == "prfaas" else "local", r.arrival_s >= 100)
                                 for r in sim.requests if r.lease is not None)
    return routed, sim


def test_a_fleet_decodes_where_requests_enter_and_a_dropped_link_moves_its_own_offload():
    """Two PrfaaS sites, two PD regions, a link each: every request decodes in its region; when
    h200 -> east drops to 0.1 Gbit/s at 100 s, its controller's estimate and t follow, east's offload
    moves to h100 -> east (and local prefill), and west keeps offloading at about its share."""
    base, _ = _fleet_run()
    dropped, sim = _fleet_run(((100.0, 0.1, "prfaas-h200->pd-east"),))
    assert all(sim.service.workers[r.decode_node].site == r.entry for r in sim.requests if r.decode_node)
    assert base[("pd-east", "prfaas-h200->pd-east", True)] > 60
    assert dropped[("pd-east", "prfaas-h200->pd-east", True)] <= 0.05 * base[("pd-east", "prfaas-h200->pd-east", True)]
    assert dropped[("pd-east", "prfaas-h100->pd-east", True)] > 3 * base[("pd-east", "prfaas-h100->pd-east", True)]
    links = sim.series[-1]["links"]
    assert links["prfaas-h200->pd-east"]["capacity_est_gbps"] == pytest.approx(0.1, rel=0.2)
    assert links["prfaas-h200->pd-east"]["threshold_tokens"] > 2 * links["prfaas-h100->pd-east"]["threshold_tokens"]

    def west_offload(c):
        off = sum(n for (entry, link, late), n in c.items() if entry == "pd-west" and late and link != "local")
        return off / sum(n for (entry, _, late), n in c.items() if entry == "pd-west" and late)

    assert west_offload(dropped) == pytest.approx(west_offload(base), abs=0.1)


@pytest.mark.slow
def test_each_pd_cluster_of_a_fleet_has_its_own_long_term_controller():
    """launch/multi-cluster.yaml, 70% of arrivals entering west, the median input tripling at 120 s: each
    PD cluster's controller converts its own decode nodes to prefill (east 3P/5D, west 1P/2D to start),
    every pair of that cluster moves to the new split, the other cluster's stays, nothing is lost."""
    import yaml

    doc = yaml.safe_load((REPO_ROOT / "launch" / "multi-cluster.yaml").read_text())
    sim = Simulation(doc, SimSettings(switch_s=20.0, longterm=LongTermSettings(
        interval_s=30, window_s=120, min_dwell_s=60, confirm=1, min_requests=20)))
    phases = arrivals.median_shift_phases(120, factor=3.0)
    requests = arrivals.entering(list(arrivals.poisson(3.0, 600, 1, 1024, phases)), {"pd-east": 0.3, "pd-west": 0.7}, 1)
    sim.run(requests, 1500)
    assert set(sim.longterm) == {"pd-east", "pd-west"}
    conversions = [e for _, e in sim.events if e.startswith("convert ")]
    assert {pd for pd in ("pd-east", "pd-west") if any(f" of {pd} " in e for e in conversions)} == {"pd-east", "pd-west"}
    for e in conversions:  # a cluster's controller converts that cluster's nodes only
        names, pd = e.removeprefix("convert ").split(" of ")[0].split(", "), e.split(" of ")[1].split()[0]
        assert all(sim.service.workers[n].site == pd for n in names), e
    for pd, ctl in sim.longterm.items():
        n_prefill = sum(r.site == pd and r.cluster == "pd" and r.role == "prefill" for r in sim.service.workers.values())
        assert ctl.history and ctl.runtime.n_prefill == n_prefill
        assert all(ps.runtime.n_prefill == n_prefill for p, ps in sim.service.pairs.items() if p.pd == pd)
    assert all(r.finish_s is not None for r in requests)
    _assert_nothing_held(sim)


@pytest.mark.slow
def test_cli_json_and_plot(tmp_path):
    out = subprocess.run([sys.executable, "-m", "prfaas_sglang.sim", "--scenario", "case-study", "--duration-s", "600",
                          "--warmup-s", "120", "--json", "--plot", str(tmp_path)], capture_output=True, text=True,
                         timeout=300, cwd=REPO_ROOT)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    for key in ("goodput_rps", "ttft_s", "tbt_ms", "offload_fraction", "egress_gbps_mean", "utilisation"):
        assert key in result
    assert result["finished"] > 0 and 0 < result["offload_fraction"] < 1
    assert (tmp_path / "timeseries.png").stat().st_size > 10_000


@pytest.mark.slow
def test_cli_refuses_bad_input():
    out = subprocess.run([sys.executable, "-m", "prfaas_sglang.sim", "--scenario", "trace"], capture_output=True,
                         text=True, timeout=120, cwd=REPO_ROOT)
    assert out.returncode == 2 and "--trace" in out.stderr
    out = subprocess.run([sys.executable, "-m", "prfaas_sglang.sim", "--pd", "4", "--pd-prefill", "4"],
                         capture_output=True, text=True, timeout=120, cwd=REPO_ROOT)
    assert out.returncode == 2 and "--pd-prefill" in out.stderr
    out = subprocess.run([sys.executable, "-m", "prfaas_sglang.sim", "--scenario", "trace", "--trace", "/nonexistent.jsonl"],
                         capture_output=True, text=True, timeout=120, cwd=REPO_ROOT)
    assert out.returncode == 2 and "no trace file" in out.stderr
    fleet = REPO_ROOT / "launch" / "multi-cluster.yaml"
    for extra, field in ((["--link-drop", "10:1:prfaas-h300->pd-east"], "--link-drop"),
                         (["--link-drop", "ten:1"], "--link-drop")):
        out = subprocess.run([sys.executable, "-m", "prfaas_sglang.sim", "--topology", str(fleet), *extra],
                             capture_output=True, text=True, timeout=120, cwd=REPO_ROOT)
        assert out.returncode == 2 and field in out.stderr, (extra, out.stderr)


@pytest.mark.slow
def test_summary_counts_every_arrival():
    sim = Simulation(FleetSpec(1, 1, 1))
    requests = list(arrivals.poisson(0.5, 300, 3, sim.runtime.output_tokens))
    sim.run(requests, 900)
    s = summarize(sim, 0, 300)
    assert s["arrived"] == len(requests) == s["finished"] + s["rejected"] + s["unfinished"]
