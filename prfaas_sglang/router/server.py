"""The PrfaaS router's HTTP front end (aiohttp): OpenAI-compatible + SGLang /generate.

Per request: token ids (``input_ids``/``prompt`` ids; text is estimated with the
word-level pseudo-tokenizer when no tokenizer is configured, see README) ->
the KV index's prefix match -> :func:`policy.route` -> the same body plus
``bootstrap_host/port/room`` POSTed to the chosen prefill worker and to the
decode worker at once, as SGLang's PD routers do -> the decode response (or
its SSE stream) back to the client, with an ``x-prfaas-route`` header.

Faults: when the prefill leg fails before anything was streamed, the decode
leg is aborted (its connection closed, so the worker frees its KV region), the
prefill worker is marked unhealthy and the request is routed again with a new
bootstrap room; after that it fails with 502. No worker -> 503 + Retry-After.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import json
import random
import time
from dataclasses import dataclass, field

import aiohttp
from aiohttp import web

from prfaas_sglang.kvindex.index import KvIndex
from prfaas_sglang.kvindex.subscriber import KvEventSubscriber
from prfaas_sglang.plan.profiles import PrefillProfile
from prfaas_sglang.protocol import BadRequest, parse_request
from prfaas_sglang.router.admin import add_admin_routes
from prfaas_sglang.router.metrics import Histogram
from prfaas_sglang.router.policy import BandwidthMode, Link, NoHealthyWorker, RouteDecision, route
from prfaas_sglang.router.telemetry import TelemetryConsumer
from prfaas_sglang.router.threshold import ThresholdController
from prfaas_sglang.router.workers import WorkerRecord

PATHS = {"generate": "/generate", "completions": "/v1/completions", "chat": "/v1/chat/completions"}


class PrefillFailed(Exception):
    """The prefill leg failed; ``retryable`` when nothing reached the client yet."""


@dataclass
class RouterState:
    workers: dict[str, WorkerRecord]
    index: KvIndex
    controller: ThresholdController
    prefill_cost: dict[str, PrefillProfile]
    kv_bytes: object  # Callable[[float], float]
    link: Link
    mode: BandwidthMode = BandwidthMode.SCARCE
    page_size: int = 512
    phase_timeout_s: float = 600.0
    health_interval_s: float = 2.0
    model_name: str = "prfaas"
    served_models: frozenset[str] = frozenset()  # empty: accept any model name
    routed: dict[str, int] = field(default_factory=lambda: {"prfaas": 0, "pd": 0})
    fallbacks: int = 0
    rejections: int = 0
    failed: int = 0
    recent: collections.deque = field(default_factory=lambda: collections.deque(maxlen=50))
    rng: random.Random = field(default_factory=random.Random)
    max_ttft_s: float | None = None  # early rejection: refuse when the best route's estimate exceeds it
    ttft: Histogram = field(default_factory=Histogram)  # streamed requests: time to the first byte
    tbt: Histogram = field(default_factory=Histogram)  # streamed requests: gaps between chunks
    e2e: Histogram = field(default_factory=Histogram)  # every successful request


STATE_KEY = web.AppKey("state", RouterState)
SESSION_KEY = web.AppKey("session", aiohttp.ClientSession)
SUB_KEY = web.AppKey("subscriber", KvEventSubscriber)
TELEMETRY_KEY = web.AppKey("telemetry", TelemetryConsumer)
_ids = itertools.count()


def _error(status: int, message: str, retry_after_s: int | None = None) -> web.Response:
    headers = {"Retry-After": str(retry_after_s)} if retry_after_s else None
    return web.json_response({"error": {"message": message, "code": status}}, status=status, headers=headers)


def decide(state: RouterState, token_ids: tuple[int, ...], exclude: set[str]) -> RouteDecision:
    match = state.index.match(token_ids, block_size=state.page_size)
    snapshots = [w.snapshot() for w in state.workers.values() if w.name not in exclude]
    return route(len(token_ids), match.by_worker, snapshots, state.controller.threshold_tokens, state.mode,
                 state.prefill_cost, state.link, state.kv_bytes)


async def _post_json(session: aiohttp.ClientSession, url: str, body: dict, timeout_s: float) -> tuple[int, bytes]:
    async with session.post(url, json=body, timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
        return resp.status, await resp.read()


async def _prefill_leg(session, prefill: WorkerRecord, path: str, body: dict, timeout_s: float) -> tuple[int, bytes]:
    """The prefill worker's (status, body). A worker fault (unreachable, 5xx) raises PrefillFailed;
    a client error (4xx, e.g. a prompt beyond the context) is returned for the client to see."""
    try:
        status, payload = await _post_json(session, prefill.url + path, {**body, "stream": False}, timeout_s)
    except (aiohttp.ClientError, asyncio.TimeoutError) as err:
        raise PrefillFailed(f"prefill worker {prefill.name} unreachable: {err or type(err).__name__}") from None
    if status >= 500:
        raise PrefillFailed(f"prefill worker {prefill.name} answered {status}: {payload[:200].decode(errors='replace')}")
    return status, payload


async def dispatch(request: web.Request, kind: str) -> web.StreamResponse:
    state, session = request.app[STATE_KEY], request.app[SESSION_KEY]
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        return _error(400, "request body is not valid JSON")
    try:
        req = parse_request(kind, body, f"prfaas-{next(_ids)}")
    except BadRequest as err:
        return _error(err.status, err.message)
    if req.bootstrap is not None:
        return _error(400, "bootstrap_host/bootstrap_port/bootstrap_room are set by the router; remove them")
    if state.served_models and req.model is not None and req.model not in state.served_models:
        return _error(404, f"model {req.model!r} not found (served: {', '.join(sorted(state.served_models))})")
    tried: set[str] = set()
    for attempt in range(2):
        try:
            decision = decide(state, req.input_ids, tried)
        except NoHealthyWorker as err:
            state.rejections += 1
            return _error(503, str(err), retry_after_s=2)
        if state.max_ttft_s is not None and decision.estimated_ttft_s > state.max_ttft_s:
            state.rejections += 1
            return _error(503, f"overloaded: estimated TTFT {decision.estimated_ttft_s:.1f} s exceeds {state.max_ttft_s:g} s",
                          retry_after_s=max(1, int(decision.estimated_ttft_s - state.max_ttft_s) + 1))
        prefill = state.workers[decision.prefill]
        out = {**body, "bootstrap_host": prefill.host, "bootstrap_port": prefill.bootstrap_port,
               "bootstrap_room": state.rng.getrandbits(63)}
        state.routed[decision.cluster] += 1
        state.recent.append({"rid": req.rid, "cluster": decision.cluster, "prefill": prefill.name,
                             "cached_tokens": decision.cached_tokens, "tokens": len(req.input_ids),
                             "reason": decision.reason, "attempt": attempt})
        try:
            return await _run_legs(request, state, session, req, decision, out)
        except PrefillFailed as err:
            prefill.healthy = False
            prefill.failures += 1
            tried.add(prefill.name)
            state.fallbacks += 1
            last_error = str(err)
    state.failed += 1
    return _error(502, f"request failed after re-dispatch: {last_error}")


async def _run_legs(request, state, session, req, decision: RouteDecision, out: dict) -> web.StreamResponse:
    prefill, decode = state.workers[decision.prefill], state.workers[decision.decode]
    path = PATHS[req.kind]
    headers = {"x-prfaas-route": f"{decision.cluster}/{prefill.name}/{decode.name}", "x-request-id": req.rid}
    estimate = max(decision.estimated_ttft_s - prefill.queue_s, 0.0)
    prefill.queue_s += estimate
    decode.running += 1
    started = time.perf_counter()
    prefill_task = asyncio.create_task(_prefill_leg(session, prefill, path, out, state.phase_timeout_s))
    # The decode worker answers (even its headers) only once the KV has arrived, so the
    # race between the two legs starts before the decode response exists.
    decode_cm = session.post(decode.url + path, json=out, timeout=aiohttp.ClientTimeout(total=state.phase_timeout_s))
    decode_task = asyncio.create_task(decode_cm.__aenter__())
    resp = None
    try:
        done, _ = await asyncio.wait({decode_task, prefill_task}, return_when=asyncio.FIRST_COMPLETED)
        if prefill_task in done:
            if prefill_task.exception() is not None:
                raise prefill_task.exception()  # nothing streamed yet: the caller re-dispatches
            status, payload = prefill_task.result()
            if status != 200:  # a client error: relay it, the decode leg is aborted in finally
                return web.Response(body=payload, status=status, headers=headers, content_type="application/json")
        resp = await decode_task
        if not req.stream or resp.status != 200:
            payload = await resp.read()
            if resp.status == 200:
                await prefill_task
                state.e2e.observe(time.perf_counter() - started)
            return web.Response(body=payload, status=resp.status, headers=headers, content_type="application/json")
        stream = web.StreamResponse(status=200, headers={**headers, "Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await stream.prepare(request)
        last = None
        async for data in resp.content.iter_any():
            now = time.perf_counter()
            if last is None:
                state.ttft.observe(now - started)
            else:
                state.tbt.observe(now - last)
            last = now
            await stream.write(data)
        await stream.write_eof()
        state.e2e.observe(time.perf_counter() - started)
        return stream
    except (aiohttp.ClientError, asyncio.TimeoutError) as err:
        if prefill_task.done() and not prefill_task.cancelled() and prefill_task.exception() is not None:
            raise prefill_task.exception() from None
        state.failed += 1
        return _error(502, f"decode worker {decode.name} failed: {err or type(err).__name__}")
    finally:
        prefill.queue_s = max(prefill.queue_s - estimate, 0.0)
        decode.running -= 1
        for task in (decode_task, prefill_task):
            if not task.done():
                task.cancel()  # closing the decode connection makes the worker free its KV region
        await asyncio.gather(decode_task, prefill_task, return_exceptions=True)
        if resp is not None:
            resp.release()


async def _health_loop(app: web.Application) -> None:
    state, session = app[STATE_KEY], app[SESSION_KEY]
    while True:
        for worker in state.workers.values():
            try:
                async with session.get(worker.url + "/health", timeout=aiohttp.ClientTimeout(total=2)) as resp:
                    worker.healthy = resp.status == 200
            except (aiohttp.ClientError, asyncio.TimeoutError):
                worker.healthy = False
        await asyncio.sleep(state.health_interval_s)


def _status(state: RouterState) -> dict:
    return {
        "threshold_tokens": state.controller.threshold_tokens,
        "bandwidth_mode": state.mode.value,
        "routed": state.routed,
        "fallbacks": state.fallbacks,
        "rejections": state.rejections,
        "failed": state.failed,
        "workers": {w.name: {"cluster": w.cluster, "role": w.role, "healthy": w.healthy, "queue_s": w.queue_s,
                             "running": w.running, "index_blocks": state.index.block_count(w.name)
                             if w.name in state.index.workers() else None} for w in state.workers.values()},
        "recent": list(state.recent)[-10:],
    }


def _metrics(state: RouterState, telemetry: TelemetryConsumer | None = None) -> str:
    routed = sum(state.routed.values())
    rows = [("prfaas_router_threshold_tokens", "gauge", "", state.controller.threshold_tokens),
            ("prfaas_router_offload_fraction", "gauge", "", state.routed.get("prfaas", 0) / routed if routed else 0.0)]
    if telemetry is not None and telemetry.series:
        last = telemetry.series[-1]
        rows += [("prfaas_router_egress_utilization", "gauge", "", last["utilization"]),
                 ("prfaas_router_egress_bps", "gauge", "", last["egress_bps"])]
    rows += [("prfaas_router_routed_total", "counter", f'{{cluster="{c}"}}', n) for c, n in state.routed.items()]
    rows += [("prfaas_router_fallbacks_total", "counter", "", state.fallbacks),
             ("prfaas_router_rejections_total", "counter", "", state.rejections),
             ("prfaas_router_failed_total", "counter", "", state.failed)]
    rows += [("prfaas_router_worker_healthy", "gauge", f'{{worker="{w.name}"}}', int(w.healthy)) for w in state.workers.values()]
    text = "".join(f"# TYPE {n} {k}\n{n}{labels} {v}\n" for n, k, labels, v in rows)
    return (text + state.ttft.render("prfaas_router_ttft_seconds") + state.tbt.render("prfaas_router_tbt_seconds")
            + state.e2e.render("prfaas_router_request_seconds"))


def build_app(state: RouterState) -> web.Application:
    app = web.Application(client_max_size=64 << 20)
    app[STATE_KEY] = state

    async def on_startup(app):
        app[SESSION_KEY] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1024))
        app[SUB_KEY] = KvEventSubscriber(state.index)
        app[TELEMETRY_KEY] = TelemetryConsumer(state)
        for w in state.workers.values():
            if w.events_endpoint:
                app[SUB_KEY].watch(w.name, w.cluster, w.events_endpoint)
            if w.telemetry_endpoint and w.cluster == "prfaas":
                app[TELEMETRY_KEY].watch(w.name, w.telemetry_endpoint)
        app["health_task"] = asyncio.create_task(_health_loop(app))

    async def on_cleanup(app):
        app["health_task"].cancel()
        await asyncio.gather(app["health_task"], return_exceptions=True)
        await app[SUB_KEY].close()
        await app[TELEMETRY_KEY].close()
        await app[SESSION_KEY].close()

    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)

    async def health(request):
        return web.Response(text="OK")

    async def models(request):
        names = sorted(state.served_models) or [state.model_name]
        return web.json_response({"object": "list", "data": [{"id": n, "object": "model", "created": int(time.time()),
                                                              "owned_by": "prfaas-sglang"} for n in names]})

    async def status(request):
        body = _status(state)
        body["threshold_history"] = [{"t_s": t, "threshold_tokens": v, "why": why} for t, v, why in state.controller.history]
        body["telemetry"] = list(request.app[TELEMETRY_KEY].series)[-int(request.query.get("telemetry", "20")):]
        return web.json_response(body)

    async def metrics(request):
        return web.Response(text=_metrics(state, request.app[TELEMETRY_KEY]), content_type="text/plain")

    def on_register(app, record):
        if record.events_endpoint:
            app[SUB_KEY].watch(record.name, record.cluster, record.events_endpoint)
        if record.telemetry_endpoint and record.cluster == "prfaas":
            app[TELEMETRY_KEY].watch(record.name, record.telemetry_endpoint)

    def on_deregister(app, name):
        if name in state.index.workers():
            app[SUB_KEY].unwatch(name)
        app[TELEMETRY_KEY].unwatch(name)

    add_admin_routes(app, STATE_KEY, on_register, on_deregister)
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/status", status)
    app.router.add_get("/metrics", metrics)
    for kind, path in PATHS.items():
        app.router.add_post(path, lambda request, kind=kind: dispatch(request, kind))
    return app
