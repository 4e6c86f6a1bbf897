"""The global KV index against the emulated engine's own cache and events (pure, no sockets)."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prfaas_sglang.engine.mock.prefix_cache import PrefixCache
from prfaas_sglang.kvindex.feed import BadFrame, kv_event_handler
from prfaas_sglang.kvindex.index import InvalidEvents, KvIndex
from prfaas_sglang.wire.kv_events import AllBlocksCleared, BlockStored, KVEventBatch, encode_batch

PAGE = 4


def feed(index: KvIndex, worker: str, cache: PrefixCache, prompts, seq0: int = 0) -> int:
    seq = seq0
    for prompt in prompts:
        index.apply(worker, seq, cache.insert(prompt))
        seq += 1
    return seq


def test_index_agrees_with_the_worker_cache_dense_and_hybrid():
    """Fed a worker's events, the index predicts what the worker's own cache reuses: exactly for a
    dense model; for a hybrid one never more (a prompt ending on an already-cached page adds a
    state checkpoint that, as in SGLang, no event announces)."""
    rng = random.Random(3)
    for hybrid in (False, True):
        cache = PrefixCache(PAGE, capacity_blocks=40, hybrid=hybrid, checkpoint_interval_tokens=8)
        index = KvIndex(hybrid=hybrid, checkpoint_interval_tokens=8)
        index.add_worker("w", "pd")
        stems = [[rng.randrange(50) for _ in range(rng.randrange(4, 30))] for _ in range(6)]
        seq = 0
        for _ in range(200):
            prompt = rng.choice(stems) + [rng.randrange(50) for _ in range(rng.randrange(0, 12))]
            predicted = index.match(prompt).by_worker["w"]
            actual = cache.match(prompt[:-1]).cached_tokens
            assert predicted == actual if not hybrid else predicted <= actual, (hybrid, prompt)
            index.apply("w", seq, cache.insert(prompt))
            seq += 1


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
       capacity=st.integers(1, 12), hybrid=st.booleans())
def test_index_never_overstates_a_worker(prompts, capacity, hybrid):
    """With eviction in play: equal to the worker's cache (dense), never above it (hybrid)."""
    cache = PrefixCache(PAGE, capacity_blocks=capacity, hybrid=hybrid, checkpoint_interval_tokens=8)
    index = KvIndex(hybrid=hybrid, checkpoint_interval_tokens=8)
    index.add_worker("w", "pd")
    for seq, prompt in enumerate(prompts):
        predicted, actual = index.match(prompt).by_worker["w"], cache.match(prompt[:-1]).cached_tokens
        assert predicted == actual if not hybrid else predicted <= actual
        index.apply("w", seq, cache.insert(prompt))


def test_hybrid_index_exact_when_every_prompt_brings_new_pages():
    cache = PrefixCache(PAGE, 100, hybrid=True, checkpoint_interval_tokens=8)
    index = KvIndex(hybrid=True, checkpoint_interval_tokens=8)
    index.add_worker("w", "pd")
    base = list(range(30))
    for seq, n in enumerate((9, 17, 26, 30)):
        prompt = base[:n]
        assert index.match(prompt + [77]).by_worker["w"] == cache.match(prompt).cached_tokens
        index.apply("w", seq, cache.insert(prompt))
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
        live.apply("w", 41, cache.insert(list(range(100, 140))))
        before = live.block_count("w")
        live.restore("w", snap)
        assert live.block_count("w") == before + original.block_count("w")
        live.apply("w", 99, cache.insert(list(range(200, 240))))  # the next event is taken, whatever its number
        assert live.resets("w") == 0

    @pytest.mark.parametrize("payload, message", [
        (b'{"v": 2, "workers": {}}', "version"),
        (b'{"v": 1}', "workers must be an object"),
        (b'{"v": 1, "workers": {"w": {"cluster": "pd", "block_size": 4, "blocks": []}}}', "exactly"),
        (b'{"v": 1, "workers": {"w": {"cluster": "pd", "block_size": 0, "blocks": [], "checkpoints": []}}}', "block_size"),
        (b'{"v": 1, "workers": {"w": {"cluster": "pd", "block_size": 4, "blocks": [[1, true]], "checkpoints": []}}}', "depth"),
        (b'{"v": 1, "workers": {"w": {"cluster": "pd", "block_size": 4, "blocks": [[1, 0]], "checkpoints": []}}}', "depth"),
        (b'{"v": 1, "workers": {"w": {"cluster": "pd", "block_size": 4, "blocks": [[18446744073709551616, 1]], '
         b'"checkpoints": []}}}', "64-bit"),
        (b'{"v": 1, "workers": {"w": {"cluster": "pd", "block_size": 4, "blocks": [1], "checkpoints": []}}}', "pairs"),
        (b"[]", "object"),
    ])
    def test_bad_snapshots_are_refused(self, payload, message):
        from prfaas_sglang.wire import kv_snapshot

        with pytest.raises(ValueError, match=message):
            kv_snapshot.decode(payload)
