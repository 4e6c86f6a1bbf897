"""The emulated engine's scheduling arithmetic: chunk budget, batch admission, KV pool accounting."""

from __future__ import annotations

import collections

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prfaas_sglang.engine.mock.scheduler import ChunkedPrefill, KvPool, PrefillJob, admit


def quadratic(n: int) -> float:
    """A cost curve with a per-request overhead and attention's quadratic term."""
    return 0.01 + 1e-4 * n + 1e-9 * n * n


def drain(sched: ChunkedPrefill) -> list[tuple[tuple, float, list]]:
    out = []
    while (fwd := sched.next_forward()) is not None:
        out.append(([(p.job, p.start, p.end) for p in fwd.pieces], fwd.duration_s, sched.complete(fwd)))
    return out


def test_forward_shares_the_chunk_budget_fcfs_and_the_cut_request_leads_the_next():
    a, b, c = PrefillJob(3000), PrefillJob(6000), PrefillJob(2000)
    sched = ChunkedPrefill(8192, quadratic)
    for job in (a, b, c):
        sched.add(job)
    first, second = drain(sched)
    assert first[0] == [(a, 0, 3000), (b, 0, 5192)] and first[2] == [a]
    assert second[0] == [(b, 5192, 6000), (c, 0, 2000)] and second[2] == [b, c]
    assert len(sched) == 0 and sched.remaining_tokens == 0


def test_chunks_of_one_request_cost_what_the_whole_prefill_costs():
    job = PrefillJob(50_000)
    sched = ChunkedPrefill(4096, quadratic)
    sched.add(job)
    forwards = drain(sched)
    assert len(forwards) == 13  # ceil(50000 / 4096)
    assert all(end - start <= 4096 for pieces, _, _ in forwards for _, start, end in pieces)
    assert sum(d for _, d, _ in forwards) == pytest.approx(quadratic(50_000))


@settings(max_examples=200, deadline=None)  # cost scales with forwards; a timing is no assertion
@given(lengths=st.lists(st.integers(1, 40_000), min_size=1, max_size=12),
       chunk=st.one_of(st.none(), st.integers(64, 20_000)))
def test_any_queue_costs_the_sum_of_its_prefills_and_no_forward_exceeds_the_budget(lengths, chunk):
    """Throughput is the planner's 1 / E[T_prefill] however chunks fall: the total telescopes."""
    sched = ChunkedPrefill(chunk, quadratic, max_forward_tokens=16_384)
    jobs = [PrefillJob(n) for n in lengths]
    for job in jobs:
        sched.add(job)
    forwards = drain(sched)
    assert sum(d for _, d, _ in forwards) == pytest.approx(sum(quadratic(n) for n in lengths))
    finished = [job for _, _, done in forwards for job in done]
    assert finished == jobs  # FCFS completion order
    for pieces, _, _ in forwards:
        tokens = sum(end - start for _, start, end in pieces)
        if chunk is not None:
            assert tokens <= chunk
            assert all(start == 0 or i == 0 for i, (_, start, _) in enumerate(pieces))  # only the head resumes
        else:
            assert len(pieces) == 1 or tokens <= 16_384
            assert all(start == 0 and end == job.uncached_tokens for job, start, end in pieces)


def test_the_chunked_request_takes_the_budget_first_as_in_sglang():
    """SGLang's PrefillAdder gives ``chunked_req`` the budget before any new request: a short
    request queued behind a long one waits for its chunks and shares the last forward."""
    long, short = PrefillJob(64_000), PrefillJob(500)
    sched = ChunkedPrefill(8192, quadratic)
    sched.add(long)
    sched.add(short)
    forwards = drain(sched)
    assert [done for _, _, done in forwards[:-1]] == [[]] * 7
    assert forwards[-1][0] == [(long, 57_344, 64_000), (short, 0, 500)] and forwards[-1][2] == [long, short]


def test_removed_jobs_are_not_computed_and_a_stale_forward_is_ignored():
    a, b = PrefillJob(10_000), PrefillJob(1000)
    sched = ChunkedPrefill(8192, quadratic)
    sched.add(a)
    sched.add(b)
    fwd = sched.next_forward()
    assert sched.remove(a) and not sched.remove(a)
    assert sched.complete(fwd) == []  # a's piece ignored; b was not in that forward
    assert sched.waiting_jobs == 1 and sched.remaining_tokens == 1000
    (pieces, _, done), = drain(sched)
    assert pieces == [(b, 0, 1000)] and done == [b]


def test_waiting_counts_only_unstarted_jobs():
    a, b = PrefillJob(10_000), PrefillJob(1000)
    sched = ChunkedPrefill(8192, quadratic)
    sched.add(a)
    sched.add(b)
    assert sched.waiting_jobs == 2 and sched.remaining_tokens == 11_000
    sched.complete(sched.next_forward())
    assert sched.waiting_jobs == 1 and sched.remaining_tokens == 1808 + 1000


def test_bad_arguments():
    with pytest.raises(ValueError):
        PrefillJob(0)
    with pytest.raises(ValueError):
        ChunkedPrefill(0, quadratic)
    with pytest.raises(ValueError):
        KvPool(0)


@settings(max_examples=200)
@given(ops=st.lists(st.tuples(st.booleans(), st.integers(0, 3000)), max_size=60))
def test_kv_pool_free_plus_used_is_total_at_every_step(ops):
    pool = KvPool(10_000)
    held: list[int] = []
    for take, n in ops:
        if take:
            before = pool.free_tokens
            ok = pool.try_take(n)
            assert ok == (n <= before)
            if ok:
                held.append(n)
        elif held:
            pool.give(held.pop(n % len(held)))
        assert pool.free_tokens + pool.used_tokens == pool.total_tokens
        assert pool.used_tokens == sum(held) and pool.free_tokens >= 0
    with pytest.raises(ValueError):
        pool.give(pool.used_tokens + 1)


def test_kv_pool_fits_and_refuses_negative():
    pool = KvPool(100)
    assert pool.fits(100) and not pool.fits(101)
    assert pool.try_take(60) and not pool.try_take(41) and pool.try_take(40)
    with pytest.raises(ValueError):
        pool.try_take(-1)


def test_admission_respects_the_batch_limit_and_drops_abandoned():
    waiting = collections.deque(["a", "x", "b", "c", "d"])
    running = ["r1"]
    taken = admit(waiting, running, 3, skip=lambda s: s == "x")
    assert running == ["r1", "a", "b"] and taken == ["a", "x", "b"] and list(waiting) == ["c", "d"]
    assert admit(waiting, running, 3) == [] and list(waiting) == ["c", "d"]
