"""Helpers shared by all test packages (import as ``helpers``; ``conftest`` names differ per directory)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from prfaas_sglang.envs import envs

REPO_ROOT = Path(__file__).resolve().parents[1]
FIXTURE_PATCHES = REPO_ROOT / "tests" / "fixtures" / "patches"
# The public Mooncake conversation trace; a checkout away from ../shared names it in PRFAAS_TRACE_PATH.
TRACE = Path(envs.TRACE_PATH.get() or REPO_ROOT.parent / "shared" / "data" / "mooncake_conversation_trace.jsonl")


def run_py(args: list[str], env: dict[str, str] | None = None, timeout: float = 120, cwd: Path = REPO_ROOT):
    """Run ``python <args>`` with this interpreter; returns CompletedProcess (text)."""
    full_env = {**os.environ, **(env or {})}
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, env=full_env, timeout=timeout, cwd=cwd
    )
