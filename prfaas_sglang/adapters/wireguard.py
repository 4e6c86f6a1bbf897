"""A host's WireGuard tunnel, up and down (I/O): the kernel's WireGuard where the host has it, ``wireguard-go`` otherwise.

What it sets up is :class:`~prfaas_sglang.transport.tunnel_plan.TunnelPlan`'s (interface, peers, the policy
routing that sends each peer's address into the tunnel and drops it when the tunnel is gone); this module
only runs ``ip``, ``wg`` and ``wireguard-go`` for it. ``wrap`` (e.g. ``("ip", "netns", "exec", NS)``) runs
every command in another network namespace. Needs CAP_NET_ADMIN (root, or a pod's NET_ADMIN).

    with Tunnel(plan, keys.tunnel_private_key(host)):
        ...   # traffic to plan.peer_hosts is encrypted; it is dropped, never sent in clear, once the tunnel goes

Two locks keep a peer's traffic out of the clear. Routing (the plan's rule and table) sends it into the
tunnel and blackholes it when the tunnel is gone. A netfilter filter (``nft``, where the host has it) drops
whatever would still leave for a peer by another interface, the tunnel's own UDP excepted, and counts it
(:meth:`Tunnel.blocked_packets`): a count above zero means routing failed to hold, and nothing leaked.
"""

from __future__ import annotations

import base64
import ipaddress
import os
import re
import shutil
import subprocess
import tempfile
import time

from prfaas_sglang.errors import PrfaasError
from prfaas_sglang.transport.tunnel_plan import (
    FWMARK,
    KEEPALIVE_S,
    RULE_PRIORITY,
    TABLE,
    TUNNEL_MTU,
    Peer,
    TunnelPlan,
    moved_peers,
)
from prfaas_sglang.wire.auth import DeploymentKeys


class TunnelError(PrfaasError):
    """A tunnel cannot be brought up here (no WireGuard, no privilege) or a command of it failed."""


def unavailable(userspace: str | None = None) -> str | None:
    """None when a :class:`Tunnel` can be brought up here, else why not."""
    if shutil.which("wg") is None:
        return "needs wireguard-tools (wg)"
    if shutil.which("ip") is None:
        return "needs iproute2 (ip)"
    if os.geteuid() != 0:
        return "needs CAP_NET_ADMIN (root)"
    if not _kernel_module() and shutil.which(userspace or "wireguard-go") is None:
        return "needs the kernel's WireGuard or wireguard-go"
    return None


def _kernel_module() -> bool:
    return os.path.isdir("/sys/module/wireguard")


def public_key(private: bytes) -> str:
    """The base64 public key of a 32-byte private key (``wg pubkey``, which clamps it as WireGuard does)."""
    proc = subprocess.run(["wg", "pubkey"], input=base64.b64encode(private).decode() + "\n", capture_output=True,
                          text=True, timeout=10)
    if proc.returncode != 0:
        raise TunnelError(f"wg pubkey failed: {proc.stderr.strip()}")
    return proc.stdout.strip()


def public_keys(keys: DeploymentKeys):
    """``host -> public key`` for :func:`~prfaas_sglang.transport.tunnel_plan.plan`, from the deployment's keys."""
    return lambda host: public_key(keys.tunnel_private_key(host))


def not_up(plan: TunnelPlan, wrap: tuple[str, ...] = ()) -> str | None:
    """None when ``plan``'s tunnel is up here (its interface, with a peer for each of the plan's), else what is missing."""
    if shutil.which("wg") is None:
        return "wireguard-tools (wg) is not installed"
    proc = subprocess.run([*wrap, "wg", "show", plan.interface, "peers"], capture_output=True, text=True, timeout=10)
    if proc.returncode != 0:
        return f"no tunnel interface {plan.interface}"
    if len(proc.stdout.split()) != len(plan.peers):
        return f"{plan.interface} has {len(proc.stdout.split())} peers, the plan {len(plan.peers)}"
    return None


HOLDER_LOCK_DIR = "/var/run/wireguard"  # wireguard-go's sockets' directory: where two holders of a name would clash


class Tunnel:
    """The tunnel of ``plan`` while the context is open (``up``/``down`` otherwise). ``userspace``: the
    wireguard-go binary to use where the kernel has no WireGuard (default: ``wireguard-go`` on PATH).
    One holder per interface name: ``up`` takes an exclusive lock beside wireguard-go's socket (released by
    ``down`` or the holder's exit), so a second holder of the same host's tunnel is refused instead of
    replacing the live interface under the first."""

    def __init__(self, plan: TunnelPlan, private_key: bytes, wrap: tuple[str, ...] = (), userspace: str | None = None):
        self.plan, self._private, self.wrap = plan, private_key, wrap
        self.userspace = userspace or "wireguard-go"
        self._daemon: subprocess.Popen | None = None
        self._lock: int | None = None  # the holder lock's file descriptor while up
        self.kernel = False
        self.filtered = False  # the netfilter lock is set (``nft`` here)

    def _hold(self) -> None:
        """The holder lock of this interface name, or TunnelError naming it when another holder has it."""
        import fcntl

        os.makedirs(HOLDER_LOCK_DIR, exist_ok=True)
        path = os.path.join(HOLDER_LOCK_DIR, f"{self.plan.interface}.prfaas-holder")
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise TunnelError(f"the tunnel {self.plan.interface} of {self.plan.host} is held by another process here "
                              f"({path}); stop that holder first") from None
        self._lock = fd

    def _release(self) -> None:
        if self._lock is not None:
            os.close(self._lock)  # closing the descriptor drops its flock
            self._lock = None

    def _run(self, *args: str, check: bool = True, stdin: str | None = None) -> subprocess.CompletedProcess:
        proc = subprocess.run([*self.wrap, *args], capture_output=True, text=True, timeout=30, input=stdin)
        if check and proc.returncode != 0:
            raise TunnelError(f"{' '.join(args)}: {proc.stderr.strip() or proc.returncode}")
        return proc

    def up(self) -> None:
        why = unavailable(self.userspace)
        if why:
            raise TunnelError(f"cannot bring up the tunnel of {self.plan.host}: {why}")
        name = self.plan.interface
        if self._lock is None:
            self._hold()
        try:
            self._interface(name)
            with tempfile.NamedTemporaryFile("w", prefix="prfaas-wg-", delete=True) as key:
                os.chmod(key.name, 0o600)
                key.write(base64.b64encode(self._private).decode() + "\n")
                key.flush()
                peers = [arg for p in self.plan.peers for arg in _peer_args(p)]
                self._run("wg", "set", name, "private-key", key.name, "listen-port", str(self.plan.listen_port),
                          "fwmark", str(FWMARK), *peers)
            self._run("ip", "link", "set", name, "mtu", str(TUNNEL_MTU), "up")
            for peer in self.plan.peer_hosts:
                self._route(peer)
            for cidr in self.plan.locked:  # the far side's ranges: what no peer route covers is dropped
                self._run("ip", _family(cidr), "route", "replace", "blackhole", cidr, "table", str(TABLE), "metric", "100")
            for family in sorted({_family(p) for p in (*self.plan.peer_hosts, *self.plan.locked)}):
                # never deleted while up: between a delete and an add, the peers' traffic would take the main table
                if not self._run("ip", family, "rule", "show", "priority", str(RULE_PRIORITY)).stdout.strip():
                    self._run("ip", family, "rule", "add", "not", "fwmark", str(FWMARK), "table", str(TABLE),
                              "priority", str(RULE_PRIORITY))
            self._filter()
        except BaseException:
            self.take_down_interface()  # what failed leaves the peers blackholed, and other tunnels here untouched
            self._release()
            raise

    def _route(self, peer: str) -> None:
        """``peer``'s address into the tunnel, and blackholed beneath (what holds while the interface is gone)."""
        family = _family(peer)
        self._run("ip", family, "route", "replace", "blackhole", _prefix(peer), "table", str(TABLE), "metric", "100")
        self._run("ip", family, "route", "replace", _prefix(peer), "dev", self.plan.interface, "src", self.plan.address,
                  "table", str(TABLE), "metric", "1")

    def _unroute(self, peer: str) -> None:
        """What :meth:`_route` added for ``peer`` (each may be gone already: the interface's goes with it)."""
        family, table = _family(peer), ("table", str(TABLE))
        self._run("ip", family, "route", "del", _prefix(peer), "dev", self.plan.interface, *table, "metric", "1",
                  check=False)
        self._run("ip", family, "route", "del", "blackhole", _prefix(peer), *table, "metric", "100", check=False)

    def update(self, new: TunnelPlan) -> list[tuple[str, str]]:
        """Follow peers whose names resolved to new addresses (a recreated pod): each moved peer's endpoint and
        allowed address, its routes and the netfilter lock, the new address blackholed before the old one is
        released. Returns (old, new) addresses of the peers moved; the plan must be this host's, resolved again."""
        if (new.host, new.interface, new.address) != (self.plan.host, self.plan.interface, self.plan.address):
            raise TunnelError(f"an update of the tunnel of {self.plan.host} is for another host or address "
                              f"({new.host} at {new.address}): bring a new tunnel up instead")
        moved = moved_peers(self.plan, new)
        for _, after in moved:
            self._run("wg", "set", self.plan.interface, *_peer_args(after))
            self._route(after.address)
        self.plan = new
        if moved:
            self._filter()
            for before, _ in moved:
                if before.address not in new.peer_hosts:  # two peers may have swapped addresses
                    self._unroute(before.address)
        return [(before.address, after.address) for before, after in moved]

    @property
    def _filter_table(self) -> str:
        return f"prfaas_{self.plan.interface}"

    def _filter(self) -> None:
        """The netfilter lock: packets for a peer leave by the tunnel's interface or carry the tunnel's mark (its
        own UDP), else they are counted and dropped. Replaced whole, so a second ``up`` leaves one copy."""
        if shutil.which("nft") is None:
            return
        destinations = self.plan.locked_destinations()
        v4 = ", ".join(d for d in destinations if ":" not in d)
        v6 = ", ".join(d for d in destinations if ":" in d)
        rules = "".join(f"        {family} daddr {{ {hosts} }} oifname != \"{self.plan.interface}\" meta mark != {FWMARK} "
                        "counter drop\n" for family, hosts in (("ip", v4), ("ip6", v6)) if hosts)
        chains = "".join(f"    chain {hook} {{\n        type filter hook {hook} priority 0; policy accept;\n{rules}    }}\n"
                         for hook in ("output", "forward"))  # this host's own traffic, and what it routes for others
        table = self._filter_table  # one transaction: created if missing, emptied, filled (never a moment without)
        self._run("nft", "-f", "-", stdin=f"table inet {table} {{}}\ndelete table inet {table}\n"
                                         f"table inet {table} {{\n{chains}}}\n")
        self.filtered = True

    def blocked_packets(self) -> int | None:
        """Packets the netfilter lock dropped since ``up`` (routing would have sent them in clear); None without it."""
        if not self.filtered:
            return None
        proc = self._run("nft", "list", "table", "inet", self._filter_table, check=False)
        return sum(int(n) for n in re.findall(r"counter packets (\d+)", proc.stdout)) if proc.returncode == 0 else None

    def _interface(self, name: str) -> None:
        """The kernel's WireGuard interface where it has one, else a wireguard-go daemon of ours (foreground)."""
        self._run("ip", "link", "del", name, check=False)  # a stale one of an earlier run
        if _kernel_module() and self._run("ip", "link", "add", name, "type", "wireguard", check=False).returncode == 0:
            self.kernel = True
            return
        env = {**os.environ, "WG_PROCESS_FOREGROUND": "1", "LOG_LEVEL": "error"}
        self._daemon = subprocess.Popen([*self.wrap, self.userspace, name], env=env, stdin=subprocess.DEVNULL,
                                        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 10
        while self._run("ip", "link", "show", name, check=False).returncode != 0:
            if self._daemon.poll() is not None or time.monotonic() > deadline:
                raise TunnelError(f"{self.userspace} {name} did not start: {(self._daemon.stderr.read() or '').strip()[-300:]}")
            time.sleep(0.05)
        while self._run("wg", "show", name, check=False).returncode != 0:  # its control socket, a moment later
            if self._daemon.poll() is not None or time.monotonic() > deadline:
                raise TunnelError(f"{self.userspace} {name} opened no control socket")
            time.sleep(0.05)

    def down(self) -> None:
        """Remove what ``up`` added for this tunnel: its interface, its peers' routes, its netfilter table, and the
        rule once no tunnel here has a route left in the table (the rule is every tunnel's on this host: taking it
        with another tunnel up would send that one's peers' traffic in clear). Safe to call twice."""
        self.take_down_interface()
        for peer in self.plan.peer_hosts:
            self._unroute(peer)
        routed = {family: self._routed(family) for family in {_family(cidr) for cidr in self.plan.locked}}
        for cidr in self.plan.locked:  # unless another tunnel here still routes a peer inside it
            if not any(_within(destination, cidr) for destination in routed[_family(cidr)]):
                self._run("ip", _family(cidr), "route", "del", "blackhole", cidr, "table", str(TABLE), "metric", "100",
                          check=False)
        for family in ("-4", "-6"):
            if not self._run("ip", family, "route", "show", "table", str(TABLE), check=False).stdout.strip():
                self._run("ip", family, "rule", "del", "priority", str(RULE_PRIORITY), check=False)
        if self.filtered:
            self._run("nft", "delete", "table", "inet", self._filter_table, check=False)
            self.filtered = False
        self._release()

    def _routed(self, family: str) -> list[str]:
        """The destinations the tunnels' table routes in ``family`` (``-4``/``-6``), blackholes aside."""
        lines = self._run("ip", family, "route", "show", "table", str(TABLE), check=False).stdout.splitlines()
        return [line.split()[0] for line in lines if line and not line.startswith("blackhole")]

    def take_down_interface(self) -> None:
        """The interface alone goes (what a crashed tunnel looks like): the blackhole routes stay, so traffic to
        the peers is dropped, not sent in clear."""
        self._run("ip", "link", "del", self.plan.interface, check=False)
        if self._daemon is not None:
            self._daemon.terminate()
            try:
                self._daemon.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._daemon.kill()
                self._daemon.wait()
            self._daemon = None

    def __enter__(self) -> Tunnel:
        self.up()
        return self

    def __exit__(self, *exc) -> None:
        self.down()


def _peer_args(peer: Peer) -> tuple[str, ...]:
    """``wg set`` arguments of one peer: its key, its address as endpoint and as the one address it may send from."""
    return ("peer", peer.public_key, "endpoint", f"{_bracket(peer.address)}:{peer.port}", "allowed-ips",
            _prefix(peer.address), "persistent-keepalive", str(KEEPALIVE_S))


def _family(destination: str) -> str:
    return "-6" if ":" in destination else "-4"


def _within(destination: str, cidr: str) -> bool:
    """Whether ``destination`` (an address or a prefix, as ``ip route`` prints it) lies inside ``cidr``."""
    try:
        return ipaddress.ip_network(destination, strict=False).subnet_of(ipaddress.ip_network(cidr))
    except (ValueError, TypeError):
        return False


def _prefix(host: str) -> str:
    return f"{host}/128" if ":" in host else f"{host}/32"


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host else host
