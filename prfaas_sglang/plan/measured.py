"""Measured cost profiles: what ``bench profile`` measured on an engine, as the profile file the
planner, the router's runtime model and the emulated engine load, and beside the roofline (pure).

The file is the planner's measured-profile format (:func:`~prfaas_sglang.plan.scenario.parse_measured_profile`)::

    name: measured-tiny-hybrid@NVIDIA-H200
    source: "bench profile --engine sglang, ..."
    gpus_per_instance: 1
    state: recurrent                  # where prefix reuse stops (runtime.state_kind's names)
    points: [{tokens, prefill_s, kv_bytes}, ...]     # T_prefill(l) and S_kv(l), uncached l
    decode: {bs_max, step_s}          # the largest batch measured and its step time
    measurements: {...}               # the raw tables (cached prefixes, decode steps, pools)

``prefill_s`` of a point is the median over its repeats, made non-decreasing in ``l`` by a
running maximum (a planner's profile must be; the raw medians stay under ``measurements``).
``kv_bytes`` is what the engine's own pools hold for a request of ``l`` tokens:
``l * kv_bytes_per_token + state_bytes_per_request``.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from prfaas_sglang.plan.analytic import Accelerator, AnalyticPrefill, ModelConfig, decode_step_s
from prfaas_sglang.plan.profiles import DecodeProfile, PrefillProfile


@dataclass(frozen=True)
class PrefillPoint:
    tokens: int
    samples_s: tuple[float, ...]  # one per fresh prompt of ``tokens`` uncached tokens

    @property
    def median_s(self) -> float:
        return statistics.median(self.samples_s)


@dataclass(frozen=True)
class CachedPoint:
    prefix_tokens: int  # sent first, so that the engine holds it
    new_tokens: int  # then the prefix plus these
    cached_tokens: int | None  # what the engine reported reusing
    prefill_s: float


@dataclass(frozen=True)
class DecodePoint:
    batch: int
    context_tokens: int
    step_s: float | None  # median interval between tokens while all ``batch`` decode; None: none seen
    intervals: int


@dataclass(frozen=True)
class PoolGeometry:
    kv_bytes_per_token: int  # full-attention KV of one token, every layer
    state_bytes_per_request: int  # linear-attention / SWA state of one request (0: none)

    def kv_bytes(self, tokens: float) -> float:
        return tokens * self.kv_bytes_per_token + self.state_bytes_per_request


@dataclass(frozen=True)
class Measurements:
    prefill: tuple[PrefillPoint, ...]
    cached: tuple[CachedPoint, ...]
    decode: tuple[DecodePoint, ...]
    pool: PoolGeometry


def monotone(values: Sequence[float]) -> list[float]:
    """Running maximum: the smallest non-decreasing sequence at or above ``values``."""
    out, top = [], float("-inf")
    for value in values:
        top = max(top, value)
        out.append(top)
    return out


def profile_doc(m: Measurements, name: str, source: str, state: str, gpus_per_instance: int = 1) -> dict:
    """The profile file's content (see the module); raises ValueError without a prefill point or a
    measured decode step."""
    if not m.prefill:
        raise ValueError("no prefill point measured")
    prefill = sorted(m.prefill, key=lambda p: p.tokens)
    times = monotone([p.median_s for p in prefill])
    stepped = [d for d in m.decode if d.step_s is not None]
    if not stepped:
        raise ValueError("no decode step measured")
    top = max(stepped, key=lambda d: (d.batch, d.context_tokens))
    return {
        "name": name, "source": source, "gpus_per_instance": gpus_per_instance, "state": state,
        "points": [{"tokens": p.tokens, "prefill_s": round(t, 6), "kv_bytes": int(m.pool.kv_bytes(p.tokens))}
                   for p, t in zip(prefill, times, strict=True)],
        "decode": {"bs_max": top.batch, "step_s": round(top.step_s, 6)},
        "measurements": {"prefill": [{"tokens": p.tokens, "samples_s": [round(s, 6) for s in p.samples_s]} for p in prefill],
                         "cached": [asdict(c) for c in m.cached], "decode": [asdict(d) for d in m.decode],
                         "pool": asdict(m.pool)},
    }


def roofline_rows(m: Measurements, model: ModelConfig, accel: Accelerator) -> list[dict]:
    """Each measured point beside the roofline's prediction for the same model on ``accel``:
    ``{quantity, at, measured, roofline, ratio}`` (ratio = measured / roofline). A cached-prefix
    point is compared with the roofline of its uncached part, which is what the router charges."""
    roof = AnalyticPrefill(model, accel)
    rows = [{"quantity": "prefill_s", "at": f"{p.tokens} uncached", "measured": p.median_s,
             "roofline": roof.prefill_s(p.tokens)} for p in sorted(m.prefill, key=lambda p: p.tokens)]
    rows += [{"quantity": "prefill_s", "at": f"{c.new_tokens} new after {c.prefix_tokens} (cached {c.cached_tokens})",
              "measured": c.prefill_s, "roofline": roof.prefill_s(c.new_tokens)} for c in m.cached]
    rows += [{"quantity": "decode_step_s", "at": f"batch {d.batch} x {d.context_tokens} context", "measured": d.step_s,
              "roofline": decode_step_s(model, accel, d.batch, d.context_tokens)} for d in m.decode if d.step_s is not None]
    tokens = sorted({p.tokens for p in m.prefill})
    rows += [{"quantity": "kv_bytes", "at": f"{n} tokens", "measured": m.pool.kv_bytes(n), "roofline": model.kv_bytes(n)}
             for n in (tokens[0], tokens[-1])] if tokens else []
    for row in rows:
        row["ratio"] = row["measured"] / row["roofline"] if row["roofline"] else None
    return rows


def format_rows(rows: Sequence[dict]) -> str:
    """``rows`` as a Markdown table."""
    lines = ["| quantity | at | measured | roofline | measured / roofline |", "|---|---|---|---|---|"]
    for r in rows:
        ratio = "n/a" if r["ratio"] is None else f"{r['ratio']:.3g}"
        lines.append(f"| {r['quantity']} | {r['at']} | {r['measured']:.4g} | {r['roofline']:.4g} | {ratio} |")
    return "\n".join(lines)


def tabulate(prefill: PrefillProfile, tokens: Sequence[int], decode: DecodeProfile, name: str, source: str,
             state: str = "none", gpus_per_instance: int = 1) -> dict:
    """A profile file whose points are ``prefill``'s own values at ``tokens``: a roofline (or any
    profile) in the measured format, so that it loads wherever a measured profile does."""
    return {"name": name, "source": source, "gpus_per_instance": gpus_per_instance, "state": state,
            "points": [{"tokens": int(n), "prefill_s": prefill.prefill_s(n), "kv_bytes": prefill.kv_bytes(n)}
                       for n in sorted(tokens)],
            "decode": {"bs_max": decode.bs_max, "step_s": decode.step_s}}


def scaled(doc: dict, time_scale: float, name: str | None = None) -> dict:
    """``doc`` with every prefill and decode time times ``time_scale`` (a profile that many times off)."""
    return {**{k: v for k, v in doc.items() if k != "measurements"}, "name": name or f"{doc['name']}*t{time_scale:g}",
            "points": [{**p, "prefill_s": p["prefill_s"] * time_scale} for p in doc["points"]],
            "decode": {**doc["decode"], "step_s": doc["decode"]["step_s"] * time_scale}}
