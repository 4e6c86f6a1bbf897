"""Probe for ``test_receiver_sends.py``: SGLang's own Mooncake receiver sends to a live prefill rank and
then to one that has died. ``sys.argv[1]``: ``hooked`` (our plugin registered, as SGLang's plugin
loader does in every server process) or ``stock``; ``sys.argv[2]``: what is sent to the dead rank,
``metadata``, ``abort`` or ``both`` (in that order). Prints a JSON line per step; a send still running
after ``BLOCKED_AFTER_S`` is reported as ``blocked`` and the process exits."""

from __future__ import annotations

import json
import os
import sys
import threading
import time

import numpy as np
import zmq

BLOCKED_AFTER_S = 10.0


class _Manager:
    """What the receiver's ``abort`` and ``send_metadata`` touch on its KV manager."""

    local_ip = "127.0.0.1"
    rank_port = 40000
    enable_staging = False

    def __init__(self):
        self.failed: dict[int, str] = {}
        self.status: dict[int, str] = {}

    def record_failure(self, room, reason):
        self.failed[room] = reason

    def update_status(self, room, status):
        from sglang.srt.disaggregation.base.conn import KVPoll

        self.status[room] = next(name for name, value in vars(KVPoll).items() if value == status)


class _Trace:
    def abort(self, abort_info=None):
        pass

    def trace_req_finish(self):
        pass


def receiver(cls, room: int, port: int, manager: _Manager):
    """A receiver past bootstrap, as SGLang's decode holds it; only the fields these sends read."""
    r = object.__new__(cls)
    r.kv_mgr, r.bootstrap_room, r.trace_ctx, r.session_id = manager, room, _Trace(), "127.0.0.1:40001"
    r.bootstrap_infos = [{"rank_ip": "127.0.0.1", "rank_port": port, "is_dummy": False}]
    r.abort_notified, r.required_dst_info_num = False, 1
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
    pages = np.arange(4, dtype=np.int32)

    receiver(MooncakeKVReceiver, 9, port, manager).send_metadata(pages, 0)
    receiver(MooncakeKVReceiver, 7, port, manager).abort()
    got = [prefill.recv_multipart()[0].decode() if prefill.poll(10_000) else None for _ in range(2)]
    say(step="live", first_parts=got, failed=sorted(manager.failed))

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
    if sys.argv[2] in ("metadata", "both"):
        dead = receiver(MooncakeKVReceiver, 10, port, manager)
        dead.send_metadata(pages, 1)
        say(step="metadata", status=manager.status.get(10), reason=manager.failed.get(10),
            shadow_left="_connect_to_bootstrap_server" in vars(dead))
    if sys.argv[2] in ("abort", "both"):
        dead = receiver(MooncakeKVReceiver, 8, port, manager)
        dead.abort()
        say(step="aborted", status=manager.status.get(8), notified=dead.abort_notified,
            shadow_left="_connect_to_bootstrap_server" in vars(dead))


if __name__ == "__main__":
    main()
