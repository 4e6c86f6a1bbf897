"""The router's relay of a decode worker's stream (``router/server.py`` ``Legs._relay_stream``): what it learns
from the gaps between chunks. Real HTTP on loopback; the worker's stream is played from a list."""

from __future__ import annotations

import asyncio
import itertools
import time
import types

import aiohttp
import pytest
from aiohttp import web
from helpers import serving

from prfaas_sglang.router.metrics import Histogram
from prfaas_sglang.router.server import Legs

CHUNK_GAP_S = 0.08


class _Content:
    def __init__(self, chunks: list[bytes]):
        self.chunks, self.sent_at = chunks, []

    async def iter_any(self):
        for chunk in self.chunks:
            await asyncio.sleep(CHUNK_GAP_S)
            self.sent_at.append(time.perf_counter())  # the relay reads it with nothing awaited in between
            yield chunk


@pytest.mark.parametrize("stream_interval", [1, 4])
def test_a_chunks_gap_over_the_workers_stream_interval_is_what_the_tbt_and_the_calibration_see(stream_interval):
    """A decode worker that streams every 4th token (its facts' ``stream_interval``, SGLang's flag) sends 4
    tokens a chunk: the router's TBT histogram and its calibration see each chunk's gap over 4, a token's gap,
    and the client gets every byte as sent."""
    gaps: list[float] = []
    tbt = Histogram()
    chunks = [b'data: {"choices": []}\n\n'] * 4
    content = _Content(chunks)

    async def scenario() -> bytes:
        async def relay(request: web.Request) -> web.StreamResponse:
            legs = Legs.__new__(Legs)
            legs.request, legs.lease, legs.started, legs.headers = request, object(), 0.0, {}
            legs.service = types.SimpleNamespace(
                counters=types.SimpleNamespace(ttft=Histogram(), tbt=tbt, e2e=Histogram()),
                first_token=lambda lease, observed_s, now_s: None,
                token_gap=lambda lease, observed_s, now_s: gaps.append(observed_s))
            legs.decode = types.SimpleNamespace(facts=types.SimpleNamespace(stream_interval=stream_interval))
            return await legs._relay_stream(b"", types.SimpleNamespace(content=content))

        app = web.Application()
        app.router.add_post("/relay", relay)
        async with serving(app) as url, aiohttp.ClientSession() as session, session.post(url + "/relay") as resp:
            return await resp.read()

    assert asyncio.run(scenario()) == b"".join(chunks)
    assert len(gaps) == 3 and tbt.n == 3
    chunk_gaps = [b - a for a, b in itertools.pairwise(content.sent_at)]  # each at least CHUNK_GAP_S
    for gap, chunk_gap in zip(gaps, chunk_gaps, strict=True):  # a chunk's gap over the tokens it carries
        assert gap == pytest.approx(chunk_gap / stream_interval, abs=2e-3)
    assert tbt.total == pytest.approx(sum(gaps))
