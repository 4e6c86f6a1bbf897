"""Cache moves in a real SGLang prefill server: the HTTP endpoints and the scheduler-side agent.

The emulated engine serves ``wire.cache_move`` itself; in SGLang the request arrives at the HTTP
process while the cache and the pools live in the scheduler process, on the scheduler's thread::

    router ── POST /prfaas/cache/import ──> target HTTP process: route added by the cache-move-routes hook
                                              │ ZMQ DEALER -> ROUTER, ipc beside SGLang's scheduler socket
                                              ▼
                                            target CacheMoveAgent (scheduler process, its own threads)
                                              │ scheduler-thread step: tokens held already?
                                              │ landing buffer, registered with the scheduler's Mooncake engine
          source HTTP <── POST /prfaas/cache/export (signed) ──┘
              │ ZMQ
              ▼
          source agent: scheduler-thread step export_prefix (copy out under a lock);
                        Mooncake TCP write of the message into the target's landing buffer
              └── 200 {bytes, transfer_s} ──> target agent: decode and check the message;
                                              scheduler-thread step import_prefix (an insert:
                                              KV and state events as for any insert)
    router <── 200 CacheImported ─────────────────┘

Threads: the agent's ZMQ loop (one thread owns the ROUTER socket) hands each request to a small
pool; a pool thread blocks on HTTP and Mooncake, never the scheduler. What touches the cache or
the pools is a :class:`SchedulerSteps` step, run by the scheduler thread between forward passes
(the ``cache-move-steps`` hook, after ``process_input_requests``). A step the scheduler has not
started by the request's deadline is cancelled and never runs.

Scope: a prefill server (``PRFAAS_ROLE`` prfaas or pd-prefill, ``--disaggregation-mode prefill``,
Mooncake backend) with one scheduler (tp, pp and dp size 1): a move between tensor-parallel
workers would need every rank's shard and a barrier, which this version does not do; such a
server answers 501 with the reason (:func:`unsupported_reason`).
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import zmq

from prfaas_sglang.adapters import http_sync
from prfaas_sglang.envs import envs
from prfaas_sglang.errors import PrfaasError
from prfaas_sglang.protocol import error_body
from prfaas_sglang.security import check_peer, load_keys, peer_hosts
from prfaas_sglang.wire import prefix_transfer
from prfaas_sglang.wire.auth import AUTH_HEADER, AuthError, ReplayGuard, sign, verify
from prfaas_sglang.wire.cache_move import CacheExport, CacheImport, CacheImported
from prfaas_sglang.wire.prefix_transfer import PrefixTransferError
from prfaas_sglang.wire.server_info import CACHE_MOVE_KEY, CacheMoveSection

logger = logging.getLogger(__name__)

PREFILL_ROLES = ("prfaas", "pd-prefill")
ENDPOINT_SUFFIX = "-prfaas-cache-move"
ROUTE_WAIT_MARGIN_S = 5.0  # the route waits for the agent this much past the move's own deadline
DEFAULT_TIMEOUT_S = 60.0  # an export's deadline (its message carries none; the importer's HTTP timeout bounds it)


def landing_grace_s() -> float:
    """How long a landing buffer stays registered after its source stopped answering: the source
    may still be waiting for its scheduler step (at most DEFAULT_TIMEOUT_S) and then writing (at
    most Mooncake's bound for a synchronous call); freeing it sooner could let that write land in
    memory reused for something else."""
    from prfaas_sglang.transport.kv_sender import mooncake_wait_bound_s

    return DEFAULT_TIMEOUT_S + mooncake_wait_bound_s() + 5.0


class MoveRefused(PrfaasError):
    """A cache move that cannot be done; ``status`` is the HTTP status the caller gets."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class MoveReply:
    status: int
    body: dict

    def encode(self) -> bytes:
        return json.dumps({"status": self.status, "body": self.body}).encode()

    @classmethod
    def decode(cls, raw: bytes) -> MoveReply:
        obj = json.loads(raw)
        return cls(int(obj["status"]), obj["body"])


# --- where it applies ---------------------------------------------------------------------------


def agent_endpoint(port_args: Any) -> str | None:
    """The agent's ZMQ endpoint, derived from the scheduler's own input socket so the HTTP process
    and the scheduler find it without a port of their own: ``ipc://<that path>-prfaas-cache-move``.
    None when SGLang's sockets are TCP (multi-node): unsupported."""
    name = getattr(port_args, "scheduler_input_ipc_name", None)
    if not isinstance(name, str) or not name.startswith("ipc://"):
        return None
    return name + ENDPOINT_SUFFIX


def unsupported_reason(server_args: Any, port_args: Any, role: str | None) -> str | None:
    """Why this server cannot serve cache moves, or None when it can (both processes ask, with the
    same answer: the routes answer 501 with it, and the scheduler starts no agent)."""
    from prfaas_sglang._compat.accessors import resolving

    server_args = resolving(server_args)
    if role not in PREFILL_ROLES:
        return f"only a prefill worker (PRFAAS_ROLE {' or '.join(PREFILL_ROLES)}) moves cached prefixes; this is {role!r}"
    if getattr(server_args, "disaggregation_mode", None) != "prefill":
        return "cache moves need --disaggregation-mode prefill"
    if not str(getattr(server_args, "disaggregation_transfer_backend", "")).startswith("mooncake"):
        return "cache moves travel over Mooncake: --disaggregation-transfer-backend mooncake or mooncake_tcp"
    sizes = {k: getattr(server_args, k, 1) or 1 for k in ("tp_size", "pp_size", "dp_size")}
    if any(v != 1 for v in sizes.values()):
        return f"cache moves need one scheduler (tp, pp and dp size 1), this server has {sizes}"
    if agent_endpoint(port_args) is None:
        return "cache moves need SGLang's ipc sockets (single-node server)"
    return None


# --- scheduler-thread steps ---------------------------------------------------------------------


class SchedulerSteps:
    """Work handed to the scheduler thread. ``call`` from any thread; ``run_pending`` from the
    scheduler's, between forward passes (it runs every step queued so far, in order)."""

    def __init__(self):
        self._queue: queue.SimpleQueue[tuple[Callable[[], Any], Future]] = queue.SimpleQueue()

    def call(self, step: Callable[[], Any], timeout_s: float) -> Any:
        """``step()``'s result, run on the scheduler thread; its exception propagates. Raises
        MoveRefused(504) when the scheduler has not run it within ``timeout_s``: the step is then
        cancelled, and never runs, unless it had already started (it then completes unobserved)."""
        future: Future = Future()
        self._queue.put((step, future))
        try:
            return future.result(max(timeout_s, 0.0))
        except (FutureTimeout, CancelledError):
            future.cancel()
            raise MoveRefused(504, f"the scheduler did not run the cache step within {timeout_s:.1f} s") from None

    def run_pending(self) -> int:
        """Run the queued steps; returns how many ran (cancelled ones are dropped)."""
        ran = 0
        while True:
            try:
                step, future = self._queue.get_nowait()
            except queue.Empty:
                return ran
            if not future.set_running_or_notify_cancel():
                continue
            ran += 1
            try:
                future.set_result(step())
            except Exception as err:  # noqa: BLE001 - handed to the waiting thread
                future.set_exception(err)


# --- the agent (scheduler process) ----------------------------------------------------------------


class CacheMoveAgent:
    """Serves cache moves for one scheduler. ``cache`` is the scheduler's tree cache (its pools
    reached through it, ``hooks/cache_import``), ``engine`` SGLang's ``MooncakeTransferEngine``
    (``register``, ``deregister``, ``transfer_sync``, ``get_session_id``). ``api_key`` is what this
    server's own ``--api-key`` is (the deployment's, so another worker's too); ``keys`` and
    ``peers`` as ``security.load_keys`` / ``peer_hosts``.

    ``start`` binds ``endpoint`` and starts the threads; ``close`` stops them (steps still queued are
    never run). The scheduler thread must call :meth:`run_pending` often (the hook does)."""

    def __init__(self, cache: Any, engine: Any, endpoint: str, *, api_key: str | None = None,
                 keys: Any = None, peers: frozenset[str] | None = None, workers: int = 2):
        self.cache, self.engine, self.endpoint = cache, engine, endpoint
        self.keys, self.peers = keys, peers
        self.steps = SchedulerSteps()
        # kept-alive connections to the sources, shared by the pool's threads
        self._http = http_sync.Client({"Authorization": f"Bearer {api_key}"} if api_key else None)
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="prfaas-cache-move")
        self._ctx = zmq.Context.instance()
        self._replies: queue.SimpleQueue[tuple[list[bytes], bytes]] = queue.SimpleQueue()
        self._wake = f"inproc://prfaas-cache-move-wake-{id(self)}"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._quarantine: list[tuple[float, int, Any]] = []  # (release at, addr, buffer): see _fetch
        self._quarantine_lock = threading.Lock()
        self.stats = {"imports": 0, "exports": 0, "imported_tokens": 0, "bytes_in": 0, "bytes_out": 0, "refused": 0}

    def run_pending(self) -> int:
        return self.steps.run_pending()

    def start(self) -> CacheMoveAgent:
        socket = self._ctx.socket(zmq.ROUTER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.bind(self.endpoint)
        wake = self._ctx.socket(zmq.PULL)
        wake.bind(self._wake)
        self._thread = threading.Thread(target=self._serve, args=(socket, wake), name="prfaas-cache-move", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        self._poke()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._http.close()
        self._release_quarantined(time.monotonic(), everything=True)

    def _poke(self) -> None:
        s = self._ctx.socket(zmq.PUSH)
        s.setsockopt(zmq.LINGER, 100)
        s.connect(self._wake)
        s.send(b"")
        s.close()

    def _serve(self, socket, wake) -> None:
        """The ZMQ loop: frames ``[identity, request id, kind, body]`` in, ``[identity, request id,
        MoveReply]`` out (the DEALER side sends ``[request id, kind, body]``)."""
        poller = zmq.Poller()
        poller.register(socket, zmq.POLLIN)
        poller.register(wake, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                ready = dict(poller.poll(1000))
                if wake in ready:
                    while wake.poll(0):
                        wake.recv()
                while True:
                    try:
                        route, reply = self._replies.get_nowait()
                    except queue.Empty:
                        break
                    socket.send_multipart([*route, reply])
                if socket in ready:
                    while socket.poll(0):
                        frames = socket.recv_multipart()
                        if len(frames) != 4:
                            continue
                        self._pool.submit(self._answer, *frames)
        finally:
            socket.close()
            wake.close()

    def _answer(self, identity: bytes, rid: bytes, kind: bytes, body: bytes) -> None:
        self._replies.put(([identity, rid], self.handle(kind.decode(errors="replace"), body).encode()))
        self._poke()

    def handle(self, kind: str, body: bytes) -> MoveReply:
        """One move request (``import`` or ``export``, the body as the route received it); never raises."""
        try:
            if kind == "import":
                return MoveReply(200, self._import(_decode(CacheImport, body)).to_json())
            if kind == "export":
                return MoveReply(200, self._export(_decode(CacheExport, body)))
            raise MoveRefused(404, f"unknown cache-move request {kind!r}")
        except MoveRefused as err:
            self.stats["refused"] += 1
            return MoveReply(err.status, error_body(err.status, str(err)))
        except Exception as err:  # noqa: BLE001 - a bug must still answer, and is logged
            logger.exception("cache move (%s) failed", kind)
            return MoveReply(500, error_body(500, f"cache move failed: {type(err).__name__}: {err}"))

    def _check_peer(self, host_or_url: str, what: str) -> None:
        try:
            check_peer(self.peers, host_or_url, what)
        except AuthError as err:
            raise MoveRefused(403, str(err)) from None

    # Target side.
    def _import(self, msg: CacheImport) -> CacheImported:
        """Fetch ``msg``'s prefix (page-aligned) from its source into a landing buffer, then insert it.
        Nothing is allocated in the pools before the message arrived intact (``import_prefix``
        allocates and inserts in one step). The landing buffer is deregistered and dropped once the
        source answered or provably never got the request; otherwise it is kept registered for
        :func:`landing_grace_s` (the source may still write) and released by a later move or ``close``."""
        from prfaas_sglang.hooks.cache_import import (
            NoRoomError,
            UnsupportedTree,
            import_prefix,
            message_bound_bytes,
            usable_prefix_tokens,
        )

        deadline = time.monotonic() + msg.timeout_s
        self._check_peer(msg.source_url, "import source")
        page = self.cache.page_size
        num_tokens = msg.num_tokens // page * page
        if num_tokens == 0:
            raise MoveRefused(400, f"{msg.num_tokens} tokens is less than one page ({page})")
        ids = msg.token_ids[:num_tokens]
        held, bound = self.steps.call(lambda: (usable_prefix_tokens(self.cache, ids), message_bound_bytes(self.cache, num_tokens)),
                                      deadline - time.monotonic())
        if held >= num_tokens:
            return CacheImported(0, held, 0, None)
        payload, transfer_s = self._fetch(msg.source_url, CacheExport(ids, num_tokens, self.engine.get_session_id(), 0, bound),
                                          deadline)
        try:
            transfer = prefix_transfer.decode(payload)
        except PrefixTransferError as err:
            raise MoveRefused(502, f"the prefix's bytes did not arrive intact: {err}") from None
        got = len(transfer.token_ids)
        if transfer.token_ids != ids[:got] or got % page:
            raise MoveRefused(502, f"the source sent {got} tokens that are not a page-aligned prefix of the request")
        try:
            imported = self.steps.call(lambda: import_prefix(self.cache, transfer), deadline - time.monotonic())
        except NoRoomError as err:
            raise MoveRefused(503, str(err)) from None
        except UnsupportedTree as err:
            raise MoveRefused(501, str(err)) from None
        except PrefixTransferError as err:  # the source's layout is not this worker's
            raise MoveRefused(502, str(err)) from None
        self.stats["imports"] += 1
        self.stats["imported_tokens"] += imported
        self.stats["bytes_in"] += len(payload)
        return CacheImported(imported, got, len(payload), transfer_s)

    def _fetch(self, source_url: str, export: CacheExport, deadline: float) -> tuple[bytes, float | None]:
        """Ask the source to write the prefix into a landing buffer registered here; returns the
        bytes that arrived and the source's transfer time."""
        import torch

        self._release_quarantined(time.monotonic())
        landing = torch.zeros(export.length, dtype=torch.uint8)
        addr = landing.data_ptr()
        self.engine.register(addr, export.length)
        answered = False  # the source's outcome is known: it wrote, or it will not write
        try:
            url = source_url.rstrip("/") + "/prfaas/cache/export"
            body = json.dumps(CacheExport(export.token_ids, export.num_tokens, export.session, addr, export.length).to_json()).encode()
            headers = {"Content-Type": "application/json"}
            if self.keys is not None:
                headers[AUTH_HEADER] = sign(self.keys.handoff_key, "POST", urlsplit(url).path, body, time.time())
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise MoveRefused(504, "the move's deadline passed before the source was asked")
            try:
                resp = self._http.request("POST", url, data=body, headers=headers, timeout_s=remaining)
            except http_sync.HttpError as err:
                # no connection was made: the request never reached the source, which cannot be writing
                answered = not err.connected
                raise MoveRefused(502, f"cannot fetch the prefix from {source_url}: {err}") from None
            answered = True
            try:
                answer = resp.json()
            except http_sync.HttpError:
                answer = {}
            if resp.status != 200:
                error = answer.get("error") if isinstance(answer, dict) else None
                detail = error.get("message") if isinstance(error, dict) else (error or resp.text[:200])
                raise MoveRefused(409 if resp.status == 409 else 502, f"the source answered {resp.status}: {detail}")
            nbytes = answer.get("bytes") if isinstance(answer, dict) else None
            if isinstance(nbytes, bool) or not isinstance(nbytes, int) or not 0 < nbytes <= export.length:
                raise MoveRefused(502, f"the source reported {nbytes!r} bytes for a {export.length}-byte region")
            transfer_s = answer.get("transfer_s")
            return landing[:nbytes].numpy().tobytes(), transfer_s if isinstance(transfer_s, float) else None
        finally:
            if answered:
                self.engine.deregister(addr)
            else:  # the source may still write into it: keep it registered and alive for a while
                with self._quarantine_lock:
                    self._quarantine.append((time.monotonic() + landing_grace_s(), addr, landing))

    def _release_quarantined(self, now: float, everything: bool = False) -> None:
        with self._quarantine_lock:
            due = [q for q in self._quarantine if everything or q[0] <= now]
            self._quarantine = [q for q in self._quarantine if q not in due]
        for _, addr, _buffer in due:
            self.engine.deregister(addr)

    @property
    def quarantined_bytes(self) -> int:
        with self._quarantine_lock:
            return sum(int(buf.numel()) for _, _, buf in self._quarantine)

    # Source side.
    def _export(self, msg: CacheExport) -> dict:
        """Write the longest prefix of ``msg``'s tokens this cache can resume from (at least one
        page) to the caller's region; 409 when nothing of it is held."""
        import torch

        from prfaas_sglang.hooks.cache_import import UnsupportedTree, export_prefix

        self._check_peer(msg.session, "export destination")
        ids = msg.token_ids[:msg.num_tokens]
        try:
            transfer = self.steps.call(lambda: export_prefix(self.cache, ids), DEFAULT_TIMEOUT_S)
        except UnsupportedTree as err:
            raise MoveRefused(501, str(err)) from None
        if transfer is None:
            raise MoveRefused(409, f"this worker holds none of the {msg.num_tokens} prefix tokens")
        payload = prefix_transfer.encode(transfer)
        if len(payload) > msg.length:
            raise MoveRefused(400, f"the region of {msg.length} bytes is smaller than the prefix's message ({len(payload)})")
        source = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        addr = source.data_ptr()
        self.engine.register(addr, len(payload))
        try:
            started = time.perf_counter()
            ret = self.engine.transfer_sync(msg.session, addr, msg.addr, len(payload))
            transfer_s = time.perf_counter() - started
        finally:
            self.engine.deregister(addr)
        if ret is None or ret < 0:
            raise MoveRefused(502, f"the Mooncake write of {len(payload)} bytes to {msg.session} failed ({ret})")
        self.stats["exports"] += 1
        self.stats["bytes_out"] += len(payload)
        return {"bytes": len(payload), "transfer_s": transfer_s, "tokens": len(transfer.token_ids)}


def _decode(cls, body: bytes):
    try:
        return cls.decode(json.loads(body))
    except (ValueError, UnicodeDecodeError) as err:  # JSONDecodeError is a ValueError
        raise MoveRefused(400, f"bad {cls.__name__}: {err}") from None


# --- the HTTP side (SGLang's FastAPI app, in the HTTP process) -------------------------------------


class AgentClient:
    """The HTTP process's line to the agent: one DEALER socket, requests matched by id. Created
    and used on the HTTP server's event loop."""

    def __init__(self, endpoint: str):
        self.endpoint = endpoint
        self._socket = None
        self._pending: dict[bytes, Any] = {}
        self._ids = 0
        self._reader = None

    async def call(self, kind: str, body: bytes, timeout_s: float) -> MoveReply:
        import asyncio

        import zmq.asyncio

        if self._socket is None:
            self._socket = zmq.asyncio.Context.instance().socket(zmq.DEALER)
            self._socket.setsockopt(zmq.LINGER, 0)
            self._socket.connect(self.endpoint)
            self._reader = asyncio.get_running_loop().create_task(self._read())
        self._ids += 1
        rid = str(self._ids).encode()
        future = asyncio.get_running_loop().create_future()
        self._pending[rid] = future
        try:
            await self._socket.send_multipart([rid, kind.encode(), body])
            return await asyncio.wait_for(future, timeout_s)
        except asyncio.TimeoutError:
            return MoveReply(504, error_body(504, f"the scheduler's cache-move agent did not answer within {timeout_s:.0f} s"))
        finally:
            self._pending.pop(rid, None)

    async def _read(self) -> None:
        while True:
            frames = await self._socket.recv_multipart()
            if len(frames) != 2:  # [request id, MoveReply]
                continue
            future = self._pending.get(frames[0])
            if future is not None and not future.done():
                future.set_result(MoveReply.decode(frames[1]))


def install_routes(app: Any, server_args: Any, port_args: Any, role: str | None = None, keys: Any = None) -> None:
    """Add ``POST /prfaas/cache/import`` and ``/prfaas/cache/export`` to SGLang's FastAPI ``app``.
    They sit behind SGLang's ``--api-key`` middleware like every route; an export must also carry
    the deployment's hand-off signature when it has a secret (401 otherwise, and for a replay).
    Where :func:`unsupported_reason` gives a reason they answer 501 with it."""
    from fastapi import Request
    from fastapi.responses import JSONResponse

    reason = unsupported_reason(server_args, port_args, role)
    client = AgentClient(agent_endpoint(port_args)) if reason is None else None
    replay = ReplayGuard()

    def route(kind: str):
        async def handler(request: Request):
            if client is None:
                return JSONResponse(error_body(501, reason), status_code=501)
            raw = await request.body()
            if kind == "export" and keys is not None:
                try:
                    now_s = time.time()
                    replay.check(verify(keys.handoff_key, request.headers.get(AUTH_HEADER), "POST", request.url.path,
                                        raw, now_s), now_s)
                except AuthError as err:
                    return JSONResponse(error_body(401, f"unauthenticated hand-off: {err}"), status_code=401)
            reply = await client.call(kind, raw, _wait_s(kind, raw))
            return JSONResponse(reply.body, status_code=reply.status)

        handler.__name__ = f"prfaas_cache_{kind}"
        handler.__annotations__ = {"request": Request}  # resolved here: FastAPI reads module globals for strings
        return handler

    for kind in ("import", "export"):
        app.add_api_route(f"/prfaas/cache/{kind}", route(kind), methods=["POST"], include_in_schema=False)


def _wait_s(kind: str, raw: bytes) -> float:
    """How long the route waits for the agent: the import's own deadline (the agent answers by
    then) plus a margin; an export's fixed bound."""
    timeout_s = DEFAULT_TIMEOUT_S
    if kind == "import":
        try:
            value = json.loads(raw).get("timeout_s")
            if isinstance(value, int | float) and not isinstance(value, bool) and 0 < value <= 3600:
                timeout_s = float(value)
        except (ValueError, AttributeError, UnicodeDecodeError):
            pass
    return timeout_s + ROUTE_WAIT_MARGIN_S


# --- the hooks ------------------------------------------------------------------------------------


def add_routes(server_args, tokenizer_manager, template_manager, port_args, scheduler_infos=None, *args, **kwargs):
    """BEFORE hook on ``http_server._setup_and_run_http_server``: the cache-move routes on SGLang's
    app (a prefill role only; other servers keep SGLang's routes unchanged), announced in
    ``/server_info`` (which merges the first scheduler's info) under ``CACHE_MOVE_KEY``, as
    :class:`~prfaas_sglang.wire.server_info.CacheMoveSection`; the router moves caches only between
    workers that say ``served``."""
    role = envs.ROLE.get()
    if role not in PREFILL_ROLES:
        return None
    from sglang.srt.entrypoints import http_server

    install_routes(http_server.app, server_args, port_args, role, load_keys())
    if scheduler_infos:
        reason = unsupported_reason(server_args, port_args, role)
        scheduler_infos[0][CACHE_MOVE_KEY] = CacheMoveSection.served_unless(reason).to_json()
    return None


def start_agent(result, scheduler, server_args, port_args, *args, **kwargs) -> None:  # noqa: ARG001
    """AFTER hook on ``Scheduler.__init__``: a prefill scheduler that can serve cache moves
    (:func:`unsupported_reason`) starts its agent, attached as ``scheduler.prfaas_cache_move``."""
    role = envs.ROLE.get()
    if role not in PREFILL_ROLES:
        return None
    reason = unsupported_reason(server_args, port_args, role)
    if reason is not None:
        logger.warning("prfaas_sglang: no cache moves on this server: %s", reason)
        return None
    queue_ = getattr(scheduler, "disagg_prefill_bootstrap_queue", None)
    engine = getattr(getattr(queue_, "kv_manager", None), "engine", None)
    if engine is None:
        logger.warning("prfaas_sglang: no cache moves on this server: its prefill queue has no Mooncake engine")
        return None
    from prfaas_sglang._compat.accessors import resolving

    scheduler.prfaas_cache_move = CacheMoveAgent(
        scheduler.tree_cache, engine, agent_endpoint(port_args), api_key=getattr(resolving(server_args), "api_key", None),
        keys=load_keys(), peers=peer_hosts()).start()
    return None


def run_steps(result, scheduler, *args, **kwargs):
    """AFTER hook on ``Scheduler.process_input_requests``: run the agent's queued cache steps."""
    agent = getattr(scheduler, "prfaas_cache_move", None)
    if agent is not None:
        agent.run_pending()
    return result
