"""Prefix cache vs transfer cache on a PrfaaS prefill worker: which prefills its tree keeps (pure).

A PrfaaS worker prefills long prompts for another cluster. Once a prompt's KV has been sent,
the worker needs it again only if a later long request shares its prefix. SGLang inserts
every finished prefill (and every chunk of it) into the radix tree, so a stream of one-off
long prompts fills the tree and evicts what is shared. This policy splits the blocks in two:

* *prefix cache*: a prefill whose prefix is known to be shared is inserted, as SGLang does;
* *transfer cache*: any other prefill is not inserted at all (not its chunks either); its
  pages and its state slot are freed as soon as its transfer has completed;
* both, split at a checkpoint hint: a prompt that would be transfer cache but asks for a state
  checkpoint (a router saw that prefix on some worker, ``router/policy.checkpoint_at``) keeps
  the prefix up to the checkpoint, with its state, and frees the rest once sent.

Modes (``PRFAAS_PREFILL_CACHE``; the launcher sets ``auto`` for the prfaas role):

``all``
    keep every prefill (SGLang's behaviour; what every other role does).
``shared``
    keep a prefill that reused at least ``min_shared_tokens`` cached tokens (it extends an entry
    already shared), or whose first ``min_shared_tokens`` or more tokens equal a prompt seen
    recently (a second sighting: the prefix is shared, the next one can hit it). Seen prompts
    are remembered as fingerprints of their leading ``min_shared_tokens * 2**k`` tokens in a
    bounded LRU (``ghost_entries``), no KV. Why: one-off long prompts, the bulk of
    a PrfaaS worker's traffic, are never inserted; a prefix seen twice is. Measured
    (``bench prefill-cache``): 3x the prefill saved of ``all`` in a cache of a few prompts, but
    0.6x of ``all``'s in one that holds a conversation's turns until the next, hence ``auto``.
``auto`` (default for the prfaas role)
    ``shared``, except that a one-off prefill is kept too while the cache is large enough for
    that to pay: when the recent re-sightings (a prompt whose leading ``min_shared_tokens`` or
    more tokens were seen before) mostly came back within the cache's reach. The reach of a
    sighting is the prompt tokens decided since it (what keeping every prefill would have
    inserted meanwhile) plus the prefix itself, an upper bound on its LRU stack distance, against
    ``capacity_tokens``; with ``capacity_states`` (a hybrid model's state slots) also the
    requests decided since it.
    Keeping a one-off in a cache whose reach covers most reuses costs little and saves the next
    turn's prefill; in a cache that cannot hold a prompt until it comes back, a one-off only
    pushes out what is shared. The estimate depends on the arrivals only, not on what was kept,
    so the choice does not feed back on itself. Needs the cache's capacity.
``none``
    keep nothing: every prefill is transfer cache.

Capacity accounting: :class:`AdmissionStats` counts the prefills and tokens of each kind. A kept
prefill's pages belong to the tree (evictable once its transfer released them); a transfer
prefill's pages belong to the request until its transfer completes, then to the free pool.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

MODES = ("all", "shared", "auto", "none")
REUSE_WINDOW = 64  # re-sightings ``auto`` weighs (the most recent)
MIN_REUSE_SAMPLES = 8  # below this many, ``auto`` keeps one-offs (a cache that has seen little is empty)
# A cache keeps each request's decision from its first match until SGLang releases it, and forgets the
# oldest beyond this many (an aborted waiting request is never released).
MAX_PENDING_DECISIONS = 65_536


class AdmissionConfigError(ValueError):
    """An admission setting that cannot work (unknown mode, non-positive sizes)."""


@dataclass
class AdmissionStats:
    kept_requests: int = 0
    kept_tokens: int = 0
    transfer_requests: int = 0
    transfer_tokens: int = 0
    reasons: dict[str, int] = field(default_factory=dict)
    reuses_seen: int = 0  # re-sightings of a prompt's leading tokens
    reuses_in_reach: int = 0  # of which came back within the cache's reach (``auto``)


@dataclass(frozen=True)
class Decision:
    keep: bool
    reason: str  # "mode-all" | "mode-none" | "reused-prefix" | "seen-prefix" | "one-off-in-reach" | "checkpoint-prefix" | "one-off"
    # With ``keep``: None, the whole prefill is prefix cache; a length, only the prompt's first so
    # many tokens are (a checkpoint hint's prefix), the rest is transfer cache.
    keep_tokens: int | None = None


class PrefixAdmission:
    """Decides, once per request, whether its prefill is kept in the tree. Not thread-safe (one
    scheduler thread calls it); holds at most ``ghost_entries`` fingerprints (default: 4096, or
    twice ``capacity_tokens / min_shared_tokens`` if more, so a sighting is remembered beyond the
    cache's reach).

    ``capacity_tokens``: the KV pool in tokens the tree can fill; ``capacity_states``: state slots
    (hybrid models), None where states do not bound the tree. Required by ``auto`` only."""

    def __init__(self, mode: str = "shared", min_shared_tokens: int = 1024, ghost_entries: int | None = None,
                 capacity_tokens: int | None = None, capacity_states: int | None = None):
        if mode not in MODES:
            raise AdmissionConfigError(f"prefill cache mode must be one of {', '.join(MODES)}, got {mode!r}")
        _check_positive("min_shared_tokens", min_shared_tokens)
        if capacity_tokens is not None:
            _check_positive("capacity_tokens", capacity_tokens)
        if capacity_states is not None:
            _check_positive("capacity_states", capacity_states)
        if mode == "auto" and capacity_tokens is None:
            raise AdmissionConfigError("prefill cache mode 'auto' needs the cache's capacity_tokens")
        if ghost_entries is None:  # remember sightings at least twice the cache's reach back
            ghost_entries = max(4096, 2 * (capacity_tokens or 0) // min_shared_tokens)
        _check_positive("ghost_entries", ghost_entries)
        self.mode = mode
        self.min_shared_tokens = min_shared_tokens
        self.ghost_entries = ghost_entries
        self.capacity_tokens = capacity_tokens
        self.capacity_states = capacity_states
        # fingerprint -> (token clock, request clock) at its last sighting
        self._ghost: OrderedDict[bytes, tuple[int, int]] = OrderedDict()
        self._tokens_decided = 0  # the token clock: prompt tokens decided so far
        self._requests_decided = 0  # the request clock
        self._recent_in_reach: deque[bool] = deque(maxlen=REUSE_WINDOW)
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

    def decide(self, token_ids: Sequence[int], hit_tokens: int, checkpoint_tokens: int | None = None) -> Decision:
        """Whether the prefill of ``token_ids`` (``hit_tokens`` of it already cached) is kept; records
        the prompt as seen and counts the decision. ``checkpoint_tokens``: where the request asks for
        a state checkpoint (a router saw that prefix on some worker): a prompt not kept otherwise
        keeps that prefix, and only that (``Decision.keep_tokens``)."""
        if self.mode == "all":
            decision = Decision(True, "mode-all")
        elif self.mode == "none":
            decision = Decision(False, "mode-none")
        else:
            prints = self.fingerprints(token_ids)
            # (prefix length, clocks at its last sighting) of each leading prefix seen before
            last_seen = [(self.min_shared_tokens << k, self._ghost[p]) for k, p in enumerate(prints) if p in self._ghost]
            if last_seen:
                self._note_reuse(last_seen)
            if hit_tokens >= self.min_shared_tokens:
                decision = Decision(True, "reused-prefix")
            elif last_seen:
                decision = Decision(True, "seen-prefix")
            elif self.mode == "auto" and self.reuse_in_reach():
                decision = Decision(True, "one-off-in-reach")
            elif checkpoint_tokens is not None and 0 < checkpoint_tokens < len(token_ids):
                decision = Decision(True, "checkpoint-prefix", checkpoint_tokens)
            else:
                decision = Decision(False, "one-off")
            now = (self._tokens_decided + len(token_ids), self._requests_decided + 1)  # clocks after it
            for p in prints:
                self._ghost[p] = now
                self._ghost.move_to_end(p)
            while len(self._ghost) > self.ghost_entries:
                self._ghost.popitem(last=False)
        self._tokens_decided += len(token_ids)
        self._requests_decided += 1
        stats = self.stats
        kept = (len(token_ids) if decision.keep_tokens is None else decision.keep_tokens) if decision.keep else 0
        stats.kept_requests += decision.keep
        stats.kept_tokens += kept
        stats.transfer_requests += not decision.keep
        stats.transfer_tokens += len(token_ids) - kept
        stats.reasons[decision.reason] = stats.reasons.get(decision.reason, 0) + 1
        return decision

    def reuse_in_reach(self) -> bool:
        """``auto``'s rule: whether at least half of the recent re-sightings came back within the
        cache's reach (True while fewer than MIN_REUSE_SAMPLES were seen)."""
        recent = self._recent_in_reach
        if len(recent) < MIN_REUSE_SAMPLES:
            return True
        return 2 * sum(recent) >= len(recent)

    def _note_reuse(self, last_seen: list[tuple[int, tuple[int, int]]]) -> None:
        """Records whether this re-sighting came back within the cache's reach: some prefix of it
        would still be in an LRU tree that kept every prefill, i.e. the prefix's own tokens plus the
        prompt tokens decided since its last sighting fit ``capacity_tokens`` (and its request plus
        those since fit ``capacity_states``)."""
        in_reach = self.capacity_tokens is not None and any(
            length + self._tokens_decided - tokens_then <= self.capacity_tokens
            and (self.capacity_states is None or 1 + self._requests_decided - requests_then <= self.capacity_states)
            for length, (tokens_then, requests_then) in last_seen)
        self._recent_in_reach.append(in_reach)
        self.stats.reuses_seen += 1
        self.stats.reuses_in_reach += in_reach


def _check_positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise AdmissionConfigError(f"{name} must be a positive integer, got {value!r}")
