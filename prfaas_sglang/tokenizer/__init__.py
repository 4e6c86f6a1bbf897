"""Token ids as SGLang 0.5.15 computes them, for the router and the emulated engine (adapter).

The router must route on the ids the engine will prefill, so it tokenizes
exactly as SGLang's own paths do (Hugging Face ``transformers``, loaded with
SGLang's settings: fast tokenizer, ``clean_up_tokenization_spaces=False``):

* text (``/generate`` ``text``, ``/v1/completions`` ``prompt``): the
  TokenizerManager calls ``tokenizer([text])``, default special tokens
  (``managers/tokenizer_manager.py`` ``_tokenize_texts``);
* chat (``/v1/chat/completions``): ``OpenAIServingChat._apply_jinja_template``:
  messages as SGLang's pydantic models validate and dump them (``user`` exact,
  the other roles case-insensitive and lower-cased; a user message needs
  content; ``None`` fields dropped, ``content: None`` -> ``""``); list content flattened or kept
  by the template's detected content format (``string`` | ``openai``, the same
  AST test as SGLang/vLLM); a trailing assistant message becomes the prefix to
  continue (``continue_final_message``) or a user message; the template
  rendered with ``add_generation_prompt=True``, ``tools``, ``reasoning_effort``
  and ``chat_template_kwargs``; then ``encode(rendered)``, with
  ``add_special_tokens=False`` when the tokenizer adds specials to ``""``.

``tests/router/test_tokenizer.py`` checks the ids against SGLang 0.5.15's own
classes on CPU. Requests SGLang would tokenize through a multimodal
processor (image, audio or video parts) raise :class:`TokenizeError`.

``load("prfaas-tiny-chatml")`` resolves a shipped tokenizer
(``tokenizer/data/``); anything else is a directory or hub id for
``AutoTokenizer`` (a directory whose config names ``PreTrainedTokenizerFast``
loads with that class directly, as AutoTokenizer would: ``_loader``).
``train`` is the shipped tokenizer's recipe (``python -m prfaas_sglang.tokenizer.train``).
"""

from __future__ import annotations

import copy
import functools
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from prfaas_sglang._compat import tool_function_dump, tools_as_sent
from prfaas_sglang.errors import ConfigError, TokenizeError

# The layering map (docs/architecture.md, checked by tests/unit/test_layering.py): an I/O package;
# these modules of it are pure.
PURE_MODULES = ()

# tools_as_sent: the upstream adapter's decision, from the workers' reported release (the router's import)
__all__ = ["PromptTokenizer", "TokenizeError", "detect_content_format", "resolve", "tools_as_sent", "SHIPPED"]

DATA_DIR = Path(__file__).resolve().parent / "data"
SHIPPED = "prfaas-tiny-chatml"
# SGLang's ChatCompletionMessageGenericParam roles (case-insensitive); "user" is its own, exact, type.
_GENERIC_ROLES = ("system", "assistant", "tool", "function", "developer", "latest_reminder")
_MESSAGE_KEYS = ("role", "content", "tool_call_id", "name", "reasoning_content", "tool_calls", "tools")


def resolve(ref: str, base_dir: Path | None = None) -> str:
    """A shipped tokenizer's name, a directory (relative to ``base_dir``) or a hub id -> what to load."""
    shipped = DATA_DIR / ref
    if shipped.is_dir():
        return str(shipped)
    path = Path(ref).expanduser()
    if not path.is_absolute() and base_dir is not None and ref.startswith(("./", "../")):
        path = base_dir / path
    return str(path.resolve()) if path.exists() else ref


def _loader(source: str) -> Any:
    """What loads ``source``: ``AutoTokenizer``, except for a directory that holds no model config and whose
    ``tokenizer_config.json`` names ``PreTrainedTokenizerFast`` and no code of its own (the shipped
    tokenizers), which AutoTokenizer would load with that very class. Imported alone, that class saves every
    process that loads such a tokenizer (emulated engines, routers) the auto classes' model mappings: an
    emulated engine with one started in 2.6 CPU-s instead of 4.1 (2026-12-01)."""
    path = Path(source)
    try:
        config = json.loads((path / "tokenizer_config.json").read_text()) if path.is_dir() else {}
    except (OSError, ValueError):
        config = {}
    if (config.get("tokenizer_class") == "PreTrainedTokenizerFast" and "auto_map" not in config
            and not (path / "config.json").exists()):
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast
    from transformers import AutoTokenizer

    return AutoTokenizer


class PromptTokenizer:
    """One loaded tokenizer; ``encode_*`` are pure functions of the request (thread-safe reads).
    ``tools_as_sent``: render tools as SGLang >= 0.5.23 does (the upstream adapter's
    :func:`~prfaas_sglang._compat.tools_as_sent`); the router sets it from the workers' release."""

    def __init__(self, tokenizer: Any, source: str, tools_as_sent: bool = False):
        self.tokenizer = tokenizer
        self.source = source
        self.tools_as_sent = tools_as_sent
        self.chat_template = getattr(tokenizer, "chat_template", None)
        self.content_format = detect_content_format(self.chat_template) if self.chat_template else "string"
        try:
            self.auto_adds_specials = len(tokenizer.encode("")) > 0
        except Exception:  # noqa: BLE001 - as SGLang: assume it does
            self.auto_adds_specials = True
        self.special_ids = frozenset(tokenizer.all_special_ids)

    @classmethod
    def load(cls, ref: str, base_dir: Path | None = None, tools_as_sent: bool = False) -> PromptTokenizer:
        source = resolve(ref, base_dir)
        try:
            tok = _loader(source).from_pretrained(source, clean_up_tokenization_spaces=False, use_fast=True)
        except (OSError, ValueError) as err:
            raise ConfigError("tokenizer", f"cannot load tokenizer {ref!r}: {str(err).splitlines()[0]}") from None
        return cls(tok, source, tools_as_sent)

    @property
    def vocab_size(self) -> int:
        return len(self.tokenizer)

    @functools.cached_property
    def max_chars_per_token(self) -> int:
        """The most characters one token can stand for: the longest entry of the vocabulary (byte-level
        entries count bytes, which bounds characters). A text of N characters has at least
        N / this many tokens, if the normaliser drops none; see ``least_tokens``."""
        try:
            return max((len(k) for k in self.tokenizer.get_vocab()), default=1) or 1
        except Exception:  # noqa: BLE001 - a tokenizer without get_vocab: no bound
            return 1 << 30

    def least_tokens(self, non_space_chars: int) -> int:
        """A lower bound on the tokens of a text with ``non_space_chars`` characters other than
        ASCII whitespace, with a factor of 2 to spare for normalisers that join characters (NFKC
        composing accents); whitespace is not counted, as some normalisers collapse it."""
        return non_space_chars // (2 * self.max_chars_per_token)

    def encode_text(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise TokenizeError("text must be a string")
        if getattr(self.tokenizer, "is_fast", False):
            return list(self.tokenizer([text])["input_ids"][0])
        return list(self.tokenizer.encode(text))

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def encode_chat(self, body: dict) -> list[int]:
        """Ids of a ``/v1/chat/completions`` body's prompt (``messages``, ``tools``, ``tool_choice``,
        ``continue_final_message``, ``reasoning_effort``, ``chat_template_kwargs``)."""
        if self.chat_template is None:
            raise TokenizeError(f"tokenizer {self.source} has no chat template")
        messages = [_dump_message(m, i) for i, m in enumerate(_list(body.get("messages"), "messages"))]
        if not messages:
            raise TokenizeError("messages must be a non-empty list")
        tools = _tools(body, self.tools_as_sent)
        for msg in messages:
            _normalize_tool_call_arguments(msg)
        processed = []
        for msg in copy.deepcopy(messages):
            if msg.get("content") is None:
                msg["content"] = ""
            msg = _content_for_format(msg, self.content_format)
            if msg["role"] == "tool" and isinstance(msg.get("content"), list) and all(
                    (isinstance(p, dict) and p.get("type") == "text") or isinstance(p, str) for p in msg["content"]):
                msg["content"] = " ".join(p.get("text", "") if isinstance(p, dict) else p for p in msg["content"])
            processed.append(msg)
        prefix = None
        if processed and processed[-1].get("role") == "assistant" and isinstance(processed[-1].get("content"), str):
            if body.get("continue_final_message") is True:
                prefix = processed.pop()["content"]
            else:
                processed[-1] = {"role": "user", "content": processed[-1]["content"]}
        kwargs: dict[str, Any] = {}
        if body.get("reasoning_effort") is not None:
            kwargs["reasoning_effort"] = body["reasoning_effort"]
        extra = body.get("chat_template_kwargs")
        if extra is not None:
            if not isinstance(extra, dict):
                raise TokenizeError("chat_template_kwargs must be an object")
            kwargs.update(extra)
        encode_kwargs = {"add_special_tokens": False} if self.auto_adds_specials else {}
        try:
            rendered = self.tokenizer.apply_chat_template(processed, tokenize=False, add_generation_prompt=True,
                                                          tools=tools, return_dict=False, **kwargs)
        except Exception as err:  # noqa: BLE001 - jinja errors of any kind are the request's fault
            raise TokenizeError(f"chat template failed: {err}") from None
        ids = list(self.tokenizer.encode(rendered, **encode_kwargs))
        if prefix:
            more = list(self.tokenizer.encode(prefix))
            if more and more[0] == self.tokenizer.bos_token_id:
                more = more[1:]
            ids += more
        return ids


def _list(value: Any, name: str) -> list:
    if not isinstance(value, list):
        raise TokenizeError(f"{name} must be a list")
    return value


def _dump_message(raw: Any, index: int) -> dict:
    """A message as SGLang's ``ChatCompletionMessage*Param.model_dump()`` with ``None`` fields dropped."""
    if not isinstance(raw, dict):
        raise TokenizeError(f"messages[{index}] must be an object")
    role = raw.get("role")
    if role != "user" and (not isinstance(role, str) or role.lower() not in _GENERIC_ROLES):
        raise TokenizeError(f"messages[{index}].role must be user or one of {', '.join(_GENERIC_ROLES)}")
    content = raw.get("content")
    if role == "user" and not isinstance(content, (str, list)):
        raise TokenizeError(f"messages[{index}].content of a user message must be a string or a list of parts")
    if content is not None and not isinstance(content, (str, list)):
        raise TokenizeError(f"messages[{index}].content must be a string, a list of parts or null")
    if isinstance(content, list):
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in ("text", "input_text"):
                if not isinstance(part.get("text"), str):
                    raise TokenizeError(f"messages[{index}].content[{j}].text must be a string")
            elif kind in ("image_url", "input_image", "video_url", "audio_url"):
                raise TokenizeError(f"messages[{index}].content[{j}]: multimodal content is not supported")
            else:
                raise TokenizeError(f"messages[{index}].content[{j}] must be a text part")
    out = {"role": role.lower()}
    for key in _MESSAGE_KEYS[1:]:
        if key in raw:
            out[key] = raw[key]
    return out


def _normalize_tool_call_arguments(message: dict) -> None:
    if message.get("role") != "assistant" or not isinstance(message.get("tool_calls"), list):
        return
    for item in message["tool_calls"]:
        function = item.get("function") if isinstance(item, dict) else None
        if isinstance(function, dict) and isinstance(function.get("arguments"), str):
            try:
                parsed = json.loads(function["arguments"])
            except json.JSONDecodeError:
                parsed = {}
            function["arguments"] = parsed if isinstance(parsed, dict) else {}


def _content_for_format(msg: dict, content_format: str) -> dict:
    content = msg.get("content")
    if not isinstance(content, list):
        return {k: v for k, v in msg.items() if v is not None}
    if content_format == "openai":
        parts = [{"type": "text", "text": p["text"]} for p in content if p.get("type") in ("text", "input_text")]
        out = {k: v for k, v in msg.items() if v is not None and k != "content"}
        out["content"] = parts
        return out
    texts = [p["text"] for p in content if p.get("type") in ("text", "input_text")]
    out = {**msg, "content": " ".join(texts) if texts else ""}
    return {k: v for k, v in out.items() if v is not None}


def _tools(body: dict, as_sent: bool = False) -> list[dict] | None:
    """``request.tools`` as SGLang dumps them (``Tool`` / ``Function`` field order and defaults; ``as_sent``:
    0.5.23's ``Function``, the client's keys in its order, ``strict`` and ``defer_loading`` only when set:
    the upstream adapter's :func:`~prfaas_sglang._compat.tool_function_dump`)."""
    raw = body.get("tools")
    choice = body.get("tool_choice", "auto")
    if not raw or choice == "none":
        return None
    tools = []
    for i, tool in enumerate(_list(raw, "tools")):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise TokenizeError(f"tools[{i}].function.name is required")
        defer = tool.get("defer_loading")
        fn_defer = fn.get("defer_loading") if fn.get("defer_loading") is not None else defer
        function = tool_function_dump(fn, fn_defer, as_sent)
        tools.append({"type": tool.get("type", "function"), "function": function, "defer_loading": defer})
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name")
        tools = [t for t in tools if t["function"]["name"] == name]
    return tools


def detect_content_format(chat_template: str) -> str:
    """``openai`` when the template loops over a message's content (list parts), else ``string``.

    The test SGLang 0.5.15 applies (``parser/jinja_template_utils.py``, adapted from vLLM):
    any of image/audio/video/vision in the text -> openai; a ``for`` over
    ``message.content`` / ``msg.content`` / ``m.content`` (through filters, tests or
    slices) -> openai; a template that does not parse -> string.
    """
    import jinja2
    import jinja2.nodes as n

    if any(word in chat_template for word in ("image", "audio", "video", "vision")):
        return "openai"
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template

        ast = _compile_jinja_template(chat_template).environment.parse(chat_template)
    except Exception:  # noqa: BLE001 - unparsable: SGLang falls back to string
        return "string"

    def var(node, name):
        return isinstance(node, n.Name) and node.ctx == "load" and node.name == name

    def attr(node, name, key):
        if isinstance(node, n.Getitem):
            return var(node.node, name) and isinstance(node.arg, n.Const) and node.arg.value == key
        return isinstance(node, n.Getattr) and var(node.node, name) and node.attr == key

    def access(node, name, key):
        if isinstance(node, n.Filter):
            return node.node is not None and access(node.node, name, key)
        if isinstance(node, n.Test):
            return access(node.node, name, key)
        if isinstance(node, n.Getitem) and isinstance(node.arg, n.Slice):
            return access(node.node, name, key)
        return attr(node, name, key)

    try:
        for loop in ast.find_all(jinja2.nodes.For):
            if any(access(loop.iter, name, "content") for name in ("message", "msg", "m")):
                return "openai"
    except Exception:  # noqa: BLE001
        return "string"
    return "string"
