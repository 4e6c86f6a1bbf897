"""The simulator and the emulated deployment on the same arrivals (bench/sim_vs_emulator.py), short:
the same routing and the same latencies within a loose band. The recorded comparison (3 seeds,
two loads, 5-minute runs) is BENCHMARKS.md, "Simulator"."""

from __future__ import annotations

import pytest

from prfaas_sglang.bench import sim_vs_emulator


@pytest.mark.slow
@pytest.mark.serial  # emulated latencies against simulated ones: other tests' load on the 2 cores skews the emulated side
def test_simulator_agrees_with_the_emulated_deployment_on_the_same_arrivals(tmp_path):
    """At speedup 1.25, not the bench's 5, as the fleet's check below: the emulated side's own wall-time costs
    count speedup-fold. Emulated TTFT p50 against the simulator's 2.95 s, 2026-11-30, on this project's 2-core
    machine alone: at 5, 3.42 and 3.35 (0.86, 0.88); at 1.25, 3.06 twice (0.96). Fresh run 51 read 4.47 at 5
    beside the fleet's check (0.66)."""
    data = sim_vs_emulator.run(seeds=1, loads=(0.5,), duration_s=90.0, warmup_s=10.0, speedup=1.25, log_dir=tmp_path,
                               modes=("t pinned",))
    row = data["rows"][0]
    sim, emu = row["sim"], row["emulator"]
    assert emu["arrived"] == sim["arrived"] > 20
    assert emu["finished"] == emu["arrived"] and sim["finished"] == sim["arrived"], emu["errors"]
    assert abs(sim["offload"] - emu["offload"]) <= 0.05  # one policy, one pinned t: the same split of the arrivals
    assert abs(row["ratio"]["goodput_rps"] - 1) <= 0.1
    for key in ("ttft_p50_s", "ttft_p90_s"):
        assert 0.7 <= row["ratio"][key] <= 1.3, (key, sim[key], emu[key])


@pytest.mark.slow
@pytest.mark.serial  # emulated latencies against simulated ones: other tests' load on the 2 cores skews the emulated side
def test_a_simulated_fleet_agrees_with_the_emulated_fleet_on_the_same_arrivals(tmp_path):
    """launch/multi-cluster.yaml, one node per role per cluster: 2 PrfaaS clusters, 2 PD regions, a link each
    shaped on its own (demo/fleet.py) against the simulator's fleet, the same arrivals entering 70/30.

    At speedup 1.25, not the bench's 5: what the emulated side adds to a request in wall time (router, HTTP, the
    shaped links' namespaces; about 0.1-0.14 s at the median on a slower 2-core machine) counts speedup-fold
    in emulated time, and the median moves about +-0.2 s from run to run besides. Emulated TTFT p50 against
    the simulator's 2.68 s, 2026-11-30, that machine: at 5, 3.38 and 2.97 alone, 3.16 beside the other serial
    tests (CI: 3.22); at 2.5, 2.82 alone and 3.23 beside; at 1.25, 2.85 alone (0.94)."""
    data = sim_vs_emulator.run_fleet(seeds=1, load_rps=1.5, duration_s=90.0, warmup_s=10.0, speedup=1.25, log_dir=tmp_path)
    row = data["rows"][0]
    sim, emu = row["sim"], row["emulator"]
    assert emu["arrived"] == sim["arrived"] > 100
    assert emu["finished"] == emu["arrived"] and sim["finished"] == sim["arrived"], emu["errors"]
    assert sim["decoded_elsewhere"] == 0
    assert abs(row["ratio"]["goodput_rps"] - 1) <= 0.15
    assert abs(row["ratio"]["ttft_p50_s"] - 1) <= 0.15, (sim["ttft_p50_s"], emu["ttft_p50_s"])
    assert abs(sim["offload"] - emu["offload"]) <= 0.1
    assert set(sim["links"]) == set(emu["links"])  # the same links carry KV on both sides
