"""Coalescing beyond adjacent entries, end to end: SGLang's Mooncake path across an emulated WAN link.

``python -m prfaas_sglang.bench kv-staging`` (root): two network namespaces joined by
:class:`~prfaas_sglang.transport.linkem.EmulatedLink` (rate, RTT); in one a PrfaaS prefill end, in the
other a decode end (:mod:`~prfaas_sglang.bench.kv_staging_peer`: SGLang 0.5.15's own bootstrap server,
Mooncake KV managers, sender and receiver on CPU, our hooks installed, each with the launcher's WAN
profile for its role). Each request's KV (``layers`` x K and V, ``request_pages`` pages of
``page_bytes``) goes in ``chunks`` chunks, as chunked prefill sends it; its pages are scattered on both
sides in runs of geometric length (mean ``mean_run`` pages), drawn apart per side and per request, the
same draws in every mode. Modes, each in fresh processes, in rotating order per repeat:

* ``adjacent``: the product before staging: SGLang's blocks (a request per run contiguous on both
  sides, per buffer), adjacent ones merged, through the kv-send hooks' asynchronous sender;
* ``prefill-staged``: the PrfaaS side's staging buffer (``PRFAAS_KV_STAGING_MIB``): a request per
  destination run;
* ``both-staged``: and the decode's KV reserve (``decode-staging-*``): a request per buffer and chunk;
* ``contiguous``: no staging, pages in one run on both sides (a fresh pool): the reference.

Per request: seconds from the first chunk's send to the prefill's Success, the writes it took, and
whether the decode's own pages then hold exactly the prefill's KV. Goodput fraction = KV bits / seconds /
rate. One warm-up request per mode opens the lanes first (not counted).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from prfaas_sglang.bench.subcommands import Invocation, Subcommand
from prfaas_sglang.bench.transport import default_env
from prfaas_sglang.bench.zygote import Zygote
from prfaas_sglang.demo.cluster import PortPicker
from prfaas_sglang.roles import Role
from prfaas_sglang.transport.linkem import EmulatedLink
from prfaas_sglang.transport.wan_defaults import WanLink, mooncake_env

PEER = (sys.executable, "-m", "prfaas_sglang.bench.kv_staging_peer")
MODES = ("adjacent", "prefill-staged", "both-staged", "contiguous")


class _Peer:
    """One end, forked from ``zygote`` at construction (SGLang imported once for every mode's ends);
    :meth:`ready` waits for its start line, and the caller closes it whatever happens."""

    def __init__(self, zygote: Zygote, wrap: tuple[str, ...], role: str, env: dict[str, str], log: Path):
        self.role, self.log_path = role, log
        self.log = open(log, "a")  # noqa: SIM115 - closed in close()
        self.proc = zygote.popen([*PEER, role], wrap=wrap, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 stderr=self.log)
        self.success: int | None = None

    def ready(self) -> _Peer:
        line = self.proc.stdout.readline()
        if not line.startswith("{"):
            raise RuntimeError(f"kv-staging {self.role} peer did not start; see {self.log_path}")
        self.success = json.loads(line)["success"]
        return self

    def ask(self, op: str, **args) -> dict:
        self.proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
        answer = json.loads(self.proc.stdout.readline())
        if "error" in answer:
            raise RuntimeError(f"{op}: {answer['error']}")
        return answer

    def close(self) -> None:
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
        self.log.close()


def _envs(mode: str, link: EmulatedLink, wan: WanLink, geometry: dict[str, int], staging_mib: int,
          reserve_pages: int, boot_port: int) -> tuple[dict[str, str], dict[str, str]]:
    common = {**{k: str(v) for k, v in geometry.items()}, "PREFILL_IP": link.ip_a, "BOOT_PORT": str(boot_port)}
    if mode == "contiguous":
        common["MEAN_RUN"] = "0"
    prefill = {**default_env(), **{d.name: d.value for d in mooncake_env(Role.PRFAAS, wan)}, **common,
               "PRFAAS_ROLE": "prfaas", "PEER_IP": link.ip_a,
               "PRFAAS_KV_STAGING_MIB": str(staging_mib if mode in ("prefill-staged", "both-staged") else 0)}
    decode = {**default_env(), **{d.name: d.value for d in mooncake_env(Role.PD_DECODE, wan)}, **common,
              "PRFAAS_ROLE": "pd-decode", "PEER_IP": link.ip_b,
              "RESERVE_PAGES": str(reserve_pages if mode == "both-staged" else 0)}
    return prefill, decode


def run(rate_mbit: float = 1000.0, rtt_ms: float = 20.0, requests: int = 3, repeats: int = 3, layers: int = 4,
        request_pages: int = 4096, page_bytes: int = 2048, mean_run: int = 64, chunks: int = 4,
        staging_mib: int = 256, tag: int | None = None, log_dir: Path | None = None) -> dict:
    """See the module docstring. ``repeats`` rounds, each every mode in fresh processes (order rotated),
    forked from one process that imported SGLang (:class:`~prfaas_sglang.bench.zygote.Zygote`)."""
    log_dir = Path(log_dir or "/tmp/prfaas-kv-staging")
    log_dir.mkdir(parents=True, exist_ok=True)
    geometry = {"LAYERS": layers, "POOL_PAGES": 4 * request_pages, "PAGE_BYTES": page_bytes,
                "REQUEST_PAGES": request_pages, "CHUNKS": chunks, "MEAN_RUN": mean_run}
    kv_bytes = 2 * layers * request_pages * page_bytes
    rows: dict[str, list[dict]] = {m: [] for m in MODES}
    with EmulatedLink(tag=tag, rate_mbit=rate_mbit, rtt_ms=rtt_ms) as link, Zygote() as zygote:
        wan = WanLink(rate_mbit * 1e6, rtt_ms / 1e3)
        for repeat in range(repeats):
            for mode in MODES[repeat % len(MODES):] + MODES[:repeat % len(MODES)]:
                prefill_env, decode_env = _envs(mode, link, wan, geometry, staging_mib, request_pages * 2,
                                                PortPicker()())
                prefill = _Peer(zygote, link.wrap_a, "prefill", prefill_env, log_dir / f"{mode}-prefill.log")
                decode = None
                try:
                    decode = _Peer(zygote, link.wrap_b, "decode", decode_env, log_dir / f"{mode}-decode.log")
                    prefill.ready()
                    decode.ready()
                    rooms = [1000 * (repeat + 1)] + [1000 * (repeat + 1) + i for i in range(1, requests + 1)]
                    writes_before = 0
                    for i, room in enumerate(rooms):  # the first warms the lanes up
                        prefill.ask("open", room=room)
                        decode.ask("recv", room=room, timeout_s=30.0)
                        sent = prefill.ask("send", room=room, timeout_s=300.0)
                        got = decode.ask("wait", room=room, timeout_s=60.0)
                        writes = (sent["writes"] or 0) - writes_before
                        writes_before = sent["writes"] or 0
                        if i:
                            rows[mode].append({"repeat": repeat, "room": room, "elapsed_s": sent["elapsed_s"],
                                               "ok": sent["state"] == got["state"] == prefill.success,
                                               "kv_intact": got["kv_intact"], "writes": writes})
                finally:
                    prefill.close()
                    if decode is not None:
                        decode.close()
    summary = {}
    for mode, done in rows.items():
        fractions = [kv_bytes * 8 / r["elapsed_s"] / (rate_mbit * 1e6) for r in done if r["ok"] and r["elapsed_s"]]
        per_repeat = [statistics.median(kv_bytes * 8 / r["elapsed_s"] / (rate_mbit * 1e6)
                                        for r in done if r["repeat"] == k and r["ok"])
                      for k in range(repeats) if any(r["repeat"] == k and r["ok"] for r in done)]
        summary[mode] = {"requests": len(done), "failed": sum(not r["ok"] for r in done),
                         "kv_intact": all(r["kv_intact"] for r in done),
                         "writes_per_request": statistics.median(r["writes"] for r in done) if done else None,
                         "seconds_median": statistics.median(r["elapsed_s"] for r in done if r["elapsed_s"])
                         if done else None,
                         "goodput_fraction": round(statistics.median(fractions), 3) if fractions else None,
                         "repeat_medians": [round(x, 3) for x in per_repeat], "rows": done}
    return {"rate_mbit": rate_mbit, "rtt_ms": rtt_ms, "requests": requests, "repeats": repeats, "layers": layers,
            "request_pages": request_pages, "page_bytes": page_bytes, "mean_run": mean_run, "chunks": chunks,
            "kv_bytes_per_request": kv_bytes, "staging_mib": staging_mib, "modes": summary}


def render_markdown(r: dict) -> str:
    lines = [f"{r['rate_mbit']:g} Mbit/s, {r['rtt_ms']:g} ms RTT; {r['repeats']} x {r['requests']} requests per mode of "
             f"{r['kv_bytes_per_request'] / (1 << 20):g} MiB ({r['layers']} layers, K and V, {r['request_pages']} pages of "
             f"{r['page_bytes']} bytes, {r['chunks']} chunks), pages in runs of mean {r['mean_run']} on both sides.", "",
             "| mode | writes per request (median) | seconds per request (median) | goodput / rate (median) "
             "| per-repeat medians | failed | KV intact |", "|---|---|---|---|---|---|---|"]
    for mode, m in r["modes"].items():
        lines.append(f"| {mode} | {m['writes_per_request']:g} | {m['seconds_median']:.2f} | **{m['goodput_fraction']}** | "
                     f"{', '.join(f'{x:.3f}' for x in m['repeat_medians'])} | {m['failed']} | {m['kv_intact']} |")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rate-mbit", type=float, default=1000.0,
                        help="the emulated link's rate, Mbit/s")
    parser.add_argument("--rtt-ms", type=float, default=20.0,
                        help="the emulated link's round-trip time, ms")
    parser.add_argument("--requests", type=int, default=3, help="measured requests per mode and repeat")
    parser.add_argument("--repeats", type=int, default=3,
                        help="rounds, each running every mode in fresh processes")
    parser.add_argument("--layers", type=int, default=4,
                        help="layers of KV per request (K and V each)")
    parser.add_argument("--request-pages", type=int, default=4096,
                        help="pages of KV per request and layer (at least --chunks)")
    parser.add_argument("--page-bytes", type=int, default=2048, help="one page of one KV buffer (page 1, 8 heads of 128, bf16)")
    parser.add_argument("--mean-run", type=int, default=64, help="mean length of a run of consecutive pages, either side")
    parser.add_argument("--chunks", type=int, default=4,
                        help="chunks each request's KV is sent in, as chunked prefill sends it")
    parser.add_argument("--staging-mib", type=int, default=256,
                        help="the PrfaaS side's staging buffer in the staged modes, MiB")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")


def cli(args: argparse.Namespace, inv: Invocation) -> int:
    from prfaas_sglang.transport.linkem import unavailable

    if (args.rate_mbit <= 0 or args.rtt_ms < 0 or min(args.requests, args.repeats, args.layers, args.chunks,
                                                       args.mean_run + 1, args.staging_mib) < 1
            or args.request_pages < args.chunks or args.page_bytes < 64):
        inv.error("kv-staging: --rate-mbit > 0, --rtt-ms >= 0, counts >= 1, --mean-run >= 0, "
                  "--request-pages >= --chunks, --page-bytes >= 64")
    if (why := unavailable()) is not None:
        inv.error(f"the emulated link {why}")
    result = run(args.rate_mbit, args.rtt_ms, args.requests, args.repeats, args.layers, args.request_pages,
                 args.page_bytes, args.mean_run, args.chunks, args.staging_mib)
    return inv.report(args, result, None, render_markdown)


SUBCOMMANDS = {"kv-staging": Subcommand(add_arguments, cli)}
