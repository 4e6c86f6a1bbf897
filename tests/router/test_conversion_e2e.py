"""P/D role conversion end to end on emulated deployments (issue #18): a PD-P worker drained under
load and turned into a decode worker, the router and the kv-index following, no request lost; the
refusals and the failure path; and the same through the launcher's supervisor (SGLang 0.5.15's
drain + restart), behind the same endpoint."""

from __future__ import annotations

import concurrent.futures
import time

import pytest
import requests

from prfaas_sglang.demo.cluster import ProcessGroup, local_topology, start_deployment

TOKEN = "conversion-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
SPEEDUP, KV_SCALE = 5, 0.002
THRESHOLD = 6_000  # short prompts (< t) go to a PD-P worker, long ones to PrfaaS


def _deploy(tmp_path, role_switch: str):
    group = ProcessGroup(tmp_path / "logs")
    doc = local_topology(pd_prefill=2, pd_decode=1, speedup=SPEEDUP, kv_scale=KV_SCALE, threshold_tokens=THRESHOLD,
                         telemetry=False, role_switch=role_switch)
    args = ("--bootstrap-timeout-s", "10", "--context-tokens", "32768")
    dep = start_deployment(group, doc, engine_args={r: args for r in ("prfaas", "pd-prefill", "pd-decode")},
                           router_env={"PRFAAS_ADMIN_TOKEN": TOKEN})
    return group, dep


def _status(url: str) -> dict:
    return requests.get(url + "/status", timeout=5).json()


def _wait(predicate, timeout_s: float = 20.0, what: str = "condition"):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def _generate(url: str, n: int, seed: int, max_new: int = 24) -> requests.Response:
    ids = [(seed * 7919 + i * 31) % 30_000 for i in range(n)]
    return requests.post(url + "/generate", json={"input_ids": ids, "sampling_params": {"max_new_tokens": max_new}}, timeout=120)


def _load(url: str, count: int, first_seed: int, pool: concurrent.futures.ThreadPoolExecutor):
    """``count`` requests, a third long (PrfaaS), the rest short (PD-P), sent 4 at a time."""
    return [pool.submit(_generate, url, 9_000 if i % 3 == 0 else 1_500 + 37 * i, first_seed + i) for i in range(count)]


def _convert(url: str, name: str, new_role: str, timeout_s: float = 60.0) -> requests.Response:
    return requests.post(url + f"/admin/workers/{name}/role", json={"new_role": new_role, "drain_timeout_s": timeout_s},
                         headers=AUTH, timeout=timeout_s + 30)


def _decodes_of_recent(url: str, last: int = 10) -> set[str]:
    return {r["decode"] for r in _status(url)["recent"][-last:]}


@pytest.mark.slow
def test_pd_prefill_becomes_decode_under_load_with_no_request_lost(tmp_path):
    group, dep = _deploy(tmp_path, "in-place")
    url = dep.router.url
    try:
        # warm both PD-P caches with short prompts; convert the one the kv-index says holds more
        for seed in range(6):
            assert _generate(url, 2_000 + seed, 100 + seed).status_code == 200
        workers = _wait(lambda: (lambda w: w if w["pd-prefill-0"]["index_blocks"] or w["pd-prefill-1"]["index_blocks"]
                                 else None)(_status(url)["workers"]), what="KV events of the PD-P workers")
        victim = max(("pd-prefill-0", "pd-prefill-1"), key=lambda n: workers[n]["index_blocks"] or 0)
        survivor = "pd-prefill-1" if victim == "pd-prefill-0" else "pd-prefill-0"
        assert workers[victim]["index_blocks"] > 0

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            futures = _load(url, 36, 1_000, pool)
            _wait(lambda: _status(url)["workers"][victim]["open_legs"], what=f"a request in flight on {victim}")
            reply = _convert(url, victim, "decode")
            futures += _load(url, 12, 2_000, pool)
            statuses = [f.result().status_code for f in futures]
        assert reply.status_code == 200, reply.text
        body = reply.json()
        assert (body["worker"], body["old_role"], body["new_role"]) == (victim, "prefill", "decode")
        assert body["drained_s"] > 0  # it was busy when asked: the router waited for its legs to end
        assert statuses == [200] * len(statuses), statuses  # nothing lost, before, during or after

        # the worker itself, the router's record and the kv-index follow
        info = requests.get(dep.workers[victim].url + "/server_info", timeout=5).json()
        assert info["disaggregation_mode"] == "decode"
        # re-adopted, and its decode KV room polled (until then the policy counts it as 0 free tokens)
        status = _wait(lambda: (lambda s: s if s["workers"][victim]["healthy"] and s["workers"][victim]["page_size"]
                                and s["workers"][victim]["kv_free_tokens"] else None)(_status(url)),
                       what="the converted worker re-adopted with its KV room known")
        record = status["workers"][victim]
        assert record["role"] == "decode" and not record["draining"]
        assert not record["index_blocks"]  # its prefix blocks left the index
        assert status["model"]["instances"] == {"prfaas": 1, "pd_prefill": 1, "pd_decode": 2}

        # new requests use it as a decode worker, and PD prefill goes to the survivor only
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            after = [f.result() for f in _load(url, 16, 3_000, pool)]
        assert all(r.status_code == 200 for r in after)
        recent = _status(url)["recent"]
        assert victim in {r["decode"] for r in recent}
        assert victim not in {r["prefill"] for r in recent}
        assert survivor in {r["prefill"] for r in recent if r["cluster"] == "pd"}

        # refusals: the last PD-P, a PrfaaS worker, an unknown one; nothing changes
        assert _convert(url, survivor, "decode").status_code == 409
        assert _convert(url, "prfaas-0", "decode").status_code == 409
        assert _convert(url, "nope", "decode").status_code == 404
        assert requests.post(url + f"/admin/workers/{victim}/role", json={"new_role": "both"}, headers=AUTH,
                             timeout=5).status_code == 400
        assert requests.post(url + f"/admin/workers/{victim}/role", json={"new_role": "prefill"},
                             timeout=5).status_code == 401
        assert _status(url)["workers"][survivor]["role"] == "prefill"

        # a rebuild that fails leaves the worker unhealthy and out of service; traffic goes on
        decode0 = dep.workers["pd-decode-0"]
        assert requests.post(decode0.url + "/prfaas/faults", json={"fail_role_switch": True}, timeout=5).ok
        failed = _convert(url, "pd-decode-0", "prefill")
        assert failed.status_code == 502 and "restart" in failed.json()["error"]["message"]
        assert requests.get(decode0.url + "/health", timeout=5).status_code == 503
        assert not _status(url)["workers"]["pd-decode-0"]["healthy"]
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            assert all(f.result().status_code == 200 for f in _load(url, 8, 4_000, pool))
        assert _decodes_of_recent(url, 8) == {victim}
        refused = requests.post(decode0.url + "/pd_role_switch", json={"new_role": "prefill"}, timeout=5)
        assert refused.status_code == 400 and refused.json()["safe_to_restore"] is False
    finally:
        group.stop()


@pytest.mark.slow
def test_supervisor_restarts_the_engine_in_the_other_role(tmp_path):
    """SGLang 0.5.15's path (role_switch: restart): the launcher runs the engine under its supervisor,
    which answers /pd_role_switch by stopping the engine and starting it in the other role."""
    group, dep = _deploy(tmp_path, "restart")
    url = dep.router.url
    try:
        for worker in (dep.workers["pd-prefill-0"], dep.workers["pd-prefill-1"]):
            assert requests.get(worker.url + "/server_info", timeout=5).json()["disaggregation_mode"] == "prefill"
            supervisor = f"http://127.0.0.1:{worker.switch_port}"
            assert requests.get(supervisor + "/health", timeout=5).json()["role"] == "pd-prefill"
            # the engine itself has no in-place switch here (as SGLang 0.5.15): the supervisor is the adapter
            assert requests.post(worker.url + "/pd_role_switch", json={"new_role": "decode"}, timeout=5).status_code == 400
            assert requests.post(supervisor + "/pd_role_switch", json={"new_role": "sideways"}, timeout=5).status_code == 400

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            futures = _load(url, 24, 5_000, pool)
            # convert whichever PD-P worker is busy when looked at (the policy decides which gets the load)
            busy = _wait(lambda: next((n for n in ("pd-prefill-1", "pd-prefill-0") if _status(url)["workers"][n]["open_legs"]),
                                      None), timeout_s=40, what="a request in flight on a PD-P worker")
            victim = dep.workers[busy]
            supervisor = f"http://127.0.0.1:{victim.switch_port}"
            reply = _convert(url, victim.name, "decode", timeout_s=90)
            futures += _load(url, 8, 6_000, pool)
            statuses = [f.result().status_code for f in futures]
        assert reply.status_code == 200, reply.text
        assert reply.json()["message"] == "restarted as decode" and reply.json()["drained_s"] > 0
        assert statuses == [200] * len(statuses), statuses
        assert requests.get(victim.url + "/server_info", timeout=5).json()["disaggregation_mode"] == "decode"
        assert requests.get(supervisor + "/health", timeout=5).json()["role"] == "pd-decode"
        _wait(lambda: _status(url)["workers"][victim.name]["page_size"], what="the restarted worker re-adopted")
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            assert all(f.result().status_code == 200 for f in _load(url, 12, 7_000, pool))
        assert victim.name in _decodes_of_recent(url)
    finally:
        group.stop()


@pytest.mark.parametrize("node, problem", [
    ({"role": "prfaas", "role_switch": "in-place"}, "only pd-prefill and pd-decode"),
    ({"role": "pd-decode", "role_switch": "in-place"}, "bootstrap_port"),
    ({"role": "pd-prefill", "role_switch": "restart", "bootstrap_port": 9001}, "switch_port"),
    ({"role": "pd-prefill", "role_switch": "sometimes", "bootstrap_port": 9001}, "unknown mode"),
    ({"role": "pd-decode", "bootstrap_port": 9001}, "switchable PD nodes"),
])
def test_topology_refuses_bad_role_switch_settings(node, problem):
    from prfaas_sglang.errors import ConfigError
    from prfaas_sglang.topology import parse_topology

    kind = "prfaas" if node["role"] == "prfaas" else "pd"
    doc = {"version": 1, "clusters": {
        kind: {"kind": kind, "nodes": [{"name": "x", "port": 9000, **node}]},
        **({} if kind == "pd" else {"pd": {"kind": "pd", "nodes": [{"name": "d", "role": "pd-decode", "port": 9100}]}})}}
    with pytest.raises(ConfigError, match=problem):
        parse_topology(doc)


@pytest.mark.slow
def test_router_long_term_loop_converts_a_decode_worker_when_pd_prefill_saturates(tmp_path):
    """The router runs the simulator's long-term controller (``--long-term``): short prompts and short
    outputs keep both PD-P workers busy while decode idles, so it converts one decode worker into a
    prefill worker through the same path as the admin API; every request still succeeds."""
    group = ProcessGroup(tmp_path / "logs")
    doc = local_topology(pd_prefill=2, pd_decode=2, speedup=SPEEDUP, kv_scale=KV_SCALE, telemetry=False,
                         role_switch="in-place")
    args = ("--bootstrap-timeout-s", "10", "--context-tokens", "32768")
    dep = start_deployment(group, doc, "--long-term", "--long-term-interval-s", "2", "--long-term-window-s", "6",
                           "--long-term-dwell-s", "600", "--long-term-min-requests", "20", "--long-term-confirm", "1",
                           engine_args={r: args for r in ("prfaas", "pd-prefill", "pd-decode")},
                           router_env={"PRFAAS_ADMIN_TOKEN": TOKEN})
    url = dep.router.url
    try:
        t = _status(url)["threshold_tokens"]
        short = int(min(t * 0.8, 6_000))
        deadline, sent, statuses = time.monotonic() + 60, 0, []
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            while time.monotonic() < deadline:
                batch = [pool.submit(_generate, url, short - 97 * (i % 7), 9_000 + sent + i, 4) for i in range(16)]
                statuses += [f.result().status_code for f in batch]
                sent += len(batch)
                if _status(url)["model"]["instances"]["pd_prefill"] == 3:
                    break
        status = _status(url)
        assert status["model"]["instances"] == {"prfaas": 1, "pd_prefill": 3, "pd_decode": 1}, status["long_term"]
        (long_term,) = status["long_term"].values()  # one PD cluster, one controller
        assert long_term["conversions"] == 1
        converted = [n for n in ("pd-decode-0", "pd-decode-1") if status["workers"][n]["role"] == "prefill"]
        assert len(converted) == 1
        assert requests.get(dep.workers[converted[0]].url + "/server_info", timeout=5).json()["disaggregation_mode"] == "prefill"
        assert statuses == [200] * len(statuses)
    finally:
        group.stop()
