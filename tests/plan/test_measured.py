"""Measured profiles (issue #48): the file ``bench profile`` writes loads in the planner, the router's
runtime model and the emulated engine; the planner answers the same from tabulated points as from its
equations; a served model's config.json gives the roofline the engine's pools agree with."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import yaml

from prfaas_sglang.engine.mock.timing import load_timing
from prfaas_sglang.errors import ConfigError
from prfaas_sglang.gpu.tiny_model import tiny_config, tiny_cpu_config
from prfaas_sglang.plan.hf import model_from_hf_config
from prfaas_sglang.plan.measured import (
    CachedPoint,
    DecodePoint,
    Measurements,
    PoolGeometry,
    PrefillPoint,
    profile_doc,
    roofline_rows,
    scaled,
    tabulate,
)
from prfaas_sglang.plan.scenario import Catalog, parse_measured_profile, parse_scenario
from prfaas_sglang.plan.search import search

CATALOG = Catalog()
SHIPPED = Path(__file__).resolve().parents[2] / "prfaas_sglang/plan/data/profiles/measured-tiny-hybrid-h200.yaml"


def _measurements() -> Measurements:
    # 2,048 tokens slower than 4,096 in one repeat: the file's curve must still be non-decreasing
    prefill = (PrefillPoint(1024, (0.031, 0.032, 0.030)), PrefillPoint(2048, (0.036, 0.037, 0.035)),
               PrefillPoint(4096, (0.033, 0.032, 0.034)), PrefillPoint(32768, (0.094, 0.096, 0.10)))
    decode = (DecodePoint(1, 1024, 0.009, 63), DecodePoint(32, 1024, 0.012, 435), DecodePoint(32, 8192, 0.0136, 435),
              DecodePoint(64, 8192, None, 0))
    return Measurements(prefill, (CachedPoint(8192, 1024, 8192, 0.026),), decode, PoolGeometry(512, 411_648))


def test_the_profile_file_round_trips_through_every_loader(tmp_path):
    doc = profile_doc(_measurements(), "measured-x", "test", "recurrent")
    assert [p["prefill_s"] for p in doc["points"]] == [0.031, 0.036, 0.036, 0.096]  # running max of the medians
    assert doc["points"][0]["kv_bytes"] == 1024 * 512 + 411_648
    assert doc["decode"] == {"bs_max": 32, "step_s": 0.0136}  # the largest batch that yielded a step
    path = tmp_path / "measured.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    loaded = yaml.safe_load(path.read_text())
    assert loaded == doc
    # the planner
    prefill, gpus, decode = parse_measured_profile(loaded)
    assert gpus == 1 and decode.bs_max == 32 and decode.step_s == 0.0136
    assert [(t, s, b) for t, s, b in prefill.points] == [(p["tokens"], p["prefill_s"], p["kv_bytes"]) for p in doc["points"]]
    assert prefill.prefill_s(32768) == pytest.approx(0.096) and prefill.kv_bytes(4096) == pytest.approx(4096 * 512 + 411_648)
    # the emulated engine: the measured curve, scaled as its emulation says; a hybrid (state) model
    timing = load_timing(str(path), speedup=2.0, kv_scale=0.5, max_batch=None)
    assert timing.prefill_s(32768) == pytest.approx(0.048) and timing.hybrid and timing.max_batch == 32
    assert timing.kv_bytes(1024) == int((1024 * 512 + 411_648) * 0.5)
    # the router's runtime model: each engine cluster of a topology given the file as its profile
    from prfaas_sglang.demo.cluster import PortPicker
    from prfaas_sglang.gpu.e2e import e2e_topology
    from prfaas_sglang.runtime import from_topology
    from prfaas_sglang.topology import parse_topology

    topo = e2e_topology(tmp_path / "model", PortPicker())
    for cluster in topo["clusters"].values():
        if cluster["kind"] in ("prfaas", "pd"):
            del cluster["accelerator"]
            cluster["profile"] = str(path)
    runtime = from_topology(parse_topology(topo, base_dir=tmp_path), emulated=False)
    assert runtime.prefill_cost("prfaas").prefill_s(32768) == pytest.approx(0.096)
    assert runtime.prefill_cost("pd").kv_bytes(1024) == pytest.approx(1024 * 512 + 411_648)
    assert runtime.costs["pd"].state == "recurrent"


def test_a_bad_state_or_an_unknown_key_is_named():
    doc = profile_doc(_measurements(), "m", "test", "recurrent")
    with pytest.raises(ConfigError, match="profile.state"):
        parse_measured_profile({**doc, "state": "quantum"})
    with pytest.raises(ConfigError, match="colour"):
        parse_measured_profile({**doc, "colour": 1})


def test_the_planner_answers_the_same_from_tabulated_points_as_from_its_equations(tmp_path):
    """The case study from the roofline, and from profile files holding the roofline's own values
    every 512 tokens: the same threshold (within one search step) and the same capacity (0.5%)."""
    base = CATALOG.scenario("case-study")
    dep = base.deployment
    tokens = range(512, int(base.workload.max_tokens) + 513, 512)
    for side, cls in (("prfaas", dep.prfaas), ("pd", dep.pd)):
        decode = cls.decode or dep.pd.decode
        (tmp_path / f"{side}.yaml").write_text(yaml.safe_dump(
            tabulate(cls.prefill, tokens, decode, f"{side}-tab", "roofline", gpus_per_instance=cls.gpus_per_instance)))
    raw = yaml.safe_load((Path(__file__).resolve().parents[2] / "prfaas_sglang/plan/data/scenarios/case-study.yaml").read_text())
    raw["prfaas"] = {"profile": str(tmp_path / "prfaas.yaml"), "instances": raw["prfaas"]["instances"]}
    raw["pd"] = {"profile": str(tmp_path / "pd.yaml"), "instances": raw["pd"]["instances"]}
    tab = parse_scenario(raw, Catalog(base_dir=tmp_path))
    ours, theirs = search(dep, base.workload, base.step_tokens).best, search(tab.deployment, tab.workload, tab.step_tokens).best
    assert abs(ours.threshold_tokens - theirs.threshold_tokens) <= base.step_tokens
    assert ours.n_prefill == theirs.n_prefill
    assert theirs.lambda_max_rps == pytest.approx(ours.lambda_max_rps, rel=5e-3)


def test_scaled_profiles_are_that_many_times_slower():
    doc = profile_doc(_measurements(), "m", "test", "recurrent")
    off = scaled(doc, 2.0)
    assert [p["prefill_s"] for p in off["points"]] == [2 * p["prefill_s"] for p in doc["points"]]
    assert off["decode"]["step_s"] == 2 * doc["decode"]["step_s"] and "measurements" not in off
    assert [p["kv_bytes"] for p in off["points"]] == [p["kv_bytes"] for p in doc["points"]]


def test_the_tiny_hybrids_roofline_holds_what_sglangs_pools_held_on_the_h200():
    """``bench profile`` on the lent H200 (2026-11-27) read 512 bytes of KV per token and 411,648
    bytes of linear-attention state per request from SGLang's pools (the shipped profile); the
    config's roofline must say the same, or the router mis-sizes every transfer."""
    model = model_from_hf_config(tiny_config(4096, 2, 0))
    shipped = yaml.safe_load(SHIPPED.read_text())
    pool = shipped["measurements"]["pool"]
    assert model.full_attention.kv_elems_per_token() * model.kv_dtype_bytes == pool["kv_bytes_per_token"] == 512
    assert model.kv_bytes(0) == pool["state_bytes_per_request"]
    assert all(model.kv_bytes(p["tokens"]) == p["kv_bytes"] for p in shipped["points"])
    assert model.recurrent.layers == 3 and model.full_attention.layers == 1 and model.moe.experts == 8
    dense = model_from_hf_config(tiny_cpu_config(4096, 2, 0))
    assert dense.recurrent is None and dense.kv_bytes(1) == 4 * 4 * 64 * 2 * 2  # 4 layers x 4 KV heads x 64 x (K, V) x bf16


def test_a_config_without_what_the_roofline_needs_is_named():
    config = tiny_config(4096, 2, 0)
    with pytest.raises(ConfigError, match="hidden_size"):
        model_from_hf_config({k: v for k, v in config.items() if k != "hidden_size"})
    with pytest.raises(ConfigError, match="linear_key_head_dim"):
        model_from_hf_config({**config, "linear_key_head_dim": "64"})
    with pytest.raises(ConfigError, match="config.json"):
        model_from_hf_config(json.dumps(config))


def test_the_roofline_rows_divide_measured_by_predicted():
    model = model_from_hf_config(tiny_config(4096, 2, 0))
    accel = dataclasses.replace(CATALOG.accelerator("h200x8", "x"), gpus=1)
    rows = roofline_rows(_measurements(), model, accel)
    assert [r["quantity"] for r in rows].count("prefill_s") == 5  # four uncached, one cached
    assert [r["quantity"] for r in rows].count("decode_step_s") == 3  # the batch that yielded no step is left out
    assert all(r["ratio"] == pytest.approx(r["measured"] / r["roofline"]) for r in rows)
    kv = [r for r in rows if r["quantity"] == "kv_bytes"]
    assert [r["ratio"] for r in kv] == [pytest.approx(1.0)] * 2
