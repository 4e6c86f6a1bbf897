"""Moving a cached prefix from one cluster's prefill worker to another's (wire format, pure).

The router executes a :class:`~prfaas_sglang.router.policy.CacheTransfer` before it dispatches
the request whose prefix it moves; the workers do the rest (the emulated engine's endpoints;
``hooks/cache_import.py`` holds SGLang's pool-level export and import)::

    router ── POST {target}/prfaas/cache/import  CacheImport ───────────> target prefill worker
                                                                           │ carve a landing region
    target ── POST {source}/prfaas/cache/export  CacheExport ──> source    │
                                  source: Mooncake TCP write of the prefix's KV and its state
    target <── 200 {bytes, transfer_s} ─────────────────────────── source
                                                                           │ check the bytes, insert the
                                                                           │ prefix into its cache (KV events)
    router <── 200 CacheImported ───────────────────────────────────────── target

A source that no longer holds the prefix answers 409; the router then prefills without it
(recompute), as it does on any failure or timeout of the move. All bodies are JSON objects with
``"v"``.

History:
  v1: first version.
"""

from __future__ import annotations

from dataclasses import dataclass

from prfaas_sglang.wire._json import VersionedJson
from prfaas_sglang.wire._json import check_int as _int

CACHE_MOVE_VERSION = 1


class _CacheMove(VersionedJson):
    VERSION, ACCEPTED, WHAT = CACHE_MOVE_VERSION, (CACHE_MOVE_VERSION,), "cache-move"


def _token_ids(token_ids, num_tokens: int) -> None:
    if not isinstance(token_ids, list) or len(token_ids) < num_tokens:
        raise ValueError(f"token_ids must be a list of at least num_tokens ({num_tokens}) ids")
    for t in token_ids:
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < 1 << 32:
            raise ValueError(f"token ids must be integers in [0, 2**32), got {t!r}")


@dataclass(frozen=True)
class CacheImport(_CacheMove):
    """Router -> target: fetch the KV of ``token_ids[:num_tokens]`` from the prefill worker at
    ``source_url`` and keep it as a prefix-cache entry; give up after ``timeout_s``."""

    token_ids: list[int]
    num_tokens: int
    source_url: str
    timeout_s: float

    def validate(self) -> None:
        _int("num_tokens", self.num_tokens, 1)
        _token_ids(self.token_ids, self.num_tokens)
        if not isinstance(self.source_url, str) or not self.source_url.startswith("http"):
            raise ValueError("source_url must be an http URL")
        if isinstance(self.timeout_s, bool) or not isinstance(self.timeout_s, int | float) or not 0 < self.timeout_s <= 3600:
            raise ValueError(f"timeout_s must be in (0, 3600], got {self.timeout_s!r}")



@dataclass(frozen=True)
class CacheExport(_CacheMove):
    """Target -> source: write the KV (and state) of ``token_ids[:num_tokens]``, at most ``length``
    bytes, to ``addr`` of Mooncake session ``session``."""

    token_ids: list[int]
    num_tokens: int
    session: str
    addr: int
    length: int

    def validate(self) -> None:
        _int("num_tokens", self.num_tokens, 1)
        _token_ids(self.token_ids, self.num_tokens)
        _int("addr", self.addr)
        _int("length", self.length, 1)
        if not isinstance(self.session, str) or not self.session:
            raise ValueError("session must be a non-empty string")



@dataclass(frozen=True)
class CacheImported(_CacheMove):
    """Target -> router: ``imported_tokens`` arrived (0: it already held them); it now holds
    ``cached_tokens`` of the prefix; ``bytes`` crossed the link in ``transfer_s``."""

    imported_tokens: int
    cached_tokens: int
    bytes: int
    transfer_s: float | None

    def validate(self) -> None:
        _int("imported_tokens", self.imported_tokens)
        _int("cached_tokens", self.cached_tokens)
        _int("bytes", self.bytes)

