"""SGLang's own Mooncake sender and receiver on CPU with our hooks installed (real objects, real TCP).

``sglang_mooncake_probe.py`` runs in a subprocess (one Mooncake engine per process; SGLang's
listener threads never exit): the plugin's ``register()``, a bootstrap server, prefill and decode
``MooncakeKVManager`` over host buffers, three requests of three chunks each. As the launcher
starts a PrfaaS worker (PRFAAS_ROLE=prfaas, PRFAAS_TELEMETRY_PORT), the prefill manager meters every
chunk's batch and publishes wire-v3 telemetry; the KV still arrives intact. Without the variables the
hooks change nothing.
"""

from __future__ import annotations

import pytest
from sglang_cpu import run_probe

from prfaas_sglang.demo.cluster import PortPicker
from prfaas_sglang.wire import telemetry


def run_as(prfaas_worker: bool) -> dict:
    if prfaas_worker:  # as the launcher starts a PrfaaS node with a telemetry port
        return run_probe(PRFAAS_ROLE="prfaas", PRFAAS_TELEMETRY_PORT=str(PortPicker()()))
    return run_probe()


@pytest.mark.slow
def test_a_prfaas_prefill_worker_meters_and_publishes_its_kv_transfers():
    out = run_as(prfaas_worker=True)
    assert all(r["sender"] == r["receiver"] == out["success"] and r["kv_intact"] and r["aux_intact"]
               for r in out["requests"]), out["requests"]
    per_request = out["kv_bytes_per_request"] + out["aux_bytes_per_request"]
    assert out["metered_bytes"] == 3 * per_request  # every byte SGLang sent, KV and aux
    assert out["metered_transfers"] == 3 * (3 + 1)  # per request: one batch per chunk, then the aux
    assert not out["decode_has_telemetry"]  # only the prefill side of the WAN leg publishes
    samples = out["samples"]
    assert samples and all(s["v"] == telemetry.WIRE_VERSION for s in samples)
    # Since v4: per decode peer (its Mooncake session), what the transfers came to; none failed here.
    peers = {name for s in samples for name in (s["peers"] or {})}
    assert len(peers) == 1 and all(s["failed"] == 0 for s in samples)
    assert sum(s["completed"] for s in samples) >= 1 and any(s["latency_p50_s"] for s in samples)
    assert max(s["egress_bps"] for s in samples) > 0
    assert any(s["tcp"] is not None for s in samples)  # the kernel's view of the Mooncake connections


@pytest.mark.slow
def test_without_the_role_the_hooks_change_nothing():
    out = run_as(prfaas_worker=False)
    assert all(r["sender"] == r["receiver"] == out["success"] and r["kv_intact"] for r in out["requests"])
    assert out["metered_bytes"] is None and out["samples"] == []
