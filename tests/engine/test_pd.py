"""Emulated prefill + decode over real HTTP, real Mooncake TCP bytes, real ZMQ events."""

from __future__ import annotations

import itertools
import os
import threading

import msgspec
import pytest
import zmq
from conftest import DECODE_PROFILE, PREFILL_PROFILE, start_worker
from helpers import subscribe

from prfaas_sglang.adapters import http_sync
from prfaas_sglang.demo.cluster import scrape_metric
from prfaas_sglang.engine.mock.timing import load_timing
from prfaas_sglang.transport.kv_send import split_even, timed_write_bytes
from prfaas_sglang.transport.wan_defaults import lanes_per_peer

KV_SCALE = 0.01
_rooms = itertools.count(1000)


@pytest.fixture(scope="module")
def pair(module_procs):
    prefill = start_worker(module_procs, "prfaas", PREFILL_PROFILE, "--speedup", "20", "--kv-scale", str(KV_SCALE),
                           "--context-tokens", "65536", "--bootstrap-timeout-s", "2", events=True)
    decode = start_worker(module_procs, "pd-decode", DECODE_PROFILE, "--speedup", "20", "--kv-scale", str(KV_SCALE),
                          "--context-tokens", "65536", "--bootstrap-timeout-s", "2")
    return prefill, decode


def pd_request(prefill, decode, body: dict, path: str = "/generate", room: int | None = None, timeout: float = 30):
    """Send the same body to both workers, as a PD router does; returns (prefill, decode) responses."""
    room = next(_rooms) if room is None else room
    body = {**body, "bootstrap_host": "127.0.0.1", "bootstrap_port": prefill.bootstrap_port, "bootstrap_room": room}
    result = {}
    t = threading.Thread(target=lambda: result.setdefault("p", http_sync.post(prefill.url + path, json_body=body, timeout_s=timeout)))
    t.start()
    d = http_sync.post(decode.url + path, json_body=body, timeout_s=timeout)
    t.join()
    return result["p"], d


def metric(worker, name: str) -> float:
    return scrape_metric(worker.url, name)


def test_decode_receives_exactly_s_kv_times_scale(pair):
    prefill, decode = pair
    timing = load_timing(DECODE_PROFILE, 1.0, KV_SCALE, None)
    before = metric(decode, "prfaas:kv_bytes_received_total")
    writes_before = metric(prefill, "prfaas:kv_writes_submitted_total")  # a PrfaaS worker: the kv-send hooks' sender
    expected_total = expected_writes = 0
    for n in (1_000, 8_000, 32_000):
        p, d = pd_request(prefill, decode, {"input_ids": list(range(n)), "sampling_params": {"max_new_tokens": 3}})
        assert p.status == 200 and d.status == 200, (p.text, d.text)
        expected = timing.kv_bytes(n)
        assert d.json()["meta_info"]["prfaas"]["kv_bytes"] == expected
        assert p.json()["meta_info"]["prfaas"]["kv_bytes"] == expected
        assert len(d.json()["output_ids"]) == 3
        expected_total += expected
        lanes = lanes_per_peer(os.environ)  # no link stated here: writes of 1 MiB (timed_write_bytes)
        expected_writes += len(split_even(0, 0, expected, lanes, max_write_bytes=timed_write_bytes(None, lanes)))
    assert metric(decode, "prfaas:kv_bytes_received_total") - before == expected_total
    assert metric(prefill, "prfaas:kv_writes_submitted_total") - writes_before == expected_writes
    assert metric(prefill, "prfaas:kv_writes_failed_total") == 0 and metric(prefill, "prfaas:kv_send_in_flight_bytes") == 0


def test_repeated_prompt_reuses_its_cached_prefix(pair):
    prefill, decode = pair
    prompt = {"input_ids": [7] * 5_000 + list(range(3_000)), "sampling_params": {"max_new_tokens": 1}}
    first, _ = pd_request(prefill, decode, prompt)
    second, _ = pd_request(prefill, decode, prompt)
    assert first.json()["meta_info"]["cached_tokens"] == 0
    assert second.json()["meta_info"]["cached_tokens"] == (8_000 // 512) * 512


def test_a_prfaas_worker_keeps_shared_prefixes_only_and_reports_what_it_kept(pair, module_procs):
    """PRFAAS_PREFILL_CACHE=shared (the same policy object as the SGLang cache backend's): one-off
    long prompts are transfer cache (not cached, no KV events), a prefix seen twice is kept and the
    third sighting reuses it; a one-off with a checkpoint hint keeps its prefix up to the hint only."""
    _, decode = pair
    prefill = start_worker(module_procs, "prfaas", PREFILL_PROFILE, "--speedup", "20", "--kv-scale", str(KV_SCALE),
                           "--context-tokens", "65536", "--bootstrap-timeout-s", "2", events=True,
                           env={"PRFAAS_PREFILL_CACHE": "shared"})
    info = http_sync.get(prefill.url + "/server_info", timeout_s=5).json()
    assert info["prfaas"]["prefill_cache"] == "shared"
    sub = subscribe(f"tcp://127.0.0.1:{prefill.kv_events_port}")
    sub.setsockopt(zmq.RCVTIMEO, 1500)
    try:
        for n in range(4):  # unique long prompts: the bulk of a PrfaaS worker's traffic
            p, d = pd_request(prefill, decode, {"input_ids": [50_000 + n] * 6_000, "sampling_params": {"max_new_tokens": 1}})
            assert p.status == 200 and d.status == 200
        with pytest.raises(zmq.Again):
            sub.recv_multipart()  # nothing was inserted, nothing published
        assert metric(prefill, "prfaas:prefill_transfer_only_total") == 4 and metric(prefill, "prfaas:prefill_kept_total") == 0
        shared = [9] * 8_192  # one chunk: the profile is hybrid, so a state checkpoint ends it
        hits = []
        for tail in (1, 2, 3):
            p, _ = pd_request(prefill, decode, {"input_ids": shared + [tail] * 600, "sampling_params": {"max_new_tokens": 1}})
            hits.append(p.json()["meta_info"]["cached_tokens"])
        assert hits == [0, 0, 8_192]  # one-off, seen before (kept), then reused
        assert metric(prefill, "prfaas:prefill_kept_total") == 2
        assert sub.recv_multipart()  # the kept prefill was published
        # A one-off asking for a state checkpoint (a router's hint): its prefix up to there is kept
        # with that state, its tail is not: a later prompt sharing the whole first prompt reuses 4,096.
        stem, tail = [70_000] * 4_096, [70_001] * 4_096
        hinted = {"max_new_tokens": 1, "custom_params": {"prfaas_checkpoint_tokens": 4_096}}
        p, _ = pd_request(prefill, decode, {"input_ids": stem + tail, "sampling_params": hinted})
        assert p.status == 200 and metric(prefill, "prfaas:prefill_kept_total") == 3
        p, _ = pd_request(prefill, decode, {"input_ids": stem + tail + [5] * 100, "sampling_params": {"max_new_tokens": 1}})
        assert p.json()["meta_info"]["cached_tokens"] == 4_096
    finally:
        sub.close(linger=0)
    with pytest.raises(Exception):  # noqa: B017 - the worker refuses a bad policy at start-up
        start_worker(module_procs, "prfaas", PREFILL_PROFILE, env={"PRFAAS_PREFILL_CACHE": "sometimes"})


def test_kv_events_decode_with_sglang_classes(pair):
    from sglang.srt.disaggregation.kv_events import BlockStored, KVEventBatch

    prefill, decode = pair
    sub = subscribe(f"tcp://127.0.0.1:{prefill.kv_events_port}")
    sub.setsockopt(zmq.RCVTIMEO, 5000)
    tokens = list(range(50_000, 50_000 + 1536))
    pd_request(prefill, decode, {"input_ids": tokens, "sampling_params": {"max_new_tokens": 1}})
    topic, seq, payload = sub.recv_multipart()
    sub.close(linger=0)
    assert topic == b"kv-events" and len(seq) == 8
    batch = msgspec.msgpack.decode(payload, type=KVEventBatch)
    stored = [e for e in batch.events if isinstance(e, BlockStored)]
    assert [e.token_ids for e in stored] == [tokens[i:i + 512] for i in (0, 512, 1024)]
    assert stored[1].parent_block_hash == stored[0].block_hashes[0]
    from sglang.srt.mem_cache.utils import get_hash_str, hash_str_to_int64

    assert [e.block_hashes[0] for e in stored] == [hash_str_to_int64(h) for h in get_hash_str(tokens, None, 512)]


def pd_stream(prefill, decode, path: str, body: dict) -> list[str]:
    """The same streaming body to both workers, as a router sends it; the decode worker's SSE lines."""
    body = {**body, "stream": True, "bootstrap_host": "127.0.0.1", "bootstrap_port": prefill.bootstrap_port,
            "bootstrap_room": next(_rooms)}
    t = threading.Thread(target=http_sync.post, args=(prefill.url + path,), kwargs={"json_body": body, "timeout_s": 30})
    t.start()
    with http_sync.stream("POST", decode.url + path, json_body=body, timeout_s=30) as resp:
        lines = [line.decode() for line in resp.lines() if line]
    t.join()
    return lines


def test_streaming_and_openai_endpoints(pair):
    lines = pd_stream(*pair, "/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "hi there"}],
                                                      "max_tokens": 4})
    assert lines[-1] == "data: [DONE]"
    chunks = [msgspec.json.decode(line[6:]) for line in lines[:-1]]
    contents = [c["choices"][0]["delta"].get("content") for c in chunks if c["choices"]]
    assert sum(1 for c in contents if c) == 4
    assert all(c["choices"] for c in chunks)  # no usage chunk unless asked for


def test_stream_options_include_usage(pair):
    lines = pd_stream(*pair, "/v1/completions", {"model": "m", "prompt": [5, 6, 7], "max_tokens": 3,
                                                 "stream_options": {"include_usage": True}})
    assert lines[-1] == "data: [DONE]"
    last = msgspec.json.decode(lines[-2][6:])
    assert last["choices"] == [] and last["usage"]["prompt_tokens"] == 3 and last["usage"]["completion_tokens"] == 3


def test_a_decode_with_a_stream_interval_streams_every_nth_token_and_says_so(pair, procs):
    """SGLang's ``--stream-interval 4``: chunks at tokens 1, 5, 9 and the last, each with the usage so far
    (``continuous_usage_stats``), the text whole; ``/server_info`` reports the interval, which the router's facts
    read (its TBT then counts a chunk's gap over 4)."""
    from prfaas_sglang.wire.server_info import parse_server_info

    prefill, _ = pair
    decode = start_worker(procs, "pd-decode", DECODE_PROFILE, "--speedup", "20", "--kv-scale", str(KV_SCALE),
                          "--bootstrap-timeout-s", "2", "--stream-interval", "4")
    body = {"model": "m", "prompt": [5, 6, 7], "max_tokens": 10,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    lines = pd_stream(prefill, decode, "/v1/completions", body)
    chunks = [msgspec.json.decode(line[6:]) for line in lines[:-1]]
    with_text = [c for c in chunks if c["choices"]]
    assert [c["usage"]["completion_tokens"] for c in with_text] == [1, 5, 9, 10]  # the last: the finish chunk
    assert with_text[-1]["choices"][0]["finish_reason"] == "length" and chunks[-1]["choices"] == []
    one_by_one = pd_stream(*pair, "/v1/completions", body)  # interval 1: the same text, a token a chunk
    text = "".join(c["choices"][0]["text"] for c in with_text)
    assert text == "".join(msgspec.json.decode(line[6:])["choices"][0]["text"] for line in one_by_one[:-2])
    assert parse_server_info(http_sync.get(decode.url + "/server_info", timeout_s=5).json()).stream_interval == 4
    assert parse_server_info(http_sync.get(pair[1].url + "/server_info", timeout_s=5).json()).stream_interval == 1


class TestBadInput:
    def test_malformed_json_and_missing_fields(self, pair):
        prefill, decode = pair
        r = http_sync.post(decode.url + "/generate", data="{not json", timeout_s=5)
        assert r.status == 400 and "not valid JSON" in r.json()["error"]["message"]
        r = http_sync.post(decode.url + "/generate", json_body={"input_ids": [1, 2]}, timeout_s=5)
        assert r.status == 400 and "bootstrap" in r.json()["error"]["message"]
        r = http_sync.post(prefill.url + "/v1/completions", json_body={"prompt": None}, timeout_s=5)
        assert r.status == 400

    def test_prompt_beyond_context(self, pair):
        prefill, decode = pair
        p, d = pd_request(prefill, decode, {"input_ids": [1] * 70_000})
        assert p.status == 400 and d.status == 400
        assert "exceeds the context length 65536" in d.json()["error"]["message"]

    def test_unknown_room_and_malformed_hand_off_on_kv_ready(self, pair):
        from prfaas_sglang.wire.handoff import KvReady

        _, decode = pair
        ready = KvReady(123456789, True, 64, 0, 1, 0.01).to_json()
        r = http_sync.post(decode.url + "/prfaas/kv_ready", json_body=ready, timeout_s=5)
        assert r.status == 404 and "unknown bootstrap room" in r.json()["error"]["message"]
        for bad in ({"room": 1, "ok": True}, {**ready, "v": 99}, {**ready, "room": "x"}, [1]):
            r = http_sync.post(decode.url + "/prfaas/kv_ready", json_body=bad, timeout_s=5)
            assert r.status == 400, bad

    def test_decode_without_prefill_partner_times_out_and_frees(self, pair):
        prefill, decode = pair
        free_before = metric(decode, "prfaas:kv_buffer_free_bytes")
        body = {"input_ids": list(range(4_000)), "bootstrap_host": "127.0.0.1",
                "bootstrap_port": prefill.bootstrap_port, "bootstrap_room": next(_rooms)}
        r = http_sync.post(decode.url + "/generate", json_body=body, timeout_s=30)
        assert r.status == 504 and "no prefill partner" in r.json()["error"]["message"]
        assert metric(decode, "prfaas:kv_buffer_free_bytes") == free_before
        assert metric(decode, "prfaas:open_rooms") == 0

    def test_prefill_without_decode_partner(self, pair):
        prefill, _ = pair
        body = {"input_ids": [1, 2, 3], "bootstrap_host": "127.0.0.1", "bootstrap_port": prefill.bootstrap_port,
                "bootstrap_room": next(_rooms)}
        r = http_sync.post(prefill.url + "/generate", json_body=body, timeout_s=30)
        assert r.status == 503 and "no decode worker registered" in r.json()["error"]["message"]
        assert metric(prefill, "prfaas:open_rooms") == 0

    def test_unreachable_bootstrap_server(self, pair):
        _, decode = pair
        body = {"input_ids": [1, 2, 3], "bootstrap_host": "127.0.0.1", "bootstrap_port": 1, "bootstrap_room": next(_rooms)}
        r = http_sync.post(decode.url + "/generate", json_body=body, timeout_s=30)
        assert r.status == 502 and "cannot reach the prefill bootstrap server" in r.json()["error"]["message"]

    def test_workers_still_serve_after_bad_input(self, pair):
        prefill, decode = pair
        p, d = pd_request(prefill, decode, {"input_ids": list(range(600)), "sampling_params": {"max_new_tokens": 2}})
        assert p.status == 200 and d.status == 200


def test_router_facing_surface(pair):
    prefill, decode = pair
    assert http_sync.get(decode.url + "/v1/models", timeout_s=5).json()["data"][0]["owned_by"] == "sglang"
    info = http_sync.get(prefill.url + "/server_info", timeout_s=5).json()
    assert info["dp_size"] == 1 and info["max_total_num_tokens"] > 0 and info["disaggregation_mode"] == "prefill"
    assert info["kv_events"]["block_size"] == info["page_size"] == 512
    assert http_sync.get(prefill.url + "/get_server_info", timeout_s=5).json() == info
    assert http_sync.get(decode.url + "/get_model_info", timeout_s=5).status == 200
    assert http_sync.get(decode.url + "/get_load", timeout_s=5).json()[0]["dp_rank"] == 0
    loads = http_sync.get(decode.url + "/v1/loads", timeout_s=5).json()["loads"][0]
    # SGLang 0.5.15's GetLoadsReqOutput core fields, which the router reads
    for key in ("num_running_reqs", "num_waiting_reqs", "num_used_tokens", "max_total_num_tokens", "max_running_requests"):
        assert isinstance(loads[key], int), key
    assert "sglang:num_running_reqs" in http_sync.get(decode.url + "/metrics", timeout_s=5).text
    assert http_sync.get(decode.url + "/version", timeout_s=5).status == 404
    assert http_sync.post(prefill.url + "/flush_cache", timeout_s=5).status == 200
    assert http_sync.get(decode.url + "/health_generate", timeout_s=5).status == 200
