"""The Grafana dashboard for a PrfaaS deployment, built with Grafana's foundation SDK (PyPI
``grafana-foundation-sdk``, the ``k8s`` extra), pure.

:data:`PANELS` is the dashboard's content as data (title, unit, queries); :func:`build` turns it
into Grafana's JSON model. Every query reads metrics the router (``prfaas_router_*``), the
kv-index (``prfaas_kvindex_*``) or a worker (SGLang's ``sglang:*`` with ``--enable-metrics``,
the emulated engine's ``prfaas:*``) exports; ``tests/engine/test_k8s_e2e.py`` scrapes a running
emulated deployment to keep that true.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from prfaas_sglang.errors import ConfigError

DATASOURCE_VARIABLE = "datasource"


@dataclass(frozen=True)
class PanelSpec:
    title: str
    unit: str
    queries: tuple[tuple[str, str], ...]  # (PromQL, legend format)
    width: int = 8  # of Grafana's 24 columns
    description: str = ""


PANELS: tuple[tuple[str, tuple[PanelSpec, ...]], ...] = (
    ("Routing", (
        PanelSpec("Requests routed per cluster", "reqps",
                  (("sum by (cluster) (rate(prfaas_router_routed_total[1m]))", "{{cluster}}"),),
                  description="Where the router sent prefills: prfaas (offloaded) or pd (local)."),
        PanelSpec("Threshold t (uncached tokens)", "none",
                  (("max(prfaas_router_threshold_tokens)", "t"),
                   ("max(prfaas_router_baseline_threshold_tokens)", "planner's baseline")),
                  description="Requests whose uncached length is above t prefill in the PrfaaS cluster."),
        PanelSpec("Offload fraction", "percentunit",
                  (("max(prfaas_router_offload_fraction)", "offloaded"),)),
    )),
    ("Cross-cluster link", (
        PanelSpec("PrfaaS egress: utilisation", "percentunit",
                  (("max(prfaas_router_egress_utilization)", "busy fraction"),)),
        PanelSpec("PrfaaS egress: rate and capacity", "bps",
                  (("max(prfaas_router_egress_bps)", "egress"), ("max(prfaas_router_offered_bps)", "offered"),
                   ("max(prfaas_router_link_capacity_estimate_bps)", "capacity estimate"))),
        PanelSpec("KV bytes sent per worker", "Bps",
                  (("sum by (pod) (rate(prfaas:kv_bytes_sent_total[1m]))", "{{pod}}"),),
                  description="Emulated engines, and PrfaaS SGLang workers with --enable-metrics (our link "
                              "telemetry's count; SGLang's in-cluster Mooncake backend exports none)."),
        PanelSpec("KV writes per PrfaaS worker (sender)", "ops",
                  (("sum by (pod) (rate(prfaas:kv_writes_submitted_total[1m]))", "{{pod}} submitted"),
                   ("sum by (pod) (rate(prfaas:kv_writes_failed_total[1m]))", "{{pod}} failed"),
                   ("sum by (pod) (rate(prfaas:kv_writes_retried_total[1m]))", "{{pod}} retried")),
                  width=12, description="The kv-send hooks' asynchronous sender, on SGLang (--enable-metrics) and "
                                        "emulated workers alike."),
        PanelSpec("KV queued or in flight per PrfaaS worker", "bytes",
                  (("sum by (pod) (prfaas:kv_send_in_flight_bytes)", "{{pod}}"),), width=12,
                  description="Grows while the link carries less than the prefills produce."),
    )),
    ("Latency", (
        PanelSpec("TTFT", "s",
                  tuple((f"histogram_quantile({q}, sum by (le) (rate(prfaas_router_ttft_seconds_bucket[1m])))", f"p{p}")
                        for q, p in ((0.5, 50), (0.9, 90), (0.99, 99))), width=12),
        PanelSpec("TBT (time between tokens)", "s",
                  tuple((f"histogram_quantile({q}, sum by (le) (rate(prfaas_router_tbt_seconds_bucket[1m])))", f"p{p}")
                        for q, p in ((0.5, 50), (0.9, 90), (0.99, 99))), width=12),
    )),
    ("Failures and load", (
        PanelSpec("Rejected by cause", "reqps",
                  (("sum by (cause) (rate(prfaas_router_rejected_total[1m]))", "{{cause}}"),)),
        PanelSpec("Failed by cause", "reqps",
                  (("sum by (cause) (rate(prfaas_router_failed_total[1m]))", "{{cause}}"),
                   ("sum(rate(prfaas_router_redispatched_total[1m]))", "re-dispatched"))),
        PanelSpec("Queues (router's estimate)", "s",
                  (("max by (cluster) (prfaas_router_queue_seconds)", "{{cluster}}"),)),
        PanelSpec("Running requests per worker", "none",
                  (("sum by (pod) (sglang:num_running_reqs)", "{{pod}}"),)),
        PanelSpec("Waiting requests per worker", "none",
                  (("sum by (pod) (sglang:num_queue_reqs)", "{{pod}}"),)),
        PanelSpec("KV usage per worker", "percentunit",
                  (("max by (pod) (sglang:token_usage)", "{{pod}}"),)),
    )),
    ("KV index and workers", (
        PanelSpec("Blocks indexed per worker (kv-index)", "none",
                  (("max by (worker) (prfaas_kvindex_blocks)", "{{worker}}"),),
                  description="The kv-index service's view."),
        PanelSpec("Blocks indexed per worker (router)", "none",
                  (("max by (worker) (prfaas_router_kv_index_blocks)", "{{worker}}"),),
                  description="The index the router routes by (the same events, in process)."),
        PanelSpec("Workers healthy (router's view)", "none",
                  (("sum(prfaas_router_worker_healthy)", "healthy workers"),)),
    )),
)


def queries() -> list[str]:
    """Every PromQL expression the dashboard runs."""
    return [q for _, panels in PANELS for p in panels for q, _ in p.queries]


def build(title: str = "PrfaaS-PD") -> dict:
    """The dashboard as Grafana's JSON model (a ``${datasource}`` variable picks the Prometheus)."""
    try:
        from grafana_foundation_sdk.builders import dashboard as gd
        from grafana_foundation_sdk.builders import prometheus, timeseries
        from grafana_foundation_sdk.cog.encoder import JSONEncoder
        from grafana_foundation_sdk.models.dashboard import DataSourceRef
    except ImportError:
        raise ConfigError("--emit", "the dashboard needs grafana-foundation-sdk (pip install 'prfaas-sglang[k8s]')") from None
    source = DataSourceRef(type_val="prometheus", uid="${" + DATASOURCE_VARIABLE + "}")
    board = (gd.Dashboard(title).uid("prfaas-pd").tags(["prfaas", "sglang"]).refresh("30s").time("now-1h", "now")
             .with_variable(gd.DatasourceVariable(DATASOURCE_VARIABLE).label("Prometheus").type("prometheus")))
    for row, panels in PANELS:
        board = board.with_row(gd.Row(row))
        for spec in panels:
            panel = (timeseries.Panel().title(spec.title).description(spec.description).unit(spec.unit)
                     .datasource(source).span(spec.width).height(8))
            for i, (expr, legend) in enumerate(spec.queries):
                panel = panel.with_target(prometheus.Dataquery().expr(expr).legend_format(legend).ref_id("ABCDEFGH"[i]))
            board = board.with_panel(panel)
    return json.loads(json.dumps(board.build(), cls=JSONEncoder))


def build_json(title: str = "PrfaaS-PD") -> str:
    return json.dumps(build(title), indent=2, sort_keys=True) + "\n"
