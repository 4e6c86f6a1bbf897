"""The emulated engine's KV over an emulated WAN link: the kv-send hooks' sender vs SGLang's way.

Two network namespaces joined by :class:`~prfaas_sglang.transport.linkem.EmulatedLink` (rate,
RTT, random loss; BBR on both ends). In one, two emulated PrfaaS workers, each started as the launcher starts one
(:func:`~prfaas_sglang.launch.command.mock_command` with the link stated: the WAN profile's
``MC_*`` settings and lanes), differing in one variable:

* ``sender``: the emulated PrfaaS worker's default, the kv-send hooks' own
  :class:`~prfaas_sglang.transport.kv_sender.AsyncKvSender` (writes of about 0.1 s of a lane's share of
  the stated link, every lane busy, completions polled with a sleep);
* ``sync``: ``PRFAAS_KV_ASYNC_SEND=0``, the emulated engine's earlier and SGLang's own way: one
  synchronous batch per 1 MiB slice, one after another, on a thread that busy-waits in Mooncake.

In the other namespace one emulated decode worker. A client in the first namespace sends PD
requests (prefill and decode legs, SGLang's bootstrap protocol) to the two prefill workers in
turns, each prompt new, its KV ``--payload-mib``. Per request: the prefill's ``kv_transfer_s``
(request to last byte acknowledged) and the CPU time its process used meanwhile (``/proc``).

``goodput_fraction`` = payload bits / ``kv_transfer_s`` / the link's rate (median, range);
``cpu_s_per_gib``: the prefill process's CPU seconds per GiB shipped (median), which includes its
idle event loop and telemetry over the same wall time; ``writes_per_request``: the Mooncake writes
the sender handed the engine per request (None for ``sync``, which has no sender).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from prfaas_sglang.bench.subcommands import CommaList, Invocation, Subcommand
from prfaas_sglang.demo.cluster import PortPicker, ProcessGroup
from prfaas_sglang.engine.mock.timing import load_timing
from prfaas_sglang.launch.command import mock_command
from prfaas_sglang.roles import Role
from prfaas_sglang.topology import Node
from prfaas_sglang.transport.linkem import EmulatedLink
from prfaas_sglang.transport.wan_defaults import WanLink

ROWS = {"sender": {}, "sync": {"PRFAAS_KV_ASYNC_SEND": "0"}}
PROFILE = "kimi-linear-1t-hybrid@h200x8"
DECODE_PROFILE = "kimi-linear-1t-hybrid@h20x8"
TOKENS = 16_384
CLIENT = (sys.executable, "-m", "prfaas_sglang.bench.mock_kv_client")


def _cpu_s(pid: int) -> float:
    """utime + stime of process ``pid`` (its threads included), seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _ask(client: subprocess.Popen, job: dict) -> dict:
    client.stdin.write(json.dumps(job) + "\n")
    client.stdin.flush()
    line = client.stdout.readline()
    if not line:
        raise RuntimeError("the bench client ended")
    return json.loads(line)


def _condition(rate_mbit: float, rtt_ms: float, loss: float, payload_bytes: int, repeats: int, tag: int | None) -> dict:
    kv_scale = payload_bytes / load_timing(PROFILE, 1.0, 1.0, None).kv_bytes(TOKENS)
    common = ("--speedup", "1000", "--kv-scale", f"{kv_scale:.9f}", "--context-tokens", str(2 * TOKENS),
              "--bootstrap-timeout-s", "120")
    link_stated = WanLink(rate_mbit * 1e6, rtt_ms / 1e3)
    pick = PortPicker()
    # BBR in both namespaces, as the WAN profile advises for PrfaaS hosts (bench transport: CUBIC collapses at 0.1% loss)
    with EmulatedLink(tag, rate_mbit, rtt_ms, loss, congestion_control="bbr") as link, \
            tempfile.TemporaryDirectory() as tmp:
        group = ProcessGroup(Path(tmp))
        try:
            decode_node = Node("decode", "pd", Role.PD_DECODE, host=link.ip_b, port=pick())
            decode = mock_command(decode_node, sys.executable, DECODE_PROFILE, common, link=link_stated)
            group.start("decode", [*link.wrap_b, *decode.argv], decode.env)
            prefills = {}
            for row, extra_env in ROWS.items():
                node = Node(f"prfaas-{row}", "prfaas", Role.PRFAAS, host=link.ip_a, port=pick(), bootstrap_port=pick())
                command = mock_command(node, sys.executable, PROFILE, common, link=link_stated)
                proc = group.start(row, [*link.wrap_a, *command.argv], {**command.env, **extra_env})
                prefills[row] = (proc, f"http://{link.ip_a}:{node.port}", node.bootstrap_port)
            client = subprocess.Popen([*link.wrap_a, *CLIENT], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            try:
                urls = [f"http://{link.ip_b}:{decode_node.port}"] + [url for _, url, _ in prefills.values()]
                if not _ask(client, {"wait": urls}).get("ok"):
                    raise RuntimeError(f"workers not healthy; logs in {tmp}")
                runs: dict[str, list[dict]] = {row: [] for row in ROWS}
                order = list(ROWS)
                for i in range(repeats + 1):  # the first round opens each sender's lanes: not counted
                    for row in order if i % 2 == 0 else order[::-1]:
                        proc, url, boot = prefills[row]
                        cpu0 = _cpu_s(proc.pid)
                        out = _ask(client, {"prefill": url, "decode": urls[0], "bootstrap": [link.ip_a, boot],
                                            "tokens": TOKENS, "seed": random.getrandbits(32)})
                        out["cpu_s"] = round(_cpu_s(proc.pid) - cpu0, 3)
                        if i:
                            runs[row].append(out)
            finally:
                client.stdin.close()
                client.wait(timeout=30)
        finally:
            group.stop()
    result = {"rtt_ms": rtt_ms, "loss": loss, "runs": runs}
    for row, outs in runs.items():
        ok = [o for o in outs if o.get("ok") and o.get("kv_transfer_s")]
        fractions = [o["kv_bytes"] * 8 / o["kv_transfer_s"] / (rate_mbit * 1e6) for o in ok]
        cpu = [o["cpu_s"] / (o["kv_bytes"] / 2**30) for o in ok]
        result[row] = {"goodput_fraction": round(statistics.median(fractions), 3) if fractions else None,
                       "fraction_range": [round(min(fractions), 3), round(max(fractions), 3)] if fractions else None,
                       "cpu_s_per_gib": round(statistics.median(cpu), 2) if cpu else None,
                       "writes_per_request": statistics.median(o["writes"] for o in ok) if ok and ok[0]["writes"] is not None else None,
                       "failed": len(outs) - len(ok)}
    return result


def run(rate_mbit: float, rtt_ms: float, losses: tuple[float, ...], payload_mib: int, repeats: int) -> dict:
    tag = None  # EmulatedLink claims a free one
    conditions = [_condition(rate_mbit, rtt_ms, loss, payload_mib << 20, repeats, tag) for loss in losses]
    return {"rate_mbit": rate_mbit, "payload_mib": payload_mib, "repeats": repeats, "conditions": conditions}


def render_markdown(result: dict) -> str:
    lines = [f"{result['payload_mib']} MiB per request, {result['rate_mbit']:g} Mbit/s, median of {result['repeats']}:",
             "| RTT | loss | sender: goodput / rate | sync (1 MiB slices): goodput / rate | sender / sync "
             "| CPU s per GiB: sender / sync |", "|---|---|---|---|---|---|"]
    for c in result["conditions"]:
        s, y = c["sender"], c["sync"]
        ratio = (f"{s['goodput_fraction'] / y['goodput_fraction']:.2f}x"
                 if s["goodput_fraction"] and y["goodput_fraction"] else "n/a")
        lines.append(f"| {c['rtt_ms']:g} ms | {c['loss']:g} | {s['goodput_fraction']} {s['fraction_range']} "
                     f"| {y['goodput_fraction']} {y['fraction_range']} | {ratio} | {s['cpu_s_per_gib']} / "
                     f"{y['cpu_s_per_gib']} |")
    failed = sum(c[row]["failed"] for c in result["conditions"] for row in ROWS)
    if failed:
        lines.append(f"{failed} requests failed")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rate-mbit", type=float, default=1000.0,
                        help="the emulated link's rate, Mbit/s")
    parser.add_argument("--rtt-ms", type=float, default=20.0,
                        help="the emulated link's round-trip time, ms")
    parser.add_argument("--losses", type=CommaList(float), default="0,0.001", help="comma list of random loss rates, one condition each")
    parser.add_argument("--payload-mib", type=int, default=64,
                        help="KV bytes each request ships, MiB")
    parser.add_argument("--repeats", type=int, default=5,
                        help="measured requests per sender and loss rate, after one not counted")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")


def cli(args: argparse.Namespace, inv: Invocation) -> int:
    from prfaas_sglang.transport.linkem import unavailable

    losses = args.losses
    if args.rate_mbit <= 0 or args.rtt_ms < 0 or args.payload_mib < 1 or args.repeats < 1 or not all(0 <= x < 1 for x in losses):
        inv.error("--rate-mbit, --payload-mib and --repeats must be positive, --rtt-ms >= 0, losses in [0, 1)")
    if (why := unavailable()) is not None:
        inv.error(f"the emulated link {why}")
    result = run(args.rate_mbit, args.rtt_ms, losses, args.payload_mib, args.repeats)
    return inv.report(args, result, None, render_markdown)


SUBCOMMANDS = {"mock-kv": Subcommand(add_arguments, cli)}
