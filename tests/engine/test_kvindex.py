"""The global KV index against the emulated engine's own cache and events (pure, no sockets)."""

from __future__ import annotations

import json
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prfaas_sglang.engine.mock.prefix_cache import PrefixCache
from prfaas_sglang.kvindex.feed import BadFrame, kv_event_handler
from prfaas_sglang.kvindex.index import InvalidEvents, KvIndex
from prfaas_sglang.wire.kv_events import (
    AllBlocksCleared,
    BlockStored,
    KVEventBatch,
    StateRemoved,
    StateStored,
    encode_batch,
    split_state_events,
)

PAGE = 4


def insert_into(index: KvIndex, worker: str, seq: int, cache: PrefixCache, prompt, report_state: bool = True) -> None:
    """``prompt`` into the worker's ``cache``, its events into ``index``: a hybrid cache's state
    events as a v2 batch carries them, or (``report_state`` false) none, as SGLang's own publisher."""
    blocks, states = split_state_events(cache.insert(prompt))
    index.apply(worker, seq, blocks, states if report_state and cache.hybrid else None)


def feed(index: KvIndex, worker: str, cache: PrefixCache, prompts, seq0: int = 0) -> int:
    seq = seq0
    for prompt in prompts:
        insert_into(index, worker, seq, cache, prompt)
        seq += 1
    return seq


def test_index_agrees_with_the_worker_cache_dense_and_hybrid():
    """Fed a worker's events, the index predicts exactly what the worker's own cache reuses, for a
    dense model and, with its state events, for a hybrid one; and (``held_by_worker``) what that
    cache would supply a decode (``PrefixCache.decode_reusable_tokens``, hooks/decode_radix's rule:
    full-attention pages whatever their states, a page short of a state the match would end at)."""
    rng = random.Random(3)
    for hybrid in (False, True):
        cache = PrefixCache(PAGE, capacity_blocks=40, hybrid=hybrid, checkpoint_interval_tokens=8)
        index = KvIndex(hybrid=hybrid, checkpoint_interval_tokens=8)
        index.add_worker("w", "pd")
        stems = [[rng.randrange(50) for _ in range(rng.randrange(4, 30))] for _ in range(6)]
        differ = 0
        for seq in range(200):
            prompt = rng.choice(stems) + [rng.randrange(50) for _ in range(rng.randrange(0, 12))]
            match = index.match(prompt)
            assert match.by_worker["w"] == cache.match(prompt[:-1]).cached_tokens, (hybrid, prompt)
            held = cache.decode_reusable_tokens(prompt[:-1])
            assert match.held_by_worker.get("w", 0) == held, (hybrid, prompt)
            differ += held != match.by_worker["w"]
            insert_into(index, "w", seq, cache, prompt)
        assert (differ > 0) == hybrid  # only for a hybrid model does a decode's rule differ from a prefill's


def test_per_cluster_best_and_worker_choice():
    index = KvIndex(hybrid=False)
    caches = {}
    for worker, cluster in (("p0", "prfaas"), ("d0", "pd"), ("d1", "pd")):
        index.add_worker(worker, cluster)
        caches[worker] = PrefixCache(PAGE, 100, hybrid=False)
    prompt = list(range(40))
    feed(index, "d1", caches["d1"], [prompt[:21]])
    feed(index, "p0", caches["p0"], [prompt[:13]])
    match = index.match(prompt)
    assert match.by_worker == {"p0": 12, "d0": 0, "d1": 20}
    assert match.by_cluster == {"prfaas": 12, "pd": 20}
    assert match.best_worker("pd") == ("d1", 20)


def test_removed_blocks_and_clear():
    index = KvIndex(hybrid=False)
    index.add_worker("w", "pd")
    cache = PrefixCache(PAGE, capacity_blocks=3, hybrid=False)
    seq = feed(index, "w", cache, [list(range(12))])
    seq = feed(index, "w", cache, [[99] * 8], seq)  # evicts two leaves of the first prompt
    assert index.match(list(range(12)) + [1]).by_worker["w"] == cache.match(list(range(12))).cached_tokens == 4
    index.apply("w", seq, [AllBlocksCleared()])
    assert index.block_count("w") == 0 and index.match([99] * 9).by_worker["w"] == 0


def test_sequence_gap_or_restart_drops_the_worker():
    index = KvIndex(hybrid=False)
    index.add_worker("w", "pd")
    cache = PrefixCache(PAGE, 100, hybrid=False)
    feed(index, "w", cache, [list(range(16))])
    assert index.match(list(range(17))).by_worker["w"] == 16
    index.apply("w", 5, [])  # expected seq 1: events 1..4 were lost
    assert index.resets("w") == 1 and index.match(list(range(17))).by_worker["w"] == 0
    feed(index, "w", PrefixCache(PAGE, 100, hybrid=False), [list(range(8))], seq0=0)  # a restart: seq back to 0
    assert index.resets("w") == 2 and index.match(list(range(9))).by_worker["w"] == 8


def test_removed_worker_is_gone_from_answers():
    index = KvIndex(hybrid=False)
    index.add_worker("a", "pd")
    index.add_worker("b", "pd")
    feed(index, "a", PrefixCache(PAGE, 100, hybrid=False), [list(range(8))])
    index.remove_worker("a")
    assert index.match(list(range(9))).by_worker == {"b": 0}


@settings(max_examples=60, deadline=None)
@given(prompts=st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=24), min_size=1, max_size=25),
       capacity=st.integers(1, 12), hybrid=st.booleans(), report_state=st.booleans())
def test_index_never_overstates_a_worker(prompts, capacity, hybrid, report_state):
    """With eviction in play: equal to the worker's cache (dense, or hybrid with state events);
    with checkpoints inferred (no state events) never above it."""
    cache = PrefixCache(PAGE, capacity_blocks=capacity, hybrid=hybrid, checkpoint_interval_tokens=8)
    index = KvIndex(hybrid=hybrid, checkpoint_interval_tokens=8)
    index.add_worker("w", "pd")
    for seq, prompt in enumerate(prompts):
        predicted, actual = index.match(prompt).by_worker["w"], cache.match(prompt[:-1]).cached_tokens
        assert predicted == actual if report_state or not hybrid else predicted <= actual
        insert_into(index, "w", seq, cache, prompt, report_state)


def test_hybrid_index_exact_when_every_prompt_brings_new_pages():
    cache = PrefixCache(PAGE, 100, hybrid=True, checkpoint_interval_tokens=8)
    index = KvIndex(hybrid=True, checkpoint_interval_tokens=8)
    index.add_worker("w", "pd")
    base = list(range(30))
    for seq, n in enumerate((9, 17, 26, 30)):
        prompt = base[:n]
        assert index.match(prompt + [77]).by_worker["w"] == cache.match(prompt).cached_tokens
        insert_into(index, "w", seq, cache, prompt, report_state=False)
    assert index.match(base[:22] + [5, 5, 5]).by_worker["w"] == 16  # last checkpoint within the 20-token match


def test_invalid_block_sizes_are_refused_whole():
    index = KvIndex(hybrid=False)
    index.add_worker("w", "pd", block_size=4)
    good = BlockStored([1], None, [1, 2, 3, 4], 4, None)
    for bad in (0, -4, 8):
        with pytest.raises(InvalidEvents):
            index.apply("w", 0, [good, BlockStored([2], 1, [5, 6, 7, 8], bad, None)])
    assert index.block_count("w") == 0  # nothing of a refused batch was applied
    with pytest.raises(InvalidEvents):
        index.add_worker("x", "pd", block_size=0)


def test_workers_with_different_block_sizes_are_matched_at_their_own():
    index = KvIndex(hybrid=False)
    index.add_worker("small", "pd", block_size=4)
    index.add_worker("big", "prfaas", block_size=8)
    prompt = list(range(40))
    feed(index, "small", PrefixCache(4, 100, hybrid=False), [prompt[:21]])
    feed(index, "big", PrefixCache(8, 100, hybrid=False), [prompt[:21]])
    assert index.match(prompt).by_worker == {"small": 20, "big": 16}


def test_feed_counts_malformed_frames_as_bad_and_applies_good_ones():
    index = KvIndex(hybrid=False)
    index.add_worker("w", "pd", block_size=4)
    handle = kv_event_handler(index, "w")
    payload = encode_batch(KVEventBatch(ts=0.0, events=[BlockStored([1], None, [1, 2, 3, 4], 4, None)]))
    assert handle([b"kv-events", (0).to_bytes(8, "big"), payload]) == 1
    for frames in ([b"kv-events", b"x"], [b"t", b"12345678", b"not msgpack"],
                   [b"t", (1).to_bytes(8, "big"), encode_batch(KVEventBatch(ts=0.0, events=[BlockStored([2], 1, [5], 0, None)]))]):
        with pytest.raises(BadFrame):
            handle(frames)
    assert index.block_count("w") == 1


class TestSnapshot:
    """A restarted router starts from the kv-index service's view (wire/kv_snapshot.py)."""

    def fed(self, hybrid: bool) -> tuple[KvIndex, list[list[int]]]:
        rng = random.Random(7)
        cache = PrefixCache(PAGE, capacity_blocks=60, hybrid=hybrid, checkpoint_interval_tokens=8)
        index = KvIndex(hybrid=hybrid, checkpoint_interval_tokens=8)
        index.add_worker("w", "pd")
        prompts = [[rng.randrange(50) for _ in range(rng.randrange(4, 30))] for _ in range(20)]
        feed(index, "w", cache, prompts)
        return index, prompts

    def test_a_restored_index_answers_as_the_original(self):
        from prfaas_sglang.wire import kv_snapshot

        for hybrid in (False, True):
            original, prompts = self.fed(hybrid)
            restored = KvIndex(hybrid=hybrid, checkpoint_interval_tokens=8)
            restored.add_worker("w", "pd")
            snap = kv_snapshot.decode(kv_snapshot.encode(original.export()))
            assert restored.restore("w", snap["w"]) == original.block_count("w") > 0
            for prompt in prompts:
                assert restored.match(prompt + [1]).by_worker == original.match(prompt + [1]).by_worker
            assert restored.restore("w", snap["w"]) == 0  # a merge: nothing new the second time

    def test_restore_refuses_another_cluster_or_page_size_and_keeps_live_blocks(self):
        original, prompts = self.fed(False)
        snap = original.export()["w"]
        other = KvIndex(hybrid=False)
        other.add_worker("w", "prfaas")
        with pytest.raises(InvalidEvents, match="cluster"):
            other.restore("w", snap)
        sized = KvIndex(hybrid=False)
        sized.add_worker("w", "pd", block_size=PAGE * 2)
        with pytest.raises(InvalidEvents, match="block size"):
            sized.restore("w", snap)
        with pytest.raises(InvalidEvents):
            KvIndex(hybrid=False).restore("nobody", snap)
        live = KvIndex(hybrid=False)
        live.add_worker("w", "pd")
        cache = PrefixCache(PAGE, capacity_blocks=60, hybrid=False)
        insert_into(live, "w", 41, cache, list(range(100, 140)))
        before = live.block_count("w")
        live.restore("w", snap)
        assert live.block_count("w") == before + original.block_count("w")
        insert_into(live, "w", 99, cache, list(range(200, 240)))  # the next event is taken, whatever its number
        assert live.resets("w") == 0

    @pytest.mark.parametrize("payload, message", [
        (b'{"v": 4, "workers": {}}', "version"),
        (b'{"v": true, "workers": {}}', "version"),
        (b'{"v": 2, "workers": {"w": {"cluster": "pd", "block_size": 4, "blocks": [], "checkpoints": []}}}', "exactly"),
        (b'{"v": 2, "workers": {"w": {"cluster": "pd", "block_size": 4, "blocks": [], "checkpoints": [], '
         b'"reports_state": 1}}}', "reports_state"),
        (b'{"v": 1}', "workers must be an object"),
        (b'{"v": 1, "workers": {"w": {"cluster": "pd", "block_size": 4, "blocks": []}}}', "exactly"),
        (b'{"v": 1, "workers": {"w": {"cluster": "pd", "block_size": 0, "blocks": [], "checkpoints": []}}}', "block_size"),
        (b'{"v": 1, "workers": {"w": {"cluster": "pd", "block_size": 4, "blocks": [[1, true]], "checkpoints": []}}}', "depth"),
        (b'{"v": 1, "workers": {"w": {"cluster": "pd", "block_size": 4, "blocks": [[1, 0]], "checkpoints": []}}}', "depth"),
        (b'{"v": 1, "workers": {"w": {"cluster": "pd", "block_size": 4, "blocks": [[18446744073709551616, 1]], '
         b'"checkpoints": []}}}', "64-bit"),
        (b'{"v": 1, "workers": {"w": {"cluster": "pd", "block_size": 4, "blocks": [1], "checkpoints": []}}}', "pairs"),
        (b'{"v": 3, "workers": {"w": {"cluster": "pd", "block_size": 4, "blocks": [], "checkpoints": [], '
         b'"reports_state": true, "swa_missing": [], "swa_window_tokens": 0}}}', "swa_window_tokens"),
        (b'{"v": 3, "workers": {"w": {"cluster": "pd", "block_size": 4, "blocks": [], "checkpoints": [], '
         b'"reports_state": true, "swa_missing": 5, "swa_window_tokens": null}}}', "swa_missing"),
        (b"[]", "object"),
    ])
    def test_bad_snapshots_are_refused(self, payload, message):
        from prfaas_sglang.wire import kv_snapshot

        with pytest.raises(ValueError, match=message):
            kv_snapshot.decode(payload)


class TestReportedState:
    """Checkpoints from a worker's state events (wire v2) instead of inferred ones."""

    def chain(self, n: int) -> list[BlockStored]:
        return [BlockStored([b], b - 1 if b > 1 else None, [b] * PAGE, PAGE, None) for b in range(1, n + 1)]

    def test_usable_hit_is_the_deepest_reported_state_inside_the_match(self):
        index = KvIndex(hybrid=True)
        index.add_worker("w", "pd")
        prompt = list(range(100))
        blocks = index.block_ids(prompt, PAGE)[:6]
        stored = [BlockStored([b], blocks[i - 1] if i else None, prompt[i * PAGE:(i + 1) * PAGE], PAGE, None)
                  for i, b in enumerate(blocks)]
        index.apply("w", 0, stored, [StateStored(blocks[1], 2 * PAGE), StateStored(blocks[4], 5 * PAGE)])
        assert index.match(prompt).by_worker["w"] == 5 * PAGE  # not 6 blocks: no state at the 6th
        assert index.match(prompt[:4 * PAGE + 1]).by_worker["w"] == 2 * PAGE
        index.apply("w", 1, [], [StateRemoved(blocks[4], 5 * PAGE)])  # a tombstone: pages stay, state goes
        assert index.block_count("w") == 6 and index.match(prompt).by_worker["w"] == 2 * PAGE
        index.apply("w", 2, [], [StateStored(blocks[5], 6 * PAGE, "lightning")])  # not a component this index knows
        assert index.match(prompt).by_worker["w"] == 2 * PAGE
        with pytest.raises(InvalidEvents):  # an swa page without its window: refused whole
            index.apply("w", 3, [], [StateStored(blocks[5], 6 * PAGE, "swa")])


    def test_shared_tokens_is_the_longest_block_match_of_any_worker_state_or_not(self):
        """What a router asks a state checkpoint for (policy.checkpoint_at): the blocks some worker
        holds, though its states (here: none past the second page on ``a``) make less reusable."""
        index = KvIndex(hybrid=True)
        index.add_worker("a", "pd")
        index.add_worker("b", "prfaas")
        prompt = list(range(100))
        blocks = index.block_ids(prompt, PAGE)[:6]
        stored = [BlockStored([b], blocks[i - 1] if i else None, prompt[i * PAGE:(i + 1) * PAGE], PAGE, None)
                  for i, b in enumerate(blocks)]
        index.apply("a", 0, stored, [StateStored(blocks[1], 2 * PAGE)])
        index.apply("b", 0, stored[:3], [])
        match = index.match(prompt)
        assert match.by_worker == {"a": 2 * PAGE, "b": 0} and match.shared_tokens == 6 * PAGE
        assert index.match(prompt[:3 * PAGE + 1]).shared_tokens == 3 * PAGE  # only full pages before the last token
        assert index.match(list(range(500, 600))).shared_tokens == 0

    def test_a_state_is_held_only_where_its_page_is(self):
        index = KvIndex(hybrid=True)
        index.add_worker("w", "pd")
        prompt = list(range(40))
        blocks = index.block_ids(prompt, PAGE)[:2]
        stored = [BlockStored([blocks[0]], None, prompt[:PAGE], PAGE, None),
                  BlockStored([blocks[1]], blocks[0], prompt[PAGE:2 * PAGE], PAGE, None)]
        from prfaas_sglang.wire.kv_events import BlockRemoved

        index.apply("w", 0, stored + [BlockRemoved([blocks[1]])], [StateStored(blocks[1], 2 * PAGE)])
        assert index.match(prompt).by_worker["w"] == 0

    def test_switching_between_reported_and_inferred_rebuilds_the_worker(self):
        index = KvIndex(hybrid=True, checkpoint_interval_tokens=8)
        index.add_worker("w", "pd")
        cache = PrefixCache(PAGE, 100, hybrid=True, checkpoint_interval_tokens=8)
        insert_into(index, "w", 0, cache, list(range(20)), report_state=False)
        assert index.block_count("w") == 5
        insert_into(index, "w", 1, cache, list(range(50, 70)), report_state=True)
        assert index.block_count("w") == 5  # the first prompt's inferred view is gone, the new one is reported
        assert index.match(list(range(20)) + [1]).by_worker["w"] == 0
        assert index.export()["w"].reports_state

    def test_bad_state_events_are_refused_whole(self):
        index = KvIndex(hybrid=True)
        index.add_worker("w", "pd")
        for bad in ([StateStored(1, 0)], [StateRemoved(1, -4)], [BlockStored([1], None, [1] * PAGE, PAGE, None)]):
            with pytest.raises(InvalidEvents):
                index.apply("w", 0, self.chain(2), bad)
            assert index.block_count("w") == 0

    def test_a_v2_frame_through_the_feed_and_a_snapshot_keep_reported_state(self):
        from prfaas_sglang.wire import kv_snapshot

        index = KvIndex(hybrid=True)
        index.add_worker("w", "pd")
        handle = kv_event_handler(index, "w")
        prompt = list(range(30))
        blocks = index.block_ids(prompt, PAGE)[:3]
        stored = [BlockStored([b], blocks[i - 1] if i else None, prompt[i * PAGE:(i + 1) * PAGE], PAGE, None)
                  for i, b in enumerate(blocks)]
        payload = encode_batch(KVEventBatch(1.0, stored, 0, [StateStored(blocks[1], 2 * PAGE)]))
        assert handle([b"kv-events", (0).to_bytes(8, "big"), payload]) == 4
        assert index.match(prompt).by_worker["w"] == 2 * PAGE
        snap = kv_snapshot.decode(kv_snapshot.encode(index.export()))["w"]
        assert snap.reports_state and snap.checkpoints == (blocks[1],)
        restored = KvIndex(hybrid=True)
        restored.add_worker("w", "pd")
        restored.restore("w", snap)
        assert restored.match(prompt).by_worker["w"] == 2 * PAGE
        # Live events came first and are inferred (SGLang's own publisher): the snapshot's checkpoints are not taken.
        live = KvIndex(hybrid=True)
        live.add_worker("w", "pd")
        live.apply("w", 0, [])
        live.restore("w", snap)
        assert not live.export()["w"].reports_state and live.match(prompt).by_worker["w"] == 0


def test_a_newer_sglangs_map_encoded_events_are_read():
    """SGLang 0.5.23 writes each event as a tagged map with optional fields omitted and new ones
    added (BENCHMARKS.md, "Hooks and registered backends onto 0.5.23"); the batch stays an array."""
    import msgspec

    from prfaas_sglang.wire.kv_events import BlockRemoved, decode_batch

    payload = msgspec.msgpack.encode([2.5, [
        {"type": "BlockStored", "block_hashes": [11, 12], "token_ids": [1, 2, 3, 4, 5, 6, 7, 8], "block_size": 4,
         "medium": "GPU", "cache_salt": "s", "session_id": "x"},
        {"type": "BlockRemoved", "block_hashes": [12]},
        {"type": "AllBlocksCleared"},
    ], 0])
    batch = decode_batch(payload)
    assert batch.events == [BlockStored([11, 12], None, [1, 2, 3, 4, 5, 6, 7, 8], 4, None, "GPU"),
                            BlockRemoved([12], None), AllBlocksCleared()]
    assert batch.ts == 2.5 and batch.attn_dp_rank == 0 and batch.state_events is None
    with pytest.raises(msgspec.ValidationError):
        decode_batch(msgspec.msgpack.encode([1.0, [{"type": "Nonsense"}]]))


def test_events_written_as_maps_keep_the_batch_array_and_read_back_the_same():
    """``encode_batch(events_as_maps=True)``: what the emulated engine writes beside SGLang 0.5.23
    (tests/engine/test_pd.py decodes it with that release's own classes)."""
    import msgspec

    from prfaas_sglang.wire.kv_events import BlockRemoved, decode_batch, encode_batch

    batch = KVEventBatch(2.5, [BlockStored([11], None, [1, 2, 3, 4], 4, None, "GPU"), BlockRemoved([11]),
                               AllBlocksCleared()], 0, [StateStored(11, 4)])
    payload = encode_batch(batch, events_as_maps=True)
    ts, events, rank, states = msgspec.msgpack.decode(payload)
    assert (ts, rank, states) == (2.5, 0, msgspec.msgpack.decode(encode_batch(batch))[3])
    assert events == [{"type": "BlockStored", "block_hashes": [11], "parent_block_hash": None, "token_ids": [1, 2, 3, 4],
                       "block_size": 4, "lora_id": None, "medium": "GPU"},  # required fields always, optional None omitted
                      {"type": "BlockRemoved", "block_hashes": [11]}, {"type": "AllBlocksCleared"}]
    assert decode_batch(payload) == batch


class TestSlidingWindowState:
    """``"swa"`` state events: per page, whether it still holds its window KV (SWARadixCache)."""

    @staticmethod
    def worker(pages: int, window_tokens: int, held: set[int]):
        index = KvIndex(hybrid=False)
        index.add_worker("w", "pd")
        prompt = list(range(pages * PAGE + 1))
        blocks = index.block_ids(prompt, PAGE)[:pages]
        stored = [BlockStored([b], blocks[i - 1] if i else None, prompt[i * PAGE:(i + 1) * PAGE], PAGE, None)
                  for i, b in enumerate(blocks)]
        index.apply("w", 0, stored, [StateRemoved(blocks[i], (i + 1) * PAGE, "swa", "GPU", window_tokens)
                                     for i in range(pages) if i not in held])
        return index, prompt, blocks

    def test_all_held_from_the_root_matches_whatever_the_window(self):
        index, prompt, _ = self.worker(6, window_tokens=100 * PAGE, held=set(range(6)))
        assert index.match(prompt).by_worker["w"] == 6 * PAGE

    def test_a_dropped_window_stops_the_hit_until_a_whole_window_is_held_again(self):
        # pages 0-1 held, 2 dropped (a tombstone), 3-5 held; window = 2 pages
        index, prompt, blocks = self.worker(6, window_tokens=2 * PAGE, held={0, 1, 3, 4, 5})
        assert index.match(prompt).by_worker["w"] == 6 * PAGE  # pages 4-5 hold the window before 6
        assert index.match(prompt[:4 * PAGE + 1]).by_worker["w"] == 2 * PAGE  # before 4: only page 3 held after the gap
        assert index.match(prompt[:5 * PAGE + 1]).by_worker["w"] == 5 * PAGE  # pages 3-4
        index.apply("w", 1, [], [StateRemoved(blocks[4], 5 * PAGE, "swa", "GPU", 2 * PAGE)])
        assert index.match(prompt).by_worker["w"] == 2 * PAGE
        index.apply("w", 2, [], [StateStored(blocks[4], 5 * PAGE, "swa", "GPU", 2 * PAGE),  # back again
                                 StateStored(blocks[2], 3 * PAGE, "swa", "GPU", 2 * PAGE)])
        assert index.match(prompt).by_worker["w"] == 6 * PAGE
        # a window not a whole number of pages needs the pages that cover it
        index, prompt, _ = self.worker(6, window_tokens=PAGE + 1, held={0, 2, 3, 4, 5})
        assert index.match(prompt[:3 * PAGE + 1]).by_worker["w"] == 1 * PAGE  # page 2 alone covers PAGE tokens
        assert index.match(prompt).by_worker["w"] == 6 * PAGE

    def test_a_page_removed_takes_its_window_state_along(self):
        from prfaas_sglang.wire.kv_events import BlockRemoved

        index, prompt, blocks = self.worker(3, window_tokens=PAGE, held={0, 1})
        assert index.match(prompt).by_worker["w"] == 2 * PAGE
        index.apply("w", 1, [BlockRemoved([blocks[2]])], [])
        index.apply("w", 2, [BlockStored([blocks[2]], blocks[1], prompt[2 * PAGE:3 * PAGE], PAGE, None)], [])
        assert index.match(prompt).by_worker["w"] == 3 * PAGE  # page 2 stored afresh: with its window KV
        index.apply("w", 3, [], [StateRemoved(12345, PAGE, "swa", "GPU", PAGE)])  # a page never stored: no mark
        assert 12345 not in index._workers["w"].swa_missing

    def test_a_snapshot_keeps_a_window_workers_pages_and_window(self):
        from prfaas_sglang.wire import kv_snapshot

        index, prompt, _ = self.worker(6, window_tokens=2 * PAGE, held={0, 1, 3, 4})
        assert index.match(prompt).by_worker["w"] == 5 * PAGE
        snap = kv_snapshot.decode(kv_snapshot.encode(index.export()))["w"]
        assert snap.swa_window_tokens == 2 * PAGE and len(snap.swa_missing) == 2
        restored = KvIndex(hybrid=False)
        restored.add_worker("w", "pd")
        restored.restore("w", snap)
        assert restored.match(prompt).by_worker["w"] == 5 * PAGE  # not 6: page 5 never held its window
        v2 = json.loads(kv_snapshot.encode(index.export()))
        v2["v"] = 2
        for w in v2["workers"].values():
            del w["swa_missing"], w["swa_window_tokens"]
        assert kv_snapshot.decode(json.dumps(v2))["w"].swa_window_tokens is None  # an older service's snapshot


def _chain(rng: random.Random, n: int) -> BlockStored:
    hashes = [rng.getrandbits(63) for _ in range(n)]
    return BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=[0] * n, block_size=1, lora_id=None)


def test_an_index_of_many_blocks_gives_the_garbage_collector_nothing_to_walk():
    """Page size 1 (a hybrid model's) is a block per token: a router may hold millions. The index
    keeps them in containers CPython leaves out of garbage collection, so the objects a collection
    walks (and its pause) do not grow with the blocks held: here 40,000 blocks on three workers,
    shared, with checkpoints (inferred and reported) and sliding-window marks, add a few dozen."""
    import gc

    rng = random.Random(5)
    index = KvIndex(hybrid=True, checkpoint_interval_tokens=64)
    for name, cluster in (("a", "prfaas"), ("b", "pd"), ("c", "pd")):
        index.add_worker(name, cluster, block_size=1)
    gc.collect()
    before = len(gc.get_objects())
    seq = {"a": 0, "b": 0, "c": 0}
    for _ in range(40):
        chain = _chain(rng, 1000)
        for name in rng.sample(["a", "b", "c"], rng.randrange(1, 4)):
            states = None if name == "a" else [StateStored(block_hash=chain.block_hashes[-1], num_tokens=1000, component_type="mamba"),
                                               StateRemoved(block_hash=chain.block_hashes[10], num_tokens=11, component_type="swa",
                                                            window_tokens=4)]
            index.apply(name, seq[name], [chain], states)
            seq[name] += 1
    gc.collect()
    assert sum(index.block_count(n) for n in "abc") >= 40_000
    assert len(gc.get_objects()) - before < 100


def test_a_worker_added_after_another_left_inherits_none_of_its_blocks():
    """Holders are kept as one bit per worker, and a new worker may take a departed one's bit:
    nothing the departed worker held may show up as the newcomer's."""
    rng = random.Random(6)
    index = KvIndex(hybrid=False)
    index.add_worker("old", "pd", block_size=1)
    index.add_worker("stays", "pd", block_size=1)
    chain = _chain(rng, 50)
    index.apply("old", 0, [chain])
    index.apply("stays", 0, [chain])
    prompt, ids = [0] * 51, {1: chain.block_hashes}
    assert index.match(prompt, ids).by_worker == {"old": 50, "stays": 50}
    index.remove_worker("old")
    index.add_worker("new", "prfaas", block_size=1)
    match = index.match(prompt, ids)
    assert match.by_worker == {"stays": 50, "new": 0} and match.by_cluster == {"pd": 50, "prfaas": 0}
    index.apply("new", 0, [chain])
    index.remove_worker("stays")
    assert index.match(prompt, ids).by_worker == {"new": 50}
    assert dict(index.export()["new"].blocks) == {b: d for d, b in enumerate(chain.block_hashes, 1)}
