"""Probe for ``test_abort_notify.py``: SGLang's own Mooncake receiver aborts a room, to a live prefill
rank and then to one that has died. ``sys.argv[1]``: ``hooked`` (our plugin registered, as SGLang's
plugin loader does in every server process) or ``stock``. Prints a JSON line per step; an abort
still running after ``BLOCKED_AFTER_S`` is reported as ``blocked`` and the process exits."""

from __future__ import annotations

import json
import os
import sys
import threading
import time

import zmq

BLOCKED_AFTER_S = 10.0


class _Manager:
    """What ``CommonKVReceiver.abort`` touches on its KV manager."""

    local_ip = "127.0.0.1"
    rank_port = 40000

    def __init__(self):
        self.failed: list[int] = []

    def record_failure(self, room, reason):
        self.failed.append(room)

    def update_status(self, room, status):
        pass


class _Trace:
    def abort(self, abort_info=None):
        pass

    def trace_req_finish(self):
        pass


def receiver(cls, room: int, port: int, manager: _Manager):
    """A receiver past bootstrap, as SGLang's decode holds it; only the fields ``abort`` reads."""
    r = object.__new__(cls)
    r.kv_mgr, r.bootstrap_room, r.trace_ctx = manager, room, _Trace()
    r.bootstrap_infos = [{"rank_ip": "127.0.0.1", "rank_port": port}]
    r.abort_notified = False
    return r


def say(**fields) -> None:
    print(json.dumps(fields), flush=True)


def main() -> None:
    if sys.argv[1] == "hooked":
        from prfaas_sglang.plugin import register

        register()
    from sglang.srt.disaggregation.mooncake.conn import MooncakeKVReceiver

    ctx = zmq.Context()
    prefill = ctx.socket(zmq.PULL)  # the prefill rank's endpoint, as its KV manager binds it
    port = prefill.bind_to_random_port("tcp://127.0.0.1")
    manager = _Manager()

    receiver(MooncakeKVReceiver, 7, port, manager).abort()
    got = prefill.recv_multipart() if prefill.poll(10_000) else None
    say(step="live", notice=[p.decode() for p in got] if got else None)

    prefill.close(linger=0)  # the prefill dies; SGLang's cached socket never reconnects
    sock, _ = MooncakeKVReceiver._connect_to_bootstrap_server({"rank_ip": "127.0.0.1", "rank_port": port})
    deadline = time.monotonic() + 10
    while sock.poll(0, zmq.POLLOUT) and time.monotonic() < deadline:
        time.sleep(0.05)
    say(step="dead", peer_gone=not sock.poll(0, zmq.POLLOUT))

    def watchdog():
        time.sleep(BLOCKED_AFTER_S)
        say(step="blocked", after_s=BLOCKED_AFTER_S)
        os._exit(3)  # the blocked send holds SGLang's socket; nothing else can end this process

    threading.Thread(target=watchdog, daemon=True).start()
    started = time.monotonic()
    dead = receiver(MooncakeKVReceiver, 8, port, manager)
    dead.abort()
    say(step="aborted", returned_in_s=time.monotonic() - started, failed=manager.failed,
        notified=dead.abort_notified, shadow_left="_connect_to_bootstrap_server" in vars(dead))


if __name__ == "__main__":
    main()
