"""``python -m prfaas_sglang.kvindex``: the global KV index as a service for other processes (HTTP).

    python -m prfaas_sglang.kvindex --config launch/local-two-cluster.yaml [--port 8001]

It subscribes to the KV events of every engine node of the topology that
publishes them (the node's ``kv_events_port``, else the worker's
``/server_info["kv_events"]``), hashes at each worker's block size (from
``/server_info``; ``--page-size`` only for workers that do not answer), and
answers:

    POST /match   {"input_ids": [...]}  ->  {"total_tokens", "by_worker": {name: tokens}, "by_cluster": {...},
                                              "shared_tokens", "held_by_worker": {name: tokens}}
    GET  /status  workers, blocks indexed, resets, per-subscription frame counts
    GET  /metrics Prometheus text: prfaas_kvindex_blocks{worker,cluster}, resets, frames (no key needed)
    GET  /health

The router embeds the same :class:`KvIndex` in process; this service is for
other consumers (a second router, schedulers, dashboards).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from prfaas_sglang.errors import ConfigError, PrfaasError

if TYPE_CHECKING:
    from prfaas_sglang.wire.server_info import KvEventsEndpoint


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m prfaas_sglang.kvindex", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", type=Path, required=True, help="topology YAML listing the workers")
    p.add_argument("--host", default=None,
                   help="bind address (default: the topology's kv-index node, else 127.0.0.1)")
    p.add_argument("--port", type=int, default=None, help="default: the topology's kv-index node")
    p.add_argument("--page-size", type=int, default=None, help="block size for workers that do not report theirs")
    p.add_argument("--wait-workers-s", type=float, default=300.0,
                   help="without --page-size: wait this long for every worker to report its block size before "
                        "failing (workers and the kv-index start together on Kubernetes)")
    p.add_argument("--memo-mib", type=float, default=64.0,
                   help="memory for the page-id memo (block ids of prompts already hashed; at page size 1 about "
                        "2.1 KiB per 256 tokens held); 0: keep none")
    p.add_argument("--dense", action="store_true", help="the model has no linear/SWA state (no checkpoint rule); "
                                                        "default: what the topology's cost model says")
    return p


def _block_size(url: str, fallback: int | None, headers: dict | None = None) -> tuple[int | None, KvEventsEndpoint | None]:
    """The worker at ``url``'s KV-event block size and endpoint, from its ``/server_info``
    (``wire/server_info.py``); ``(fallback, None)`` when it does not answer or its answer is malformed."""
    from prfaas_sglang.adapters import http_sync
    from prfaas_sglang.wire.server_info import parse_server_info

    try:
        facts = parse_server_info(http_sync.get_json(url + "/server_info", timeout_s=2, headers=headers))
    except (http_sync.HttpError, ValueError):  # FactsError is a ValueError
        return fallback, None
    return facts.events_block_size, facts.kv_events


def _wait_block_size(url: str, fallback: int | None, headers: dict | None,
                     wait_s: float) -> tuple[int | None, KvEventsEndpoint | None]:
    """:func:`_block_size`, asked again every second for up to ``wait_s`` while the worker does not answer."""
    deadline = time.monotonic() + wait_s
    while True:
        size, endpoint = _block_size(url, None, headers)
        if size is not None or time.monotonic() >= deadline:
            return (size if size is not None else fallback), endpoint
        time.sleep(1.0)


def build_app(index, workers: dict[str, tuple[str, str, str]], keys=None):
    """``workers``: name -> (cluster, ZMQ endpoint, topic). With ``keys`` (the deployment's), the
    KV-event streams are CURVE clients and every endpoint but /health needs the worker API key
    (what it serves is derived from prompts)."""
    from aiohttp import web
    from prometheus_client import CONTENT_TYPE_PLAIN_0_0_4, CollectorRegistry, generate_latest

    from prfaas_sglang.adapters.http_auth import bearer_middleware
    from prfaas_sglang.adapters.zmq import CurveKeys, ZmqSubscriber
    from prfaas_sglang.kvindex.feed import kv_event_handler
    from prfaas_sglang.wire import kv_snapshot

    api_key = bearer_middleware(keys.worker_api_key if keys else None, lambda err: error(401, str(err)))
    app = web.Application(client_max_size=64 << 20, middlewares=[api_key])
    sub_key = web.AppKey("subscriber", ZmqSubscriber)
    metrics_key = web.AppKey("metrics", CollectorRegistry)  # what /metrics serves: the app's own registry
    app[metrics_key] = CollectorRegistry()
    app[metrics_key].register(KvIndexMetrics(index, lambda: app[sub_key].stats(time.monotonic())))

    async def on_startup(app):
        app[sub_key] = ZmqSubscriber(curve=CurveKeys.from_deployment(keys))
        for name, (_cluster, endpoint, topic) in workers.items():
            app[sub_key].watch(name, endpoint, topic.encode(), kv_event_handler(index, name))

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
        result = index.match(ids)
        return web.json_response({"total_tokens": result.total_tokens, "by_worker": result.by_worker,
                                  "by_cluster": result.by_cluster, "shared_tokens": result.shared_tokens,
                                  "held_by_worker": result.held_by_worker})

    async def status(request):
        subs = request.app[sub_key].stats(time.monotonic())
        return web.json_response({
            "workers": {w: {"cluster": c, "blocks": index.block_count(w), "resets": index.resets(w),
                            **dict(zip(("checkpoints", "checkpoints_from"), index.checkpoints(w), strict=True))}
                        for w, c in index.workers().items()},
            "subscriptions": subs,
            "events_applied_frames": sum(s["frames"] - s["bad_frames"] - s["handler_errors"] for s in subs.values()),
            "bad_frames": sum(s["bad_frames"] for s in subs.values()),
            "auth_failures": sum(s["auth_failures"] for s in subs.values()),
            "memo": index.memo.stats()})

    async def health(request):
        return web.Response(text="OK")

    async def metrics(request):
        return web.Response(body=generate_latest(request.app[metrics_key]), headers={"Content-Type": CONTENT_TYPE_PLAIN_0_0_4})

    async def snapshot(request):  # what a restarted router starts from (wire/kv_snapshot.py)
        return web.Response(body=kv_snapshot.encode(index.export()), content_type="application/json")

    app.router.add_get("/snapshot", snapshot)
    app.router.add_post("/match", match)
    app.router.add_get("/status", status)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    return app


class KvIndexMetrics:
    """The kv-index's ``/metrics`` (a prometheus_client collector), read at each scrape: blocks and
    resets per worker of ``index``, frames per subscription of ``subscriptions()`` (the subscriber's
    ``stats``: source -> {"connected", "frames", "bad_frames", "auth_failures", ...})."""

    def __init__(self, index, subscriptions: Callable[[], dict[str, dict]]):
        self._index, self._subscriptions = index, subscriptions

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        workers = sorted(self._index.workers().items())
        subscriptions = sorted(self._subscriptions().items())
        blocks = GaugeMetricFamily("prfaas_kvindex_blocks", "Blocks the index holds for a worker", labels=["worker", "cluster"])
        resets = CounterMetricFamily("prfaas_kvindex_resets_total", "Times a worker's blocks were dropped (cache cleared, gap)",
                                     labels=["worker", "cluster"])
        for worker, cluster in workers:
            blocks.add_metric([worker, cluster], self._index.block_count(worker))
            resets.add_metric([worker, cluster], self._index.resets(worker))
        yield blocks
        yield resets
        for name, key, doc in (("prfaas_kvindex_frames_total", "frames", "KV-event frames received per subscription"),
                               ("prfaas_kvindex_bad_frames_total", "bad_frames", "Frames that did not decode (dropped)"),
                               ("prfaas_kvindex_auth_failures_total", "auth_failures", "Publishers refused (no deployment key)")):
            family = CounterMetricFamily(name, doc, labels=["source"])
            for source, stats in subscriptions:
                family.add_metric([source], stats[key])
            yield family
        connected = GaugeMetricFamily("prfaas_kvindex_subscription_connected",
                                      "1 while the subscription's handshake with its publisher holds", labels=["source"])
        for source, stats in subscriptions:
            connected.add_metric([source], int(stats["connected"]))
        yield connected


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        from prfaas_sglang import runtime
        from prfaas_sglang.kvindex.index import KvIndex
        from prfaas_sglang.roles import ROLE_SPECS, Role
        from prfaas_sglang.security import load_keys, warn_if_open
        from prfaas_sglang.topology import load_topology
        from prfaas_sglang.wire.blocks import PageIdMemo, memo_bytes_from_mib
        from prfaas_sglang.wire.kv_events import KV_EVENTS_TOPIC

        if args.page_size is not None and args.page_size < 1:
            raise ConfigError("--page-size", f"must be >= 1, got {args.page_size}")
        try:
            memo_bytes = memo_bytes_from_mib(args.memo_mib)
        except ValueError as e:
            raise ConfigError("--memo-mib", str(e)) from None
        if not args.wait_workers_s >= 0:
            raise ConfigError("--wait-workers-s", f"must be >= 0, got {args.wait_workers_s}")
        keys = load_keys()
        warn_if_open(keys, "kv-index")
        topology = load_topology(args.config)
        hybrid = False if args.dense else runtime.from_topology(topology).hybrid
        index = KvIndex(hybrid=hybrid, memo=PageIdMemo(max_segments=None, max_bytes=memo_bytes))
        workers = {}
        engines = [n for n in topology.nodes if ROLE_SPECS[n.role].is_engine_role and n.port is not None]
        bearer = keys.bearer() if keys else None

        def facts(n):
            return _wait_block_size(f"http://{n.host or '127.0.0.1'}:{n.port}", args.page_size, bearer,
                                    args.wait_workers_s if n.kv_events_port is not None and args.page_size is None
                                    else 0.0)  # --page-size: no waiting, the fallback serves

        # Every worker is waited for at once: N late workers cost one wait, not N in a row.
        with concurrent.futures.ThreadPoolExecutor(max_workers=max(len(engines), 1)) as pool:
            answers = list(pool.map(facts, engines))
        for n, (size, endpoint) in zip(engines, answers, strict=True):
            host = n.host or "127.0.0.1"
            port = n.kv_events_port or (endpoint.port if endpoint else None)
            if port is None:
                continue
            if size is None:
                raise ConfigError(f"nodes.{n.name}", "did not report its block size (/server_info); give --page-size")
            index.add_worker(n.name, ROLE_SPECS[n.role].cluster_kind, size)
            workers[n.name] = (ROLE_SPECS[n.role].cluster_kind, f"tcp://{host}:{port}",
                               (endpoint.topic if endpoint else None) or KV_EVENTS_TOPIC)
        if not workers:
            raise ConfigError("--config", "no engine node publishes KV events (kv_events_port)")
        node = next(iter(topology.nodes_of(Role.KV_INDEX)), None)
        host = args.host or (node.host if node and node.host else "127.0.0.1")
        port = args.port or (node.port if node else None)
        if port is None:
            raise ConfigError("--port", "is required (the topology has no kv-index node with a port)")
    except PrfaasError as err:
        print(f"error: {err}", file=sys.stderr)
        return err.exit_code
    from aiohttp import web

    from prfaas_sglang.procgc import freeze_startup_objects

    app = build_app(index, workers, keys)
    freeze_startup_objects()
    web.run_app(app, host=host, port=port, access_log=None, print=None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
