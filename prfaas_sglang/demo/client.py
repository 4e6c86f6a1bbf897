"""A streaming /generate client that measures what a user sees: TTFT, gaps between tokens, the route.

Used by the demo and the benchmarks (one pooled aiohttp session per run).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import aiohttp


@dataclass
class RequestResult:
    input_tokens: int
    status: int | None = None
    route: str = ""  # the PrfaaS router's x-prfaas-route header ("cluster/prefill/decode"), if any
    output_tokens: int = 0
    ttft_s: float | None = None
    token_gaps_s: list[float] = field(default_factory=list)
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None and self.ttft_s is not None

    @property
    def mean_tbt_s(self) -> float:
        return sum(self.token_gaps_s) / len(self.token_gaps_s) if self.token_gaps_s else 0.0


async def stream_generate(session: aiohttp.ClientSession, url: str, tokens: list[int], max_new_tokens: int) -> RequestResult:
    """POST ``{url}/generate`` with ``stream: true``; never raises for HTTP or connection errors."""
    result = RequestResult(len(tokens))
    body = {"input_ids": tokens, "sampling_params": {"max_new_tokens": max_new_tokens}, "stream": True}
    start = last = time.perf_counter()
    try:
        async with session.post(url + "/generate", json=body) as resp:
            result.status = resp.status
            result.route = resp.headers.get("x-prfaas-route", "")
            if resp.status != 200:
                result.error = f"{resp.status}: {(await resp.text())[:200]}"
                return result
            async for raw in resp.content:
                line = raw.decode().strip()
                if not line.startswith("data: {"):
                    continue
                count = len(json.loads(line[6:])["output_ids"])
                if count <= result.output_tokens:
                    continue
                now = time.perf_counter()
                if result.ttft_s is None:
                    result.ttft_s = now - start
                else:
                    result.token_gaps_s.append(now - last)
                last = now
                result.output_tokens = count
    except (aiohttp.ClientError, asyncio.TimeoutError) as err:
        result.error = str(err) or type(err).__name__
    return result


async def replay(url: str, arrivals, connector_limit: int = 512, timeout_s: float = 300) -> tuple[list[RequestResult], float]:
    """Send ``(offset_s, tokens, max_new_tokens)`` arrivals on schedule; returns results and wall time."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s),
                                     connector=aiohttp.TCPConnector(limit=connector_limit)) as session:
        start = time.perf_counter()
        tasks = []
        for offset, tokens, max_new in arrivals:
            delay = start + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(stream_generate(session, url, tokens, max_new)))
        results = await asyncio.gather(*tasks)
        return list(results), time.perf_counter() - start
