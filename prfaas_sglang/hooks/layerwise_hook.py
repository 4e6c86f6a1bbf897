"""Hooks: a PrfaaS prefill worker sends each layer's KV as soon as the forward has written it.

Behind ``PRFAAS_KV_LAYERWISE=1`` (off by default), on top of the asynchronous sender
(:class:`~prfaas_sglang.transport.kv_sender.AsyncKvSender`, attached by
:mod:`prfaas_sglang.hooks.kv_send_hook`). SGLang 0.5.15 sends a chunk's KV only after the chunk's
whole forward; over a WAN the last chunk's transfer then starts when its forward ends and adds
its full length to TTFT. Streaming by layer starts it after the first layer, so most of it
overlaps the rest of the forward (the paper's layer-wise prefill; the KV-messenger seed).

Three hooks, on one :class:`LayerStreamer` per prefill Mooncake manager:

* ``kv-layerwise-batch`` (AROUND ``Scheduler.run_batch``), scheduler thread: for an extend
  batch of a disaggregated prefill server, first SGLang's own early send of cached prefixes
  (``maybe_send_cached_prefix_chunk``, idempotent; run_batch calls it again), then plan each
  request's chunk per decode destination (:func:`~prfaas_sglang.transport.layerwise.chunk_range`,
  pages read from ``req_to_token`` as ``send_kv_chunk`` reads them) and open it in the
  :class:`~prfaas_sglang.transport.layerwise.LayerLedger`; the plan is the current forward's
  for the duration of the call (a context variable);
* ``kv-layerwise-layer`` (AFTER ``RadixAttention.forward``): a layer of the target model's KV
  pool was written (launched, on a GPU): record a blocking CUDA event and queue the layer;
  the streamer thread waits on the event (sleeping) and submits the layer's blocks of every
  planned chunk as asynchronous writes, claim and submission under the sender's lock;
* SGLang's own send of the chunk later reaches ``kv-send`` (``_transfer_data``), which settles
  it against the ledger: blocks already streamed are dropped, the rest go as usual, and the aux
  barrier waits for every write, streamed ones included, before the decode hears Success.

Falls back to chunk-level sending, never to wrong bytes: a request still bootstrapping, a
destination with another attention-TP size, a KV pool other than MHA / MLA / hybrid-linear,
context-parallel or staged transfers, and a forward that ran without per-layer calls (a prefill
CUDA graph) stream nothing, and SGLang's send carries the chunk whole.
"""

from __future__ import annotations

import contextvars
import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from prfaas_sglang._compat.accessors import chunk_end, pool_row
from prfaas_sglang.transport.layerwise import LayerLedger, chunk_range, layer_blocks, runs

logger = logging.getLogger(__name__)
_ATTR = "_prfaas_layerwise"
SUPPORTED_POOLS = frozenset({"MHATokenToKVPool", "MLATokenToKVPool"})


@dataclass
class _Forward:
    """One forward's plan: the ledger keys of its chunks, with their sessions."""

    streamer: LayerStreamer
    pool: Any  # the target model's KV pool; layers of another pool (a draft model) are not ours
    layer_index: Callable[[int], int | None]  # layer_id -> index into the pool's transfer buffers
    chunks: list[tuple[int, str]]
    layers_seen: set[int] = field(default_factory=set)


_FORWARD: contextvars.ContextVar[_Forward | None] = contextvars.ContextVar("prfaas_layerwise_forward", default=None)


class LayerStreamer:
    """Layer-wise sending for one prefill ``MooncakeKVManager`` and its ``AsyncKvSender``. The ledger
    and the per-room cursors are guarded by the sender's lock; one daemon thread submits layers."""

    def __init__(self, manager, sender):
        self.manager = manager
        self.sender = sender
        self.ledger = LayerLedger()
        self._cursors: dict[int, tuple[int, int]] = {}  # room -> (next token to send, next decode page)
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._queued = 0  # layers queued and not yet submitted (guarded by _idle)
        self._idle = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="prfaas-kv-layerwise", daemon=True)
        self._thread.start()
        self._warned: set[str] = set()
        self.forwards_planned = 0
        self.forwards_without_layers = 0
        self.layers_streamed = 0
        self.streamed_bytes = 0  # dropped from SGLang's sends: already on the wire
        self.unplanned_bytes = 0  # in SGLang's sends and in no open chunk

    # --- scheduler thread -----------------------------------------------------------------

    def begin(self, scheduler, batch) -> _Forward | None:
        """Plan ``batch``'s chunks; the forward to announce layers to, or None (nothing to stream)."""
        pool = scheduler.token_to_kv_pool_allocator.get_kvcache()
        layers = _layer_indexer(pool)
        if layers is None:
            self._warn_once("pool", "KV pool %s: layer-wise streaming off, chunks sent whole", type(pool).__name__)
            return None
        page_size = scheduler.token_to_kv_pool_allocator.page_size
        req_to_token = scheduler.req_to_token_pool.req_to_token
        chunks: list[tuple[int, str]] = []
        live = self.manager.request_status
        with self.sender._lock:
            self.ledger.drop_rooms(live)
            for room in [r for r in self._cursors if r not in live]:
                del self._cursors[room]
        for req in batch.reqs:
            chunks.extend(self._plan(req, req_to_token, page_size))
        if not chunks:
            return None
        self.forwards_planned += 1
        return _Forward(self, pool, layers, chunks)

    def end(self, fwd: _Forward) -> None:
        if not fwd.layers_seen:  # no per-layer call ran: SGLang's send carries every layer
            self.forwards_without_layers += 1
            self._warn_once("graph", "a prefill forward ran without per-layer attention calls (a CUDA graph?): "
                                     "its KV goes chunk by chunk")

    def _plan(self, req, req_to_token, page_size: int) -> list[tuple[int, str]]:
        sender = getattr(req, "disagg_kv_sender", None)
        if sender is None or getattr(sender, "kv_mgr", None) is not self.manager or getattr(req, "pending_bootstrap", False):
            return []
        # SGLang's own warm-up and /health_generate requests (and any with a fake bootstrap host) hold a
        # FakeKVSender on the same manager: nothing to send. It crashed the prefill's first forward on CPU.
        # 0.5.15's has no room; 0.5.23's keeps the request's (0 for both), which a live request may also have.
        room = getattr(sender, "bootstrap_room", None)
        if room is None or _is_fake(sender):
            return []
        infos = self.manager.transfer_infos.get(room)
        extend_end, row = chunk_end(req), pool_row(req)
        if not infos or extend_end is None or row is None:
            return []
        first_token, first_page = self._cursors.get(room, (req.start_send_idx, sender.curr_idx))
        try:
            rng = chunk_range(first_token, extend_end, len(req.origin_input_ids), page_size)
        except ValueError:
            return []
        if rng is None:
            return []
        token_locs = req_to_token[row, rng.first_token:rng.end_token].cpu().numpy()
        src_pages = token_locs if page_size == 1 else token_locs[::page_size] // page_size  # send_kv_chunk's pages
        if rng.last:
            self._cursors.pop(room, None)
        else:
            self._cursors[room] = (rng.end_token, first_page + len(src_pages))
        planned = []
        for info in list(infos.values()):
            buffers = self._layer_buffers(info)
            if buffers is None:
                continue
            dst_pages = info.dst_kv_indices[first_page:first_page + len(src_pages)]
            page_runs = runs(src_pages[:len(dst_pages)], dst_pages)
            session = str(info.mooncake_session_id)
            blocks = {i: layer_blocks(page_runs, bufs) for i, bufs in enumerate(buffers)}
            with self.sender._lock:
                planned.append((self.ledger.open(room, session, blocks), session))
        return planned

    def _layer_buffers(self, info) -> list[list[tuple[int, int, int]]] | None:
        """Per pool layer index, its ``(src_ptr, dst_ptr, item_len)`` buffers toward ``info``'s decode,
        as SGLang's ``_send_kvcache_generic`` pairs them; None where SGLang would not send this way."""
        mgr = self.manager
        if getattr(info, "is_dummy", False):
            return None
        reg = mgr.decode_kv_args_table.get(info.mooncake_session_id)
        if reg is None:
            return None
        items = mgr.kv_args.kv_item_lens
        if mgr.is_mla_backend:
            src, dst, n = mgr.get_mla_kv_ptrs_with_pp(mgr.kv_args.kv_data_ptrs, reg.dst_kv_ptrs)
            return [[(src[i], dst[i], items[i])] for i in range(n)]
        if mgr.attn_tp_size != reg.dst_attn_tp_size:  # SGLang sends head slices (send_kvcache_slice)
            return None
        src_k, src_v, dst_k, dst_v, n = mgr.get_mha_kv_ptrs_with_pp(mgr.kv_args.kv_data_ptrs, reg.dst_kv_ptrs)
        if n > len(dst_k):
            return None
        return [[(src_k[i], dst_k[i], items[i]), (src_v[i], dst_v[i], items[n + i])] for i in range(n)]

    # --- forward (scheduler thread) -> streamer thread -------------------------------------

    def layer_written(self, fwd: _Forward, layer_id: int) -> None:
        """The forward launched the write of ``layer_id``'s KV: stream it once it has run."""
        index = fwd.layer_index(layer_id)
        if index is None or index in fwd.layers_seen:
            return
        fwd.layers_seen.add(index)
        event = None
        if "cuda" in str(getattr(fwd.pool, "device", "")):
            import torch

            event = torch.cuda.Event(blocking=True)  # the waiting thread sleeps
            event.record()
        with self._idle:
            self._queued += 1
        self._queue.put((fwd.chunks, index, event))

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait until every queued layer has been submitted (tests, shutdown); False on timeout."""
        with self._idle:
            return self._idle.wait_for(lambda: self._queued == 0, timeout_s)

    def _run(self) -> None:
        while True:
            chunks, index, event = self._queue.get()
            try:
                if event is not None:
                    event.synchronize()
                self._submit_layer(chunks, index)
            except Exception:  # noqa: BLE001 - the chunk then goes whole with SGLang's send
                logger.exception("prfaas_sglang: streaming layer %d failed", index)
            finally:
                with self._idle:
                    self._queued -= 1
                    self._idle.notify_all()

    def _submit_layer(self, chunks: list[tuple[int, str]], index: int) -> None:
        by_session: dict[str, list] = {}
        with self.sender._lock:  # claim and submit at once: a settle or an aux barrier sees both or neither
            for key, session in chunks:
                blocks = self.ledger.claim(key, index)
                if blocks:
                    by_session.setdefault(session, []).extend(blocks)
            for session, blocks in by_session.items():
                self.sender.submit_locked(session, blocks)
            if by_session:
                self.layers_streamed += 1

    # --- SGLang's transfer thread (kv-send), under the sender's lock ------------------------

    def settle(self, session: str, blocks) -> list:
        settled = self.ledger.settle(session, blocks)
        self.streamed_bytes += settled.streamed_bytes
        self.unplanned_bytes += settled.unplanned_bytes
        return settled.to_send

    def _warn_once(self, key: str, msg: str, *args) -> None:
        if key not in self._warned:
            self._warned.add(key)
            logger.warning("prfaas_sglang: " + msg, *args)


def _layer_indexer(pool):
    """``layer_id -> index`` into the pool's per-layer transfer buffers (None for a layer without
    KV there), or None for a pool whose layout this module does not stream."""
    inner = getattr(pool, "full_kv_pool", None)
    if type(pool).__name__ == "HybridLinearKVPool" and type(inner).__name__ in SUPPORTED_POOLS:
        mapping = pool.full_attention_layer_id_mapping
        return mapping.get
    if type(pool).__name__ not in SUPPORTED_POOLS:
        return None
    start, num = getattr(pool, "start_layer", 0) or 0, pool.layer_num

    def index(layer_id: int) -> int | None:
        i = layer_id - start
        return i if 0 <= i < num else None

    return index


def streamer_of(manager) -> LayerStreamer | None:
    return getattr(manager, _ATTR, None)


def attach(manager, sender) -> LayerStreamer | None:
    """Give a prefill manager a streamer, unless its transfers take a path layers cannot follow."""
    for flag in ("enable_all_cp_ranks_for_transfer", "is_dummy_cp_rank", "enable_staging"):
        if getattr(manager, flag, False):
            logger.warning("prfaas_sglang: PRFAAS_KV_LAYERWISE set but %s is on: KV goes chunk by chunk", flag)
            return None
    streamer = LayerStreamer(manager, sender)
    setattr(manager, _ATTR, streamer)
    logger.info("prfaas_sglang: KV streamed layer by layer as the forward writes it")
    return streamer


def _streamer_of_scheduler(scheduler) -> LayerStreamer | None:
    if getattr(getattr(scheduler, "disaggregation_mode", None), "value", None) != "prefill":
        return None
    bootstrap = getattr(scheduler, "disagg_prefill_bootstrap_queue", None)
    return streamer_of(getattr(bootstrap, "kv_manager", None))


def stream_forward(original, scheduler, batch, *args, **kwargs):
    """AROUND hook on ``Scheduler.run_batch``: plan an extend batch's chunks, make them the current
    forward's while it runs."""
    streamer = _streamer_of_scheduler(scheduler)
    mode = getattr(batch, "forward_mode", None)
    if streamer is None or mode is None or not mode.is_extend():
        return original(scheduler, batch, *args, **kwargs)
    for req in batch.reqs:  # SGLang's early send of cached prefixes first (run_batch repeats it, a no-op)
        scheduler.maybe_send_cached_prefix_chunk(req)
    fwd = streamer.begin(scheduler, batch)
    if fwd is None:
        return original(scheduler, batch, *args, **kwargs)
    token = _FORWARD.set(fwd)
    try:
        return original(scheduler, batch, *args, **kwargs)
    finally:
        _FORWARD.reset(token)
        streamer.end(fwd)


def _is_fake(sender) -> bool:
    """Whether ``sender`` is SGLang's ``FakeKVSender`` (a fake bootstrap host: nothing is sent)."""
    from sglang.srt.disaggregation.fake.conn import FakeKVSender

    return isinstance(sender, FakeKVSender)


def layer_written(result, layer, q=None, k=None, v=None, forward_batch=None, *args, **kwargs):
    """AFTER hook on ``RadixAttention.forward``: the layer's KV write has been issued."""
    fwd = _FORWARD.get()
    if fwd is not None and forward_pool(forward_batch) is fwd.pool:
        fwd.streamer.layer_written(fwd, layer.layer_id)
    return None


def forward_pool(forward_batch) -> Any:
    """The KV pool a layer's forward writes: SGLang's ``ForwardBatch`` carries none, the model runner
    publishes it in the forward context (its attention backend's ``token_to_kv_pool``, a draft model's
    its own); a batch that names one (the NPU backends') wins. None outside a forward."""
    pool = getattr(forward_batch, "token_to_kv_pool", None)
    if pool is not None:
        return pool
    from sglang.srt.model_executor import forward_context

    return forward_context.get_token_to_kv_pool() if forward_context.has_forward_context() else None
