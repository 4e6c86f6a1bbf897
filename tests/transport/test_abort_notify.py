"""A decode's abort notice to a dead prefill rank (the ``abort-notify-nonblocking`` hook).

SGLang 0.5.15's own ``MooncakeKVReceiver.abort`` with its own cached ZMQ sockets and a real prefill
endpoint (``abort_notify_probe.py``, one process per case, so a send that never returns cannot hang
pytest): the notice reaches a live prefill rank; once that rank has died, stock SGLang blocks in
the send for good (the decode scheduler's main thread, in a server), and with our plugin the abort
returns at once, the room still recorded failed.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

PROBE = Path(__file__).with_name("abort_notify_probe.py")


def run_probe(mode: str) -> dict[str, dict]:
    """Steps the probe printed, by name (the probe reports an abort that does not return as ``blocked``)."""
    out = subprocess.run([sys.executable, str(PROBE), mode], capture_output=True, text=True,
                         timeout=120).stdout
    return {step["step"]: step for step in map(json.loads, filter(lambda line: line.startswith("{"),
                                                                   out.splitlines()))}


def test_stock_sglang_blocks_its_abort_on_a_dead_prefill():
    """The fault the hook exists for, so the next test can fail: without it the abort never returns."""
    steps = run_probe("stock")
    assert steps["live"]["notice"] == ["ABORT", "7", "127.0.0.1", "40000"]
    assert steps["dead"]["peer_gone"]
    assert "blocked" in steps and "aborted" not in steps


def test_with_the_plugin_the_abort_returns_and_a_live_prefill_still_gets_the_notice():
    steps = run_probe("hooked")
    assert "blocked" not in steps
    assert steps["live"]["notice"] == ["ABORT", "7", "127.0.0.1", "40000"]
    assert steps["dead"]["peer_gone"]
    aborted = steps["aborted"]
    assert aborted["failed"] == [7, 8]  # both rooms recorded failed, as SGLang does
    assert aborted["notified"]  # SGLang does not try again on a later abort
    assert not aborted["shadow_left"]  # the receiver is left as SGLang made it
