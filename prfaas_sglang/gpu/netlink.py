"""A network namespace behind a rate-shaped veth, made through netlink (pyroute2), no iproute2.

The lent GPU machine has no ``ip`` or ``tc``; pyroute2 talks netlink directly. Layout::

    root namespace                      namespace NAME
    HOST_IF 10.78.0.1/30  <-- veth -->  INNER_IF 10.78.0.2/30, default route via 10.78.0.1
                                        tbf on INNER_IF: everything leaving NAME at RATE
    netem on HOST_IF (where the kernel has it, :func:`set_delay`): everything entering NAME delayed

A process started with ``preexec_fn=ns.enter`` runs inside NAME: what it sends (a PrfaaS
server's KV) crosses the shaped link; what it receives does not. Needs root.

NAME reaches no DNS server, so a name lookup there waits out the resolver's timeouts: torch's
TCPStore (SGLang's rank-0 rendezvous, with itself) timed out that way, and SGLang never started
inside (real SGLang on CPU, 2026-11-26). ``enter`` therefore also gives the child its own mount
namespace with a resolv.conf bound over ``/etc/resolv.conf`` that names no server: glibc asks
127.0.0.1, nothing answers there, and a lookup fails at once. The host's is untouched.

The veth's names and addresses are fixed, so one shaped namespace exists at a time on a host: the
first holds an exclusive lock (``/run/prfaas-netns/shaped.lock``) while it lives, and a second is
refused with :class:`ShapedLinkBusy` naming the holder, where it used to delete the first one's veth
as stale and cut a running harness off its servers. Leftovers with no live holder are still removed.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import os
from collections.abc import Iterator
from dataclasses import dataclass

HOST_IP, INNER_IP, PREFIX = "10.78.0.1", "10.78.0.2", 30
HOST_IF, INNER_IF = "pfe2e0", "pfe2e1"
RUN_DIR = "/run/prfaas-netns"


class ShapedLinkBusy(RuntimeError):
    """Another live process holds the host's one shaped namespace."""


@dataclass(frozen=True)
class ShapedNamespace:
    name: str
    host_ip: str
    inner_ip: str
    rate_mbit: float
    resolv_conf: str | None = None  # bound over /etc/resolv.conf in the child (see the module)

    def enter(self) -> None:
        """``preexec_fn``: move the child into the namespace (and, with ``resolv_conf``, a mount
        namespace of its own with that file as ``/etc/resolv.conf``) before it execs."""
        from pyroute2 import netns

        netns.setns(self.name)
        if self.resolv_conf is not None:
            private_resolv_conf(self.resolv_conf)


_CLONE_NEWNS, _MS_BIND, _MS_REC, _MS_PRIVATE = 0x00020000, 4096, 1 << 14, 1 << 18


def private_resolv_conf(path: str) -> None:
    """In this process: a mount namespace of its own, where ``path`` is ``/etc/resolv.conf``."""
    libc = ctypes.CDLL(None, use_errno=True)
    for call, what in ((lambda: libc.unshare(_CLONE_NEWNS), "unshare(CLONE_NEWNS)"),
                       (lambda: libc.mount(None, b"/", None, _MS_REC | _MS_PRIVATE, None), "make / private"),
                       (lambda: libc.mount(path.encode(), b"/etc/resolv.conf", None, _MS_BIND, None), "bind resolv.conf")):
        if call() != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"{what}: {os.strerror(err)}")


def tbf_burst_bytes(rate_mbit: float) -> int:
    """A token bucket that holds 4 ms at the rate, at least 64 KiB (the kernel needs one segment
    plus headroom for TSO bursts)."""
    return max(64 * 1024, int(rate_mbit * 1e6 / 8 * 0.004))


@contextlib.contextmanager
def asyncio_default_loops() -> Iterator[None]:
    """pyroute2 opens its netlink sockets on an event loop of the process's policy; uvloop's cannot
    carry AF_NETLINK, and importing SGLang's tokenizer manager installs uvloop's policy process-wide."""
    import asyncio

    policy = asyncio.get_event_loop_policy()
    asyncio.set_event_loop_policy(asyncio.DefaultEventLoopPolicy())
    try:
        yield
    finally:
        asyncio.set_event_loop_policy(policy)


@contextlib.contextmanager
def shaped_namespace(name: str, rate_mbit: float) -> Iterator[ShapedNamespace]:
    """Create the namespace, veth and shaper; remove them on exit (also on error). Raises
    :class:`ShapedLinkBusy` while another process's shaped namespace lives."""
    with _exclusive_lock(os.path.join(RUN_DIR, "shaped.lock")):
        with _shaped(name, rate_mbit) as ns:
            yield ns


@contextlib.contextmanager
def _exclusive_lock(path: str) -> Iterator[None]:
    """Hold ``path`` locked (``flock``) for the block; the holder's pid is in the file."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            raise ShapedLinkBusy(f"the shaped link ({HOST_IF}, {HOST_IP}) is in use by process {holder}; "
                                 "one at a time on a host") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        yield
    finally:
        os.close(fd)  # closing releases the lock (a forked child's copy keeps it until it exits or execs)


@contextlib.contextmanager
def _shaped(name: str, rate_mbit: float) -> Iterator[ShapedNamespace]:
    from pyroute2 import netns

    resolv, owner = _write_no_dns_resolv_conf(name), os.getpid()
    try:
        with asyncio_default_loops():
            if name in netns.listnetns():
                netns.remove(name)
            netns.create(name)
            _wire(name, rate_mbit)
        yield ShapedNamespace(name, HOST_IP, INNER_IP, rate_mbit, resolv)
    finally:
        if os.getpid() == owner:  # a forked child that unwinds through here must not undo them
            with asyncio_default_loops():
                _unwire(name)
            with contextlib.suppress(OSError):
                os.remove(resolv)


def _write_no_dns_resolv_conf(name: str) -> str:
    """A regular file for ``/etc/resolv.conf`` in the namespace, naming no server. Not ``/dev/null``:
    with that bound there SGLang's rank-0 rendezvous still failed (a plain TCPStore did not; cause
    not pinned down). Not in a ``tempfile`` directory either: that file vanished under a running
    check, very likely removed by a forked pyroute2 helper that unwound through the directory's cleanup
    (not reproduced; fixed by ``bench.__main__.exit_on_sigterm``). This one is removed only by the
    process that made it."""
    os.makedirs(RUN_DIR, exist_ok=True)
    path = os.path.join(RUN_DIR, f"{name}.resolv.conf")
    with open(path, "w") as f:
        f.write("# no DNS server is reachable from this network namespace: lookups fail at once\n")
    return path


def _wire(name: str, rate_mbit: float) -> None:
    from pyroute2 import IPRoute, NetNS

    with IPRoute() as ipr:
        for stale in ipr.link_lookup(ifname=HOST_IF):
            ipr.link("del", index=stale)
        ipr.link("add", ifname=HOST_IF, kind="veth", peer={"ifname": INNER_IF, "net_ns_fd": name})
        host = ipr.link_lookup(ifname=HOST_IF)[0]
        ipr.addr("add", index=host, address=HOST_IP, prefixlen=PREFIX)
        ipr.link("set", index=host, state="up")
    with NetNS(name) as ns:
        ns.link("set", index=ns.link_lookup(ifname="lo")[0], state="up")
        inner = ns.link_lookup(ifname=INNER_IF)[0]
        ns.addr("add", index=inner, address=INNER_IP, prefixlen=PREFIX)
        ns.link("set", index=inner, state="up")
        ns.route("add", dst="default", gateway=HOST_IP)
        ns.tc("add", "tbf", inner, 0x10000, rate=f"{int(rate_mbit * 1000)}kbit", burst=tbf_burst_bytes(rate_mbit),
              latency="100ms")


def set_delay(rtt_ms: float | None) -> None:
    """Delay everything that enters the namespace (requests, the KV's acknowledgements) by ``rtt_ms``
    with netem on the veth's host end, so that a round trip across the link takes that long; None
    removes the delay. The KV leaving the namespace stays under the tbf alone. Raises pyroute2's
    ``NetlinkError`` where the kernel has no netem (this dev machine's: ENOENT)."""
    from pyroute2 import IPRoute
    from pyroute2.netlink.exceptions import NetlinkError

    with asyncio_default_loops(), IPRoute() as ipr:
        host = ipr.link_lookup(ifname=HOST_IF)[0]
        with contextlib.suppress(NetlinkError):  # none there yet
            ipr.tc("del", index=host, root=True)
        if rtt_ms:
            # a queue that holds a round trip of acknowledgements at any rate this harness uses
            ipr.tc("add", "netem", host, 0x10000, delay=int(rtt_ms * 1000), limit=100_000)


def delay_unavailable() -> str | None:
    """None when :func:`set_delay` works here (tried, then removed), else why not."""
    from pyroute2.netlink.exceptions import NetlinkError

    try:
        set_delay(1.0)
    except NetlinkError as err:
        return f"no netem in this kernel ({err})"
    set_delay(None)
    return None


def _unwire(name: str) -> None:
    from pyroute2 import IPRoute, netns

    with contextlib.suppress(Exception), IPRoute() as ipr:
        for index in ipr.link_lookup(ifname=HOST_IF):
            ipr.link("del", index=index)
    with contextlib.suppress(Exception):
        netns.remove(name)
