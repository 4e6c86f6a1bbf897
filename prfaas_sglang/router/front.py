"""``python -m prfaas_sglang.router.front``: a thin HTTP front that keeps clients' connections
across a router crash or restart.

A killed router process takes its clients' connections with it: they reset, and no typed error
can reach them. The front holds those connections instead and relays each request to the router:

* the router cannot be reached, or dropped the request before answering (its process died):
  the front sends the request again, sleeping between tries, until ``retry_window_s`` has passed
  (long enough for a supervisor to restart the router), then answers 503 with a JSON error and
  ``Retry-After``. Only the data plane (``/generate``, ``/v1/completions``,
  ``/v1/chat/completions``) and reads (GET) are sent again once the router may have seen them: a
  repeated generation costs compute but answers the client; any other request that the router
  may have received is answered 502 instead (an admin change is not repeated behind the
  operator's back);
* a streamed answer (SSE) that breaks after it started ends with an error event and ``[DONE]``,
  as the router ends a broken decode stream; a whole answer (JSON) is read before the client gets
  it, so a router that dies meanwhile is retried as above.

The front keeps no state but one connection pool, parses nothing but the request line and headers,
and adds one local hop (measured in BENCHMARKS.md, "Chaos"). A front that is itself killed resets
its connections as the router would: run it where a process supervisor restarts it, or run two
behind the deployment's load balancer.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import time
from dataclasses import dataclass

import aiohttp
import orjson
from aiohttp import web

from prfaas_sglang.protocol import ends_event, stream_failed_event
from prfaas_sglang.router.service import MAX_BODY_BYTES

logger = logging.getLogger(__name__)

REPLAYABLE_PATHS = frozenset({"/generate", "/v1/completions", "/v1/chat/completions"})
HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
                        "trailers", "transfer-encoding", "upgrade", "host", "content-length"})
FIRST_BACKOFF_S, MAX_BACKOFF_S = 0.05, 0.5


@dataclass(frozen=True)
class FrontConfig:
    router_url: str
    retry_window_s: float = 10.0
    max_body_bytes: int = MAX_BODY_BYTES


def may_resend(method: str, path: str) -> bool:
    """Whether a request the router may already have received is sent again (pure)."""
    return method == "GET" or (method == "POST" and path in REPLAYABLE_PATHS)


def error_body(status: int, message: str, kind: str) -> bytes:
    return orjson.dumps({"error": {"message": message, "code": status, "type": kind}})


class _Unanswered(Exception):
    """The router gave no (complete) answer; ``sent``: it may have received the request."""

    def __init__(self, message: str, sent: bool):
        super().__init__(message)
        self.sent = sent


class Front:
    """The relay. ``session`` is created in :meth:`start` (the app's startup) and closed in :meth:`close`."""

    def __init__(self, config: FrontConfig):
        self.config = config
        self.session: aiohttp.ClientSession | None = None
        self.counters = {"relayed": 0, "resent": 0, "unavailable": 0, "stream_broken": 0}

    async def start(self, _app=None) -> None:
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1024),
                                             timeout=aiohttp.ClientTimeout(total=None, sock_connect=2.0),
                                             auto_decompress=False)

    async def close(self, _app=None) -> None:
        if self.session is not None:
            await self.session.close()

    async def handle(self, request: web.Request) -> web.StreamResponse:
        if request.path == "/front/health":
            return web.json_response({"ok": True, **self.counters})
        if request.content_length is not None and request.content_length > self.config.max_body_bytes:
            return _json(413, f"request body of {request.content_length} bytes exceeds {self.config.max_body_bytes} bytes",
                         "too_large")
        try:
            body = await request.read()
        except web.HTTPRequestEntityTooLarge:
            return _json(413, f"request body exceeds {self.config.max_body_bytes} bytes", "too_large")
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP}
        headers["X-Forwarded-For"] = request.remote or ""
        url = self.config.router_url.rstrip("/") + request.path_qs
        deadline = time.monotonic() + self.config.retry_window_s
        backoff_s, tries = FIRST_BACKOFF_S, 0
        while True:
            tries += 1
            try:
                return await self._relay(request, url, body, headers)
            except _Unanswered as err:
                if err.sent and not may_resend(request.method, request.path):
                    return _json(502, f"the router dropped the request ({err}); it is not sent again", "router_failed")
                if time.monotonic() + backoff_s >= deadline:
                    self.counters["unavailable"] += 1
                    return _json(503, f"the router did not answer within {self.config.retry_window_s:g} s "
                                      f"({tries} tries; last: {err})", "router_unavailable", retry_after_s=1)
                self.counters["resent"] += 1
                await asyncio.sleep(backoff_s)
                backoff_s = min(2 * backoff_s, MAX_BACKOFF_S)

    async def _relay(self, request: web.Request, url: str, body: bytes, headers: dict) -> web.StreamResponse:
        """One try. Raises :class:`_Unanswered` when the router gave no complete answer and the
        client has had nothing yet; a stream that breaks later is ended here."""
        try:
            async with self.session.request(request.method, url, data=body, headers=headers,
                                            allow_redirects=False) as resp:
                out_headers = {k: v for k, v in resp.headers.items() if k.lower() not in HOP_BY_HOP}
                if not resp.content_type.startswith("text/event-stream"):
                    payload = await resp.read()
                    self.counters["relayed"] += 1
                    return web.Response(body=payload, status=resp.status, headers=out_headers)
                return await self._relay_stream(request, resp, out_headers)
        except (aiohttp.ClientConnectorError, aiohttp.ServerTimeoutError) as err:  # not connected (sock_connect only)
            raise _Unanswered(f"{type(err).__name__}: {err}", sent=False) from None
        except (aiohttp.ClientError, asyncio.TimeoutError) as err:  # connected: the router may have it
            raise _Unanswered(f"{type(err).__name__}: {err}", sent=True) from None

    async def _relay_stream(self, request: web.Request, resp: aiohttp.ClientResponse, headers: dict) -> web.StreamResponse:
        stream = web.StreamResponse(status=resp.status, headers=headers)
        await stream.prepare(request)
        at_event_end = True
        try:
            async for data in resp.content.iter_any():
                await stream.write(data)
                at_event_end = ends_event(data)
            if not at_event_end:
                raise aiohttp.ClientPayloadError("the router's stream ended inside an event")
        except (aiohttp.ClientError, asyncio.TimeoutError) as err:
            self.counters["stream_broken"] += 1
            try:
                await stream.write(stream_failed_event(502, f"the router's stream broke: {type(err).__name__}: {err}", at_event_end))
            except (ConnectionError, RuntimeError):
                return stream
        self.counters["relayed"] += 1
        try:
            await stream.write_eof()
        except (ConnectionError, RuntimeError):
            pass
        return stream


def _json(status: int, message: str, kind: str, retry_after_s: int | None = None) -> web.Response:
    headers = {"Retry-After": str(retry_after_s)} if retry_after_s else None
    return web.Response(body=error_body(status, message, kind), status=status, headers=headers,
                        content_type="application/json")


def build_app(config: FrontConfig) -> web.Application:
    front = Front(config)
    app = web.Application(client_max_size=config.max_body_bytes)
    app.on_startup.append(front.start)
    app.on_cleanup.append(front.close)
    app.router.add_route("*", "/{tail:.*}", front.handle)
    return app


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m prfaas_sglang.router.front", description=__doc__.split("\n\n")[0])
    parser.add_argument("--router", required=True, help="the router's URL, e.g. http://127.0.0.1:8000")
    parser.add_argument("--host", default="127.0.0.1", help="address the front listens on")
    parser.add_argument("--port", type=int, required=True, help="port the front listens on")
    parser.add_argument("--retry-window-s", type=float, default=10.0,
                        help="how long a request waits for an unreachable router before a 503 (default 10)")
    args = parser.parse_args(argv)
    if not args.router.startswith(("http://", "https://")):
        parser.error("--router must be an http(s) URL")
    if not 0 < args.retry_window_s <= 600:
        parser.error("--retry-window-s must be in (0, 600]")
    if not 0 < args.port < 65536:
        parser.error(f"--port must be in 1..65535, got {args.port}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    web.run_app(build_app(FrontConfig(args.router, args.retry_window_s)), host=args.host, port=args.port,
                access_log=None, print=None)


if __name__ == "__main__":
    main()
