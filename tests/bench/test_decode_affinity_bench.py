"""``bench decode-affinity`` end to end, small: both rows complete every request, the result has
the structure BENCHMARKS.md is written from, and with affinity every later turn finds its earlier
turns on its decode worker."""

from __future__ import annotations

import pytest

from prfaas_sglang.bench import decode_affinity


@pytest.mark.slow
def test_a_small_run_completes_and_affinity_holds_every_later_turn():
    result = decode_affinity.run(seeds=1, conversations=2, turns=2, decode_workers=2, models=("qwen3-235b-a22b",))
    rows = {r["row"]: r for r in result["rows"]}
    assert set(rows) == {"affinity", "free-KV only"} and all(r["requests"] == 4 for r in rows.values())
    # 2 of the 4 prompts are later turns; each is mostly its earlier turn, held by its decode worker
    assert rows["affinity"]["decode_held_fraction"] > 0.3
    assert rows["affinity"]["decode_kv_bytes"] <= rows["free-KV only"]["decode_kv_bytes"]
    ratios = result["ratios_affinity_over_free_kv"]["qwen3-235b-a22b"]
    assert set(ratios) == {"decode_kv_bytes", "wan_kv_bytes", "latency_p50_s"} and len(ratios["decode_kv_bytes"]) == 1
    assert "| qwen3-235b-a22b | 0 | affinity | 4 |" in decode_affinity.markdown(result)
