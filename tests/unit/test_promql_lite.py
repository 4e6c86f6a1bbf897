"""promql_lite (scrape parsing, a PromQL subset) and the dashboard renderer built on it."""

from __future__ import annotations

import ast
import math
import re

import pytest
from helpers import REPO_ROOT

from prfaas_sglang.bench.dashboard_png import format_value, render_dashboard
from prfaas_sglang.bench.promql_lite import (
    PromQLError,
    Store,
    evaluate,
    metric_names,
    parse_exposition,
)

SCRAPE = r"""# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="m",path="C:\\tmp",quote="say \"hi\"",note="a\nb"} 3
inf_gauge +Inf
nan_gauge NaN
small{a="x",} 1e-05 1700000000000
"""


def store_of(*scrapes: tuple[float, str, dict[str, str]]) -> Store:
    store = Store()
    for t_s, text, target in scrapes:
        store.add(t_s, parse_exposition(text), target)
    return store


def values(vector: dict) -> dict[frozenset, float]:
    """The vector keyed by frozen label sets, so tests need not spell sorted tuples."""
    return {frozenset(labels): value for labels, value in vector.items()}


# --------------------------------------------------------------------------- exposition


def test_exposition_parses_escapes_special_values_and_colon_names():
    samples = parse_exposition(SCRAPE)
    assert samples[0] == (
        "sglang:num_running_reqs",
        {"model_name": "m", "path": "C:\\tmp", "quote": 'say "hi"', "note": "a\nb"},
        3.0,
    )
    assert samples[1] == ("inf_gauge", {}, math.inf)
    assert samples[2][0] == "nan_gauge" and math.isnan(samples[2][2])
    assert samples[3] == ("small", {"a": "x"}, 1e-05)  # trailing comma, timestamp ignored
    assert len(samples) == 4


def test_exposition_rejects_a_malformed_line_with_its_number():
    with pytest.raises(ValueError, match="line 2"):
        parse_exposition('ok 1\nbad{a="x" 1\n')


def test_store_merges_target_labels_and_keeps_a_clashing_scraped_one_as_exported():
    store = store_of((0.0, 'reqs{job="inner",cluster="a"} 1\n', {"job": "router", "instance": "127.0.0.1:8000"}))
    assert values(evaluate("reqs", store, 0.0)) == {
        frozenset({("__name__", "reqs"), ("job", "router"), ("exported_job", "inner"), ("cluster", "a"),
                   ("instance", "127.0.0.1:8000")}): 1.0
    }


# --------------------------------------------------------------------------- selectors


def test_instant_selector_takes_the_latest_sample_within_five_minutes():
    store = store_of((0.0, "g 1\n", {}), (10.0, "g 2\n", {}))
    assert evaluate("g", store, 5.0) == {(("__name__", "g"),): 1.0}
    assert evaluate("g", store, 10.0) == {(("__name__", "g"),): 2.0}
    assert evaluate("g", store, 309.0) == {(("__name__", "g"),): 2.0}
    assert evaluate("g", store, 310.0) == {}  # lookback is (t - 5m, t]
    assert evaluate("g", store, -1.0) == {}


def test_label_matchers_and_anchored_regexes():
    text = 'r{cluster="prfaas"} 1\nr{cluster="pd"} 2\nr{cluster="prfaas-2"} 3\nr 4\n'
    store = store_of((0.0, text, {}))

    def clusters(expr):
        return sorted(dict(labels).get("cluster", "") for labels in evaluate(expr, store, 0.0))

    assert clusters('r{cluster="pd"}') == ["pd"]
    assert clusters('r{cluster!="pd"}') == ["", "prfaas", "prfaas-2"]
    assert clusters('r{cluster=~"prfaas"}') == ["prfaas"]  # anchored: not prfaas-2
    assert clusters('r{cluster=~"p.*"}') == ["pd", "prfaas", "prfaas-2"]
    assert clusters('r{cluster=~"fa"}') == []
    assert clusters('r{cluster!~"prfaas.*"}') == ["", "pd"]
    assert clusters('r{cluster=""}') == [""]  # a missing label matches as empty
    assert clusters('{__name__="r", cluster="pd"}') == ["pd"]


# --------------------------------------------------------------------------- functions


def test_rate_and_increase_handle_a_counter_reset():
    store = store_of(*((t, f"c_total {v}\n", {"job": "j"}) for t, v in [(0, 0), (10, 10), (20, 20), (30, 5), (40, 15)]))
    # window (0, 40]: 10, 20, 5, 15 -> (15 - 10) + 20 (the reset) = 25 over 30 s
    assert evaluate("increase(c_total[40s])", store, 40.0) == {(("job", "j"),): 25.0}
    assert evaluate("rate(c_total[40s])", store, 40.0) == {(("job", "j"),): pytest.approx(25.0 / 30.0)}
    assert evaluate("rate(c_total[1m])", store, 40.0) == {(("job", "j"),): pytest.approx(35.0 / 40.0)}
    assert evaluate("rate(c_total[10s])", store, 40.0) == {}  # one sample in (30, 40]: absent


def test_histogram_quantile_interpolates_within_the_bucket():
    buckets = {"0.1": 10, "0.5": 30, "1": 40, "+Inf": 40}
    text = "".join(f'h_bucket{{le="{le}",cluster="a"}} {n}\n' for le, n in buckets.items())
    text += "".join(f'h_bucket{{le="{le}",cluster="empty"}} 0\n' for le in buckets)
    text += "".join(f'h_bucket{{le="{le}",cluster="tail"}} {n}\n' for le, n in zip(buckets, (10, 30, 40, 50), strict=True))
    store = store_of((0.0, text, {}))
    assert values(evaluate('histogram_quantile(0.5, h_bucket{cluster!="tail"})', store, 0.0)) == {
        frozenset({("cluster", "a")}): pytest.approx(0.1 + (20 - 10) / (30 - 10) * (0.5 - 0.1))  # 0.3; "empty" omitted
    }
    assert evaluate('histogram_quantile(0.25, h_bucket{cluster="a"})', store, 0.0) == {
        (("cluster", "a"),): pytest.approx(0.1)
    }
    assert evaluate('histogram_quantile(1, h_bucket{cluster="a"})', store, 0.0) == {(("cluster", "a"),): 1.0}
    # a rank in the +Inf bucket (45 of 50) gives the highest finite bound
    assert evaluate('histogram_quantile(0.9, h_bucket{cluster="tail"})', store, 0.0) == {(("cluster", "tail"),): 1.0}


def test_histogram_quantile_over_a_rate_of_a_summed_histogram():
    def scrape(t_s, counts):
        return t_s, "".join(f'lat_bucket{{le="{le}",pod="{pod}"}} {n}\n'
                            for pod in ("p1", "p2") for le, n in zip(("0.1", "1", "+Inf"), counts, strict=True)), {}

    store = store_of(scrape(0.0, (0, 0, 0)), scrape(10.0, (5, 10, 10)))
    expr = "histogram_quantile(0.75, sum by (le) (rate(lat_bucket[1m])))"
    assert evaluate(expr, store, 10.0) == {(): pytest.approx(0.1 + (15 - 10) / (20 - 10) * 0.9)}
    assert metric_names(expr) == {"lat_bucket"}


# --------------------------------------------------------------------------- aggregations and arithmetic


@pytest.fixture
def reqs() -> Store:
    text = ('reqs{cluster="a",role="prefill"} 1\nreqs{cluster="a",role="decode"} 2\n'
            'reqs{cluster="b",role="prefill"} 4\nreqs{cluster="b",role="decode"} 8\n')
    return store_of((0.0, text, {"job": "router"}))


def test_sum_by_and_without_before_or_after_the_argument(reqs):
    by_cluster = {(("cluster", "a"),): 3.0, (("cluster", "b"),): 12.0}
    assert evaluate("sum by (cluster) (reqs)", reqs, 0.0) == by_cluster
    assert evaluate("sum(reqs) by (cluster)", reqs, 0.0) == by_cluster
    assert evaluate("sum without (role, job) (reqs)", reqs, 0.0) == by_cluster
    assert evaluate("sum(reqs) without (cluster)", reqs, 0.0) == {
        (("job", "router"), ("role", "decode")): 10.0, (("job", "router"), ("role", "prefill")): 5.0}
    assert evaluate("sum(reqs)", reqs, 0.0) == {(): 15.0}
    assert evaluate("avg(reqs)", reqs, 0.0) == {(): 3.75}
    assert evaluate("max by (role) (reqs)", reqs, 0.0) == {(("role", "decode"),): 8.0, (("role", "prefill"),): 4.0}
    assert evaluate("min(reqs)", reqs, 0.0) == {(): 1.0}


def test_vector_scalar_arithmetic_drops_the_name_and_keeps_precedence(reqs):
    assert evaluate('reqs{cluster="a",role="decode"} * 2 + 1', reqs, 0.0) == {
        (("cluster", "a"), ("job", "router"), ("role", "decode")): 5.0}
    assert evaluate('1 + 2 * reqs{cluster="a",role="decode"}', reqs, 0.0) == {
        (("cluster", "a"), ("job", "router"), ("role", "decode")): 5.0}
    assert evaluate('(1 + 2) * -reqs{cluster="a",role="decode"}', reqs, 0.0) == {
        (("cluster", "a"), ("job", "router"), ("role", "decode")): -6.0}
    assert evaluate("2 * (3 - 1) / 4", reqs, 0.0) == {(): 1.0}
    assert evaluate("10 - 2 - 3", reqs, 0.0) == {(): 5.0}  # left-associative


def test_vector_vector_arithmetic_matches_one_to_one(reqs):
    share = evaluate("sum by (cluster) (reqs) / sum by (cluster) (reqs{role=\"decode\"})", reqs, 0.0)
    assert share == {(("cluster", "a"),): 1.5, (("cluster", "b"),): 1.5}
    # unmatched series drop out; a division by zero is +Inf as in Prometheus
    zero = evaluate('sum by (cluster) (reqs) / (sum by (cluster) (reqs{cluster="a"}) * 0)', reqs, 0.0)
    assert zero == {(("cluster", "a"),): math.inf}
    assert evaluate("sum(reqs) / sum(reqs{role=\"prefill\"})", reqs, 0.0) == {(): 3.0}


# --------------------------------------------------------------------------- parsing


def test_metric_names_come_from_the_parse():
    expr = "histogram_quantile(0.9, sum by (le) (rate(prfaas_router_ttft_seconds_bucket[1m])))"
    assert metric_names(expr) == {"prfaas_router_ttft_seconds_bucket"}
    assert metric_names('sum(rate(a_total{x=~"sum|rate"}[5m])) / sum(b) + 1') == {"a_total", "b"}
    assert metric_names("sglang:num_running_reqs * 2") == {"sglang:num_running_reqs"}


@pytest.mark.parametrize("expr, message", [
    ("topk(3, x)", "unsupported aggregation 'topk'"),
    ("x offset 5m", "unsupported modifier 'offset'"),
    ("rate(x[5m] offset 1m)", "unsupported modifier 'offset'"),
    ("count(x)", "unsupported aggregation 'count'"),
    ("abs(x)", "unsupported function 'abs'"),
    ("x > 1", "unsupported binary operator '>'"),
    ("x and y", "unsupported binary operator 'and'"),
    ("x / on(a) y", "unsupported vector matching modifier 'on'"),
    ("x[5m]", "range selector"),
    ("rate(x)", "needs a range selector"),
    ("rate(x[5m:1m])", "subquery"),
    ('{job="a"}', "without a metric name"),
    ("sum(x", "expected ')'"),
    ("sum(x) y", "unexpected 'y'"),
    ('x{a=~"("}', "bad regex"),
    ("", "empty"),
])
def test_unsupported_or_malformed_expressions_raise_promql_error(expr, message):
    with pytest.raises(PromQLError, match=re.escape(message)):
        evaluate(expr, Store(), 0.0)
    assert issubclass(PromQLError, ValueError)


def test_type_errors_do_not_depend_on_data():
    with pytest.raises(PromQLError, match="instant vector"):
        evaluate("sum(1)", Store(), 0.0)
    with pytest.raises(PromQLError, match="scalar quantile"):
        evaluate("histogram_quantile(x, y)", Store(), 0.0)


def test_promql_lite_is_pure():
    tree = ast.parse((REPO_ROOT / "prfaas_sglang" / "bench" / "promql_lite.py").read_text())
    imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(tree)
                 if isinstance(node, ast.ImportFrom) and node.module}
    assert imported <= {"__future__", "bisect", "collections", "dataclasses", "itertools", "math", "re"}


# --------------------------------------------------------------------------- the dashboard


def test_format_value_knows_the_common_grafana_units():
    assert format_value(0.25, "s") == "250 ms"
    assert format_value(1536, "bytes") == "1.5 KiB"
    assert format_value(0.5, "percentunit") == "50%"
    assert format_value(12000, "reqps") == "12 k req/s"


def test_render_dashboard_writes_a_png_with_a_no_data_panel(tmp_path):
    store = Store()
    for t_s in range(0, 60, 5):
        text = (f'prfaas_router_requests_total{{cluster="prfaas"}} {t_s * 2}\n'
                f'prfaas_router_requests_total{{cluster="pd"}} {t_s * 3}\n')
        store.add(float(t_s), parse_exposition(text), {"job": "router", "instance": "127.0.0.1:8000"})
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
    render_dashboard(dashboard, store, [float(t) for t in range(0, 60, 5)], out)
    data = out.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 10_000
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert width == 2000 and height > 300


def test_render_dashboard_names_the_panel_of_an_unsupported_query(tmp_path):
    dashboard = {"title": "t", "panels": [{"type": "timeseries", "title": "Top", "gridPos": {"x": 0, "y": 0, "w": 24, "h": 6},
                                          "targets": [{"expr": "topk(3, x)"}]}]}
    with pytest.raises(PromQLError, match="panel 'Top'.*topk"):
        render_dashboard(dashboard, Store(), [0.0], tmp_path / "strict.png")
    render_dashboard(dashboard, Store(), [0.0], tmp_path / "lenient.png", strict=False)
    assert (tmp_path / "lenient.png").stat().st_size > 0
