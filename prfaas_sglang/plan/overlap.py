"""Layer-wise overlap of a prefill and its KV transfer (pure): when the KV has left, if it leaves as it is written.

A PrfaaS prefill worker that streams its KV by layer (``links[].layerwise`` in the topology, which
sets ``PRFAAS_KV_LAYERWISE`` on the worker: the kv-layerwise hooks on SGLang, the emulated engine's
own streaming) has written ``k/G`` of a request's full-attention KV after ``k/G`` of its prefill;
the recurrent (linear-attention / SWA) state is written once, at the end. Over a link that drains
``X`` seconds of full-attention KV and ``X_state`` of state, the transfer ends ``finish`` after the
prefill starts::

    finish = max(P + X/G, P/G + X) + X_state        P: the prefill, G: layer groups

either the link waits on the last group (compute-bound: P + X/G) or it is busy from the first
group on (link-bound: P/G + X). Without streaming (``groups=None``) the whole KV leaves after the
prefill: ``P + X + X_state``, what the router assumed before (SGLang 0.5.15 sends a chunked
request's KV chunk by chunk, so that is an upper bound for a prompt longer than one chunk).

The router's TTFT estimate (``router.policy``), the planner's capacity at the SLO
(``plan.slo_capacity``) and the emulated engine (``engine.mock``: :func:`ready_bytes`, stepping each
forward by :data:`STREAM_GROUPS`) share these definitions; the engine's timing of a forward remains
its own truth.
"""

from __future__ import annotations

import math

# Layer groups a streamed forward is cut into (the emulated engine's steps, the router's estimate): a
# real model streams each of its full-attention layers; eight groups leave a tail of 1/8 of the last
# group's KV after the forward, within a few percent of a per-layer stream for the models in the catalog.
STREAM_GROUPS = 8


def kv_finish_s(prefill_s: float, stream_s: float, tail_s: float = 0.0, groups: int | None = STREAM_GROUPS) -> float:
    """Seconds from the prefill's start until its KV has crossed the link: ``prefill_s`` of compute,
    ``stream_s`` of the link's time for the KV that streams, ``tail_s`` for what goes at the end (the
    recurrent state); ``groups=None``: nothing streams, the transfer starts when the prefill ends."""
    if prefill_s < 0 or stream_s < 0 or tail_s < 0:
        raise ValueError(f"times must be >= 0, got prefill {prefill_s}, stream {stream_s}, tail {tail_s}")
    if groups is None:
        return prefill_s + stream_s + tail_s
    if groups < 1:
        raise ValueError(f"groups must be >= 1 or None, got {groups}")
    return max(prefill_s + stream_s / groups, prefill_s / groups + stream_s) + tail_s


def ready_bytes(stream_bytes: int, total_bytes: int, total_tokens: int, held_tokens: int, ready_tokens: float) -> int:
    """Of a request's ``total_bytes`` to ship (``stream_bytes`` of full-attention KV beyond the
    receiver's ``held_tokens``, then the state), the bytes written once its first ``ready_tokens``
    prompt tokens have their KV (cached ones count from the start): the full-attention share of
    ``ready_tokens - held_tokens`` (rounded down), everything once the whole prompt is ready."""
    if ready_tokens >= total_tokens:
        return total_bytes
    beyond = max(ready_tokens - held_tokens, 0.0)
    return min(stream_bytes, math.floor(stream_bytes * beyond / max(total_tokens - held_tokens, 1)))
