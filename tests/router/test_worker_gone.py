"""``worker_gone``: the router's probe, after a decode leg failed though its prefill leg answered, of whether
the prefill worker went away in between (the request is then routed again). Real sockets on loopback."""

from __future__ import annotations

import asyncio
import socket

import aiohttp
from aiohttp import web

from prfaas_sglang.router.server import worker_gone


async def _serve(handler) -> tuple[web.AppRunner, str]:
    app = web.Application()
    app.router.add_get("/health", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    return runner, f"http://127.0.0.1:{port}"


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

        runners, out = [], {}
        async with aiohttp.ClientSession() as session:
            for name, handler in (("ok", ok), ("failing", failing), ("silent", silent)):
                runner, url = await _serve(handler)
                runners.append(runner)
                out[name] = await worker_gone(session, url, timeout_s=0.5)
            with socket.socket() as s:  # a port nothing listens on: refused
                s.bind(("127.0.0.1", 0))
                closed = s.getsockname()[1]
            out["refused"] = await worker_gone(session, f"http://127.0.0.1:{closed}", timeout_s=0.5)
        released.set()
        for runner in runners:
            await runner.cleanup()
        return out

    gone = asyncio.run(run())
    assert gone["ok"] is None
    assert gone["failing"] == "/health answered 503"
    assert gone["silent"] == "no answer from /health within 0.5 s"
    assert gone["refused"] and "Cannot connect" in gone["refused"]
