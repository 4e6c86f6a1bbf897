"""Shared test helpers.

Tests that change process-global state of SGLang (its HookRegistry, patched
functions) run in a subprocess so that the rest of the suite sees stock
SGLang.
"""

from __future__ import annotations

import functools
import json
import os
import resource
import shutil
import sys
import time
from pathlib import Path

import pytest
from helpers import FIXTURE_PATCHES, REPO_ROOT, run_py  # noqa: F401 - re-exported for tests
from hypothesis import HealthCheck, settings

from prfaas_sglang.envs import envs
from prfaas_sglang.gpu.e2e import CPU_POLL_WAIT

pytest_plugins = ["deployments"]  # emulated deployments shared across test files (tests/deployments.py)
# The suite runs its workers beside servers on two cores: how long an example takes to draw or to run
# says how busy the machine is, not whether the property holds, so neither is a failure (a too-slow
# health check failed a property test in a loaded run). CI (CI=true) draws the same examples on every
# run, so a red build is reproducible; local runs keep exploring new ones.
_UNTIMED = {"deadline": None, "suppress_health_check": [HealthCheck.too_slow]}
settings.register_profile("suite", **_UNTIMED)
settings.register_profile("ci", derandomize=True, print_blob=True, **_UNTIMED)
settings.load_profile("ci" if os.environ.get("CI") else "suite")

# Every real SGLang server a test starts shares the two cores with the rest of the suite: its scheduler
# waits on its sockets, 5 ms at a time, while a request is in flight with nothing to run (the
# scheduler-poll-wait hook), instead of spinning a core (gpu/e2e.py CPU_PROFILE sets the same).
os.environ.setdefault(*CPU_POLL_WAIT)


def pytest_configure(config):
    """Under pytest-xdist each worker picks its servers' ports from a slice of its own of the one
    picker's range (``PRFAAS_PORT_RANGE``, inherited by every process the worker starts), so two
    workers never pick the same port between a pick and its server's bind."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")  # "gw0", "gw1", ...
    if not worker:
        return
    from prfaas_sglang.demo.cluster import own_port_range

    index, count = int(worker.removeprefix("gw")), int(os.environ["PYTEST_XDIST_WORKER_COUNT"])
    low, high = own_port_range()
    width = (high - low) // count
    os.environ["PRFAAS_PORT_RANGE"] = f"{low + index * width}-{low + (index + 1) * width}"


@functools.cache
def release_leg() -> tuple[str, ...]:
    """The tests that differ by SGLang release (:func:`prfaas_sglang._compat.release_tests.release_dependent_tests`):
    marked ``sglang``, what `make test-sglang SGLANG=VERSION` runs against another supported release."""
    from prfaas_sglang._compat.release_tests import release_dependent_tests

    return release_dependent_tests()


def in_release_leg(nodeid: str) -> bool:
    """Whether the test ``nodeid`` is one of :func:`release_leg` (its file, class or test named there)."""
    base = nodeid.split("[", 1)[0]
    return any(base == entry or base.startswith(entry + "::") for entry in release_leg())


DURATIONS = REPO_ROOT / "tests" / "durations.json"  # group -> seconds, from a whole run (scripts/test_report.py)
SLOW_TEST_S, QUICK_TEST_S = 15.0, 0.05  # a group's estimate where DURATIONS does not know it


def group_of(item) -> str:
    """The item's ``xdist_group``: the one it names (a deployment shared across files), else its file's path,
    so a file's module-scoped fixtures are made once, on the worker that runs the whole file."""
    mark = item.get_closest_marker("xdist_group")
    if mark is not None:
        return str(mark.args[0] if mark.args else mark.kwargs.get("name", "default"))
    return Path(item.path).relative_to(REPO_ROOT).as_posix()


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own, which reads the xdist_group marks
def pytest_collection_modifyitems(config, items):
    """Marks ``sglang`` on the release leg's tests; gives every test its group (:func:`group_of`), and orders
    the groups longest first (``tests/durations.json``, else a count of its tests marked ``slow``): pytest-xdist
    (``--dist loadgroup --no-loadscope-reorder``) hands them out in this order, so no long one starts last."""
    for item in items:
        if in_release_leg(item.nodeid):
            item.add_marker(pytest.mark.sglang)
        if item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(group_of(item)))
    known = json.loads(DURATIONS.read_text()) if DURATIONS.is_file() else {}
    estimate: dict[str, float] = {}
    for item in items:
        group = group_of(item)
        estimate[group] = estimate.get(group, 0.0) + (SLOW_TEST_S if item.get_closest_marker("slow") else QUICK_TEST_S)
    cost = {group: known.get(group, guess) for group, guess in estimate.items()}
    order = {id(item): i for i, item in enumerate(items)}
    items.sort(key=lambda item: (-cost[group_of(item)], group_of(item), order[id(item)]))
    write_serial_plan(items)


def write_serial_plan(items) -> None:
    """With ``PRFAAS_TEST_SERIAL_PLAN`` (a directory; the pinned release's parallel phase, which collects the
    whole suite and deselects the serial tests after this hook), the node ids of the tests marked ``serial``:
    ``alone``, those of the real-SGLang deployment's group (:data:`deployments.SGLANG_CPU`: four or five
    servers on the two cores), which run one after another; ``beside``, the rest, timing tests on a few
    emulated engines (a tenth of a core each, measured 2026-11-30), which run beside each other and beside
    them. scripts/run-tests.sh waits for the plan and runs the two beside the parallel phases, at a higher
    priority than theirs; each pytest-xdist worker writes the same."""
    plan_dir = envs.TEST_SERIAL_PLAN.get()
    if not plan_dir:
        return
    from deployments import SGLANG_CPU

    plan: dict[str, list[str]] = {"alone": [], "beside": []}
    for item in items:  # in the order they would run; before pytest-xdist appends "@GROUP" to the node ids
        if item.get_closest_marker("serial") is not None:
            plan["alone" if group_of(item) == SGLANG_CPU else "beside"].append(item.nodeid)
    Path(plan_dir).mkdir(parents=True, exist_ok=True)
    for name, nodeids in plan.items():
        tmp = Path(plan_dir) / f".{name}.{os.getpid()}"
        tmp.write_text("".join(f"{nodeid}\n" for nodeid in nodeids))
        os.replace(tmp, Path(plan_dir) / name)


PHASE_OUTCOMES = pytest.StashKey[list]()


def _cpu_s() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    report = (yield).get_result()
    item.stash.setdefault(PHASE_OUTCOMES, []).append(report.outcome)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """With ``PRFAAS_TEST_REPORT`` set, appends the test's wall time (setup, call and teardown), its CPU
    time (this process's and its reaped children's: a child still running, a deployment the next test shares,
    is counted where it is reaped), outcome and group to that file: the suite's own total and slowest tests,
    printed at the end of `make test`."""
    began, cpu_began = time.monotonic(), _cpu_s()
    yield
    path = envs.TEST_REPORT.get()
    if path:
        outcomes = item.stash.get(PHASE_OUTCOMES, [])
        nodeid = item.nodeid  # pytest-xdist (--dist loadgroup) appends "@GROUP"
        if nodeid.rfind("@") > nodeid.rfind("]"):
            nodeid = nodeid.rsplit("@", 1)[0]
        record = {"test": nodeid, "group": group_of(item), "s": round(time.monotonic() - began, 3),
                  "cpu_s": round(_cpu_s() - cpu_began, 3),
                  "outcome": next((o for o in outcomes if o != "passed"), "passed"), "pid": os.getpid()}
        with open(path, "a") as out:  # one short line per write: appends from parallel workers stay whole
            out.write(json.dumps(record) + "\n")


def pytest_sessionfinish(session, exitstatus):
    """The SGLang zygote this process started (tests/zygote.py), if it did, goes with it."""
    if "zygote" in sys.modules:
        sys.modules["zygote"].stop()


@pytest.fixture(autouse=True)
def _sglang_stays_stock(request):
    """Keeps the rule above: a test that registers hooks with SGLang's HookRegistry in the test process
    (our plugin's ``register()``, ``install_hooks``) fails, named, instead of a later test failing on
    hooked SGLang (a decode hook reading what its test's queue lacks, depending on the order)."""
    yield
    registry = sys.modules.get("sglang.srt.plugins.hook_registry")
    if registry is None:
        return
    hooked = sorted(registry.HookRegistry._hooks) + sorted(registry.HookRegistry._patched)
    if hooked:
        registry.HookRegistry.reset()  # what is already patched stays so; the next test's check starts clean
        pytest.fail(f"{request.node.nodeid} left SGLang hooked in the test process ({', '.join(hooked[:3])}"
                    f"{', ...' if len(hooked) > 3 else ''}); register hooks in a subprocess", pytrace=False)


@pytest.fixture
def installed_sglang_root() -> Path:
    from prfaas_sglang._compat import installed_sglang_root as find

    root = find()
    assert root is not None, "the CPU test environment installs sglang (make env)"
    return root


@pytest.fixture
def sglang_tree(tmp_path: Path, installed_sglang_root: Path) -> Path:
    """A small real sglang 0.5.15 tree: the files the fixture series touches, copied."""
    root = tmp_path / "site"
    for rel in ("sglang/_version.py", "sglang/srt/plugins/__init__.py"):
        dst = root / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(installed_sglang_root / rel, dst)
    return root


@pytest.fixture
def fixture_series_dir(tmp_path: Path) -> Path:
    """A writable copy of tests/fixtures/patches."""
    dst = tmp_path / "patches"
    shutil.copytree(FIXTURE_PATCHES, dst)
    return dst
