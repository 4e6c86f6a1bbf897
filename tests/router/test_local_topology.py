"""launch/local-two-cluster.yaml brought up on emulated engines (every node through the launcher, the router
with no --node); text and chat end to end; a conversation sent as text keeps its prefix's worker."""

from __future__ import annotations

import json
import sys
import time

import pytest
import requests
import yaml
from helpers import REPO_ROOT

from prfaas_sglang.demo.cluster import (
    PortPicker,
    ProcessGroup,
    local_topology,
    start_deployment,
    topology_nodes,
)

PORT_KEYS = ("port", "bootstrap_port", "kv_events_port", "telemetry_port")


@pytest.fixture(scope="module")
def shipped(tmp_path_factory):
    """The shipped file with its ports moved to free ones (nothing else changed)."""
    tmp = tmp_path_factory.mktemp("local")
    doc = yaml.safe_load((REPO_ROOT / "launch" / "local-two-cluster.yaml").read_text())
    pick = PortPicker()
    for node in topology_nodes(doc).values():
        for key in PORT_KEYS:
            if key in node:
                node[key] = pick()
    config = tmp / "local-two-cluster.yaml"
    config.write_text(yaml.safe_dump(doc, sort_keys=False))
    group = ProcessGroup(tmp / "logs")
    launch = [sys.executable, "-m", "prfaas_sglang.launch", "--config", str(config)]
    try:
        engines = []
        for node in topology_nodes(doc).values():
            if node["role"] in ("prfaas", "pd-prefill", "pd-decode"):
                engines.append((group.start(node["name"], [*launch, "--node", node["name"], "--engine", "mock"]), node))
        for proc, node in engines:
            group.wait_healthy(f"http://127.0.0.1:{node['port']}/health", proc)
        nodes = topology_nodes(doc)
        router = group.start("router", launch)  # no --node: the topology's router node
        group.wait_healthy(f"http://127.0.0.1:{nodes['router']['port']}/health", router)
        kv_index = group.start("kv-index", [*launch, "--node", "kv-index"])
        group.wait_healthy(f"http://127.0.0.1:{nodes['kv-index']['port']}/health", kv_index)
        yield {"router": f"http://127.0.0.1:{nodes['router']['port']}", "kv_index": f"http://127.0.0.1:{nodes['kv-index']['port']}",
               "logs": group.log_dir}
    finally:
        group.stop()


def sse(resp) -> list[dict]:
    return [json.loads(line[6:]) for line in resp.iter_lines(decode_unicode=True) if line.startswith("data: {")]


@pytest.mark.slow
def test_text_completion_end_to_end(shipped):
    url = shipped["router"]
    r = requests.post(url + "/v1/completions", json={"model": "tiny-hybrid", "prompt": "Prefill as a service, " * 40,
                                                     "max_tokens": 6}, timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model"] == "tiny-hybrid" and body["usage"]["completion_tokens"] == 6 and body["choices"][0]["text"]
    with requests.post(url + "/v1/completions", json={"prompt": "stream me", "max_tokens": 4, "stream": True,
                                                      "stream_options": {"include_usage": True}}, stream=True, timeout=60) as s:
        chunks = sse(s)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4
    assert sum(1 for c in chunks if c["choices"] and c["choices"][0]["text"]) == 4


def test_chat_end_to_end(shipped):
    url = shipped["router"]
    body = {"model": "tiny-hybrid", "max_tokens": 5, "messages": [
        {"role": "system", "content": "You answer in five tokens."}, {"role": "user", "content": "Where does prefill run?"}]}
    r = requests.post(url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["role"] == "assistant" and r.json()["usage"]["completion_tokens"] == 5
    with requests.post(url + "/v1/chat/completions", json={**body, "stream": True}, stream=True, timeout=60) as s:
        chunks = sse(s)
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == r.json()["choices"][0]["message"]["content"]  # deterministic outputs: same text both ways


def test_models_and_unknown_model(shipped):
    url = shipped["router"]
    assert [m["id"] for m in requests.get(url + "/v1/models", timeout=5).json()["data"]] == ["tiny-hybrid"]
    r = requests.post(url + "/v1/chat/completions", json={"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]}, timeout=5)
    assert r.status_code == 404 and "tiny-hybrid" in r.json()["error"]["message"]


def test_router_status_reflects_the_topology(shipped):
    status = requests.get(shipped["router"] + "/status", timeout=5).json()
    from prfaas_sglang import runtime
    from prfaas_sglang.topology import load_topology

    expected = runtime.from_topology(load_topology(REPO_ROOT / "launch" / "local-two-cluster.yaml")).baseline_threshold_tokens
    # the planner's t for the topology; the live threshold moves with what this module's other tests sent
    assert status["model"]["baseline_threshold_tokens"] == expected
    assert status["model"]["emulation"] == {"speedup": 20.0, "kv_scale": 0.01}
    assert status["model"]["defaults_used"] == []  # everything the scheduler assumes is in the file
    assert status["subscriptions"]["link:prfaas-0"]["frames"] > 0  # real telemetry from the emulated PrfaaS worker


def test_kv_index_sees_the_text_prompts(shipped):
    from prfaas_sglang.tokenizer import PromptTokenizer

    prompt = "a long shared context " * 400
    ids = PromptTokenizer.load("prfaas-tiny-chatml").encode_text(prompt)
    assert requests.post(shipped["router"] + "/v1/completions", json={"prompt": prompt, "max_tokens": 1}, timeout=60).status_code == 200
    deadline = time.monotonic() + 10
    while True:
        match = requests.post(shipped["kv_index"] + "/match", json={"input_ids": ids + [5]}, timeout=5).json()
        if max(match["by_worker"].values()) >= 512:
            break
        assert time.monotonic() < deadline, match
        time.sleep(0.2)


def test_each_process_logged_to_its_own_file(shipped):
    assert {p.name for p in shipped["logs"].glob("*.log")} == {"prfaas-0.log", "pd-prefill-0.log", "pd-decode-0.log",
                                                              "router.log", "kv-index.log"}


@pytest.mark.slow
def test_a_repeated_conversation_sent_as_text_keeps_its_prefix_worker(tmp_path):
    """Two PD-P workers. Turn 1 is sent while pd-prefill-0 is drained, so it lands on pd-prefill-1; then
    turn 2 (turn 1 + the answer + a new question, as chat text) must follow its prefix there, although
    an idle pd-prefill-0 would win any tie."""
    group = ProcessGroup(tmp_path / "logs")
    token, auth = "t", {"Authorization": "Bearer t"}
    try:
        doc = local_topology(pd_prefill=2, speedup=50, kv_scale=0.002, tokenizer="prfaas-tiny-chatml", served_name="m",
                             threshold_tokens=100_000, telemetry=False)
        url = start_deployment(group, doc, router_env={"PRFAAS_ADMIN_TOKEN": token}).router.url
        system = "You are a patient assistant. " + "Remember this context carefully. " * 400
        turn1 = [{"role": "system", "content": system}, {"role": "user", "content": "First question?"}]
        assert requests.post(url + "/admin/workers/pd-prefill-0/drain", json={"draining": True}, headers=auth, timeout=5).ok
        first = requests.post(url + "/v1/chat/completions", json={"messages": turn1, "max_tokens": 8}, timeout=60)
        assert first.status_code == 200 and first.headers["x-prfaas-route"].startswith("pd/pd-prefill-1/")
        assert requests.post(url + "/admin/workers/pd-prefill-0/drain", json={"draining": False}, headers=auth, timeout=5).ok
        answer = first.json()["choices"][0]["message"]["content"]
        turn2 = turn1 + [{"role": "assistant", "content": answer}, {"role": "user", "content": "And a second one?"}]
        deadline = time.monotonic() + 10
        while (requests.get(url + "/status", timeout=5).json()["workers"]["pd-prefill-1"]["index_blocks"] or 0) < 4:
            assert time.monotonic() < deadline, "the router never indexed turn 1"
            time.sleep(0.1)
        second = requests.post(url + "/v1/chat/completions", json={"messages": turn2, "max_tokens": 8}, timeout=60)
        assert second.status_code == 200 and second.headers["x-prfaas-route"].startswith("pd/pd-prefill-1/")
        recent = requests.get(url + "/status", timeout=5).json()["recent"][-1]
        assert recent["cached_tokens"] >= 2_048 and second.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 2_048
    finally:
        group.stop()
