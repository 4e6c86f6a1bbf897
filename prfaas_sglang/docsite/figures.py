"""The site's pictures that are drawn from data, never by hand.

    architecture.svg   a topology file's clusters, their nodes by role, and the links between them
                       (``launch/multi-cluster.yaml``: two PrfaaS sites, two PD regions, one control
                       plane), laid out as the request path runs: control on top, PrfaaS left, PD right
    kv-efficiency.svg  the KV transport's goodput over the shaped rate against the link's rate, ours and
                       SGLang's own Mooncake settings, clean and lossy: recorded ``bench transport --json``
                       documents (``docs/benchmarks/data/transport-*.json``)
    attainment-*.svg   per capacity condition, each row's attainment against offered load with each
                       point's 95% interval and the 90% target: recorded capacity documents
                       (``docs/benchmarks/data/capacity-*.json``, ``bench compare --capacity --json``'s shape)

Pure: a :class:`Topology` in, SVG text out (deterministic, so the committed figure is checked like a
generated page). ``docs/dashboard.png`` is drawn by ``python -m prfaas_sglang.bench dashboard`` from a
live run's metrics.
"""

from __future__ import annotations

import math
from html import escape

from prfaas_sglang.topology import Topology

NODE_W, NODE_H, GAP, PAD, TITLE_H = 150, 26, 6, 12, 34
COLUMN_GAP, ROW_GAP = 260, 60
ROLE_FILL = {"prfaas": "#f4b183", "pd-prefill": "#9dc3e6", "pd-decode": "#a9d18e", "router": "#d9d9d9",
             "kv-index": "#d9d9d9", "single": "#d9d9d9"}
KIND_TITLE = {"prfaas": "PrfaaS cluster", "pd": "PD cluster", "control": "control plane"}


def _box(x: float, y: float, w: float, h: float, fill: str, rx: int = 6, stroke: str = "#404040") -> str:
    return f'<rect x="{x:.0f}" y="{y:.0f}" width="{w:.0f}" height="{h:.0f}" rx="{rx}" fill="{fill}" stroke="{stroke}"/>'


def _text(x: float, y: float, text: str, size: int = 12, weight: str = "normal", anchor: str = "middle") -> str:
    return (f'<text x="{x:.0f}" y="{y:.0f}" font-family="sans-serif" font-size="{size}" font-weight="{weight}" '
            f'text-anchor="{anchor}">{escape(text)}</text>')


def architecture_svg(topology: Topology, title: str) -> str:
    """The topology as a picture: one box per cluster holding its nodes, a line per link labelled with its
    bandwidth and round-trip time (and ``encrypted`` / ``layer-wise`` when set)."""
    kinds = topology.cluster_kinds
    columns = {"prfaas": [c for c in kinds if kinds[c] == "prfaas"], "pd": [c for c in kinds if kinds[c] == "pd"]}
    nodes_of = {c: [n for n in topology.nodes if n.cluster == c] for c in kinds}

    def height(cluster: str) -> float:
        return TITLE_H + len(nodes_of[cluster]) * (NODE_H + GAP) + PAD

    control = [c for c in kinds if kinds[c] == "control"]
    top = 50 + max((height(c) for c in control), default=0) + (ROW_GAP if control else 0)
    boxes: dict[str, tuple[float, float, float, float]] = {}
    width = 2 * PAD + NODE_W
    for column, key in enumerate(("prfaas", "pd")):
        y = top
        for cluster in columns[key]:
            boxes[cluster] = (40 + column * (width + COLUMN_GAP), y, width, height(cluster))
            y += height(cluster) + ROW_GAP / 2
    total_w = 80 + 2 * width + COLUMN_GAP
    for cluster in control:
        boxes[cluster] = ((total_w - width) / 2, 50, width, height(cluster))
    total_h = max(y + h for _, y, _, h in boxes.values()) + 30

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{total_w:.0f}" height="{total_h:.0f}" '
           f'viewBox="0 0 {total_w:.0f} {total_h:.0f}">', '<rect width="100%" height="100%" fill="white"/>',
           _text(total_w / 2, 28, title, 15, "bold")]
    for link in topology.links:  # under the boxes
        (x1, y1, w1, h1), (x2, y2, _, h2) = boxes[link.src], boxes[link.dst]
        ax, ay, bx, by = x1 + w1, y1 + h1 / 2, x2, y2 + h2 / 2
        out.append(f'<line x1="{ax:.0f}" y1="{ay:.0f}" x2="{bx:.0f}" y2="{by:.0f}" stroke="#c55a11" stroke-width="2"/>')
        label = f"{link.bandwidth_gbps:g} Gbps" + (f", {link.rtt_ms:g} ms" if link.rtt_ms is not None else "")
        flags = [f for f, on in (("encrypted", link.encrypt), ("layer-wise", link.layerwise)) if on]
        mx, my = ax + (bx - ax) * 0.35, ay + (by - ay) * 0.35
        out.append(_text(mx, my - 4, label + (f" ({', '.join(flags)})" if flags else ""), 11))
    for cluster, (x, y, w, h) in boxes.items():
        out.append(_box(x, y, w, h, "#f7f7f7", 10, "#808080"))
        out.append(_text(x + w / 2, y + 15, cluster, 12, "bold"))
        out.append(_text(x + w / 2, y + 28, KIND_TITLE[kinds[cluster]], 10))
        for i, node in enumerate(nodes_of[cluster]):
            ny = y + TITLE_H + i * (NODE_H + GAP)
            out.append(_box(x + PAD, ny, NODE_W, NODE_H, ROLE_FILL.get(node.role.value, "#ffffff"), 4))
            out.append(_text(x + PAD + NODE_W / 2, ny + 17, f"{node.name} ({node.role.value})", 10))
    out.append(_text(total_w / 2, total_h - 10, "KV crosses each PrfaaS-to-PD link over Ethernet (Mooncake TCP); "
                     "the router routes each request by its uncached length", 10))
    out.append("</svg>")
    return "\n".join(out) + "\n"


CHART_W, CHART_H, MARGIN_L, MARGIN_R, MARGIN_T, MARGIN_B = 640, 360, 64, 180, 40, 48
PALETTE = ("#c55a11", "#2e75b6", "#548235", "#7030a0", "#bf9000", "#404040", "#00a0a0", "#d03080")


def nice_step(span: float, max_ticks: int = 6) -> float:
    """The smallest of 1, 2, 2.5, 5 times a power of ten that cuts ``span`` into at most ``max_ticks`` intervals."""
    magnitude = 10 ** math.floor(math.log10(span / max_ticks)) if span > 0 else 1.0
    return next(m * magnitude for m in (1, 2, 2.5, 5, 10) if span / (m * magnitude) <= max_ticks + 1e-9)


def ticks(low: float, high: float) -> list[float]:
    step = nice_step(high - low)
    first = math.ceil(low / step - 1e-9)
    return [round(k * step, 9) for k in range(first, math.floor(high / step + 1e-9) + 1)]


def line_chart_svg(title: str, x_label: str, y_label: str, series: dict[str, list[tuple[float, float]]],
                   y_max: float = 1.0, dashed: tuple[str, ...] = (), y_min: float = 0.0,
                   bars: dict[str, list[tuple[float, float, float]]] | None = None,
                   guide: tuple[float, str] | None = None) -> str:
    """Each series as a polyline with its points marked, y from ``y_min`` to ``y_max``, x from 0 to the largest
    x; the legend to the right. ``dashed``: the series drawn dashed; ``bars``: per series, vertical error bars
    ``(x, low, high)`` in its colour; ``guide``: a grey dashed line across at that y, with its label."""
    xs = [x for points in series.values() for x, _ in points]
    x_max = max(xs, default=1.0) * 1.05
    plot_w, plot_h = CHART_W - MARGIN_L - MARGIN_R, CHART_H - MARGIN_T - MARGIN_B

    def px(x: float) -> float:
        return MARGIN_L + plot_w * x / x_max

    def py(y: float) -> float:
        return MARGIN_T + plot_h * (1 - (min(max(y, y_min), y_max) - y_min) / (y_max - y_min))

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{CHART_W}" height="{CHART_H}" viewBox="0 0 {CHART_W} {CHART_H}">',
           '<rect width="100%" height="100%" fill="white"/>', _text(CHART_W / 2, 22, title, 13, "bold"),
           f'<rect x="{MARGIN_L}" y="{MARGIN_T}" width="{plot_w}" height="{plot_h}" fill="none" stroke="#808080"/>']
    for y in ticks(y_min, y_max):
        out += [f'<line x1="{MARGIN_L}" y1="{py(y):.1f}" x2="{MARGIN_L + plot_w}" y2="{py(y):.1f}" stroke="#e0e0e0"/>',
                _text(MARGIN_L - 6, py(y) + 4, f"{y:g}", 10, anchor="end")]
    for x in ticks(0.0, x_max):
        out.append(_text(px(x), MARGIN_T + plot_h + 16, f"{x:g}", 10))
    if guide is not None:
        out += [f'<line x1="{MARGIN_L}" y1="{py(guide[0]):.1f}" x2="{MARGIN_L + plot_w}" y2="{py(guide[0]):.1f}" '
                f'stroke="#808080" stroke-dasharray="6,4"/>',
                _text(MARGIN_L + 4, py(guide[0]) + 13, guide[1], 10, anchor="start")]
    out += [_text(MARGIN_L + plot_w / 2, CHART_H - 10, x_label, 11),
            f'<text x="16" y="{MARGIN_T + plot_h / 2:.0f}" font-family="sans-serif" font-size="11" text-anchor="middle" '
            f'transform="rotate(-90 16 {MARGIN_T + plot_h / 2:.0f})">{escape(y_label)}</text>']
    for i, (name, points) in enumerate(series.items()):
        colour, dash = PALETTE[i % len(PALETTE)], ' stroke-dasharray="5,4"' if name in dashed else ""
        coords = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in sorted(points))
        out.append(f'<polyline points="{coords}" fill="none" stroke="{colour}" stroke-width="2"{dash}/>')
        out += [f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="3" fill="{colour}"/>' for x, y in points]
        out += [f'<line x1="{px(x):.1f}" y1="{py(lo):.1f}" x2="{px(x):.1f}" y2="{py(hi):.1f}" stroke="{colour}" '
                f'stroke-width="1" opacity="0.6"/>' for x, lo, hi in (bars or {}).get(name, ())]
        ly = MARGIN_T + 14 + 18 * i
        out += [f'<line x1="{CHART_W - MARGIN_R + 12}" y1="{ly - 4}" x2="{CHART_W - MARGIN_R + 36}" y2="{ly - 4}" '
                f'stroke="{colour}" stroke-width="2"{dash}/>', _text(CHART_W - MARGIN_R + 42, ly, name, 10, anchor="start")]
    out.append("</svg>")
    return "\n".join(out) + "\n"


def kv_efficiency_svg(documents: list[dict]) -> str:
    """Goodput over the shaped rate against the link's rate, from ``bench transport --json`` documents (their
    ``result``): ours and SGLang's own settings, per condition (clean, lossy, ...)."""
    series: dict[str, list[tuple[float, float]]] = {}
    for doc in sorted(documents, key=lambda d: d["result"]["rate_mbit"]):
        result = doc["result"]
        for cond in result["conditions"]:
            name = cond.get("condition") or cond.get("name")
            series.setdefault(f"ours, {name}", []).append((result["rate_mbit"], cond["goodput_fraction"]))
            series.setdefault(f"SGLang's settings, {name}", []).append((result["rate_mbit"], cond["default_goodput_fraction"]))
    payloads = sorted({d["result"]["payload_mib"] for d in documents})
    return line_chart_svg(f"KV transport over an emulated WAN link ({', '.join(map(str, payloads))} MiB transfers)",
                          "link rate (Mbit/s)", "goodput / shaped rate", series,
                          dashed=tuple(n for n in series if n.startswith("SGLang")))


TARGET = 0.9  # the share of all arrivals that must meet the SLO at a row's capacity


def attainment_svg(document: dict) -> str:
    """One capacity condition's rows (``document``: a ``bench compare --capacity --json`` result or a recorded
    one in its shape, its first condition): attainment against offered load through every measured point,
    each with its 95% Wilson interval over its arrivals, and the 90% target dashed across."""
    from prfaas_sglang.bench.slo import row_points, wilson_band

    cond = document.get("conditions", [document])[0]
    series: dict[str, list[tuple[float, float]]] = {}
    bars: dict[str, list[tuple[float, float, float]]] = {}
    for name, row in cond["rows"].items():
        label = name.split(" (")[0]
        points = row_points(row)
        series[label] = [(load, att) for load, att, _ in points]
        bars[label] = [(load, *wilson_band(att, n)) for load, att, n in points]
    lowest = min((lo for rows in bars.values() for _, lo, _ in rows), default=TARGET)
    y_min = min(int(lowest * 10) / 10, 0.8)
    return line_chart_svg(f"{cond['condition']}: {cond.get('link', '')}, TTFT SLO {cond.get('ttft_slo_s', 0):g} s",
                          f"offered load (req/s, emulated; {cond.get('setting', {}).get('output_tokens', '?')}-token outputs)",
                          "attainment (all arrivals)", series, y_min=y_min,
                          bars=bars, guide=(TARGET, "90% of arrivals within the SLO"))
