"""A reset, not a graceful close, for this process's Mooncake connections (I/O adapter).

Mooncake 0.3.13 closes a failed TCP lane (its stall timeout, a status timeout) with a plain
``close()``. The kernel then keeps the unacknowledged bytes of the request the lane was sending
as an orphan socket and retransmits them for ``net.ipv4.tcp_orphan_retries`` (about 100 s by
default). The peer's server session has no timeout of its own and writes what it reads straight
into the destination, so when a dark link returns, the tail of a write the engine has already
reported failed still lands, in decode pages SGLang has freed by then. ``SO_LINGER`` on with a
zero timeout makes that close send a reset and drop the send queue: nothing is retransmitted.

A socket option belongs to the socket, not to a descriptor: it is set here on a duplicate of
Mooncake's descriptor (checked to be the same socket by its inode) and outlives the duplicate.
On a connection that works nothing changes: Mooncake closes a lane only once the request on it
is acknowledged or has failed.
"""

from __future__ import annotations

import os
import socket
import struct

from prfaas_sglang.adapters.tcpinfo import own_sockets
from prfaas_sglang.transport.wan_defaults import MOONCAKE_RPC_PORTS

_LINGER_RESET = struct.pack("ii", 1, 0)


def linger_reset(sock: socket.socket) -> bool:
    """Whether ``sock`` will be reset on close (``SO_LINGER`` on, zero seconds)."""
    onoff, seconds = struct.unpack("ii", sock.getsockopt(socket.SOL_SOCKET, socket.SO_LINGER, 8))
    return bool(onoff) and seconds == 0


class ResetOnClose:
    """Sets ``SO_LINGER`` {on, 0} on every TCP socket of this process connected to a port in
    ``port_range`` (Mooncake's handshake and data ports) of one of the ``peer_ips`` given to
    :meth:`scan`. Each socket is looked at until its answer is final (connected, or not a TCP
    client), then never again. Not thread-safe: one caller."""

    def __init__(self, port_range: tuple[int, int] = MOONCAKE_RPC_PORTS):
        self.port_range = port_range
        self._settled: set[int] = set()  # inodes with a final answer
        self.sockets_reset = 0  # sockets given the option, in all

    def scan(self, peer_ips: set[str]) -> int:
        """Look at the sockets this process holds now; how many were given the option by this call.
        Costs a ``readlink`` per descriptor and a few system calls per new socket."""
        current = own_sockets()
        count = 0
        for inode, fd in current.items():
            if inode in self._settled:
                continue
            verdict = self._examine(fd, inode, peer_ips)
            if verdict is not None:
                self._settled.add(inode)
                count += verdict
        self._settled &= current.keys()
        self.sockets_reset += count
        return count

    def _examine(self, fd: int, inode: int, peer_ips: set[str]) -> bool | None:
        """True: given the option; False: final, left alone; None: look again later (not connected
        yet, or to no peer of ours yet)."""
        try:
            dup = os.dup(fd)
        except OSError:
            return None
        try:
            if os.fstat(dup).st_ino != inode:  # the descriptor was reused meanwhile
                os.close(dup)
                return None
            sock = socket.socket(fileno=dup)  # owns ``dup`` from here; closing it leaves Mooncake's open
        except OSError:  # a family Python cannot wrap: not a TCP socket
            os.close(dup)
            return False
        with sock:
            if sock.type != socket.SOCK_STREAM or sock.family not in (socket.AF_INET, socket.AF_INET6):
                return False
            try:
                if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                    return False  # a listener
                host, port = sock.getpeername()[:2]
            except OSError:  # not connected (yet)
                return None
            lo, hi = self.port_range
            if not lo <= port <= hi:
                return False
            if host.removeprefix("::ffff:") not in peer_ips:
                return None
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RESET)
            return True
