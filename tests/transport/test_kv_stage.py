"""Coalescing beyond adjacent entries: the PrfaaS sender's staging buffer (``transport/kv_stager.py``).

Pure parts first (grouping by destination run, the arena), then the stager's copy on host buffers
(what lands where equals what SGLang's blocks would have written), then the sender holding each
region until its batch's last write ended, and SGLang's own Mooncake classes on CPU: a chunk whose
prefill pages are scattered and whose decode pages are one run goes as one write per KV buffer.
"""

from __future__ import annotations

import ctypes
import threading
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sglang_cpu import run_probe
from test_kv_send import FakeEngine, _manager, _until

from prfaas_sglang.errors import ConfigError
from prfaas_sglang.hooks.kv_send_hook import staging_mib_from_env
from prfaas_sglang.transport.kv_send import DONE, FAILED, coalesce
from prfaas_sglang.transport.kv_sender import AsyncKvSender
from prfaas_sglang.transport.kv_stage import (
    DestinationRun,
    StagingArena,
    row_bytes,
    runs_by_destination,
)
from prfaas_sglang.transport.kv_stager import KvStager

PAGE = 4096


@st.composite
def scattered_blocks(draw):
    """Blocks as SGLang builds them for one layer: runs of pages contiguous on both sides."""
    n = draw(st.integers(1, 40))
    src = draw(st.permutations(range(64)))[:n]
    dst = draw(st.permutations(range(64)))[:n] if draw(st.booleans()) else list(range(7, 7 + n))
    return [(s * PAGE, (1 << 20) + d * PAGE, PAGE) for s, d in zip(src, dst, strict=True)]


@given(scattered_blocks())
def test_runs_by_destination_cover_every_byte_once_and_break_only_where_the_destination_does(blocks):
    runs = runs_by_destination(blocks)
    assert sum(r.length for r in runs) == sum(n for _, _, n in blocks)
    assert [s for r in runs for s in r.sources] == [(s, n) for s, _, n in blocks]  # every source, in order
    for r in runs:
        assert r.length == sum(n for _, n in r.sources)
    for a, b in zip(runs, runs[1:], strict=False):  # maximal: a run ends only where the next block's destination jumps
        assert a.dst + a.length != b.dst
    # as they are, the runs are exactly what coalesce gives the blocks
    assert [e for r in runs for e in r.direct()] == coalesce(blocks)


def test_a_run_is_worth_staging_when_it_is_several_small_requests():
    small = DestinationRun(0, 3 * PAGE, ((10 * PAGE, PAGE), (3 * PAGE, PAGE), (40 * PAGE, PAGE)))
    assert small.worth_staging() and len(small.direct()) == 3
    one = DestinationRun(0, 2 * PAGE, ((10 * PAGE, PAGE), (11 * PAGE, PAGE)))  # continues on both sides: one request
    assert not one.worth_staging() and one.direct() == [(10 * PAGE, 0, 2 * PAGE)]
    large = DestinationRun(0, 16 << 20, ((0, 8 << 20), (64 << 20, 8 << 20)))  # already large requests
    assert not large.worth_staging()


def test_row_bytes_is_the_common_granule_of_offsets_and_lengths():
    run = DestinationRun(0, 3 * PAGE, ((100 + 2 * PAGE, PAGE), (100 + 5 * PAGE, 2 * PAGE)))
    assert row_bytes(run, base=100) == PAGE
    assert row_bytes(DestinationRun(0, 96, ((100 + 32, 32), (100 + 96, 64))), base=100) is None  # under 64 bytes


@settings(max_examples=200)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 5000)), max_size=60))
def test_the_arena_never_hands_out_overlapping_regions_and_merges_what_is_freed(ops):
    arena = StagingArena(1 << 16, align_bytes=256)
    taken: dict[int, int] = {}
    for do_alloc, n in ops:
        if do_alloc or not taken:
            off = arena.alloc(n)
            if off is not None:
                assert off % 256 == 0 and off + n <= arena.capacity_bytes
                assert all(off + n <= o or o + m <= off for o, m in taken.items())
                taken[off] = n
        else:
            off = sorted(taken)[n % len(taken)]
            arena.free(off)
            del taken[off]
    for off in list(taken):
        arena.free(off)
    assert arena.free_bytes == arena.capacity_bytes and arena.regions_taken == 0
    assert arena.alloc(arena.capacity_bytes) == 0  # one stretch again
    with pytest.raises(KeyError):
        arena.free(12345)


# --- the stager on host buffers ------------------------------------------------------------------


class HostKv:
    """Two layers' K and V as host buffers, prefill side filled, decode side zero."""

    def __init__(self, pages: int = 64, seed: int = 0):
        rng = np.random.default_rng(seed)
        self.src = [rng.integers(0, 255, (pages, PAGE), dtype=np.uint8) for _ in range(4)]
        self.dst = [np.zeros((pages, PAGE), dtype=np.uint8) for _ in range(4)]
        self.spans = [(b.ctypes.data, b.nbytes) for b in self.src]

    def blocks(self, src_pages, dst_pages):
        """SGLang's blocks for these page lists (runs contiguous on both sides), every buffer."""
        out = []
        for s, d in zip(self.src, self.dst, strict=True):
            for sp, dp in zip(src_pages, dst_pages, strict=True):
                out.append((s.ctypes.data + int(sp) * PAGE, d.ctypes.data + int(dp) * PAGE, PAGE))
        return out


def _land(engine: FakeEngine) -> None:
    """Every write the engine holds lands: its bytes copied, then reported done."""
    with engine.lock:
        pending = [i for i, v in engine.status.items() if v == 0]
    _apply(engine.submitted[i - 1][1:] for i in pending)
    engine.end(DONE)


def _stage_all(stager: KvStager, blocks):
    """Every run of ``blocks`` through ``stage_run`` (a run without room now sent as it is, as no sender
    would: it waits), then ``ready``: the entries and regions."""
    entries, regions = [], []
    for run in runs_by_destination(blocks):
        got = stager.stage_run(run)
        more, region = got if got is not None else (run.direct(), None)
        entries += more
        if region is not None:
            regions.append(region)
    stager.ready()
    return entries, regions


def _apply(entries) -> None:
    """Do what the transfer engine does with each entry: copy its bytes."""
    for src, dst, n in entries:
        ctypes.memmove(dst, src, n)


def test_staged_entries_write_exactly_what_sglangs_blocks_would():
    kv = HostKv()
    rng = np.random.default_rng(1)
    src_pages = rng.permutation(64)[:24]
    dst_pages = np.r_[np.arange(3, 13), np.arange(30, 44)]  # two destination runs (10 and 14 pages)
    stager = KvStager(kv.spans, 1 << 20, "cpu")
    blocks = kv.blocks(src_pages, dst_pages)
    entries, regions = _stage_all(stager, blocks)
    assert len(entries) == 2 * 4 and len(regions) == 8  # one write per destination run per buffer
    assert all(stager.base_ptr <= src < stager.base_ptr + (1 << 20) for src, _, _ in entries)
    _apply(entries)
    for s, d in zip(kv.src, kv.dst, strict=True):
        assert (d[dst_pages] == s[src_pages]).all()
        assert not d[np.setdiff1d(np.arange(64), dst_pages)].any()  # nothing else written
    assert stager.counters()["staged_bytes"] == 24 * PAGE * 4
    stager.release(regions)
    assert stager.arena.free_bytes == 1 << 20


def test_a_run_without_room_now_waits_and_one_that_could_never_fit_goes_as_it_is():
    kv = HostKv()
    src_pages = np.random.default_rng(2).permutation(64)[:16]
    runs = runs_by_destination(kv.blocks(src_pages, np.arange(16)))  # one run of 16 pages per buffer
    stager = KvStager(kv.spans, 2 * 16 * PAGE, "cpu")  # room for two of the four
    first, second = stager.stage_run(runs[0]), stager.stage_run(runs[1])
    assert first[1] is not None and second[1] is not None
    assert stager.stage_run(runs[2]) is None and stager.counters()["waits"] == 1  # no room now: wait
    stager.ready()
    _apply(first[0] + second[0])  # the first two landed ...
    stager.release([first[1]])  # ... and a region came back
    third = stager.stage_run(runs[2])
    assert third is not None and third[1] == first[1]
    stager.ready()
    _apply(third[0])
    for s, d in zip(kv.src[:3], kv.dst[:3], strict=True):
        assert (d[:16] == s[src_pages]).all()
    small = KvStager(kv.spans, 8 * PAGE, "cpu")  # smaller than a run: it could never fit
    assert small.stage_run(runs[3]) == (runs[3].direct(), None)


def test_blocks_outside_the_kv_buffers_or_worth_nothing_go_as_they_are():
    kv = HostKv()
    stager = KvStager(kv.spans, 1 << 20, "cpu")
    state = np.arange(8 * PAGE, dtype=np.uint8)  # e.g. a Mamba state buffer: not one of the KV buffers
    outside = [(state.ctypes.data + i * PAGE, kv.dst[0].ctypes.data + i * PAGE, PAGE) for i in (0, 5, 2)]
    assert _stage_all(stager, outside) == (coalesce(outside), [])
    contiguous = kv.blocks(np.arange(8), np.arange(20, 28))  # continues on both sides: already one write a buffer
    assert _stage_all(stager, contiguous) == (coalesce(contiguous), [])
    assert stager.counters()["staged_runs"] == 0


def test_the_sender_frees_a_region_once_its_write_is_over_never_while_the_engine_may_read_it():
    kv = HostKv()
    engine = FakeEngine()
    stager = KvStager(kv.spans, 1 << 20, "cpu")
    sender = AsyncKvSender(_manager({1: "d:1"}), engine, wait_bound_s=10.0, lanes=2, retry_within_s=None,
                           stager=stager)
    rng = np.random.default_rng(3)
    assert sender.submit("d:1", kv.blocks(rng.permutation(64)[:8], np.arange(8))) == 0
    _until(lambda: len(engine.submitted) == 2)  # two of the four staged writes on the lanes
    assert stager.arena.regions_taken == 4  # one per buffer
    with engine.lock:
        engine.status[1] = FAILED  # the first write fails; the second is still on the wire
    _until(lambda: sender.ledger.failed("d:1"))
    assert not sender.barrier("d:1", 1)  # the room fails, the batch is abandoned, its two queued writes dropped
    _until(lambda: stager.arena.regions_taken == 1)  # the failed write's and the dropped ones' are back ...
    time.sleep(0.05)
    assert stager.arena.regions_taken == 1  # ... the other's is held: the engine may still read it
    engine.end(DONE)
    _until(lambda: stager.arena.regions_taken == 0)
    assert len(engine.submitted) == 2
    # the next chunk goes through, and its regions come back once it landed
    assert sender.submit("d:1", kv.blocks(rng.permutation(64)[:8], np.arange(8, 16))) == 0
    while len(engine.submitted) < 6:
        held = len(engine.submitted)
        _until(lambda held=held: len(engine.submitted) > held)
        engine.end(DONE)
    engine.end(DONE)
    assert sender.barrier("d:1", 2)
    _until(lambda: stager.arena.regions_taken == 0)
    assert sender.counters()["staged_bytes"] == 2 * 8 * PAGE * 4


def test_the_sender_stages_runs_as_they_come_up_and_they_wait_for_room_instead_of_going_page_by_page():
    kv = HostKv()
    engine = FakeEngine()
    stager = KvStager(kv.spans, 2 * 8 * PAGE, "cpu")  # room for two of a chunk's four runs
    sender = AsyncKvSender(_manager({1: "d:1"}), engine, wait_bound_s=10.0, lanes=4, stager=stager)
    src_pages = np.random.default_rng(4).permutation(64)[:8]
    assert sender.submit("d:1", kv.blocks(src_pages, np.arange(8))) == 0
    _until(lambda: len(engine.submitted) == 2)
    time.sleep(0.05)
    assert len(engine.submitted) == 2 and stager.counters()["waits"] > 0  # the other two wait, unsent
    while len(engine.submitted) < 4:
        held = len(engine.submitted)
        _land(engine)
        _until(lambda held=held: len(engine.submitted) > held)
    _land(engine)
    assert sender.barrier("d:1", 1)
    assert all(stager.base_ptr <= src < stager.base_ptr + stager.arena.capacity_bytes for _, src, _, _ in engine.submitted)
    for s, d in zip(kv.src, kv.dst, strict=True):
        assert (d[:8] == s[src_pages]).all()
    _until(lambda: stager.arena.regions_taken == 0)


def test_a_malformed_staging_size_stops_startup(monkeypatch):
    monkeypatch.setenv("PRFAAS_KV_STAGING_MIB", "lots")
    with pytest.raises(ConfigError, match="PRFAAS_KV_STAGING_MIB"):
        staging_mib_from_env()
    monkeypatch.setenv("PRFAAS_KV_STAGING_MIB", "-1")
    with pytest.raises(ConfigError, match="PRFAAS_KV_STAGING_MIB"):
        staging_mib_from_env()
    monkeypatch.delenv("PRFAAS_KV_STAGING_MIB")
    assert staging_mib_from_env() == 0


def test_concurrent_chunks_stage_into_their_own_regions():
    kv = HostKv(pages=256)
    stager = KvStager(kv.spans, 8 << 20, "cpu")
    results = {}

    def one(i):
        pages = np.random.default_rng(10 + i).permutation(256)[:32]
        results[i] = (pages, _stage_all(stager, kv.blocks(pages, np.arange(32 * i, 32 * i + 32))))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, (pages, (entries, regions)) in results.items():
        _apply(entries)
        for s, d in zip(kv.src, kv.dst, strict=True):
            assert (d[32 * i:32 * i + 32] == s[pages]).all()
        stager.release(regions)
    assert stager.arena.free_bytes == 8 << 20


@pytest.mark.slow
def test_sglang_sends_a_scattered_chunk_into_contiguous_decode_pages_as_one_write_per_buffer():
    """SGLang's own Mooncake managers on CPU (the probe): three requests of three 64-page chunks, prefill
    pages random, decode pages one run. With the launcher's staging buffer each chunk is one write per KV
    buffer, where SGLang's blocks are a write per page (nothing continues on the prefill side), and the
    KV lands intact; every region is back once the writes landed."""
    env = {"PRFAAS_ROLE": "prfaas", "PRFAAS_KV_ASYNC_SEND": "1", "PROBE_DST": "contiguous"}
    staged = run_probe(**env, PRFAAS_KV_STAGING_MIB="64")
    plain = run_probe(**env, PRFAAS_KV_STAGING_MIB="0")
    for out in (staged, plain):
        assert all(r["sender"] == r["receiver"] == out["success"] and r["kv_intact"] and r["aux_intact"]
                   for r in out["requests"]), out["requests"]
        assert out["async"]["writes_failed"] == 0 and out["async"]["in_flight_bytes"] == 0
        assert out["prefill_rooms_left"] == out["decode_rooms_left"] == out["transfer_infos_left"] == []
    chunks, buffers, pages = 3 * 3, 8, 64
    assert staged["async"]["writes"] == chunks * buffers
    assert plain["async"]["staging"] is None and plain["async"]["writes"] >= chunks * buffers * pages * 0.9
    counters = staged["async"]["staging"]
    assert counters["staged_bytes"] == staged["kv_bytes_per_request"] * 3 and counters["failed_copies"] == 0
    assert counters["staging_free_bytes"] == 64 << 20
