"""``prfaas-hybrid`` on SGLang's unified radix tree (SGLang 0.5.23): state events and prefill admission.

SGLang 0.5.23 serves every model kind from one tree (``UnifiedRadixCache``) whose per-node data are
*components* (full-attention KV, sliding-window KV, Mamba state). It reports pages only, as 0.5.15
did: a Mamba state stored on a prefix, or evicted from it while its pages stay, is not published,
yet it decides how much of the prefix a hybrid model can reuse. Both parts below go through the
extension points that release provides, no patch:

* :class:`StateEventsMambaComponent`, SGLang's ``MambaComponent`` (through
  ``CacheInitParams.component_registry_override``) that tells its cache where a state was stored
  and evicted. A custom component runs on SGLang's Python tree core (SGLang selects it for any
  override: its Rust core runs the component hooks natively, out of reach), so a hybrid model's
  ``prfaas-hybrid`` tree pays the Python core's cost, as every tree did on 0.5.15.
* :class:`PrfaasUnifiedRadixCache` (``create_unified_radix_cache``'s ``cache_class``): the state
  events, queued beside SGLang's block events (:class:`EventsWithState`), and a PrfaaS prefill
  worker's admission (:mod:`prfaas_sglang.kvindex.admission`): a request decided *transfer cache*
  at its first match is marked ``skip_radix_cache_insert``, SGLang's own flag for a request barred
  from the tree: none of its chunks is checkpointed, and SGLang frees all beyond its cached prefix,
  state slot included, when it releases the request after its KV transfer.

Not ported to this tree yet (0.5.15 has them): a checkpoint hint's keep-to-checkpoint (a hinted
one-off is transfer cache here), sliding-window state events (an SWA model's batches carry no state
list, which consumers read as "reports no state"), and the decode radix cache (upstream's own serves
decode). Cache moves are ported: :mod:`prfaas_sglang.hooks.cache_import_unified`.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from sglang.srt.disaggregation.kv_events import namespaced_block_hash
from sglang.srt.mem_cache.unified_cache.components import ComponentType
from sglang.srt.mem_cache.unified_cache.components.base import EvictLayer
from sglang.srt.mem_cache.unified_cache.components.mamba import MambaComponent
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
from sglang.srt.mem_cache.utils import hash_str_to_int64

from prfaas_sglang.hooks.event_publisher import EventsWithState
from prfaas_sglang.hooks.radix_nodes import prefix_len
from prfaas_sglang.kvindex.admission import MAX_PENDING_DECISIONS, Decision, PrefixAdmission
from prfaas_sglang.wire.kv_events import DEVICE_MEDIUM, StateRemoved, StateStored


class StateEventsMambaComponent(MambaComponent):
    """SGLang's Mamba component, telling its cache (a :class:`PrfaasUnifiedRadixCache`) each node
    whose device state it stored (an insert's end, a tombstone given a state again) or dropped
    (evicted: a tombstone, or with its leaf). A split moves no state: SGLang keeps it on the child,
    whose end and id are unchanged."""

    def commit_insert_component_data(self, node: Any, is_new_leaf: bool, params: Any, result: Any,
                                      cache_actions: list) -> None:
        super().commit_insert_component_data(node, is_new_leaf, params, result, cache_actions)
        if node.component_data[self.component_type].value is not None:
            self.cache.state_stored(node)

    def evict_component(self, node: Any, device_frees: dict, host_frees: dict, cache_actions: list,
                        target: EvictLayer = EvictLayer.DEVICE) -> tuple[int, int]:
        data = node.component_data[self.component_type]
        held = data.value is not None
        freed = super().evict_component(node, device_frees, host_frees, cache_actions, target)
        if held and data.value is None:
            self.cache.state_removed(node)
        return freed


class PrfaasUnifiedRadixCache(UnifiedRadixCache):
    """SGLang's unified tree with state events (where the tree has a Mamba component; with
    :class:`StateEventsMambaComponent` in it) and, with ``admission``, a PrfaaS prefill worker's
    admission policy. Each request is decided once, at its first ``match_prefix`` that names it (the
    scheduler's); a decision is dropped when SGLang releases the request. Records state only while
    KV events are enabled; a reset clears all (SGLang's ``AllBlocksCleared``)."""

    def __init__(self, params: Any, admission: PrefixAdmission | None = None, chunk_checkpoints: bool = True):
        self.admission = admission
        # False: no request's chunks go into the tree, a state only at a request's end
        # (PRFAAS_STATE_CHECKPOINTS=end; each checkpoint is a state slot).
        self.chunk_checkpoints = chunk_checkpoints
        self._decided: OrderedDict[str, Decision] = OrderedDict()  # rid -> decision (decided, not released)
        self._state_queue: list = []
        self._stated: dict[int, tuple[int, int]] = {}  # node id -> (block hash, num_tokens) reported
        super().__init__(params)

    # --- admission ------------------------------------------------------------------------------

    def match_prefix(self, params: Any):
        result = super().match_prefix(params)
        req = params.req
        if self.admission is not None and req is not None and req.rid not in self._decided:
            key = params.key
            decision = self.admission.decide(list(key.token_ids[: len(key)]), result.device_prefix_len)
            self._decided[req.rid] = decision
            while len(self._decided) > MAX_PENDING_DECISIONS:
                self._decided.popitem(last=False)
            if not decision.keep:
                req.skip_radix_cache_insert = True  # transfer cache: SGLang keeps it out of the tree
        return result

    def checkpoint(self, req: Any, *, up_to: int, **kwargs) -> None:
        if not self.chunk_checkpoints and not req.finished():
            return  # the chunk stays the request's own, as for a request barred from the tree
        super().checkpoint(req, up_to=up_to, **kwargs)

    def on_release(self, req: Any, *, checkpointed: bool) -> None:
        self._decided.pop(req.rid, None)
        super().on_release(req, checkpointed=checkpointed)

    # --- state events ---------------------------------------------------------------------------

    def reset(self) -> None:
        super().reset()
        self._state_queue, self._stated = [], {}

    def take_events(self):
        """This batch's block events, and its state events where the tree has a Mamba component
        (:class:`EventsWithState`); a plain list (no state reported) otherwise."""
        events = super().take_events()
        if not isinstance(self.components.get(ComponentType.MAMBA), StateEventsMambaComponent):
            return events
        states, self._state_queue = self._state_queue, []
        return EventsWithState(events, states)

    def state_stored(self, node: Any) -> None:
        """``node`` holds a device state at its end (its component told so)."""
        if self.tree_core.kv_events.enabled and node.id not in self._stated:
            self._stated[node.id] = stated = (self._last_page_hash(node), prefix_len(node, self.root_node))
            self._state_queue.append(StateStored(*stated, "mamba", DEVICE_MEDIUM))

    def state_removed(self, node: Any) -> None:
        """``node``'s device state was evicted (its pages may stay: a tombstone)."""
        stated = self._stated.pop(node.id, None)
        if stated is not None:
            self._state_queue.append(StateRemoved(*stated, "mamba", DEVICE_MEDIUM))

    def _last_page_hash(self, node: Any) -> int:
        """The block hash SGLang's own ``BlockStored`` gave ``node``'s last page (its recorder's hashing)."""
        recorder = self.tree_core.kv_events
        page = recorder._node_event_hash_values(node)[-1]
        return namespaced_block_hash(hash_str_to_int64(page), namespace_seed=recorder._namespace_seed(node))


def builds_unified(ctx: Any) -> bool:
    """Whether SGLang 0.5.23's ``default_radix_cache_factory`` builds a working (not disabled) unified
    tree for ``ctx`` (its selection chain, in its order; a drift test compares the two)."""
    from sglang.srt.runtime_context import get_memory

    memory = get_memory()
    if ctx.disable_radix_cache or memory.enable_lmcache:
        return False
    if memory.enable_unified_cache_external_linker:
        return True
    if ctx.is_hybrid_swa and ctx.full_tokens_per_layer == 0:  # PureSWARadixCache
        return False
    return not memory.enable_flexkv


def build_unified(ctx: Any, admission: PrefixAdmission | None, chunk_checkpoints: bool):
    """Where SGLang builds its unified tree, ours (state events for a hybrid-SSM model, the admission
    policy); SGLang's own choice anywhere else."""
    from sglang.srt.mem_cache.registry import (
        create_unified_radix_cache,
        default_radix_cache_factory,
    )

    if not builds_unified(ctx):
        return default_radix_cache_factory(ctx)
    if ctx.is_hybrid_ssm:
        ctx.params.component_registry_override = {**(ctx.params.component_registry_override or {}),
                                                  ComponentType.MAMBA: StateEventsMambaComponent}
    return create_unified_radix_cache(
        ctx, cache_class=lambda params: PrfaasUnifiedRadixCache(params, admission, chunk_checkpoints))
