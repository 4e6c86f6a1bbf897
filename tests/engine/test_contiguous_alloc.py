"""A decode worker's prompt KV in one run of slots (``hooks/contiguous_alloc.py``), on CPU.

SGLang's own ``DecodePreallocQueue._pre_alloc`` (on a queue holding only what it reads), its page-1
``TokenToKVPoolAllocator`` with the sorted free list disaggregation uses, its ``ReqToTokenPool``, and
its ``group_concurrent_contiguous``, which decides how many requests the Mooncake sender writes.
"""

from __future__ import annotations

import contextlib
from array import array
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

from sglang.srt.disaggregation import decode as sglang_decode  # noqa: E402
from sglang.srt.disaggregation.common.utils import group_concurrent_contiguous  # noqa: E402
from sglang.srt.disaggregation.decode import DecodePreallocQueue  # noqa: E402
from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator  # noqa: E402
from sglang.srt.mem_cache.base_prefix_cache import BasePrefixCache  # noqa: E402
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool  # noqa: E402

from prfaas_sglang.hooks.contiguous_alloc import contiguous_prealloc, take_contiguous  # noqa: E402

POOL_TOKENS = 256


def test_the_shortest_run_that_holds_the_request_is_taken():
    free = torch.tensor([3, 4, 9, 10, 11, 12, 20, 21, 22])
    taken, rest = take_contiguous(free, 3)
    assert taken.tolist() == [20, 21, 22] and rest.tolist() == [3, 4, 9, 10, 11, 12]
    taken, rest = take_contiguous(free, 4)
    assert taken.tolist() == [9, 10, 11, 12] and rest.tolist() == [3, 4, 20, 21, 22]
    assert take_contiguous(free, 5) is None  # no run that long
    assert take_contiguous(free, 1) is None  # one slot: any will do, SGLang's choice
    assert take_contiguous(torch.tensor([], dtype=torch.int64), 2) is None


def _free_list(gaps_and_runs: list[tuple[int, int]]) -> list[int]:
    """Runs of free slots: each (gap, length) skips ``gap`` used slots, then ``length`` free ones."""
    out, at = [], 1
    for gap, length in gaps_and_runs:
        at += gap
        out.extend(range(at, at + length))
        at += length
    return out


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 4), st.integers(1, 12)), max_size=12), st.integers(2, 14))
def test_taken_is_one_run_of_free_slots_and_the_rest_stays_sorted(gaps_and_runs, need):
    free = torch.tensor(_free_list(gaps_and_runs), dtype=torch.int64)
    picked = take_contiguous(free, need)
    runs = [len(g) for g in np.split(free.numpy(), np.where(np.diff(free.numpy()) != 1)[0] + 1)] if len(free) else []
    if picked is None:
        assert not any(n >= need for n in runs)
        return
    taken, rest = picked
    assert len(taken) == need and (torch.diff(taken) == 1).all()
    assert sorted(taken.tolist() + rest.tolist()) == free.tolist()
    assert rest.tolist() == sorted(rest.tolist())
    # best fit: the run it came from is the shortest that holds ``need``
    source = next(len(g) for g in np.split(free.numpy(), np.where(np.diff(free.numpy()) != 1)[0] + 1)
                  if taken[0].item() in g)
    assert source == min(n for n in runs if n >= need)


class Decode:
    """A decode worker's allocator and request pool, fragmented as decoding leaves them."""

    def __init__(self):
        self.kv = TokenToKVPoolAllocator(size=POOL_TOKENS, dtype=torch.int64, device="cpu", kvcache=None, need_sort=True)
        self.req_pool = ReqToTokenPool(size=8, max_context_len=POOL_TOKENS, device="cpu", enable_memory_saver=False)
        queue = DecodePreallocQueue.__new__(DecodePreallocQueue)  # SGLang's method; only what it reads
        queue.token_to_kv_pool_allocator, queue.req_to_token_pool = self.kv, self.req_pool
        queue.token_to_kv_pool = self.kv.get_kvcache()  # as its __init__ sets it
        queue.scheduler = SimpleNamespace(server_args=SimpleNamespace(disaggregation_decode_enable_radix_cache=False),
                                          enable_hisparse=False, enable_decode_hicache=False)
        if hasattr(BasePrefixCache, "maybe_hand_to_session"):
            # 0.5.23: the pre-allocation hands a streaming session's row to the tree (a decode worker's
            # UnifiedRadixCache, disabled without --disaggregation-decode-enable-radix-cache); only what it reads
            from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
            from sglang.srt.session.streaming_session import StreamingSession

            queue.tree_cache = UnifiedRadixCache.__new__(UnifiedRadixCache)
            queue.tree_cache.session = StreamingSession(queue.tree_cache)
        self.queue = queue

    @staticmethod
    def config():
        """The process's config as the pre-allocation reads it: 0.5.23 reads the published config
        (``get_disagg()``; published here for the call, then restored), 0.5.15 the scheduler's
        ``server_args`` (set above)."""
        if not hasattr(sglang_decode, "get_disagg"):
            return contextlib.nullcontext()
        from sglang.srt.runtime_context import get_context

        return get_context().override_server_args(disaggregation_decode_enable_radix_cache=False)

    def fragment(self, block: int = 64) -> torch.Tensor:
        """Two requests decode side by side (each step's slots taken for the batch at once, so they
        interleave) until the untouched part of the pool is gone, a third request's ``block``-slot
        prompt taken half way; the second and third finish. Returns the survivor's slots. SGLang's
        sorted free list then starts with single holes; the finished prompt is the one long run."""
        a, b, c = [], [], None
        while len(self.kv.free_pages) >= 2:
            if c is None and block and len(self.kv.free_pages) <= POOL_TOKENS // 2:
                c = self.kv.alloc(block)
            step = self.kv.alloc(2)
            a.append(step[0:1])
            b.append(step[1:2])
        self.kv.free(torch.cat(b + ([c] if c is not None else [])))  # to SGLang's release list
        return torch.cat(a)

    def pre_alloc(self, n: int, hooked: bool) -> torch.Tensor:
        self.req = self._req(n)
        with self.config():
            if hooked:
                return contiguous_prealloc(DecodePreallocQueue._pre_alloc, self.queue, self.req)
            return DecodePreallocQueue._pre_alloc(self.queue, self.req)

    def req_pool_idx(self) -> int:
        """The request's row in the request pool (0.5.23 keeps it in ``req.kv``)."""
        return (self.req.kv if hasattr(self.req, "kv") else self.req).req_pool_idx

    @staticmethod
    def _req(n: int):
        from sglang.srt.managers.schedule_batch import Req
        from sglang.srt.sampling.sampling_params import SamplingParams

        return Req(rid=f"r{n}", origin_input_text="", origin_input_ids=array("q", range(n)),
                   sampling_params=SamplingParams(max_new_tokens=4))


def _requests_per_layer(dst: torch.Tensor) -> int:
    """How many requests SGLang's sender makes per layer for ``dst`` from a contiguous source."""
    src = np.arange(1000, 1000 + len(dst), dtype=np.int64)
    return len(group_concurrent_contiguous(src, dst.numpy().astype(np.int64))[0])


@pytest.mark.parametrize("hooked", [False, True])
def test_a_prompt_after_interleaved_decodes_is_one_request_per_layer_with_the_hook(monkeypatch, hooked):
    monkeypatch.setenv("PRFAAS_DECODE_CONTIGUOUS_KV", "1")
    decode = Decode()
    survivor = decode.fragment()
    free_before = decode.kv.available_size()
    loc = decode.pre_alloc(40, hooked)
    assert len(loc) == 40 and decode.kv.available_size() == free_before - 40
    assert not set(loc.tolist()) & set(survivor.tolist())  # never a slot still in use
    free_now = set(decode.kv.free_pages.tolist()) | set(decode.kv.release_pages.tolist())
    assert not set(loc.tolist()) & free_now  # and no longer free
    assert decode.req_pool.req_to_token[decode.req_pool_idx(), :40].tolist() == loc.tolist()  # SGLang wrote what we returned
    assert "alloc" not in vars(decode.kv)  # the override is gone: later allocs are SGLang's own
    # unhooked: the holes between the survivor's slots, one request each; hooked: the finished prompt's run
    assert _requests_per_layer(loc) == (1 if hooked else 40)
    if hooked:
        assert loc.tolist() == list(range(loc[0].item(), loc[0].item() + 40))


def test_without_a_long_enough_run_sglangs_choice_stands(monkeypatch):
    monkeypatch.setenv("PRFAAS_DECODE_CONTIGUOUS_KV", "1")
    decode = Decode()
    decode.fragment(block=0)  # every free slot is a single hole: no run of 2
    loc = decode.pre_alloc(30, hooked=True)
    assert len(loc) == 30 and _requests_per_layer(loc) == 30 and "alloc" not in vars(decode.kv)


def test_off_or_another_allocator_runs_sglang_unchanged(monkeypatch):
    decode = Decode()
    decode.fragment()
    monkeypatch.setenv("PRFAAS_DECODE_CONTIGUOUS_KV", "0")
    assert _requests_per_layer(decode.pre_alloc(20, hooked=True)) == 20
    monkeypatch.setenv("PRFAAS_DECODE_CONTIGUOUS_KV", "1")
    decode.kv.need_sort = False  # not the disaggregation allocator: its free list is not kept sorted
    assert _requests_per_layer(decode.pre_alloc(20, hooked=True)) == 20
