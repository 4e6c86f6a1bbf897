"""Reading the kernel's TCP_INFO for this process's connections, with iproute2's ``ss`` (I/O adapter).

``ss -tineH state established`` asks ``inet_diag`` for every established TCP socket of the
current network namespace with its TCP_INFO and socket inode; this process's own sockets are
the inodes behind ``/proc/self/fd``. One call costs a few milliseconds. Parsing and everything
computed from it live in :mod:`prfaas_sglang.transport.tcpstate` (pure).
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import subprocess

from prfaas_sglang.transport.tcpstate import TcpConn, kv_connections, parse_ss

_SOCKET = re.compile(r"socket:\[(\d+)\]")
SS_ARGS = ("-tineH", "state", "established")


def own_sockets() -> dict[int, int]:
    """The sockets this process holds open now: inode -> a descriptor of it (valid when read; it may be
    closed or reused at any time after, so check the inode behind it before relying on it)."""
    sockets: dict[int, int] = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            match = _SOCKET.fullmatch(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:  # closed meanwhile
            continue
        if match:
            sockets.setdefault(int(match.group(1)), int(fd))
    return sockets


def own_socket_inodes() -> set[int]:
    """Inodes of the sockets this process holds open now."""
    return set(own_sockets())


def available() -> bool:
    return shutil.which("ss") is not None and os.path.isdir("/proc/self/fd")


def read_own_kv_connections(peer_ips: set[str] | None = None) -> list[TcpConn]:
    """This process's established connections to Mooncake ports, with their TCP_INFO; [] when
    ``ss`` is missing or fails (telemetry then carries no ``tcp`` view). Blocks for one ``ss`` call."""
    try:
        out = subprocess.run(["ss", *SS_ARGS], capture_output=True, text=True, timeout=2)
    except (OSError, subprocess.TimeoutExpired):
        return []
    if out.returncode != 0:
        return []
    return kv_connections(parse_ss(out.stdout), own_socket_inodes(), peer_ips)


async def own_kv_connections(peer_ips: set[str] | None = None) -> list[TcpConn]:
    """:func:`read_own_kv_connections` off the event loop."""
    return await asyncio.to_thread(read_own_kv_connections, peer_ips)
