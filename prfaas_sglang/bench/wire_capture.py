"""What crosses a link device: capture until stdin closes and the packets queued by then are read, then print a
summary (encrypted links' evidence).

Run inside the namespace that holds the device (``ip netns exec NS ...``) by ``bench chaos --encrypt`` and
``tests/transport/test_tunnel.py``. Needs root (an AF_PACKET socket).

    python -m prfaas_sglang.bench.wire_capture IFACE PATTERN_HEX [PORT]   ->  "ready", then at stdin's end one JSON line:
    {"packets", "bytes", "protocols": {"udp": n, ...}, "ports": [ports every packet had], "with_pattern": n,
     "dropped": packets the kernel could not queue for this capture, "not_ipv4": packets neither IPv4, ARP
     nor IPv6 link-local control ("ipv6_link_local": neighbour discovery, MLD),
     "strays": with PORT (the one port every packet should have), the first 16 IPv4 packets without it, each
     [the kernel's receive time (Unix seconds), protocol, "src:port", "dst:port", TCP flags or None]: what
     crossed, when, between whom; "at_first_stray": this namespace's policy rules, the route to the first
     stray's destination and its socket (``ip rule``, ``ip route get``, ``ss``) as they were when it was read}
"""

from __future__ import annotations

import errno
import ipaddress
import json
import select
import socket
import struct
import sys
import time

ETH_P_ALL, ETH_P_IP, ETH_P_ARP, ETH_P_IPV6 = 0x0003, 0x0800, 0x0806, 0x86DD
SOL_PACKET, PACKET_STATISTICS = 263, 6
SO_TIMESTAMPNS = SCM_TIMESTAMPNS = 35
PROTOCOLS = {6: "tcp", 17: "udp", 1: "icmp"}
MAX_STRAYS = 16
TCP_FLAGS = "FSRPAUEC"  # bit 0 (FIN) first


def describe(data: bytes, proto: str, header: int, ports: tuple[int, int] | None, t_s: float) -> list:
    """One IPv4 packet as [t_s, protocol, "src:port", "dst:port", TCP flags or None]."""
    src, dst = str(ipaddress.IPv4Address(data[12:16])), str(ipaddress.IPv4Address(data[16:20]))
    if ports is not None:
        src, dst = f"{src}:{ports[0]}", f"{dst}:{ports[1]}"
    flags = None
    if proto == "tcp" and len(data) > header + 13:
        flags = "".join(c for i, c in enumerate(TCP_FLAGS) if data[header + 13] >> i & 1)
    return [round(t_s, 3), proto, src, dst, flags]


def snapshot(stray: list) -> dict:
    """The routing state that sent ``stray`` (read after the fact: what it still is when the capture gets to it)."""
    import subprocess

    def run(*args: str) -> str:
        proc = subprocess.run(args, capture_output=True, text=True, timeout=10)
        return (proc.stdout + proc.stderr).strip()
    src, dst = stray[2], stray[3]
    return {"ip rule": run("ip", "-4", "rule"), "ip route get": run("ip", "route", "get", dst.split(":")[0]),
            "ss": run("ss", "-tiepnH", "src", src, "dst", dst) if ":" in dst else None}


def main() -> None:
    iface, pattern = sys.argv[1], bytes.fromhex(sys.argv[2])
    expected_port = int(sys.argv[3]) if len(sys.argv) > 3 else None
    sock = socket.socket(socket.AF_PACKET, socket.SOCK_DGRAM, socket.htons(ETH_P_ALL))
    sock.bind((iface, 0))
    sock.setsockopt(socket.SOL_SOCKET, 33, 256 << 20)  # SO_RCVBUFFORCE (root): a burst must not be dropped here
    sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)  # when the kernel saw it, not when this loop got to it
    print("ready", flush=True)
    strays: list[list] = []
    at_first_stray = None
    packets = nbytes = with_pattern = not_ipv4 = link_local = 0
    protocols: dict[str, int] = {}
    common: set[int] | None = None
    closing = False  # stdin has ended: what the kernel already queued for this socket is still counted
    while True:
        ready, _, _ = select.select([sock] if closing else [sock, sys.stdin], [], [], 0 if closing else None)
        if closing and not ready:
            break  # drained: on loaded cores this loop ran behind, and the queue held the transfer's tail (MiBs)
        if not closing and sys.stdin in ready and not sys.stdin.readline():
            closing = True
            continue
        if sock in ready:
            try:
                data, ancillary, _, address = sock.recvmsg(1 << 17, 64)
            except OSError as err:  # the device was set down meanwhile (a black-holed link): nothing crossed it
                if err.errno != errno.ENETDOWN:
                    raise
                if closing:
                    break  # a device that is down queues nothing more
                continue
            if address[1] == ETH_P_ARP:
                continue
            if address[1] == ETH_P_IPV6 and len(data) >= 24 and data[6] in (0, 58) and (data[8:10] == b"\xfe\x80"
                                                                                       or data[8:24] == bytes(16)):
                link_local += 1  # neighbour discovery, MLD: the link's own control messages
                continue
            if not data or address[1] not in (ETH_P_IP, 0) or data[0] >> 4 != 4:  # TUN devices report protocol 0
                not_ipv4 += 1
                continue
            packets += 1
            nbytes += len(data)
            proto = PROTOCOLS.get(data[9], "other")
            protocols[proto] = protocols.get(proto, 0) + 1
            header = (data[0] & 0x0F) * 4
            pair = (int.from_bytes(data[header:header + 2], "big"), int.from_bytes(data[header + 2:header + 4], "big")) \
                if proto in ("tcp", "udp") else None
            ports = set(pair or ())
            common = ports if common is None else common & ports
            if expected_port is not None and expected_port not in ports and len(strays) < MAX_STRAYS:
                stamp = next((struct.unpack("qq", d[:16]) for level, kind, d in ancillary
                              if level == socket.SOL_SOCKET and kind == SCM_TIMESTAMPNS), None)
                strays.append(describe(data, proto, header, pair, stamp[0] + stamp[1] / 1e9 if stamp else time.time()))
                at_first_stray = at_first_stray or snapshot(strays[0])
            with_pattern += pattern in data
    tp_packets, tp_drops = struct.unpack("II", sock.getsockopt(SOL_PACKET, PACKET_STATISTICS, 8))
    print(json.dumps({"packets": packets, "bytes": nbytes, "protocols": protocols, "dropped": tp_drops, "not_ipv4": not_ipv4,
                      "ipv6_link_local": link_local,
                      "ports": sorted(common or ()), "with_pattern": with_pattern, "strays": strays,
                      "at_first_stray": at_first_stray}))


if __name__ == "__main__":
    main()
