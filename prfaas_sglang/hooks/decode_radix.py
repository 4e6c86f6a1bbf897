"""Decode-side radix cache for hybrid (linear-attention) models on SGLang 0.5.15.

SGLang 0.5.15 refuses ``--disaggregation-decode-enable-radix-cache`` for Mamba/SSM hybrids
(``kv_cache_builder.build_kv_cache``), so every turn of a conversation ships its whole prefix's
full-attention KV from the prefill worker again, across the PrfaaS link when the prefill was
remote. Yet a decode worker never needs a linear state from its tree: the prefill worker always
sends the request's final state after the last KV chunk (``MooncakeKVManager.maybe_send_extra``),
into the slot the decode worker allocated for the request. What a decode worker can reuse is
full-attention KV alone, and SGLang's PD protocol already carries how much of it the decode worker
holds (``decode_prefix_len``: the prefill worker starts sending there).

This is the shape upstream took (sglang #32732, #38634, and Kimi Linear decode radix over Mooncake
TCP in #40263's line), backported as three parts:

* patch ``0001`` asks :func:`allows_hybrid_decode_radix` before refusing: yes when the decode
  worker runs the ``prfaas-hybrid`` radix-cache backend with SGLang's ``no_buffer`` Mamba
  strategy (page size 1; Kimi Linear's only strategy); a typed refusal with the fix for
  ``extra_buffer``, whose insert path tracks states only during prefill forwards, which a decode
  worker never runs;
* :class:`DecodeMambaRadixCache`, which the backend builds on a decode worker: ``match_prefix``
  matches full-attention KV only (upstream's ``skip_mamba_match``), takes no state from the tree
  (no copy-on-write: the state arrives over the network), leaves the prompt's last token
  unmatched, so every transfer has a KV chunk for the state to follow as it always does, and
  stops a page short of a node that holds a state, so that the lock SGLang takes on the match
  pins KV only (SGLang's lock pins a matched node's state too: a slot the request never reads,
  and with one per running request the pool, sized for the requests' own, runs dry)::

      prompt   |<---- full-attention KV in the tree ---->|<----- not in the tree ------>|
               0                                    matched (<= len - 1)              len
               reused, locked until the request ends | shipped (decode_prefix_len = matched)
      state    the request's final state, at len: always shipped into the request's own slot

  When the request ends SGLang inserts its KV and donates its state slot to the tree, as on a
  prefill worker; those states are a cache of free slots and leave first when slots run short;
* the hook :func:`make_room_for_state` (before ``DecodePreallocQueue._pre_alloc``): a decode
  request takes a state slot from the pool that the tree's donated states share, and 0.5.15
  takes it without evicting (an allocator assert when the tree holds the rest); the hook evicts
  the least recently used unlocked state first, as SGLang's colocated admission does
  (``alloc_req_slots``; upstream's fix in #38634).
"""

from __future__ import annotations

from typing import Any

import torch
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, MatchResult
from sglang.srt.mem_cache.mamba_radix_cache import get_last_access_time

from prfaas_sglang.hooks.hybrid_cache import RADIX_CACHE_BACKEND, StateEventsMambaRadixCache


class DecodeRadixConfigError(ValueError):
    """The decode worker's flags ask for a decode-side radix cache this backport cannot serve
    (raised where SGLang raises its own refusal: a ``ValueError`` at startup)."""


def allows_hybrid_decode_radix(server_args: Any) -> bool:
    """Patch 0001's seam, in ``build_kv_cache`` on a decode worker with the decode radix cache on
    and a Mamba/SSM model: True when this backport serves it (the ``prfaas-hybrid`` backend, the
    ``no_buffer`` strategy); False leaves SGLang's own refusal standing (another backend).
    Raises :class:`DecodeRadixConfigError` for ``extra_buffer``, naming the fix."""
    if getattr(server_args, "radix_cache_backend", None) != RADIX_CACHE_BACKEND:
        return False
    if server_args.enable_mamba_extra_buffer():
        raise DecodeRadixConfigError(
            "--disaggregation-decode-enable-radix-cache with a Mamba/SSM model needs "
            "--mamba-radix-cache-strategy no_buffer (page size 1) on the decode worker: with "
            f"{server_args.mamba_radix_cache_strategy!r} SGLang 0.5.15 keeps states only where a prefill "
            "forward tracked them, and a decode worker runs none")
    return True


class DecodeMambaRadixCache(StateEventsMambaRadixCache):
    """A decode worker's tree for a hybrid model (see the module docstring): matches
    full-attention KV only, never copies a state out of the tree, never matches a prompt's last
    token. Inserts, eviction, locking and state events are ``MambaRadixCache``'s (and
    :class:`StateEventsMambaRadixCache`'s); no prefill admission policy (nothing is prefilled here).

    ``match_prefix`` contract: the result's ``device_indices`` are the KV slots of the prompt's
    first ``len(device_indices)`` tokens, held by the tree; ``last_device_node`` is the node they
    end at, which holds no state; the caller locks it (``inc_lock_ref``: its KV and its ancestors')
    and unlocks it when the request ends. The request's state slot is untouched.
    """

    def __init__(self, params: Any):
        super().__init__(params, admission=None)

    def match_prefix(self, params: Any) -> MatchResult:
        key = params.key
        usable = (len(key) - 1) // self.page_size * self.page_size if len(key) else 0
        if self.disable or usable <= 0:
            return self._result([], self.root_node)
        value, node = self._match_full_attention(key[:usable])
        self.full_lru_list.reset_node_and_parents_mru(node, self.root_node)
        self.mamba_lru_list.reset_node_and_parents_mru(node, self.root_node)
        now = get_last_access_time()
        walk = node
        while walk is not None:  # as MambaRadixCache: nodes nearer the root count as less recently used
            walk.last_access_time = now
            now -= 0.00001
            walk = walk.parent
        return self._result(value, node)

    def _match_full_attention(self, key: Any) -> tuple[list, Any]:
        """The tree's pages along ``key`` whatever their states, and the node they end at
        (splitting a node a match ends inside, as SGLang's own walk does), which never holds a state."""
        node, value = self.root_node, []
        while len(key) > 0:
            child = node.children.get(key.child_key(self.page_size))
            if child is None:
                break
            matched = child.key.match(key, page_size=self.page_size)
            if matched < len(child.key):
                node = self._split_node(child.key, child, matched)
                value.append(node.value)
                break
            value.append(child.value)
            node, key = child, key[matched:]
        while node is not self.root_node and node.mamba_value is not None:
            # Stop a page short of a node holding a state: the caller's lock then pins its KV only,
            # never a state slot this request does not use (SGLang locks a matched node's state too).
            if len(node.key) > self.page_size:
                node = self._split_node(node.key, node, len(node.key) - self.page_size)
                value[-1] = node.value
            else:
                value.pop()
                node = node.parent
        return value, node

    def _result(self, value: list, node: Any) -> MatchResult:
        indices = torch.cat(value) if value else torch.empty((0,), dtype=torch.int64, device=self.device)
        return MatchResult(device_indices=indices, last_device_node=node, last_host_node=node, best_match_node=node)


def make_room_for_state(queue: Any, req: Any, *args: Any, **kwargs: Any) -> None:
    """BEFORE ``DecodePreallocQueue._pre_alloc``: with a :class:`DecodeMambaRadixCache`, a request
    about to take a state slot finds one free, the tree's least recently used unlocked state
    evicted for it if needed. Anything else: nothing. When every state is locked (each by a
    running request) the pool is sized for them (``max_running_requests`` plus the pre-allocation
    room), so a slot is free."""
    tree = queue.tree_cache
    if not isinstance(tree, DecodeMambaRadixCache) or getattr(req, "mamba_pool_idx", None) is not None:
        return
    if queue.req_to_token_pool.mamba_allocator.available_size() < 1:
        tree.evict(EvictParams(num_tokens=0, mamba_num=1))
