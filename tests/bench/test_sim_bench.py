"""``bench sim``: each study the simulator's figures come from, at a small size, through the report it
prints (in process; the emulated study is ``tests/sim/test_sim_vs_emulator.py``'s, the shift's building
block ``test_simulator.py``'s)."""

from __future__ import annotations

import itertools

import pytest
from helpers import TRACE

from prfaas_sglang.bench import sim, sim_fleet


def _report(study: str, data) -> list[str]:
    return sim.render_markdown({"study": study, "seeds": 1, "data": data, "wall_s": 1.0}).splitlines()


def test_analytic_one_saturated_fleet_is_reported_beside_equation_6():
    row = sim.saturated(sim.CASE_STUDY, 0, duration_s=300.0, warmup_s=150.0)
    assert row["binding"] and row["measured_rps"] > 0 and row["lambda_max_rps"] > 0
    assert _report("analytic", [row])[2].startswith(f"| {row['fleet']} | {row['binding']} |")


@pytest.mark.slow
def test_bias_each_router_gets_a_capacity_and_a_bracket():
    rows = sim.study_bias(1, biases=(1.4,), rounds=1)
    assert [r["router"] for r in rows] == ["calibration on", "calibration off", "true scale given, calibration off"]
    assert len([line for line in _report("bias", rows) if line.startswith("| 1.4 |")]) == 3


@pytest.mark.slow
def test_paper_each_system_at_its_best_split_and_at_one_common_load():
    data = sim.study_paper(1, sweep=0, common_duration_s=400.0, duration_s=200.0, iters=1)
    assert {r["config"] for r in data["rows"]} == {"prfaas-pd", "homogeneous", "naive-heterogeneous"}
    assert data["common_rps"] > 0 and len(data["common"]) == 3
    assert any(line.startswith("prfaas-pd / homogeneous") for line in _report("paper", data))


@pytest.mark.slow
def test_scale_runs_every_fleet_size_on_a_few_trace_requests(tmp_path):
    trace = tmp_path / "trace.jsonl"
    with open(TRACE) as f:
        trace.write_text("".join(itertools.islice(f, 20)))
    rows = sim.study_scale(trace)
    assert [r["gpus"] for r in rows] == [64, 128, 256, 512, 512, 512] and [r["requests"] for r in rows][-1] == 80
    assert len(_report("scale", rows)) == 2 + len(rows) + 2


@pytest.mark.slow
def test_fleet_every_system_gets_a_capacity_on_the_planned_entry_shares():
    data = sim_fleet.study(1, rounds=1, duration_s=30.0, warmup_s=10.0, conditions=("as planned",))
    assert [r["system"] for r in data["rows"]] == list(sim_fleet.SYSTEMS)
    assert len([line for line in _report("fleet", data) if line.startswith("| as planned |")]) == 3
