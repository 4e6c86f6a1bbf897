"""python -m prfaas_sglang.bench compare: every row runs end to end, the JSON carries the ratios, the
shaped link binds. No goodput figure is asserted (timings are not test assertions)."""

from __future__ import annotations

import json

import pytest
from helpers import run_py

from prfaas_sglang.bench import compare
from prfaas_sglang.demo import netns

pytestmark = pytest.mark.skipif(netns.available() is not None, reason=f"shaped link: {netns.available()}")


@pytest.mark.slow
def test_compare_runs_every_row_and_reports_ratios():
    # token ids: ten engines and two routers need no tokenizer (3 CPU-s each to load); text goes through the demo
    proc = run_py(["-m", "prfaas_sglang.bench", "compare", "--seeds", "1", "--duration", "4", "--load", "0.5",
                   "--tokenizer", "none", "--json"], timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout)["result"]
    assert set(result["rows"]) == set(compare.ROWS)
    for name, row in result["rows"].items():
        assert row["requests"] == result["arrivals"][0] > 0, name
        assert row["completed_fraction"] >= 0.9, (name, row["requests_ok"], row["requests"])
        assert row["requests_failed"] == 0, name
        for key in ("goodput_rps", "ttft_p50_s", "ttft_p90_s", "tbt_p99_s", "offload_fraction", "egress_gbps"):
            assert set(row[key]) == {"median", "min", "max"}, (name, key)
    assert set(result["goodput_ratio"]) == set(compare.ROWS) - {"prfaas"}
    assert result["best_other_row"] in set(compare.ROWS) - set(compare.OURS)
    best = result["rows"][result["best_other_row"]]["goodput_rps"]["median"]
    assert result["goodput_ratio_vs_best"] == pytest.approx(result["rows"]["prfaas"]["goodput_rps"]["median"] / best)
    # who offloads: ours part, naive and the PrfaaS-only peer everything, homogeneous nothing
    offload = {name: row["offload_fraction"]["median"] for name, row in result["rows"].items()}
    assert offload["naive"] == offload["sglang-router-prfaas-prefill"] == 1.0 and offload["homogeneous"] == 0.0
    # our router's t is the runtime model's for the comparison's hetero topology
    setting = compare.Setting(**result["setting"])
    assert result["threshold_tokens"] == compare.hetero_model(setting).baseline_threshold_tokens


@pytest.mark.slow
def test_the_scarce_link_binds_the_naive_row():
    """Every prefill remote over the scarce link: the wire carries >= 90% of the capacity at its peak
    and never more than the capacity plus the tbf bucket over any window."""
    setting = compare.Setting(link="scarce", duration_s=10.0, tokenizer=None)  # token ids: the link, not the text
    result = compare.run(setting, seeds=1, rows=("naive",))
    run = result["rows"]["naive"]["per_seed"][0]
    assert run["requests_failed"] == 0 and run["offload_fraction"] == 1.0
    assert run["link_peak_utilisation"] >= 0.9, run
    assert run["link_max_excess_bytes"] <= netns.TBF_BURST_BYTES, run
    # the engines' own count agrees: the modelled egress cannot exceed the modelled capacity
    assert run["egress_gbps"] <= setting.link_gbps * 1.02
