"""Request streams for the demo and the benchmarks, and the scheduler prior that describes each (pure).

``case-study``: Poisson arrivals, lengths from the paper's truncated log-normal
(capped at ``max_input_tokens``). ``trace:PATH``: a Mooncake-format trace, its
arrivals compressed by ``speedup``; each 512-token block id becomes the same
tokens (or text) wherever it appears, so prefixes repeat as in the trace.

With a tokenizer the prompts are *text* sent to ``/v1/completions``: words
drawn from the tokenizer's own vocabulary, about one token each, so the router
and the engines tokenize what a user would send. Without one they are token
ids sent to ``/generate``. :func:`prior` is the ``scheduler.workload`` entry of
the topology for the same stream, so the router plans for what it will see.
"""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

from prfaas_sglang.demo.client import Arrival, completion_text, generate_ids
from prfaas_sglang.errors import ConfigError
from prfaas_sglang.plan.workload import case_study_lengths, read_trace

VOCAB = 32_000
BLOCK_TOKENS = 512


def prior(workload: str, max_input_tokens: int) -> dict:
    """The topology's ``scheduler.workload`` for this stream."""
    if workload == "case-study":
        return case_study_lengths(max_input_tokens).config()
    if workload.startswith("trace:"):
        return {"kind": "trace", "path": str(Path(workload[len("trace:"):]).resolve()), "cache": {"kind": "unbounded"}}
    raise ConfigError("--workload", f"expected case-study or trace:PATH, got {workload!r}")


class TextSource:
    """Text of about N tokens from a tokenizer's word-like vocabulary entries (deterministic per seed)."""

    def __init__(self, tokenizer):
        words = []
        for token, _ in sorted(tokenizer.tokenizer.get_vocab().items(), key=lambda kv: kv[1]):
            if token.startswith("Ġ") and token[1:].isalpha() and token[1:].isascii():
                words.append(token[1:])
        if len(words) < 100:
            raise ConfigError("tokenizer", "too few word tokens to build demo text from")
        self.words = words

    def text(self, rng: random.Random, n_tokens: int) -> str:
        return " " + " ".join(rng.choice(self.words) for _ in range(max(n_tokens, 1)))


def case_study(duration_s: float, rate: float, output_tokens: int, max_input_tokens: int, seed: int,
               text: TextSource | None, max_requests: int, model: str | None = None) -> list[Arrival]:
    rng = random.Random(seed)
    dist = case_study_lengths(max_input_tokens)
    out, t = [], 0.0
    while len(out) < max_requests:
        t += rng.expovariate(rate)
        if t > duration_s:
            break
        n = int(dist.sample(rng, 1)[0])
        if text is not None:
            out.append(dataclasses.replace(completion_text(t, text.text(rng, n), output_tokens, model), input_tokens=n))
        else:
            out.append(generate_ids(t, [rng.randrange(VOCAB) for _ in range(n)], output_tokens))
    return out


def trace(path: str, duration_s: float, speedup: float, output_tokens: int, max_input_tokens: int,
          text: TextSource | None, max_requests: int, model: str | None = None) -> list[Arrival]:
    out = []
    for rec in read_trace(path, "--workload"):
        offset = rec.timestamp_ms / 1000.0 / speedup
        if offset > duration_s or len(out) >= max_requests:
            break
        n = min(rec.input_length, max_input_tokens)
        max_new = max(1, min(rec.output_length, output_tokens))
        if text is not None:
            blocks = [text.text(random.Random(h), BLOCK_TOKENS) for h in rec.hash_ids[: -(-n // BLOCK_TOKENS)]]
            out.append(completion_text(offset, "".join(blocks), max_new, model))
        else:
            ids = [(h * 7919 + i) % VOCAB for h in rec.hash_ids for i in range(BLOCK_TOKENS)][:n]
            out.append(generate_ids(offset, ids, max_new))
    return out


def arrivals(workload: str, duration_s: float, rate: float, output_tokens: int, max_input_tokens: int, seed: int,
             speedup: float, text: TextSource | None = None, max_requests: int = 100_000,
             model: str | None = None) -> list[Arrival]:
    if workload == "case-study":
        return case_study(duration_s, rate, output_tokens, max_input_tokens, seed, text, max_requests, model)
    if workload.startswith("trace:"):
        return trace(workload[len("trace:"):], duration_s, speedup, output_tokens, max_input_tokens, text, max_requests, model)
    raise ConfigError("--workload", f"expected case-study or trace:PATH, got {workload!r}")
