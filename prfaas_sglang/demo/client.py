"""A streaming client that measures what a user sees: TTFT, gaps between tokens, the route.

Speaks SGLang's ``/generate`` (ids or text) and OpenAI ``/v1/completions`` /
``/v1/chat/completions`` (SSE, with ``stream_options.include_usage``). Used by
the demo and the benchmarks (one pooled aiohttp session per run).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import aiohttp

from prfaas_sglang.protocol import event_failure


@dataclass(frozen=True)
class Arrival:
    """One request of a replay: when (seconds after the start), where, what."""

    offset_s: float
    path: str  # /generate | /v1/completions | /v1/chat/completions
    body: dict
    input_tokens: int | None = None  # when the sender knows it (ids); else the usage tells
    headers: dict[str, str] | None = None  # sent with it (e.g. x-prfaas-entry: the region it enters at)


def generate_ids(offset_s: float, tokens: list[int], max_new_tokens: int) -> Arrival:
    return Arrival(offset_s, "/generate", {"input_ids": tokens, "sampling_params": {"max_new_tokens": max_new_tokens}}, len(tokens))


def completion_text(offset_s: float, text: str, max_tokens: int, model: str | None = None) -> Arrival:
    # the usage in every chunk (SGLang's continuous_usage_stats): a chunk's tokens are counted, not its text,
    # so a server that streams every Nth token (--stream-interval) or holds an incomplete character is read right
    body = {"prompt": text, "max_tokens": max_tokens, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    if model:
        body["model"] = model
    return Arrival(offset_s, "/v1/completions", body)


@dataclass
class RequestResult:
    input_tokens: int
    status: int | None = None
    route: str = ""  # the PrfaaS router's x-prfaas-route header ("cluster/prefill/decode"), if any
    link: str = ""  # its x-prfaas-link header: the pair routed in ("prfaas->pd")
    output_tokens: int = 0
    ttft_s: float | None = None
    token_gaps_s: list[float] = field(default_factory=list)
    error: str | None = None
    sent_s: float = 0.0  # offset from the replay's start
    retry_after_s: float | None = None

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None and self.ttft_s is not None

    @property
    def rejected(self) -> bool:
        """Refused on purpose (load shedding: 429/503 with Retry-After), not a failure."""
        return self.status in (429, 503) and self.retry_after_s is not None

    @property
    def mean_tbt_s(self) -> float:
        return sum(self.token_gaps_s) / len(self.token_gaps_s) if self.token_gaps_s else 0.0


def _failure_message(obj: dict) -> str:
    """What a failure event says (its error's or its abort's message), at most 200 characters."""
    error, meta = obj.get("error"), obj.get("meta_info")
    reason = meta.get("finish_reason") if isinstance(meta, dict) else None
    said = next((x.get("message") for x in (error, reason, obj) if isinstance(x, dict) and x.get("message")), None)
    return str(said or obj)[:200]


async def stream_request(session: aiohttp.ClientSession, url: str, arrival: Arrival,
                         result: RequestResult | None = None) -> RequestResult:
    """POST ``arrival`` with ``stream: true``; never raises for HTTP or connection errors. ``result``
    (optional) is filled as the stream goes, so a caller that cancels the task keeps what came. A stream is
    ok only when it carried a token, no failure event, and its ``[DONE]``: one that breaks after its first
    token is an error naming how many came."""
    result = result if result is not None else RequestResult(arrival.input_tokens or 0)
    body = {**arrival.body, "stream": True}
    start = last = time.perf_counter()
    try:
        async with session.post(url + arrival.path, json=body, headers=arrival.headers) as resp:
            result.status = resp.status
            result.route = resp.headers.get("x-prfaas-route", "")
            result.link = resp.headers.get("x-prfaas-link", "")
            if resp.status != 200:
                result.error = f"{resp.status}: {(await resp.text())[:200]}"
                if resp.headers.get("Retry-After"):
                    result.retry_after_s = float(resp.headers["Retry-After"])
                return result
            count, failure, done = 0, None, False
            async for raw in resp.content:
                line = raw.decode().strip()
                if line == "data: [DONE]":
                    done = True
                    continue
                if not line.startswith("data: {"):
                    continue
                obj = json.loads(line[6:])
                if (code := event_failure(obj)) is not None:  # the router's (or SGLang's) failure event
                    failure = f"{code}: {_failure_message(obj)}"
                usage = obj.get("usage")
                if usage:
                    result.input_tokens = usage.get("prompt_tokens", result.input_tokens)
                if "output_ids" in obj:
                    new = len(obj["output_ids"])
                    if "meta_info" in obj:
                        result.input_tokens = obj["meta_info"].get("prompt_tokens", result.input_tokens)
                elif obj.get("choices") and usage and isinstance(usage.get("completion_tokens"), int):
                    new = usage["completion_tokens"]  # continuous usage: the tokens so far, however many a chunk holds
                else:
                    choice = (obj.get("choices") or [{}])[0]
                    piece = choice.get("text") if "text" in choice else (choice.get("delta") or {}).get("content")
                    new = count + 1 if piece else count
                if new <= count:
                    continue
                now = time.perf_counter()
                if result.ttft_s is None:
                    result.ttft_s = now - start  # a first chunk of several tokens: their gaps are unseen, none counted
                else:  # k tokens in one chunk: k gaps of a token each
                    result.token_gaps_s.extend([(now - last) / (new - count)] * (new - count))
                last, count = now, new
            result.output_tokens = count
            if count == 0:  # a 200 without a token is no answer: say what the stream said, if anything
                result.error = f"stream ended without a token: {failure or 'no error event'}"
            elif failure is not None:  # it broke after it started (the router's or SGLang's failure event)
                result.error = f"stream failed after {count} tokens: {failure}"
            elif not done:  # the connection ended without the stream's end
                result.error = f"stream cut after {count} tokens (no [DONE])"
    except (aiohttp.ClientError, asyncio.TimeoutError) as err:
        result.error = str(err) or type(err).__name__
    return result


async def replay(url: str, arrivals: list[Arrival], connector_limit: int = 512, timeout_s: float = 300) -> tuple[list[RequestResult], float]:
    """Send ``arrivals`` on schedule; returns results (in arrival order) and wall time."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s),
                                     connector=aiohttp.TCPConnector(limit=connector_limit)) as session:
        start = time.perf_counter()
        tasks = []
        for arrival in arrivals:
            delay = start + arrival.offset_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)

            async def one(a=arrival):
                r = await stream_request(session, url, a)
                r.sent_s = a.offset_s
                return r

            tasks.append(asyncio.create_task(one()))
        results = await asyncio.gather(*tasks)
        return list(results), time.perf_counter() - start
