"""Bring a local deployment up and down (I/O): the demo's, the benchmarks', the tests' and the
GPU harness's (``gpu/``, which runs from a bundle: this module needs nothing beyond the standard
library and our own pure modules, yaml only where a topology is written).

:func:`local_topology` writes one topology document (free ports, the
``scheduler:``/``emulation:`` sections); :func:`start_deployment` starts each of
its nodes through the launcher (``python -m prfaas_sglang.launch --config ...
--node ...``), exactly as an operator would, engines first, the router last.
Each process logs to its own file in the group's directory.

:class:`ProcessGroup` is the one process harness: each child gets its own session
(process group); :meth:`ProcessGroup.stop` sends SIGTERM to every group, waits,
then SIGKILLs each group, so nothing outlives the owner. :func:`wait_healthy` is
the one readiness poll.
"""

from __future__ import annotations

import logging
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from prfaas_sglang.adapters import http_sync
from prfaas_sglang.envs import envs
from prfaas_sglang.errors import PrfaasError

if TYPE_CHECKING:
    from prfaas_sglang.bench.zygote import Zygotes

logger = logging.getLogger(__name__)


class StartupError(PrfaasError):
    """A child process exited or never became healthy."""


def scrape_metric(url: str, name: str) -> float:
    """One unlabelled-or-labelled sample ``name`` from ``{url}/metrics`` (0.0 when absent); raises
    :class:`~prfaas_sglang.adapters.http_sync.HttpError` when the page cannot be had."""
    text = http_sync.get_text(url + "/metrics", timeout_s=CONTROL_REQUEST_TIMEOUT_S)
    match = re.search(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? (\S+)$", text, re.M)
    return float(match.group(1)) if match else 0.0


HEALTH_POLL_S = 0.2  # between two readiness probes
HEALTH_REQUEST_TIMEOUT_S = 5.0  # one probe (SGLang's /health runs a one-token forward)
# A hang guard on one process's start (an emulated engine, a router, a peer router, the front), not a
# timing: an idle 2-core machine starts an emulated engine with a tokenizer in about 6 s (5 CPU-s, most of
# them importing transformers and torch); on CI's loaded machine two such starts took more than 60 s.
START_TIMEOUT_S = 180.0
# A hang guard on one of the harness's own requests to a server it started (a metrics scrape, /status, a
# flush, /v1/loads), not a timing: on CI's loaded machine a router that served nothing for a whole probe did
# not answer /status within 5 s (2026-11-30, test_capacity_smoke), and the run ended on it.
CONTROL_REQUEST_TIMEOUT_S = 30.0


def log_tail(text: str, lines: int = 3, width: int = 300) -> str:
    """The last ``lines`` lines of a server log worth reading (SGLang's per-model import notices and
    repeated health-check lines skipped), each cut to ``width``, joined with `` | ``."""
    noise = ("Ignore import error", "Health check failed", "warnings.warn", "return _create_error_response")
    kept = [line.strip()[:width] for line in text.splitlines() if line.strip() and not any(n in line for n in noise)]
    return " | ".join(kept[-lines:]) or "(empty)"


def wait_healthy(url: str, timeout_s: float, *, proc: subprocess.Popen | None = None, log_path: Path | None = None,
                 name: str | None = None) -> None:
    """The one readiness poll: ``GET url`` every :data:`HEALTH_POLL_S` until it answers 200.

    Raises :class:`StartupError` when ``proc`` (if given) exits first or ``timeout_s`` passes; the
    message names ``name`` (default: the URL) and ends with the last words of the log at
    ``log_path`` (if given)."""
    who = name or url

    def tail() -> str:
        if log_path is None:
            return ""
        words = log_tail(log_path.read_text(errors="replace")) if log_path.exists() else "(no log)"
        return f"; its log ends: {words}"

    deadline = time.monotonic() + timeout_s
    while True:
        if proc is not None and proc.poll() is not None:
            raise StartupError(f"{who} exited with {proc.returncode} before {url} answered{tail()}")
        try:
            if http_sync.get(url, timeout_s=HEALTH_REQUEST_TIMEOUT_S).status == 200:
                return
        except http_sync.HttpError:
            pass
        if time.monotonic() >= deadline:
            raise StartupError(f"{who}: {url} not healthy after {timeout_s:g} s{tail()}")
        time.sleep(HEALTH_POLL_S)


OWN_PORTS_FROM = 20000  # above Mooncake's random RPC and data ports (MC_MIN/MAX_RPC_PORT, 15000-17000)


def ephemeral_port_range(path: str = "/proc/sys/net/ipv4/ip_local_port_range") -> tuple[int, int]:
    """The ports the kernel hands to ``bind(0)`` and ``connect()`` (Linux's default where unreadable)."""
    try:
        with open(path) as f:
            low, high = (int(x) for x in f.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def own_port_range() -> tuple[int, int]:
    """The ports :func:`free_port` picks from, ``[low, high)``: ``PRFAAS_PORT_RANGE`` ('low-high',
    a parallel test worker's slice) or [``OWN_PORTS_FROM``, the kernel's ephemeral range)."""
    def parse(text: str) -> tuple[int, int]:
        low, _, high = text.partition("-")
        low_port, high_port = int(low), int(high)
        if not 0 < low_port < high_port <= 65536:
            raise ValueError(f"must be 'low-high' with 0 < low < high <= 65536, not {text!r}")
        return low_port, high_port
    return envs.PORT_RANGE.parse(parse) or (OWN_PORTS_FROM, ephemeral_port_range()[0])


def free_port(host: str = "127.0.0.1", rng: random.Random | None = None) -> int:
    """A port free on every address here now, for a server started later on ``host``. Picked at
    random in :func:`own_port_range` (by default below the kernel's ephemeral range): no ``bind(0)``
    or ``connect()`` of any process here is handed it meanwhile. One picked by ``bind(0)`` was: a
    real SGLang server's own ``get_free_port`` took it between our pick and the kv-events
    publisher's bind (``Address already in use``, CI's real-SGLang test). Free on ``host`` alone is
    not enough: smg binds its metrics on 0.0.0.0, and a pick free on loopback was a bootstrap port
    on a namespace link's host end (fresh-clone run 3 of issue #47). Where that range is empty, a
    port the kernel picks."""
    rng = rng or random.SystemRandom()
    low, top = own_port_range()
    for _ in range(64 if top > low else 0):
        port = rng.randrange(low, top)
        with socket.socket() as s:
            try:
                s.bind(("0.0.0.0", port))  # fails while any address here holds the port
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


PICK_ATTEMPTS = 256  # picks a PortPicker makes before it says its range is spent


class PortPicker:
    """Free ports (:func:`free_port`) that are also distinct from each other and from ``taken``: one
    topology (or one worker) needs each of its ports once, and nothing holds a picked port until its
    server binds it (a port picked for a server not started yet is free to any other pick: pass it in
    ``taken``)."""

    def __init__(self, taken: Iterable[int] = ()) -> None:
        self._taken: set[int] = set(taken)

    def __call__(self, host: str = "127.0.0.1") -> int:
        """A port; :class:`StartupError` when :data:`PICK_ATTEMPTS` picks in a row were all taken already."""
        for _ in range(PICK_ATTEMPTS):
            port = free_port(host)
            if port not in self._taken:
                self._taken.add(port)
                return port
        low, top = own_port_range()
        raise StartupError(f"no free port in {low}-{top} that is not already picked ({len(self._taken)} picked)")



@dataclass(frozen=True)
class Launch:
    """How a child was started, so that :meth:`ProcessGroup.restart` can start it again the same way."""

    argv: tuple[str, ...]
    env: Mapping[str, str]  # added to base_env
    base_env: Mapping[str, str] | None  # None: the owner's environment at start
    preexec_fn: Callable[[], None] | None
    fork_from: tuple[str, ...] = ()  # the modules of the zygote it was forked from (none: started afresh)


@dataclass
class ProcessGroup:
    """The one process harness (demo, benchmarks, tests, the GPU checks): children started
    together and stopped together.

    Each child runs in its own session (process group), its output appended to
    ``log_dir/<name>.log``; ``procs`` lists every child started, in order (a restarted name
    twice), each with ``.name`` and ``.launch`` (a :class:`Launch`). :meth:`stop` TERMs each
    group, waits, then KILLs each group (children that outlived their parent too). A forked copy
    of the owner (pyroute2's netns helpers are one) neither kills nor stops anything: the
    children are its parent's.

    A child started ``fork_from`` some modules is forked from a process that imported them once (a
    :class:`~prfaas_sglang.bench.zygote.Zygote` of ``zygotes``, which the caller may share among groups and
    stops itself; None: the group's own, stopped with all its children), where it can be (``python -m``,
    a script or ``-c`` with this interpreter and ``PYTHONPATH``, no ``preexec_fn``): for a program whose
    imports cost more than its start (a peer router that imports SGLang's server code). Such a child is as
    much of a ``Popen`` as the group uses."""

    log_dir: Path
    procs: list[subprocess.Popen] = field(default_factory=list)
    _owner_pid: int = field(default_factory=os.getpid, init=False, repr=False)
    zygotes: Zygotes | None = None
    _own_zygotes: Zygotes | None = field(default=None, init=False, repr=False)

    def _owned_here(self) -> bool:
        return os.getpid() == self._owner_pid

    def start(self, name: str, argv: list[str], env: Mapping[str, str] | None = None, *,
              base_env: Mapping[str, str] | None = None,
              preexec_fn: Callable[[], None] | None = None, fork_from: tuple[str, ...] = ()) -> subprocess.Popen:
        """Start ``argv`` as ``name``, its output appended to ``log_dir/<name>.log`` (a restart keeps
        the earlier life's). Its environment: ``base_env`` (None: this process's), ``env`` added.
        ``preexec_fn`` runs in the child after it got its own session (entering a network namespace).
        ``fork_from``: forked from this group's zygote of those modules where it can be (see the class)."""
        from prfaas_sglang.bench.zygote import Zygotes, forkable

        self.log_dir.mkdir(parents=True, exist_ok=True)
        environ = {**(os.environ if base_env is None else base_env), **(env or {})}
        with open(self.log_dir / f"{name}.log", "ab") as log:  # the child holds its own descriptor
            if fork_from and preexec_fn is None and forkable(argv := list(argv), environ):
                if self.zygotes is None and self._own_zygotes is None:
                    self._own_zygotes = Zygotes()
                zygote = (self.zygotes or self._own_zygotes).get(tuple(fork_from))
                proc = zygote.popen(argv, env=environ, stdout=log, stderr=subprocess.STDOUT)
            else:
                proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=environ,
                                        start_new_session=True, preexec_fn=preexec_fn)
        proc.name = name
        proc.launch = Launch(tuple(argv), dict(env or {}), None if base_env is None else dict(base_env), preexec_fn,
                             tuple(fork_from))
        self.procs.append(proc)
        return proc

    def _latest_or_none(self, name: str) -> subprocess.Popen | None:
        return next((p for p in reversed(self.procs) if p.name == name), None)

    def latest(self, name: str) -> subprocess.Popen:
        """The child last started as ``name``; KeyError when there is none."""
        proc = self._latest_or_none(name)
        if proc is None:
            raise KeyError(f"no process {name!r} in this group")
        return proc

    def restart(self, name: str) -> subprocess.Popen:
        """Start process ``name`` again exactly as it was last started (argv, environment, preexec_fn)."""
        launch: Launch = self.latest(name).launch
        return self.start(name, list(launch.argv), launch.env, base_env=launch.base_env, preexec_fn=launch.preexec_fn,
                          fork_from=launch.fork_from)

    def log(self, name: str) -> str:
        """What ``name`` has written so far (every life of it); empty when nothing."""
        path = self.log_dir / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def wait_healthy(self, url: str, proc: subprocess.Popen, timeout_s: float = START_TIMEOUT_S) -> None:
        """:func:`wait_healthy` for ``proc`` of this group: the error names it and quotes its log."""
        wait_healthy(url, timeout_s, proc=proc, log_path=self.log_dir / f"{proc.name}.log", name=proc.name)

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to the process group of ``name``'s latest child, if it runs, and wait (30 s at
        most) for that child to end. Nothing when there is none, or it ended already."""
        proc = self._latest_or_none(name)
        if proc is None or not self._owned_here() or proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass

    def stop(self, names: Iterable[str] | None = None, grace_s: float = 10.0) -> list[str]:
        """TERM the process group of every child (or of those named ``names``), wait ``grace_s`` in all,
        then KILL each group (what outlived its parent goes too). Returns the names that had to be
        KILLed while their child still ran. Children stopped by name are forgotten (the name can be
        started afresh); stopping all keeps them listed and stops the group's own zygotes."""
        if not self._owned_here():
            return []
        wanted = None if names is None else set(names)
        chosen = [p for p in self.procs if wanted is None or p.name in wanted]
        for proc in chosen:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + grace_s
        killed = []
        for proc in chosen:
            try:
                proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
                late = False
            except subprocess.TimeoutExpired:
                late = True
                killed.append(proc.name)
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            if late:
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    logger.warning("%s (pid %d) outlived SIGKILL by 10 s", proc.name, proc.pid)
        if wanted is not None:
            self.procs = [p for p in self.procs if p not in chosen]
        elif self._own_zygotes is not None:  # every child gone: the group's own zygotes too (not a shared one)
            self._own_zygotes.stop()
        return killed


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
                  served_name: str, link_gbps: float = 100.0, threshold_tokens: float | None = None,
                  host: str = "127.0.0.1", hosts: dict[str, str] | None = None) -> dict:
    """The demo's deployment, also the comparison benchmark's: 1 PrfaaS (8xH200) + 1 PD-P and 1 PD-D (8xH20),
    a router, ``workload_prior`` as the scheduler's prior (``host``/``hosts``: as :func:`local_topology`)."""
    return local_topology(speedup=speedup, kv_scale=kv_scale, workload=workload_prior, output_tokens=output_tokens,
                          tokenizer=tokenizer, served_name=served_name, accelerators=("h200x8", "h20x8"),
                          link_gbps=link_gbps, threshold_tokens=threshold_tokens, host=host, hosts=hosts)


def write_topology(doc: dict, path: Path) -> Path:
    import yaml

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def topology_nodes(doc: dict) -> dict[str, dict]:
    return {n["name"]: n for c in doc["clusters"].values() for n in c["nodes"]}


NODE_PORT_KEYS = ("port", "bootstrap_port", "kv_events_port", "telemetry_port", "switch_port")


def topology_ports(doc: dict) -> set[int]:
    """Every port a topology document's nodes bind once started: what another pick for the same run avoids."""
    return {n[key] for n in topology_nodes(doc).values() for key in NODE_PORT_KEYS if n.get(key)}


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
                     name: str = "topology", node_env: dict[str, dict[str, str]] | None = None,
                     python: str = sys.executable) -> LocalDeployment:
    """Write ``doc``, start every engine node (emulated) through the launcher, wait for health, then the router.

    ``engine_args[node or role]`` are extra emulated-engine flags (after ``--``); ``wrap[node or role]`` prefixes
    the command (a network namespace, a container: ``demo/containers.py``; the router's is ``wrap["router"]``), and
    ``python`` is the interpreter there; ``node_env[node or role]`` adds to an engine's environment."""
    config = write_topology(doc, group.log_dir / f"{name}.yaml")
    engine_args, wrap, node_env = engine_args or {}, wrap or {}, node_env or {}
    workers, procs = {}, []
    for n in topology_nodes(doc).values():
        if n["role"] in ("router", "kv-index"):
            continue
        key = n["name"] if n["name"] in engine_args else n["role"]
        proc = start_node(group, config, n["name"], extra=engine_args.get(key, ()),
                          wrap=wrap.get(n["name"], wrap.get(n["role"], ())),
                          env=node_env.get(n["name"], node_env.get(n["role"])), python=python)
        url = f"http://{n['host']}:{n['port']}"
        procs.append((proc, url))
        workers[n["name"]] = Worker(n["name"], url, n["port"], n.get("bootstrap_port"), n.get("kv_events_port"),
                                    n.get("telemetry_port"), n.get("switch_port"))
    for proc, url in procs:
        group.wait_healthy(url + "/health", proc)
    return LocalDeployment(config, workers, start_topology_router(group, config, doc, *router_args, env=router_env,
                                                                   wrap=wrap.get("router", ()), python=python))


def start_topology_router(group: ProcessGroup, config: Path, doc: dict, *router_args: str,
                          env: dict[str, str] | None = None, wrap: tuple[str, ...] = (),
                          python: str = sys.executable) -> RouterHandle | None:
    """The router node of ``doc`` (written at ``config``) through the launcher, as :func:`start_deployment` starts
    it (``python -m prfaas_sglang.launch --config CONFIG ROUTER_ARGS``, ``env`` added), once it answers /health;
    None where ``doc`` names no router. On its own: a router over workers that are already running."""
    router_node = next((n for n in topology_nodes(doc).values() if n["role"] == "router"), None)
    if router_node is None:
        return None
    proc = group.start("router", [*wrap, python, "-m", "prfaas_sglang.launch", "--config", str(config), *router_args],
                       env=env)
    url = f"http://{router_node['host']}:{router_node['port']}"
    group.wait_healthy(url + "/health", proc)
    return RouterHandle(url, config, proc)


# --- lower level (tests of single workers, peers) ------------------------------------------


PEER_ROUTERS = {"sglang-router": "sglang_router.launch_router", "smg": "smg.launch_router"}
# sglang-router 0.3's launcher imports SGLang's server code for its mini load balancer (6 CPU-s a start, the
# Rust router's own start a fraction of it): a group forks its starts from one process that imported it.
PEER_ROUTER_PRELOAD = {"sglang-router": ("sglang_router.launch_router",)}
PEER_PORT_ATTEMPTS = 3  # starts of a peer router whose picked port another process took first


def start_peer_router(group: ProcessGroup, kind: str, prefill: list[Worker], decode: list[Worker], *,
                      prefill_policy: str = "cache_aware", decode_policy: str | None = None,
                      host: str = "127.0.0.1", name: str | None = None, timeout_s: float = START_TIMEOUT_S,
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
                "--prometheus-host", host, "--prometheus-port", str(pick(host)), *extra_args]
        logged_before = len(group.log(name or kind))
        proc = group.start(name or kind, argv, fork_from=PEER_ROUTER_PRELOAD.get(kind, ()))
        url = f"http://{host}:{port}"
        try:
            group.wait_healthy(url + "/health", proc, timeout_s=timeout_s)
            break
        except StartupError as e:  # the bind error may sit above the log's last words that the error quotes
            if "Address already in use" not in group.log(name or kind)[logged_before:] or attempt == PEER_PORT_ATTEMPTS - 1:
                raise
            logger.warning("%s: a picked port was taken before it bound one (%s); new ports", name or kind, e)
    deadline = time.monotonic() + timeout_s
    wanted = {w.url for w in prefill + decode}
    while time.monotonic() < deadline:
        try:
            if http_sync.get_json(url + "/v1/models", timeout_s=2).get("data") and (kind != "smg" or _smg_ready(url, wanted)):
                return url
        except http_sync.HttpError:
            pass
        time.sleep(0.2)
    raise StartupError(f"{kind}: not every worker ready at {url} after {timeout_s:g} s")


def _smg_ready(url: str, wanted: set[str]) -> bool:
    """smg lists a model once one worker is registered, and registers the others in the background:
    ready when ``GET /workers`` shows every given worker healthy and ready."""
    workers = http_sync.get_json(url + "/workers", timeout_s=2).get("workers") or []
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
    group.wait_healthy(url + "/front/health", proc)
    return url


def start_router(group: ProcessGroup, topology: dict, *args: str, name: str = "router",
                 env: dict[str, str] | None = None, python: str = sys.executable) -> RouterHandle:
    """Write ``topology`` next to the logs and start ``python -m prfaas_sglang.router`` for it on a free port."""
    config = write_topology(topology, group.log_dir / f"{name}-topology.yaml")
    port = free_port()
    proc = group.start(name, [python, "-m", "prfaas_sglang.router", "--config", str(config), "--host", "127.0.0.1",
                              "--port", str(port), *args], env=env)
    url = f"http://127.0.0.1:{port}"
    group.wait_healthy(url + "/health", proc)
    return RouterHandle(url, config, proc)
