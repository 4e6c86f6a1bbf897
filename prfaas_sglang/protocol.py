"""SGLang's request and response shapes for /generate, /v1/completions, /v1/chat/completions (pure).

A request body is reduced to one :class:`EngineRequest`. Its ``input_ids`` are
what SGLang would prefill:

* ``input_ids`` (``/generate``) or a list of ints as ``prompt`` (completions): as given;
* text (``text``, ``prompt``) and chat ``messages``: the served model's tokenizer,
  as SGLang's own paths apply it (:class:`prfaas_sglang.tokenizer.PromptTokenizer`);
* with no tokenizer, ``text_ids`` (a callable, the emulated engine's explicit
  fallback: one pseudo-token per word) or, when there is none, a 400 that says
  to send ``input_ids`` or configure a tokenizer.

The response side renders token ids with ``detokenize`` (the tokenizer's
decode, or the emulated engine's `` t<id>`` pseudo-text) in SGLang's
/generate and OpenAI shapes, streaming or not, with ``stream_options.include_usage``.
"""

from __future__ import annotations

import hashlib
import json
import struct
import sys
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from prfaas_sglang.errors import TokenizeError
from prfaas_sglang.wire.token_ids import JsonIds

if TYPE_CHECKING:  # pragma: no cover
    from prfaas_sglang.tokenizer import PromptTokenizer

MAX_TOKEN_ID = 2**31 - 1
# A state checkpoint asked for at this prompt length (tokens), in SGLang's pass-through
# ``custom_params`` (``sampling_params.custom_params`` on /generate, top-level on the OpenAI
# endpoints): the router sets it on a prefill leg, a client may set it too; SGLang keeps
# custom_params on the request untouched, our cache backend reads it (hooks/hybrid_cache.py).
CHECKPOINT_PARAM = "prfaas_checkpoint_tokens"
# Where a body's token ids sit, per endpoint kind (chat has none): what parse_request reads.
ID_KEYS = {"generate": "input_ids", "completions": "prompt"}
Detokenize = Callable[[Sequence[int]], str]


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
    input_ids: Sequence[int]  # a tuple, or a JsonIds the router cut from the raw body (immutable both)
    max_new_tokens: int
    stream: bool
    rid: str
    model: str | None
    bootstrap: Bootstrap | None
    include_usage: bool = False  # stream_options.include_usage (OpenAI kinds)
    continuous_usage: bool = False  # stream_options.continuous_usage_stats (OpenAI kinds): the usage in every chunk
    created: int = 0  # unix seconds, stamped by the adapter that parsed it
    checkpoint_tokens: int | None = None  # custom_params.prfaas_checkpoint_tokens: a state checkpoint asked for there

    @property
    def kv_tokens(self) -> int:
        """Tokens of KV this request may hold on a decode worker: prompt + every output token."""
        return len(self.input_ids) + self.max_new_tokens


def prompt_seed(input_ids) -> int:
    """Seed of the emulated engine's outputs: a function of the prompt alone, like greedy decoding."""
    digest = hashlib.blake2b(struct.pack(f"<{len(input_ids)}I", *input_ids), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def output_token(seed: int, position: int, vocab: int) -> int:
    digest = hashlib.blake2b(f"{seed}:{position}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little") % vocab


def _int_list(value: Any, field_name: str) -> list[int]:
    """``value`` if it is a list of token ids (exact ``int``s in 0..MAX_TOKEN_ID), else BadRequest.
    A :class:`JsonIds` was checked when it was cut from the body and passes as it is.

    C-speed for a 32K-token prompt (about 0.5 ms): packing into ``array("I")`` rejects
    non-integers, negatives and ids of 2**32 and more; the top bit of each packed id then
    finds those over MAX_TOKEN_ID. ``bool`` is the one ``int`` subclass JSON yields and packs
    as 0/1, so the exact type scan runs only for a prompt holding a 0 or a 1.
    """
    if isinstance(value, JsonIds):
        return value
    if not isinstance(value, list):
        raise BadRequest(400, f"{field_name} must be a list of token ids")
    try:
        packed = array("I", value)
    except TypeError:
        raise BadRequest(400, f"{field_name} must be a list of token ids") from None
    except OverflowError:
        raise BadRequest(400, f"{field_name} has a token id outside 0..{MAX_TOKEN_ID}") from None
    raw = packed.tobytes()
    if _has_0_or_1(raw, len(value)) and not set(map(type, value)) <= {int}:  # a 0 or 1 may be a bool
        raise BadRequest(400, f"{field_name} must be a list of token ids")
    high_bytes = raw[3::4] if sys.byteorder == "little" else raw[0::4]
    if high_bytes.translate(None, _LOW_HALF):  # some id has its top bit set: > 2**31 - 1
        raise BadRequest(400, f"{field_name} has a token id outside 0..{MAX_TOKEN_ID}")
    return value


_LOW_HALF = bytes(range(0x80))
_NOT_0_OR_1 = bytes([0, 0] + [1] * 254)  # translate table: byte 0 or 1 -> 0, anything else -> 1


def _has_0_or_1(packed: bytes, n: int) -> bool:
    """Whether any of the ``n`` uint32 words in ``packed`` (native order) is 0 or 1, in C time.

    Word i is <= 1 iff its three high bytes are 0 and its low byte is 0 or 1. Taking every 4th
    byte gives one byte string per byte position; OR-ing them as big integers (the low byte
    first mapped to 0 for 0/1, else 1) leaves a zero byte exactly at such words::

        packed:  | w0: b0 b1 b2 b3 | w1: b0 b1 b2 b3 | ...      (little-endian)
        lanes:   b0s = packed[0::4], b1s = packed[1::4], ...     (one byte per word)
        merged:  b0s' | b1s | b2s | b3s  -> byte i == 0  <=>  word i in {0, 1}
    """
    low, highs = (0, (1, 2, 3)) if sys.byteorder == "little" else (3, (0, 1, 2))
    merged = int.from_bytes(packed[low::4].translate(_NOT_0_OR_1), "big")
    for k in highs:
        merged |= int.from_bytes(packed[k::4], "big")
    return 0 in merged.to_bytes(n, "big")


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
    if isinstance(room, list) or isinstance(host, list):
        raise BadRequest(400, "batched requests are not supported")
    if not isinstance(host, str) or isinstance(port, bool) or not isinstance(port, int) or not isinstance(room, int) or isinstance(room, bool):
        raise BadRequest(400, "bootstrap_host must be a string, bootstrap_port and bootstrap_room integers")
    return Bootstrap(host, port, room)


def _text_ids(text: str, tokenizer: PromptTokenizer | None, text_ids: Callable[[str], list[int]] | None) -> list[int]:
    if tokenizer is not None:
        return tokenizer.encode_text(text)
    if text_ids is not None:
        return text_ids(text)
    raise BadRequest(400, "this server has no tokenizer: send token ids (input_ids, or prompt as a list of ints), "
                          "or configure model.tokenizer in the topology")


MAX_RID_CHARS = 256


def _rid(value: Any) -> str | None:
    """A client's request id: 1 to 256 visible ASCII characters (it is echoed in the
    ``x-request-id`` header and in logs, so no control characters, spaces or line breaks)."""
    if value is None:
        return None
    if not isinstance(value, str) or not 0 < len(value) <= MAX_RID_CHARS or not value.isascii() \
            or not all(33 <= ord(c) <= 126 for c in value):
        raise BadRequest(400, f"rid must be 1 to {MAX_RID_CHARS} visible ASCII characters (no spaces or control characters)")
    return value


def parse_request(kind: str, body: Any, rid: str, created_s: int = 0, tokenizer: PromptTokenizer | None = None,
                  text_ids: Callable[[str], list[int]] | None = None) -> EngineRequest:
    """Validate a decoded JSON body; raise :class:`BadRequest` naming the offending field.

    ``created_s`` stamps the OpenAI ``created`` field (the caller's clock)."""
    if not isinstance(body, dict):
        raise BadRequest(400, "request body must be a JSON object")
    try:
        if kind == "generate":
            params = body.get("sampling_params") or {}
            if not isinstance(params, dict):
                raise BadRequest(400, "sampling_params must be an object")
            if body.get("input_ids") is not None:
                ids = _int_list(body["input_ids"], "input_ids")
            elif isinstance(body.get("text"), str):
                ids = _text_ids(body["text"], tokenizer, text_ids)
            else:
                raise BadRequest(400, "one of input_ids or text (a string) is required")
            max_new = _positive_int(params.get("max_new_tokens"), "sampling_params.max_new_tokens", 128)
        elif kind == "completions":
            prompt = body.get("prompt")
            if isinstance(prompt, str):
                ids = _text_ids(prompt, tokenizer, text_ids)
            elif isinstance(prompt, JsonIds) or (isinstance(prompt, list) and prompt and not isinstance(prompt[0], (str, list))):
                ids = _int_list(prompt, "prompt")
            else:
                raise BadRequest(400, "prompt must be a string or a non-empty list of token ids")
            max_new = _positive_int(body.get("max_tokens"), "max_tokens", 16)
        elif kind == "chat":
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                raise BadRequest(400, "messages must be a non-empty list")
            if tokenizer is not None:
                ids = tokenizer.encode_chat(body)
            else:
                ids = _text_ids(_chat_as_text(messages), None, text_ids)
            max_new = _positive_int(body.get("max_completion_tokens", body.get("max_tokens")), "max_tokens", 128)
        else:  # pragma: no cover - routes are fixed
            raise BadRequest(404, f"unknown endpoint kind {kind}")
    except TokenizeError as err:
        raise BadRequest(400, str(err)) from None
    if not ids:
        raise BadRequest(400, "the prompt is empty")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest(400, "stream must be true or false")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise BadRequest(400, "stream_options must be an object")
    include_usage = bool(options and options.get("include_usage") is True and kind != "generate")
    continuous_usage = bool(options and options.get("continuous_usage_stats") is True and kind != "generate")
    model = body.get("model")
    rid_value = _rid(body.get("rid"))
    return EngineRequest(kind, ids if isinstance(ids, JsonIds) else tuple(ids), max_new, stream, rid_value or rid,
                         model if isinstance(model, str) else None, _bootstrap(body), include_usage, continuous_usage,
                         created_s, checkpoint_tokens(custom_params(kind, body)))


def custom_params(kind: str, body: dict) -> dict | None:
    """SGLang's ``custom_params`` of a request body (where ``kind``'s endpoint takes them), or None.
    Raises BadRequest when they are there but not an object."""
    holder = body.get("sampling_params") if kind == "generate" else body
    value = holder.get("custom_params") if isinstance(holder, dict) else None
    if value is not None and not isinstance(value, dict):
        raise BadRequest(400, "custom_params must be an object")
    return value


def with_checkpoint(kind: str, body: dict, at_tokens: int) -> dict:
    """The top-level members that set ``custom_params.prfaas_checkpoint_tokens`` on ``body`` (the
    client's other custom and sampling params kept): appended to a leg's JSON, they replace the
    client's (``router.server.leg_bytes``)."""
    params = {**(custom_params(kind, body) or {}), CHECKPOINT_PARAM: at_tokens}
    if kind == "generate":
        return {"sampling_params": {**(body.get("sampling_params") or {}), "custom_params": params}}
    return {"custom_params": params}


def checkpoint_tokens(params: dict | None) -> int | None:
    """The checkpoint hint in a request's ``custom_params`` (None: none). Raises BadRequest when it is
    not a positive integer."""
    value = None if params is None else params.get(CHECKPOINT_PARAM)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_TOKEN_ID:
        raise BadRequest(400, f"custom_params.{CHECKPOINT_PARAM} must be a positive integer (a prompt length in tokens)")
    return value


def _chat_as_text(messages: list) -> str:
    """Chat messages flattened for a tokenizer-less fallback (the emulated engine's pseudo-tokens)."""
    words = []
    for i, message in enumerate(messages):
        content = message.get("content", "") if isinstance(message, dict) else None
        if not isinstance(message, dict) or not isinstance(content, (str, type(None))) or "role" not in message:
            raise BadRequest(400, f"messages[{i}] must have a role and string content")
        words.append(f"<{message['role']}> {content or ''}")
    return " ".join(words)


def _usage(req: EngineRequest, tokens: Sequence[int], cached_tokens: int) -> dict:
    return {"prompt_tokens": len(req.input_ids), "completion_tokens": len(tokens),
            "total_tokens": len(req.input_ids) + len(tokens),
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def meta_info(req: EngineRequest, tokens: Sequence[int], finished: bool, cached_tokens: int, extra: dict) -> dict:
    meta = {
        "id": req.rid,
        "prompt_tokens": len(req.input_ids),
        "completion_tokens": len(tokens),
        "cached_tokens": cached_tokens,
        "finish_reason": {"type": "length", "length": len(tokens)} if finished else None,
    }
    meta.update(extra)
    return meta


def full_response(req: EngineRequest, tokens: list[int], cached_tokens: int, model: str, extra: dict,
                  detokenize: Detokenize) -> dict:
    """The non-streaming body for ``req.kind``."""
    text = detokenize(tokens)
    meta = meta_info(req, tokens, True, cached_tokens, extra)
    if req.kind == "generate":
        return {"text": text, "output_ids": tokens, "meta_info": meta}
    if req.kind == "completions":
        return {"id": f"cmpl-{req.rid}", "object": "text_completion", "created": req.created, "model": model,
                "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": "length"}],
                "usage": _usage(req, tokens, cached_tokens), "meta_info": meta}
    return {"id": f"chatcmpl-{req.rid}", "object": "chat.completion", "created": req.created, "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"}],
            "usage": _usage(req, tokens, cached_tokens), "meta_info": meta}


def stream_chunk(req: EngineRequest, tokens: list[int], delta_text: str, finished: bool, cached_tokens: int, model: str,
                 extra: dict, text: str) -> str:
    """One SSE event (``data: ...\\n\\n``): ``text`` is all output so far, ``delta_text`` its new part."""
    if req.kind == "generate":
        body = {"text": text, "output_ids": tokens, "meta_info": meta_info(req, tokens, finished, cached_tokens, extra)}
    elif req.kind == "completions":
        body = {"id": f"cmpl-{req.rid}", "object": "text_completion", "created": req.created, "model": model,
                "choices": [{"index": 0, "text": delta_text, "logprobs": None, "finish_reason": "length" if finished else None}]}
    else:
        body = {"id": f"chatcmpl-{req.rid}", "object": "chat.completion.chunk", "created": req.created, "model": model,
                "choices": [{"index": 0, "delta": {"role": "assistant", "content": delta_text} if delta_text or not finished else {},
                             "finish_reason": "length" if finished else None}]}
    if req.continuous_usage:  # as SGLang's stream_options.continuous_usage_stats (parse_request: OpenAI kinds only)
        body["usage"] = _usage(req, tokens, cached_tokens)
    return f"data: {json.dumps(body)}\n\n"


def usage_chunk(req: EngineRequest, tokens: list[int], cached_tokens: int, model: str) -> str:
    """The final ``include_usage`` event of an OpenAI stream: no choices, the usage."""
    obj = "chat.completion.chunk" if req.kind == "chat" else "text_completion"
    prefix = "chatcmpl" if req.kind == "chat" else "cmpl"
    body = {"id": f"{prefix}-{req.rid}", "object": obj, "created": req.created, "model": model, "choices": [],
            "usage": _usage(req, tokens, cached_tokens)}
    return f"data: {json.dumps(body)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def stream_error(req: EngineRequest, status: int, message: str) -> str:
    """A failure as SGLang 0.5.15 streams it after its 200 (then ``SSE_DONE``): ``/generate``
    reports a server-side abort (5xx) in ``meta_info.finish_reason`` and a bad request as an
    ``error`` object; the OpenAI routes send ``{"error": ErrorResponse}`` for both."""
    if req.kind == "generate" and status >= 500:
        body = {"text": "", "output_ids": [], "meta_info": {
            "id": req.rid, "finish_reason": {"type": "abort", "message": message, "status_code": status}}}
    elif req.kind == "generate":
        body = {"error": {"message": message, "type": "invalid_request_error", "code": status, "retryable": False}}
    else:
        body = {"error": {"object": "error", "message": message, "type": "BadRequestError" if status < 500 else
                          "InternalServerError", "param": None, "code": status}}
    return f"data: {json.dumps(body)}\n\n"


def error_body(status: int, message: str) -> dict:
    """An error answer in SGLang's shape (the emulated engine's, and the cache-move routes')."""
    kind = "BadRequestError" if status < 500 else "ServiceUnavailableError" if status in (503, 504) else "InternalServerError"
    return {"error": {"message": message, "type": kind, "code": status}}


def ends_event(data: bytes) -> bool:
    """Whether bytes of an SSE stream end at an event boundary (a blank line)."""
    return data.endswith((b"\n\n", b"\r\n\r\n"))


def stream_failed_event(status: int, message: str, at_event_end: bool = True) -> bytes:
    """What ends an SSE stream that broke after it started (the router's decode leg, the front's
    relay): an error event in SGLang's shape, then ``[DONE]``. ``at_event_end`` False: the bytes
    sent so far stop inside an event, which is closed first (its partial data line then ends as
    it was; a client drops it as malformed)."""
    event = "data: " + json.dumps({"error": {"message": message, "code": status, "type": "stream_failed"}}) + "\n\n"
    return (b"" if at_event_end else b"\n\n") + event.encode() + b"data: [DONE]\n\n"


def stream_failure(event: bytes) -> int | None:
    """The HTTP status an SSE event reports a failure with, or None for an ordinary event.

    SGLang 0.5.15 answers a streamed request with 200 at once and reports a later failure as an
    event: an aborted request (a failed KV transfer is one) as ``meta_info.finish_reason`` =
    ``{"type": "abort", "status_code": 500, ...}``, an exception as ``{"error": {"code": 400, ...}}``
    (the OpenAI routes: ``{"object": "error", "code": ...}``). ``event`` is the stream's bytes from
    an event's start; only that first event (``data: ...`` up to its blank line) is read, and
    anything unparsable is an ordinary event.
    """
    ends = [i for i in (event.find(b"\n\n"), event.find(b"\r\n\r\n")) if i >= 0]
    data = (event[:min(ends)] if ends else event).strip()
    if not data.startswith(b"data:"):
        return None
    try:
        obj = json.loads(data[5:])
    except ValueError:
        return None
    return event_failure(obj)


def event_failure(obj) -> int | None:
    """:func:`stream_failure` of an event already parsed (its ``data:`` JSON)."""
    if not isinstance(obj, dict):
        return None
    error = obj.get("error")
    if isinstance(error, dict) or obj.get("object") == "error":
        code = (error if isinstance(error, dict) else obj).get("code")
        return code if isinstance(code, int) and 400 <= code < 600 else 500
    meta = obj.get("meta_info")
    reason = meta.get("finish_reason") if isinstance(meta, dict) else None
    if isinstance(reason, dict) and reason.get("type") == "abort":
        code = reason.get("status_code")  # none: a graceful abort (the client's), an ordinary end
        return code if isinstance(code, int) and 400 <= code < 600 else None
    return None
