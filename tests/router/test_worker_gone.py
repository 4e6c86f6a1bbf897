"""``worker_gone``: the router's probe, after a decode leg failed though its prefill leg answered, of whether
the prefill worker went away in between (the request is then routed again). Real sockets on loopback."""

from __future__ import annotations

import asyncio
import contextlib
import socket

import aiohttp
from aiohttp import web
from helpers import serving

from prfaas_sglang.router.server import worker_gone


def _health(handler) -> web.Application:
    app = web.Application()
    app.router.add_get("/health", handler)
    return app


def test_a_worker_that_answers_is_not_gone_and_one_that_is_refused_silent_or_failing_is():
    async def run() -> dict[str, str | None]:
        async def ok(_request):
            return web.Response(text="ok")

        async def failing(_request):
            return web.Response(status=503)

        released = asyncio.Event()

        async def silent(_request):  # a worker whose address no longer answers (a pod's IP gone)
            await released.wait()
            return web.Response(text="late")

        out = {}
        async with contextlib.AsyncExitStack() as servers:
            async with aiohttp.ClientSession() as session:
                for name, handler in (("ok", ok), ("failing", failing), ("silent", silent)):
                    url = await servers.enter_async_context(serving(_health(handler)))
                    out[name] = await worker_gone(session, url, timeout_s=0.5)
                with socket.socket() as s:  # a port nothing listens on: refused
                    s.bind(("127.0.0.1", 0))
                    closed = s.getsockname()[1]
                out["refused"] = await worker_gone(session, f"http://127.0.0.1:{closed}", timeout_s=0.5)
            released.set()
        return out

    gone = asyncio.run(run())
    assert gone["ok"] is None
    assert gone["failing"] == "/health answered 503"
    assert gone["silent"] == "no answer from /health within 0.5 s"
    assert gone["refused"] and "Cannot connect" in gone["refused"]
