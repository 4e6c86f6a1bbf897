"""Publish KV events on ZMQ exactly as SGLang's ``ZmqEventPublisher`` does (I/O adapter).

Frames: ``(topic, seq 8-byte big-endian, msgpack(KVEventBatch))``. One batch
per engine step that changed the cache. ``publish`` is non-blocking (drops if
the high-water mark is hit, like upstream's PUB socket).
"""

from __future__ import annotations

import time

from prfaas_sglang.engine.kv_events import KVCacheEvent, KVEventBatch, encode_batch


class ZmqKvEventPublisher:
    def __init__(self, endpoint: str, topic: str):
        import zmq

        self._ctx = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, 100_000)
        self._pub.bind(endpoint)
        self._topic = topic.encode()
        self._seq = 0

    def publish(self, events: list[KVCacheEvent]) -> None:
        if not events:
            return
        payload = encode_batch(KVEventBatch(ts=time.time(), events=events, attn_dp_rank=0))
        self._pub.send_multipart((self._topic, self._seq.to_bytes(8, "big"), payload))
        self._seq += 1

    def publish_raw(self, topic: bytes, payload: bytes) -> None:
        """Another stream on the same socket (e.g. link telemetry); KV-event subscribers filter it out by topic."""
        self._pub.send_multipart((topic, payload))

    def close(self) -> None:
        self._pub.close(linger=0)
