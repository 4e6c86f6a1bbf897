"""The emulated worker's state and request flows (asyncio; no HTTP types here).

PD protocol between emulated workers (SGLang's, at the granularity the
router sees: the same body with ``bootstrap_host/port/room`` goes to both)::

    router ──body──> prefill                         router ──body──> decode
                      │                                                 │ 1. carve a receive region
                      │ 2. queue, prefill for T(l_uncached), cache pages (KV events), meanwhile
                      │ <── POST /prfaas/register {room, session, addr, length, notify_url}
                      │ 3. Mooncake TCP write: S_kv(l) * kv_scale bytes ──> region
                      │ 4. POST notify_url {room, ok, first_token, ...} ─────> │ 5. check bytes arrived
       <── 200 (KV shipped, like SGLang's prefill)                            │ 6. continuous-batch decode
                                                                 <── tokens (stream or not)

Timeouts: the prefill waits ``bootstrap_timeout_s`` for its decode partner
(503); the decode waits as long for its KV (504). Every path frees what it
took (receive region, room entries) in ``finally``.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import time
from dataclasses import dataclass, field

import aiohttp

from prfaas_sglang.engine.kv_events import AllBlocksCleared
from prfaas_sglang.engine.mock.kv_transport import PATTERN, KvEndpoint, KvTransferError
from prfaas_sglang.engine.mock.prefix_cache import PrefixCache
from prfaas_sglang.engine.mock.timing import EngineTiming
from prfaas_sglang.launch.roles import ROLE_SPECS, Role
from prfaas_sglang.protocol import BadRequest, EngineRequest, output_token, prompt_seed
from prfaas_sglang.transport.telemetry import TELEMETRY_TOPIC, LinkMeter


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
    cache_tokens: int = 2_097_152
    context_tokens: int = 131_072
    kv_buffer_bytes: int = 1 << 30
    bootstrap_timeout_s: float = 30.0

    @property
    def advertise_host(self) -> str:
        return "127.0.0.1" if self.host in ("0.0.0.0", "::", "") else self.host

    @property
    def mode(self) -> str:
        return ROLE_SPECS[self.role].disaggregation_mode


@dataclass
class Registration:
    session: str
    addr: int
    length: int
    notify_url: str


@dataclass
class Sequence:
    req: EngineRequest
    seed: int
    tokens: list[int]
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: bool = False
    kv_region: tuple[int, int] | None = None  # (offset, length) in the receive arena; freed by finish()
    kv_message: dict = field(default_factory=dict)  # the prefill's kv_ready report

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


class MockEngine:
    """One emulated worker. ``start()`` opens Mooncake and ZMQ; ``stop()`` closes them."""

    def __init__(self, config: MockConfig, timing: EngineTiming):
        self.config, self.timing = config, timing
        self.cache = PrefixCache(config.page_size, max(config.cache_tokens // config.page_size, 1), timing.hybrid)
        self.stats = Stats()
        self.kv: KvEndpoint | None = None
        self.publisher = None
        self.telemetry = None
        self.http: aiohttp.ClientSession | None = None
        self.ready = False
        self.waiting = 0  # queued for prefill, or for a decode slot
        self.running: list[Sequence] = []
        self._decode_queue: collections.deque[Sequence] = collections.deque()
        self._wake = asyncio.Event()
        self._rooms: dict[int, asyncio.Future] = {}  # prefill: room -> Registration
        self._pending: dict[int, asyncio.Future] = {}  # decode: room -> kv_ready message
        self._prefill_lock = asyncio.Lock()
        self._tasks: list[asyncio.Task] = []
        self._recent: collections.deque[tuple[float, int]] = collections.deque(maxlen=512)
        self.meter = LinkMeter()
        self._transfer_ids = itertools.count()

    # --- lifecycle -------------------------------------------------------------------

    async def start(self) -> None:
        cfg = self.config
        if cfg.mode == "prefill":
            source = self.timing.kv_bytes(cfg.context_tokens)
            self.kv = await asyncio.to_thread(KvEndpoint, cfg.advertise_host, source, True)
        else:
            self.kv = await asyncio.to_thread(KvEndpoint, cfg.advertise_host, cfg.kv_buffer_bytes, False)
            self._tasks.append(asyncio.create_task(self._decode_loop(), name="decode-loop"))
        if cfg.kv_events_port is not None:
            from prfaas_sglang.engine.mock.events import ZmqKvEventPublisher
            from prfaas_sglang.launch.plan import KV_EVENTS_TOPIC

            self.publisher = ZmqKvEventPublisher(f"tcp://*:{cfg.kv_events_port}", KV_EVENTS_TOPIC)
        if cfg.telemetry_port is not None and cfg.mode == "prefill":
            from prfaas_sglang.engine.mock.events import ZmqKvEventPublisher

            # Its own socket: the KV-event stream stays exactly SGLang's format.
            self.telemetry = ZmqKvEventPublisher(f"tcp://*:{cfg.telemetry_port}", TELEMETRY_TOPIC.decode())
            self._tasks.append(asyncio.create_task(self._telemetry_loop(), name="telemetry"))
        self.http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=cfg.bootstrap_timeout_s))
        self.ready = True

    async def stop(self) -> None:
        self.ready = False
        for task in self._tasks:
            task.cancel()
        if self.http:
            await self.http.close()
        for pub in (self.publisher, self.telemetry):
            if pub:
                pub.close()
        if self.kv:
            self.kv.close()

    # --- shared ----------------------------------------------------------------------

    @property
    def open_rooms(self) -> int:
        """Bootstrap rooms this worker still tracks (prefill: registrations; decode: awaited KV)."""
        return len(self._rooms) + len(self._pending)

    def check_length(self, req: EngineRequest) -> None:
        total = len(req.input_ids) + req.max_new_tokens
        if total > self.config.context_tokens:
            raise BadRequest(400, f"prompt ({len(req.input_ids)}) + max_new_tokens ({req.max_new_tokens}) = {total} "
                                  f"exceeds the context length {self.config.context_tokens}")

    def flush_cache(self) -> None:
        self.cache.clear()
        if self.publisher:
            self.publisher.publish([AllBlocksCleared()])

    def gen_throughput(self) -> float:
        now = time.monotonic()
        recent = [n for t, n in self._recent if now - t < 5.0]
        return sum(recent) / 5.0

    # --- prefill side ----------------------------------------------------------------

    def _room_future(self, room: int) -> asyncio.Future:
        future = self._rooms.get(room)
        if future is None:
            future = asyncio.get_running_loop().create_future()
            self._rooms[room] = future
        return future

    def register_decode(self, room: int, registration: Registration) -> None:
        """Bootstrap server: a decode worker says where room ``room``'s KV goes."""
        future = self._room_future(room)
        if future.done():
            raise BadRequest(409, f"bootstrap room {room} is already registered")
        future.set_result(registration)
        # A registration nobody claims (its prefill never arrives) is dropped after the timeout.
        asyncio.get_running_loop().call_later(self.config.bootstrap_timeout_s, self._drop_room, room, future)

    def _drop_room(self, room: int, future: asyncio.Future) -> None:
        if self._rooms.get(room) is future:
            del self._rooms[room]

    async def prefill(self, req: EngineRequest) -> dict:
        """Run one prefill and ship its KV; returns the numbers the response reports."""
        if req.bootstrap is None:
            raise BadRequest(400, "this is a PD prefill server: requests need bootstrap_host, bootstrap_port, bootstrap_room")
        self.check_length(req)
        room = req.bootstrap.room
        future = self._room_future(room)
        deadline = time.monotonic() + self.config.bootstrap_timeout_s
        self.waiting += 1
        queued = True
        try:
            # Like SGLang, compute at once; the decode's registration is needed only to ship.
            async with self._prefill_lock:
                self.waiting -= 1
                queued = False
                # The last prompt token is always computed (its logits give the first output
                # token), so an exact repeat reuses at most the pages before it.
                match = self.cache.match(req.input_ids[:-1])
                await asyncio.sleep(self.timing.prefill_s(len(req.input_ids) - match.cached_tokens))
                events = self.cache.insert(req.input_ids)
            if self.publisher:
                self.publisher.publish(events)
            try:
                registration: Registration = await asyncio.wait_for(asyncio.shield(future), max(deadline - time.monotonic(), 0.001))
            except asyncio.TimeoutError:
                raise BadRequest(503, f"no decode worker registered bootstrap room {room} within "
                                      f"{self.config.bootstrap_timeout_s:g} s") from None
            return await self._ship(req, registration, match.cached_tokens)
        finally:
            if queued:
                self.waiting -= 1
            if self._rooms.get(room) is future:
                del self._rooms[room]
            if not future.done():
                future.cancel()

    async def _ship(self, req: EngineRequest, registration: Registration, cached_tokens: int) -> dict:
        length = self.timing.kv_bytes(len(req.input_ids))
        first_token = output_token(prompt_seed(req.input_ids), 0)
        message = {"room": req.bootstrap.room, "kv_bytes": length, "cached_tokens": cached_tokens, "first_token": first_token}
        if length > registration.length:
            message.update(ok=False, error=f"decode region of {registration.length} bytes is smaller than the KV ({length})")
        else:
            start = time.perf_counter()
            transfer_id = next(self._transfer_ids)
            self.meter.start(transfer_id, time.monotonic())
            try:
                await self.kv.write(registration.session, registration.addr, length)
                message.update(ok=True, transfer_s=time.perf_counter() - start)
                self.meter.end(transfer_id, time.monotonic(), length)
            except KvTransferError as err:
                message.update(ok=False, error=str(err))
                self.meter.end(transfer_id, time.monotonic(), 0)
        try:
            async with self.http.post(registration.notify_url, json=message) as resp:
                resp.raise_for_status()
        except (aiohttp.ClientError, asyncio.TimeoutError) as err:
            message.setdefault("error", f"cannot notify the decode worker: {err}")
            message["ok"] = False
        if not message["ok"]:
            self.stats.requests_failed += 1
            raise BadRequest(502, f"KV transfer for bootstrap room {req.bootstrap.room} failed: {message['error']}")
        self.stats.kv_bytes_sent += length
        self.stats.kv_transfer_s += message["transfer_s"]
        self.stats.prompt_tokens += len(req.input_ids)
        self.stats.cached_tokens += cached_tokens
        self.stats.requests_ok += 1
        return message

    async def _telemetry_loop(self, interval_s: float = 0.25) -> None:
        """Publish this prefill worker's link telemetry (transport.telemetry wire format)."""
        while True:
            await asyncio.sleep(interval_s)
            sample = self.meter.sample(self.config.served_model_name + f"@{self.config.port}", time.monotonic(), self.waiting)
            self.telemetry.publish_raw(TELEMETRY_TOPIC, sample.encode())

    # --- decode side -----------------------------------------------------------------

    def kv_ready(self, message: dict) -> None:
        """A prefill worker reports the KV for ``message['room']`` (written, or failed)."""
        room = message.get("room")
        future = self._pending.get(room)
        if future is None or future.done():
            raise BadRequest(404, f"unknown bootstrap room {room!r} (not waiting for KV)")
        future.set_result(message)

    async def decode(self, req: EngineRequest) -> Sequence:
        """Receive the KV, then enqueue for decoding. The caller iterates ``seq.queue``
        (token ids, ``None`` at the end) and must call :meth:`finish` in a ``finally``."""
        if req.bootstrap is None:
            raise BadRequest(400, "this is a PD decode server: requests need bootstrap_host, bootstrap_port, bootstrap_room")
        self.check_length(req)
        room = req.bootstrap.room
        if room in self._pending:
            raise BadRequest(409, f"bootstrap room {room} is already in use on this decode worker")
        length = self.timing.kv_bytes(len(req.input_ids))
        offset = self.kv.arena.alloc(length)
        if offset is None:
            raise BadRequest(503, f"KV receive buffer full ({self.kv.arena.free_bytes} bytes free, {length} needed)")
        region = self.kv.region(offset, length)
        region[:8] = 0
        region[-8:] = 0
        future = asyncio.get_running_loop().create_future()
        self._pending[room] = future
        try:
            message = await self._await_kv(req, self.kv.base + offset, length, future)
            if not (region[:8] == PATTERN).all() or not (region[-8:] == PATTERN).all():
                raise BadRequest(500, f"KV for bootstrap room {room} was reported written but did not arrive")
        except BaseException:
            self.kv.arena.free(offset, length)
            raise
        finally:
            self._pending.pop(room, None)
        self.stats.kv_bytes_received += length
        self.stats.kv_transfer_s += message.get("transfer_s", 0.0)
        seq = Sequence(req, prompt_seed(req.input_ids), [message["first_token"]], kv_region=(offset, length), kv_message=message)
        seq.queue.put_nowait(message["first_token"])
        if seq.done:
            seq.queue.put_nowait(None)
        else:
            self.waiting += 1
            self._decode_queue.append(seq)
            self._wake.set()
        return seq

    async def _await_kv(self, req: EngineRequest, addr: int, length: int, future: asyncio.Future) -> dict:
        b = req.bootstrap
        registration = {"room": b.room, "session": self.kv.session, "addr": addr, "length": length,
                        "notify_url": f"http://{self.config.advertise_host}:{self.config.port}/prfaas/kv_ready"}
        url = f"http://{b.host}:{b.port}/prfaas/register"
        try:
            async with self.http.post(url, json=registration) as resp:
                if resp.status != 200:
                    raise BadRequest(502, f"prefill bootstrap server {b.host}:{b.port} refused room {b.room}: "
                                          f"{resp.status} {(await resp.text())[:200]}")
        except (aiohttp.ClientError, asyncio.TimeoutError) as err:
            raise BadRequest(502, f"cannot reach the prefill bootstrap server {b.host}:{b.port}: {err}") from None
        try:
            message = await asyncio.wait_for(future, self.config.bootstrap_timeout_s)
        except asyncio.TimeoutError:
            raise BadRequest(504, f"no KV for bootstrap room {b.room} within {self.config.bootstrap_timeout_s:g} s "
                                  "(no prefill partner?)") from None
        if not message.get("ok"):
            raise BadRequest(502, f"prefill reported a failed KV transfer: {message.get('error')}")
        return message

    def finish(self, seq: Sequence, ok: bool) -> None:
        """Release what ``decode`` took; safe to call once per sequence, any time."""
        seq.cancelled = True
        region = seq.kv_region
        if region is not None:
            self.kv.arena.free(*region)
            seq.kv_region = None
            self.stats.requests_ok += ok
            self.stats.requests_failed += not ok
            self.stats.prompt_tokens += len(seq.req.input_ids)
            self.stats.cached_tokens += seq.kv_message.get("cached_tokens", 0)

    async def _decode_loop(self) -> None:
        """Continuous batching: admit up to max_batch, one step per ``decode_step_s``."""
        while True:
            if not self.running and not self._decode_queue:
                self._wake.clear()
                await self._wake.wait()
            while self._decode_queue and len(self.running) < self.timing.max_batch:
                seq = self._decode_queue.popleft()
                self.waiting -= 1
                if not seq.cancelled:
                    self.running.append(seq)
            if not self.running:
                continue
            context = sum(len(s.req.input_ids) + len(s.tokens) for s in self.running) / len(self.running)
            await asyncio.sleep(self.timing.decode_step_s(len(self.running), context))
            produced = 0
            for seq in self.running:
                if seq.cancelled:
                    continue
                token = output_token(seq.seed, len(seq.tokens))
                seq.tokens.append(token)
                seq.queue.put_nowait(token)
                produced += 1
                if seq.done:
                    seq.queue.put_nowait(None)
            self.stats.generation_tokens += produced
            self._recent.append((time.monotonic(), produced))
            self.running = [s for s in self.running if not (s.done or s.cancelled)]
