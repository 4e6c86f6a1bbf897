"""Worker health: SGLang's /health answers late while its scheduler is busy; the router must not take
a busy worker out, and must take out one that refuses or never answers."""

from __future__ import annotations

import asyncio
import dataclasses

from test_conversion import _service

from prfaas_sglang.router.workers import WorkerRecord


def test_note_health_takes_a_worker_out_at_once_when_down_and_after_misses_in_a_row_when_silent():
    w = WorkerRecord("w", "http://w", "pd", "prefill", "w", None, None, healthy=True)
    w.note_health("timeout", 2)
    assert w.healthy and w.health_misses == 1  # one late answer: still in
    w.note_health("ok", 2)
    assert w.healthy and w.health_misses == 0  # an answer resets the count
    w.note_health("timeout", 2)
    w.note_health("timeout", 2)
    assert not w.healthy  # two in a row: out
    w.note_health("ok", 2)
    assert w.healthy
    w.note_health("down", 2)
    assert not w.healthy  # refused or non-200: out at once


def test_a_worker_whose_health_answers_slowly_stays_routable_and_a_silent_one_goes_out():
    """SGLang's /health generates one token and answers on a 1 s poll: with a timeout under that,
    every busy worker would flap out of routing (seen with real SGLang servers on CPU)."""
    import aiohttp
    from aiohttp import web
    from aiohttp.test_utils import TestServer

    from prfaas_sglang.router.loops import poll_health

    service = _service()
    service.config = dataclasses.replace(service.config, health_timeout_s=0.5, health_misses_to_down=2)
    slow, silent, gone = (service.workers[n] for n in ("pd-prefill-0", "pd-prefill-1", "pd-decode-0"))

    async def scenario():
        async def health_slow(request):
            await asyncio.sleep(0.3)  # like SGLang's, under the timeout
            return web.Response(status=200)

        async def health_silent(request):
            await asyncio.sleep(5)
            return web.Response(status=200)

        app = web.Application()
        app.router.add_get("/slow/health", health_slow)
        app.router.add_get("/silent/health", health_silent)
        async with TestServer(app) as server, aiohttp.ClientSession() as session:
            base = str(server.make_url("")).rstrip("/")
            slow.url, silent.url, gone.url = base + "/slow", base + "/silent", "http://127.0.0.1:1"
            states = []
            for _ in range(2):
                await asyncio.gather(*(poll_health(service, session, None, w) for w in (slow, silent, gone)))
                states.append((slow.healthy, silent.healthy, gone.healthy))
            return states

    first, second = asyncio.run(scenario())
    assert first == (True, True, False)  # the silent one's first miss keeps it in; refused: out at once
    assert second == (True, False, False)
