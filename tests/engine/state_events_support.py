"""The state-event tests' common parts (either supported SGLang release): a real cache driven as the
scheduler drives it, the wire from its events to a kv-index, and the randomized replay that compares
the two (``test_state_events.py``: 0.5.15's per-kind caches; ``test_unified_cache.py``: 0.5.23's tree)."""

from __future__ import annotations

import time

import msgspec
from hypothesis import strategies as st
from sglang.srt.disaggregation import kv_events as sglang_kv_events
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
from sglang.srt.mem_cache.radix_cache import RadixKey

from prfaas_sglang.hooks import event_publisher
from prfaas_sglang.kvindex.feed import kv_event_handler
from prfaas_sglang.kvindex.index import KvIndex


class CacheOps:
    """A real SGLang hybrid pool and a state-reporting cache over it (``bench/sglang_cpu.py``: a
    ``CpuHybridCache``, either release's); operations as the scheduler performs them (alloc, evict
    when short, insert, free a duplicate state slot)."""

    key_of = staticmethod(list)  # a key's token ids as the tree holds them (0.5.23's: ``array("q")``)

    def __init__(self, built):
        self.cache, self.kv, self.req_pool, self.kv_pool = built.cache, built.kv, built.req_pool, built.kv_pool
        self.params, self.page_size = built.params, built.page_size

    def insert(self, tokens: list[int]) -> bool:
        n = len(tokens)
        if n == 0 or n % self.page_size:
            return False
        if self.kv.available_size() < n:
            self.cache.evict(EvictParams(num_tokens=n - self.kv.available_size()))
        value = self.kv.alloc(n)
        if value is None:
            return False
        slot = self.req_pool.mamba_allocator.alloc(1)
        if slot is None:
            self.cache.evict(EvictParams(num_tokens=0, mamba_num=1))
            slot = self.req_pool.mamba_allocator.alloc(1)
        if slot is None:
            self.kv.free(value)
            return False
        result = self.cache.insert(InsertParams(key=RadixKey(self.key_of(tokens)), value=value, mamba_value=slot))
        if result.mamba_exist:  # the state was already cached: the scheduler frees its own slot
            self.req_pool.mamba_allocator.free(slot)
        return True

    def match(self, tokens: list[int]) -> int:
        return matched_len(self.cache.match_prefix(MatchPrefixParams(key=RadixKey(self.key_of(tokens)))))


def matched_len(result) -> int:
    """The device prefix a match found (0.5.23 counts it, 0.5.15 lists its indices)."""
    length = getattr(result, "device_prefix_len", None)
    return len(result.device_indices) if length is None else length




class Wire:
    """The cache's events through SGLang's scheduler-side batch, our publisher's v2 batch, its
    bytes and the kv-index's feed (no socket: the ZMQ test below has one)."""

    def __init__(self, index: KvIndex, worker: str = "w"):
        self.handle = kv_event_handler(index, worker)
        self.seq = 0
        self.batches: list[bytes] = []

    def flush(self, cache) -> None:
        """Publish what the cache queued since the last batch, if anything (one scheduler step)."""
        events = cache.take_events()
        if events:
            self.publish(events)

    def publish(self, events) -> None:
        """``events`` (a cache's ``take_events()``) as one published batch, fed to the index."""
        payload = wire_bytes(events)
        self.batches.append(payload)
        self.handle([b"kv-events", self.seq.to_bytes(8, "big"), payload])
        self.seq += 1


def wire_bytes(events) -> bytes:
    """A cache's events as our publisher writes them: SGLang's scheduler-side batch (as
    ``publish_kv_events`` builds it), then wire v2, then msgpack."""
    batch = sglang_kv_events.KVEventBatch(ts=time.time(), events=events)
    return msgspec.msgpack.encode(event_publisher.to_wire_batch(batch))


def both_decoders(cache) -> tuple:
    """The cache's queued events as a published batch, read by SGLang's own decoder (which skips the
    4th element) and by ours: (theirs, ours)."""
    from prfaas_sglang.wire.kv_events import decode_batch

    payload = wire_bytes(cache.take_events())
    return msgspec.msgpack.Decoder(sglang_kv_events.KVEventBatch).decode(payload), decode_batch(payload)


def index_for(page_size: int) -> KvIndex:
    index = KvIndex(hybrid=True)
    index.add_worker("w", "pd", block_size=page_size)
    return index


OPS = st.lists(
    st.one_of(
        st.tuples(st.just("insert"), st.lists(st.integers(0, 3), min_size=1, max_size=6)),
        st.tuples(st.just("evict_full"), st.integers(1, 12)),
        st.tuples(st.just("evict_mamba"), st.integers(1, 3)),
        st.tuples(st.just("match"), st.lists(st.integers(0, 3), min_size=1, max_size=6)),
    ),
    min_size=1, max_size=14,
)


def replay_and_compare(real, index: KvIndex, ops, page_size: int, evict_state) -> None:
    """Run ``ops`` (insert / match a key of whole pages, evict full KV or state: ``evict_state(n)``)
    on the real cache, publishing a batch after each; then, for every key inserted so far and the
    operation's own, the index's hit must equal the cache's ``match_prefix``."""
    wire = Wire(index)
    seen: list[list[int]] = []
    for op, arg, *extra in ops:
        if op in ("insert", "match"):
            key = [t for t in arg for _ in range(page_size)]  # whole pages, with sharing between keys
            if op == "insert" and real.insert(key, *extra):
                seen.append(key)
            seen_now = seen + [key]
        else:
            real.cache.evict(EvictParams(num_tokens=arg * page_size) if op == "evict_full" else evict_state(arg))
            seen_now = seen
        wire.flush(real.cache)
        for key in seen_now:
            # The index reads the full pages of prompt[:-1]; SGLang matches the key it is given.
            assert index.match(key + [0]).by_worker["w"] == real.match(key), (key, ops)
        real.cache.take_events()  # match_prefix splits nodes (no events); nothing may be pending
        assert not real.cache.take_events()
