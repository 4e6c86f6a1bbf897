"""Router overhead: latency added by the PrfaaS router vs dispatching to the workers directly.

Both modes send the same requests at a fixed rate to one emulated PD-P + PD-D
pair (speedup 1000, so worker time is small): ``direct`` does the PD dispatch
itself (same body with bootstrap fields to both workers, as a router would),
``router`` sends to our router. The two paths take turns at the same rate in
the same window (not one after the other), so drift of a noisy machine hits
both alike. Added latency = router - direct, per percentile, from that run.

``prompt_tokens`` sets the body size (default 16, a pure dispatch cost). With
``prompt="text"`` the body is ``/generate`` text of that many tokens of the
shipped tokenizer, which workers and router load: directly, both workers
tokenize it; through the router, the router tokenizes it once (to route on the
ids) and sends the workers the ids, so its tokenization is part of what it adds.

``peers`` adds paths through PyPI PD routers (``sglang-router``, ``smg``; compiled, in
Rust) over the same two workers, taking turns with the others: what a proxy in the
router's place adds on this machine when its code is not Python. Next to them the
bench can measure what this machine charges for a hop after an idle gap
(:func:`idle_rtt`): a proxy adds two wake-ups per request (the request in, the
answer back) and handles the body once more, and on a virtual machine whose idle
vCPUs halt, the same work costs more after a gap than back to back.

``router_cpu`` pins the router (every thread) to that CPU and everything else (the
workers, the client) to the other CPUs, as a deployment gives the router its own
cores: on a 2-core machine it separates what the router's code and hop cost from
time spent waiting for a core that the client and both workers also want.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import tempfile
import time
from pathlib import Path

import aiohttp
import orjson

from prfaas_sglang.bench.subcommands import Invocation, Subcommand
from prfaas_sglang.demo.cluster import (
    PEER_ROUTERS,
    ProcessGroup,
    start_front,
    start_mock_worker,
    start_peer_router,
    start_router,
)
from prfaas_sglang.demo.workloads import TextSource
from prfaas_sglang.stats import percentile
from prfaas_sglang.tokenizer import SHIPPED, PromptTokenizer
from prfaas_sglang.wire.server_timing import server_timing

PROFILE = "kimi-linear-1t-hybrid@h20x8"
JSON = {"Content-Type": "application/json"}



async def _drive(rate: float, duration_s: float, *senders) -> list[tuple[list[float], int]]:
    """Send at ``rate`` per sender for ``duration_s``, the senders taking turns (one tick each), so
    every path sees the same machine at the same time; returns (latencies, failures) per sender."""
    latencies: list[list[float]] = [[] for _ in senders]
    failures = [0] * len(senders)

    async def one(k: int, i: int):
        start = time.perf_counter()
        ok = await senders[k](i)
        if ok:
            latencies[k].append(time.perf_counter() - start)
        else:
            failures[k] += 1

    tasks = []
    start = time.perf_counter()
    i = 0
    step_rate = rate * len(senders)
    while time.perf_counter() - start < duration_s:
        tasks.append(asyncio.create_task(one(i % len(senders), i)))
        i += 1
        await asyncio.sleep(max(0.0, start + i / step_rate - time.perf_counter()))
    await asyncio.gather(*tasks)
    return [(latencies[k], failures[k]) for k in range(len(senders))]


def _descendants(pid: int) -> list[int]:
    """``pid`` and every live process below it (from /proc's parent links)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        out.append(todo.pop())
        todo.extend(children.get(out[-1], ()))
    return out


ECHO_CHILD = """
import socket, sys, orjson
conn, size, parse = socket.socket(fileno=int(sys.argv[1])), int(sys.argv[2]), sys.argv[3] == "1"
while True:
    buf = b""
    while len(buf) < size:
        data = conn.recv(1 << 20)
        if not data:
            sys.exit(0)
        buf += data
    if parse:
        orjson.loads(buf)
    conn.sendall(b"x")
"""


def idle_rtt(payload: bytes, parse: bool, samples: int, idle_s: float) -> list[float]:
    """Round trips (ms): ``payload`` over a local socket to a child process, which reads it all (and
    parses it with ``orjson`` if ``parse``) and answers one byte. Each holds two wake-ups and, with a
    payload, the work a hop does on a body. ``idle_s`` apart: 0 keeps the CPUs busy; the gap the
    bench's requests leave lets them go idle first, and on a virtual machine an idle vCPU may give
    its core (and caches) away. Blocking: call it outside the event loop."""
    import socket
    import subprocess
    import sys

    mine, theirs = socket.socketpair()
    child = subprocess.Popen([sys.executable, "-c", ECHO_CHILD, str(theirs.fileno()), str(len(payload)), str(int(parse))],
                             pass_fds=[theirs.fileno()])
    theirs.close()
    out: list[float] = []
    try:
        for i in range(samples + 20):  # the first 20 warm up
            if idle_s:
                time.sleep(idle_s)
            start = time.perf_counter()
            mine.sendall(payload)
            if not mine.recv(1):
                raise RuntimeError("the echo child exited")
            if i >= 20:
                out.append((time.perf_counter() - start) * 1e3)
    finally:
        mine.close()
        child.wait(timeout=10)
    return out


def pin(pid: int, cpus: set[int]) -> int:
    """Every thread of ``pid`` and of its descendants onto ``cpus`` (``sched_setaffinity`` applies to one
    thread; threads and processes made later inherit their creator's). Returns how many threads moved."""
    return sum(_pin_threads(proc, cpus) for proc in _descendants(pid))


def _pin_threads(pid: int, cpus: set[int]) -> int:
    """Every thread of ``pid`` alone (not its children) onto ``cpus``; how many moved."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0
    moved = 0
    for tid in tids:
        try:
            os.sched_setaffinity(int(tid), cpus)
            moved += 1
        except (ProcessLookupError, PermissionError):
            pass
    return moved


async def _run(rate: float, duration_s: float, log_dir: Path, prompt_tokens: int, prompt: str, front: bool = False,
               router_cpu: int | None = None, peers: tuple[str, ...] = (), page_size: int | None = None) -> dict:
    group = ProcessGroup(log_dir)
    affinity_before = os.sched_getaffinity(0)
    try:
        extra = ["--speedup", "1000", "--kv-scale", "0.0005", "--context-tokens", str(prompt_tokens + 64)]
        if page_size is not None:
            extra += ["--page-size", str(page_size)]
        if prompt == "text":
            extra += ["--tokenizer", SHIPPED]
        # KV events on: the router's index holds what the workers cache, so a prompt sent again is
        # matched whole (every page hashed and looked up), as a deployment's repeated prefixes are.
        pp = await asyncio.to_thread(start_mock_worker, group, "pd-prefill", "pd-prefill", PROFILE, extra, events=True)
        dd = await asyncio.to_thread(start_mock_worker, group, "pd-decode", "pd-decode", PROFILE, extra, events=True)
        topology = {"version": 1, "emulation": {"speedup": 1000, "kv_scale": 0.0005}, "clusters": {"a": {"kind": "pd", "nodes": [
            {"name": "pp", "role": "pd-prefill", "port": pp.port, "bootstrap_port": pp.bootstrap_port},
            {"name": "dd", "role": "pd-decode", "port": dd.port}]}}}
        if prompt == "text":
            topology["model"] = {"tokenizer": SHIPPED}
        router = await asyncio.to_thread(start_router, group, topology, "--threshold", "1000000")
        router_url = router.url
        front_url = await asyncio.to_thread(start_front, group, router_url) if front else None
        # One prefill and one decode: a policy has nothing to choose, so the cheapest (round_robin) is
        # each peer's strongest setting for this measurement.
        peer_urls = {kind: await asyncio.to_thread(start_peer_router, group, kind, [pp], [dd], prefill_policy="round_robin",
                                                   decode_policy="round_robin") for kind in peers}
        if router_cpu is not None:
            rest = affinity_before - {router_cpu}
            for proc in group.procs:
                pin(proc.pid, rest)
            pin(router.proc.pid, {router_cpu})  # after the group: the router is one of its processes
            _pin_threads(os.getpid(), rest)  # the client: this process, not its children
        rng = random.Random(11)
        if prompt == "text":
            body = {"text": TextSource(PromptTokenizer.load(SHIPPED)).text(rng, prompt_tokens)}
        else:
            body = {"input_ids": [rng.randrange(4096) for _ in range(prompt_tokens)]}
        body["sampling_params"] = {"max_new_tokens": 1}
        rooms = random.Random(7)
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=512)) as session:

            # Bodies are serialised once, up front, so both paths cost the client the same.
            raw = orjson.dumps(body)
            head = raw[:-1] + b',"bootstrap_host":"127.0.0.1","bootstrap_port":%d,"bootstrap_room":' % pp.bootstrap_port

            async def direct(i: int) -> bool:
                out = head + b"%d}" % rooms.getrandbits(63)

                async def post(url):
                    async with session.post(url, data=out, headers=JSON) as resp:
                        await resp.read()
                        return resp.status

                statuses = await asyncio.gather(post(pp.url + "/generate"), post(dd.url + "/generate"))
                return statuses == [200, 200]

            own: dict[str, list[float]] = {"parse": [], "route": []}
            paired: list[float] = []  # per request: the client's wait minus the router's legs (ms)

            async def via_router(i: int) -> bool:
                start = time.perf_counter()
                async with session.post(router_url + "/generate", data=raw, headers=JSON) as resp:
                    await resp.read()
                    waited_ms = (time.perf_counter() - start) * 1e3
                    timings = server_timing(resp.headers.get("Server-Timing", ""))
                    for name, ms in timings.items():
                        if name != "ttft-estimate":  # a prediction, not time the router spent
                            own.setdefault(name, []).append(ms)
                    if resp.status == 200 and "legs" in timings:
                        paired.append(waited_ms - timings["legs"])
                    return resp.status == 200

            def via(url: str):
                """The client's body as is, to another proxy (a peer router, the front)."""
                async def send(i: int) -> bool:
                    async with session.post(url + "/generate", data=raw, headers=JSON) as resp:
                        await resp.read()
                        return resp.status == 200
                return send

            senders = (direct, via_router, *(via(url) for url in peer_urls.values()), *((via(front_url),) if front else ()))
            await _drive(rate, 1.0, *senders)  # warm every path
            for values in (*own.values(), paired):
                values.clear()
            (d_lat, d_fail), (r_lat, r_fail), *others = await _drive(rate, duration_s, *senders)
            peered, fronted = others[:len(peer_urls)], others[len(peer_urls):]
    finally:
        group.stop()
        _pin_threads(os.getpid(), affinity_before)
    extra = {"router_cpu": router_cpu, "page_size": page_size}
    if peered:
        extra["peers"] = {kind: {**_path(lat, fail), **{f"added_{k}": v for k, v in _added(lat, d_lat).items()}}
                          for kind, (lat, fail) in zip(peer_urls, peered, strict=True)}
    if fronted:
        f_lat, f_fail = fronted[0]
        extra |= {"front": _path(f_lat, f_fail), **{f"front_added_{k}": v for k, v in _added(f_lat, r_lat).items()}}
    return {**extra,
        "rate_rps": rate, "duration_s": duration_s, "prompt_tokens": prompt_tokens, "prompt": prompt,
        "direct": _path(d_lat, d_fail), "router": _path(r_lat, r_fail),
        **{f"added_{k}": v for k, v in _added(r_lat, d_lat).items()},
        # The router's own time before the legs, from its Server-Timing header: the part of the
        # added latency that is its code, apart from the extra hop of the body and the reply.
        "router_own_ms": {name: {"p50": percentile(v, 0.5), "p99": percentile(v, 0.99)}
                          for name, v in own.items() if v and name != "legs"},
        # Per request, paired: the client's wait through the router minus that request's legs as the
        # router timed them (its Server-Timing ``legs``): the hop of the body into the router, its
        # parse and route, and the reply relayed back. Unlike ``added_*`` (a difference of two
        # independent distributions' percentiles) this is a percentile of the added time itself.
        # ``legs_ms`` next to ``direct`` shows the legs through the router cost what they cost the
        # client dispatching itself, so nothing the router does is hidden inside them.
        "added_per_request_ms": {"p50": percentile(paired, 0.5), "p99": percentile(paired, 0.99),
                                 "max": max(paired)} if paired else None,
        "legs_ms": {"p50": percentile(own["legs"], 0.5), "p99": percentile(own["legs"], 0.99)} if own.get("legs") else None,
    }


GC_PROBE = """
import gc, json, statistics, sys, time
import prfaas_sglang.router.__main__, prfaas_sglang.router.server  # what a router process imports
from prfaas_sglang.procgc import freeze_startup_objects
held = None
if sys.argv[1]:
    from prfaas_sglang.tokenizer import PromptTokenizer
    held = PromptTokenizer.load(sys.argv[1])
def pause_ms(n):
    out = []
    for _ in range(n):
        start = time.perf_counter()
        gc.collect()
        out.append((time.perf_counter() - start) * 1e3)
    return statistics.median(out)
n = int(sys.argv[2])
before = {"full_collection_ms": pause_ms(n), "tracked_objects": len(gc.get_objects())}
frozen = freeze_startup_objects()
after = {"full_collection_ms": pause_ms(n), "tracked_objects": len(gc.get_objects())}
print(json.dumps({"before": before, "after": after, "frozen_objects": frozen}))
"""


def gc_pause(tokenizer: str | None = SHIPPED, collections: int = 7) -> dict:
    """A full collection's pause (median of ``collections``) in a fresh process holding what a router
    holds (its modules, and ``tokenizer`` loaded unless None), before and after
    :func:`~prfaas_sglang.procgc.freeze_startup_objects`, as the router calls it before serving."""
    import json
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", GC_PROBE, tokenizer or "", str(collections)], capture_output=True,
                          text=True, timeout=300, check=True)
    return {"tokenizer": tokenizer, **json.loads(proc.stdout.strip().splitlines()[-1])}


def render_gc(r: dict) -> str:
    b, a = r["before"], r["after"]
    return "\n".join([
        f"router process{' with its tokenizer' if r['tokenizer'] else ''}: full collection, objects tracked",
        "", "| | full collection (median) | objects the collector tracks |", "|---|---|---|",
        f"| as started | {b['full_collection_ms']:.2f} ms | {b['tracked_objects']:,} |",
        f"| after freeze_startup_objects() | {a['full_collection_ms']:.2f} ms | {a['tracked_objects']:,} "
        f"({r['frozen_objects']:,} frozen) |",
    ])


def _path(latencies_s: list[float], failed: int) -> dict:
    """One path's requests, failures and p50 / p99 (ms)."""
    return {"requests": len(latencies_s), "failed": failed, "p50_ms": percentile(latencies_s, 0.5) * 1e3,
            "p99_ms": percentile(latencies_s, 0.99) * 1e3}


def _added(path_s: list[float], base_s: list[float]) -> dict:
    """``path`` minus ``base`` per percentile (ms): ``p50_ms``, ``p99_ms``."""
    return {f"p{q}_ms": (percentile(path_s, q / 100) - percentile(base_s, q / 100)) * 1e3 for q in (50, 99)}




def router_cpu_problem(cpu: int) -> str | None:
    """None when the router can have ``cpu`` to itself with at least one CPU left for the rest, else why not."""
    allowed = os.sched_getaffinity(0)
    if cpu not in allowed:
        return f"CPU {cpu} is not one this process may run on ({sorted(allowed)})"
    if not allowed - {cpu}:
        return f"pinning the router to CPU {cpu} leaves no other CPU for the workers and the client"
    return None


def run(rate: float = 200.0, duration_s: float = 10.0, prompt_tokens: int = 16, prompt: str = "ids", front: bool = False,
        router_cpu: int | None = None, peers: tuple[str, ...] = (), wakeup_samples: int = 0,
        page_size: int | None = None) -> dict:
    """``front``: a path through the router's front (router/front.py) to the same router.
    ``peers``: a path through each of these PyPI routers (keys of ``PEER_ROUTERS``).
    ``router_cpu``: the router alone on that CPU, the rest on the others (ValueError if that leaves none).
    ``page_size``: the workers' page size (None: the emulated engine's default, 512); SGLang runs
    Kimi Linear at 1, a block per token for the router's index to hash and look up.
    ``wakeup_samples``: also measure :func:`idle_rtt` (one byte; the body, parsed) back to back and
    after the gap the bench's paths leave between requests, this many round trips each (``wakeup``)."""
    if router_cpu is not None and (why := router_cpu_problem(router_cpu)):
        raise ValueError(why)
    if unknown := set(peers) - set(PEER_ROUTERS):
        raise ValueError(f"unknown peer routers {sorted(unknown)}; choose from {', '.join(PEER_ROUTERS)}")
    with tempfile.TemporaryDirectory(prefix="prfaas-overhead-") as tmp:
        result = asyncio.run(_run(rate, duration_s, Path(tmp), prompt_tokens, prompt, front, router_cpu, tuple(peers),
                                  page_size))
    if wakeup_samples:
        gap_s = 1.0 / (rate * (2 + len(peers) + int(front)))  # between one request and the next, any path
        body = orjson.dumps({"input_ids": [random.Random(11).randrange(4096) for _ in range(prompt_tokens)]})
        result["wakeup"] = {"gap_s": gap_s, "body_bytes": len(body)}
        for name, payload, parse in (("byte", b"x", False), ("body_parsed", body, True)):
            for when, idle_s in (("busy", 0.0), ("after_gap", gap_s)):
                v = idle_rtt(payload, parse, wakeup_samples, idle_s)
                result["wakeup"][f"{name}_{when}_ms"] = {"p50": percentile(v, 0.5), "p99": percentile(v, 0.99)}
    return result


def render_markdown(r: dict) -> str:
    """One table per prompt kind (``{"ids": ..., "text": ...}``) or for one result (``router-gc``'s too)."""
    if "frozen_objects" in r:
        return render_gc(r)
    if "router" not in r:
        return "\n\n".join(f"{kind} prompt of {x['prompt_tokens']:,} tokens at {x['rate_rps']:g} req/s:\n\n" + render_markdown(x)
                            for kind, x in r.items())
    d, o = r["direct"], r["router"]
    return "\n".join([
        "| path | requests | failed | p50 | p99 |", "|---|---|---|---|---|",
        f"| direct (client does PD dispatch) | {d['requests']} | {d['failed']} | {d['p50_ms']:.2f} ms | {d['p99_ms']:.2f} ms |",
        f"| through the PrfaaS router | {o['requests']} | {o['failed']} | {o['p50_ms']:.2f} ms | {o['p99_ms']:.2f} ms |",
        f"| **added by the router** | | | **{r['added_p50_ms']:.2f} ms** | **{r['added_p99_ms']:.2f} ms** |",
        *(f"| router's own: {name} (Server-Timing) | | | {v['p50']:.2f} ms | {v['p99']:.2f} ms |"
          for name, v in r.get("router_own_ms", {}).items()),
        *([f"| legs through the router (Server-Timing) | | | {r['legs_ms']['p50']:.2f} ms | {r['legs_ms']['p99']:.2f} ms |"]
          if r.get("legs_ms") else []),
        *([f"| **added per request (wait - legs)** | | | **{r['added_per_request_ms']['p50']:.2f} ms** | "
           f"**{r['added_per_request_ms']['p99']:.2f} ms** |"] if r.get("added_per_request_ms") else []),
        *(f"| through {kind} (compiled peer) | {v['requests']} | {v['failed']} | {v['p50_ms']:.2f} ms | {v['p99_ms']:.2f} ms |\n"
          f"| **added by {kind}** | | | **{v['added_p50_ms']:.2f} ms** | **{v['added_p99_ms']:.2f} ms** |"
          for kind, v in r.get("peers", {}).items()),
        *(f"| machine: a local round trip, {what}, back to back / after a {r['wakeup']['gap_s'] * 1e3:.0f} ms gap | | | "
          f"{r['wakeup'][f'{key}_busy_ms']['p50']:.2f} / {r['wakeup'][f'{key}_after_gap_ms']['p50']:.2f} ms | "
          f"{r['wakeup'][f'{key}_busy_ms']['p99']:.2f} / {r['wakeup'][f'{key}_after_gap_ms']['p99']:.2f} ms |"
          for key, what in (("byte", "one byte"), ("body_parsed", "the body, parsed (orjson)")) if r.get("wakeup")),
        *([f"| through the front, then the router | {r['front']['requests']} | {r['front']['failed']} | "
           f"{r['front']['p50_ms']:.2f} ms | {r['front']['p99_ms']:.2f} ms |",
           f"| **added by the front (front - router)** | | | **{r['front_added_p50_ms']:.2f} ms** | "
           f"**{r['front_added_p99_ms']:.2f} ms** |"] if r.get("front") else []),
    ])


def add_overhead_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rate", type=float, default=None, help="requests/s (default: 200, or 5 for prompts over 1K tokens)")
    parser.add_argument("--duration", type=float, default=10.0,
                        help="load window, seconds (the paths take turns within it)")
    parser.add_argument("--prompt-tokens", type=int, default=16,
                        help="prompt length, tokens (over 1,024: --rate 5 and --prompt both "
                             "by default)")
    parser.add_argument("--prompt", choices=("ids", "text", "both"), default=None,
                        help="input_ids, /generate text, or both (default: ids, or both for prompts over 1K tokens)")
    parser.add_argument("--front", action="store_true", help="also a path through the router's front (router/front.py)")
    parser.add_argument("--peers", default="", help="comma list of PyPI PD routers to route the same requests too "
                                                    "(sglang-router, smg): what a compiled proxy adds on this machine")
    parser.add_argument("--page-size", type=int, default=None,
                        help="the workers' page size (default: the emulated engine's 512; SGLang runs Kimi Linear at 1)")
    parser.add_argument("--wakeup-samples", type=int, default=0,
                        help="also measure this machine's cost of waking a process, this many round trips (0: not)")
    parser.add_argument("--router-cpu", type=int, default=None,
                        help="pin the router to this CPU and the workers and client to the others (its own core, as deployed)")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")


def overhead_cli(args: argparse.Namespace, inv: Invocation) -> int:
    long = args.prompt_tokens > 1024
    rate = args.rate or (5.0 if long else 200.0)
    kinds = {"both": ("ids", "text"), None: ("ids", "text") if long else ("ids",)}.get(args.prompt, (args.prompt,))
    if args.prompt_tokens < 1 or rate <= 0:
        inv.error("--prompt-tokens must be >= 1 and --rate > 0")
    if args.router_cpu is not None and (why := router_cpu_problem(args.router_cpu)):
        inv.error(f"--router-cpu: {why}")
    peers = tuple(p for p in args.peers.split(",") if p)
    if unknown := set(peers) - set(PEER_ROUTERS):
        inv.error(f"--peers: unknown {sorted(unknown)}; choose from {', '.join(PEER_ROUTERS)}")
    if args.wakeup_samples < 0:
        inv.error("--wakeup-samples must be >= 0")
    if args.page_size is not None and args.page_size < 1:
        inv.error("--page-size must be >= 1")
    result = {kind: run(rate, args.duration, args.prompt_tokens, kind, front=args.front, router_cpu=args.router_cpu,
                        peers=peers, wakeup_samples=args.wakeup_samples, page_size=args.page_size) for kind in kinds}
    result = result[kinds[0]] if len(kinds) == 1 else result
    return inv.report(args, result, None, render_markdown)


def add_gc_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--no-tokenizer", action="store_true", help="without the shipped tokenizer loaded")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")


def gc_cli(args: argparse.Namespace, inv: Invocation) -> int:
    result = gc_pause(None if args.no_tokenizer else SHIPPED)
    return inv.report(args, result, None, render_markdown)


SUBCOMMANDS = {"router-overhead": Subcommand(add_overhead_arguments, overhead_cli),
               "router-gc": Subcommand(add_gc_arguments, gc_cli)}
