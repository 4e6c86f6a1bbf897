"""Hook: TCP keepalive on a real SGLang worker's Mooncake connections (``PRFAAS_KV_KEEPALIVE``).

AFTER ``MooncakeKVManager.__init__`` (SGLang 0.5.15, ``disaggregation/mooncake/conn.py``): in a
process with ``PRFAAS_KV_KEEPALIVE`` set (the launcher sets it where KV crosses the WAN link: the
prfaas role's sender, the pd-decode role's receiver), one thread per manager turns keepalive on for
every new connection to or from a Mooncake port (:class:`~prfaas_sglang.adapters.sockopts.KeepAlive`),
looking every :data:`SCAN_INTERVAL_S`.

Why: Mooncake 0.3.13 sets no keepalive, and its server session only reads. A lane the sender
closes on a dark link (its reset lost) stays ESTABLISHED on the receiver until the process ends;
measured, 4 per outage on the decode (``tests/transport/test_sglang_session_recovery.py``). On an
idle lane, probes also keep a NAT's or load balancer's flow entry alive.

Without the variable nothing starts. A malformed value stops startup (:class:`ConfigError`).
"""

from __future__ import annotations

import logging
import threading

from prfaas_sglang.adapters.sockopts import KeepAlive, KeepAliveSettings
from prfaas_sglang.envs import envs

logger = logging.getLogger(__name__)
# A new lane gets keepalive within this. A scan costs a readlink per descriptor the process holds
# (a few milliseconds for thousands), so it runs no more often than this.
SCAN_INTERVAL_S = 2.0
_ATTR = "_prfaas_keepalive"  # the manager's LaneKeepAlive, set by start_lane_keepalive


class LaneKeepAlive:
    """A daemon thread that runs ``keepalive.scan()`` every ``interval_s`` until :meth:`stop`."""

    def __init__(self, keepalive: KeepAlive, interval_s: float = SCAN_INTERVAL_S):
        self.keepalive, self.interval_s = keepalive, interval_s
        self.scan_errors = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="prfaas-lane-keepalive", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.keepalive.scan()
            except OSError as err:  # never kill the thread: the next scan looks again
                self.scan_errors += 1
                if self.scan_errors == 1:
                    logger.warning("prfaas_sglang: lane keepalive scan failed (%s); retrying every %.1f s",
                                   err, self.interval_s)


def settings_from_env() -> KeepAliveSettings | None:
    """``PRFAAS_KV_KEEPALIVE`` parsed; None when unset. Raises ConfigError when malformed."""
    return envs.KV_KEEPALIVE.parse(KeepAliveSettings.parse)


def start_lane_keepalive(result, manager, args, disaggregation_mode, server_args, is_mla_backend=False):
    """AFTER hook on ``MooncakeKVManager.__init__``: with ``PRFAAS_KV_KEEPALIVE`` set, start the
    manager's keepalive thread (stored on the manager; it lives as long as the process)."""
    settings = settings_from_env()
    if settings is None:
        return None
    keeper = LaneKeepAlive(KeepAlive(settings), SCAN_INTERVAL_S)
    keeper.start()
    setattr(manager, _ATTR, keeper)
    logger.info("prfaas_sglang: TCP keepalive on Mooncake connections (idle %d s, every %d s, %d probes)",
                settings.idle_s, settings.interval_s, settings.probes)
    return None
