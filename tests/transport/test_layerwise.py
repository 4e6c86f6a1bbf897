"""Layer-wise KV streaming (``PRFAAS_KV_LAYERWISE``): the plan is SGLang's own send, block for block.

Pure parts first (:mod:`prfaas_sglang.transport.layerwise`). Then the planning hooks against
SGLang 0.5.15's real scheduling code, in process: a real ``Req`` and ``ReqToTokenPool``, real
``MHATokenToKVPool`` buffers, SGLang's ``send_kv_chunk`` and ``maybe_send_cached_prefix_chunk``
(the prefill mixin's methods on a scheduler object), its ``MooncakeKVSender`` index bookkeeping
(``curr_idx``), and its ``_send_kvcache_generic``, which builds the blocks a chunk's send carries;
only the transfer engine is replaced by a recorder. Across random prompt lengths, page sizes,
chunk sizes, decode-side and prefill-side prefixes, overlap on and off, and any subset of layers
streamed before SGLang's send: what the streamer sent plus what SGLang's send still carries is
exactly what SGLang alone would have sent, each block once. The Mooncake path with real transfers
is ``test_sglang_streams_layers_as_the_forward_writes_them`` (a probe in a subprocess).
"""

from __future__ import annotations

import inspect
import threading
import types
from array import array
from collections import Counter

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sglang_cpu import run_probe

from prfaas_sglang._compat.accessors import set_chunk, set_pool_row
from prfaas_sglang.demo import netns
from prfaas_sglang.transport.layerwise import LayerLedger, chunk_range, layer_blocks, runs


class TestPure:
    def test_chunk_range_holds_a_partial_page_back_until_the_last_chunk(self):
        assert chunk_range(0, 10, 100, 4) == chunk_range(0, 8, 100, 4)
        assert chunk_range(0, 10, 100, 4).end_token == 8 and not chunk_range(0, 10, 100, 4).last
        assert chunk_range(8, 100, 100, 4).end_token == 100 and chunk_range(8, 100, 100, 4).last
        assert chunk_range(8, 11, 100, 4) is None  # no whole page yet: SGLang skips the send
        assert chunk_range(96, 98, 98, 4).last and chunk_range(96, 98, 98, 4).end_token == 98
        with pytest.raises(ValueError):
            chunk_range(3, 10, 100, 4)

    def test_runs_and_blocks_follow_sglangs_grouping(self):
        from sglang.srt.disaggregation.common.utils import group_concurrent_contiguous

        src, dst = np.array([5, 6, 7, 9, 10, 2], np.int32), np.array([0, 1, 2, 3, 4, 8], np.int32)
        groups = group_concurrent_contiguous(src, dst)
        assert runs(src, dst) == [(g[0], d[0], len(g)) for g, d in zip(*groups, strict=True)]
        assert layer_blocks([(5, 0, 3)], [(1000, 2000, 10), (5000, 6000, 10)]) == [(1050, 2000, 30), (5050, 6000, 30)]
        with pytest.raises(ValueError):
            runs([1, 2], [3])

    def test_a_block_goes_once_by_whoever_comes_first(self):
        ledger = LayerLedger()
        a = ledger.open(1, "d0", {0: [(0, 0, 8)], 1: [(100, 100, 8)]})
        assert ledger.claim(a, 0) == [(0, 0, 8)] and ledger.claim(a, 0) == [] and ledger.claim(a, 7) == []
        settled = ledger.settle("d0", [(0, 0, 8), (100, 100, 8), (500, 500, 4)])
        assert settled.to_send == [(100, 100, 8), (500, 500, 4)]
        assert (settled.streamed_bytes, settled.unplanned_bytes) == (8, 4)
        assert ledger.claim(a, 1) == [] and ledger.open_chunks() == 0  # settled: a late layer sends nothing
        b = ledger.open(2, "d0", {0: [(0, 0, 8)]})
        ledger.open(3, "d1", {0: [(0, 0, 8)]})
        assert ledger.drop_rooms({3}) == 1 and ledger.claim(b, 0) == [] and ledger.open_chunks() == 1


# --- SGLang's own scheduling code, in process ----------------------------------------------

NUM_LAYERS, HEAD_DIM = 3, 4


class RecordingEngine:
    """What SGLang's ``_transfer_data`` would hand the transfer engine, per session."""

    def __init__(self):
        self.sent: list[tuple[str, list]] = []


def _manager(pool, decode_pool, room: int, session: str, dst_pages: np.ndarray):
    """A prefill Mooncake manager as far as planning and block building read it: SGLang's own
    ``get_mha_kv_ptrs_with_pp`` and ``_send_kvcache_generic`` over real pools' pointers."""
    from sglang.srt.disaggregation.common.conn import CommonKVManager
    from sglang.srt.disaggregation.mooncake.conn import MooncakeKVManager

    class Manager:
        get_mha_kv_ptrs_with_pp = CommonKVManager.get_mha_kv_ptrs_with_pp
        get_mla_kv_ptrs_with_pp = CommonKVManager.get_mla_kv_ptrs_with_pp
        _send_kvcache_generic = MooncakeKVManager._send_kvcache_generic

        def __init__(self):
            ptrs, _, items = pool.get_contiguous_buf_infos()
            self.kv_args = types.SimpleNamespace(kv_data_ptrs=ptrs, kv_item_lens=items, prefill_start_layer=0,
                                                 state_types=[])
            self.is_mla_backend, self.attn_tp_size, self.enable_custom_mem_pool = False, 1, False
            self.is_hybrid_mla_backend, self.max_transfer_batch_indices = False, 0  # read by SGLang 0.5.23 (0: one batch)
            self.transfer_infos = {room: {session: types.SimpleNamespace(
                mooncake_session_id=session, dst_kv_indices=dst_pages, is_dummy=False)}}
            self.decode_kv_args_table = {session: types.SimpleNamespace(
                dst_kv_ptrs=decode_pool.get_contiguous_buf_infos()[0], dst_attn_tp_size=1)}
            self.request_status = {room: 0}
            self.streamed: list[tuple[str, list]] = []
            self.sglang_sent: list[tuple[str, list, bool]] = []  # (session, blocks, after a planned forward)

        def _transfer_data(self, session, blocks):
            self.sglang_sent.append((session, list(blocks)))
            return 0

    return Manager()


def _scheduler(mgr, pool, req_pool, page_size: int):
    from sglang.srt.disaggregation.prefill import SchedulerDisaggregationPrefillMixin
    from sglang.srt.disaggregation.utils import DisaggregationMode

    class Scheduler(SchedulerDisaggregationPrefillMixin):
        pass

    sched = Scheduler()
    sched.disaggregation_mode = DisaggregationMode.PREFILL
    sched.enable_staging = False
    # what SGLang 0.5.23's send path also reads
    sched.enable_overlap, sched.kv_checksum_computer, sched.disagg_prefill_pending_chunk_rids = False, None, set()
    sched.req_to_token_pool = req_pool
    sched.token_to_kv_pool_allocator = types.SimpleNamespace(  # 0.5.23 also asks for transfer ids: a static pool's
        page_size=page_size, get_kvcache=lambda: pool, translate_kv_indices_for_transfer=lambda ids: ids)
    sched.disagg_metadata_buffers = types.SimpleNamespace(set_buf=lambda req: None)
    sched.disagg_prefill_bootstrap_queue = types.SimpleNamespace(kv_manager=mgr)
    return sched


class Sender:
    """SGLang's ``CommonKVSender`` index bookkeeping (``_prepare_send_indices``), with the transfer
    worker's lookup of the decode's pages, handing SGLang's blocks to ``on_send``."""

    def __init__(self, mgr, room: int, session: str, on_send):
        self.kv_mgr, self.bootstrap_room, self.curr_idx = mgr, room, 0
        self.session, self.on_send = session, on_send

    def should_send_kv_chunk(self, num_pages: int, last_chunk: bool) -> bool:
        return num_pages > 0 or last_chunk

    def get_max_transfer_tokens(self) -> None:  # SGLang 0.5.23 asks; None: no DCP pack limit (its base class's)
        return None

    def send(self, page_indices, state_indices=None, **_):  # 0.5.23 also passes num_kv_tokens
        index_slice = slice(self.curr_idx, self.curr_idx + len(page_indices))
        self.curr_idx += len(page_indices)
        if not len(page_indices):
            return
        info = self.kv_mgr.transfer_infos[self.bootstrap_room][self.session]
        dst = info.dst_kv_indices[index_slice]
        before = len(self.kv_mgr.sglang_sent)
        self.kv_mgr._send_kvcache_generic(self.session, self.kv_mgr.kv_args.kv_data_ptrs,
                                          self.kv_mgr.decode_kv_args_table[self.session].dst_kv_ptrs,
                                          self.kv_mgr.kv_args.kv_item_lens, page_indices[:len(dst)], dst, None)
        for session, blocks in self.kv_mgr.sglang_sent[before:]:
            self.on_send(session, blocks)


@pytest.mark.slow
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(page_size=st.sampled_from([1, 2, 4, 16]), total=st.integers(1, 260), chunk=st.integers(1, 90),
       decode_pages=st.integers(0, 8), cached_pages=st.integers(0, 12), overlap=st.booleans(),
       streamed=st.lists(st.sets(st.integers(0, NUM_LAYERS - 1)), min_size=12, max_size=12),
       seed=st.integers(0, 2**16))
def test_streamed_plus_what_sglang_still_sends_is_sglangs_send_block_for_block(
        page_size, total, chunk, decode_pages, cached_pages, overlap, streamed, seed):
    import torch
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
    from sglang.srt.sampling.sampling_params import SamplingParams

    from prfaas_sglang.hooks.layerwise_hook import attach, layer_written, stream_forward

    decode_prefix = min(decode_pages * page_size, (total - 1) // page_size * page_size)
    cached = min(cached_pages * page_size, (total - 1) // page_size * page_size)
    num_pages = (total + page_size - 1) // page_size + 1
    rng = np.random.default_rng(seed)
    pool = MHATokenToKVPool(num_pages * page_size, page_size, torch.bfloat16, 1, HEAD_DIM, NUM_LAYERS, "cpu", False)
    decode_pool = MHATokenToKVPool(num_pages * page_size, page_size, torch.bfloat16, 1, HEAD_DIM, NUM_LAYERS, "cpu", False)
    req_pool = ReqToTokenPool(2, total + page_size, "cpu", False)
    src_pages = rng.permutation(np.arange(1, num_pages))[:(total + page_size - 1) // page_size]  # page 0 is SGLang's pad
    token_locs = (src_pages[:, None] * page_size + np.arange(page_size)).reshape(-1)[:total]
    req_pool.req_to_token[0, :total] = torch.from_numpy(token_locs.astype(np.int32))
    room, session = 7, "10.0.0.2:1234"
    dst_pages = rng.permutation(np.arange(1, num_pages))[:(total - decode_prefix + page_size - 1) // page_size].astype(np.int32)
    mgr = _manager(pool, decode_pool, room, session, dst_pages)
    sched = _scheduler(mgr, pool, req_pool, page_size)

    streamed_blocks: list = []
    sender_stub = types.SimpleNamespace(_lock=threading.Lock(),
                                        submit_locked=lambda s, blocks: streamed_blocks.extend((s, b) for b in blocks))
    streamer = attach(mgr, sender_stub)
    seen: list[tuple[Counter, Counter, Counter, int]] = []  # per SGLang send: (SGLang's, streamed then, still sent, unplanned)

    def on_send(sess, blocks):
        before = Counter(b for _, b in streamed_blocks)
        unplanned = streamer.unplanned_bytes
        with sender_stub._lock:
            rest = streamer.settle(sess, blocks)
        seen.append((Counter(blocks), before, Counter(rest), streamer.unplanned_bytes - unplanned))

    req = Req(rid="r", origin_input_text="", origin_input_ids=array("q", range(total)),
              sampling_params=SamplingParams(max_new_tokens=1))
    req.start_send_idx, req.pending_bootstrap = decode_prefix, False
    set_pool_row(req, 0)
    req.prefix_indices = torch.from_numpy(token_locs[:cached].astype(np.int64))
    req.disagg_kv_sender = Sender(mgr, room, session, on_send)
    batch = types.SimpleNamespace(reqs=[req], forward_mode=types.SimpleNamespace(is_extend=lambda: True))
    # As SGLang's model runner runs a forward: the batch names no pool, the forward context does.
    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context

    forward_batch = types.SimpleNamespace()
    context = ForwardContext(attn_backend=types.SimpleNamespace(token_to_kv_pool=pool))
    layers = [types.SimpleNamespace(layer_id=i) for i in range(NUM_LAYERS)]
    pending_send = None  # overlap: chunk N's send runs after chunk N+1's run_batch
    start, n = cached, 0
    while True:
        end = min(start + chunk, total)
        set_chunk(req, start, end)
        last = end == total
        layers_now = streamed[n % len(streamed)]

        def forward(_sched, _batch, layers_now=layers_now):
            with forward_context(context):
                for i in sorted(layers_now):
                    layer_written(None, layers[i], None, None, None, forward_batch)
            assert streamer.wait_idle(60.0)  # a hang guard: on the loaded 2-core box 5 s once ran out (2026-11-30)
            return "result"

        assert stream_forward(forward, sched, batch) == "result"
        if pending_send is not None:
            sched.send_kv_chunk(req, last_chunk=False, end_idx=pending_send)
            pending_send = None
        if last:
            sched.send_kv_chunk(req, last_chunk=True)
            break
        if overlap:
            pending_send = end
        else:
            sched.send_kv_chunk(req)
        start, n = end, n + 1

    sglang_total = Counter()
    for sent, streamed_before, rest, _ in seen:
        sglang_total += sent
        # Every block SGLang's send holds was either streamed already or is still sent, never both.
        assert rest + (sent - rest) == sent and all(streamed_before[b] >= 1 for b in sent - rest)
        assert not any(streamed_before[b] for b in rest)
    assert Counter(b for _, b in streamed_blocks) <= sglang_total  # nothing streamed that SGLang would not send
    assert all(s == session for s, _ in streamed_blocks)
    # The plan matched every send after a planned forward: only SGLang's early cached-prefix send is unplanned.
    early = [u for (_, _, _, u) in seen if u]
    assert len(early) <= 1 and (not early or cached > decode_prefix)
    assert streamer.ledger.open_chunks() == 0


def test_a_layer_counts_when_the_forward_context_holds_the_pool_it_was_planned_on():
    """SGLang's ForwardBatch names no KV pool: the model runner publishes it in the forward context. A layer
    of the planned pool is queued; one of another pool (a draft model's), or outside a forward, is not."""
    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context

    from prfaas_sglang.hooks import layerwise_hook

    queued = []
    streamer = types.SimpleNamespace(layer_written=lambda fwd, layer_id: queued.append(layer_id))
    pool, draft = object(), object()
    fwd = layerwise_hook._Forward(streamer, pool, lambda i: i, [])
    token = layerwise_hook._FORWARD.set(fwd)
    try:
        batch = types.SimpleNamespace()  # as a real ForwardBatch: no token_to_kv_pool
        layerwise_hook.layer_written(None, types.SimpleNamespace(layer_id=0), None, None, None, batch)  # no context
        for which, layer_id in ((pool, 1), (draft, 2)):
            with forward_context(ForwardContext(attn_backend=types.SimpleNamespace(token_to_kv_pool=which))):
                layerwise_hook.layer_written(None, types.SimpleNamespace(layer_id=layer_id), None, None, None, batch)
        layerwise_hook.layer_written(None, types.SimpleNamespace(layer_id=3), None, None, None,
                                     types.SimpleNamespace(token_to_kv_pool=pool))  # a batch that names its pool
    finally:
        layerwise_hook._FORWARD.reset(token)
    assert queued == [1, 3]


def test_a_request_with_sglangs_fake_sender_is_not_streamed():
    """SGLang's disaggregation warm-up request (a fake bootstrap host) holds a ``FakeKVSender`` on the
    prefill's own manager (0.5.15's without a bootstrap room, 0.5.23's with the request's): the plan skips
    it (it crashed the prefill's first forward, real SGLang on CPU with PRFAAS_KV_LAYERWISE=1), and a real
    request beside it is planned."""
    import torch
    from sglang.srt.disaggregation.fake.conn import FakeKVSender
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool

    from prfaas_sglang.hooks.layerwise_hook import attach

    page_size, total = 4, 16
    pool = MHATokenToKVPool(8 * page_size, page_size, torch.bfloat16, 1, HEAD_DIM, NUM_LAYERS, "cpu", False)
    decode_pool = MHATokenToKVPool(8 * page_size, page_size, torch.bfloat16, 1, HEAD_DIM, NUM_LAYERS, "cpu", False)
    req_pool = ReqToTokenPool(2, total, "cpu", False)
    req_pool.req_to_token[0, :total] = torch.arange(page_size, page_size + total, dtype=torch.int32)
    room, session = 7, "10.0.0.2:1234"
    mgr = _manager(pool, decode_pool, room, session, np.arange(1, 5, dtype=np.int32))
    streamer = attach(mgr, types.SimpleNamespace(_lock=threading.Lock(), submit_locked=lambda s, blocks: None))

    def req(sender):
        return types.SimpleNamespace(disagg_kv_sender=sender, pending_bootstrap=False, req_pool_idx=0, start_send_idx=0,
                                     origin_input_ids=list(range(total)), extend_range=types.SimpleNamespace(end=total))

    # as each release's PrefillBootstrapQueue.create_sender builds it (SGLang's warm-up and /health_generate
    # send room 0): 0.5.15 with the destination TP ranks and PP rank, 0.5.23 whether the request names a DP rank
    params = inspect.signature(FakeKVSender).parameters
    per_release = ({"dest_tp_ranks": [0], "pp_rank": 0} if "dest_tp_ranks" in params
                   else {"req_has_disagg_prefill_dp_rank": False})
    fake = req(FakeKVSender(mgr=mgr, bootstrap_addr="2.2.2.2:8998", bootstrap_room=0, **per_release))
    real = req(Sender(mgr, room, session, on_send=lambda *_: None))
    sched = _scheduler(mgr, pool, req_pool, page_size)
    fwd = streamer.begin(sched, types.SimpleNamespace(reqs=[fake, real]))
    assert fwd is not None and len(fwd.chunks) == 1  # the real request's chunk only
    assert streamer.begin(sched, types.SimpleNamespace(reqs=[fake])) is None
    # 0.5.23's fake sender keeps its request's room: one that is also a live request's is still not streamed
    same_room = req(FakeKVSender(mgr=mgr, bootstrap_addr="2.2.2.2:8998", bootstrap_room=room, **per_release))
    assert streamer.begin(sched, types.SimpleNamespace(reqs=[same_room])) is None


@pytest.mark.slow
def test_sglang_streams_layers_as_the_forward_writes_them():
    """Real Mooncake TCP, SGLang's managers, sender and receiver, real KV pools on both sides: each
    layer of a chunk is on the decode's pages before the next layer is written, SGLang's own sends
    then carry nothing, the KV lands intact, and no room is left."""
    out = run_probe(PRFAAS_KV_ASYNC_SEND="1", PRFAAS_KV_LAYERWISE="1", PROBE_LAYERWISE="1")
    assert out["layerwise"] is not None
    for r in out["requests"]:
        assert (r["sender"], r["receiver"], r["kv_intact"], r["aux_intact"]) == (
            out["success"], out["success"], True, True), r
        assert r["layer_landed_before_next_written"], r
    lw = out["layerwise"]
    assert lw["unplanned_bytes"] == 0 and lw["streamed_bytes"] == out["kv_bytes_total"]
    assert lw["forwards_without_layers"] == 0 and lw["open_chunks"] == 0
    assert out["async"]["in_flight_bytes"] == 0 and out["async"]["writes_failed"] == 0
    assert out["prefill_rooms_left"] == [] and out["decode_rooms_left"] == [] and out["transfer_infos_left"] == []


@pytest.mark.slow
@pytest.mark.skipif(netns.available() is not None, reason=f"shaped loopback: {netns.available()}")
def test_bench_layerwise_smoke():
    """The benchmark end to end, one run per mode: with streaming on every byte went layer by layer
    and nothing was sent twice, with it off nothing streamed; every request's KV landed intact (the
    bench refuses to report otherwise). No timing is asserted."""
    import zygote

    from prfaas_sglang.bench.layerwise_bench import run

    out = run(rate_mbit=400.0, forward_s=0.05, tokens=512, layers=4, requests=2, repeats=1, zygote=zygote.zygote())
    (on,), (off,) = out["runs"]["on"], out["runs"]["off"]
    assert off["layerwise"] is None
    assert on["layerwise"]["unplanned_bytes"] == 0 and on["layerwise"]["open_chunks"] == 0
    assert on["layerwise"]["streamed_bytes"] == 2 * out["kv_bytes_per_request"]
    assert out["on_after_forward_s"]["median"] >= 0 and out["off_after_forward_s"]["median"] >= 0


@pytest.mark.parametrize("cpu_engine", [True, False])
def test_a_cpu_engines_mooncake_sender_takes_the_host_index_path(monkeypatch, cpu_engine):
    """Hook cpu-sender-indices: under SGLang's CPU engine a Mooncake sender says it takes no host-tensor
    indices (0.5.23's path for them needs CUDA), so the scheduler computes them on the host; elsewhere,
    and for every other sender, nothing changes."""
    import sglang.srt.utils

    from prfaas_sglang.hooks.cpu_engine import sender_host_indices_off

    monkeypatch.setattr(sglang.srt.utils, "is_cpu", lambda: cpu_engine)
    sender = types.SimpleNamespace(supports_host_tensor_indices=True)
    assert sender_host_indices_off(None, sender, "mgr", "addr", 7) is None
    assert sender.supports_host_tensor_indices is (not cpu_engine)
