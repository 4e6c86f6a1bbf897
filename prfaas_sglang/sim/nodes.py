"""The simulated fleet's parts as SimPy processes: prefill nodes, decode nodes, the shared link.

Time is model seconds (real accelerators, ``speedup`` 1); bytes are real KV bytes. Each part keeps
the counters the long-term controller samples (completed, busy instance-seconds, queued).

* :class:`PrefillNode`: SGLang's chunked prefill, the emulated engine's own arithmetic
  (``engine.mock.scheduler.ChunkedPrefill`` over ``EngineTiming.prefill_s``): one forward at a
  time, each ``chunk_tokens`` of the queue, first come first served.
* :class:`DecodeNode`: continuous batching. Up to ``max_batch`` sequences share every step; a
  step takes ``EngineTiming.decode_step_s(batch, context)`` (the analytic roofline the emulated
  engine sleeps for). Simulated per *event* (an admission or a completion), not per step: between
  events the batch is fixed, so every running sequence advances ``dt / step_s`` tokens::

      steps        0 ----------- s_now ------------- s_done(A) ----- s_done(B)
      sequence A   admitted at s_a, done when s_now - s_a = L_out(A)
      the next event is min(the next completion, an arrival)  ->  O(events), not O(steps)

* :class:`SharedLink`: processor sharing, every transfer in flight gets ``capacity / n`` (TCP
  flows sharing a bottleneck, fairly), capacity changed by a schedule. The same bookkeeping:
  ``served`` grows by ``capacity / n`` per second for every flow; a flow ends when
  ``served`` reaches its target.

The cross-cluster KV ships after the prefill ends (SGLang 0.5.15 sends per chunk, so real
transfers overlap the prefill a little: the simulator is pessimistic there by up to one chunk's
worth; a layer-wise link, ``links[].layerwise``, overlaps most of it, which the simulator does not
model: the emulated engine and ``plan.overlap`` do). In-cluster PD-P -> PD-D over RDMA is free. Both
are stated in the report.
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass

import simpy

from prfaas_sglang.engine.mock.scheduler import ChunkedPrefill, KvPool, PrefillJob
from prfaas_sglang.engine.mock.timing import EngineTiming
from prfaas_sglang.engine.mock.truth import ServiceTruth


@dataclass(eq=False)
class SimRequest:
    """One request's life. Times in model seconds; None until it happens."""

    rid: str
    arrival_s: float
    input_tokens: int
    output_tokens: int
    hash_ids: tuple[int, ...] = ()
    cluster: str | None = None
    prefill_node: str | None = None
    decode_node: str | None = None
    uncached_tokens: int | None = None
    kv_bytes: float = 0.0
    prefill_done_s: float | None = None
    kv_arrived_s: float | None = None
    first_token_s: float | None = None
    finish_s: float | None = None
    rejected: str | None = None
    lease: object = None
    dispatched_s: float | None = None  # when the router sent its legs (the router's TTFT starts here)
    entry: str | None = None  # the PD cluster it entered at (it decodes there); None: any (one global entry)

    @property
    def kv_tokens(self) -> int:  # the router's ``EngineRequest.kv_tokens``
        return self.input_tokens + self.output_tokens

    @property
    def input_ids(self) -> range:  # the router only takes its length
        return range(self.input_tokens)

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s

    @property
    def tbt_s(self) -> float | None:
        """Mean time between output tokens (None for a one-token answer or an unfinished one)."""
        if self.finish_s is None or self.first_token_s is None or self.output_tokens < 2:
            return None
        return (self.finish_s - self.first_token_s) / (self.output_tokens - 1)


class BlockCache:
    """One prefill node's prefix cache over the trace's 512-token blocks, LRU, with the events a
    real worker publishes (stored runs with the state at their end; evictions)."""

    def __init__(self, capacity_blocks: int):
        self.capacity_blocks = max(capacity_blocks, 1)
        self._lru: OrderedDict[int, None] = OrderedDict()
        self.states: set[int] = set()  # blocks that end a stored prompt: a linear state sits there

    def match(self, hash_ids: tuple[int, ...], hybrid: bool) -> int:
        """Leading blocks held (a hybrid model: up to the deepest one with a state)."""
        best = 0
        for depth, h in enumerate(hash_ids, 1):
            if h not in self._lru:
                break
            if not hybrid or h in self.states:
                best = depth
        return best

    def insert(self, hash_ids: tuple[int, ...]) -> tuple[list[int], int | None, list[int]]:
        """Cache the prompt's blocks; returns (new blocks, their parent, evicted blocks)."""
        new, parent = [], None
        for i, h in enumerate(hash_ids):
            if h in self._lru:
                self._lru.move_to_end(h)
            else:
                if not new:
                    parent = hash_ids[i - 1] if i else None
                new.append(h)
                self._lru[h] = None
        if hash_ids:
            self.states.add(hash_ids[-1])
        evicted = []
        while len(self._lru) > self.capacity_blocks:
            h, _ = self._lru.popitem(last=False)
            self.states.discard(h)
            evicted.append(h)
        return new, parent, evicted


class PrefillNode:
    def __init__(self, env: simpy.Environment, name: str, cluster: str, timing: EngineTiming, chunk_tokens: int | None,
                 on_done: Callable[[PrefillNode, SimRequest], None], cache_blocks: int, truth: ServiceTruth | None = None):
        self.env, self.name, self.cluster, self.timing = env, name, cluster, timing
        self.truth = truth or ServiceTruth()
        self.on_done = on_done
        self.queue = ChunkedPrefill(chunk_tokens, timing.prefill_s)
        self.cache = BlockCache(cache_blocks)
        self.jobs: dict[PrefillJob, SimRequest] = {}
        self.completed, self.busy_s = 0, 0.0
        self.retired = False
        self._wake = env.event()
        self.process = env.process(self._run())

    @property
    def idle(self) -> bool:
        return not self.jobs

    def submit(self, req: SimRequest, uncached_tokens: int) -> None:
        job = PrefillJob(max(uncached_tokens, 1), cost_factor=self.truth.prefill_factor())
        self.jobs[job] = req
        self.queue.add(job)
        if not self._wake.triggered:
            self._wake.succeed()

    def _run(self):
        while not self.retired:
            forward = self.queue.next_forward()
            if forward is None:
                self._wake = self.env.event()
                yield self._wake
                continue
            yield self.env.timeout(forward.duration_s)
            self.busy_s += forward.duration_s
            for job in self.queue.complete(forward):
                self.completed += 1
                self.on_done(self, self.jobs.pop(job))


_FIRST_TOKEN, _DONE = 0, 1  # a first token due at the same step as a finish is stamped first


class DecodeNode:
    def __init__(self, env: simpy.Environment, name: str, timing: EngineTiming, max_batch: int, pool_tokens: int,
                 on_finish: Callable[[DecodeNode, SimRequest], None], decode_bias: float = 1.0):
        self.env, self.name, self.timing, self.max_batch = env, name, timing, max_batch
        self.decode_bias = decode_bias  # the truth's mean step factor (steps are aggregated here: no per-step noise)
        self.on_finish = on_finish
        self.pool = KvPool(pool_tokens)
        self.waiting: deque[SimRequest] = deque()
        self.running: set[SimRequest] = set()
        self._due: list[tuple[float, int, int, SimRequest]] = []  # (step count, kind, tie, request)
        self._tie = itertools.count()
        self.steps, self._last_s, self._step_s = 0.0, env.now, 0.0
        self._context_sum = 0
        self.completed, self.busy_s = 0, 0.0
        self.retired = False
        self._wake = env.event()
        self._step_cache: dict[tuple[int, int], float] = {}
        self.process = env.process(self._run())

    @property
    def idle(self) -> bool:
        return not self.running and not self.waiting

    def arrive(self, req: SimRequest) -> None:
        self.waiting.append(req)
        if not self._wake.triggered:
            self._wake.succeed()

    def step_s(self, batch: int, context_tokens: float) -> float:
        key = (batch, int(context_tokens) >> 10)  # 1K-token buckets of context
        cached = self._step_cache.get(key)
        if cached is None:
            cached = self._step_cache[key] = self.timing.decode_step_s(batch, (key[1] << 10) + 512) * self.decode_bias
        return cached

    def _advance(self) -> None:
        now = self.env.now
        dt = now - self._last_s
        if dt > 0 and self.running:
            self.steps += dt / self._step_s
            self.busy_s += dt * len(self.running) / self.max_batch
        self._last_s = now

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.max_batch:
            req = self.waiting[0]
            if not self.pool.try_take(req.kv_tokens):
                break  # FCFS: the head waits for room
            self.waiting.popleft()
            self.running.add(req)
            self._context_sum += req.input_tokens + req.output_tokens // 2
            # its first token comes out of the first step it joins, its last after output_tokens steps
            tie = next(self._tie)
            heapq.heappush(self._due, (self.steps + 1, _FIRST_TOKEN, tie, req))
            heapq.heappush(self._due, (self.steps + req.output_tokens, _DONE, tie, req))

    def _pop_due(self) -> None:
        """Everything due by the current step count: first tokens stamped, finished sequences out."""
        while self._due and self._due[0][0] <= self.steps + 1e-9:
            _, kind, _, req = heapq.heappop(self._due)
            if req.first_token_s is None:
                req.first_token_s = self.env.now
            if kind == _DONE:
                self.running.discard(req)
                self._context_sum -= req.input_tokens + req.output_tokens // 2
                self.pool.give(req.kv_tokens)
                req.finish_s = self.env.now
                self.completed += 1
                self.on_finish(self, req)

    def _run(self):
        while not self.retired:
            self._advance()
            self._pop_due()
            self._admit()
            if not self.running:
                self._wake = self.env.event()
                yield self._wake
                continue
            self._step_s = self.step_s(len(self.running), self._context_sum / len(self.running))
            steps_left = max(self._due[0][0] - self.steps, 0.0)
            self._wake = self.env.event()
            yield self.env.timeout(steps_left * self._step_s) | self._wake


@dataclass
class _Flow:
    req: SimRequest
    target: float
    done: Callable[[SimRequest], None]


class SharedLink:
    """PrfaaS -> PD egress: processor sharing at ``capacity_bps``; telemetry like a worker's."""

    def __init__(self, env: simpy.Environment, capacity_bps: float):
        self.env, self.capacity_bps = env, capacity_bps
        self.flows: list[_Flow] = []
        self.served = 0.0  # bytes each flow in flight has received since the epoch
        self._last_s = env.now
        self._wake = env.event()
        self.delivered_bytes = 0.0
        self.busy_s = 0.0
        self.offered_bytes = 0.0
        self.process = env.process(self._run())

    def send(self, req: SimRequest, num_bytes: float, done: Callable[[SimRequest], None]) -> None:
        self._advance()
        self.flows.append(_Flow(req, self.served + num_bytes, done))
        self.offered_bytes += num_bytes
        self._kick()

    def set_capacity(self, capacity_bps: float) -> None:
        self._advance()
        self.capacity_bps = capacity_bps
        self._kick()

    def backlog_bytes(self) -> float:
        return sum(f.target - self.served for f in self.flows)

    def _kick(self) -> None:
        if not self._wake.triggered:
            self._wake.succeed()

    def _advance(self) -> None:
        now = self.env.now
        dt = now - self._last_s
        if dt > 0 and self.flows:
            per_flow = self.capacity_bps / 8.0 / len(self.flows) * dt
            self.served += per_flow
            self.delivered_bytes += per_flow * len(self.flows)
            self.busy_s += dt
        self._last_s = now

    def _run(self):
        while True:
            self._advance()
            done = [f for f in self.flows if f.target <= self.served + 1e-6]
            if done:
                self.flows = [f for f in self.flows if f.target > self.served + 1e-6]
                for f in done:
                    f.done(f.req)
            if not self.flows:
                self._wake = self.env.event()
                yield self._wake
                continue
            nearest = min(f.target for f in self.flows) - self.served
            rate = self.capacity_bps / 8.0 / len(self.flows)
            self._wake = self.env.event()
            yield self.env.timeout(max(nearest / rate, 1e-9)) | self._wake
