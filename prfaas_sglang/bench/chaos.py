"""``python -m prfaas_sglang.bench chaos``: a bounded mixed load on an emulated two-cluster deployment
while faults are injected at seeded times (issue #16 item 5). Root: the PrfaaS worker sits in a
network namespace, so its link can be black-holed and throttled.

Deployment: PrfaaS (own namespace, veth) + PD-P + PD-D + router, every node through the launcher.
Load: ``rate`` requests/s, half short (PD path), half long (PrfaaS path), half streamed, each
with a client deadline of ``hung_after_s``.

Faults, one at a time, evenly spread over the run (a fault that overruns its slot delays the next); each round injects every fault once, in a
seeded order:

* ``kill-<node>``: ``kill -9`` of a worker (PrfaaS, PD-P, PD-D) or of the router, restarted
  after ``down_s``; the fault ends when the new process answers ``/health``;
* ``zmq-garbage``: PD-P killed and its KV-event port taken by a publisher of malformed frames
  (random bytes, truncated batches, wrong topic) for ``down_s``, then PD-P restarted;
* ``link-blackhole``: the PrfaaS veth down for ``4 * down_s`` (every packet lost; long enough
  for the router to see the telemetry go silent and route around the PrfaaS worker);
* ``link-throttle``: the PrfaaS link at 1/10 of its rate for ``2 * down_s``;
* ``http-fuzz``: ``fuzz_requests`` malformed HTTP requests (bad JSON, wrong types, absurd
  sizes, bad headers) sent to the router alongside the load;
* ``tunnel-down`` (with ``--encrypt``: the link is ``encrypt: true`` and each side's host holds its
  WireGuard tunnel, ``adapters/wireguard.py``): the PrfaaS side's tunnel interface removed for
  ``4 * down_s`` (its routes fail closed: nothing to the other side leaves, in clear or at all), then
  brought up again.

Every request is classified: ``ok``; ``error`` (an HTTP error with a JSON message, or a stream
that ends with an error event); ``reset`` (the connection broke: counted apart, and expected
only while the router itself is down); ``truncated`` (a stream that ended cleanly without
``[DONE]`` or an error event); ``hung`` (no end within the deadline). After the load: leaked
rooms and KV bytes per worker (its metrics, idle), time to recover after each fault (until
every worker is healthy in the router's view and a probe on each path succeeds), and the
router's RSS over time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import signal
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from prfaas_sglang.bench.subcommands import Invocation, Subcommand

DEADLINE_S = 60.0
PROBE_INTERVAL_S = 0.25
CONTEXT_TOKENS = 32_768  # every engine's --context-tokens: a prompt plus its output beyond it is refused (400)
MAX_OUTPUT_TOKENS = 11  # _body's largest max_new_tokens
LONG_PROBE_MAX_TOKENS = CONTEXT_TOKENS - MAX_OUTPUT_TOKENS  # a recovery check's long probe: above the threshold, never above this
BOOTSTRAP_TIMEOUT_S = 10.0  # the workers' (--bootstrap-timeout-s): how long an unclaimed room may stay open
FAULTS = ("kill-pd-decode-0", "kill-pd-prefill-0", "kill-prfaas-0", "kill-router", "zmq-garbage",
          "link-blackhole", "link-throttle", "http-fuzz")
ENCRYPTED_FAULTS = ("tunnel-down",)  # with --encrypt only


@dataclass
class Tally:
    sent: int = 0
    ok: int = 0
    error: int = 0
    reset: int = 0
    reset_outside_router_faults: int = 0
    truncated: int = 0
    hung: int = 0
    untyped_errors: list = field(default_factory=list)
    errors_by_status: dict = field(default_factory=dict)

    def add(self, kind: str, status: int | None = None, detail: str | None = None, router_down: bool = False) -> None:
        setattr(self, kind, getattr(self, kind) + 1)
        if kind == "error":
            self.errors_by_status[str(status)] = self.errors_by_status.get(str(status), 0) + 1
            if detail is not None and len(self.untyped_errors) < 10:
                self.untyped_errors.append(detail)
        if kind == "reset" and not router_down:
            self.reset_outside_router_faults += 1


def _body(rng: random.Random, long: bool, stream: bool, k: int, min_tokens: int = 0) -> dict:
    n = max(rng.randrange(9000, 14000) if long else rng.randrange(600, 2500), min_tokens)
    base = rng.randrange(4096)
    ids = [(base + k * 7919 + i * 40503) % 4096 for i in range(n)]
    return {"input_ids": ids, "sampling_params": {"max_new_tokens": rng.randrange(2, MAX_OUTPUT_TOKENS + 1)}, "stream": stream}


def _typed(text: str) -> bool:
    try:
        err = json.loads(text).get("error")
    except (ValueError, AttributeError):
        return False
    message = err.get("message") if isinstance(err, dict) else err
    return isinstance(message, str) and bool(message.strip())


async def _one(session, url: str, body: dict, tally: Tally, state: dict) -> None:
    import aiohttp

    tally.sent += 1
    try:
        async with asyncio.timeout(DEADLINE_S):
            async with session.post(url + "/generate", json=body) as resp:
                if not body["stream"] or resp.status != 200:
                    text = await resp.text()
                    if resp.status == 200:
                        tally.add("ok")
                    else:
                        tally.add("error", resp.status, None if _typed(text) else f"{resp.status}: {text[:120]}")
                    return
                done = errored = False
                async for line in resp.content:
                    line = line.strip()
                    if line == b"data: [DONE]":
                        done = True
                    elif line.startswith(b"data: ") and b'"error"' in line:
                        errored = True
                if errored:
                    tally.add("error", 200)
                elif done:
                    tally.add("ok")
                else:
                    tally.add("truncated")
    except TimeoutError:
        tally.add("hung")
    except (aiohttp.ClientError, ConnectionError):
        tally.add("reset", router_down=state["router_down"])


async def _load(url: str, rate: float, duration_s: float, seed: int, tally: Tally, state: dict) -> None:
    import aiohttp

    rng = random.Random(seed)
    tasks = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
        start = time.monotonic()
        k = 0
        while time.monotonic() - start < duration_s:
            tasks.append(asyncio.create_task(_one(session, url, _body(rng, k % 2 == 0, (k // 2) % 2 == 0, k), tally, state)))
            k += 1
            await asyncio.sleep(rng.expovariate(rate))
        await asyncio.gather(*tasks)


FUZZ_BODIES = (b"", b"{", b"[]", b"null", b'{"input_ids": "x"}', b'{"input_ids": [-1]}', b'{"input_ids": [1e99]}',
               b'{"text": 5}', b'{"input_ids": [4294967296]}', b'{"sampling_params": {"max_new_tokens": -3}, "text": "a"}',
               b'{"input_ids": [1,2,3], "bootstrap_host": "10.1.1.1"}', b'{"messages": [{"role": 7}]}',
               b'\xff\xfe\x00garbage', b'[' * 2000, b'{"rid": "a\\u0000b", "input_ids": [1]}',
               b'{"input_ids": [' + b"1," * 5000 + b'1], "stream": "yes"}')


async def _fuzz(url: str, n: int, seed: int) -> dict:
    """Malformed requests to every router path; returns counts by status (5xx are findings)."""
    import aiohttp

    rng = random.Random(seed)
    statuses: dict[str, int] = {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        for _ in range(n):
            path = rng.choice(["/generate", "/v1/completions", "/v1/chat/completions", "/admin/threshold", "/status?x=%ff"])
            body = rng.choice(FUZZ_BODIES) if rng.random() < 0.8 else bytes(rng.randrange(256) for _ in range(rng.randrange(1, 300)))
            headers = rng.choice([{"Content-Type": "application/json"}, {"Content-Type": "application/json; charset=bogus"},
                                  {"Content-Type": "text/plain"}, {"Transfer-Encoding": "chunked"}])
            try:
                async with session.request("GET" if "status" in path else "POST", url + path, data=body, headers=headers) as resp:
                    await resp.read()
                    key = str(resp.status)
            except (aiohttp.ClientError, TimeoutError) as err:
                key = type(err).__name__
            statuses[key] = statuses.get(key, 0) + 1
    return statuses


async def _garbage(port: int, host: str, seconds: float, seed: int) -> int:
    """Bind ``host:port`` (a killed worker's KV-event port) and publish malformed frames there."""
    import zmq
    import zmq.asyncio

    rng = random.Random(seed)
    sock = zmq.asyncio.Context.instance().socket(zmq.PUB)
    sock.bind(f"tcp://{host}:{port}")
    sent = 0
    try:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            frames = rng.choice([
                [b"kv-events", (sent).to_bytes(8, "big"), bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64)))],
                [b"kv-events", b"short"], [b"kv-events"], [b"kv-events.evil", b"\x00" * 8, b"\x93\x00\x90\xc0"],
                [b"kv-events", b"\x00" * 8, b"\x93\xcb" + b"\x7f\xf8" + b"\x00" * 6 + b"\x91\x92\x00\x00\x00"],
            ])
            await sock.send_multipart(frames)
            sent += 1
            await asyncio.sleep(0.02)
    finally:
        sock.close(linger=0)
    return sent


class Chaos:
    """The deployment, its processes' argv for restarts, and the fault actions."""

    def __init__(self, group, deployment, config: Path, net, engine_args: dict, router_args: tuple[str, ...],
                 front_url: str | None = None, tunnels: list | None = None):
        self.group, self.d, self.config, self.net = group, deployment, config, net
        self.tunnels = tunnels or []  # with --encrypt: [the PrfaaS side's, the other side's]
        self.engine_args, self.router_args = engine_args, router_args
        self.procs = {p.name: p for p in group.procs}
        self.url = front_url or deployment.router.url  # where clients send: the front, when one runs

    def kill(self, name: str) -> None:
        proc = self.procs[name]
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()

    async def restart(self, name: str) -> None:
        """Start a killed process again with the argv and environment it first had (the router keeps
        its admin token and flags, a PrfaaS worker its network namespace)."""
        proc = self.group.restart(name)
        url = self.d.router.url if name == "router" else self.d.workers[name].url
        self.procs[name] = proc
        await asyncio.to_thread(self.group.wait_healthy, url + "/health", proc, 90)


async def _status(session, url: str) -> dict:
    async with session.get(url + "/status") as resp:
        return await resp.json()


def _why(status: dict) -> str:
    """What the router last decided and on what (the threshold, the link estimate), for a probe that failed."""
    ctl, recent = status.get("controller") or {}, status.get("recent") or [{}]
    est, nominal = ctl.get("capacity_est_bps"), ctl.get("nominal_bps")
    link = f", link estimate {est / nominal:.3f} of nominal" if est and nominal else ""
    return f" (t {status.get('threshold_tokens')}{link}; last route: {recent[-1].get('reason')})"


async def _recovered(session, url: str, since: float, limit_s: float = 60.0) -> tuple[float | None, str | None]:
    """Seconds from ``since`` until every worker is healthy and a probe on each path succeeds, or
    ``None`` and what the last probe saw when ``limit_s`` passes first. The long probe is longer than
    the router's threshold as it stands (at most :data:`LONG_PROBE_MAX_TOKENS`, what the engines' context accepts: a
    fresh run once waited its 60 s on 400s for a 34K-token probe with t at 31K, 2026-12-02): after a link fault the
    link's estimate may stay below nominal, and the threshold raised with it (a lightly used link's drop
    leaves it at half of nominal, and only samples above 1.4x that raise it again), so what the PrfaaS
    path must carry again is what the router offloads (a fresh run once saw t at 14,336 and 12.5K-token probes
    routed to PD, rightly, for the rest of the check)."""
    rng = random.Random(int(since * 1000))
    last = "no probe answered"
    while time.monotonic() - since < limit_s:
        try:
            status = await _status(session, url)
            unhealthy = sorted(n for n, w in status["workers"].items() if not w["healthy"])
            last = f"unhealthy {unhealthy}, link down {status.get('link_down_workers')}"
            if not unhealthy and not status.get("link_down_workers"):
                answers, seen = [], []
                threshold = status.get("threshold_tokens") or 0
                above_t = min(math.ceil(1.1 * threshold), LONG_PROBE_MAX_TOKENS)  # a longer one is refused (400)
                if above_t <= threshold:
                    last = (f"threshold {threshold} tokens: no prompt the engines accept (at most {LONG_PROBE_MAX_TOKENS}) "
                            f"is offloaded{_why(status)}")
                    await asyncio.sleep(PROBE_INTERVAL_S)
                    continue
                for long in (False, True):
                    body = _body(rng, long, False, rng.randrange(10**6), above_t if long else 0)
                    async with session.post(url + "/generate", json=body) as resp:
                        route = resp.headers.get("x-prfaas-route", "")
                        answers.append(resp.status == 200 and route.startswith("prfaas/" if long else "pd/"))
                        seen.append(f"{'long' if long else 'short'} probe: {resp.status} routed {route or None}")
                last = ", ".join(seen)
                if all(answers):
                    return time.monotonic() - since, None
                last += _why(await _status(session, url))
        except Exception as exc:  # noqa: BLE001 - the router may be restarting
            last = f"{type(exc).__name__}: {exc}"
        await asyncio.sleep(PROBE_INTERVAL_S)
    return None, last


async def _inject(chaos: Chaos, fault: str, down_s: float, seed: int, state: dict, fuzz_requests: int, rate_mbit: float) -> dict:
    record: dict = {"fault": fault, "started_s": time.monotonic() - state["t0"]}
    if fault.startswith("kill-"):
        name = fault.removeprefix("kill-")
        state["router_down"] = name == "router"
        chaos.kill(name)
        await asyncio.sleep(down_s)
        await chaos.restart(name)
        state["router_down"] = False
    elif fault == "zmq-garbage":
        w = chaos.d.worker("pd-prefill")
        chaos.kill(w.name)
        await asyncio.sleep(0.2)
        record["garbage_frames"] = await _garbage(w.kv_events_port, "127.0.0.1", down_s, seed)
        await chaos.restart(w.name)
    elif fault == "link-blackhole":
        import subprocess

        subprocess.run(["ip", "link", "set", chaos.net.outer, "down"], check=True, capture_output=True)
        await asyncio.sleep(4 * down_s)
        subprocess.run(["ip", "link", "set", chaos.net.outer, "up"], check=True, capture_output=True)
    elif fault == "tunnel-down":
        chaos.tunnels[0].take_down_interface()
        await asyncio.sleep(4 * down_s)
        await asyncio.to_thread(chaos.tunnels[0].up)
    elif fault == "link-throttle":
        chaos.net.throttle(rate_mbit / 10)
        await asyncio.sleep(2 * down_s)
        chaos.net.throttle(rate_mbit)
    elif fault == "http-fuzz":
        record["statuses"] = await _fuzz(chaos.url, fuzz_requests, seed)
    record["ended_s"] = time.monotonic() - state["t0"]
    return record


async def _paths(chaos: Chaos, changes: list, state: dict, stop: asyncio.Event) -> None:
    """With --encrypt: each side's route to the other (``ip route get``), every 0.25 s; ``changes`` gets
    ``[seconds, side, route]`` whenever one differs from its last (evidence for a stray on the link)."""
    import subprocess

    sides = {"pd": ((), chaos.net.inner_ip), "prfaas": (chaos.net.wrap, chaos.net.outer_ip)}
    last: dict[str, str] = {}
    while not stop.is_set():
        for side, (wrap, peer) in sides.items():
            proc = await asyncio.to_thread(subprocess.run, [*wrap, "ip", "route", "get", peer], capture_output=True,
                                           text=True)
            route = " ".join((proc.stdout or proc.stderr).split()[:6])
            if last.get(side) != route:
                last[side] = route
                changes.append([round(time.monotonic() - state["t0"], 2), side, route])
        await asyncio.sleep(0.25)


async def _rss(pid_of, samples: list, state: dict, stop: asyncio.Event) -> None:
    import psutil

    while not stop.is_set():
        try:
            pid = pid_of()
            samples.append((time.monotonic() - state["t0"], pid, psutil.Process(pid).memory_info().rss))
        except Exception:  # noqa: BLE001 - between a kill and its restart
            pass
        await asyncio.sleep(1.0)


async def _experiment(chaos: Chaos, duration_s: float, rate: float, seed: int, down_s: float, fuzz_requests: int,
                      rate_mbit: float, faults: tuple[str, ...], rounds: int) -> dict:
    import aiohttp

    url = chaos.url
    state = {"t0": time.monotonic(), "t0_unix_s": time.time(), "router_down": False}
    tally, records, rss = Tally(), [], []
    stop = asyncio.Event()
    order = []
    for r in range(rounds):  # every fault once per round, in a seeded order
        batch = list(faults)
        random.Random(seed * 1000 + r).shuffle(batch)
        order += batch
    load = asyncio.create_task(_load(url, rate, duration_s, seed, tally, state))
    sampler = asyncio.create_task(_rss(lambda: chaos.procs["router"].pid, rss, state, stop))
    path_changes: list = []
    paths = asyncio.create_task(_paths(chaos, path_changes, state, stop)) if chaos.tunnels else None
    slot = duration_s * 0.8 / max(len(order), 1)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as session:
        for i, fault in enumerate(order):
            start_at = duration_s * 0.1 + i * slot
            await asyncio.sleep(max(start_at - (time.monotonic() - state["t0"]), 0))
            record = await _inject(chaos, fault, down_s, seed + i, state, fuzz_requests, rate_mbit)
            record["recovery_s"], record["not_recovered_because"] = await _recovered(
                session, url, state["t0"] + record["ended_s"])
            records.append(record)
        await load
        leaks, rest_s = await _at_rest(session, chaos, state)
        front_counters = None
        if url != chaos.d.router.url:
            async with session.get(url + "/front/health") as resp:
                front_counters = await resp.json()
    stop.set()
    await sampler
    if paths is not None:
        await paths
    return {"tally": vars(tally), "faults": records, "leaks": leaks, "router_rss": _rss_summary(rss),
            "duration_s": duration_s, "rate_rps": rate, "seed": seed, "rounds": rounds, "down_s": down_s,
            "front": url != chaos.d.router.url, "front_counters": front_counters, "t0_unix_s": state["t0_unix_s"],
            "path_changes": path_changes, "rest_s": rest_s}


async def _at_rest(session, chaos: Chaos, state: dict) -> tuple[dict, float]:
    """What each worker holds once the load and every fault are over (:func:`_leak_view`), and when (s after
    the experiment's start). A room whose request was moved away while its worker sat behind a fault (a tunnel
    down: the router's close cannot reach it) is freed by the worker's bootstrap timeout or by the close's
    retransmission once the path is back, so the workers get up to :data:`BOOTSTRAP_TIMEOUT_S` and 5 s more
    to drain, polled; whatever is held after that is a leak."""
    await asyncio.sleep(3.0)  # let the last finished requests release what they held
    deadline = time.monotonic() + BOOTSTRAP_TIMEOUT_S + 5.0
    while True:
        leaks = {}
        for name, w in chaos.d.workers.items():
            async with session.get(w.url + "/metrics") as resp:
                leaks[name] = _leak_view(await resp.text())
        held = any(v.get("prfaas:open_rooms") or v.get("prfaas:kv_pool_used_tokens") or v.get("leaked_kv_bytes")
                   for v in leaks.values())
        if not held or time.monotonic() >= deadline:
            return leaks, round(time.monotonic() - state["t0"], 2)
        await asyncio.sleep(0.5)


def _leak_view(metrics: str) -> dict:
    """What a worker holds at rest: open rooms, KV-pool tokens, landing-buffer bytes not free."""
    vals = {}
    for line in metrics.splitlines():
        if line.startswith(("prfaas:open_rooms", "prfaas:kv_buffer_free_bytes", "prfaas:kv_buffer_total_bytes",
                            "prfaas:kv_pool_used_tokens", "sglang:num_running_reqs", "sglang:num_queue_reqs")):
            vals[line.split("{", 1)[0]] = float(line.rsplit(" ", 1)[1])
    vals["leaked_kv_bytes"] = vals.get("prfaas:kv_buffer_total_bytes", 0) - vals.get("prfaas:kv_buffer_free_bytes", 0)
    return vals


def _rss_summary(samples: list) -> dict:
    """Per router process: RSS after its first 20 s and at its end; growth of the longest-lived."""
    by_pid: dict[int, list] = {}
    for t, pid, rss in samples:
        by_pid.setdefault(pid, []).append((t, rss))
    out = []
    for pid, series in by_pid.items():
        warm = next((rss for t, rss in series if t - series[0][0] >= 20), series[0][1])
        out.append({"pid": pid, "lived_s": series[-1][0] - series[0][0], "rss_warm_mb": warm / 2**20,
                    "rss_end_mb": series[-1][1] / 2**20, "growth": series[-1][1] / warm - 1, "max_mb": max(r for _, r in series) / 2**20})
    longest = max(out, key=lambda s: s["lived_s"]) if out else None
    return {"processes": out, "growth_longest_lived": longest["growth"] if longest else None,
            "series_mb": [(round(t, 1), round(rss / 2**20, 1)) for t, _pid, rss in samples[:: max(len(samples) // 120, 1)]]}


def run(duration_s: float = 60.0, rate: float = 2.0, seed: int = 0, down_s: float = 3.0, fuzz_requests: int = 200,
        rate_mbit: float = 400.0, faults: tuple[str, ...] = FAULTS, rounds: int = 1, log_dir: Path | None = None,
        front: bool = True, encrypt: bool = False) -> dict:
    """One run; ``rounds``: how many times every fault is injected (the slots shrink to fit); ``front``:
    clients reach the router through ``router/front.py`` (its retry window 20 s), which ``kill-router``
    leaves running."""
    from prfaas_sglang.demo.cluster import (
        ProcessGroup,
        local_topology,
        start_deployment,
        start_front,
    )
    from prfaas_sglang.demo.netns import Netns

    log_dir = log_dir or Path(tempfile.mkdtemp(prefix="prfaas-chaos-"))
    group = ProcessGroup(log_dir)
    engine = ("--bootstrap-timeout-s", f"{BOOTSTRAP_TIMEOUT_S:g}", "--context-tokens", str(CONTEXT_TOKENS))
    engine_args = {r: engine for r in ("prfaas", "pd-prefill", "pd-decode")}
    router_args = ("--no-early-rejection", "--phase-timeout-s", "20", "--admission-timeout-s", "10",
                   "--health-interval-s", "0.5")
    tunnels: list = []
    capture = None
    with Netns() as net:
        try:
            net.throttle(rate_mbit)
            doc = local_topology(hosts={"prfaas": net.inner_ip}, host=net.outer_ip, link_gbps=rate_mbit / 1000,
                                 speedup=50, kv_scale=0.002, threshold_tokens=6000, output_tokens=8)
            if encrypt:
                doc["links"][0]["encrypt"] = True
                tunnels = _tunnels(doc, net)
                capture = _capture(net.outer, tunnels[0].plan.listen_port)  # all that crossed, from the start
            d = start_deployment(group, doc, *router_args, wrap={"prfaas": net.wrap}, engine_args=engine_args, name="chaos")
            front_url = start_front(group, d.router.url) if front else None
            chaos = Chaos(group, d, d.config, net, engine_args, router_args, front_url, tunnels)
            result = asyncio.run(_experiment(chaos, duration_s, rate, seed, down_s, fuzz_requests, rate_mbit, faults, rounds))
            if capture is not None:
                out, _ = capture.communicate(timeout=30)
                wire = json.loads(out)
                for stray in wire["strays"]:  # when, on the faults' clock
                    stray[0] = round(stray[0] - result["t0_unix_s"], 2)
                result["wire"] = {**wire, "tunnel_port": tunnels[0].plan.listen_port,
                                  "blocked": {side: t.blocked_packets() for side, t in zip(("prfaas", "pd"), tunnels, strict=True)}}
            result["logs"] = str(log_dir)
            result["encrypted"] = encrypt
            return result
        finally:
            group.stop()
            if capture is not None and capture.poll() is None:
                capture.kill()
            for tunnel in tunnels:
                tunnel.down()


def _capture(device: str, port: int):
    """A capture of ``device`` (``bench/wire_capture.py``) running until its stdin closes; ``port``: the tunnel's."""
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-m", "prfaas_sglang.bench.wire_capture", device, (b"\x00" * 8).hex(),
                             str(port)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    if proc.stdout.readline().strip() != "ready":
        raise RuntimeError(f"the capture of {device} did not start")
    return proc


def _tunnels(doc: dict, net) -> list:
    """Each side's tunnel for the encrypted link of ``doc`` (the PrfaaS host's in ``net``, the rest's here), up."""
    from prfaas_sglang.adapters.wireguard import Tunnel, public_keys
    from prfaas_sglang.topology import parse_topology
    from prfaas_sglang.transport.tunnel_plan import plan
    from prfaas_sglang.wire.auth import DeploymentKeys

    keys, topology = DeploymentKeys.from_secret(os.urandom(32)), parse_topology(doc)
    tunnels = []
    try:
        for host, wrap in ((net.inner_ip, net.wrap), (net.outer_ip, ())):
            tunnels.append(Tunnel(plan(topology, host, public_keys(keys)), keys.tunnel_private_key(host), wrap=wrap))
            tunnels[-1].up()
    except BaseException:
        for tunnel in tunnels:
            tunnel.down()
        raise
    return tunnels


def verdict(result: dict) -> list[str]:
    """The acceptance checks that do not depend on timing; an empty list is a pass. Behind the
    front no connection may break at all, a router kill included."""
    t, problems = result["tally"], []
    for kind in ("hung", "truncated", "reset" if result.get("front") else "reset_outside_router_faults"):
        if t[kind]:
            problems.append(f"{t[kind]} {kind}")
    if t["untyped_errors"]:
        problems.append(f"untyped errors: {t['untyped_errors'][:3]}")
    for name, v in result["leaks"].items():
        if v.get("prfaas:open_rooms"):
            problems.append(f"{name}: {v['prfaas:open_rooms']:.0f} rooms open at rest")
        if v.get("prfaas:kv_pool_used_tokens"):
            problems.append(f"{name}: {v['prfaas:kv_pool_used_tokens']:.0f} KV-pool tokens held at rest")
        if v.get("leaked_kv_bytes"):
            problems.append(f"{name}: {v['leaked_kv_bytes']:.0f} landing-buffer bytes held at rest")
    wire = result.get("wire")
    if wire is not None:  # the link encrypted: nothing but the tunnel's UDP crossed it
        if wire["ports"] != [wire["tunnel_port"]] or set(wire["protocols"]) - {"udp"} or wire["not_ipv4"] or wire["dropped"]:
            problems.append(f"the encrypted link carried more than its tunnel: {wire}")
    for r in result["faults"]:
        if r["recovery_s"] is None:
            problems.append(f"{r['fault']}: not recovered ({r.get('not_recovered_because')})")
        for status in (r.get("statuses") or {}):
            if status.isdigit() and int(status) >= 500 and status != "503":
                problems.append(f"{r['fault']}: answered {status}")
    return problems


def render_markdown(result: dict) -> str:
    t = result["tally"]
    lines = [("Clients behind the router front. " if result.get("front") else "") + f"{t['sent']} requests: {t['ok']} ok, {t['error']} typed errors {t['errors_by_status']}, {t['reset']} reset "
             f"({t['reset_outside_router_faults']} outside router kills), {t['truncated']} truncated, {t['hung']} hung.", "",
             "| fault | at s | ended s | recovered after s | notes |", "|---|---|---|---|---|"]
    for r in result["faults"]:
        notes = r.get("statuses") or ({"frames": r["garbage_frames"]} if "garbage_frames" in r else "")
        notes = notes if r["recovery_s"] is not None else f"{notes} last probe: {r.get('not_recovered_because')}".strip()
        rec = "not recovered" if r["recovery_s"] is None else f"{r['recovery_s']:.2f}"
        lines.append(f"| {r['fault']} | {r['started_s']:.1f} | {r['ended_s']:.1f} | {rec} | {notes} |")
    rss = result["router_rss"]
    lines += ["", f"Router RSS growth (longest-lived process): {rss['growth_longest_lived']:+.1%}; "
              + "; ".join(f"pid {p['pid']}: {p['rss_warm_mb']:.0f} -> {p['rss_end_mb']:.0f} MB over {p['lived_s']:.0f} s"
                          for p in rss["processes"]),
              f"Held at rest (checked at {result['rest_s']:.1f} s): " + "; ".join(f"{n}: rooms {v.get('prfaas:open_rooms', 0):.0f}, pool tokens "
                                            f"{v.get('prfaas:kv_pool_used_tokens', 0):.0f}, KV bytes {v['leaked_kv_bytes']:.0f}"
                                            for n, v in result["leaks"].items()),
              *([f"Front: {result['front_counters']}"] if result.get("front_counters") else []),
              *([f"The link encrypted: {result['wire']['packets']} packets crossed it, protocols "
                 f"{result['wire']['protocols']}, ports common to all {result['wire']['ports']}; dropped by the "
                 f"netfilter lock, by side: {result['wire'].get('blocked')}",
                 *(f"  not the tunnel's, at {s[0]} s: {s[1]} {s[2]} -> {s[3]} {s[4] or ''}".rstrip()
                   for s in result["wire"].get("strays", ())),
                 *([f"  then: {result['wire']['at_first_stray']}"] if result["wire"].get("at_first_stray") else []),
                 *([f"  routes to the peer, as they changed: {result['path_changes']}"] if result.get("path_changes") else [])]
                if result.get("wire") else []),
              "Verdict: " + ("; ".join(verdict(result)) or "pass")]
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--duration", type=float, default=60.0, help="load window, seconds (the faults spread over it)")
    parser.add_argument("--rate", type=float, default=2.0, help="requests/s")
    parser.add_argument("--down-s", type=float, default=3.0, help="how long each fault lasts")
    parser.add_argument("--fuzz-requests", type=int, default=200,
                        help="malformed HTTP requests the http-fuzz fault sends the router")
    parser.add_argument("--rounds", type=int, default=None, help="every fault this many times (default: one per 200 s, at least 1)")
    parser.add_argument("--seed", type=int, default=0,
                        help="random seed for the load, the fault order and the fuzzed requests")
    parser.add_argument("--faults", default=None,
                        help="comma list of the faults to inject (default: all; e.g. all but kill-router to follow one "
                             "router process's memory over the whole run)")
    parser.add_argument("--front", action=argparse.BooleanOptionalAction, default=True,
                        help="clients reach the router through its front (python -m prfaas_sglang.router.front), which a "
                             "router kill leaves running, as in the Kubernetes deployment (default); --no-front: directly")
    parser.add_argument("--encrypt", action="store_true",
                        help="the PrfaaS link encrypted (links[].encrypt: a WireGuard tunnel on each side's host), and the "
                             "tunnel-down fault among the faults")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")


def cli(args: argparse.Namespace, inv: Invocation) -> int:
    from prfaas_sglang.demo.netns import available

    if args.duration < 20 or args.rate <= 0 or args.down_s <= 0 or args.fuzz_requests < 0:
        inv.error("--duration must be >= 20, --rate and --down-s > 0, --fuzz-requests >= 0")
    if (why := available()) is not None:
        inv.error(f"the PrfaaS link's namespace {why}")
    known = FAULTS + (ENCRYPTED_FAULTS if args.encrypt else ())
    faults = known if args.faults is None else tuple(f.strip() for f in args.faults.split(",") if f.strip())
    if not faults or set(faults) - set(known):
        inv.error(f"--faults must name some of {', '.join(known)}")
    if args.encrypt:
        from prfaas_sglang.adapters.wireguard import unavailable as no_tunnel

        if (why := no_tunnel()) is not None:
            inv.error(f"--encrypt: {why}")
    rounds = args.rounds or max(int(args.duration // 200), 1)
    if rounds < 1 or args.duration / (rounds * len(faults)) < args.down_s + 2:
        inv.error(f"--rounds must be >= 1, with room for each fault (--duration / (rounds x {len(faults)}) "
                  f">= --down-s + 2)")
    result = run(args.duration, args.rate, args.seed, args.down_s, args.fuzz_requests, faults=faults,
                 rounds=rounds, front=args.front, encrypt=args.encrypt)
    return inv.report(args, result, None, render_markdown)


SUBCOMMANDS = {"chaos": Subcommand(add_arguments, cli)}
