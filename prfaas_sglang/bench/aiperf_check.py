"""An independent client: the same trace through our router with AIPerf and with the benchmarks' own client.

A Mooncake-format trace (``timestamp`` ms, ``input_length``, ``output_length``,
``hash_ids``) is drawn from the case-study lengths at ``load`` x the hetero
deployment's planned capacity (``bench.compare``), with wall-clock timestamps,
input lengths in whole 512-token blocks and unique hash ids (no prefix reuse),
so both clients send prompts of the same lengths at the same instants. The
deployment is the comparison's hetero one on loopback. Our client
(``demo.client.replay``, text built per hash block from the shipped tokenizer)
runs first, after a discarded warm-up pass (another seed's trace: otherwise
the first client alone pays the deployment's cold start, 10-15% of TTFT p50);
caches are flushed; then AIPerf 0.13 replays the file with
``--custom-dataset-type mooncake_trace --fixed-schedule`` and the same local
tokenizer, streaming ``/v1/completions``. Reported: TTFT p50/p90 of each,
in wall seconds, and their ratios (target within 10%).

AIPerf pins packages that conflict with SGLang's (orjson, pyzmq, ...), so it
lives in its own environment: ``make aiperf-env`` (``.venv-aiperf``).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import random
import shutil
import subprocess
import tempfile
from pathlib import Path

from prfaas_sglang.bench import compare
from prfaas_sglang.bench.subcommands import Invocation, Subcommand
from prfaas_sglang.demo import workloads
from prfaas_sglang.demo.client import replay
from prfaas_sglang.demo.cluster import ProcessGroup, start_deployment
from prfaas_sglang.errors import ConfigError
from prfaas_sglang.plan.workload import case_study_lengths
from prfaas_sglang.stats import percentile
from prfaas_sglang.tokenizer import SHIPPED, PromptTokenizer, resolve

BLOCK_TOKENS = workloads.BLOCK_TOKENS


def write_trace(path: Path, rate_rps: float, duration_s: float, output_tokens: int, seed: int) -> int:
    """A Mooncake-format trace at ``rate_rps`` (wall) for ``duration_s``; returns the request count."""
    rng = random.Random(seed)
    dist = case_study_lengths(compare.MAX_INPUT_TOKENS)
    clock, next_hash, lines = 0.0, 0, []
    while True:
        clock += rng.expovariate(rate_rps)
        if clock > duration_s:
            break
        blocks = max(1, -(-int(dist.sample(rng, 1)[0]) // BLOCK_TOKENS))
        lines.append(json.dumps({"timestamp": int(clock * 1000), "input_length": blocks * BLOCK_TOKENS,
                                 "output_length": output_tokens, "hash_ids": list(range(next_hash, next_hash + blocks))}))
        next_hash += blocks
    path.write_text("\n".join(lines) + "\n")
    return len(lines)



TOKENIZER_REPO = "prfaas/prfaas-tiny-chatml"


def hub_cache_with_shipped_tokenizer(cache: Path) -> tuple[Path, str]:
    """Lay the shipped tokenizer out as a cached hub snapshot under ``cache``; returns (cache, repo id).

    The layout is huggingface_hub's: ``models--{org}--{name}/refs/main`` holds a commit id and
    ``snapshots/{commit}/`` the files, which is what ``snapshot_download(local_files_only=True)``
    resolves in offline mode. Files are copied, so the cache outlives edits of the package.
    """
    source = Path(resolve(SHIPPED))
    files = sorted(p for p in source.iterdir() if p.is_file())
    commit = hashlib.sha1(b"".join(p.name.encode() + p.read_bytes() for p in files)).hexdigest()
    repo_dir = cache / ("models--" + TOKENIZER_REPO.replace("/", "--"))
    snapshot = repo_dir / "snapshots" / commit
    snapshot.mkdir(parents=True, exist_ok=True)
    for p in files:
        shutil.copyfile(p, snapshot / p.name)
    (repo_dir / "refs").mkdir(exist_ok=True)
    (repo_dir / "refs" / "main").write_text(commit)
    return cache, TOKENIZER_REPO


def _aiperf_ttft(artifacts: Path) -> dict:
    """TTFT p50/p90 (seconds) from AIPerf's JSON export."""
    found = sorted(artifacts.rglob("*aiperf*.json"))
    for path in found:
        data = json.loads(path.read_text())
        metric = data.get("time_to_first_token") or (data.get("records") or {}).get("time_to_first_token")
        if isinstance(metric, dict) and "p50" in metric:
            scale = {"ms": 1e-3, "us": 1e-6, "ns": 1e-9, "s": 1.0}[metric.get("unit", "ms")]
            count = (data.get("request_count") or {}).get("avg")
            return {"ttft_p50_s": metric["p50"] * scale, "ttft_p90_s": metric["p90"] * scale, "requests": count,
                    "export": str(path)}
    raise RuntimeError(f"no time_to_first_token in AIPerf's exports under {artifacts}: {[str(p) for p in found]}")


def run(aiperf: str, load: float = 0.5, duration_s: float = 40.0, speedup: float = 2.0, seed: int = 0,
        log_dir: Path | None = None) -> dict:
    if not Path(aiperf).is_file():
        raise ConfigError("--aiperf", f"{aiperf} not found (make aiperf-env builds .venv-aiperf)")
    setting = compare.Setting(load=load, duration_s=duration_s, speedup=speedup)
    log_dir = log_dir or Path(tempfile.mkdtemp(prefix="prfaas-aiperf-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    trace = log_dir / "trace.jsonl"
    count = write_trace(trace, compare.offered_rps(setting), duration_s, setting.output_tokens, seed)
    text = workloads.TextSource(PromptTokenizer.load(SHIPPED))
    arrivals = workloads.trace(str(trace), duration_s + 1, 1.0, setting.output_tokens, compare.MAX_INPUT_TOKENS, text,
                               100_000, compare.SERVED_NAME)
    group = ProcessGroup(log_dir / "procs")
    try:
        doc = compare.topology(setting, "hetero")
        context = ("--context-tokens", str(2 * compare.MAX_INPUT_TOKENS + setting.output_tokens))
        dep = start_deployment(group, doc, engine_args={r: context for r in ("prfaas", "pd-prefill", "pd-decode")})
        url = dep.router.url
        # A warm-up pass (another seed's trace, discarded): the measured passes then both meet warm
        # processes and connections; without it the first client also pays the cold start.
        warm_trace = log_dir / "warmup.jsonl"
        write_trace(warm_trace, compare.offered_rps(setting), min(duration_s, 15.0), setting.output_tokens, seed + 1000)
        asyncio.run(replay(url, workloads.trace(str(warm_trace), duration_s + 1, 1.0, setting.output_tokens,
                                                compare.MAX_INPUT_TOKENS, text, 100_000, compare.SERVED_NAME)))
        compare.flush_caches(dep.workers.values())
        results, _ = asyncio.run(replay(url, arrivals))
        ok = [r for r in results if r.ok]
        ours = {"requests": len(results), "ok": len(ok), "ttft_p50_s": percentile([r.ttft_s for r in ok], 0.5),
                "ttft_p90_s": percentile([r.ttft_s for r in ok], 0.9)}
        compare.flush_caches(dep.workers.values())
        artifacts = log_dir / "aiperf"
        hub_cache, tokenizer_repo = hub_cache_with_shipped_tokenizer(log_dir / "hf-hub")
        argv = [aiperf, "profile", "--model", compare.SERVED_NAME, "--url", url, "--endpoint-type", "completions",
                "--streaming", "--tokenizer", tokenizer_repo, "--input-file", str(trace),
                "--custom-dataset-type", "mooncake_trace", "--fixed-schedule", "--random-seed", str(seed),
                "--output-artifact-dir", str(artifacts), "--ui-type", "none"]
        # Offline, against a private hub cache: AIPerf 0.13's prompt synthesis decodes in worker
        # processes that force HF_HUB_OFFLINE and resolve the tokenizer name as a cached hub repo,
        # so a local directory path fails there (BrokenProcessPool) even when the parent loaded it.
        env = dict(os.environ, HF_HUB_CACHE=str(hub_cache), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=duration_s * 10 + 300)
        (log_dir / "aiperf.log").write_text(proc.stdout + proc.stderr)
        if proc.returncode != 0:
            raise RuntimeError(f"aiperf exited {proc.returncode}: {(proc.stdout + proc.stderr)[-1500:]}")
        theirs = _aiperf_ttft(artifacts)
    finally:
        group.stop()
    return {"trace_requests": count, "offered_rps_wall": compare.offered_rps(setting), "speedup": speedup,
            "ours": ours, "aiperf": theirs, "logs": str(log_dir),
            "ttft_p50_ratio": theirs["ttft_p50_s"] / ours["ttft_p50_s"], "ttft_p90_ratio": theirs["ttft_p90_s"] / ours["ttft_p90_s"]}


def render_markdown(r: dict) -> str:
    o, a = r["ours"], r["aiperf"]
    return "\n".join([
        f"{r['trace_requests']} requests at {r['offered_rps_wall']:.2f} req/s (wall), speedup {r['speedup']:g}; TTFT in wall seconds", "",
        "| client | requests ok | TTFT p50 | TTFT p90 |", "|---|---|---|---|",
        f"| ours (demo.client) | {o['ok']} / {o['requests']} | {o['ttft_p50_s']:.3f} | {o['ttft_p90_s']:.3f} |",
        f"| AIPerf 0.13 (mooncake_trace, fixed schedule) | {a['requests']} | {a['ttft_p50_s']:.3f} | {a['ttft_p90_s']:.3f} |",
        f"| **AIPerf / ours** | | **{r['ttft_p50_ratio']:.2f}** | **{r['ttft_p90_ratio']:.2f}** |",
    ])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--aiperf", default=".venv-aiperf/bin/aiperf", help="the aiperf executable (make aiperf-env)")
    parser.add_argument("--load", type=float, default=0.5)
    parser.add_argument("--duration", type=float, default=40.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true")


def cli(args: argparse.Namespace, inv: Invocation) -> int:
    result = run(args.aiperf, args.load, args.duration, seed=args.seed)
    header = f"<!-- python -m prfaas_sglang.bench aiperf-check --load {args.load:g} --duration {args.duration:g}; {inv.stamp} -->"
    return inv.report(args, result, header, render_markdown)


SUBCOMMANDS = {"aiperf-check": Subcommand(add_arguments, cli)}
