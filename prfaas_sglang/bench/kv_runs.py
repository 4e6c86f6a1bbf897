"""How large are the requests SGLang's Mooncake sender makes, once the pools have been serving a while?

SGLang 0.5.15's Mooncake path writes one request per layer (K and V apart) per run of pages that
is contiguous on *both* sides (``group_concurrent_contiguous``: the prefill's source pages and the
decode's destination pages), and a Mooncake TCP lane carries one request at a time, waiting an RTT
for its acknowledgement. So on a WAN what bounds a transfer's goodput is the length of those runs,
which the allocators' history decides, not the model. This replays a Mooncake-format trace through
SGLang's own allocators on CPU (``TokenToKVPoolAllocator`` / ``PagedTokenToKVPoolAllocator``,
``need_sort=True`` as SGLang sets it for disaggregation), and for each request after a warm-up
groups its source and destination pages with SGLang's own ``group_concurrent_contiguous``; at page
size 1 also with the decode's prompt allocation as the ``decode-contiguous-kv`` hook makes it
(:func:`~prfaas_sglang.hooks.contiguous_alloc.alloc_contiguous`), on the same arrivals:

* decode side: a request's prompt pages are allocated when it arrives (waiting while the pool is
  full), one new page per request whenever its generated tokens cross a page boundary, allocated for
  the whole batch at once each step as SGLang's decode does, and all freed when it has generated
  its ``output_length`` tokens (``--step-ms`` per decode step);
* prefill side (the PrfaaS worker): a request's pages are fresh (a transfer cache, nothing kept in a
  radix tree, which could only shorten runs) and freed once ``--prefill-inflight`` later requests
  have arrived.

Each transfer is also sized as the PrfaaS worker's staging sender sends it (``PRFAAS_KV_STAGING_MIB``,
``transport/kv_stager.py``): SGLang's blocks grouped by destination run with the product's own
:func:`~prfaas_sglang.transport.kv_stage.runs_by_destination`, a run worth staging one request, any other
as its blocks (the ``staged`` sender; the other is ``adjacent``, blocks merged only where both sides
continue). The staging buffer's size is not modelled: a run waits for room, it never goes unstaged.

Reported, bytes-weighted (a request's share of the KV it carries): the request size quantiles, the
share of bytes in requests under 1 and 4 MiB, and a lane model of the goodput those sizes allow:
``lanes`` lanes each carrying its requests one after another, each costing an RTT plus its bytes at
``rate / lanes``. The model is optimistic (0.17 of 1 Gbit/s at 128 KiB, where ``bench transport``
measured 0.14; 0.96 at 16 MiB, measured 0.87-0.94), so read it as an upper bound; ``--measure`` sends
sampled transfers over real Mooncake TCP instead (:func:`measure`).
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from prfaas_sglang.bench.subcommands import CommaList, Invocation, Subcommand, trace_path

MIB = 1 << 20


@dataclass
class _Running:
    pages: list  # tensors of token indices (page-aligned), freed together
    remaining: int  # tokens still to generate
    next_pos: int  # the position of the next token: a new page is needed when it is a page's first


@dataclass
class Sizes:
    """Request sizes (bytes) and how many requests of each, accumulated over requests."""

    counts: dict[int, int] = field(default_factory=dict)

    @classmethod
    def of(cls, transfers) -> Sizes:
        """The sizes of every request of ``transfers`` (lists of request sizes)."""
        sizes = cls()
        for one in transfers:
            for n in one:
                sizes.add(n)
        return sizes

    def add(self, size_bytes: int, n: int = 1) -> None:
        self.counts[size_bytes] = self.counts.get(size_bytes, 0) + n

    def weighted_quantile(self, q: float) -> int:
        """The size below which a fraction ``q`` of the bytes travels."""
        total = sum(s * n for s, n in self.counts.items())
        acc = 0
        for s in sorted(self.counts):
            acc += s * self.counts[s]
            if acc >= q * total:
                return s
        return max(self.counts)

    def share_below(self, limit_bytes: int) -> float:
        total = sum(s * n for s, n in self.counts.items())
        return sum(s * n for s, n in self.counts.items() if s < limit_bytes) / total if total else 0.0

    def lane_model_fraction(self, lanes: int, rtt_s: float, rate_bps: float) -> float:
        """Goodput / rate if ``lanes`` lanes carry these requests, each an RTT plus its bytes at rate/lanes."""
        total_bytes = sum(s * n for s, n in self.counts.items())
        lane_s = sum(n * (rtt_s + s * 8 * lanes / rate_bps) for s, n in self.counts.items()) / lanes
        return total_bytes * 8 / rate_bps / lane_s if lane_s else 0.0


def _allocator(tokens: int, page_size: int):
    import torch
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator

    if page_size == 1:
        return TokenToKVPoolAllocator(size=tokens, dtype=torch.int64, device="cpu", kvcache=None, need_sort=True)
    return PagedTokenToKVPoolAllocator(size=tokens, page_size=page_size, dtype=torch.int64, device="cpu", kvcache=None,
                                       need_sort=True)


def _pages(indices, page_size: int):
    """Token indices (page-aligned allocations) -> the page ids SGLang's sender groups."""
    return indices[::page_size] // page_size


class _CachedPrefill:
    """A PrfaaS worker's pool behind SGLang's own ``RadixCache`` (page ``page_size``, the allocator SGLang
    builds for disaggregation): a request's source pages are its cached prefix's (wherever the tree holds
    them) and fresh ones for the rest, taken after evicting least-recently-used leaves when the pool is
    short; the whole prompt then stays in the tree (SGLang's behaviour, ``PRFAAS_PREFILL_CACHE=all``)."""

    def __init__(self, pool_tokens: int, page_size: int):
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.radix_cache import RadixCache

        from prfaas_sglang.bench.sglang_cpu import set_global_server_args

        set_global_server_args(page_size)
        self.page_size = page_size
        self.kv = _allocator(pool_tokens, page_size)
        self.cache = RadixCache(CacheInitParams(disable=False, req_to_token_pool=None,
                                                token_to_kv_pool_allocator=self.kv, page_size=page_size))
        self.hit_tokens = self.prompt_tokens = 0

    def take(self, tokens: list[int]):
        """The prompt's source token indices (prefix hit, then fresh), or None when the pool cannot hold it."""
        import torch
        from sglang.srt.mem_cache.base_prefix_cache import (
            EvictParams,
            InsertParams,
            MatchPrefixParams,
        )
        from sglang.srt.mem_cache.radix_cache import RadixKey

        match = self.cache.match_prefix(MatchPrefixParams(key=RadixKey(tokens)))
        hit, node = match.device_indices, match.last_device_node
        self.cache.inc_lock_ref(node)  # the prefix is the request's while it runs: not evicted under it
        try:
            need = len(tokens) - len(hit)
            if self.kv.available_size() < need:
                self.cache.evict(EvictParams(num_tokens=need - self.kv.available_size()))
            fresh = self.kv.alloc(need) if need else hit.new_empty(0)
        finally:
            self.cache.dec_lock_ref(node)
        if fresh is None:
            return None
        src = torch.cat([hit.to(fresh.dtype), fresh])
        result = self.cache.insert(InsertParams(key=RadixKey(tokens), value=src))
        if result.prefix_len > len(hit):  # already in the tree after all: the duplicates go back, as SGLang does
            self.kv.free(src[len(hit):result.prefix_len])
        self.hit_tokens += len(hit)
        self.prompt_tokens += len(tokens)
        return src


def _prompt(row: dict, index: int, page_size: int) -> list[int]:
    """Row ``index``'s prompt from its ``hash_ids`` (shared ids share tokens), padded with tokens of its own
    (beyond the shared vocabulary, a range per row) to ``input_length`` rounded up to a page."""
    from prfaas_sglang.bench.state_events import VOCAB, prompt_from_hash_ids

    n = -(-row["input_length"] // page_size) * page_size
    tokens = prompt_from_hash_ids(row.get("hash_ids") or [], n)
    own = VOCAB + index * (1 << 24)
    return tokens + list(range(own + len(tokens), own + n))


def simulate(rows: list[dict], page_size: int = 64, decode_pool_tokens: int = 1 << 20, prefill_pool_tokens: int = 1 << 19,
             step_s: float = 0.03, prefill_inflight: int = 2, warmup_s: float = 120.0, bytes_per_token_layer: int = 2048,
             max_input_tokens: int | None = None, contiguous: bool = False, prefill_cache: bool = False) -> dict:
    """Replay ``rows`` (``timestamp`` ms, ``input_length``, ``output_length``) through both allocators; see
    the module docstring. Requests longer than either pool (or ``max_input_tokens``) are left out.
    ``contiguous``: the decode takes each prompt's pages as ``hooks.contiguous_alloc`` does (best-fit run).
    ``prefill_cache``: the PrfaaS side keeps prompts in SGLang's radix cache (:class:`_CachedPrefill`)
    instead of freeing them after ``prefill_inflight`` later requests."""
    import torch
    from sglang.srt.disaggregation.common.utils import group_concurrent_contiguous

    from prfaas_sglang.hooks.contiguous_alloc import alloc_contiguous

    decode, prefill = _allocator(decode_pool_tokens, page_size), _allocator(prefill_pool_tokens, page_size)
    cached = _CachedPrefill(prefill_pool_tokens, page_size) if prefill_cache else None
    index_of = {id(r): i for i, r in enumerate(rows)}
    limit = min(decode_pool_tokens, prefill_pool_tokens) // 2
    if max_input_tokens is not None:
        limit = min(limit, max_input_tokens)
    t0 = rows[0]["timestamp"] / 1e3
    arrivals = deque((r["timestamp"] / 1e3 - t0, r) for r in rows if 0 < r["input_length"] <= limit)
    waiting: deque[tuple[float, dict]] = deque()
    running: list[_Running] = []
    in_prefill: deque = deque()
    left_out = len(rows) - len(arrivals)
    transfers: dict[int, list[int]] = {}  # per measured request (keyed by its row's id): its request sizes, one layer
    staged: dict[int, list[int]] = {}  # the same, as the staging sender sends them
    decode_page_misses = 0  # steps' new pages the decode pool had no room for (SGLang would retract)
    waited_s: list[float] = []
    now = 0.0

    def round_up(n: int) -> int:
        return -(-n // page_size) * page_size

    def admit(arrived_s: float, row: dict) -> bool:
        need = round_up(row["input_length"])
        dst = alloc_contiguous(decode, need) if contiguous else decode.alloc(need)
        if dst is None:
            return False
        if cached is not None:
            src = cached.take(_prompt(row, index_of[id(row)], page_size))
        else:
            src = prefill.alloc(need)
            while src is None and in_prefill:
                prefill.free(in_prefill.popleft())
                src = prefill.alloc(need)
        if src is None:
            decode.free(dst)
            return False
        if cached is None:
            in_prefill.append(src)
            while len(in_prefill) > prefill_inflight:
                prefill.free(in_prefill.popleft())
        if arrived_s >= warmup_s:
            src_groups, dst_groups = group_concurrent_contiguous(_pages(src, page_size).numpy(),
                                                                 _pages(dst, page_size).numpy())
            page_bytes = page_size * bytes_per_token_layer
            transfers[id(row)] = [len(g) * page_bytes for g in src_groups]
            staged[id(row)] = staged_sizes([(int(a[0]) * page_bytes, int(b[0]) * page_bytes, len(a) * page_bytes)
                                            for a, b in zip(src_groups, dst_groups, strict=True)])
            waited_s.append(now - arrived_s)
        running.append(_Running([dst], max(1, row["output_length"]), row["input_length"]))
        return True

    while arrivals or waiting or running:
        while arrivals and arrivals[0][0] <= now:
            waiting.append(arrivals.popleft())
        while waiting and admit(*waiting[0]):
            waiting.popleft()
        # one decode step: a new page for each request whose next token crosses a page boundary, for the
        # batch at once (consecutive free pages, in batch order), as SGLang's decode allocates
        crossing = [r for r in running if r.next_pos % page_size == 0]
        if crossing:
            fresh = decode.alloc(page_size * len(crossing))
            decode_page_misses += fresh is None
            if fresh is not None:
                for i, r in enumerate(crossing):
                    r.pages.append(fresh[i * page_size:(i + 1) * page_size])
        still = []
        for r in running:
            r.next_pos += 1
            r.remaining -= 1
            if r.remaining > 0:
                still.append(r)
            else:
                decode.free(torch.cat(r.pages))
        running = still
        if not running and not waiting and arrivals:
            now = max(now + step_s, arrivals[0][0])  # idle: jump to the next arrival
        else:
            now += step_s
    return {"page_size": page_size, "decode_alloc": "contiguous" if contiguous else "sglang",
            "prefill_side": "radix cache" if cached else "fresh pages",
            "prefill_hit_share": round(cached.hit_tokens / cached.prompt_tokens, 3) if cached and cached.prompt_tokens else None,
            "decode_pool_tokens": decode_pool_tokens, "prefill_pool_tokens": prefill_pool_tokens,
            "step_s": step_s, "prefill_inflight": prefill_inflight, "warmup_s": warmup_s,
            "bytes_per_token_layer": bytes_per_token_layer, "requests_measured": len(transfers),
            "requests_left_out": left_out,
            "runs_per_request_median": statistics.median(map(len, transfers.values())) if transfers else None,
            "admission_wait_s_p90": statistics.quantiles(waited_s, n=10)[-1] if len(waited_s) > 1 else None,
            "decode_page_misses": decode_page_misses,
            "sizes": Sizes.of(transfers.values()), "transfers": transfers, "staged": staged}


def staged_sizes(blocks: list[tuple[int, int, int]]) -> list[int]:
    """The request sizes the staging sender makes of one layer's ``(src, dst, length)`` blocks: per
    destination run, one request when it is worth staging, else its blocks merged where both sides continue."""
    from prfaas_sglang.transport.kv_stage import runs_by_destination

    out: list[int] = []
    for run in runs_by_destination(blocks):
        out += [run.length] if run.worth_staging() else [n for _, _, n in run.direct()]
    return out


def summarize(result: dict, lanes: int = 4, rtt_ms: float = 20.0, rate_gbps: float = 1.0,
              sender: str = "adjacent") -> dict:
    """One table row: ``result`` (from :func:`simulate`) as the ``sender`` (adjacent | staged) sends it."""
    result = dict(result)
    transfers = result.pop("transfers") if sender == "adjacent" else result.pop("staged")
    result.pop("transfers", None)
    result.pop("staged", None)
    sizes: Sizes = result.pop("sizes") if sender == "adjacent" else Sizes.of(transfers.values())
    result.pop("sizes", None)
    result["sender"] = sender
    result["runs_per_request_median"] = statistics.median(map(len, transfers.values())) if transfers else None
    if not sizes.counts:
        return {**result, "requests": 0}
    return {**result, "requests_per_layer": sum(sizes.counts.values()),
            "size_bytes_weighted_p10": sizes.weighted_quantile(0.1),
            "size_bytes_weighted_p50": sizes.weighted_quantile(0.5),
            "size_bytes_weighted_p90": sizes.weighted_quantile(0.9),
            "bytes_share_below_1mib": round(sizes.share_below(MIB), 3),
            "bytes_share_below_4mib": round(sizes.share_below(4 * MIB), 3),
            "lane_model": {"lanes": lanes, "rtt_ms": rtt_ms, "rate_gbps": rate_gbps,
                           "fraction": round(sizes.lane_model_fraction(lanes, rtt_ms / 1e3, rate_gbps * 1e9), 3),
                           "fraction_if_16mib": round(Sizes({16 * MIB: 1}).lane_model_fraction(lanes, rtt_ms / 1e3,
                                                                                                rate_gbps * 1e9), 3)}}


def run(trace: Path, page_sizes: tuple[int, ...] = (1, 64), duration_s: float = 600.0,
        model: tuple[int, float, float] = (4, 20.0, 1.0), measure_transfers: int = 0, seed: int = 0,
        max_measured_mib: int = 16, measure_layers: int = 8, **kwargs) -> dict:
    """The first ``duration_s`` of ``trace`` per page size, SGLang's decode allocation and, at page size 1
    (where the ``decode-contiguous-kv`` hook acts), the hook's, side by side on the same arrivals;
    ``model`` = (lanes, RTT ms, Gbit/s) of the lane model."""
    rows = []
    with open(trace) as f:
        for line in f:
            row = json.loads(line)
            if rows and (row["timestamp"] - rows[0]["timestamp"]) / 1e3 > duration_s:
                break
            rows.append(row)
    results = {(p, c): simulate(rows, page_size=p, contiguous=c, **kwargs)
               for p in page_sizes for c in ((False, True) if p == 1 else (False,))}
    out = {"trace": str(trace), "duration_s": duration_s, "requests": len(rows)}
    if measure_transfers and (1, False) in results:
        import random

        theirs, ours = results[(1, False)]["transfers"], results[(1, True)]["transfers"]
        staged = results[(1, True)]["staged"]
        pairs = [(theirs[key], ours[key], staged[key]) for key in theirs  # the same requests every way
                 if key in ours and sum(theirs[key]) <= max_measured_mib * MIB]
        picked = random.Random(seed).sample(pairs, min(measure_transfers, len(pairs)))
        out["measured"] = measure(picked, model[2] * 1e3, model[1], measure_layers)
        out["measured"]["lane_model"] = {mode: round(Sizes.of(pair[i] for pair in picked)
                                                     .lane_model_fraction(model[0], model[1] / 1e3, model[2] * 1e9), 3)
                                         for i, mode in enumerate(MEASURED_MODES)}
    out["by_page_size"] = [summarize(r, *model, sender=sender) for r in results.values()
                           for sender in ("adjacent", "staged")]
    return out


# The measured ways to send one request's KV: SGLang's decode allocation (adjacent entries merged), the
# decode-contiguous-kv hook's, and the hook's with the PrfaaS worker's staging buffer.
MEASURED_MODES = ("sglang", "contiguous", "contiguous+staged")


def measure(pairs: list[tuple[list[int], ...]], rate_mbit: float, rtt_ms: float, layers: int = 8,
            tag: int | None = None) -> dict:
    """Real Mooncake TCP over an emulated link (``EmulatedLink``, the launcher's WAN profile for it, root):
    each tuple is one request's transfer of one layer, its request sizes in each of :data:`MEASURED_MODES`
    (SGLang's decode allocation, the hook's, the hook's with staging); sent for ``layers`` buffers (K and V of ``layers / 2``
    layers: SGLang's sender makes every layer's requests, which Mooncake spreads over the lanes, one
    request per lane at a time) back to back by the kv-send hooks' own sender (``ProductSender``: a
    write per lane in the engine, the rest queued in the sender), the modes in turns. Returns per mode the goodput fraction (bytes / elapsed / rate)
    over all its transfers, and per transfer."""
    import subprocess

    from prfaas_sglang.bench.transport import PEER, _Sender, default_env, ours_env
    from prfaas_sglang.transport.linkem import EmulatedLink
    from prfaas_sglang.transport.wan_defaults import WanLink

    buffer_mib = max(64, -(-max(max(map(sum, sizes)) for sizes in pairs) * layers // MIB))
    out: dict = {mode: [] for mode in MEASURED_MODES}
    with EmulatedLink(tag=tag, rate_mbit=rate_mbit, rtt_ms=rtt_ms) as link:
        recv_proc = subprocess.Popen((*link.wrap_b, *PEER, "recv", "--host", link.ip_b, "--buffer-mib", str(buffer_mib)),
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                     env=default_env())
        try:
            recv = json.loads(recv_proc.stdout.readline())
            sender = _Sender(link, recv, buffer_mib, ours_env(WanLink(rate_mbit * 1e6, rtt_ms / 1e3)))
            try:
                sender.run(32 * MIB, 16 * MIB, pipeline=True)  # open the lanes first
                for ways in pairs:
                    for mode, sizes in zip(MEASURED_MODES, ways, strict=True):
                        r = sender.run(0, 0, sizes=sizes * layers, product=True)
                        out[mode].append({"bytes": sum(sizes) * layers, "requests": len(sizes) * layers,
                                          "elapsed_s": r["elapsed_s"], "ok": r["ok"]})
            finally:
                sender.close()
        finally:
            recv_proc.stdin.close()
            recv_proc.wait(timeout=10)
    summary = {}
    for mode, runs in out.items():
        total_bytes, total_s = sum(r["bytes"] for r in runs), sum(r["elapsed_s"] for r in runs)
        summary[mode] = {"transfers": len(runs), "failed": sum(not r["ok"] for r in runs),
                         "requests": sum(r["requests"] for r in runs),
                         "goodput_fraction": round(total_bytes * 8 / total_s / (rate_mbit * 1e6), 3) if total_s else None,
                         "per_transfer": runs}
    return {"rate_mbit": rate_mbit, "rtt_ms": rtt_ms, "layers": layers, **summary}


def render_markdown(r: dict) -> str:
    lines = [f"Trace {Path(r['trace']).name}, first {r['duration_s']:g} s ({r['requests']} requests).", "",
             "| page size | decode allocation | sender | requests measured | requests per transfer per layer (median) "
             "| request size p10 / p50 / p90 (bytes-weighted) "
             "| bytes in requests < 1 MiB / < 4 MiB | lane model: goodput / rate (16 MiB requests) |",
             "|---|---|---|---|---|---|---|---|"]
    for x in r["by_page_size"]:
        if not x.get("requests_per_layer"):
            continue
        lm = x["lane_model"]
        lines.append(f"| {x['page_size']} | {x['decode_alloc']} | {x['sender']} | {x['requests_measured']} | "
                     f"{x['runs_per_request_median']:g} | "
                     f"{x['size_bytes_weighted_p10'] / 1024:,.0f} / {x['size_bytes_weighted_p50'] / 1024:,.0f} / "
                     f"{x['size_bytes_weighted_p90'] / 1024:,.0f} KiB | {x['bytes_share_below_1mib']:.2f} / "
                     f"{x['bytes_share_below_4mib']:.2f} | {lm['fraction']:.2f} ({lm['fraction_if_16mib']:.2f}) |")
    if m := r.get("measured"):
        lines += ["", f"Measured over Mooncake TCP on an emulated {m['rate_mbit']:g} Mbit/s, {m['rtt_ms']:g} ms link "
                  f"({m['sglang']['transfers']} requests' transfers, {m['layers']} KV buffers each, page size 1, same requests "
                  "every way):", "",
                  "| decode allocation (+ sender) | requests sent | failed | goodput / rate measured | lane model, same requests |",
                  "|---|---|---|---|---|"]
        for mode in MEASURED_MODES:
            lines.append(f"| {mode} | {m[mode]['requests']} | {m[mode]['failed']} | **{m[mode]['goodput_fraction']}** | "
                         f"{m['lane_model'][mode]} |")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trace", default=None, help="Mooncake trace JSONL (default: PRFAAS_TRACE_PATH or ../shared/data)")
    parser.add_argument("--duration", type=float, default=600.0, help="seconds of the trace replayed")
    parser.add_argument("--warmup", type=float, default=120.0, help="seconds before requests are measured")
    parser.add_argument("--page-sizes", type=CommaList(int), default="1,64",
                        help="comma list of KV page sizes to replay, tokens (1: also with the "
                             "decode-contiguous-kv allocation)")
    parser.add_argument("--decode-pool-tokens", type=int, default=1 << 20,
                        help="the decode worker's KV pool, tokens")
    parser.add_argument("--prefill-pool-tokens", type=int, default=1 << 19,
                        help="the PrfaaS worker's KV pool, tokens")
    parser.add_argument("--prefill-inflight", type=int, default=2, help="requests whose pages the PrfaaS worker still holds")
    parser.add_argument("--prefill-cache", action="store_true",
                        help="the PrfaaS worker keeps prompts in SGLang's radix cache (LRU eviction when short), so its "
                             "pages fragment too, instead of fresh pages freed after --prefill-inflight requests")
    parser.add_argument("--step-ms", type=float, default=30.0, help="one decode step (every running request, one token)")
    parser.add_argument("--bytes-per-token-layer", type=int, default=2048,
                        help="K (or V) of one token in one layer (2048: 8 KV heads of dim 128, bf16)")
    parser.add_argument("--lanes", type=int, default=4,
                        help="lane model: Mooncake lanes per peer")
    parser.add_argument("--rtt-ms", type=float, default=20.0,
                        help="the link's round-trip time, ms (lane model and --measure)")
    parser.add_argument("--rate-gbps", type=float, default=1.0,
                        help="the link's rate, Gbit/s (lane model and --measure)")
    parser.add_argument("--measure", type=int, default=0,
                        help="also send N sampled requests' transfers (page 1, both allocations) over real Mooncake TCP "
                             "on an emulated link of --rate-gbps and --rtt-ms (root, linkem)")
    parser.add_argument("--seed", type=int, default=0, help="which transfers --measure samples")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")


def cli(args: argparse.Namespace, inv: Invocation) -> int:
    pages = args.page_sizes
    if (min(pages) < 1 or args.duration <= 0 or args.warmup < 0 or args.step_ms <= 0 or args.lanes < 1
            or min(args.decode_pool_tokens, args.prefill_pool_tokens, args.prefill_inflight,
                   args.bytes_per_token_layer) < 1 or args.rtt_ms < 0 or args.rate_gbps <= 0):
        inv.error("kv-runs: sizes, counts, --duration, --step-ms and --rate-gbps must be positive")
    if args.measure < 0:
        inv.error("--measure must be >= 0")
    if args.measure and 1 not in pages:
        inv.error("--measure compares the allocations at page size 1: include 1 in --page-sizes")
    if args.measure:
        from prfaas_sglang.transport.linkem import unavailable

        if (why := unavailable()) is not None:
            inv.error(f"--measure: the emulated link {why}")
    trace = trace_path(args.trace)
    result = run(Path(trace), pages, args.duration, measure_transfers=args.measure, seed=args.seed,
                 decode_pool_tokens=args.decode_pool_tokens,
                 prefill_pool_tokens=args.prefill_pool_tokens, step_s=args.step_ms / 1e3,
                 prefill_inflight=args.prefill_inflight, warmup_s=args.warmup,
                 bytes_per_token_layer=args.bytes_per_token_layer, prefill_cache=args.prefill_cache,
                 model=(args.lanes, args.rtt_ms, args.rate_gbps))
    return inv.report(args, result, None, render_markdown)


SUBCOMMANDS = {"kv-runs": Subcommand(add_arguments, cli)}
