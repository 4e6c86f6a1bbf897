"""Token ids cut from the raw body (wire/token_ids.py): exact or absent, and parsed only as far as routing reads."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from itertools import chain

import numpy as np
import orjson
import pytest
from helpers import run_py
from hypothesis import event, given, settings
from hypothesis import strategies as st

from prfaas_sglang.kvindex.index import KvIndex
from prfaas_sglang.protocol import BadRequest, parse_request
from prfaas_sglang.wire.blocks import (
    MEMO_ENTRY_OVERHEAD_BYTES,
    PageIdMemo,
    digest_to_int64,
    page_digests,
)
from prfaas_sglang.wire.kv_events import BlockStored
from prfaas_sglang.wire.token_ids import MAX_DIGITS, JsonIds, _has_run, split_ids


def full_parse(raw: bytes, key: str):
    """What the router does without the cut: orjson, then protocol's exact id check."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return "invalid"
    try:
        return body, list(parse_request("generate" if key == "input_ids" else "completions", body, "r").input_ids)
    except BadRequest:
        return "rejected"


_RNG = random.Random(3)
IDS = [_RNG.randrange(200_000) for _ in range(3000)]  # one generator: 3,000 draws, not one draw 3,000 times
BODY = {"sampling_params": {"max_new_tokens": 8, "stop": ["\n"]}, "input_ids": IDS, "stream": False}


@pytest.mark.parametrize("dumps", [
    orjson.dumps,  # compact (orjson, httpx >= 0.28)
    lambda o: json.dumps(o).encode(),  # ", " and ": " (requests, aiohttp's json=)
    lambda o: json.dumps(o, indent=2).encode(),  # newlines and indentation
], ids=["compact", "json.dumps", "indented"])
def test_what_common_clients_send_takes_the_cut(dumps):
    raw = dumps(BODY)
    cut = split_ids(raw, "input_ids")
    assert cut is not None
    obj, ids = cut
    assert isinstance(ids, JsonIds) and len(ids) == len(IDS) and list(ids) == IDS
    assert {k: v for k, v in obj.items() if k != "input_ids"} == {k: v for k, v in BODY.items() if k != "input_ids"}
    req = parse_request("generate", obj, "r")
    assert req.input_ids is ids and len(req.input_ids) == len(IDS) and req.max_new_tokens == 8


@pytest.mark.parametrize("raw", [
    b'{"input_ids": [1, 02]}',  # a leading zero: not JSON
    b'{"input_ids": [1,,2]}', b'{"input_ids": [,1]}', b'{"input_ids": [1,]}', b'{"input_ids": []}',
    b'{"input_ids": [1 2]}',  # whitespace between two numbers
    b'{"input_ids": [1, -2]}', b'{"input_ids": [1.5]}', b'{"input_ids": [1e3]}', b'{"input_ids": [true]}',
    b'{"input_ids": [2147483648]}', b'{"input_ids": [1000000000]}',  # 10 digits: the full parse decides
    b'{"input_ids": [[1, 2], [3]]}',  # batched
    b'{"input_ids": [1, 2], "input_ids": [3]}',  # written twice: the last one counts
    b'{"x": {"input_ids": [1, 2]}}',  # nested, not the request's
    b'{"x": {"input_ids": [1, 2]}, "input\\u005fids": []}',  # the top-level key spelled with an escape
    b'{"text": "\\"input_ids\\": [1, 2]"}',
    b'{"input_ids": [1, 2]', b'{"input_ids": [1, 2]} x', b'[{"input_ids": [1]}]',
])
def test_anything_unsure_goes_to_the_full_parse(raw):
    assert split_ids(raw, "input_ids") is None


@st.composite
def bodies(draw):
    """JSON-ish bodies around an id array, with the mistakes clients and attackers make."""
    valid = st.one_of(st.integers(0, 300_000), st.integers(0, 2**31 + 5)).map(str)
    bad = st.sampled_from(["01", "00", "-1", "1.0", "true", "", " ", "1 2"])
    element = st.integers(0, 15).flatmap(lambda k: bad if k == 0 else valid)  # mostly valid: the cut must be taken often
    items = draw(st.lists(element, min_size=0, max_size=12))
    sep = draw(st.sampled_from([",", ", ", " ,", ",\n  "]))
    array = "[" + draw(st.sampled_from(["", " "])) + sep.join(items) + "]"
    key = draw(st.sampled_from(['"input_ids"', '"input_ids"', '"input_ids" ', '"input\\u005fids"']))
    extra = draw(st.sampled_from(["", ', "stream": true', ', "sampling_params": {"max_new_tokens": 2}', ', "x": {"input_ids": [5]}',
                                  ', "input_ids": [9]', ', "s": "\\"input_ids\\": [4]"']))
    before = draw(st.booleans())
    members = [f"{key}: {array}"] + ([extra.lstrip(", ")] if extra else [])
    return ("{" + ", ".join(reversed(members) if before else members) + "}").encode()


@given(bodies())
@settings(max_examples=600, deadline=None)
def test_the_cut_is_exact_or_absent(raw):
    """Whatever the cut accepts, the full parse accepts with the same object and ids (and the
    common case, plain ids around ordinary members, is taken: see the event below)."""
    cut = split_ids(raw, "input_ids")
    event("cut taken" if cut is not None else "full parse")
    if cut is None:
        return
    expected = full_parse(raw, "input_ids")
    assert expected not in ("invalid", "rejected"), raw
    body, ids = expected
    obj, got = cut
    assert list(got) == ids, raw
    assert {k: v for k, v in obj.items() if k != "input_ids"} == {k: v for k, v in body.items() if k != "input_ids"}


def test_ids_of_every_width_up_to_nine_digits_take_the_cut():
    """The cut is not only exact but taken: ids of 1 to MAX_DIGITS digits, side by side and
    alone, at the array's ends and inside it (a run check one digit short would send them all
    to the full parse, which the exactness test cannot see)."""
    widest = [int("9" * w) for w in range(1, MAX_DIGITS + 1)] + [10 ** (w - 1) for w in range(1, MAX_DIGITS + 1)]
    for ids in (widest, widest[::-1], [widest[-1]], [0, widest[-1], 0]):
        cut = split_ids(orjson.dumps({"input_ids": ids}), "input_ids")
        assert cut is not None and list(cut[1]) == ids, ids


@given(st.lists(st.booleans(), max_size=40), st.integers(1, 16))
@settings(max_examples=400, deadline=None)
def test_run_check_by_doubling_matches_a_plain_scan(mask, length):
    """_has_run (log2 passes) against the definition: some window of ``length`` all true."""
    expected = any(all(mask[i : i + length]) for i in range(len(mask) - length + 1))
    assert _has_run(np.array(mask, dtype=bool), length) == expected


def test_completions_prompt_ids_take_the_cut_too():
    raw = orjson.dumps({"model": "m", "prompt": IDS[:100], "max_tokens": 3})
    obj, ids = split_ids(raw, "prompt")
    req = parse_request("completions", obj, "r")
    assert list(req.input_ids) == IDS[:100] and req.max_new_tokens == 3


def test_a_cold_prompt_is_parsed_one_page_deep():
    """The prefix match hashes page by page and stops at the first page nobody holds: a new prompt
    costs one page of parsing, a cached one as much as it hits, and the digests equal the list's."""
    page = 64
    index = KvIndex(hybrid=False)
    index.add_worker("w", "pd", block_size=page)
    _, cold = split_ids(orjson.dumps({"input_ids": IDS}), "input_ids")
    assert index.match(cold).by_worker["w"] == 0
    # one page or one of the memo's segments (the ids of JSON text are parsed a segment at a time)
    assert page <= cold.num_parsed <= 2 * max(page, index.memo.segment_tokens)

    held = [digest_to_int64(d) for d in page_digests(IDS[:1024], page)]
    index.apply("w", 0, [BlockStored(held, None, IDS[:1024], page, None)])
    long_ids = IDS * 4
    _, warm = split_ids(orjson.dumps({"input_ids": long_ids}), "input_ids")
    looked_up = index.memo.hits + index.memo.misses
    assert index.match(warm).by_worker["w"] == 1024
    # The walk reads batches that double (1, 2, 4, ... pages): past the hit's 17 pages, not the
    # whole 12,000-token prompt (47 of the memo's 256-token segments), and parses no more.
    segments = index.memo.hits + index.memo.misses - looked_up
    assert 1088 // index.memo.segment_tokens < segments <= 2 * 1088 // index.memo.segment_tokens + 2
    assert warm.num_parsed <= 4 * 1088
    assert [digest_to_int64(d) for d in page_digests(warm, page)] == [digest_to_int64(d) for d in page_digests(long_ids, page)]


def test_the_router_keeps_request_buffers_in_its_heap_unless_told_otherwise():
    """glibc: mallopt applies (True); an operator's own MALLOC_* setting is left alone (False)."""
    code = "from prfaas_sglang.router.__main__ import keep_request_buffers_mapped as k; print(k())"
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    assert run_py(["-c", code], env=env).stdout.strip() == "True"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**env, "MALLOC_TRIM_THRESHOLD_": "1000000"})
    assert proc.stdout.strip() == "False", proc.stderr


@given(st.lists(st.integers(0, 2**31 - 1), max_size=300), st.sampled_from([1, 2, 5, 16, 64, 100]),
       st.integers(0, 40), st.booleans(), st.sampled_from([None, 0, 150, 250, 500]))
@settings(max_examples=300, deadline=None)
def test_the_page_id_memo_gives_the_ids_hashing_gives(ids, page, extra, as_json, max_bytes):
    """Whatever the memo holds (a tiny one, so segments are evicted; by count, or by bytes), the ids it
    gives are SGLang's chained ids of the same pages, for a prompt, the same prompt again, and a longer
    one sharing its start; from a list or from ids still in their JSON text; cut at ``max_tokens``."""
    memo = PageIdMemo(max_segments=3, segment_tokens=8, max_bytes=max_bytes)
    rng = random.Random(len(ids))
    longer = ids + [rng.randrange(1000) for _ in range(extra)]
    for prompt in (ids, ids, longer, ids):
        cut = split_ids(orjson.dumps({"input_ids": prompt}), "input_ids") if as_json and prompt else None
        source = cut[1] if cut is not None else prompt  # 10-digit ids are not cut: the list then
        for max_tokens in (None, max(len(prompt) - 1, 0)):
            want = [digest_to_int64(d) for d in page_digests(prompt[:max_tokens], page)]
            assert list(chain.from_iterable(memo.segments(source, page, max_tokens))) == want
            assert len(memo) <= 3
            assert memo.nbytes == sum(len(v) + MEMO_ENTRY_OVERHEAD_BYTES for v in memo._entries.values())
            assert max_bytes is None or memo.nbytes <= max_bytes


def test_a_byte_bounded_memo_evicts_the_least_recently_used_segments():
    """At page size 1 a 64-token segment costs 64 ids x 8 bytes + its 32-byte digest + the entry's overhead."""
    one = 64 * 8 + 32 + MEMO_ENTRY_OVERHEAD_BYTES
    memo = PageIdMemo(max_segments=None, segment_tokens=64, max_bytes=3 * one)
    a, b = list(range(128)), list(range(1000, 1128))  # two segments each
    list(chain.from_iterable(memo.segments(a, 1)))
    assert (len(memo), memo.nbytes) == (2, 2 * one)
    list(chain.from_iterable(memo.segments(b, 1)))  # room for one more: a's first segment goes
    assert (len(memo), memo.nbytes) == (3, 3 * one)
    list(chain.from_iterable(memo.segments(b, 1)))
    assert memo.hits == 2
    list(chain.from_iterable(memo.segments(a, 1)))  # a's first is gone, so its chain misses throughout
    assert (memo.hits, memo.misses) == (2, 6) and memo.stats()["bytes"] == 3 * one <= memo.stats()["max_bytes"]
    tiny = PageIdMemo(segment_tokens=64, max_bytes=one - 1)  # smaller than one segment: nothing is kept
    assert list(chain.from_iterable(tiny.segments(a, 1))) == [digest_to_int64(d) for d in page_digests(a, 1)]
    assert (len(tiny), tiny.nbytes) == (0, 0)


def test_a_prompt_seen_before_is_not_hashed_again_and_a_longer_one_only_past_it():
    memo = PageIdMemo(segment_tokens=64)
    prompt = IDS[:2000]
    list(chain.from_iterable(memo.segments(prompt, 1)))
    assert (memo.hits, memo.misses) == (0, 2000 // 64)
    list(chain.from_iterable(memo.segments(prompt, 1)))
    assert (memo.hits, memo.misses) == (31, 31)
    list(chain.from_iterable(memo.segments(prompt + IDS[:200], 1)))  # 2200 tokens: 34 segments, 31 known
    assert (memo.hits, memo.misses) == (62, 34)
    first = next(memo.segments(IDS[:64], 4))  # another page size keys its own chain
    assert memo.misses == 35 and list(first) == [digest_to_int64(d) for d in page_digests(IDS[:64], 4)]


def test_the_kv_index_walks_a_page_one_prompt_from_its_memo_without_tracking_objects():
    """Page size 1 through the index: the same answer hashed or from the memo, and neither the memo
    nor the index gives the garbage collector objects to walk."""
    import gc

    prompt = IDS + IDS[:100]
    index = KvIndex(hybrid=False)
    index.add_worker("w", "pd", block_size=1)
    held = [digest_to_int64(d) for d in page_digests(prompt[:2500], 1)]
    index.apply("w", 0, [BlockStored(held, None, prompt[:2500], 1, None)])
    gc.collect()
    before = len(gc.get_objects())
    answers = [index.match(prompt).by_worker["w"] for _ in range(3)]
    gc.collect()
    assert answers == [2500, 2500, 2500] and index.memo.hits >= 2 * (2500 // index.memo.segment_tokens)
    assert len(gc.get_objects()) - before < 50


@given(st.lists(st.integers(0, 999_999_999), min_size=1, max_size=60), st.data())
@settings(max_examples=300, deadline=None)
def test_text_between_is_the_text_of_exactly_those_ids(ids, data):
    _, cut = split_ids(orjson.dumps({"input_ids": ids}), "input_ids")
    start = data.draw(st.integers(0, len(ids) - 1))
    stop = data.draw(st.integers(start + 1, len(ids)))
    text = cut.text_between(start, stop)
    assert orjson.loads(b"[" + bytes(text) + b"]") == ids[start:stop]
    assert cut.num_parsed == 0  # found by its commas, nothing parsed
    if len(ids) > 1:
        spaced = split_ids(json.dumps({"input_ids": ids}).encode(), "input_ids")[1]  # ", " between ids
        assert spaced.text_between(start, stop) is None


def test_a_memo_budget_below_zero_or_not_a_number_is_refused(tmp_path):
    """The router's ``--kv-memo-mib`` and the kv-index's ``--memo-mib``: a typed error naming the flag."""
    import yaml

    from prfaas_sglang.demo.cluster import local_topology

    path = tmp_path / "t.yaml"
    path.write_text(yaml.safe_dump(local_topology()))
    for module, flag in (("prfaas_sglang.router", "--kv-memo-mib"), ("prfaas_sglang.kvindex", "--memo-mib")):
        for value in ("-1", "nan"):
            proc = run_py(["-m", module, "--config", str(path), flag, value])
            assert proc.returncode == 2, proc.stderr
            assert proc.stderr.strip() == f"error: {flag}: must be in 0..{1 << 20}, got {float(value)}"
