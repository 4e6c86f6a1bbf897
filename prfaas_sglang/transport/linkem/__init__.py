"""An emulated WAN link between two network namespaces: rate, one-way delay, random loss (I/O fixture).

This kernel has no ``netem`` (only ``tbf``/``htb``), so delay and loss come from
``linkem.c``: a small C forwarder between a TUN device in each namespace, built here
with the system's C compiler on first use (cached by the source's hash). The TUN devices
take TCP segmentation offload, so linkem moves superpackets of up to 64 KiB and applies
rate, loss and the queue limit per wire segment (it cuts a superpacket that loses one):
0.15 of a core for one stream at 1 Gbit/s, where forwarding every 1500-byte packet took 0.75. Traffic stays
inside the two namespaces this object creates; both are removed on exit, and the
forwarder ends when its stdin closes (so it dies with its owner).

    with EmulatedLink(tag=1, rate_mbit=1000, rtt_ms=20, loss=0.001) as link:
        link.wrap_a + ("python", "-m", ...)   # run a process in namespace A (address link.ip_a)
        link.set(rate_mbit=100)                # a 10x drop, mid-transfer
        link.stats()                           # wire segments delivered, lost, dropped by the queue

The bottleneck queue holds ``queue_ms`` of serialisation (default: one RTT, at least
5 ms), tail-dropping beyond it, like a router buffer sized to the path's BDP.
Needs root (namespaces, TUN).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
from pathlib import Path

from prfaas_sglang.adapters.netns import claim_tag
from prfaas_sglang.errors import PrfaasError

# The layering map (docs/architecture.md, checked by tests/unit/test_layering.py): an I/O package;
# these modules of it are pure.
PURE_MODULES = ()

SOURCE = Path(__file__).with_name("linkem.c")


class LinkEmulatorUnavailable(PrfaasError):
    """The emulator cannot run here (not root, no C compiler, no /dev/net/tun)."""


def unavailable() -> str | None:
    """None when an :class:`EmulatedLink` can be made here, else why not."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, TUN devices)"
    if not Path("/dev/net/tun").exists():
        return "needs /dev/net/tun"
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        return "needs a C compiler (cc) to build linkem"
    if shutil.which("ip") is None:
        return "needs iproute2 (ip)"
    return None


def binary(cache_dir: Path | None = None) -> Path:
    """The built forwarder, compiled once per source version."""
    source = SOURCE.read_bytes()
    digest = hashlib.sha256(source).hexdigest()[:16]
    cache_dir = cache_dir or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "prfaas-sglang"
    out = cache_dir / f"linkem-{digest}"
    if out.exists():
        return out
    cache_dir.mkdir(parents=True, exist_ok=True)
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise LinkEmulatorUnavailable("no C compiler to build linkem")
    tmp = out.with_suffix(f".tmp{os.getpid()}")
    proc = subprocess.run([compiler, "-O2", "-Wall", "-o", str(tmp), str(SOURCE)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise LinkEmulatorUnavailable(f"building linkem failed: {proc.stderr.strip()[-400:]}")
    tmp.replace(out)
    return out


def _sh(*args: str) -> None:
    proc = subprocess.run(args, capture_output=True, text=True)
    if proc.returncode != 0:
        raise LinkEmulatorUnavailable(f"{' '.join(args)}: {proc.stderr.strip()}")


class EmulatedLink:
    """Namespaces ``prfaas-la{tag}`` (``ip_a``) and ``prfaas-lb{tag}`` (``ip_b``) joined by linkem.

    ``tag`` None claims a free tag on entry: ``ip netns add`` of a name that exists fails, so the
    first link to create ``prfaas-la{tag}`` owns the tag, and links of concurrent tests never collide."""

    def __init__(self, tag: int | None, rate_mbit: float, rtt_ms: float = 0.0, loss: float = 0.0,
                 queue_ms: float | None = None, congestion_control: str | None = None,
                 slow_start_after_idle: bool = True, tcp_buffer_bytes: int | None = None,
                 tcp_timestamps: bool = True):
        if tag is not None and not 0 <= tag < 256:
            raise ValueError("tag must be in 0..255")
        if rate_mbit <= 0 or rtt_ms < 0 or not 0 <= loss < 1:
            raise ValueError("rate_mbit must be > 0, rtt_ms >= 0 and loss in [0, 1)")
        self.tag = tag
        self._name(tag if tag is not None else 0)
        self.rate_mbit, self.rtt_ms, self.loss = rate_mbit, rtt_ms, loss
        self.queue_ms = queue_ms if queue_ms is not None else max(rtt_ms, 5.0)
        self.congestion_control = congestion_control
        # False: net.ipv4.tcp_slow_start_after_idle=0 in both namespaces (a connection keeps its
        # congestion window across idle gaps instead of restarting slow start after an idle RTO)
        self.slow_start_after_idle = slow_start_after_idle
        # not None: the most a TCP socket's send and receive buffers autotune to in both namespaces
        # (net.ipv4.tcp_wmem / tcp_rmem max, the usual long-fat-network host tuning); None: the host's
        if tcp_buffer_bytes is not None and tcp_buffer_bytes < 65536:
            raise ValueError("tcp_buffer_bytes must be at least 64 KiB")
        self.tcp_buffer_bytes = tcp_buffer_bytes
        # False: net.ipv4.tcp_timestamps=0 in both namespaces (no 12-byte timestamp option per segment)
        self.tcp_timestamps = tcp_timestamps
        self._proc: subprocess.Popen | None = None
        self._allowed_before: str | None = None  # the host's allowed congestion controls, when we widened them

    def _name(self, tag: int) -> None:
        self.ns_a, self.ns_b = f"prfaas-la{tag}", f"prfaas-lb{tag}"
        self.tun_a, self.tun_b = f"plta{tag}", f"pltb{tag}"
        self.ip_a, self.ip_b = f"10.215.{tag}.1", f"10.215.{tag}.2"

    def _claim(self) -> None:
        """Create both namespaces: under the given tag, or under the first free one (random order)."""
        if self.tag is not None:
            for ns in (self.ns_a, self.ns_b):
                _sh("ip", "netns", "add", ns)
            return
        tag = claim_tag("prfaas-la", range(256))
        if tag is None:
            raise LinkEmulatorUnavailable("no free link tag in 0..255")
        self._name(tag)
        self.tag = tag
        _sh("ip", "netns", "add", self.ns_b)

    @property
    def wrap_a(self) -> tuple[str, ...]:
        return ("ip", "netns", "exec", self.ns_a)

    @property
    def wrap_b(self) -> tuple[str, ...]:
        return ("ip", "netns", "exec", self.ns_b)

    def __enter__(self) -> EmulatedLink:
        why = unavailable()
        if why:
            raise LinkEmulatorUnavailable(why)
        exe = binary()
        try:
            self._allow(self.congestion_control)
            self._claim()
            self._proc = subprocess.Popen(
                [str(exe), self.ns_a, self.tun_a, self.ns_b, self.tun_b, f"{self.rate_mbit:g}",
                 f"{self.rtt_ms * 500:g}", f"{self.loss * 1e6:g}", f"{self.queue_ms * 1000:g}"],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1)
            if self._proc.stdout.readline().strip() != "ready":
                raise LinkEmulatorUnavailable(f"linkem did not start: {self._proc.stderr.read().strip()[-400:]}")
            for ns, tun, ip in ((self.ns_a, self.tun_a, self.ip_a), (self.ns_b, self.tun_b, self.ip_b)):
                _sh("ip", "netns", "exec", ns, "ip", "addr", "add", f"{ip}/30", "dev", tun)
                _sh("ip", "netns", "exec", ns, "ip", "link", "set", tun, "up", "mtu", "1500", "txqueuelen", "10000")
                _sh("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
                if self.congestion_control:
                    _sh("ip", "netns", "exec", ns, "sysctl", "-qw", f"net.ipv4.tcp_congestion_control={self.congestion_control}")
                if not self.slow_start_after_idle:
                    _sh("ip", "netns", "exec", ns, "sysctl", "-qw", "net.ipv4.tcp_slow_start_after_idle=0")
                if not self.tcp_timestamps:
                    _sh("ip", "netns", "exec", ns, "sysctl", "-qw", "net.ipv4.tcp_timestamps=0")
                if self.tcp_buffer_bytes is not None:
                    for name, default in (("tcp_wmem", 16384), ("tcp_rmem", 131072)):
                        _sh("ip", "netns", "exec", ns, "sysctl", "-qw",
                            f"net.ipv4.{name}=4096 {default} {self.tcp_buffer_bytes}")
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    _ALLOWED = Path("/proc/sys/net/ipv4/tcp_allowed_congestion_control")

    def _allow(self, algorithm: str | None) -> None:
        """Namespaces other than the host's may only pick an *allowed* algorithm (by default reno and
        the host's default): widen the host's list for the link's lifetime, restored on exit."""
        if algorithm is None:
            return
        available = Path("/proc/sys/net/ipv4/tcp_available_congestion_control").read_text().split()
        if algorithm not in available:
            raise LinkEmulatorUnavailable(f"congestion control {algorithm!r} is not available here ({' '.join(available)})")
        allowed = self._ALLOWED.read_text().split()
        if algorithm not in allowed:
            self._allowed_before = " ".join(allowed)
            self._ALLOWED.write_text(" ".join([*allowed, algorithm]))

    def set(self, *, rate_mbit: float | None = None, rtt_ms: float | None = None, loss: float | None = None,
            blackhole: bool | None = None) -> None:
        """Change the link now, both directions (takes effect for packets arriving from now on)."""
        lines = []
        if rate_mbit is not None:
            lines.append(f"rate {rate_mbit:g}")
        if rtt_ms is not None:
            lines.append(f"delay {rtt_ms * 500:g}")
        if loss is not None:
            lines.append(f"loss {loss * 1e6:g}")
        if blackhole is not None:
            lines.append(f"blackhole {int(blackhole)}")
        self._send("".join(line + "\n" for line in lines))

    def stats(self) -> dict:
        """Per direction (``ab``: A to B, ``ba``): wire segments (``pkts``) and bytes delivered, segments lost,
        overflowed and blackholed; superpackets delivered ``whole`` and ``cut`` into their surviving segments."""
        self._send("stats\n")
        return json.loads(self._proc.stdout.readline())

    def _send(self, text: str) -> None:
        if self._proc is None or self._proc.poll() is not None:
            raise LinkEmulatorUnavailable("linkem is not running")
        self._proc.stdin.write(text)
        self._proc.stdin.flush()

    def __exit__(self, *exc) -> None:
        if self._proc is not None:
            try:
                self._proc.stdin.close()
                self._proc.wait(timeout=5)
            except (OSError, subprocess.TimeoutExpired):
                self._proc.kill()
                self._proc.wait()
            self._proc = None
        for ns in (self.ns_a, self.ns_b):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        if self._allowed_before is not None:
            self._ALLOWED.write_text(self._allowed_before)
            self._allowed_before = None
