"""The tiny hybrid model (SGLang 0.5.15's own config loader on CPU) and the import trace of this
environment (a real subprocess)."""

from __future__ import annotations

import json

import pytest

from prfaas_sglang.gpu import bundle as spec
from prfaas_sglang.gpu.builder import run_trace
from prfaas_sglang.gpu.tiny_model import (
    MIN_CONTEXT_TOKENS,
    ModelError,
    check_config,
    check_with_sglang,
    make_model,
)


def test_the_tiny_model_is_a_hybrid_sglang_loads_with_the_routers_tokenizer(tmp_path):
    recipe = make_model(tmp_path / "m", log=lambda _line: None)
    assert recipe["architecture"] == "Qwen3NextForCausalLM" and recipe["tokenizer"] == "prfaas-tiny-chatml"
    facts = check_with_sglang(tmp_path / "m")
    assert facts["config_class"] == "Qwen3NextConfig"
    assert facts["linear_layers"] == [0, 1, 2] and facts["full_layers"] == [3]
    assert facts["context_tokens"] >= MIN_CONTEXT_TOKENS
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert config["vocab_size"] >= recipe["tokenizer_vocab"] and config["num_experts"] == 8

    from transformers import AutoTokenizer

    from prfaas_sglang.tokenizer import PromptTokenizer

    ours = PromptTokenizer.load(str(tmp_path / "m"))
    hf = AutoTokenizer.from_pretrained(str(tmp_path / "m"))
    text = "Prefill-as-a-Service moves the KV cache across datacenters."
    assert ours.encode_text(text) == hf(text)["input_ids"]
    assert hf.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                  add_generation_prompt=True).endswith("<|im_start|>assistant\n")


def test_another_hybrid_config_is_accepted_and_a_dense_one_refused(tmp_path):
    make_model(tmp_path / "base", log=lambda _line: None)
    other = json.loads((tmp_path / "base" / "config.json").read_text())
    other.update(num_hidden_layers=8, full_attention_interval=2)
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "config.json").write_text(json.dumps(other))
    make_model(tmp_path / "m2", config=tmp_path / "cfg", log=lambda _line: None)
    facts = check_with_sglang(tmp_path / "m2")
    assert facts["full_layers"] == [1, 3, 5, 7] and len(facts["linear_layers"]) == 4

    dense = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 4096, "hidden_size": 256,
             "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
             "max_position_embeddings": 65536}
    (tmp_path / "dense").mkdir()
    (tmp_path / "dense" / "config.json").write_text(json.dumps(dense))
    make_model(tmp_path / "m3", config=tmp_path / "dense", log=lambda _line: None)
    with pytest.raises(ModelError, match="not a hybrid config"):
        check_with_sglang(tmp_path / "m3")


def test_bad_model_configs_get_clear_errors(tmp_path):
    assert check_config({"architectures": ["X"], "vocab_size": 100, "max_position_embeddings": 2048}, 4096) == [
        "vocab_size 100 is smaller than the tokenizer's 4096 tokens",
        f"context 2048 tokens is under the {MIN_CONTEXT_TOKENS} the long-prompt checks need"]
    with pytest.raises(ModelError, match="no config.json"):
        make_model(tmp_path / "m", config=tmp_path / "nowhere", log=lambda _line: None)
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text("{not json")
    with pytest.raises(ModelError, match="not JSON"):
        make_model(tmp_path / "m", config=tmp_path / "bad", log=lambda _line: None)


@pytest.mark.slow
def test_the_trace_sees_modules_and_the_libraries_they_map():
    traced = run_trace(["sglang.srt.disaggregation.mooncake.conn", "mooncake.engine", "no_such_module_here"], None)
    assert traced["failed"] == {"no_such_module_here": "ModuleNotFoundError: No module named 'no_such_module_here'"}
    dists = {spec.normalize(name): entry for name, entry in traced["dists"].items()}
    assert dists["sglang"]["version"] == "0.5.15"
    assert "sglang/srt/disaggregation/mooncake/conn.py" in dists["sglang"]["files"]
    mooncake = dists["mooncake-transfer-engine-non-cuda"]["files"]
    assert "mooncake/engine.so" in mooncake
    # engine.so's linked libraries are mapped, not imported: only /proc/self/maps shows them
    assert any(spec.file_key(f).startswith("LIBS/libglog") for f in mooncake), mooncake
    assert any(f.endswith("prfaas_sglang/__init__.py") for f in traced["unowned"]) or "prfaas-sglang" in dists
