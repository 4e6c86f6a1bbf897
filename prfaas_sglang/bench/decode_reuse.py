"""``bench decode-reuse``: how much of each turn a hybrid model's decode radix cache already holds.

A decode worker's real SGLang pools and tree on CPU (``bench/sglang_cpu.py``: a tiny hybrid layout,
page 1), fed the same conversations on either supported release. Each request goes through the
decode side as SGLang's scheduler takes it: a state slot made free, the prefix matched and locked,
its rows pre-allocated, the prefill worker's KV for the rest (and the final state) landed, the answer
decoded one KV slot per token, the request released into the tree. Reported per row: the prompt
tokens the decode cache held (what the prefill worker did not have to send), as a fraction of all
prompt tokens.

Rows, by the installed release:

* SGLang 0.5.15, ``ours``: ``DecodeMambaRadixCache`` (``hooks/decode_radix.py``), whose match is on
  full-attention KV only (the prefill worker sends the final state anyway), with the
  ``decode-state-slot`` hook making a request's state slot;
* SGLang 0.5.15, ``state-aware match on ours``: the same tree and flow, each prompt also matched by
  SGLang's own ``MambaRadixCache.match_prefix`` (up to the last node holding a state), which is what a
  state-aware match would have held there (counterfactual: the tree is ours);
* SGLang 0.5.23, ``upstream``: SGLang's own decode radix cache for hybrids (the unified tree, its
  copy-on-write state-aware match, ``ensure_mamba_capacity`` making the state slot).

The workload: ``conversations`` conversations sharing a system prompt, ``turns`` turns each, their turns
interleaved in a seeded random order; a turn's prompt is the previous prompt, its answer and a new
message. One request at a time, so the pools' state slots (``state_slots``: a decode worker's
``max_running_requests`` plus its pre-allocation reserve) are what conversations compete for.
"""

from __future__ import annotations

import argparse
import random
from array import array
from dataclasses import dataclass
from types import SimpleNamespace

from prfaas_sglang.bench.subcommands import Invocation, Subcommand

SYSTEM_TOKENS = 64
PRE_ALLOC = 1  # the decode pool's reserve for requests receiving KV


@dataclass(frozen=True)
class Turn:
    conversation: int
    prompt: list[int]
    answer: list[int]


def conversations(seed: int, count: int, turns: int) -> list[Turn]:
    """The requests in arrival order: each conversation's turns in order, conversations interleaved at
    random. A first message of 200-800 tokens, later ones of 20-200, answers of 16-64 (pure)."""
    rng = random.Random(seed)
    system = [1_000 + i for i in range(SYSTEM_TOKENS)]
    order = [c for c in range(count) for _ in range(turns)]
    rng.shuffle(order)
    history: dict[int, list[int]] = {}
    out = []
    for c in order:
        first = c not in history
        message = [rng.randrange(2_000, 30_000) for _ in range(rng.randint(200, 800) if first else rng.randint(20, 200))]
        prompt = (system if first else history[c]) + message
        answer = [rng.randrange(2_000, 30_000) for _ in range(rng.randint(16, 64))]
        out.append(Turn(c, prompt, answer))
        history[c] = prompt + answer
    return out


class OursDecode:
    """SGLang 0.5.15's decode path with ``DecodeMambaRadixCache``: ``DecodePreallocQueue``'s own
    ``_match_prefix_and_lock`` and ``_pre_alloc`` (on a queue holding only what they read), the
    ``decode-state-slot`` hook's ``make_room_for_state``, ``release_kv_cache``."""

    def __init__(self, kv_tokens: int, state_slots: int):
        from sglang.srt.disaggregation.decode import DecodePreallocQueue

        from prfaas_sglang.bench.sglang_cpu import cpu_decode_hybrid_cache
        from prfaas_sglang.hooks.decode_radix import DecodeMambaRadixCache

        self.built = cpu_decode_hybrid_cache(DecodeMambaRadixCache, kv_tokens, state_slots - PRE_ALLOC, PRE_ALLOC)
        queue = DecodePreallocQueue.__new__(DecodePreallocQueue)
        queue.tree_cache, queue.req_to_token_pool = self.built.cache, self.built.req_pool
        queue.token_to_kv_pool_allocator, queue.token_to_kv_pool = self.built.kv, self.built.kv_pool
        queue.scheduler = SimpleNamespace(server_args=SimpleNamespace(disaggregation_decode_enable_radix_cache=True),
                                          enable_hisparse=False, enable_decode_hicache=False)
        self.queue = queue

    def state_aware_match(self, prompt: list[int]) -> int:
        """What SGLang's ``MambaRadixCache.match_prefix`` holds of ``prompt`` on this tree."""
        from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
        from sglang.srt.mem_cache.mamba_radix_cache import MambaRadixCache
        from sglang.srt.mem_cache.radix_cache import RadixKey

        result = MambaRadixCache.match_prefix(self.built.cache, MatchPrefixParams(key=RadixKey(array("q", prompt)[:-1])))
        return len(result.device_indices)

    def serve(self, turn: Turn) -> int:
        """One request through the decode side; returns the prompt tokens the cache held."""
        from sglang.srt.managers.schedule_batch import FINISH_LENGTH, Req
        from sglang.srt.mem_cache.common import release_kv_cache
        from sglang.srt.sampling.sampling_params import SamplingParams

        from prfaas_sglang.hooks.decode_radix import make_room_for_state

        req = Req(rid=f"r{id(turn)}", origin_input_text="", origin_input_ids=array("q", turn.prompt),
                  sampling_params=SamplingParams(max_new_tokens=len(turn.answer)))
        match = self.queue._match_prefix_and_lock(req)
        make_room_for_state(self.queue, req)
        self.queue._pre_alloc(req, match.prefix_indices, match.l1_prefix_len, match.decode_prefix_len)
        req.cache_protected_len = match.decode_prefix_len
        _decode(self.built, req, turn.answer, lambda r: (r.req_pool_idx, r.kv_committed_len),
                lambda r, n: setattr(r, "kv_committed_len", r.kv_committed_len + n) or
                setattr(r, "kv_allocated_len", r.kv_allocated_len + n))
        req.finished_reason = FINISH_LENGTH(length=len(turn.answer))
        release_kv_cache(req, self.built.cache)
        return match.decode_prefix_len


class UpstreamDecode:
    """SGLang 0.5.23's decode path with its own decode radix cache for hybrids: its unified tree
    (full-attention and Mamba components, SGLang's own), ``ensure_mamba_capacity``, ``match_kv_cache``
    with copy-on-write of the state and a lock (``_match_prefix_and_lock``'s steps), the request pool's
    ``alloc`` and the prefix rows, ``release_kv_cache`` into the tree."""

    def __init__(self, kv_tokens: int, state_slots: int):
        import torch
        from sglang.srt.disaggregation.decode import HybridMambaDecodeReqToTokenPool
        from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.memory_pool import HybridLinearKVPool
        from sglang.srt.mem_cache.unified_cache.components import ComponentType
        from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

        from prfaas_sglang.bench.sglang_cpu import set_global_server_args, tiny_mamba_params

        set_global_server_args(1)
        pool = HybridMambaDecodeReqToTokenPool(
            size=state_slots - PRE_ALLOC, max_context_len=kv_tokens, device="cpu", enable_memory_saver=False,
            cache_params=tiny_mamba_params(), mamba_layer_ids=[0],
            speculative_num_draft_tokens=None, enable_mamba_extra_buffer=False, pre_alloc_size=PRE_ALLOC,
            enable_overlap_schedule=False)
        kv_pool = HybridLinearKVPool(size=kv_tokens, dtype=torch.bfloat16, page_size=1, head_num=2, head_dim=8,
                                     full_attention_layer_ids=[1], device="cpu", mamba_pool=pool.mamba_pool)
        kv = TokenToKVPoolAllocator(size=kv_tokens, dtype=torch.bfloat16, device="cpu", kvcache=kv_pool, need_sort=False)
        params = CacheInitParams(disable=False, req_to_token_pool=pool, token_to_kv_pool_allocator=kv, page_size=1,
                                 enable_kv_cache_events=False, enable_mamba_extra_buffer=False)
        params.tree_components = (ComponentType.FULL, ComponentType.MAMBA)  # create_unified_radix_cache's, for a hybrid
        self.built = SimpleNamespace(cache=UnifiedRadixCache(params), kv=kv, req_pool=pool, kv_pool=kv_pool)

    def serve(self, turn: Turn) -> int:
        from sglang.srt.managers.schedule_batch import FINISH_LENGTH, Req
        from sglang.srt.mem_cache.allocation import ensure_mamba_capacity
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams
        from sglang.srt.mem_cache.common import match_kv_cache, release_kv_cache
        from sglang.srt.sampling.sampling_params import SamplingParams

        cache, pool, kv = self.built.cache, self.built.req_pool, self.built.kv
        req = Req(rid=f"r{id(turn)}", origin_input_text="", origin_input_ids=array("q", turn.prompt),
                  sampling_params=SamplingParams(max_new_tokens=len(turn.answer)))
        assert ensure_mamba_capacity(pool, [req], cache)
        result = match_kv_cache(req, cache, req.origin_input_ids, cow_mamba=cache.supports_mamba())
        req.lock = cache.lock(result.last_device_node)
        held = req.prefix_len
        prefix = cache.prefix_device_indices(req)
        assert pool.alloc([req]) is not None
        if held:
            pool.write((req.kv.req_pool_idx, slice(0, held)), prefix[:held])
        rest = len(turn.prompt) - held
        if kv.available_size() < rest:
            cache.evict(EvictParams(num_tokens=rest - kv.available_size()))
        pool.write((req.kv.req_pool_idx, slice(held, len(turn.prompt))), kv.alloc(rest))
        req.kv.kv_committed_len = req.kv.kv_allocated_len = len(turn.prompt)
        req.kv.cache_protected_len = held
        _decode(self.built, req, turn.answer, lambda r: (r.kv.req_pool_idx, r.kv.kv_committed_len),
                lambda r, n: setattr(r.kv, "kv_committed_len", r.kv.kv_committed_len + n) or
                setattr(r.kv, "kv_allocated_len", r.kv.kv_allocated_len + n))
        req.finished_reason = FINISH_LENGTH(length=len(turn.answer))
        release_kv_cache(req, cache, checkpoint=True)
        return held


def _decode(built, req, answer: list[int], row_and_pos, advance) -> None:
    """``answer`` generated: the first token came with the prefill, each later one takes a KV slot."""
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    req.output_ids.append(answer[0])
    for token in answer[1:]:
        if built.kv.available_size() < 1:
            built.cache.evict(EvictParams(num_tokens=1))
        row, pos = row_and_pos(req)
        built.req_pool.write((row, slice(pos, pos + 1)), built.kv.alloc(1))
        advance(req, 1)
        req.output_ids.append(token)


def run(seeds: list[int], conversation_count: int, turns: int, state_slots: list[int], kv_tokens: int) -> dict:
    """Per state-slot count and row: held prompt tokens / prompt tokens, pooled over seeds, and per seed."""
    from prfaas_sglang._compat import TreeKind, tree_kind

    per_kind = tree_kind() is TreeKind.PER_KIND
    rows: dict[str, dict[int, dict]] = {}
    for slots in state_slots:
        for seed in seeds:
            workload = conversations(seed, conversation_count, turns)
            prompt_tokens = sum(len(t.prompt) for t in workload)
            held = {"ours": 0, "state-aware match on ours": 0} if per_kind else {"upstream": 0}
            worker = OursDecode(kv_tokens, slots) if per_kind else UpstreamDecode(kv_tokens, slots)
            for turn in workload:
                if per_kind:
                    held["state-aware match on ours"] += worker.state_aware_match(turn.prompt)
                held["ours" if per_kind else "upstream"] += worker.serve(turn)
            for name, tokens in held.items():
                row = rows.setdefault(name, {}).setdefault(slots, {"held": 0, "prompt": 0, "per_seed": []})
                row["held"] += tokens
                row["prompt"] += prompt_tokens
                row["per_seed"].append(round(tokens / prompt_tokens, 4))
    for by_slots in rows.values():
        for row in by_slots.values():
            row["reuse"] = round(row["held"] / row["prompt"], 4)
    from prfaas_sglang._compat import installed_sglang_version

    return {"sglang": installed_sglang_version(), "seeds": seeds, "conversations": conversation_count, "turns": turns,
            "kv_tokens": kv_tokens, "rows": {name: {str(k): v for k, v in by.items()} for name, by in rows.items()}}


def render(result: dict) -> str:
    slots = sorted({int(s) for by in result["rows"].values() for s in by})
    lines = [f"SGLang {result['sglang']}: decode-held prompt tokens / prompt tokens (per seed), "
             f"{result['conversations']} conversations x {result['turns']} turns, {result['kv_tokens']} KV tokens", "",
             "| row | " + " | ".join(f"{s} state slots" for s in slots) + " |", "|---|" + "---|" * len(slots)]
    for name, by in result["rows"].items():
        cells = [f"{by[str(s)]['reuse']:.3f} ({', '.join(f'{x:.3f}' for x in by[str(s)]['per_seed'])})" for s in slots]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seeds", default="1,2,3", help="comma list")
    parser.add_argument("--conversations", type=int, default=12,
                        help="conversations sharing a system prompt, their turns interleaved")
    parser.add_argument("--turns", type=int, default=6, help="turns per conversation")
    parser.add_argument("--state-slots", default="3,6,12,24", help="comma list: a decode pool's state slots")
    parser.add_argument("--kv-tokens", type=int, default=65_536,
                        help="the decode worker's KV pool (and longest context), tokens")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")


def cli(args: argparse.Namespace, invocation: Invocation) -> int:
    try:
        seeds = [int(s) for s in args.seeds.split(",")]
        slots = [int(s) for s in args.state_slots.split(",")]
    except ValueError:
        invocation.error("--seeds and --state-slots are comma lists of integers")
    if min(slots) <= PRE_ALLOC or args.conversations < 1 or args.turns < 1:
        invocation.error(f"--state-slots must exceed the pre-allocation reserve ({PRE_ALLOC}); "
                         "--conversations and --turns at least 1")
    result = run(seeds, args.conversations, args.turns, slots, args.kv_tokens)
    header = (f"<!-- python -m prfaas_sglang.bench decode-reuse --seeds {args.seeds} --conversations "
              f"{args.conversations} --turns {args.turns} --state-slots {args.state_slots} --kv-tokens "
              f"{args.kv_tokens}; {invocation.stamp} -->")
    return invocation.report(args, result, header, render)


SUBCOMMANDS = {"decode-reuse": Subcommand(add_arguments, cli)}
