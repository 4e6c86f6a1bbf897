"""``bench prefill-cache``: the admission modes replayed on a Mooncake-format trace (pure parts)."""

from __future__ import annotations

import json

from helpers import run_py

from prfaas_sglang.bench import prefill_cache


def _trace(tmp_path, records) -> str:
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps({"timestamp": i, "input_length": n, "output_length": 8, "hash_ids": ids}) + "\n"
                            for i, (n, ids) in enumerate(records)))
    return str(path)


def test_one_off_prompts_are_never_inserted_and_a_thrice_seen_prefix_hits(tmp_path):
    unique = [(40 * 512, list(range(100 * k, 100 * k + 40))) for k in range(1, 6)]  # five one-off long prompts
    shared = [(40 * 512, list(range(40)) + [9_000 + k]) for k in range(3)]  # one 20K-token prefix, thrice
    short = [(1_000, [7, 8])]  # below --min-tokens: not PrfaaS traffic
    result = prefill_cache.run(_trace(tmp_path, unique + shared + short), min_tokens=16_384, cache_tokens=(1 << 22,))
    rows = {r["mode"]: r for r in result["rows"]}
    assert result["requests"] == 8
    assert rows["none"]["hit_fraction"] == 0 and rows["none"]["inserted_tokens_per_request"] == 0
    # shared keeps the second and third sighting of the prefix only; all keeps everything
    assert rows["shared"]["kept_requests"] == 2 and rows["all"]["kept_requests"] == 8
    assert rows["shared"]["inserted_tokens_per_request"] < rows["all"]["inserted_tokens_per_request"]
    # all hits on the 2nd and 3rd sighting, shared on the 3rd only (the 2nd found it not yet kept)
    assert 0 < rows["shared"]["hit_fraction"] < rows["all"]["hit_fraction"]


def test_a_small_cache_thrashes_under_all_and_not_under_shared(tmp_path):
    """The tree holds one long prompt: under ``all`` each one-off prompt evicts the shared prefix
    between its sightings; under ``shared`` one-offs never enter and the prefix survives."""
    records = []
    for k in range(4):
        records.append((40 * 512, list(range(40)) + [9_000 + k]))  # the shared prefix again
        records.append((40 * 512, list(range(1_000 * (k + 1), 1_000 * (k + 1) + 40))))  # a one-off in between
    result = prefill_cache.run(_trace(tmp_path, records), min_tokens=16_384, cache_tokens=(41 * 512,))
    rows = {r["mode"]: r for r in result["rows"]}
    assert rows["all"]["hit_fraction"] == 0
    assert rows["shared"]["hit_fraction"] > 0 and rows["shared"]["evicted_blocks"] < rows["all"]["evicted_blocks"]


def test_cli_prints_a_table_and_refuses_bad_input(tmp_path):
    trace = _trace(tmp_path, [(20_000, list(range(40)))] * 3)
    ok = run_py(["-m", "prfaas_sglang.bench", "prefill-cache", "--trace", trace, "--cache-tokens", "65536"])
    assert ok.returncode == 0, ok.stderr
    assert "| 65,536 | `shared` |" in ok.stdout
    for bad in (["--cache-tokens", "x"], ["--cache-tokens", "100"], ["--min-tokens", "0"], ["--min-tokens", "999999"]):
        r = run_py(["-m", "prfaas_sglang.bench", "prefill-cache", "--trace", trace, *bad])
        assert r.returncode == 2 and "error" in r.stderr, (bad, r.stderr[-300:])


def test_auto_follows_all_in_a_cache_that_holds_a_turn_until_the_next_and_shared_in_one_that_does_not(tmp_path):
    """Conversations (a 16K-token turn, back 2 steps later as a 20K-token turn) and a 10K-token
    system prompt with unique 10K-token tails. 400 pages hold a turn until the next one: keeping
    every prefill (``all``) hits every second turn, ``shared`` misses them. 64 pages do not: there
    ``all`` thrashes and ``shared`` keeps the system prompt. ``auto`` does the better in each."""
    def conversation(c: int, blocks: int) -> list[int]:
        return [100_000 + 100 * c + j for j in range(blocks)]

    records = []
    for i in range(40):
        records.append((32 * 512, conversation(i, 32)))
        if i >= 2:
            records.append((40 * 512, conversation(i - 2, 40)))
        records.append((40 * 512, list(range(20)) + [50_000 + 20 * i + j for j in range(20)]))
    result = prefill_cache.run(_trace(tmp_path, records), min_tokens=16_384, cache_tokens=(64 * 512, 400 * 512))
    hits = {(r["cache_tokens"] // 512, r["mode"]): r["hit_fraction"] for r in result["rows"]}
    assert hits[400, "all"] > 2 * hits[400, "shared"] and hits[400, "auto"] == hits[400, "all"]
    assert hits[64, "shared"] > 20 * hits[64, "all"]
    assert hits[64, "auto"] >= 0.9 * hits[64, "shared"]  # less only by what it kept before it had measured
