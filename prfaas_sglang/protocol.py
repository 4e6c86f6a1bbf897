"""SGLang's request and response shapes for /generate, /v1/completions, /v1/chat/completions (pure).

Requests are reduced to one :class:`EngineRequest`. Prompts arrive as token
ids (``input_ids``, or a list of ints as ``prompt``) or as text; the mock has
no tokenizer, so text becomes one pseudo-token per whitespace-separated word
(``pseudo_tokenize``, deterministic). Output tokens are pseudo-random but
deterministic per (prompt, position), and rendered as ``" t<id>"``.
"""

from __future__ import annotations

import hashlib
import json
import struct
import time
from dataclasses import dataclass, field
from typing import Any

VOCAB_SIZE = 32_000


class BadRequest(Exception):
    """A client error: ``status`` and a one-line message (never leaks worker state)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass(frozen=True)
class Bootstrap:
    host: str
    port: int
    room: int


@dataclass(frozen=True)
class EngineRequest:
    kind: str  # "generate" | "completions" | "chat"
    input_ids: tuple[int, ...]
    max_new_tokens: int
    stream: bool
    rid: str
    model: str | None
    bootstrap: Bootstrap | None
    created: int = field(default_factory=lambda: int(time.time()))


def pseudo_tokenize(text: str) -> list[int]:
    return [int.from_bytes(hashlib.blake2b(w.encode(), digest_size=4).digest(), "little") % VOCAB_SIZE for w in text.split()]


def prompt_seed(input_ids) -> int:
    """Seed of the pseudo-tokens: a function of the prompt alone, like greedy decoding of fixed weights."""
    digest = hashlib.blake2b(struct.pack(f"<{len(input_ids)}I", *input_ids), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def output_token(seed: int, position: int) -> int:
    digest = hashlib.blake2b(f"{seed}:{position}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little") % VOCAB_SIZE


def render(tokens: list[int]) -> str:
    return "".join(f" t{t}" for t in tokens)


def _int_list(value: Any, field_name: str) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in value):
        raise BadRequest(400, f"{field_name} must be a list of token ids")
    if any(x < 0 for x in value):
        raise BadRequest(400, f"{field_name} has a negative token id")
    return value


def _positive_int(value: Any, field_name: str, default: int) -> int:
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise BadRequest(400, f"{field_name} must be a positive integer, got {value!r}")
    return value


def _bootstrap(body: dict) -> Bootstrap | None:
    keys = ("bootstrap_host", "bootstrap_port", "bootstrap_room")
    present = [k for k in keys if body.get(k) is not None]
    if not present:
        return None
    if len(present) != 3:
        raise BadRequest(400, f"PD requests need all of {', '.join(keys)}; got only {', '.join(present)}")
    host, port, room = body["bootstrap_host"], body["bootstrap_port"], body["bootstrap_room"]
    if not isinstance(host, str) or not isinstance(port, int) or not isinstance(room, int) or isinstance(room, bool):
        raise BadRequest(400, "bootstrap_host must be a string, bootstrap_port and bootstrap_room integers")
    if isinstance(room, list) or isinstance(host, list):
        raise BadRequest(400, "batched requests are not supported by the emulated engine")
    return Bootstrap(host, port, room)


def parse_request(kind: str, body: Any, rid: str) -> EngineRequest:
    """Validate a decoded JSON body; raise :class:`BadRequest` with the offending field."""
    if not isinstance(body, dict):
        raise BadRequest(400, "request body must be a JSON object")
    if kind == "generate":
        params = body.get("sampling_params") or {}
        if not isinstance(params, dict):
            raise BadRequest(400, "sampling_params must be an object")
        if body.get("input_ids") is not None:
            ids = _int_list(body["input_ids"], "input_ids")
        elif isinstance(body.get("text"), str):
            ids = pseudo_tokenize(body["text"])
        else:
            raise BadRequest(400, "one of input_ids or text is required")
        max_new = _positive_int(params.get("max_new_tokens"), "sampling_params.max_new_tokens", 128)
    elif kind == "completions":
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            ids = pseudo_tokenize(prompt)
        elif isinstance(prompt, list) and prompt and all(isinstance(x, int) for x in prompt):
            ids = _int_list(prompt, "prompt")
        else:
            raise BadRequest(400, "prompt must be a string or a list of token ids")
        max_new = _positive_int(body.get("max_tokens"), "max_tokens", 16)
    elif kind == "chat":
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest(400, "messages must be a non-empty list")
        words = []
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or not isinstance(message.get("content", ""), str) or "role" not in message:
                raise BadRequest(400, f"messages[{i}] must have a role and string content")
            words.append(f"<{message['role']}> {message.get('content', '')}")
        ids = pseudo_tokenize(" ".join(words))
        max_new = _positive_int(body.get("max_completion_tokens", body.get("max_tokens")), "max_tokens", 128)
    else:  # pragma: no cover - routes are fixed
        raise BadRequest(404, f"unknown endpoint kind {kind}")
    if not ids:
        raise BadRequest(400, "the prompt is empty")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest(400, "stream must be true or false")
    model = body.get("model")
    return EngineRequest(kind, tuple(ids), max_new, stream, str(body.get("rid") or rid), model if isinstance(model, str) else None,
                         _bootstrap(body))


def meta_info(req: EngineRequest, tokens: list[int], finished: bool, cached_tokens: int, extra: dict) -> dict:
    meta = {
        "id": req.rid,
        "prompt_tokens": len(req.input_ids),
        "completion_tokens": len(tokens),
        "cached_tokens": cached_tokens,
        "finish_reason": {"type": "length", "length": len(tokens)} if finished else None,
    }
    meta.update(extra)
    return meta


def full_response(req: EngineRequest, tokens: list[int], cached_tokens: int, model: str, extra: dict) -> dict:
    """The non-streaming body for ``req.kind``."""
    text = render(tokens)
    usage = {"prompt_tokens": len(req.input_ids), "completion_tokens": len(tokens), "total_tokens": len(req.input_ids) + len(tokens)}
    if req.kind == "generate":
        return {"text": text, "output_ids": tokens, "meta_info": meta_info(req, tokens, True, cached_tokens, extra)}
    if req.kind == "completions":
        return {"id": f"cmpl-{req.rid}", "object": "text_completion", "created": req.created, "model": model,
                "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": "length"}], "usage": usage,
                "meta_info": meta_info(req, tokens, True, cached_tokens, extra)}
    return {"id": f"chatcmpl-{req.rid}", "object": "chat.completion", "created": req.created, "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"}],
            "usage": usage, "meta_info": meta_info(req, tokens, True, cached_tokens, extra)}


def stream_chunk(req: EngineRequest, tokens: list[int], new: list[int], finished: bool, cached_tokens: int, model: str, extra: dict) -> str:
    """One SSE event (``data: ...\\n\\n``) for the tokens produced so far."""
    if req.kind == "generate":
        body = {"text": render(tokens), "output_ids": tokens, "meta_info": meta_info(req, tokens, finished, cached_tokens, extra)}
    elif req.kind == "completions":
        body = {"id": f"cmpl-{req.rid}", "object": "text_completion", "created": req.created, "model": model,
                "choices": [{"index": 0, "text": render(new), "logprobs": None, "finish_reason": "length" if finished else None}]}
    else:
        body = {"id": f"chatcmpl-{req.rid}", "object": "chat.completion.chunk", "created": req.created, "model": model,
                "choices": [{"index": 0, "delta": {"role": "assistant", "content": render(new)} if new else {},
                             "finish_reason": "length" if finished else None}]}
    return f"data: {json.dumps(body)}\n\n"


SSE_DONE = "data: [DONE]\n\n"
