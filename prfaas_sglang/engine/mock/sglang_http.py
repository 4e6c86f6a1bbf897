"""SGLang's HTTP surface for the emulated worker (aiohttp), as a router sees it.

Served: /health, /health_generate, /v1/models (owned_by "sglang"),
/server_info and /get_server_info, /model_info and /get_model_info,
/get_load, /v1/loads, /metrics (SGLang gauge names), /flush_cache,
/generate, /v1/completions, /v1/chat/completions (SSE or not), plus the
internal /prfaas/kv_ready (decode), upstream's /pd_role_switch (with
``--enable-pd-role-switch``; ``wire.role_switch``) and /prfaas/faults (fault injection for tests:
``{"fail_kv_transfers": N}`` fails the next N KV transfers of a prefill worker as a
broken link would: both legs answer 502; ``{"fail_role_switch": true}`` fails the next role
switch while rebuilding) and /prfaas/truth (``{"period_seed": N}``: the slow periods of its service truth
start afresh from N; a benchmark restarts every engine's before each run). Prefill roles (and switchable decode workers) also serve the bootstrap
endpoints (/health, /prfaas/register) on ``--bootstrap-port``. /version is
not served (404), as SGLang does not serve it.

Errors are JSON ``{"error": {"message", "type", "code"}}`` with a 4xx/5xx
status; nothing a failed request took stays allocated.

With a deployment secret (``MockConfig.keys``): every endpoint but ``/health*`` and
``/metrics`` demands the worker API key as SGLang's ``--api-key`` does (401 otherwise); the
hand-offs from other workers (``/prfaas/register``, ``/prfaas/kv_ready``,
``/prfaas/cache/export``) must also carry a fresh, unseen signature (``wire.auth``), checked
before their body is parsed; hosts they name must be peers (403). Refusals are counted in
``prfaas:auth_rejected_total{reason}``.
"""

from __future__ import annotations

import asyncio
import datetime
import hashlib
import itertools
import json
import time

from aiohttp import web
from prometheus_client import CONTENT_TYPE_PLAIN_0_0_4, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from prfaas_sglang.adapters.http_auth import bearer_middleware
from prfaas_sglang.engine.mock.detokenize import StreamText
from prfaas_sglang.engine.mock.engine import MockConfig, MockEngine
from prfaas_sglang.protocol import (
    SSE_DONE,
    BadRequest,
    error_body,
    full_response,
    parse_request,
    stream_chunk,
    stream_error,
    usage_chunk,
)
from prfaas_sglang.transport.kv_send import SENDER_METRICS
from prfaas_sglang.wire.auth import AUTH_HEADER, AuthError
from prfaas_sglang.wire.blocks import HASH_SCHEME
from prfaas_sglang.wire.cache_move import CacheExport, CacheImport
from prfaas_sglang.wire.handoff import KvReady, Registration
from prfaas_sglang.wire.kv_events import KV_EVENTS_TOPIC
from prfaas_sglang.wire.role_switch import RoleSwitchReply, RoleSwitchRequest

ENGINE_KEY = web.AppKey("engine", MockEngine)
METRICS_KEY = web.AppKey("metrics", CollectorRegistry)  # what /metrics serves: the app's own registry
_rid_counter = itertools.count()


def pseudo_tokenize(text: str) -> list[int]:
    """The tokenizer-less fallback: one deterministic pseudo-token per whitespace-separated word."""
    return [int.from_bytes(hashlib.blake2b(w.encode(), digest_size=4).digest(), "little") % 32_000 for w in text.split()]


def error_response(status: int, message: str) -> web.Response:
    return web.json_response(error_body(status, message), status=status)


async def _json_body(request: web.Request):
    try:
        return await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise BadRequest(400, "request body is not valid JSON") from None


async def _signed_json_body(engine: MockEngine, request: web.Request):
    """The body of a hand-off from another worker, after its signature checked (no-op without a
    secret); an :class:`AuthError` becomes 401."""
    raw = await request.read()
    try:
        engine.authenticate(request.headers.get(AUTH_HEADER), request.method, request.path, raw)
    except AuthError as err:
        raise BadRequest(401, f"unauthenticated hand-off: {err}") from None
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise BadRequest(400, "request body is not valid JSON") from None


def api_key_middleware(engine: MockEngine):
    """SGLang's ``--api-key`` rule: all but /health* and /metrics need the bearer key."""
    keys = engine.config.keys

    def reject(err: AuthError) -> web.Response:
        engine.stats.auth_rejected[err.reason] += 1
        return error_response(401, str(err))

    return bearer_middleware(keys.worker_api_key if keys else None, reject)


def _info(engine: MockEngine) -> dict:
    """``/server_info``: the fields of SGLang 0.5.15's answer a router reads, plus ``prfaas``; ``version``
    is the release the worker emulates (``MockConfig.sglang_release``)."""
    cfg = engine.config
    return {
        "model_path": cfg.served_model_name,
        "served_model_name": cfg.served_model_name,
        "tokenizer_path": cfg.tokenizer,
        "skip_tokenizer_init": engine.tokenizer is None,
        "dp_size": 1,
        "tp_size": 1,
        "page_size": cfg.page_size,
        "stream_interval": cfg.stream_interval,
        "max_total_num_tokens": engine.max_total_tokens if cfg.mode == "decode" else cfg.cache_tokens,
        "max_req_input_len": cfg.context_tokens - 1,
        "max_prefill_tokens": cfg.context_tokens,
        "chunked_prefill_size": cfg.chunked_prefill_size if cfg.chunked_prefill_size is not None else -1,
        "max_running_requests": engine.timing.max_batch,
        "context_length": cfg.context_tokens,
        "disaggregation_mode": cfg.mode,
        "disaggregation_transfer_backend": "mooncake",
        "disaggregation_bootstrap_port": cfg.bootstrap_port,
        "load_balance_method": "follow_bootstrap_room" if cfg.mode == "prefill" else "round_robin",
        "kv_events": {"publisher": "zmq", "endpoint_host": "*", "endpoint_port_base": cfg.kv_events_port,
                      "topic": KV_EVENTS_TOPIC, "block_size": cfg.page_size, "dp_size": 1}
        if cfg.kv_events_port is not None else None,
        "prfaas": {"engine": "mock", "role": cfg.role.value, "profile": cfg.profile, "speedup": cfg.speedup,
                   "kv_scale": cfg.kv_scale, "block_hash": HASH_SCHEME, "hybrid": engine.timing.hybrid,
                   "telemetry_port": cfg.telemetry_port, "cache_import": cfg.mode == "prefill",
                   "role_switch": cfg.enable_pd_role_switch, "prefill_cache": cfg.prefill_cache,
                   "kv_layerwise": engine.layerwise},
        "version": cfg.sglang_release,
    }


AUTH_REJECT_REASONS = ("missing", "malformed", "stale", "bad_mac", "replayed", "bad_key", "unknown_peer")


class MockEngineMetrics:
    """The emulated engine's ``/metrics`` (a prometheus_client collector), read from ``engine`` at each
    scrape: SGLang's names (``sglang:*``) where SGLang has the metric, ours (``prfaas:*``; a PrfaaS
    worker's KV sender's from ``transport.kv_send.SENDER_METRICS``) beside them, each labelled
    ``model_name`` as SGLang's are; ``prfaas:auth_rejected_total`` also by ``reason``."""

    def __init__(self, engine: MockEngine):
        self._engine = engine

    def collect(self):
        engine = self._engine
        s, cfg = engine.stats, engine.config
        running, used, _ = engine.load_tokens
        total = engine.max_total_tokens if cfg.mode == "decode" else cfg.cache_tokens
        hit_rate = s.cached_tokens / s.prompt_tokens if s.prompt_tokens else 0.0
        rows = [  # (name, kind, value, help)
            ("sglang:num_running_reqs", "gauge", running, "The number of running requests"),
            ("sglang:num_queue_reqs", "gauge", engine.waiting, "The number of requests in the waiting queue"),
            ("sglang:token_usage", "gauge", used / total, "The token usage (fraction of the KV pool)"),
            ("sglang:gen_throughput", "gauge", engine.gen_throughput(), "The generation throughput (tokens/s)"),
            ("sglang:cache_hit_rate", "gauge", hit_rate, "The prefix cache hit rate"),
            ("sglang:prompt_tokens_total", "counter", s.prompt_tokens, "Number of prefill tokens processed"),
            ("sglang:generation_tokens_total", "counter", s.generation_tokens, "Number of generation tokens processed"),
            ("sglang:num_requests_total", "counter", s.requests_ok + s.requests_failed,  # SGLang: each finished request
             "Number of requests processed"),
            ("prfaas:kv_bytes_sent_total", "counter", s.kv_bytes_sent, "KV bytes this worker sent"),
            ("prfaas:kv_bytes_received_total", "counter", s.kv_bytes_received, "KV bytes this worker received"),
            ("prfaas:decode_prefix_tokens_total", "counter", s.decode_prefix_tokens,
             "Prompt tokens the decode worker's own cache held (not shipped)"),
            ("prfaas:kv_transfer_seconds_total", "counter", s.kv_transfer_s, "Seconds spent transferring KV"),
            ("prfaas:forward_intended_seconds_total", "counter", s.forward_intended_s,
             "Seconds of forward passes the timing model asked for"),
            ("prfaas:forward_actual_seconds_total", "counter", s.forward_actual_s,
             "Seconds the forward passes took (decode: on its schedule, what the cadence lost added)"),
            ("prfaas:requests_ok_total", "counter", s.requests_ok, "Requests that succeeded"),
            ("prfaas:requests_failed_total", "counter", s.requests_failed, "Requests that failed"),
            ("prfaas:kv_buffer_free_bytes", "gauge", engine.kv.arena.free_bytes if engine.kv else 0,
             "Free bytes of the KV landing buffer"),
            ("prfaas:kv_buffer_total_bytes", "gauge", engine.kv.arena.size if engine.kv else 0,
             "Size of the KV landing buffer"),
            ("prfaas:kv_pool_used_tokens", "gauge", engine.used_tokens, "Tokens of the KV pool in use"),
            ("prfaas:decode_room_waits_total", "counter", s.room_waits, "Times a request waited for decode room"),
            ("prfaas:open_rooms", "gauge", engine.open_rooms, "Bootstrap rooms open"),
            ("prfaas:prefix_imported_tokens_total", "counter", s.prefix_imported_tokens,
             "Tokens of cached prefixes imported from another cluster"),
            ("prfaas:prefix_export_bytes_total", "counter", s.prefix_export_bytes,
             "Bytes of cached prefixes exported to another cluster"),
            # prefill roles: prefills the cache kept (prefix cache) and did not (transfer cache), kvindex/admission.py
            ("prfaas:prefill_kept_total", "counter", engine.admission.stats.kept_requests,
             "Prefills whose KV the prefix cache kept"),
            ("prfaas:prefill_transfer_only_total", "counter", engine.admission.stats.transfer_requests,
             "Prefills whose KV was only transferred"),
        ]
        sender = engine.kv.sender if engine.kv else None
        if sender is not None:  # a PrfaaS worker's KV sender (the kv-send hooks' own)
            c = sender.counters()
            rows += [(name, kind, c[key], doc) for key, name, kind, doc in SENDER_METRICS]
        model = cfg.served_model_name
        for name, kind, value, doc in rows:
            family = (CounterMetricFamily if kind == "counter" else GaugeMetricFamily)(name, doc, labels=["model_name"])
            family.add_metric([model], value)
            yield family
        rejected = CounterMetricFamily("prfaas:auth_rejected_total", "Requests refused for their authentication, per reason",
                                       labels=["model_name", "reason"])
        for reason in AUTH_REJECT_REASONS:
            rejected.add_metric([model, reason], s.auth_rejected[reason])
        yield rejected


def _load(engine: MockEngine) -> dict:
    """One DP rank of SGLang 0.5.15's ``/v1/loads`` (``GetLoadsReqOutput``, core fields)."""
    cfg = engine.config
    total = engine.max_total_tokens if cfg.mode == "decode" else cfg.cache_tokens
    running, used, used_or_pending = engine.load_tokens
    return {"dp_rank": 0, "timestamp": time.time(), "num_running_reqs": running,
            "num_waiting_reqs": engine.waiting, "num_waiting_uncached_tokens": engine.waiting_uncached_tokens,
            "num_used_tokens": used, "num_total_tokens": used_or_pending, "max_total_num_tokens": total,
            "token_usage": used / total if total else 0.0, "gen_throughput": engine.gen_throughput(),
            "cache_hit_rate": engine.stats.cached_tokens / engine.stats.prompt_tokens if engine.stats.prompt_tokens else 0.0,
            "utilization": len(engine.running) / engine.timing.max_batch, "max_running_requests": engine.timing.max_batch,
            "disaggregation": {"mode": cfg.mode}}


def build_app(engine: MockEngine) -> web.Application:
    app = web.Application(client_max_size=64 << 20, middlewares=[api_key_middleware(engine)])
    app[ENGINE_KEY] = engine
    app[METRICS_KEY] = CollectorRegistry()
    app[METRICS_KEY].register(MockEngineMetrics(engine))

    async def health(request):
        return web.Response(status=200 if engine.ready else 503)

    async def models(request):
        name = engine.config.served_model_name
        return web.json_response({"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "sglang", "root": name}]})

    async def server_info(request):
        return web.json_response(_info(engine))

    async def model_info(request):
        return web.json_response({"model_path": engine.config.served_model_name, "tokenizer_path": None, "is_generation": True,
                                  "preferred_sampling_params": None, "weight_version": "default", "model_type": "prfaas-mock",
                                  "architectures": ["PrfaasMockForCausalLM"]})

    async def get_load(request):
        load = _load(engine)
        return web.json_response([{"dp_rank": 0, "num_reqs": load["num_running_reqs"] + load["num_waiting_reqs"],
                                   "num_waiting_reqs": load["num_waiting_reqs"], "num_tokens": load["num_total_tokens"],
                                   "num_pending_tokens": load["num_total_tokens"] - load["num_used_tokens"],
                                   "ts_tic": time.perf_counter()}])

    async def loads(request):
        return web.json_response({"timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                                  "version": engine.config.sglang_release, "loads": [_load(engine)]})

    async def metrics(request):
        return web.Response(body=generate_latest(request.app[METRICS_KEY]), headers={"Content-Type": CONTENT_TYPE_PLAIN_0_0_4})

    async def flush_cache(request):
        engine.flush_cache()
        return web.Response(text="Cache flushed.\n")

    async def kv_ready(request):
        try:
            try:
                ready = KvReady.decode(await _signed_json_body(engine, request))
            except ValueError as err:
                raise BadRequest(400, str(err)) from None
            engine.kv_ready(ready)
        except BadRequest as err:
            return error_response(err.status, err.message)
        return web.json_response({"ok": True})

    async def faults(request):
        try:
            body = await _json_body(request)
            if not isinstance(body, dict) or not body or set(body) - {"fail_kv_transfers", "fail_role_switch"}:
                raise BadRequest(400, "expected {\"fail_kv_transfers\": <non-negative int>} and/or "
                                      "{\"fail_role_switch\": <bool>}")
            n = body.get("fail_kv_transfers", engine.fail_kv_transfers)
            if not isinstance(n, int) or isinstance(n, bool) or n < 0:
                raise BadRequest(400, "fail_kv_transfers must be a non-negative integer")
            fail_switch = body.get("fail_role_switch", engine.fail_role_switch)
            if not isinstance(fail_switch, bool):
                raise BadRequest(400, "fail_role_switch must be true or false")
        except BadRequest as err:
            return error_response(err.status, err.message)
        engine.fail_kv_transfers, engine.fail_role_switch = n, fail_switch
        return web.json_response({"fail_kv_transfers": n, "fail_role_switch": fail_switch})

    async def truth_periods(request):
        """``{"period_seed": N}``: the engine's slow periods start afresh from N (``ServiceTruth.restart_periods``;
        a benchmark's control, before each run: the router never calls it)."""
        try:
            body = await _json_body(request)
            seed = body.get("period_seed") if isinstance(body, dict) and set(body) == {"period_seed"} else None
            if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
                raise BadRequest(400, "expected {\"period_seed\": <non-negative int>}")
        except BadRequest as err:
            return error_response(err.status, err.message)
        engine.truth.restart_periods(seed)
        return web.json_response({"period_seed": seed})

    async def role_switch(request):
        """Upstream's /pd_role_switch (``wire.role_switch``): 200 and the reply on success, 400 otherwise."""
        try:
            switch = RoleSwitchRequest.decode(await _json_body(request))
        except (BadRequest, ValueError) as err:
            reply = RoleSwitchReply(False, getattr(err, "message", None) or str(err), engine.config.mode)
        else:
            reply = await engine.switch_role(switch.new_role)
        return web.json_response(reply.to_json(), status=reply.http_status)

    def cache_move(kind: str):
        """``/prfaas/cache/import`` (the router asks this worker to fetch a prefix) and
        ``/prfaas/cache/export`` (another worker fetches one from this worker); wire.cache_move."""
        async def handler(request: web.Request):
            if not engine.ready:
                return error_response(503, "server is starting")
            try:
                body = await (_json_body(request) if kind == "import" else _signed_json_body(engine, request))
                try:
                    msg = (CacheImport if kind == "import" else CacheExport).decode(body)
                except ValueError as err:
                    raise BadRequest(400, str(err)) from None
                if kind == "import":
                    return web.json_response((await engine.import_prefix(msg)).to_json())
                return web.json_response(await engine.export_prefix(msg))
            except BadRequest as err:
                return error_response(err.status, err.message)

        return handler

    def data_plane(kind: str):
        async def handler(request: web.Request):
            if not engine.ready:
                return error_response(503, "server is starting")
            try:
                # Off the event loop, as SGLang tokenizes in its tokenizer manager, apart from the scheduler:
                # a long text prompt (~50 ms per 27K tokens) must not delay the forwards and decode steps.
                req = await asyncio.to_thread(parse_request, kind, await _json_body(request), f"mock-{next(_rid_counter)}",
                                              int(time.time()), engine.tokenizer, pseudo_tokenize)
                if req.bootstrap is not None:  # before a stream starts: a refusal is a status, not an event
                    engine.check_peer(req.bootstrap.host, "bootstrap host")
                engine.check_vocab(req)
                if engine.config.mode == "prefill":
                    return await _prefill_response(engine, req)
                return await _decode_response(engine, req, request)
            except BadRequest as err:
                return error_response(err.status, err.message)

        return handler

    app.router.add_get("/health", health)
    app.router.add_get("/health_generate", health)
    app.router.add_get("/v1/models", models)
    for path in ("/server_info", "/get_server_info"):
        app.router.add_get(path, server_info)
    for path in ("/model_info", "/get_model_info"):
        app.router.add_get(path, model_info)
    app.router.add_get("/get_load", get_load)
    app.router.add_get("/v1/loads", loads)
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/flush_cache", flush_cache)
    app.router.add_post("/prfaas/truth", truth_periods)
    app.router.add_post("/prfaas/kv_ready", kv_ready)
    app.router.add_post("/prfaas/faults", faults)
    app.router.add_post("/pd_role_switch", role_switch)
    app.router.add_post("/prfaas/cache/import", cache_move("import"))
    app.router.add_post("/prfaas/cache/export", cache_move("export"))
    app.router.add_post("/generate", data_plane("generate"))
    app.router.add_post("/v1/completions", data_plane("completions"))
    app.router.add_post("/v1/chat/completions", data_plane("chat"))
    return app


async def _prefill_response(engine: MockEngine, req) -> web.StreamResponse:
    ready = await engine.prefill(req)
    extra = {"prfaas": {"kv_bytes": ready.kv_bytes, "kv_transfer_s": ready.transfer_s, "role": "prefill"}}
    body = full_response(req, [], ready.cached_tokens, engine.config.served_model_name, extra, engine.detokenize)
    return web.json_response(body)


async def _decode_response(engine: MockEngine, req, request: web.Request) -> web.StreamResponse:
    if req.stream:  # as SGLang: 200 at once; a failure after that (a failed KV transfer) is an event
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        try:
            seq = await engine.decode(req)
        except BadRequest as err:
            await response.write((stream_error(req, err.status, err.message) + SSE_DONE).encode())
            return response
        return await _decode_stream(engine, req, seq, response)
    seq = await engine.decode(req)
    ok = False
    try:
        while await seq.queue.get() is not None:
            pass
        ok = True
        return web.json_response(full_response(req, seq.tokens, seq.ready.cached_tokens, req.model or engine.config.served_model_name,
                                               _extra(seq), engine.detokenize))
    finally:
        await engine.finish(seq, ok)


def _extra(seq) -> dict:
    return {"prfaas": {"kv_bytes": seq.ready.kv_bytes, "kv_transfer_s": seq.ready.transfer_s, "role": "decode",
                       "decode_prefix_len": seq.decode_prefix_len}}


async def _decode_stream(engine: MockEngine, req, seq, response: web.StreamResponse) -> web.StreamResponse:
    ok = False
    model = req.model or engine.config.served_model_name
    cached, extra = seq.ready.cached_tokens, _extra(seq)
    try:
        sent, text, interval = 0, StreamText(engine.detokenize), engine.config.stream_interval
        # Tokens are appended to seq.tokens before they are queued, so [:sent] is complete. As SGLang's
        # scheduler (output_streamer), with an interval N > 1 a chunk goes out at tokens 1, N+1, 2N+1, ...
        while await seq.queue.get() is not None:
            sent += 1
            if interval > 1 and sent % interval != 1:
                continue
            delta = text.add(seq.tokens[:sent])
            await response.write(stream_chunk(req, seq.tokens[:sent], delta, False, cached, model, extra, text.text).encode())
        tail = text.finish(seq.tokens)
        await response.write(stream_chunk(req, seq.tokens, tail, True, cached, model, extra, text.text).encode())
        if req.include_usage:
            await response.write(usage_chunk(req, seq.tokens, cached, model).encode())
        await response.write(SSE_DONE.encode())
        ok = True
        return response
    finally:
        await engine.finish(seq, ok)


async def serve(config: MockConfig, engine: MockEngine) -> None:
    """Run the HTTP server (and, for prefill roles, the bootstrap server) until cancelled."""
    await engine.start()
    runners = []
    try:
        # A client that disconnects (e.g. a router aborting a PD leg) cancels its handler,
        # whose finally-blocks free the KV region and the room at once.
        main = web.AppRunner(build_app(engine), access_log=None, handler_cancellation=True)
        await main.setup()
        await web.TCPSite(main, config.host, config.port).start()
        runners.append(main)
        if config.bootstrap_port is not None:  # a switchable decode worker has one for when it is prefill
            boot = web.AppRunner(build_bootstrap_app(engine), access_log=None)
            await boot.setup()
            await web.TCPSite(boot, config.host, config.bootstrap_port).start()
            runners.append(boot)
        await asyncio.Event().wait()
    finally:
        for runner in runners:
            await runner.cleanup()
        await engine.stop()


def build_bootstrap_app(engine: MockEngine) -> web.Application:
    """The prefill worker's bootstrap server: decode workers register where each room's KV goes."""
    app = web.Application()

    async def health(request):
        return web.Response(text="OK")

    async def register(request: web.Request):
        try:
            body = await _signed_json_body(engine, request)
            if not isinstance(body, dict):
                raise BadRequest(400, "registration must be an object")
            try:
                registration = Registration.decode(body)
            except ValueError as err:
                raise BadRequest(400, f"bad registration: {err}") from None
            if engine.config.mode != "prefill":
                raise BadRequest(503, f"this worker serves {engine.config.mode} now, not prefill")
            engine.register_decode(registration)
        except BadRequest as err:
            return error_response(err.status, err.message)
        return web.json_response({"ok": True})

    app.router.add_get("/health", health)
    app.router.add_post("/prfaas/register", register)
    return app
