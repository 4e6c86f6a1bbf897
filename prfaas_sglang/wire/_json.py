"""Decoding a versioned JSON object into a dataclass, shared by the JSON wire formats (pure)."""

from __future__ import annotations

import json
from dataclasses import fields
from typing import Any


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
