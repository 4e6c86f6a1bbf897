"""Start and stop a local deployment's processes (I/O).

Each child gets its own session (process group); :meth:`ProcessGroup.stop`
sends SIGTERM to every group, waits, then SIGKILLs what is left, so nothing
outlives the owner. Used by the demo, the benchmarks and the tests.
"""

from __future__ import annotations

import os
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


class StartupError(PrfaasError):
    """A child process exited or never became healthy."""


def scrape_metric(url: str, name: str) -> float:
    """One unlabelled-or-labelled sample ``name`` from ``{url}/metrics`` (0.0 when absent)."""
    text = urllib.request.urlopen(url + "/metrics", timeout=5).read().decode()
    match = re.search(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? (\S+)$", text, re.M)
    return float(match.group(1)) if match else 0.0


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass
class ProcessGroup:
    log_dir: Path
    procs: list[subprocess.Popen] = field(default_factory=list)

    def start(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log = open(self.log_dir / f"{name}.log", "w")  # noqa: SIM115 - owned by the child for its lifetime
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, **(env or {})})
        proc.name = name
        self.procs.append(proc)
        return proc

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


@dataclass(frozen=True)
class Worker:
    name: str
    url: str
    port: int
    bootstrap_port: int | None
    kv_events_port: int | None
    telemetry_port: int | None = None


def start_mock_worker(group: ProcessGroup, name: str, role: str, profile: str, extra: list[str],
                      events: bool = False, host: str = "127.0.0.1", python: str = sys.executable,
                      telemetry: bool = False) -> Worker:
    """One emulated worker on free ports; returns when it answers /health."""
    port = free_port(host)
    bootstrap = free_port(host) if role != "pd-decode" else None
    kv_events = free_port(host) if events else None
    telemetry_port = free_port(host) if telemetry and bootstrap is not None else None
    argv = [python, "-m", "prfaas_sglang.engine.mock", "--role", role, "--host", host, "--port", str(port), "--profile", profile, *extra]
    if bootstrap is not None:
        argv += ["--bootstrap-port", str(bootstrap)]
    if kv_events is not None:
        argv += ["--kv-events-port", str(kv_events)]
    if telemetry_port is not None:
        argv += ["--telemetry-port", str(telemetry_port)]
    proc = group.start(name, argv)
    url = f"http://{host}:{port}"
    group.wait_healthy(url + "/health", proc)
    return Worker(name, url, port, bootstrap, kv_events, telemetry_port)


@dataclass(frozen=True)
class RouterHandle:
    url: str
    config: Path
    proc: subprocess.Popen


def start_router(group: ProcessGroup, topology: dict, *args: str, name: str = "router",
                 env: dict[str, str] | None = None, python: str = sys.executable) -> RouterHandle:
    """Write ``topology`` next to the logs and start ``python -m prfaas_sglang.router`` for it."""
    import yaml

    config = group.log_dir / f"{name}-topology.yaml"
    group.log_dir.mkdir(parents=True, exist_ok=True)
    config.write_text(yaml.safe_dump(topology))
    port = free_port()
    proc = group.start(name, [python, "-m", "prfaas_sglang.router", "--config", str(config), "--port", str(port), *args], env=env)
    url = f"http://127.0.0.1:{port}"
    group.wait_healthy(url + "/health", proc)
    return RouterHandle(url, config, proc)
