"""SGLang's KV-event wire format (``sglang/srt/disaggregation/kv_events.py``, 0.5.15), re-declared,
plus this distribution's backwards-compatible extension for hybrid-model state.

ZMQ PUB frames: ``(topic, seq as 8-byte big-endian, msgpack(KVEventBatch))``.
Structs are msgspec ``array_like`` and events are tagged with their class
name, so a batch encodes as ``[ts, [["BlockStored", [...], ...], ...], dp_rank]``.
The declarations mirror upstream field for field; ``tests/engine`` decodes
our frames with SGLang's own classes to prove it.

State events (v2). SGLang 0.5.15 reports pages only: storing or evicting the
linear-attention (Mamba) state of a prefix emits nothing, although it decides
how much of the prefix a hybrid model can reuse. A publisher of ours appends
one more element to the batch array, ``state_events`` (always a list, possibly
empty, so its presence says "this worker reports state")::

    [ts, events, attn_dp_rank, [["StateStored", block_hash, num_tokens, "mamba", "GPU"], ...]]

msgspec ignores trailing elements of an ``array_like`` struct, so SGLang's own
``KVEventBatch`` and every consumer that decodes 0.5.15 batches read such a
batch as before and never see the state (tested against SGLang's class). The
events follow the component-typed KV events upstream is moving to (in upstream's
main source behind ``--enable-kv-events-component-types``; not in the 0.5.23
wheel, which has neither the flag nor the types; sglang PR #32514 proposes
``component_types`` per stored page): one event per state checkpoint,
anchored to the chained hash of the prefix's last page, labelled with its
component (``"mamba"``, or ``"swa"``: a page's window KV, see :class:`StateStored`), plus the prefix length in
tokens, which upstream leaves to the consumer's block depth.

Contract of ``state_events``: it reports every change of the cache's state
checkpoints, including a state that leaves with its node, and applies after
the same batch's ``events``; a state is held at most where its page is held.

Wire history (ours follows upstream's; bump if upstream changes):
  1: SGLang 0.5.15 BlockStored / BlockRemoved / AllBlocksCleared.
  2: + the batch's 4th element ``state_events`` (StateStored / StateRemoved);
     a v1 batch decodes with ``state_events`` None.
  3: StateStored and StateRemoved may carry ``window_tokens`` (trailing, optional; v2 decoders
     ignore it): ``"swa"`` events, sent only when a stored page loses its sliding-window KV
     (StateRemoved) or gets it back (StateStored).
  SGLang 0.5.23 writes events as tagged maps (``{"type": "BlockStored", ...}``, optional fields
  omitted, new ones such as ``cache_salt``) in the same batch array; :func:`decode_batch` takes
  those too, so a kv-index of this pin reads a newer worker, and :func:`encode_batch` writes them
  (``events_as_maps``) where the emulated engine runs beside such an SGLang.
"""

from __future__ import annotations

from typing import Any

import msgspec

WIRE_VERSION = 3
# The topic our launcher configures (``--kv-events-config``) and the emulated engine
# publishes on; a worker's ``/server_info["kv_events"]["topic"]`` says which one it uses.
KV_EVENTS_TOPIC = "kv-events"
STATE_COMPONENTS = ("mamba", "swa")
DEVICE_MEDIUM = "GPU"  # a state event's medium from a device tree (SGLang's StorageMedium.GPU); a host tier says its own


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


class StateStored(KVCacheEvent):
    """A state checkpoint now exists for the prefix ending at page ``block_hash``
    (``num_tokens`` long): a hybrid model can resume there.

    ``component_type="swa"`` (v3): page ``block_hash`` holds its sliding-window KV again after a
    :class:`StateRemoved` (``num_tokens``: the prefix length at the page's end; ``window_tokens``:
    the model's window). A stored page holds it unless a StateRemoved said otherwise, so only
    changes are sent. A prefix is resumable at L when every page of its last ``window_tokens``
    tokens, or of all of it, holds it (SGLang's ``SWARadixCache.match_prefix``)."""

    block_hash: int
    num_tokens: int
    component_type: str = "mamba"
    medium: str | None = None
    window_tokens: int | None = None


class StateRemoved(KVCacheEvent):
    """The state checkpoint at page ``block_hash`` is gone (evicted alone, or with its pages);
    ``"swa"`` (v3): the page stays but without its sliding-window KV (a tombstone, or stored
    without it), ``window_tokens`` the model's window. A removed page takes either along."""

    block_hash: int
    num_tokens: int
    component_type: str = "mamba"
    medium: str | None = None
    window_tokens: int | None = None


StateEvent = StateStored | StateRemoved


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    # v2: None from a publisher that does not report state (SGLang's own, v1).
    state_events: list[StateStored | StateRemoved] | None = None


# SGLang 0.5.23's map-encoded events (decode only; unknown keys ignored), mapped onto ours.
class _MapEvent(msgspec.Struct, tag=True, gc=False):
    pass


class _BlockStoredMap(_MapEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None = None
    token_ids: list[int] = []
    block_size: int = 0
    lora_id: int | None = None
    medium: str | None = None


class _BlockRemovedMap(_MapEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None = None


class _AllBlocksClearedMap(_MapEvent, tag="AllBlocksCleared"):
    pass


class _MapBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[_BlockStoredMap | _BlockRemovedMap | _AllBlocksClearedMap]
    attn_dp_rank: int | None = None
    state_events: list[StateStored | StateRemoved] | None = None


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(KVEventBatch)
_MAP_DECODER = msgspec.msgpack.Decoder(_MapBatch)


def _from_map(event) -> KVCacheEvent:
    if isinstance(event, _BlockStoredMap):
        return BlockStored(event.block_hashes, event.parent_block_hash, event.token_ids, event.block_size,
                           event.lora_id, event.medium)
    if isinstance(event, _BlockRemovedMap):
        return BlockRemoved(event.block_hashes, event.medium)
    return AllBlocksCleared()


def _to_map(event) -> dict:
    """``event`` as SGLang 0.5.23 writes it: ``{"type": <class>, <every field>}``, its one optional field
    (``medium``) only when set."""
    out = {"type": type(event).__struct_config__.tag, **msgspec.structs.asdict(event)}
    if out.get("medium") is None:
        out.pop("medium", None)
    return out


def encode_batch(batch: KVEventBatch, *, events_as_maps: bool = False) -> bytes:
    """Bytes of ``batch``. With ``state_events`` set, ``attn_dp_rank`` is written even when None,
    so the state list is the 4th element. ``events_as_maps``: the block events as SGLang 0.5.23
    writes them (tagged maps); the batch and its state events stay arrays."""
    if events_as_maps:
        batch = msgspec.structs.replace(batch, events=[_to_map(e) for e in batch.events])
    return _ENCODER.encode(batch)


def decode_batch(payload: bytes) -> KVEventBatch:
    """A batch with array-encoded events (0.5.15, ours) or map-encoded ones (0.5.23); raises
    msgspec's DecodeError / ValidationError for anything else (the array form's error)."""
    try:
        return _DECODER.decode(payload)
    except (msgspec.DecodeError, msgspec.ValidationError) as err:
        try:
            batch = _MAP_DECODER.decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError):
            raise err from None
    return KVEventBatch(batch.ts, [_from_map(e) for e in batch.events], batch.attn_dp_rank, batch.state_events)


def split_state_events(events: list) -> tuple[list, list]:
    """``(block events, state events)`` of a mixed list, each in its order (pure)."""
    blocks, states = [], []
    for event in events:
        (states if isinstance(event, (StateStored, StateRemoved)) else blocks).append(event)
    return blocks, states
