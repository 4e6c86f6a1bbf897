"""A prefix cached only in the PrfaaS cluster: moved to PD-P, or recomputed there? TTFT of each, per
prompt length and link rate, next to what the router's cost model predicts.

Deployment (emulated engines, every node through the launcher): 1 PrfaaS worker (8xH200 profile)
in a network namespace whose egress ``tbf`` shapes at the link's rate (modelled capacity x
kv_scale x speedup on the wire, as ``bench compare``), 1 PD-P and 1 PD-D (8xH20). Per link rate,
four routers over the same workers, abundant mode, early rejection off, ``t`` pinned below the
shortest prompt, placement by the paper's rule alone (``--placement threshold``: placement by expected
TTFT would move a long prompt off PrfaaS wherever it and its KV over the link are expected later than
PD-P, so where the prefix lands would depend on the link; here it is fixed). Every request's route is
checked against the rule's (the warm-up on PrfaaS; the timed turn on PD-P, or on PrfaaS under ``off``):
a run that went elsewhere stops the benchmark rather than fill a column with another measurement.

    always   the move is forced wherever the other cluster's cache is longer
    never    never moved: PD-P recomputes the prefix
    off      the other cluster's cache is not credited (each cluster judged alone, as with real SGLang
             workers today): the request prefills on PrfaaS, where the prefix is cached, and its
             whole KV crosses the link to PD-D
    auto     the product: the cost model decides (move when ``transfer_s < saved prefill``)

Per prompt length and repeat, for each router, a fresh random prompt ``P`` is sent once (it
prefills on PrfaaS, whose cache keeps every prefill: ``PRFAAS_PREFILL_CACHE=all``; under the
launcher's ``auto`` a one-off prompt needed a second send to be kept, and the rule sent that one, only
the tail after ``P``'s last state checkpoint uncached, to PD-P wherever ``t`` was above the tail),
then ``P`` + ``suffix`` (routed to PD-P: its uncached length
after the best cache is the suffix); the TTFT of that second request (streamed, one output token)
is what is recorded, with the router's decision; then the next turn (``P`` + suffix + suffix), which
shows where the prefix now lives (moved or recomputed: PD-P, locally; off: PrfaaS again, across the
link). Times are wall seconds (observed) and modelled
seconds (x speedup). The crossover is the shortest length at which moving beats recomputing,
measured (medians) and predicted (the cost model's ``transfer_s`` vs saved prefill, as the auto
router reported them). Needs root (network namespace, tbf).
"""

from __future__ import annotations

import argparse
import os
import random
import re
import signal
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from prfaas_sglang.adapters import http_sync
from prfaas_sglang.bench.subcommands import CommaList, Invocation, Subcommand
from prfaas_sglang.demo.cluster import (
    CONTROL_REQUEST_TIMEOUT_S,
    ProcessGroup,
    local_topology,
    scrape_metric,
    start_deployment,
    start_router,
)
from prfaas_sglang.demo.netns import Netns
from prfaas_sglang.envs import envs

MODES = ("always", "never", "off", "auto")
# where the rule sends P + suffix (X-Prfaas-Route's cluster): after the best cache only the suffix is new,
# unless ``off`` judges each cluster's cache alone (then all of P is new to PD-P)
TIMED_ROUTE = {"always": "pd/", "never": "pd/", "off": "prfaas/", "auto": "pd/"}
PAGE = 512
ACCELERATORS = ("h200x8", "h20x8")
_COST = re.compile(r"\(([\d.]+) s (<|>=) recompute ([\d.]+) s\)")


def _topology(net: Netns, rate_gbps: float, speedup: float, kv_scale: float, threshold: int) -> dict:
    """The workers' topology (no router node) with the link at ``rate_gbps`` modelled, i.e. as the router
    sees it: bits on the wire per wall second (x kv_scale x speedup), like ``bench compare``."""
    return local_topology(speedup=speedup, kv_scale=kv_scale, accelerators=ACCELERATORS,
                          link_gbps=rate_gbps * kv_scale * speedup, threshold_tokens=threshold, telemetry=False,
                          hosts={"prfaas": net.inner_ip}, host=net.outer_ip, router=False)


def _wait_index(url: str, worker: str, at_least: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if (http_sync.get_json(url + "/status", timeout_s=CONTROL_REQUEST_TIMEOUT_S)["workers"][worker]["index_blocks"] or 0) >= at_least:
            return
        time.sleep(0.05)
    raise RuntimeError(f"{url}: the KV index never saw {at_least} blocks of {worker}")


def _ttft(url: str, ids: list[int]) -> tuple[float, dict]:
    """Streamed, one output token: seconds to the first event, and the router's headers."""
    started = time.perf_counter()
    with http_sync.stream("POST", url + "/generate", timeout_s=600,
                          json_body={"input_ids": ids, "stream": True, "sampling_params": {"max_new_tokens": 1}}) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{url}: HTTP {resp.status} {resp.read()[:200].decode(errors='replace')}")
        for line in resp.lines():
            if line.startswith(b"data: "):
                ttft = time.perf_counter() - started
                resp.read()
                return ttft, {k.lower(): v for k, v in resp.headers.items()}
    raise RuntimeError(f"{url}: the stream ended without an event")


def _route(url: str, headers, expected: str, what: str) -> str:
    """The router's ``X-Prfaas-Route``, which must name ``expected``'s cluster (RuntimeError with the
    router's reason otherwise)."""
    route = headers.get("x-prfaas-route") or ""
    if not route.startswith(expected):
        reason = http_sync.get_json(url + "/status", timeout_s=CONTROL_REQUEST_TIMEOUT_S)["recent"][-1]["reason"]
        raise RuntimeError(f"{what} was routed {route or 'nowhere'}, not {expected}: {reason}")
    return route


def _one(url: str, mode: str, rng: random.Random, length: int, suffix: int) -> dict:
    """Warm ``P`` on PrfaaS through ``url`` (its cache keeps every prefill), then time ``P`` + suffix;
    what the router decided."""
    prompt = [rng.randrange(1, 1 << 31) for _ in range(length)]
    before = http_sync.get_json(url + "/status", timeout_s=CONTROL_REQUEST_TIMEOUT_S)["workers"]["prfaas-0"]["index_blocks"] or 0
    warm = http_sync.post(url + "/generate", json_body={"input_ids": prompt, "sampling_params": {"max_new_tokens": 1}},
                          timeout_s=600)
    if warm.status != 200:
        raise RuntimeError(f"{url}: the warm-up failed: HTTP {warm.status}")
    _route(url, warm.headers, "prfaas/", f"the warm-up of {length} tokens")
    _wait_index(url, "prfaas-0", before + length // PAGE - 1)
    grown = prompt + [rng.randrange(1, 1 << 31) for _ in range(suffix)]
    ttft_s, headers = _ttft(url, grown)
    _route(url, headers, TIMED_ROUTE[mode], f"{mode}: the timed turn")
    recent = http_sync.get_json(url + "/status", timeout_s=CONTROL_REQUEST_TIMEOUT_S)["recent"][-1]
    cost = _COST.search(recent["reason"])
    time.sleep(0.2)  # the KV events of the turn reach the router's index
    next_s, next_headers = _ttft(url, grown + [rng.randrange(1, 1 << 31) for _ in range(suffix)])
    return {"ttft_s": ttft_s, "route": headers.get("x-prfaas-route"), "cached_tokens": recent["cached_tokens"],
            "next_ttft_s": next_s, "next_route": next_headers.get("x-prfaas-route"),
            "moved": "; move " in recent["reason"], "reason": recent["reason"],
            "predicted_transfer_s": float(cost.group(1)) if cost else None,
            "predicted_saved_s": float(cost.group(3)) if cost else None}


def run(rates_gbps: tuple[float, ...] = (2.0, 10.0, 50.0), lengths: tuple[int, ...] = (8192, 16384, 32768, 65536),
        suffix: int = 512, repeats: int = 3, speedup: float = 4.0, kv_scale: float = 0.01, seed: int = 0,
        log_dir: Path | None = None) -> dict:
    log_dir = log_dir or Path(tempfile.mkdtemp(prefix="prfaas-cache-transfer-"))
    threshold = min(lengths) // 2
    rng = random.Random(seed)
    out: dict = {"setting": {"rates_gbps": list(rates_gbps), "lengths": list(lengths), "suffix_tokens": suffix,
                             "repeats": repeats, "speedup": speedup, "kv_scale": kv_scale, "threshold_tokens": threshold,
                             "seed": seed}, "logs": str(log_dir), "rates": []}
    net = Netns()
    group = ProcessGroup(log_dir)
    try:
        net.__enter__()
        context = ("--context-tokens", str(2 * max(lengths) + 2 * suffix), "--cache-tokens", str(64 * max(lengths)),
                   "--bootstrap-timeout-s", "60")
        doc = _topology(net, rates_gbps[0], speedup, kv_scale, threshold)
        deployment = start_deployment(group, doc, engine_args={r: context for r in ("prfaas", "pd-prefill", "pd-decode")},
                                      wrap={"prfaas": net.wrap}, node_env={"prfaas": {envs.PREFILL_CACHE.name: "all"}},
                                      name="workers")
        for rate in rates_gbps:
            wire_mbit = rate * 1e3 * kv_scale * speedup
            net.throttle(wire_mbit)
            doc["links"][0]["bandwidth_gbps"] = wire_mbit / 1e3  # the same workers; only the link the routers see differs
            routers = {mode: start_router(group, doc, "--bandwidth-mode", "abundant", "--no-early-rejection",
                                          "--placement", "threshold", "--cache-transfer", mode,
                                          name=f"router-{rate:g}-{mode}") for mode in MODES}
            try:
                rows = {str(n): {mode: [] for mode in MODES} for n in lengths}
                for length in lengths:
                    for _ in range(repeats):
                        for mode in MODES:
                            rows[str(length)][mode].append(_one(routers[mode].url, mode, rng, length, suffix))
            finally:
                for handle in routers.values():
                    _stop(handle.proc)
            out["rates"].append(_summarise(rate, wire_mbit, lengths, rows, speedup))
        out["prefix_export_bytes"] = scrape_metric(deployment.workers["prfaas-0"].url, "prfaas:prefix_export_bytes_total")
    finally:
        group.stop()
        net.__exit__(None, None, None)
    return out


def _stop(proc) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=10)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        pass


def _summarise(rate: float, wire_mbit: float, lengths, rows: dict, speedup: float) -> dict:
    table = []
    for n in lengths:
        cell = rows[str(n)]
        moved = [r["ttft_s"] for r in cell["always"] if r["moved"]]
        recomputed = [r["ttft_s"] for r in cell["never"] if not r["moved"]]
        remote = [r["ttft_s"] for r in cell["off"]]  # on PrfaaS, each (checked by _one)
        auto = cell["auto"]
        predicted = next((r for r in auto if r["predicted_transfer_s"] is not None), None)
        table.append({
            "tokens": n,
            "moved_ttft_s": _spread(moved), "recomputed_ttft_s": _spread(recomputed),
            "moved_runs": len(moved), "recomputed_runs": len(recomputed),
            "auto_ttft_s": _spread([r["ttft_s"] for r in auto]),
            "off_ttft_s": _spread(remote), "off_runs": len(remote),
            "next_turn_ttft_s": {mode: _spread([r["next_ttft_s"] for r in cell[mode]]) for mode in MODES},
            "next_turn_routes": {mode: sorted({r["next_route"] for r in cell[mode]}) for mode in MODES},
            "auto_moved": sum(r["moved"] for r in auto), "auto_runs": len(auto),
            "predicted_transfer_s": predicted["predicted_transfer_s"] if predicted else None,
            "predicted_saved_s": predicted["predicted_saved_s"] if predicted else None,
            "predicted_move": bool(predicted and predicted["predicted_transfer_s"] < predicted["predicted_saved_s"]),
            "measured_move_faster": bool(moved and recomputed and statistics.median(moved) < statistics.median(recomputed)),
            "moved_cached_tokens": statistics.median([r["cached_tokens"] for r in cell["always"]]),
        })
    measured = next((r["tokens"] for r in table if r["measured_move_faster"]), None)
    predicted = next((r["tokens"] for r in table if r["predicted_move"]), None)
    return {"rate_gbps": rate, "tbf_mbit": wire_mbit, "speedup": speedup, "lengths": table,
            "crossover_measured_tokens": measured, "crossover_predicted_tokens": predicted,
            "auto_agrees_with_measured": sum((r["auto_moved"] > r["auto_runs"] / 2) == r["measured_move_faster"]
                                             for r in table if r["moved_runs"] and r["recomputed_runs"])}


def _cell(s: dict | None, sp: float) -> str:
    return "—" if s is None else f"{s['median'] * sp:.2f} [{s['min'] * sp:.2f}, {s['max'] * sp:.2f}]"


def _median(s: dict | None, sp: float) -> str:
    return "—" if s is None else f"{s['median'] * sp:.2f}"


def _spread(values: list[float]) -> dict | None:
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def render_markdown(result: dict) -> str:
    lines = []
    for r in result["rates"]:
        sp = r["speedup"]
        lines.append(f"link {r['rate_gbps']:g} Gbps modelled (tbf {r['tbf_mbit']:g} Mbit/s); TTFT in modelled seconds "
                     f"(wall x {sp:g}), median [min, max] of {result['setting']['repeats']}; crossover measured at "
                     f"{r['crossover_measured_tokens']} tokens, predicted at {r['crossover_predicted_tokens']}")
        lines.append("")
        lines.append("| prompt tokens | moved TTFT | recomputed TTFT | auto TTFT (moved / runs) | off: on PrfaaS TTFT | "
                     "predicted transfer vs saved | model says | measured | next turn: moved / recomputed / off |")
        lines.append("|---|---|---|---|---|---|---|---|---|")

        for row in r["lengths"]:
            pred = ("—" if row["predicted_transfer_s"] is None else
                    f"{row['predicted_transfer_s'] * sp:.2f} vs {row['predicted_saved_s'] * sp:.2f} s")
            lines.append(f"| {row['tokens']} | {_cell(row['moved_ttft_s'], sp)} | {_cell(row['recomputed_ttft_s'], sp)} | "
                         f"{_cell(row['auto_ttft_s'], sp)} ({row['auto_moved']} / {row['auto_runs']}) | "
                         f"{_cell(row['off_ttft_s'], sp)} | {pred} | "
                         f"{'move' if row['predicted_move'] else 'recompute'} | "
                         f"{'move' if row['measured_move_faster'] else 'recompute'} faster | "
                         + " / ".join(_median(row["next_turn_ttft_s"][m], sp) for m in ("always", "never", "off")) + " |")
        lines.append("")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rates-gbps", type=CommaList(float), default="2,10,50", help="modelled link rates, comma list")
    parser.add_argument("--lengths", type=CommaList(int), default="8192,16384,32768,65536",
                        help="cached prefix lengths, comma list (tokens)")
    parser.add_argument("--suffix-tokens", type=int, default=512, help="the new turn after the cached prefix")
    parser.add_argument("--repeats", type=int, default=3,
                        help="timed turns per prompt length and router")
    parser.add_argument("--speedup", type=float, default=4.0,
                        help="the emulated engines divide every duration by this")
    parser.add_argument("--seed", type=int, default=0, help="random seed for the prompts")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")


def cli(args: argparse.Namespace, inv: Invocation) -> int:
    from prfaas_sglang.demo.netns import available

    rates, lengths = args.rates_gbps, args.lengths
    if min(rates) <= 0 or min(lengths) < 2 * PAGE or args.suffix_tokens < 1 or args.repeats < 1:
        inv.error(f"rates must be > 0, lengths >= {2 * PAGE}, --suffix-tokens and --repeats >= 1")
    if (why := available()) is not None:
        inv.error(f"the shaped PrfaaS link {why}")
    result = run(rates, lengths, args.suffix_tokens, args.repeats, args.speedup, seed=args.seed)
    return inv.report(args, result, None, render_markdown)


SUBCOMMANDS = {"cache-transfer": Subcommand(add_arguments, cli)}
