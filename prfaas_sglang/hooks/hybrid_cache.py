"""SGLang side of state-aware KV events, through SGLang's own registries (no hook, no patch).

SGLang 0.5.15's ``MambaRadixCache`` publishes pages only: when it stores a
linear-attention state for a prefix, or evicts one (a *tombstone*: the pages
stay, the state goes), nothing is published, yet that state decides how much
of the prefix a hybrid model can reuse. Two registered parts fix that (both bound to SGLang's
registries by :mod:`prfaas_sglang.hooks.cache_backend`):

* the radix-cache backend :data:`RADIX_CACHE_BACKEND` (``--radix-cache-backend
  prfaas-hybrid``): where SGLang's default chain would build a
  ``MambaRadixCache``, it builds :class:`StateEventsMambaRadixCache`, the same
  cache that also records :class:`~prfaas_sglang.wire.kv_events.StateStored` /
  ``StateRemoved``; anywhere else it builds what the default chain builds;
* the event publisher ``prfaas-zmq`` (:mod:`prfaas_sglang.hooks.event_publisher`):
  SGLang's ZMQ publisher, writing the batch's state events as its 4th element
  (wire v2), which SGLang 0.5.15's own decoder and every v1 consumer skip.

The same backend applies a PrfaaS prefill worker's admission policy
(:mod:`prfaas_sglang.kvindex.admission`, ``PRFAAS_PREFILL_CACHE``) in the Mamba cache and, for
full-attention models, in :class:`AdmissionRadixCache` (SGLang's ``RadixCache``), and for
sliding-window models in :class:`StateEventsSWARadixCache`: a request whose prefill is *transfer
cache* is never inserted (neither its chunks nor its end), so its pages and state slot go back to
the pools when SGLang releases it after its KV transfer.

The cache hands its state events to the publisher inside the list
``take_events()`` returns (:class:`EventsWithState`), which SGLang passes on
untouched; with SGLang's own ``zmq`` publisher they are simply not written.
A batch carries a state list (possibly empty) exactly when its cache reports
state, which is how a consumer tells reported checkpoints from none.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import Any

import torch
from sglang.srt.disaggregation.kv_events import BlockRemoved as SglBlockRemoved
from sglang.srt.mem_cache.common import free_swa_out_of_window_slots
from sglang.srt.mem_cache.mamba_radix_cache import MambaRadixCache
from sglang.srt.mem_cache.radix_cache import RadixCache
from sglang.srt.mem_cache.swa_radix_cache import LRUList as SwaLRUList
from sglang.srt.mem_cache.swa_radix_cache import SWARadixCache
from sglang.srt.mem_cache.utils import compute_node_hash_values, hash_str_to_int64

from prfaas_sglang.hooks.event_publisher import EventsWithState
from prfaas_sglang.hooks.radix_nodes import prefix_len
from prfaas_sglang.kvindex.admission import MAX_PENDING_DECISIONS, Decision, PrefixAdmission
from prfaas_sglang.kvindex.admission_env import admission_from_env, chunk_checkpoints_from_env  # noqa: F401 (re-exported)
from prfaas_sglang.launch.command import RADIX_CACHE_BACKEND  # noqa: F401 (re-exported for decode_radix)
from prfaas_sglang.protocol import BadRequest, checkpoint_tokens
from prfaas_sglang.wire.kv_events import DEVICE_MEDIUM, StateRemoved, StateStored


class _PrefillAdmission:
    """Mixin for a radix cache (before it in the bases): a PrfaaS prefill worker's admission
    policy (:mod:`prfaas_sglang.kvindex.admission`). Each request is decided once, at its first
    ``match_prefix`` (the scheduler's, which passes the request). A *transfer-cache* request then
    takes SGLang's no-insert path in ``cache_unfinished_req`` (its chunks stay its own, as in
    ``ChunkCache``) and finishes with ``is_insert=False``: everything beyond its cached prefix
    goes back to the pools when SGLang releases the request after its KV transfer.

    A request kept only up to its checkpoint (``Decision.keep_tokens``; only in a cache that can
    stop there, :meth:`_checkpoint`) is inserted once, at the forward that tracked the state at
    that length (``req.mamba_last_track_seqlen``), and otherwise takes the no-insert path: the
    prefix and its state stay in the tree, the rest is freed once sent."""

    admission: PrefixAdmission | None

    def _init_admission(self, admission: PrefixAdmission | None) -> None:
        self.admission = admission
        self._decided: OrderedDict[str, Decision] = OrderedDict()  # rid -> decision (decided, not finished)

    def match_prefix(self, params: Any):
        result, checkpoint = self._checkpoint(super().match_prefix(params), params)
        req = params.req
        if self.admission is not None and req is not None and req.rid not in self._decided:
            key = params.key
            self._decided[req.rid] = self.admission.decide(key.token_ids[: len(key)], len(result.device_indices),
                                                           checkpoint)
            while len(self._decided) > MAX_PENDING_DECISIONS:
                self._decided.popitem(last=False)
        return result

    def _checkpoint(self, result: Any, params: Any) -> tuple[Any, int | None]:
        """SGLang's match and the length at which this prefill will leave a state the tree can keep
        on its own, for a request with a checkpoint hint; None where this cache cannot stop a
        prefill there (here: never; the Mamba cache with SGLang's extra buffer can)."""
        return result, None

    def _keeps_whole(self, req: Any) -> bool:
        """Whether ``req``'s whole prefill is prefix cache (SGLang's behaviour; undecided requests too)."""
        decision = self._decided.get(req.rid)
        return decision is None or (decision.keep and decision.keep_tokens is None)

    def _inserts_chunks(self, req: Any) -> bool:
        """Whether ``req``'s finished chunks go into the tree."""
        return self._keeps_whole(req)

    def _at_kept_prefix(self, req: Any) -> bool:
        """Whether ``req`` is kept up to its checkpoint only and its last forward tracked the state there."""
        decision = self._decided.get(req.rid)
        return (decision is not None and decision.keep_tokens is not None
                and getattr(req, "mamba_last_track_seqlen", None) == decision.keep_tokens)

    def cache_unfinished_req(self, req: Any, chunked: bool = False) -> None:
        if self._inserts_chunks(req) or self._at_kept_prefix(req):
            return super().cache_unfinished_req(req, chunked=chunked)
        # SGLang's own no-insert path (MambaRadixCache's _skip_cache_unfinished_req, ChunkCache's):
        # the request keeps its chunks' KV; the next chunk's prefix is what it computed so far.
        kv_indices = self.req_to_token_pool.req_to_token[req.req_pool_idx, : req.extend_range.end]
        req.prefix_indices = kv_indices.to(dtype=torch.int64, copy=True)

    def cache_finished_req(self, req: Any, is_insert: bool = True) -> None:
        insert = self._keeps_whole(req) or self._at_kept_prefix(req)
        self._decided.pop(req.rid, None)
        super().cache_finished_req(req, is_insert=is_insert and insert)


def checkpoint_hint(req: Any) -> int | None:
    """The state checkpoint a request asks for (``custom_params.prfaas_checkpoint_tokens``, which
    SGLang keeps on the request untouched), or None when absent or not a positive integer (the
    router and the emulated engine refuse those with a 400; here one is only ignored)."""
    params = getattr(getattr(req, "sampling_params", None), "custom_params", None)
    try:
        return checkpoint_tokens(params) if isinstance(params, dict) else None
    except BadRequest:
        return None


class AdmissionRadixCache(_PrefillAdmission, RadixCache):
    """SGLang's ``RadixCache`` (full-attention models) with the prefill admission policy; built by
    the ``prfaas-hybrid`` backend where SGLang would build a ``RadixCache`` and
    ``PRFAAS_PREFILL_CACHE`` is set (the launcher sets it for the prfaas role)."""

    def __init__(self, params: Any, admission: PrefixAdmission | None):
        self._init_admission(admission)
        super().__init__(params)


class StateEventsMambaRadixCache(_PrefillAdmission, MambaRadixCache):
    """``MambaRadixCache`` that records where Mamba state is stored and evicted.

    A node's state sits at the node's end: the prefix up to its last page. Stored
    when ``_insert_helper`` leaves a state at the inserted key's end (a new leaf,
    or a tombstone given one again); removed when a node is tombstoned or an
    evicted leaf leaves with it (after that leaf's ``BlockRemoved``). A split moves
    no state: the state stays on the child, whose last page is unchanged. Reset
    clears all (``AllBlocksCleared``). Records only while KV events are enabled.

    With an ``admission`` policy: :class:`_PrefillAdmission`. With ``chunk_checkpoints`` off, no
    request's chunks are inserted (a state only at a request's end).
    """

    def __init__(self, params: Any, admission: PrefixAdmission | None = None, chunk_checkpoints: bool = True):
        self._init_admission(admission)
        # False: a state checkpoint only at a request's end, none at its chunk boundaries
        # (each is a state slot: ~74 MiB for Qwen3-Next-80B), PRFAAS_STATE_CHECKPOINTS=end.
        self.chunk_checkpoints = chunk_checkpoints
        super().__init__(params)

    def _checkpoint(self, result: Any, params: Any) -> tuple[Any, int | None]:
        """Where the request asks for a state checkpoint (:func:`checkpoint_hint`) and SGLang found
        no branching point of its own, that point becomes the match's ``mamba_branching_seqlen``:
        SGLang's extra-buffer scheduling then tracks the state there during the prefill (the
        mechanism SGLang uses for its own branching points). Rounded down to a multiple of the page
        and of the Mamba chunk size, and used only between the reused prefix and the prompt's end.
        With a hint, the branching point that will be tracked (the hint's or SGLang's) is where the
        prefill can be kept to. Without the extra buffer SGLang keeps states at chunk ends only:
        the hint changes nothing there."""
        at = checkpoint_hint(params.req)
        if at is None:
            return result, None
        if result.mamba_branching_seqlen is None:
            step = math.lcm(self.page_size, self.mamba_cache_chunk_size)
            branch = at // step * step
            if len(result.device_indices) < branch < len(params.key):
                result = result._replace(mamba_branching_seqlen=branch)
        return result, result.mamba_branching_seqlen if self.enable_mamba_extra_buffer else None

    def reset(self) -> None:  # also run by MambaRadixCache.__init__
        super().reset()
        self._state_queue: list = []
        self._stated: dict[int, tuple[int, int]] = {}  # node id -> (block hash, num_tokens) reported

    def take_events(self):
        """This batch's block events and state events (:class:`EventsWithState`)."""
        events = super().take_events()
        states, self._state_queue = self._state_queue, []
        return EventsWithState(events, states)

    def _inserts_chunks(self, req: Any) -> bool:
        return self.chunk_checkpoints and super()._inserts_chunks(req)

    def _insert_helper(self, node: Any, key: Any, value: Any, mamba_value: Any, chunked: bool = False,
                       prev_prefix_len: int = 0):
        result = super()._insert_helper(node, key, value, mamba_value, chunked, prev_prefix_len)
        if self.enable_kv_cache_events and len(key) > 0:
            end = self._node_ending_at(node, key)
            if end is not None and end.mamba_value is not None and end.id not in self._stated:
                # The end's prefix length: the start node's plus the key's (no walk from the root for it).
                self._stated[end.id] = stated = (self._last_page_hash(end), self._prefix_len(node) + len(key))
                self._state_queue.append(StateStored(*stated, "mamba", DEVICE_MEDIUM))
        return result

    def _tombstone_internal_node(self, node: Any) -> None:
        self._forget_state(node)
        super()._tombstone_internal_node(node)

    def _delete_leaf(self, node: Any) -> None:
        self._forget_state(node)
        super()._delete_leaf(node)

    # --- helpers ----------------------------------------------------------------------------

    def _forget_state(self, node: Any) -> None:
        stated = self._stated.pop(node.id, None)
        if stated is not None:
            self._state_queue.append(StateRemoved(*stated, "mamba", DEVICE_MEDIUM))

    def _node_ending_at(self, start: Any, key: Any) -> Any | None:
        """The node whose end is ``key``'s end, walking down from ``start`` (after an insert the
        path exists node for node); None if the tree has no such node."""
        node = start
        while len(key) > 0:
            child = node.children.get(key.child_key(self.page_size))
            if child is None:
                return None
            matched = child.key.match(key, page_size=self.page_size)
            if matched < len(child.key):
                return None
            node, key = child, key[matched:]
        return node

    def _last_page_hash(self, node: Any) -> int:
        return hash_str_to_int64(_hash_values(node, self.page_size)[-1])

    def _prefix_len(self, node: Any) -> int:
        return prefix_len(node, self.root_node)


def _hash_values(node: Any, page_size: int) -> list[str]:
    """A tree node's page hashes (SGLang's strings; ``hash_str_to_int64`` gives the events' ints),
    computed once and kept on the node, as SGLang's own events do."""
    if node.hash_value is None:
        node.hash_value = compute_node_hash_values(node, page_size)
    return node.hash_value


class _TouchedLRUList(SwaLRUList):
    """SGLang's SWA LRU list, noting every node it gains or loses. A node is in this list exactly
    when it holds its sliding-window KV (``SWARadixCache``'s invariant, its ``sanity_check``), so
    the nodes noted are all whose SWA presence may have changed."""

    def __init__(self, cache: Any):
        super().__init__(is_swa_list=True)
        self._cache = cache

    def insert_mru(self, node: Any) -> None:
        super().insert_mru(node)
        if self._cache.enable_kv_cache_events:
            self._cache._touched.append(node)

    def remove_node(self, node: Any) -> None:
        super().remove_node(node)
        if self._cache.enable_kv_cache_events:
            self._cache._touched.append(node)


class StateEventsSWARadixCache(_PrefillAdmission, SWARadixCache):
    """``SWARadixCache`` that reports which stored pages lack their sliding-window KV.

    SGLang's tree keeps a node's full-attention KV after freeing its window KV (a *tombstone*,
    silent in its events), and a prefix is resumable only where the window before it is held, so
    its ``BlockStored`` events overstate what matches. Here a stored page holds its window KV
    unless told otherwise: ``"swa"`` :class:`~prfaas_sglang.wire.kv_events.StateRemoved` when a
    page still in the tree loses it (tombstoned, or inserted without it after a long decode),
    ``StateStored`` when it gets it back; a page that leaves the tree takes its mark along with
    its ``BlockRemoved``. At ``take_events`` the nodes the SWA LRU list gained or lost since the
    last batch are compared with what was published: a node in the tree and in the list holds its
    pages; a tombstone does not; a page merged or split into another node keeps what that node
    says, so splits and merges publish nothing. Events scale with window evictions, not with
    stored pages. Records only while KV events are enabled; reset clears all (``AllBlocksCleared``).

    With an ``admission`` policy: :class:`_PrefillAdmission`. A transfer-cache request's chunks
    are its own, outside the tree, so no tree eviction frees their window KV: each chunk's end
    frees the request's sliding-window KV older than the window before that chunk's start, as
    SGLang does for a chunk cache (``free_swa_out_of_window_slots``). The chunk just computed may
    still run under overlap scheduling; it reads nothing older. The full-attention KV stays until
    the transfer completes."""

    def __init__(self, params: Any, admission: PrefixAdmission | None = None):
        self._init_admission(admission)
        super().__init__(params)

    def cache_unfinished_req(self, req: Any, chunked: bool = False) -> None:
        super().cache_unfinished_req(req, chunked=chunked)
        if not self._inserts_chunks(req) and not self.disable:
            free_swa_out_of_window_slots(
                req, req.extend_range.start, sliding_window_size=self.sliding_window_size, page_size=self.page_size,
                req_to_token_pool=self.req_to_token_pool, token_to_kv_pool_allocator=self.token_to_kv_pool_allocator,
                is_chunk_cache=True)

    def reset(self) -> None:  # also run by SWARadixCache.__init__
        super().reset()
        self._touched: list = []
        self._missing: dict[int, int] = {}  # page hash -> num_tokens, published as lacking its window KV
        self.swa_lru_list = _TouchedLRUList(self)  # the empty list reset() made, noting changes

    def take_events(self):
        """This batch's block events and the pages whose window KV came or went (:class:`EventsWithState`)."""
        events = super().take_events()
        for event in events:  # a consumer forgets a removed page's state with it (a page stored again is new)
            if isinstance(event, SglBlockRemoved):
                for page in event.block_hashes:
                    self._missing.pop(page, None)
        return EventsWithState(events, self._swa_changes())

    def _add_new_node(self, parent: Any, key: Any, value: Any, swa_tombstone: bool = False) -> Any:
        node = super()._add_new_node(parent, key, value, swa_tombstone)
        if swa_tombstone and self.enable_kv_cache_events:  # stored without its window KV: never in the SWA list
            self._touched.append(node)
        return node

    def _compact_single_child_chain(self, node: Any) -> None:
        super()._compact_single_child_chain(node)  # the child's pages now belong to ``node``
        if self.enable_kv_cache_events:
            self._touched.append(node)

    def _swa_changes(self) -> list:
        touched, self._touched = self._touched, []
        if not touched:
            return []
        held: dict[int, tuple[bool, int]] = {}
        gone: list[int] = []
        for node in {id(n): n for n in touched}.values():
            if self._in_tree(node):
                start, in_list = prefix_len(node.parent, self.root_node), self.swa_lru_list.in_list(node)
                for i, page in enumerate(map(hash_str_to_int64, _hash_values(node, self.page_size))):
                    held[page] = (in_list, start + (i + 1) * self.page_size)
            elif node.hash_value is not None:  # left the tree (deleted, or merged into its parent)
                gone += (hash_str_to_int64(h) for h in node.hash_value)
        for page in gone:
            if page not in held:  # deleted: its BlockRemoved takes the mark along
                self._missing.pop(page, None)
        out: list = []
        window = self.sliding_window_size
        for page, (holds, num_tokens) in held.items():
            if not holds and page not in self._missing:
                self._missing[page] = num_tokens
                out.append(StateRemoved(page, num_tokens, "swa", DEVICE_MEDIUM, window))
            elif holds and page in self._missing:
                out.append(StateStored(page, self._missing.pop(page), "swa", DEVICE_MEDIUM, window))
        return out

    def _in_tree(self, node: Any) -> bool:
        while node is not self.root_node:
            parent = node.parent
            if parent is None or parent.children.get(node.key.child_key(self.page_size)) is not node:
                return False
            node = parent
        return True



def default_builds_swa_radix_cache(ctx: Any) -> bool:
    """Whether SGLang 0.5.15's ``default_radix_cache_factory`` builds an ``SWARadixCache`` for
    ``ctx`` (its selection chain, in its order; a drift test compares the two)."""
    from sglang.srt.environ import envs
    from sglang.srt.utils.tensor_bridge import use_mlx

    if ctx.effective_chunked_prefill_size is not None and ctx.disable_radix_cache:
        return False  # a chunk cache
    if envs.SGLANG_EXPERIMENTAL_CPP_RADIX_TREE.get() or envs.SGLANG_ENABLE_UNIFIED_RADIX_TREE.get() or use_mlx():
        return False
    if ctx.enable_hierarchical_cache:
        return False
    return bool(ctx.is_hybrid_swa) and ctx.full_tokens_per_layer != 0  # 0: PureSWARadixCache


def default_builds_radix_cache(ctx: Any) -> bool:
    """Whether SGLang 0.5.15's ``default_radix_cache_factory`` builds a plain ``RadixCache`` for
    ``ctx`` (the chain's last branch; a drift test compares the two)."""
    from sglang.srt.environ import envs
    from sglang.srt.utils.tensor_bridge import use_mlx

    if ctx.effective_chunked_prefill_size is not None and ctx.disable_radix_cache:
        return False  # a chunk cache
    if envs.SGLANG_EXPERIMENTAL_CPP_RADIX_TREE.get() or envs.SGLANG_ENABLE_UNIFIED_RADIX_TREE.get() or use_mlx():
        return False
    if ctx.enable_hierarchical_cache or ctx.is_hybrid_swa or ctx.is_hybrid_ssm:
        return False
    return not ctx.server_args.enable_lmcache


def default_builds_mamba_radix_cache(ctx: Any) -> bool:
    """Whether SGLang 0.5.15's ``default_radix_cache_factory`` builds a ``MambaRadixCache`` for
    ``ctx`` (its selection chain, in its order; a drift test compares the two)."""
    from sglang.srt.environ import envs
    from sglang.srt.utils.tensor_bridge import use_mlx

    if ctx.effective_chunked_prefill_size is not None and ctx.disable_radix_cache:
        return False  # ChunkCache
    if envs.SGLANG_EXPERIMENTAL_CPP_RADIX_TREE.get() or envs.SGLANG_ENABLE_UNIFIED_RADIX_TREE.get() or use_mlx():
        return False
    if ctx.enable_hierarchical_cache or ctx.is_hybrid_swa:
        return False
    return bool(ctx.is_hybrid_ssm)
