"""The emulated engine's scheduling arithmetic (pure: no asyncio, no clocks, no I/O).

Three pieces, each the shape SGLang 0.5.15's scheduler has at the granularity
a router can observe:

* :class:`ChunkedPrefill`: ``--chunked-prefill-size``. Every prefill forward
  processes at most ``chunk_tokens`` new tokens, shared first come, first
  served by the requests waiting. Only the last request of a forward can be
  cut; it leads the next forward (SGLang's ``chunked_req``)::

      queue:    [ A: 3000 left ][ B: 6000 ][ C: 2000 ]        chunk_tokens = 8192
      forward:  [ A 0..3000    ][ B 0..5192 ]                   8192 tokens
      next:     [ B 5192..6000 ][ C 0..2000 ]                   2808 tokens

  A forward's duration is the sum of its pieces' incremental costs, where a
  request's cost curve is the profile's ``T_prefill`` over its *uncached*
  tokens: piece ``[s, e)`` costs ``T(e) - T(s)`` (``T(0) = 0``, so the
  per-request overhead is paid once). The pieces of one request telescope to
  ``T(l_uncached)``, so a saturated worker delivers the planner's
  ``Theta = 1 / E[T_prefill]`` however the chunks fall, while a short request
  behind a long one waits for one chunk, not for the whole long prefill.
  ``chunk_tokens=None`` (SGLang's ``-1``) disables chunking: whole requests,
  first come first served, while the forward stays within ``max_forward_tokens``
  (always at least one request).
* :class:`KvPool`: the decode worker's KV pool in tokens. ``free + used =
  total`` at every step; taking more than is free returns False, giving back
  more than was taken raises.
* :func:`admit`: continuous-batching admission, FCFS up to the batch limit.

Who owns what: the engine creates a :class:`PrefillJob` per request, keeps the
job object to recognise it in :meth:`ChunkedPrefill.complete`'s result, and
calls :meth:`ChunkedPrefill.remove` if the request is abandoned.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from dataclasses import dataclass

# SGLang's --max-prefill-tokens default: the budget of an unchunked prefill batch.
DEFAULT_MAX_FORWARD_TOKENS = 16_384


@dataclass(eq=False)
class PrefillJob:
    """One request's prefill: ``uncached_tokens`` to compute; ``done_tokens`` computed so far.
    ``cost_factor`` scales its cost curve (the engine's truth against its profile: ``truth.ServiceTruth``)."""

    uncached_tokens: int
    done_tokens: int = 0
    cost_factor: float = 1.0

    def __post_init__(self):
        if self.uncached_tokens < 1:
            raise ValueError(f"a prefill computes at least one token, got {self.uncached_tokens}")

    @property
    def waiting_tokens(self) -> int:
        """Uncached tokens of the jobs not started yet."""
        return sum(job.uncached_tokens for job in self._queue if job.done_tokens == 0)

    @property
    def remaining_tokens(self) -> int:
        return self.uncached_tokens - self.done_tokens


@dataclass(frozen=True)
class Piece:
    """Tokens ``[start, end)`` of ``job``'s uncached part, computed in one forward."""

    job: PrefillJob
    start: int
    end: int


@dataclass(frozen=True)
class Forward:
    """One prefill forward: the pieces it computes and how long it takes (cost units of ``cost_s``)."""

    pieces: tuple[Piece, ...]
    duration_s: float

    @property
    def num_tokens(self) -> int:
        return sum(p.end - p.start for p in self.pieces)


class ChunkedPrefill:
    """FCFS chunked prefill over a queue of :class:`PrefillJob`.

    ``cost_s(n)``: seconds to prefill ``n`` uncached tokens of one request from
    scratch (non-decreasing; called with ``n >= 1``). ``forward_s(pieces)``: a
    forward's duration from its pieces' costs, each ``(cost_s, starts_a_request)``;
    None: their sum (the telescoping above; ``truth.ServiceTruth.forward_s`` gives
    another form). Usage, one forward at a time: ``fwd = next_forward()``; run it
    for ``fwd.duration_s``; then ``complete(fwd)`` returns the jobs it finished
    (removed from the queue).
    """

    def __init__(self, chunk_tokens: int | None, cost_s: Callable[[int], float],
                 max_forward_tokens: int = DEFAULT_MAX_FORWARD_TOKENS,
                 forward_s: Callable[[list[tuple[float, bool]]], float] | None = None):
        if chunk_tokens is not None and chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be >= 1 or None, got {chunk_tokens}")
        self.chunk_tokens, self.cost_s, self.max_forward_tokens = chunk_tokens, cost_s, max_forward_tokens
        self.forward_s = forward_s
        self._queue: collections.deque[PrefillJob] = collections.deque()

    def __len__(self) -> int:
        return len(self._queue)

    @property
    def waiting_jobs(self) -> int:
        """Jobs not started yet (SGLang's waiting queue; a chunked request counts as running)."""
        return sum(job.done_tokens == 0 for job in self._queue)

    @property
    def waiting_tokens(self) -> int:
        """Uncached tokens of the jobs not started yet."""
        return sum(job.uncached_tokens for job in self._queue if job.done_tokens == 0)

    @property
    def remaining_tokens(self) -> int:
        """Uncached tokens still to compute, over every queued job: the worker's outstanding prefill work."""
        return sum(job.remaining_tokens for job in self._queue)

    def add(self, job: PrefillJob) -> None:
        self._queue.append(job)

    def remove(self, job: PrefillJob) -> bool:
        """Drop an abandoned job (queued or part-done); False if it is not queued."""
        try:
            self._queue.remove(job)
        except ValueError:
            return False
        return True

    def _piece_cost_s(self, piece: Piece) -> float:
        start, end = piece.start, piece.end
        return piece.job.cost_factor * (self.cost_s(end) - (self.cost_s(start) if start > 0 else 0.0))

    def next_forward(self) -> Forward | None:
        """The next forward's pieces (does not change the queue), or None when there is nothing to do."""
        pieces: list[Piece] = []
        if self.chunk_tokens is None:
            total = 0
            for job in self._queue:
                if pieces and total + job.remaining_tokens > self.max_forward_tokens:
                    break
                pieces.append(Piece(job, job.done_tokens, job.uncached_tokens))
                total += job.remaining_tokens
        else:
            budget = self.chunk_tokens
            for job in self._queue:
                if budget <= 0:
                    break
                take = min(job.remaining_tokens, budget)
                pieces.append(Piece(job, job.done_tokens, job.done_tokens + take))
                budget -= take
        if not pieces:
            return None
        costs = [(self._piece_cost_s(p), p.start == 0) for p in pieces]
        return Forward(tuple(pieces), self.forward_s(costs) if self.forward_s else sum(cost for cost, _ in costs))

    def complete(self, forward: Forward) -> list[PrefillJob]:
        """Apply a finished forward; returns the jobs it completed. Pieces of removed jobs are ignored."""
        finished = []
        queued = set(map(id, self._queue))
        for piece in forward.pieces:
            job = piece.job
            if id(job) not in queued or job.done_tokens != piece.start:
                continue
            job.done_tokens = piece.end
            if job.remaining_tokens == 0:
                finished.append(job)
        for job in finished:
            self._queue.remove(job)
        return finished


class KvPool:
    """A decode worker's KV pool, in tokens (SGLang's ``max_total_num_tokens``)."""

    def __init__(self, total_tokens: int):
        if total_tokens < 1:
            raise ValueError(f"a KV pool holds at least one token, got {total_tokens}")
        self.total_tokens = total_tokens
        self.used_tokens = 0

    @property
    def free_tokens(self) -> int:
        return self.total_tokens - self.used_tokens

    def fits(self, tokens: int) -> bool:
        """Whether ``tokens`` could ever fit (an empty pool would hold them)."""
        return 0 <= tokens <= self.total_tokens

    def try_take(self, tokens: int) -> bool:
        """Take ``tokens`` if they are free now; False (and nothing taken) otherwise."""
        if tokens < 0:
            raise ValueError(f"cannot take {tokens} tokens")
        if tokens > self.free_tokens:
            return False
        self.used_tokens += tokens
        return True

    def give(self, tokens: int) -> None:
        """Return ``tokens`` taken earlier; returning more than is in use is a bug and raises."""
        if not 0 <= tokens <= self.used_tokens:
            raise ValueError(f"cannot give back {tokens} tokens: {self.used_tokens} in use")
        self.used_tokens -= tokens


def admit(waiting: collections.deque, running: list, max_batch: int, skip: Callable[[object], bool] = lambda _: False) -> list:
    """Move sequences FCFS from ``waiting`` to ``running`` while ``len(running) < max_batch``.

    Sequences for which ``skip`` is true (abandoned) are dropped from ``waiting`` without
    taking a slot. Returns the sequences taken off ``waiting`` (admitted or dropped).
    """
    taken = []
    while waiting and len(running) < max_batch:
        seq = waiting.popleft()
        taken.append(seq)
        if not skip(seq):
            running.append(seq)
    return taken
