"""Link telemetry: one sample of a PrfaaS prefill worker's KV egress (wire format, pure).

ZMQ PUB on the worker's telemetry port, topic ``prfaas-telemetry``, frames
``(topic, json)``; the JSON object is one :class:`LinkSample`::

    {"v": 2, "worker": str, "ts": float, "window_s": float,
     "egress_bps": float, "offered_bps": float, "busy_fraction": float,
     "capacity_bps": float | null, "inflight": int, "backlog_bytes": int, "queue": int}

Units: bits per second, bytes, seconds; ``ts`` is the sender's wall clock
(``time.time()``), informational only: receivers use their own clock.

History:
  v1: worker, ts (sender's monotonic clock), egress_bps, busy_fraction,
      capacity_bps, inflight, queue.
  v2: ts becomes wall-clock time; adds window_s, offered_bps (KV bits whose
      transfer was requested in the window, per second: the demand on the link)
      and backlog_bytes (requested, not yet delivered). Values are validated
      (finite, in range). v1 samples still decode (window_s 1.0, offered_bps
      equal to egress_bps, backlog 0).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass

from prfaas_sglang.wire._json import build, json_object

TELEMETRY_TOPIC = b"prfaas-telemetry"
WIRE_VERSION = 2


@dataclass(frozen=True)
class LinkSample:
    worker: str
    ts: float
    egress_bps: float  # bits delivered in the window / window
    busy_fraction: float  # share of the window with a transfer in flight, [0, 1]
    capacity_bps: float | None  # rate delivered while busy; None: too little was sent to tell
    inflight: int  # transfers in flight now
    queue: int = 0  # requests waiting for prefill on this worker
    window_s: float = 1.0
    offered_bps: float = 0.0  # bits requested in the window / window (demand)
    backlog_bytes: int = 0  # requested, not yet delivered

    def encode(self) -> bytes:
        return json.dumps({"v": WIRE_VERSION, **asdict(self)}).encode()

    @classmethod
    def decode(cls, payload: bytes) -> LinkSample:
        """Raise ValueError on anything that is not a valid v1 or v2 sample."""
        obj = json_object(payload, "telemetry")
        version = obj.pop("v", None)
        if version == 1:
            obj.setdefault("offered_bps", obj.get("egress_bps"))
        elif version != WIRE_VERSION:
            raise ValueError(f"unsupported telemetry version {version!r}")
        sample = build(cls, obj, "telemetry")
        sample._validate()
        return sample

    def _validate(self) -> None:
        if not isinstance(self.worker, str):
            raise ValueError("worker must be a string")
        for name in ("ts", "egress_bps", "busy_fraction", "window_s", "offered_bps"):
            _finite(name, getattr(self, name))
        if self.capacity_bps is not None:
            _finite("capacity_bps", self.capacity_bps)
        for name in ("inflight", "queue", "backlog_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
        if not 0.0 <= self.busy_fraction <= 1.0:
            raise ValueError(f"busy_fraction must be in [0, 1], got {self.busy_fraction!r}")
        if not self.window_s > 0:
            raise ValueError(f"window_s must be > 0, got {self.window_s!r}")


def _finite(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
