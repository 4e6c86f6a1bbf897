"""Router-chosen state checkpoints (issue #15 item 5): the wire field, the router's choice, the
emulated engine keeping the state there, end to end. SGLang's side (the hint becoming the match's
branching point) is in tests/engine/test_state_events.py."""

from __future__ import annotations

import dataclasses
import json

import pytest
import requests
from deployments import EMULATED_PAIR
from test_conversion import _service
from test_router_e2e import wait_for_index

from prfaas_sglang.demo.cluster import local_topology
from prfaas_sglang.protocol import (
    CHECKPOINT_PARAM,
    BadRequest,
    EngineRequest,
    parse_request,
    with_checkpoint,
)
from prfaas_sglang.router.server import ClientBody, leg_bytes
from prfaas_sglang.wire.kv_events import BlockStored

PAGE = 512


def test_the_hint_is_read_from_sglangs_custom_params_and_refused_when_malformed():
    generate = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2, "custom_params": {CHECKPOINT_PARAM: 2}}}
    assert parse_request("generate", generate, "r").checkpoint_tokens == 2
    chat = {"messages": [{"role": "user", "content": "a b"}], "custom_params": {CHECKPOINT_PARAM: 1, "x": "y"}}
    assert parse_request("chat", chat, "r", text_ids=lambda t: [1, 2, 3]).checkpoint_tokens == 1
    assert parse_request("completions", {"prompt": [1, 2]}, "r").checkpoint_tokens is None
    for bad in ({CHECKPOINT_PARAM: 0}, {CHECKPOINT_PARAM: "9"}, {CHECKPOINT_PARAM: True}, {CHECKPOINT_PARAM: 2**40}):
        with pytest.raises(BadRequest, match=CHECKPOINT_PARAM):
            parse_request("completions", {"prompt": [1, 2], "custom_params": bad}, "r")
    with pytest.raises(BadRequest, match="custom_params must be an object"):
        parse_request("generate", {"input_ids": [1], "sampling_params": {"custom_params": [1]}}, "r")


@pytest.mark.parametrize("kind, body", [
    ("generate", {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 5, "custom_params": {"a": 1}}}),
    ("generate", {"input_ids": [1, 2, 3]}),
    ("completions", {"prompt": [1, 2, 3], "max_tokens": 5, "custom_params": {"a": 1}}),
])
def test_the_prefill_leg_carries_the_hint_and_keeps_the_clients_params(kind, body):
    """Appended to the client's bytes (no re-serialisation of the prompt), the members replace the
    client's ``sampling_params`` / ``custom_params`` with the same plus the hint."""
    raw = json.dumps(body).encode()
    sent = json.loads(leg_bytes(ClientBody(body, raw), None, {"stream": False, **with_checkpoint(kind, body, 1024)}))
    params = sent["sampling_params"]["custom_params"] if kind == "generate" else sent["custom_params"]
    assert params[CHECKPOINT_PARAM] == 1024 and params.get("a") == body.get("custom_params", body.get("sampling_params", {}).get("custom_params", {})).get("a")
    if kind == "generate" and "sampling_params" in body:
        assert sent["sampling_params"]["max_new_tokens"] == 5
    assert parse_request(kind, sent, "r").checkpoint_tokens == 1024  # what the engine reads back


def _service_holding(prompt: list[int], pages: int, **config):
    """A router service whose index has ``pd-prefill-0`` holding ``prompt``'s first ``pages`` pages,
    with no state (a hybrid model's prefix computed for an earlier request)."""
    service = _service()
    service.config = dataclasses.replace(service.config, **config)
    for name, worker in service.workers.items():
        service.index.add_worker(name, worker.cluster, PAGE)
    blocks = service.index.block_ids(prompt, PAGE)[:pages]
    service.index.apply("pd-prefill-0", 0, [BlockStored([b], blocks[i - 1] if i else None,
                                                        prompt[i * PAGE:(i + 1) * PAGE], PAGE, None)
                                            for i, b in enumerate(blocks)], [])
    return service


def test_the_router_asks_for_a_checkpoint_where_a_prefix_is_held_without_a_state():
    prompt = list(range(10_000, 10_000 + 6 * PAGE))
    req = EngineRequest("generate", tuple(prompt), 8, False, "r", None, None)
    service = _service_holding(prompt, 3)
    assert service.index.hybrid
    decision = service.decide(service.route_input(req), set(), 0.0)
    assert decision.cluster == "pd" and decision.cached_tokens == 0 and decision.checkpoint_tokens == 3 * PAGE
    off = _service_holding(prompt, 3, checkpoint_min_tokens=None)
    assert off.decide(off.route_input(req), set(), 0.0).checkpoint_tokens is None


def _cached(response: requests.Response) -> int:
    assert response.status_code == 200, response.text[:300]
    return response.json()["meta_info"]["cached_tokens"]


@pytest.mark.slow
@pytest.mark.xdist_group(EMULATED_PAIR)
@pytest.mark.parametrize("hints", [True, False])
def test_end_to_end_the_second_sighting_leaves_a_state_at_the_shared_prefix(emulated_pair, tmp_path, hints):
    """Emulated hybrid workers (the standard pair, tests/deployments.py), chunk checkpoints every 8,192
    tokens: a 1,536-token prefix followed by 1,536 unique tokens, three times, on PD-P. The first leaves
    blocks but no state at 1,536; the router then asks the second for one there (the worker keeps it and
    reports it); the third resumes there. With ``--checkpoint-min-tokens 0`` it never asks and the third
    reuses nothing."""
    with emulated_pair.deployment(tmp_path / "logs", "--no-early-rejection",
                                  *(() if hints else ("--checkpoint-min-tokens", "0")), threshold_tokens=8192,
                                  name="hints" if hints else "no-hints") as d:
        stem = list(range(20_000, 20_000 + 3 * PAGE))

        def send(k: int) -> requests.Response:
            ids = stem + [30_000 + 1_000 * k + i for i in range(3 * PAGE)]
            return requests.post(d.router.url + "/generate", timeout=60,
                                 json={"input_ids": ids, "sampling_params": {"max_new_tokens": 2}})

        assert _cached(send(0)) == 0
        wait_for_index(d.router.url, "pd-prefill-0", 6)
        assert _cached(send(1)) == 0  # nothing to resume from yet: only blocks at 1,536
        wait_for_index(d.router.url, "pd-prefill-0", 9)
        third = send(2)
        status = requests.get(d.router.url + "/metrics", timeout=5).text
        hinted = next(float(line.split()[-1]) for line in status.splitlines()
                      if line.startswith("prfaas_router_checkpoint_hints_total"))
        if hints:
            assert _cached(third) == len(stem) and hinted >= 1
        else:
            assert _cached(third) == 0 and hinted == 0


def test_a_negative_checkpoint_minimum_is_refused(tmp_path):
    import yaml
    from helpers import run_py

    path = tmp_path / "t.yaml"
    path.write_text(yaml.safe_dump(local_topology()))
    proc = run_py(["-m", "prfaas_sglang.router", "--config", str(path), "--checkpoint-min-tokens", "-1"])
    assert proc.returncode == 2 and proc.stderr.strip() == "error: --checkpoint-min-tokens: must be >= 0 (0: never), got -1"
