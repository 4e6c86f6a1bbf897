"""Hook: a decode's abort notice to a prefill never blocks the decode's scheduler.

When a request is aborted on a PD decode worker while its KV is still expected (the router aborts
the decode leg when the prefill leg fails, or a client disconnects), SGLang 0.5.15 runs
``CommonKVReceiver.abort`` -> ``_send_abort_notification`` on the scheduler's main thread: a
"best-effort" ZMQ ``send_multipart`` on the receiver's cached PUSH socket to each prefill rank. The
socket is created with ``RECONNECT_IVL=-1`` and no send timeout, so once that prefill has died its
connection is gone for good, the socket has no peer, and a PUSH send **blocks forever**: every
request on the decode hangs and its ``/health`` fails. The decode's heartbeat thread then blocks too,
on the same socket's lock, when it tries to drop the dead endpoint. Seen with real SGLang servers on
CPU (``bench gpu-e2e --engine sglang-cpu --checks failover``: 8 of 8 long requests hung once the
PrfaaS server was killed mid-run; ``py-spy`` put the decode scheduler in ``Socket.send``).

``notify_without_blocking`` (AROUND ``CommonKVReceiver._send_abort_notification``): SGLang's own
notice, with each ``send_multipart`` made with ``zmq.NOBLOCK``. To a live prefill the notice goes out
as before (ZMQ queues it); to a dead one the send raises ``zmq.Again`` at once, which SGLang's own
``except`` logs at debug and moves on. The cached socket and its lock are SGLang's, untouched: only
this call's sends are non-blocking (an instance attribute shadows the class's lookup for the
duration of the call and is removed after).
"""

from __future__ import annotations

import zmq


class _NonBlockingSends:
    """A ZMQ socket whose ``send_multipart`` does not wait for a peer; everything else is the socket's."""

    def __init__(self, sock):
        self._sock = sock

    def send_multipart(self, parts, flags: int = 0, **kwargs):
        return self._sock.send_multipart(parts, flags=flags | zmq.NOBLOCK, **kwargs)

    def __getattr__(self, name):
        return getattr(self._sock, name)


def notify_without_blocking(original, self):
    connect = type(self)._connect_to_bootstrap_server

    def connect_nonblocking(bootstrap_info):
        sock, lock = connect(bootstrap_info)
        return _NonBlockingSends(sock), lock

    shadowed = "_connect_to_bootstrap_server" in vars(self)
    if shadowed:  # someone else's instance override: leave it, and SGLang's behaviour, alone
        return original(self)
    self._connect_to_bootstrap_server = connect_nonblocking
    try:
        return original(self)
    finally:
        del self._connect_to_bootstrap_server
