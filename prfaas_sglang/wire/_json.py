"""Decoding a versioned JSON object into a dataclass, shared by the JSON wire formats (pure)."""

from __future__ import annotations

import json
from dataclasses import asdict, fields
from typing import Any, ClassVar


def json_object(payload: bytes | str | dict, what: str) -> dict:
    """``payload`` (bytes, text or an already decoded object) as a fresh dict; ValueError otherwise."""
    if isinstance(payload, (bytes, str)):
        try:
            payload = json.loads(payload)
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise ValueError(f"{what} is not JSON: {err}") from None
    if not isinstance(payload, dict):
        raise ValueError(f"{what} must be a JSON object, got {type(payload).__name__}")
    return dict(payload)


def build(cls, obj: dict[str, Any], what: str):
    """``cls(**obj)`` refusing unknown or missing fields with ValueError (the caller validates values)."""
    unknown = set(obj) - {f.name for f in fields(cls)}
    if unknown:
        raise ValueError(f"{what}: unknown field(s) {sorted(unknown)}")
    try:
        return cls(**obj)
    except TypeError as err:
        raise ValueError(f"{what}: {err}") from None


def check_int(name: str, value, lo: int = 0) -> None:
    """ValueError unless ``value`` is an int (not a bool) >= ``lo``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise ValueError(f"{name} must be an integer >= {lo}, got {value!r}")


class VersionedJson:
    """A JSON message dataclass with ``"v"``: ``to_json`` writes ``VERSION``, ``decode`` accepts the
    ``ACCEPTED`` versions, refuses unknown or missing fields, then runs the subclass's ``validate``."""

    VERSION: ClassVar[int]
    ACCEPTED: ClassVar[tuple[int, ...]]
    WHAT: ClassVar[str]  # the format's name in errors ("hand-off", "cache-move")

    def validate(self) -> None:
        raise NotImplementedError

    def to_json(self) -> dict:
        return {"v": self.VERSION, **asdict(self)}

    @classmethod
    def decode(cls, payload):
        obj = json_object(payload, cls.__name__)
        version = obj.pop("v", None)
        if version not in cls.ACCEPTED:
            raise ValueError(f"{cls.__name__}: unsupported {cls.WHAT} version {version!r}")
        message = build(cls, obj, cls.__name__)
        message.validate()
        return message
