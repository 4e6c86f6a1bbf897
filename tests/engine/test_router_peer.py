"""Acceptance: the real peer routers (PyPI, pinned: sglang-router 0.3.2 and its successor smg 1.13)
in PD mode in front of emulated workers."""

from __future__ import annotations

import os

import msgspec
import pytest
import requests
from deployments import EMULATED_PAIR

from prfaas_sglang.demo.cluster import ProcessGroup, start_peer_router

# The peer routers run over the standard pair's PrfaaS (as their prefill) and PD-D workers (tests/deployments.py).
pytestmark = pytest.mark.xdist_group(EMULATED_PAIR)
PEERS = {"sglang-router": "0.3.2", "smg": "1.13.0"}


@pytest.fixture(scope="module", params=sorted(PEERS))
def router(request, emulated_pair, tmp_path_factory):
    import importlib.metadata

    version = PEERS[request.param]
    assert importlib.metadata.version(request.param) == version
    emulated_pair.reset()
    group = ProcessGroup(tmp_path_factory.mktemp(request.param) / "logs")
    try:
        prefill, decode = emulated_pair.worker("prfaas"), emulated_pair.worker("pd-decode")
        url = start_peer_router(group, request.param, [prefill], [decode], prefill_policy="cache_aware",
                                decode_policy="round_robin")
        yield url, decode
    finally:
        group.stop()


def sse_events(resp) -> list[str]:
    return [line[6:] for line in resp.iter_lines(decode_unicode=True) if line.startswith("data: ")]


@pytest.mark.slow
def test_generate_non_streaming(router):
    url, _ = router
    r = requests.post(url + "/generate", json={"input_ids": list(range(2_000)), "sampling_params": {"max_new_tokens": 6}}, timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    assert len(body["output_ids"]) == 6 and body["meta_info"]["prompt_tokens"] == 2_000
    assert body["meta_info"]["prfaas"]["role"] == "decode" and body["meta_info"]["prfaas"]["kv_bytes"] > 0


def test_generate_streaming(router):
    url, _ = router
    with requests.post(url + "/generate", json={"input_ids": list(range(900)), "sampling_params": {"max_new_tokens": 5}, "stream": True},
                       stream=True, timeout=60) as r:
        assert r.status_code == 200
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    last = msgspec.json.decode(events[-2])
    assert len(last["output_ids"]) == 5 and last["meta_info"]["finish_reason"]["type"] == "length"


def test_chat_completions_streaming_and_not(router):
    url, _ = router
    body = {"model": "kimi-linear-1t-hybrid", "messages": [{"role": "user", "content": "say something long"}], "max_tokens": 4}
    r = requests.post(url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["message"]["role"] == "assistant" and len(choice["message"]["content"].split()) == 4
    with requests.post(url + "/v1/chat/completions", json={**body, "stream": True}, stream=True, timeout=60) as s:
        events = sse_events(s)
    assert events[-1] == "[DONE]"
    chunks = [msgspec.json.decode(e) for e in events[:-1]]
    # smg asks for stream_options.include_usage: a last chunk with no choices carries the usage
    deltas = [c["choices"][0]["delta"].get("content") for c in chunks if c["choices"]]
    assert all(c.get("usage", {}).get("completion_tokens") == 4 for c in chunks if not c["choices"])
    assert "".join(d for d in deltas if d) == choice["message"]["content"]


def test_completions(router):
    url, _ = router
    r = requests.post(url + "/v1/completions", json={"model": "kimi-linear-1t-hybrid", "prompt": "one two three", "max_tokens": 3}, timeout=60)
    assert r.status_code == 200 and len(r.json()["choices"][0]["text"].split()) == 3


def test_router_spreads_nothing_it_should_not(router):
    """After the requests above, the decode worker holds no KV region and no room."""
    _, decode = router
    text = requests.get(decode.url + "/metrics", timeout=5).text
    assert "prfaas:open_rooms{" in text and 'prfaas:open_rooms{model_name="kimi-linear-1t-hybrid"} 0' in text


@pytest.mark.slow
def test_a_peer_router_whose_picked_port_was_taken_starts_again_on_new_ports(emulated_pair, procs, monkeypatch):
    """A port picked free can be taken before the peer router binds it (CI saw sglang-router exit with
    "Address already in use" for its Prometheus port): it is started again on new ports, not failed."""
    import socket

    from prfaas_sglang.demo import cluster

    emulated_pair.reset()
    prefill, decode = emulated_pair.worker("prfaas"), emulated_pair.worker("pd-decode")
    with socket.socket() as held:
        held.bind(("0.0.0.0", 0))
        held.listen()
        taken, picks = held.getsockname()[1], []
        real_pick = cluster.PortPicker.__call__

        def pick(self, host="127.0.0.1"):  # the first start's second pick (its Prometheus port) is taken
            picks.append(taken if len(picks) == 1 else real_pick(self, host))
            return picks[-1]

        monkeypatch.setattr(cluster.PortPicker, "__call__", pick)
        url = start_peer_router(procs, "sglang-router", [prefill], [decode], name="peer-port-race",
                                decode_policy="round_robin")
    starts = [p for p in procs.procs if p.name == "peer-port-race"]
    assert len(starts) == 2 and starts[0].returncode not in (None, 0) and starts[1].poll() is None
    assert url == f"http://127.0.0.1:{picks[2]}" and taken not in picks[2:]
    r = requests.post(url + "/generate", json={"input_ids": list(range(600)), "sampling_params": {"max_new_tokens": 3}}, timeout=60)
    assert r.status_code == 200 and len(r.json()["output_ids"]) == 3


def _parent_of(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


@pytest.mark.slow
def test_sglang_router_starts_fork_from_one_zygote_that_outlives_the_groups_sharing_it(emulated_pair, tmp_path):
    """sglang-router imports SGLang's server code each start (6 CPU-s): the starts of groups that share a
    :class:`~prfaas_sglang.bench.zygote.Zygotes` fork from one process that imported it once, route, and
    stop with their group; the zygote stops with the pool, not the group. smg (a light launcher) starts
    afresh."""
    from prfaas_sglang.bench.zygote import Zygotes

    emulated_pair.reset()
    prefill, decode = emulated_pair.worker("prfaas"), emulated_pair.worker("pd-decode")
    with Zygotes() as zygotes:
        parents = []
        for i in range(2):
            group = ProcessGroup(tmp_path / f"run-{i}", zygotes=zygotes)
            try:
                url = start_peer_router(group, "sglang-router", [prefill], [decode], decode_policy="round_robin")
                proc = group.latest("sglang-router")
                parents.append(_parent_of(proc.pid))
                r = requests.post(url + "/generate", json={"input_ids": list(range(600)),
                                                           "sampling_params": {"max_new_tokens": 3}}, timeout=60)
                assert r.status_code == 200 and len(r.json()["output_ids"]) == 3
            finally:
                group.stop()
            assert proc.poll() is not None  # gone with its group
        zygote = zygotes.get(("sglang_router.launch_router",))
        assert parents == [zygote.proc.pid] * 2 and zygote.proc.poll() is None  # one zygote, alive after both groups
    assert zygote.proc.poll() is not None
    group = ProcessGroup(tmp_path / "smg")
    try:
        start_peer_router(group, "smg", [prefill], [decode], decode_policy="round_robin")
        assert _parent_of(group.latest("smg").pid) == os.getpid()
    finally:
        group.stop()
