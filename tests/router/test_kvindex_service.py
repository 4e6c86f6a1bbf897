"""The kv-index service: fed by real workers' KV events, queried over HTTP by other processes."""

from __future__ import annotations

import sys
import threading
import time

import pytest
import requests
import yaml
from deployments import EMULATED_PAIR
from helpers import wait_subscribed

from prfaas_sglang.demo.cluster import PortPicker, ProcessGroup, free_port

EXTRA = ["--speedup", "50", "--kv-scale", "0.002"]


def prefill_through(pp0, d0, prompt: list[int], room: int, index_url: str, min_blocks: int) -> None:
    """One PD request of ``prompt`` (SGLang's way: the same body to both), then wait until the
    kv-index service at ``index_url`` holds ``min_blocks`` of pp0's blocks."""
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 1}, "bootstrap_host": "127.0.0.1",
            "bootstrap_port": pp0.bootstrap_port, "bootstrap_room": room}
    t = threading.Thread(target=requests.post, args=(pp0.url + "/generate",), kwargs={"json": body, "timeout": 30})
    t.start()
    assert requests.post(d0.url + "/generate", json=body, timeout=30).status_code == 200
    t.join()
    deadline = time.monotonic() + 10
    while requests.get(index_url + "/status", timeout=5).json()["workers"]["pp0"]["blocks"] < min_blocks:
        assert time.monotonic() < deadline
        time.sleep(0.1)


@pytest.mark.slow
@pytest.mark.xdist_group(EMULATED_PAIR)
def test_kvindex_service_answers_matches_from_worker_events(emulated_pair, tmp_path):
    group = ProcessGroup(tmp_path / "logs")
    try:
        emulated_pair.reset()  # the standard pair's PD-P and PD-D (tests/deployments.py), named pp0 and d0 here
        pp0, d0 = emulated_pair.worker("pd-prefill"), emulated_pair.worker("pd-decode")
        topology = {"version": 1, "emulation": {"speedup": 50, "kv_scale": 0.002}, "clusters": {"a": {"kind": "pd", "nodes": [
            {"name": "pp0", "role": "pd-prefill", "port": pp0.port, "bootstrap_port": pp0.bootstrap_port, "kv_events_port": pp0.kv_events_port},
            {"name": "d0", "role": "pd-decode", "port": d0.port}]}}}
        config = tmp_path / "t.yaml"
        config.write_text(yaml.safe_dump(topology))
        port = free_port()
        proc = group.start("kv-index", [sys.executable, "-m", "prfaas_sglang.kvindex", "--config", str(config), "--port", str(port)])
        url = f"http://127.0.0.1:{port}"
        group.wait_healthy(url + "/health", proc)
        wait_subscribed(url + "/status", ["pp0"])

        prompt = list(range(5_000))
        prefill_through(pp0, d0, prompt, 77, url, 9)
        match = requests.post(url + "/match", json={"input_ids": prompt + [1, 2, 3]}, timeout=5).json()
        # held_by_worker: what a decode worker's own cache would supply, a page short of the state at 4,608
        assert match == {"total_tokens": 5_003, "by_worker": {"pp0": 4_608}, "by_cluster": {"pd": 4_608}, "shared_tokens": 4_608,
                         "held_by_worker": {"pp0": 4_096}}
        assert requests.post(url + "/match", json={"input_ids": ["x"]}, timeout=5).status_code == 400
        assert requests.post(url + "/match", data="{", timeout=5).status_code == 400
        status = requests.get(url + "/status", timeout=5).json()
        assert status["subscriptions"]["pp0"]["frames"] >= 1 and status["bad_frames"] == 0
        assert status["subscriptions"]["pp0"]["connected"] and status["subscriptions"]["pp0"]["connects"] == 1
        assert 'prfaas_kvindex_subscription_connected{source="pp0"} 1.0' in requests.get(url + "/metrics", timeout=5).text
        assert status["memo"]["max_bytes"] == 64 << 20 and status["memo"]["bytes"] <= status["memo"]["max_bytes"]
        # The emulated hybrid worker reports its state checkpoints (wire v2): one, at the prompt's last page.
        assert (status["workers"]["pp0"]["checkpoints"], status["workers"]["pp0"]["checkpoints_from"]) == (1, "reported")
    finally:
        group.stop()


@pytest.mark.slow
@pytest.mark.xdist_group(EMULATED_PAIR)
def test_a_router_started_after_the_events_takes_the_kv_index_services_view(emulated_pair, tmp_path):
    """Issue #16: a restarted router's KV index was empty until new events refilled it, so the first
    requests after a restart were routed as if nothing were cached. It now takes the kv-index
    service's snapshot at start-up (``GET /snapshot``, wire/kv_snapshot.py)."""
    group = ProcessGroup(tmp_path / "logs")
    try:
        emulated_pair.reset()  # the standard pair's PD-P and PD-D (tests/deployments.py), named pp0 and d0 here
        pp0, d0 = emulated_pair.worker("pd-prefill"), emulated_pair.worker("pd-decode")
        pick = PortPicker()  # distinct: nothing binds them before the topology starts
        index_port, router_port = pick(), pick()
        topology = {"version": 1, "emulation": {"speedup": 50, "kv_scale": 0.002}, "clusters": {
            "a": {"kind": "pd", "nodes": [
                {"name": "pp0", "role": "pd-prefill", "port": pp0.port, "bootstrap_port": pp0.bootstrap_port,
                 "kv_events_port": pp0.kv_events_port},
                {"name": "d0", "role": "pd-decode", "port": d0.port}]},
            "control": {"kind": "control", "nodes": [
                {"name": "router", "role": "router", "host": "127.0.0.1", "port": router_port},
                {"name": "kv-index", "role": "kv-index", "host": "127.0.0.1", "port": index_port}]}}}
        config = tmp_path / "t.yaml"
        config.write_text(yaml.safe_dump(topology))
        index = group.start("kv-index", [sys.executable, "-m", "prfaas_sglang.kvindex", "--config", str(config)])
        index_url = f"http://127.0.0.1:{index_port}"
        group.wait_healthy(index_url + "/health", index)
        wait_subscribed(index_url + "/status", ["pp0"])
        prompt = list(range(5_000))
        prefill_through(pp0, d0, prompt, 78, index_url, 9)

        # the router starts after every event was published: only the snapshot can tell it
        router = group.start("router", [sys.executable, "-m", "prfaas_sglang.launch", "--config", str(config)])
        router_url = f"http://127.0.0.1:{router_port}"
        group.wait_healthy(router_url + "/health", router)
        deadline = time.monotonic() + 10
        while requests.get(router_url + "/status", timeout=5).json()["workers"]["pp0"]["index_blocks"] in (None, 0):
            assert time.monotonic() < deadline, "the router never took the kv-index service's blocks"
            time.sleep(0.1)
        status = requests.get(router_url + "/status", timeout=5).json()
        assert status["workers"]["pp0"]["index_blocks"] == requests.get(index_url + "/status", timeout=5).json()["workers"]["pp0"]["blocks"]
        assert "prfaas_router_restored_blocks_total 9" in requests.get(router_url + "/metrics", timeout=5).text
        answer = requests.post(router_url + "/generate", json={"input_ids": prompt + [1, 2, 3],
                                                               "sampling_params": {"max_new_tokens": 1}}, timeout=30)
        assert answer.status_code == 200
        recent = requests.get(router_url + "/status", timeout=5).json()["recent"][-1]
        assert recent["cached_tokens"] == 4_608  # routed on the restored prefix
    finally:
        group.stop()


@pytest.mark.slow
def test_the_kv_index_waits_for_a_worker_that_starts_after_it(tmp_path):
    """On Kubernetes the kv-index and the workers start together: a worker not answering yet is
    asked again (``--wait-workers-s``) instead of failing the kv-index at once; past the wait it
    fails with the worker named."""
    group = ProcessGroup(tmp_path / "logs")
    pick = PortPicker()  # distinct: nothing binds them before the topology starts
    pick_port, events_port, index_port, boot, decode_port = pick(), pick(), pick(), pick(), pick()
    topology = {"version": 1, "emulation": {"speedup": 50, "kv_scale": 0.002}, "clusters": {"a": {"kind": "pd", "nodes": [
        {"name": "pp0", "role": "pd-prefill", "host": "127.0.0.1", "port": pick_port, "bootstrap_port": boot,
         "kv_events_port": events_port},
        {"name": "d0", "role": "pd-decode", "host": "127.0.0.1", "port": decode_port}]}}}  # no events: not waited for
    config = tmp_path / "t.yaml"
    config.write_text(yaml.safe_dump(topology))
    try:
        late = group.start("kv-index-late", [sys.executable, "-m", "prfaas_sglang.kvindex", "--config", str(config),
                                             "--port", str(index_port), "--wait-workers-s", "1"])
        assert late.wait(timeout=30) == 2  # nobody answered within 1 s: a typed error, the worker named
        assert "nodes.pp0" in (tmp_path / "logs" / "kv-index-late.log").read_text()
        proc = group.start("kv-index", [sys.executable, "-m", "prfaas_sglang.kvindex", "--config", str(config),
                                        "--port", str(index_port), "--wait-workers-s", "60"])
        time.sleep(2.0)
        assert proc.poll() is None  # still waiting for pp0
        group.start("pp0", [sys.executable, "-m", "prfaas_sglang.engine.mock", "--role", "pd-prefill", "--host", "127.0.0.1",
                            "--port", str(pick_port), "--bootstrap-port", str(boot), "--kv-events-port", str(events_port),
                            "--profile", "kimi-linear-1t-hybrid@h20x8", *EXTRA])
        group.wait_healthy(f"http://127.0.0.1:{index_port}/health", proc)
        status = requests.get(f"http://127.0.0.1:{index_port}/status", timeout=5).json()
        assert status["workers"]["pp0"]["blocks"] == 0 and "pp0" in status["subscriptions"]
    finally:
        group.stop()


@pytest.mark.slow
def test_the_kv_index_waits_for_its_workers_at_once_not_one_after_another(tmp_path, monkeypatch):
    """Two workers that answer only once both are being asked: waited for one after another, the
    first wait would never end (the barrier breaks); waited for at once, both answer."""
    import threading

    from prfaas_sglang.kvindex import __main__ as kvindex_main

    topology = {"version": 1, "emulation": {"speedup": 50, "kv_scale": 0.002}, "clusters": {"a": {"kind": "pd", "nodes": [
        {"name": "pp0", "role": "pd-prefill", "host": "127.0.0.1", "port": 1, "bootstrap_port": 2, "kv_events_port": 3},
        {"name": "pp1", "role": "pd-prefill", "host": "127.0.0.1", "port": 4, "bootstrap_port": 5, "kv_events_port": 6},
        {"name": "d0", "role": "pd-decode", "host": "127.0.0.1", "port": 7}]}}}
    config = tmp_path / "t.yaml"
    config.write_text(yaml.safe_dump(topology))
    both_asked = threading.Barrier(3, timeout=10)  # pp0, pp1 and d0 (asked without waiting)
    asked = []

    def answer(url, fallback, headers, wait_s):
        asked.append(url)
        both_asked.wait()
        return 64, None

    served = {}
    monkeypatch.setattr(kvindex_main, "_wait_block_size", answer)
    monkeypatch.setattr("aiohttp.web.run_app", lambda app, **kw: served.update(kw))
    assert kvindex_main.main(["--config", str(config), "--port", "9"]) == 0
    assert sorted(asked) == ["http://127.0.0.1:1", "http://127.0.0.1:4", "http://127.0.0.1:7"] and served["port"] == 9
