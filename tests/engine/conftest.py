"""Real emulated workers (and peers) as subprocesses on free loopback ports.

Built on :mod:`prfaas_sglang.demo.cluster`: every child runs in its own process
group and the group is killed at teardown, so nothing outlives a test.
"""

from __future__ import annotations

import pytest

from prfaas_sglang.demo.cluster import ProcessGroup, free_port, start_mock_worker  # noqa: F401 - re-exported

PREFILL_PROFILE = "kimi-linear-1t-hybrid@h200x8"
DECODE_PROFILE = "kimi-linear-1t-hybrid@h20x8"


def start_worker(procs: ProcessGroup, role: str, profile: str, *extra: str, events: bool = False,
                 env: dict[str, str] | None = None):
    return start_mock_worker(procs, f"{role}-{len(procs.procs)}", role, profile, list(extra), events=events, env=env)




@pytest.fixture
def procs(tmp_path):
    group = ProcessGroup(tmp_path)
    yield group
    group.stop()


@pytest.fixture(scope="module")
def module_procs(tmp_path_factory):
    group = ProcessGroup(tmp_path_factory.mktemp("procs"))
    yield group
    group.stop()
