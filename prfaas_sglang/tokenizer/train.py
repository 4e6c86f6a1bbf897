"""``python -m prfaas_sglang.tokenizer.train``: the recipe of the shipped tokenizer ``prfaas-tiny-chatml``.

A byte-level BPE (GPT-2 pre-tokenizer, so any UTF-8 text encodes with no unknown
token) trained with Hugging Face ``tokenizers`` on plain-text files, plus three
special tokens and a ChatML chat template. It stands in for a real model's
tokenizer in tests, the demo and the tiny random-weight model: same file
layout (``tokenizer.json`` + ``tokenizer_config.json``), loaded the way SGLang
loads tokenizers.

    python -m prfaas_sglang.tokenizer.train --out DIR [--vocab-size 4096] [--bos] CORPUS...

The shipped copy was trained on the five text files of ``shared/seeds`` (the
PrfaaS paper and the works it builds on), vocabulary 4096; ``recipe.json``
beside it records the corpus files' SHA-256 and the command. ``--bos`` adds a
post-processor that prepends ``<|endoftext|>`` as BOS (tests use such a
tokenizer to exercise SGLang's add_special_tokens branch).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

# ChatML. Content may be a string or a list of OpenAI text parts; tools, when
# given, are listed in a system block first. The loop over message content makes
# SGLang (and vLLM) treat the template as taking OpenAI-format content.
CHAT_TEMPLATE = (
    "{%- if tools -%}"
    "{{- '<|im_start|>system\\n# Tools\\n' -}}"
    "{%- for tool in tools -%}{{- tool | tojson -}}{{- '\\n' -}}{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'text' -%}{{- part['text'] -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def train(corpus: list[Path], out: Path, vocab_size: int = 4096, bos: bool = False,
          chat_template: str = CHAT_TEMPLATE) -> Path:
    """Train, then write ``tokenizer.json``, ``tokenizer_config.json`` and ``recipe.json`` into ``out``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train([str(p) for p in corpus], trainer)
    if bos:
        tok.post_processor = processors.TemplateProcessing(
            single="<|endoftext|> $A", pair="<|endoftext|> $A <|endoftext|> $B",
            special_tokens=[("<|endoftext|>", tok.token_to_id("<|endoftext|>"))])
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|endoftext|>" if bos else None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "model_max_length": 131072,
        "clean_up_tokenization_spaces": False,
        "chat_template": chat_template,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    recipe = {
        "command": "python -m prfaas_sglang.tokenizer.train --out DIR --vocab-size "
                   f"{vocab_size}{' --bos' if bos else ''} " + " ".join(p.name for p in corpus),
        "vocab_size": tok.get_vocab_size(),
        "corpus": {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in corpus},
    }
    (out / "recipe.json").write_text(json.dumps(recipe, indent=2) + "\n")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m prfaas_sglang.tokenizer.train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("corpus", nargs="+", type=Path, help="plain-text files to train on")
    p.add_argument("--out", type=Path, required=True,
                   help="directory to write tokenizer.json, tokenizer_config.json and recipe.json")
    p.add_argument("--vocab-size", type=int, default=4096,
                   help="vocabulary size, special tokens included (at least 300)")
    p.add_argument("--bos", action="store_true",
                   help="prepend <|endoftext|> as a BOS token to every encoded sequence")
    args = p.parse_args(argv)
    missing = [str(c) for c in args.corpus if not c.is_file()]
    if missing or args.vocab_size < 300:
        print(f"error: {'missing corpus file ' + missing[0] if missing else '--vocab-size must be >= 300'}", file=sys.stderr)
        return 2
    print(train(sorted(args.corpus), args.out, args.vocab_size, args.bos))
    return 0


if __name__ == "__main__":
    sys.exit(main())
