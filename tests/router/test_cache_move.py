"""Cross-cluster cache moves end to end on emulated workers (``wire.cache_move``, issue #15 item 4).

A long prompt is prefilled once on the PrfaaS worker, which keeps it in its prefix cache (the KV
index hears its events). The same prompt grown by a short turn is then routed, in abundant mode,
to PD-P (its uncached length after the best cache is under ``t``), and the router executes the
policy's :class:`~prfaas_sglang.router.policy.CacheTransfer`: PD-P fetches the prefix from the
PrfaaS worker over Mooncake TCP and keeps it, then prefills only the rest. Where the cost model
says recompute (a link too slow for the bytes), nothing moves and PD-P computes it all. A move
that fails (the source's transfer fails) leaves the request to recompute, and it still succeeds;
a source asked for a prefix it does not hold answers 409.
"""

from __future__ import annotations

import pytest
import requests
from deployments import EMULATED_PAIR
from test_router_e2e import wait_for_index

from prfaas_sglang.wire.cache_move import CacheExport, CacheImport, CacheImported

# The standard emulated pair (tests/deployments.py: speedup 50, KV scale 0.002, no telemetry, a 10 s
# bootstrap timeout), each deployment below a router of its own over it.
pytestmark = pytest.mark.xdist_group(EMULATED_PAIR)
THRESHOLD, PAGE = 4096, 512
P0, PP0 = "prfaas-0", "pd-prefill-0"


def _deploy(pair, tmp, name: str, link_gbps: float, *router_args: str):
    return pair.deployment(tmp / f"logs-{name}", "--bandwidth-mode", "abundant", "--no-early-rejection", *router_args,
                           threshold_tokens=THRESHOLD, link_gbps=link_gbps, name=name)


def generate(url: str, ids: list[int], max_new: int = 2) -> requests.Response:
    return requests.post(url + "/generate", json={"input_ids": ids, "sampling_params": {"max_new_tokens": max_new}},
                         timeout=120)


def metric(url: str, name: str, labels: str = "") -> float:
    for line in requests.get(url + "/metrics", timeout=5).text.splitlines():
        if line.startswith(name + labels + " ") or (not labels and line.startswith(name + "{")):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def warm_on_prfaas(url: str, stem: list[int]) -> None:
    """Cache ``stem`` on the PrfaaS worker: its cache keeps a prefix seen twice (the launcher's
    PRFAAS_PREFILL_CACHE=shared; a one-off long prompt is transfer cache), so it is sent twice."""
    for _ in range(2):
        sent = generate(url, stem)
        assert sent.status_code == 200 and sent.headers["x-prfaas-route"].startswith("prfaas/"), sent.text[:300]
    wait_for_index(url, P0, len(stem) // PAGE - 1)


@pytest.fixture(scope="module")
def fast(emulated_pair, tmp_path_factory):
    with _deploy(emulated_pair, tmp_path_factory.mktemp("move"), "fast", 100.0) as d:
        yield d


def test_the_cost_model_moves_a_long_prefix_over_a_fast_link_and_pd_prefills_only_the_rest(fast):
    url, pd_prefill = fast.router.url, fast.worker("pd-prefill").url
    stem = list(range(1_000_000, 1_000_000 + 16 * PAGE))
    warm_on_prfaas(url, stem)
    grown = generate(url, stem + list(range(2_000_000, 2_000_300)))
    assert grown.status_code == 200, grown.text[:300]
    assert grown.headers["x-prfaas-route"] == f"pd/{PP0}/pd-decode-0"
    recent = requests.get(url + "/status", timeout=5).json()["recent"][-1]
    assert "move" in recent["reason"] and recent["cached_tokens"] >= 15 * PAGE, recent
    # PD-P received the prefix (its own metric) and reported it cached: only the rest was computed.
    assert metric(pd_prefill, "prfaas:prefix_imported_tokens_total") >= 15 * PAGE
    assert grown.json()["meta_info"]["cached_tokens"] >= 15 * PAGE
    assert metric(url, "prfaas_router_cache_moves_total", '{outcome="ok"}') == 1
    assert "move;dur=" in grown.headers["Server-Timing"]
    # The prefix is now PD-P's own: the next turn needs no move.
    again = generate(url, stem + list(range(2_000_000, 2_000_300)) + [7] * 200)
    assert again.status_code == 200 and metric(url, "prfaas_router_cache_moves_total", '{outcome="ok"}') == 1


def test_a_failed_move_recomputes_and_the_request_succeeds(fast):
    url, prfaas = fast.router.url, fast.worker("prfaas").url
    stem = list(range(3_000_000, 3_000_000 + 12 * PAGE))
    warm_on_prfaas(url, stem)
    # The source's next transfer fails (as over a broken link): the move fails, PD-P computes it all.
    assert requests.post(prfaas + "/prfaas/faults", json={"fail_kv_transfers": 1}, timeout=5).status_code == 200
    grown = generate(url, stem + list(range(4_000_000, 4_000_100)))
    assert grown.status_code == 200 and grown.headers["x-prfaas-route"].startswith("pd/"), grown.text[:300]
    assert "move" in requests.get(url + "/status", timeout=5).json()["recent"][-1]["reason"]
    assert metric(url, "prfaas_router_cache_moves_total", '{outcome="failed"}') == 1
    assert grown.json()["meta_info"]["cached_tokens"] == 0


def test_the_endpoints_refuse_bad_input_with_a_400(fast):
    prfaas = fast.worker("prfaas").url
    for body in ({}, {"v": 1}, {"v": 2, "token_ids": [1], "num_tokens": 1, "source_url": "http://x", "timeout_s": 1},
                 {"v": 1, "token_ids": [1], "num_tokens": 2, "source_url": "http://x", "timeout_s": 1},
                 {"v": 1, "token_ids": [-1], "num_tokens": 1, "source_url": "http://x", "timeout_s": 1},
                 {"v": 1, "token_ids": [1], "num_tokens": 1, "source_url": "ftp://x", "timeout_s": 1}):
        r = requests.post(prfaas + "/prfaas/cache/import", json=body, timeout=5)
        assert r.status_code == 400, (body, r.text)
    r = requests.post(prfaas + "/prfaas/cache/export", data=b"[", timeout=5)
    assert r.status_code == 400
    decode = fast.worker("pd-decode").url
    body = CacheImport(list(range(PAGE)), PAGE, "http://127.0.0.1:1", 1.0).to_json()
    assert requests.post(decode + "/prfaas/cache/import", json=body, timeout=5).status_code == 400  # not a prefill worker
    body = CacheExport(list(range(PAGE)), PAGE, "127.0.0.1:1", 0, 1 << 20).to_json()
    assert requests.post(prfaas + "/prfaas/cache/export", json=body, timeout=5).status_code == 409  # not held


def test_over_a_slow_link_the_cost_model_recomputes(emulated_pair, tmp_path):
    with _deploy(emulated_pair, tmp_path, "slow", 0.05) as d:
        url, pd_prefill = d.router.url, d.worker("pd-prefill").url
        imported = metric(pd_prefill, "prfaas:prefix_imported_tokens_total")  # the shared PD-P's (the fast link's moves)
        stem = list(range(5_000_000, 5_000_000 + 16 * PAGE))
        warm_on_prfaas(url, stem)
        grown = generate(url, stem + list(range(6_000_000, 6_000_300)))
        assert grown.status_code == 200
        recent = requests.get(url + "/status", timeout=5).json()["recent"][-1]
        assert "recompute instead of moving" in recent["reason"], recent
        assert metric(pd_prefill, "prfaas:prefix_imported_tokens_total") == imported  # none imported here
        assert metric(url, "prfaas_router_cache_moves_total", '{outcome="ok"}') == 0


def test_wire_round_trip_and_refusals():
    msg = CacheImport([1, 2, 3], 2, "http://h:1", 2.5)
    assert CacheImport.decode(msg.to_json()) == msg
    assert CacheImported.decode(CacheImported(512, 1024, 99, None).to_json()).cached_tokens == 1024
    for bad in ({"v": 1, "token_ids": [1], "num_tokens": 0, "source_url": "http://h", "timeout_s": 1},
                {"v": 1, "token_ids": [True], "num_tokens": 1, "source_url": "http://h", "timeout_s": 1},
                {"v": 1, "token_ids": [1], "num_tokens": 1, "source_url": "http://h", "timeout_s": float("nan")},
                {"v": 1, "token_ids": [1], "num_tokens": 1, "source_url": "http://h", "timeout_s": 1, "x": 1}):
        with pytest.raises(ValueError):
            CacheImport.decode(bad)
