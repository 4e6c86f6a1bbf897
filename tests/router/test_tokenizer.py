"""The router's token ids equal those SGLang's own tokenizer paths compute (its classes, on CPU), on each
supported release (0.5.15 and 0.5.23).

SGLang's side (:class:`SGLangPaths`): a ``TokenizerManager`` filled by its own ``init_model_config`` and
``init_tokenizer_and_processor`` (its loader ``get_tokenizer``), ``TemplateManager`` (chat-template and
content-format detection), ``OpenAIServingChat._process_messages`` (chat) and
``TokenizerManager._tokenize_texts`` (text).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import importlib.util
import json
import os
import shutil
from unittest import mock

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prfaas_sglang.tokenizer import (
    DATA_DIR,
    SHIPPED,
    PromptTokenizer,
    TokenizeError,
    detect_content_format,
    tools_as_sent,
)

STRING_TEMPLATE = (  # content is used as a string: SGLang flattens list parts with spaces
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def variant(tmp_path, name: str, template: str | None = None, bos: bool = False):
    """The shipped tokenizer with another chat template, or one that prepends a BOS token."""
    from tokenizers import Tokenizer, processors

    out = tmp_path / name
    shutil.copytree(DATA_DIR / SHIPPED, out)
    config = json.loads((out / "tokenizer_config.json").read_text())
    if template is not None:
        config["chat_template"] = template
    if bos:
        tok = Tokenizer.from_file(str(out / "tokenizer.json"))
        tok.post_processor = processors.TemplateProcessing(single="<|endoftext|> $A", pair="<|endoftext|> $A $B",
                                                           special_tokens=[("<|endoftext|>", tok.token_to_id("<|endoftext|>"))])
        tok.save(str(out / "tokenizer.json"))
        config["bos_token"] = "<|endoftext|>"
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return str(out)


def first_difference(ours: PromptTokenizer, mine: list[int], sglangs: list[int]) -> str:
    """Where the router's ids and SGLang's part, as text (special tokens kept), for a failing assertion."""
    at = next((i for i, (a, b) in enumerate(zip(mine, sglangs, strict=False)) if a != b), min(len(mine), len(sglangs)))

    def text(ids: list[int]) -> str:
        return ours.tokenizer.decode(ids[max(0, at - 24):at + 64], skip_special_tokens=False)

    return (f"the router's ids ({len(mine)}) and SGLang's ({len(sglangs)}) part at token {at}:\n"
            f"  router: ...{text(mine)!r}...\n  SGLang: ...{text(sglangs)!r}...")


class SGLangPaths:
    """SGLang's tokenization of one tokenizer, through its own classes (on CPU, no processes, no sockets).

    Both releases: the ``ServerArgs`` of a launch of the tiny model with this tokenizer
    (``--tokenizer-path``), a ``TokenizerManager`` that its own ``init_model_config`` and
    ``init_tokenizer_and_processor`` fill (its loader ``get_tokenizer`` with the server's arguments),
    ``TemplateManager.initialize_templates`` as the engine calls it (chat-template and content-format
    detection), ``OpenAIServingChat(manager, templates)._process_messages`` (chat) and the manager's
    ``_tokenize_texts`` (text).

    0.5.15: ``TemplateManager`` is in ``sglang.srt.managers.template_manager``; the manager, the chat
    server and the templates read the config from ``manager.server_args``.
    0.5.23: ``TemplateManager`` moved to ``sglang.srt.parser.template_manager``; the config is read from
    the published runtime context (``get_serving()``, ``get_model()``, ``manager.config_value(...)``), so
    the ``ServerArgs`` is published, as the tokenizer process publishes it (role ``tokenizer``), into a
    context of its own (``create_context``) that building and every call activate (``use_context``): the
    process's own context stays as it was. Which applies is decided by what the modules provide.
    """

    def __init__(self, path: str):
        from helpers import REPO_ROOT
        from sglang.srt import runtime_context
        from sglang.srt.entrypoints.openai.serving_chat import OpenAIServingChat
        from sglang.srt.managers.tokenizer_manager import TokenizerManager
        from sglang.srt.server_args import ServerArgs

        moved = "sglang.srt.parser.template_manager"  # 0.5.23; 0.5.15: sglang.srt.managers.template_manager
        TemplateManager = importlib.import_module(
            moved if importlib.util.find_spec(moved) else "sglang.srt.managers.template_manager").TemplateManager

        with mock.patch.dict(os.environ):  # resolving the arguments exports defaults for the server's processes
            # CPU settings the tiny (hybrid Mamba) model's argument checks require; no tokenization reads them.
            server_args = ServerArgs(model_path=str(REPO_ROOT / "tests" / "fixtures" / "models" / "tiny-qwen3-next"),
                                     tokenizer_path=path, device="cpu", mamba_radix_cache_strategy="no_buffer",
                                     disable_overlap_schedule=True)
            self.context = (runtime_context.create_context(server_args, role="tokenizer")  # 0.5.23
                            if hasattr(runtime_context, "create_context") else None)
        with self.active():
            self.manager = object.__new__(TokenizerManager)
            self.manager.server_args = server_args
            self.manager.init_model_config()
            self.manager.init_tokenizer_and_processor()
            self.templates = TemplateManager()
            self.templates.initialize_templates(self.manager, model_path=self.manager.model_path)
            self.chat = OpenAIServingChat(self.manager, self.templates)

    def active(self):
        """0.5.23: this server's published config, for the duration; 0.5.15 publishes none."""
        if self.context is None:
            return contextlib.nullcontext()
        from sglang.srt.runtime_context import use_context

        return use_context(self.context)

    def chat_ids(self, body: dict) -> list[int]:
        from sglang.srt.entrypoints.openai.protocol import ChatCompletionRequest

        with self.active():
            request = ChatCompletionRequest(model="m", **body)
            return list(self.chat._process_messages(request, is_multimodal=False).prompt_ids)

    def text_ids(self, text: str) -> list[int]:
        with self.active():
            ids, _ = asyncio.run(self.manager._tokenize_texts(text))
        return list(ids)


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tok")
    paths = {"shipped (openai content)": str(DATA_DIR / SHIPPED),
             "string content": variant(tmp, "string", STRING_TEMPLATE),
             "bos-adding": variant(tmp, "bos", bos=True)}
    import sglang  # the router renders tools as its workers' release does: here, the installed one

    return {name: (PromptTokenizer.load(path, tools_as_sent=tools_as_sent(sglang.__version__)), SGLangPaths(path))
            for name, path in paths.items()}


LONG = " ".join(f"word{i % 97} prefill{i % 13}" for i in range(6_000))
CHATS = [
    {"messages": [{"role": "user", "content": "hi"}]},
    {"messages": [{"role": "system", "content": "You are brief."}, {"role": "user", "content": "Explain PrfaaS."},
                  {"role": "assistant", "content": "Long prefills elsewhere."}, {"role": "user", "content": "And decode?"}]},
    {"messages": [{"role": "user", "content": "Grüße, 東京, emoji 😀, RTL שלום, zero\u200bwidth"}]},
    {"messages": [{"role": "SYSTEM", "content": "roles other than user are case-insensitive"}, {"role": "user", "content": "ok"}]},
    {"messages": [{"role": "system", "content": LONG}, {"role": "user", "content": "summarise"}]},
    {"messages": [{"role": "user", "content": [{"type": "text", "text": "part one"}, {"type": "text", "text": "part two"}]}]},
    {"messages": [{"role": "system", "content": None}, {"role": "user", "content": "x"}]},
    {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a trailing answer"}]},
    {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "to continue"}], "continue_final_message": True},
    {"messages": [{"role": "user", "content": "weather?"}],
     "tools": [{"type": "function", "function": {"name": "get_weather", "description": "city weather",
                                                 "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]},
    {"messages": [{"role": "user", "content": "weather?"}], "tool_choice": "none",
     "tools": [{"type": "function", "function": {"name": "get_weather"}}]},
    {"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"enable_thinking": False}},
    {"messages": [{"role": "user", "content": "x"}], "reasoning_effort": "low"},
    {"messages": [{"role": "tool", "content": [{"type": "text", "text": "42"}], "tool_call_id": "c1"}]},
]
TEXTS = ["", "a", "Hello world", "  leading and trailing  ", "tabs\tand\nnewlines\r\n", "Grüße 東京 😀", LONG,
         "<|im_start|>user\nspecial tokens in text<|im_end|>"]


REFUSED = [  # SGLang's request models refuse these (422/400): so does the router (400)
    {"messages": [{"role": "User", "content": "the user role is exact"}]},
    {"messages": [{"role": "user", "content": None}]},
    {"messages": [{"role": "wizard", "content": "x"}]},
]


@pytest.mark.parametrize("name", ["shipped (openai content)", "string content", "bos-adding"])
@pytest.mark.parametrize("body", CHATS, ids=range(len(CHATS)))
def test_chat_ids_equal_sglangs(tokenizers, name, body):
    ours, theirs = tokenizers[name]
    mine, sglangs = ours.encode_chat(json.loads(json.dumps(body))), theirs.chat_ids(json.loads(json.dumps(body)))
    assert mine == sglangs, first_difference(ours, mine, sglangs)


@pytest.mark.parametrize("body", REFUSED, ids=range(len(REFUSED)))
def test_what_sglang_refuses_the_router_refuses(tokenizers, body):
    import pydantic

    ours, theirs = tokenizers["shipped (openai content)"]
    with pytest.raises(pydantic.ValidationError):
        theirs.chat_ids(body)
    with pytest.raises(TokenizeError):
        ours.encode_chat(body)


@pytest.mark.parametrize("name", ["shipped (openai content)", "bos-adding"])
@pytest.mark.parametrize("text", TEXTS, ids=range(len(TEXTS)))
def test_text_ids_equal_sglangs(tokenizers, name, text):
    ours, theirs = tokenizers[name]
    if not text:  # both releases' /v1/completions refuse an empty prompt, as our protocol does (400)
        try:
            sglangs = theirs.text_ids(text)
        except ValueError:
            return  # 0.5.15's tokenizer refuses empty text too; 0.5.23's tokenizes it: then the ids must agree
    else:
        sglangs = theirs.text_ids(text)
    mine = ours.encode_text(text)
    assert mine == sglangs, first_difference(ours, mine, sglangs)


@pytest.mark.parametrize("name", ["shipped (openai content)", "string content", "bos-adding"])
def test_content_format_detection_agrees(tokenizers, name):
    ours, theirs = tokenizers[name]
    assert ours.content_format == theirs.templates.jinja_template_content_format


def test_content_format_detection_on_sglang_examples():
    from sglang.srt.parser.jinja_template_utils import (
        detect_jinja_template_content_format as theirs,
    )

    for template in ("{% for message in messages %}{{ message['content'] }}{% endfor %}",
                     "{% for message in messages %}{% for c in message['content'] %}{{ c.text }}{% endfor %}{% endfor %}",
                     "{% for m in messages %}{% for c in m.content | selectattr('type') %}{{ c }}{% endfor %}{% endfor %}",
                     "{{ 'image' }}", "{% for x in %}broken"):
        assert detect_content_format(template) == theirs(template), template


messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]),
                                           "content": st.text(max_size=60)}), min_size=1, max_size=5)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(msgs=messages)
def test_generated_conversations_match(tokenizers, msgs):
    ours, theirs = tokenizers["shipped (openai content)"]
    mine, sglangs = ours.encode_chat({"messages": msgs}), theirs.chat_ids({"messages": msgs})
    assert mine == sglangs, first_difference(ours, mine, sglangs)


@pytest.mark.parametrize("body, message", [
    ({"messages": "hi"}, "messages must be a list"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "role must be user or one of"),
    ({"messages": [{"role": "user", "content": 5}]}, "content of a user message must be"),
    ({"messages": [{"role": "system", "content": 5}]}, "content must be a string, a list of parts or null"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "multimodal"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"function": {}}]}, "function.name"),
    ({"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": [1]}, "chat_template_kwargs"),
])
def test_bad_chat_bodies_are_typed_errors(tokenizers, body, message):
    ours, _ = tokenizers["shipped (openai content)"]
    with pytest.raises(TokenizeError, match=message):
        ours.encode_chat(body)


def test_shipped_tokenizer_is_what_its_recipe_says():
    recipe = json.loads((DATA_DIR / SHIPPED / "recipe.json").read_text())
    tok = PromptTokenizer.load(SHIPPED)
    assert tok.vocab_size == recipe["vocab_size"] == 4096
    assert tok.chat_template and tok.content_format == "openai" and not tok.auto_adds_specials
    text = "Grüße 東京 😀 — any UTF-8 round-trips"
    assert tok.decode(tok.encode_text(text)) == text  # byte-level: nothing is unknown


def test_a_tokenizer_whose_config_names_the_fast_class_loads_as_autotokenizer_loads_it(tmp_path):
    """The shipped tokenizer loads with the class its config names (without AutoTokenizer's mappings): the
    same class, vocabulary, specials, template and ids as AutoTokenizer's. A directory that also holds a model
    config, or names another class, is AutoTokenizer's to resolve."""
    import shutil

    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    from prfaas_sglang.tokenizer import _loader, resolve

    source = resolve(SHIPPED)
    assert _loader(source) is PreTrainedTokenizerFast
    ours, auto = PromptTokenizer.load(SHIPPED).tokenizer, AutoTokenizer.from_pretrained(
        source, clean_up_tokenization_spaces=False, use_fast=True)
    assert type(ours) is type(auto) and ours.get_vocab() == auto.get_vocab()
    assert ours.all_special_ids == auto.all_special_ids and ours.chat_template == auto.chat_template
    text = "Grüße 東京 😀 <|im_start|>user\nhi<|im_end|>"
    assert ours([text])["input_ids"] == auto([text])["input_ids"]
    with_model = shutil.copytree(source, tmp_path / "with-model")
    (with_model / "config.json").write_text("{}")
    assert _loader(str(with_model)) is AutoTokenizer
    other = shutil.copytree(source, tmp_path / "other")
    config = json.loads((other / "tokenizer_config.json").read_text())
    (other / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": "Qwen2TokenizerFast"}))
    assert _loader(str(other)) is AutoTokenizer and _loader("org/hub-id") is AutoTokenizer


def test_a_missing_tokenizer_is_a_config_error():
    from prfaas_sglang.errors import ConfigError

    with pytest.raises(ConfigError, match="cannot load tokenizer"):
        PromptTokenizer.load("/no/such/tokenizer")


def test_the_tiny_model_fixture_covers_the_shipped_tokenizer():
    """local-two-cluster.yaml serves the tiny model with this tokenizer: every id must have an embedding row."""
    from helpers import REPO_ROOT

    config = json.loads((REPO_ROOT / "tests" / "fixtures" / "models" / "tiny-qwen3-next" / "config.json").read_text())
    assert config["vocab_size"] >= PromptTokenizer.load(SHIPPED).vocab_size


@pytest.mark.parametrize("body, chars", [
    ({"text": "abcd", "messages": [{"role": "user", "content": "xy"}]}, 6),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "abc"}, {"type": "image"}]}]}, 3),
    ({"messages": True}, 0), ({"messages": "hi"}, 0), ({"messages": [1, None]}, 0), ([1, 2], 0), ({"text": 5}, 0),
])
def test_text_chars_counts_what_the_tokenizer_reads_and_never_raises(body, chars):
    from prfaas_sglang.router.server import _text_chars
    assert _text_chars(body) == chars


@settings(max_examples=200)
@given(obj=st.dictionaries(st.text(max_size=6), st.integers() | st.text(max_size=5) | st.booleans(), max_size=5),
       pad=st.sampled_from(["", " ", "\n  "]), stream=st.booleans())
def test_leg_bytes_parse_to_the_body_with_the_router_fields_set(obj, pad, stream):
    """The client's bytes re-sent with members appended read, to Python's json and to orjson, as
    the client's object with the router's keys set (a duplicate key: the router's wins)."""
    import orjson

    from prfaas_sglang.router.server import ClientBody, leg_bytes

    obj = {k: v for k, v in obj.items() if not isinstance(v, int) or abs(v) < 2**63}
    raw = pad.encode() + json.dumps({**obj, "stream": stream}).encode() + pad.encode()
    extra = {"bootstrap_host": "h", "bootstrap_room": 2**62, "stream": False}
    body = ClientBody(orjson.loads(raw), raw)
    expected = {**obj, "stream": stream, **extra}
    assert json.loads(leg_bytes(body, None, extra)) == expected == orjson.loads(leg_bytes(body, None, extra))
    assert json.loads(leg_bytes(body, {"input_ids": [1, 2]}, extra)) == {"input_ids": [1, 2], **extra}
    assert json.loads(leg_bytes(ClientBody({}, b" {} "), None, extra)) == extra


def test_tools_render_as_the_workers_release_does():
    """0.5.15 dumps every Function field in the model's order with strict false; 0.5.23 the client's keys in the
    client's order, strict and defer_loading only when set (a tool's defer_loading fills the function's)."""
    from prfaas_sglang.tokenizer import _tools

    body = {"tools": [{"type": "function", "defer_loading": True,
                       "function": {"parameters": {"type": "object"}, "name": "w", "extra": 1}},
                      {"type": "function", "function": {"name": "v", "strict": True, "description": "d"}}]}
    assert [list(t["function"].items()) for t in _tools(body)] == [
        [("description", None), ("name", "w"), ("parameters", {"type": "object"}), ("strict", False), ("defer_loading", True)],
        [("description", "d"), ("name", "v"), ("parameters", None), ("strict", True)]]
    assert [list(t["function"].items()) for t in _tools(body, as_sent=True)] == [
        [("parameters", {"type": "object"}), ("name", "w"), ("description", None), ("defer_loading", True)],
        [("name", "v"), ("strict", True), ("description", "d"), ("parameters", None)]]
    assert [tools_as_sent(v) for v in ("0.5.15", "0.5.23", "0.6.0", None, "dev")] == [False, True, True, False, False]
