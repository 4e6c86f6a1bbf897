"""The emulated engine's pure parts: block hashes, prefix cache, receive arena, request parsing."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prfaas_sglang.engine.mock.kv_transport import KvArena
from prfaas_sglang.engine.mock.prefix_cache import PrefixCache
from prfaas_sglang.protocol import BadRequest, parse_request
from prfaas_sglang.wire.blocks import digest_to_int64, page_digests
from prfaas_sglang.wire.kv_events import BlockRemoved, BlockStored


def test_block_hash_matches_sglang_native_hash():
    """Our pure-Python chained SHA-256 equals SGLang's C++ extension (compiled on first use)."""
    from sglang.srt.mem_cache.utils import get_hash_str, hash_str_to_int64

    tokens = [7, 70_000, 3, 31_999, 0] * 400
    theirs = [hash_str_to_int64(h) for h in get_hash_str(tokens, None, page_size=64)]
    ours = [digest_to_int64(d) for d in page_digests(tokens, 64)]
    # SGLang also hashes a trailing partial page; its radix tree (and so its events) holds full pages only.
    assert len(ours) == len(tokens) // 64 == len(theirs) - 1
    assert ours == theirs[: len(ours)]


class TestPrefixCache:
    def test_dense_match_is_page_aligned(self):
        cache = PrefixCache(page_size=4, capacity_blocks=100, hybrid=False)
        events = cache.insert(list(range(10)))
        assert [type(e) for e in events] == [BlockStored, BlockStored]
        assert events[1].parent_block_hash == events[0].block_hashes[0]
        assert events[0].parent_block_hash is None and events[0].token_ids == [0, 1, 2, 3]
        assert cache.match(list(range(9)) + [99]).cached_tokens == 8
        assert cache.match([5] + list(range(1, 12))).cached_tokens == 0

    def test_hybrid_match_stops_at_the_last_checkpoint(self):
        """Linear state can only be resumed where it was saved: prompt end and every interval."""
        cache = PrefixCache(page_size=4, capacity_blocks=100, hybrid=True, checkpoint_interval_tokens=8)
        cache.insert(list(range(20)))  # blocks 1..5; checkpoints after blocks 2, 4 and 5 (prompt end)
        longer = list(range(20)) + [100, 101, 102, 103]
        assert cache.match(longer).cached_tokens == 20
        diverges_in_block_4 = list(range(14)) + [999] * 10
        match = cache.match(diverges_in_block_4)
        assert match.matched_blocks == 3 and match.cached_tokens == 8

    def test_dense_model_reuses_the_whole_match(self):
        cache = PrefixCache(page_size=4, capacity_blocks=100, hybrid=False, checkpoint_interval_tokens=8)
        cache.insert(list(range(20)))
        assert cache.match(list(range(14)) + [999] * 10).cached_tokens == 12

    def test_lru_evicts_leaves_first_and_reports_removals(self):
        cache = PrefixCache(page_size=2, capacity_blocks=3, hybrid=False)
        cache.insert([1, 2, 3, 4, 5, 6])  # 3 blocks, a chain
        events = cache.insert([9, 9])  # a 4th block: the chain's leaf must go, not its root
        removed = [e for e in events if isinstance(e, BlockRemoved)]
        assert len(removed) == 1 and len(cache) == 3
        assert cache.match([1, 2, 3, 4, 5, 6]).cached_tokens == 4

    def test_reinserting_emits_nothing_new(self):
        cache = PrefixCache(page_size=4, capacity_blocks=10, hybrid=False)
        cache.insert(list(range(8)))
        assert cache.insert(list(range(8))) == []


class _PlainPrefixCache(PrefixCache):
    """The cache as first written: one Python step per page in match and insert (the reference)."""

    def match(self, token_ids):
        from prfaas_sglang.engine.mock.prefix_cache import Match

        ids = self._ids(token_ids)
        matched = best = 0
        for i, block_id in enumerate(ids):
            block = self._blocks.get(block_id)
            if block is None:
                break
            matched = i + 1
            if not self.hybrid or block.checkpoint:
                best = matched
        for block_id in reversed(ids[:matched]):
            self._blocks.move_to_end(block_id)
        return Match(matched, best * self.page_size)

    def insert(self, token_ids, medium="GPU", checkpoints_at=(), chunk_checkpoints=True):
        from prfaas_sglang.engine.mock.prefix_cache import _Block
        from prfaas_sglang.wire.kv_events import StateStored

        ids = self._ids(token_ids)
        if not ids:
            return []
        interval = self.checkpoint_interval_tokens if chunk_checkpoints else None
        interval_blocks = max(interval // self.page_size, 1) if interval is not None else len(ids)
        asked = {n // self.page_size - 1 for n in checkpoints_at if n >= self.page_size}
        events, states = [], []
        for i, block_id in enumerate(ids):
            checkpoint = self.hybrid and ((i + 1) % interval_blocks == 0 or i == len(ids) - 1 or i in asked)
            block = self._blocks.get(block_id)
            if block is None:
                parent = ids[i - 1] if i else None
                block = self._blocks[block_id] = _Block(parent, False, (i + 1) * self.page_size)
                events.append(BlockStored([block_id], parent, list(token_ids[i * self.page_size : (i + 1) * self.page_size]),
                                          self.page_size, None, medium))
            if checkpoint and not block.checkpoint:
                block.checkpoint = True
                states.append(StateStored(block_id, (i + 1) * self.page_size, "mamba", medium))
        for block_id in reversed(ids):
            self._blocks.move_to_end(block_id)
        evicted, lost_states = self._evict(medium)
        return events + evicted + states + lost_states


_PROMPT = st.lists(st.integers(0, 3), min_size=0, max_size=40)  # few distinct tokens: prompts share prefixes
_OP = st.one_of(st.tuples(st.just("match"), _PROMPT),
                st.tuples(st.just("insert"), _PROMPT, st.lists(st.integers(0, 44), max_size=3), st.booleans()))


@given(st.lists(_OP, max_size=25), st.booleans(), st.sampled_from([1, 2, 4]), st.sampled_from([None, 4, 8]),
       st.integers(3, 40))
@settings(max_examples=300, deadline=None)
def test_the_prefix_cache_answers_and_emits_what_the_per_page_loop_does(ops, hybrid, page, interval, capacity):
    """Matching and inserting skip the pages already held (a walk in C); every answer, every event
    and its order, and the cache's recency order stay those of the plain per-page loop."""
    fast = PrefixCache(page, capacity, hybrid, interval)
    plain = _PlainPrefixCache(page, capacity, hybrid, interval)
    for op in ops:
        if op[0] == "match":
            assert fast.match(op[1]) == plain.match(op[1])
            assert fast.decode_reusable_tokens(op[1]) == plain.decode_reusable_tokens(op[1])
        else:
            _, prompt, asked, chunks = op
            assert fast.insert(prompt, checkpoints_at=asked, chunk_checkpoints=chunks) == \
                plain.insert(prompt, checkpoints_at=asked, chunk_checkpoints=chunks)
        assert list(fast._blocks.items()) == list(plain._blocks.items())


@given(ops=st.lists(st.tuples(st.booleans(), st.integers(1, 50_000)), max_size=40))
@settings(max_examples=200, deadline=None)
def test_arena_never_overlaps_and_frees_everything(ops):
    arena = KvArena(1 << 20)
    live: list[tuple[int, int]] = []
    for is_alloc, n in ops:
        if is_alloc or not live:
            off = arena.alloc(n)
            if off is not None:
                for o, ln in live:
                    assert off + n <= o or o + ln <= off
                live.append((off, n))
        else:
            arena.free(*live.pop(0))
    for region in live:
        arena.free(*region)
    assert arena.free_bytes == 1 << 20


class TestParse:
    @pytest.mark.parametrize("kind, body, message", [
        ("generate", [], "JSON object"),
        ("generate", {}, "one of input_ids or text"),
        ("generate", {"input_ids": [1, "x"]}, "list of token ids"),
        ("generate", {"input_ids": [1, 2**40]}, "outside"),
        ("generate", {"input_ids": [1], "sampling_params": {"max_new_tokens": 0}}, "max_new_tokens must be a positive"),
        ("generate", {"input_ids": [1], "bootstrap_room": 5}, "need all of bootstrap_host"),
        ("completions", {"prompt": 3}, "prompt must be"),
        ("chat", {"messages": []}, "non-empty list"),
        ("chat", {"messages": [{"content": "x"}]}, "role"),
        ("generate", {"input_ids": [1], "stream": "yes"}, "stream must be"),
    ])
    def test_bad_bodies(self, kind, body, message):
        with pytest.raises(BadRequest) as err:
            parse_request(kind, body, "r")
        assert err.value.status == 400 and message in err.value.message

    @pytest.mark.parametrize("ids, ok", [
        ([0, 1, 2**31 - 1], True), ([], True), ([True, 5], False), ([5, False], False), ([1.0], False),
        ([2**31], False), ([2**32], False), ([-1], False), ([3, None], False), ([1, [2]], False), ([2**64], False),
    ])
    def test_token_ids_are_exact_ints_in_range(self, ids, ok):
        if ok:
            assert parse_request("generate", {"input_ids": ids or [7]}, "r").input_ids == tuple(ids or [7])
        else:
            with pytest.raises(BadRequest) as err:
                parse_request("generate", {"input_ids": ids}, "r")
            assert err.value.status == 400

    @given(st.lists(st.one_of(st.integers(-2, 2**33), st.booleans(), st.floats(allow_nan=False), st.text(max_size=2)),
                    min_size=1, max_size=40))
    @settings(max_examples=300, deadline=None)
    def test_the_fast_id_check_is_the_exact_definition(self, ids):
        exact = all(type(x) is int and 0 <= x <= 2**31 - 1 for x in ids)
        try:
            parse_request("generate", {"input_ids": ids}, "r")
            accepted = True
        except BadRequest:
            accepted = False
        assert accepted == exact

    def test_without_a_tokenizer_text_is_refused_with_the_fix(self):
        for kind, body in (("generate", {"text": "a b c"}), ("completions", {"prompt": "a b c"}),
                           ("chat", {"messages": [{"role": "user", "content": "hi"}]})):
            with pytest.raises(BadRequest) as err:
                parse_request(kind, body, "r")
            assert err.value.status == 400 and "no tokenizer" in err.value.message and "input_ids" in err.value.message

    def test_the_emulated_engines_fallback_pseudo_tokenizes_deterministically(self):
        from prfaas_sglang.engine.mock.sglang_http import pseudo_tokenize

        a = parse_request("generate", {"text": "a b c"}, "r", text_ids=pseudo_tokenize)
        b = parse_request("completions", {"prompt": "a b c"}, "r", text_ids=pseudo_tokenize)
        assert a.input_ids == b.input_ids and len(a.input_ids) == 3

    def test_real_tokenizer_for_text_and_chat(self):
        from prfaas_sglang.tokenizer import PromptTokenizer

        tok = PromptTokenizer.load("prfaas-tiny-chatml")
        a = parse_request("completions", {"prompt": "prefill over Ethernet"}, "r", tokenizer=tok)
        assert list(a.input_ids) == tok.encode_text("prefill over Ethernet")
        c = parse_request("chat", {"messages": [{"role": "user", "content": "hi"}]}, "r", tokenizer=tok)
        assert tok.decode(c.input_ids) == "user\nhi\nassistant\n"  # specials skipped on decode

    def test_usage_option_and_kv_tokens(self):
        r = parse_request("completions", {"prompt": [1, 2, 3], "max_tokens": 5, "stream": True,
                                          "stream_options": {"include_usage": True}}, "r")
        assert r.include_usage and r.kv_tokens == 8
        assert not parse_request("generate", {"input_ids": [1], "stream_options": {"include_usage": True}}, "r").include_usage
        with pytest.raises(BadRequest):
            parse_request("completions", {"prompt": [1], "stream_options": 3}, "r")


def test_outputs_depend_on_the_prompt_only():
    from prfaas_sglang.protocol import output_token, prompt_seed

    a, b = prompt_seed([1, 2, 3]), prompt_seed([1, 2, 3])
    assert a == b != prompt_seed([1, 2, 4])
    assert [output_token(a, i, 32_000) for i in range(5)] == [output_token(b, i, 32_000) for i in range(5)]


class TestStreamFailure:
    """What the router reads from a decode stream's first event before it answers the client."""

    def _req(self, kind: str):
        import dataclasses

        from prfaas_sglang.protocol import parse_request

        if kind == "generate":
            return parse_request(kind, {"input_ids": [1, 2, 3], "stream": True}, "r1")
        completions = parse_request("completions", {"prompt": [1, 2, 3], "stream": True}, "r1")
        return dataclasses.replace(completions, kind=kind)  # chat would need a tokenizer; the event shape does not

    def test_failures_as_sglang_streams_them(self):
        from prfaas_sglang.protocol import SSE_DONE, stream_error, stream_failure

        for kind in ("generate", "completions", "chat"):
            for status in (400, 500, 502):
                event = stream_error(self._req(kind), status, "KV transfer failed")
                assert stream_failure((event + SSE_DONE).encode()) == status, (kind, status)
        # SGLang 0.5.15's own bytes: /generate abort, OpenAI error chunk (serving_chat), http_server's ValueError.
        abort = b'data: {"text":"","output_ids":[],"meta_info":{"id":"x","finish_reason":{"type":"abort","message":"m","status_code":500}}}\n\n'
        chat = b'data: {"error": {"object": "error", "message": "m", "type": "INTERNAL_SERVER_ERROR", "param": null, "code": 500}}\r\n\r\n'
        value_error = b'data: {"error":{"message":"m","type":"invalid_request_error","code":400,"retryable":false}}\n\n'
        assert [stream_failure(e) for e in (abort, chat, value_error)] == [500, 500, 400]

    def test_ordinary_events_are_not_failures(self):
        from prfaas_sglang.protocol import stream_chunk, stream_failure

        for kind in ("generate", "completions", "chat"):
            first = stream_chunk(self._req(kind), [5], "a", False, 0, "m", {}, "a").encode()
            assert stream_failure(first) is None
        graceful = b'data: {"text":"","meta_info":{"finish_reason":{"type":"abort","message":"client"}}}\n\n'
        assert stream_failure(graceful) is None  # no status: the client's own abort, an ordinary end
        # Only the first event is read; junk, comments and non-objects are ordinary.
        later = b'data: {"text":"a"}\n\ndata: {"error":{"code":500}}\n\n'
        for event in (later, b": keep-alive\n\n", b"data: [DONE]\n\n", b"data: [1,2]\n\n", b"data: {not json\n\n", b""):
            assert stream_failure(event) is None, event


def test_a_decode_step_that_wakes_late_is_repaid_by_the_next_so_the_cadence_is_the_truths():
    """The pacer (engine/mock/timing.py): steps are due one ``step_s`` after the previous was due. A wake-up
    that comes late, and the work between steps, shorten the sleeps after it; past ``max_debt_s`` behind, or
    after a rest, a new schedule starts from now."""
    from prfaas_sglang.engine.mock.timing import Pacer

    pacer, now, ends = Pacer(max_debt_s=0.05), 100.0, []
    for _ in range(50):
        now += pacer.delay_s(0.010, now) + 0.004  # every wake-up 4 ms late
        ends.append(now)
        now += 0.001  # the step's tokens handed out
    # Unpaced, 50 steps would take 50 x 15 ms; paced, the schedule holds while the debt stays under 50 ms.
    assert ends[-1] - 100.0 == pytest.approx(50 * 0.010 + 0.004)  # the schedule, and the last wake-up's lateness
    assert pacer.started_s < now and pacer.slip_s == 0.0  # late wake-ups repaid: nothing lost

    fresh = Pacer(max_debt_s=0.05)
    assert fresh.delay_s(0.010, 5.0) == pytest.approx(0.010) and fresh.started_s == 5.0
    assert fresh.delay_s(0.010, 5.013) == pytest.approx(0.007)  # 3 ms late: repaid
    assert fresh.started_s == pytest.approx(5.010)
    assert fresh.slip_s == 0.0
    assert fresh.delay_s(0.010, 5.2) == pytest.approx(0.010) and fresh.started_s == 5.2  # 180 ms behind: a new schedule
    assert fresh.slip_s == pytest.approx(0.180)  # what the cadence lost there
    fresh.rest()
    assert fresh.delay_s(0.010, 5.205) == pytest.approx(0.010) and fresh.started_s == 5.205
    assert fresh.slip_s == 0.0  # after a rest the loop was idle, not behind


def test_a_streams_text_is_decoded_a_window_at_a_time_and_adds_up_to_the_whole():
    """StreamText (engine/mock/detokenize.py), as SGLang's detokenizer: the pieces it returns add up to the
    decode of every id, a character split over tokens is held until it is whole, and each token costs a short
    window's decode, not the whole output's."""
    import random

    from prfaas_sglang.engine.mock.detokenize import StreamText
    from prfaas_sglang.tokenizer import PromptTokenizer

    tok = PromptTokenizer.load("prfaas-tiny-chatml")
    decoded = []

    def decode(ids):
        decoded.append(len(ids))
        return tok.decode(ids)

    def stream(ids):
        text = StreamText(decode)
        pieces = [text.add(ids[:n]) for n in range(1, len(ids) + 1)]
        return pieces + [text.finish(ids)], text.text

    words = tok.encode_text("naïve café — 東京 ✓ " * 40)
    pieces, whole = stream(words)
    assert "".join(pieces) == whole == tok.decode(words)
    assert "" in pieces[:-1] and not any("\ufffd" in piece for piece in pieces)  # a character over tokens: held
    rng = random.Random(0)
    ids = words + [rng.randrange(300, 2000) for _ in range(600)]
    decoded.clear()
    pieces, whole = stream(ids)
    assert "".join(pieces) == whole == tok.decode(ids)
    assert sum(decoded) < 8 * len(ids)  # a whole-output decode per token: len(ids)^2 / 2
