"""The global KV index: which worker holds which prefix, from SGLang's KV events (pure).

Fed with decoded event batches (``apply``), queried with token ids
(``match``). Blocks are SGLang's chained page hashes (``engine.blocks``), so
holding block *k* of a prompt means holding the whole prefix up to it; a
worker's reusable prefix is its longest run of leading blocks.

Hybrid models. A prefix is usable only up to the longest linear-attention
state checkpoint inside its full-attention match (the rule of SGLang's
MambaRadixCache), so ``match`` caps hybrid reuse at the deepest matched
block that holds one. Where the checkpoints come from, per worker:

* *reported*: a worker whose batches carry ``state_events`` (wire v2: our
  SGLang cache backend, the emulated engine) says where each state is stored
  and evicted; the index holds exactly those (``"mamba"`` ones; other
  components are not used here yet);
* *inferred*: for a worker on SGLang's own publisher (no state events; its
  Mamba evictions emit nothing) the index expects a checkpoint at the last
  block of every stored run (a prefilled prompt's end) and every
  ``checkpoint_interval_tokens`` (chunk-aligned checkpoints). That can
  overstate reuse after a state eviction; the router treats it as an estimate.

A worker that switches between the two (a restart with another publisher)
is dropped and rebuilt from its new events.

Sliding-window (SWA) models. A worker whose cache is SGLang's ``SWARadixCache`` (our backend)
reports which stored pages lost their sliding-window KV (``"swa"`` StateRemoved, StateStored when
it comes back, with the model's window). Its usable hit is SGLang's rule: the deepest matched
block ``L`` whose last ``ceil(window / block_size)`` blocks all hold it, or all of whose blocks
from the root do (before the first such event every stored page holds it).
Such a worker is matched by that rule only (SGLang builds the SWA tree, not the Mamba one, for a
model that has both). Without these events (SGLang's own publisher) its full-attention match is
taken as is, an overstatement after window evictions, like an inferred hybrid one.

Block sizes. Each worker hashes at its own page size (``/server_info``'s
``kv_events.block_size``, given to :meth:`add_worker`, or learnt from its
first event). Events with another size, or a size below 1, are refused whole
(:class:`InvalidEvents`); ``match`` hashes the prompt once per distinct size.

Consistency. Each worker's events carry a sequence number. A gap means
events were lost: the worker's entries are dropped (an empty index is safe,
a wrong one is not) until new events rebuild it. A sequence number going
backwards means the worker restarted: same treatment. ``AllBlocksCleared``
empties the worker.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from itertools import accumulate, chain, compress, islice, repeat, takewhile
from operator import and_

from prfaas_sglang.wire.blocks import PageIdMemo, digest_to_int64, iter_page_digests
from prfaas_sglang.wire.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    StateRemoved,
    StateStored,
)
from prfaas_sglang.wire.kv_snapshot import WorkerSnapshot


class InvalidEvents(ValueError):
    """An event batch that cannot be right for its worker; nothing of it was applied."""


@dataclass
class _WorkerState:
    """One worker's blocks. Every per-block collection is a plain dict of ints (``None`` values for a
    set): CPython keeps such a dict out of garbage collection, so millions of blocks (page size 1,
    a hybrid model's, is one block per token) add nothing to a collection's pause. A ``set`` is
    always tracked and walked element by element."""

    cluster: str
    bit: int  # this worker's bit in KvIndex's holder masks
    block_size: int | None = None
    depth: dict[int, int] = field(default_factory=dict)  # block -> blocks from the root; its keys are the blocks held
    checkpoints: dict[int, None] = field(default_factory=dict)
    last_seq: int | None = None
    resets: int = 0
    reports_state: bool = False  # checkpoints come from the worker's state events, not inferred
    swa_missing: dict[int, None] = field(default_factory=dict)  # stored pages without their sliding-window KV ("swa" events)
    swa_window_tokens: int | None = None  # set: a sliding-window worker, matched by the window rule


@dataclass(frozen=True)
class PrefixMatch:
    """Reusable prefix per worker and per cluster, in tokens (0 when nothing matches)."""

    total_tokens: int
    by_worker: dict[str, int]
    by_cluster: dict[str, int]
    # The longest prefix some worker holds as full-attention blocks, state or not: a prefix shared
    # with earlier requests (for a hybrid model, where a state checkpoint would make it reusable).
    shared_tokens: int = 0
    # What a decode worker's own cache supplies (SGLang's decode radix cache, hooks/decode_radix's
    # rule): the full-attention blocks a worker holds, state or not, for a hybrid model a page short
    # of a state checkpoint the match would end at. Every worker with a nonzero hold is listed.
    held_by_worker: dict[str, int] = field(default_factory=dict)

    def best_worker(self, cluster: str) -> tuple[str | None, int]:
        candidates = [(n, w) for w, n in self.by_worker.items() if self._cluster_of.get(w) == cluster]
        if not candidates:
            return None, 0
        n, w = max(candidates)
        return w, n

    _cluster_of: dict[str, str] = field(default_factory=dict, repr=False, compare=False)


class KvIndex:
    def __init__(self, hybrid: bool, checkpoint_interval_tokens: int = 8192, memo: PageIdMemo | None = None):
        """``memo``: where ``match`` keeps the block ids of prompts it hashed, for workers whose
        pages are smaller than its segments (page size 1: a SHA-256 per token); None: a default one
        (32K segments of 256 tokens, about 70 MB when full at page size 1)."""
        self.hybrid = hybrid
        self.memo = memo if memo is not None else PageIdMemo()
        self.checkpoint_interval_tokens = checkpoint_interval_tokens
        self._workers: dict[str, _WorkerState] = {}
        # block hash -> the workers holding it, one bit each (_WorkerState.bit): ints, not sets,
        # so the garbage collector never walks the index (see _WorkerState)
        self._holders: dict[int, int] = {}

    # --- membership ----------------------------------------------------------------

    def add_worker(self, worker: str, cluster: str, block_size: int | None = None) -> None:
        state = self._workers.get(worker)
        if state is None:
            taken = {s.bit for s in self._workers.values()}
            state = self._workers[worker] = _WorkerState(cluster, bit=min(set(range(len(taken) + 1)) - taken))
        if block_size is not None:
            if block_size < 1:
                raise InvalidEvents(f"block size of {worker} must be >= 1, got {block_size}")
            if state.block_size not in (None, block_size):
                self._drop(worker)
            state.block_size = block_size

    def remove_worker(self, worker: str) -> None:
        self._drop(worker)  # clears the worker's bit from every mask before another worker may take it
        self._workers.pop(worker, None)

    def workers(self) -> dict[str, str]:
        return {w: s.cluster for w, s in self._workers.items()}

    def block_count(self, worker: str) -> int:
        return len(self._workers[worker].depth)

    def resets(self, worker: str) -> int:
        return self._workers[worker].resets

    def checkpoints(self, worker: str) -> tuple[int, str]:
        """(state checkpoints held for ``worker``, ``"reported"`` or ``"inferred"``)."""
        state = self._workers[worker]
        return len(state.checkpoints), "reported" if state.reports_state else "inferred"

    # --- snapshots (a restarted router takes the kv-index service's view) --------------

    def export(self) -> dict[str, WorkerSnapshot]:
        """Every worker's blocks, their depths and the expected checkpoints; pure read."""
        return {w: WorkerSnapshot(s.cluster, s.block_size, tuple(s.depth.items()),
                                  tuple(s.checkpoints), s.reports_state, tuple(s.swa_missing), s.swa_window_tokens)
                for w, s in self._workers.items()}

    def restore(self, worker: str, snap: WorkerSnapshot) -> int:
        """Add ``snap``'s blocks to ``worker`` (added first, same cluster and block size; else
        InvalidEvents); the blocks added. A merge, not a replacement: what live events stored since
        stays. The sequence check restarts, so the next event is taken whatever its number
        (events between the snapshot and the subscription are missed: an estimate, as ever)."""
        state = self._workers.get(worker)
        if state is None or state.cluster != snap.cluster:
            raise InvalidEvents(f"{worker}: not a worker of cluster {snap.cluster!r} here")
        if snap.block_size is not None and state.block_size not in (None, snap.block_size):
            raise InvalidEvents(f"{worker}: snapshot block size {snap.block_size}, the worker's is {state.block_size}")
        if snap.block_size is not None:
            state.block_size = snap.block_size
        # One source of checkpoints per worker: live events, once any came, decide it.
        take_checkpoints = snap.reports_state == state.reports_state or state.last_seq is None
        if take_checkpoints:
            state.reports_state = snap.reports_state
        added = 0
        holders, bit = self._holders, 1 << state.bit
        for block, depth in snap.blocks:
            if block not in state.depth:
                state.depth[block] = depth
                holders[block] = holders.get(block, 0) | bit
                added += 1
        if take_checkpoints:
            state.checkpoints.update((b, None) for b in snap.checkpoints if b in state.depth)
            state.swa_missing.update((b, None) for b in snap.swa_missing if b in state.depth)
            if snap.swa_window_tokens is not None:
                state.swa_window_tokens = snap.swa_window_tokens
        state.last_seq = None
        return added

    # --- ingest ------------------------------------------------------------------------

    def apply(self, worker: str, seq: int, events: Iterable, state_events: Iterable | None = None) -> None:
        """Apply one event batch numbered ``seq`` from ``worker`` (added first with add_worker):
        its block ``events``, then its ``state_events`` (None: the worker reports no state)."""
        state = self._workers[worker]
        events = list(events)
        state_events = None if state_events is None else list(state_events)
        self._check(worker, state, events, state_events)
        if state.last_seq is not None and seq != state.last_seq + 1:
            self._drop(worker)  # a gap (lost events) or a restart (seq went back): start over
            state.resets += 1
        state.last_seq = seq
        reports_state = state_events is not None
        if reports_state != state.reports_state:
            self._drop(worker)  # another source of checkpoints: rebuild from this batch on
            state.reports_state = reports_state
        self._apply_blocks(worker, state, events)
        for event in state_events or ():
            if event.component_type == "swa":
                state.swa_window_tokens = event.window_tokens
                if isinstance(event, StateStored):
                    state.swa_missing.pop(event.block_hash, None)
                elif event.block_hash in state.depth:  # marks a stored page only
                    state.swa_missing[event.block_hash] = None
                continue
            if event.component_type != "mamba":
                continue
            if isinstance(event, StateStored):
                if event.block_hash in state.depth:  # a state is held at most where its page is
                    state.checkpoints[event.block_hash] = None
            else:
                state.checkpoints.pop(event.block_hash, None)

    @staticmethod
    def _check(worker: str, state: _WorkerState, events: list, state_events: list | None) -> None:
        """Refuse a batch that cannot be right (InvalidEvents) before anything of it is applied."""
        for event in events:
            if isinstance(event, BlockStored):
                size = event.block_size
                if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                    raise InvalidEvents(f"{worker}: BlockStored with block_size {size!r}")
                if state.block_size is not None and size != state.block_size:
                    raise InvalidEvents(f"{worker}: BlockStored with block_size {size}, the worker's is {state.block_size}")
        for event in state_events or ():
            if not isinstance(event, (StateStored, StateRemoved)):
                raise InvalidEvents(f"{worker}: {type(event).__name__} among state events")
            if isinstance(event.num_tokens, bool) or not isinstance(event.num_tokens, int) or event.num_tokens < 1:
                raise InvalidEvents(f"{worker}: {type(event).__name__} with num_tokens {event.num_tokens!r}")
            if event.component_type == "swa":
                window = event.window_tokens
                if isinstance(window, bool) or not isinstance(window, int) or window < 1:
                    raise InvalidEvents(f"{worker}: an swa {type(event).__name__} with window_tokens {window!r}")

    def _apply_blocks(self, worker: str, state: _WorkerState, events: list) -> None:
        infer = self.hybrid and not state.reports_state  # expect checkpoints where SGLang takes them
        run_end: int | None = None  # last block of the chain being stored in this batch
        for event in events:
            if isinstance(event, BlockStored):
                state.block_size = event.block_size
                interval = max(self.checkpoint_interval_tokens // event.block_size, 1)
                parent = event.parent_block_hash
                if infer and run_end is not None and parent != run_end:
                    state.checkpoints[run_end] = None  # the previous prompt's end
                holders, bit = self._holders, 1 << state.bit
                for block in event.block_hashes:
                    # Absolute depth from the root; an unknown parent (lost to a reset) restarts at 1.
                    depth = state.depth.get(parent, 0) + 1 if parent is not None else 1
                    state.depth[block] = depth
                    holders[block] = holders.get(block, 0) | bit
                    if infer and depth % interval == 0:
                        state.checkpoints[block] = None
                    parent = block
                run_end = parent
                continue
            if infer and run_end is not None:
                state.checkpoints[run_end] = None
            run_end = None
            if isinstance(event, BlockRemoved):
                for block in event.block_hashes:
                    self._forget(worker, block)
            elif isinstance(event, AllBlocksCleared):
                self._drop(worker)
        if infer and run_end is not None:
            state.checkpoints[run_end] = None

    def _forget(self, worker: str, block: int) -> None:
        state = self._workers[worker]
        state.checkpoints.pop(block, None)
        state.swa_missing.pop(block, None)
        if state.depth.pop(block, None) is None:
            return
        mask = self._holders.get(block, 0) & ~(1 << state.bit)
        if mask:
            self._holders[block] = mask
        else:
            self._holders.pop(block, None)

    def _drop(self, worker: str) -> None:
        state = self._workers.get(worker)
        if state is None:
            return
        for block in list(state.depth):
            self._forget(worker, block)
        state.checkpoints.clear()
        state.swa_missing.clear()

    # --- queries ------------------------------------------------------------------------

    def block_sizes(self) -> set[int]:
        return {s.block_size for s in self._workers.values() if s.block_size}

    def block_ids(self, token_ids: Sequence[int], block_size: int) -> list[int]:
        """The block ids ``match`` would compute for ``token_ids[:-1]`` at ``block_size``."""
        return [digest_to_int64(d) for d in iter_page_digests(token_ids, block_size, max_tokens=len(token_ids) - 1)]

    def match(self, token_ids: Sequence[int], block_ids: dict[int, Sequence[int]] | None = None) -> PrefixMatch:
        """Reusable prefix of ``token_ids`` on every worker, in tokens. Reads the index; records
        the prompt's block ids in :attr:`memo` (small pages only), which changes no answer.

        The last token is never reusable (it is always recomputed), so only the full
        pages of ``token_ids[:-1]`` are looked up, at each worker's own block size.
        A caller that already hashed them passes ``block_ids[block_size]``.
        """
        by_worker = {w: 0 for w in self._workers}
        held: dict[str, int] = {}
        shared = 0
        if len(token_ids) > 1:
            for size in sorted(self.block_sizes()):
                members = {w for w, st in self._workers.items() if st.block_size == size}
                best, blocks_tokens, holds = self._match_size(token_ids, size, members, (block_ids or {}).get(size))
                by_worker.update(best)
                held.update(holds)
                shared = max(shared, blocks_tokens)
        by_cluster: dict[str, int] = {}
        for w, n in by_worker.items():
            cluster = self._workers[w].cluster
            by_cluster[cluster] = max(by_cluster.get(cluster, 0), n)
        return PrefixMatch(len(token_ids), by_worker, by_cluster, shared, held,
                           {w: s.cluster for w, s in self._workers.items()})

    def _mask(self, workers) -> int:
        """The holder mask of these (known) workers."""
        mask = 0
        for w in workers:
            mask |= 1 << self._workers[w].bit
        return mask

    def _match_size(self, token_ids: Sequence[int], size: int, members: set[str],
                    given=None) -> tuple[dict[str, int], int, dict[str, int]]:
        """(reusable tokens per member, the longest full-attention block match of any member, the
        tokens each member holds for a decode (``PrefixMatch.held_by_worker``)).

        The walk runs in C (``map``, ``accumulate``) over batches of blocks that double in size,
        so a new prompt costs a page or so of hashing and a held one no Python step per block (at
        page size 1, a block per token): first which members hold every block so far, then per
        member how far it holds and, for a hybrid model, which of those blocks are its checkpoints::

            blocks:   b1   b2   b3   b4   b5        (the prompt's pages, hashed as the walk reads them)
            alive:    ABC  AB   AB   A    A         (members holding b1..bk; it only shrinks)
            held(A) = 5, held(B) = 3, held(C) = 1   (leading blocks while in alive)
        """
        # Hash lazily: the walk stops in the first batch where no member holds a block.
        if given is not None:
            ids = iter(given)
        elif size < self.memo.segment_tokens or getattr(token_ids, "compact", False):
            # Small pages (a SHA-256 call per few tokens) or ids still in their JSON text (parsed
            # only on a miss): skip what was hashed before.
            ids = chain.from_iterable(self.memo.segments(token_ids, size, max_tokens=len(token_ids) - 1))
        else:
            ids = (digest_to_int64(d) for d in iter_page_digests(token_ids, size, max_tokens=len(token_ids) - 1))
        holders, alive = self._holders, self._mask(members)
        blocks: list[int] = []
        alives: list[int] = []  # alives[k]: the members holding blocks[0..k]
        batch_len = 1
        while alive:
            batch = list(islice(ids, batch_len))
            if not batch:
                break
            run = list(takewhile(bool, accumulate(map(holders.get, batch, repeat(0)), and_, initial=alive)))[1:]
            blocks += batch[: len(run)]
            alives += run
            if len(run) < len(batch):
                break
            alive, batch_len = run[-1], batch_len * 2
        best: dict[str, int] = {}
        holds: dict[str, int] = {}
        for w in members:
            st = self._workers[w]
            bit = 1 << st.bit
            if not alives or not alives[0] & bit:
                continue  # holds not even the first block
            n = bisect_left(alives, True, key=lambda a, bit=bit: not a & bit)  # blocks w holds from the root
            mine = blocks[:n]
            state_ends = set()
            if self.hybrid and len(st.checkpoints) < n:
                # Fewer checkpoints than path blocks: go from each checkpoint's depth to the path's
                # block there. A block stored under a parent lost to a reset has too small a depth
                # and is missed here: a smaller estimate, never a larger one.
                depth_of = st.depth
                state_ends = {d for d in map(depth_of.get, st.checkpoints) if d is not None and d <= n
                              and st.checkpoints.get(mine[d - 1], False) is None}
            elif self.hybrid:  # many: look each of the path's blocks up
                state_ends = set(compress(range(1, n + 1), map(st.checkpoints.__contains__, mine)))
            if st.swa_window_tokens is not None:
                # SWARadixCache.match_prefix: resumable where the window before it is held, or
                # where nothing from the root was ever dropped
                window_run = 0
                for depth, block in enumerate(mine, 1):
                    window_run = 0 if block in st.swa_missing else window_run + 1
                    if window_run == depth or window_run * size >= st.swa_window_tokens:
                        best[w] = depth * size
            elif not self.hybrid:
                best[w] = n * size
            elif state_ends:
                best[w] = max(state_ends) * size
            while n and n in state_ends:
                n -= 1  # a page short of a state the match would end at (its lock would pin the state)
            if n:
                holds[w] = n * size
        return best, len(blocks) * size, holds
