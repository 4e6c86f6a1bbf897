"""``python -m prfaas_sglang.bench api-fuzz``: schemathesis against the router's published OpenAPI
description, on an emulated two-cluster deployment (issue #16).

The deployment: one PrfaaS worker, one PD-P, one PD-D (emulated, every node through the
launcher, the shipped tokenizer so text and chat prompts are real, a 2,048-token context so no
generated request decodes for long) and the router with an admin token, so the admin API is
fuzzed past its 401. schemathesis (PyPI) reads ``/openapi.json`` and
sends generated requests, valid and invalid (``--mode all``), ``max_examples`` per operation,
checking ``not_a_server_error`` (no response >= 500). Afterwards every process must still be
alive and a plain request must still be served through the router.

Bounded: ``max_examples`` per operation and phase; the run is stopped after ``max_time_s``
(schemathesis's own ``--max-time`` would repeat fuzzing until it is spent); requests time out
after 30 s. Everything stays on
loopback (worker URLs the admin API is given are refused unless they parse; registered ones
are only health-checked).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from prfaas_sglang.bench.subcommands import Invocation, Subcommand

ADMIN_TOKEN = "api-fuzz-admin-token"


def _deploy(tmp: Path):
    from prfaas_sglang.demo.cluster import ProcessGroup, local_topology, start_deployment

    group = ProcessGroup(tmp / "logs")
    doc = local_topology(speedup=200, kv_scale=0.002, threshold_tokens=2048, tokenizer="prfaas-tiny-chatml",
                         served_name="m", telemetry=False)
    d = start_deployment(group, doc, "--no-early-rejection", router_env={"PRFAAS_ADMIN_TOKEN": ADMIN_TOKEN},
                         engine_args={r: ("--bootstrap-timeout-s", "5", "--context-tokens", "2048")
                                      for r in ("prfaas", "pd-prefill", "pd-decode")},
                         name="api-fuzz")
    return group, d


def run(max_examples: int = 250, seed: int = 0, max_time_s: float = 900.0, workers: int = 2) -> dict:
    """Fuzz, then check the deployment still serves. Returns counts and the survivors' state."""
    from prfaas_sglang.adapters import http_sync

    with tempfile.TemporaryDirectory(prefix="prfaas-api-fuzz-") as tmp_name:
        tmp = Path(tmp_name)
        group, d = _deploy(tmp)
        try:
            ndjson = tmp / "events.ndjson"
            argv = [sys.executable, "-m", "schemathesis.cli", "run", d.router.url + "/openapi.json",
                    "--checks", "not_a_server_error", "--mode", "all", "--max-examples", str(max_examples),
                    "--seed", str(seed), "--workers", str(workers), "--request-timeout", "30",
                    "--generation-database", "none", "--no-color",
                    "--header", f"Authorization: Bearer {ADMIN_TOKEN}",
                    "--report", "ndjson", "--report-ndjson-path", str(ndjson)]
            started = time.monotonic()
            # cwd: schemathesis writes its .schemathesis/ cache into the working directory
            proc = subprocess.run(argv, capture_output=True, text=True, timeout=max_time_s + 300, cwd=tmp)
            elapsed_s = time.monotonic() - started
            counts = count_events(ndjson)
            alive = {p.name: p.poll() is None for p in group.procs}
            after = http_sync.post(d.router.url + "/generate", json_body={"text": "still serving after the fuzzer",
                                                                          "sampling_params": {"max_new_tokens": 2}}, timeout_s=60)
            health = {name: http_sync.get(w.url + "/health", timeout_s=5).status for name, w in d.workers.items()}
            return {"max_examples_per_operation": max_examples, "seed": seed, "elapsed_s": elapsed_s,
                    "schemathesis_exit_code": proc.returncode, **counts,
                    "processes_alive": alive, "served_after": after.status, "worker_health_after": health,
                    "schemathesis_tail": proc.stdout[-3000:]}
        finally:
            group.stop()


def count_events(path: Path) -> dict:
    """Cases, responses by status class and server errors, from schemathesis's NDJSON event stream."""
    statuses: dict[str, int] = {}
    server_errors: list[dict] = []
    cases = 0
    if not path.exists():
        return {"cases": 0, "responses_by_class": {}, "server_errors": []}
    for line in path.read_text().splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        for status, method, url in _responses(event):
            cases += 1
            key = f"{status // 100}xx"
            statuses[key] = statuses.get(key, 0) + 1
            if status >= 500 and len(server_errors) < 20:
                server_errors.append({"status": status, "method": method, "url": url})
    return {"cases": cases, "responses_by_class": dict(sorted(statuses.items())), "server_errors": server_errors}


def _responses(obj):
    """Every (status, method, url) of an HTTP interaction found anywhere in an event."""
    if isinstance(obj, dict):
        response, request = obj.get("response"), obj.get("request")
        if isinstance(response, dict) and isinstance(response.get("status_code"), int):
            req = request if isinstance(request, dict) else {}
            yield response["status_code"], req.get("method"), req.get("uri") or req.get("url")
            return
        for value in obj.values():
            yield from _responses(value)
    elif isinstance(obj, list):
        for value in obj:
            yield from _responses(value)


def render_markdown(result: dict) -> str:
    lines = ["| cases | responses by class | server errors (>= 500) | processes alive after | a request after |",
             "|---|---|---|---|---|",
             f"| {result['cases']} | {', '.join(f'{k}: {v}' for k, v in result['responses_by_class'].items())} | "
             f"{len(result['server_errors'])} | {sum(result['processes_alive'].values())}/{len(result['processes_alive'])} | "
             f"{result['served_after']} |"]
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-examples", type=int, default=250, help="cases per operation")
    parser.add_argument("--seed", type=int, default=0, help="schemathesis's random seed")
    parser.add_argument("--max-time", type=float, default=900.0, help="seconds")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")


def cli(args: argparse.Namespace, inv: Invocation) -> int:
    if args.max_examples < 1 or args.max_time <= 0:
        inv.error("--max-examples must be >= 1 and --max-time > 0")
    result = run(args.max_examples, args.seed, args.max_time)
    return inv.report(args, result, None, render_markdown)


SUBCOMMANDS = {"api-fuzz": Subcommand(add_arguments, cli)}
