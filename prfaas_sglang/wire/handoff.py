"""The emulated engine's PD hand-off between a prefill and a decode worker (wire format, pure).

SGLang's own workers hand KV over with ZMQ messages inside its Mooncake backend;
the emulated engine follows the same shape over HTTP, at the granularity a router
sees (``engine/mock/engine.py`` has the sequence diagram)::

    decode  ── POST {bootstrap}/prfaas/register  Registration ──> prefill
    prefill ── Mooncake TCP write of the KV into the registered region
    prefill ── POST {notify_url}                 KvReady      ──> decode

Both bodies are JSON objects with ``"v"``.

History:
  v1: first typed version (the same fields the untyped dicts had); ``v`` added.
  v2: ``Registration.decode_prefix_len`` (SGLang's name): tokens of the prompt the
      decode worker already holds in its own prefix cache
      (``--disaggregation-decode-enable-radix-cache``); the prefill worker ships only
      the KV beyond them. A v1 message still decodes, with 0.
"""

from __future__ import annotations

from dataclasses import dataclass

from prfaas_sglang.wire._json import VersionedJson
from prfaas_sglang.wire._json import check_int as _int

HANDOFF_VERSION = 2
ACCEPTED_VERSIONS = (1, 2)


class _Handoff(VersionedJson):
    VERSION, ACCEPTED, WHAT = HANDOFF_VERSION, ACCEPTED_VERSIONS, "hand-off"


@dataclass(frozen=True)
class Registration(_Handoff):
    """Decode -> prefill: write bootstrap room ``room``'s KV (``length`` bytes at most) to
    ``addr`` of Mooncake session ``session``, then POST a :class:`KvReady` to ``notify_url``."""

    room: int
    session: str
    addr: int
    length: int
    notify_url: str
    decode_prefix_len: int = 0  # v2: prompt tokens whose KV the decode worker already holds

    def validate(self) -> None:
        _int("room", self.room)
        _int("addr", self.addr)
        _int("length", self.length, 1)
        _int("decode_prefix_len", self.decode_prefix_len)
        if not isinstance(self.session, str) or not self.session:
            raise ValueError("session must be a non-empty string")
        if not isinstance(self.notify_url, str) or not self.notify_url.startswith("http"):
            raise ValueError("notify_url must be an http URL")



@dataclass(frozen=True)
class KvReady(_Handoff):
    """Prefill -> decode: room ``room``'s KV was written (``ok``) or could not be (``error``)."""

    room: int
    ok: bool
    kv_bytes: int
    cached_tokens: int
    first_token: int
    transfer_s: float | None = None
    error: str | None = None

    def validate(self) -> None:
        _int("room", self.room)
        _int("kv_bytes", self.kv_bytes)
        _int("cached_tokens", self.cached_tokens)
        _int("first_token", self.first_token)
        if not isinstance(self.ok, bool):
            raise ValueError("ok must be true or false")
        if self.ok and self.transfer_s is None:
            raise ValueError("a successful hand-off reports transfer_s")
        if not self.ok and not self.error:
            raise ValueError("a failed hand-off says why (error)")

