"""What crosses a link device: capture until stdin closes, then print a summary (encrypted links' evidence).

Run inside the namespace that holds the device (``ip netns exec NS ...``) by ``bench chaos --encrypt`` and
``tests/transport/test_tunnel.py``. Needs root (an AF_PACKET socket).

    python -m prfaas_sglang.bench.wire_capture IFACE PATTERN_HEX   ->  "ready", then at stdin's end one JSON line:
    {"packets", "bytes", "protocols": {"udp": n, ...}, "ports": [ports every packet had], "with_pattern": n,
     "dropped": packets the kernel could not queue for this capture, "not_ipv4": packets neither IPv4, ARP
     nor IPv6 link-local control ("ipv6_link_local": neighbour discovery, MLD)}
"""

from __future__ import annotations

import errno
import json
import select
import socket
import struct
import sys

ETH_P_ALL, ETH_P_IP, ETH_P_ARP, ETH_P_IPV6 = 0x0003, 0x0800, 0x0806, 0x86DD
SOL_PACKET, PACKET_STATISTICS = 263, 6
PROTOCOLS = {6: "tcp", 17: "udp", 1: "icmp"}


def main() -> None:
    iface, pattern = sys.argv[1], bytes.fromhex(sys.argv[2])
    sock = socket.socket(socket.AF_PACKET, socket.SOCK_DGRAM, socket.htons(ETH_P_ALL))
    sock.bind((iface, 0))
    sock.setsockopt(socket.SOL_SOCKET, 33, 256 << 20)  # SO_RCVBUFFORCE (root): a burst must not be dropped here
    print("ready", flush=True)
    packets = nbytes = with_pattern = not_ipv4 = link_local = 0
    protocols: dict[str, int] = {}
    common: set[int] | None = None
    while True:
        ready, _, _ = select.select([sock, sys.stdin], [], [])
        if sys.stdin in ready and not sys.stdin.readline():
            break
        if sock in ready:
            try:
                data, address = sock.recvfrom(1 << 17)
            except OSError as err:  # the device was set down meanwhile (a black-holed link): nothing crossed it
                if err.errno != errno.ENETDOWN:
                    raise
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
            ports = {int.from_bytes(data[header:header + 2], "big"), int.from_bytes(data[header + 2:header + 4], "big")} \
                if proto in ("tcp", "udp") else set()
            common = ports if common is None else common & ports
            with_pattern += pattern in data
    tp_packets, tp_drops = struct.unpack("II", sock.getsockopt(SOL_PACKET, PACKET_STATISTICS, 8))
    print(json.dumps({"packets": packets, "bytes": nbytes, "protocols": protocols, "dropped": tp_drops, "not_ipv4": not_ipv4,
                      "ipv6_link_local": link_local,
                      "ports": sorted(common or ()), "with_pattern": with_pattern}))


if __name__ == "__main__":
    main()
