"""``bench profile`` (issue #48): a cost profile measured on real SGLang. On CPU in CI (the pipeline,
not the numbers); the lent GPU's run is in BENCHMARKS.md and ships as
``plan/data/profiles/measured-tiny-hybrid-h200.yaml``."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import yaml

from prfaas_sglang.gpu.profile import CPU_GRID, decode_step
from prfaas_sglang.plan.hf import model_from_hf_config
from prfaas_sglang.plan.scenario import parse_measured_profile


def test_the_decode_step_is_timed_only_while_every_request_decodes():
    # request a's first token at 0 and b's at 1.0: before 1.0 only a decoded (batch 1)
    a = [0.0, 0.1, 0.2, 1.0, 1.5, 2.0]
    b = [1.0, 1.5, 2.0, 2.5]
    step_s, intervals = decode_step([a, b])
    assert step_s == pytest.approx(0.5) and intervals == 5
    assert decode_step([a, []]) == (None, 0)  # a request that streamed nothing: no step


def test_pool_geometry_reads_a_hybrids_full_attention_kv_and_its_state_slots():
    """The layout of SGLang 0.5.15's pools for a linear-attention hybrid (HybridLinearKVPool around
    the full-attention pool; the Mamba pool's conv list and temporal state, [layers, slots, ...])."""
    from prfaas_sglang.hooks.pool_geometry import pool_geometry

    slots, tokens = 5, 17
    full = SimpleNamespace(k_buffer=[torch.zeros(tokens, 2, 64, dtype=torch.bfloat16)],
                           v_buffer=[torch.zeros(tokens, 2, 64, dtype=torch.bfloat16)])
    kv = SimpleNamespace(full_kv_pool=full)
    cache = SimpleNamespace(conv=[torch.zeros(3, slots, 1024, 3, dtype=torch.bfloat16)],
                            temporal=torch.zeros(3, slots, 8, 64, 64, dtype=torch.float32))
    params = SimpleNamespace(token_to_kv_pool_allocator=SimpleNamespace(get_kvcache=lambda: kv, size=16),
                             req_to_token_pool=SimpleNamespace(mamba_pool=SimpleNamespace(mamba_cache=cache, size=4)))
    geometry = pool_geometry(params)
    assert geometry["kv_bytes_per_token"] == 2 * 2 * 64 * 2  # K and V, 2 heads of 64, bf16: 512
    assert geometry["state_bytes_per_request"] == 3 * 1024 * 3 * 2 + 3 * 8 * 64 * 64 * 4 == 411_648  # the tiny hybrid's
    assert geometry["state_slots"] == 4 and geometry["kv_pool_tokens"] == 16


@pytest.mark.slow
@pytest.mark.serial  # a measurement of the engine's times (and calibration's input): alone, beside the shared deployment
@pytest.mark.xdist_group("sglang-cpu")
def test_profile_on_real_sglang_on_cpu_writes_a_profile_the_planner_loads(cpu_profile):
    """The whole pipeline on SGLang's CPU engine (a tiny Llama): server through the launcher, prefill,
    cached prefix, decode steps, the engine's own pools, the file, the roofline beside it."""
    out, result = cpu_profile
    doc = yaml.safe_load(out.read_text())
    prefill, gpus, decode = parse_measured_profile(doc)
    assert [p[0] for p in prefill.points] == list(CPU_GRID.prefill_tokens) and gpus == 1
    assert decode.bs_max == max(CPU_GRID.decode_batches) and decode.step_s > 0
    assert doc["state"] == "none"  # a dense model: reuse does not stop at a state
    # what SGLang's pools hold per token is what the served config's roofline says (4 KiB for the tiny Llama)
    from prfaas_sglang.gpu.tiny_model import tiny_cpu_config

    model = model_from_hf_config(tiny_cpu_config(4096, 2, 0))
    assert doc["measurements"]["pool"] == {"kv_bytes_per_token": 4096, "state_bytes_per_request": 0}
    assert all(p["kv_bytes"] == model.kv_bytes(p["tokens"]) for p in doc["points"])
    # the prefix sent just before is reused in full; every decode point saw steps while all decoded
    (cached,) = doc["measurements"]["cached"]
    assert cached["cached_tokens"] == cached["prefix_tokens"] == CPU_GRID.cached[0][0]
    assert all(d["step_s"] and d["intervals"] > 0 for d in doc["measurements"]["decode"])
    quantities = [r["quantity"] for r in result["roofline"]]
    assert quantities.count("prefill_s") == len(CPU_GRID.prefill_tokens) + len(CPU_GRID.cached)
    assert all(r["ratio"] and r["ratio"] > 0 for r in result["roofline"])


def test_the_variants_are_the_roofline_the_measured_profile_and_it_twice_as_slow():
    from prfaas_sglang.gpu.predict import ttft_estimate_s, variant_docs
    from prfaas_sglang.gpu.tiny_model import tiny_config
    from prfaas_sglang.plan.scenario import Catalog

    shipped = yaml.safe_load((Catalog().data_dir / "profiles/measured-tiny-hybrid-h200.yaml").read_text())
    docs = variant_docs(shipped, tiny_config(4096, 2, 0), "h200x8", 1)
    for doc in docs.values():
        parse_measured_profile(doc)  # each loads where a measured profile does
    assert [p["tokens"] for p in docs["roofline"]["points"]] == [p["tokens"] for p in shipped["points"]]
    assert docs["roofline"]["points"][0]["kv_bytes"] == shipped["points"][0]["kv_bytes"]  # same bytes, other times
    assert docs["off-2x"]["points"][-1]["prefill_s"] == 2 * shipped["points"][-1]["prefill_s"]
    assert docs["off-half"]["points"][-1]["prefill_s"] == 0.5 * shipped["points"][-1]["prefill_s"] == docs["off-half-given"]["points"][-1]["prefill_s"]
    assert ttft_estimate_s("parse;dur=0.4, route;dur=0.1, ttft-estimate;dur=250.0, legs;dur=300") == 0.25
    assert ttft_estimate_s("parse;dur=0.4") is None


@pytest.mark.slow
@pytest.mark.serial  # the real engine's TTFTs are what it learns from: other tests' load on the 2 cores skews them
@pytest.mark.xdist_group("sglang-cpu")
def test_on_real_sglang_on_cpu_calibration_moves_the_routers_predictions_toward_what_it_sees(cpu_profile, sglang_cpu_ready):
    """``bench predict`` on SGLang's CPU engine: the measured profile twice as fast, as given and with
    the router's online calibration, their requests interleaved. On two cores the PD path's TTFT is mostly a per-request cost
    (bootstrap, KV hand-over, the decode's first step), so the error does not fall below 15% here
    (BENCHMARKS.md); what must hold is that calibration moves the predictions toward what is seen, in
    both clusters, and that the correction goes the error's way.

    Until 2026-11-29 this asserted a scale above 1 in both clusters: every idle SGLang scheduler polled
    without pause (a core each; the servers now run with --sleep-on-idle), so the three servers the
    predictions ran on were slower than the one the profile was measured on by more than the profile's
    2x. With that contention gone, what the scale must do follows from the uncalibrated error.

    Until 2026-11-29 the two variants also ran one after the other: CI's run of 667b901 saw the PD
    path's TTFTs several times slower while the calibrated router ran (PD median predicted / seen 0.31
    as given, 0.15 calibrated, with a learnt scale of 2.7 on a profile already doubled), which fails
    the assertion for a reason that is not the calibration's. Interleaved, a slow spell falls on both.

    Until 2026-11-30 the calibrated router was compared with the measured profile as given, not with the
    doubled one it starts from: with the PD decode no longer spinning a core beside the prefill it waits
    for (the scheduler-poll-wait hook), the measured profile predicted PrfaaS within 11% (median ratio
    0.90), closer than 16 requests calibrate a 2x error to (1.30). The baseline became the router on the
    same starting profile without calibration, run beside it.

    Until 2026-11-30 the profile was doubled, not halved: how far a doubled profile is off depends on how much
    a route's TTFT holds beyond its prefill, which differs by machine. On a slower machine (runs 37 and 38 of
    docs/benchmarks/test-suite.md) the doubled profile predicted PrfaaS within 5% (median 1.05), leaving
    calibration nothing to correct there (it went to 1.19 and 1.18). A route's TTFT holds its prefill and
    more, so a halved profile under-predicts both clusters unless the measured one is twice too slow (the
    most seen: 1.46x, PrfaaS, a profile measured before the deployment started)."""
    from prfaas_sglang.gpu import predict

    out, _ = cpu_profile
    ctx = sglang_cpu_ready  # its variant routers run over the session's deployment (tests/deployments.py)
    variants = predict.run("sglang-cpu", None, out, ctx.log, requests=16, variants=("off-half-given", "off-half"),
                           dep=ctx.dep, model_dir=ctx.model_dir)["variants"]
    given, calibrated = variants["off-half-given"], variants["off-half"]
    print(f"\npredicted / seen, median: off-half as given {given['median_ratio_predicted_to_seen']}, calibrated "
          f"{calibrated['median_ratio_predicted_to_seen']} (scale {calibrated['prefill_scale']}, offset "
          f"{calibrated['prefill_offset_s']})")
    assert given["calibration"] is False and calibrated["calibration"] is True
    for cluster in ("pd", "prfaas"):  # |log(predicted / seen)|, the median request's
        before = abs(math.log(given["median_ratio_predicted_to_seen"][cluster]))
        after = abs(math.log(calibrated["median_ratio_predicted_to_seen"][cluster]))
        assert after < before, (cluster, given["median_ratio_predicted_to_seen"], calibrated["median_ratio_predicted_to_seen"])
    # The correction goes the error's way: up where the profile under-predicts (with a halved one, both
    # clusters), down where it over-predicts. Not read from the scale alone: the router learns a per-request
    # offset beside it, and where that offset takes the fixed cost, a scale can rightly fall although the
    # median request is under-predicted (2026-11-30, a doubled profile: PD 0.72 -> 0.92 with a scale of 0.88).
    scales = calibrated["prefill_scale"]  # per cluster of the topology (by name, since the fleet change)
    assert len(scales) == 2, scales
    for cluster in ("pd", "prfaas"):
        before, after = given["median_ratio_predicted_to_seen"][cluster], calibrated["median_ratio_predicted_to_seen"][cluster]
        assert (after > before) == (before < 1), (cluster, before, after, scales, calibrated["prefill_offset_s"])
    assert all(row["predicted_s"] and row["seen_s"] > 0 for row in calibrated["rows"])
