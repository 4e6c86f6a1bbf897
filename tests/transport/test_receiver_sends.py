"""A decode receiver's sends to a dead prefill rank (hooks ``abort-notify-nonblocking`` and
``metadata-send-nonblocking``).

SGLang 0.5.15's own ``MooncakeKVReceiver`` (its ``send_metadata`` and ``abort``) with its own cached
ZMQ sockets and a real prefill endpoint (``receiver_sends_probe.py``, one process per case, forked from the
SGLang zygote, so a send that never returns cannot hang pytest): both reach a live prefill rank; once that rank has died,
stock SGLang blocks in either send for good (the decode scheduler's main thread, in a server), and
with our plugin both return at once: the metadata's room is failed, the abort's room stays failed.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import zygote
from helpers import retired_here

# Both hooks are retired together on SGLang 0.5.23 (its receiver sockets send with a timeout).
pytestmark = [retired_here("abort-notify-nonblocking"), retired_here("metadata-send-nonblocking")]

PROBE = Path(__file__).with_name("receiver_sends_probe.py")


def run_probe(mode: str, dead: str) -> dict[str, dict]:
    """Steps the probe printed, by name (the probe reports a send that does not return as ``blocked``)."""
    out = zygote.run([sys.executable, str(PROBE), mode, dead], timeout=300).stdout
    return {step["step"]: step for step in map(json.loads, filter(lambda line: line.startswith("{"),
                                                                   out.splitlines()))}


@pytest.mark.slow
@pytest.mark.parametrize("dead", ["metadata", "abort"])
def test_stock_sglang_blocks_a_send_to_a_dead_prefill(dead):
    """The fault the hooks exist for, so the next test can fail: without them neither send returns."""
    steps = run_probe("stock", dead)
    assert steps["live"]["first_parts"] == ["9", "ABORT"]  # the metadata names its room first
    assert steps["dead"]["peer_gone"]
    assert "blocked" in steps and "metadata" not in steps and "aborted" not in steps


@pytest.mark.slow
def test_with_the_plugin_both_return_and_a_live_prefill_still_gets_them():
    steps = run_probe("hooked", "both")
    assert "blocked" not in steps
    assert steps["live"]["first_parts"] == ["9", "ABORT"] and steps["live"]["failed"] == [7]
    assert steps["dead"]["peer_gone"]
    metadata = steps["metadata"]
    assert metadata["status"] == "Failed" and "unreachable" in metadata["reason"]  # the decode releases it
    assert not metadata["shadow_left"]  # the receiver is left as SGLang made it
    aborted = steps["aborted"]
    assert aborted["status"] == "Failed" and aborted["notified"] and not aborted["shadow_left"]
