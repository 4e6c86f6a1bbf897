"""The emulated worker's state and request flows (asyncio; no HTTP types here).

PD protocol between emulated workers (SGLang's, at the granularity the
router sees: the same body with ``bootstrap_host/port/room`` goes to both;
message types and versions in :mod:`prfaas_sglang.wire.handoff`)::

    router ──body──> prefill                         router ──body──> decode
                      │                                                 │ 1. wait for KV-pool room (tokens),
                      │                                                 │    carve a landing region (bytes)
                      │ 2. queue, prefill for T(l_uncached), cache pages (KV events), meanwhile
                      │ <── POST /prfaas/register  Registration{room, session, addr, length, notify_url}
                      │ 3. Mooncake TCP write, 1 MiB slices: S_kv(l) * kv_scale bytes ──> region
                      │ 4. POST notify_url  KvReady{room, ok, first_token, ...} ─────────> │ 5. check the bytes
       <── 200 (KV shipped, like SGLang's prefill)                                        │    arrived, free the region
                                                                                         │ 6. continuous-batch decode
                                                                          <── tokens (stream or not)

With ``decode_radix_cache`` (SGLang's ``--disaggregation-decode-enable-radix-cache``)
the decode worker keeps finished sequences (prompt + output) in its own prefix
cache, matches each new prompt there at step 1 and registers the match as
``decode_prefix_len``; the prefill worker then ships only the KV beyond it
(``EngineTiming.kv_bytes_beyond``: later pages plus the whole recurrent state).
For a linear-attention hybrid it follows ``hooks/decode_radix`` (patch 0001): full-attention pages
whatever their checkpoints, a page short of one the match would end at
(``PrefixCache.decode_reusable_tokens``); sliding-window profiles are refused, as SGLang 0.5.15
refuses them. The decode cache publishes its KV events like SGLang's decode tree (the router
prefers the decode worker holding a prompt's prefix; a decode worker's holdings credit no
cluster's prefill). Simplification: that cache has its own capacity (``cache_tokens``) instead of
sharing the pool (SGLang evicts cached pages on demand, so admission is the same while eviction
is free).

Decode KV is accounted in tokens, as SGLang's pool is: a sequence holds
``prompt + max_new_tokens`` from step 1 until :meth:`MockEngine.finish`. A
decode request that does not fit waits (SGLang's prealloc queue) up to
``bootstrap_timeout_s``, then fails 503; so does one that finds no landing
space. The prefill waits as long for its decode partner (503); the decode as
long for its KV (504). Every path frees what it took in ``finally``.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import aiohttp
import orjson

from prfaas_sglang._pin import PINNED_SGLANG_VERSION
from prfaas_sglang.adapters import tcpinfo
from prfaas_sglang.engine.mock.detokenize import REPLACEMENT
from prfaas_sglang.engine.mock.kv_transport import PATTERN, KvEndpoint, KvTransferError
from prfaas_sglang.engine.mock.prefix_cache import PrefixCache
from prfaas_sglang.engine.mock.scheduler import ChunkedPrefill, KvPool, PrefillJob, admit
from prfaas_sglang.engine.mock.timing import DECODE_MAX_DEBT_S, EngineTiming, Pacer
from prfaas_sglang.engine.mock.truth import ServiceTruth, forward_costs
from prfaas_sglang.envs import envs
from prfaas_sglang.hosts import local_host
from prfaas_sglang.kvindex.admission import PrefixAdmission
from prfaas_sglang.plan.overlap import STREAM_GROUPS, ready_bytes
from prfaas_sglang.protocol import BadRequest, EngineRequest, output_token, prompt_seed
from prfaas_sglang.roles import ROLE_SPECS, Role
from prfaas_sglang.security import check_peer
from prfaas_sglang.transport.meter import LinkMeter, with_tcp_view
from prfaas_sglang.transport.tcpstate import TcpCongestion
from prfaas_sglang.wire.auth import (
    AUTH_HEADER,
    AuthError,
    DeploymentKeys,
    ReplayGuard,
    sign,
    verify,
)
from prfaas_sglang.wire.cache_move import CacheExport, CacheImport, CacheImported
from prfaas_sglang.wire.handoff import KvReady, Registration
from prfaas_sglang.wire.kv_events import KV_EVENTS_TOPIC, AllBlocksCleared, split_state_events
from prfaas_sglang.wire.role_switch import RoleSwitchReply
from prfaas_sglang.wire.telemetry import TELEMETRY_TOPIC

PSEUDO_VOCAB = 32_000


@dataclass(frozen=True)
class MockConfig:
    role: Role
    host: str
    port: int
    profile: str
    served_model_name: str
    bootstrap_port: int | None = None
    kv_events_port: int | None = None
    telemetry_port: int | None = None
    speedup: float = 1.0
    kv_scale: float = 0.01
    max_batch: int | None = None
    page_size: int = 512
    stream_interval: int = 1  # SGLang's --stream-interval: a stream's chunk every Nth token (and its last)
    cache_tokens: int = 2_097_152
    context_tokens: int = 131_072
    max_total_tokens: int | None = None  # decode KV pool; None: the profile's
    chunked_prefill_size: int | None = 8192  # SGLang's --chunked-prefill-size; None: no chunking (SGLang's -1)
    kv_buffer_bytes: int = 1 << 30  # decode landing buffer
    bootstrap_timeout_s: float = 300.0  # SGLang's SGLANG_DISAGGREGATION_{BOOTSTRAP,WAITING}_TIMEOUT
    decode_radix_cache: bool = False  # SGLang's --disaggregation-decode-enable-radix-cache (decode role)
    prefill_cache: str = "all"  # prefill roles: which prefills the cache keeps (kvindex/admission.py; PRFAAS_PREFILL_CACHE)
    prefill_cache_min_shared_tokens: int = 1024  # PRFAAS_PREFILL_CACHE_MIN_SHARED_TOKENS
    chunk_checkpoints: bool = True  # hybrid: a state checkpoint per chunk, not only at the end (PRFAAS_STATE_CHECKPOINTS)
    tokenizer: str | None = None  # what the tokenizer was loaded from, for /server_info
    enable_pd_role_switch: bool = False  # serve /pd_role_switch (SGLang 0.5.23's --enable-pd-role-switch)
    keys: DeploymentKeys | None = None  # the deployment secret's keys (security.load_keys); None: no authentication
    peer_hosts: frozenset[str] | None = None  # hosts KV may go to or come from (security.peer_hosts); None: any
    # the SGLang release this worker reports (/server_info and /v1/loads ``version``; a router renders chat tools
    # as that release does): a supported one, the pin by default
    sglang_release: str = PINNED_SGLANG_VERSION

    @property
    def advertise_host(self) -> str:
        return local_host(self.host)

    @property
    def mode(self) -> str:
        return ROLE_SPECS[self.role].disaggregation_mode


@dataclass
class _Written:
    """A streamed prefill's progress: tokens of its uncached part whose KV every layer group has written
    (fractional inside a forward); ``wake`` is set whenever it moves or the prefill ends."""

    wake: asyncio.Event
    tokens: float = 0.0


@dataclass(frozen=True)
class _Stream:
    """What :meth:`MockEngine._ship` needs of a prefill still running: its progress and its task."""

    written: _Written
    computing: asyncio.Future


def async_send(role: Role) -> bool:
    """Whether a prefill worker of ``role`` sends KV through the kv-send hooks' sender: a PrfaaS
    worker does, as the launcher has SGLang's do; the in-cluster prefill keeps SGLang's way.
    ``PRFAAS_KV_ASYNC_SEND`` decides where it is set."""
    return envs.KV_ASYNC_SEND.get() if envs.KV_ASYNC_SEND.is_set() else role is Role.PRFAAS


@dataclass
class Sequence:
    req: EngineRequest
    seed: int
    tokens: list[int]
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: bool = False
    pool_tokens: int = 0  # decode KV-pool tokens held; returned by finish()
    ready: KvReady | None = None  # the prefill's report
    decode_prefix_len: int = 0  # prompt tokens the decode worker's own prefix cache supplied

    @property
    def done(self) -> bool:
        return len(self.tokens) >= self.req.max_new_tokens


@dataclass
class Stats:
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generation_tokens: int = 0
    kv_bytes_sent: int = 0
    kv_bytes_received: int = 0
    kv_transfer_s: float = 0.0
    requests_ok: int = 0
    requests_failed: int = 0
    room_waits: int = 0  # decode requests that found the pool or the landing buffer full and waited
    decode_prefix_tokens: int = 0  # decode: prompt tokens found in the decode-side prefix cache (not shipped)
    prefix_imported_tokens: int = 0  # prefill: prefix tokens imported from another cluster's worker
    prefix_export_bytes: int = 0  # prefill: bytes of cached prefixes sent to another cluster's worker
    auth_rejected: collections.Counter = field(default_factory=collections.Counter)  # reason -> refused requests
    # The emulation's own timing error: what the forwards and decode steps were to take (wall) and what they
    # took (a busy event loop or machine wakes the sleeps late; a decode step counts from when it was due,
    # so the work between steps is in it too). Their ratio is the engine's timing error.
    forward_intended_s: float = 0.0
    forward_actual_s: float = 0.0


class MockEngine:
    """One emulated worker. ``start()`` opens Mooncake and ZMQ; ``stop()`` closes them.

    ``tokenizer`` (a :class:`~prfaas_sglang.tokenizer.PromptTokenizer`) makes text and
    chat prompts real token ids and outputs real text; without one, prompts must be
    ids or fall back to one pseudo-token per word, and outputs read `` t<id>``.
    """

    def __init__(self, config: MockConfig, timing: EngineTiming, tokenizer=None, truth: ServiceTruth | None = None):
        self.config, self.timing, self.tokenizer = config, timing, tokenizer
        self.truth = truth or ServiceTruth()  # what it really takes, apart from the profile (never reported)
        # State checkpoints where SGLang takes them: each chunk's end (with chunked prefill), and the prompt's end.
        interval = config.chunked_prefill_size if config.chunk_checkpoints else None
        self.cache = PrefixCache(config.page_size, max(config.cache_tokens // config.page_size, 1), timing.hybrid,
                                 checkpoint_interval_tokens=interval)
        # Which prefills the cache keeps (the same policy object as the SGLang cache backend's).
        self.admission = PrefixAdmission(config.prefill_cache, config.prefill_cache_min_shared_tokens,
                                         capacity_tokens=self.cache.capacity_blocks * config.page_size)
        self.stats = Stats()
        self.kv: KvEndpoint | None = None
        self.publisher = None
        self.telemetry = None
        self.http: aiohttp.ClientSession | None = None
        self.ready = False
        self.running: list[Sequence] = []
        self.prefill_inflight_reqs = 0  # prefill: requests inside the worker (queued, computing or shipping)
        self.prefill_inflight_tokens = 0  # and their prompt tokens
        self.prefills, self.pool = self._queues()
        self._prefill_done: dict[PrefillJob, asyncio.Future] = {}
        # Streaming by layer group (PRFAAS_KV_LAYERWISE, as the kv-layerwise hooks on SGLang): what of each
        # job's KV the forwards have written so far, and a wake-up for its shipper.
        self.layerwise = bool(envs.KV_LAYERWISE.get())
        self._written: dict[PrefillJob, _Written] = {}
        self._prefill_wake = asyncio.Event()
        self._decode_waiting = 0  # decode: waiting for pool room, for KV, or for a batch slot
        self._room = asyncio.Condition()  # decode: signalled when pool tokens or landing bytes are freed
        self._decode_queue: collections.deque[Sequence] = collections.deque()
        self._wake = asyncio.Event()
        self._rooms: dict[int, asyncio.Future] = {}  # prefill: room -> Registration
        self._pending: dict[int, asyncio.Future] = {}  # decode: room -> KvReady
        self._tasks: list[asyncio.Task] = []
        self._recent: collections.deque[tuple[float, int]] = collections.deque(maxlen=512)
        self.fail_kv_transfers = 0  # fault injection (POST /prfaas/faults): fail this many next KV transfers
        self.fail_role_switch = False  # fault injection: the next role switch fails while rebuilding
        self.unhealthy: str | None = None  # why a failed role switch left this worker unusable until restarted
        self._switching = False
        self.meter = LinkMeter(window_s=1.0)  # writes of ~0.1 s: a shorter window sees too few of them on a slow link
        self._transfer_ids = itertools.count()
        self._replay = ReplayGuard()
        if tokenizer is not None:  # what the emulated model says: tokens that are whole characters on their own
            special = tokenizer.special_ids  # (a byte of a longer one is held by a stream's detokenizer: no text)
            self._vocab = [i for i in range(tokenizer.vocab_size)
                           if i not in special and (text := tokenizer.decode([i])) and REPLACEMENT not in text]
        else:
            self._vocab = None

    # --- lifecycle -------------------------------------------------------------------

    async def start(self) -> None:
        cfg = self.config
        from prfaas_sglang.adapters.zmq import ZmqPublisher

        if cfg.kv_events_port is not None:
            self.publisher = ZmqPublisher(f"tcp://{self._bind_host}:{cfg.kv_events_port}", KV_EVENTS_TOPIC,
                                          curve=self._curve())
        self.http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60),
                                          headers=cfg.keys.bearer() if cfg.keys else None)
        await self._open_role()
        self.ready = True

    async def stop(self) -> None:
        self.ready = False
        await self._close_role()
        if self.http:
            await self.http.close()
        if self.publisher:
            self.publisher.close()

    def _queues(self) -> tuple[ChunkedPrefill, KvPool]:
        """Fresh scheduler state: the chunked-prefill queue and the decode KV pool (tokens)."""
        costs = forward_costs(self.timing)
        return (ChunkedPrefill(self.config.chunked_prefill_size, self.timing.prefill_s,
                               forward_s=lambda pieces: self.truth.forward_s(pieces, costs)),
                KvPool(self.config.max_total_tokens or self.timing.kv_pool_tokens))

    def _slowdown(self) -> float:
        """The truth's slow-period factor now (its clock: emulated seconds, this process's monotonic x speedup)."""
        return self.truth.slowdown(time.monotonic() * self.timing.speedup)

    @property
    def _bind_host(self) -> str:
        return f"[{self.config.host}]" if ":" in self.config.host else self.config.host  # the configured interface only

    def _curve(self):
        from prfaas_sglang.adapters.zmq import CurveKeys

        return CurveKeys.from_deployment(self.config.keys)

    async def _open_role(self) -> None:
        """What the current role needs beside the HTTP servers: the Mooncake endpoint (prefill: room to
        import one context's prefix next to the source; decode: the landing buffer), the role's loop,
        and, for prefill, the link-telemetry socket (its own: the KV-event stream stays SGLang's)."""
        cfg = self.config
        if cfg.mode == "prefill":
            source = self.timing.kv_bytes(cfg.context_tokens)
            self.kv = await asyncio.to_thread(KvEndpoint, cfg.advertise_host, source, source, async_send(cfg.role))
            self._tasks.append(asyncio.create_task(self._prefill_loop(), name="prefill-loop"))
            if cfg.telemetry_port is not None:
                from prfaas_sglang.adapters.zmq import ZmqPublisher

                self.telemetry = ZmqPublisher(f"tcp://{self._bind_host}:{cfg.telemetry_port}", TELEMETRY_TOPIC.decode(),
                                              curve=self._curve())
                self._tasks.append(asyncio.create_task(self._telemetry_loop(), name="telemetry"))
        else:
            self.kv = await asyncio.to_thread(KvEndpoint, cfg.advertise_host, 0, cfg.kv_buffer_bytes)
            self._tasks.append(asyncio.create_task(self._decode_loop(), name="decode-loop"))

    async def _close_role(self) -> None:
        """Undo :meth:`_open_role` (the loops end, the endpoint and the telemetry socket close)."""
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self.telemetry:
            self.telemetry.close()
            self.telemetry = None
        if self.kv:
            self.kv.close()
            self.kv = None

    # --- role switch (upstream's /pd_role_switch) ------------------------------------------

    @property
    def idle(self) -> bool:
        """Nothing in flight: no request computing, queued, decoding, holding pool room or a bootstrap room."""
        return (not self.running and self.waiting == 0 and not self._rooms and not self._pending
                and not self._prefill_done and not self._decode_queue and self.pool.used_tokens == 0)

    async def switch_role(self, new_role: str) -> RoleSwitchReply:
        """Turn this PD worker into a ``new_role`` ("prefill" | "decode") worker, as SGLang 0.5.23's
        ``Scheduler.handle_pd_role_switch`` does: refused unless enabled, PD-cluster, healthy, not already
        switching and idle (the caller drains first; nothing is taken from a request); the same role is
        a no-op. The transfer side is torn down and rebuilt in the new role and the prefix cache is
        emptied (one ``AllBlocksCleared`` event tells the kv-index). A rebuild that fails leaves the
        worker unhealthy (``/health`` 503, every later switch refused) until it is restarted."""
        old = self.config.mode
        if not self.config.enable_pd_role_switch:
            return RoleSwitchReply(False, "role switching is off (start the worker with --enable-pd-role-switch)", old)
        if self.config.role not in (Role.PD_PREFILL, Role.PD_DECODE):
            return RoleSwitchReply(False, f"a {self.config.role.value} worker does not switch roles (PD-cluster workers only)", old)
        if self.unhealthy is not None:
            return RoleSwitchReply(False, f"instance unhealthy ({self.unhealthy}); restart required", old,
                                   safe_to_restore=False)
        if self._switching:
            return RoleSwitchReply(False, "a role switch is already in progress", old)
        if new_role == old:
            return RoleSwitchReply(True, "already in target role", old, new_role)
        if not self.idle:
            return RoleSwitchReply(False, f"instance is not idle ({len(self.running)} running, {self.waiting} waiting, "
                                          f"{self.open_rooms} open rooms); drain it first", old)
        self._switching, self.ready = True, False
        try:
            await self._close_role()
            self.config = dataclasses.replace(self.config, role=Role.PD_PREFILL if new_role == "prefill" else Role.PD_DECODE)
            self.flush_cache()
            self.prefills, self.pool = self._queues()
            if self.fail_role_switch:
                self.fail_role_switch = False
                raise RuntimeError("injected fault (POST /prfaas/faults fail_role_switch)")
            await self._open_role()
        except (RuntimeError, OSError, KvTransferError) as err:
            self.unhealthy = f"rebuilding as {new_role} failed: {err}"
            return RoleSwitchReply(False, f"{self.unhealthy}; the instance is unhealthy, restart required", old, new_role,
                                   safe_to_restore=False)
        finally:
            self._switching = False
        self.ready = True
        return RoleSwitchReply(True, f"switched from {old} to {new_role}", old, new_role)

    # --- shared ----------------------------------------------------------------------

    @property
    def waiting(self) -> int:
        """Requests queued: for prefill (not started), or for decode room, KV or a batch slot."""
        return self.prefills.waiting_jobs + self._decode_waiting

    @property
    def waiting_uncached_tokens(self) -> int:
        """Prefill tokens still to compute (queued and part-done requests)."""
        return self.prefills.remaining_tokens

    @property
    def load_tokens(self) -> tuple[int, int, int]:
        """(running requests, KV tokens in use, KV tokens in use or pending) as SGLang's ``/v1/loads``
        counts them: a decode worker's pool; a prefill worker's requests past its waiting queue
        (computing, or holding KV until it ships), pending = those still waiting. A prefill worker's
        prefix cache is evictable and, as in SGLang (``pool_stats_observer``), not counted."""
        if self.config.mode == "decode":
            return len(self.running), self.used_tokens, self.used_tokens
        waiting_reqs = self.prefills.waiting_jobs
        used = max(self.prefill_inflight_tokens - self.prefills.waiting_tokens, 0)
        return max(self.prefill_inflight_reqs - waiting_reqs, 0), used, self.prefill_inflight_tokens

    @property
    def max_total_tokens(self) -> int:
        return self.pool.total_tokens

    @property
    def used_tokens(self) -> int:
        return self.pool.used_tokens

    @property
    def open_rooms(self) -> int:
        """Bootstrap rooms this worker still tracks (prefill: registrations; decode: awaited KV)."""
        return len(self._rooms) + len(self._pending)

    def output_token(self, seed: int, position: int) -> int:
        if self._vocab is None:
            return output_token(seed, position, PSEUDO_VOCAB)
        return self._vocab[output_token(seed, position, len(self._vocab))]

    def detokenize(self, ids) -> str:
        if self.tokenizer is None:
            return "".join(f" t{t}" for t in ids)
        return self.tokenizer.decode(ids)

    def check_length(self, req: EngineRequest) -> None:
        total = req.kv_tokens
        if total > self.config.context_tokens:
            raise BadRequest(400, f"prompt ({len(req.input_ids)}) + max_new_tokens ({req.max_new_tokens}) = {total} "
                                  f"exceeds the context length {self.config.context_tokens}")

    def check_vocab(self, req: EngineRequest) -> None:
        """With a tokenizer (the emulated model's vocabulary), prompt ids outside it get 400, as
        on a real worker (the ``input-ids-in-vocab`` hook)."""
        if self.tokenizer is not None and req.input_ids:
            vocab = self.tokenizer.vocab_size
            if max(req.input_ids) >= vocab:
                raise BadRequest(400, f"input_ids contain {max(req.input_ids)}, outside the model's vocabulary [0, {vocab})")

    def flush_cache(self) -> None:
        self.cache.clear()
        if self.publisher:
            self.publisher.publish([AllBlocksCleared()], time.time(), [] if self.cache.hybrid else None)

    def gen_throughput(self) -> float:
        now = time.monotonic()
        recent = [n for t, n in self._recent if now - t < 5.0]
        return sum(recent) / 5.0

    # --- prefill side ----------------------------------------------------------------

    # --- authentication (wire.auth; PRFAAS_SECRET_FILE) ----------------------------------

    def authenticate(self, header: str | None, method: str, path: str, body: bytes) -> None:
        """Check a signed hand-off (register, kv_ready, cache export) before acting on it: the
        deployment's MAC, fresh, not seen before. No-op without a secret. Raises :class:`AuthError`
        (counted by reason)."""
        keys = self.config.keys
        if keys is None:
            return
        try:
            now_s = time.time()
            self._replay.check(verify(keys.handoff_key, header, method, path, body, now_s), now_s)
        except AuthError as err:
            self.stats.auth_rejected[err.reason] += 1
            raise

    def check_peer(self, host_or_url: str, what: str) -> None:
        """Refuse (403, counted) a host outside ``PRFAAS_PEER_HOSTS`` that KV would go to or come from."""
        try:
            check_peer(self.config.peer_hosts, host_or_url, what)
        except AuthError as err:
            self.stats.auth_rejected[err.reason] += 1
            raise BadRequest(403, str(err)) from None

    def _post_signed(self, url: str, payload: dict, **kwargs):
        """POST ``payload`` as JSON to another worker, signed when the deployment has a secret."""
        body = orjson.dumps(payload)
        headers = {"Content-Type": "application/json"}
        if self.config.keys is not None:
            headers[AUTH_HEADER] = sign(self.config.keys.handoff_key, "POST", urlsplit(url).path, body, time.time())
        return self.http.post(url, data=body, headers=headers, **kwargs)

    def _room_future(self, room: int) -> asyncio.Future:
        future = self._rooms.get(room)
        if future is None:
            future = asyncio.get_running_loop().create_future()
            self._rooms[room] = future
        return future

    def register_decode(self, registration: Registration) -> None:
        """Bootstrap server: a decode worker says where a room's KV goes (authenticated by the caller)."""
        self.check_peer(registration.notify_url, "notify_url host")
        self.check_peer(registration.session, "KV destination")
        room = registration.room
        future = self._room_future(room)
        if future.done():
            raise BadRequest(409, f"bootstrap room {room} is already registered")
        future.set_result(registration)
        # A registration nobody claims (its prefill never arrives) is dropped after the timeout.
        asyncio.get_running_loop().call_later(self.config.bootstrap_timeout_s, self._drop_room, room, future)

    def _drop_room(self, room: int, future: asyncio.Future) -> None:
        if self._rooms.get(room) is future:
            del self._rooms[room]

    async def prefill(self, req: EngineRequest) -> KvReady:
        """Run one prefill and ship its KV; returns the hand-off the decode worker was sent."""
        if req.bootstrap is None:
            raise BadRequest(400, "this is a PD prefill server: requests need bootstrap_host, bootstrap_port, bootstrap_room")
        self.check_length(req)
        room = req.bootstrap.room
        future = self._room_future(room)
        deadline = time.monotonic() + self.config.bootstrap_timeout_s
        self.prefill_inflight_reqs += 1
        self.prefill_inflight_tokens += len(req.input_ids)
        try:
            # Like SGLang, compute at once; the decode's registration is needed only to ship.
            # The last prompt token is always computed (its logits give the first output
            # token), so an exact repeat reuses at most the pages before it.
            match = self.cache.match(req.input_ids[:-1])
            # Prefix cache or transfer cache (decided at the match, as the SGLang backend does): a
            # transfer-cache prefill is never inserted; its KV is the request's until shipped.
            decision = self.admission.decide(req.input_ids, match.cached_tokens, req.checkpoint_tokens)
            job = PrefillJob(len(req.input_ids) - match.cached_tokens, cost_factor=self.truth.prefill_factor())
            written = _Written(asyncio.Event()) if self.layerwise else None
            computing = asyncio.ensure_future(self._compute_and_keep(req, job, decision, written))
            try:
                if written is None:  # the KV leaves once the prefill is done (SGLang without the layerwise hooks)
                    await computing
                try:
                    registration: Registration = await asyncio.wait_for(asyncio.shield(future),
                                                                        max(deadline - time.monotonic(), 0.001))
                except asyncio.TimeoutError:
                    raise BadRequest(503, f"no decode worker registered bootstrap room {room} within "
                                          f"{self.config.bootstrap_timeout_s:g} s") from None
                return await self._ship(req, registration, match.cached_tokens, _Stream(written, computing)
                                        if written is not None else None)
            finally:
                if not computing.done():
                    computing.cancel()
        finally:
            self.prefill_inflight_reqs -= 1
            self.prefill_inflight_tokens -= len(req.input_ids)
            if self._rooms.get(room) is future:
                del self._rooms[room]
            if not future.done():
                future.cancel()

    async def _compute_and_keep(self, req: EngineRequest, job: PrefillJob, decision, written: _Written | None) -> None:
        """Prefill ``job`` (its KV written layer group by layer group into ``written``, when streaming), then keep
        what the cache admission decided and publish its KV events."""
        if written is not None:
            self._written[job] = written
        try:
            await self._compute(job)
        finally:
            self._written.pop(job, None)
            if written is not None:
                written.wake.set()
        if decision.keep:  # a state also where the request asked for one (a router's checkpoint hint)
            asked = () if req.checkpoint_tokens is None else (req.checkpoint_tokens,)
            kept = req.input_ids if decision.keep_tokens is None else req.input_ids[: decision.keep_tokens]
            events, states = split_state_events(self.cache.insert(kept, checkpoints_at=asked))
            if self.publisher:  # a hybrid model's cache reports its state checkpoints (wire v2)
                self.publisher.publish(events, time.time(), states if self.cache.hybrid else None)

    async def _compute(self, job: PrefillJob) -> None:
        """Queue ``job`` for the prefill loop and wait until its last chunk is computed."""
        done = asyncio.get_running_loop().create_future()
        self._prefill_done[job] = done
        self.prefills.add(job)
        self._prefill_wake.set()
        try:
            await done
        finally:
            self._prefill_done.pop(job, None)
            self.prefills.remove(job)  # abandoned: its remaining chunks are not computed

    async def _prefill_loop(self) -> None:
        """One forward at a time: chunked prefill with a shared token budget (``scheduler.ChunkedPrefill``)."""
        while True:
            forward = self.prefills.next_forward()
            if forward is None:
                self._prefill_wake.clear()
                await self._prefill_wake.wait()
                continue
            began, duration_s = time.perf_counter(), forward.duration_s * self._slowdown()
            if self.layerwise:
                await self._forward_by_layer_group(forward, duration_s)
            else:
                await asyncio.sleep(duration_s)
            self.stats.forward_intended_s += duration_s
            self.stats.forward_actual_s += time.perf_counter() - began
            for job in self.prefills.complete(forward):
                done = self._prefill_done.get(job)
                if done is not None and not done.done():
                    done.set_result(None)

    async def _forward_by_layer_group(self, forward, duration_s: float) -> None:
        """Run ``forward`` as :data:`STREAM_GROUPS` equal steps; after step ``k`` each piece has written ``k/G`` of
        its tokens' KV (every layer group of them up to ``k``), which its shipper may send at once."""
        for k in range(1, STREAM_GROUPS + 1):
            await asyncio.sleep(duration_s / STREAM_GROUPS)
            for piece in forward.pieces:
                written = self._written.get(piece.job)
                if written is not None:
                    written.tokens = piece.start + (piece.end - piece.start) * k / STREAM_GROUPS
                    written.wake.set()

    async def _ship(self, req: EngineRequest, registration: Registration, cached_tokens: int,
                    stream: _Stream | None = None) -> KvReady:
        """Send the request's KV beyond what the decode holds, and tell the decode worker. ``stream``: the
        prefill is still running; each layer group's KV goes as soon as it is written."""
        first_token = self.output_token(prompt_seed(req.input_ids), 0)
        room = req.bootstrap.room
        transfer_s, error = None, None
        held = registration.decode_prefix_len
        length = self.timing.kv_bytes_beyond(len(req.input_ids), min(held, len(req.input_ids)))
        if held >= len(req.input_ids):
            error = f"decode_prefix_len {held} leaves nothing of the {len(req.input_ids)}-token prompt to ship"
        elif length > registration.length:
            error = f"decode region of {registration.length} bytes is smaller than the KV ({length})"
        else:
            start = time.perf_counter()
            try:
                if self.fail_kv_transfers > 0:  # metered as a failed transfer, as a broken link's would be
                    self.fail_kv_transfers -= 1
                    self._metered_failure(length, registration.session)
                    raise KvTransferError("injected fault: the KV transfer failed (POST /prfaas/faults)")
                if stream is None:
                    await self._write_metered(registration, 0, length)
                else:
                    await self._write_streamed(req, registration, cached_tokens, length, stream)
                transfer_s = time.perf_counter() - start
            except KvTransferError as err:
                error = str(err)
        ready = KvReady(room, error is None, length, cached_tokens, first_token, transfer_s, error)
        try:
            async with self._post_signed(registration.notify_url, ready.to_json()) as resp:
                resp.raise_for_status()
        except (aiohttp.ClientError, asyncio.TimeoutError) as err:
            error = error or f"cannot notify the decode worker: {err or type(err).__name__}"
        if error is not None:
            self.stats.requests_failed += 1
            raise BadRequest(502, f"KV transfer for bootstrap room {room} failed: {error}")
        self.stats.kv_bytes_sent += length
        self.stats.kv_transfer_s += transfer_s
        self.stats.prompt_tokens += len(req.input_ids)
        self.stats.cached_tokens += cached_tokens
        self.stats.requests_ok += 1
        return ready

    def _metered_failure(self, length: int, session: str) -> None:
        transfer_id = next(self._transfer_ids)
        self.meter.start(transfer_id, time.monotonic(), length, session)
        self.meter.end(transfer_id, time.monotonic(), False)

    async def _write_metered(self, registration: Registration, offset: int, length: int) -> None:
        """Bytes ``[offset, offset + length)`` of the request's KV into its decode region, as one metered transfer."""
        transfer_id = next(self._transfer_ids)
        self.meter.start(transfer_id, time.monotonic(), length, registration.session)
        ok = False
        try:
            await self.kv.write(registration.session, registration.addr + offset, length,
                                lambda n, since_s, tid=transfer_id: self.meter.progress(tid, time.monotonic(), n, since_s))
            ok = True
        finally:
            self.meter.end(transfer_id, time.monotonic(), ok)

    async def _write_streamed(self, req: EngineRequest, registration: Registration, cached_tokens: int, length: int,
                              stream: _Stream) -> None:
        """Send what the prefill has written and the link has not carried, in one write each time, until all
        ``length`` bytes are across: the full-attention KV as its layer groups are written (cached tokens from
        the start), the state at the end. Raises what the prefill raised (it was abandoned or failed)."""
        total, held = len(req.input_ids), min(registration.decode_prefix_len, len(req.input_ids))
        stream_bytes = max(length - self.timing.kv_bytes_beyond(total, total), 0)  # all but the state at the end
        sent = 0
        while sent < length:
            stream.written.wake.clear()
            done = stream.computing.done()
            if done:
                stream.computing.result()  # the prefill's own error, if it failed
            ready_tokens = total if done else cached_tokens + stream.written.tokens
            ready = ready_bytes(stream_bytes, length, total, held, ready_tokens)
            if ready > sent:
                await self._write_metered(registration, sent, ready - sent)
                sent = ready
            elif not done:
                await stream.written.wake.wait()

    async def export_prefix(self, msg: CacheExport) -> dict:
        """Source: write the KV and state of a prefix this worker holds to another worker's region
        (metered like a PD transfer: it crosses the same link). 409 when it no longer holds it."""
        if self.config.mode != "prefill":
            raise BadRequest(400, "only a prefill worker exports cached prefixes")
        self.check_peer(msg.session, "export destination")
        ids = msg.token_ids[:msg.num_tokens]
        held = self.cache.match(ids).cached_tokens
        if held < msg.num_tokens:
            raise BadRequest(409, f"this worker holds {held} of the {msg.num_tokens} prefix tokens")
        length = self.timing.kv_bytes(msg.num_tokens)
        if length > msg.length:
            raise BadRequest(400, f"the region of {msg.length} bytes is smaller than the prefix's KV ({length})")
        transfer_id = next(self._transfer_ids)
        start = time.perf_counter()
        self.meter.start(transfer_id, time.monotonic(), length, msg.session)
        ok = False
        try:
            if self.fail_kv_transfers > 0:
                self.fail_kv_transfers -= 1
                raise KvTransferError("injected fault: the KV transfer failed (POST /prfaas/faults)")
            await self.kv.write(msg.session, msg.addr, length,
                                lambda n, since_s, tid=transfer_id: self.meter.progress(tid, time.monotonic(), n, since_s))
            ok = True
        except KvTransferError as err:
            raise BadRequest(502, f"exporting {msg.num_tokens} prefix tokens failed: {err}") from None
        finally:
            self.meter.end(transfer_id, time.monotonic(), ok)
        self.stats.prefix_export_bytes += length
        return {"bytes": length, "transfer_s": time.perf_counter() - start}

    async def import_prefix(self, msg: CacheImport) -> CacheImported:
        """Target: fetch a prefix's KV and state from ``msg.source_url`` into a landing region, check
        the bytes arrived, then keep the prefix (page-aligned) as a prefix-cache entry, publishing its
        KV events (and, hybrid, a state checkpoint at its end). The region is freed on every path."""
        if self.config.mode != "prefill":
            raise BadRequest(400, "only a prefill worker imports cached prefixes")
        self.check_peer(msg.source_url, "import source")
        num_tokens = msg.num_tokens // self.cache.page_size * self.cache.page_size
        if num_tokens == 0:
            raise BadRequest(400, f"{msg.num_tokens} tokens is less than one page ({self.cache.page_size})")
        if num_tokens > self.config.context_tokens:
            raise BadRequest(400, f"{num_tokens} prefix tokens exceed the context length {self.config.context_tokens}")
        ids = msg.token_ids[:num_tokens]
        held = self.cache.match(ids).cached_tokens
        if held >= num_tokens:
            return CacheImported(0, held, 0, None)
        length = self.timing.kv_bytes(num_tokens)
        offset = self.kv.arena.alloc(length)
        if offset is None:
            raise BadRequest(503, f"no landing room for {length} bytes ({self.kv.arena.free_bytes} free)")
        try:
            region = self.kv.region(offset, length)
            region[:8] = 0
            region[-8:] = 0
            export = CacheExport(ids, num_tokens, self.kv.session, self.kv.base + offset, length)
            try:
                async with self._post_signed(msg.source_url.rstrip("/") + "/prfaas/cache/export", export.to_json(),
                                             timeout=aiohttp.ClientTimeout(total=msg.timeout_s)) as resp:
                    status, answer = resp.status, await resp.json(content_type=None)
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as err:
                raise BadRequest(502, f"cannot fetch the prefix from {msg.source_url}: {err or type(err).__name__}") from None
            if status != 200:
                error = answer.get("error") if isinstance(answer, dict) else None
                detail = error.get("message") if isinstance(error, dict) else (error or answer)
                raise BadRequest(409 if status == 409 else 502, f"the source answered {status}: {detail}")
            if not (region[:8] == PATTERN).all() or not (region[-8:] == PATTERN).all():
                raise BadRequest(502, "the source reported the prefix written but its bytes did not arrive")
        finally:
            self.kv.arena.free(offset, length)
        events, states = split_state_events(self.cache.insert(ids))
        if self.publisher:
            self.publisher.publish(events, time.time(), states if self.cache.hybrid else None)
        self.stats.prefix_imported_tokens += num_tokens - held
        transfer_s = answer.get("transfer_s") if isinstance(answer, dict) else None
        return CacheImported(num_tokens - held, num_tokens, length, transfer_s if isinstance(transfer_s, float) else None)

    async def _telemetry_loop(self, interval_s: float = 0.25) -> None:
        """Publish this prefill worker's link telemetry (``wire.telemetry`` format): the transfer-level
        meter, and the kernel's TCP_INFO of its Mooncake connections where ``ss`` can read it."""
        name = f"{self.config.served_model_name}@{self.config.advertise_host}:{self.config.port}"
        tcp = TcpCongestion() if tcpinfo.available() else None
        while True:
            await asyncio.sleep(interval_s)
            interval = tcp.update(await tcpinfo.own_kv_connections(), time.monotonic()) if tcp is not None else None
            sample = self.meter.sample(name, time.monotonic(), time.time(), self.waiting)
            self.telemetry.publish_raw(with_tcp_view(sample, interval).encode())

    # --- decode side -----------------------------------------------------------------

    def kv_ready(self, ready: KvReady) -> None:
        """A prefill worker reports the KV for ``ready.room`` (written, or failed)."""
        future = self._pending.get(ready.room)
        if future is None or future.done():
            raise BadRequest(404, f"unknown bootstrap room {ready.room!r} (not waiting for KV)")
        future.set_result(ready)

    async def _take_room(self, tokens: int, length: int, deadline: float) -> int:
        """Wait until the pool has ``tokens`` and the landing buffer ``length`` bytes; returns the offset."""
        async with self._room:
            waited = False
            while True:
                if tokens <= self.pool.free_tokens:
                    offset = self.kv.arena.alloc(length)
                    if offset is not None:
                        self.pool.try_take(tokens)
                        return offset
                if not waited:
                    waited = True
                    self.stats.room_waits += 1
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise BadRequest(503, f"no decode room for {tokens} tokens within {self.config.bootstrap_timeout_s:g} s "
                                          f"({self.max_total_tokens - self.used_tokens} tokens and "
                                          f"{self.kv.arena.free_bytes} landing bytes free)")
                try:
                    await asyncio.wait_for(self._room.wait(), remaining)
                except asyncio.TimeoutError:
                    pass

    async def _give_back(self, tokens: int = 0, region: tuple[int, int] | None = None) -> None:
        async with self._room:
            self.pool.give(tokens)
            if region is not None:
                self.kv.arena.free(*region)
            self._room.notify_all()

    async def decode(self, req: EngineRequest) -> Sequence:
        """Take pool room, receive the KV, then enqueue for decoding. The caller iterates
        ``seq.queue`` (token ids, ``None`` at the end) and must call :meth:`finish` in a ``finally``."""
        if req.bootstrap is None:
            raise BadRequest(400, "this is a PD decode server: requests need bootstrap_host, bootstrap_port, bootstrap_room")
        self.check_peer(req.bootstrap.host, "bootstrap host")
        self.check_length(req)
        if not self.pool.fits(req.kv_tokens):
            raise BadRequest(400, f"prompt + max_new_tokens ({req.kv_tokens}) exceeds the decode KV pool ({self.max_total_tokens} tokens)")
        room = req.bootstrap.room
        if room in self._pending:
            raise BadRequest(409, f"bootstrap room {room} is already in use on this decode worker")
        # The last prompt token's KV always comes from the prefill (its logits give the first token).
        held = self.cache.decode_reusable_tokens(req.input_ids[:-1]) if self.config.decode_radix_cache else 0
        length = self.timing.kv_bytes_beyond(len(req.input_ids), held)
        if length > self.kv.arena.size:
            raise BadRequest(400, f"KV of {length} bytes exceeds the landing buffer ({self.kv.arena.size} bytes)")
        deadline = time.monotonic() + self.config.bootstrap_timeout_s
        future = asyncio.get_running_loop().create_future()
        self._pending[room] = future  # the room is ours from here: a duplicate is refused at once
        self._decode_waiting += 1
        try:
            offset = await self._take_room(req.kv_tokens, length, deadline)
        except BaseException:
            self._pending.pop(room, None)
            raise
        finally:
            self._decode_waiting -= 1
        region = self.kv.region(offset, length)
        region[:8] = 0
        region[-8:] = 0
        try:
            ready = await self._await_kv(req, self.kv.base + offset, length, held, future)
            if not (region[:8] == PATTERN).all() or not (region[-8:] == PATTERN).all():
                raise BadRequest(500, f"KV for bootstrap room {room} was reported written but did not arrive")
        except BaseException:
            await self._give_back(req.kv_tokens, (offset, length))
            raise
        finally:
            self._pending.pop(room, None)
        await self._give_back(0, (offset, length))  # checked: the bytes live on as pool tokens
        self.stats.kv_bytes_received += ready.kv_bytes
        self.stats.kv_transfer_s += ready.transfer_s or 0.0
        self.stats.decode_prefix_tokens += held
        seq = Sequence(req, prompt_seed(req.input_ids), [ready.first_token], pool_tokens=req.kv_tokens, ready=ready,
                       decode_prefix_len=held)
        seq.queue.put_nowait(ready.first_token)
        if seq.done:
            seq.queue.put_nowait(None)
        else:
            self._decode_waiting += 1
            self._decode_queue.append(seq)
            self._wake.set()
        return seq

    async def _await_kv(self, req: EngineRequest, addr: int, length: int, held: int, future: asyncio.Future) -> KvReady:
        b = req.bootstrap
        registration = Registration(b.room, self.kv.session, addr, length,
                                    f"http://{self.config.advertise_host}:{self.config.port}/prfaas/kv_ready", held)
        url = f"http://{b.host}:{b.port}/prfaas/register"
        try:
            async with self._post_signed(url, registration.to_json()) as resp:
                if resp.status != 200:
                    raise BadRequest(502, f"prefill bootstrap server {b.host}:{b.port} refused room {b.room}: "
                                          f"{resp.status} {(await resp.text())[:200]}")
        except (aiohttp.ClientError, asyncio.TimeoutError) as err:
            raise BadRequest(502, f"cannot reach the prefill bootstrap server {b.host}:{b.port}: "
                                  f"{err or type(err).__name__}") from None
        try:
            ready: KvReady = await asyncio.wait_for(future, self.config.bootstrap_timeout_s)
        except asyncio.TimeoutError:
            raise BadRequest(504, f"no KV for bootstrap room {b.room} within {self.config.bootstrap_timeout_s:g} s "
                                  "(no prefill partner?)") from None
        if not ready.ok:
            raise BadRequest(502, f"prefill reported a failed KV transfer: {ready.error}")
        return ready

    async def finish(self, seq: Sequence, ok: bool) -> None:
        """Release what ``decode`` took; safe to call once per sequence, any time."""
        seq.cancelled = True
        if seq.pool_tokens:
            tokens, seq.pool_tokens = seq.pool_tokens, 0
            await self._give_back(tokens)
            self.stats.requests_ok += ok
            self.stats.requests_failed += not ok
            if ok and self.config.decode_radix_cache:  # SGLang caches a finished request's prompt + output
                events, states = split_state_events(self.cache.insert(list(seq.req.input_ids) + seq.tokens,
                                                                      chunk_checkpoints=False))
                if self.publisher:  # as SGLang's decode tree does with KV events on: the router can find it
                    self.publisher.publish(events, time.time(), states if self.cache.hybrid else None)
            self.stats.prompt_tokens += len(seq.req.input_ids)
            self.stats.cached_tokens += seq.ready.cached_tokens if seq.ready else 0

    async def _decode_loop(self) -> None:
        """Continuous batching: admit up to max_batch, one step per ``decode_step_s``."""
        pacer = Pacer(DECODE_MAX_DEBT_S)
        while True:
            if not self.running and not self._decode_queue:
                pacer.rest()
                self._wake.clear()
                await self._wake.wait()
            self._decode_waiting -= len(admit(self._decode_queue, self.running, self.timing.max_batch,
                                              lambda seq: seq.cancelled))
            if not self.running:
                continue
            context = sum(len(s.req.input_ids) + len(s.tokens) for s in self.running) / len(self.running)
            profile_step_s = self.timing.decode_step_s(len(self.running), context)
            step_s = self.truth.decode_step_s(profile_step_s, len(self.running)) * self.truth.decode_factor() * self._slowdown()
            await asyncio.sleep(pacer.delay_s(step_s, time.perf_counter()))
            self.stats.forward_intended_s += step_s
            self.stats.forward_actual_s += step_s + pacer.slip_s  # the cadence's time: a late wake-up is repaid
            produced = 0
            for seq in self.running:
                if seq.cancelled:
                    continue
                token = self.output_token(seq.seed, len(seq.tokens))
                seq.tokens.append(token)
                seq.queue.put_nowait(token)
                produced += 1
                if seq.done:
                    seq.queue.put_nowait(None)
            self.stats.generation_tokens += produced
            self._recent.append((time.monotonic(), produced))
            self.running = [s for s in self.running if not (s.done or s.cancelled)]
