"""Hooks: link telemetry from a real SGLang PrfaaS prefill worker (wire v5), as the emulated engine publishes it.

Two hooks on SGLang 0.5.15's Mooncake backend (``disaggregation/mooncake/conn.py``):

* AFTER ``MooncakeKVManager.__init__``: in a prefill manager of a process started as
  ``PRFAAS_ROLE=prfaas`` with ``PRFAAS_TELEMETRY_PORT`` set, start one publisher thread
  (ZMQ PUB on that port, topic ``prfaas-telemetry``) for the manager's lifetime;
* AROUND ``MooncakeKVManager._transfer_data``: each synchronous batch (one per chunked-prefill
  chunk: every layer's K and V of the chunk's pages) is one transfer of the manager's
  :class:`~prfaas_sglang.transport.meter.LinkMeter`: requested, delivered (return code 0) or
  failed. The hook never raises: SGLang's transfer worker thread dies on an exception.

The publisher samples the meter every 0.25 s and adds the kernel's view of the process's
Mooncake connections (``ss``; :mod:`prfaas_sglang.transport.tcpstate`), so the capacity moves
within one interval of a change even while one chunk's batch is still on the wire. Without
the two variables nothing starts and ``_transfer_data`` is called unchanged (one attribute
lookup), so installing the plugin never changes a stock server.
"""

from __future__ import annotations

import itertools
import logging
import os
import socket
import threading
import time

from prfaas_sglang.adapters.tcpinfo import read_own_kv_connections
from prfaas_sglang.envs import envs
from prfaas_sglang.hosts import is_wildcard, zmq_bind_host
from prfaas_sglang.transport.meter import LinkMeter, with_tcp_view
from prfaas_sglang.transport.tcpstate import TcpCongestion
from prfaas_sglang.wire.telemetry import TELEMETRY_TOPIC

logger = logging.getLogger(__name__)
INTERVAL_S = 0.25
# What a PrfaaS SGLang worker with --enable-metrics adds to its /metrics (adapters.prom), under the
# emulated engine's name where it has one: the dashboard's "KV bytes sent per worker" reads both.
LINK_METRICS = (
    ("delivered_bytes", "prfaas:kv_bytes_sent_total", "counter", "KV bytes delivered to decode peers"),
    ("transfers", "prfaas:kv_transfers_total", "counter", "KV transfers (chunks and aux) ended"),
    ("transfers_failed", "prfaas:kv_transfers_failed_total", "counter", "KV transfers ended undelivered"),
)
_ATTR = "_prfaas_link"  # the manager's LinkTelemetry, set by start_link_telemetry


class LinkTelemetry:
    """One prefill manager's meter and publisher thread. Thread-safe: transfer threads record,
    the publisher samples."""

    def __init__(self, port: int, worker: str, bind_host: str = "*", curve=None, metrics=None):
        """Publishes on ``tcp://bind_host:port``; ``curve`` (``adapters.zmq.CurveKeys``) makes it a
        CURVE server admitting only the deployment's subscribers; ``metrics``
        (``adapters.prom.ProcessMetrics`` of :data:`LINK_METRICS`) is brought up to date with each sample."""
        self.meter = LinkMeter(window_s=1.0)
        self.worker = worker
        self.port = port
        self.bind_host = zmq_bind_host(bind_host)
        self.curve = curve
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._stop = threading.Event()
        self.samples_sent = 0
        self.delivered_bytes_total = 0
        self.transfers_total = 0
        self.failed_total = 0
        self.metrics = metrics
        self._thread = threading.Thread(target=self._run, name="prfaas-link-telemetry", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def begin(self, nbytes: int, peer: str | None = None) -> int:
        transfer_id = next(self._ids)
        with self._lock:
            self.meter.start(transfer_id, time.monotonic(), nbytes, peer)
        return transfer_id

    def progress(self, transfer_id: int, nbytes: int, since_s: float | None = None) -> None:
        """``nbytes`` more of the transfer landed (asynchronous sends report each write, with
        ``since_s``, its start on ``time.monotonic()``)."""
        with self._lock:
            self.meter.progress(transfer_id, time.monotonic(), nbytes, since_s)
            self.delivered_bytes_total += nbytes

    def end(self, transfer_id: int, ok: bool) -> None:
        with self._lock:
            self.failed_total += not ok
            self.transfers_total += 1
            self.meter.end(transfer_id, time.monotonic(), ok)

    def finish(self, transfer_id: int, nbytes: int, ok: bool) -> None:
        """A synchronous transfer ended: all of it delivered (``ok``) or none."""
        if ok:
            self.progress(transfer_id, nbytes)
        self.end(transfer_id, ok)

    def _run(self) -> None:
        import zmq

        from prfaas_sglang.adapters.zmq import CurveServer, bind_socket

        server = CurveServer(self.curve) if self.curve is not None else None
        try:
            pub = bind_socket(zmq.PUB, f"tcp://{self.bind_host}:{self.port}", server, hwm=1000, linger_ms=0)
        except zmq.ZMQError as err:
            logger.error("prfaas_sglang: link telemetry cannot bind %s:%s: %s", self.bind_host, self.port, err)
            if server is not None:
                server.close()
            return
        tcp = TcpCongestion()
        while not self._stop.wait(INTERVAL_S):
            try:
                interval = tcp.update(read_own_kv_connections(), time.monotonic())
                with self._lock:
                    sample = self.meter.sample(self.worker, time.monotonic(), time.time())
                pub.send_multipart([TELEMETRY_TOPIC, with_tcp_view(sample, interval).encode()], flags=zmq.NOBLOCK)
                self.samples_sent += 1
                if self.metrics is not None:
                    self.metrics.publish(self.totals())
            except Exception:  # noqa: BLE001 - telemetry must never take the worker down
                logger.exception("prfaas_sglang: link telemetry sample failed")
        pub.close()
        if server is not None:
            server.close()

    def totals(self) -> dict[str, int]:
        """The counters :data:`LINK_METRICS` shows: KV bytes delivered, transfers ended, failed."""
        with self._lock:
            return {"delivered_bytes": self.delivered_bytes_total, "transfers": self.transfers_total,
                    "transfers_failed": self.failed_total}

    def stop(self) -> None:
        self._stop.set()


def start_link_telemetry(result, manager, args, disaggregation_mode, server_args, is_mla_backend=False):
    """AFTER hook on ``MooncakeKVManager.__init__``: a PrfaaS prefill manager publishes telemetry."""
    port = envs.TELEMETRY_PORT.get()
    if envs.ROLE.get() != "prfaas" or port is None or getattr(disaggregation_mode, "value", None) != "prefill":
        return None
    from prfaas_sglang.adapters.zmq import CurveKeys
    from prfaas_sglang.security import load_keys

    bind = getattr(server_args, "host", None) or "127.0.0.1"  # SGLang's --host: the configured interface
    host = socket.gethostname() if is_wildcard(bind) else bind
    keys = load_keys()
    metrics = None
    if getattr(server_args, "enable_metrics", False):
        from prfaas_sglang.adapters.prom import ProcessMetrics, worker_labels

        metrics = ProcessMetrics(LINK_METRICS, worker_labels(server_args))
    telemetry = LinkTelemetry(int(port), f"{host}:{getattr(server_args, 'port', '')}@pid{os.getpid()}", bind,
                              CurveKeys.from_deployment(keys), metrics)
    setattr(manager, _ATTR, telemetry)
    telemetry.start()
    logger.info("prfaas_sglang: link telemetry on tcp://%s:%s%s", bind, port, " (CURVE)" if keys else "")
    return None


def meter_transfer(original, manager, mooncake_session_id, transfer_blocks):
    """AROUND hook on ``MooncakeKVManager._transfer_data``: one chunk's batch is one metered transfer."""
    telemetry = getattr(manager, _ATTR, None)
    if telemetry is None or not transfer_blocks:
        return original(manager, mooncake_session_id, transfer_blocks)
    try:
        nbytes = sum(int(length) for _, _, length in transfer_blocks)
        transfer_id = telemetry.begin(nbytes, str(mooncake_session_id))
    except Exception:  # noqa: BLE001 - never fail a transfer for its telemetry
        return original(manager, mooncake_session_id, transfer_blocks)
    ret = original(manager, mooncake_session_id, transfer_blocks)
    try:
        telemetry.finish(transfer_id, nbytes, ret == 0)
    except Exception:  # noqa: BLE001
        logger.exception("prfaas_sglang: link telemetry record failed")
    return ret
