"""What a simulation run comes to: goodput under the SLOs, latency percentiles, offload, egress,
per-stage utilisation; and the time-series plots."""

from __future__ import annotations

from pathlib import Path

from prfaas_sglang.router.policy import PRFAAS
from prfaas_sglang.sim.fleet import Simulation
from prfaas_sglang.stats import percentile


def meets_slo(req, ttft_slo_s: float, slo_tokens_per_s: float) -> bool:
    """Finished, first token within the TTFT SLO, and decoded at the SLO's rate or better."""
    if req.finish_s is None or req.ttft_s is None or req.ttft_s > ttft_slo_s:
        return False
    return req.tbt_s is None or req.tbt_s <= 1.0 / slo_tokens_per_s


def summarize(sim: Simulation, start_s: float, end_s: float) -> dict:
    """Requests that *arrived* in ``[start_s, end_s)``; goodput = those meeting both SLOs per second."""
    rt = sim.targets
    window = [r for r in sim.requests if start_s <= r.arrival_s < end_s]
    done = [r for r in window if r.finish_s is not None]
    good = [r for r in done if meets_slo(r, rt.ttft_slo_s, rt.slo_tokens_per_s)]
    rejected = sum(r.rejected is not None for r in window)
    routed = [r for r in window if r.cluster is not None]
    ttft = [r.ttft_s for r in done]
    tbt = [r.tbt_s for r in done if r.tbt_s is not None]
    span = end_s - start_s
    egress = [s["egress_gbps"] for s in sim.series if start_s <= s["t_s"] < end_s]
    busy = {}
    for stage in ("prfaas", "pd-prefill", "pd-decode"):
        values = [s["busy"][stage] for s in sim.series if start_s <= s["t_s"] < end_s and stage in s["busy"]]
        busy[stage] = sum(values) / len(values) if values else None

    def pct(values, q):
        return round(percentile(values, q / 100), 3) if values else None

    return {
        "window_s": [start_s, end_s], "arrived": len(window), "finished": len(done),
        "rejected": rejected,
        "unfinished": len(window) - len(done) - rejected,
        "offered_rps": len(window) / span, "throughput_rps": len(done) / span, "goodput_rps": len(good) / span,
        "slo_attainment": len(good) / len(window) if window else None,
        "ttft_s": {"p50": pct(ttft, 50), "p90": pct(ttft, 90), "p99": pct(ttft, 99)},
        "tbt_ms": {f"p{q}": (round(1e3 * percentile(tbt, q / 100), 2) if tbt else None) for q in (50, 90, 99)},
        "offload_fraction": sum(r.cluster == PRFAAS for r in routed) / len(routed) if routed else None,
        "egress_gbps_mean": sum(egress) / len(egress) if egress else 0.0,
        "utilisation": busy,
        "conversions": [e for e in sim.events if start_s <= e[0] < end_s and e[1].startswith("convert")],
    }


def plot(sim: Simulation, out_dir: Path) -> list[Path]:
    """Time series: each link's t and the split, egress and each link's capacity, stage utilisation; PNGs
    in ``out_dir``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    ts = [s["t_s"] / 60 for s in sim.series]
    fig, axes = plt.subplots(3, 1, figsize=(9, 9), sharex=True)
    ax = axes[0]
    for link in sim.series[0]["links"] if sim.series else ():
        ax.plot(ts, [s["links"][link]["threshold_tokens"] / 1e3 for s in sim.series], label=f"t (K tokens), {link}")
    ax2 = ax.twinx()
    ax2.step(ts, [s["n_prefill"] for s in sim.series], where="post", color="tab:red", label="PD-P nodes")
    ax2.step(ts, [s["n_decode"] for s in sim.series], where="post", color="tab:green", label="PD-D nodes")
    ax.set_ylabel("t (K tokens)")
    ax2.set_ylabel("nodes")
    ax.legend(loc="upper left")
    ax2.legend(loc="upper right")
    ax = axes[1]
    ax.plot(ts, [s["egress_gbps"] for s in sim.series], label="egress Gbit/s (every link)")
    for link in sim.series[0]["links"] if sim.series else ():
        if sim.series[0]["links"][link]["link_capacity_gbps"] is not None:
            ax.plot(ts, [s["links"][link]["link_capacity_gbps"] for s in sim.series], label=f"capacity {link}", linestyle="--")
            ax.plot(ts, [s["links"][link]["capacity_est_gbps"] for s in sim.series], label=f"router's estimate {link}",
                    linestyle=":")
    ax.set_ylabel("Gbit/s")
    ax.legend(loc="upper left")
    ax = axes[2]
    for stage in ("prfaas", "pd-prefill", "pd-decode"):
        ax.plot(ts, [s["busy"].get(stage, 0.0) for s in sim.series], label=stage)
    ax.set_ylabel("busy fraction")
    ax.set_xlabel("minutes")
    ax.legend(loc="upper left")
    fig.tight_layout()
    path = out_dir / "timeseries.png"
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return [path]
