"""The demo's streaming client (``demo/client.py``): what it counts as an answer."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from aiohttp import web
from helpers import serving

from prfaas_sglang.demo.client import completion_text, generate_ids, stream_request

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


def test_a_chunk_of_several_tokens_counts_each_token_and_its_share_of_the_gap():
    """A server streaming every 4th token (SGLang's ``--stream-interval``) with the usage in every chunk
    (``continuous_usage_stats``): 9 tokens in chunks of 1, 4 and 4 are 9 tokens and 8 token gaps, each a quarter
    of its chunk's gap; without the usage, a chunk with text is one token (as before)."""
    def chunk(tokens: int | None) -> bytes:
        usage = f', "usage": {{"prompt_tokens": 3, "completion_tokens": {tokens}}}' if tokens else ""
        return f'data: {{"choices": [{{"index": 0, "text": "ab"}}]{usage}}}\n\n'.encode()

    async def scenario(events):
        async def completions(request):
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            for event in events:
                await resp.write(event)
                await asyncio.sleep(0.04)
            await resp.write(DONE)
            return resp

        app = web.Application()
        app.router.add_post("/v1/completions", completions)
        async with serving(app) as url, aiohttp.ClientSession() as session:
            return await stream_request(session, url, completion_text(0.0, "a prompt", 9))

    result = asyncio.run(scenario([chunk(1), chunk(5), chunk(9)]))
    assert result.ok and result.output_tokens == 9 and result.input_tokens == 3
    assert len(result.token_gaps_s) == 8 and result.token_gaps_s[0] == result.token_gaps_s[3]
    assert 0.005 < result.mean_tbt_s < 0.04  # a chunk's gap over its 4 tokens, not the chunk's gap
    plain = asyncio.run(scenario([chunk(None)] * 3))
    assert plain.output_tokens == 3 and len(plain.token_gaps_s) == 2
