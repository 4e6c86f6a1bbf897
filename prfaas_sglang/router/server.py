"""The PrfaaS router's request path (aiohttp, adapter): one client request from the HTTP handler to
the answer. Background loops are ``router/loops.py``; the app that joins them, ``router/app.py``.

The path, top to bottom (the decisions are :class:`~prfaas_sglang.router.service.RouterService`'s)::

    dispatch (the handler)     parse and tokenize as SGLang would; 400 now if no worker could take it
      service.decide           the prompt's cached prefix per worker, a snapshot per pair
        fleet.route_fleet      every pair of the candidate PD clusters, then the best among them
          policy.route         where this pair would prefill and decode it
    with no decode room        wait in the router (FIFO-ish, bounded by ``admission_timeout_s`` and
                               ``max_waiting``: 503 / 429 with Retry-After; :class:`WaitingRoom`)
    service.begin              its work in the ledgers
    _run_legs                  the same body plus ``bootstrap_host/port/room`` POSTed to the prefill
                               and the decode worker at once, as SGLang's PD routers do; the decode
                               response (or its SSE stream) back, with ``x-prfaas-route`` and
                               ``x-prfaas-link`` headers
    service.finish             everything it held released

Faults: when the prefill leg fails before anything was streamed, the decode
leg is aborted (its connection closed, so the worker frees its KV), the
prefill worker is marked unhealthy and the request is routed again with a new
room (``redispatched``); after that it fails with 502. A decode leg that fails
before anything was streamed though the prefill leg answered counts as the
prefill's failure when the prefill worker no longer answers its health check
(it went away before the decode took the KV). A stream that breaks
after it started ends with an error event (``{"error": {"code": 502, ...}}``)
and ``[DONE]``, never a second response.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import random
import time
from array import array
from dataclasses import dataclass

import aiohttp
import orjson
from aiohttp import web

from prfaas_sglang.protocol import (
    ID_KEYS,
    BadRequest,
    EngineRequest,
    ends_event,
    parse_request,
    stream_failed_event,
    stream_failure,
    with_checkpoint,
)
from prfaas_sglang.router.policy import NoDecodeRoom, NoHealthyWorker, RouteDecision, refuse_early
from prfaas_sglang.router.service import MAX_BODY_BYTES, Lease, RouterService
from prfaas_sglang.router.workers import WorkerRecord
from prfaas_sglang.wire.cache_move import CacheImport, CacheImported
from prfaas_sglang.wire.token_ids import split_ids

logger = logging.getLogger(__name__)
PATHS = {"generate": "/generate", "completions": "/v1/completions", "chat": "/v1/chat/completions"}
# The PD cluster a request entered at (a region's users): it decodes there. Without it, the global
# scheduler chooses among every PD cluster.
ENTRY_HEADER = "x-prfaas-entry"
LONG_TEXT_CHARS = 20_000  # tokenize longer prompts off the event loop
LOGGED_WAIT_S = 1.0  # a request that waited this long for decode room gets a log line naming why

SERVICE_KEY = web.AppKey("service", RouterService)
SESSION_KEY = web.AppKey("session", aiohttp.ClientSession)
ROOM_KEY = web.AppKey("room", asyncio.Condition)  # notified whenever decode room may have freed
_ids = itertools.count()
_rng = random.Random()


class PrefillFailed(Exception):
    """The prefill leg failed before anything reached the client."""


class DecodeUnreachable(Exception):
    """The decode worker could not be reached, or dropped the connection, before anything reached
    the client (a worker that answered, even 5xx, is alive: its answer is relayed instead)."""


class Rejected(Exception):
    def __init__(self, status: int, cause: str, message: str, retry_after_s: int | None = None):
        super().__init__(message)
        self.status, self.cause, self.message, self.retry_after_s = status, cause, message, retry_after_s


def _error(status: int, message: str, retry_after_s: int | None = None, cause: str | None = None) -> web.Response:
    """An OpenAI-style error body; ``cause`` (the rejection's counter name, e.g. ``ttft_estimate``)
    becomes its ``type``, so a client can tell a refusal before any work from a failure."""
    headers = {"Retry-After": str(retry_after_s)} if retry_after_s else None
    error = {"message": message, "code": status, **({"type": cause} if cause else {})}
    return web.json_response({"error": error}, status=status, headers=headers)


# --- the handler: read, route (waiting for decode room), begin, the legs ---------------------------


async def dispatch(request: web.Request, kind: str) -> web.StreamResponse:
    """The HTTP handler of the generate paths: read the request, then at most two attempts of route
    (``service.decide``; waiting in the router for decode room) -> begin -> the legs. A leg that failed
    before anything reached the client routes it again, off the worker it failed on."""
    app, service = request.app, request.app[SERVICE_KEY]
    received = time.perf_counter()
    try:
        req, body, entry = await _read(request, service, kind)
    except BadRequest as err:
        return _bad_request(service, err)
    parsed = time.perf_counter()
    tried: set[str] = set()
    failure = ("", "prefill", "")  # the last failed leg's (message, leg, worker)
    for attempt in range(2):
        room = WaitingRoom(app, req.rid, entry)
        routed = service.route_input(req)  # the prompt is hashed once per attempt, not on every wake-up
        try:
            while True:
                try:
                    decision = service.decide(routed, tried, time.monotonic(), entry)
                    break
                except NoDecodeRoom as err:
                    await room.wait(err)
            _refuse_early(decision, service.config.max_ttft_s)
        except NoHealthyWorker as err:
            return _rejected(service, Rejected(503, "no_worker", str(err), retry_after_s=2))
        except Rejected as err:
            return _rejected(service, err)
        finally:
            room.leave()
        lease = service.begin(req, decision, time.monotonic(), attempt)
        # The router's own time before the legs (W3C Server-Timing, ms): reading and checking the
        # body, then routing it (prefix match, policy; waiting for decode room included).
        timing = f"parse;dur={(parsed - received) * 1e3:.3f}, route;dur={(time.perf_counter() - parsed) * 1e3:.3f}"
        try:
            if decision.transfer is not None:  # move, then prefill the rest (recompute if the move fails)
                timing += f", move;dur={await _move_cache(app, req, decision) * 1e3:.3f}"
            return await _run_legs(request, service, req, body, lease, timing)
        except (PrefillFailed, DecodeUnreachable) as err:
            failure = _leg_failed(service, req, decision, err, attempt)
            tried.add(failure[2])
        finally:
            service.finish(lease)
            async with app[ROOM_KEY]:
                app[ROOM_KEY].notify_all()
    message, leg, _ = failure
    service.counters.failed[leg] += 1
    return _error(502, f"request failed after re-dispatch: {message}", cause=f"{leg}_failed")


def _rejected(service: RouterService, err: Rejected) -> web.Response:
    """Count a request refused while routing (no worker, no decode room, the TTFT estimate), and answer it."""
    service.counters.rejected[err.cause] += 1
    return _error(err.status, err.message, err.retry_after_s, err.cause)


def _refuse_early(decision: RouteDecision, max_ttft_s: float | None) -> None:
    """Early rejection: 503 now when the best route's estimated TTFT exceeds ``max_ttft_s``."""
    if refuse_early(decision, max_ttft_s):
        raise Rejected(503, "ttft_estimate", f"overloaded: estimated TTFT {decision.estimated_ttft_s:.1f} s exceeds "
                                             f"{max_ttft_s:g} s",
                       retry_after_s=max(1, int(decision.estimated_ttft_s - max_ttft_s) + 1))


def _leg_failed(service: RouterService, req: EngineRequest, decision: RouteDecision, err: Exception,
                attempt: int) -> tuple[str, str, str]:
    """A leg of ``decision`` failed before anything reached the client: its worker leaves service (or that
    pair), counted and logged. Returns (what failed, the leg, the worker: not to be tried again)."""
    leg = "prefill" if isinstance(err, PrefillFailed) else "decode"
    worker = service.leg_failed(decision, leg, time.monotonic())
    service.counters.redispatched += 1
    logger.warning("request %s: its %s leg on %s failed (%s)%s", req.rid, leg, worker, err,
                   "; routing it again" if attempt == 0 else "")
    return str(err), leg, worker


class WaitingRoom:
    """One attempt's wait in the router for decode room: at most ``max_waiting`` requests wait (then 429),
    each at most ``admission_timeout_s`` (then 503), both with Retry-After (:class:`Rejected`). A request
    that waited counts at its entry (``RouterService.start_waiting``: what the long-term controller sees
    queue at a PD cluster) until :meth:`leave`, which observes how long it waited."""

    def __init__(self, app: web.Application, rid: str, entry: str | None):
        self.service, self.room, self.rid, self.entry = app[SERVICE_KEY], app[ROOM_KEY], rid, entry
        self.deadline = time.monotonic() + self.service.config.admission_timeout_s
        self.since: float | None = None  # when it started waiting
        self.why = ""

    async def wait(self, err: NoDecodeRoom) -> None:
        """Wait until room may have freed (at most a second), after ``err`` said there is none now."""
        service, cfg = self.service, self.service.config
        if self.since is None:
            if service.waiting >= cfg.max_waiting:
                raise Rejected(429, "queue_full", f"{service.waiting} requests already wait for decode room",
                               retry_after_s=2) from None
            self.since, self.why = time.monotonic(), str(err)
            service.start_waiting(self.entry)
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            raise Rejected(503, "no_decode_room", f"{err} (waited {cfg.admission_timeout_s:g} s)",
                           retry_after_s=max(1, int(cfg.admission_timeout_s / 4))) from None
        async with self.room:
            try:
                await asyncio.wait_for(self.room.wait(), min(remaining, 1.0))
            except asyncio.TimeoutError:
                pass

    def leave(self) -> None:
        """The wait is over, whatever its outcome."""
        if self.since is None:
            return
        self.service.stop_waiting(self.entry)
        waited_s = time.monotonic() - self.since
        self.service.counters.queue_wait.observe(waited_s)
        if waited_s >= LOGGED_WAIT_S:
            logger.info("request %s waited %.1f s in the router for decode room (%s)", self.rid, waited_s, self.why)
        self.since = None


# --- reading the request --------------------------------------------------------------------------


async def _read(request: web.Request, service: RouterService, kind: str) -> tuple[EngineRequest, ClientBody, str | None]:
    """The request, parsed and checked as SGLang would (its body, its ids or tokenized text, its model, whether
    it fits), and the PD cluster it entered at (``x-prfaas-entry``; None: any). Raises BadRequest (400, 404, 413)."""
    limit = service.max_body_bytes()
    if request.content_length is not None and request.content_length > limit:  # refused before a byte is read
        raise BadRequest(413, f"request body of {request.content_length} bytes exceeds {limit} bytes "
                              "(64 bytes per token of the largest context)")
    req, body = await _parse(request, service, kind)
    entry = request.headers.get(ENTRY_HEADER)
    if entry is not None and entry not in service.pd_sites():
        raise BadRequest(400, f"{ENTRY_HEADER}: {entry!r} is not a PD cluster of this deployment "
                              f"({', '.join(service.pd_sites())})")
    return req, body, entry


def _bad_request(service: RouterService, err: BadRequest) -> web.Response:
    """Count a request refused before routing, and answer it (a 413 says why in its ``type``)."""
    cause = {404: "unknown_model", 413: "too_large"}.get(err.status, "bad_request")
    service.counters.rejected[cause] += 1
    return _error(err.status, err.message, cause=cause if err.status == 413 else None)


async def _parse(request: web.Request, service: RouterService, kind: str) -> tuple[EngineRequest, ClientBody]:
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise BadRequest(413, f"request body exceeds {MAX_BODY_BYTES} bytes") from None
    if len(raw) > service.max_body_bytes():  # a chunked body, which gave no length up front
        raise BadRequest(413, f"request body of {len(raw)} bytes exceeds {service.max_body_bytes()} bytes")
    cut = split_ids(raw, ID_KEYS[kind]) if kind in ID_KEYS else None
    if cut is not None:  # token ids: checked in their JSON text, parsed only as far as routing reads
        body = cut[0]
    else:
        try:
            body = orjson.loads(raw)  # one parse, fast; bounded nesting (1024), 64-bit integers
        except orjson.JSONDecodeError:
            raise BadRequest(400, "request body is not valid JSON") from None
    rid = f"prfaas-{next(_ids)}"
    created = int(time.time())
    chars = _text_chars(body) if service.tokenizer is not None else 0
    if service.tokenizer is not None:
        _refuse_text_beyond_context(service, body, chars)
    if chars > LONG_TEXT_CHARS:
        req = await asyncio.to_thread(parse_request, kind, body, rid, created, service.tokenizer)
    else:
        req = parse_request(kind, body, rid, created, service.tokenizer)
    if req.bootstrap is not None:
        raise BadRequest(400, "bootstrap_host/bootstrap_port/bootstrap_room are set by the router; remove them")
    service.check_model(req.model)
    service.check_fits(req)
    return req, ClientBody(body, raw)


@dataclass(frozen=True)
class ClientBody:
    """The client's JSON object, parsed once, and its bytes (re-sent as they came when unchanged).
    ``obj`` may hold a :class:`JsonIds` for its ids (never serialised: the bytes are re-sent)."""

    obj: dict
    raw: bytes


def _text_chars(body, count=len) -> int:
    """Characters of text the tokenizer would read (0 for token ids): decides where to tokenize.
    ``count`` measures one string (default: all its characters)."""
    if not isinstance(body, dict):
        return 0
    n = sum(count(body[k]) for k in ("text", "prompt") if isinstance(body.get(k), str))
    messages = body.get("messages")
    for message in messages if isinstance(messages, list) else ():
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            n += count(content)
        elif isinstance(content, list):
            n += sum(count(p.get("text") or "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return n


def _non_space(text: str) -> int:
    return len(text) - text.count(" ") - text.count("\n") - text.count("\t") - text.count("\r")


def _refuse_text_beyond_context(service: RouterService, body, chars: int) -> None:
    """400 before tokenizing a text of ``chars`` characters that cannot fit any worker's context (a
    lower bound on its tokens from its length: ``PromptTokenizer.least_tokens``); tokenizing 10 MB
    takes seconds."""
    context = service.context_tokens()
    if context and chars > context:  # a token has at least one character, so shorter texts cannot be too long
        least = service.tokenizer.least_tokens(_text_chars(body, _non_space))
        if least > context:
            raise BadRequest(400, f"the prompt has at least {least} tokens ({chars} characters), more than the "
                                  f"context length {context}")


# --- the legs -------------------------------------------------------------------------------------


JSON_HEADERS = {"Content-Type": "application/json"}
CACHE_MOVE_MIN_TIMEOUT_S = 5.0  # a move may take this long, or 4x the policy's estimate if longer
# An idle pooled connection to a worker is dropped after this, before SGLang's HTTP server closes it
# (uvicorn keep-alive, SGLANG_TIMEOUT_KEEP_ALIVE, 5 s). aiohttp's default keeps one 15 s, and a leg
# sent on one the server had just closed failed writing its body ("Can not write request body"): the
# router took a healthy PrfaaS worker out of routing and re-dispatched to PD (0.5.23 harness, 2026-11-28).
WORKER_KEEPALIVE_S = 4.0


def _link_header(lease: Lease) -> str:
    """The link the KV crossed (``prfaas->pd``), or the PD cluster that prefilled it locally."""
    return str(lease.pair) if lease.decision.cluster == "prfaas" else lease.pair.pd


async def _run_legs(request: web.Request, service: RouterService, req: EngineRequest, body: ClientBody,
                    lease: Lease, timing: str) -> web.StreamResponse:
    """Both legs of ``lease``'s decision and the client's answer (:class:`Legs`). Raises PrefillFailed /
    DecodeUnreachable while nothing has reached the client (the caller routes it again)."""
    legs = Legs(request, service, req, body, lease, timing)
    legs.start()
    try:
        return await legs.answer()
    except (aiohttp.ClientError, asyncio.TimeoutError) as err:
        return await legs.failed(err)
    finally:
        await legs.close()


class Legs:
    """One dispatched request's two legs, SGLang's PD protocol: the same body plus
    ``bootstrap_host/port/room`` POSTed to the prefill and the decode worker at once; the client's
    answer is the decode worker's. A non-streamed decode answers (even its headers) only once the KV
    has arrived; a streamed one answers 200 at once (SGLang) and its first event says whether the KV
    came. Until then nothing reaches the client, so a failed prefill leg can still be routed again."""

    def __init__(self, request: web.Request, service: RouterService, req: EngineRequest, body: ClientBody,
                 lease: Lease, timing: str):
        self.request, self.service, self.req, self.lease = request, service, req, lease
        decision = lease.decision
        self.prefill, self.decode = service.workers[decision.prefill], service.workers[decision.decode]
        replaced = engine_body(req, body.obj, service.tokenizer is not None)
        # serialised once; both legs then append their members to the same bytes
        self.body = ClientBody(replaced, orjson.dumps(replaced)) if replaced is not None else body
        # ttft-estimate: the TTFT the router predicted when it routed (calibrated; what placement and early
        # rejection compared with the SLO), beside what the client then sees
        self.timing = timing + f", ttft-estimate;dur={decision.estimated_ttft_s * 1e3:.3f}"
        self.headers = {"x-prfaas-route": f"{decision.cluster}/{self.prefill.name}/{self.decode.name}",
                        "x-request-id": req.rid, "x-prfaas-link": _link_header(lease), "Server-Timing": self.timing}
        self.timeout_s = service.config.phase_timeout_s
        self.prefill_task: asyncio.Task | None = None
        self.decode_task: asyncio.Task | None = None
        self.gone_task: asyncio.Task | None = None  # raises once the prefill worker has left (see _prefill_worker_gone)
        self.resp: aiohttp.ClientResponse | None = None
        self.stream: web.StreamResponse | None = None
        self.at_event_end = True  # what the client got of the stream so far ends at an event boundary
        self.started = 0.0

    def start(self) -> None:
        """Send both legs: the prefill's ends its work in the ledger (``prefill_done``) whatever its outcome."""
        session, path, decision = self.request.app[SESSION_KEY], PATHS[self.req.kind], self.lease.decision
        bootstrap = {"bootstrap_host": self.prefill.host, "bootstrap_port": self.prefill.bootstrap_port,
                     "bootstrap_room": _rng.getrandbits(63)}
        prefill_extra = {**bootstrap, "stream": False}
        if decision.checkpoint_tokens is not None and self.req.checkpoint_tokens is None:  # a client's own hint stands
            prefill_extra.update(with_checkpoint(self.req.kind, self.body.obj, decision.checkpoint_tokens))
            self.service.counters.checkpoint_hints += 1
        self.started = time.perf_counter()
        self.prefill_task = asyncio.create_task(_prefill_leg(session, self.prefill, path,
                                                             leg_bytes(self.body, None, prefill_extra), self.timeout_s))
        self.prefill_task.add_done_callback(lambda _t: self.service.prefill_done(self.lease))
        decode_cm = session.post(self.decode.url + path, data=leg_bytes(self.body, None, bootstrap), headers=JSON_HEADERS,
                                 timeout=aiohttp.ClientTimeout(total=self.timeout_s))
        self.decode_task = asyncio.create_task(decode_cm.__aenter__())
        self.gone_task = asyncio.create_task(self._prefill_worker_gone())

    async def _prefill_worker_gone(self) -> None:
        """Raises PrefillFailed once the prefill worker has left: the health checks took it out and a probe of its
        ``/health`` confirms. A worker deleted or partitioned away can go silent rather than refuse (behind an
        encrypted link's tunnel, or a WAN that drops): its legs would wait out the phase timeout, the decode its
        bootstrap timeout, while nothing has reached the client and the request could go elsewhere."""
        session = self.request.app[SESSION_KEY]
        while True:
            await asyncio.sleep(GONE_POLL_S)
            if not self.prefill.healthy and (why := await worker_gone(session, self.prefill.url, PREFILL_PROBE_S)):
                raise PrefillFailed(f"prefill worker {self.prefill.name} left before the KV arrived ({why})")

    async def answer(self) -> web.StreamResponse:
        """The client's answer: a prefill worker's 4xx, the decode worker's response, or its stream."""
        prefill_task, service = self.prefill_task, self.service
        done, _ = await asyncio.wait({self.decode_task, prefill_task, self.gone_task}, return_when=asyncio.FIRST_COMPLETED)
        if self.gone_task in done:
            raise self.gone_task.exception()  # nothing streamed yet: the caller re-dispatches
        if prefill_task in done:
            if prefill_task.exception() is not None:
                raise prefill_task.exception()  # nothing streamed yet: the caller re-dispatches
            status, payload = prefill_task.result()
            if status != 200:  # a client error: relay it, the decode leg is aborted in close()
                service.counters.rejected["worker_4xx"] += 1
                return web.Response(body=payload, status=status, headers=self.headers, content_type="application/json")
        self.resp = resp = await _unless_failed(self.decode_task, self.gone_task)
        if resp.status >= 500:  # before anything reached the client: a failed transfer is re-dispatched
            await self._raise_if_prefill_side_failed(resp.status)
        first = b""
        if self.req.stream and resp.status == 200:
            first = await _first_event(resp, prefill_task, self.gone_task)
            if (failed := stream_failure(first) or 0) >= 500:
                await self._raise_if_prefill_side_failed(failed)
        self.gone_task.cancel()  # the decode answered: the prefill worker's departure no longer matters
        if not self.req.stream or resp.status != 200:
            return await self._whole(resp)
        return await self._relay_stream(first, resp)

    async def _raise_if_prefill_side_failed(self, status: int) -> None:
        """The decode leg failed with ``status`` before anything reached the client: PrefillFailed (the request
        is routed again) when the prefill leg failed too (:func:`_raise_if_prefill_failed`); when its worker
        went away in between, its bootstrap server with it, so the decode could not take the KV (a Kubernetes
        pod deleted mid-request: scripts/k8s-local.sh's drill); or when the decode says 502, its upstream (the
        prefill's bootstrap server, the KV's path) failed although the router reaches the worker: a path
        between the two that another route avoids (a recreated PrfaaS pod that the decode's tunnel has not
        followed yet, the same drill with the link encrypted). A prefill worker that answers leaves any other
        failure of the decode to relay."""
        await _raise_if_prefill_failed(self.prefill_task, self.timeout_s)
        if why := await worker_gone(self.request.app[SESSION_KEY], self.prefill.url, PREFILL_PROBE_S):
            raise PrefillFailed(f"the decode leg could not take the KV: prefill worker {self.prefill.name} is gone ({why})")
        if status == 502:
            raise PrefillFailed(f"the decode leg could not take the KV from {self.prefill.name} (its answer: 502)")

    async def _whole(self, resp: aiohttp.ClientResponse) -> web.Response:
        """The decode worker's whole answer (not streamed, or an error)."""
        payload = await resp.read()
        if resp.status == 200:
            await self.prefill_task
            legs_s = time.perf_counter() - self.started
            self.service.counters.e2e.observe(legs_s)
            # Both legs, from the first byte sent to the last byte of both answers: what the
            # client would have waited dispatching itself; the rest of its wait is the router's.
            self.headers["Server-Timing"] = f"{self.timing}, legs;dur={legs_s * 1e3:.3f}"
        else:
            self.service.counters.failed[f"decode_{resp.status}"] += 1
        return web.Response(body=payload, status=resp.status, headers=self.headers, content_type="application/json")

    async def _relay_stream(self, first: bytes, resp: aiohttp.ClientResponse) -> web.StreamResponse:
        """The decode worker's SSE stream, chunk by chunk: its first token and gaps teach the calibration. A
        worker that streams every Nth token (SGLang's ``--stream-interval``, in its facts) sends N tokens a
        chunk after the first: a chunk's gap over N is the token gap the TBT histogram and the calibration
        see (otherwise its decode would read N times slower than it is)."""
        service, lease, started = self.service, self.lease, self.started
        facts = self.decode.facts
        per_chunk = facts.stream_interval if facts is not None else 1
        self.stream = stream = web.StreamResponse(status=200, headers={**self.headers, "Content-Type": "text/event-stream",
                                                                       "Cache-Control": "no-cache"})
        await stream.prepare(self.request)
        last = None
        async for data in _chain(first, resp.content.iter_any()):
            now = time.perf_counter()
            if last is None:
                service.counters.ttft.observe(now - started)
                service.first_token(lease, now - started, time.monotonic())
            else:
                gap_s = (now - last) / per_chunk
                service.counters.tbt.observe(gap_s)
                service.token_gap(lease, gap_s, time.monotonic())
            last = now
            await stream.write(data)
            self.at_event_end = ends_event(data)
        if not self.at_event_end:  # the worker closed its stream cleanly in the middle of an event
            raise aiohttp.ClientPayloadError("the decode stream ended inside an event")
        await stream.write_eof()
        service.counters.e2e.observe(time.perf_counter() - started)
        return stream

    async def failed(self, err: Exception) -> web.StreamResponse:
        """A leg failed mid-way: re-dispatch while nothing reached the client, else end what it got with a 502."""
        prefill_task = self.prefill_task
        if prefill_task.done() and not prefill_task.cancelled() and prefill_task.exception() is not None and self.stream is None:
            raise prefill_task.exception() from None
        if self.stream is None and self.resp is None and isinstance(err, (aiohttp.ClientConnectionError, aiohttp.ServerDisconnectedError)):
            # nothing reached the client and the decode worker never answered: route again
            raise DecodeUnreachable(f"decode worker {self.decode.name} unreachable: {err or type(err).__name__}") from None
        self.service.counters.failed["decode"] += 1
        message = f"decode worker {self.decode.name} failed: {err or type(err).__name__}"
        if self.stream is not None:  # the client already has a 200 and part of a stream: end it, never answer twice
            await _end_stream_with_error(self.stream, 502, message, self.at_event_end)
            return self.stream
        return _error(502, message)

    async def close(self) -> None:
        """Cancel what is still running (closing the decode connection makes the worker free its KV)."""
        tasks = [t for t in (self.decode_task, self.prefill_task, self.gone_task) if t is not None]
        for task in tasks:
            if not task.done():
                task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self.resp is not None:
            self.resp.release()


def _prefix_ids(input_ids, num_tokens: int) -> list[int]:
    if hasattr(input_ids, "packed_prefix"):  # ids still in their JSON text (wire.token_ids.JsonIds)
        return array("I", input_ids.packed_prefix(num_tokens)[:4 * num_tokens]).tolist()
    return list(input_ids[:num_tokens])


async def _move_cache(app: web.Application, req: EngineRequest, decision: RouteDecision) -> float:
    """Execute ``decision.transfer``: the chosen prefill worker fetches the prefix from the other
    cluster's worker that holds it (``wire.cache_move``) before the legs start. Returns the seconds it
    took. Never raises: a failed or timed-out move is counted by outcome, and the prefill then
    computes what did not arrive (recompute)."""
    service, session = app[SERVICE_KEY], app[SESSION_KEY]
    move = decision.transfer
    source, target = service.workers.get(move.source), service.workers.get(decision.prefill)
    started = time.perf_counter()
    if source is None or target is None:
        service.counters.cache_moves["no_worker"] += 1
        return 0.0
    timeout_s = min(service.config.phase_timeout_s, max(CACHE_MOVE_MIN_TIMEOUT_S, 4 * move.estimated_s))
    body = CacheImport(_prefix_ids(req.input_ids, move.tokens), move.tokens, source.url, timeout_s).to_json()
    outcome = "failed"
    try:
        async with session.post(target.url + "/prfaas/cache/import", data=orjson.dumps(body), headers=JSON_HEADERS,
                                timeout=aiohttp.ClientTimeout(total=timeout_s + 1.0)) as resp:
            payload = await resp.read()
        if resp.status == 200:
            CacheImported.decode(payload)
            outcome = "ok"
        elif resp.status == 409:
            outcome = "source_lost"  # the source evicted it since the index saw it
        else:
            logger.warning("cache move of %d tokens %s -> %s: %d %s", move.tokens, source.name, target.name,
                           resp.status, payload[:200].decode(errors="replace"))
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as err:
        outcome = "timeout" if isinstance(err, asyncio.TimeoutError) else "failed"
        logger.warning("cache move of %d tokens %s -> %s: %s", move.tokens, source.name, target.name,
                       err or type(err).__name__)
    elapsed = time.perf_counter() - started
    service.counters.cache_moves[outcome] += 1
    if outcome == "ok":
        service.counters.cache_move.observe(elapsed)
    return elapsed


def engine_body(req: EngineRequest, body: dict, tokenized: bool) -> dict | None:
    """What the workers get instead of the client's body, or None for the body unchanged: a text
    prompt the router tokenized is replaced by its ids (``/generate`` and ``/v1/completions`` take
    ids; chat keeps its messages, the template is the engine's), so the workers do not tokenize
    the same text again."""
    if not tokenized:
        return None
    if req.kind == "generate" and body.get("input_ids") is None:
        return {**{k: v for k, v in body.items() if k != "text"}, "input_ids": list(req.input_ids)}
    if req.kind == "completions" and isinstance(body.get("prompt"), str):
        return {**body, "prompt": list(req.input_ids)}
    return None


def leg_bytes(body: ClientBody, replaced: dict | None, extra: dict) -> bytes:
    """The JSON a worker gets: ``replaced`` (or the client's object) with ``extra``'s keys set.

    When the client's object is unchanged its bytes are re-sent, with ``extra`` appended as
    members before the closing brace (no re-serialisation of a 32K-token prompt). A key both in the
    client's object and in ``extra`` then appears twice and the later, ``extra``'s, wins, as it
    does for every JSON parser SGLang and the emulated engine use (Python's ``json``, ``orjson``).
    """
    if replaced is not None:
        return orjson.dumps({**replaced, **extra})
    head = body.raw.rstrip()
    members = orjson.dumps(extra)[1:-1]
    if not body.obj:
        return b"{" + members + b"}"
    return head[:-1] + b"," + members + b"}"


async def _prefill_leg(session, prefill: WorkerRecord, path: str, data: bytes, timeout_s: float) -> tuple[int, bytes]:
    """The prefill worker's (status, body). A worker fault (unreachable, 5xx) raises PrefillFailed;
    a client error (4xx) is returned for the client to see."""
    try:
        async with session.post(prefill.url + path, data=data, headers=JSON_HEADERS,
                                timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            status, payload = resp.status, await resp.read()
    except (aiohttp.ClientError, asyncio.TimeoutError) as err:
        raise PrefillFailed(f"prefill worker {prefill.name} unreachable: {err or type(err).__name__}") from None
    if status >= 500:
        raise PrefillFailed(f"prefill worker {prefill.name} answered {status}: {payload[:200].decode(errors='replace')}")
    return status, payload


PREFILL_VERDICT_S = 5.0  # after a decode failure, how long the prefill leg's own verdict is awaited
PREFILL_PROBE_S = 1.0  # then, when the prefill leg answered, how long its worker's /health is given
GONE_POLL_S = 0.5  # how often a request waiting for its KV looks whether its prefill worker was taken out


async def worker_gone(session: aiohttp.ClientSession, url: str, timeout_s: float) -> str | None:
    """Why the worker at ``url`` is gone (no 200 from its ``/health`` within ``timeout_s``: refused, reset,
    silent, or another status), or None when it answers."""
    try:
        async with session.get(url + "/health", timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            return None if resp.status == 200 else f"/health answered {resp.status}"
    except asyncio.TimeoutError:
        return f"no answer from /health within {timeout_s:g} s"
    except aiohttp.ClientError as err:
        return str(err) or type(err).__name__


async def _raise_if_prefill_failed(prefill_task: asyncio.Task, timeout_s: float) -> None:
    """After the decode leg failed before anything reached the client: raise the prefill leg's
    PrefillFailed if it failed too (unreachable, 5xx: a prefill fault or a failed KV transfer,
    which SGLang reports on both legs), so the caller routes the request again. A prefill that
    answered, or gives no verdict within :data:`PREFILL_VERDICT_S`, leaves the decode's failure
    to relay. Does not cancel ``prefill_task``."""
    try:
        await asyncio.wait_for(asyncio.shield(prefill_task), min(PREFILL_VERDICT_S, timeout_s))
    except asyncio.TimeoutError:
        pass


async def _unless_failed(task: asyncio.Task, *watchers: asyncio.Task):
    """``task``'s result, unless a watcher (a task that only ever fails: a prefill leg, its worker's departure)
    fails first: then that failure is raised (nothing has reached the client yet)."""
    watching = set(watchers)
    while not task.done():
        done, _ = await asyncio.wait({task, *watching}, return_when=asyncio.FIRST_COMPLETED)
        for watcher in done - {task}:
            if not watcher.cancelled() and watcher.exception() is not None:
                raise watcher.exception()
            watching.discard(watcher)  # it ended well (a prefill leg answered): nothing more to watch there
    return task.result()


async def _first_event(resp: aiohttp.ClientResponse, *watchers: asyncio.Task) -> bytes:
    """The decode stream's first SSE event (up to its blank line), read before the client is
    answered: SGLang sends 200 at once and reports a failure as an event. While it waits, a
    failed prefill leg or a prefill worker gone raises its PrefillFailed (nothing has reached the
    client yet)."""
    first_task = asyncio.create_task(_read_first_event(resp.content))
    try:
        return await _unless_failed(first_task, *watchers)
    finally:
        if not first_task.done():
            first_task.cancel()


FIRST_EVENT_MAX_BYTES = 1 << 20  # past this the first event is relayed unread (failure events are small)


async def _read_first_event(content: aiohttp.StreamReader) -> bytes:
    """Bytes from the stream up to at least the end of its first event (``\n\n`` or ``\r\n\r\n``),
    the end of the stream, or :data:`FIRST_EVENT_MAX_BYTES`; possibly more (whole reads)."""
    buf = b""
    while b"\n\n" not in buf and b"\r\n\r\n" not in buf and len(buf) < FIRST_EVENT_MAX_BYTES:
        data = await content.readany()
        if not data:
            break
        buf += data
    return buf


async def _end_stream_with_error(stream: web.StreamResponse, status: int, message: str, at_event_end: bool) -> None:
    """End a started SSE stream with :func:`~prfaas_sglang.protocol.stream_failed_event`. A client
    that left meanwhile is not an error."""
    try:
        await stream.write(stream_failed_event(status, message, at_event_end))
        await stream.write_eof()
    except (ConnectionError, RuntimeError):
        pass


async def _chain(first: bytes, rest):
    if first:
        yield first
    async for data in rest:
        yield data
