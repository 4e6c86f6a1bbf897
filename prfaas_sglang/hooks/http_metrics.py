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


def multiprocess_values(result, *args, **kwargs):
    """AFTER ``sglang.srt.utils.common.set_prometheus_multiproc_dir``: metrics created from here on in
    this process write to the multiprocess directory SGLang just set.

    ``prometheus_client`` picks its value class (in-process, or files in ``PROMETHEUS_MULTIPROC_DIR``)
    once, when first imported. SGLang sets that directory in ``_set_envs_and_config``, after plugins
    load, and imports ``prometheus_client`` only later, on purpose. Our plugin resolves its hook
    targets at load, and ``sglang.srt.disaggregation.mooncake.conn`` imports ``prometheus_client`` at
    module level, so in the HTTP server's process the class was already chosen, in-process: the
    tokenizer manager's metrics (``sglang:num_requests_total``, TTFT and end-to-end latency
    histograms, ...) were never written where ``/metrics`` reads (SGLang's ``MultiProcessCollector``),
    and vanished from it (seen with real SGLang servers on CPU). Choose the class again, now that the
    directory is set. Metrics created before keep theirs (none of SGLang's in that process: its
    collectors are built after this call); scheduler processes inherit the directory and were right.
    """
    import sys

    values = sys.modules.get("prometheus_client.values")
    if values is not None:  # not imported yet: its own import will choose right
        values.ValueClass = values.get_value_class()
    return result
