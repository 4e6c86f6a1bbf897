"""The demo's minimal PD dispatcher and load driver (asyncio + one pooled aiohttp session).

Demo only: the product's router is issue #5. It applies the paper's
bandwidth-scarce rule with per-cluster prefix estimates: a request prefills
on PD-P when ``l_total - l_cached_pd <= t``, else on PrfaaS; decode is always
the PD-D worker. Like SGLang's PD routers, it sends the same body (plus
``bootstrap_host/port/room``) to the chosen prefill worker and to the decode
worker, and streams the decode response.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field

import aiohttp

from prfaas_sglang.demo.cluster import Worker
from prfaas_sglang.engine.blocks import digest_to_int64, page_digests
from prfaas_sglang.plan.workload import leading_matches


@dataclass
class RequestResult:
    route: str
    input_tokens: int
    ok: bool = False
    output_tokens: int = 0
    ttft_s: float | None = None
    token_gaps_s: list[float] = field(default_factory=list)
    error: str | None = None


class MiniDispatcher:
    def __init__(self, session: aiohttp.ClientSession, prfaas: Worker, pd_prefill: Worker, decode: Worker,
                 threshold_tokens: float, page_size: int, rng: random.Random):
        self.session, self.threshold_tokens, self.page_size, self.rng = session, threshold_tokens, page_size, rng
        self.prefill = {"prfaas": prfaas, "pd-prefill": pd_prefill}
        self.decode = decode
        self._seen: dict[str, set[int]] = {"prfaas": set(), "pd-prefill": set()}

    def route(self, token_ids: list[int]) -> tuple[str, list[int]]:
        """``(cluster, block ids)``: PD-P when the uncached length there is <= t (bandwidth-scarce rule)."""
        blocks = [digest_to_int64(d) for d in page_digests(token_ids, self.page_size)]
        cached_pd = leading_matches(blocks, self._seen["pd-prefill"]) * self.page_size
        return ("pd-prefill" if len(token_ids) - cached_pd <= self.threshold_tokens else "prfaas"), blocks

    async def run(self, token_ids: list[int], max_new_tokens: int) -> RequestResult:
        route, blocks = self.route(token_ids)
        self._seen[route].update(blocks)
        prefill = self.prefill[route]
        body = {"input_ids": token_ids, "sampling_params": {"max_new_tokens": max_new_tokens}, "stream": True,
                "bootstrap_host": "127.0.0.1", "bootstrap_port": prefill.bootstrap_port,
                "bootstrap_room": self.rng.getrandbits(63)}
        result = RequestResult(route, len(token_ids))
        start = time.perf_counter()
        prefill_task = asyncio.create_task(self._prefill(prefill.url + "/generate", body))
        try:
            await self._stream_decode(body, start, result)
            status, text = await prefill_task
            if status != 200:
                raise RuntimeError(f"prefill {prefill.name} answered {status}: {text[:200]}")
            result.ok = result.error is None
        except (aiohttp.ClientError, asyncio.TimeoutError, RuntimeError) as err:
            result.error = result.error or str(err) or type(err).__name__
        finally:
            if not prefill_task.done():
                prefill_task.cancel()
        return result

    async def _prefill(self, url: str, body: dict) -> tuple[int, str]:
        async with self.session.post(url, json={**body, "stream": False}) as resp:
            return resp.status, await resp.text()

    async def _stream_decode(self, body: dict, start: float, result: RequestResult) -> None:
        last = None
        async with self.session.post(self.decode.url + "/generate", json=body) as resp:
            if resp.status != 200:
                result.error = f"decode answered {resp.status}: {(await resp.text())[:200]}"
                return
            async for raw in resp.content:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                count = len(json.loads(line[6:])["output_ids"])
                if count <= result.output_tokens:
                    continue
                now = time.perf_counter()
                if result.ttft_s is None:
                    result.ttft_s = now - start
                elif last is not None:
                    result.token_gaps_s.append(now - last)
                last = now
                result.output_tokens = count
