"""The PrfaaS-PD throughput model, paper section 3.4, equations (1)-(6) (pure).

Units: lengths in tokens, times in seconds, bytes in bytes, bandwidth in
bits/s, throughputs in requests/s. ``N_*`` count *instances* (one model
replica on ``gpus_per_instance`` GPUs), as ``T_prefill`` is per instance.

    (1) Phi_kv(l)     = S_kv(l) / T_prefill(l)                      profiles.PrefillProfile.phi_kv_bps
    (2) B_out         = N/P * Phi_kv(L_avg)                         required_egress_bps
    (3) Theta_prfaas  = min(N_prfaas / T_prefill(l_long), B_out / S_kv(l_long))
    (4) Theta_pd_p    = N_p / T_prefill(l_short)
    (5) Theta_pd_d    = N_d * BS_max / (T_decode * L_out)
    (6) Lambda_max    = min(Theta_prfaas / p, Theta_pd_p / (1 - p), Theta_pd_d)

A term whose share of requests is zero (p = 0 for PrfaaS, p = 1 for PD-P)
does not limit Lambda_max. A PD cluster fed by several PrfaaS clusters, a link
each (:func:`evaluate_pooled`): Theta_prfaas = sum_i Theta_prfaas_i in (6).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from prfaas_sglang.errors import ConfigError
from prfaas_sglang.plan.profiles import InstanceClass, PrefillProfile
from prfaas_sglang.plan.workload import Split

STAGES = ("prfaas-compute", "prfaas-bandwidth", "pd-prefill", "pd-decode")


@dataclass(frozen=True)
class Deployment:
    """Fixed hardware: a PrfaaS cluster, a local PD cluster (split searched), one link."""

    prfaas: InstanceClass
    n_prfaas: int
    pd: InstanceClass
    n_pd: int
    egress_bps: float  # B_out: the PrfaaS cluster's egress capacity
    output_tokens: float  # L_out

    def __post_init__(self):
        if self.n_prfaas < 0:
            raise ConfigError("prfaas.instances", f"must be >= 0, got {self.n_prfaas!r}")
        if self.n_pd < 1:
            raise ConfigError("pd.instances", f"must be >= 1, got {self.n_pd!r}")
        if not self.egress_bps > 0:
            raise ConfigError("link.egress_gbps", f"must be > 0, got {self.egress_bps / 1e9!r}")
        if not self.output_tokens > 0:
            raise ConfigError("workload.output_tokens", f"must be > 0, got {self.output_tokens!r}")
        if self.pd.decode is None:
            raise ConfigError("pd", "the PD instance class needs a decode profile")


@dataclass(frozen=True)
class OperatingPoint:
    threshold_tokens: float | None  # None: no threshold (a baseline)
    n_prefill: int
    n_decode: int
    offload_fraction: float
    mean_long_tokens: float | None
    mean_short_tokens: float | None
    prfaas_compute_rps: float  # N_prfaas / T_prefill(l_long)
    prfaas_bandwidth_rps: float  # B_out / S_kv(l_long)
    theta_prfaas_rps: float
    theta_pd_prefill_rps: float
    theta_pd_decode_rps: float
    lambda_max_rps: float
    binding_stage: str
    egress_gbps: float  # PrfaaS egress at Lambda_max: Lambda * p * S_kv(l_long)
    egress_utilization: float  # egress_gbps / B_out


def required_egress_bps(n_gpus: int, gpus_per_instance: int, profile: PrefillProfile, l_avg: float) -> float:
    """Equation (2): egress a fully busy N-GPU prefill cluster needs, bits/s."""
    return n_gpus / gpus_per_instance * profile.phi_kv_bps(l_avg)


def theta_prfaas(n: int, profile: PrefillProfile, l_long: float, egress_bps: float) -> tuple[float, float]:
    """Equation (3), as its two terms: (compute rate, bandwidth ceiling), requests/s."""
    compute = n / profile.prefill_s(l_long)
    kv_bits = 8.0 * profile.kv_bytes(l_long)
    bandwidth = egress_bps / kv_bits if kv_bits > 0 else math.inf
    return compute, bandwidth


def theta_pd_prefill(n_p: int, profile: PrefillProfile, l_short: float) -> float:
    """Equation (4)."""
    return n_p / profile.prefill_s(l_short)


def theta_pd_decode(n_d: int, pd: InstanceClass, output_tokens: float) -> float:
    """Equation (5)."""
    decode = pd.decode
    return n_d * decode.bs_max / (decode.step_s * output_tokens)


def evaluate(dep: Deployment, split: Split, n_prefill: int, n_decode: int) -> OperatingPoint:
    """Equation (6) at one (threshold, split) point."""
    p = split.offload_fraction
    if p > 0 and dep.n_prfaas > 0:
        compute, bandwidth = theta_prfaas(dep.n_prfaas, dep.prfaas.prefill, split.mean_long_tokens, dep.egress_bps)
    else:
        compute = bandwidth = 0.0
    kv_bytes = dep.prfaas.prefill.kv_bytes(split.mean_long_tokens) if p > 0 else 0.0
    return _operating_point(dep, split, n_prefill, n_decode, (compute, bandwidth, min(compute, bandwidth)), kv_bytes,
                            dep.egress_bps)


def evaluate_pooled(deps: Sequence[Deployment], split: Split, n_prefill: int, n_decode: int) -> OperatingPoint:
    """Equation (6) for one PD cluster fed by several PrfaaS clusters, each over its own link: ``deps`` holds
    one :class:`Deployment` per pair (the same PD cluster, split and ``L_out`` in each). A request longer
    than ``t`` may be prefilled on any of them, so ``Theta_prfaas`` is the sum of each pair's equation (3)
    and, at ``Lambda_max``, each carries the offload in proportion to its term: the fleet's linear program
    (``fleet_model.py``) for one PD cluster. The compute and bandwidth terms, and the links' capacities, add
    up alike. On one pair: :func:`evaluate`."""
    if len(deps) == 1:
        return evaluate(deps[0], split, n_prefill, n_decode)
    p = split.offload_fraction
    terms = [theta_prfaas(d.n_prfaas, d.prfaas.prefill, split.mean_long_tokens, d.egress_bps)
             if p > 0 and d.n_prfaas > 0 else (0.0, 0.0) for d in deps]
    carried = [min(term) for term in terms]
    prfaas = sum(carried)
    shares = [c / prfaas for c in carried] if prfaas > 0 else [1.0 / len(deps)] * len(deps)
    kv_bytes = sum(share * d.prfaas.prefill.kv_bytes(split.mean_long_tokens) for share, d in zip(shares, deps, strict=True)) \
        if p > 0 else 0.0
    thetas = (sum(c for c, _ in terms), sum(b for _, b in terms), prfaas)
    return _operating_point(deps[0], split, n_prefill, n_decode, thetas, kv_bytes, sum(d.egress_bps for d in deps))


def _operating_point(dep: Deployment, split: Split, n_prefill: int, n_decode: int,
                     prfaas_rps: tuple[float, float, float], kv_bytes: float, egress_capacity_bps: float) -> OperatingPoint:
    """Equations (4)-(6) on ``dep``'s PD cluster, given equation (3)'s terms (compute, bandwidth, what the
    PrfaaS side carries), the mean KV bytes an offloaded request ships and the egress capacity."""
    compute, bandwidth, prfaas = prfaas_rps
    p = split.offload_fraction
    pd_p = theta_pd_prefill(n_prefill, dep.pd.prefill, split.mean_short_tokens) if p < 1 else 0.0
    pd_d = theta_pd_decode(n_decode, dep.pd, dep.output_tokens)

    limits = {
        "prfaas-compute" if compute <= bandwidth else "prfaas-bandwidth": prfaas / p if p > 0 else math.inf,
        "pd-prefill": pd_p / (1 - p) if p < 1 else math.inf,
        "pd-decode": pd_d,
    }
    binding = min(limits, key=limits.get)
    lam = limits[binding]
    egress_bps = lam * p * 8.0 * kv_bytes if p > 0 else 0.0
    return OperatingPoint(
        threshold_tokens=split.threshold_tokens,
        n_prefill=n_prefill,
        n_decode=n_decode,
        offload_fraction=p,
        mean_long_tokens=split.mean_long_tokens,
        mean_short_tokens=split.mean_short_tokens,
        prfaas_compute_rps=compute,
        prfaas_bandwidth_rps=bandwidth,
        theta_prfaas_rps=prfaas,
        theta_pd_prefill_rps=pd_p,
        theta_pd_decode_rps=pd_d,
        lambda_max_rps=lam,
        binding_stage=binding,
        egress_gbps=egress_bps / 1e9,
        egress_utilization=egress_bps / egress_capacity_bps,
    )
