"""Socket options on this process's Mooncake connections: a reset on close, keepalive (I/O adapter).

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

Keepalive (:class:`KeepAlive`) is for the connections nothing else would ever end. The reset a
lane's close sends on a dark link is lost, and the receiving side's session reads, never writes:
it keeps its socket ESTABLISHED until the process ends, one per lane per outage. Keepalive
probes find the peer gone (a reset from its host once the link is back, or no answer) and end it.
On an idle lane across a NAT or a load balancer, probes also keep the middlebox's flow entry
(cloud NATs drop idle flows after 4-6 minutes), so the next transfer does not stall on a lane
that silently went dead.
"""

from __future__ import annotations

import os
import socket
import struct
from collections.abc import Callable
from dataclasses import dataclass

from prfaas_sglang.adapters.tcpinfo import own_sockets
from prfaas_sglang.transport.wan_defaults import MOONCAKE_RPC_PORTS

_LINGER_RESET = struct.pack("ii", 1, 0)
SO_MAX_PACING_RATE = getattr(socket, "SO_MAX_PACING_RATE", 47)  # Linux; Python 3.11 does not name it
_PACING_UNLIMITED = 0xFFFFFFFFFFFFFFFF  # ~0UL: no cap


def linger_reset(sock: socket.socket) -> bool:
    """Whether ``sock`` will be reset on close (``SO_LINGER`` on, zero seconds)."""
    onoff, seconds = struct.unpack("ii", sock.getsockopt(socket.SOL_SOCKET, socket.SO_LINGER, 8))
    return bool(onoff) and seconds == 0


def _peer_of(sock: socket.socket) -> tuple[str, int] | None:
    """``sock``'s peer (host without the IPv4-mapped prefix, port); None while not connected."""
    try:
        host, port = sock.getpeername()[:2]
    except OSError:
        return None
    return host.removeprefix("::ffff:"), port


class _SocketScan:
    """Looks at the TCP sockets this process holds, each until ``decide`` gives a final answer
    (True: changed, False: left alone), then never again. Not thread-safe: one caller."""

    def __init__(self):
        self._settled: set[int] = set()  # inodes with a final answer

    def _scan(self, decide: Callable[[socket.socket], bool | None]) -> int:
        """Sockets ``decide`` changed in this call. Costs a ``readlink`` per descriptor and a few
        system calls per socket not yet settled."""
        current = own_sockets()
        count = 0
        for inode, fd in current.items():
            if inode in self._settled:
                continue
            verdict = self._examine(fd, inode, decide)
            if verdict is not None:
                self._settled.add(inode)
                count += verdict
        self._settled &= current.keys()
        return count

    @staticmethod
    def _examine(fd: int, inode: int, decide: Callable[[socket.socket], bool | None]) -> bool | None:
        """``decide`` on a connected TCP socket; False (final) for anything else; None: look again
        later (not connected yet, or the descriptor went meanwhile)."""
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
            except OSError:
                return None
            return decide(sock)


class ResetOnClose(_SocketScan):
    """Sets ``SO_LINGER`` {on, 0} on every TCP socket of this process connected to a port in
    ``port_range`` (Mooncake's handshake and data ports) of one of the ``peer_ips`` given to
    :meth:`scan`. Each socket is looked at until its answer is final (connected, or not a TCP
    client), then never again. Not thread-safe: one caller."""

    def __init__(self, port_range: tuple[int, int] = MOONCAKE_RPC_PORTS):
        super().__init__()
        self.port_range = port_range
        self.sockets_reset = 0  # sockets given the option, in all

    def scan(self, peer_ips: set[str]) -> int:
        """Look at the sockets this process holds now; how many were given the option by this call."""
        lo, hi = self.port_range

        def decide(sock: socket.socket) -> bool | None:
            peer = _peer_of(sock)
            if peer is None:
                return None  # not connected (yet)
            if not lo <= peer[1] <= hi:
                return False
            if peer[0] not in peer_ips:
                return None  # to no peer of ours yet
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RESET)
            return True

        count = self._scan(decide)
        self.sockets_reset += count
        return count


@dataclass(frozen=True)
class KeepAliveSettings:
    """TCP keepalive: the first probe after ``idle_s`` without traffic, then every ``interval_s``;
    the connection ends after ``probes`` unanswered ones (or at once on a reset). A dead peer of an
    idle connection is found within ``idle_s + probes * interval_s``."""

    idle_s: int
    interval_s: int
    probes: int

    @classmethod
    def parse(cls, text: str) -> KeepAliveSettings:
        """``"idle_s,interval_s,probes"``, whole seconds (``PRFAAS_KV_KEEPALIVE``). Raises ValueError
        naming what is wrong."""
        parts = [p.strip() for p in text.split(",")]
        if len(parts) != 3 or not all(p.isascii() and p.isdigit() for p in parts):
            raise ValueError(f"{text!r}: expected three whole numbers 'idle_s,interval_s,probes'")
        idle_s, interval_s, probes = (int(p) for p in parts)
        # Linux bounds: TCP_KEEPIDLE and TCP_KEEPINTVL 1..32767 s, TCP_KEEPCNT 1..127
        if not (1 <= idle_s <= 32767 and 1 <= interval_s <= 32767 and 1 <= probes <= 127):
            raise ValueError(f"{text!r}: idle_s and interval_s must be 1..32767 s, probes 1..127")
        return cls(idle_s, interval_s, probes)

    def bound_s(self) -> int:
        return self.idle_s + self.probes * self.interval_s


def keepalive_of(sock: socket.socket) -> KeepAliveSettings | None:
    """``sock``'s keepalive settings; None when keepalive is off."""
    if not sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE):
        return None
    return KeepAliveSettings(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE),
                             sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL),
                             sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT))


class KeepAlive(_SocketScan):
    """Turns TCP keepalive on, with ``settings``, for every TCP connection of this process whose local
    or remote port is in ``port_range`` (Mooncake's handshake and data ports: the lanes it opened and
    the ones its server accepted). Not thread-safe: one caller."""

    def __init__(self, settings: KeepAliveSettings, port_range: tuple[int, int] = MOONCAKE_RPC_PORTS):
        super().__init__()
        self.settings, self.port_range = settings, port_range
        self.sockets_set = 0  # sockets given keepalive, in all

    def scan(self) -> int:
        """Look at the sockets this process holds now; how many got keepalive by this call."""
        lo, hi = self.port_range

        def decide(sock: socket.socket) -> bool | None:
            peer = _peer_of(sock)
            if peer is None:
                return None
            if not (lo <= peer[1] <= hi or lo <= sock.getsockname()[1] <= hi):
                return False
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, self.settings.idle_s)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, self.settings.interval_s)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, self.settings.probes)
            return True

        count = self._scan(decide)
        self.sockets_set += count
        return count


def max_pacing_rate(sock: socket.socket) -> int | None:
    """``sock``'s pacing cap in bytes per second; None when it has none."""
    (rate,) = struct.unpack("Q", sock.getsockopt(socket.SOL_SOCKET, SO_MAX_PACING_RATE, 8))
    return None if rate in (_PACING_UNLIMITED, 0xFFFFFFFF) else rate


def set_lane_pacing(bytes_per_s: int | None, peer_ips: set[str],
                    port_range: tuple[int, int] = MOONCAKE_RPC_PORTS) -> int:
    """Give every TCP connection of this process to a port in ``port_range`` of one of ``peer_ips``
    (Mooncake's lanes to those peers) the pacing cap ``bytes_per_s`` (``SO_MAX_PACING_RATE``; None
    lifts it); how many connections were set. The kernel paces each socket at no more than its cap,
    whatever its congestion control computes. Raises OSError where the option is not supported."""
    lo, hi = port_range
    value = struct.pack("Q", _PACING_UNLIMITED if bytes_per_s is None else bytes_per_s)
    count = 0

    def decide(sock: socket.socket) -> bool:
        nonlocal count
        peer = _peer_of(sock)
        if peer is not None and lo <= peer[1] <= hi and peer[0] in peer_ips:
            sock.setsockopt(socket.SOL_SOCKET, SO_MAX_PACING_RATE, value)
            count += 1
        return False

    _SocketScan()._scan(decide)
    return count


def mooncake_connections(port_range: tuple[int, int] = MOONCAKE_RPC_PORTS) -> list[tuple[tuple[str, int], tuple[str, int]]]:
    """This process's connected TCP sockets with a local or remote port in ``port_range``, as
    ((local host, port), (remote host, port)), hosts without the IPv4-mapped prefix."""
    lo, hi = port_range
    found = []

    def note(sock: socket.socket) -> bool:
        peer = _peer_of(sock)
        if peer is not None:
            host, port = sock.getsockname()[:2]
            if lo <= peer[1] <= hi or lo <= port <= hi:
                found.append(((host.removeprefix("::ffff:"), port), peer))
        return False

    _SocketScan()._scan(note)
    return found
