"""The decode side of coalescing beyond adjacent entries: the KV reserve (``hooks/decode_stage.py``).

Pure parts (runs of page ids), the reserve on host buffers (what is told the prefill, what lands where,
the quarantine), the reserve taken from SGLang's own allocators, and SGLang's own Mooncake classes on
CPU: prompts whose pages are scattered on both sides arrive as one write per KV buffer and chunk (the
PrfaaS side gathers, the decode receives in its reserve and copies home), intact, and nothing else of
the decode's pages is written.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from sglang_cpu import run_probe

from prfaas_sglang.errors import ConfigError
from prfaas_sglang.hooks.decode_stage import DecodeStaging, reserve_pages, staging_tokens_from_env
from prfaas_sglang.transport.kv_stage import page_runs, worth_redirecting

PAGE = 4096


def test_page_runs_and_when_redirecting_pays():
    assert page_runs([]) == 0 and page_runs([5]) == 1 and page_runs([3, 4, 5]) == 1
    assert page_runs([3, 4, 9, 10, 2]) == 3
    assert not worth_redirecting(np.arange(10, 50), PAGE)  # one run already
    assert worth_redirecting(np.array([3, 9, 10, 40]), PAGE)  # three small runs
    assert not worth_redirecting(np.r_[np.arange(0, 2048), np.arange(4096, 6144)], 4096)  # two 8 MiB runs


class HostDecode:
    """Four KV buffers of ``pages`` pages, the last ``reserve`` of them the reserve; the first part as a
    prefill would have written it into the reserve is simulated by the test."""

    def __init__(self, pages: int = 64, reserve: int = 16):
        self.bufs = [np.zeros((pages + reserve, PAGE), dtype=np.uint8) for _ in range(4)]
        self.pages, self.reserve = pages, reserve
        self.now = 0.0

    def staging(self, quarantine_s: float = 5.0) -> DecodeStaging:
        return DecodeStaging([(b.ctypes.data, b.nbytes, PAGE) for b in self.bufs], self.pages, self.reserve, "cpu",
                             quarantine_s=quarantine_s, clock=lambda: self.now)

    def write_as_prefill(self, told, seed: int) -> list[np.ndarray]:
        """What a prefill writes to the pages it was told: per buffer, random rows; returns them."""
        rng = np.random.default_rng(seed)
        rows = []
        for b in self.bufs:
            data = rng.integers(1, 255, (len(told), PAGE), dtype=np.uint8)
            b[told] = data
            rows.append(data)
        return rows


def test_a_scattered_prompt_is_told_reserve_pages_and_lands_on_its_own():
    dec = HostDecode()
    staging = dec.staging()
    own = np.array([9, 40, 41, 3, 30], dtype=np.int32)
    told = staging.redirect(7, own)
    assert told.dtype == own.dtype and list(told) == list(range(64, 69))  # one run of reserve pages
    written = dec.write_as_prefill(told, seed=1)
    assert staging.land(7)
    for b, data in zip(dec.bufs, written, strict=True):
        assert (b[own] == data).all()
        assert not b[np.setdiff1d(np.arange(64), own)].any()  # nothing else of the decode's own pages
    assert staging.counters()["free_pages"] == 16 and not staging.land(7)  # freed; landing twice does nothing
    contiguous = np.arange(20, 30)
    assert staging.redirect(8, contiguous) is contiguous or (staging.redirect(8, contiguous) == contiguous).all()
    assert staging.counters()["redirected_rooms"] == 1


def test_the_reserve_never_waits_and_a_failed_rooms_pages_come_back_after_the_quarantine():
    dec = HostDecode(reserve=8)
    staging = dec.staging(quarantine_s=5.0)
    a = staging.redirect(1, np.array([1, 5, 9, 13, 17]))
    assert a.min() >= 64
    too_many = np.array([2, 6, 10, 14])
    assert (staging.redirect(2, too_many) == too_many).all()  # no room: its own pages, at once
    assert staging.counters()["no_room"] == 1
    staging.retire(1)  # failed: the prefill may still be writing into the reserve
    assert (staging.redirect(3, too_many) == too_many).all()
    dec.now = 5.0  # the quarantine passed
    b = staging.redirect(4, too_many)
    assert b.min() >= 64 and staging.counters()["retired_rooms"] == 1


@pytest.mark.parametrize("page_size", [1, 64])
def test_the_reserve_is_the_fresh_pools_top_pages_and_sglangs_allocator_shrinks_by_them(page_size):
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator

    def allocator():
        if page_size == 1:
            return TokenToKVPoolAllocator(size=8192, dtype=torch.int64, device="cpu", kvcache=None, need_sort=True)
        return PagedTokenToKVPoolAllocator(size=8192, page_size=page_size, dtype=torch.int64, device="cpu",
                                           kvcache=None, need_sort=True)

    fresh = allocator()
    before = fresh.available_size()
    first, num = reserve_pages(fresh, 1000)
    assert num == 1000 // page_size and first + num - 1 == 8192 // page_size  # the top pages, one run
    assert fresh.available_size() == before - num * page_size == fresh.size  # accounted: a smaller pool
    for _ in range(2):  # never handed out, not even after SGLang's clear()
        taken = fresh.alloc(fresh.available_size())
        pages = set((taken[::page_size] // page_size).tolist() if page_size > 1 else taken.tolist())
        assert pages and max(pages) < first
        fresh.clear()
    used = allocator()
    used.alloc(used.available_size() - page_size)  # every page in use but the first
    left = used.available_size()
    assert reserve_pages(used, 4 * page_size) is None and used.available_size() == left  # nothing taken


def test_a_malformed_reserve_size_stops_startup(monkeypatch):
    monkeypatch.setenv("PRFAAS_DECODE_STAGING_TOKENS", "many")
    with pytest.raises(ConfigError, match="PRFAAS_DECODE_STAGING_TOKENS"):
        staging_tokens_from_env()
    monkeypatch.setenv("PRFAAS_DECODE_STAGING_TOKENS", "4096")
    assert staging_tokens_from_env() == 4096


@pytest.mark.slow
def test_sglang_sends_prompts_scattered_on_both_sides_as_one_write_per_buffer_and_chunk():
    """SGLang's own Mooncake managers on CPU (the probe): three requests of three 64-page chunks, pages
    random on both sides. With the PrfaaS side's staging buffer and the decode's reserve, each chunk is
    one write per KV buffer (SGLang's blocks: one per page), the KV lands on the decode's own pages,
    intact, nothing else of its pages is written, and the reserve is whole again."""
    env = {"PRFAAS_ROLE": "prfaas", "PRFAAS_KV_ASYNC_SEND": "1", "PRFAAS_KV_STAGING_MIB": "64",
           "PROBE_DECODE_RESERVE_PAGES": "192"}
    out = run_probe(**env)
    assert all(r["sender"] == r["receiver"] == out["success"] and r["kv_intact"] and r["aux_intact"]
               for r in out["requests"]), out["requests"]
    assert out["async"]["writes"] == 3 * 3 * 8 and out["async"]["writes_failed"] == 0
    reserve = out["decode_staging"]
    assert reserve["redirected_rooms"] == reserve["landed_rooms"] == 3 and reserve["rooms_held"] == 0
    assert reserve["free_pages"] == 192 and reserve["no_room"] == 0
    assert out["prefill_rooms_left"] == out["decode_rooms_left"] == out["transfer_infos_left"] == []
    # the reserve alone, the PrfaaS side sending as SGLang builds its blocks: still intact, a write per page
    plain = run_probe(**{**env, "PRFAAS_KV_STAGING_MIB": "0"})
    assert all(r["kv_intact"] for r in plain["requests"]) and plain["decode_staging"]["landed_rooms"] == 3
    assert plain["async"]["writes"] > 3 * 3 * 8 * 32
