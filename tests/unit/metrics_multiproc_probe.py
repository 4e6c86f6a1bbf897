"""Probe for ``test_http_metrics.py``: does SGLang's tokenizer metrics collector, built the way an HTTP
server process builds it, reach what ``/metrics`` reads (a ``MultiProcessCollector``)?
``sys.argv[1]``: ``hooked`` (our plugin registered first, as SGLang's plugin loader does before it sets
``PROMETHEUS_MULTIPROC_DIR``) or ``stock`` (only the import our plugin's load makes). Prints EXPORTED
or MISSING.

``route-path``: SGLang's middleware path lookup on an app with an included router, the plugin
registered (the ``metrics-route-path`` hook); prints what the lookup returned for each request, as
JSON. A process of its own: ``register()`` hooks SGLang for the rest of the process."""

from __future__ import annotations

import dataclasses
import json
import sys
import types


def server_args_defaults():
    """ServerArgs' field defaults, without its __post_init__ (which loads a model config): a dataclass's
    fields (0.5.15), else its constructor's defaults (0.5.23)."""
    import inspect

    from sglang.srt.server_args import ServerArgs

    if not dataclasses.is_dataclass(ServerArgs):
        return types.SimpleNamespace(**{name: p.default for name, p in inspect.signature(ServerArgs).parameters.items()
                                        if p.default is not inspect.Parameter.empty})
    return types.SimpleNamespace(**{
        f.name: f.default if f.default is not dataclasses.MISSING else f.default_factory()
        for f in dataclasses.fields(ServerArgs)
        if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING})


def route_paths() -> None:
    from fastapi import APIRouter, FastAPI
    from fastapi.testclient import TestClient

    from prfaas_sglang.plugin import register

    register()  # what SGLang's plugin loader does in every server process
    from sglang.srt.utils.common import _get_fastapi_request_path

    app = FastAPI()
    sub = APIRouter()

    @sub.get("/v1/loads/{which}")
    async def loads(which: str):
        return {"which": which}

    @app.get("/health")
    async def health():
        return {}

    app.include_router(sub)
    seen = []

    @app.middleware("http")
    async def track(request, call_next):
        seen.append(_get_fastapi_request_path(request))
        return await call_next(request)

    client = TestClient(app)
    statuses = [client.get(path).status_code for path in ("/v1/loads/all", "/health", "/nowhere")]
    print(json.dumps({"statuses": statuses, "seen": seen}))


def main() -> None:
    if sys.argv[1] == "route-path":
        route_paths()
        return
    if sys.argv[1] == "hooked":
        from prfaas_sglang.plugin import register

        register()
    else:
        import sglang.srt.disaggregation.mooncake.conn  # noqa: F401 - what resolving our hook targets imports
    assert "prometheus_client" in sys.modules
    from sglang.srt.utils import common

    common.set_prometheus_multiproc_dir()  # what SGLang's _set_envs_and_config does with --enable-metrics
    from prometheus_client import CollectorRegistry, generate_latest, multiprocess
    from sglang.srt.observability.metrics_collector import TokenizerMetricsCollector

    from prfaas_sglang.bench.layerwise_bench import published_server_args

    # 0.5.23 reads its observability config from the process's published context, as a server process has it
    server_args = published_server_args(0) or server_args_defaults()
    collector = TokenizerMetricsCollector(server_args=server_args, labels={"model_name": "m"})
    labels = {"model_name": "m"}
    if "is_streaming" in collector.num_requests_total._labelnames:  # 0.5.23 labels the stream too
        labels["is_streaming"] = "false"
    collector.num_requests_total.labels(**labels).inc()
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry)
    print("EXPORTED" if b"sglang:num_requests_total" in generate_latest(registry) else "MISSING")


if __name__ == "__main__":
    main()
