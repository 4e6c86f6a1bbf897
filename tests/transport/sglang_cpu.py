"""Run ``sglang_mooncake_probe.py`` (SGLang's own Mooncake classes on CPU) in a process of its own, forked from
the test process's SGLang zygote (``tests/zygote.py``), and read its result."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import zygote
from helpers import SGLANG_PROCESS_GUARD_S

from prfaas_sglang.demo.cluster import PortPicker

PROBE = Path(__file__).with_name("sglang_mooncake_probe.py")


def run_probe(**env_vars: str) -> dict:
    """The probe's JSON result, run with this environment less every PRFAAS_*, MC_* and SGLang
    session-probe variable, plus ``env_vars`` and a free BOOT_PORT. Fails on a probe error."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PRFAAS_", "MC_", "SGLANG_ENABLE_FAILED"))}
    env.update(BOOT_PORT=str(PortPicker()()), **env_vars)
    proc = zygote.run([sys.executable, str(PROBE)], env=env, timeout=SGLANG_PROCESS_GUARD_S)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert lines, proc.stdout[-1500:] + proc.stderr[-3000:]
    out = json.loads(lines[-1])
    assert "error" not in out, out["error"] + "\n" + proc.stderr[-3000:]
    return out
