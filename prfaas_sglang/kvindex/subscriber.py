"""Feed a :class:`KvIndex` from every worker's ZMQ KV-event publisher (asyncio adapter).

One SUB socket per worker (so each event batch is attributed to its worker
and its sequence numbers checked per worker). Frames are SGLang's
``(topic, seq, msgpack(KVEventBatch))``; a frame that does not decode is
counted and skipped, never fatal.
"""

from __future__ import annotations

import asyncio
import logging

import msgspec
import zmq
import zmq.asyncio

from prfaas_sglang.engine.kv_events import decode_batch
from prfaas_sglang.kvindex.index import KvIndex

logger = logging.getLogger(__name__)


class KvEventSubscriber:
    def __init__(self, index: KvIndex, topic: str = "kv-events"):
        self.index = index
        self.topic = topic.encode()
        self.ctx = zmq.asyncio.Context.instance()
        self.events_applied = 0
        self.bad_frames = 0
        self._tasks: dict[str, asyncio.Task] = {}

    def watch(self, worker: str, cluster: str, endpoint: str) -> None:
        """Start consuming ``endpoint`` (``tcp://host:port``) as ``worker``'s events."""
        self.index.add_worker(worker, cluster)
        sock = self.ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.SUBSCRIBE, self.topic)
        sock.setsockopt(zmq.RCVHWM, 100_000)
        sock.connect(endpoint)
        self._tasks[worker] = asyncio.create_task(self._consume(worker, sock), name=f"kv-events-{worker}")

    async def _consume(self, worker: str, sock) -> None:
        try:
            while True:
                frames = await sock.recv_multipart()
                if len(frames) != 3 or len(frames[1]) != 8:
                    self.bad_frames += 1
                    continue
                try:
                    batch = decode_batch(frames[2])
                except (msgspec.DecodeError, msgspec.ValidationError):
                    self.bad_frames += 1
                    continue
                self.index.apply(worker, int.from_bytes(frames[1], "big"), batch.events)
                self.events_applied += len(batch.events)
        except asyncio.CancelledError:
            pass
        finally:
            sock.close(linger=0)

    def unwatch(self, worker: str) -> None:
        task = self._tasks.pop(worker, None)
        if task:
            task.cancel()
        self.index.remove_worker(worker)

    async def close(self) -> None:
        for worker in list(self._tasks):
            task = self._tasks.pop(worker)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
