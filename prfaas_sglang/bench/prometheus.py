"""A Prometheus server of our own, for the dashboard's queries: start, wait, query, stop (I/O).

Contract. :meth:`Prometheus.start` writes a scrape config for the given targets (one job per
``job``, each target labelled ``pod``, ``/metrics`` every ``scrape_interval_s``) and an empty TSDB
directory under ``work_dir``, starts the ``prometheus`` binary (Debian's 2.42, installed by
``scripts/setup-env.sh``) on a free loopback port through a
:class:`~prfaas_sglang.demo.cluster.ProcessGroup` of its own (its log: ``work_dir/prometheus.log``),
and returns once ``/-/ready`` answers 200. Nothing depends on a system Prometheus service; every
instance is its own process with its own port, config and storage, stopped by :meth:`stop`.

Prometheus 2.42 hands static targets to its scrapers on a 5 s discovery tick, so the first scrape
lands about 5 s after the start: start it early (before the processes it scrapes are healthy; a
target that is not up yet is just retried) and wait for data with :meth:`wait_scraped`, not sleeps.

Queries go through the HTTP API (``/api/v1/query``, ``/api/v1/query_range``). A query Prometheus
rejects (its syntax or types: HTTP 400 ``bad_data``, 422 ``execution``) raises :class:`QueryError`;
an accepted query that selects nothing returns ``[]`` (:meth:`require_data` makes that an error).
"""

from __future__ import annotations

import json
import math
import shutil
import time
import urllib.parse
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from prfaas_sglang.adapters import http_sync
from prfaas_sglang.demo.cluster import PortPicker, ProcessGroup, StartupError
from prfaas_sglang.errors import PrfaasError

__all__ = ["NoDataError", "Prometheus", "PrometheusError", "QueryError", "ScrapeTarget", "Series", "scrape_config"]

BINARY = "prometheus"
START_ATTEMPTS = 3  # a picked port another process bound first: pick another
POLL_S = 0.1


class PrometheusError(PrfaasError):
    """Prometheus is missing, did not start, is unreachable, or a target it scrapes is down."""


class QueryError(PrometheusError):
    """Prometheus rejected ``expr``: ``error_type`` is its API's (``bad_data`` for a parse error)."""

    def __init__(self, expr: str, error_type: str, message: str):
        self.expr, self.error_type, self.message = expr, error_type, message
        super().__init__(f"{expr!r}: {error_type}: {message}")


class NoDataError(PrometheusError):
    """Queries Prometheus accepted that returned no series (a metric nothing exports, a wrong label)."""

    def __init__(self, exprs: list[str]):
        self.exprs = exprs
        super().__init__(f"{len(exprs)} queries returned no series: " + "; ".join(exprs))


@dataclass(frozen=True)
class ScrapeTarget:
    """A process whose ``{url}/metrics`` Prometheus scrapes, labelled ``job`` and ``pod``."""

    job: str
    pod: str
    url: str  # http://host:port


class Series(NamedTuple):
    """One series of a result: its labels (``__name__`` where Prometheus keeps it) and ``(unix_s, value)`` points."""

    labels: dict[str, str]
    points: list[tuple[float, float]]


def _duration(seconds: float) -> str:
    milliseconds = round(seconds * 1000)
    if milliseconds < 1:
        raise ValueError(f"a Prometheus duration must be >= 1 ms, got {seconds!r} s")
    return f"{milliseconds}ms"


def scrape_config(targets: Iterable[ScrapeTarget], scrape_interval_s: float) -> dict:
    """The Prometheus config (pure): one scrape job per distinct ``job``, every target with its ``pod``
    label, interval = timeout = evaluation interval = ``scrape_interval_s``."""
    jobs: dict[str, list[dict]] = {}
    for target in targets:
        address = urllib.parse.urlsplit(target.url).netloc
        if not address:
            raise ValueError(f"target {target.pod!r}: {target.url!r} is not an http://host:port URL")
        jobs.setdefault(target.job, []).append({"targets": [address], "labels": {"pod": target.pod}})
    interval = _duration(scrape_interval_s)
    return {"global": {"scrape_interval": interval, "scrape_timeout": interval, "evaluation_interval": interval},
            "scrape_configs": [{"job_name": job, "metrics_path": "/metrics", "static_configs": static}
                               for job, static in sorted(jobs.items())]}


class Prometheus:
    """A running Prometheus (see the module's contract). Use as a context manager, or call :meth:`stop`."""

    def __init__(self, url: str, group: ProcessGroup, targets: tuple[ScrapeTarget, ...], scrape_interval_s: float):
        self.url, self.group, self.targets, self.scrape_interval_s = url, group, targets, scrape_interval_s

    @classmethod
    def start(cls, targets: Iterable[ScrapeTarget], work_dir: Path, *, scrape_interval_s: float = 1.0,
              binary: str = BINARY, timeout_s: float = 30.0, avoid_ports: Iterable[int] = ()) -> Prometheus:
        """Start a Prometheus scraping ``targets``, its config, storage and log under ``work_dir``; return once ready.
        Its port is none of the targets' and none of ``avoid_ports`` (ports picked for servers not yet started:
        a Prometheus started first took one of them, and that server could not bind it).

        Raises :class:`PrometheusError` when ``binary`` is not on PATH or does not become ready."""
        targets = tuple(targets)
        pick = PortPicker(taken={*avoid_ports, *(urllib.parse.urlsplit(t.url).port for t in targets)})
        path = shutil.which(binary)
        if path is None:
            raise PrometheusError(f"{binary!r} is not on PATH: scripts/setup-env.sh installs Debian's "
                                  "(apt-get install prometheus)")
        work_dir.mkdir(parents=True, exist_ok=True)
        config = work_dir / "prometheus.yml"
        config.write_text(json.dumps(scrape_config(targets, scrape_interval_s), indent=1))  # JSON is YAML
        group = ProcessGroup(work_dir)
        for attempt in range(START_ATTEMPTS):
            port = pick()
            storage = work_dir / f"data-{attempt}"
            proc = group.start("prometheus", [path, f"--config.file={config}", f"--storage.tsdb.path={storage}",
                                              f"--web.listen-address=127.0.0.1:{port}"])
            url = f"http://127.0.0.1:{port}"
            try:
                group.wait_healthy(url + "/-/ready", proc, timeout_s=timeout_s)
            except StartupError as exc:
                group.stop()
                group.procs.clear()
                if attempt + 1 < START_ATTEMPTS and "address already in use" in _tail(work_dir / "prometheus.log"):
                    continue
                raise PrometheusError(f"prometheus did not start ({exc}); log: {work_dir / 'prometheus.log'}") from exc
            return cls(url, group, targets, scrape_interval_s)
        raise AssertionError("unreachable")

    def stop(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL after the group's grace); its files stay in ``work_dir``."""
        self.group.stop()

    def __enter__(self) -> Prometheus:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    # ------------------------------------------------------------------ the HTTP API

    def _get(self, path: str, params: dict[str, str], expr: str | None = None) -> dict:
        url = f"{self.url}{path}?{urllib.parse.urlencode(params)}"
        try:
            answer = http_sync.get(url, timeout_s=30)
            body = answer.json()
        except http_sync.HttpError as exc:  # no answer, or a body that is not JSON
            raise PrometheusError(str(exc)) from exc
        if not answer.ok or body.get("status") != "success":  # 400 bad_data, 422 execution, 503 timeout
            if expr is not None:
                raise QueryError(expr, str(body.get("errorType")), str(body.get("error")))
            raise PrometheusError(f"{url}: HTTP {answer.status}: {body.get('error')}")
        return body["data"]

    def query(self, expr: str, at_unix_s: float | None = None) -> list[Series]:
        """``expr`` evaluated at ``at_unix_s`` (now when None): one single-point :class:`Series` per
        element of the vector (a scalar: one series without labels). Raises :class:`QueryError` if rejected."""
        data = self._get("/api/v1/query", {"query": expr, "time": f"{time.time() if at_unix_s is None else at_unix_s:.3f}"},
                         expr)
        if data["resultType"] in ("scalar", "string"):
            t_s, value = data["result"]
            return [Series({}, [(float(t_s), float(value))])]
        return [Series(r["metric"], [(float(r["value"][0]), float(r["value"][1]))]) for r in data["result"]]

    def query_range(self, expr: str, start_unix_s: float, end_unix_s: float, step_s: float) -> list[Series]:
        """``expr`` evaluated at ``start + k * step`` up to ``end``: one :class:`Series` per series, with the
        points where it has a value. Raises :class:`QueryError` if rejected."""
        data = self._get("/api/v1/query_range", {"query": expr, "start": f"{start_unix_s:.3f}", "end": f"{end_unix_s:.3f}",
                                                 "step": f"{step_s:g}"}, expr)
        return [Series(r["metric"], [(float(t_s), float(v)) for t_s, v in r["values"]]) for r in data["result"]]

    def require_data(self, exprs: Iterable[str], at_unix_s: float | None = None) -> dict[str, list[Series]]:
        """Every expression's instant result; raises :class:`QueryError` for the first one Prometheus
        rejects, then :class:`NoDataError` naming every one that returned no series."""
        results = {expr: self.query(expr, at_unix_s) for expr in exprs}
        empty = [expr for expr, result in results.items() if not result]
        if empty:
            raise NoDataError(empty)
        return results

    def wait_scraped(self, since_unix_s: float, scrapes: int = 1, timeout_s: float = 30.0) -> None:
        """Return once every target has been scraped successfully at least ``scrapes`` times after
        ``since_unix_s`` and its latest scrape succeeded. ``scrapes=2`` leaves two samples of every series the
        targets exported at ``since_unix_s``: enough for ``rate``. A scrape that failed before the target
        came up (refused while it starts) does not count. Raises :class:`PrometheusError` naming a target whose
        latest scrape failed after it had been up (with Prometheus's error), or after ``timeout_s`` naming the
        targets short of their scrapes and their last errors."""
        wanted = {(t.job, t.pod) for t in self.targets}
        deadline = time.monotonic() + timeout_s
        counts: dict[tuple[str, str], float] = {}
        while True:
            window_ms = math.ceil((time.time() - since_unix_s) * 1000)
            if window_ms > 0:  # up is 1 for a scrape that succeeded, 0 for one that failed: the sum counts the former
                counts = {(s.labels.get("job", ""), s.labels.get("pod", "")): s.points[0][1]
                          for s in self.query(f"sum_over_time(up[{window_ms}ms])")}
                if all(counts.get(key, 0) >= scrapes for key in wanted):
                    break
            if time.monotonic() > deadline:
                missing = sorted(f"{job}/{pod}: {counts.get((job, pod), 0):g}" for job, pod in wanted
                                 if counts.get((job, pod), 0) < scrapes)
                raise PrometheusError(f"not every target scraped {scrapes}x within {timeout_s:g} s: {missing}"
                                      + "".join(f"; {d}" for d in self._down()))
            time.sleep(POLL_S)
        if down := self._down():
            raise PrometheusError("targets down: " + "; ".join(down))

    def _down(self) -> list[str]:
        """Each target whose latest scrape failed: its pod, URL and Prometheus's error."""
        return [f"{t['labels'].get('pod')} ({t['scrapeUrl']}): {t['lastError']}"
                for t in self._get("/api/v1/targets", {"state": "active"})["activeTargets"] if t["health"] != "up"]


def _tail(path: Path, chars: int = 4000) -> str:
    try:
        return path.read_text()[-chars:]
    except OSError:
        return ""
