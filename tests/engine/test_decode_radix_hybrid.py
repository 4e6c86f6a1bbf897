"""The decode-side radix cache for hybrid models (``hooks/decode_radix.py``, patch 0001), on CPU.

SGLang's real decode path: ``DecodePreallocQueue._match_prefix_and_lock`` and ``_pre_alloc``
(the queue's own methods, on a queue holding only what they read), SGLang's decode request pool
``HybridMambaDecodeReqToTokenPool`` with a ``HybridLinearKVPool``, our ``DecodeMambaRadixCache``
through the registered ``prfaas-hybrid`` backend, ``release_kv_cache`` when a request ends, and
SGLang's ``build_kv_cache`` with patch 0001 applied. What the network would do is played by hand:
the prefill worker's KV lands in the slots ``_pre_alloc`` returned, its final state in the
request's own slot; each decode step takes one KV slot, as a forward would.
"""

from __future__ import annotations

from array import array
from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prfaas_sglang._compat import RADIX_TREES, installed_has

torch = pytest.importorskip("torch")
if not installed_has(RADIX_TREES):
    pytest.skip("SGLang 0.5.15's DecodeMambaRadixCache; on 0.5.23 a decode worker's hybrid tree is upstream's own "
                "(bench decode-reuse measures the two)", allow_module_level=True)

from sglang.srt.disaggregation.decode import DecodePreallocQueue  # noqa: E402
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, MatchPrefixParams  # noqa: E402
from sglang.srt.mem_cache.mamba_radix_cache import MambaRadixCache  # noqa: E402
from sglang.srt.mem_cache.radix_cache import RadixKey  # noqa: E402

from prfaas_sglang.hooks import cache_backend, hybrid_cache  # noqa: E402
from prfaas_sglang.hooks.decode_radix import (  # noqa: E402
    DecodeMambaRadixCache,
    DecodeRadixConfigError,
    allows_hybrid_decode_radix,
    make_room_for_state,
)

KV_TOKENS, MAX_RUNNING, PRE_ALLOC = 200, 2, 1
STATE_SLOTS = MAX_RUNNING + PRE_ALLOC  # the decode pool's sizing: one state per request it can hold


class Decode:
    """One decode worker's pools, tree and prealloc queue; requests admitted, received, decoded and
    finished as SGLang's decode scheduler does, with the network played by hand."""

    def __init__(self, kv_tokens: int = KV_TOKENS, hook: bool = True):
        from prfaas_sglang.bench.sglang_cpu import cpu_decode_hybrid_cache

        self.built = cpu_decode_hybrid_cache(DecodeMambaRadixCache, kv_tokens, MAX_RUNNING, PRE_ALLOC)
        self.kv_tokens, self.hook = kv_tokens, hook
        queue = DecodePreallocQueue.__new__(DecodePreallocQueue)  # SGLang's methods; only what they read
        queue.tree_cache, queue.req_to_token_pool = self.built.cache, self.built.req_pool
        queue.token_to_kv_pool_allocator, queue.token_to_kv_pool = self.built.kv, self.built.kv_pool
        queue.scheduler = SimpleNamespace(server_args=SimpleNamespace(disaggregation_decode_enable_radix_cache=True),
                                          enable_hisparse=False, enable_decode_hicache=False)
        self.queue, self.in_flight, self.seed = queue, [], 0

    @property
    def tree(self) -> DecodeMambaRadixCache:
        return self.built.cache

    def admit(self, rid: str, ids: list[int], new_tokens: int = 4):
        """Match, lock and pre-allocate (``pop_preallocated``'s steps); then the prefill worker's KV
        for what is not held lands, and its final state. Returns (req, decode_prefix_len)."""
        from sglang.srt.managers.schedule_batch import Req
        from sglang.srt.sampling.sampling_params import SamplingParams

        req = Req(rid=rid, origin_input_text="", origin_input_ids=array("q", ids),
                  sampling_params=SamplingParams(max_new_tokens=new_tokens))
        match = self.queue._match_prefix_and_lock(req)
        if self.hook:
            make_room_for_state(self.queue, req)
        kv_loc = self.queue._pre_alloc(req, match.prefix_indices, match.l1_prefix_len, match.decode_prefix_len)
        req.cache_protected_len = match.decode_prefix_len
        assert len(kv_loc) == len(ids) - match.decode_prefix_len  # what the prefill worker is asked to send
        self._land(req, kv_loc, match.decode_prefix_len)
        self.in_flight.append(req)
        return req, match.decode_prefix_len

    def _land(self, req, kv_loc, start: int) -> None:
        """The prefill worker's transfer: the KV of tokens ``start..`` (values derived from the token
        and its position, so equal prefixes carry equal bytes) and the request's final state."""
        buf = self.built.kv_pool.full_kv_pool.k_buffer[0]
        for i, slot in enumerate(kv_loc.tolist()):
            buf[slot] = float(req.origin_input_ids[start + i] % 97 + (start + i) % 13)
        conv = self.built.req_pool.mamba_pool.mamba_cache.conv[0]
        conv[:, req.mamba_pool_idx] = float(len(req.origin_input_ids))

    def decode(self, req, tokens: list[int]) -> None:
        """``tokens`` generated: the first came with the prefill; each later one is a forward over
        the previous token, which takes one KV slot."""
        req.output_ids.append(tokens[0])
        for token in tokens[1:]:
            loc = self.built.kv.alloc(1)
            if loc is None:
                self.tree.evict(EvictParams(num_tokens=1))
                loc = self.built.kv.alloc(1)
            pos = req.kv_committed_len
            self.built.req_pool.write((req.req_pool_idx, slice(pos, pos + 1)), loc)
            req.kv_committed_len += 1
            req.kv_allocated_len += 1
            req.output_ids.append(token)

    def finish(self, req) -> None:
        from sglang.srt.mem_cache.common import release_kv_cache

        release_kv_cache(req, self.tree)
        self.in_flight.remove(req)

    def turn(self, rid: str, ids: list[int], answer: list[int]):
        """A whole request: admitted, decoded, finished. Returns (decode_prefix_len, its KV row)."""
        req, held = self.admit(rid, ids, len(answer))
        self.decode(req, answer)
        row = self.built.req_pool.req_to_token[req.req_pool_idx, : req.kv_committed_len].clone()
        self.finish(req)
        return held, row

    def kv_bytes(self, slots) -> list[float]:
        return self.built.kv_pool.full_kv_pool.k_buffer[0][slots].flatten().tolist()

    def check_accounting(self) -> None:
        """Every KV slot is free, in the tree, or held by a running request beyond its reused prefix;
        every state slot is free, in the tree, or a running request's own."""
        tree_tokens, tree_states = self.tree.total_size()
        held = sum(r.kv_committed_len - r.cache_protected_len for r in self.in_flight)
        assert self.built.kv.available_size() + tree_tokens + held == self.kv_tokens
        free_states = self.built.req_pool.mamba_allocator.available_size()
        assert free_states + tree_states + len(self.in_flight) == STATE_SLOTS
        if not self.in_flight:  # SGLang's own checks of its LRU lists and sizes (for an idle tree)
            self.tree.full_lru_list.sanity_check(self.tree)
            self.tree.mamba_lru_list.sanity_check(self.tree)

    def stateful_match(self, ids: list[int]) -> int:
        """What SGLang's own ``MambaRadixCache.match_prefix`` reuses of ``ids`` on this tree (up to
        the last node holding a state)."""
        result = MambaRadixCache.match_prefix(self.tree, MatchPrefixParams(key=RadixKey(array("q", ids)[:-1])))
        return len(result.device_indices)


SYSTEM = list(range(1_000, 1_020))  # a 20-token system prompt several conversations share


def test_a_follow_up_turn_ships_only_what_the_decode_worker_lacks():
    d = Decode()
    first = SYSTEM + list(range(100, 110))
    held, row = d.turn("a1", first, [9_000, 9_001, 9_002, 9_003])
    assert held == 0
    # The next turn: the previous prompt, its answer, a new message. The answer's last token never
    # had its KV computed (it was the last one generated), so the tree holds the first turn up to
    # the one before; the match stops a token short of that node, which holds the turn's state.
    second = first + [9_000, 9_001, 9_002, 9_003] + list(range(200, 210))
    req, held = d.admit("a2", second)
    assert held == len(first) + 3 - 1
    assert d.tree.total_size()[1] == 1 and req.last_node.mamba_value is None  # the lock pins no state
    prefix = d.built.req_pool.req_to_token[req.req_pool_idx, :held]
    assert torch.equal(prefix, row[:held])  # the tree's slots: turn 1's KV, not shipped again
    assert d.kv_bytes(prefix) == d.kv_bytes(row[:held])
    assert req.mamba_cow_src_index is None  # no state taken from the tree: the request's own came with the KV
    assert d.built.req_pool.mamba_pool.mamba_cache.conv[0][:, req.mamba_pool_idx].flatten()[0] == len(second)
    d.check_accounting()
    d.decode(req, [9_010, 9_011])
    d.finish(req)
    d.check_accounting()


@pytest.mark.parametrize("tombstone", [False, True])
def test_a_prefix_held_without_a_state_there_is_still_reused(tombstone):
    """Two conversations share only the system prompt: the tree's state sits at the end of the
    first, not where they part, so SGLang's own match reuses nothing. Or the first conversation's
    state at the end of its first turn was evicted (a tombstone) before a branch from it arrives.
    A decode worker needs no state from its tree: it reuses the KV either way."""
    d = Decode()
    d.turn("a", SYSTEM + list(range(100, 110)), [9_000, 9_001])
    if tombstone:
        base = SYSTEM + list(range(100, 110)) + [9_000]
        d.turn("a2", base + list(range(300, 305)), [9_100, 9_101])  # the first turn's node is now internal
        assert d.tree.evict(EvictParams(num_tokens=0, mamba_num=1)).mamba_num_evicted == 1  # the older state goes
        other, expected = base + list(range(400, 405)), len(base)
    else:
        other, expected = SYSTEM + list(range(700, 712)), len(SYSTEM)
    assert d.stateful_match(other) == 0
    req, held = d.admit("b", other)
    assert held == expected
    d.check_accounting()


def test_a_prompt_the_tree_holds_whole_still_ships_its_last_token():
    """Every transfer carries a KV chunk, after which the state follows, as in every other transfer."""
    d = Decode()
    prompt = SYSTEM + list(range(100, 110))
    d.turn("a", prompt, [9_000, 9_001, 9_002])
    req, held = d.admit("again", prompt[:25])
    assert held == 24
    d.check_accounting()


def test_a_new_request_evicts_a_cached_state_when_the_tree_holds_every_free_slot():
    """Finished requests donate their state slots to the tree; the pool is sized for the requests a
    decode worker holds at once. With every slot in the tree, a new request's slot comes from the
    least recently used state (its KV leaf goes with it); without the hook SGLang 0.5.15's
    ``_pre_alloc`` finds no slot."""
    for hook in (True, False):
        d = Decode(hook=hook)
        for n in range(STATE_SLOTS):
            d.turn(f"c{n}", [5_000 + 100 * n + i for i in range(12)], [9_000, 9_001])
        assert d.built.req_pool.mamba_allocator.available_size() == 0
        assert d.tree.total_size()[1] == STATE_SLOTS
        if not hook:
            with pytest.raises((AssertionError, TypeError, RuntimeError)):
                d.admit("new", list(range(8_000, 8_020)))
            continue
        oldest = [5_000 + i for i in range(12)]
        req, held = d.admit("new", list(range(8_000, 8_020)))
        assert held == 0 and req.mamba_pool_idx is not None
        assert d.tree.total_size()[1] == STATE_SLOTS - 1
        assert d.stateful_match(oldest + [1]) == 0  # the least recently used conversation left
        d.check_accounting()


def _reference_match(tree: DecodeMambaRadixCache, ids: list[int]) -> int:
    """By walking the tree's nodes: the longest prefix of ``ids[:-1]`` whose KV the tree holds,
    less a token (the page) for each node with a state the match would end at."""
    want, node, n, ends_at_node = ids[:-1], tree.root_node, 0, False
    while n < len(want):
        child = next((c for c in node.children.values() if c.key.token_ids[0] == want[n]), None)
        if child is None:
            break
        keys = list(child.key.token_ids)
        k = 0
        while k < len(keys) and n + k < len(want) and keys[k] == want[n + k]:
            k += 1
        n += k
        if k < len(keys):
            ends_at_node = False
            break
        node, ends_at_node = child, True
    while ends_at_node and node is not tree.root_node and node.mamba_value is not None:
        n -= 1
        ends_at_node = len(node.key) == 1
        node = node.parent
    return n


@pytest.mark.slow
@settings(max_examples=300, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(steps=st.lists(st.tuples(st.integers(0, 3), st.integers(0, 2), st.integers(1, 12), st.booleans()),
                      min_size=4, max_size=14))
def test_accounting_and_the_match_hold_over_random_conversations(steps):
    """Four conversations sharing a system prompt, each step a new turn of one of them (its previous
    prompt and answer, then new tokens), up to two requests in flight and eviction under a small KV
    pool: at every step the match equals the KV the tree holds, what is reused is turn-to-turn
    identical KV, and every KV and state slot is accounted for."""
    d = Decode(kv_tokens=160)
    history: dict[int, list[int]] = {}
    for i, (conv, shared, extra, finish_now) in enumerate(steps):
        base = history.get(conv, SYSTEM[: 8 * shared])
        prompt = base + [20_000 + 100 * conv + 10 * i + j for j in range(extra)]
        expected = _reference_match(d.tree, prompt)
        req, held = d.admit(f"r{i}", prompt, 3)
        assert held == expected
        d.check_accounting()
        answer = [30_000 + i, 30_001 + i, 30_002 + i]
        d.decode(req, answer)
        history[conv] = prompt + answer
        if finish_now or len(d.in_flight) >= MAX_RUNNING:
            for r in list(d.in_flight):
                d.finish(r)
                d.check_accounting()
    for r in list(d.in_flight):
        d.finish(r)
    d.check_accounting()


def test_the_patched_builder_builds_the_decode_cache_and_refuses_what_it_cannot_serve():
    """SGLang's ``build_kv_cache`` with patch 0001, on a decode worker with the decode radix cache
    and a Mamba/SSM model: the ``prfaas-hybrid`` backend with ``no_buffer`` gets the decode cache;
    without the backend SGLang's own refusal stands; ``extra_buffer`` gets a typed refusal naming the fix."""
    from sglang.srt.configs.model_config import ModelImpl
    from sglang.srt.mem_cache.kv_cache_builder import build_kv_cache
    from sglang.srt.server_args import ServerArgs
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    from prfaas_sglang.bench.sglang_cpu import cpu_decode_hybrid_cache

    cache_backend.register_backends()
    built = cpu_decode_hybrid_cache(DecodeMambaRadixCache, 64, MAX_RUNNING, PRE_ALLOC)

    def build(backend: str | None, strategy: str = "no_buffer", mode: str = "decode"):
        args = ServerArgs(model_path="dummy", device="cpu")
        args.disaggregation_mode, args.disaggregation_decode_enable_radix_cache = mode, True
        args.disable_radix_cache, args.radix_cache_backend, args.mamba_radix_cache_strategy = False, backend, strategy
        runner = SimpleNamespace(linear_attn_model_spec=None, hybrid_gdn_config=object(), mamba2_config=None,
                                 kimi_linear_config=None, hybrid_lightning_config=None)
        worker = SimpleNamespace(is_hybrid_swa=False, model_runner=runner,
                                 get_memory_pool=lambda: (built.req_pool, built.kv))
        return build_kv_cache(
            server_args=args, model_config=SimpleNamespace(is_multimodal=False, _resolved_model_impl=ModelImpl.SGLANG),
            tp_worker=worker, page_size=1, spec_algorithm=SpeculativeAlgorithm.NONE, attn_tp_cpu_group=None,
            tp_cpu_group=None, attn_cp_cpu_group=None, enable_metrics=False, enable_kv_cache_events=False,
            ps=SimpleNamespace(pp_rank=0, pp_size=1, tp_size=1, tp_rank=0), tp_group=None,
            pp_group=SimpleNamespace(cpu_group=None), enable_hierarchical_cache=False).tree_cache

    assert type(build("prfaas-hybrid")) is DecodeMambaRadixCache
    assert type(build("prfaas-hybrid", mode="prefill")) is hybrid_cache.StateEventsMambaRadixCache
    with pytest.raises(ValueError, match="incompatible with Mamba/SSM models"):
        build(None)
    with pytest.raises(DecodeRadixConfigError, match="--mamba-radix-cache-strategy no_buffer"):
        build("prfaas-hybrid", strategy="extra_buffer")
    assert allows_hybrid_decode_radix(SimpleNamespace(radix_cache_backend="other")) is False
