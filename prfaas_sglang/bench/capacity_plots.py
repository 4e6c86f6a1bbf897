"""Attainment against offered load, one PNG per condition of a ``bench compare --capacity`` result
(matplotlib and SciPy, imported lazily; writes files).

Every row is a line through what it was measured at (the bisection's probes and the interval's load grid,
each point its pooled attainment over every seed), with a band of each point's 95% Wilson interval over its
arrivals; the 90% target is drawn across, and where the row has a grid estimate its capacity sits on that
line with its interval as an error bar. A reader sees the crossings, not a table to reconstruct them from.
"""

from __future__ import annotations

import re
from pathlib import Path

from prfaas_sglang.errors import ConfigError
from prfaas_sglang.plan.plots import pyplot

TARGET = 0.9


def row_points(row: dict) -> list[tuple[float, float, int]]:
    """(load, attainment, arrivals) of every measurement of one row, by load: the bisection's probes and the
    grid's loads (the grid's where both measured one load)."""
    points = {p["load_rps"]: (p["attainment"], p["arrivals"]) for p in row.get("probes", []) if p.get("arrivals")}
    points |= {g["load_rps"]: (g["attainment"], g["arrivals"]) for g in (row.get("interval") or {}).get("grid", [])}
    return [(load, att, n) for load, (att, n) in sorted(points.items())]


def wilson_band(attainment: float, arrivals: int) -> tuple[float, float]:
    """The 95% Wilson interval of an attainment measured over ``arrivals`` (SciPy, imported here)."""
    try:
        from scipy.stats import binomtest
    except ImportError as err:
        raise ConfigError("--plot", "needs scipy (pip install 'prfaas-sglang[fleet]')") from err
    band = binomtest(round(attainment * arrivals), arrivals).proportion_ci(0.95, method="wilson")
    return band.low, band.high


def write_attainment_plots(result: dict, out_dir: Path) -> list[Path]:
    """One ``attainment-<condition>.png`` per condition of ``result`` (a run's or a merge's document) in ``out_dir``."""
    plt = pyplot()
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for cond in result.get("conditions", [result]):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for name, row in cond["rows"].items():
            points = row_points(row)
            if not points:
                continue
            loads = [p[0] for p in points]
            bands = [wilson_band(att, n) for _, att, n in points]
            (line,) = ax.plot(loads, [p[1] for p in points], "o-", ms=3, label=name)
            ax.fill_between(loads, [b[0] for b in bands], [b[1] for b in bands], color=line.get_color(), alpha=0.15)
            interval = row.get("interval")
            if interval and interval.get("capacity"):
                ax.errorbar([interval["capacity"]], [TARGET], color=line.get_color(), capsize=4, fmt="D", ms=4,
                            xerr=[[interval["capacity"] - interval["low"]], [interval["high"] - interval["capacity"]]])
        ax.axhline(TARGET, color="grey", lw=0.8, ls="--")
        ax.set_xscale("log")
        ax.set_xlabel("offered load (req/s, emulated)")
        ax.set_ylabel("attainment (all arrivals)")
        ax.set_ylim(0, 1.02)
        ax.set_title(f"{cond['condition']}: TTFT SLO {cond.get('ttft_slo_s', 0):g} s, outputs "
                     f"{cond.get('setting', {}).get('output_tokens', '?')} tokens", fontsize=9)
        ax.legend(fontsize=7)
        fig.tight_layout()
        path = out_dir / f"attainment-{re.sub(r'[^A-Za-z0-9.-]+', '_', cond['condition'])}.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        paths.append(path)
    return paths
