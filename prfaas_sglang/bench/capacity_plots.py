"""Attainment against offered load, one PNG per condition (or piece of one) of a ``bench compare --capacity`` result
(matplotlib and SciPy, imported lazily; writes files).

Every row is a line through what it was measured at (the bisection's probes and the interval's load grid,
each point its pooled attainment over every seed), with a band of each point's 95% Wilson interval over its
arrivals; the 90% target is drawn across, and where the row has a grid estimate its capacity sits on that
line with its interval as an error bar. A reader sees the crossings, not a table to reconstruct them from.
"""

from __future__ import annotations

import re
from pathlib import Path

from prfaas_sglang.bench.slo import row_points, wilson_band
from prfaas_sglang.errors import ConfigError
from prfaas_sglang.plan.plots import pyplot

TARGET = 0.9


def write_attainment_plots(result: dict, out_dir: Path) -> list[Path]:
    """One ``attainment-<condition>.png`` per condition of ``result`` (a run's or a merge's document) in ``out_dir``;
    ``attainment-<condition>-<families>.png`` per piece of a condition run in pieces."""
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
            try:
                bands = [wilson_band(att, n) for _, att, n in points]
            except ImportError as err:
                raise ConfigError("--plot", "needs scipy (pip install 'prfaas-sglang[fleet]')") from err
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
        name = cond["condition"] + (f"-{cond['piece'].split(';')[0]}" if cond.get("piece") else "")  # a piece: its families
        path = out_dir / f"attainment-{re.sub(r'[^A-Za-z0-9.-]+', '_', name)}.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        paths.append(path)
    return paths
