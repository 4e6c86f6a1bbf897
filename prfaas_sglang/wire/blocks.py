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
from collections.abc import Iterator, Sequence

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
    for page in _packed_pages(token_ids, page_size, usable // page_size):
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


def page_digests(token_ids: Sequence[int], page_size: int, prior: bytes | None = None) -> list[bytes]:
    """One 32-byte digest per *full* page of ``token_ids``; a trailing partial page is not hashed."""
    return list(iter_page_digests(token_ids, page_size, prior))


def digest_to_int64(digest: bytes) -> int:
    """SGLang's event id for a block: the digest's first 8 bytes, big-endian, as signed int64."""
    return int.from_bytes(digest[:8], "big", signed=True)
