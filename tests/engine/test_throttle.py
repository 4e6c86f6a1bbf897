"""Real bytes on a real (shaped) link: the emulated prefill worker in its own network
namespace behind a veth pair, a tbf qdisc on its egress, the decode worker in the
root namespace. Throttling the link must stretch the KV transfer and TTFT by at least
bytes / rate: a physical bound, not a timing threshold.

Needs root, iproute2 and tbf (this project's machines and CI have them).
"""

from __future__ import annotations

import random
import sys
import threading
import time

import pytest

from prfaas_sglang.adapters import http_sync
from prfaas_sglang.demo.cluster import PortPicker, ProcessGroup
from prfaas_sglang.demo.netns import Netns
from prfaas_sglang.engine.mock.timing import load_timing

PROFILE = "kimi-linear-1t-hybrid@h20x8"
KV_SCALE = 0.01
RATE_MBIT = 40


@pytest.fixture(scope="module")
def link():
    """A namespace joined to the root namespace by a veth pair; removed afterwards."""
    with Netns() as net:
        yield net


@pytest.fixture(scope="module")
def workers(link, tmp_path_factory):
    ns, prefill_ip, root_ip = link.ns, link.inner_ip, link.outer_ip
    group = ProcessGroup(tmp_path_factory.mktemp("throttle"))
    common = ["--profile", PROFILE, "--speedup", "20", "--kv-scale", str(KV_SCALE), "--bootstrap-timeout-s", "60"]
    pick = PortPicker()
    p_port, p_boot, d_port = pick(), pick(), pick(root_ip)
    prefill = group.start("prefill", ["ip", "netns", "exec", ns, sys.executable, "-m", "prfaas_sglang.engine.mock",
                                      "--role", "prfaas", "--host", prefill_ip, "--port", str(p_port),
                                      "--bootstrap-port", str(p_boot), *common])
    decode = group.start("decode", [sys.executable, "-m", "prfaas_sglang.engine.mock", "--role", "pd-decode",
                                    "--host", root_ip, "--port", str(d_port), *common])
    try:
        group.wait_healthy(f"http://{prefill_ip}:{p_port}/health", prefill)
        group.wait_healthy(f"http://{root_ip}:{d_port}/health", decode)
        yield {"prefill": f"http://{prefill_ip}:{p_port}", "bootstrap": (prefill_ip, p_boot), "decode": f"http://{root_ip}:{d_port}"}
    finally:
        group.stop()


def pd_request(workers, tokens: list[int]) -> tuple[dict, dict]:
    """Returns (prefill meta_info, decode meta_info + "ttft_s" measured here: one output token)."""
    host, port = workers["bootstrap"]
    body = {"input_ids": tokens, "sampling_params": {"max_new_tokens": 1},
            "bootstrap_host": host, "bootstrap_port": port, "bootstrap_room": random.getrandbits(63)}
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("p", http_sync.post(workers["prefill"] + "/generate", json_body=body, timeout_s=120)))
    start = time.perf_counter()
    t.start()
    d = http_sync.post(workers["decode"] + "/generate", json_body=body, timeout_s=120)
    ttft_s = time.perf_counter() - start
    t.join()
    assert out["p"].status == 200 and d.status == 200, (out["p"].text, d.text)
    return out["p"].json()["meta_info"], {**d.json()["meta_info"], "ttft_s": ttft_s}


def test_throttled_link_stretches_transfer_by_at_least_bytes_over_rate(link, workers):
    n = 16_384
    expected_bytes = load_timing(PROFILE, 20, KV_SCALE, None).kv_bytes(n)
    pd_request(workers, [1] * 700)  # warm the lanes

    fast_p, fast_d = pd_request(workers, [random.randrange(32_000) for _ in range(n)])
    assert fast_d["prfaas"]["kv_bytes"] == expected_bytes

    link.throttle(RATE_MBIT)
    try:
        slow_p, slow_d = pd_request(workers, [random.randrange(32_000) for _ in range(n)])
    finally:
        link.throttle(None)

    floor_s = expected_bytes * 8 / (RATE_MBIT * 1e6)
    assert slow_d["prfaas"]["kv_bytes"] == expected_bytes
    assert slow_p["prfaas"]["kv_transfer_s"] >= 0.9 * floor_s
    assert fast_p["prfaas"]["kv_transfer_s"] < 0.5 * floor_s
    assert slow_d["ttft_s"] - fast_d["ttft_s"] >= 0.8 * floor_s


def test_with_the_link_down_nothing_for_the_namespace_leaves_the_host():
    """The chaos bench's blackhole sets the veth down; its traffic must then be dropped here, not sent
    through the default route (a gateway there answered the router's prefill legs with 404)."""
    import subprocess

    with Netns() as net:
        subprocess.run(["ip", "link", "set", net.outer, "down"], check=True)
        route = subprocess.run(["ip", "route", "get", net.inner_ip], capture_output=True, text=True)
        assert route.returncode != 0 and "via" not in route.stdout, route.stdout + route.stderr
    assert net.subnet not in subprocess.run(["ip", "route"], capture_output=True, text=True).stdout
