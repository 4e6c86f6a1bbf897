"""python -m prfaas_sglang.bench compare: the user-facing comparison runs end to end (no numbers asserted)."""

from __future__ import annotations

import json

from helpers import run_py


def test_compare_command_reports_both_routers_and_the_ratio():
    proc = run_py(["-m", "prfaas_sglang.bench", "compare", "--duration", "4", "--json"], timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout)["result"]
    for router in ("prfaas", "sglang-router"):
        summary = result[router]
        assert summary["requests_failed"] == 0 and summary["requests"] == result["arrivals"] > 0
        assert {"goodput_rps", "ttft_p50_s", "ttft_p90_s", "tbt_p99_s", "offload_fraction", "egress_gbps"} <= set(summary)
    assert "goodput_ratio" in result
    # our router's t (from its /status) is the runtime model's for the comparison's topology
    from prfaas_sglang import runtime
    from prfaas_sglang.bench.compare import compare_topology
    from prfaas_sglang.topology import parse_topology

    topology = compare_topology("case-study", 64, result["speedup"], result["kv_scale"], result["tokenizer"])
    assert result["threshold_tokens"] == runtime.from_topology(parse_topology(topology)).baseline_threshold_tokens
