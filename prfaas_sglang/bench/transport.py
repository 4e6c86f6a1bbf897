"""KV over Mooncake TCP across an emulated WAN link: our WAN profile vs SGLang's Mooncake settings.

Two network namespaces joined by :class:`~prfaas_sglang.transport.linkem.EmulatedLink`
(rate, RTT, random loss; this kernel has no netem). A Mooncake transfer engine in each,
real TCP between them. The sender writes the payload as SGLang 0.5.15's Mooncake backend
does (one synchronous batch write per chunked-prefill chunk), in two configurations, each
in a fresh sender process, alternating, in the same run over the same link:

* ``default``: Mooncake's own TCP settings (what SGLang runs with: 4 lanes per peer, 64 KiB
  socket writes, 30 s timeouts) and SGLang's request size on a fragmented KV pool, one
  entry per page per layer, K and V apart (``--default-request-kib``, 128 KiB: a 64-token page
  of one layer's K of a model with 8 KV heads of dim 128 in bf16);
* ``ours``: the WAN profile the launcher gives cross-cluster legs
  (:func:`~prfaas_sglang.transport.wan_defaults.sender_profile` for this link), KV coalesced
  into ``--request-mib`` requests, sent by the ``kv-send`` hooks' own
  :class:`~prfaas_sglang.transport.kv_sender.AsyncKvSender` (``transport_peer.ProductSender``): each chunk
  queued as soon as it exists, at most a write per lane in the engine, completions polled with a
  sleep: no barrier at chunk ends, no thread spinning in a sync call;
* ``ours_engine_queued`` (``engine_queued``, off by default): the same requests all handed to the
  engine at once (up to 8 outstanding), as the hooks did before they kept the queue themselves
  (which let a failed room's queued writes go out after an outage): what keeping it costs;
* ``ours_unpaced`` (``unpaced``, off by default): ``ours`` without ``PRFAAS_KV_LANE_PACING``, in a
  sender of its own: what keeping the lanes level (:mod:`~prfaas_sglang.transport.lane_pacing`) buys;
* ``ours_headroom`` (``headroom_row``, off by default): ``ours`` with its lanes' caps at another
  headroom over the equal share (``PRFAAS_KV_LANE_PACING``'s third field), in a sender of its own:
  the profile's headroom against another in the same run;
* ``ours_per_chunk``: the same profile and requests, sent SGLang's way (one sync batch per
  chunk), to separate the two mechanisms.

``goodput_fraction`` = payload bits / elapsed / shaped rate (the median of ``--repeats``, after
one transfer per sender of up to 64 MiB that opens its lanes and ramps its congestion window:
reported apart as ``first_transfer``, since a deployment's persistent lanes pay it once);
``tcp_reference_fraction`` is the same for one plain TCP stream of the payload over the same
link in the same run, on a new connection per transfer (it pays connect and slow start each
time); ``tcp_warm_fraction`` for one TCP connection kept open across transfers, like a lane:
the strongest plain-TCP baseline, what the link, the emulator and the kernel give one flow
(TCP/IP headers alone cost 3.5% of a 1500-byte MTU; the last byte's acknowledgement one RTT).
``lane_spread_ms``: how far apart our lanes' last requests completed (median), i.e. how long the
transfer waited on its slowest flow. ``--tcp-buffer-mib`` raises the TCP buffers' autotuning limit
(``net.ipv4.tcp_wmem`` / ``tcp_rmem`` max) in both namespaces for every row: one flow needs
about 2 x BDP of send buffer to fill the link, and the host default (4 MiB) holds less.
The size x lanes table (64 MiB per cell, our profile otherwise) finds the knee: a lane
carries one request at a time and waits an RTT for its acknowledgement, so throughput
follows about lanes x size / (RTT + size / rate) until the link binds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from dataclasses import dataclass

from prfaas_sglang.bench.subcommands import Invocation, Subcommand
from prfaas_sglang.transport.linkem import EmulatedLink
from prfaas_sglang.transport.wan_defaults import WanLink, sender_profile

PEER = (sys.executable, "-m", "prfaas_sglang.bench.transport_peer")
CHUNK_BYTES = 64 << 20  # KV of one chunked-prefill chunk (e.g. 8K tokens x 8 KiB per token)


@dataclass(frozen=True)
class Condition:
    name: str
    rtt_ms: float
    loss: float
    congestion_control: str | None = None  # None: the host's default


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("MC_")}


def ours_env(link: WanLink, lanes: int | None = None) -> dict[str, str]:
    """What the launcher gives a PrfaaS worker whose topology states ``link`` (``lanes`` overrides)."""
    env = {**_clean_env(), "MC_FORCE_TCP": "1", **{d.name: d.value for d in sender_profile(link)}}
    if lanes is not None:
        env["MC_TCP_LANES_PER_PEER"] = str(lanes)
    return env


def default_env() -> dict[str, str]:
    return {**_clean_env(), "MC_FORCE_TCP": "1"}


class _Sender:
    def __init__(self, link: EmulatedLink, recv: dict, buffer_mib: int, env: dict[str, str], warm: bool = False):
        if "port" in recv:  # the plain-TCP reference (``warm``: one connection for every job)
            argv = (*link.wrap_a, *PEER, "tcp-send", "--host", link.ip_a, "--peer", f"{link.ip_b}:{recv['port']}",
                    *(("--warm",) if warm else ()))
        else:
            argv = (*link.wrap_a, *PEER, "send", "--host", link.ip_a, "--buffer-mib", str(buffer_mib),
                    "--peer", recv["session"], "--addr", str(recv["addr"]))
        self.env = env
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     text=True, env=env)
        if not self.proc.stdout.readline():
            raise RuntimeError("transport sender did not start")

    def run(self, payload_bytes: int, request_bytes: int, chunk_bytes: int = CHUNK_BYTES, pipeline: bool = False,
            sizes: list[int] | None = None, inflight: int = 8, product: bool = False) -> dict:
        """One transfer; ``sizes`` (pipelined or product only): these request sizes back to back instead of
        ``payload_bytes`` in ``request_bytes`` pieces; ``product``: through the kv-send hooks' sender."""
        self.proc.stdin.write(json.dumps({"payload_bytes": payload_bytes, "request_bytes": request_bytes,
                                          "chunk_bytes": chunk_bytes, "pipeline": pipeline or bool(sizes),
                                          "inflight": inflight, "sizes": sizes, "product": product}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("transport sender died")
        return json.loads(line)

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _with_drops(link: EmulatedLink, sender: _Sender, *args, **kwargs) -> dict:
    """``sender.run(*args, **kwargs)`` with ``drops``: the data direction's (A to B) segments linkem
    dropped meanwhile, at its queue (``overflow``) and at random (``lost``). Rows take turns, so each
    count is one row's transfer alone on the link."""
    before = link.stats()["ab"]
    result = sender.run(*args, **kwargs)
    after = link.stats()["ab"]
    result["drops"] = {key: after[key] - before[key] for key in ("overflow", "lost")}
    return result


def _lane_spread_ms(runs: list[dict], lanes: int) -> float | None:
    """How far apart the lanes' flows finished, median over the transfers: the last request's completion
    after the ``lanes``-th from last (with equal requests taken in order, each lane's last one)."""
    spreads = [r["done_s"][-1] - r["done_s"][-min(lanes, len(r["done_s"]))] for r in runs if r["ok"] and r.get("done_s")]
    return round(1e3 * statistics.median(spreads), 1) if spreads else None


def _fraction(result: dict, payload_bytes: int, rate_mbit: float) -> float:
    if not result["ok"]:
        return 0.0
    return payload_bytes * 8 / result["elapsed_s"] / (rate_mbit * 1e6)


def run_condition(tag: int | None, rate_mbit: float, cond: Condition, payload_mib: int, request_mib: float,
                  default_request_kib: int, repeats: int, table: bool, slow_start_after_idle: bool = True,
                  lanes: int | None = None, tcp_buffer_bytes: int | None = None, engine_queued: bool = False,
                  unpaced: bool = False, tcp_timestamps: bool = True, headroom_row: float | None = None) -> dict:
    payload = payload_mib << 20
    buffer_mib = max(payload_mib, 64)
    with EmulatedLink(tag=tag, rate_mbit=rate_mbit, rtt_ms=cond.rtt_ms, loss=cond.loss,
                      congestion_control=cond.congestion_control, slow_start_after_idle=slow_start_after_idle,
                      tcp_buffer_bytes=tcp_buffer_bytes, tcp_timestamps=tcp_timestamps) as link:
        recv_proc = subprocess.Popen((*link.wrap_b, *PEER, "recv", "--host", link.ip_b, "--buffer-mib", str(buffer_mib)),
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                     env=default_env())
        tcp_proc = subprocess.Popen((*link.wrap_b, *PEER, "tcp-recv", "--host", link.ip_b), stdout=subprocess.PIPE,
                                    stderr=subprocess.DEVNULL, text=True)
        try:
            recv = json.loads(recv_proc.stdout.readline())
            tcp_recv = json.loads(tcp_proc.stdout.readline())
            runs: dict[str, list[dict]] = {"ours": [], "ours_per_chunk": [], "default": [], "tcp": [], "tcp_warm": []}
            if engine_queued:
                runs["ours_engine_queued"] = []
            if unpaced:
                runs["ours_unpaced"] = []
            if headroom_row is not None:
                runs["ours_headroom"] = []
            wan = WanLink(rate_mbit * 1e6, cond.rtt_ms / 1e3)
            senders = {"ours": _Sender(link, recv, buffer_mib, ours_env(wan, lanes)), "default": _Sender(link, recv, buffer_mib, default_env()),
                       "tcp": _Sender(link, tcp_recv, buffer_mib, default_env()),
                       "tcp_warm": _Sender(link, tcp_recv, buffer_mib, default_env(), warm=True)}
            senders["ours_per_chunk"] = senders["ours"]
            if engine_queued:  # lanes of its own: each row's lanes then sit idle alike between its turns
                senders["ours_engine_queued"] = _Sender(link, recv, buffer_mib, ours_env(wan, lanes))
            if unpaced:
                env = ours_env(wan, lanes)
                env.pop("PRFAAS_KV_LANE_PACING", None)
                senders["ours_unpaced"] = _Sender(link, recv, buffer_mib, env)
            if headroom_row is not None:
                env = ours_env(wan, lanes)
                env["PRFAAS_KV_LANE_PACING"] += f",{headroom_row:g}"
                senders["ours_headroom"] = _Sender(link, recv, buffer_mib, env)
            ours_request = int(request_mib * (1 << 20))
            # name -> (request bytes, how: "product" the hooks' sender, "pipeline" all handed to the engine, "sync" per chunk)
            jobs = {"ours": (ours_request, "product"), "ours_unpaced": (ours_request, "product"),
                    "ours_headroom": (ours_request, "product"),
                    "ours_per_chunk": (ours_request, "sync"),
                    "ours_engine_queued": (ours_request, "pipeline"), "default": (default_request_kib << 10, "sync"),
                    "tcp": (payload, "sync"), "tcp_warm": (payload, "sync")}
            first: dict[str, dict] = {}
            try:
                # One transfer per sender first, reported apart: it opens the lanes and ramps the
                # congestion window, which a deployment's persistent lanes pay once, not per request.
                for name in runs:
                    request, how = jobs[name]
                    first[name] = _with_drops(link, senders[name], min(payload, WARMUP_BYTES), request,
                                              pipeline=how == "pipeline", product=how == "product")
                for _ in range(repeats):  # take turns, so drift hits all alike
                    for name in runs:
                        request, how = jobs[name]
                        runs[name].append(_with_drops(link, senders[name], payload, request,
                                                      pipeline=how == "pipeline", product=how == "product"))
            finally:
                for sender in {id(x): x for x in senders.values()}.values():
                    sender.close()
            our_lanes = int(senders["ours"].env["MC_TCP_LANES_PER_PEER"])
            out = {"condition": cond.name, "rtt_ms": cond.rtt_ms, "loss": cond.loss,
                   "congestion_control": cond.congestion_control or _host_cc(),
                   "slow_start_after_idle": slow_start_after_idle,
                   "goodput_fraction": statistics.median(_fraction(r, payload, rate_mbit) for r in runs["ours"]),
                   "default_goodput_fraction": statistics.median(_fraction(r, payload, rate_mbit) for r in runs["default"]),
                   "per_chunk_goodput_fraction": statistics.median(_fraction(r, payload, rate_mbit) for r in runs["ours_per_chunk"]),
                   "tcp_reference_fraction": statistics.median(_fraction(r, payload, rate_mbit) for r in runs["tcp"]),
                   "tcp_warm_fraction": statistics.median(_fraction(r, payload, rate_mbit) for r in runs["tcp_warm"]),
                   "engine_queued_fraction": (statistics.median(_fraction(r, payload, rate_mbit)
                                                                for r in runs["ours_engine_queued"]) if engine_queued else None),
                   "unpaced_fraction": (statistics.median(_fraction(r, payload, rate_mbit) for r in runs["ours_unpaced"])
                                        if unpaced else None),
                   "lane_spread_ms": _lane_spread_ms(runs["ours"], our_lanes),
                   "unpaced_lane_spread_ms": _lane_spread_ms(runs["ours_unpaced"], our_lanes) if unpaced else None,
                   "headroom_row": (None if headroom_row is None else {
                       "headroom": headroom_row,
                       "fraction": statistics.median(_fraction(r, payload, rate_mbit) for r in runs["ours_headroom"]),
                       "lane_spread_ms": _lane_spread_ms(runs["ours_headroom"], our_lanes)}),
                   # how often ours changed its lanes' pacing cap per transfer (capped, re-capped as writes
                   # ended, freed; 0: never capped), median over the repeats
                   "pacing_changes": statistics.median(r.get("pacing_changes", 0) for r in runs["ours"]),
                   "tcp_buffer_bytes": tcp_buffer_bytes, "tcp_timestamps": tcp_timestamps,
                   # segments of the data direction linkem dropped per transfer, median per row: at its
                   # bottleneck queue (the senders together overran it) and at random (the condition's loss)
                   "queue_drops": {name: statistics.median(r["drops"]["overflow"] for r in rs) for name, rs in runs.items()},
                   "random_drops": {name: statistics.median(r["drops"]["lost"] for r in rs) for name, rs in runs.items()},
                   # [min, max] over the repeats, per row: the spread behind each median
                   "fraction_range": {name: [round(min(f), 3), round(max(f), 3)] for name, f in
                                      ((name, [_fraction(r, payload, rate_mbit) for r in rs]) for name, rs in runs.items())},
                   "runs": runs, "first_transfer": first}
            if table:
                out["table"] = _size_lanes_table(link, recv, buffer_mib, rate_mbit, wan)
            out["link"] = link.stats()
            return out
        finally:
            recv_proc.stdin.close()
            recv_proc.wait(timeout=10)
            tcp_proc.kill()
            tcp_proc.wait()


WARMUP_BYTES = 64 << 20
TABLE_SIZES_KIB = (64, 256, 1024, 4096, 16384)
TABLE_LANES = (4, 16)


def _size_lanes_table(link: EmulatedLink, recv: dict, buffer_mib: int, rate_mbit: float, wan: WanLink) -> dict:
    payload = 64 << 20
    table = {}
    for lanes in TABLE_LANES:
        sender = _Sender(link, recv, buffer_mib, ours_env(wan, lanes))
        try:
            table[str(lanes)] = {str(kib): round(_fraction(sender.run(payload, kib << 10), payload, rate_mbit), 3)
                                 for kib in TABLE_SIZES_KIB}
        finally:
            sender.close()
    return table


def _host_cc() -> str:
    with open("/proc/sys/net/ipv4/tcp_congestion_control") as f:
        return f.read().strip()


CONDITIONS = {
    "clean": Condition("clean", rtt_ms=20.0, loss=0.0),
    "lossy": Condition("lossy", rtt_ms=20.0, loss=0.001),
    "lossy-cubic": Condition("lossy-cubic", rtt_ms=20.0, loss=0.001, congestion_control="cubic"),
    "lossy-bbr": Condition("lossy-bbr", rtt_ms=20.0, loss=0.001, congestion_control="bbr"),
}


def run(rate_mbit: float = 1000.0, payload_mib: int = 256, request_mib: float = 16.0, default_request_kib: int = 128,
        conditions: tuple[str, ...] = ("clean", "lossy"), repeats: int = 3, table: bool = True,
        slow_start_after_idle: bool = True, lanes: int | None = None, tcp_buffer_bytes: int | None = None,
        engine_queued: bool = False, unpaced: bool = False, tcp_timestamps: bool = True,
        headroom_row: float | None = None) -> dict:
    """``lanes``: our rows' lanes per peer (None: the WAN profile's for this link); the table varies its own.
    ``tcp_buffer_bytes``: the TCP buffers' autotuning limit in both namespaces, for every row (None: the host's).
    ``engine_queued``: add the ``ours_engine_queued`` row; ``unpaced``: the ``ours_unpaced`` row;
    ``headroom_row``: the ``ours_headroom`` row, its lanes capped at this headroom over the equal share.
    ``tcp_timestamps`` False: ``net.ipv4.tcp_timestamps=0`` in both namespaces, for every row (each
    segment then carries 1460 payload bytes, not 1448)."""
    results = []
    for i, name in enumerate(conditions):
        results.append(run_condition(None, rate_mbit, CONDITIONS[name], payload_mib, request_mib,
                                     default_request_kib, repeats, table and i == 0, slow_start_after_idle, lanes,
                                     tcp_buffer_bytes, engine_queued, unpaced, tcp_timestamps, headroom_row))
    first = results[0]
    return {"rate_mbit": rate_mbit, "payload_mib": payload_mib, "request_mib": request_mib, "lanes": lanes,
            "tcp_buffer_bytes": tcp_buffer_bytes, "tcp_timestamps": tcp_timestamps,
            "default_request_kib": default_request_kib, "chunk_mib": CHUNK_BYTES >> 20,
            "goodput_fraction": first["goodput_fraction"], "default_goodput_fraction": first["default_goodput_fraction"],
            "conditions": results}


def render_markdown(r: dict) -> str:
    buffers = f"TCP buffers up to {r['tcp_buffer_bytes'] >> 20} MiB" if r.get("tcp_buffer_bytes") else "host TCP buffers"
    if r.get("tcp_timestamps") is False:
        buffers += ", TCP timestamps off"
    lines = [f"Link {r['rate_mbit']:g} Mbit/s, payload {r['payload_mib']} MiB in {r['chunk_mib']} MiB chunks; "
             f"ours: {r['request_mib']:g} MiB requests, WAN profile; default: {r['default_request_kib']} KiB requests, "
             f"Mooncake's settings; {buffers}.", "",
             "| condition | congestion control | ours (the kv-send hooks' sender) | ours, one sync batch per chunk | default "
             "| one plain TCP stream | one warm TCP stream |",
             "|---|---|---|---|---|---|---|"]
    def cell(c: dict, key: str, row: str) -> str:
        low, high = c["fraction_range"][row]
        return f"{c[key]:.3f} [{low:.3f}, {high:.3f}]"

    for c in r["conditions"]:
        queued = (f" (all in the engine: {cell(c, 'engine_queued_fraction', 'ours_engine_queued')})"
                  if c.get("engine_queued_fraction") is not None else "")
        if c.get("unpaced_fraction") is not None:
            queued += f" (lanes not paced: {cell(c, 'unpaced_fraction', 'ours_unpaced')})"
        if c.get("headroom_row") is not None:
            low, high = c["fraction_range"]["ours_headroom"]
            queued += (f" (caps at headroom {c['headroom_row']['headroom']:g}: "
                       f"{c['headroom_row']['fraction']:.3f} [{low:.3f}, {high:.3f}])")
        lines.append(f"| {c['condition']} (RTT {c['rtt_ms']:g} ms, loss {c['loss'] * 100:g}%) | {c['congestion_control']} "
                     f"| **{cell(c, 'goodput_fraction', 'ours')}**{queued} "
                     f"| {cell(c, 'per_chunk_goodput_fraction', 'ours_per_chunk')} "
                     f"| {cell(c, 'default_goodput_fraction', 'default')} | {cell(c, 'tcp_reference_fraction', 'tcp')} "
                     f"| {cell(c, 'tcp_warm_fraction', 'tcp_warm')} |")
    lines.append("")
    lines.append("(goodput / shaped rate: median [min, max] of the repeats)")
    for c in r["conditions"]:
        if "table" in c:
            lines += ["", f"Goodput / rate by request size x lanes ({c['condition']}, 64 MiB, WAN profile otherwise):", "",
                      "| lanes | " + " | ".join(f"{k} KiB" for k in TABLE_SIZES_KIB) + " |",
                      "|---|" + "---|" * len(TABLE_SIZES_KIB)]
            for lanes, row in c["table"].items():
                lines.append(f"| {lanes} | " + " | ".join(f"{v:.3f}" for v in row.values()) + " |")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rate-mbit", type=float, default=1000.0,
                        help="the emulated link's rate, Mbit/s")
    parser.add_argument("--payload-mib", type=int, default=256,
                        help="bytes per timed transfer, MiB")
    parser.add_argument("--request-mib", type=float, default=16.0, help="our coalesced request size (a 64 MiB chunk over 4 lanes)")
    parser.add_argument("--default-request-kib", type=int, default=128, help="SGLang's request on a fragmented pool")
    parser.add_argument("--lanes", type=int, default=None,
                        help="our lanes per peer, 1..16 (default: what the WAN profile gives this link)")
    parser.add_argument("--conditions", default="clean,lossy", help="comma list of: clean, lossy, lossy-cubic, lossy-bbr")
    parser.add_argument("--repeats", type=int, default=3,
                        help="timed transfers per row and condition (the median is reported)")
    parser.add_argument("--no-table", action="store_true", help="skip the request size x lanes table")
    parser.add_argument("--no-slow-start-after-idle", action="store_true",
                        help="net.ipv4.tcp_slow_start_after_idle=0 on both ends: connections keep their window across idle gaps")
    parser.add_argument("--tcp-buffer-mib", type=int, default=None,
                        help="TCP buffers autotune up to this (net.ipv4.tcp_wmem/tcp_rmem max) on both ends, every row "
                             "(default: the host's)")
    parser.add_argument("--no-tcp-timestamps", action="store_true",
                        help="net.ipv4.tcp_timestamps=0 on both ends, every row: 12 more payload bytes per segment "
                             "(host advice, with its caveats: docs/kv-transport.md)")
    parser.add_argument("--engine-queued-row", action="store_true",
                        help="add a row with every request handed to the engine at once (the kv-send hooks before they "
                             "kept the queue): what keeping it costs")
    parser.add_argument("--unpaced-row", action="store_true",
                        help="add a row of ours without lane pacing (PRFAAS_KV_LANE_PACING unset): what keeping the "
                             "lanes level buys")
    parser.add_argument("--headroom-row", type=float, default=None, metavar="H",
                        help="add a row of ours with its lanes' caps at headroom H (0..1) over the equal share, in a "
                             "sender of its own: the profile's headroom against H in the same run")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")


def cli(args: argparse.Namespace, inv: Invocation) -> int:
    from prfaas_sglang.transport.linkem import unavailable

    conditions = tuple(args.conditions.split(","))
    if unknown := set(conditions) - set(CONDITIONS):
        inv.error(f"unknown conditions {sorted(unknown)}; choose from {', '.join(CONDITIONS)}")
    if args.rate_mbit <= 0 or args.payload_mib < 1 or args.repeats < 1 or args.request_mib <= 0 or args.default_request_kib < 1:
        inv.error("--rate-mbit, --payload-mib, --repeats, --request-mib and --default-request-kib must be positive")
    if args.lanes is not None and not 1 <= args.lanes <= 16:
        inv.error("--lanes must be in 1..16 (Mooncake's range for MC_TCP_LANES_PER_PEER)")
    if args.tcp_buffer_mib is not None and not 1 <= args.tcp_buffer_mib <= 1024:
        inv.error("--tcp-buffer-mib must be in 1..1024")
    if args.headroom_row is not None and not 0 <= args.headroom_row <= 1:
        inv.error("--headroom-row must be in 0..1")
    if (why := unavailable()) is not None:
        inv.error(f"the emulated link {why}")
    result = run(args.rate_mbit, args.payload_mib, args.request_mib, args.default_request_kib, conditions,
                 args.repeats, not args.no_table, not args.no_slow_start_after_idle, args.lanes,
                 args.tcp_buffer_mib << 20 if args.tcp_buffer_mib else None, args.engine_queued_row,
                 args.unpaced_row, not args.no_tcp_timestamps, args.headroom_row)
    return inv.report(args, result, None, render_markdown)


SUBCOMMANDS = {"transport": Subcommand(add_arguments, cli)}
