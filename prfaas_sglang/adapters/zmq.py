"""ZMQ PUB/SUB for KV events and link telemetry (I/O adapter).

:class:`ZmqPublisher` binds a PUB socket and frames KV events exactly as
SGLang's ``ZmqEventPublisher`` does: ``(topic, seq 8-byte big-endian,
msgpack(KVEventBatch))``, one batch per cache change; ``publish_raw`` sends
another stream (link telemetry) as ``(topic, payload)`` on its own socket.
Sends never block: past the high-water mark frames are dropped, as upstream's.

:class:`ZmqSubscriber` is the only subscriber in the package. It opens one SUB
socket per *source* (a worker's KV-event or telemetry endpoint), so every frame
is attributed to its source, and hands each multipart frame to that source's
handler. A handler raises :class:`BadFrame` for a malformed frame (counted,
skipped); any other exception is logged and counted too, and the loop goes on:
one bad frame or one handler bug never stops consumption. ``stats()`` reports
per-source frame counts, bad frames, handler errors and the age of the last frame.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import zmq
import zmq.asyncio

from prfaas_sglang.wire.kv_events import KVCacheEvent, KVEventBatch, encode_batch

logger = logging.getLogger(__name__)


class BadFrame(ValueError):
    """A frame that does not decode; the subscriber counts it and skips it (any ``BadFrame``
    subclass, or a handler's own ``ValueError`` named BadFrame, e.g. ``kvindex.feed.BadFrame``)."""


class ZmqPublisher:
    def __init__(self, endpoint: str, topic: str, hwm: int = 100_000):
        self._ctx = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, hwm)
        self._pub.bind(endpoint)
        self._topic = topic.encode()
        self._seq = 0

    def publish(self, events: list[KVCacheEvent], wall_s: float, state_events: list[KVCacheEvent] | None = None) -> None:
        """One KV-event batch stamped ``wall_s``, with ``state_events`` (wire v2; None: this
        publisher reports no state); nothing is sent when both are empty."""
        if not events and not state_events:
            return
        payload = encode_batch(KVEventBatch(ts=wall_s, events=events, attn_dp_rank=0, state_events=state_events))
        self._pub.send_multipart((self._topic, self._seq.to_bytes(8, "big"), payload), flags=zmq.NOBLOCK)
        self._seq += 1

    def publish_raw(self, payload: bytes) -> None:
        """``(topic, payload)``: a non-KV-event stream on this socket."""
        try:
            self._pub.send_multipart((self._topic, payload), flags=zmq.NOBLOCK)
        except zmq.Again:
            pass

    def close(self) -> None:
        self._pub.close(linger=0)


@dataclass
class SourceStats:
    endpoint: str
    frames: int = 0
    bad_frames: int = 0
    handler_errors: int = 0
    last_frame_mono_s: float | None = None
    last_error: str | None = None


@dataclass
class _Source:
    stats: SourceStats
    task: asyncio.Task
    handle: Callable[[list[bytes]], None] = field(repr=False)


class ZmqSubscriber:
    """Sources are watched from a running event loop; ``close()`` cancels them all."""

    def __init__(self, rcvhwm: int = 100_000):
        self.ctx = zmq.asyncio.Context.instance()
        self.rcvhwm = rcvhwm
        self._sources: dict[str, _Source] = {}

    def watch(self, source: str, endpoint: str, topic: bytes, handle: Callable[[list[bytes]], None]) -> None:
        """Consume ``endpoint`` (``tcp://host:port``) under the name ``source``; replaces an older watch."""
        self.unwatch(source)
        sock = self.ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.SUBSCRIBE, topic)
        sock.setsockopt(zmq.RCVHWM, self.rcvhwm)
        sock.connect(endpoint)
        stats = SourceStats(endpoint)
        task = asyncio.create_task(self._consume(source, sock, stats, handle), name=f"zmq-{source}")
        self._sources[source] = _Source(stats, task, handle)

    def unwatch(self, source: str) -> None:
        entry = self._sources.pop(source, None)
        if entry is not None:
            entry.task.cancel()

    def sources(self) -> list[str]:
        return list(self._sources)

    def stats(self, now_mono_s: float) -> dict[str, dict]:
        out = {}
        for name, entry in self._sources.items():
            s = entry.stats
            out[name] = {"endpoint": s.endpoint, "frames": s.frames, "bad_frames": s.bad_frames,
                         "handler_errors": s.handler_errors, "last_error": s.last_error,
                         "last_frame_age_s": None if s.last_frame_mono_s is None else now_mono_s - s.last_frame_mono_s}
        return out

    @staticmethod
    async def _consume(source: str, sock, stats: SourceStats, handle) -> None:
        try:
            while True:
                frames = await sock.recv_multipart()
                stats.frames += 1
                stats.last_frame_mono_s = time.monotonic()
                try:
                    handle(frames)
                except ValueError as err:  # BadFrame, or a decoder's ValueError: a bad frame
                    stats.bad_frames += 1
                    stats.last_error = str(err)[:200]
                except Exception as err:  # noqa: BLE001 - a handler bug must not stop the stream
                    stats.handler_errors += 1
                    stats.last_error = f"{type(err).__name__}: {err}"[:200]
                    logger.exception("zmq source %s: handler failed", source)
        except asyncio.CancelledError:
            pass
        finally:
            sock.close(linger=0)

    async def close(self) -> None:
        tasks = [entry.task for entry in self._sources.values()]
        self._sources.clear()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
