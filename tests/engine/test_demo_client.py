"""The demo's streaming client (``demo/client.py``): what it counts as an answer."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from aiohttp import web
from helpers import serving

from prfaas_sglang.demo.client import generate_ids, stream_request

TOKENS = [b'data: {"output_ids": [5], "meta_info": {"prompt_tokens": 3}}\n\n',
          b'data: {"output_ids": [5, 6], "meta_info": {"prompt_tokens": 3}}\n\n']
FAILURE = b'data: {"error": {"message": "decode worker lost", "code": 502}}\n\n'
DONE = b"data: [DONE]\n\n"


@pytest.mark.parametrize("events, error", [
    (TOKENS + [DONE], None),
    (TOKENS + [FAILURE, DONE], "stream failed after 2 tokens: 502: decode worker lost"),
    (TOKENS, "stream cut after 2 tokens (no [DONE])"),
    ([FAILURE, DONE], "stream ended without a token: 502: decode worker lost"),
])
def test_a_stream_is_an_answer_only_when_it_ends_whole(events, error):
    """Tokens then ``[DONE]``: ok. Tokens then a failure event, or tokens then the connection's end without
    ``[DONE]`` (a stream broken after its first token): an error saying how many tokens came, not ok."""
    async def scenario():
        async def generate(request):
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            for event in events:
                await resp.write(event)
            return resp

        app = web.Application()
        app.router.add_post("/generate", generate)
        async with serving(app) as url, aiohttp.ClientSession() as session:
            return await stream_request(session, url, generate_ids(0.0, [1, 2, 3], 2))

    result = asyncio.run(scenario())
    assert result.error == error and result.ok == (error is None)
    assert result.output_tokens == (2 if events[0] in TOKENS else 0)
