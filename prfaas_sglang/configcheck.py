"""Strict checks for values read from YAML/JSON configuration (pure).

Every failure is a :class:`ConfigError` whose ``field`` is the dotted path of
the bad value, so an operator sees *which* line of which file to fix.
"""

from __future__ import annotations

import difflib
import math
from typing import Any

from prfaas_sglang.errors import ConfigError


def join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else str(key)


def check_keys(obj: dict, allowed: set[str] | frozenset[str], path: str) -> None:
    """Refuse unknown keys, suggesting the nearest known one."""
    for key in obj:
        if key not in allowed:
            near = difflib.get_close_matches(str(key), sorted(allowed), n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else f" (known: {', '.join(sorted(allowed))})"
            raise ConfigError(join(path, key), f"unknown field{hint}")


def mapping(value: Any, path: str) -> dict:
    if not isinstance(value, dict):
        raise ConfigError(path, f"must be a mapping, got {type(value).__name__}")
    return value


def opt_str(obj: dict, key: str, path: str) -> str | None:
    value = obj.get(key)
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise ConfigError(join(path, key), f"must be a non-empty string, got {value!r}")
    return value


def req_str(obj: dict, key: str, path: str) -> str:
    value = opt_str(obj, key, path)
    if value is None:
        raise ConfigError(join(path, key), "is required")
    return value


def number(obj: dict, key: str, path: str, *, required: bool = False, default: float | None = None,
           positive: bool = False, nonnegative: bool = False, integer: bool = False,
           at_most: float | None = None) -> Any:
    """A numeric field; ``None`` (or ``default``) when absent and not required."""
    value = obj.get(key)
    field = join(path, key)
    if value is None:
        if required:
            raise ConfigError(field, "is required")
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(field, f"must be a number, got {value!r}")
    if not math.isfinite(value):
        raise ConfigError(field, f"must be a finite number, got {value!r}")
    if positive and not value > 0:
        raise ConfigError(field, f"must be a positive number, got {value!r}")
    if nonnegative and value < 0:
        raise ConfigError(field, f"must be >= 0, got {value!r}")
    if at_most is not None and value > at_most:
        raise ConfigError(field, f"must be <= {at_most:g}, got {value!r}")
    if integer:
        if int(value) != value:
            raise ConfigError(field, f"must be an integer, got {value!r}")
        return int(value)
    return float(value)


def port(obj: dict, key: str, path: str) -> int | None:
    value = obj.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 65535:
        raise ConfigError(join(path, key), f"must be a port number in 1..65535, got {value!r}")
    return value


def str_list(obj: dict, key: str, path: str) -> tuple[str, ...]:
    value = obj.get(key, [])
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ConfigError(join(path, key), "must be a list of strings")
    return tuple(value)
