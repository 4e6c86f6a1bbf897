"""SGLang's ``--api-key`` rule as aiohttp middleware, for every HTTP server of ours that a
deployment secret protects (the emulated engine, the kv-index, the role supervisor)."""

from __future__ import annotations

from collections.abc import Callable

from aiohttp import web

from prfaas_sglang.wire.auth import AuthError, check_bearer

OPEN_PREFIXES = ("/health", "/metrics")  # SGLang's own exemptions: probes and scrapes need no key


def bearer_middleware(key: str | None, reject: Callable[[AuthError], web.Response],
                      open_prefixes: tuple[str, ...] = OPEN_PREFIXES):
    """Middleware: with ``key``, every request but ``OPTIONS`` and paths under ``open_prefixes``
    needs ``Authorization: Bearer <key>`` (constant-time compare); a refusal is ``reject(err)``
    (the server's own 401 body; it may count ``err.reason``). Without ``key``: passes everything."""

    @web.middleware
    async def check(request: web.Request, handler):
        if key is not None and request.method != "OPTIONS" and not request.path.startswith(open_prefixes):
            try:
                check_bearer(key, request.headers.get("Authorization"))
            except AuthError as err:
                return reject(err)
        return await handler(request)

    return check
