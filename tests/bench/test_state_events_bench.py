"""``bench state-events`` on the trace's first requests, both caches it compares (SGLang's per-kind caches on
CPU, in process: a few seconds once SGLang's caches are imported)."""

from __future__ import annotations

import pytest
from helpers import TRACE

from prfaas_sglang._compat import RADIX_TREES, installed_has
from prfaas_sglang.bench import state_events

pytest.importorskip("torch")
import sglang  # noqa: E402, F401 - the bench drives the installed SGLang's own caches (marker sglang)

if not installed_has(RADIX_TREES):
    pytest.skip("the bench compares SGLang 0.5.15's per-kind caches, which this release does not have",
                allow_module_level=True)


@pytest.mark.slow
@pytest.mark.parametrize("cache", ["mamba", "swa"])
def test_stock_and_ours_take_the_same_stream_match_alike_and_ours_adds_only_the_state_it_owes(cache):
    """Both caches hit the same tokens on every request. A hybrid's cache adds state events (a Mamba state
    stored per request) and their bytes; a window model's adds none on this prefill-side stream (no
    tombstones), only one empty state list per batch (one byte)."""
    result = state_events.run(str(TRACE), requests=3, page_sizes=(64,), kv_tokens=1 << 14, mamba_slots=8,
                              cache=cache)
    (row,) = result["rows"]
    assert row["requests"] == 3 and row["hits_equal"], row
    if cache == "mamba":
        assert row["state_events_stored"] > 0 and row["ours_events"] > row["stock_events"] > 0
        assert row["ours_bytes"] > row["stock_bytes"] > 0
    else:
        assert row["state_events_stored"] == row["state_events_removed"] == 0
        assert row["ours_events"] == row["stock_events"] > 0 and row["ours_bytes"] == row["stock_bytes"] + 3
    assert len(state_events.render_markdown(result).splitlines()) == 5
