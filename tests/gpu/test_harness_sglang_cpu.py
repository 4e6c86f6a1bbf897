"""``bench gpu-e2e --engine sglang-cpu``: the harness's checks on real SGLang servers on this CPU, on every
supported release (this module runs in the 0.5.23 leg too: it drives ``engine="sglang-cpu"``)."""

from __future__ import annotations

import pytest
from helpers import harness_checks

from prfaas_sglang.gpu import checks
from prfaas_sglang.gpu.e2e import summary


@pytest.mark.slow
# Four or five SGLang servers on the two cores: serial, so at a higher priority than the parallel part (which runs at
# nice 10). Among it at equal priority (its own file since 2026-11-28, so --dist loadfile ran it next to other heavy
# files), two timing tests failed in two fresh-clone runs.
@pytest.mark.serial
@pytest.mark.xdist_group("sglang-cpu")  # the session's real-SGLang deployment (tests/deployments.py)
def test_real_sglang_on_cpu_serves_both_routes_and_switches_roles_through_the_launcher(sglang_cpu_ready):
    """Real SGLang servers on this CPU (a tiny Llama, SGLang's CPU engine) started by our launcher in every
    role, behind our router: short prompts prefilled on PD-P, long ones on PrfaaS with their KV over
    Mooncake TCP through the kv-send hooks (staging buffer and decode reserve on, as the profiles set
    them). Its first runs found faults no emulated engine shows (docs/real-sglang.md):

    * routing: the threshold's routes, and SGLang's own request counters agree (they were missing
      from /metrics: hook ``metrics-multiproc-values``);
    * kv-index: its predicted reuse equals SGLang's ``cached_tokens`` for a prompt's first, second and
      third sighting and an extension (the PrfaaS worker keeps a prefix once seen twice);
    * cache-move: a prefix cached on PD-P only is moved to the PrfaaS server through the cache-move
      routes, and a longer prompt routed there reuses it (on 0.5.23 through its unified tree);
    * failover: the PrfaaS server killed with long requests in flight; each completes (re-run on PD-P)
      or fails with a clear error, none hangs (all hung on SGLang's blocking abort notice to the dead
      prefill: hook ``abort-notify-nonblocking``);
    * role-switch, where SGLang serves ``/pd_role_switch`` (0.5.23): the router turns a PD prefill
      worker into decode and back in place while two clients send prompts; it serves requests in each
      role and none is lost (a decode that had served it kept its old endpoint after the switch back:
      hook ``decode-peer-rebootstrap``, ``RouterConfig.prefill_rejoin_s``)."""
    asked = harness_checks()  # on the session's deployment (conftest.py); its next user restores what failover killed
    switch = "role-switch" in asked
    result = summary(checks.run_checks(sglang_cpu_ready, asked), {})
    assert result["ok"], result["failed"]
    assert result["checks"]["routing"]["routed"] == {"prfaas": 2, "pd": 2}
    # SGLang's own counters agree: the prefills served their route's two, the decode all four
    engines = result["checks"]["routing"]["engines"]
    assert (engines["prfaas-0"], engines["pd-decode-0"]) == (2, 4)
    assert sum(n for name, n in engines.items() if name.startswith("pd-prefill-")) == 2
    rows = {row["prompt"]: row for row in result["checks"]["kv-index"]["rows"]}
    assert rows["repeat"]["cached_tokens"] > 0 and rows["extend"]["cached_tokens"] > 0  # a cache that hits
    move = result["checks"]["cache-move"]  # PD-P -> PrfaaS over Mooncake TCP, then reused there by SGLang
    assert move["imported_tokens"] == move["tokens"] and move["again_imported"] == 0
    assert move["longer_cached_tokens"] >= move["imported_tokens"]
    failover = result["checks"]["failover"]
    assert failover["completed"] + failover["failed"] == 24 and failover["prfaas_healthy"] is False
    assert failover["redispatched"] >= 1  # the kill caught requests in flight, re-run on PD-P
    if switch:
        role_switch = result["checks"]["role-switch"]
        assert [(s["to"], s["status"], s["server_mode"]) for s in role_switch["steps"]] == [
            ("decode", 200, "decode"), ("prefill", 200, "prefill")]
        # in each role it served requests (its peer drained meanwhile), and nothing sent throughout was lost
        assert all(s["served"] >= checks.ROLE_SWITCH_SERVED for s in role_switch["steps"])
        assert role_switch["lost"] == 0 and role_switch["requests"] > 0
