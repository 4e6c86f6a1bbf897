"""The link emulator the WAN tests stand on: its delay, rate and loss are what a TCP connection sees.

Physical bounds only (a connect cannot beat the RTT, bytes cannot beat the rate), plus the
emulator's own counters for loss. Needs root, /dev/net/tun and a C compiler (this project's
machines and CI have them).
"""

from __future__ import annotations

import hashlib
import json
import random
import subprocess
import sys

import pytest

from prfaas_sglang.transport.linkem import EmulatedLink, LinkEmulatorUnavailable

CLIENT = r"""
import json, socket, sys, time
host, port, nbytes = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
t0 = time.perf_counter()
c = socket.create_connection((host, port))
connect_s = time.perf_counter() - t0
block = bytes(1 << 16)
t1 = time.perf_counter()
for off in range(0, nbytes, len(block)):
    c.sendall(block[: min(len(block), nbytes - off)])
c.shutdown(socket.SHUT_WR)
c.recv(1)
print(json.dumps({"connect_s": connect_s, "send_s": time.perf_counter() - t1}))
"""

SERVER = r"""
import socket, sys
s = socket.socket(); s.bind((sys.argv[1], 0)); s.listen(4)
print(s.getsockname()[1], flush=True)
while True:
    c, _ = s.accept()
    while c.recv(1 << 20):
        pass
    c.sendall(b"k"); c.close()
"""


def _transfer(link: EmulatedLink, port: int, nbytes: int) -> dict:
    out = subprocess.run((*link.wrap_a, sys.executable, "-c", CLIENT, link.ip_b, str(port), str(nbytes)),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.fixture
def served():
    def start(link: EmulatedLink) -> tuple[subprocess.Popen, int]:
        proc = subprocess.Popen((*link.wrap_b, sys.executable, "-c", SERVER, link.ip_b), stdout=subprocess.PIPE, text=True)
        return proc, int(proc.stdout.readline())
    procs = []
    yield lambda link: procs.append(start(link)) or procs[-1][1]
    for proc, _ in procs:
        proc.kill()
        proc.wait()


def test_delay_rate_and_loss_are_what_tcp_sees(served):
    rate_mbit, rtt_ms, nbytes = 50.0, 40.0, 4 << 20
    with EmulatedLink(tag=None, rate_mbit=rate_mbit, rtt_ms=rtt_ms) as link:
        port = served(link)
        result = _transfer(link, port, nbytes)
        assert result["connect_s"] >= rtt_ms / 1e3  # SYN and SYN-ACK cross the link once each
        assert result["send_s"] >= nbytes * 8 / (rate_mbit * 1e6)  # no faster than the rate
        link.set(rate_mbit=rate_mbit / 10)  # a 10x drop takes effect for the next bytes
        slow = _transfer(link, port, nbytes // 4)
        assert slow["send_s"] >= (nbytes // 4) * 8 / (rate_mbit / 10 * 1e6)
        stats = link.stats()
        assert stats["ab"]["bytes"] >= nbytes * 1.25 and stats["ab"]["lost"] == 0


def test_random_loss_is_counted_and_tcp_recovers(served):
    with EmulatedLink(tag=None, rate_mbit=200, rtt_ms=2, loss=0.02) as link:
        port = served(link)
        _transfer(link, port, 8 << 20)  # TCP retransmits what was lost: the bytes all arrive
        ab = link.stats()["ab"]
        assert ab["pkts"] > 4000 and 0.01 < ab["lost"] / (ab["pkts"] + ab["lost"]) < 0.03


INTACT_SERVER = r"""
import hashlib, socket, sys
s = socket.socket(); s.bind((sys.argv[1], 0)); s.listen(1)
print(s.getsockname()[1], flush=True)
c, _ = s.accept()
digest = hashlib.sha256()
while chunk := c.recv(1 << 20):
    digest.update(chunk)
c.sendall(digest.hexdigest().encode()); c.close()
"""

INTACT_CLIENT = r"""
import random, socket, sys
data = random.Random(int(sys.argv[4])).randbytes(int(sys.argv[3]))
c = socket.create_connection((sys.argv[1], int(sys.argv[2])))
c.sendall(data); c.shutdown(socket.SHUT_WR)
print(c.recv(64).decode())
"""


def _snmp(wrap: tuple[str, ...]) -> dict[str, int]:
    """The namespace's IP and TCP counters (/proc/net/snmp), as ``Ip.InHdrErrors``, ``Tcp.InCsumErrors``..."""
    lines = subprocess.run((*wrap, "cat", "/proc/net/snmp"), capture_output=True, text=True, check=True).stdout.splitlines()
    out = {}
    for names, values in zip(lines[::2], lines[1::2], strict=True):
        proto, *keys = names.split()
        out.update({f"{proto[:-1]}.{k}": int(v) for k, v in zip(keys, values.split()[1:], strict=True)})
    return out


def test_superpackets_cross_whole_or_cut_and_every_byte_arrives_intact():
    """The TUN devices carry TCP superpackets (segmentation offload). One that loses a segment is cut
    into its survivors with rewritten headers and checksums: the receiver must get every byte in
    order and its stack must count no header or checksum error."""
    nbytes, seed = 16 << 20, 7
    with EmulatedLink(tag=None, rate_mbit=400, rtt_ms=4, loss=0.005) as link:
        server = subprocess.Popen((*link.wrap_b, sys.executable, "-c", INTACT_SERVER, link.ip_b), stdout=subprocess.PIPE,
                                  text=True)
        try:
            port = int(server.stdout.readline())
            out = subprocess.run((*link.wrap_a, sys.executable, "-c", INTACT_CLIENT, link.ip_b, str(port), str(nbytes),
                                  str(seed)), capture_output=True, text=True, timeout=120)
        finally:
            server.kill()
            server.wait()
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == hashlib.sha256(random.Random(seed).randbytes(nbytes)).hexdigest()
        ab = link.stats()["ab"]
        assert ab["whole"] > 0 and ab["cut"] > 0 and ab["lost"] > 0
        assert ab["pkts"] > ab["whole"] + ab["cut"]  # whole superpackets carried several wire segments each
        received = _snmp(link.wrap_b)
        assert received["Ip.InHdrErrors"] == 0 and received["Tcp.InCsumErrors"] == 0 and received["Tcp.InErrs"] == 0


def test_blackhole_and_back():
    with EmulatedLink(tag=None, rate_mbit=100, rtt_ms=2) as link:
        link.set(blackhole=True)
        probe = subprocess.run((*link.wrap_a, sys.executable, "-c",
                                f"import socket; socket.create_connection(('{link.ip_b}', 9), timeout=1)"),
                               capture_output=True, text=True)
        assert "timed out" in probe.stderr  # nothing crosses, not even a refusal
        link.set(blackhole=False)
        refused = subprocess.run((*link.wrap_a, sys.executable, "-c",
                                  f"import socket; socket.create_connection(('{link.ip_b}', 9), timeout=5)"),
                                 capture_output=True, text=True)
        assert "Connection refused" in refused.stderr  # back: B answers (no listener on port 9)
        assert link.stats()["ab"]["blackholed"] >= 1


def test_bad_settings_are_refused_before_anything_is_made():
    with pytest.raises(ValueError):
        EmulatedLink(tag=300, rate_mbit=10)
    with pytest.raises(ValueError):
        EmulatedLink(tag=1, rate_mbit=0)
    with pytest.raises(LinkEmulatorUnavailable, match="not available"):
        link = EmulatedLink(None, rate_mbit=10, congestion_control="no-such-cc")
        link.__enter__()
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    assert link.tag is None or not {link.ns_a, link.ns_b} & set(namespaces)


def test_slow_start_after_idle_is_set_per_namespace_only():
    def value(wrap) -> str:
        return subprocess.run((*wrap, "sysctl", "-n", "net.ipv4.tcp_slow_start_after_idle"), capture_output=True,
                              text=True, check=True).stdout.strip()

    host = subprocess.run(("sysctl", "-n", "net.ipv4.tcp_slow_start_after_idle"), capture_output=True, text=True).stdout.strip()
    with EmulatedLink(tag=None, rate_mbit=100, slow_start_after_idle=False) as link:
        assert value(link.wrap_a) == value(link.wrap_b) == "0"
    with EmulatedLink(tag=None, rate_mbit=100) as link:
        assert value(link.wrap_a) == "1"
    assert subprocess.run(("sysctl", "-n", "net.ipv4.tcp_slow_start_after_idle"), capture_output=True,
                          text=True).stdout.strip() == host


def test_tcp_buffer_limit_is_set_per_namespace_only():
    def limits(wrap=()) -> list[str]:
        return [subprocess.run((*wrap, "sysctl", "-n", f"net.ipv4.{name}"), capture_output=True, text=True,
                               check=True).stdout.split()[-1] for name in ("tcp_wmem", "tcp_rmem")]

    host = limits()
    with EmulatedLink(tag=None, rate_mbit=100, tcp_buffer_bytes=24 << 20) as link:
        assert limits(link.wrap_a) == limits(link.wrap_b) == [str(24 << 20)] * 2
    assert limits() == host
    with pytest.raises(ValueError):
        EmulatedLink(tag=None, rate_mbit=100, tcp_buffer_bytes=4096)


TIMESTAMP_OPTION = r"""
import socket, sys
c = socket.create_connection((sys.argv[1], int(sys.argv[2])))
info = c.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 104)
print(info[5] & 1)  # tcpi_options & TCPI_OPT_TIMESTAMPS: the option was negotiated
"""


def test_tcp_timestamps_off_leaves_the_option_out_of_the_links_connections_only(served):
    def negotiated(link: EmulatedLink, port: int) -> str:
        return subprocess.run((*link.wrap_a, sys.executable, "-c", TIMESTAMP_OPTION, link.ip_b, str(port)),
                              capture_output=True, text=True, check=True, timeout=60).stdout.strip()

    host = subprocess.run(("sysctl", "-n", "net.ipv4.tcp_timestamps"), capture_output=True, text=True).stdout.strip()
    with EmulatedLink(tag=None, rate_mbit=100, tcp_timestamps=False) as link:
        assert negotiated(link, served(link)) == "0"
    with EmulatedLink(tag=None, rate_mbit=100) as link:
        assert negotiated(link, served(link)) == "1"
    assert subprocess.run(("sysctl", "-n", "net.ipv4.tcp_timestamps"), capture_output=True, text=True).stdout.strip() == host
