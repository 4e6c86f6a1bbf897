"""SGLang's HTTP metrics middleware with FastAPI's included routers (the ``metrics-route-path`` hook)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import zygote
from helpers import SGLANG_PROCESS_GUARD_S, retired_here


@pytest.mark.slow
@retired_here("metrics-route-path")
def test_a_request_to_an_included_routers_endpoint_is_counted_not_failed():
    """SGLang's own middleware (add_prometheus_middleware's path lookup) on an app with an included
    router, as SGLang mounts /v1/loads: HTTP 200, labelled with the request's path (FastAPI 0.165 does not
    expose the included endpoint's template); SGLang's own answer elsewhere. In a process of its own:
    the plugin's ``register()`` hooks SGLang for the rest of its process."""
    raw = _probe("route-path")
    assert raw.startswith("{"), raw  # the probe's stderr otherwise
    out = json.loads(raw)
    assert out["statuses"] == [200, 200, 404]
    assert out["seen"] == [["/v1/loads/all", True], ["/health", True], ["/nowhere", False]]


def _probe(mode: str) -> str:
    """The probe's last line (its stderr if it printed none). ``route-path`` is forked from the SGLang
    zygote; the metrics modes start afresh: what they test is the order in which a fresh process imports
    prometheus_client and SGLang, which a process that preloaded SGLang has already fixed."""
    argv = [sys.executable, str(Path(__file__).with_name("metrics_multiproc_probe.py")), mode]
    proc = (zygote.run(argv, timeout=SGLANG_PROCESS_GUARD_S) if mode == "route-path"
            else subprocess.run(argv, capture_output=True, text=True, timeout=SGLANG_PROCESS_GUARD_S))
    return proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else proc.stderr[-2000:]


@pytest.mark.slow
def test_the_http_processs_request_metrics_reach_metrics_although_the_plugin_imports_prometheus_first():
    """``metrics-multiproc-values``: with only the early import our plugin's load makes, SGLang's
    ``sglang:num_requests_total`` never reaches the multiprocess collector ``/metrics`` serves (the fault,
    so the test can fail); with the plugin registered, it does. Fresh processes: prometheus_client's
    choice is per process."""
    assert _probe("stock") == "MISSING"
    assert _probe("hooked") == "EXPORTED"
