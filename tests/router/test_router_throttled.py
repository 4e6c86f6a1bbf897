"""Acceptance: two clusters on this machine with the PrfaaS worker behind a throttled link
(network namespace + veth + tbf): routing on the uncached length, KV over the shaped link,
a long prompt cached in PD-P staying local. Needs root and iproute2 (the project's machines)."""

from __future__ import annotations

import random
import sys
import time

import pytest
import requests

from prfaas_sglang.bench.bandwidth import Netns
from prfaas_sglang.demo.cluster import ProcessGroup, free_port, start_mock_worker, start_router

RATE_MBIT = 200
EXTRA = ["--speedup", "50", "--kv-scale", "0.005", "--bootstrap-timeout-s", "30"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("throttled")
    group = ProcessGroup(tmp / "logs")
    with Netns(random.randrange(16, 250)) as net:
        try:
            p_port, p_boot, p_events = free_port(), free_port(), free_port()
            prfaas = group.start("prfaas", ["ip", "netns", "exec", net.ns, sys.executable, "-m", "prfaas_sglang.engine.mock",
                                            "--role", "prfaas", "--host", net.inner_ip, "--port", str(p_port), "--bootstrap-port",
                                            str(p_boot), "--kv-events-port", str(p_events), "--profile", "kimi-linear-1t-hybrid@h200x8", *EXTRA])
            group.wait_healthy(f"http://{net.inner_ip}:{p_port}/health", prfaas)
            pp0 = start_mock_worker(group, "pp0", "pd-prefill", "kimi-linear-1t-hybrid@h20x8", EXTRA, events=True, host=net.outer_ip)
            d0 = start_mock_worker(group, "d0", "pd-decode", "kimi-linear-1t-hybrid@h20x8", EXTRA, host=net.outer_ip)
            net.throttle(RATE_MBIT)
            topology = {"version": 1, "clusters": {
                "b": {"kind": "prfaas", "nodes": [{"name": "p0", "role": "prfaas", "host": net.inner_ip, "port": p_port,
                                                   "bootstrap_port": p_boot, "kv_events_port": p_events}]},
                "a": {"kind": "pd", "nodes": [
                    {"name": "pp0", "role": "pd-prefill", "host": net.outer_ip, "port": pp0.port, "bootstrap_port": pp0.bootstrap_port,
                     "kv_events_port": pp0.kv_events_port},
                    {"name": "d0", "role": "pd-decode", "host": net.outer_ip, "port": d0.port}]}},
                "links": [{"from": "b", "to": "a", "bandwidth_gbps": RATE_MBIT / 1000}]}
            yield start_router(group, topology, "--threshold", "10000").url
        finally:
            group.stop()


def generate(url: str, tokens: list[int]):
    return requests.post(url + "/generate", json={"input_ids": tokens, "sampling_params": {"max_new_tokens": 2}}, timeout=120)


def test_routing_on_uncached_length_over_a_throttled_link(cluster):
    short = generate(cluster, list(range(3_000)))
    assert short.status_code == 200 and short.headers["x-prfaas-route"] == "pd/pp0/d0"
    long = generate(cluster, list(range(10_000, 34_000)))
    assert long.status_code == 200 and long.headers["x-prfaas-route"] == "prfaas/p0/d0"
    meta = long.json()["meta_info"]["prfaas"]
    # The KV really crossed the 200 Mbit/s link: it cannot have taken less than bytes / rate.
    assert meta["kv_transfer_s"] >= 0.9 * meta["kv_bytes"] * 8 / (RATE_MBIT * 1e6)


def test_long_prompt_cached_in_pd_stays_local(cluster):
    stem = list(range(100_000, 108_192))
    assert generate(cluster, stem + [7]).headers["x-prfaas-route"] == "pd/pp0/d0"
    deadline = time.monotonic() + 10
    while (requests.get(cluster + "/status", timeout=5).json()["workers"]["pp0"]["index_blocks"] or 0) < 16:
        assert time.monotonic() < deadline, "the router never indexed pp0's blocks"
        time.sleep(0.1)
    grown = generate(cluster, stem + list(range(200_000, 206_000)))  # 14.2K total, 6K uncached on PD-P
    assert grown.status_code == 200 and grown.headers["x-prfaas-route"] == "pd/pp0/d0"
    assert generate(cluster, list(range(300_000, 314_192))).headers["x-prfaas-route"] == "prfaas/p0/d0"
