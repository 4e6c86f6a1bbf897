"""The paper's published KV-throughput anchors, and our profiles' values beside them (pure).

Table 3 (8xH200, SGLang v0.5.9, 32K tokens) and section 2.3 (a 512-GPU
prefill cluster at L_avg = 32K, equation (2)).
"""

from __future__ import annotations

from dataclasses import dataclass

from prfaas_sglang.plan.analytic import Accelerator, AnalyticPrefill, ModelConfig
from prfaas_sglang.plan.model import required_egress_bps

ANCHOR_TOKENS = 32 * 1024
CLUSTER_GPUS = 512


@dataclass(frozen=True)
class Anchor:
    model: str
    paper_phi_kv_gbps: float | None  # Table 3 at 32K
    paper_egress_512_tbps: float | None  # section 2.3
    note: str


ANCHORS: tuple[Anchor, ...] = (
    Anchor("minimax-m2.5", 59.93, 3.8, "dense GQA"),
    Anchor("qwen3-235b-a22b", 33.35, 2.1, "dense GQA"),
    Anchor("qwen3.5-397b-a17b", 8.25, None, "hybrid 3:1 GDN"),
    Anchor("mimo-v2-flash", 4.66, None, "hybrid 5:1 SWA"),
    Anchor("ring-2.5-1t", None, 0.170, "hybrid 7:1 linear, MLA; config estimated"),
)


@dataclass(frozen=True)
class AnchorCheck:
    anchor: Anchor
    phi_kv_gbps: float
    egress_512_tbps: float
    implied_prefill_mfu: float | None  # the MFU at which our FLOP count meets Table 3

    @property
    def phi_ratio(self) -> float | None:
        return self.phi_kv_gbps / self.anchor.paper_phi_kv_gbps if self.anchor.paper_phi_kv_gbps else None

    @property
    def egress_ratio(self) -> float | None:
        return self.egress_512_tbps / self.anchor.paper_egress_512_tbps if self.anchor.paper_egress_512_tbps else None


def check_anchor(anchor: Anchor, model: ModelConfig, accel: Accelerator) -> AnchorCheck:
    profile = AnalyticPrefill(model, accel)
    phi = profile.phi_kv_bps(ANCHOR_TOKENS)
    egress = required_egress_bps(CLUSTER_GPUS, accel.gpus, profile, ANCHOR_TOKENS)
    implied = None
    if anchor.paper_phi_kv_gbps:
        # Phi = S / T and T is proportional to 1/MFU, so the MFU that meets the anchor:
        implied = accel.prefill_mfu * anchor.paper_phi_kv_gbps / (phi / 1e9)
    return AnchorCheck(anchor, phi / 1e9, egress / 1e12, implied)
