"""SGLang's HTTP metrics middleware with FastAPI's included routers (the ``metrics-route-path`` hook)."""

from __future__ import annotations

from fastapi import APIRouter, FastAPI
from fastapi.testclient import TestClient

from prfaas_sglang.plugin import register


def test_a_request_to_an_included_routers_endpoint_is_counted_not_failed():
    """SGLang's own middleware (add_prometheus_middleware's path lookup) on an app with an included
    router, as SGLang mounts /v1/loads: HTTP 200, labelled with the request's path (FastAPI 0.165 does not
    expose the included endpoint's template); SGLang's own answer elsewhere."""
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
    assert client.get("/v1/loads/all").status_code == 200
    assert client.get("/health").status_code == 200
    assert client.get("/nowhere").status_code == 404
    assert seen == [("/v1/loads/all", True), ("/health", True), ("/nowhere", False)]
