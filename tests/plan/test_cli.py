"""python -m prfaas_sglang.plan: JSON keys, fixed threshold, plots, bad input naming the field."""

from __future__ import annotations

import json

import pytest
import yaml
from helpers import REPO_ROOT, TRACE, run_py

REQUIRED_KEYS = {
    "threshold_tokens", "n_prefill", "n_decode", "offload_fraction", "mean_long_tokens", "mean_short_tokens",
    "lambda_max_rps", "egress_gbps", "gain_vs_homogeneous", "gain_vs_naive", "binding_stage",
}


def plan_cli(*args: str, cwd=REPO_ROOT):
    return run_py(["-m", "prfaas_sglang.plan", *args], cwd=cwd)


def test_case_study_json_has_the_documented_keys():
    proc = plan_cli("--scenario", "case-study", "--json")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert REQUIRED_KEYS <= set(result)
    assert result["threshold_searched"] is True


def test_fixed_threshold_reproduces_the_paper_split_figures():
    result = json.loads(plan_cli("--scenario", "case-study", "--threshold", "19400", "--json").stdout)
    assert result["threshold_tokens"] == 19400 and result["threshold_searched"] is False
    assert result["offload_fraction"] == pytest.approx(0.496, abs=0.002)
    assert 44_000 <= result["mean_long_tokens"] <= 46_000
    assert 27_000 <= result["mean_tokens"] <= 28_000


def test_human_table_shows_paper_beside_ours():
    out = plan_cli("--scenario", "case-study").stdout
    assert "ours" in out and "paper" in out and "19.4K" in out and "1.54x" in out


def test_plots_are_written(tmp_path):
    proc = plan_cli("--scenario", "case-study", "--plot", str(tmp_path), "--threshold-step", "1024")
    assert proc.returncode == 0, proc.stderr
    for name in ("split_search.png", "threshold_search.png"):
        data = (tmp_path / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_flags_only_scenario_with_the_trace(tmp_path):
    trace = TRACE
    proc = plan_cli("--model", "qwen3.5-397b-a17b", "--prfaas", "h200x8:4", "--pd", "h200x8:8", "--egress-gbps", "100",
                    f"--workload=trace:{trace}:lru=20000", "--output-tokens", "343", "--slo", "40", "--json")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["model"] == "qwen3.5-397b-a17b" and result["paper"] == {}
    assert 0 <= result["offload_fraction"] <= 1


def test_progress_bar_on_request():
    proc = plan_cli("--scenario", "case-study", "--progress", "--threshold-step", "4096")
    assert proc.returncode == 0
    assert "searching [" in proc.stderr and "32/32 thresholds" in proc.stderr


def write(path, data):
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.parametrize("args, field", [
    (["--egress-gbps", "-1"], "link.egress_gbps"),
    (["--workload", "lognormal:9.9,0,128,1000"], "workload.sigma"),
    (["--pd", "h20x8:eight"], "--pd"),
    (["--prfaas", "tpu:4"], "prfaas.accelerator"),
    (["--threshold", "0"], "--threshold"),
    (["--threshold-step", "0"], "search.threshold_step_tokens"),
    (["--scenario", "no-such-scenario"], "--scenario"),
])
def test_bad_flags_name_the_field(args, field):
    proc = plan_cli(*(["--scenario", "case-study"] if "--scenario" not in args else []), *args)
    assert proc.returncode == 2, proc.stdout
    assert proc.stderr.startswith(f"error: {field}:"), proc.stderr


def test_empty_workload_is_refused(tmp_path):
    empty = tmp_path / "lengths.txt"
    empty.write_text("\n")
    proc = plan_cli("--scenario", "case-study", f"--workload=lengths:{empty}")
    assert proc.returncode == 2 and "error: workload.lengths: is empty" in proc.stderr


def test_unknown_model_field_is_named(tmp_path):
    model = yaml.safe_load((REPO_ROOT / "prfaas_sglang/plan/data/models/qwen3-235b-a22b.yaml").read_text())
    model["full_attention"]["num_layerz"] = 94
    path = write(tmp_path / "m.yaml", model)
    proc = plan_cli("--scenario", "case-study", "--model", str(path))
    assert proc.returncode == 2
    assert "error: model.full_attention.num_layerz: unknown field" in proc.stderr


def measured_scenario(tmp_path, last_prefill_s: float):
    """The case study with the PD class replaced by a measured profile file."""
    profile = {
        "name": "h20-measured", "gpus_per_instance": 8,
        "points": [{"tokens": 1024, "prefill_s": 0.3, "kv_bytes": 2e7},
                   {"tokens": 8192, "prefill_s": 1.9, "kv_bytes": 1.5e8},
                   {"tokens": 32768, "prefill_s": last_prefill_s, "kv_bytes": 6e8}],
        "decode": {"bs_max": 24, "step_s": 0.025},
    }
    write(tmp_path / "h20.yaml", profile)
    scenario = yaml.safe_load((REPO_ROOT / "prfaas_sglang/plan/data/scenarios/case-study.yaml").read_text())
    scenario["pd"] = {"profile": "h20.yaml", "instances": 8}
    return write(tmp_path / "s.yaml", scenario)


def test_non_monotone_measured_profile_is_named(tmp_path):
    proc = plan_cli("--scenario", str(measured_scenario(tmp_path, last_prefill_s=1.5)))
    assert proc.returncode == 2
    assert "error: pd.profile.points[2].prefill_s: must be non-decreasing" in proc.stderr


def test_measured_profile_scenario_runs(tmp_path):
    proc = plan_cli("--scenario", str(measured_scenario(tmp_path, last_prefill_s=9.5)), "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["decode_bs_max"] == 24


def test_negative_bandwidth_in_a_scenario_file(tmp_path):
    scenario = yaml.safe_load((REPO_ROOT / "prfaas_sglang/plan/data/scenarios/case-study.yaml").read_text())
    scenario["link"]["egress_gbps"] = -5
    proc = plan_cli("--scenario", str(write(tmp_path / "s.yaml", scenario)))
    assert proc.returncode == 2 and "error: link.egress_gbps: must be a positive number" in proc.stderr


def test_the_plan_prints_capacity_at_the_slo_beside_lambda_max_and_refuses_a_bad_slo():
    result = json.loads(plan_cli("--scenario", "case-study", "--ttft-slo-s", "5", "--json").stdout)
    at, best = result["slo"]["at_plan"], result["slo"]["best_for_slo"]
    assert at["threshold_tokens"] == result["threshold_tokens"] and at["lambda_max_rps"] == result["lambda_max_rps"]
    assert 0 < at["capacity_rps"] < at["lambda_max_rps"] and best["capacity_rps"] >= at["capacity_rps"]
    assert result["slo"]["ttft_slo_s"] == 5 and result["slo"]["target"] == 0.9
    table = plan_cli("--scenario", "case-study", "--ttft-slo-s", "10").stdout
    assert "capacity at the TTFT SLO (10 s, 90% of arrivals" in table and "best for the SLO" in table
    bad = plan_cli("--scenario", "case-study", "--ttft-slo-s", "0")
    assert bad.returncode == 2 and "--ttft-slo-s" in bad.stderr


def test_layerwise_streaming_is_priced_in_the_slo_capacity_and_needs_an_slo(capsys):
    from prfaas_sglang.plan.__main__ import main as plan_main

    def slo(*flags):
        assert plan_main(["--scenario", "case-study", "--ttft-slo-s", "5", "--json", *flags]) == 0
        return json.loads(capsys.readouterr().out)["slo"]

    after, streamed = slo(), slo("--layerwise")
    assert not after["layerwise"] and streamed["layerwise"]
    assert streamed["at_plan"]["capacity_rps"] >= after["at_plan"]["capacity_rps"]
    assert streamed["at_plan"]["lambda_max_rps"] == after["at_plan"]["lambda_max_rps"]  # a throughput bound: unchanged
    assert plan_main(["--scenario", "case-study", "--layerwise"]) == 2
    assert "--layerwise: applies with --ttft-slo-s only" in capsys.readouterr().err


def test_a_plan_of_the_engines_as_the_router_learned_them_scales_each_clusters_prefill(capsys):
    """``--prefill-scale CLUSTER=X[+OFFSET_S]``: the router's learned prefill scale and offset, per cluster. Faster
    PrfaaS prefill (X < 1) raises both bounds; an offset on every PD prefill lowers the SLO capacity against the
    same scale without one. A cluster that is not one, a cluster twice, or X <= 0 is a usage error."""
    from prfaas_sglang.plan.__main__ import main as plan_main

    def plan(*flags):
        assert plan_main(["--scenario", "case-study", "--prfaas", "h200x8:1", "--pd", "h20x8:2", "--egress-gbps", "25",
                          "--ttft-slo-s", "5", "--json", *flags]) == 0
        return json.loads(capsys.readouterr().out)

    roofline, faster = plan(), plan("--prefill-scale", "prfaas=0.74", "--prefill-scale", "pd=0.95")
    assert faster["slo"]["at_plan"]["capacity_rps"] > 1.5 * roofline["slo"]["at_plan"]["capacity_rps"]
    assert faster["lambda_max_rps"] > roofline["lambda_max_rps"]
    offset = plan("--prefill-scale", "prfaas=0.74", "--prefill-scale", "pd=0.95+0.5")
    assert offset["slo"]["best_for_slo"]["capacity_rps"] < faster["slo"]["best_for_slo"]["capacity_rps"]
    for bad in (["decode=0.5"], ["prfaas=0"], ["prfaas=x"], ["pd=1", "--prefill-scale", "pd=2"], ["pd=1+-1"]):
        assert plan_main(["--scenario", "case-study", "--prefill-scale", *bad]) == 2
        assert "--prefill-scale" in capsys.readouterr().err


def test_the_plans_slo_capacity_counts_decode_and_a_step_that_grows_with_the_batch(capsys):
    """``--ttft-slo-s`` judges decode too: each point reports the share meeting the scenario's TBT SLO and its
    mean batch per decode instance; ``--decode-growth`` (a step's rise per running sequence) lowers neither
    bound nor raises the capacity. Without ``--ttft-slo-s``, or negative, it is a usage error."""
    from prfaas_sglang.plan.__main__ import main as plan_main

    def slo(*flags):
        assert plan_main(["--scenario", "case-study", "--ttft-slo-s", "10", "--json", *flags]) == 0
        return json.loads(capsys.readouterr().out)["slo"]

    plain, grown = slo(), slo("--decode-growth", "0.05")
    assert plain["tbt_slo_s"] == pytest.approx(1 / 40) and grown["decode_growth_per_seq"] == 0.05
    for point in (plain["at_plan"], grown["at_plan"]):
        assert 0.9 <= point["tbt_met"] <= 1.0 and point["decode_mean_batch"] > 1
    assert grown["at_plan"]["capacity_rps"] < plain["at_plan"]["capacity_rps"]
    assert grown["at_plan"]["lambda_max_rps"] == plain["at_plan"]["lambda_max_rps"]
    assert plain["early_rejection"] and not slo("--no-early-rejection")["early_rejection"]
    for bad, flag in ((["--decode-growth", "0.01"], "--decode-growth"), (["--ttft-slo-s", "5", "--decode-growth", "-1"],
                      "--decode-growth"), (["--no-early-rejection"], "--no-early-rejection")):
        assert plan_main(["--scenario", "case-study", *bad]) == 2
        assert flag in capsys.readouterr().err
