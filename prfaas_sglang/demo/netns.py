"""A network namespace joined to the root namespace by a veth pair, its egress shaped by ``tbf``.

The emulated PrfaaS worker runs inside (``ip netns exec``, see :attr:`Netns.wrap`);
everything it sends to the PD cluster crosses the veth, so ``tbf`` on the inner
end is the inter-cluster link, shared by every concurrent transfer. Needs root
and iproute2 (``ip``, ``tc``); the kernel here has no ``netem``, so no delay or loss.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from prfaas_sglang.adapters.netns import claim_tag

TBF_BURST_BYTES = 65_536  # the shaper's bucket: the most the link can carry beyond its rate over any window


def available() -> str | None:
    """None when namespaces can be made here, else why not."""
    if os.geteuid() != 0:
        return "needs root (ip netns, tc)"
    for tool in ("ip", "tc"):
        if subprocess.run(["which", tool], capture_output=True).returncode != 0:
            return f"needs iproute2's {tool}"
    return None


def _sh(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True)


TAGS = range(16, 250)  # a namespace's tag names it, its veth ends and its 10.214.<tag>.0/30 subnet


class Netns:
    """A namespace joined to the root namespace by a veth pair (removed on exit).

    ``tag`` None (the usual case) claims a free tag on entry: ``ip netns add`` of a name that
    exists fails, so the first namespace to take a tag owns it and its veth names and subnet, and
    namespaces of concurrent tests or benchmarks never collide."""

    def __init__(self, tag: int | None = None):
        self.tag = tag
        if tag is not None:
            self._name(tag)

    def _name(self, tag: int) -> None:
        self.tag = tag
        self.ns, self.inner, self.outer = f"prfaas-bw{tag}", f"pbi{tag}", f"pbo{tag}"
        self.inner_ip, self.outer_ip = f"10.214.{tag}.1", f"10.214.{tag}.2"
        self.subnet = f"10.214.{tag}.0/30"

    def _claim(self) -> None:
        """Name this namespace after the first free tag (in random order) and create it."""
        if self.tag is not None:
            _sh("ip", "netns", "add", self.ns)
            return
        tag = claim_tag("prfaas-bw", TAGS)
        if tag is None:
            raise RuntimeError(f"no free namespace tag in {TAGS.start}..{TAGS.stop - 1}")
        self._name(tag)

    def __enter__(self) -> Netns:
        self._claim()
        _sh("ip", "link", "add", self.outer, "type", "veth", "peer", "name", self.inner)
        _sh("ip", "link", "set", self.inner, "netns", self.ns)
        _sh("ip", "addr", "add", f"{self.outer_ip}/30", "dev", self.outer)
        _sh("ip", "link", "set", self.outer, "up")
        # Behind the veth's own route: with the link down (the chaos bench's blackhole), traffic for the
        # namespace is dropped here, never sent on through the default route to whatever answers there.
        _sh("ip", "route", "replace", "blackhole", self.subnet, "metric", "65535")
        _sh("ip", "netns", "exec", self.ns, "ip", "addr", "add", f"{self.inner_ip}/30", "dev", self.inner)
        _sh("ip", "netns", "exec", self.ns, "ip", "link", "set", self.inner, "up")
        _sh("ip", "netns", "exec", self.ns, "ip", "link", "set", "lo", "up")
        return self

    @property
    def wrap(self) -> tuple[str, ...]:
        return ("ip", "netns", "exec", self.ns)

    def throttle(self, rate_mbit: float | None) -> None:
        subprocess.run(["ip", "netns", "exec", self.ns, "tc", "qdisc", "del", "dev", self.inner, "root"], capture_output=True)
        if rate_mbit is not None:
            _sh("ip", "netns", "exec", self.ns, "tc", "qdisc", "add", "dev", self.inner, "root", "tbf",
                "rate", f"{rate_mbit}mbit", "burst", f"{TBF_BURST_BYTES}b", "latency", "2000ms")

    def set_rate(self, rate_mbit: float) -> None:
        """Change the shaped rate in place (``tc qdisc replace``: the link is never unshaped meanwhile)."""
        _sh("ip", "netns", "exec", self.ns, "tc", "qdisc", "replace", "dev", self.inner, "root", "tbf",
            "rate", f"{rate_mbit}mbit", "burst", f"{TBF_BURST_BYTES}b", "latency", "2000ms")

    def rx_bytes(self) -> int:
        """Bytes the root namespace has received from inside (the link's egress, at the wire)."""
        return int(Path(f"/sys/class/net/{self.outer}/statistics/rx_bytes").read_text())

    def __exit__(self, *exc) -> None:
        subprocess.run(["ip", "netns", "del", self.ns], capture_output=True)
        subprocess.run(["ip", "link", "del", self.outer], capture_output=True)
        subprocess.run(["ip", "route", "del", "blackhole", self.subnet], capture_output=True)


