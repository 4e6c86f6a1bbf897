"""The router's side of link telemetry: subscribe to PrfaaS workers, drive the threshold controller.

Samples (``transport.telemetry`` wire format) arrive on each PrfaaS worker's
ZMQ publisher under topic ``prfaas-telemetry``. The router aggregates the
latest sample of every PrfaaS worker (utilisation: the busiest link;
capacity: the delivered capacities summed, or the topology's link when none
was measured yet) and feeds the controller with its own clock. Every
decision and sample summary is kept for ``/status`` (a time series).
"""

from __future__ import annotations

import asyncio
import collections
import time

import zmq
import zmq.asyncio

from prfaas_sglang.transport.telemetry import TELEMETRY_TOPIC, LinkSample


class TelemetryConsumer:
    def __init__(self, state, history: int = 2_000):
        self.state = state
        self.ctx = zmq.asyncio.Context.instance()
        self.latest: dict[str, LinkSample] = {}
        self.series: collections.deque[dict] = collections.deque(maxlen=history)
        self.bad_frames = 0
        self._tasks: dict[str, asyncio.Task] = {}
        self._t0 = time.monotonic()

    def watch(self, worker: str, endpoint: str) -> None:
        sock = self.ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.SUBSCRIBE, TELEMETRY_TOPIC)
        sock.connect(endpoint)
        self._tasks[worker] = asyncio.create_task(self._consume(worker, sock), name=f"telemetry-{worker}")

    def unwatch(self, worker: str) -> None:
        task = self._tasks.pop(worker, None)
        if task:
            task.cancel()
        self.latest.pop(worker, None)

    async def _consume(self, worker: str, sock) -> None:
        try:
            while True:
                frames = await sock.recv_multipart()
                try:
                    sample = LinkSample.decode(frames[-1])
                except ValueError:
                    self.bad_frames += 1
                    continue
                self.latest[worker] = sample
                self.observe(time.monotonic())
        except asyncio.CancelledError:
            pass
        finally:
            sock.close(linger=0)

    def observe(self, now_s: float) -> float | None:
        """Aggregate the latest samples and feed the controller; returns a new threshold or None."""
        samples = list(self.latest.values())
        if not samples:
            return None
        utilization = max(s.busy_fraction for s in samples)
        measured = [s.capacity_bps for s in samples if s.capacity_bps]
        capacity = sum(measured) if measured else self.state.link.capacity_bps
        queue_s = sum(w.queue_s for w in self.state.workers.values() if w.cluster == "prfaas" and w.role == "prefill")
        changed = self.state.controller.observe(now_s, utilization, capacity, queue_s)
        self.series.append({"t_s": now_s - self._t0, "mono_s": now_s, "utilization": utilization, "capacity_bps": capacity,
                            "egress_bps": sum(s.egress_bps for s in samples), "queue_s": queue_s,
                            "threshold_tokens": self.state.controller.threshold_tokens})
        return changed

    async def close(self) -> None:
        for task in self._tasks.values():
            task.cancel()
        await asyncio.gather(*self._tasks.values(), return_exceptions=True)
