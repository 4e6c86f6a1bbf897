"""Deployments shared by test files (a pytest plugin: ``pytest_plugins`` in tests/conftest.py).

Emulated workers are what an end-to-end test pays to start; a router is cheap. So the workers below
start once per test process (session scope), and each user (a test file's module fixture, or one
test) borrows them with a router of its own, started with the user's settings and stopped when it
is done:

* ``emulated_pair`` (xdist group :data:`EMULATED_PAIR`): the standard deployment, one PrfaaS
  (h200x8), one PD-P and one PD-D (h20x8) worker from :func:`local_topology` (speedup 50, KV scale
  0.002, KV events from both prefill workers, no telemetry), started through the launcher with a
  10 s bootstrap timeout. A user starts a router through the launcher with
  :meth:`SharedWorkers.deployment` (its flags, environment, ``t`` and link bandwidth: the launcher
  gives the workers of such a topology the same command lines; the bandwidth changes only the PrfaaS
  worker's Mooncake timeout for a stalled transfer), or names the workers in a topology of its own
  (:meth:`SharedWorkers.worker`).
* ``realtime_pair`` (xdist group :data:`REALTIME_PAIR`): a PD-P ``pp0`` and PD-D ``d0`` running in
  real time (``helpers.start_real_time_pd_pair``), so a request is still streaming when a test kills
  something: the router under the router front, or the decode worker itself.
* ``sglang_cpu`` (xdist group :data:`SGLANG_CPU`): real SGLang on this CPU, :func:`cpu_model` (a tiny
  Llama) in every role behind our router and kv-index (:func:`prfaas_sglang.gpu.checks.deployment`), its
  hooks reporting (``PRFAAS_HOOK_REPORT``); switchable where the installed SGLang serves role switches
  (``helpers.harness_checks``). Its users: the harness's checks, the cost profile's calibration, the hook
  reports. Pinned-release users that measure time run in the serial phase (``serial``), where nothing
  else runs; ``sglang_cpu_ready`` first restores what a previous user stopped (failover kills PrfaaS).

A session fixture is made once only if every test that uses it runs in one pytest-xdist worker
process: each such test carries ``pytest.mark.xdist_group(<its group>)`` (checked at collection),
and the suite runs ``--dist loadgroup``.

Isolation: each loan starts with :meth:`SharedWorkers.reset`: a worker that a previous user killed is
started again (same command, same ports), every worker is waited for until idle (nothing running or
queued, no bootstrap room open), injected faults are disarmed and every prefix cache is flushed
(SGLang's ``/flush_cache``; the ``AllBlocksCleared`` event it publishes reaches no router, since the
next one subscribes after it). The previous user's router is gone by then (its index with it). What a
reset leaves: the workers' cumulative metrics (a user compares a counter with its value at its own
start) and a PrfaaS worker's admission history (``PRFAAS_PREFILL_CACHE=auto`` remembers prompts seen,
and keeps one-off prompts while recent re-sightings came back within the cache's reach: the users'
few prompts always do, so it keeps every prefill as on a fresh worker).
"""

from __future__ import annotations

import contextlib
import copy
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from prfaas_sglang.adapters import http_sync
from prfaas_sglang.demo.cluster import (
    LocalDeployment,
    ProcessGroup,
    Worker,
    free_port,
    local_topology,
    scrape_metric,
    start_deployment,
    start_topology_router,
    topology_nodes,
    write_topology,
)

EMULATED_PAIR = "emulated-pair"
REALTIME_PAIR = "emulated-realtime"
SGLANG_CPU = "sglang-cpu"
SHARED = {"emulated_pair": EMULATED_PAIR, "realtime_pair": REALTIME_PAIR,  # fixture -> its xdist group
          "sglang_cpu": SGLANG_CPU, "cpu_profile": SGLANG_CPU}
ENGINE_ROLES = ("prfaas", "pd-prefill", "pd-decode")
IDLE_TIMEOUT_S = 60.0  # a previous user's requests still finishing (a real-time stream decodes for seconds)


@dataclass
class SharedWorkers:
    """Running emulated workers lent to one user at a time; ``doc`` is their topology (no router node)."""

    group: ProcessGroup
    doc: dict
    workers: dict[str, Worker]

    @classmethod
    def start(cls, log_dir: Path, doc: dict, engine_args: dict[str, tuple[str, ...]] | None = None) -> SharedWorkers:
        """The engine nodes of ``doc`` started through the launcher (:func:`start_deployment`)."""
        group = ProcessGroup(log_dir)
        try:
            return cls(group, doc, start_deployment(group, doc, engine_args=engine_args, name="workers").workers)
        except BaseException:
            group.stop()
            raise

    @classmethod
    def running(cls, group: ProcessGroup, doc: dict) -> SharedWorkers:
        """Workers ``group`` already started as the nodes of ``doc``."""
        workers = {name: Worker(name, f"http://{n.get('host', '127.0.0.1')}:{n['port']}", n["port"], n.get("bootstrap_port"),
                                n.get("kv_events_port"), n.get("telemetry_port"))
                   for name, n in topology_nodes(doc).items()}
        return cls(group, doc, workers)

    def worker(self, role: str, i: int = 0) -> Worker:
        return self.workers[f"{role}-{i}"]

    def stop(self) -> None:
        self.group.stop()

    def reset(self) -> None:
        """What a user finds: every worker running, idle, no fault armed, its prefix cache empty."""
        for name, worker in self.workers.items():
            if self.group.latest(name).poll() is not None:  # killed by a previous user: the same command again
                self.group.wait_healthy(worker.url + "/health", self.group.restart(name))
        deadline = time.monotonic() + IDLE_TIMEOUT_S
        for name, worker in self.workers.items():
            while not _idle(worker.url):
                assert time.monotonic() < deadline, f"{name} still busy after {IDLE_TIMEOUT_S:g} s"
                time.sleep(0.1)
        for worker in self.workers.values():
            http_sync.post_json(worker.url + "/prfaas/faults", {"fail_kv_transfers": 0, "fail_role_switch": False}, timeout_s=5)
            http_sync.post(worker.url + "/flush_cache", timeout_s=5).raise_for_status()

    def topology(self, *, threshold_tokens: float | None = None, link_gbps: float | None = None) -> dict:
        """The workers' topology with a router node on a free port, ``threshold_tokens`` (the operator's ``t``)
        and every link's ``link_gbps`` where given."""
        doc = copy.deepcopy(self.doc)
        if threshold_tokens is not None:
            doc.setdefault("scheduler", {})["threshold_tokens"] = threshold_tokens
        if link_gbps is not None:
            for link in doc.get("links", []):
                link["bandwidth_gbps"] = link_gbps
        host = next(iter(topology_nodes(doc).values())).get("host", "127.0.0.1")
        doc["clusters"]["control"] = {"kind": "control", "nodes": [{"name": "router", "role": "router", "host": host,
                                                                    "port": free_port(host)}]}
        return doc

    @contextlib.contextmanager
    def deployment(self, log_dir: Path, *router_args: str, router_env: dict[str, str] | None = None,
                   threshold_tokens: float | None = None, link_gbps: float | None = None,
                   name: str = "topology") -> Iterator[LocalDeployment]:
        """Lends the workers (:meth:`reset` first) with a router of their topology (:meth:`topology`) started
        through the launcher with ``router_args`` and ``router_env``, as :func:`start_deployment` starts it; the
        router (logging under ``log_dir``) is stopped at the end."""
        self.reset()
        group = ProcessGroup(log_dir)
        try:
            doc = self.topology(threshold_tokens=threshold_tokens, link_gbps=link_gbps)
            config = write_topology(doc, log_dir / f"{name}.yaml")
            yield LocalDeployment(config, self.workers, start_topology_router(group, config, doc, *router_args, env=router_env))
        finally:
            group.stop()


def _idle(url: str) -> bool:
    """Nothing running or queued on the worker at ``url``, no bootstrap room open."""
    load = http_sync.get_json(url + "/v1/loads", timeout_s=5)["loads"][0]
    return load["num_running_reqs"] == 0 and load["num_waiting_reqs"] == 0 and scrape_metric(url, "prfaas:open_rooms") == 0


@pytest.fixture(scope="session")
def emulated_pair(tmp_path_factory) -> Iterator[SharedWorkers]:
    doc = local_topology(speedup=50, kv_scale=0.002, telemetry=False, router=False)
    pair = SharedWorkers.start(tmp_path_factory.mktemp(EMULATED_PAIR) / "logs", doc,
                               engine_args={role: ("--bootstrap-timeout-s", "10") for role in ENGINE_ROLES})
    yield pair
    pair.stop()


@pytest.fixture(scope="session")
def realtime_pair(tmp_path_factory) -> Iterator[SharedWorkers]:
    from helpers import start_real_time_pd_pair

    group = ProcessGroup(tmp_path_factory.mktemp(REALTIME_PAIR) / "logs")
    try:
        pair = SharedWorkers.running(group, start_real_time_pd_pair(group))
    except BaseException:
        group.stop()
        raise
    yield pair
    pair.stop()


@pytest.fixture(scope="session")
def cpu_model(tmp_path_factory) -> Path:
    """The tiny Llama every real SGLang server here serves (random weights, SGLang's CPU engine)."""
    from prfaas_sglang.gpu.tiny_model import make_model

    model_dir = tmp_path_factory.mktemp("tiny-cpu") / "model"
    make_model(model_dir, cpu=True, log=lambda _line: None)
    return model_dir


@pytest.fixture(scope="session")
def sglang_cpu(cpu_model):
    """The real-SGLang deployment (see the module); ``ctx.lines``: what the harness logged."""
    from helpers import harness_checks

    from prfaas_sglang.gpu import checks

    lines: list[str] = []
    with checks.deployment("sglang-cpu", harness_checks(), lines.append, model_config=cpu_model) as ctx:
        ctx.lines = lines
        yield ctx


@pytest.fixture
def sglang_cpu_ready(sglang_cpu):
    """:func:`sglang_cpu`, every server healthy and routed to (a previous user may have killed one)."""
    from prfaas_sglang.gpu import checks

    checks.restore(sglang_cpu)
    return sglang_cpu


@pytest.fixture(scope="session")
def cpu_profile(cpu_model, tmp_path_factory):
    """``bench profile --engine sglang-cpu`` once, on :func:`cpu_model`: (the profile file, the command's JSON
    result). Its server is its own, started and stopped by the command."""
    import json
    import subprocess
    import sys

    out = tmp_path_factory.mktemp("profile") / "cpu.yaml"
    proc = subprocess.run([sys.executable, "-m", "prfaas_sglang.bench", "profile", "--engine", "sglang-cpu",
                           "--model-config", str(cpu_model), "--out", str(out), "--json"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, json.loads(proc.stdout)


@pytest.hookimpl(trylast=True)  # after tests/conftest.py's and pytest-xdist's own
def pytest_collection_modifyitems(config, items):
    """A test using a shared deployment must run in its group's worker process: else a second
    process starts the workers again (and ``--dist loadgroup`` no longer keeps the users together)."""
    for item in items:
        for fixture, group in SHARED.items():
            if fixture not in getattr(item, "fixturenames", ()):
                continue
            mark = item.get_closest_marker("xdist_group")
            if mark is None or _group_name(mark) != group:
                raise pytest.UsageError(f"{item.nodeid} uses the session fixture {fixture}: mark it "
                                        f"pytest.mark.xdist_group({group!r}) (tests/deployments.py)")


def _group_name(mark) -> str:
    """An ``xdist_group`` mark's group, read as pytest-xdist reads it."""
    return str(mark.args[0] if mark.args else mark.kwargs.get("name", "default"))
