"""Hooks: a decode receiver's sends to a prefill never block the decode's scheduler.

A PD decode worker's Mooncake receiver sends to each prefill rank over a ZMQ PUSH socket that SGLang
0.5.15 caches per endpoint (``CommonKVReceiver._connect``), created with ``RECONNECT_IVL=-1`` and no
send timeout. Once that prefill has died, its connection is gone for good, the socket has no peer,
and a PUSH send **blocks forever** on the scheduler's main thread: every request on the decode hangs
and its ``/health`` fails. The decode's heartbeat thread then blocks too, on the same socket's lock,
when it tries to drop the dead endpoint. The cached socket outlives the prefill until that heartbeat
gives it up (two failed checks, about 10 s), so two sends hit it:

* the **abort notice** (``_send_abort_notification``, "best-effort"): the router aborts the decode
  leg when the prefill leg fails. Seen with real SGLang servers on CPU (``bench gpu-e2e --engine
  sglang-cpu --checks failover``: 8 of 8 long requests hung once the PrfaaS server was killed
  mid-run; ``py-spy`` put the decode scheduler in ``Socket.send``);
* the **metadata** naming the decode's pages (``send_metadata``), for a request whose prefill leg
  went to that prefill in the same window (its bootstrap information is cached too, so nothing else
  touches the network first).

``notify_without_blocking`` (AROUND ``CommonKVReceiver._send_abort_notification``) and
``send_metadata_without_blocking`` (AROUND ``MooncakeKVReceiver.send_metadata``) run SGLang's own
code with each ``send_multipart`` of that call made with ``zmq.NOBLOCK``. To a live prefill the
message goes out as before (ZMQ queues it; a queue at its high-water mark, 1,000 messages, also
refuses). To a dead one the send raises ``zmq.Again`` at once: the abort notice's own ``except`` logs
it; for the metadata, the room is recorded failed, as SGLang records a prefill it could not reach at
bootstrap, and the decode releases it through its usual failure path. The cached socket and its
lock are SGLang's, untouched: an instance attribute shadows the class's socket lookup for the
duration of the call and is removed after.
"""

from __future__ import annotations

import contextlib

import zmq


class _NonBlockingSends:
    """A ZMQ socket whose ``send_multipart`` does not wait for a peer; everything else is the socket's."""

    def __init__(self, sock):
        self._sock = sock

    def send_multipart(self, parts, flags: int = 0, **kwargs):
        return self._sock.send_multipart(parts, flags=flags | zmq.NOBLOCK, **kwargs)

    def __getattr__(self, name):
        return getattr(self._sock, name)


@contextlib.contextmanager
def _sends_without_blocking(receiver):
    """Within: ``receiver``'s socket lookups hand out non-blocking senders (see the module)."""
    if "_connect_to_bootstrap_server" in vars(receiver):  # someone else's instance override: leave it alone
        yield
        return
    connect = type(receiver)._connect_to_bootstrap_server

    def connect_nonblocking(bootstrap_info):
        sock, lock = connect(bootstrap_info)
        return _NonBlockingSends(sock), lock

    receiver._connect_to_bootstrap_server = connect_nonblocking
    try:
        yield
    finally:
        del receiver._connect_to_bootstrap_server


def notify_without_blocking(original, self, *args, **kwargs):
    with _sends_without_blocking(self):
        return original(self, *args, **kwargs)


def send_metadata_without_blocking(original, self, *args, **kwargs):
    try:
        with _sends_without_blocking(self):
            return original(self, *args, **kwargs)
    except zmq.Again:
        from sglang.srt.disaggregation.base.conn import KVPoll

        peers = ", ".join(f"{info.get('rank_ip')}:{info.get('rank_port')}" for info in self.bootstrap_infos or ())
        self.kv_mgr.record_failure(self.bootstrap_room, f"prefill rank(s) {peers} unreachable: the metadata "
                                                        "send found no connected peer (prefill dead?)")
        self.kv_mgr.update_status(self.bootstrap_room, KVPoll.Failed)
        return None
