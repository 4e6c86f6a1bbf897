"""python -m prfaas_sglang.bench compare --capacity --quick: the whole method end to end on emulated engines over
a shaped link (fresh routers, interleaved rows, bisection, pooled scoring, ratios). No capacity figure is
asserted (timings are not test assertions); what is asserted is that the figures are what the probes say."""

from __future__ import annotations

import json

import pytest
from helpers import run_py

from prfaas_sglang.bench import capacity
from prfaas_sglang.demo import netns

pytestmark = pytest.mark.skipif(netns.available() is not None, reason=f"shaped link: {netns.available()}")


@pytest.mark.slow
def test_quick_capacity_run(tmp_path):
    out = tmp_path / "piece.json"
    proc = run_py(["-m", "prfaas_sglang.bench", "compare", "--capacity", "--quick", "--json", "--out", str(out)], timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)["result"]
    assert result["condition"] == "case-study/abundant/out-64" and result["best_config"] == {"sglang-router": "sr-cache_aware"}
    setting = capacity.CapacitySetting(**result["setting"])
    assert setting.truth_model == "batched"  # the engines' truth is named, and is not the router's own form
    assert set(result["rows"]) == {"prfaas", "sr-cache_aware"}
    for name, row in result["rows"].items():
        probes = {p["load_rps"]: p for p in row["probes"]}
        for p in probes.values():  # every scored arrival is in the score, a refusal a miss
            assert p["arrivals"] == setting.seeds * setting.scored_per_seed, name
            assert p["met"] + p["refused"] + p["failed"] + p["unserved"] <= p["arrivals"]
            assert p["attainment"] == pytest.approx(p["met"] / p["arrivals"])
            assert p["engine_timing_error"]["prefill"] is not None
        # the interval is fitted to every run of the row: its grid's loads (in the bisection's bracket, every seed)
        # and the bisection's own probes, each load's arrivals those of its runs
        fitted = row["interval"]["grid"]
        assert {round(load, 9) for load in probes} <= {g["load_rps"] for g in fitted} and setting.grid_extensions == 0
        assert sum(g["runs"] for g in fitted) == (len(row["probes"]) + setting.grid_loads) * setting.seeds
        assert all(g["arrivals"] == g["runs"] * setting.scored_per_seed for g in fitted)
        assert row["interval"]["low"] <= row["interval"]["capacity"] <= row["interval"]["high"]
        for target in ("0.9", "0.99"):
            lo, hi = row["search"]["brackets"][target]["lo"], row["search"]["brackets"][target]["hi"]
            assert row["capacity_rps"][target] == (lo or 0.0)
            if lo is not None:
                assert probes[lo]["attainment"] >= float(target)
            if hi is not None:
                assert probes[hi]["attainment"] < float(target) and (lo is None or lo < hi)
    ours = result["rows"]["prfaas"]["probes"]
    assert all(p.get("calibration") for p in ours), "our router reports its calibration"
    # the PrfaaS link's utilisation per probe (the KV its workers sent over the replay / the shaped rate): where
    # anything was offloaded, it is the link's share that was busy
    for p in ours:
        assert p["link_utilization"] is not None and 0 <= p["link_utilization"] <= 1.2
        assert (p["link_utilization"] > 0) == (p["offload_fraction"] > 0)
    ratio = result["ratios"]["0.9"]
    theirs = result["rows"]["sr-cache_aware"]["capacity_rps"]["0.9"]
    if theirs:
        assert ratio["capacity_ratio_vs_best"] == pytest.approx(result["rows"]["prfaas"]["capacity_rps"]["0.9"] / theirs)
    grid_ratio = ratio["vs"]["sglang-router"]["interval"]  # the ratio of the two grid estimates, with its interval
    if grid_ratio["ratio"] is not None:  # a side a censored grid leaves open is None (slo.ratio_interval)
        low, high = grid_ratio["low"], grid_ratio["high"]
        assert low is None or high is None or low <= high
        assert grid_ratio["ahead"] == (low is not None and low > 1)
    # a piece merges, its kept runs fitted again (--refit), and the merged document renders
    assert set(result["grid_runs"]) == set(result["rows"])
    merged = run_py(["-m", "prfaas_sglang.bench", "compare", "--merge", str(out), str(out), "--refit",
                     "--plot", str(tmp_path / "plots")], timeout=60)
    assert merged.returncode == 0 and merged.stdout.count("**case-study/abundant/out-64**") == 1, merged.stderr
    assert "engine truth batched, decode radix cache on" in merged.stdout and "outputs 64 tokens" in merged.stdout
    assert "refitted" in merged.stdout and "Capacity @90% fitted to every run of the row" in merged.stdout
    plot = tmp_path / "plots" / "attainment-case-study_abundant_out-64.png"  # one per condition
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and [p.name for p in plot.parent.iterdir()] == [plot.name]
