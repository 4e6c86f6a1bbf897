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

Authentication (when the deployment has a secret, :class:`CurveKeys`): every publisher is a
CURVE server with its own context and a ZAP handler that admits only the deployment's client
key (a subscriber without it gets nothing: prompts in KV events stay private); every subscriber
is a CURVE client that only completes a handshake with the deployment's server key, so a
publisher without the secret (a forged KV-event or telemetry source) delivers nothing. Failed
handshakes are counted on both sides (``auth_failures``, ``refused_subscribers``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import zmq
import zmq.asyncio

from prfaas_sglang.wire.auth import DeploymentKeys
from prfaas_sglang.wire.kv_events import KVCacheEvent, KVEventBatch, encode_batch

logger = logging.getLogger(__name__)


class BadFrame(ValueError):
    """A frame that does not decode; the subscriber counts it and skips it (any ``BadFrame``
    subclass, or a handler's own ``ValueError`` named BadFrame, e.g. ``kvindex.feed.BadFrame``)."""


_HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                     | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
_WATCHED_EVENTS = _HANDSHAKE_FAILED | zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED
# A subscriber gives up a connection attempt after this, and libzmq resolves the endpoint's name again on the
# next one. Without it a publisher that came back elsewhere under the same name (a Kubernetes pod recreated:
# its DNS name now names a new IP) was reached only after the kernel gave up on SYNs to the old address: on
# the one-node cluster of scripts/k8s-local.sh the router heard a recreated PrfaaS pod's telemetry again
# after 3.5 minutes, routing nothing to it meanwhile (its link marked down).
CONNECT_TIMEOUT_MS = 2_000
# ZMTP heartbeats: a publisher whose host vanished without closing the connection (no FIN) is dropped, and
# reconnected to, after HEARTBEAT_TIMEOUT_MS without an answer.
HEARTBEAT_IVL_MS, HEARTBEAT_TIMEOUT_MS = 1_000, 5_000


@dataclass(frozen=True, repr=False)
class CurveKeys:
    """The deployment's CURVE key pairs (Z85): publishers hold the server pair, subscribers the
    client pair and the server's public key."""

    server_secret: bytes
    server_public: bytes
    client_secret: bytes
    client_public: bytes

    @classmethod
    def from_deployment(cls, keys: DeploymentKeys | None) -> CurveKeys | None:
        """The deployment's CURVE keys; None without a deployment secret (no authentication)."""
        from zmq.utils import z85

        if keys is None:
            return None

        if not zmq.has("curve"):
            raise RuntimeError("this libzmq has no CURVE support; a deployment secret needs it")
        server, client = z85.encode(keys.zmq_server_seed), z85.encode(keys.zmq_client_seed)
        return cls(server, zmq.curve_public(server), client, zmq.curve_public(client))

    def __repr__(self) -> str:
        return "CurveKeys(<hidden>)"


class _ClientKeyCheck:
    """ZAP credentials provider: only the deployment's client key; refusals counted."""

    def __init__(self, client_public: bytes):
        self.client_public, self.refused = client_public, 0

    def callback(self, domain: str, key: bytes) -> bool:
        if key == self.client_public:
            return True
        self.refused += 1
        return False


class CurveServer:
    """A context whose sockets may be CURVE servers admitting only the deployment's client key.
    ``close()`` stops the ZAP thread; sockets made from ``ctx`` must be closed first."""

    def __init__(self, curve: CurveKeys):
        from zmq.auth.thread import ThreadAuthenticator

        self.curve = curve
        self.ctx = zmq.Context()
        self.check = _ClientKeyCheck(curve.client_public)
        self._auth = ThreadAuthenticator(self.ctx, log=logging.getLogger("prfaas_sglang.zap"))
        self._auth.start()
        self._auth.configure_curve_callback("*", credentials_provider=self.check)

    def secure(self, sock: zmq.Socket) -> zmq.Socket:
        """Make ``sock`` (of ``ctx``, before bind) a CURVE server."""
        sock.curve_secretkey = self.curve.server_secret
        sock.curve_publickey = self.curve.server_public
        sock.curve_server = True
        return sock

    def close(self) -> None:
        self._auth.stop()
        self.ctx.term()


def bind_socket(kind: int, endpoint: str, server: CurveServer | None, *, hwm: int | None = None,
                linger_ms: int | None = None) -> zmq.Socket:
    """A ``kind`` socket (``zmq.PUB``, ``zmq.ROUTER``, ...) bound at ``endpoint``. With ``server``
    it is made in the server's context and is a CURVE server admitting only the deployment's
    subscribers; without, in the process's shared context. The caller closes the socket, and only
    then ``server``. Raises ``zmq.ZMQError`` when the endpoint cannot be bound (the socket closed)."""
    sock = (server.ctx if server is not None else zmq.Context.instance()).socket(kind)
    if hwm is not None:
        sock.setsockopt(zmq.SNDHWM, hwm)
    if linger_ms is not None:
        sock.setsockopt(zmq.LINGER, linger_ms)
    if server is not None:
        server.secure(sock)
    try:
        sock.bind(endpoint)
    except zmq.ZMQError:
        sock.close(linger=0)
        raise
    return sock


class ZmqPublisher:
    """A PUB socket bound at ``endpoint`` (give the configured interface, not ``*``, unless all
    interfaces are meant); with ``curve``, a CURVE server (see the module's docstring). KV events
    are encoded as the installed SGLang encodes them (``_compat.kv_events_as_maps``: 0.5.23's tagged
    maps; 0.5.15's arrays, also where no SGLang is installed)."""

    def __init__(self, endpoint: str, topic: str, hwm: int = 100_000, curve: CurveKeys | None = None):
        from prfaas_sglang._compat import kv_events_as_maps

        self._events_as_maps = kv_events_as_maps()
        self._server = CurveServer(curve) if curve is not None else None
        try:
            self._pub = bind_socket(zmq.PUB, endpoint, self._server, hwm=hwm)
        except zmq.ZMQError:
            if self._server:
                self._server.close()
            raise
        self._topic = topic.encode()
        self._seq = 0

    @property
    def refused_subscribers(self) -> int:
        """Subscribers refused for want of the deployment's key (0 without CURVE)."""
        return self._server.check.refused if self._server else 0

    def publish(self, events: list[KVCacheEvent], wall_s: float, state_events: list[KVCacheEvent] | None = None) -> None:
        """One KV-event batch stamped ``wall_s``, with ``state_events`` (wire v2; None: this
        publisher reports no state); nothing is sent when both are empty."""
        if not events and not state_events:
            return
        payload = encode_batch(KVEventBatch(ts=wall_s, events=events, attn_dp_rank=0, state_events=state_events),
                               events_as_maps=self._events_as_maps)
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
        if self._server:
            self._server.close()


@dataclass
class SourceStats:
    endpoint: str
    frames: int = 0
    bad_frames: int = 0
    handler_errors: int = 0
    auth_failures: int = 0  # handshakes that failed: a publisher without the deployment's key
    connected: bool = False  # the handshake with the publisher succeeded, and it has not disconnected since
    connects: int = 0  # handshakes that succeeded (more than 1: the publisher restarted or the link broke)
    last_frame_mono_s: float | None = None
    last_error: str | None = None


@dataclass
class _Source:
    stats: SourceStats
    task: asyncio.Task
    handle: Callable[[list[bytes]], None] = field(repr=False)


class ZmqSubscriber:
    """Sources are watched from a running event loop; ``close()`` cancels them all. With
    ``curve``, every source must be a CURVE server holding the deployment's key.

    Each source's :meth:`stats` say whether it is ``connected`` (its ZMTP handshake succeeded and
    the subscription went out after it). It is not a delivery guarantee: the publisher applies the
    subscription on its own I/O thread, so a frame published at that instant can still be filtered
    out (PUB/SUB's slow joiner, seen under load in CI). What must arrive is sent again until it is
    heard (KV events: sequence numbers and the publisher's replay)."""

    def __init__(self, rcvhwm: int = 100_000, curve: CurveKeys | None = None):
        self.ctx = zmq.asyncio.Context.instance()
        self.rcvhwm = rcvhwm
        self.curve = curve
        self._sources: dict[str, _Source] = {}

    def watch(self, source: str, endpoint: str, topic: bytes, handle: Callable[[list[bytes]], None]) -> None:
        """Consume ``endpoint`` (``tcp://host:port``) under the name ``source``; replaces an older watch."""
        self.unwatch(source)
        sock = self.ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.SUBSCRIBE, topic)
        sock.setsockopt(zmq.RCVHWM, self.rcvhwm)
        sock.setsockopt(zmq.CONNECT_TIMEOUT, CONNECT_TIMEOUT_MS)
        sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
        stats = SourceStats(endpoint)
        if self.curve is not None:
            sock.curve_secretkey = self.curve.client_secret
            sock.curve_publickey = self.curve.client_public
            sock.curve_serverkey = self.curve.server_public
        monitor = sock.get_monitor_socket(_WATCHED_EVENTS)
        sock.connect(endpoint)
        task = asyncio.create_task(self._consume(source, sock, stats, handle, monitor), name=f"zmq-{source}")
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
            out[name] = {"endpoint": s.endpoint, "connected": s.connected, "connects": s.connects,
                         "frames": s.frames, "bad_frames": s.bad_frames,
                         "handler_errors": s.handler_errors, "auth_failures": s.auth_failures, "last_error": s.last_error,
                         "last_frame_age_s": None if s.last_frame_mono_s is None else now_mono_s - s.last_frame_mono_s}
        return out

    @staticmethod
    async def _follow_connection(source: str, monitor, stats: SourceStats) -> None:
        """The socket's monitor: handshakes that succeed or fail, and disconnections."""
        from zmq.utils.monitor import parse_monitor_message

        while True:
            event = parse_monitor_message(await monitor.recv_multipart())["event"]
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                stats.connected, stats.connects = True, stats.connects + 1
            elif event == zmq.EVENT_DISCONNECTED:
                stats.connected = False
            elif event & _HANDSHAKE_FAILED:
                stats.connected = False
                stats.auth_failures += 1
                if stats.auth_failures == 1:
                    logger.warning("zmq source %s (%s): handshake refused; it does not hold this deployment's key",
                                   source, stats.endpoint)

    @classmethod
    async def _consume(cls, source: str, sock, stats: SourceStats, handle, monitor) -> None:
        watcher = asyncio.create_task(cls._follow_connection(source, monitor, stats))
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
            watcher.cancel()
            sock.disable_monitor()
            monitor.close(linger=0)
            sock.close(linger=0)

    async def close(self) -> None:
        tasks = [entry.task for entry in self._sources.values()]
        self._sources.clear()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
