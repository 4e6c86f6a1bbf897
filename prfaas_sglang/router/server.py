"""The PrfaaS router's HTTP front end (aiohttp): OpenAI-compatible + SGLang /generate (adapter).

Per request (the decisions are :class:`~prfaas_sglang.router.service.RouterService`'s):
parse and tokenize as SGLang would -> 400 now if no worker could take it ->
decide a route; with no decode room, wait in the router (FIFO-ish, bounded by
``admission_timeout_s`` and ``max_waiting``: 503 / 429 with Retry-After) ->
the same body plus ``bootstrap_host/port/room`` POSTed to the prefill and the
decode worker at once, as SGLang's PD routers do -> the decode response (or
its SSE stream) back, with an ``x-prfaas-route`` header.

Faults: when the prefill leg fails before anything was streamed, the decode
leg is aborted (its connection closed, so the worker frees its KV), the
prefill worker is marked unhealthy and the request is routed again with a new
room (``redispatched``); after that it fails with 502. A stream that breaks
after it started ends with an error event (``{"error": {"code": 502, ...}}``)
and ``[DONE]``, never a second response.

Background loops: health + facts (``/health``, ``/server_info``) every
``health_interval_s``; load (``/v1/loads``) every ``load_interval_s``; the
controller every ``control_interval_s``; KV events and link telemetry through
one :class:`~prfaas_sglang.adapters.zmq.ZmqSubscriber`.
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
from prometheus_client import CONTENT_TYPE_PLAIN_0_0_4, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily

from prfaas_sglang import __version__
from prfaas_sglang.adapters.zmq import CurveKeys, ZmqSubscriber
from prfaas_sglang.kvindex.feed import kv_event_handler
from prfaas_sglang.kvindex.index import InvalidEvents
from prfaas_sglang.procgc import gc_status
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
from prfaas_sglang.router.admin import add_admin_routes
from prfaas_sglang.router.conversion import RoleSwitchClient, convert
from prfaas_sglang.router.longterm import pick_nodes
from prfaas_sglang.router.openapi import router_openapi
from prfaas_sglang.router.policy import NoDecodeRoom, NoHealthyWorker, RouteDecision, refuse_early
from prfaas_sglang.router.service import MAX_BODY_BYTES, Lease, RouterService
from prfaas_sglang.router.workers import (
    FactsError,
    WorkerRecord,
    check_facts,
    parse_loads,
    parse_server_info,
)
from prfaas_sglang.wire import kv_snapshot
from prfaas_sglang.wire.auth import DeploymentKeys
from prfaas_sglang.wire.cache_move import CacheImport, CacheImported
from prfaas_sglang.wire.kv_events import KV_EVENTS_TOPIC
from prfaas_sglang.wire.server_info import with_live_mode
from prfaas_sglang.wire.telemetry import TELEMETRY_TOPIC, LinkSample
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
SUB_KEY = web.AppKey("subscriber", ZmqSubscriber)
ROOM_KEY = web.AppKey("room", asyncio.Condition)
METRICS_KEY = web.AppKey("metrics", CollectorRegistry)  # what /metrics serves: the app's own registry


@dataclass(frozen=True)
class LongTermOptions:
    """How the router runs the long-term controller's decisions (the policy's own settings are in
    ``LongTermSettings``)."""

    sample_s: float = 10.0  # stage samples; decisions come every LongTermSettings.interval_s
    drain_timeout_s: float = 300.0  # a conversion gives up (back in service) after this


LONGTERM_KEY = web.AppKey("longterm", LongTermOptions)
_ids = itertools.count()
_rng = random.Random()


class RouterMetrics:
    """The router's ``/metrics`` (a prometheus_client collector), read from the app at each scrape:
    the service's gauges, counters and histograms (``router/metrics.py``), then the ZMQ handshakes
    its subscriber refused. Registered in the app's registry (:data:`METRICS_KEY`) by :func:`build_app`."""

    def __init__(self, app: web.Application):
        self._app = app

    def collect(self):
        now = time.monotonic()
        service = self._app[SERVICE_KEY]
        yield from service.counters.families(service.metrics_gauges(now))
        refused = sum(s["auth_failures"] for s in self._app[SUB_KEY].stats(now).values())
        yield CounterMetricFamily("prfaas_router_zmq_auth_failures_total", "ZMQ handshakes refused: a KV-event or "
                                  "telemetry publisher without the deployment's key", value=refused)


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


@dataclass(frozen=True)
class ClientBody:
    """The client's JSON object, parsed once, and its bytes (re-sent as they came when unchanged).
    ``obj`` may hold a :class:`JsonIds` for its ids (never serialised: the bytes are re-sent)."""

    obj: dict
    raw: bytes


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


async def _decide(app: web.Application, req: EngineRequest, tried: set[str], entry: str | None = None) -> RouteDecision:
    """A route, waiting for decode room when that is all that is missing. ``entry``: the PD cluster the
    request entered at (``x-prfaas-entry``), where it decodes; None: any."""
    service, room = app[SERVICE_KEY], app[ROOM_KEY]
    cfg = service.config
    deadline = time.monotonic() + cfg.admission_timeout_s
    waited_since, waited_for = None, ""
    request = service.route_input(req)  # the prompt is hashed once, not on every wake-up below
    try:
        while True:
            try:
                decision = service.decide(request, tried, time.monotonic(), entry)
                break
            except NoDecodeRoom as err:
                if waited_since is None:
                    if service.waiting >= cfg.max_waiting:
                        raise Rejected(429, "queue_full", f"{service.waiting} requests already wait for decode room",
                                       retry_after_s=2) from None
                    waited_since, waited_for = time.monotonic(), str(err)
                    service.waiting += 1
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise Rejected(503, "no_decode_room", f"{err} (waited {cfg.admission_timeout_s:g} s)",
                                   retry_after_s=max(1, int(cfg.admission_timeout_s / 4))) from None
                async with room:
                    try:
                        await asyncio.wait_for(room.wait(), min(remaining, 1.0))
                    except asyncio.TimeoutError:
                        pass
            except NoHealthyWorker as err:
                raise Rejected(503, "no_worker", str(err), retry_after_s=2) from None
    finally:
        if waited_since is not None:
            service.waiting -= 1
            waited_s = time.monotonic() - waited_since
            service.counters.queue_wait.observe(waited_s)
            if waited_s >= LOGGED_WAIT_S:
                logger.info("request %s waited %.1f s in the router for decode room (%s)", req.rid, waited_s, waited_for)
    if refuse_early(decision, cfg.max_ttft_s):
        raise Rejected(503, "ttft_estimate", f"overloaded: estimated TTFT {decision.estimated_ttft_s:.1f} s exceeds "
                                             f"{cfg.max_ttft_s:g} s",
                       retry_after_s=max(1, int(decision.estimated_ttft_s - cfg.max_ttft_s) + 1))
    return decision


async def dispatch(request: web.Request, kind: str) -> web.StreamResponse:
    service = request.app[SERVICE_KEY]
    received = time.perf_counter()
    limit = service.max_body_bytes()
    if request.content_length is not None and request.content_length > limit:  # refused before a byte is read
        service.counters.rejected["too_large"] += 1
        return _error(413, f"request body of {request.content_length} bytes exceeds {limit} bytes "
                           "(64 bytes per token of the largest context)", cause="too_large")
    try:
        req, body = await _parse(request, service, kind)
    except BadRequest as err:
        cause = {404: "unknown_model", 413: "too_large"}.get(err.status, "bad_request")
        service.counters.rejected[cause] += 1
        return _error(err.status, err.message, cause=cause if err.status == 413 else None)
    entry = request.headers.get(ENTRY_HEADER)
    if entry is not None and entry not in {p.pd for p in service.pairs}:
        service.counters.rejected["bad_request"] += 1
        return _error(400, f"{ENTRY_HEADER}: {entry!r} is not a PD cluster of this deployment "
                           f"({', '.join(p.pd for p in service.pairs)})")
    parsed = time.perf_counter()
    tried: set[str] = set()
    last_error, last_leg = "", "prefill"
    for attempt in range(2):
        try:
            decision = await _decide(request.app, req, tried, entry)
        except Rejected as err:
            service.counters.rejected[err.cause] += 1
            return _error(err.status, err.message, err.retry_after_s, err.cause)
        lease = service.begin(req, decision, time.monotonic(), attempt)
        # The router's own time before the legs (W3C Server-Timing, ms): reading and checking the
        # body, then routing it (prefix match, policy; waiting for decode room included).
        timing = f"parse;dur={(parsed - received) * 1e3:.3f}, route;dur={(time.perf_counter() - parsed) * 1e3:.3f}"
        try:
            if decision.transfer is not None:  # move, then prefill the rest (recompute if the move fails)
                moved_s = await _move_cache(request.app, req, decision)
                timing += f", move;dur={moved_s * 1e3:.3f}"
            return await _run_legs(request, service, req, body, lease, timing)
        except (PrefillFailed, DecodeUnreachable) as err:
            leg = "prefill" if isinstance(err, PrefillFailed) else "decode"
            tried.add(worker := service.leg_failed(decision, leg, time.monotonic()))
            service.counters.redispatched += 1
            logger.warning("request %s: its %s leg on %s failed (%s)%s", req.rid, leg, worker, err,
                           "; routing it again" if attempt == 0 else "")
            last_error, last_leg = str(err), leg
        finally:
            service.finish(lease)
            async with request.app[ROOM_KEY]:
                request.app[ROOM_KEY].notify_all()
    service.counters.failed[last_leg] += 1
    return _error(502, f"request failed after re-dispatch: {last_error}", cause=f"{last_leg}_failed")


JSON_HEADERS = {"Content-Type": "application/json"}
CACHE_MOVE_MIN_TIMEOUT_S = 5.0  # a move may take this long, or 4x the policy's estimate if longer
# An idle pooled connection to a worker is dropped after this, before SGLang's HTTP server closes it
# (uvicorn keep-alive, SGLANG_TIMEOUT_KEEP_ALIVE, 5 s). aiohttp's default keeps one 15 s, and a leg
# sent on one the server had just closed failed writing its body ("Can not write request body"): the
# router took a healthy PrfaaS worker out of routing and re-dispatched to PD (0.5.23 harness, 2026-11-28).
WORKER_KEEPALIVE_S = 4.0


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


async def _first_event(resp: aiohttp.ClientResponse, prefill_task: asyncio.Task) -> bytes:
    """The decode stream's first SSE event (up to its blank line), read before the client is
    answered: SGLang sends 200 at once and reports a failure as an event. While it waits, a
    failed prefill leg raises its PrefillFailed (nothing has reached the client yet)."""
    first_task = asyncio.create_task(_read_first_event(resp.content))
    try:
        done, _ = await asyncio.wait({first_task, prefill_task}, return_when=asyncio.FIRST_COMPLETED)
        if first_task not in done and prefill_task.exception() is not None:
            raise prefill_task.exception()
        return await first_task
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


def _link_header(decision: RouteDecision, service: RouterService) -> str:
    """The link the KV crossed (``prfaas->pd``), or the PD cluster that prefilled it locally."""
    pair = decision.pair or service.pair.pair
    return str(pair) if decision.cluster == "prfaas" else pair.pd


async def _run_legs(request: web.Request, service: RouterService, req: EngineRequest, body: ClientBody,
                    lease: Lease, timing: str) -> web.StreamResponse:
    decision = lease.decision
    session = request.app[SESSION_KEY]
    prefill, decode = service.workers[decision.prefill], service.workers[decision.decode]
    replaced = engine_body(req, body.obj, service.tokenizer is not None)
    if replaced is not None:  # serialised once; both legs then append their members to the same bytes
        body = ClientBody(replaced, orjson.dumps(replaced))
    bootstrap = {"bootstrap_host": prefill.host, "bootstrap_port": prefill.bootstrap_port,
                 "bootstrap_room": _rng.getrandbits(63)}
    path = PATHS[req.kind]
    # ttft-estimate: the TTFT the router predicted when it routed (calibrated; what placement and early
    # rejection compared with the SLO), beside what the client then sees
    timing += f", ttft-estimate;dur={decision.estimated_ttft_s * 1e3:.3f}"
    headers = {"x-prfaas-route": f"{decision.cluster}/{prefill.name}/{decode.name}", "x-request-id": req.rid,
               "x-prfaas-link": _link_header(decision, service),
               "Server-Timing": timing}
    timeout = service.config.phase_timeout_s
    started = time.perf_counter()
    prefill_extra = {**bootstrap, "stream": False}
    if decision.checkpoint_tokens is not None and req.checkpoint_tokens is None:  # a client's own hint stands
        prefill_extra.update(with_checkpoint(req.kind, body.obj, decision.checkpoint_tokens))
        service.counters.checkpoint_hints += 1
    prefill_task = asyncio.create_task(_prefill_leg(session, prefill, path, leg_bytes(body, None, prefill_extra), timeout))
    prefill_task.add_done_callback(lambda _t: service.prefill_done(lease))
    # A non-streamed decode answers (even its headers) only once the KV has arrived; a streamed
    # one answers 200 at once (SGLang) and its first event says whether the KV came. Until then
    # nothing reaches the client, so a failed prefill leg can still be routed again.
    decode_cm = session.post(decode.url + path, data=leg_bytes(body, None, bootstrap), headers=JSON_HEADERS,
                             timeout=aiohttp.ClientTimeout(total=timeout))
    decode_task = asyncio.create_task(decode_cm.__aenter__())
    resp = None
    stream = None
    at_event_end = True  # what the client got of the stream so far ends at an event boundary
    try:
        done, _ = await asyncio.wait({decode_task, prefill_task}, return_when=asyncio.FIRST_COMPLETED)
        if prefill_task in done:
            if prefill_task.exception() is not None:
                raise prefill_task.exception()  # nothing streamed yet: the caller re-dispatches
            status, payload = prefill_task.result()
            if status != 200:  # a client error: relay it, the decode leg is aborted in finally
                service.counters.rejected["worker_4xx"] += 1
                return web.Response(body=payload, status=status, headers=headers, content_type="application/json")
        resp = await decode_task
        if resp.status >= 500:  # before anything reached the client: a failed transfer is re-dispatched
            await _raise_if_prefill_failed(prefill_task, service.config.phase_timeout_s)
        first = b""
        if req.stream and resp.status == 200:
            first = await _first_event(resp, prefill_task)
            if (stream_failure(first) or 0) >= 500:
                await _raise_if_prefill_failed(prefill_task, service.config.phase_timeout_s)
        if not req.stream or resp.status != 200:
            payload = await resp.read()
            if resp.status == 200:
                await prefill_task
                legs_s = time.perf_counter() - started
                service.counters.e2e.observe(legs_s)
                # Both legs, from the first byte sent to the last byte of both answers: what the
                # client would have waited dispatching itself; the rest of its wait is the router's.
                headers["Server-Timing"] = f"{timing}, legs;dur={legs_s * 1e3:.3f}"
            else:
                service.counters.failed[f"decode_{resp.status}"] += 1
            return web.Response(body=payload, status=resp.status, headers=headers, content_type="application/json")
        stream = web.StreamResponse(status=200, headers={**headers, "Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await stream.prepare(request)
        last = None
        async for data in _chain(first, resp.content.iter_any()):
            now = time.perf_counter()
            if last is None:
                service.counters.ttft.observe(now - started)
                service.first_token(lease, now - started, time.monotonic())
            else:
                service.counters.tbt.observe(now - last)
                service.token_gap(now - last, time.monotonic())
            last = now
            await stream.write(data)
            at_event_end = ends_event(data)
        if not at_event_end:  # the worker closed its stream cleanly in the middle of an event
            raise aiohttp.ClientPayloadError("the decode stream ended inside an event")
        await stream.write_eof()
        service.counters.e2e.observe(time.perf_counter() - started)
        return stream
    except (aiohttp.ClientError, asyncio.TimeoutError) as err:
        if prefill_task.done() and not prefill_task.cancelled() and prefill_task.exception() is not None and stream is None:
            raise prefill_task.exception() from None
        if stream is None and resp is None and isinstance(err, (aiohttp.ClientConnectionError, aiohttp.ServerDisconnectedError)):
            # nothing reached the client and the decode worker never answered: route again
            raise DecodeUnreachable(f"decode worker {decode.name} unreachable: {err or type(err).__name__}") from None
        service.counters.failed["decode"] += 1
        message = f"decode worker {decode.name} failed: {err or type(err).__name__}"
        if stream is not None:  # the client already has a 200 and part of a stream: end it, never answer twice
            await _end_stream_with_error(stream, 502, message, at_event_end)
            return stream
        return _error(502, message)
    finally:
        for task in (decode_task, prefill_task):
            if not task.done():
                task.cancel()  # closing the decode connection makes the worker free its KV
        await asyncio.gather(decode_task, prefill_task, return_exceptions=True)
        if resp is not None:
            resp.release()


# --- background loops ----------------------------------------------------------------------


async def _get_json(session: aiohttp.ClientSession, url: str, timeout_s: float = 2.0):
    async with session.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
        if resp.status != 200:
            raise FactsError(f"{url} answered {resp.status}")
        return await resp.json(content_type=None)


async def _model_info(session: aiohttp.ClientSession, url: str) -> dict | None:
    """A worker's ``/model_info`` (where SGLang 0.5.23 states its live role), or None when it has none to give."""
    try:
        return await _get_json(session, url + "/model_info")
    except (aiohttp.ClientError, asyncio.TimeoutError, FactsError, ValueError):
        return None


def adopt_facts(service: RouterService, worker: WorkerRecord, info, sub: ZmqSubscriber | None) -> str | None:
    """Parse and check a worker's /server_info; on success start its event feed. Returns why it was refused."""
    try:
        facts = parse_server_info(info)
    except FactsError as err:
        worker.refused = f"{worker.name}: bad /server_info: {err}"
        return worker.refused
    problem = check_facts(worker, facts, list(service.workers.values()), service.emulation_spec, service.runtime.state)
    worker.refused = problem
    if problem is None:
        worker.facts = facts
        if sub is not None:
            _watch_worker(service, worker, sub)
    return problem


def _watch_worker(service: RouterService, worker: WorkerRecord, sub: ZmqSubscriber) -> None:
    url = worker.kv_events_url
    if url is not None and f"kv:{worker.name}" not in sub.sources():
        block = worker.facts.kv_events.block_size if worker.facts and worker.facts.kv_events else worker.facts.page_size
        service.index.add_worker(worker.name, worker.cluster, block)
        topic = (worker.kv_events_topic if worker.kv_events_topic is not None else KV_EVENTS_TOPIC).encode()
        sub.watch(f"kv:{worker.name}", url, topic, kv_event_handler(service.index, worker.name))
    if worker.telemetry_endpoint and worker.cluster == "prfaas" and f"link:{worker.name}" not in sub.sources():
        def on_sample(frames, name=worker.name):
            service.take_telemetry(name, LinkSample.decode(frames[-1]), time.monotonic(), time.time())

        sub.watch(f"link:{worker.name}", worker.telemetry_endpoint, TELEMETRY_TOPIC, on_sample)


async def poll_health(service: RouterService, session: aiohttp.ClientSession, sub: ZmqSubscriber | None,
                      worker: WorkerRecord) -> None:
    """One health check of ``worker`` (``/health``; ``/server_info`` while it has no facts), recorded
    with :meth:`WorkerRecord.note_health`: no answer within ``health_timeout_s`` is a miss, and only
    ``health_misses_to_down`` misses in a row take the worker out. An answer that left the worker
    before a role change (``worker.epoch`` moved meanwhile) is dropped."""
    epoch, config = worker.epoch, service.config
    try:
        async with session.get(worker.url + "/health", timeout=aiohttp.ClientTimeout(total=config.health_timeout_s)) as resp:
            answer = "ok" if resp.status == 200 else "down"
        if answer == "ok" and worker.facts is None:
            info = with_live_mode(await _get_json(session, worker.url + "/server_info"),
                                  await _model_info(session, worker.url))
            if not worker.poll_is_current(epoch):
                return
            problem = adopt_facts(service, worker, info, sub)
            if problem:
                logger.error("refusing worker %s: %s", worker.name, problem)
    except asyncio.TimeoutError:
        answer = "timeout"
    except (aiohttp.ClientError, FactsError, ValueError):
        answer = "down"
    if worker.poll_is_current(epoch):
        was = worker.healthy
        worker.note_health(answer, config.health_misses_to_down)
        if was and not worker.healthy:
            logger.warning("worker %s is down (health check: %s)", worker.name, answer)


async def poll_load(session: aiohttp.ClientSession, worker: WorkerRecord) -> None:
    """One ``/v1/loads`` read of ``worker`` into ``worker.load`` (None when it cannot be read). An
    answer that left the worker before a role change is dropped: a prefill worker's load read as a
    decode worker's would make its KV room look like the old role's cache size until the next poll."""
    epoch, covers = worker.epoch, worker.last_ticket
    try:
        load = parse_loads(await _get_json(session, worker.url + "/v1/loads", 1.0))
    except (aiohttp.ClientError, asyncio.TimeoutError, FactsError, ValueError):
        load = None
    if worker.poll_is_current(epoch):
        worker.take_load(load, covers)


async def _health_loop(app: web.Application) -> None:
    """Every ``health_interval_s``, one health check of each worker. The first pass asks only the
    workers the startup preflight did not adopt (it has just checked the others), so what the router
    knows of an adopted worker one interval after start comes from that preflight or a failed leg."""
    service, session, sub = app[SERVICE_KEY], app[SESSION_KEY], app[SUB_KEY]
    first_pass = True
    while True:
        for worker in list(service.workers.values()):
            if not (first_pass and worker.healthy):
                await poll_health(service, session, sub, worker)
        first_pass = False
        await asyncio.sleep(service.config.health_interval_s)


async def _load_loop(app: web.Application) -> None:
    service, session, room = app[SERVICE_KEY], app[SESSION_KEY], app[ROOM_KEY]
    while True:
        for worker in list(service.workers.values()):
            if worker.healthy:
                await poll_load(session, worker)
        service.poll_stages(time.monotonic())
        async with room:
            room.notify_all()
        await asyncio.sleep(service.config.load_interval_s)


async def _control_loop(app: web.Application) -> None:
    service = app[SERVICE_KEY]
    while True:
        for pair, t in service.control_tick(time.monotonic()).items():
            logger.info("threshold t of %s -> %.0f tokens (%s)", pair, t, service.pairs[pair].controller.history[-1][2])
        await asyncio.sleep(service.config.control_interval_s)


async def _longterm_loop(app: web.Application) -> None:
    """The long-term scheduler (``router.longterm``, the simulator's own policy object), one controller
    per PD cluster: a stage sample every ``sample_s``; a decision converts that cluster's least-loaded
    workers through ``convert``. A conversion that fails leaves the controller on the split that really
    serves."""
    service = app[SERVICE_KEY]
    options = app[LONGTERM_KEY]
    service.stage_samples(time.monotonic())  # the first sample starts here
    interval_s = min(ctl.settings.interval_s for ctl in service.longterm.values())
    while True:
        await asyncio.sleep(min(options.sample_s, interval_s))
        now = time.monotonic()
        for pair, sample in service.stage_samples(now).items():
            replan = service.longterm[pair].observe(now, sample, service.pairs[pair].controller.threshold_tokens)
            if replan is not None:
                await _convert_for(app, pair, replan)
        service.sync_longterm()  # a conversion that failed, or too few switchable workers: the split that serves


async def _convert_for(app: web.Application, pair, replan) -> None:
    """Carry out one long-term decision on PD cluster ``pair.pd``."""
    service, session, options = app[SERVICE_KEY], app[SESSION_KEY], app[LONGTERM_KEY]
    from_role, to_role = ("decode", "prefill") if replan.convert > 0 else ("prefill", "decode")
    candidates = [(w.name, float(service.open_legs(w.name))) for w in service.workers.values()
                  if w.cluster == "pd" and w.site == pair.pd and w.role == from_role and w.routable
                  and w.switch_url is not None]
    chosen = pick_nodes(candidates, abs(replan.convert))
    logger.info("long-term %s: convert %s to %s (%s)", pair.pd, ", ".join(chosen) or "nothing switchable", to_role,
                replan.reason)
    results = await asyncio.gather(*(convert(service, RoleSwitchClient(session), name, to_role,
                                             drain_timeout_s=options.drain_timeout_s, runtime=replan.runtime,
                                             why=f"long-term: {replan.reason}", on_converted=lambda n: _unwatch(app, n),
                                             rejoin_s=service.config.prefill_rejoin_s)
                                     for name in chosen), return_exceptions=True)
    for err in (r for r in results if isinstance(r, BaseException)):
        logger.error("long-term conversion failed: %s", err)


async def _restore_index(app: web.Application, kv_index_url: str) -> None:
    """Take the kv-index service's view once at start-up (a restarted router does not wait for new
    events to learn what the workers hold); merged into what live events already stored. A missing
    or unreachable kv-index service is logged, not fatal."""
    service, session = app[SERVICE_KEY], app[SESSION_KEY]
    try:
        async with session.get(kv_index_url + "/snapshot", timeout=aiohttp.ClientTimeout(total=10)) as resp:
            payload = await resp.read() if resp.status == 200 else None
        snapshot = kv_snapshot.decode(payload) if payload is not None else {}
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as err:
        logger.warning("kv-index snapshot from %s not taken: %s", kv_index_url, err or type(err).__name__)
        return
    for name, snap in snapshot.items():
        worker = service.workers.get(name)
        if worker is None or name not in service.index.workers():
            continue  # not ours, or not adopted yet (its facts, hence its page size, unknown)
        try:
            added = service.index.restore(name, snap)
        except InvalidEvents as err:
            logger.warning("kv-index snapshot for %s refused: %s", name, err)
            continue
        service.counters.restored_blocks += added
        logger.info("kv-index snapshot: %d blocks of %s restored", added, name)


def _unwatch(app: web.Application, name: str) -> None:
    """Stop following worker ``name``'s streams (deregistered; or converted: the health loop re-reads
    its facts and subscribes again for its new role)."""
    app[SUB_KEY].unwatch(f"kv:{name}")
    app[SUB_KEY].unwatch(f"link:{name}")


def build_app(service: RouterService, kv_index_url: str | None = None, keys: DeploymentKeys | None = None,
              longterm: LongTermOptions | None = None) -> web.Application:
    """The router's HTTP app. With ``keys`` (the deployment secret's), every request to a worker or
    the kv-index carries the worker API key, and KV-event and telemetry streams are CURVE clients
    that accept only publishers holding the deployment's key."""
    app = web.Application(client_max_size=MAX_BODY_BYTES)
    app[SERVICE_KEY] = service
    app[LONGTERM_KEY] = longterm or LongTermOptions()
    app[METRICS_KEY] = CollectorRegistry()
    app[METRICS_KEY].register(RouterMetrics(app))

    async def on_startup(app):
        app[SESSION_KEY] = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=1024, keepalive_timeout=WORKER_KEEPALIVE_S),
            headers=keys.bearer() if keys else None)
        app[SUB_KEY] = ZmqSubscriber(curve=CurveKeys.from_deployment(keys))
        app[ROOM_KEY] = asyncio.Condition()
        for worker in service.workers.values():
            if worker.facts is not None:
                _watch_worker(service, worker, app[SUB_KEY])
        loops = [_health_loop, _load_loop, _control_loop] + ([_longterm_loop] if service.longterm else [])
        app["tasks"] = [asyncio.create_task(loop(app), name=loop.__name__) for loop in loops]
        if kv_index_url is not None:
            app["tasks"].append(asyncio.create_task(_restore_index(app, kv_index_url), name="restore_index"))

    async def on_cleanup(app):
        for task in app["tasks"]:
            task.cancel()
        await asyncio.gather(*app["tasks"], return_exceptions=True)
        await app[SUB_KEY].close()
        await app[SESSION_KEY].close()

    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)

    async def health(request):
        return web.Response(text="OK")

    async def models(request):
        return web.json_response({"object": "list", "data": [{"id": n, "object": "model", "created": int(time.time()),
                                                              "owned_by": "prfaas-sglang"} for n in service.model_names()]})

    async def status(request):
        now = time.monotonic()
        body = service.status(now)
        body["threshold_history"] = [{"t_s": t, "threshold_tokens": v, "why": why} for t, v, why in service.controller.history]
        body["subscriptions"] = request.app[SUB_KEY].stats(now)
        body["gc"] = gc_status()
        body["kv_memo"] = service.index.memo.stats()
        return web.json_response(body)

    async def metrics(request):
        return web.Response(body=generate_latest(request.app[METRICS_KEY]),
                            headers={"Content-Type": CONTENT_TYPE_PLAIN_0_0_4})

    def on_register(app, record):
        pass  # the health loop fetches its facts, then subscribes

    def on_deregister(app, name):
        _unwatch(app, name)
        if name in service.index.workers():
            service.index.remove_worker(name)
        service.forget_worker(name)

    async def on_convert(app, name, new_role, drain_timeout_s):
        return await convert(service, RoleSwitchClient(app[SESSION_KEY]), name, new_role, drain_timeout_s=drain_timeout_s,
                             on_converted=lambda n: _unwatch(app, n), rejoin_s=service.config.prefill_rejoin_s)

    add_admin_routes(app, SERVICE_KEY, on_register, on_deregister, on_convert)
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/status", status)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/openapi.json", lambda request: web.json_response(router_openapi(__version__, service.model_names())))
    for kind, path in PATHS.items():
        app.router.add_post(path, lambda request, kind=kind: dispatch(request, kind))
    return app
