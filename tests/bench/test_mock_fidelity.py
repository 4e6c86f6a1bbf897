"""``bench mock-fidelity`` at its smallest setting: one emulated PD pair (no router), two lengths, each
sent twice (a few seconds)."""

from __future__ import annotations

import pytest

from prfaas_sglang.bench import mock


@pytest.mark.slow
def test_each_prompt_is_timed_cold_and_again_and_a_repeat_reuses_the_hybrid_prefix_up_to_its_last_checkpoint():
    """A 1K prompt reuses nothing (no checkpoint before its last page); a 16K one, on its repeat, the 8K
    up to its checkpoint. Every row has its KV transfer and a prediction to compare with."""
    rows = mock.run(speedup=20.0, lengths=(1_024, 16_384))
    assert [(r["tokens"], r["attempt"]) for r in rows] == [(1_024, "cold"), (1_024, "repeat"), (16_384, "cold"),
                                                           (16_384, "repeat")]
    assert [r["cached_tokens"] for r in rows] == [0, 0, 0, 8_192]
    assert all(r["kv_bytes"] > 0 and r["kv_transfer_s"] >= 0 and r["predicted_ttft_s"] > 0 and r["ratio"] > 0
               for r in rows)
    table = mock.render_markdown(rows).splitlines()
    assert len(table) == 2 + len(rows) and table[2].startswith("| 1,024 | cold | 0 |")
