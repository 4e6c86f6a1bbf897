"""Helpers shared by all test packages (import as ``helpers``; ``conftest`` names differ per directory)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

from prfaas_sglang.envs import envs

REPO_ROOT = Path(__file__).resolve().parents[1]
FIXTURE_PATCHES = REPO_ROOT / "tests" / "fixtures" / "patches"
# The public Mooncake conversation trace; a checkout away from ../shared names it in PRFAAS_TRACE_PATH.
TRACE = Path(envs.TRACE_PATH.get() or REPO_ROOT.parent / "shared" / "data" / "mooncake_conversation_trace.jsonl")


INTERRUPT_GRACE_S = 30.0  # a timed-out command's time to stop what it started, after SIGINT
# A hang guard, not a timing, for a test's own process that imports SGLang and serves or probes once: alone
# 30-40 s, but beside the loaded suite on a slow machine a Mooncake probe took 170 s, then more than 240, and the
# HTTP-metrics probes and cache-move workers more than 180 (2026-11-30, fresh runs 42, 43, 45).
SGLANG_PROCESS_GUARD_S = 600.0


def run_py(args: list[str], env: dict[str, str] | None = None, timeout: float = 120, cwd: Path = REPO_ROOT):
    """Run ``python <args>`` with this interpreter; returns CompletedProcess (text). Past ``timeout``
    the command gets SIGINT first, so that its ``finally`` blocks stop the servers it started (they run
    in sessions of their own, which killing the command alone would leave running), then SIGKILL;
    ``subprocess.TimeoutExpired`` is raised either way."""
    full_env = {**os.environ, **(env or {})}
    argv = [sys.executable, *args]
    with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=full_env,
                          cwd=cwd) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGINT)
            try:
                stdout, stderr = proc.communicate(timeout=INTERRUPT_GRACE_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                stdout, stderr = proc.communicate()
            raise subprocess.TimeoutExpired(argv, timeout, output=stdout, stderr=stderr) from None
    return subprocess.CompletedProcess(argv, proc.returncode, stdout, stderr)


def start_real_time_pd_pair(group) -> dict:
    """An emulated PD-P ``pp0`` and PD-D ``d0`` (Kimi-Linear on H20) running in real time (speedup 1),
    so a request is still streaming when a test kills something; returns their topology."""
    from prfaas_sglang.demo.cluster import start_mock_worker

    slow = ["--speedup", "1", "--kv-scale", "0.002", "--bootstrap-timeout-s", "5"]
    pp0 = start_mock_worker(group, "pp0", "pd-prefill", "kimi-linear-1t-hybrid@h20x8", slow)
    d0 = start_mock_worker(group, "d0", "pd-decode", "kimi-linear-1t-hybrid@h20x8", slow)
    return {"version": 1, "emulation": {"speedup": 1, "kv_scale": 0.002}, "clusters": {
        "a": {"kind": "pd", "nodes": [{"name": "pp0", "role": "pd-prefill", "port": pp0.port, "bootstrap_port": pp0.bootstrap_port},
                                      {"name": "d0", "role": "pd-decode", "port": d0.port}]}}}


SUBSCRIBE_READY_TIMEOUT_S = 10.0


def wait_subscribed(status_url: str, sources: list[str], timeout_s: float = SUBSCRIBE_READY_TIMEOUT_S) -> None:
    """Wait until the router's or kv-index's ``/status`` says each of ``sources`` is ``connected`` (its
    handshake with the publisher succeeded): the readiness probe in place of a PUB/SUB-join sleep."""
    import time

    from prfaas_sglang.adapters import http_sync

    deadline = time.monotonic() + timeout_s
    while True:
        subs = http_sync.get_json(status_url, timeout_s=5.0)["subscriptions"]
        if all(subs.get(source, {}).get("connected") for source in sources):
            return
        assert time.monotonic() < deadline, f"not connected within {timeout_s:g} s: {subs}"
        time.sleep(0.02)


def subscribe(endpoint: str, topic: bytes = b"", timeout_s: float = SUBSCRIBE_READY_TIMEOUT_S):
    """A SUB socket on ``endpoint``, returned once its handshake with the publisher succeeded (the
    subscription goes out with it), so what is published next reaches it: no slow-joiner sleep."""
    import zmq
    from zmq.utils.monitor import parse_monitor_message

    sock = zmq.Context.instance().socket(zmq.SUB)
    sock.setsockopt(zmq.SUBSCRIBE, topic)
    monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
    try:
        sock.connect(endpoint)
        if not monitor.poll(int(timeout_s * 1000)):
            sock.close(linger=0)
            raise AssertionError(f"no handshake with {endpoint} within {timeout_s:g} s")
        assert parse_monitor_message(monitor.recv_multipart())["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED
    finally:
        sock.disable_monitor()
        monitor.close(linger=0)
    return sock


def applies_here(hook_name: str):
    """A skip mark for the tests of a hook the installed SGLang does not take (retired there, or its
    ``only_if`` marker absent: a seam only another release has)."""
    import pytest

    from prfaas_sglang.plugin import HOOKS

    where = next(h for h in HOOKS if h.name == hook_name).where()
    return pytest.mark.skipif(where != "applies", reason=f"{hook_name}: {where} on this SGLang")


def retired_here(hook_name: str):
    """A skip mark for the tests of a hook that the installed SGLang has retired (its ``upstream_marker``
    is there: upstream does it itself, and the hook is neither installed nor checked)."""
    import pytest

    from prfaas_sglang.plugin import HOOKS

    where = next(h for h in HOOKS if h.name == hook_name).where()
    return pytest.mark.skipif(where == "retired", reason=f"{hook_name}: retired on this SGLang (upstream does it itself)")



def harness_checks() -> tuple[str, ...]:
    """The harness's checks the suite runs on real SGLang on CPU (tests/deployments.py: sglang_cpu): role-switch
    where the installed SGLang serves it."""
    from prfaas_sglang._compat import serves_pd_role_switch

    return ("routing", "kv-index", "cache-move", "failover") + (("role-switch",) if serves_pd_role_switch() else ())


@contextlib.asynccontextmanager
async def serving(app):
    """``app`` (an aiohttp ``web.Application``) served on a free loopback port while the block runs; yields its
    base URL. For tests that stand a small HTTP peer in front of the code under test."""
    from aiohttp import web

    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
    finally:
        await runner.cleanup()
