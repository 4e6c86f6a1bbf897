"""``python -m prfaas_sglang.bench predict --engine {sglang,sglang-cpu} --measured FILE``: the router's
TTFT predictions against the TTFTs real SGLang then shows, per cost profile.

One deployment through our launcher (``bench gpu-e2e``'s: PrfaaS, PD-P, PD-D, kv-index, loopback),
then, for each variant, a router of its own over the same workers, started from a topology whose
engine clusters name the variant's profile file (``clusters.<c>.profile``):

    roofline     the served model's roofline (its ``config.json``, ``plan/hf.py``) on
                 ``--roofline-accelerator``, tabulated; calibration off: the model as given
    measured     the profile ``bench profile`` measured (``--measured``); calibration off
    off-2x       that profile with every time doubled; the router's online calibration on
    off-2x-given the off-2x profile, calibration off: where off-2x starts from (not run by default;
                 the tests compare the two)
    off-half     that profile with every time halved, calibration on; off-half-given the same, calibration
                 off (neither run by default; the tests compare the two): a route's TTFT holds its prefill
                 and more (the KV hand-over, the decode's first step), so a halved profile under-predicts
                 unless the measured one is twice too slow, where how far a doubled one is off depends on
                 how much more, which differs by machine

Each router gets prompts of the same lengths, one at a time (lengths cycling over the engine
profile's short and long ones, so both clusters serve), each streamed with a few output tokens; the
routers' requests interleave (each length to every router in turn), so that a slow spell of the
machine falls on every variant alike. Per request: the TTFT the router predicted when it routed
(``Server-Timing: ttft-estimate``, the number placement and early rejection compare with the SLO)
and the TTFT the client saw; from each router, its own error series (``/status`` ``calibration.ttft_error_series``: median and mean
``|predicted - observed| / observed`` per 25 requests, observed from its dispatch) and the
scales it learned.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from prfaas_sglang.adapters import http_sync
from prfaas_sglang.demo.cluster import ProcessGroup, free_port
from prfaas_sglang.gpu.e2e import (
    RunningDeployment,
    http,
    profile_for,
    prompt_ids,
    request_body,
    route_header,
    router_ready,
    start_deployment,
    start_router,
    unpack,
)

VARIANTS = ("roofline", "measured", "off-2x")  # what runs by default
OFF_BY = {"off-2x": 2.0, "off-half": 0.5}  # the measured profile with every time scaled by this
CALIBRATED = tuple(OFF_BY)  # the variants whose router calibrates online; each also runs as NAME-given, without
ALL_VARIANTS = (*VARIANTS, *(name for name in OFF_BY if name not in VARIANTS), *(f"{name}-given" for name in OFF_BY))
OUTPUT_TOKENS = 4


def stream_ttft(router: str, ids: list[int], model: str) -> tuple[float, dict]:
    """(seconds to the first streamed chunk, response headers) of a completion of ``ids``."""
    case = {"name": "predict", "endpoint": "/v1/completions", "stream": True}
    body = {**request_body(case, ids, None, model), "max_tokens": OUTPUT_TOKENS}
    started, first = time.monotonic(), None
    with http_sync.stream("POST", router + "/v1/completions", json_body=body, timeout_s=300) as answer:
        headers = dict(answer.raise_for_status().headers)
        for line in answer.lines():
            if first is None and line.startswith(b"data:"):
                first = time.monotonic() - started
    if first is None:
        raise RuntimeError("the stream carried no chunk")
    return first, headers


def ttft_estimate_s(server_timing: str) -> float | None:
    """The ``ttft-estimate`` of a ``Server-Timing`` header, in seconds (pure)."""
    from prfaas_sglang.wire.server_timing import server_timing as parse

    ms = parse(server_timing).get("ttft-estimate")
    return None if ms is None else ms / 1e3


def variant_docs(measured: dict, model_config: dict, accelerator: str, gpus: int) -> dict[str, dict]:
    """Every variant's profile file (pure but for reading the shipped accelerator)."""
    from prfaas_sglang.plan.analytic import AnalyticPrefill, decode_step_s
    from prfaas_sglang.plan.hf import model_from_hf_config
    from prfaas_sglang.plan.measured import scaled, tabulate
    from prfaas_sglang.plan.profiles import DecodeProfile
    from prfaas_sglang.plan.scenario import Catalog

    model = model_from_hf_config(model_config)
    accel = dataclasses.replace(Catalog().accelerator(accelerator, "--roofline-accelerator"), gpus=gpus)
    tokens = [p["tokens"] for p in measured["points"]]
    bs_max = measured["decode"]["bs_max"]
    roofline = tabulate(AnalyticPrefill(model, accel), tokens, DecodeProfile(bs_max, decode_step_s(model, accel, bs_max, tokens[0])),
                        f"roofline-{model.name}@{gpus}x{accel.name}", "plan/hf.py + the accelerator file",
                        state=measured.get("state", "none"))
    off = {name: scaled(measured, factor) for name, factor in OFF_BY.items()}
    return {"roofline": roofline, "measured": measured, **off, **{f"{name}-given": doc for name, doc in off.items()}}


def start_variant_router(dep: RunningDeployment, name: str, profile_path: Path, router_args: list[str],
                         threshold_tokens: int, work: Path, wait: bool = True) -> str:
    """A router of its own (``router-{name}``) over ``dep``'s workers and kv-index, every engine
    cluster costed by ``profile_path``; its URL, once healthy with the threshold pinned unless ``wait``
    is False (then :func:`~prfaas_sglang.gpu.e2e.router_ready`)."""
    import yaml

    topology = json.loads(json.dumps(dep.topology))
    for cluster in topology["clusters"].values():
        if cluster["kind"] in ("prfaas", "pd"):
            cluster.pop("accelerator", None)
            cluster["profile"] = str(profile_path)
        for node in cluster["nodes"]:
            if node["role"] == "router":
                node["port"] = free_port()
                url = f"http://{node['host']}:{node['port']}"
    config = work / f"topology-{name}.yaml"
    config.write_text(yaml.safe_dump(topology, sort_keys=False))
    start_router(dep.procs, f"router-{name}", config, dep.env, router_args, url, threshold_tokens, wait=wait)
    return url


def drive(routers: dict[str, str], lengths: list[int], vocab: int, model: str, seeds: dict[str, int]) -> dict[str, list[dict]]:
    """One request per length for each router, one at a time and interleaved (each length goes to every
    router in turn), so that a slow spell of the machine falls on every variant alike: per router, each
    request's predicted and seen TTFT and its route. ``seeds``: each router's first prompt seed (its own
    prompts, so none hits what another left cached)."""
    rows: dict[str, list[dict]] = {name: [] for name in routers}
    for i, num_tokens in enumerate(lengths):
        for name, router in routers.items():
            seen_s, headers = stream_ttft(router, prompt_ids(num_tokens, vocab, seeds[name] + i), model)
            predicted = ttft_estimate_s(headers.get("Server-Timing") or headers.get("server-timing") or "")
            route = route_header(headers) or ""
            rows[name].append({"tokens": num_tokens, "cluster": route.split("/")[0], "predicted_s": predicted,
                               "seen_s": seen_s})
    return rows


def summarize(rows: list[dict], status: dict) -> dict:
    """Per variant: the median predicted / seen TTFT by cluster, the mean |predicted - seen| / seen of
    the first and the last 25 requests, and the router's own error series, scales and offsets (pure)."""
    def err(r: dict) -> float:
        return abs(r["predicted_s"] - r["seen_s"]) / r["seen_s"]

    by_cluster = {c: [r for r in rows if r["cluster"] == c] for c in dict.fromkeys(r["cluster"] for r in rows)}
    calibration = status.get("calibration") or {}
    return {"median_ratio_predicted_to_seen": {c: statistics.median(r["predicted_s"] / r["seen_s"] for r in rs)
                                               for c, rs in by_cluster.items()},
            "client_error_first_25": statistics.mean(err(r) for r in rows[:25]),
            "client_error_last_25": statistics.mean(err(r) for r in rows[-25:]),
            "router_error_series": calibration.get("ttft_error_series"),
            "prefill_scale": calibration.get("prefill_scale"), "prefill_offset_s": calibration.get("prefill_offset_s"),
            "calibration": calibration.get("enabled")}


def run(engine: str, bundle_dir: Path | None, measured_path: Path, log: Callable[[str], None], requests: int = 50,
        variants: tuple[str, ...] = VARIANTS, roofline_accelerator: str = "h200x8", roofline_gpus: int = 1,
        dep: RunningDeployment | None = None, model_dir: Path | None = None) -> dict:
    """Each of ``variants`` (:func:`variant_docs`) as a router of its own over one deployment, driven with
    ``requests`` prompts: what it predicted against what it saw. ``dep``: a running deployment of ``engine``
    (serving ``model_dir``) to use, left running; else one is started, and stopped at the end."""
    import yaml

    checkout, started = Path(__file__).resolve().parents[2], time.monotonic()
    profile = profile_for(engine)
    root = unpack(bundle_dir) if engine == "sglang" and dep is None else None
    if root is not None and str(root / "site") not in sys.path:  # what the GPU machine lacks, as checks.run adds it
        sys.path.append(str(root / "site"))
    work = Path(tempfile.mkdtemp(prefix="prfaas-predict-"))
    if model_dir is None and engine == "sglang-cpu":
        from prfaas_sglang.gpu.tiny_model import make_model

        make_model(work / "model", cpu=True, log=log)
        model_dir = work / "model"
    model_dir = model_dir or root / "model"
    model_config = json.loads((model_dir / "config.json").read_text())
    docs = variant_docs(yaml.safe_load(measured_path.read_text()), model_config, roofline_accelerator, roofline_gpus)
    lengths = [n for _ in range(requests) for n in (*profile.short_tokens, *profile.long_tokens)][:requests]
    own = dep is None  # a deployment of its own: stopped at the end
    procs, results = ProcessGroup(work / "logs") if own else dep.procs, {}
    try:
        if own:
            dep = start_deployment(root, checkout, model_dir, procs, work, engine=engine, profile=profile)
            log(f"[predict] deployment healthy after {time.monotonic() - started:.1f} s")
        routers = {}
        try:
            for name in variants:  # every variant's router up before the first request: their requests interleave
                path = work / f"profile-{name}.yaml"
                path.write_text(yaml.safe_dump(docs[name], sort_keys=False))
                args = [*profile.router_args, *(["--no-calibration"] if name not in CALIBRATED else [])]
                routers[name] = start_variant_router(dep, name, path, args, profile.threshold_tokens, work, wait=False)
            for name, router in routers.items():  # started side by side: about 20 s each on the H200's host
                router_ready(dep.procs, f"router-{name}", router, profile.threshold_tokens)
            rows = drive(routers, lengths, int(model_config["vocab_size"]), profile.served_name,
                         seeds={name: 4_000_000 + 100_000 * index for index, name in enumerate(variants)})
            for name, router in routers.items():
                status = json.loads(http("GET", router + "/status")[2])
                results[name] = {"rows": rows[name], **summarize(rows[name], status)}
                log(f"[predict] {name}: {json.dumps({k: v for k, v in results[name].items() if k != 'rows'})}")
        finally:
            procs.stop([f"router-{name}" for name in routers])
    finally:
        if own:
            procs.stop()
    return {"engine": engine, "requests": requests, "lengths": sorted(set(lengths)), "variants": results,
            "measured": str(measured_path), "seconds": round(time.monotonic() - started, 1)}
