"""SGLang's KV-event wire format (``sglang/srt/disaggregation/kv_events.py``, 0.5.15), re-declared.

ZMQ PUB frames: ``(topic, seq as 8-byte big-endian, msgpack(KVEventBatch))``.
Structs are msgspec ``array_like`` and events are tagged with their class
name, so a batch encodes as ``[ts, [["BlockStored", [...], ...], ...], dp_rank]``.
The declarations mirror upstream field for field; ``tests/engine`` decodes
our frames with SGLang's own classes to prove it.

Wire history (ours follows upstream's; bump if upstream changes):
  1: SGLang 0.5.15 BlockStored / BlockRemoved / AllBlocksCleared.
"""

from __future__ import annotations

from typing import Any

import msgspec

WIRE_VERSION = 1
# The topic our launcher configures (``--kv-events-config``) and the emulated engine
# publishes on; a worker's ``/server_info["kv_events"]["topic"]`` says which one it uses.
KV_EVENTS_TOPIC = "kv-events"


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    attn_dp_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base of the tagged event union."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(KVEventBatch)


def encode_batch(batch: KVEventBatch) -> bytes:
    return _ENCODER.encode(batch)


def decode_batch(payload: bytes) -> KVEventBatch:
    return _DECODER.decode(payload)
