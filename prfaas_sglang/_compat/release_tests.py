"""The tests that differ by SGLang release: what the second release's test leg runs (development side).

``python -m prfaas_sglang._compat.release_tests`` prints them, one a line (paths relative to the
repository, ``path::name`` for a single test of a file not named whole). They are the drift tests
(``tests/drift``), every test a hook or registered backend names (``plugin.HOOKS``,
``plugin.REGISTRATIONS``), every test a marker or an adapter function names (``Marker.tests``,
``fn.tests``: :func:`~prfaas_sglang._compat.exercised_by`), the tests that hold our code to SGLang's own
behaviour (:data:`COMPARED_WITH_SGLANG`), and the adapter's own tests.
``tests/unit/test_upstream_adapter.py`` checks that every one of those names a test that exists, and that
every test module importing SGLang is among them.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from types import FunctionType

from prfaas_sglang import _compat
from prfaas_sglang._compat import MARKERS, accessors
from prfaas_sglang.plugin import HOOKS, REGISTRATIONS

ADAPTER_TESTS = "tests/unit/test_upstream_adapter.py"
DRIFT_DIR = "tests/drift"
# Tests that hold a computation of ours to SGLang's own (its hash, its argument parser, its server_info, its
# caches' events): no marker or hook names them, yet a release that changed SGLang's side would fail them.
COMPARED_WITH_SGLANG = (
    "tests/engine/test_engine_pure.py::test_block_hash_matches_sglang_native_hash",  # get_hash_str, hash_str_to_int64
    "tests/unit/test_launch.py",  # the launcher's flags through SGLang's ServerArgs, its publisher and cache factories
    "tests/router/test_worker_facts.py",  # SGLang's /server_info, /v1/loads and io_struct, parsed as the router does
    "tests/bench/test_state_events_bench.py",  # the bench drives the installed SGLang's caches
    # SGLang's own processes (a real server's, its plugin loader) verify every hook, or stop on a broken one
    "tests/gpu/test_e2e_harness.py::test_every_sglang_process_reports_the_hooks_it_verified",
    "tests/gpu/test_e2e_harness.py::test_the_broken_hook_scaffold_stops_real_sglang_plugin_loading",
)
REPO_ROOT = Path(__file__).resolve().parents[2]


def split_tests(tests: str) -> tuple[str, ...]:
    """A ``tests`` field (space-separated) as its entries."""
    return tuple(tests.split())


def adapter_functions() -> Iterator[FunctionType]:
    """The adapter's release-dependent functions: those of :mod:`prfaas_sglang._compat` and
    :mod:`~prfaas_sglang._compat.accessors` marked with the tests that run them."""
    for module in (_compat, accessors):
        for fn in vars(module).values():
            if isinstance(fn, FunctionType) and fn.__module__ == module.__name__ and hasattr(fn, "tests"):
                yield fn


def named_tests() -> Iterator[tuple[str, str]]:
    """(who names it, test entry) for every test the specs, the markers and the adapter's functions name."""
    for spec in (*HOOKS, *REGISTRATIONS):
        yield from ((f"spec {spec.name}", entry) for entry in split_tests(spec.tests))
    for name, marker in vars(_compat).items():
        if marker in MARKERS:
            yield from ((f"marker {name}", entry) for entry in split_tests(marker.tests))
    for fn in adapter_functions():
        yield from ((f"{fn.__module__}.{fn.__name__}", entry) for entry in split_tests(fn.tests))


def release_dependent_tests(repo_root: Path = REPO_ROOT) -> tuple[str, ...]:
    """Every test that differs by release (see the module docstring), sorted; a ``path::name`` entry is
    left out where its whole file is listed. Reads only the names of ``tests/drift``'s files."""
    entries = {entry for _, entry in named_tests()} | {ADAPTER_TESTS, *COMPARED_WITH_SGLANG}
    entries |= {path.relative_to(repo_root).as_posix() for path in (repo_root / DRIFT_DIR).glob("test_*.py")}
    return tuple(sorted(_without_covered(entries)))


def _without_covered(entries: Iterable[str]) -> Iterator[str]:
    entries = set(entries)
    for entry in entries:
        if "::" not in entry or entry.split("::", 1)[0] not in entries:
            yield entry


def main() -> int:
    print("\n".join(release_dependent_tests()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
