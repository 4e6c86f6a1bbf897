"""Render a Grafana dashboard (its JSON model) to a PNG from range queries' results.

No Grafana: every target's ``expr`` goes to the caller's ``query_range`` (in ``bench
dashboard``, a real Prometheus's ``/api/v1/query_range``: :mod:`prfaas_sglang.bench.prometheus`),
which returns its series at the given times, and each panel is drawn
where its ``gridPos`` puts it on Grafana's 24-column grid. ``timeseries`` (and any
other panel type with targets) draws one line per series; ``stat``, ``gauge`` and
``bargauge`` show each series' last value over a faint sparkline; ``row`` panels are
section headings (a collapsed row's nested panels are drawn too); ``text`` panels
show their content. A panel whose queries return nothing says "no data".

Template variables: ``$__rate_interval``, ``$__interval`` become ``rate_interval``,
``$__range`` the span of the times, and a dashboard variable its current value
(``.*`` for "All"); ``$name``, ``${name}`` and ``[[name]]`` are all understood.

A query the source rejects (:class:`QueryError`) raises it again naming the panel,
unless ``strict=False``, which prints the error in the panel instead.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prfaas_sglang.bench.prometheus import QueryError

__all__ = ["QueryRange", "format_value", "render_dashboard"]

# An expression -> its series over the rendered times: each a label set and (time_s, value) points
# at some of those times (Prometheus's query_range over [times_s[0], times_s[-1]], step = their spacing).
QueryRange = Callable[[str], Sequence[tuple[Mapping[str, str], Sequence[tuple[float, float]]]]]
Labels = tuple[tuple[str, str], ...]

GRID_COLUMNS = 24
FIGURE_WIDTH_IN = 20.0
GRID_UNIT_IN = 0.42  # one gridPos row: Grafana's 30 px plus margin on a ~1900 px wide screen
HEADER_IN = 0.75
FOOTER_IN = 0.2
SIDE_MARGIN_IN = 0.15
PANEL_GAP_IN = 0.08
DPI = 100
MAX_LEGEND_ENTRIES = 12
STAT_TYPES = frozenset({"stat", "gauge", "bargauge"})

THEME = {
    "background": "#111217",
    "panel": "#181b1f",
    "border": "#2c3235",
    "text": "#d8d9da",
    "muted": "#8e8e8e",
    "grid": "#2c3235",
    "error": "#f2495c",
}
PALETTE = ("#73bf69", "#f2cc0c", "#8ab8ff", "#ff780a", "#f2495c", "#5794f2", "#b877d9",
           "#705da0", "#37872d", "#fade2a", "#ca95e5", "#ffb357")


@dataclass(frozen=True)
class _Line:
    legend: str
    values: list[float]


@dataclass(frozen=True)
class _Rect:
    """A rectangle in figure fractions."""

    left: float
    bottom: float
    width: float
    height: float


@dataclass(frozen=True)
class _Geometry:
    width_in: float
    height_in: float

    def cell(self, pos: Mapping[str, Any]) -> _Rect:
        """The rectangle of a gridPos, less half a gap on every side."""
        column_in = (self.width_in - 2 * SIDE_MARGIN_IN) / GRID_COLUMNS
        left_in = SIDE_MARGIN_IN + float(pos.get("x", 0)) * column_in + PANEL_GAP_IN / 2
        top_in = HEADER_IN + float(pos.get("y", 0)) * GRID_UNIT_IN + PANEL_GAP_IN / 2
        width_in = float(pos.get("w", 12)) * column_in - PANEL_GAP_IN
        height_in = float(pos.get("h", 8)) * GRID_UNIT_IN - PANEL_GAP_IN
        return _Rect(left_in / self.width_in, 1 - (top_in + height_in) / self.height_in,
                     width_in / self.width_in, height_in / self.height_in)

    def inset(self, rect: _Rect, left_in: float, right_in: float, top_in: float, bottom_in: float) -> _Rect:
        return _Rect(rect.left + left_in / self.width_in, rect.bottom + bottom_in / self.height_in,
                     max(rect.width - (left_in + right_in) / self.width_in, 0.01),
                     max(rect.height - (top_in + bottom_in) / self.height_in, 0.01))


def render_dashboard(dashboard: dict, query_range: QueryRange, times_s: list[float], out_path: str | Path, *,
                     strict: bool = True, rate_interval: str = "1m") -> list[str]:
    """Draw ``dashboard`` as it looks over ``times_s`` (evenly spaced, the clock of ``query_range``'s
    points) and save a PNG at ``out_path``. Returns the expressions that returned no series (their
    panels may say "no data")."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    panels = list(_flatten(dashboard.get("panels") or []))
    grid_rows = max((_bottom(p) for p in panels), default=1)
    geometry = _Geometry(FIGURE_WIDTH_IN, HEADER_IN + grid_rows * GRID_UNIT_IN + FOOTER_IN)
    figure = Figure(figsize=(geometry.width_in, geometry.height_in), dpi=DPI, facecolor=THEME["background"])
    FigureCanvasAgg(figure)
    _draw_header(figure, geometry, dashboard, times_s)
    variables = _variables(dashboard, times_s, rate_interval)
    empty: list[str] = []
    for panel in panels:
        _draw_panel(figure, geometry, panel, query_range, times_s, variables, strict, empty)
    figure.savefig(out_path, dpi=DPI, facecolor=THEME["background"], format="png")
    return empty


# --------------------------------------------------------------------------- the model


def _flatten(panels: list[dict]) -> Iterator[dict]:
    """Panels in drawing order; a collapsed row carries its panels inside it."""
    for panel in panels:
        yield panel
        if panel.get("type") == "row":
            yield from panel.get("panels") or []


def _bottom(panel: Mapping[str, Any]) -> float:
    pos = panel.get("gridPos") or {}
    return float(pos.get("y", 0)) + float(pos.get("h", 8))


def _variables(dashboard: Mapping[str, Any], times_s: list[float], rate_interval: str) -> dict[str, str]:
    span_s = max(int(times_s[-1] - times_s[0]), 1) if times_s else 1
    values = {"__rate_interval": rate_interval, "__interval": rate_interval, "__range": f"{span_s}s"}
    for variable in (dashboard.get("templating") or {}).get("list") or []:
        name = variable.get("name")
        if name:
            values[name] = _variable_value((variable.get("current") or {}).get("value"))
    return values


def _variable_value(current: Any) -> str:
    options = current if isinstance(current, list) else [current]
    if not options or any(o in (None, "$__all", "All") for o in options):
        return ".*"
    return "|".join(str(o) for o in options)


_VARIABLE_RE = re.compile(r"\$\{(\w+)(?::\w+)?\}|\[\[(\w+)\]\]|\$(\w+)")


def _substitute(expr: str, variables: Mapping[str, str]) -> str:
    def replace(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2) or match.group(3)
        return variables.get(name, match.group())

    return _VARIABLE_RE.sub(replace, expr)


def _panel_lines(panel: Mapping[str, Any], query_range: QueryRange, times_s: list[float],
                 variables: Mapping[str, str], empty: list[str]) -> list[_Line]:
    lines = []
    step_s = (times_s[-1] - times_s[0]) / (len(times_s) - 1) if len(times_s) > 1 else 1.0
    for target in panel.get("targets") or []:
        expr = target.get("expr")
        if not expr or target.get("hide"):
            continue
        expr = _substitute(expr, variables)
        try:
            result = query_range(expr)
        except QueryError as exc:
            raise QueryError(exc.expr, exc.error_type, f"panel {panel.get('title')!r}: {exc.message}") from exc
        if not result:
            empty.append(expr)
        columns: dict[Labels, list[float]] = {}
        for labels, points in result:
            column = columns.setdefault(tuple(sorted(labels.items())), [math.nan] * len(times_s))
            for t_s, value in points:
                index = round((t_s - times_s[0]) / step_s)
                if 0 <= index < len(times_s):
                    column[index] = value
        legend_format = target.get("legendFormat")
        lines.extend(_Line(_legend(legend_format, labels, expr), values) for labels, values in sorted(columns.items()))
    return lines


def _legend(legend_format: str | None, labels: Labels, expr: str) -> str:
    values = dict(labels)
    if legend_format and legend_format != "__auto":
        text = re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: values.get(m.group(1), ""), legend_format)
        if text.strip():
            return text
    name = values.pop("__name__", "")
    if not values:
        return name or expr
    return name + "{" + ", ".join(f'{k}="{v}"' for k, v in values.items()) + "}"


# --------------------------------------------------------------------------- units


def format_value(value: float, unit: str | None) -> str:
    """A value as Grafana would label it in ``unit`` (the common units; others as plain numbers)."""
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    unit = unit or "short"
    if unit == "percent":
        return f"{value:.3g}%"
    if unit == "percentunit":
        return f"{value * 100:.3g}%"
    if unit in ("s", "ms", "us", "µs", "ns"):
        return _seconds(value * {"s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}[unit])
    if unit in ("bytes", "binBps"):
        return _scaled(value, 1024, ("B", "KiB", "MiB", "GiB", "TiB")) + ("/s" if unit == "binBps" else "")
    if unit in ("decbytes", "Bps"):
        return _scaled(value, 1000, ("B", "kB", "MB", "GB", "TB")) + ("/s" if unit == "Bps" else "")
    if unit == "bps":
        return _scaled(value, 1000, ("b/s", "kb/s", "Mb/s", "Gb/s", "Tb/s"))
    suffix = {"reqps": " req/s", "rps": " req/s", "ops": " ops/s", "short": "", "none": ""}.get(unit, "")
    return _scaled(value, 1000, ("", "k", "M", "G", "T")) + suffix


def _seconds(value_s: float) -> str:
    magnitude = abs(value_s)
    if magnitude == 0 or magnitude >= 1:
        return f"{value_s:.3g} s"
    if magnitude >= 1e-3:
        return f"{value_s * 1e3:.3g} ms"
    if magnitude >= 1e-6:
        return f"{value_s * 1e6:.3g} µs"
    return f"{value_s * 1e9:.3g} ns"


def _scaled(value: float, base: float, suffixes: tuple[str, ...]) -> str:
    power = 0
    while power < len(suffixes) - 1 and abs(value) >= base ** (power + 1):
        power += 1
    return f"{value / base ** power:.3g}" + (f" {suffixes[power]}" if suffixes[power] else "")


# --------------------------------------------------------------------------- drawing


def _draw_header(figure: Any, geometry: _Geometry, dashboard: Mapping[str, Any], times_s: list[float]) -> None:
    top = 1 - 0.15 / geometry.height_in
    figure.text(SIDE_MARGIN_IN / geometry.width_in, top, str(dashboard.get("title") or "dashboard"),
                color=THEME["text"], fontsize=16, fontweight="bold", va="top")
    span_s = times_s[-1] - times_s[0] if times_s else 0.0
    figure.text(1 - SIDE_MARGIN_IN / geometry.width_in, top, f"{len(times_s)} points over {span_s:.0f} s",
                color=THEME["muted"], fontsize=10, va="top", ha="right")


def _draw_panel(figure: Any, geometry: _Geometry, panel: Mapping[str, Any], query_range: QueryRange,
                times_s: list[float], variables: Mapping[str, str], strict: bool, empty: list[str]) -> None:
    rect = geometry.cell(panel.get("gridPos") or {})
    title = str(panel.get("title") or "")
    kind = panel.get("type")
    if kind == "row":
        figure.text(rect.left, rect.bottom + rect.height / 2, title, color=THEME["text"], fontsize=13,
                    fontweight="bold", va="center")
        return
    _draw_card(figure, geometry, rect, title)
    body = geometry.inset(rect, 0.1, 0.1, 0.38, 0.1)
    if kind == "text":
        _draw_message(figure, body, _text_content(panel), THEME["muted"], fontsize=9)
        return
    try:
        lines = _panel_lines(panel, query_range, times_s, variables, empty)
    except QueryError as exc:
        if strict:
            raise
        _draw_message(figure, body, str(exc), THEME["error"], fontsize=8)
        return
    if not any(not math.isnan(v) for line in lines for v in line.values):
        _draw_message(figure, body, "no data", THEME["muted"], fontsize=12)
        return
    unit = ((panel.get("fieldConfig") or {}).get("defaults") or {}).get("unit")
    elapsed_s = [t - times_s[0] for t in times_s]
    if kind in STAT_TYPES:
        _draw_stat(figure, body, lines, elapsed_s, unit)
    else:
        _draw_timeseries(figure, geometry.inset(rect, 0.75, 0.15, 0.38, 0.3), lines, elapsed_s, unit)


def _draw_card(figure: Any, geometry: _Geometry, rect: _Rect, title: str) -> None:
    from matplotlib.patches import Rectangle

    figure.add_artist(Rectangle((rect.left, rect.bottom), rect.width, rect.height, transform=figure.transFigure,
                                facecolor=THEME["panel"], edgecolor=THEME["border"], linewidth=0.8, zorder=0))
    figure.text(rect.left + 0.1 / geometry.width_in, rect.bottom + rect.height - 0.08 / geometry.height_in, title,
                color=THEME["text"], fontsize=11, fontweight="bold", va="top", ha="left")


def _draw_message(figure: Any, body: _Rect, message: str, color: str, fontsize: float) -> None:
    figure.text(body.left + body.width / 2, body.bottom + body.height / 2, message, color=color,
                fontsize=fontsize, ha="center", va="center", wrap=True)


def _text_content(panel: Mapping[str, Any]) -> str:
    content = str((panel.get("options") or {}).get("content") or panel.get("content") or "")
    return "\n".join(content.strip().splitlines()[:8])


def _styled_axes(figure: Any, rect: _Rect) -> Any:
    axes = figure.add_axes((rect.left, rect.bottom, rect.width, rect.height), facecolor=THEME["panel"])
    for spine in axes.spines.values():
        spine.set_color(THEME["border"])
    axes.tick_params(colors=THEME["muted"], labelsize=9)
    return axes


def _draw_timeseries(figure: Any, rect: _Rect, lines: list[_Line], elapsed_s: list[float], unit: str | None) -> None:
    from matplotlib.ticker import FuncFormatter

    axes = _styled_axes(figure, rect)
    for index, line in enumerate(lines):
        axes.plot(elapsed_s, line.values, color=PALETTE[index % len(PALETTE)], linewidth=1.4,
                  label=line.legend if index < MAX_LEGEND_ENTRIES else None)
    axes.grid(True, color=THEME["grid"], linewidth=0.6, linestyle=":")
    axes.yaxis.set_major_formatter(FuncFormatter(lambda value, _pos: format_value(value, unit)))
    axes.set_xlabel("seconds since start", color=THEME["muted"], fontsize=8, labelpad=1)
    if elapsed_s[-1] > elapsed_s[0]:
        axes.set_xlim(elapsed_s[0], elapsed_s[-1])
    legend = axes.legend(loc="upper left", fontsize=8, frameon=True, ncol=1 if len(lines) <= 6 else 2,
                         facecolor=THEME["panel"], edgecolor=THEME["border"], labelcolor=THEME["text"],
                         framealpha=0.8, handlelength=1.2)
    if len(lines) > MAX_LEGEND_ENTRIES:
        legend.set_title(f"(first {MAX_LEGEND_ENTRIES} of {len(lines)})", prop={"size": 7})
        legend.get_title().set_color(THEME["muted"])


def _draw_stat(figure: Any, body: _Rect, lines: list[_Line], elapsed_s: list[float], unit: str | None) -> None:
    axes = _styled_axes(figure, body)
    axes.set_axis_off()
    shown = [(index, line, _last(line.values)) for index, line in enumerate(lines)
             if not math.isnan(_last(line.values))][:4]
    for index, line in enumerate(lines):
        axes.plot(elapsed_s, line.values, color=PALETTE[index % len(PALETTE)], linewidth=1.0, alpha=0.35)
    fontsize = 26 if len(shown) == 1 else 15
    for row, (index, line, value) in enumerate(shown):
        y = 1 - (row + 0.5) / len(shown)
        label = format_value(value, unit) if len(shown) == 1 else f"{line.legend}: {format_value(value, unit)}"
        axes.text(0.5, y, label, transform=axes.transAxes, ha="center", va="center", fontsize=fontsize,
                  fontweight="bold", color=PALETTE[index % len(PALETTE)])


def _last(values: list[float]) -> float:
    return next((v for v in reversed(values) if not math.isnan(v)), math.nan)
