"""Our counters in a real SGLang worker's ``/metrics`` (prometheus_client, SGLang's multiprocess mode).

SGLang with ``--enable-metrics`` sets ``PROMETHEUS_MULTIPROC_DIR`` before it starts its scheduler
processes, and its HTTP server's ``/metrics`` collects every process's values from that directory.
A :class:`ProcessMetrics` made in any of those processes therefore appears beside ``sglang:*``.
Its table says what to show, under the names the emulated engine's ``/metrics`` uses, so one
dashboard reads both.
"""

from __future__ import annotations

from collections.abc import Iterable

# (key in the values given to publish, metric name, "counter" | "gauge", help)
MetricTable = Iterable[tuple[str, str, str, str]]


class ProcessMetrics:
    """One process's metrics of ``table``, with fixed ``labels``. :meth:`publish` is called from one
    thread: it adds to each counter what grew since the previous call, and sets each gauge (summed
    over live processes). Made only where SGLang runs with ``--enable-metrics``."""

    def __init__(self, table: MetricTable, labels: dict[str, str]):
        from prometheus_client import Counter, Gauge

        names = sorted(labels)
        self._metrics = {}
        for key, name, kind, doc in table:
            if kind == "counter":  # prometheus_client adds the _total suffix itself
                metric = Counter(name.removesuffix("_total"), doc, names)
            elif kind == "gauge":
                metric = Gauge(name, doc, names, multiprocess_mode="livesum")
            else:
                raise ValueError(f"{name}: unknown metric type {kind!r}")
            self._metrics[key] = (kind, metric.labels(**labels))
        self._published: dict[str, float] = {}

    def publish(self, values: dict[str, float]) -> None:
        for key, (kind, metric) in self._metrics.items():
            value = values[key]
            if kind == "gauge":
                metric.set(value)
            elif (grown := value - self._published.get(key, 0)) > 0:
                metric.inc(grown)
            self._published[key] = value


def worker_labels(server_args) -> dict[str, str]:
    """The labels SGLang's own metrics carry that a dashboard groups by: the served model."""
    return {"model_name": str(getattr(server_args, "served_model_name", None) or getattr(server_args, "model_path", ""))}
