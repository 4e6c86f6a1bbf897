"""``bench decode-reuse`` on the installed SGLang's real decode pools (a small workload: seconds)."""

from __future__ import annotations

import pytest

from prfaas_sglang._compat import RADIX_TREES, installed_has
from prfaas_sglang.bench import decode_reuse

pytest.importorskip("torch")
import sglang  # noqa: E402, F401 - the bench drives the installed SGLang's own classes (marker sglang)


def test_the_workload_is_conversations_whose_turns_extend_their_history():
    turns = decode_reuse.conversations(seed=3, count=4, turns=3)
    assert len(turns) == 12 and turns == decode_reuse.conversations(seed=3, count=4, turns=3)
    history: dict[int, list[int]] = {}
    for turn in turns:
        if turn.conversation in history:
            assert turn.prompt[: len(history[turn.conversation])] == history[turn.conversation]
        else:
            assert turn.prompt[: decode_reuse.SYSTEM_TOKENS] == turns[0].prompt[: decode_reuse.SYSTEM_TOKENS]
        history[turn.conversation] = turn.prompt + turn.answer


def test_the_decode_cache_holds_history_and_a_full_attention_match_holds_no_less_than_a_state_aware_one():
    """Through SGLang's own decode path on either release, later turns find their history; on 0.5.15 our
    full-attention-only match holds at least what SGLang's state-aware match holds on the same tree,
    and more once state slots are scarce (a conversation's state evicted, its KV still there)."""
    result = decode_reuse.run([1], 6, 3, [3, 12], 16_384)
    rows = result["rows"]
    if installed_has(RADIX_TREES):
        ours, aware = rows["ours"], rows["state-aware match on ours"]
        assert all(ours[s]["held"] >= aware[s]["held"] for s in ours)
        assert ours["3"]["held"] > aware["3"]["held"]
        assert ours["12"]["reuse"] > ours["3"]["reuse"] > 0
    else:
        assert rows["upstream"]["12"]["reuse"] > rows["upstream"]["3"]["reuse"] > 0
