"""``python -m prfaas_sglang.kvindex``: the global KV index as a service for other processes (HTTP).

    python -m prfaas_sglang.kvindex --config launch/local-two-cluster.yaml --port 8001

It subscribes to the KV events of every engine node of the topology that
publishes them and answers:

    POST /match   {"input_ids": [...]}  ->  {"total_tokens", "by_worker": {name: tokens}, "by_cluster": {...}}
    GET  /status  workers, blocks indexed, events applied, resets
    GET  /health

The router embeds the same :class:`KvIndex` in process; this service is for
other consumers (a second router, schedulers, dashboards).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from prfaas_sglang.errors import ConfigError, PrfaasError


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m prfaas_sglang.kvindex", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", type=Path, required=True, help="topology YAML listing the workers")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--page-size", type=int, default=512)
    p.add_argument("--dense", action="store_true", help="the model has no linear/SWA state (no checkpoint rule)")
    return p


def build_app(index, workers: dict[str, tuple[str, str]], page_size: int):
    """``workers``: name -> (cluster, ZMQ endpoint)."""
    from aiohttp import web

    from prfaas_sglang.kvindex.subscriber import KvEventSubscriber

    app = web.Application(client_max_size=64 << 20)
    sub_key = web.AppKey("subscriber", KvEventSubscriber)

    async def on_startup(app):
        app[sub_key] = KvEventSubscriber(index)
        for name, (cluster, endpoint) in workers.items():
            app[sub_key].watch(name, cluster, endpoint)

    async def on_cleanup(app):
        await app[sub_key].close()

    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)

    def error(status: int, message: str):
        return web.json_response({"error": {"message": message, "code": status}}, status=status)

    async def match(request):
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return error(400, "body is not valid JSON")
        ids = body.get("input_ids") if isinstance(body, dict) else None
        if not isinstance(ids, list) or not all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 2**32 for x in ids):
            return error(400, "input_ids must be a list of token ids (0 <= id < 2^32)")
        result = index.match(ids, block_size=page_size)
        return web.json_response({"total_tokens": result.total_tokens, "by_worker": result.by_worker, "by_cluster": result.by_cluster})

    async def status(request):
        sub = request.app[sub_key]
        return web.json_response({
            "workers": {w: {"cluster": c, "blocks": index.block_count(w), "resets": index.resets(w)} for w, c in index.workers().items()},
            "events_applied": sub.events_applied, "bad_frames": sub.bad_frames})

    async def health(request):
        return web.Response(text="OK")

    app.router.add_post("/match", match)
    app.router.add_get("/status", status)
    app.router.add_get("/health", health)
    return app


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        from prfaas_sglang.kvindex.index import KvIndex
        from prfaas_sglang.launch.roles import ROLE_SPECS
        from prfaas_sglang.launch.topology import load_topology

        if args.page_size < 1:
            raise ConfigError("--page-size", f"must be >= 1, got {args.page_size}")
        topology = load_topology(args.config)
        workers = {n.name: (ROLE_SPECS[n.role].cluster_kind, f"tcp://{n.host or '127.0.0.1'}:{n.kv_events_port}")
                   for n in topology.nodes if ROLE_SPECS[n.role].is_engine_role and n.kv_events_port is not None}
        if not workers:
            raise ConfigError("--config", "no engine node publishes KV events (kv_events_port)")
    except PrfaasError as err:
        print(f"error: {err}", file=sys.stderr)
        return err.exit_code
    from aiohttp import web

    web.run_app(build_app(KvIndex(hybrid=not args.dense), workers, args.page_size), host=args.host, port=args.port,
                access_log=None, print=None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
