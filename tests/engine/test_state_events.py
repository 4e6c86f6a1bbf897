"""State-aware KV events from SGLang 0.5.15's own hybrid caches (``hooks/hybrid_cache.py``), on CPU.

SGLang's real ``HybridReqToTokenPool``, ``TokenToKVPoolAllocator`` and ``MambaRadixCache``
(our subclass through the registered ``prfaas-hybrid`` backend), SGLang's scheduler-side
``SchedulerKvEventsPublisher`` and ``EventPublisherFactory`` with the registered
``prfaas-zmq`` publisher, and SGLang's own batch decoder. CPU workarounds as in
``../shared/notes/sglang-0.5.15-internals.md`` section 4: ``device="cpu"``, the mamba chunk size
set on the global server args, ``no_buffer`` (page 1) or ``extra_buffer`` (page 4). These are the
per-kind caches of a release that has them (marker ``_compat.RADIX_TREES``); on the unified tree
(0.5.23) the port's tests are ``test_unified_cache.py``, on the same replay (``state_events_support.py``).
"""

from __future__ import annotations

import time
from array import array
from types import SimpleNamespace

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prfaas_sglang._compat import RADIX_TREES, installed_has
from prfaas_sglang.kvindex.feed import kv_event_handler
from prfaas_sglang.kvindex.index import KvIndex
from prfaas_sglang.wire.kv_events import StateRemoved, StateStored, decode_batch

torch = pytest.importorskip("torch")
sglang_kv_events = pytest.importorskip("sglang.srt.disaggregation.kv_events")
if not installed_has(RADIX_TREES):
    pytest.skip("SGLang 0.5.15's per-kind caches, which this release does not have; its unified tree's "
                "port is tested in test_unified_cache.py", allow_module_level=True)

from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams  # noqa: E402
from sglang.srt.mem_cache.radix_cache import RadixKey  # noqa: E402
from state_events_support import OPS, CacheOps, Wire, both_decoders, index_for, replay_and_compare  # noqa: E402

from prfaas_sglang.hooks import cache_backend, event_publisher, hybrid_cache  # noqa: E402

MAMBA_SLOTS = 6
KV_TOKENS = 96
FLOW_SWA_TOKENS, FLOW_WINDOW_TOKENS = 56, 8  # Flows("swa"): two 40-token prompts in flight need 80 without window freeing


class RealCache(CacheOps):
    """SGLang 0.5.15's real hybrid pool and our state-reporting MambaRadixCache over it."""

    def __init__(self, page_size: int, events: bool = True):
        from prfaas_sglang.bench.sglang_cpu import cpu_hybrid_cache

        super().__init__(cpu_hybrid_cache(hybrid_cache.StateEventsMambaRadixCache, page_size, KV_TOKENS, MAMBA_SLOTS,
                                          events))


class ServedCache(RealCache):
    """The same, keyed as a server keys a request (``array("q")``): a cache move's export and import
    match against what a server inserted, and the tree asserts both keys have one type."""

    key_of = staticmethod(lambda tokens: array("q", tokens))


def test_a_tombstoned_state_stops_the_hit_in_the_index_as_in_the_cache():
    """The case SGLang's own events get wrong: evicting a state keeps its pages (a tombstone), so
    the prefix stops matching while every BlockStored stays advertised."""
    real, index = RealCache(page_size=1), index_for(1)
    wire = Wire(index)
    real.insert([1, 2, 3, 4])
    wire.flush(real.cache)  # one batch per scheduler step: one request finished in each
    real.insert([1, 2, 3, 4, 5, 6])  # the state at 4 is now on an inner node
    wire.flush(real.cache)
    assert index.match([1, 2, 3, 4, 9, 0]).by_worker["w"] == 4  # (no match on the cache: it would reorder its LRU)
    real.cache.evict(EvictParams(num_tokens=0, mamba_num=1))  # LRU: the inner node's state -> tombstone
    events = real.cache.take_events()
    assert list(events) == [] and events.state_events == [StateRemoved(events.state_events[0].block_hash, 4, "mamba", "GPU")]
    wire.publish(events)
    assert real.match([1, 2, 3, 4, 9]) == index.match([1, 2, 3, 4, 9, 0]).by_worker["w"] == 0
    assert real.match([1, 2, 3, 4, 5, 6, 7]) == index.match([1, 2, 3, 4, 5, 6, 7, 0]).by_worker["w"] == 6
    # The same stream without state events (SGLang's own publisher): the index can only infer and overstates.
    inferred = index_for(1)
    for seq, payload in enumerate(wire.batches):
        plain = sglang_kv_events.KVEventBatch(ts=0.0, events=decode_batch(payload).events)
        kv_event_handler(inferred, "w")([b"kv-events", seq.to_bytes(8, "big"), msgspec.msgpack.encode(plain)])
    assert inferred.match([1, 2, 3, 4, 9, 0]).by_worker["w"] == 4


@pytest.mark.slow
@pytest.mark.parametrize("page_size", [1, 4])
@settings(max_examples=1500, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS)
def test_the_index_hit_equals_the_real_caches_match_prefix(page_size, ops):
    """Randomized insert / evict / match sequences on the real cache: after every operation, for
    every prefix inserted so far and the operation's own key, the kv-index fed only the published
    batches predicts exactly the length ``MambaRadixCache.match_prefix`` returns."""
    replay_and_compare(RealCache(page_size), index_for(page_size), ops, page_size,
                       lambda n: EvictParams(num_tokens=0, mamba_num=n))


def test_sglangs_own_decoder_reads_a_v2_batch_and_skips_the_state():
    real = RealCache(page_size=1)
    real.insert([5, 6, 7])
    theirs, ours = both_decoders(real.cache)
    assert [type(e).__name__ for e in theirs.events] == ["AllBlocksCleared"] + ["BlockStored"] * 3
    assert [e.block_hashes for e in theirs.events[1:]] == [e.block_hashes for e in ours.events[1:]]
    assert ours.state_events == [StateStored(ours.events[-1].block_hashes[0], 3, "mamba", "GPU")]


def test_without_kv_events_nothing_is_recorded():
    real = RealCache(page_size=1, events=False)
    real.insert([1, 2, 3])
    real.cache.evict(EvictParams(num_tokens=0, mamba_num=1))
    events = real.cache.take_events()
    assert not events and events.state_events == []


def test_the_registered_factory_builds_ours_where_sglang_builds_a_mamba_radix_cache(monkeypatch):
    """``prfaas-hybrid`` = SGLang's default chain with our subclass in MambaRadixCache's place, and
    ``default_builds_mamba_radix_cache`` predicts the default chain (drift check). With ``auto``
    admission the policy gets the pools' real capacity: KV tokens and state slots."""
    from sglang.srt.mem_cache.mamba_radix_cache import MambaRadixCache
    from sglang.srt.mem_cache.registry import default_radix_cache_factory

    real = RealCache(page_size=1)

    def ctx(**kw):
        base = dict(server_args=SimpleNamespace(enable_lmcache=False, disaggregation_mode="prefill"), params=real.params,
                    is_hybrid_swa=False, is_hybrid_ssm=True, enable_hierarchical_cache=False, disable_radix_cache=False,
                    effective_chunked_prefill_size=None, tp_worker=None, model_config=None, tp_size=1, tp_rank=0,
                    tp_group=None)
        return SimpleNamespace(**{**base, **kw})

    for kw in ({}, {"is_hybrid_ssm": False}, {"disable_radix_cache": True, "effective_chunked_prefill_size": 64}):
        c = ctx(**kw)
        default = default_radix_cache_factory(c)
        assert hybrid_cache.default_builds_mamba_radix_cache(c) == (type(default) is MambaRadixCache), kw
        ours = cache_backend.build_tree_cache(c)
        if type(default) is MambaRadixCache:
            assert type(ours) is hybrid_cache.StateEventsMambaRadixCache
        else:
            assert type(ours) is type(default)
    monkeypatch.setenv("PRFAAS_PREFILL_CACHE", "auto")
    ours = cache_backend.build_tree_cache(ctx())
    assert ours.admission.mode == "auto"
    assert ours.admission.capacity_tokens == real.kv.size == KV_TOKENS
    assert ours.admission.capacity_states == real.req_pool.mamba_pool.size == MAMBA_SLOTS


def test_scheduler_publisher_over_zmq_to_the_kv_index():
    """End to end on SGLang's classes: the scheduler's SchedulerKvEventsPublisher takes the cache's
    events, EventPublisherFactory builds the registered ``prfaas-zmq`` publisher from a
    ``--kv-events-config`` string, and our subscriber's kv-index gets the state over ZMQ."""
    import json

    import zmq
    from sglang.srt.managers.scheduler_components.kv_events_publisher import (
        SchedulerKvEventsPublisher,
    )

    from prfaas_sglang.demo.cluster import PortPicker

    cache_backend.register_backends()
    port = PortPicker()()
    config = json.dumps({"publisher": cache_backend.EVENT_PUBLISHER, "endpoint": f"tcp://*:{port}", "topic": "kv-events"})
    real = RealCache(page_size=1)
    ps = SimpleNamespace(pp_rank=0, attn_tp_rank=0, attn_cp_rank=0, attn_dp_size=1, attn_dp_rank=0, dp_rank=None)
    publisher = SchedulerKvEventsPublisher(
        kv_events_config=config, ps=ps, attn_tp_rank=0, attn_cp_rank=0, attn_dp_rank=0, dp_rank=None,
        tree_cache=real.cache, send_metrics_from_scheduler=None, max_running_requests=4, max_total_num_tokens=KV_TOKENS,
        get_stats=lambda: None)
    assert type(publisher.kv_event_publisher) is event_publisher.StateEventsZmqPublisher
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv-events")
    sub.connect(f"tcp://127.0.0.1:{port}")
    index = index_for(1)
    handle = kv_event_handler(index, "w")
    try:
        deadline = time.monotonic() + 10
        while True:  # PUB/SUB joins asynchronously: publish until a batch arrives
            real.insert([int(time.monotonic() * 1e6) % 1000 + 10, 2])
            publisher.publish_kv_events()
            if sub.poll(200):
                break
            assert time.monotonic() < deadline, "no batch arrived"
        while sub.poll(200):
            handle(sub.recv_multipart())
        real.cache.evict(EvictParams(num_tokens=KV_TOKENS, mamba_num=MAMBA_SLOTS))  # the warm-up's keys go
        real.insert([7, 8, 9])
        real.insert([7, 8, 9, 10])
        real.cache.evict(EvictParams(num_tokens=0, mamba_num=1))  # tombstones [7, 8, 9]: a state-only batch
        publisher.publish_kv_events()
        while sub.poll(1000):
            handle(sub.recv_multipart())
        assert real.match([7, 8, 9, 11]) == index.match([7, 8, 9, 11, 0]).by_worker["w"] == 0
        assert real.match([7, 8, 9, 10, 11]) == index.match([7, 8, 9, 10, 11, 0]).by_worker["w"] == 4
        assert index.export()["w"].reports_state
    finally:
        sub.close(linger=0)
        publisher.kv_event_publisher.shutdown()


def test_the_registered_factory_puts_admission_where_sglang_builds_a_plain_radix_cache(monkeypatch):
    """A full-attention model on a PrfaaS worker: with ``PRFAAS_PREFILL_CACHE`` set, ``prfaas-hybrid``
    builds ``AdmissionRadixCache`` where SGLang's chain builds a ``RadixCache``; unset, SGLang's own.
    ``default_builds_radix_cache`` predicts the chain (drift check)."""
    from sglang.srt.mem_cache.radix_cache import RadixCache
    from sglang.srt.mem_cache.registry import default_radix_cache_factory

    from prfaas_sglang.bench.sglang_cpu import cpu_radix_cache

    built = cpu_radix_cache(RadixCache, 1, KV_TOKENS)

    def ctx(**kw):
        base = dict(server_args=SimpleNamespace(enable_lmcache=False), params=built.params, is_hybrid_swa=False,
                    is_hybrid_ssm=False, enable_hierarchical_cache=False, disable_radix_cache=False,
                    effective_chunked_prefill_size=None, tp_worker=None, model_config=None, tp_size=1, tp_rank=0,
                    tp_group=None)
        return SimpleNamespace(**{**base, **kw})

    for env in (None, "shared", "auto"):
        if env is None:
            monkeypatch.delenv("PRFAAS_PREFILL_CACHE", raising=False)
        else:
            monkeypatch.setenv("PRFAAS_PREFILL_CACHE", env)
        for kw in ({}, {"disable_radix_cache": True, "effective_chunked_prefill_size": 64}):
            c = ctx(**kw)
            default = default_radix_cache_factory(c)
            assert hybrid_cache.default_builds_radix_cache(c) == (type(default) is RadixCache), kw
            ours = cache_backend.build_tree_cache(c)
            if type(default) is RadixCache and env is not None:
                assert type(ours) is hybrid_cache.AdmissionRadixCache and ours.admission.mode == env
                # the token pool bounds a full-attention tree; no state slots
                assert (ours.admission.capacity_tokens, ours.admission.capacity_states) == (KV_TOKENS, None)
            else:
                assert type(ours) is type(default)
    for kw in ({"is_hybrid_ssm": True}, {"server_args": SimpleNamespace(enable_lmcache=True)},
               {"enable_hierarchical_cache": True}):
        assert not hybrid_cache.default_builds_radix_cache(ctx(**kw)), kw  # other branches of the chain
    monkeypatch.setenv("PRFAAS_PREFILL_CACHE", "sometimes")
    with pytest.raises(ValueError, match="all, shared, auto, none"):
        cache_backend.build_tree_cache(ctx())


# --- prefix cache vs transfer cache (kvindex/admission.py) on SGLang's own request flows -------------


class Flows:
    """Real ``Req`` objects through the scheduler's cache calls: ``init_next_round_input`` (the
    match), pool allocation, chunked prefill with ``maybe_cache_unfinished_req``, and
    ``release_kv_cache`` once the KV transfer is done (what SGLang's PD prefill does)."""

    def __init__(self, mode: str | None, min_shared_tokens: int = 8, chunk_checkpoints: bool = True,
                 kind: str = "mamba"):
        """``kind``: ``mamba`` (a hybrid model's StateEventsMambaRadixCache), ``radix`` (a
        full-attention model's AdmissionRadixCache over SGLang's plain pools) or ``swa`` (a
        sliding-window model's StateEventsSWARadixCache over SGLang's SWA pools: FLOW_SWA_TOKENS of
        window KV, less than two prompts in flight need unless out-of-window KV is freed)."""
        from prfaas_sglang.bench.sglang_cpu import cpu_radix_cache, cpu_swa_cache
        from prfaas_sglang.kvindex.admission import PrefixAdmission

        admission = None if mode is None else PrefixAdmission(mode, min_shared_tokens, capacity_tokens=KV_TOKENS)
        self.kind = kind
        if kind == "mamba":
            self.real = RealCache(page_size=1)
            self.real.cache.admission = admission
            self.real.cache.chunk_checkpoints = chunk_checkpoints
        elif kind == "swa":
            self.real = cpu_swa_cache(lambda params: hybrid_cache.StateEventsSWARadixCache(params, admission), 1,
                                      KV_TOKENS, FLOW_SWA_TOKENS, FLOW_WINDOW_TOKENS)
        else:
            self.real = cpu_radix_cache(lambda params: hybrid_cache.AdmissionRadixCache(params, admission), 1, KV_TOKENS)
        self.in_flight: list = []

    def tree_tokens(self) -> int:
        size = self.real.cache.total_size()
        return size if self.kind == "radix" else size[0]

    def free_tokens(self) -> int:
        """Free full-attention KV slots."""
        kv = self.real.kv
        return kv.full_available_size() if self.kind == "swa" else kv.available_size()

    def check_accounting(self) -> None:
        """Every KV slot is free, in the tree, or held by a request beyond its cached prefix (for
        window KV: beyond its cached prefix and what it freed out of the window)."""
        kv = self.real.kv
        held = sum(req.done - req.cache_protected_len for req in self.in_flight)
        assert self.free_tokens() + self.tree_tokens() + held == KV_TOKENS
        if self.kind == "swa":
            held_swa = sum(req.done - max(req.cache_protected_len, req.swa_evicted_seqlen) for req in self.in_flight)
            assert kv.swa_available_size() + self.real.cache.total_size()[1] + held_swa == FLOW_SWA_TOKENS
        if self.kind == "mamba":
            mamba = self.real.req_pool.mamba_allocator
            assert mamba.available_size() + self.real.cache.total_size()[1] + len(self.in_flight) == MAMBA_SLOTS

    def start(self, rid: str, ids: list[int]):
        from array import array

        from sglang.srt.managers.schedule_batch import Req
        from sglang.srt.sampling.sampling_params import SamplingParams

        req = Req(rid=rid, origin_input_text="", origin_input_ids=array("q", ids),
                  sampling_params=SamplingParams(max_new_tokens=1))
        req.init_next_round_input(self.real.cache)
        req.swa_uuid_for_lock = self.real.cache.inc_lock_ref(req.last_node).swa_uuid_for_lock  # as PrefillAdder does
        if self.kind == "mamba" and self.real.req_pool.mamba_allocator.available_size() == 0:
            self.real.cache.evict(EvictParams(num_tokens=0, mamba_num=1))
        self.real.req_pool.alloc([req])
        req.done = len(req.prefix_indices)
        self.real.req_pool.write((req.req_pool_idx, slice(0, req.done)), req.prefix_indices)
        self.in_flight.append(req)
        return req

    def chunk(self, req, size: int) -> bool:
        """Prefill the next ``size`` tokens; True when the prompt is done (the transfer may start)."""
        from sglang.srt.mem_cache.common import maybe_cache_unfinished_req

        end = min(req.done + size, len(req.origin_input_ids))
        kv, cache = self.real.kv, self.real.cache
        free = self.free_tokens()
        if free < end - req.done:
            cache.evict(EvictParams(num_tokens=end - req.done - free))
        if self.kind == "swa" and kv.swa_available_size() < end - req.done:
            cache.evict(EvictParams(num_tokens=0, swa_num_tokens=end - req.done - kv.swa_available_size()))
        loc = kv.alloc(end - req.done)
        assert loc is not None, "the test's pools are sized so that a prompt always fits"
        self.real.req_pool.write((req.req_pool_idx, slice(req.done, end)), loc)
        req.set_extend_range(req.done, end)
        req.kv_committed_len = req.kv_allocated_len = end
        req.done = end
        if end < len(req.origin_input_ids):
            maybe_cache_unfinished_req(req, cache, chunked=True)
            # What PrefillAdder.add_chunked_req takes as the next chunk's prefix: all computed so far.
            row = self.real.req_pool.req_to_token[req.req_pool_idx, :end]
            assert torch.equal(req.prefix_indices.to(row.dtype), row)
            return False
        return True

    def transferred(self, req) -> None:
        from sglang.srt.mem_cache.common import release_kv_cache

        release_kv_cache(req, self.real.cache)
        self.in_flight.remove(req)


@pytest.mark.parametrize("kind", ["mamba", "radix", "swa"])
def test_unique_long_prompts_are_transfer_cache_and_leave_the_tree_empty(kind):
    """The PrfaaS worker's bulk traffic: one-off long prompts. With ``shared`` nothing of them is
    inserted (neither chunks nor ends) and every page and state slot is back once sent; SGLang's
    behaviour (``all``) fills the tree with them. A hybrid model's cache, a full-attention one's and
    a sliding-window one's."""
    for mode, tree_after in (("shared", 0), ("none", 0), (None, 1), ("all", 1)):
        flows = Flows(mode, kind=kind)
        for n in range(6):
            req = flows.start(f"r{n}", [1000 * (n + 1) + i for i in range(40)])
            while not flows.chunk(req, 16):
                flows.check_accounting()
            flows.check_accounting()
            flows.transferred(req)
            flows.check_accounting()
        tokens = flows.tree_tokens()
        assert (tokens > 0) == bool(tree_after), (mode, tokens)
        if not tree_after:
            if kind == "swa":
                assert (flows.real.kv.full_available_size(), flows.real.kv.swa_available_size()) == (KV_TOKENS, FLOW_SWA_TOKENS)
            else:
                assert flows.real.kv.available_size() == KV_TOKENS
            assert kind == "radix" or flows.real.cache.total_size()[1] == 0
        if mode is not None:
            stats = flows.real.cache.admission.stats
            assert stats.kept_requests + stats.transfer_requests == 6


@pytest.mark.parametrize("kind", ["mamba", "radix", "swa"])
def test_a_prefix_seen_twice_is_kept_and_then_reused(kind):
    flows = Flows("shared", kind=kind)
    shared = list(range(500, 532))
    for rid, tail in (("first", [1, 2, 3]), ("second", [4, 5, 6]), ("third", [7, 8, 9])):
        req = flows.start(rid, shared + tail)
        while not flows.chunk(req, 16):
            pass
        flows.transferred(req)
        flows.check_accounting()
    stats = flows.real.cache.admission.stats
    assert stats.reasons == {"one-off": 1, "seen-prefix": 1, "reused-prefix": 1}
    # The second prefill's chunk checkpoints (16, 32) are in the tree: the third reused 32 tokens.
    from array import array

    key = RadixKey(array("q", shared + [0]))  # a Req's keys are arrays; the tree compares like with like
    assert len(flows.real.cache.match_prefix(MatchPrefixParams(key=key)).device_indices) == 32


def test_checkpoints_at_the_request_end_only():
    """PRFAAS_STATE_CHECKPOINTS=end: no state slot per chunk boundary; the finished prefill has
    one, at its end, and a prompt sharing only the first chunks reuses nothing (no state there)."""
    for chunk_checkpoints, states_after, shorter_hit in ((True, 3, 32), (False, 1, 0)):
        flows = Flows(None, chunk_checkpoints=chunk_checkpoints)
        ids = list(range(300, 340))
        req = flows.start("r", ids)
        during = []
        while not flows.chunk(req, 16):
            during.append(flows.real.cache.total_size()[1])
            flows.check_accounting()
        assert during == ([1, 2] if chunk_checkpoints else [0, 0])  # states in the tree after chunks 1 and 2
        flows.transferred(req)
        flows.check_accounting()
        assert flows.real.cache.total_size() == (40, states_after)
        from array import array

        key = RadixKey(array("q", ids[:36] + [1]))
        assert len(flows.real.cache.match_prefix(MatchPrefixParams(key=key)).device_indices) == shorter_hit
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PRFAAS_STATE_CHECKPOINTS", "end")
        assert hybrid_cache.chunk_checkpoints_from_env() is False
        mp.setenv("PRFAAS_STATE_CHECKPOINTS", "sometimes")
        with pytest.raises(ValueError, match="chunks, end"):
            hybrid_cache.chunk_checkpoints_from_env()


@settings(max_examples=150, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(mode=st.sampled_from(["shared", "auto", "none", "all"]), chunk_checkpoints=st.booleans(),
       kind=st.sampled_from(["mamba", "radix", "swa"]),
       prompts=st.lists(st.tuples(st.integers(0, 2), st.integers(1, 30), st.integers(4, 16)), min_size=1, max_size=8))
def test_accounting_holds_at_every_step_with_two_requests_in_flight(mode, chunk_checkpoints, kind, prompts):
    """free + tree + held = total (KV) and free + tree + requests = total (Mamba slots) after every
    chunk, insert and release, two prefills interleaved, under every mode and checkpoint placement,
    in a hybrid model's cache and a full-attention one's."""
    flows = Flows(mode, chunk_checkpoints=chunk_checkpoints, kind=kind)
    pending = []
    for n, (stem, tail, chunk) in enumerate(prompts):
        ids = [stem] * 10 + [100 + n] * tail  # three shared stems, unique tails
        pending.append((flows.start(f"r{n}", ids), chunk))
        flows.check_accounting()
        if len(pending) == 2 or n == len(prompts) - 1:
            while pending:
                for item in list(pending):
                    req, size = item
                    if flows.chunk(req, size):
                        flows.transferred(req)
                        pending.remove(item)
                    flows.check_accounting()
    assert flows.free_tokens() + flows.tree_tokens() == KV_TOKENS


# --- a prefix moved between clusters (hooks/cache_import.py, wire/prefix_transfer.py) -----------------


def _fill(real: RealCache, tokens: list[int], seed: int) -> None:
    """Give the cached prefix ``tokens`` distinct KV rows and state (what a forward pass writes)."""
    gen = torch.Generator().manual_seed(seed)
    match = real.cache.match_prefix(MatchPrefixParams(key=RadixKey(real.key_of(tokens))))
    for buf in (real.kv_pool.full_kv_pool.k_buffer + real.kv_pool.full_kv_pool.v_buffer):
        buf[match.device_indices] = torch.randn(buf[match.device_indices].shape, generator=gen).to(buf.dtype)
    slot = int(match.last_device_node.mamba_value[0])
    state = real.req_pool.mamba_pool.mamba_cache
    for buf in list(state.conv) + [state.temporal]:
        buf[:, slot] = torch.randn(buf[:, slot].shape, generator=gen).to(buf.dtype)


def _held(real: RealCache, tokens: list[int]) -> tuple[int, list[torch.Tensor]]:
    match = real.cache.match_prefix(MatchPrefixParams(key=RadixKey(real.key_of(tokens))))
    slot = int(match.last_device_node.mamba_value[0]) if len(match.device_indices) else None
    full, state = real.kv_pool.full_kv_pool, real.req_pool.mamba_pool.mamba_cache
    rows = [buf[match.device_indices].clone() for buf in full.k_buffer + full.v_buffer]
    states = [buf[:, slot].clone() for buf in list(state.conv) + [state.temporal]] if slot is not None else []
    return len(match.device_indices), rows + states


def test_an_imported_prefix_matches_with_the_sources_length_and_bytes():
    """A prefix cached only in the source cluster: exported (the longest prefix with a state), sent
    as bytes, imported into another worker's pools as prefix cache; there it is matched with the
    same usable length and its KV rows and state equal the source's, bit for bit. The destination
    announces it to a kv-index as any insert (pages, then the state)."""
    from prfaas_sglang.hooks.cache_import import export_prefix, import_prefix
    from prfaas_sglang.wire import prefix_transfer

    source, dest = ServedCache(page_size=1), ServedCache(page_size=1)
    prompt = list(range(40, 64))
    assert source.insert(prompt[:16]) and source.insert(prompt)  # states at 16 and 24
    _fill(source, prompt[:16], seed=1)
    _fill(source, prompt, seed=2)
    source.cache.take_events()
    query = prompt[:20] + [999, 998]  # diverges after 20 tokens: usable up to the state at 16
    message = prefix_transfer.encode(export_prefix(source.cache, query))
    transfer = prefix_transfer.decode(message)
    assert transfer.token_ids == prompt[:16] and transfer.nbytes() > 0

    index = index_for(1)
    dest.cache.take_events()
    assert import_prefix(dest.cache, transfer) == 16
    Wire(index).flush(dest.cache)
    assert index.match(query + [0]).by_worker["w"] == 16
    held_src, bytes_src = _held(source, prompt[:16] + [7])
    held_dst, bytes_dst = _held(dest, prompt[:16] + [7])
    assert held_src == held_dst == 16
    assert len(bytes_src) == len(bytes_dst) == 4  # k, v of the full-attention layer; conv, temporal state
    assert all(torch.equal(a, b) for a, b in zip(bytes_src, bytes_dst, strict=True))
    assert import_prefix(dest.cache, transfer) == 0  # already held: nothing allocated
    assert dest.kv.available_size() + dest.cache.total_size()[0] == KV_TOKENS


def test_an_import_that_does_not_fit_is_refused_and_allocates_nothing():
    from prfaas_sglang.hooks.cache_import import export_prefix, import_prefix
    from prfaas_sglang.wire import prefix_transfer
    from prfaas_sglang.wire.prefix_transfer import PrefixTransferError

    source, dest = ServedCache(page_size=1), ServedCache(page_size=1)
    source.insert([5, 6, 7, 8])
    transfer = export_prefix(source.cache, [5, 6, 7, 8, 9])
    assert export_prefix(source.cache, [1, 2, 3]) is None
    free = dest.kv.available_size(), dest.req_pool.mamba_allocator.available_size()
    broken = [
        msgspec.structs.replace(transfer, page_size=4),
        msgspec.structs.replace(transfer, kv=transfer.kv[:1]),
        msgspec.structs.replace(transfer, kv=[msgspec.structs.replace(transfer.kv[0], dtype="float32")] + transfer.kv[1:]),
        msgspec.structs.replace(transfer, state=[msgspec.structs.replace(transfer.state[0], data=b"x")] + transfer.state[1:]),
    ]
    for bad in broken:
        with pytest.raises(PrefixTransferError):
            import_prefix(dest.cache, bad)
    assert (dest.kv.available_size(), dest.req_pool.mamba_allocator.available_size()) == free
    for payload in (b"\x01", prefix_transfer.encode(msgspec.structs.replace(transfer, version=9)),
                    prefix_transfer.encode(msgspec.structs.replace(transfer, token_ids=[]))):
        with pytest.raises(PrefixTransferError):
            prefix_transfer.decode(payload)


# --- sliding-window (SWA) models: SGLang's SWARadixCache -------------------------------------

SWA_FULL_TOKENS, SWA_TOKENS = 160, 64


class RealSwaCache:
    """SGLang's real SWA pools (``SWAKVPool``, ``SWATokenToKVPoolAllocator``) on CPU and our
    ``StateEventsSWARadixCache`` over them; an insert may arrive with its first pages' window KV
    already freed (``swa_evicted_seqlen``: what a long decode does, ``free_swa_out_of_window_slots``)."""

    def __init__(self, page_size: int, window_tokens: int, events: bool = True):
        from prfaas_sglang.bench.sglang_cpu import cpu_swa_cache

        built = cpu_swa_cache(hybrid_cache.StateEventsSWARadixCache, page_size, SWA_FULL_TOKENS, SWA_TOKENS,
                              window_tokens, events)
        self.alloc, self.params, self.cache, self.page_size = built.kv, built.params, built.cache, page_size

    def _alloc(self, n: int):
        if self.page_size == 1:
            return self.alloc.alloc(n)
        full = self.alloc.full_attn_allocator.alloc(n)  # SWATokenToKVPoolAllocator.alloc is page-1 only
        swa = self.alloc.swa_attn_allocator.alloc(n) if full is not None else None
        if swa is None:
            if full is not None:
                self.alloc.full_attn_allocator.free(full)
            return None
        self.alloc.set_full_to_swa_mapping(full, swa)
        return full

    def insert(self, tokens: list[int], window_dropped_pages: int = 0) -> bool:
        n = len(tokens)
        if n == 0 or n % self.page_size:
            return False
        if self.alloc.full_available_size() < n:
            self.cache.evict(EvictParams(num_tokens=n - self.alloc.full_available_size()))
        if self.alloc.swa_available_size() < n:
            self.cache.evict(EvictParams(num_tokens=0, swa_num_tokens=n - self.alloc.swa_available_size()))
        value = self._alloc(n)
        if value is None:
            return False
        dropped = min(window_dropped_pages, n // self.page_size - 1) * self.page_size
        if dropped:
            self.alloc.free_swa(value[:dropped])
        self.cache.insert(InsertParams(key=RadixKey(list(tokens)), value=value, swa_evicted_seqlen=dropped))
        return True

    def match(self, tokens: list[int]) -> int:
        return len(self.cache.match_prefix(MatchPrefixParams(key=RadixKey(list(tokens)))).device_indices)


def swa_index_for(page_size: int) -> KvIndex:
    index = KvIndex(hybrid=False)  # a sliding-window model: no linear-attention state
    index.add_worker("w", "pd", block_size=page_size)
    return index


def test_a_dropped_window_stops_the_hit_in_the_index_as_in_the_cache():
    """SGLang's own events say nothing when a page's window KV is freed (the page stays, a
    tombstone), so the full-attention match overstates; the swa events make the index exact."""
    real, index = RealSwaCache(page_size=1, window_tokens=4), swa_index_for(1)
    wire = Wire(index)
    real.insert(list(range(1, 9)))
    real.insert(list(range(1, 7)) + [90, 91, 92, 93, 94])  # splits [1..8] at 6
    wire.flush(real.cache)
    real.cache.evict(EvictParams(num_tokens=0, swa_num_tokens=6))  # window KV of the LRU side first
    events = real.cache.take_events()
    assert any(isinstance(e, StateRemoved) and e.component_type == "swa" for e in events.state_events)
    wire.publish(events)
    for key in ([1, 2, 3], list(range(1, 7)) + [90], list(range(1, 7)) + [90, 91, 92, 93, 94]):
        assert index.match(key + [0]).by_worker["w"] == real.match(key), key
    assert real.match(list(range(1, 7)) + [90]) == 0 and index.block_count("w") >= 6  # pages held, hit 0
    # an insert whose first pages' window was freed during its decode: a tombstone, then live pages
    real.insert(list(range(200, 216)), window_dropped_pages=10)
    wire.flush(real.cache)
    for n in (5, 10, 13, 14, 16):
        key = list(range(200, 200 + n))
        assert index.match(key + [0]).by_worker["w"] == real.match(key), n
    assert real.match(list(range(200, 213))) == 0 and real.match(list(range(200, 214))) == 14


SWA_OPS = st.lists(
    st.one_of(
        st.tuples(st.just("insert"), st.lists(st.integers(0, 3), min_size=1, max_size=8), st.integers(0, 4)),
        st.tuples(st.just("evict_full"), st.integers(1, 12), st.just(0)),
        st.tuples(st.just("evict_state"), st.integers(1, 12), st.just(0)),
        st.tuples(st.just("match"), st.lists(st.integers(0, 3), min_size=1, max_size=8), st.just(0)),
    ),
    min_size=1, max_size=14,
)


@pytest.mark.slow
@pytest.mark.parametrize("page_size,window_tokens", [(1, 3), (4, 6), (4, 8)])
@settings(max_examples=700, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(ops=SWA_OPS)
def test_the_index_hit_equals_the_real_swa_caches_match_prefix(page_size, window_tokens, ops):
    """Randomized insert (some with their first pages' window KV already freed) / evict full /
    evict window / match sequences on the real SWARadixCache: after every operation, for every key
    inserted so far and the operation's own, the kv-index fed only the published batches predicts
    exactly the length ``SWARadixCache.match_prefix`` returns."""
    real = RealSwaCache(page_size, window_tokens)
    replay_and_compare(real, swa_index_for(page_size), [(op, arg, dropped) if op == "insert" else (op, arg)
                                                         for op, arg, dropped in ops], page_size,
                       lambda n: EvictParams(num_tokens=0, swa_num_tokens=n * page_size))
    real.cache.sanity_check()


def test_without_kv_events_the_swa_cache_records_nothing():
    real = RealSwaCache(page_size=1, window_tokens=4, events=False)
    real.insert(list(range(1, 9)), window_dropped_pages=2)
    real.cache.evict(EvictParams(num_tokens=0, swa_num_tokens=4))
    assert real.cache._touched == [] and real.cache._missing == {}


def test_the_registered_factory_builds_ours_where_sglang_builds_an_swa_radix_cache(monkeypatch):
    """``prfaas-hybrid`` puts the state-reporting SWA cache where SGLang's default chain builds an
    ``SWARadixCache``, and ``default_builds_swa_radix_cache`` predicts the chain (drift check); with
    ``PRFAAS_PREFILL_CACHE`` the admission policy, sized by the full-attention pool."""
    from sglang.srt.mem_cache.registry import default_radix_cache_factory
    from sglang.srt.mem_cache.swa_radix_cache import SWARadixCache

    real = RealSwaCache(page_size=1, window_tokens=4)

    def ctx(**kw):
        base = dict(server_args=SimpleNamespace(enable_lmcache=False), params=real.params, is_hybrid_swa=True,
                    is_hybrid_ssm=False, full_tokens_per_layer=SWA_FULL_TOKENS, enable_hierarchical_cache=False,
                    disable_radix_cache=False, effective_chunked_prefill_size=None, tp_worker=None, model_config=None,
                    tp_size=1, tp_rank=0, tp_group=None)
        return SimpleNamespace(**{**base, **kw})

    for kw in ({}, {"is_hybrid_ssm": True}, {"full_tokens_per_layer": 0},
               {"disable_radix_cache": True, "effective_chunked_prefill_size": 64}):
        c = ctx(**kw)
        default = default_radix_cache_factory(c)
        assert hybrid_cache.default_builds_swa_radix_cache(c) == (type(default) is SWARadixCache), kw
        assert not hybrid_cache.default_builds_mamba_radix_cache(c)  # SWA comes first in the chain
        ours = cache_backend.build_tree_cache(c)
        if type(default) is SWARadixCache:
            assert type(ours) is hybrid_cache.StateEventsSWARadixCache and ours.admission is None
        else:
            assert type(ours) is type(default)
    monkeypatch.setenv("PRFAAS_PREFILL_CACHE", "auto")
    ours = cache_backend.build_tree_cache(ctx())
    assert ours.admission.mode == "auto"
    assert (ours.admission.capacity_tokens, ours.admission.capacity_states) == (SWA_FULL_TOKENS, None)


def test_a_checkpoint_hint_becomes_sglangs_branching_point():
    """``custom_params.prfaas_checkpoint_tokens`` on a real ``Req``: our Mamba cache's match gives
    SGLang's extra-buffer scheduling the hint as its ``mamba_branching_seqlen`` (rounded down to the
    page and the Mamba chunk size), which ``Req.init_next_round_input`` takes, so the prefill tracks
    and the tree keeps a state there. SGLang's own branching point wins where it has one; a hint
    at or before the reused prefix, or at the prompt's end, is ignored. The admission policy takes
    a hinted prompt as shared."""
    from array import array

    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    from prfaas_sglang.bench.sglang_cpu import cpu_hybrid_cache
    from prfaas_sglang.kvindex.admission import PrefixAdmission

    page = 64  # > 1: SGLang's extra buffer (bench/sglang_cpu.py); Mamba chunk size 64
    built = cpu_hybrid_cache(hybrid_cache.StateEventsMambaRadixCache, page, 1024, MAMBA_SLOTS)
    built.cache.admission = PrefixAdmission("shared", 64)

    def branching(ids, hint):
        params = SamplingParams(max_new_tokens=1, custom_params=None if hint is None else {"prfaas_checkpoint_tokens": hint})
        req = Req(rid=f"r{len(ids)}-{hint}", origin_input_text="", origin_input_ids=array("q", ids), sampling_params=params)
        req.init_next_round_input(built.cache)
        return req.mamba_branching_seqlen

    prompt = list(range(1, 6 * page + 1))
    assert branching(prompt, 3 * page + 10) == 3 * page  # an empty tree: SGLang has no branching point
    assert built.cache.admission.stats.reasons == {"checkpoint-prefix": 1}  # a first sighting: its prefix is kept
    assert branching(prompt, None) is None
    assert branching(prompt, page - 1) is None and branching(prompt, 6 * page) is None
    # the tree holds 4 pages of another prompt sharing the first 4 pages, with a state only at its end
    other = prompt[: 4 * page] + [9_999] * (2 * page)
    slot = built.req_pool.mamba_allocator.alloc(1)
    built.cache.insert(InsertParams(key=RadixKey(array("q", other)), value=built.kv.alloc(len(other)), mamba_value=slot))
    assert branching(prompt, 2 * page) == 4 * page  # SGLang's own: the end of the full-attention match


@pytest.mark.parametrize("mode, hint, tree_after", [
    ("shared", 130, (128, 1)),  # a one-off asking for a checkpoint: the prefix to it and that state, nothing more
    ("shared", None, (0, 0)),  # a one-off: transfer cache, all freed once sent
    ("all", 130, (320, 3)),  # SGLang's behaviour: every tracked point (the hint's, then chunk ends) and the end
])
def test_sglangs_extra_buffer_flow_keeps_a_hinted_one_off_up_to_its_checkpoint_only(mode, hint, tree_after):
    """A real ``Req`` through SGLang's extra-buffer flow on CPU pools (page 64, Mamba chunk 64): the
    match (with the hint as branching point), the request pool's ping-pong buffers, three chunks with
    ``maybe_cache_unfinished_req`` and ``release_kv_cache``. The forward's track step (GPU code) is
    played as SGLang's ``prepare_for_extend`` does it: swap the ping-pong index, record the tracked
    length (the branching point in the forward that holds it, else the chunk-aligned end)."""
    from array import array

    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.mem_cache.common import maybe_cache_unfinished_req, release_kv_cache
    from sglang.srt.sampling.sampling_params import SamplingParams

    from prfaas_sglang.bench.sglang_cpu import cpu_hybrid_cache
    from prfaas_sglang.kvindex.admission import PrefixAdmission

    page, kv_tokens = 64, 1024
    built = cpu_hybrid_cache(hybrid_cache.StateEventsMambaRadixCache, page, kv_tokens, MAMBA_SLOTS)
    cache, pool = built.cache, built.req_pool
    cache.admission = PrefixAdmission(mode, 64)
    prompt = list(range(1, 5 * page + 1))
    params = SamplingParams(max_new_tokens=1, custom_params=None if hint is None else {"prfaas_checkpoint_tokens": hint})
    req = Req(rid="r", origin_input_text="", origin_input_ids=array("q", prompt), sampling_params=params)
    req.init_next_round_input(cache)
    cache.inc_lock_ref(req.last_node)
    pool.alloc([req])
    assert req.mamba_branching_seqlen == (None if hint is None else 2 * page)
    done = 0
    for end in (2 * page, 4 * page, 5 * page):
        loc = built.kv.alloc(end - done)
        pool.write((req.req_pool_idx, slice(done, end)), loc)
        req.set_extend_range(done, end)
        req.kv_committed_len = req.kv_allocated_len = end
        req.mamba_next_track_idx = pool.get_mamba_ping_pong_other_idx(req.mamba_next_track_idx)
        branch = req.mamba_branching_seqlen
        req.mamba_last_track_seqlen = branch if branch is not None and done < branch <= end else end
        done = end
        if end < len(prompt):
            maybe_cache_unfinished_req(req, cache, chunked=True)
    release_kv_cache(req, cache)
    assert cache.total_size() == tree_after
    assert built.kv.available_size() + tree_after[0] == kv_tokens  # the rest went back once "sent"
    assert pool.mamba_allocator.available_size() + tree_after[1] == MAMBA_SLOTS
