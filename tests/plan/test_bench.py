"""python -m prfaas_sglang.bench plan: runs and reports what BENCHMARKS.md records (no timing asserted)."""

from __future__ import annotations

import json

from helpers import run_py


def test_plan_bench_reports_search_and_sensitivity():
    proc = run_py(["-m", "prfaas_sglang.bench", "plan", "--repeat", "1", "--json"], timeout=300)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)["result"]
    assert result["search_128"]["thresholds"] == 1024 and result["search_128"]["splits"] == 8
    assert result["search_32"]["thresholds"] == 4096
    assert len(result["sensitivity"]) == 9
    assert result["case_study"]["scenario"] == "case-study"


def test_bench_rejects_bad_repeat():
    proc = run_py(["-m", "prfaas_sglang.bench", "plan", "--repeat", "0"])
    assert proc.returncode == 2 and "--repeat must be >= 1" in proc.stderr
