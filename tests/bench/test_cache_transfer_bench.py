"""``bench cache-transfer`` end to end at its smallest setting: a router + emulated workers over a shaped
link (root), one rate, one length, one repeat (about 15 s)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from prfaas_sglang.bench.cache_transfer import PAGE
from prfaas_sglang.demo import netns


@pytest.mark.slow
@pytest.mark.skipif(netns.available() is not None, reason=f"shaped link: {netns.available()}")
def test_every_mode_runs_where_the_rule_places_it_over_a_slow_link():
    """At 2 Gbps and 16K tokens (``t`` 8K): the warm-up prefills on PrfaaS and the timed turn runs where
    each mode's rule puts it (the benchmark checks every route); the forced move keeps the prefix, the
    next turn stays in the PD cluster unless the other cluster's cache is not credited (``off``).
    Before the warm-up was one send under ``PRFAAS_PREFILL_CACHE=all``, its second send went to PD-P
    at this setting and the benchmark stopped."""
    proc = subprocess.run([sys.executable, "-m", "prfaas_sglang.bench", "cache-transfer", "--rates-gbps", "2",
                           "--lengths", "16384", "--repeats", "1", "--json"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (rate,) = json.loads(proc.stdout)["result"]["rates"]
    (row,) = rate["lengths"]
    assert row["moved_runs"] == row["recomputed_runs"] == row["off_runs"] == row["auto_runs"] == 1
    assert row["moved_cached_tokens"] >= 3 * PAGE and row["predicted_transfer_s"] is not None
    assert row["next_turn_routes"]["always"] == row["next_turn_routes"]["never"] == ["pd/pd-prefill-0/pd-decode-0"]
    assert row["next_turn_routes"]["off"] == ["prfaas/prfaas-0/pd-decode-0"]
