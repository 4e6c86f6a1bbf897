"""PNG plots in the style of the paper's Figure 5 (matplotlib, imported lazily; writes files).

(a) throughput vs the PD split at the optimal threshold: Lambda_max, the
    producers (Theta_prfaas + Theta_pd_p) and the consumer (Theta_pd_d);
(b) the two producer curves vs the threshold at the optimal split:
    Theta_prfaas/p and Theta_pd_p/(1-p), their intersection, and Lambda_max.
"""

from __future__ import annotations

import math
from pathlib import Path

from prfaas_sglang.errors import ConfigError
from prfaas_sglang.plan.model import evaluate
from prfaas_sglang.plan.report import Plan


def pyplot():
    """matplotlib's ``pyplot`` on the Agg backend (files only); :class:`ConfigError` naming ``--plot`` without it."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:
        raise ConfigError("--plot", "needs matplotlib (pip install 'prfaas-sglang[plot]')") from err
    return plt


def write_plots(plan: Plan, out_dir: Path) -> list[Path]:
    plt = pyplot()
    out_dir.mkdir(parents=True, exist_ok=True)
    dep, workload, best = plan.scenario.deployment, plan.scenario.workload, plan.best
    split_at_best = workload.split(best.threshold_tokens)

    # (a) split sweep at the optimal threshold
    n_ps = list(range(0, dep.n_pd))
    points = [evaluate(dep, split_at_best, n_p, dep.n_pd - n_p) for n_p in n_ps]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(n_ps, [p.lambda_max_rps for p in points], "o-", label="Lambda_max")
    ax.plot(n_ps, [p.theta_prfaas_rps + p.theta_pd_prefill_rps for p in points], "s--", label="Theta_prfaas + Theta_pd-p (producers)")
    ax.plot(n_ps, [p.theta_pd_decode_rps for p in points], "^--", label="Theta_pd-d (consumer)")
    ax.axvline(best.n_prefill, color="grey", lw=0.8)
    ax.set_xticks(n_ps, [f"{n}P/{dep.n_pd - n}D" for n in n_ps], rotation=45)
    path_a = _finish(plt, fig, ax, "PD-cluster split", f"(a) split search at t = {best.threshold_tokens / 1000:.1f}K",
                     out_dir / "split_search.png")

    # (b) threshold sweep at the optimal split
    thresholds = plan.search.thresholds if plan.search else [best.threshold_tokens]
    curve_prfaas, curve_pdp, curve_lambda = [], [], []
    for t in thresholds:
        point = evaluate(dep, workload.split(t), best.n_prefill, best.n_decode)
        p = point.offload_fraction
        curve_prfaas.append(point.theta_prfaas_rps / p if p > 0 else math.nan)
        curve_pdp.append(point.theta_pd_prefill_rps / (1 - p) if p < 1 else math.nan)
        curve_lambda.append(point.lambda_max_rps)
    ks = [t / 1000 for t in thresholds]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(ks, curve_prfaas, label="Theta_prfaas / p")
    ax.plot(ks, curve_pdp, label="Theta_pd-p / (1 - p)")
    ax.plot(ks, curve_lambda, "k:", label="Lambda_max")
    ax.axvline(best.threshold_tokens / 1000, color="grey", lw=0.8)
    top = max(v for v in curve_lambda) * 3
    ax.set_ylim(0, top)
    path_b = _finish(plt, fig, ax, "threshold t (K tokens)", f"(b) threshold search at {best.n_prefill}P/{best.n_decode}D",
                     out_dir / "threshold_search.png")
    return [path_a, path_b]


def _finish(plt, fig, ax, xlabel: str, title: str, path: Path) -> Path:
    ax.set_xlabel(xlabel)
    ax.set_ylabel("requests/s")
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
