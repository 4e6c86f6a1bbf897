"""The tiny hybrid model the GPU check serves: a config, the shipped tokenizer, no weights.

No weights can be downloaded, so SGLang serves it with ``--load-format dummy`` (random weights,
deterministic for a seed: greedy outputs compare across deployments). The default config is a
Qwen3-Next (the paper's model family in SGLang: gated-delta-net linear-attention layers with a
full-attention layer every :data:`FULL_ATTENTION_INTERVAL`, a small MoE), small enough for three
servers to share one GPU, with a context of :data:`CONTEXT_TOKENS`. Its tokenizer is the one the
router loads (``prfaas-tiny-chatml``: byte-level BPE trained locally, ChatML template).

``--model-config DIR`` takes another config (``config.json``, and the directory's tokenizer when
it has one): :func:`check_with_sglang` requires that SGLang 0.5.15 loads it as one of its hybrid
configs with both linear and full-attention layers.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

from prfaas_sglang.tokenizer import DATA_DIR, SHIPPED

CONTEXT_TOKENS = 65536
MIN_CONTEXT_TOKENS = 40960
FULL_ATTENTION_INTERVAL = 4
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


class ModelError(Exception):
    """The model directory cannot be made, or its config is not a hybrid SGLang serves."""


def tiny_config(vocab_size: int, eos_token_id: int, pad_token_id: int) -> dict:
    """The default tiny Qwen3-Next config (4 layers: 3 linear-attention, 1 full-attention; 8 experts)."""
    return {
        "architectures": ["Qwen3NextForCausalLM"],
        "model_type": "qwen3_next",
        "vocab_size": vocab_size,
        "hidden_size": 512,
        "intermediate_size": 1024,
        "num_hidden_layers": 4,
        "full_attention_interval": FULL_ATTENTION_INTERVAL,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "partial_rotary_factor": 0.25,
        "rope_theta": 10000000.0,
        "max_position_embeddings": CONTEXT_TOKENS,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 64,
        "linear_value_head_dim": 64,
        "linear_num_key_heads": 4,
        "linear_num_value_heads": 8,
        "decoder_sparse_step": 1,
        "moe_intermediate_size": 256,
        "shared_expert_intermediate_size": 256,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "norm_topk_prob": True,
        "mlp_only_layers": [],
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "attention_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "eos_token_id": eos_token_id,
        "pad_token_id": pad_token_id,
    }


def tiny_cpu_config(vocab_size: int, eos_token_id: int, pad_token_id: int) -> dict:
    """A tiny Llama for real SGLang on CPU (``bench gpu-e2e --engine sglang-cpu``): SGLang's CPU path
    serves plain attention (torch_native), not the hybrid's linear-attention kernels. 4 layers, 2 KV
    heads of 64 in float32: 4 KiB of KV per token, so a 4K-token prompt's KV (16 MiB) binds a 200 Mbit/s link.
    float32, not bfloat16 (served with ``--dtype float32``: SGLang's ``auto`` casts a float32 checkpoint to
    float16): on a CPU without native bfloat16 matrix units torch's bfloat16 GEMMs ran about 60x slower than
    float32's, and one 4,096-token prefill took 3.6-4.1 CPU-s in bfloat16 against 1.1 in float32 (2026-12-01,
    the dev machine's AMD EPYC, one thread)."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": -(-vocab_size // 64) * 64,
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "rope_theta": 10000.0,
        "max_position_embeddings": CONTEXT_TOKENS,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "bos_token_id": eos_token_id,
        "eos_token_id": eos_token_id,
        "pad_token_id": pad_token_id,
    }


def check_config(config: dict, tokenizer_vocab: int) -> list[str]:
    """What is wrong with ``config`` for the GPU check (pure): [] when nothing."""
    problems = []
    if not config.get("architectures"):
        problems.append("config.json names no architecture")
    vocab = config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size")
    if not isinstance(vocab, int) or vocab < tokenizer_vocab:
        problems.append(f"vocab_size {vocab} is smaller than the tokenizer's {tokenizer_vocab} tokens")
    context = config.get("max_position_embeddings") or (config.get("text_config") or {}).get("max_position_embeddings")
    if not isinstance(context, int) or context < MIN_CONTEXT_TOKENS:
        problems.append(f"context {context} tokens is under the {MIN_CONTEXT_TOKENS} the long-prompt checks need")
    return problems


def _tokenizer_vocab(directory: Path) -> tuple[int, int, int]:
    """(vocabulary size, eos id, pad id) of the tokenizer in ``directory``."""
    data = json.loads((directory / "tokenizer.json").read_text())
    vocab = dict(data["model"]["vocab"])
    for added in data.get("added_tokens", ()):
        vocab[added["content"]] = added["id"]
    cfg = json.loads((directory / "tokenizer_config.json").read_text())
    eos = vocab.get(cfg.get("eos_token") or "", 0)
    pad = vocab.get(cfg.get("pad_token") or "", eos)
    return max(vocab.values()) + 1, eos, pad


def make_model(dest: Path, config: Path | None = None, log: Callable[[str], None] = print, cpu: bool = False) -> dict:
    """Write the model directory ``dest`` (``config.json``, tokenizer files, ``recipe.json``);
    return the recipe. ``config``: a ``config.json`` or a directory holding one (its tokenizer
    files are taken when present); else the tiny hybrid, or with ``cpu`` :func:`tiny_cpu_config`.
    Raises ModelError."""
    source_dir = None
    if config is not None:
        config_file = config / "config.json" if config.is_dir() else config
        if not config_file.is_file():
            raise ModelError(f"--model-config {config}: no config.json there")
        source_dir = config_file.parent
    tokenizer_dir = source_dir if source_dir is not None and (source_dir / "tokenizer.json").is_file() else DATA_DIR / SHIPPED
    vocab, eos, pad = _tokenizer_vocab(tokenizer_dir)
    if config is None:
        hf_config = (tiny_cpu_config if cpu else tiny_config)(vocab, eos, pad)
    else:
        try:
            hf_config = json.loads(config_file.read_text())
        except ValueError as err:
            raise ModelError(f"--model-config {config_file}: not JSON ({err})") from None
    problems = check_config(hf_config, vocab)
    if problems:
        raise ModelError(f"model config {'--model-config ' + str(config) if config else '(tiny)'}: " + "; ".join(problems))
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    for name in TOKENIZER_FILES:
        shutil.copyfile(tokenizer_dir / name, dest / name)
    (dest / "generation_config.json").write_text(json.dumps({"eos_token_id": hf_config.get("eos_token_id", eos)}) + "\n")
    default = ("tiny Llama (prfaas_sglang.gpu.tiny_model.tiny_cpu_config)" if cpu
               else "tiny Qwen3-Next (prfaas_sglang.gpu.tiny_model.tiny_config)")
    recipe = {"config": str(config) if config else default,
              "architecture": hf_config["architectures"][0],
              "tokenizer": str(tokenizer_dir.name if tokenizer_dir.parent == DATA_DIR else tokenizer_dir),
              "tokenizer_vocab": vocab, "load_format": "dummy"}
    (dest / "recipe.json").write_text(json.dumps(recipe, indent=2) + "\n")
    log(f"[gpu-model] {dest}: {recipe['architecture']}, tokenizer {recipe['tokenizer']} ({vocab} tokens)")
    return recipe


def check_with_sglang(model_dir: Path) -> dict:
    """Load ``model_dir``'s config the way SGLang 0.5.15 does and require a hybrid it serves with
    both linear and full attention. Returns ``{"config_class", "linear_layers", "full_layers",
    "context_tokens"}``; raises ModelError. Imports SGLang (seconds)."""
    from sglang.srt.utils.hf_transformers_utils import get_config

    try:
        config = get_config(str(model_dir), trust_remote_code=False)
    except Exception as err:  # noqa: BLE001 - SGLang's and transformers' errors vary; all mean "not loadable"
        raise ModelError(f"SGLang cannot load {model_dir}/config.json: {type(err).__name__}: {err}") from None
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    linear = getattr(text, "linear_layer_ids", None)
    full = getattr(text, "full_attention_layer_ids", None)
    if linear is None or full is None:
        raise ModelError(f"{type(config).__name__} is not a hybrid config SGLang serves with linear and full attention "
                         "(it has no linear_layer_ids / full_attention_layer_ids)")
    if not linear or not full:
        raise ModelError(f"{type(config).__name__}: {len(linear)} linear and {len(full)} full-attention layers; "
                         "the checks need both kinds")
    return {"config_class": type(config).__name__, "linear_layers": list(linear), "full_layers": list(full),
            "context_tokens": int(getattr(text, "max_position_embeddings", 0))}
