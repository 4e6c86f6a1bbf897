"""A Hugging Face ``config.json`` as the planner's :class:`~prfaas_sglang.plan.analytic.ModelConfig` (pure).

The roofline of the model actually served: ``bench profile`` prints it beside what the engine
measured. Two families, the ones this project serves:

* dense or MoE decoder-only transformers with GQA attention in every layer (Llama, Qwen2/3,
  Qwen3-MoE, Mistral): ``num_hidden_layers`` full-attention layers;
* Qwen3-Next hybrids: one full-attention layer every ``full_attention_interval`` (gated query,
  so the query projection is twice as wide), the others gated-delta-net linear attention whose
  per-request state is ``linear_num_value_heads x linear_key_head_dim x linear_value_head_dim``
  (fp32) plus a causal-conv window of ``linear_conv_kernel_dim - 1`` steps over the q, k, v channels.

Parameter counts leave out the embedding and the LM head from the *active* count: a prefill
computes logits for its last token only, so their FLOPs do not grow with the prompt.
"""

from __future__ import annotations

from typing import Any

from prfaas_sglang.errors import ConfigError
from prfaas_sglang.plan.analytic import FullAttention, ModelConfig, MoE, RecurrentState

STATE_DTYPE_BYTES = 4  # SGLang's Mamba pool keeps the recurrent state in fp32 by default
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def _int(config: dict, key: str, default: int | None = None) -> int:
    value = config.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"config.json.{key}", f"must be a non-negative integer, got {value!r}")
    return value


def model_from_hf_config(config: dict[str, Any], name: str = "served-model") -> ModelConfig:
    """``config`` (a parsed ``config.json``) as a :class:`ModelConfig`; a field it needs that is
    missing or malformed raises :class:`ConfigError` naming it."""
    if not isinstance(config, dict):
        raise ConfigError("config.json", "must be a JSON object")
    hidden, layers = _int(config, "hidden_size"), _int(config, "num_hidden_layers")
    q_heads = _int(config, "num_attention_heads")
    kv_heads = _int(config, "num_key_value_heads", q_heads)
    head_dim = _int(config, "head_dim", hidden // max(q_heads, 1))
    hybrid = config.get("model_type") == "qwen3_next" or "full_attention_interval" in config
    interval = _int(config, "full_attention_interval", 1) if hybrid else 1
    full_layers = layers // max(interval, 1)
    gated_q = 2 if hybrid else 1
    attn_params = hidden * q_heads * head_dim * gated_q + 2 * hidden * kv_heads * head_dim + q_heads * head_dim * hidden
    recurrent, linear_params = None, 0
    if hybrid and layers > full_layers:
        nk, nv = _int(config, "linear_num_key_heads"), _int(config, "linear_num_value_heads")
        dk, dv = _int(config, "linear_key_head_dim"), _int(config, "linear_value_head_dim")
        kernel = _int(config, "linear_conv_kernel_dim", 4)
        recurrent = RecurrentState(layers - full_layers, nv, dk, dv, STATE_DTYPE_BYTES,
                                   conv_channels=2 * nk * dk + nv * dv, conv_kernel=kernel)
        linear_params = hidden * (2 * nk * dk + 2 * nv * dv) + hidden * 2 * nv + nv * dv * hidden
    experts = _int(config, "num_experts", 0) or _int(config, "num_local_experts", 0)
    moe = None
    if experts:
        top_k = _int(config, "num_experts_per_tok")
        expert = 3 * hidden * _int(config, "moe_intermediate_size")
        shared = 3 * hidden * _int(config, "shared_expert_intermediate_size", 0)
        mlp_total, mlp_active = experts * expert + shared + hidden * experts, top_k * expert + shared + hidden * experts
        moe = MoE(experts, top_k)
    else:
        mlp_total = mlp_active = 3 * hidden * _int(config, "intermediate_size")
    body_total = full_layers * attn_params + (layers - full_layers) * linear_params + layers * mlp_total
    body_active = full_layers * attn_params + (layers - full_layers) * linear_params + layers * mlp_active
    vocab = _int(config, "vocab_size")
    embeddings = vocab * hidden * (1 if config.get("tie_word_embeddings") else 2)
    dtype = DTYPE_BYTES.get(str(config.get("torch_dtype", "bfloat16")), 2)
    return ModelConfig(
        name=name, source="config.json", total_params_b=(body_total + embeddings) / 1e9,
        active_params_b=body_active / 1e9, weight_bytes_per_param=dtype, kv_dtype_bytes=dtype,
        full_attention=FullAttention(full_layers, "gqa", q_heads, head_dim, head_dim, kv_heads=kv_heads),
        recurrent=recurrent, moe=moe)
