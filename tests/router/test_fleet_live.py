"""Acceptance (issue #45): the fleet of launch/multi-cluster.yaml on this box, one node per role per
cluster (2 PrfaaS clusters of different profiles, 2 PD regions, each PrfaaS -> PD link shaped on its
own), emulated engines shipping real KV over Mooncake TCP, and the router's global scheduler: a
long prompt decodes where it entered, offloaded over one of that region's links; a link throttled
250x is routed around by its region while the other region's offloads keep their link. Needs root
and iproute2 (the project's machines)."""

from __future__ import annotations

import time

import pytest
import requests
import yaml
from helpers import REPO_ROOT

from prfaas_sglang.demo import netns
from prfaas_sglang.demo.cluster import ProcessGroup, start_deployment
from prfaas_sglang.demo.fleet import FleetNet, fleet_sites, links_mbit, local_fleet

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(netns.available() is not None, reason=f"shaped links: {netns.available()}")]
SPEEDUP, KV_SCALE = 20.0, 0.01
THROTTLED_MBIT = 40.0


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    raw = yaml.safe_load((REPO_ROOT / "launch" / "multi-cluster.yaml").read_text())
    prfaas, pd = fleet_sites(raw)
    group = ProcessGroup(tmp_path_factory.mktemp("fleet") / "logs")
    with FleetNet(pd, prfaas, links_mbit(raw, SPEEDUP, KV_SCALE)) as net:
        try:
            doc = local_fleet(raw, net, speedup=SPEEDUP, kv_scale=KV_SCALE, scheduler={"output_tokens": 16})
            wrap = {n["name"]: net.nets[site].wrap for site in prfaas for n in doc["clusters"][site]["nodes"]}
            d = start_deployment(group, doc, wrap=wrap, engine_args={r: ("--bootstrap-timeout-s", "30")
                                                                      for r in ("prfaas", "pd-prefill", "pd-decode")})
            yield d.router.url, net
        finally:
            group.stop()


def generate(url: str, tokens: list[int], entry: str):
    return requests.post(url + "/generate", json={"input_ids": tokens, "sampling_params": {"max_new_tokens": 2}},
                         headers={"x-prfaas-entry": entry}, timeout=120)


def test_each_region_offloads_over_its_own_links_and_a_throttled_link_loses_only_its_own_traffic(fleet):
    url, net = fleet
    prompt = iter(range(0, 10**9, 100_000))

    def long(entry: str):
        start = next(prompt)
        r = generate(url, list(range(start, start + 60_000)), entry)
        assert r.status_code == 200, r.text
        return r.headers["x-prfaas-link"], r.headers["x-prfaas-route"]

    west_link, west_route = long("pd-west")
    east_link, _ = long("pd-east")
    assert west_link.endswith("->pd-west") and west_route.startswith("prfaas/") and "/west-d-0" in west_route
    assert east_link.endswith("->pd-east")
    status = requests.get(url + "/status", timeout=5).json()
    assert status["pairs"][west_link]["link"]["transfers_completed"] >= 1 or status["pairs"][west_link]["routed"]
    # The west link just used goes 250x down: the next long west prompt crawls over it, its telemetry
    # (the transfers to west's decode peers alone) shows the link's rate, and its controller drops.
    prfaas_site = west_link.split("->")[0]
    net.set_rate(prfaas_site, "pd-west", THROTTLED_MBIT)
    assert long("pd-west")[0] == west_link  # the router cannot know yet
    deadline = time.monotonic() + 20
    while True:
        pairs = requests.get(url + "/status", timeout=5).json()["pairs"]
        if pairs[west_link]["controller"]["capacity_est_bps"] < 0.1 * pairs[west_link]["controller"]["nominal_bps"]:
            break
        assert time.monotonic() < deadline, pairs[west_link]["controller"]
        time.sleep(0.25)
    for _ in range(2):
        assert long("pd-west")[0] != west_link  # around it: the other link, or west's own PD-P
        assert long("pd-east")[0] == east_link  # east's offload keeps its link
    assert pairs[east_link]["controller"]["capacity_est_bps"] == pairs[east_link]["controller"]["nominal_bps"]
