"""Bring a local deployment up and down (I/O): the demo's, the benchmarks' and the tests'.

:func:`local_topology` writes one topology document (free ports, the
``scheduler:``/``emulation:`` sections); :func:`start_deployment` starts each of
its nodes through the launcher (``python -m prfaas_sglang.launch --config ...
--node ...``), exactly as an operator would, engines first, the router last.
Each process logs to its own file in the group's directory.

Each child gets its own session (process group); :meth:`ProcessGroup.stop`
sends SIGTERM to every group, waits, then SIGKILLs what is left, so nothing
outlives the owner.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from prfaas_sglang.errors import PrfaasError

logger = logging.getLogger(__name__)


class StartupError(PrfaasError):
    """A child process exited or never became healthy."""


def scrape_metric(url: str, name: str) -> float:
    """One unlabelled-or-labelled sample ``name`` from ``{url}/metrics`` (0.0 when absent)."""
    text = urllib.request.urlopen(url + "/metrics", timeout=5).read().decode()
    match = re.search(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? (\S+)$", text, re.M)
    return float(match.group(1)) if match else 0.0


def get_json(url: str, timeout_s: float = 5.0):
    with urllib.request.urlopen(url, timeout=timeout_s) as resp:
        return json.loads(resp.read())


OWN_PORTS_FROM = 20000  # above Mooncake's random RPC and data ports (MC_MIN/MAX_RPC_PORT, 15000-17000)


def ephemeral_port_range(path: str = "/proc/sys/net/ipv4/ip_local_port_range") -> tuple[int, int]:
    """The ports the kernel hands to ``bind(0)`` and ``connect()`` (Linux's default where unreadable)."""
    try:
        with open(path) as f:
            low, high = (int(x) for x in f.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def free_port(host: str = "127.0.0.1", rng: random.Random | None = None) -> int:
    """A port free on ``host`` now, for a server started later. Picked at random in
    [``OWN_PORTS_FROM``, the kernel's ephemeral range): no ``bind(0)`` or ``connect()`` of any process
    here is handed it meanwhile. One picked by ``bind(0)`` was: a real SGLang server's own
    ``get_free_port`` took it between our pick and the kv-events publisher's bind (``Address already
    in use``, CI's real-SGLang test). Where that range is empty, a port the kernel picks."""
    rng = rng or random.SystemRandom()
    top = ephemeral_port_range()[0]
    for _ in range(64 if top > OWN_PORTS_FROM else 0):
        port = rng.randrange(OWN_PORTS_FROM, top)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class PortPicker:
    """Free ports (:func:`free_port`) that are also distinct from each other: one topology (or one
    worker) needs each of its ports once, and nothing holds a picked port until its server binds it."""

    def __init__(self) -> None:
        self._taken: set[int] = set()

    def __call__(self, host: str = "127.0.0.1") -> int:
        port = free_port(host)
        while port in self._taken:
            port = free_port(host)
        self._taken.add(port)
        return port



@dataclass
class ProcessGroup:
    log_dir: Path
    procs: list[subprocess.Popen] = field(default_factory=list)

    def start(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
        """Start ``argv``, its output in ``log_dir/<name>.log`` (appended: a restart keeps the earlier life's)."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log = open(self.log_dir / f"{name}.log", "a")  # noqa: SIM115 - owned by the child for its lifetime
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, **(env or {})})
        proc.name, proc.launch = name, (list(argv), dict(env or {}))
        self.procs.append(proc)
        return proc

    def restart(self, name: str) -> subprocess.Popen:
        """Start process ``name`` again exactly as it was last started (argv and added environment)."""
        last = next((p for p in reversed(self.procs) if p.name == name), None)
        if last is None:
            raise KeyError(f"no process {name!r} in this group")
        argv, env = last.launch
        return self.start(name, argv, env)

    def wait_healthy(self, url: str, proc: subprocess.Popen, timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                tail = (self.log_dir / f"{proc.name}.log").read_text()[-800:]
                raise StartupError(f"{proc.name} exited with {proc.returncode}: {tail.strip().splitlines()[-1:] or ''}")
            try:
                with urllib.request.urlopen(url, timeout=1) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.2)
        raise StartupError(f"{proc.name}: {url} not healthy after {timeout_s:g} s")

    def stop(self, grace_s: float = 10.0) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + grace_s
        for proc in self.procs:
            try:
                proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait()


# --- topologies -------------------------------------------------------------------------


def local_topology(*, prfaas: int = 1, pd_prefill: int = 1, pd_decode: int = 1, host: str = "127.0.0.1",
                   hosts: dict[str, str] | None = None, link_gbps: float = 100.0, rtt_ms: float | None = None,
                   speedup: float | None = 20.0, kv_scale: float | None = 0.01, workload: dict | None = None,
                   output_tokens: int | None = 64, slo_tokens_per_s: float | None = None, ttft_slo_s: float | None = None,
                   tokenizer: str | None = None,
                   served_name: str | None = None, threshold_tokens: float | None = None, telemetry: bool = True,
                   kv_events: bool = True, decode_events: bool = False, accelerators: tuple[str, str] | None = None,
                   router: bool = True, role_switch: str | None = None) -> dict:
    """A one-box topology document with free ports. ``hosts`` maps a role to its bind address
    (e.g. a PrfaaS worker inside a network namespace). ``role_switch`` (in-place | restart) makes every
    PD node switchable: each gets a bootstrap port and KV events whatever its role, and a supervisor
    port for restart."""
    hosts = hosts or {}
    distinct_port = PortPicker()

    def node(role: str, i: int) -> dict:
        h = hosts.get(role, host)
        n = {"name": f"{role}-{i}", "role": role, "host": h, "port": distinct_port(host)}
        switchable = role_switch is not None and role != "prfaas"
        if switchable:
            n["role_switch"] = role_switch
            if role_switch == "restart":
                n["switch_port"] = distinct_port(host)
        if role != "pd-decode" or switchable:
            n["bootstrap_port"] = distinct_port(host)
            if kv_events:
                n["kv_events_port"] = distinct_port(host)
            if telemetry and role == "prfaas":
                n["telemetry_port"] = distinct_port(host)
        elif decode_events:
            n["kv_events_port"] = distinct_port(host)
        return n

    prfaas_cluster = {"kind": "prfaas", "nodes": [node("prfaas", i) for i in range(prfaas)]}
    pd_cluster = {"kind": "pd", "nodes": [node("pd-prefill", i) for i in range(pd_prefill)]
                  + [node("pd-decode", i) for i in range(pd_decode)]}
    if accelerators:
        prfaas_cluster["accelerator"], pd_cluster["accelerator"] = accelerators
    clusters = {"pd": pd_cluster}
    if prfaas:
        clusters = {"prfaas": prfaas_cluster, **clusters}
    if router:
        clusters["control"] = {"kind": "control", "nodes": [{"name": "router", "role": "router", "host": host, "port": distinct_port(host)}]}
    model = {k: v for k, v in (("tokenizer", tokenizer), ("served_name", served_name)) if v is not None}
    scheduler = {k: v for k, v in (("workload", workload), ("output_tokens", output_tokens),
                                   ("slo_tokens_per_s", slo_tokens_per_s), ("ttft_slo_s", ttft_slo_s),
                                   ("threshold_tokens", threshold_tokens)) if v is not None}
    doc = {"version": 1, "clusters": clusters, "links": []}
    if prfaas:
        doc["links"].append({"from": "prfaas", "to": "pd", "bandwidth_gbps": link_gbps, **({"rtt_ms": rtt_ms} if rtt_ms else {})})
    if model:
        doc["model"] = model
    if scheduler:
        doc["scheduler"] = scheduler
    if speedup is not None or kv_scale is not None:
        doc["emulation"] = {k: v for k, v in (("speedup", speedup), ("kv_scale", kv_scale)) if v is not None}
    return doc


def demo_topology(workload_prior: dict, *, speedup: float, kv_scale: float, output_tokens: int, tokenizer: str | None,
                  served_name: str, link_gbps: float = 100.0, threshold_tokens: float | None = None) -> dict:
    """The demo's deployment, also the comparison benchmark's: 1 PrfaaS (8xH200) + 1 PD-P and 1 PD-D (8xH20),
    a router, ``workload_prior`` as the scheduler's prior."""
    return local_topology(speedup=speedup, kv_scale=kv_scale, workload=workload_prior, output_tokens=output_tokens,
                          tokenizer=tokenizer, served_name=served_name, accelerators=("h200x8", "h20x8"),
                          link_gbps=link_gbps, threshold_tokens=threshold_tokens)


def write_topology(doc: dict, path: Path) -> Path:
    import yaml

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def topology_nodes(doc: dict) -> dict[str, dict]:
    return {n["name"]: n for c in doc["clusters"].values() for n in c["nodes"]}


@dataclass(frozen=True)
class Worker:
    name: str
    url: str
    port: int
    bootstrap_port: int | None
    kv_events_port: int | None
    telemetry_port: int | None = None
    switch_port: int | None = None


@dataclass(frozen=True)
class RouterHandle:
    url: str
    config: Path
    proc: subprocess.Popen


@dataclass
class LocalDeployment:
    config: Path
    workers: dict[str, Worker]
    router: RouterHandle | None

    def worker(self, role: str, i: int = 0) -> Worker:
        return self.workers[f"{role}-{i}"]


def start_node(group: ProcessGroup, config: Path, name: str, *args: str, engine: str = "mock",
               wrap: tuple[str, ...] = (), extra: tuple[str, ...] = (), env: dict[str, str] | None = None,
               python: str = sys.executable) -> subprocess.Popen:
    """``python -m prfaas_sglang.launch --config CONFIG --node NAME`` (``wrap`` prefixes it, e.g. ``ip netns exec``)."""
    argv = [*wrap, python, "-m", "prfaas_sglang.launch", "--config", str(config), "--node", name, "--engine", engine, *args]
    if extra:
        argv += ["--", *extra]
    return group.start(name, argv, env=env)


def start_deployment(group: ProcessGroup, doc: dict, *router_args: str, engine_args: dict[str, tuple[str, ...]] | None = None,
                     wrap: dict[str, tuple[str, ...]] | None = None, router_env: dict[str, str] | None = None,
                     name: str = "topology", node_env: dict[str, dict[str, str]] | None = None) -> LocalDeployment:
    """Write ``doc``, start every engine node (emulated) through the launcher, wait for health, then the router.

    ``engine_args[node or role]`` are extra emulated-engine flags (after ``--``); ``wrap[node or role]`` prefixes
    the command (a network namespace); ``node_env[node or role]`` adds to an engine's environment."""
    config = write_topology(doc, group.log_dir / f"{name}.yaml")
    engine_args, wrap, node_env = engine_args or {}, wrap or {}, node_env or {}
    workers, procs = {}, []
    for n in topology_nodes(doc).values():
        if n["role"] in ("router", "kv-index"):
            continue
        key = n["name"] if n["name"] in engine_args else n["role"]
        proc = start_node(group, config, n["name"], extra=engine_args.get(key, ()),
                          wrap=wrap.get(n["name"], wrap.get(n["role"], ())),
                          env=node_env.get(n["name"], node_env.get(n["role"])))
        url = f"http://{n['host']}:{n['port']}"
        procs.append((proc, url))
        workers[n["name"]] = Worker(n["name"], url, n["port"], n.get("bootstrap_port"), n.get("kv_events_port"),
                                    n.get("telemetry_port"), n.get("switch_port"))
    for proc, url in procs:
        group.wait_healthy(url + "/health", proc)
    router = None
    router_node = next((n for n in topology_nodes(doc).values() if n["role"] == "router"), None)
    if router_node is not None:
        proc = group.start("router", [sys.executable, "-m", "prfaas_sglang.launch", "--config", str(config), *router_args],
                           env=router_env)
        url = f"http://{router_node['host']}:{router_node['port']}"
        group.wait_healthy(url + "/health", proc, timeout_s=90)
        router = RouterHandle(url, config, proc)
    return LocalDeployment(config, workers, router)


# --- lower level (tests of single workers, peers) ------------------------------------------


PEER_ROUTERS = {"sglang-router": "sglang_router.launch_router", "smg": "smg.launch_router"}
PEER_PORT_ATTEMPTS = 3  # starts of a peer router whose picked port another process took first


def start_peer_router(group: ProcessGroup, kind: str, prefill: list[Worker], decode: list[Worker], *,
                      prefill_policy: str = "cache_aware", decode_policy: str | None = None,
                      host: str = "127.0.0.1", name: str | None = None, timeout_s: float = 90,
                      extra_args: tuple[str, ...] = ()) -> str:
    """Start a PyPI PD router (``sglang-router`` 0.3.x or ``smg`` 1.x) over these workers; returns its URL
    once it routes (smg registers workers in the background after ``/health`` answers, so this waits
    until ``/v1/models`` lists a model). ``decode_policy`` None: ``power_of_two`` (load-aware) where there
    are two decode workers or more, else ``round_robin`` (smg refuses power_of_two over one). smg is
    waited for until ``GET /workers`` shows every worker ready: it lists a model after the first.
    ``extra_args``: more of the peer's own flags (admission knobs, balance thresholds, ...)."""
    decode_policy = decode_policy or ("power_of_two" if len(decode) >= 2 else "round_robin")
    pick = PortPicker()
    workers = [arg for w in prefill for arg in ("--prefill", w.url, str(w.bootstrap_port))]
    workers += [arg for w in decode for arg in ("--decode", w.url)]
    for attempt in range(PEER_PORT_ATTEMPTS):
        # The ports are free when picked, not when the router binds them: another process's outgoing
        # connection can take one in between (the router then exits "Address already in use").
        port = pick(host)
        argv = [sys.executable, "-m", PEER_ROUTERS[kind], "--pd-disaggregation", *workers,
                "--prefill-policy", prefill_policy, "--decode-policy", decode_policy, "--host", host, "--port", str(port),
                "--prometheus-port", str(pick(host)), *extra_args]
        proc = group.start(name or kind, argv)
        url = f"http://{host}:{port}"
        try:
            group.wait_healthy(url + "/health", proc, timeout_s=timeout_s)
            break
        except StartupError as e:
            if "Address already in use" not in str(e) or attempt == PEER_PORT_ATTEMPTS - 1:
                raise
            logger.warning("%s: a picked port was taken before it bound one (%s); new ports", name or kind, e)
    deadline = time.monotonic() + timeout_s
    wanted = {w.url for w in prefill + decode}
    while time.monotonic() < deadline:
        try:
            if get_json(url + "/v1/models", timeout_s=2).get("data") and (kind != "smg" or _smg_ready(url, wanted)):
                return url
        except (urllib.error.URLError, ConnectionError, TimeoutError, ValueError):
            pass
        time.sleep(0.2)
    raise StartupError(f"{kind}: not every worker ready at {url} after {timeout_s:g} s")


def _smg_ready(url: str, wanted: set[str]) -> bool:
    """smg lists a model once one worker is registered, and registers the others in the background:
    ready when ``GET /workers`` shows every given worker healthy and ready."""
    workers = get_json(url + "/workers", timeout_s=2).get("workers") or []
    ready = {w.get("url") for w in workers if w.get("is_healthy") and w.get("status", "ready") == "ready"}
    return wanted <= ready


def start_mock_worker(group: ProcessGroup, name: str, role: str, profile: str, extra: list[str],
                      events: bool = False, host: str = "127.0.0.1", python: str = sys.executable,
                      telemetry: bool = False, env: dict[str, str] | None = None) -> Worker:
    """One emulated worker on free ports, started directly (no topology), ``env`` added to its
    environment; returns when it answers /health."""
    pick = PortPicker()
    port = pick(host)
    bootstrap = pick(host) if role != "pd-decode" else None
    kv_events = pick(host) if events else None
    telemetry_port = pick(host) if telemetry and bootstrap is not None else None
    argv = [python, "-m", "prfaas_sglang.engine.mock", "--role", role, "--host", host, "--port", str(port), "--profile", profile, *extra]
    if bootstrap is not None:
        argv += ["--bootstrap-port", str(bootstrap)]
    if kv_events is not None:
        argv += ["--kv-events-port", str(kv_events)]
    if telemetry_port is not None:
        argv += ["--telemetry-port", str(telemetry_port)]
    proc = group.start(name, argv, env)
    url = f"http://{host}:{port}"
    group.wait_healthy(url + "/health", proc)
    return Worker(name, url, port, bootstrap, kv_events, telemetry_port)


def start_front(group: ProcessGroup, router_url: str, retry_window_s: float = 20.0, name: str = "front") -> str:
    """Start ``python -m prfaas_sglang.router.front`` before ``router_url`` on a free port; returns its URL."""
    port = free_port()
    proc = group.start(name, [sys.executable, "-m", "prfaas_sglang.router.front", "--router", router_url,
                              "--port", str(port), "--retry-window-s", f"{retry_window_s:g}"])
    url = f"http://127.0.0.1:{port}"
    group.wait_healthy(url + "/front/health", proc, timeout_s=30)
    return url


def start_router(group: ProcessGroup, topology: dict, *args: str, name: str = "router",
                 env: dict[str, str] | None = None, python: str = sys.executable) -> RouterHandle:
    """Write ``topology`` next to the logs and start ``python -m prfaas_sglang.router`` for it on a free port."""
    config = write_topology(topology, group.log_dir / f"{name}-topology.yaml")
    port = free_port()
    proc = group.start(name, [python, "-m", "prfaas_sglang.router", "--config", str(config), "--host", "127.0.0.1",
                              "--port", str(port), *args], env=env)
    url = f"http://127.0.0.1:{port}"
    group.wait_healthy(url + "/health", proc, timeout_s=90)
    return RouterHandle(url, config, proc)
