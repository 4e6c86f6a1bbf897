"""The 60 s chaos run in CI (issue #16 item 5): every fault once (kill -9 and restart of each worker
and of the router, malformed ZMQ frames, a black-holed and a throttled PrfaaS link, fuzzed HTTP, and, the link
being encrypted, its WireGuard tunnel taken down) under a mixed load, clients behind the router's front (the default, as in Kubernetes). Asserted:
what does not depend on timing (nothing hung, no stream truncated without an error event, every
non-ok answer a typed error, no connection broken, nothing held at rest, every fault recovered
from); without the front, connections broken only by the router's own death. Recovery times and
RSS growth are the recorded run's (BENCHMARKS.md), not assertions here."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from prfaas_sglang.bench import chaos
from prfaas_sglang.demo import netns

pytestmark = pytest.mark.skipif(netns.available() is not None, reason=f"the PrfaaS link's namespace: {netns.available()}")


@pytest.mark.slow
def test_sixty_seconds_of_chaos_leave_nothing_hung_truncated_reset_or_held():
    proc = subprocess.run([sys.executable, "-m", "prfaas_sglang.bench", "chaos", "--duration", "60", "--encrypt", "--json"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)["result"]
    assert chaos.verdict(result) == [], chaos.render_markdown(result)
    tally = result["tally"]
    assert tally["sent"] >= 60 and tally["ok"] >= tally["sent"] // 2, tally
    # the link encrypted (--encrypt): its tunnel taken down is one more fault, routed around like a dead link
    assert sorted(r["fault"] for r in result["faults"]) == sorted(chaos.FAULTS + chaos.ENCRYPTED_FAULTS)
    assert result["encrypted"] is True
    garbage = next(r for r in result["faults"] if r["fault"] == "zmq-garbage")
    assert garbage["garbage_frames"] > 0
    fuzz = next(r for r in result["faults"] if r["fault"] == "http-fuzz")
    assert sum(fuzz["statuses"].values()) == 200 and not any(s.startswith("5") for s in fuzz["statuses"])
    assert set(result["leaks"]) == {"prfaas-0", "pd-prefill-0", "pd-decode-0"}
    assert len(result["router_rss"]["processes"]) == 2  # the router was killed once: two processes
    assert result["front"] is True and tally["reset"] == 0  # behind the front (the default), as in Kubernetes


@pytest.mark.slow
def test_without_the_front_connections_break_only_while_the_router_is_dead():
    """Clients sent straight to the router (--no-front): a killed router can only reset its own
    connections; nothing else breaks, hangs or is truncated."""
    proc = subprocess.run([sys.executable, "-m", "prfaas_sglang.bench", "chaos", "--duration", "30", "--no-front",
                           "--faults", "kill-router,kill-pd-decode-0", "--json"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)["result"]
    assert result["front"] is False and chaos.verdict(result) == [], chaos.render_markdown(result)
    assert sorted(r["fault"] for r in result["faults"]) == ["kill-pd-decode-0", "kill-router"]


def test_the_verdict_names_each_kind_of_failure():
    clean = {"tally": {"hung": 0, "truncated": 0, "reset_outside_router_faults": 0, "untyped_errors": []},
             "leaks": {"w": {"prfaas:open_rooms": 0.0, "prfaas:kv_pool_used_tokens": 0.0, "leaked_kv_bytes": 0.0}},
             "faults": [{"fault": "http-fuzz", "recovery_s": 0.1, "statuses": {"400": 3, "503": 1}}]}
    assert chaos.verdict(clean) == []
    fronted = {**json.loads(json.dumps(clean)), "front": True}
    fronted["tally"]["reset"] = 2  # behind the front, even a router kill may break no connection
    assert chaos.verdict(fronted) == ["2 reset"] and chaos.verdict({**fronted, "front": False}) == []
    bad = json.loads(json.dumps(clean))
    bad["tally"].update(hung=1, truncated=2, reset_outside_router_faults=3, untyped_errors=["502: <html>"])
    bad["leaks"]["w"].update({"prfaas:open_rooms": 1.0, "leaked_kv_bytes": 4096.0})
    bad["faults"] = [{"fault": "kill-router", "recovery_s": None, "not_recovered_because": "link down ['prfaas-0']"}, {"fault": "http-fuzz", "recovery_s": 0.1, "statuses": {"500": 1}}]
    bad["wire"] = {"ports": [51820, 22777], "tunnel_port": 51820, "protocols": {"udp": 9, "tcp": 1}, "not_ipv4": 0,
                   "dropped": 0}
    problems = " | ".join(chaos.verdict(bad))
    for words in ("1 hung", "2 truncated", "3 reset_outside_router_faults", "untyped", "rooms open", "landing-buffer bytes",
                  "kill-router: not recovered (link down", "http-fuzz: answered 500", "carried more than its tunnel"):
        assert words in problems, (words, problems)


def test_faults_are_chosen_by_name_and_a_bad_choice_is_refused():
    from helpers import run_py

    for bad in (["--faults", "kill-everything"], ["--faults", ","], ["--faults", "http-fuzz", "--duration", "20",
                                                                   "--rounds", "9"]):
        r = run_py(["-m", "prfaas_sglang.bench", "chaos", *bad])
        assert r.returncode == 2 and "error" in r.stderr, (bad, r.stderr[-300:])
