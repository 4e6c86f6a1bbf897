"""``python -m prfaas_sglang.bench profile --engine {sglang,sglang-cpu}``: a cost profile measured on real SGLang.

Starts one plain SGLang server through our launcher (role ``single``, the server flags of
``bench gpu-e2e``'s profile, our ``prfaas-hybrid`` cache backend so that the engine reports its
own pools), then measures, each time on fresh random prompts (no prefix cached unless asked):

    prefill   T_prefill(l) for uncached l over the grid: SGLang's own ``e2e_latency`` of a
              one-token answer (the prefill and one sampling step; no HTTP), median of repeats
    cached    l new tokens after a prefix of c tokens the engine holds (sent just before):
              the time, and the ``cached_tokens`` SGLang reports
    decode    the step time at batch B and context C: B streamed requests of C tokens start
              together; the median interval between tokens once all B decode
    pools     KV bytes per token (full attention, every layer) and state bytes per request
              (linear attention), read from the engine's pools (``PRFAAS_POOL_REPORT``)

and writes the measured profile file (``plan/measured.py``) that the planner (``profile:`` in
a scenario), the router's runtime model (``clusters.<c>.profile``) and the emulated engine
(``--profile FILE``) load, and prints each measured point beside the roofline's prediction for
the same model (its ``config.json``, ``plan/hf.py``) on ``--roofline-accelerator``.

``--engine sglang`` runs on the GPU machine from the ``gpu-bundle`` (the tiny hybrid);
``--engine sglang-cpu`` on this machine's CPU with a tiny Llama: that proves the pipeline,
not the numbers.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import json
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from prfaas_sglang.adapters import http_sync
from prfaas_sglang.demo.cluster import ProcessGroup, free_port
from prfaas_sglang.gpu.e2e import (
    STARTUP_TIMEOUT_S,
    bundle_env,
    http,
    profile_for,
    prompt_ids,
    unpack,
)
from prfaas_sglang.plan.measured import (
    CachedPoint,
    DecodePoint,
    Measurements,
    PoolGeometry,
    PrefillPoint,
)


@dataclass(frozen=True)
class Grid:
    prefill_tokens: tuple[int, ...]
    repeats: int
    cached: tuple[tuple[int, int], ...]  # (prefix tokens, new tokens)
    decode_batches: tuple[int, ...]
    decode_contexts: tuple[int, ...]
    decode_new_tokens: int


# The tiny hybrid's context is 65,536 tokens (gpu/tiny_model.py); the server's pool holds 512K.
GPU_GRID = Grid((1024, 2048, 4096, 8192, 16384, 32768, 65000), 3, ((8192, 1024), (8192, 8192), (32768, 4096)),
                (1, 8, 32), (1024, 8192), 64)
# Two cores: seconds per point, the pipeline exercised end to end.
CPU_GRID = Grid((256, 512, 1024, 2048), 1, ((1024, 256),), (1, 4), (256,), 8)
GRIDS = {"sglang": GPU_GRID, "sglang-cpu": CPU_GRID}
REQUEST_TIMEOUT_S = 300.0


def generate(url: str, ids: list[int], max_new_tokens: int) -> dict:
    """SGLang's native ``/generate`` of ``ids``, greedy, EOS ignored; its ``meta_info``; raises on an error."""
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True}}
    status, _, payload = http("POST", url + "/generate", body, timeout_s=REQUEST_TIMEOUT_S)
    if status != 200:
        raise RuntimeError(f"/generate of {len(ids)} tokens: HTTP {status} {payload[:300]!r}")
    return json.loads(payload)["meta_info"]


def token_times(url: str, ids: list[int], max_new_tokens: int, start: threading.Barrier) -> list[float]:
    """A streamed ``/generate``: the monotonic time each chunk (one token) arrived."""
    body = {"input_ids": ids, "stream": True,
            "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True}}
    start.wait()
    times = []
    with http_sync.stream("POST", url + "/generate", json_body=body, timeout_s=REQUEST_TIMEOUT_S) as answer:
        for line in answer.raise_for_status().lines():
            if line.startswith(b"data:") and not line.startswith(b"data: [DONE]"):
                times.append(time.monotonic())
    return times


def decode_step(per_request: list[list[float]]) -> tuple[float | None, int]:
    """(median interval between tokens once every request has its first, number of intervals) (pure)."""
    import statistics

    if not per_request or any(not t for t in per_request):
        return None, 0
    all_decoding = max(t[0] for t in per_request)
    intervals = [b - a for t in per_request for a, b in itertools.pairwise(t) if a >= all_decoding]
    return (statistics.median(intervals) if intervals else None), len(intervals)


class Prompts:
    """Fresh prompts: each call a seed no earlier prompt used."""

    def __init__(self, vocab_size: int, seed: int = 9_000_000):
        self.vocab_size, self.seed = vocab_size, seed

    def __call__(self, num_tokens: int) -> list[int]:
        self.seed += 1
        return prompt_ids(num_tokens, self.vocab_size, self.seed)


def measure(url: str, grid: Grid, prompts: Prompts, log: Callable[[str], None]) -> tuple[list, list, list]:
    """The prefill, cached-prefix and decode tables of :data:`Grid` against the server at ``url``."""
    prefill = []
    for tokens in grid.prefill_tokens:
        generate(url, prompts(tokens), 1)  # a warm-up: kernels compile per shape on first use
        samples = tuple(float(generate(url, prompts(tokens), 1)["e2e_latency"]) for _ in range(grid.repeats))
        prefill.append(PrefillPoint(tokens, samples))
        log(f"[profile] prefill {tokens}: {', '.join(f'{s:.4f}' for s in samples)} s")
    cached = []
    for prefix_tokens, new_tokens in grid.cached:
        prefix = prompts(prefix_tokens)
        generate(url, prefix, 1)
        meta = generate(url, prefix + prompts(new_tokens), 1)
        cached.append(CachedPoint(prefix_tokens, new_tokens, meta.get("cached_tokens"), float(meta["e2e_latency"])))
        log(f"[profile] cached {cached[-1]}")
    decode = []
    for context in grid.decode_contexts:
        for batch in grid.decode_batches:
            barrier = threading.Barrier(batch)
            with concurrent.futures.ThreadPoolExecutor(batch) as pool:
                futures = [pool.submit(token_times, url, prompts(context), grid.decode_new_tokens, barrier) for _ in range(batch)]
                step_s, intervals = decode_step([f.result() for f in futures])
            decode.append(DecodePoint(batch, context, step_s, intervals))
            log(f"[profile] decode {decode[-1]}")
    return prefill, cached, decode


def read_pool(report: Path) -> PoolGeometry:
    """The engine's pool geometry from its ``PRFAAS_POOL_REPORT`` lines; raises when none is usable."""
    lines = [json.loads(x) for x in report.read_text().splitlines()] if report.exists() else []
    good = [x for x in lines if "kv_bytes_per_token" in x]
    if not good:
        raise RuntimeError(f"the engine reported no pool geometry ({lines[:1] or 'no report'})")
    return PoolGeometry(int(good[0]["kv_bytes_per_token"]), int(good[0]["state_bytes_per_request"]))


def run(engine: str, bundle_dir: Path | None, model_dir: Path | None, out: Path, log: Callable[[str], None],
        grid: Grid | None = None, roofline_accelerator: str = "h200x8", roofline_gpus: int = 1) -> dict:
    """Start the server, measure, write the profile to ``out``; the result (profile, roofline rows, facts)."""
    import yaml

    from prfaas_sglang.plan.hf import model_from_hf_config
    from prfaas_sglang.plan.measured import format_rows, profile_doc, roofline_rows
    from prfaas_sglang.plan.scenario import Catalog

    checkout, started = Path(__file__).resolve().parents[2], time.monotonic()
    profile, grid = profile_for(engine), grid or GRIDS[engine]
    root = unpack(bundle_dir) if engine == "sglang" else None
    if root is not None and str(root / "site") not in sys.path:  # what the GPU machine lacks, as checks.run adds it
        sys.path.append(str(root / "site"))
    work = Path(tempfile.mkdtemp(prefix="prfaas-profile-"))
    if model_dir is None and engine == "sglang-cpu":
        from prfaas_sglang.gpu.tiny_model import make_model

        make_model(work / "model", cpu=True, log=log)
        model_dir = work / "model"
    model_dir = model_dir or root / "model"
    config = json.loads((model_dir / "config.json").read_text())
    procs, report, port = ProcessGroup(work / "logs"), work / "pool.jsonl", free_port()
    env = {**bundle_env(root, checkout, profile=profile), "PRFAAS_POOL_REPORT": str(report)}
    versions = _versions(root, checkout, engine)
    try:
        procs.start("server", [sys.executable, "-m", "prfaas_sglang.launch", "--role", "single", "--model-path",
                               str(model_dir), "--host", "127.0.0.1", "--port", str(port), "--", *profile.flags,
                               "--radix-cache-backend", "prfaas-hybrid"], base_env=env)
        url = f"http://127.0.0.1:{port}"
        procs.wait_healthy(url + "/health", procs.latest("server"), timeout_s=STARTUP_TIMEOUT_S)  # quotes its log
        log(f"[profile] server healthy after {time.monotonic() - started:.1f} s")
        pool = read_pool(report)
        prefill, cached, decode = measure(url, grid, Prompts(int(config["vocab_size"])), log)
    finally:
        procs.stop()
    measurements = Measurements(tuple(prefill), tuple(cached), tuple(decode), pool)
    model = model_from_hf_config(config, name=profile.served_name)
    state = "recurrent" if model.recurrent is not None else "none"
    device = versions.get("gpu") or "cpu"
    source = (f"bench profile --engine {engine}: {device}, sglang {versions.get('sglang')}, "
              f"{time.strftime('%Y-%m-%d')}; prefill_s = SGLang's e2e_latency of a one-token answer")
    doc = profile_doc(measurements, f"measured-{profile.served_name}@{device.replace(' ', '-')}", source, state)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(yaml.safe_dump(doc, sort_keys=False))
    accel = dataclasses.replace(Catalog().accelerator(roofline_accelerator, "--roofline-accelerator"), gpus=roofline_gpus)
    rows = roofline_rows(measurements, model, accel)
    log(f"[profile] measured vs the roofline ({model.name} on {roofline_gpus} x {accel.name}'s GPU):\n{format_rows(rows)}")
    shutil.rmtree(work, ignore_errors=True)
    return {"profile": str(out), "doc": doc, "roofline": rows, "roofline_accelerator": f"{roofline_gpus}x {accel.name}",
            "versions": versions, "engine": engine, "seconds": round(time.monotonic() - started, 1)}


def _versions(root: Path | None, checkout: Path, engine: str) -> dict:
    if engine == "sglang":
        from prfaas_sglang.gpu.checks import preflight

        return preflight(root, checkout)
    import importlib.metadata as md

    return {d: md.version(d) for d in ("sglang", "torch", "transformers")}
