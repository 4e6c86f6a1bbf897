"""The PrfaaS router's HTTP app (aiohttp, adapter): the request path (``router/server.py``) on the
generate paths, the admin API, ``/status``, ``/metrics`` and the rest, and the background loops
(``router/loops.py``) and clients it owns for its lifetime.

On start-up: one pooled HTTP session to the workers (and the kv-index), one ZMQ subscriber for every
worker's KV events and link telemetry, the room requests wait on for decode room; then the loops
(health, load, control; long-term with ``--long-term``) and, with a kv-index service, its snapshot.
On clean-up, all of them stop, in that order reversed.
"""

from __future__ import annotations

import asyncio
import functools
import time

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_PLAIN_0_0_4, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily

from prfaas_sglang import __version__
from prfaas_sglang.adapters.zmq import CurveKeys, ZmqSubscriber
from prfaas_sglang.procgc import gc_status
from prfaas_sglang.router import loops, server
from prfaas_sglang.router.admin import add_admin_routes
from prfaas_sglang.router.conversion import RoleSwitchClient, convert
from prfaas_sglang.router.loops import LongTermOptions
from prfaas_sglang.router.openapi import router_openapi
from prfaas_sglang.router.service import MAX_BODY_BYTES, RouterService
from prfaas_sglang.wire.auth import DeploymentKeys

SUB_KEY = web.AppKey("subscriber", ZmqSubscriber)
METRICS_KEY = web.AppKey("metrics", CollectorRegistry)  # what /metrics serves: the app's own registry
LONGTERM_KEY = web.AppKey("longterm", LongTermOptions)
TASKS_KEY = web.AppKey("tasks", list)


class RouterMetrics:
    """The router's ``/metrics`` (a prometheus_client collector), read from the app at each scrape:
    the service's gauges, counters and histograms (``router/metrics.py``), then the ZMQ handshakes
    its subscriber refused. Registered in the app's registry (:data:`METRICS_KEY`) by :func:`build_app`."""

    def __init__(self, app: web.Application):
        self._app = app

    def collect(self):
        now = time.monotonic()
        service = self._app[server.SERVICE_KEY]
        yield from service.counters.families(service.metrics_gauges(now))
        refused = sum(s["auth_failures"] for s in self._app[SUB_KEY].stats(now).values())
        yield CounterMetricFamily("prfaas_router_zmq_auth_failures_total", "ZMQ handshakes refused: a KV-event or "
                                  "telemetry publisher without the deployment's key", value=refused)


def build_app(service: RouterService, kv_index_url: str | None = None, keys: DeploymentKeys | None = None,
              longterm: LongTermOptions | None = None) -> web.Application:
    """The router's HTTP app. With ``keys`` (the deployment secret's), every request to a worker or
    the kv-index carries the worker API key, and KV-event and telemetry streams are CURVE clients
    that accept only publishers holding the deployment's key."""
    app = web.Application(client_max_size=MAX_BODY_BYTES)
    app[server.SERVICE_KEY] = service
    app[LONGTERM_KEY] = longterm or LongTermOptions()
    app[METRICS_KEY] = CollectorRegistry()
    app[METRICS_KEY].register(RouterMetrics(app))
    app.on_startup.append(functools.partial(_start, kv_index_url=kv_index_url, keys=keys))
    app.on_cleanup.append(_stop)
    _add_routes(app, service)
    return app


async def _start(app: web.Application, kv_index_url: str | None, keys: DeploymentKeys | None) -> None:
    """The clients, then the loops (and the kv-index snapshot)."""
    service = app[server.SERVICE_KEY]
    session = app[server.SESSION_KEY] = aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=1024, keepalive_timeout=server.WORKER_KEEPALIVE_S),
        headers=keys.bearer() if keys else None)
    sub = app[SUB_KEY] = ZmqSubscriber(curve=CurveKeys.from_deployment(keys))
    room = app[server.ROOM_KEY] = asyncio.Condition()
    for worker in service.workers.values():
        if worker.facts is not None:
            loops.watch_worker(service, worker, sub)
    runs = {"health_loop": loops.health_loop(service, session, sub), "load_loop": loops.load_loop(service, session, room),
            "control_loop": loops.control_loop(service)}
    if service.longterm:
        runs["longterm_loop"] = loops.longterm_loop(service, session, app[LONGTERM_KEY],
                                                    functools.partial(loops.unwatch, sub))
    if kv_index_url is not None:
        runs["restore_index"] = loops.restore_index(service, session, kv_index_url)
    app[TASKS_KEY] = [asyncio.create_task(run, name=name) for name, run in runs.items()]


async def _stop(app: web.Application) -> None:
    for task in app[TASKS_KEY]:
        task.cancel()
    await asyncio.gather(*app[TASKS_KEY], return_exceptions=True)
    await app[SUB_KEY].close()
    await app[server.SESSION_KEY].close()


def _add_routes(app: web.Application, service: RouterService) -> None:
    """The generate paths (the request path), the admin API and the read-only endpoints."""

    async def health(request):
        return web.Response(text="OK")

    async def models(request):
        return web.json_response({"object": "list", "data": [{"id": n, "object": "model", "created": int(time.time()),
                                                              "owned_by": "prfaas-sglang"} for n in service.model_names()]})

    async def status(request):
        now = time.monotonic()
        body = service.status(now)
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
        loops.unwatch(app[SUB_KEY], name)
        if name in service.index.workers():
            service.index.remove_worker(name)
        service.forget_worker(name)

    async def on_convert(app, name, new_role, drain_timeout_s):
        return await convert(service, RoleSwitchClient(app[server.SESSION_KEY]), name, new_role, drain_timeout_s=drain_timeout_s,
                             on_converted=functools.partial(loops.unwatch, app[SUB_KEY]),
                             rejoin_s=service.config.prefill_rejoin_s)

    add_admin_routes(app, server.SERVICE_KEY, on_register, on_deregister, on_convert)
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/status", status)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/openapi.json", lambda request: web.json_response(router_openapi(__version__, service.model_names())))
    for kind, path in server.PATHS.items():
        app.router.add_post(path, lambda request, kind=kind: server.dispatch(request, kind))
