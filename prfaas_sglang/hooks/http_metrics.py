"""Hook: SGLang's HTTP metrics middleware names the route of a request to an included router.

With ``--enable-metrics`` (the launcher's default), SGLang 0.5.15 labels every HTTP request with its
route's path template (``_get_fastapi_request_path``: the first of ``app.routes`` that matches, its
``.path``). FastAPI 0.165 (the version this project's environment and GPU bundle carry) lists a router
mounted with ``include_router`` as one ``_IncludedRouter`` route without a ``.path``, so every request
to such an endpoint (``GET /v1/loads``, which our router polls for each worker's load) failed with
HTTP 500 in the middleware (seen with real SGLang servers on CPU, ``bench gpu-e2e --engine sglang-cpu``).

``route_path`` (AROUND ``sglang.srt.utils.common._get_fastapi_request_path``): SGLang's answer where
it has one; where the matching route has no ``.path``, the request's own path (FastAPI 0.165 does not
expose the included endpoint's template; such labels are concrete paths, which SGLang's own comment
accepts behind a router).
"""

from __future__ import annotations


def route_path(original, request):
    try:
        return original(request)
    except AttributeError:
        pass
    from starlette.routing import Match

    for route in request.app.routes:
        match, _ = route.matches(request.scope)
        if match == Match.FULL:
            return getattr(route, "path", None) or request.url.path, True
    return request.url.path, False
