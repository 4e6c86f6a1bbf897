"""Analytic (roofline) profiles from a model config and accelerator specs (pure).

Prefill is compute-bound for the lengths that matter here, so::

    T_prefill(l) = FLOPs(l) / (gpus * peak_flops * prefill_mfu) + prefill_overhead_s
    FLOPs(l)     = 2 * active_params * l                          (all matmuls, MoE: active experts)
                 + full_layers * q_heads * (d_qk + d_v) * l^2     (causal attention: QK^T and AV)
                 + linear_layers * 4 * heads * d_k * d_v * l      (chunked delta-rule / SSM update)
                 + swa_layers * q_heads * (d_qk + d_v) * 2 * l * min(l, window)

    S_kv(l)      = full_layers * kv_bytes_per_token_per_layer * l  (GQA: kv_heads*(d_qk+d_v); MLA: rank+rope)
                 + linear_layers * (heads*d_k*d_v*state_dtype + conv state)
                 + swa_layers * min(l, window) * kv_heads*(d_qk+d_v) * kv_dtype

Decode is bandwidth-bound; one step of a batch of ``bs`` requests costs::

    step(bs) = overhead + [W(bs) + bs * S_kv(ctx)] / (gpus * hbm_bw * bw_eff)
             + bs * 2 * active_params / (gpus * peak_flops * decode_mfu)
    W(bs)    = weight_bytes * (dense + routed * (1 - (1 - top_k/experts)^bs))   (experts touched)

``BS_max`` is the largest batch with ``step(bs) <= 1 / SLO`` whose KV also
fits next to the weights; ``T_decode = 1 / SLO``. ``prefill_mfu`` and the
decode efficiencies are the calibration knobs; each shipped accelerator file
says where its values come from.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from prfaas_sglang.errors import ConfigError
from prfaas_sglang.plan.profiles import DecodeProfile, PrefillProfile


@dataclass(frozen=True)
class FullAttention:
    layers: int
    kind: str  # "gqa" (incl. MHA/MQA) | "mla"
    q_heads: int
    head_dim: int  # query/key head dim (MLA: nope + rope)
    v_head_dim: int
    kv_heads: int = 0  # gqa
    kv_lora_rank: int = 0  # mla: compressed KV width
    qk_rope_head_dim: int = 0  # mla: decoupled rope key width

    def kv_elems_per_token(self) -> int:
        per_layer = (self.kv_lora_rank + self.qk_rope_head_dim) if self.kind == "mla" else self.kv_heads * (self.head_dim + self.v_head_dim)
        return self.layers * per_layer

    def flops(self, tokens: float) -> float:
        return self.layers * self.q_heads * (self.head_dim + self.v_head_dim) * tokens * tokens


@dataclass(frozen=True)
class RecurrentState:
    """Linear attention / SSM layers (KDA, GDN, Mamba2, Lightning): a fixed-size state per request."""

    layers: int
    heads: int
    key_dim: int
    value_dim: int
    state_dtype_bytes: int = 4
    conv_channels: int = 0
    conv_kernel: int = 0

    def state_bytes(self, conv_dtype_bytes: int) -> float:
        per_layer = self.heads * self.key_dim * self.value_dim * self.state_dtype_bytes
        per_layer += self.conv_channels * max(self.conv_kernel - 1, 0) * conv_dtype_bytes
        return self.layers * per_layer

    def flops(self, tokens: float) -> float:
        return self.layers * 4.0 * self.heads * self.key_dim * self.value_dim * tokens


@dataclass(frozen=True)
class SlidingWindow:
    layers: int
    q_heads: int
    kv_heads: int
    head_dim: int
    v_head_dim: int
    window: int

    def state_bytes(self, tokens: float, kv_dtype_bytes: int) -> float:
        return self.layers * min(tokens, self.window) * self.kv_heads * (self.head_dim + self.v_head_dim) * kv_dtype_bytes

    def flops(self, tokens: float) -> float:
        return self.layers * self.q_heads * (self.head_dim + self.v_head_dim) * 2.0 * tokens * min(tokens, self.window)


@dataclass(frozen=True)
class MoE:
    experts: int
    top_k: int


@dataclass(frozen=True)
class ModelConfig:
    name: str
    source: str
    total_params_b: float
    active_params_b: float
    weight_bytes_per_param: float
    kv_dtype_bytes: int
    full_attention: FullAttention
    recurrent: RecurrentState | None = None
    sliding_window: SlidingWindow | None = None
    moe: MoE | None = None

    def kv_bytes(self, tokens: float) -> float:
        total = self.full_attention.kv_elems_per_token() * self.kv_dtype_bytes * tokens
        if self.recurrent:
            total += self.recurrent.state_bytes(self.kv_dtype_bytes)
        if self.sliding_window:
            total += self.sliding_window.state_bytes(tokens, self.kv_dtype_bytes)
        return total

    def prefill_flops(self, tokens: float) -> float:
        flops = 2.0 * self.active_params_b * 1e9 * tokens + self.full_attention.flops(tokens)
        if self.recurrent:
            flops += self.recurrent.flops(tokens)
        if self.sliding_window:
            flops += self.sliding_window.flops(tokens)
        return flops

    def weight_bytes_read(self, batch: float) -> float:
        """Weights one decode step reads for ``batch`` requests (MoE: only the experts touched)."""
        total = self.total_params_b * 1e9
        if self.moe is None:
            return total * self.weight_bytes_per_param
        share = self.moe.top_k / self.moe.experts
        dense = max((self.active_params_b * 1e9 - total * share) / (1 - share), 0.0)
        touched = 1.0 - (1.0 - share) ** batch
        return self.weight_bytes_per_param * (dense + (total - dense) * touched)


@dataclass(frozen=True)
class Accelerator:
    """One instance class: ``gpus`` GPUs of one kind, plus efficiency factors."""

    name: str
    source: str
    gpus: int
    peak_tflops: float  # dense bf16, per GPU
    hbm_tb_s: float  # per GPU
    hbm_gb: float  # per GPU
    prefill_mfu: float
    decode_mfu: float = 0.3
    decode_bw_efficiency: float = 0.6
    decode_overhead_ms: float = 3.0
    prefill_overhead_ms: float = 0.0
    mem_fraction: float = 0.9


class AnalyticPrefill(PrefillProfile):
    def __init__(self, model: ModelConfig, accel: Accelerator):
        self.model, self.accel = model, accel
        self.name = f"{model.name}@{accel.name}"
        self._flops_per_s = accel.gpus * accel.peak_tflops * 1e12 * accel.prefill_mfu

    def prefill_s(self, tokens: float) -> float:
        return self.model.prefill_flops(tokens) / self._flops_per_s + self.accel.prefill_overhead_ms / 1e3

    def kv_bytes(self, tokens: float) -> float:
        return self.model.kv_bytes(tokens)


def decode_step_s(model: ModelConfig, accel: Accelerator, batch: float, context_tokens: float) -> float:
    bandwidth = accel.gpus * accel.hbm_tb_s * 1e12 * accel.decode_bw_efficiency
    compute = accel.gpus * accel.peak_tflops * 1e12 * accel.decode_mfu
    moved = model.weight_bytes_read(batch) + batch * model.kv_bytes(context_tokens)
    return accel.decode_overhead_ms / 1e3 + moved / bandwidth + batch * 2.0 * model.active_params_b * 1e9 / compute


def analytic_decode(
    model: ModelConfig, accel: Accelerator, input_tokens: float, output_tokens: float, slo_tokens_per_s: float
) -> DecodeProfile:
    """``BS_max`` and ``T_decode = 1/SLO`` for requests of ``input_tokens`` + ``output_tokens``."""
    budget_s = 1.0 / slo_tokens_per_s
    mean_context = input_tokens + output_tokens / 2.0
    free_bytes = accel.gpus * accel.hbm_gb * 1e9 * accel.mem_fraction - model.total_params_b * 1e9 * model.weight_bytes_per_param
    if free_bytes <= 0:
        raise ConfigError(f"accelerators.{accel.name}", f"{accel.gpus} GPUs cannot hold the weights of {model.name}")
    by_memory = free_bytes / model.kv_bytes(input_tokens + output_tokens)
    if decode_step_s(model, accel, 1, mean_context) > budget_s:
        raise ConfigError("slo_tokens_per_s", f"{model.name} on {accel.name} cannot decode one request at {slo_tokens_per_s:g} tok/s")
    lo, hi = 1, 1
    while hi < 1_000_000 and decode_step_s(model, accel, hi * 2, mean_context) <= budget_s:
        hi *= 2
    hi *= 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if decode_step_s(model, accel, mid, mean_context) <= budget_s:
            lo = mid
        else:
            hi = mid
    bs_max = float(min(lo, by_memory))
    batches = sorted({*(2**k for k in range(int(math.log2(2 * lo)) + 2)), lo, 2 * lo})
    steps = tuple((float(b), decode_step_s(model, accel, b, mean_context)) for b in batches)
    return DecodeProfile(bs_max=bs_max, step_s=budget_s, batch_steps=steps)
