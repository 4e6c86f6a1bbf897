"""The prefill admission policy (``kvindex/admission.py``), pure: ``shared`` and ``auto``."""

from __future__ import annotations

import pytest

from prfaas_sglang.kvindex.admission import MIN_REUSE_SAMPLES, AdmissionConfigError, PrefixAdmission

MIN_SHARED = 1024


def _prompt(stem: int, tail: int, stem_tokens: int = 2048, tail_tokens: int = 2048) -> list[int]:
    """``stem_tokens`` of stem ``stem`` (shared by every prompt with that stem), then a unique tail."""
    return [stem] * stem_tokens + [1_000_000 + tail] * tail_tokens


def _replay(admission: PrefixAdmission, rounds: int, gap: int) -> list[str]:
    """Each round: a prompt with a stem seen ``gap`` rounds ago (a re-sighting), then ``gap``
    one-off prompts; returns each one-off's decision reason."""
    reasons = []
    tail = 0
    for r in range(rounds):
        tail += 1
        admission.decide(_prompt(r, tail), hit_tokens=0)  # a new stem, seen again below
        if r >= gap:
            tail += 1
            admission.decide(_prompt(r - gap, tail), hit_tokens=0)
        for _ in range(gap):
            tail += 1
            reasons.append(admission.decide(_prompt(10_000 + tail, tail), hit_tokens=0).reason)
    return reasons


def test_shared_keeps_a_prefix_from_its_second_sighting_and_never_a_one_off():
    admission = PrefixAdmission("shared", MIN_SHARED)
    assert admission.decide(_prompt(1, 1), 0).reason == "one-off"
    assert admission.decide(_prompt(1, 2), 0).reason == "seen-prefix"  # same 2,048-token stem
    assert admission.decide(_prompt(2, 3), hit_tokens=MIN_SHARED).reason == "reused-prefix"
    assert admission.decide(_prompt(3, 4, stem_tokens=100), 0).reason == "one-off"  # < MIN_SHARED in common
    assert admission.stats.kept_requests == 2 and admission.stats.transfer_requests == 2


def test_auto_keeps_one_offs_where_prompts_come_back_within_the_caches_reach():
    """Every prompt is 4,096 tokens; a stem comes back after ``gap * (gap + 2)`` other prompts (in
    its round ``gap + 1`` after it, ``gap + 2`` in each round between, 1 in the round it is back).
    An LRU tree that kept everything still holds (the first 1,024 tokens of) the stem then if it has
    room for those prompts and that prefix."""
    gap = 3
    reach = gap * (gap + 2) * 4096 + MIN_SHARED
    big = PrefixAdmission("auto", MIN_SHARED, capacity_tokens=reach)
    small = PrefixAdmission("auto", MIN_SHARED, capacity_tokens=reach - 1)
    big_reasons, small_reasons = _replay(big, rounds=40, gap=gap), _replay(small, rounds=40, gap=gap)
    assert set(big_reasons) == {"one-off-in-reach"}
    # a small cache: kept while it knew too little, refused once MIN_REUSE_SAMPLES came back out of reach
    assert small_reasons[-30:] == ["one-off"] * 30
    assert small_reasons[:gap * gap] == ["one-off-in-reach"] * gap * gap  # cold: no re-sighting yet
    # the estimate depends on the arrivals only, not on what was kept
    assert big.stats.reuses_seen == small.stats.reuses_seen == 40 - 3
    assert big.stats.reuses_in_reach == 37
    assert small.stats.reuses_in_reach == gap  # the first rounds had no re-sighting to add between
    # shared in the same stream keeps no one-off
    assert set(_replay(PrefixAdmission("shared", MIN_SHARED), rounds=40, gap=3)) == {"one-off"}


def test_auto_counts_the_reused_prefix_itself_against_the_capacity():
    """A prefix that comes back right after one 4,096-token prompt: its shortest shared part (1,024
    tokens) and that prompt need 5,120 tokens of an LRU tree; the prompt alone would fit 4,600."""
    def reasons(capacity_tokens):
        admission = PrefixAdmission("auto", MIN_SHARED, capacity_tokens=capacity_tokens)
        out = []
        for k in range(MIN_REUSE_SAMPLES + 4):
            admission.decide([7] * 6144 + [k], 0)  # the prefix again (its 4,096-token print matches)
            out.append(admission.decide(_prompt(100 + k, k), 0).reason)
        return out[-1]
    assert reasons(4_600) == "one-off"
    assert reasons(5_120) == "one-off-in-reach"


def test_auto_with_few_state_slots_refuses_one_offs_though_tokens_would_fit():
    """A hybrid model's tree also needs a state slot per kept request: a reuse ``gap`` requests
    later is out of reach of 2 slots, however many KV tokens the pool has."""
    tokens_only = PrefixAdmission("auto", MIN_SHARED, capacity_tokens=1 << 30)
    few_slots = PrefixAdmission("auto", MIN_SHARED, capacity_tokens=1 << 30, capacity_states=2)
    assert _replay(tokens_only, rounds=30, gap=3)[-10:] == ["one-off-in-reach"] * 10
    assert _replay(few_slots, rounds=30, gap=3)[-10:] == ["one-off"] * 10


def test_settings_that_cannot_work_are_refused_with_a_typed_error():
    with pytest.raises(AdmissionConfigError, match="capacity_tokens"):
        PrefixAdmission("auto", MIN_SHARED)  # auto must know the cache's size
    for kw in ({"mode": "most"}, {"min_shared_tokens": 0}, {"ghost_entries": 0}, {"capacity_tokens": -1},
               {"capacity_states": 0}, {"min_shared_tokens": True}):
        with pytest.raises(AdmissionConfigError):
            PrefixAdmission(**{"mode": "shared", **kw})
    # the ghost remembers sightings beyond the cache's reach: twice its capacity in shortest prefixes
    assert PrefixAdmission("auto", MIN_SHARED, capacity_tokens=1 << 24).ghost_entries == 2 * (1 << 24) // MIN_SHARED
    assert PrefixAdmission("shared", MIN_SHARED).ghost_entries == 4096


def test_a_one_off_with_a_checkpoint_hint_keeps_that_prefix_only():
    """A request that asks for a state checkpoint (a router saw that prefix on some worker): where
    the prompt would be transfer cache, its prefix up to the checkpoint is kept and the rest is not;
    where it is kept anyway (seen before, or ``auto`` with the cache's reach), it is kept whole."""
    for mode in ("shared", "auto"):
        admission = PrefixAdmission(mode, MIN_SHARED, capacity_tokens=1000)
        for k in range(MIN_REUSE_SAMPLES + 2):  # auto: a cache too small for any reuse, so one-offs are refused
            admission.decide(_prompt(k, k), 0)
            admission.decide(_prompt(k, k + 100), 0)
        assert admission.decide(_prompt(500, 1), 0).reason == "one-off"
        before = (admission.stats.kept_tokens, admission.stats.transfer_tokens)
        decision = admission.decide(_prompt(501, 2), 0, checkpoint_tokens=2048)
        assert (decision.keep, decision.reason, decision.keep_tokens) == (True, "checkpoint-prefix", 2048)
        assert (admission.stats.kept_tokens - before[0], admission.stats.transfer_tokens - before[1]) == (2048, 2048)
        seen = admission.decide(_prompt(501, 3), 0, checkpoint_tokens=2048)  # the stem again: kept whole
        assert (seen.reason, seen.keep_tokens) == ("seen-prefix", None)
        assert admission.decide(_prompt(502, 4), 0, checkpoint_tokens=4096).reason == "one-off"  # not inside the prompt
    roomy = PrefixAdmission("auto", MIN_SHARED, capacity_tokens=1 << 30)
    assert roomy.decide(_prompt(1, 1), 0, checkpoint_tokens=2048).keep_tokens is None  # in reach: the whole prompt
    assert not PrefixAdmission("none").decide(_prompt(1, 1), 0, checkpoint_tokens=2048).keep
