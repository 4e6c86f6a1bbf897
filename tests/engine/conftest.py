"""Real emulated workers (and peers) as subprocesses on free loopback ports.

Every process starts in its own process group and the whole group is killed
at teardown, so nothing outlives a test.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import requests

PREFILL_PROFILE = "kimi-linear-1t-hybrid@h200x8"
DECODE_PROFILE = "kimi-linear-1t-hybrid@h20x8"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args} exited with {proc.returncode}")
        try:
            if requests.get(url, timeout=1).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{url} not healthy after {timeout_s} s")


@dataclass
class Procs:
    log_dir: Path
    procs: list[subprocess.Popen] = field(default_factory=list)

    def start(self, name: str, argv: list[str]) -> subprocess.Popen:
        log = open(self.log_dir / f"{name}.log", "w")
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.procs.append(proc)
        return proc

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        for proc in self.procs:
            try:
                proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


@dataclass
class Worker:
    url: str
    port: int
    bootstrap_port: int | None
    kv_events_port: int | None
    proc: subprocess.Popen


def start_worker(procs: Procs, role: str, profile: str, *extra: str, events: bool = False) -> Worker:
    port = free_port()
    bootstrap = free_port() if role != "pd-decode" else None
    kv_events = free_port() if events else None
    argv = [sys.executable, "-m", "prfaas_sglang.engine.mock", "--role", role, "--port", str(port), "--profile", profile, *extra]
    if bootstrap:
        argv += ["--bootstrap-port", str(bootstrap)]
    if kv_events:
        argv += ["--kv-events-port", str(kv_events)]
    proc = procs.start(f"{role}-{port}", argv)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url + "/health", proc)
    return Worker(url, port, bootstrap, kv_events, proc)


@pytest.fixture
def procs(tmp_path):
    p = Procs(tmp_path)
    yield p
    p.stop()


@pytest.fixture(scope="module")
def module_procs(tmp_path_factory):
    p = Procs(tmp_path_factory.mktemp("procs"))
    yield p
    p.stop()
