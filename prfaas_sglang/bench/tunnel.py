"""KV over Mooncake TCP through the WireGuard tunnel of an encrypted link, against the same transfer in clear.

One emulated WAN link (:class:`~prfaas_sglang.transport.linkem.EmulatedLink`: rate, RTT) between two network
namespaces, with two address pairs on it: ``ip_a -> ip_b`` goes through each host's tunnel
(:mod:`prfaas_sglang.adapters.wireguard`, planned by :mod:`prfaas_sglang.transport.tunnel_plan` for a link with
``encrypt: true``), a second pair crosses the same link in clear. A Mooncake receiver on each address of B, and
on A a sender for each, both with the WAN profile and the kv-send hooks' sender (``bench transport``'s
``ours``); the two take turns per payload size, so drift hits both alike.

``fraction`` = payload bits / elapsed / the link's rate (median of ``--repeats``); ``ratio`` = tunnel / clear;
``wg_cpu_s_per_gbit``: the CPU seconds both tunnel daemons (wireguard-go) used per gigabit carried, i.e. the
cores the tunnel takes at 1 Gbit/s. Needs root, /dev/net/tun, wireguard-go and wg.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time
from types import SimpleNamespace

from prfaas_sglang.adapters.wireguard import Tunnel, public_keys
from prfaas_sglang.bench.mock_kv import _cpu_s
from prfaas_sglang.bench.subcommands import Invocation, Subcommand
from prfaas_sglang.bench.transport import (
    PEER,
    WARMUP_BYTES,
    _fraction,
    _Sender,
    default_env,
    ours_env,
)
from prfaas_sglang.topology import parse_topology
from prfaas_sglang.transport.linkem import EmulatedLink
from prfaas_sglang.transport.tunnel_plan import plan
from prfaas_sglang.transport.wan_defaults import WanLink
from prfaas_sglang.wire.auth import DeploymentKeys

REQUEST_BYTES = 16 << 20  # bench transport's ours: a 64 MiB chunk's KV over 4 lanes


def _topology(host_a: str, host_b: str):
    return parse_topology({"version": 1, "clusters": {
        "prfaas": {"kind": "prfaas", "nodes": [{"name": "prfaas-0", "role": "prfaas", "host": host_a, "port": 30000,
                                                "bootstrap_port": 8998}]},
        "pd": {"kind": "pd", "nodes": [{"name": "pd-decode-0", "role": "pd-decode", "host": host_b, "port": 30001}]}},
        "links": [{"from": "prfaas", "to": "pd", "bandwidth_gbps": 1, "encrypt": True}]})


def _receiver(link: EmulatedLink, host: str, buffer_mib: int) -> tuple[subprocess.Popen, dict]:
    proc = subprocess.Popen((*link.wrap_b, *PEER, "recv", "--host", host, "--buffer-mib", str(buffer_mib)),
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env=default_env())
    return proc, json.loads(proc.stdout.readline())


def run(rate_mbit: float = 1000.0, rtt_ms: float = 20.0, payloads_mib: tuple[int, ...] = (64, 256, 1024),
        repeats: int = 3, userspace: str | None = None) -> dict:
    """Tunnel vs clear for each payload; ``userspace``: the wireguard-go binary (default: the one on PATH)."""
    keys = DeploymentKeys.from_secret(os.urandom(32))
    buffer_mib = max(payloads_mib)
    wan = WanLink(rate_mbit * 1e6, rtt_ms / 1e3)
    with EmulatedLink(tag=None, rate_mbit=rate_mbit, rtt_ms=rtt_ms) as link:
        clear_a, clear_b = f"10.216.{link.tag}.1", f"10.216.{link.tag}.2"
        for wrap, tun, ip in ((link.wrap_a, link.tun_a, clear_a), (link.wrap_b, link.tun_b, clear_b)):
            subprocess.run([*wrap, "ip", "addr", "add", f"{ip}/30", "dev", tun], check=True, capture_output=True)
        topo = _topology(link.ip_a, link.ip_b)
        tunnels = [Tunnel(plan(topo, host, public_keys(keys)), keys.tunnel_private_key(host), wrap=wrap, userspace=userspace)
                   for host, wrap in ((link.ip_a, link.wrap_a), (link.ip_b, link.wrap_b))]
        procs, senders = [], {}
        try:
            for t in tunnels:
                t.up()
            for name, (a, b) in {"tunnel": (link.ip_a, link.ip_b), "clear": (clear_a, clear_b)}.items():
                proc, landing = _receiver(link, b, buffer_mib)
                procs.append(proc)
                ends = SimpleNamespace(wrap_a=link.wrap_a, ip_a=a, ip_b=b)
                senders[name] = _Sender(ends, landing, buffer_mib, ours_env(wan))
            for sender in senders.values():  # opens the lanes and ramps the windows: not counted
                sender.run(WARMUP_BYTES, REQUEST_BYTES, product=True)
            daemons = [t._daemon.pid for t in tunnels if t._daemon is not None]
            rows = []
            for payload_mib in payloads_mib:
                runs: dict[str, list[float]] = {"tunnel": [], "clear": []}
                cpu_s = gbit = 0.0
                for i in range(repeats):
                    for name in ("tunnel", "clear") if i % 2 == 0 else ("clear", "tunnel"):
                        cpu0 = sum(map(_cpu_s, daemons)) if name == "tunnel" else 0.0
                        result = senders[name].run(payload_mib << 20, REQUEST_BYTES, product=True)
                        runs[name].append(_fraction(result, payload_mib << 20, rate_mbit))
                        if name == "tunnel" and result["ok"]:
                            cpu_s += sum(map(_cpu_s, daemons)) - cpu0
                            gbit += (payload_mib << 20) * 8 / 1e9
                tunnel, clear = statistics.median(runs["tunnel"]), statistics.median(runs["clear"])
                rows.append({"payload_mib": payload_mib, "tunnel_fraction": round(tunnel, 3), "clear_fraction": round(clear, 3),
                             "ratio": round(tunnel / clear, 3) if clear else None,
                             "tunnel_range": [round(min(runs["tunnel"]), 3), round(max(runs["tunnel"]), 3)],
                             "clear_range": [round(min(runs["clear"]), 3), round(max(runs["clear"]), 3)],
                             "wg_cpu_s_per_gbit": round(cpu_s / gbit, 3) if gbit and daemons else None})
        finally:
            for sender in senders.values():
                sender.close()
            for proc in procs:
                proc.stdin.close()
                proc.wait(timeout=10)
            for t in tunnels:
                t.down()
    return {"rate_mbit": rate_mbit, "rtt_ms": rtt_ms, "repeats": repeats, "request_mib": REQUEST_BYTES >> 20,
            "tunnel": "kernel" if tunnels[0].kernel else "wireguard-go", "wireguard_go": _version(userspace),
            "rows": rows, "date": time.strftime("%Y-%m-%d")}


def _version(userspace: str | None) -> str | None:
    try:
        out = subprocess.run([userspace or "wireguard-go", "--version"], capture_output=True, text=True, timeout=10).stdout
    except OSError:
        return None
    return out.split()[1] if len(out.split()) > 1 else None


def render_markdown(r: dict) -> str:
    lines = [f"KV through the tunnel ({r['tunnel']} {r['wireguard_go'] or ''}) vs in clear, {r['rate_mbit']:g} Mbit/s, "
             f"{r['rtt_ms']:g} ms RTT, our sender and WAN profile ({r['request_mib']} MiB requests), median of "
             f"{r['repeats']}, turns alternating:", "",
             "| payload | clear | tunnel | tunnel / clear | wireguard-go CPU s per Gbit (both ends) |",
             "|---|---|---|---|---|"]
    for row in r["rows"]:
        lines.append(f"| {row['payload_mib']} MiB | {row['clear_fraction']:.3f} {row['clear_range']} | "
                     f"{row['tunnel_fraction']:.3f} {row['tunnel_range']} | {row['ratio']} | {row['wg_cpu_s_per_gbit']} |")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rate-mbit", type=float, default=1000.0,
                        help="the emulated link's rate, Mbit/s")
    parser.add_argument("--rtt-ms", type=float, default=20.0,
                        help="the emulated link's round-trip time, ms")
    parser.add_argument("--payloads-mib", default="64,256,1024", help="comma list of payload sizes")
    parser.add_argument("--repeats", type=int, default=3,
                        help="timed transfers per payload size, tunnel and clear (median reported)")
    parser.add_argument("--wireguard-go", default=None, metavar="PATH",
                        help="the userspace WireGuard binary (default: wireguard-go on PATH)")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")


def cli(args: argparse.Namespace, inv: Invocation) -> int:
    from prfaas_sglang.adapters.wireguard import unavailable as no_tunnel
    from prfaas_sglang.transport.linkem import unavailable as no_link

    try:
        payloads = tuple(int(x) for x in args.payloads_mib.split(","))
    except ValueError:
        inv.error(f"--payloads-mib: expected a comma list of integers, got {args.payloads_mib!r}")
    if not payloads or min(payloads) < 1 or max(payloads) > 2048 or args.repeats < 1 or args.rate_mbit <= 0:
        inv.error("--payloads-mib in 1..2048, --repeats >= 1, --rate-mbit > 0")
    for why in (no_link(), no_tunnel(args.wireguard_go)):
        if why is not None:
            inv.error(f"cannot run here: {why}")
    result = run(args.rate_mbit, args.rtt_ms, payloads, args.repeats, args.wireguard_go)
    return inv.report(args, result, None, render_markdown)


SUBCOMMANDS = {"tunnel": Subcommand(add_arguments, cli)}
