"""Acceptance: two clusters on this machine with the PrfaaS worker behind a throttled link
(network namespace + veth + tbf): routing on the uncached length, KV over the shaped link,
a long prompt cached in PD-P staying local. Needs root and iproute2 (the project's machines)."""

from __future__ import annotations

import time

import pytest
import requests

from prfaas_sglang.demo.cluster import ProcessGroup, local_topology, start_deployment
from prfaas_sglang.demo.netns import Netns

RATE_MBIT = 200
LOCAL, REMOTE = "pd/pd-prefill-0/pd-decode-0", "prfaas/prfaas-0/pd-decode-0"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """The PrfaaS worker in its own namespace (started through the launcher inside it), the rest outside."""
    tmp = tmp_path_factory.mktemp("throttled")
    group = ProcessGroup(tmp / "logs")
    with Netns() as net:
        try:
            net.throttle(RATE_MBIT)
            doc = local_topology(hosts={"prfaas": net.inner_ip}, host=net.outer_ip, link_gbps=RATE_MBIT / 1000,
                                 speedup=50, kv_scale=0.005, threshold_tokens=10_000, telemetry=False)
            d = start_deployment(group, doc, wrap={"prfaas": net.wrap},
                                 engine_args={r: ("--bootstrap-timeout-s", "30") for r in ("prfaas", "pd-prefill", "pd-decode")})
            yield d.router.url
        finally:
            group.stop()


def generate(url: str, tokens: list[int]):
    return requests.post(url + "/generate", json={"input_ids": tokens, "sampling_params": {"max_new_tokens": 2}}, timeout=120)


@pytest.mark.slow
def test_routing_on_uncached_length_over_a_throttled_link(cluster):
    short = generate(cluster, list(range(3_000)))
    assert short.status_code == 200 and short.headers["x-prfaas-route"] == LOCAL
    long = generate(cluster, list(range(10_000, 34_000)))
    assert long.status_code == 200 and long.headers["x-prfaas-route"] == REMOTE
    meta = long.json()["meta_info"]["prfaas"]
    # The KV really crossed the 200 Mbit/s link: it cannot have taken less than bytes / rate.
    assert meta["kv_transfer_s"] >= 0.9 * meta["kv_bytes"] * 8 / (RATE_MBIT * 1e6)


def test_long_prompt_cached_in_pd_stays_local(cluster):
    stem = list(range(100_000, 108_192))
    assert generate(cluster, stem + [7]).headers["x-prfaas-route"] == LOCAL
    deadline = time.monotonic() + 10
    while (requests.get(cluster + "/status", timeout=5).json()["workers"]["pd-prefill-0"]["index_blocks"] or 0) < 16:
        assert time.monotonic() < deadline, "the router never indexed pp0's blocks"
        time.sleep(0.1)
    grown = generate(cluster, stem + list(range(200_000, 206_000)))  # 14.2K total, 6K uncached on PD-P
    assert grown.status_code == 200 and grown.headers["x-prfaas-route"] == LOCAL
    assert generate(cluster, list(range(300_000, 314_192))).headers["x-prfaas-route"] == REMOTE
