"""Link telemetry: what a prefill worker's KV egress looks like, measured from its own transfers (pure).

A :class:`LinkMeter` records each KV transfer's start, end and size (times are
arguments, never read from a clock here) and summarises a sliding window:

* ``busy_fraction``: share of the window with at least one transfer in flight.
  A saturated (or throttled) link is busy ~100% of the time whatever its
  nominal capacity says, so this is the utilisation signal the router uses.
* ``egress_bps``: bits completed in the window / window.
* ``capacity_bps``: bits completed / busy time, the rate the link delivered
  while in use (None until enough was measured).

Wire format (ZMQ, topic ``prfaas-telemetry``, one JSON object per frame)::

    {"v": 1, "worker": str, "ts": float, "egress_bps": float, "busy_fraction": float,
     "capacity_bps": float | null, "inflight": int, "queue": int}

History: v1, first version.
"""

from __future__ import annotations

import json
from collections import deque
from dataclasses import asdict, dataclass

TELEMETRY_TOPIC = b"prfaas-telemetry"
WIRE_VERSION = 1


@dataclass(frozen=True)
class LinkSample:
    worker: str
    ts: float
    egress_bps: float
    busy_fraction: float
    capacity_bps: float | None
    inflight: int
    queue: int = 0

    def encode(self) -> bytes:
        return json.dumps({"v": WIRE_VERSION, **asdict(self)}).encode()

    @classmethod
    def decode(cls, payload: bytes) -> LinkSample:
        """Raise ValueError on anything that is not a v1 sample."""
        try:
            obj = json.loads(payload)
            if obj.pop("v") != WIRE_VERSION:
                raise ValueError("unsupported telemetry version")
            return cls(**obj)
        except (KeyError, TypeError, json.JSONDecodeError) as err:
            raise ValueError(f"not a telemetry sample: {err}") from None


class LinkMeter:
    def __init__(self, window_s: float = 1.0, min_busy_s: float = 0.02):
        self.window_s = window_s
        self.min_busy_s = min_busy_s
        self._inflight: dict[int, float] = {}
        self._done: deque[tuple[float, float, int]] = deque()  # (start, end, bytes)

    def start(self, transfer_id: int, now_s: float) -> None:
        self._inflight[transfer_id] = now_s

    def end(self, transfer_id: int, now_s: float, nbytes: int) -> None:
        start = self._inflight.pop(transfer_id, None)
        if start is not None and nbytes > 0:
            self._done.append((start, now_s, nbytes))

    def sample(self, worker: str, now_s: float, queue: int = 0) -> LinkSample:
        lo = now_s - self.window_s
        while self._done and self._done[0][1] < lo:
            self._done.popleft()
        intervals = [(max(s, lo), e) for s, e, _ in self._done if e > lo]
        intervals += [(max(s, lo), now_s) for s in self._inflight.values()]
        busy = 0.0
        cursor = lo
        for s, e in sorted(intervals):
            s = max(s, cursor)
            if e > s:
                busy += e - s
                cursor = e
        recent = [(s, e, b) for s, e, b in self._done if e > lo]
        # Egress counts each transfer's bits in proportion to its overlap with the window.
        window_bits = 8.0 * sum(b * (e - max(s, lo)) / (e - s) if e > s else b for s, e, b in recent)
        done_busy = sum(e - s for s, e, _ in recent)
        capacity = 8.0 * sum(b for _, _, b in recent) / done_busy if done_busy >= self.min_busy_s else None
        return LinkSample(worker, now_s, window_bits / self.window_s, min(busy / self.window_s, 1.0), capacity,
                          len(self._inflight), queue)
