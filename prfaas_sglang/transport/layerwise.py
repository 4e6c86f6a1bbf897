"""Layer-wise KV streaming: what a chunk sends, per layer, and the claims that send each block once (pure).

With layer-wise streaming a PrfaaS prefill worker sends a layer's KV for the chunk being
prefilled as soon as the forward has written that layer, instead of the whole chunk after the
forward. SGLang still makes its own per-chunk send afterwards (``send_kv_chunk`` ->
``_transfer_data``), unchanged; this module decides, block by block, what that send still has
to carry. A *block* is one ``(src_addr, dst_addr, length_bytes)`` write, exactly as SGLang's
``_send_kvcache_generic`` builds it: per layer, K then V (one buffer for MLA), per run of pages
contiguous on both sides.

Which tokens a chunk sends (:func:`chunk_range`), SGLang 0.5.15's ``send_kv_chunk`` arithmetic::

    token  0        first (page-aligned)                 end                        total
           |-- earlier chunks sent it --|===== this chunk =====|-- later chunks --|
                                         end = total                 on the last chunk
                                         end = floor(extend_end / page) * page   otherwise
                                         (a partial last page waits for the next chunk)

and where they go: page ``i`` of the chunk lands in the decode's page
``dst_kv_indices[dst_first_page + i]``, where ``dst_first_page`` counts the pages SGLang's
sender already sent for the room (its ``curr_idx``).

A :class:`LayerLedger` holds the chunks planned for the forward in flight. The streamer
:meth:`~LayerLedger.claim`\\ s a layer once its KV is written and sends the blocks it gets;
SGLang's later send of the chunk is :meth:`~LayerLedger.settle`\\ d: blocks already claimed are
dropped from it, the rest (layers not yet claimed, or anything the plan did not foresee) go as
SGLang built them, and the chunk closes, so a late claim gets nothing. A plan that disagrees with
SGLang's send costs duplicate bytes (counted), never wrong ones: every planned block is a page
whose layer is final, written to the decode page SGLang itself would write it to.

The caller serialises access (one lock) and makes a claim and the submission of its writes
atomic with respect to :meth:`~LayerLedger.settle` (else the aux could overtake them).
"""

from __future__ import annotations

from collections.abc import Container, Iterable, Sequence
from dataclasses import dataclass, field

Block = tuple[int, int, int]  # (src_addr, dst_addr, length_bytes)


@dataclass(frozen=True)
class ChunkRange:
    """Tokens ``[first_token, end_token)`` of a request that one chunk sends."""

    first_token: int
    end_token: int
    last: bool


def chunk_range(first_token: int, extend_end_token: int, total_tokens: int, page_size: int) -> ChunkRange | None:
    """The tokens a chunk whose forward ends at ``extend_end_token`` sends, from ``first_token``
    (page-aligned: where the previous send stopped); None when it sends no page (SGLang then skips
    a middle chunk; a last chunk with no page left still sends its state and aux, not streamed)."""
    if page_size < 1 or first_token % page_size:
        raise ValueError(f"first_token {first_token} is not aligned to page_size {page_size}")
    last = extend_end_token >= total_tokens
    end = min(extend_end_token, total_tokens)
    if not last:
        end -= end % page_size
    if end <= first_token:
        return None
    return ChunkRange(first_token, end, last)


def runs(src_pages: Sequence[int], dst_pages: Sequence[int]) -> list[tuple[int, int, int]]:
    """``(src_first, dst_first, num_pages)`` per run contiguous on both sides, in order: SGLang's
    ``group_concurrent_contiguous``."""
    if len(src_pages) != len(dst_pages):
        raise ValueError(f"{len(src_pages)} source pages for {len(dst_pages)} destination pages")
    out: list[tuple[int, int, int]] = []
    for s, d in zip(src_pages, dst_pages, strict=True):
        s, d = int(s), int(d)
        if out and out[-1][0] + out[-1][2] == s and out[-1][1] + out[-1][2] == d:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + 1)
        else:
            out.append((s, d, 1))
    return out


def layer_blocks(page_runs: Iterable[tuple[int, int, int]],
                 buffers: Sequence[tuple[int, int, int]]) -> list[Block]:
    """One layer's blocks: for each of its buffers ``(src_ptr, dst_ptr, item_len_bytes)`` (K then V;
    one for MLA), one block per run, as SGLang's ``set_transfer_blocks`` builds them."""
    page_runs = list(page_runs)
    return [(src_ptr + s * item, dst_ptr + d * item, item * n)
            for src_ptr, dst_ptr, item in buffers for s, d, n in page_runs]


@dataclass
class _Chunk:
    room: int
    session: str
    layers: dict[int, list[Block]]
    claimed: set[int] = field(default_factory=set)


@dataclass(frozen=True)
class Settled:
    """What SGLang's send of some blocks still has to carry, and what the streamer already did."""

    to_send: list[Block]
    streamed_bytes: int  # dropped: a claimed layer's block
    unplanned_bytes: int  # sent as SGLang built them: no open chunk had the block


@dataclass
class LayerLedger:
    """Chunks planned for streaming, per decode session, until SGLang's send of each settles it."""

    _chunks: dict[int, _Chunk] = field(default_factory=dict)
    _owner: dict[str, dict[Block, tuple[int, int]]] = field(default_factory=dict)  # session -> block -> (chunk, layer)
    _next_key: int = 0

    def open(self, room: int, session: str, layers: dict[int, list[Block]]) -> int:
        """Plan a chunk of ``room`` to ``session``: its blocks per layer index. Returns its key."""
        key = self._next_key
        self._next_key += 1
        self._chunks[key] = _Chunk(room, session, {i: list(b) for i, b in layers.items()})
        owner = self._owner.setdefault(session, {})
        for layer, blocks in layers.items():
            for block in blocks:
                owner[block] = (key, layer)
        return key

    def claim(self, key: int, layer: int) -> list[Block]:
        """The blocks of ``layer`` of chunk ``key`` to send now, once: [] when the chunk is settled or
        dropped, the layer is not one of its layers, or it was claimed before."""
        chunk = self._chunks.get(key)
        if chunk is None or layer not in chunk.layers or layer in chunk.claimed:
            return []
        chunk.claimed.add(layer)
        return chunk.layers[layer]

    def settle(self, session: str, blocks: Iterable[tuple[int, int, int]]) -> Settled:
        """SGLang sends ``blocks`` to ``session`` now: drop those of claimed layers, keep the rest, and
        close every chunk they touch (its unclaimed layers travel with this send)."""
        owner = self._owner.get(session, {})
        to_send: list[Block] = []
        touched: set[int] = set()
        streamed = unplanned = 0
        for raw in blocks:
            block = (int(raw[0]), int(raw[1]), int(raw[2]))
            hit = owner.get(block)
            if hit is None:
                to_send.append(block)
                unplanned += block[2]
                continue
            key, layer = hit
            touched.add(key)
            if layer in self._chunks[key].claimed:
                streamed += block[2]
            else:
                to_send.append(block)
        for key in touched:
            self._close(key)
        return Settled(to_send, streamed, unplanned)

    def drop_rooms(self, live_rooms: Container[int]) -> int:
        """Close the chunks of rooms not in ``live_rooms`` (failed, aborted, retried); how many."""
        dead = [key for key, chunk in self._chunks.items() if chunk.room not in live_rooms]
        for key in dead:
            self._close(key)
        return len(dead)

    def open_chunks(self) -> int:
        return len(self._chunks)

    def _close(self, key: int) -> None:
        chunk = self._chunks.pop(key)
        owner = self._owner.get(chunk.session, {})
        for blocks in chunk.layers.values():
            for block in blocks:
                if owner.get(block, (None,))[0] == key:
                    del owner[block]
        if not owner:
            self._owner.pop(chunk.session, None)
