"""Link telemetry: one sample of a PrfaaS prefill worker's KV egress (wire format, pure).

ZMQ PUB on the worker's telemetry port, topic ``prfaas-telemetry``, frames
``(topic, json)``; the JSON object is one :class:`LinkSample`::

    {"v": 3, "worker": str, "ts": float, "window_s": float,
     "egress_bps": float, "offered_bps": float, "busy_fraction": float,
     "capacity_bps": float | null, "inflight": int, "backlog_bytes": int, "queue": int,
     "tcp": null | {"connections": int, "goodput_bps": float, "retrans_fraction": float | null,
                    "rtt_ms": float | null, "min_rtt_ms": float | null,
                    "delivery_rate_bps": float | null, "backlogged": bool},
     "congested": bool,
     "completed": int, "failed": int, "latency_p50_s": float | null, "latency_max_s": float | null,
     "peers": {peer: {"egress_bps": float, "offered_bps": float, "inflight": int,
                      "completed": int, "failed": int,
                      "busy_fraction": float, "capacity_bps": float | null, "backlog_bytes": int}}}

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
  v3: adds ``tcp`` (the kernel's view of the KV connections over the sample's last
      interval, ``transport.tcpstate``; null where the sender cannot read it) and
      ``congested`` (queue growth or loss on those connections while KV waits, with
      hysteresis). When ``tcp`` shows a backlogged interval, the sender reports its goodput
      as ``capacity_bps`` (the link's rate as this sender sees it, within one interval of a
      change, even mid-transfer); otherwise ``capacity_bps`` keeps its v2 meaning, so a v2
      reader (the router's controller) needs no change. v1 and v2 samples still decode
      (tcp null, congested false).
  v4: adds what each transfer came to: ``completed`` and ``failed`` (transfers that ended in the
      window, delivered or not), ``latency_p50_s`` / ``latency_max_s`` (request to end, over the
      completed ones; null when none), and ``peers``, the same per decode peer (its Mooncake
      session, ``host:port``): egress, demand, in flight, completed, failed. Nothing earlier
      changes meaning; v1-v3 samples still decode (zero counts, null latencies, no peers).
  v5: each peer adds ``busy_fraction``, ``capacity_bps`` and ``backlog_bytes``, measured over that
      peer's transfers alone. A PrfaaS worker serving several PD clusters crosses a link per
      cluster; the router splits a sample by the clusters its peers belong to
      (:meth:`LinkSample.for_peers`) and watches each link on its own. A v4 peer decodes with busy
      0, capacity null and backlog 0.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass

from prfaas_sglang.wire._json import build, json_object

TELEMETRY_TOPIC = b"prfaas-telemetry"
WIRE_VERSION = 5
MAX_PEERS = 4096  # decode peers one sample may list


@dataclass(frozen=True)
class TcpView:
    """The kernel's TCP_INFO over the KV connections for the last interval (``transport.tcpstate``)."""

    connections: int
    goodput_bps: float
    retrans_fraction: float | None
    rtt_ms: float | None
    min_rtt_ms: float | None
    delivery_rate_bps: float | None
    backlogged: bool

    def _validate(self) -> None:
        if isinstance(self.connections, bool) or not isinstance(self.connections, int) or self.connections < 0:
            raise ValueError("tcp.connections must be a non-negative integer")
        _finite("tcp.goodput_bps", self.goodput_bps)
        for name in ("retrans_fraction", "rtt_ms", "min_rtt_ms", "delivery_rate_bps"):
            if getattr(self, name) is not None:
                _finite(f"tcp.{name}", getattr(self, name))
        if not isinstance(self.backlogged, bool):
            raise ValueError("tcp.backlogged must be true or false")


@dataclass(frozen=True)
class PeerView:
    """One decode peer's share of a sample's window (v4; busy, capacity and backlog v5)."""

    egress_bps: float
    offered_bps: float
    inflight: int
    completed: int
    failed: int
    busy_fraction: float = 0.0
    capacity_bps: float | None = None
    backlog_bytes: int = 0

    def _validate(self, peer: str) -> None:
        _finite(f"peers[{peer!r}].egress_bps", self.egress_bps)
        _finite(f"peers[{peer!r}].offered_bps", self.offered_bps)
        if self.capacity_bps is not None:
            _finite(f"peers[{peer!r}].capacity_bps", self.capacity_bps)
        _finite(f"peers[{peer!r}].busy_fraction", self.busy_fraction)
        if self.busy_fraction > 1.0:
            raise ValueError(f"peers[{peer!r}].busy_fraction must be in [0, 1], got {self.busy_fraction!r}")
        for name in ("inflight", "completed", "failed", "backlog_bytes"):
            _count(f"peers[{peer!r}].{name}", getattr(self, name))


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
    tcp: TcpView | None = None  # v3: the kernel's view of the KV connections
    congested: bool = False  # v3: queue growth or loss on the KV connections while KV waits
    completed: int = 0  # v4: transfers delivered in the window
    failed: int = 0  # v4: transfers that ended undelivered in the window
    latency_p50_s: float | None = None  # v4: request to end, completed transfers in the window
    latency_max_s: float | None = None
    peers: dict[str, PeerView] | None = None  # v4: per decode peer (Mooncake session)

    def encode(self) -> bytes:
        return json.dumps({"v": WIRE_VERSION, **asdict(self)}).encode()

    @classmethod
    def decode(cls, payload: bytes) -> LinkSample:
        """Raise ValueError on anything that is not a valid v1-v4 sample."""
        obj = json_object(payload, "telemetry")
        version = obj.pop("v", None)
        if version == 1:
            obj.setdefault("offered_bps", obj.get("egress_bps"))
        elif version not in (2, 3, 4, WIRE_VERSION):
            raise ValueError(f"unsupported telemetry version {version!r}")
        if version < 3 and ("tcp" in obj or "congested" in obj):
            raise ValueError(f"tcp and congested are v3 fields, not v{version}")
        if version < 4 and any(k in obj for k in _V4_FIELDS):
            raise ValueError(f"{', '.join(sorted(_V4_FIELDS))} are v4 fields, not v{version}")
        peers = obj.pop("peers", None)
        if peers is not None:
            if not isinstance(peers, dict) or len(peers) > MAX_PEERS:
                raise ValueError(f"peers must be an object of at most {MAX_PEERS} peers, or null")
            peers = {str(k): _peer(k, v, version) for k, v in peers.items()}
            for name, view in peers.items():
                view._validate(name)
        obj["peers"] = peers
        tcp = obj.pop("tcp", None)
        if tcp is not None and not isinstance(tcp, dict):
            raise ValueError("tcp must be an object or null")
        if tcp is not None:
            tcp = build(TcpView, tcp, "telemetry.tcp")
            tcp._validate()
        sample = build(cls, {**obj, "tcp": tcp}, "telemetry")
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
        if not isinstance(self.congested, bool):
            raise ValueError("congested must be true or false")
        for name in ("completed", "failed"):
            _count(name, getattr(self, name))
        for name in ("latency_p50_s", "latency_max_s"):
            if getattr(self, name) is not None:
                _finite(name, getattr(self, name))


_V4_FIELDS = frozenset({"completed", "failed", "latency_p50_s", "latency_max_s", "peers"})


_V5_PEER_FIELDS = frozenset({"busy_fraction", "capacity_bps", "backlog_bytes"})


def _peer(peer, obj, version: int) -> PeerView:
    if not isinstance(obj, dict):
        raise ValueError(f"peers[{peer!r}] must be an object")
    if version < 5 and _V5_PEER_FIELDS & set(obj):
        raise ValueError(f"peers[{peer!r}]: {', '.join(sorted(_V5_PEER_FIELDS))} are v5 fields, not v{version}")
    return build(PeerView, obj, f"telemetry.peers[{peer!r}]")


def _count(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be a non-negative integer, got {value!r}")


def _finite(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
