"""The emulated engine's prefix cache: page blocks, LRU, hybrid checkpoints (pure).

Blocks are full pages keyed by SGLang's chained digests (``engine.blocks``).
A prefix is reusable up to the longest matched chain of blocks; for a hybrid
model (linear attention / SWA state), only up to the longest *state
checkpoint* inside that match, because recurrent state can only be resumed at
the exact length where it was saved (SGLang's MambaRadixCache does the same).
Checkpoints are taken where the engine would save state: at every
``checkpoint_interval_tokens`` boundary of a prefill (SGLang's chunk ends;
None with ``PRFAAS_STATE_CHECKPOINTS=end``) and at the prompt's last full page.

Every mutation returns the KV events it causes (BlockStored / BlockRemoved),
in the order SGLang would emit them, and for a hybrid model the state events
our SGLang cache backend adds (StateStored when a block becomes a checkpoint,
StateRemoved when a checkpoint block is evicted; ``wire.kv_events`` v2), so a
KV index holds exactly this cache's checkpoints. Eviction is LRU over blocks;
parents are always more recent than their children, so leaves go first.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain, takewhile

from prfaas_sglang.wire.blocks import PageIdMemo
from prfaas_sglang.wire.kv_events import (
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    StateRemoved,
    StateStored,
)


@dataclass(frozen=True)
class Match:
    """``cached_tokens``: reusable prefix length (page-aligned, checkpoint-limited when hybrid)."""

    matched_blocks: int  # full-attention blocks found
    cached_tokens: int


@dataclass
class _Block:
    parent: int | None  # event id of the parent block
    checkpoint: bool  # a linear-state checkpoint ends at this block
    num_tokens: int  # the prefix length this block ends


MEMO_SEGMENTS = 1 << 13  # of 256 tokens: 2M tokens of prompts, about 18 MB at page size 1


class PrefixCache:
    def __init__(self, page_size: int, capacity_blocks: int, hybrid: bool, checkpoint_interval_tokens: int | None = 8192):
        """``checkpoint_interval_tokens``: a state checkpoint every so many tokens of a prefill (its
        chunk size) besides the one at its last full page; None: the last full page only."""
        if page_size <= 0 or capacity_blocks <= 0:
            raise ValueError("page_size and capacity_blocks must be positive")
        if checkpoint_interval_tokens is not None and checkpoint_interval_tokens <= 0:
            raise ValueError("checkpoint_interval_tokens must be positive or None")
        self.page_size = page_size
        self.capacity_blocks = capacity_blocks
        self.hybrid = hybrid
        self.checkpoint_interval_tokens = checkpoint_interval_tokens
        self._blocks: OrderedDict[int, _Block] = OrderedDict()
        # Block ids of prompts hashed before: at page size 1 (Kimi Linear's) hashing is a SHA-256
        # per token, 36 ms per 32K-token prompt, twice or more per request (match, insert).
        self._memo = PageIdMemo(max_segments=MEMO_SEGMENTS)

    def __len__(self) -> int:
        return len(self._blocks)

    def _ids(self, token_ids: Sequence[int]) -> list[int]:
        return list(chain.from_iterable(self._memo.segments(token_ids, self.page_size)))

    def _held(self, ids: list[int]) -> int:
        """How many of ``ids`` from the start this cache holds (the walk in C: a cached 32K-token
        prompt at page size 1 is 32K lookups)."""
        return len(list(takewhile(self._blocks.__contains__, ids)))

    def _touch(self, ids: Sequence[int]) -> None:
        """Mark ``ids`` (a chain, parents first) recently used, children first so parents end up most recent."""
        deque(map(self._blocks.move_to_end, reversed(ids)), maxlen=0)

    def match(self, token_ids: Sequence[int]) -> Match:
        """Reusable prefix of ``token_ids``. Marks the matched blocks recently used; no events."""
        return self._match(self._ids(token_ids))

    def _match(self, ids: list[int]) -> Match:
        matched = self._held(ids)
        best = matched
        if self.hybrid:  # back to the last checkpoint inside the match
            while best and not self._blocks[ids[best - 1]].checkpoint:
                best -= 1
        self._touch(ids[:matched])
        return Match(matched, best * self.page_size)

    def decode_reusable_tokens(self, token_ids: Sequence[int]) -> int:
        """What a decode worker's cache supplies of ``token_ids`` (``hooks/decode_radix``'s rule: a
        decode worker never resumes a state, its request's state always ships): the matched
        full-attention pages whatever their checkpoints, for a hybrid model a page short of a
        checkpoint the match would end at (SGLang would pin that state with the match's lock)."""
        ids = self._ids(token_ids)
        reusable = self._match(ids).matched_blocks
        if self.hybrid:
            while reusable and self._blocks[ids[reusable - 1]].checkpoint:
                reusable -= 1
        return reusable * self.page_size

    def insert(self, token_ids: Sequence[int], medium: str = "GPU", checkpoints_at: Sequence[int] = (),
               chunk_checkpoints: bool = True) -> list[KVCacheEvent]:
        """Cache every full page of a prefilled prompt; returns its block events, then (hybrid)
        its state events (the order a v2 batch applies them in). ``checkpoints_at``: prefix lengths
        (tokens) where a state was asked for besides the usual places (a router's hint), each at
        the page boundary at or below it. ``chunk_checkpoints`` False: no state at chunk boundaries
        (a decode worker's finished sequence: SGLang donates its state at the end only)."""
        ids = self._ids(token_ids)
        if not ids:
            return []
        interval = self.checkpoint_interval_tokens if chunk_checkpoints else None
        interval_blocks = max(interval // self.page_size, 1) if interval is not None else len(ids)
        asked = {n // self.page_size - 1 for n in checkpoints_at if n >= self.page_size}
        events: list[KVCacheEvent] = []
        states: list[KVCacheEvent] = []
        held = self._held(ids)
        #   ids:  | held: already cached, only checkpoints to add | new: a block (and event) per page |
        #         0                                              held                               len(ids)
        wanted = (set(range(interval_blocks - 1, len(ids), interval_blocks)) | {len(ids) - 1} | asked) if self.hybrid else set()
        for i in sorted(i for i in wanted if i < held):
            block = self._blocks[ids[i]]
            if not block.checkpoint:
                block.checkpoint = True
                states.append(StateStored(ids[i], (i + 1) * self.page_size, "mamba", medium))
        for i in range(held, len(ids)):
            block_id = ids[i]
            block = self._blocks.get(block_id)
            if block is None:
                parent = ids[i - 1] if i else None
                block = self._blocks[block_id] = _Block(parent, False, (i + 1) * self.page_size)
                page = list(token_ids[i * self.page_size : (i + 1) * self.page_size])
                # One BlockStored per page, as SGLang's KVCacheEventMixin emits them.
                events.append(BlockStored([block_id], parent, page, self.page_size, None, medium))
            if i in wanted and not block.checkpoint:
                block.checkpoint = True
                states.append(StateStored(block_id, (i + 1) * self.page_size, "mamba", medium))
        self._touch(ids)
        evicted, lost_states = self._evict(medium)
        return events + evicted + states + lost_states

    def _evict(self, medium: str) -> tuple[list[KVCacheEvent], list[KVCacheEvent]]:
        """(BlockRemoved, StateRemoved per evicted checkpoint) for what exceeds the capacity."""
        removed, states = [], []
        while len(self._blocks) > self.capacity_blocks:
            block_id, block = self._blocks.popitem(last=False)
            removed.append(block_id)
            if block.checkpoint:
                states.append(StateRemoved(block_id, block.num_tokens, "mamba", medium))
        return ([BlockRemoved(removed, medium)] if removed else []), states

    def clear(self) -> None:
        self._blocks.clear()
