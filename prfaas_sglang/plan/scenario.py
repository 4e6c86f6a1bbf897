"""Scenarios: hardware + model + link + workload, from YAML or a built-in name.

Parsing is pure (``parse_*`` take loaded dicts); :class:`Catalog` does the
file reads, resolving a name such as ``kimi-linear-1t-hybrid`` against the
files shipped in ``prfaas_sglang/plan/data`` (or a path). Every bad value is a
:class:`ConfigError` naming its field.

Scenario file (all sections but ``paper`` required)::

    name: case-study
    model: kimi-linear-1t-hybrid          # shipped name | path | inline mapping
    prfaas: {accelerator: h200x8, instances: 4}
    pd: {accelerator: h20x8, instances: 8}
    # instead of `accelerator`, a measured profile: {profile: path.yaml, instances: N}
    link: {egress_gbps: 100}
    workload: {kind: lognormal, mu: MU, sigma: SIGMA, min_tokens: N, max_tokens: N}  # the case study's: workload.CASE_STUDY_LENGTHS.config()
    #        | {kind: lengths, lengths: [...]}
    #        | {kind: trace, path: trace.jsonl, cache: {kind: unbounded | lru, capacity_blocks: N}, limit: N}
    output_tokens: 1024
    slo_tokens_per_s: 40
    search: {threshold_step_tokens: 128}
    baselines: {homogeneous_instances: 12}
    paper: {...}                           # reference figures printed beside ours
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import yaml

from prfaas_sglang import configcheck as cc
from prfaas_sglang.errors import ConfigError
from prfaas_sglang.plan.analytic import (
    Accelerator,
    AnalyticPrefill,
    FullAttention,
    ModelConfig,
    MoE,
    RecurrentState,
    SlidingWindow,
    analytic_decode,
)
from prfaas_sglang.plan.model import Deployment
from prfaas_sglang.plan.profiles import DecodeProfile, InstanceClass, TabulatedPrefill
from prfaas_sglang.plan.workload import (
    EmpiricalLengths,
    LruBlockCache,
    TraceRecord,
    TruncatedLogNormal,
    UnboundedCache,
    Workload,
    incremental_lengths,
    read_trace,
)

DATA_DIR = Path(__file__).resolve().parent / "data"


# --- models and accelerators -----------------------------------------------------------

_FULL_KEYS = {"layers", "kind", "q_heads", "kv_heads", "head_dim", "v_head_dim", "kv_lora_rank", "qk_rope_head_dim"}
_REC_KEYS = {"layers", "heads", "key_dim", "value_dim", "state_dtype_bytes", "conv_channels", "conv_kernel"}
_SWA_KEYS = {"layers", "q_heads", "kv_heads", "head_dim", "v_head_dim", "window"}
_MODEL_KEYS = {"name", "source", "total_params_b", "active_params_b", "weight_bytes_per_param", "kv_dtype_bytes",
               "full_attention", "recurrent", "sliding_window", "moe"}


def _ints(obj: dict, path: str, required: set[str], optional: set[str] = frozenset()) -> dict[str, int]:
    out = {k: cc.number(obj, k, path, required=True, positive=True, integer=True) for k in sorted(required)}
    for k in sorted(optional):
        value = cc.number(obj, k, path, nonnegative=True, integer=True)
        if value is not None:
            out[k] = value
    return out


def model_mapping(model: ModelConfig) -> dict:
    """``model`` in the form :func:`parse_model` reads (a topology's ``model.cost_model`` mapping):
    ``parse_model(model_mapping(m)) == m``. Zero-valued fields of another attention kind are left out."""
    def fields(part) -> dict:
        return {k: v for k, v in asdict(part).items() if v or k == "kind"}

    out = {"name": model.name, "source": model.source, "total_params_b": model.total_params_b,
           "active_params_b": model.active_params_b, "weight_bytes_per_param": model.weight_bytes_per_param,
           "kv_dtype_bytes": model.kv_dtype_bytes, "full_attention": fields(model.full_attention)}
    for key in ("recurrent", "sliding_window", "moe"):
        if getattr(model, key) is not None:
            out[key] = fields(getattr(model, key))
    return out


def parse_model(data: Any, path: str = "model") -> ModelConfig:
    obj = cc.mapping(data, path)
    cc.check_keys(obj, _MODEL_KEYS, path)
    full = cc.mapping(obj.get("full_attention"), f"{path}.full_attention")
    cc.check_keys(full, _FULL_KEYS, f"{path}.full_attention")
    kind = full.get("kind")
    if kind not in ("gqa", "mla"):
        raise ConfigError(f"{path}.full_attention.kind", f"must be gqa or mla, got {kind!r}")
    needed = {"layers", "q_heads", "head_dim", "v_head_dim"} | ({"kv_heads"} if kind == "gqa" else {"kv_lora_rank", "qk_rope_head_dim"})
    full_attention = FullAttention(kind=kind, **_ints(full, f"{path}.full_attention", needed))
    recurrent = sliding = moe = None
    if obj.get("recurrent") is not None:
        rec = cc.mapping(obj["recurrent"], f"{path}.recurrent")
        cc.check_keys(rec, _REC_KEYS, f"{path}.recurrent")
        recurrent = RecurrentState(**_ints(rec, f"{path}.recurrent", {"layers", "heads", "key_dim", "value_dim"},
                                           {"state_dtype_bytes", "conv_channels", "conv_kernel"}))
    if obj.get("sliding_window") is not None:
        swa = cc.mapping(obj["sliding_window"], f"{path}.sliding_window")
        cc.check_keys(swa, _SWA_KEYS, f"{path}.sliding_window")
        sliding = SlidingWindow(**_ints(swa, f"{path}.sliding_window", _SWA_KEYS))
    if obj.get("moe") is not None:
        m = cc.mapping(obj["moe"], f"{path}.moe")
        cc.check_keys(m, {"experts", "top_k"}, f"{path}.moe")
        moe = MoE(**_ints(m, f"{path}.moe", {"experts", "top_k"}))
        if moe.top_k > moe.experts:
            raise ConfigError(f"{path}.moe.top_k", "cannot exceed experts")
    total = cc.number(obj, "total_params_b", path, required=True, positive=True)
    active = cc.number(obj, "active_params_b", path, required=True, positive=True)
    if active > total:
        raise ConfigError(f"{path}.active_params_b", f"cannot exceed total_params_b ({active:g} > {total:g})")
    return ModelConfig(
        name=cc.req_str(obj, "name", path),
        source=cc.opt_str(obj, "source", path) or "",
        total_params_b=total,
        active_params_b=active,
        weight_bytes_per_param=cc.number(obj, "weight_bytes_per_param", path, default=2.0, positive=True),
        kv_dtype_bytes=cc.number(obj, "kv_dtype_bytes", path, default=2, positive=True, integer=True),
        full_attention=full_attention,
        recurrent=recurrent,
        sliding_window=sliding,
        moe=moe,
    )


_ACCEL_KEYS = {"name", "source", "gpus", "peak_tflops", "hbm_tb_s", "hbm_gb", "prefill_mfu", "decode_mfu",
               "decode_bw_efficiency", "decode_overhead_ms", "prefill_overhead_ms", "mem_fraction"}


def parse_accelerator(data: Any, path: str = "accelerator") -> Accelerator:
    obj = cc.mapping(data, path)
    cc.check_keys(obj, _ACCEL_KEYS, path)
    fraction = {"positive": True, "at_most": 1.0}
    return Accelerator(
        name=cc.req_str(obj, "name", path),
        source=cc.opt_str(obj, "source", path) or "",
        gpus=cc.number(obj, "gpus", path, required=True, positive=True, integer=True),
        peak_tflops=cc.number(obj, "peak_tflops", path, required=True, positive=True),
        hbm_tb_s=cc.number(obj, "hbm_tb_s", path, required=True, positive=True),
        hbm_gb=cc.number(obj, "hbm_gb", path, required=True, positive=True),
        prefill_mfu=cc.number(obj, "prefill_mfu", path, required=True, **fraction),
        decode_mfu=cc.number(obj, "decode_mfu", path, default=0.3, **fraction),
        decode_bw_efficiency=cc.number(obj, "decode_bw_efficiency", path, default=0.6, **fraction),
        decode_overhead_ms=cc.number(obj, "decode_overhead_ms", path, default=3.0, nonnegative=True),
        prefill_overhead_ms=cc.number(obj, "prefill_overhead_ms", path, default=0.0, nonnegative=True),
        mem_fraction=cc.number(obj, "mem_fraction", path, default=0.9, **fraction),
    )


MEASURED_STATES = ("none", "recurrent", "swa", "recurrent+swa")  # runtime.state_kind's names


def parse_measured_profile(data: Any, path: str = "profile") -> tuple[TabulatedPrefill, int, DecodeProfile | None]:
    """A measured profile file: ``{name, gpus_per_instance, points: [...], decode: {bs_max, step_s}}``,
    optionally ``state`` (:func:`measured_state`) and ``measurements`` (raw tables, not read here;
    ``plan/measured.py`` writes both)."""
    obj = cc.mapping(data, path)
    cc.check_keys(obj, {"name", "source", "gpus_per_instance", "points", "decode", "state", "measurements"}, path)
    measured_state(obj, path)
    points = obj.get("points")
    if not isinstance(points, list):
        raise ConfigError(f"{path}.points", "must be a list of {tokens, prefill_s, kv_bytes}")
    prefill = TabulatedPrefill(cc.req_str(obj, "name", path), points, path)
    gpus = cc.number(obj, "gpus_per_instance", path, required=True, positive=True, integer=True)
    decode = None
    if obj.get("decode") is not None:
        d = cc.mapping(obj["decode"], f"{path}.decode")
        cc.check_keys(d, {"bs_max", "step_s"}, f"{path}.decode")
        decode = DecodeProfile(cc.number(d, "bs_max", f"{path}.decode", required=True, positive=True),
                               cc.number(d, "step_s", f"{path}.decode", required=True, positive=True))
    return prefill, gpus, decode


def measured_state(data: Any, path: str = "profile") -> str:
    """The state a measured profile's model stops prefix reuse at (``state``, default ``none``)."""
    state = cc.mapping(data, path).get("state", "none")
    if state not in MEASURED_STATES:
        raise ConfigError(f"{path}.state", f"must be one of {', '.join(MEASURED_STATES)}, got {state!r}")
    return state


# --- scenarios ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Scenario:
    name: str
    description: str
    model_name: str
    deployment: Deployment
    workload: Workload
    slo_tokens_per_s: float
    step_tokens: float
    homogeneous_instances: int
    paper: dict


class Catalog:
    """Resolves names of shipped data (``data/<kind>/<name>.yaml``) or paths; reads files."""

    def __init__(self, data_dir: Path = DATA_DIR, base_dir: Path | None = None):
        self.data_dir, self.base_dir = data_dir, base_dir or Path.cwd()

    def names(self, kind: str) -> list[str]:
        return sorted(p.stem for p in (self.data_dir / kind).glob("*.yaml"))

    def _path(self, kind: str, ref: str, field: str) -> Path:
        shipped = self.data_dir / kind / f"{ref}.yaml"
        if shipped.is_file():
            return shipped
        path = Path(ref) if Path(ref).is_absolute() else self.base_dir / ref
        if path.is_file():
            return path
        raise ConfigError(field, f"no {kind[:-1]} named {ref!r} (shipped: {', '.join(self.names(kind))}) and no such file")

    def load_yaml(self, kind: str, ref: str, field: str) -> Any:
        path = self._path(kind, ref, field)
        try:
            return yaml.safe_load(path.read_text())
        except yaml.YAMLError as err:
            raise ConfigError(field, f"{path} is not valid YAML: {err}") from None

    def model(self, ref: Any, field: str = "model") -> ModelConfig:
        if isinstance(ref, dict):
            return parse_model(ref, field)
        if not isinstance(ref, str):
            raise ConfigError(field, "must be a model name, a path or a mapping")
        return parse_model(self.load_yaml("models", ref, field), field)

    def accelerator(self, ref: str, field: str) -> Accelerator:
        return parse_accelerator(self.load_yaml("accelerators", ref, field), field)

    def scenario(self, ref: str) -> Scenario:
        path = self._path("scenarios", ref, "--scenario")
        data = yaml.safe_load(path.read_text())
        return parse_scenario(data, Catalog(self.data_dir, path.parent))

    def trace_records(self, ref: str, field: str, limit: int | None) -> list[TraceRecord]:
        """The first ``limit`` records (None: all) of the trace ``ref`` (relative to :attr:`base_dir`);
        :func:`~prfaas_sglang.plan.workload.read_trace`'s errors."""
        path = Path(ref) if Path(ref).is_absolute() else self.base_dir / ref
        return list(read_trace(path, field, limit))


def parse_workload(data: Any, catalog: Catalog, path: str = "workload") -> Workload:
    obj = cc.mapping(data, path)
    kind = obj.get("kind")
    if kind == "lognormal":
        cc.check_keys(obj, {"kind", "mu", "sigma", "min_tokens", "max_tokens"}, path)
        return TruncatedLogNormal(
            cc.number(obj, "mu", path, required=True),
            cc.number(obj, "sigma", path, required=True, positive=True),
            cc.number(obj, "min_tokens", path, default=1.0, positive=True),
            cc.number(obj, "max_tokens", path, required=True, positive=True),
        )
    if kind == "lengths":
        cc.check_keys(obj, {"kind", "lengths"}, path)
        lengths = obj.get("lengths")
        if not isinstance(lengths, list) or not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in lengths):
            raise ConfigError(f"{path}.lengths", "must be a list of numbers")
        return EmpiricalLengths(lengths, "lengths")
    if kind == "trace":
        cc.check_keys(obj, {"kind", "path", "cache", "limit"}, path)
        cache_obj = cc.mapping(obj.get("cache", {"kind": "unbounded"}), f"{path}.cache")
        cc.check_keys(cache_obj, {"kind", "capacity_blocks"}, f"{path}.cache")
        if cache_obj.get("kind") == "unbounded":
            cache = UnboundedCache()
        elif cache_obj.get("kind") == "lru":
            cache = LruBlockCache(cc.number(cache_obj, "capacity_blocks", f"{path}.cache", required=True, positive=True, integer=True))
        else:
            raise ConfigError(f"{path}.cache.kind", f"must be unbounded or lru, got {cache_obj.get('kind')!r}")
        limit = cc.number(obj, "limit", path, positive=True, integer=True)
        records = catalog.trace_records(cc.req_str(obj, "path", path), f"{path}.path", limit)
        if not records:
            raise ConfigError(f"{path}.path", "trace has no records")
        return EmpiricalLengths(incremental_lengths(records, cache), "trace")
    raise ConfigError(f"{path}.kind", f"must be lognormal, lengths or trace, got {kind!r}")


_SCENARIO_KEYS = {"name", "description", "model", "prfaas", "pd", "link", "workload", "output_tokens",
                  "slo_tokens_per_s", "search", "baselines", "paper"}


def _instance_class(obj: dict, path: str, model: ModelConfig | None, catalog: Catalog,
                    workload: Workload, output_tokens: float, slo: float, needs_decode: bool) -> tuple[InstanceClass, int]:
    cc.check_keys(obj, {"accelerator", "profile", "instances"}, path)
    instances = cc.number(obj, "instances", path, required=True, nonnegative=True, integer=True)
    if ("accelerator" in obj) == ("profile" in obj):
        raise ConfigError(path, "give exactly one of accelerator (analytic) or profile (measured points)")
    if "profile" in obj:
        prefill, gpus, decode = parse_measured_profile(catalog.load_yaml("profiles", cc.req_str(obj, "profile", path), f"{path}.profile"), f"{path}.profile")
        if needs_decode and decode is None:
            raise ConfigError(f"{path}.profile", "a PD profile needs a decode section {bs_max, step_s}")
        return InstanceClass(prefill.name, gpus, prefill, decode), instances
    if model is None:
        raise ConfigError("model", f"is required when {path} uses an accelerator")
    accel = catalog.accelerator(cc.req_str(obj, "accelerator", path), f"{path}.accelerator")
    decode = analytic_decode(model, accel, workload.mean_tokens, output_tokens, slo) if needs_decode else None
    return InstanceClass(accel.name, accel.gpus, AnalyticPrefill(model, accel), decode), instances


def parse_scenario(data: Any, catalog: Catalog) -> Scenario:
    obj = cc.mapping(data, "scenario")
    cc.check_keys(obj, _SCENARIO_KEYS, "")
    name = cc.req_str(obj, "name", "")
    model = catalog.model(obj["model"]) if obj.get("model") is not None else None
    workload = parse_workload(obj.get("workload"), catalog)
    output_tokens = cc.number(obj, "output_tokens", "", required=True, positive=True)
    slo = cc.number(obj, "slo_tokens_per_s", "", required=True, positive=True)
    prfaas, n_prfaas = _instance_class(cc.mapping(obj.get("prfaas"), "prfaas"), "prfaas", model, catalog, workload, output_tokens, slo, False)
    pd, n_pd = _instance_class(cc.mapping(obj.get("pd"), "pd"), "pd", model, catalog, workload, output_tokens, slo, True)
    link = cc.mapping(obj.get("link"), "link")
    cc.check_keys(link, {"egress_gbps"}, "link")
    egress_bps = cc.number(link, "egress_gbps", "link", required=True, positive=True) * 1e9
    search = cc.mapping(obj.get("search", {}), "search")
    cc.check_keys(search, {"threshold_step_tokens"}, "search")
    baselines = cc.mapping(obj.get("baselines", {}), "baselines")
    cc.check_keys(baselines, {"homogeneous_instances"}, "baselines")
    same_gpus = round((n_prfaas * prfaas.gpus_per_instance + n_pd * pd.gpus_per_instance) / pd.gpus_per_instance)
    return Scenario(
        name=name,
        description=cc.opt_str(obj, "description", "") or "",
        model_name=model.name if model else pd.name,
        deployment=Deployment(prfaas, n_prfaas, pd, n_pd, egress_bps, output_tokens),
        workload=workload,
        slo_tokens_per_s=slo,
        step_tokens=cc.number(search, "threshold_step_tokens", "search", default=128.0, positive=True),
        homogeneous_instances=cc.number(baselines, "homogeneous_instances", "baselines", default=same_gpus, positive=True, integer=True),
        paper=dict(cc.mapping(obj.get("paper", {}), "paper")),
    )
