"""``prfaas-hybrid`` on SGLang 0.5.23's unified radix tree (``hooks/unified_cache.py``), on CPU.

SGLang's real ``HybridReqToTokenPool``, ``HybridLinearKVPool`` and token allocators, its
``UnifiedRadixCache`` on its Python tree core with our ``StateEventsMambaComponent`` in the Mamba
component's place (as the registered backend builds it, ``bench/sglang_cpu.cpu_unified_hybrid_cache``),
SGLang's own selection chain, ``Req`` and its release path. The replay and the wire to the kv-index are
those of the 0.5.15 caches' tests (``state_events_support.py``).
"""

from __future__ import annotations

import dataclasses
from array import array
from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, given, settings

from prfaas_sglang._compat import RADIX_TREES, installed_has
from prfaas_sglang.wire.kv_events import StateRemoved, StateStored

torch = pytest.importorskip("torch")
sglang_kv_events = pytest.importorskip("sglang.srt.disaggregation.kv_events")
if installed_has(RADIX_TREES):
    pytest.skip("SGLang 0.5.23's unified tree, which this release does not have; its per-kind caches are "
                "tested in test_state_events.py", allow_module_level=True)

from sglang.srt.mem_cache.base_prefix_cache import EvictParams  # noqa: E402
from state_events_support import OPS, CacheOps, Wire, both_decoders, index_for, replay_and_compare  # noqa: E402

from prfaas_sglang.hooks import cache_backend, unified_cache  # noqa: E402

MAMBA_SLOTS = 6
KV_TOKENS = 96


class RealCache(CacheOps):
    """SGLang 0.5.23's real hybrid pools and its unified tree as ``prfaas-hybrid`` builds it."""

    key_of = staticmethod(lambda tokens: array("q", tokens))  # as a ``Req`` keys the tree

    def __init__(self, page_size: int, events: bool = True, admission=None, chunk_checkpoints: bool = True):
        from prfaas_sglang.bench.sglang_cpu import cpu_unified_hybrid_cache

        super().__init__(cpu_unified_hybrid_cache(page_size, KV_TOKENS, MAMBA_SLOTS, events, admission,
                                                  chunk_checkpoints))


def test_an_evicted_state_stops_the_hit_in_the_index_as_in_the_cache():
    """SGLang's tree evicts a state whose pages stay (an inner node's: a tombstone) without a word in
    its own events; ours says so, and the index stops the prefix where the cache does."""
    real, index = RealCache(page_size=1), index_for(1)
    wire = Wire(index)
    real.insert([1, 2, 3, 4])
    wire.flush(real.cache)
    real.insert([1, 2, 3, 4, 5, 6])  # the state at 4 is now on an inner node
    real.insert([1, 2, 3, 4, 7, 8])  # a second branch: the inner node is no leaf's only ancestor
    wire.flush(real.cache)
    assert index.match([1, 2, 3, 4, 9, 0]).by_worker["w"] == real.match([1, 2, 3, 4, 9]) == 4
    removed: list = []
    while not any(e.num_tokens == 4 for e in removed):  # SGLang's LRU order: leaves' states, then the inner one
        assert real.cache.evict(EvictParams(num_tokens=0, mamba_num=1)).mamba_num_evicted == 1
        events = real.cache.take_events()
        removed += events.state_events
        wire.publish(events)
    assert all(isinstance(e, StateRemoved) and e.component_type == "mamba" for e in removed)
    assert real.match([1, 2, 3, 4, 9]) == index.match([1, 2, 3, 4, 9, 0]).by_worker["w"] == 0
    assert real.match([1, 2, 3, 4]) == 0  # the pages are still in the tree, the prefix is not resumable
    for key in ([1, 2, 3, 4, 5, 6, 0], [1, 2, 3, 4, 7, 8, 0]):
        assert real.match(key[:-1]) == index.match(key).by_worker["w"]


@pytest.mark.slow
@pytest.mark.parametrize("page_size", [1, 4])
@settings(max_examples=600, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS)
def test_the_index_hit_equals_the_unified_trees_match_prefix(page_size, ops):
    """Randomized insert / evict / match sequences on SGLang's unified tree: after every operation, for
    every prefix inserted so far and the operation's own key, the kv-index fed only the published
    batches predicts exactly the length ``UnifiedRadixCache.match_prefix`` returns."""
    replay_and_compare(RealCache(page_size), index_for(page_size), ops, page_size,
                       lambda n: EvictParams(num_tokens=0, mamba_num=n))


def test_sglangs_own_decoder_reads_a_v2_batch_and_skips_the_state():
    real = RealCache(page_size=1)
    real.insert([5, 6, 7])
    theirs, ours = both_decoders(real.cache)
    assert [type(e).__name__ for e in theirs.events] == ["AllBlocksCleared", "BlockStored"]
    assert theirs.events[1].block_hashes == ours.events[1].block_hashes
    assert ours.state_events == [StateStored(ours.events[-1].block_hashes[-1], 3, "mamba", "GPU")]


def test_without_kv_events_nothing_is_recorded():
    real = RealCache(page_size=1, events=False)
    real.insert([1, 2, 3])
    real.cache.evict(EvictParams(num_tokens=0, mamba_num=1))
    events = real.cache.take_events()
    assert not events and events.state_events == []


def build_context(params, **kw):
    """SGLang's ``TreeCacheBuildContext`` for a hybrid-SSM model over ``params`` (``kw`` overrides)."""
    from sglang.srt.mem_cache.registry import TreeCacheBuildContext

    base = dict(server_args=SimpleNamespace(), params=params, is_hybrid_swa=False, is_hybrid_ssm=True,
                enable_hierarchical_cache=False, disable_radix_cache=False, tp_worker=None, model_config=None,
                tp_size=1, tp_rank=0, tp_group=None)
    return TreeCacheBuildContext(**{**base, **kw})


def test_the_registered_factory_builds_ours_where_sglang_builds_its_unified_tree(monkeypatch):
    """``prfaas-hybrid`` = SGLang's default chain with our tree (and, for a hybrid-SSM model, our Mamba
    component) where the chain builds a working ``UnifiedRadixCache``; ``builds_unified`` predicts the
    chain (drift check). With ``auto`` admission the policy gets the pools' real capacity."""
    from sglang.srt.mem_cache.registry import default_radix_cache_factory
    from sglang.srt.mem_cache.unified_cache.components import ComponentType
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    real = RealCache(page_size=1)
    for kw in ({}, {"disable_radix_cache": True}):
        disable = kw.get("disable_radix_cache", False)  # SGLang's params say what its context says
        params = dataclasses.replace(real.params, disable=disable)  # each build sets its components on its params
        default = default_radix_cache_factory(build_context(dataclasses.replace(real.params, disable=disable), **kw))
        builds = type(default) is UnifiedRadixCache and not default.disable
        assert unified_cache.builds_unified(build_context(params, **kw)) == builds, kw
        ours = cache_backend.build_tree_cache(build_context(params, **kw))
        if builds:
            assert type(ours) is unified_cache.PrfaasUnifiedRadixCache and ours.admission is None
            assert type(ours.components[ComponentType.MAMBA]) is unified_cache.StateEventsMambaComponent
            assert type(ours.tree_core).__name__ == "UnifiedTreeCore"  # SGLang's Python core runs our component
        else:
            assert type(ours) is type(default)
    monkeypatch.setenv("PRFAAS_PREFILL_CACHE", "auto")
    ours = cache_backend.build_tree_cache(build_context(dataclasses.replace(real.params)))
    assert ours.admission.mode == "auto"
    assert ours.admission.capacity_tokens == real.kv.size == KV_TOKENS
    assert ours.admission.capacity_states == real.req_pool.mamba_pool.size == MAMBA_SLOTS


class Flow:
    """Real ``Req`` objects through SGLang 0.5.23's own cache calls, as its PD prefill makes them:
    ``init_next_round_input`` (the match, where our admission decides), the request pool's ``alloc``,
    ``checkpoint_kv_cache`` after each chunk but the last, ``release_kv_cache`` once the KV transfer is
    done. Pools: ``KV_TOKENS`` of KV, ``MAMBA_SLOTS`` states, page 1."""

    def __init__(self, mode: str | None, chunk_checkpoints: bool = True, min_shared_tokens: int = 8):
        from prfaas_sglang.kvindex.admission import PrefixAdmission

        admission = None if mode is None else PrefixAdmission(mode, min_shared_tokens, capacity_tokens=KV_TOKENS)
        self.real = RealCache(page_size=1, admission=admission, chunk_checkpoints=chunk_checkpoints)

    def prefill(self, rid: str, ids: list[int], chunk_tokens: int = 16):
        """Prefill ``ids`` in chunks, then release the request (its transfer done). Returns the request,
        with ``matched``: the prefix its match reused."""
        from sglang.srt.managers.schedule_batch import FINISH_LENGTH, Req
        from sglang.srt.mem_cache.common import checkpoint_kv_cache, release_kv_cache
        from sglang.srt.sampling.sampling_params import SamplingParams

        cache, kv, pool = self.real.cache, self.real.kv, self.real.req_pool
        req = Req(rid=rid, origin_input_text="", origin_input_ids=array("q", ids),
                  sampling_params=SamplingParams(max_new_tokens=1))
        req.init_next_round_input(cache)
        assert pool.alloc([req]) is not None
        done = req.matched = req.prefix_len
        while done < len(ids):
            end = min(done + chunk_tokens, len(ids))
            pool.write((req.kv.req_pool_idx, slice(done, end)), kv.alloc(end - done))
            req.kv.kv_committed_len = req.kv.kv_allocated_len = req.extend_end = done = end
            if end < len(ids):
                checkpoint_kv_cache(req, cache)
        req.finished_reason = FINISH_LENGTH(length=0)
        release_kv_cache(req, cache, checkpoint=True)
        return req

    def check_pools(self) -> None:
        """Every KV slot and state slot is free or in the tree (no request in flight)."""
        tree_tokens, tree_states = self.real.cache.total_size()
        assert self.real.kv.available_size() + tree_tokens == KV_TOKENS
        assert self.real.req_pool.mamba_allocator.available_size() + tree_states == MAMBA_SLOTS


PROMPT = list(range(1, 41))


@pytest.mark.parametrize("mode", ["none", "shared", "auto"])
def test_a_one_off_prefill_is_transfer_cache_and_leaves_the_tree_empty(mode):
    """A prompt never seen is decided transfer cache at its match (``auto``: a cache that has seen
    little keeps one-offs, so ``auto`` keeps it): SGLang keeps none of its chunks and frees its KV and
    state when it releases the request; the tree publishes nothing."""
    flow = Flow(mode)
    req = flow.prefill("a", PROMPT)
    events = flow.real.cache.take_events()
    flow.check_pools()
    kept = mode == "auto"
    assert req.skip_radix_cache_insert is not kept
    assert flow.real.cache.total_size() == ((40, 3) if kept else (0, 0))  # kept: a state per chunk end (16, 32, 40)
    assert any(type(e).__name__ == "BlockStored" for e in events) is kept
    assert len(events.state_events) == (3 if kept else 0)
    assert (flow.real.match(PROMPT + [0]) == 40) is kept


def test_a_prefix_seen_twice_is_kept_and_then_reused():
    """The second sighting is kept (states at its chunk ends: 16, 32, 48); the third shares 40 tokens
    with it and reuses up to the deepest state within them, 32, which the index predicts from the
    published batches."""
    flow, index = Flow("shared"), index_for(1)
    wire = Wire(index)
    flow.prefill("a", PROMPT)
    assert flow.prefill("b", PROMPT + [99] * 8).matched == 0  # kept, nothing to reuse yet
    wire.flush(flow.real.cache)
    flow.check_pools()
    third = PROMPT + [98] * 8
    assert index.match(third).by_worker["w"] == flow.prefill("c", third).matched == 32
    flow.check_pools()


def test_checkpoints_at_the_request_end_only():
    """``PRFAAS_STATE_CHECKPOINTS=end``: a kept prefill leaves one state, at its end, none per chunk."""
    flow = Flow("all", chunk_checkpoints=False)
    flow.prefill("a", PROMPT)
    flow.check_pools()
    assert flow.real.cache.total_size() == (40, 1)
    assert flow.real.match(PROMPT) == 40 and flow.real.match(PROMPT[:32]) == 0
