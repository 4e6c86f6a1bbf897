"""Decode affinity end to end on emulated hybrid workers: with SGLang's decode radix cache on two
decode workers publishing their KV events, a conversation's next turn goes to the decode worker
that holds its earlier turns, which then receives only the KV beyond them (real HTTP, real
Mooncake bytes, the router's own index). The router's prediction of what the decode worker holds
is what the worker then reports as ``decode_prefix_len``."""

from __future__ import annotations

import concurrent.futures
import time

import pytest
import requests
from deployments import SharedWorkers

from prfaas_sglang.demo.cluster import local_topology

THRESHOLD = 6_000  # first turns of 9K go to PrfaaS (their KV crosses the link), later additions are PD-sized
ARGS = ("--bootstrap-timeout-s", "10", "--context-tokens", "65536")


@pytest.fixture(scope="module")
def workers(tmp_path_factory):
    """The workers, started once: each test lends them (their caches flushed) with a router of its own."""
    doc = local_topology(pd_prefill=1, pd_decode=2, speedup=20, kv_scale=0.002, threshold_tokens=THRESHOLD,
                         telemetry=False, decode_events=True, router=False)
    engine_args = {"prfaas": ARGS, "pd-prefill": ARGS, "pd-decode": ARGS + ("--disaggregation-decode-enable-radix-cache",)}
    shared = SharedWorkers.start(tmp_path_factory.mktemp("affinity") / "logs", doc, engine_args)
    yield shared
    shared.stop()


def _status(url: str) -> dict:
    return requests.get(url + "/status", timeout=5).json()


def _blocks(url: str) -> dict[str, int]:
    return {name: w["index_blocks"] or 0 for name, w in _status(url)["workers"].items() if name.startswith("pd-decode")}


def _conversations(url: str, n_conversations: int = 3, turns: int = 3) -> list[dict]:
    """Turn by turn, the conversations' turns at once (each prompt: the previous prompt, its answer
    and a new message; lengths differ per conversation, so the router's recent decisions tell them
    apart); after each round, until the decode workers' events for it reached the router's index.
    Returns per turn the router's decision and what the decode worker reported."""
    out, history = [], {}

    def send(c: int, turn: int) -> tuple[list[int], dict]:
        fresh = [(c * 7_919 + turn * 104_729 + i * 31) % 30_000 for i in range((9_000 if turn == 0 else 1_200) + 7 * c)]
        prompt = history.get(c, []) + fresh
        # first turns decode longer: their reservations are still open when the others are routed
        reply = requests.post(url + "/generate", json={"input_ids": prompt,
                                                       "sampling_params": {"max_new_tokens": 64 if turn == 0 else 8}},
                              timeout=120)
        assert reply.status_code == 200, reply.text
        return prompt, reply.json()

    with concurrent.futures.ThreadPoolExecutor(n_conversations) as pool:
        for turn in range(turns):
            before = _blocks(url)
            replies = list(pool.map(lambda c, turn=turn: send(c, turn), range(n_conversations)))
            recent = {r["tokens"]: r for r in _status(url)["recent"]}
            for c, (prompt, body) in enumerate(replies):
                decision = recent[len(prompt)]
                out.append({"conversation": c, "turn": turn, "decode": decision["decode"], "earlier": len(history.get(c, [])),
                            "predicted": decision["decode_held_tokens"],
                            "held": body["meta_info"]["prfaas"]["decode_prefix_len"]})
                history[c] = prompt + body["output_ids"]
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and sum(_blocks(url).values()) == sum(before.values()):
                time.sleep(0.05)
            time.sleep(0.3)  # the round's last events
    return out


@pytest.mark.slow
def test_a_conversation_stays_on_the_decode_worker_that_holds_it_and_ships_only_what_is_new(workers, tmp_path):
    with workers.deployment(tmp_path / "logs") as dep:
        turns = _conversations(dep.router.url)
    first = {t["conversation"]: t["decode"] for t in turns if t["turn"] == 0}
    assert len(set(first.values())) == 2  # the first turns spread (most free KV): nothing is held yet
    for t in turns:
        assert t["held"] == t["predicted"], t  # the router's index predicted what the worker supplied
        if t["turn"] > 0:
            assert t["decode"] == first[t["conversation"]], t
            # the earlier turns (prompts and answers) in whole pages, but the page their state ends on
            assert t["held"] >= t["earlier"] - 2 * 512, t


@pytest.mark.slow
def test_without_affinity_the_router_still_knows_what_each_decode_worker_holds(workers, tmp_path):
    """The same conversations with affinity off (``--decode-affinity-slack -1``): the decode worker is
    chosen by free KV alone (``tests/router/test_policy.py::TestDecodeAffinity``), and whatever it
    lands on, the router's index predicted exactly what that worker's cache supplied; the metric
    adds it up."""
    with workers.deployment(tmp_path / "logs", "--decode-affinity-slack", "-1") as dep:
        turns = _conversations(dep.router.url)
        metrics = requests.get(dep.router.url + "/metrics", timeout=5).text
    for t in turns:
        assert t["held"] == t["predicted"], t
    held_total = next(float(line.split()[-1]) for line in metrics.splitlines()
                      if line.startswith("prfaas_router_decode_held_tokens_total"))
    assert held_total == sum(t["held"] for t in turns)


@pytest.mark.slow
def test_a_decode_affinity_slack_above_one_or_not_a_number_is_refused(tmp_path):
    import yaml
    from helpers import run_py

    path = tmp_path / "t.yaml"
    path.write_text(yaml.safe_dump(local_topology()))
    for value in ("1.5", "nan"):
        proc = run_py(["-m", "prfaas_sglang.router", "--config", str(path), "--decode-affinity-slack", value])
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.strip() == f"error: --decode-affinity-slack: must be <= 1 (negative: off), got {float(value)}"
