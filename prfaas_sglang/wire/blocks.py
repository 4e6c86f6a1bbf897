"""SGLang's chained block hashes, in pure Python (no sglang import).

SGLang 0.5.15 (``mem_cache/cpp_utils/hash_binding.cpp``) hashes a prompt page
by page: ``digest_i = SHA256(digest_{i-1} || page_i tokens as little-endian
uint32)`` (no prefix for the first page), and KV events carry the first 64 bits
of each digest as a signed int64 (``mem_cache/utils.py:hash_str_to_int64``).
Using the same function in the emulated engine and the kv-index means both
see real SGLang's and the mock's events identically.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Iterable, Iterator, Sequence

import orjson

# The block-id scheme of SGLang 0.5.15's KV events, as a name: workers that state one
# (the emulated engine, in /server_info["prfaas"]["block_hash"]) must state this one;
# SGLang itself states none and uses it.
HASH_SCHEME = "sglang-sha256-chain-int64"

if sys.byteorder != "little":  # SGLang's native hash has the same restriction
    raise ImportError("prfaas_sglang.wire.blocks needs a little-endian host")


def iter_page_digests(token_ids: Sequence[int], page_size: int, prior: bytes | None = None,
                      max_tokens: int | None = None) -> Iterator[bytes]:
    """Digests of the *full* pages of ``token_ids[:max_tokens]``, one at a time (stop early to hash less).

    ``max_tokens`` limits the pages without copying the list (``token_ids[:-1]`` of a 128K
    prompt costs as much as hashing it). Ids with a ``packed_prefix(n)`` method (a
    :class:`~prfaas_sglang.wire.token_ids.JsonIds` still in its JSON text) are parsed only as
    far as the pages read, so stopping early also parses less.
    """
    if page_size <= 0:
        raise ValueError("page_size must be positive")
    usable = len(token_ids) if max_tokens is None else min(max_tokens, len(token_ids))
    yield from _chain(_packed_pages(token_ids, page_size, usable // page_size), prior)


def _chain(pages: Iterable[memoryview], prior: bytes | None) -> Iterator[bytes]:
    """SGLang's chained digests of these packed pages, the first chained to ``prior`` (None: none)."""
    for page in pages:
        h = hashlib.sha256(prior) if prior is not None else hashlib.sha256()
        h.update(page)
        prior = h.digest()
        yield prior


def _packed_pages(token_ids: Sequence[int], page_size: int, num_pages: int) -> Iterator[memoryview]:
    """Pages ``0 .. num_pages - 1`` as little-endian uint32 bytes (``page_size * 4`` each)."""
    step = page_size * 4
    packed_prefix = getattr(token_ids, "packed_prefix", None)
    if packed_prefix is None:
        packed = memoryview(array("I", token_ids).tobytes())  # little-endian uint32 on the supported hosts
        for k in range(num_pages):
            yield packed[k * step : (k + 1) * step]
        return
    packed, have_pages = memoryview(b""), 0
    for k in range(num_pages):
        if k >= have_pages:  # the source at least doubles what it parsed on each call
            packed = memoryview(packed_prefix((k + 1) * page_size))
            have_pages = len(packed) // step
        yield packed[k * step : (k + 1) * step]


# A memo entry's cost beside its value's bytes (CPython 3.11, 64-bit: the key int, the bytes object's
# header, the dict's slot and index), so that ``max_bytes`` tracks the process's memory.
MEMO_ENTRY_OVERHEAD_BYTES = 100


MAX_MEMO_MIB = 1 << 20  # the largest memo budget a flag accepts (1 TiB)


def memo_bytes_from_mib(mib: float) -> int:
    """A flag's memo budget in MiB as :class:`PageIdMemo`'s ``max_bytes``; ValueError (with the
    message a CLI shows after the flag's name) outside 0..:data:`MAX_MEMO_MIB`, NaN included."""
    if not 0 <= mib <= MAX_MEMO_MIB:
        raise ValueError(f"must be in 0..{MAX_MEMO_MIB}, got {mib}")
    return int(mib * (1 << 20))


class PageIdMemo:
    """Block ids of prompt segments already hashed, so a prompt sharing a prefix with one hashed
    before skips SHA-256 over that prefix (pure; bounded, least recently used goes first).

    At page size 1 (SGLang's for Kimi Linear) a block is a token: a 32K-token prompt is 32,768
    chained SHA-256 calls (about 17 ms), each a Python call for 4 bytes. The memo keys segments
    of ``segment_tokens`` by a cheap chained fingerprint of their tokens from the prompt's start
    (Python's ``hash``, keyed per process) and keeps each segment's ids with the digest it ends
    on, where hashing resumes after a miss::

        prompt:   | seg 1 | seg 2 | seg 3 | seg 4 |rest|     (full segments only; rest hashed plainly)
        key k:    fp_k = hash((fp_{k-1}, seg_k as uint32 bytes)), fp_0 = page size
                  (ids still in JSON text: seg_k's text, fp_0 = -page size)
        value k:  seg k's block ids (int64, packed) + the digest after seg k

    A fingerprint collision (64 bits, random per process) would hand the walk another prefix's
    ids: a wrong prefix estimate for one request, never a wrong output (SGLang matches tokens).
    Values are bytes and keys ints, so the garbage collector never walks the memo.
    """

    def __init__(self, max_segments: int | None = 1 << 15, segment_tokens: int = 256, max_bytes: int | None = None):
        """Holds at most ``max_segments`` segments (None: no count bound) and, where ``max_bytes`` is
        given, at most that many bytes (each segment: its ids and digest, plus
        :data:`MEMO_ENTRY_OVERHEAD_BYTES`; 256 tokens at page size 1: 2,180 bytes, at page 64: 164),
        evicting the least recently used first; a segment bigger than ``max_bytes`` is not kept."""
        if (max_segments is not None and max_segments < 1) or segment_tokens < 1:
            raise ValueError("max_segments and segment_tokens must be >= 1")
        if max_bytes is not None and max_bytes < 0:
            raise ValueError("max_bytes must be >= 0")
        self.max_segments = max_segments
        self.max_bytes = max_bytes
        self.segment_tokens = segment_tokens
        self._entries: dict[int, bytes] = {}
        self.nbytes = 0  # what the segments held cost, as max_bytes counts it
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._entries)

    def stats(self) -> dict[str, int | None]:
        """What the memo holds and how it served: for a ``/status``."""
        return {"segments": len(self._entries), "bytes": self.nbytes, "max_segments": self.max_segments,
                "max_bytes": self.max_bytes, "hits": self.hits, "misses": self.misses}

    def _keep(self, key: int, value: bytes) -> None:
        """Insert ``value`` last (the most recently used), evicting from the front to stay in bounds."""
        entries, cost = self._entries, len(value) + MEMO_ENTRY_OVERHEAD_BYTES
        count, budget = self.max_segments or float("inf"), self.max_bytes
        if budget is not None and cost > budget:
            return
        while entries and (len(entries) >= count or (budget is not None and self.nbytes + cost > budget)):
            self.nbytes -= len(entries.pop(next(iter(entries)))) + MEMO_ENTRY_OVERHEAD_BYTES
        entries[key] = value
        self.nbytes += cost

    def segments(self, token_ids: Sequence[int], page_size: int, max_tokens: int | None = None) -> Iterator[Sequence[int]]:
        """The block ids of ``token_ids[:max_tokens]``'s full pages (as :func:`iter_page_digests`
        and :func:`digest_to_int64` give them), a segment at a time: stop early to hash less.
        Records the segments it hashed; refreshes those it found.

        Ids still in compact JSON text (:class:`~prfaas_sglang.wire.token_ids.JsonIds`) are keyed
        by their text, so a prompt sent again is neither parsed nor hashed (a chain of keys of its
        own: the same ids written otherwise are other keys, giving the same ids); they are parsed
        only where a segment is missing: through their own doubling parse while it has reached the
        segment, else (the memo had what comes before) that segment's text alone."""
        if page_size <= 0:
            raise ValueError("page_size must be positive")
        usable = len(token_ids) if max_tokens is None else min(max_tokens, len(token_ids))
        num_pages = usable // page_size
        segment_tokens = max(1, self.segment_tokens // page_size) * page_size
        step = page_size * 4
        parse = getattr(token_ids, "packed_prefix", None)
        packed = memoryview(b"") if parse is not None else memoryview(array("I", token_ids).tobytes())

        def packed_between(start: int, stop: int) -> memoryview:  # tokens [start, stop) as uint32 bytes
            nonlocal packed
            if len(packed) < stop * 4:
                if by_text and len(packed) < start * 4:  # past segments found in the memo, never parsed:
                    text = token_ids.text_between(start, stop)  # parse these alone, not all before them
                    return memoryview(array("I", orjson.loads(b"[" + text + b"]")).tobytes())
                packed = memoryview(parse(stop))
            return packed[start * 4 : stop * 4]  # read-only bytes: hashable without a copy

        by_text = bool(num_pages) and getattr(token_ids, "compact", False)
        key_of = token_ids.text_between if by_text else packed_between
        entries, fingerprint, prior = self._entries, -page_size if by_text else page_size, None
        num_segments = num_pages // (segment_tokens // page_size)
        for k in range(num_segments):
            start, stop = k * segment_tokens, (k + 1) * segment_tokens
            fingerprint = hash((fingerprint, key_of(start, stop)))
            value = entries.pop(fingerprint, None)
            if value is None:
                self.misses += 1
                ids, prior = _chain_ids(packed_between(start, stop), step, prior)
                value = ids.tobytes() + prior
            else:
                self.nbytes -= len(value) + MEMO_ENTRY_OVERHEAD_BYTES
                self.hits += 1
                prior = value[-32:]
            self._keep(fingerprint, value)  # (re)inserted last: the most recently used
            yield memoryview(value)[:-32].cast("q")
        if num_pages * page_size > num_segments * segment_tokens:  # pages past the last full segment: hashed, not kept
            yield _chain_ids(packed_between(num_segments * segment_tokens, num_pages * page_size), step, prior)[0]


def _chain_ids(packed: memoryview, step: int, prior: bytes | None) -> tuple[array, bytes | None]:
    """The block ids of ``packed``'s pages of ``step`` bytes, chained from ``prior``, and the last digest."""
    digests = list(_chain((packed[at : at + step] for at in range(0, len(packed), step)), prior))
    return array("q", map(digest_to_int64, digests)), digests[-1] if digests else prior


def page_digests(token_ids: Sequence[int], page_size: int, prior: bytes | None = None) -> list[bytes]:
    """One 32-byte digest per *full* page of ``token_ids``; a trailing partial page is not hashed."""
    return list(iter_page_digests(token_ids, page_size, prior))


def digest_to_int64(digest: bytes) -> int:
    """SGLang's event id for a block: the digest's first 8 bytes, big-endian, as signed int64."""
    return int.from_bytes(digest[:8], "big", signed=True)
