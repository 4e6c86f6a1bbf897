"""Prefix cache vs transfer cache on a PrfaaS prefill worker: which prefills its tree keeps (pure).

A PrfaaS worker prefills long prompts for another cluster. Once a prompt's KV has been sent,
the worker needs it again only if a later long request shares its prefix. SGLang inserts
every finished prefill (and every chunk of it) into the radix tree, so a stream of one-off
long prompts fills the tree and evicts what is shared. This policy splits the blocks in two:

* *prefix cache*: a prefill whose prefix is known to be shared is inserted, as SGLang does;
* *transfer cache*: any other prefill is not inserted at all (not its chunks either); its
  pages and its state slot are freed as soon as its transfer has completed.

Modes (``PRFAAS_PREFILL_CACHE``; the launcher sets ``shared`` for the prfaas role):

``all``
    keep every prefill (SGLang's behaviour; what every other role does).
``shared`` (default for the prfaas role)
    keep a prefill that reused at least ``min_shared_tokens`` cached tokens (it extends an entry
    already shared), or whose first ``min_shared_tokens`` or more tokens equal a prompt seen
    recently (a second sighting: the prefix is shared, the next one can hit it). Seen prompts
    are remembered as fingerprints of their leading ``min_shared_tokens * 2**k`` tokens in a
    bounded LRU (``ghost_entries``), no KV. Why the default: one-off long prompts, the bulk of
    a PrfaaS worker's traffic, are never inserted; a prefix seen twice is.
``none``
    keep nothing: every prefill is transfer cache.

Capacity accounting: :class:`AdmissionStats` counts the prefills and tokens of each kind. A kept
prefill's pages belong to the tree (evictable once its transfer released them); a transfer
prefill's pages belong to the request until its transfer completes, then to the free pool.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

MODES = ("all", "shared", "none")


class AdmissionConfigError(ValueError):
    """An admission setting that cannot work (unknown mode, non-positive sizes)."""


@dataclass
class AdmissionStats:
    kept_requests: int = 0
    kept_tokens: int = 0
    transfer_requests: int = 0
    transfer_tokens: int = 0
    reasons: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Decision:
    keep: bool
    reason: str  # "mode-all" | "mode-none" | "reused-prefix" | "seen-prefix" | "one-off"


class PrefixAdmission:
    """Decides, once per request, whether its prefill is kept in the tree. Not thread-safe (one
    scheduler thread calls it); holds at most ``ghost_entries`` fingerprints."""

    def __init__(self, mode: str = "shared", min_shared_tokens: int = 1024, ghost_entries: int = 4096):
        if mode not in MODES:
            raise AdmissionConfigError(f"prefill cache mode must be one of {', '.join(MODES)}, got {mode!r}")
        if isinstance(min_shared_tokens, bool) or not isinstance(min_shared_tokens, int) or min_shared_tokens < 1:
            raise AdmissionConfigError(f"min_shared_tokens must be a positive integer, got {min_shared_tokens!r}")
        if isinstance(ghost_entries, bool) or not isinstance(ghost_entries, int) or ghost_entries < 1:
            raise AdmissionConfigError(f"ghost_entries must be a positive integer, got {ghost_entries!r}")
        self.mode = mode
        self.min_shared_tokens = min_shared_tokens
        self.ghost_entries = ghost_entries
        self._ghost: OrderedDict[bytes, None] = OrderedDict()
        self.stats = AdmissionStats()

    def fingerprints(self, token_ids: Sequence[int]) -> list[bytes]:
        """Digests of ``token_ids[:L]`` for L = min_shared_tokens * 2**k <= len (pure)."""
        out: list[bytes] = []
        h = hashlib.blake2b(digest_size=16)
        done = 0
        length = self.min_shared_tokens
        while length <= len(token_ids):
            h.update(array("q", token_ids[done:length]).tobytes())
            out.append(h.copy().digest())
            done, length = length, length * 2
        return out

    def decide(self, token_ids: Sequence[int], hit_tokens: int) -> Decision:
        """Whether the prefill of ``token_ids`` (``hit_tokens`` of it already cached) is kept; records
        the prompt as seen and counts the decision."""
        if self.mode == "all":
            decision = Decision(True, "mode-all")
        elif self.mode == "none":
            decision = Decision(False, "mode-none")
        else:
            prints = self.fingerprints(token_ids)
            if hit_tokens >= self.min_shared_tokens:
                decision = Decision(True, "reused-prefix")
            elif any(p in self._ghost for p in prints):
                decision = Decision(True, "seen-prefix")
            else:
                decision = Decision(False, "one-off")
            for p in prints:
                self._ghost[p] = None
                self._ghost.move_to_end(p)
            while len(self._ghost) > self.ghost_entries:
                self._ghost.popitem(last=False)
        stats = self.stats
        if decision.keep:
            stats.kept_requests += 1
            stats.kept_tokens += len(token_ids)
        else:
            stats.transfer_requests += 1
            stats.transfer_tokens += len(token_ids)
        stats.reasons[decision.reason] = stats.reasons.get(decision.reason, 0) + 1
        return decision
