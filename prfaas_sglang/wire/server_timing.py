"""The ``Server-Timing`` response header (W3C) the router writes: parsed (pure, standard library only).

The router's own milliseconds (``parse``, ``route``, ``move``, ``legs``) and its TTFT prediction
(``ttft-estimate``) are metrics with a ``dur`` in ms: ``parse;dur=0.41, route;dur=0.12``.
"""

from __future__ import annotations


def server_timing(header: str) -> dict[str, float]:
    """``Server-Timing: parse;dur=0.41, route;dur=0.12`` -> {"parse": 0.41, "route": 0.12} (ms); a
    metric without a readable ``dur`` is left out."""
    out = {}
    for metric in header.split(","):
        name, _, params = metric.strip().partition(";")
        for param in params.split(";"):
            key, _, value = param.strip().partition("=")
            if key == "dur" and name:
                try:
                    out[name] = float(value)
                except ValueError:
                    pass
    return out
