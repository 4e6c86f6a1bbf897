"""The dashboard renderer (on given query results) and the Prometheus harness's pure parts.

Real Prometheus evaluating the dashboard's queries is tests/engine/test_k8s_e2e.py's."""

from __future__ import annotations

import pytest

from prfaas_sglang.bench.dashboard_png import format_value, render_dashboard
from prfaas_sglang.bench.prometheus import (
    Prometheus,
    PrometheusError,
    QueryError,
    ScrapeTarget,
    scrape_config,
)


def test_format_value_knows_the_common_grafana_units():
    assert format_value(0.25, "s") == "250 ms"
    assert format_value(1536, "bytes") == "1.5 KiB"
    assert format_value(0.5, "percentunit") == "50%"
    assert format_value(12000, "reqps") == "12 k req/s"


def test_render_dashboard_draws_query_results_and_reports_the_empty_ones(tmp_path):
    times_s = [1_700_000_000.0 + t for t in range(0, 60, 5)]
    asked: list[str] = []

    def query_range(expr: str):
        asked.append(expr)
        if "absent_metric" in expr:
            return []
        return [({"cluster": c}, [(t, k * (t - times_s[0])) for t in times_s[1:]]) for k, c in ((2, "prfaas"), (3, "pd"))]

    dashboard = {
        "title": "PrfaaS",
        "panels": [
            {"type": "row", "title": "Router", "gridPos": {"x": 0, "y": 0, "w": 24, "h": 1}},
            {"type": "timeseries", "title": "Requests per second", "gridPos": {"x": 0, "y": 1, "w": 12, "h": 8},
             "targets": [{"expr": "sum by (cluster) (rate(prfaas_router_requests_total[$__rate_interval]))",
                          "legendFormat": "{{cluster}}"}],
             "fieldConfig": {"defaults": {"unit": "reqps"}}},
            {"type": "stat", "title": "Nothing scraped", "gridPos": {"x": 12, "y": 1, "w": 12, "h": 8},
             "targets": [{"expr": "sum(absent_metric)"}]},
        ],
    }
    out = tmp_path / "dashboard.png"
    assert render_dashboard(dashboard, query_range, times_s, out, rate_interval="2m") == ["sum(absent_metric)"]
    assert asked == ["sum by (cluster) (rate(prfaas_router_requests_total[2m]))", "sum(absent_metric)"]
    data = out.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 10_000
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert width == 2000 and height > 300


def test_render_dashboard_names_the_panel_of_a_rejected_query(tmp_path):
    def query_range(expr: str):
        raise QueryError(expr, "bad_data", "parse error: unexpected end of input")

    dashboard = {"title": "t", "panels": [{"type": "timeseries", "title": "Top", "gridPos": {"x": 0, "y": 0, "w": 24, "h": 6},
                                          "targets": [{"expr": "topk(3, x"}]}]}
    with pytest.raises(QueryError, match="panel 'Top'.*parse error") as raised:
        render_dashboard(dashboard, query_range, [0.0], tmp_path / "strict.png")
    assert raised.value.expr == "topk(3, x" and raised.value.error_type == "bad_data"
    assert render_dashboard(dashboard, query_range, [0.0], tmp_path / "lenient.png", strict=False) == []
    assert (tmp_path / "lenient.png").stat().st_size > 0


def test_scrape_config_has_a_job_per_role_and_a_pod_label_per_target():
    targets = [ScrapeTarget("router", "router-0", "http://127.0.0.1:8000"),
               ScrapeTarget("prfaas", "prfaas-0", "http://127.0.0.1:30100"),
               ScrapeTarget("prfaas", "prfaas-1", "http://127.0.0.1:30101")]
    config = scrape_config(targets, 0.5)
    assert config["global"] == {"scrape_interval": "500ms", "scrape_timeout": "500ms", "evaluation_interval": "500ms"}
    assert config["scrape_configs"] == [
        {"job_name": "prfaas", "metrics_path": "/metrics",
         "static_configs": [{"targets": ["127.0.0.1:30100"], "labels": {"pod": "prfaas-0"}},
                            {"targets": ["127.0.0.1:30101"], "labels": {"pod": "prfaas-1"}}]},
        {"job_name": "router", "metrics_path": "/metrics",
         "static_configs": [{"targets": ["127.0.0.1:8000"], "labels": {"pod": "router-0"}}]}]
    with pytest.raises(ValueError, match="not an http"):
        scrape_config([ScrapeTarget("x", "x-0", "127.0.0.1:1")], 1.0)
    with pytest.raises(ValueError, match=">= 1 ms"):
        scrape_config(targets, 0.0001)


def test_a_missing_prometheus_binary_is_a_typed_error_naming_the_fix(tmp_path):
    with pytest.raises(PrometheusError, match="setup-env.sh"):
        Prometheus.start([], tmp_path, binary="prometheus-not-installed-here")
