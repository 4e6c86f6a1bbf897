"""Shared test helpers.

Tests that change process-global state of SGLang (its HookRegistry, patched
functions) run in a subprocess so that the rest of the suite sees stock
SGLang.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import sys
from pathlib import Path

import pytest
from helpers import FIXTURE_PATCHES, REPO_ROOT, run_py  # noqa: F401 - re-exported for tests
from hypothesis import settings

# CI (CI=true) draws the same hypothesis examples on every run, so a red build is reproducible;
# local runs keep exploring new ones.
settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")


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


# A test module touches SGLang's own code when it imports sglang (anywhere in it), runs one of the
# probes that do (tests/*/*_probe.py), or drives real SGLang through the CPU harness (``sglang_cpu``,
# ``engine="sglang-cpu"``).
_TOUCHES_SGLANG = re.compile(r"^\s*(?:from sglang[\s.]|import sglang\b)|_probe\.py|\bsglang_cpu\b|run_probe\("
                             r"|engine=\"sglang-cpu\"", re.M)


@functools.cache
def touches_sglang(path: Path) -> bool:
    """Whether the test module at ``path`` touches SGLang's own code (marker ``sglang``: the subset
    `make test-sglang SGLANG=VERSION` runs against another supported release); tests/drift always does."""
    return path.parent.name == "drift" or bool(_TOUCHES_SGLANG.search(path.read_text()))


def pytest_collection_modifyitems(config, items):
    """Marks ``sglang`` where a module touches SGLang's code (:func:`touches_sglang`: a rule, not a list).
    The files with the most tests marked ``slow`` run first (the order is stable otherwise): under
    pytest-xdist's ``--dist loadfile`` a long file started last would run alone at the end."""
    for item in items:
        if touches_sglang(Path(item.path)):
            item.add_marker(pytest.mark.sglang)
    slow_per_file: dict[str, int] = {}
    for item in items:
        slow_per_file[item.path] = slow_per_file.get(item.path, 0) + (item.get_closest_marker("slow") is not None)
    order = {id(item): i for i, item in enumerate(items)}
    items.sort(key=lambda item: (-slow_per_file[item.path], order[id(item)]))


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
