"""A worker's ``GET /server_info``: the facts its readers take from it, and our versioned section (pure).

The body is SGLang 0.5.15's (``asdict(server_args)``, merged with the first scheduler's info, plus
``version`` and ``kv_events``, SGLang's ``describe_kv_events_publisher()``), or the emulated
engine's, which has the same fields and a ``prfaas`` section of its own. SGLang's body carries no
format version (its ``version`` is SGLang's release): :func:`parse_server_info` reads what the
router and the kv-index use into :class:`WorkerFacts`, ignores the rest, and is the one parser of
it (``router/workers.py``, ``kvindex/__main__.py``).

One section in it is ours and versioned: a prefill worker whose SGLang runs the
``cache-move-routes`` hook announces under :data:`CACHE_MOVE_KEY` whether it serves
``/prfaas/cache/import`` and ``/export`` (``wire/cache_move.py``)::

    "prfaas_cache_move": {"v": 1, "served": bool, "reason": str | null}

``reason``: why it does not (null when it does). :class:`CacheMoveSection` is that section: the
hook writes ``CacheMoveSection.served_unless(reason).to_json()``, the router reads it with
:meth:`CacheMoveSection.decode` (a worker whose section is missing, malformed or of another version
is not asked to move caches).

Errors: :class:`FactsError` (a ``ValueError``) for a body or section that is malformed or of an
unsupported version.

History (``prfaas_cache_move``):
  v1: first version.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from prfaas_sglang.wire.blocks import HASH_SCHEME

CACHE_MOVE_KEY = "prfaas_cache_move"
CACHE_MOVE_VERSION = 1


class FactsError(ValueError):
    """A worker's answer about itself (``/server_info``, a section of it, ``/v1/loads``) is
    malformed or of an unsupported version."""


@dataclass(frozen=True)
class KvEventsEndpoint:
    """Where a worker publishes its KV events: ZMQ port ``port`` (of its host), topic ``topic``,
    events hashed at ``block_size`` tokens per block."""

    port: int
    topic: str
    block_size: int


@dataclass(frozen=True)
class WorkerFacts:
    served_model_name: str | None
    page_size: int
    disaggregation_mode: str | None
    max_total_tokens: int | None  # the KV pool (decode: what bounds its requests)
    max_running_requests: int | None
    context_length: int | None
    kv_events: KvEventsEndpoint | None
    block_hash: str
    tokenizer_path: str | None
    emulated: dict | None  # the emulated engine's "prfaas" section (speedup, kv_scale, profile, ...)
    version: str | None
    cache_import: bool = False  # serves /prfaas/cache/import and /export (wire.cache_move)
    linear_state: bool | None = None  # SGLang's uses_mamba_radix_cache (a linear-attention model); None: not said
    stream_interval: int = 1  # SGLang's --stream-interval: its streams carry a chunk every Nth token

    @property
    def events_block_size(self) -> int:
        """The block size of the worker's KV events (its page size when it publishes none)."""
        return self.kv_events.block_size if self.kv_events is not None else self.page_size


class CacheMoveSection(msgspec.Struct, frozen=True, gc=False):
    """``/server_info["prfaas_cache_move"]``: whether the worker serves cache moves, and if not, why."""

    version: int = msgspec.field(name="v")
    served: bool
    reason: str | None = None

    @classmethod
    def served_unless(cls, reason: str | None) -> CacheMoveSection:
        """The section of a worker that cannot serve cache moves for ``reason`` (None: it can)."""
        return cls(CACHE_MOVE_VERSION, reason is None, reason)

    def to_json(self) -> dict:
        return msgspec.to_builtins(self)

    @classmethod
    def decode(cls, section: Any) -> CacheMoveSection:
        """The section as found in a parsed ``/server_info``; :class:`FactsError` unless it is a
        v1 object with a boolean ``served`` and a string or null ``reason`` (unknown fields ignored)."""
        if not isinstance(section, dict):
            raise FactsError(f"{CACHE_MOVE_KEY} must be a JSON object, got {type(section).__name__}")
        version = section.get("v")
        if isinstance(version, bool) or version != CACHE_MOVE_VERSION:
            raise FactsError(f"unsupported {CACHE_MOVE_KEY} version {version!r}")
        try:
            return msgspec.convert(section, cls, strict=True)
        except msgspec.ValidationError as err:
            raise FactsError(f"{CACHE_MOVE_KEY}: {err}") from None


def opt_int(obj: dict, key: str, lo: int = 0) -> int | None:
    """``obj[key]``: None when absent or null, else an integer >= ``lo`` (:class:`FactsError` otherwise)."""
    value = obj.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise FactsError(f"{key} must be an integer >= {lo}, got {value!r}")
    return value


def with_live_mode(info: Any, model_info: Any) -> Any:
    """``info`` (a ``/server_info`` body) with the worker's live disaggregation mode where its ``/model_info``
    body states one (pure). SGLang 0.5.23's ``/server_info`` reports the startup configuration, so a worker
    switched in place by ``/pd_role_switch`` still names its first role there, while ``/model_info`` names
    the one it runs now; 0.5.15 and the emulated engine state none there (``info`` comes back unchanged)."""
    mode = model_info.get("disaggregation_mode") if isinstance(model_info, dict) else None
    if not isinstance(info, dict) or not isinstance(mode, str):
        return info
    return {**info, "disaggregation_mode": mode}


def parse_server_info(info: Any) -> WorkerFacts:
    """SGLang 0.5.15's ``/server_info`` (or the emulated engine's), decoded JSON -> the facts its
    readers use. :class:`FactsError` for a body that is not an object, has no page size (neither
    ``page_size`` nor a KV-event block size), or a field of the wrong type or range."""
    if not isinstance(info, dict):
        raise FactsError("server_info must be a JSON object")
    page_size = opt_int(info, "page_size", 1)
    events = info.get("kv_events")
    endpoint = None
    if isinstance(events, dict) and events.get("endpoint_port_base") is not None:
        port = opt_int(events, "endpoint_port_base", 1)
        block = opt_int(events, "block_size", 1) or page_size
        topic = events.get("topic") or ""
        if not isinstance(topic, str):
            raise FactsError("kv_events.topic must be a string")
        endpoint = KvEventsEndpoint(port, topic, block)
        page_size = page_size or block
    if page_size is None:
        raise FactsError("page_size is missing")
    emulated = info.get("prfaas") if isinstance(info.get("prfaas"), dict) else None
    block_hash = emulated.get("block_hash", HASH_SCHEME) if emulated else HASH_SCHEME
    name = info.get("served_model_name")
    if isinstance(name, list):  # SGLang accepts several; the first is the canonical one
        name = name[0] if name else None
    return WorkerFacts(
        served_model_name=name if isinstance(name, str) else None,
        page_size=page_size,
        disaggregation_mode=info.get("disaggregation_mode") if isinstance(info.get("disaggregation_mode"), str) else None,
        max_total_tokens=opt_int(info, "max_total_num_tokens", 1),
        max_running_requests=opt_int(info, "max_running_requests", 1),
        context_length=opt_int(info, "context_length", 1),
        kv_events=endpoint,
        block_hash=str(block_hash),
        tokenizer_path=info.get("tokenizer_path") if isinstance(info.get("tokenizer_path"), str) else None,
        emulated=emulated,
        version=str(info["version"]) if info.get("version") is not None else None,
        cache_import=_serves_cache_moves(info, emulated),
        linear_state=_linear_state(info),
        stream_interval=opt_int(info, "stream_interval", 1) or 1,
    )


def _linear_state(info: dict) -> bool | None:
    """Whether the worker's prefix cache holds linear-attention state (SGLang 0.5.15's
    ``uses_mamba_radix_cache``); None when it does not say, or keeps no prefix cache (a decode worker
    by default: SGLang then reports False even for a hybrid model, and no reuse is predicted there)."""
    uses = info.get("uses_mamba_radix_cache")
    if not isinstance(uses, bool) or info.get("disable_radix_cache") is not False:
        return None
    return uses


def _serves_cache_moves(info: dict, emulated: dict | None) -> bool:
    """The emulated engine says so in its ``prfaas`` section; an SGLang server in its
    :class:`CacheMoveSection` (a missing, malformed or newer section: it does not)."""
    if emulated is not None:
        return emulated.get("cache_import") is True
    section = info.get(CACHE_MOVE_KEY)
    if section is None:
        return False
    try:
        return CacheMoveSection.decode(section).served
    except FactsError:
        return False
