"""SGLang KV-event frames -> :meth:`KvIndex.apply` (pure: bytes in, index updates out).

A worker's ZMQ frames are ``(topic, seq 8-byte big-endian, msgpack(KVEventBatch))``
(:mod:`prfaas_sglang.wire.kv_events`; v2 batches also carry state events). :func:`kv_event_handler` returns the
callable :class:`~prfaas_sglang.adapters.zmq.ZmqSubscriber` runs per frame; a
frame that does not decode, or whose events are invalid (a block size of 0, a
block size other than the worker's), raises :class:`BadFrame` (a ``ValueError``)
and changes nothing; the subscriber counts it and goes on.
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec

from prfaas_sglang.kvindex.index import InvalidEvents, KvIndex
from prfaas_sglang.wire.kv_events import decode_batch


class BadFrame(ValueError):
    """A frame that is not a valid KV-event batch."""


def kv_event_handler(index: KvIndex, worker: str) -> Callable[[list[bytes]], int]:
    """A handler applying ``worker``'s frames to ``index``; returns the number of events applied."""

    def handle(frames: list[bytes]) -> int:
        if len(frames) != 3 or len(frames[1]) != 8:
            raise BadFrame(f"expected (topic, seq, payload), got {len(frames)} frame(s)")
        try:
            batch = decode_batch(frames[2])
        except (msgspec.DecodeError, msgspec.ValidationError) as err:
            raise BadFrame(f"not a KV-event batch: {err}") from None
        try:
            index.apply(worker, int.from_bytes(frames[1], "big"), batch.events, batch.state_events)
        except InvalidEvents as err:
            raise BadFrame(str(err)) from None
        return len(batch.events) + len(batch.state_events or ())

    return handle
