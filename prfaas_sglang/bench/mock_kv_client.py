"""The client of ``bench mock-kv``, run inside the prefill workers' network namespace.

Reads one job per stdin line and answers one JSON line each:

* ``{"wait": [url, ...]}``: until every URL's ``/health`` answers 200 (90 s at most): ``{"ok"}``;
* ``{"prefill", "decode", "bootstrap": [host, port], "tokens", "seed"}``: one PD request, both legs
  at once as SGLang's PD router sends them, a prompt of ``tokens`` random ids and one new token:
  ``{"ok", "kv_bytes", "kv_transfer_s"}`` from the prefill's answer, and ``writes``: how many
  writes the prefill's KV sender handed Mooncake meanwhile (``prfaas:kv_writes_submitted_total``;
  None for a worker without one).
"""

from __future__ import annotations

import json
import random
import sys
import threading
import time

from prfaas_sglang.adapters import http_sync
from prfaas_sglang.demo.cluster import StartupError, wait_healthy


def _wait(urls: list[str], timeout_s: float = 90.0) -> bool:
    """Whether every URL's ``/health`` answered 200 within ``timeout_s`` (for all of them together)."""
    deadline = time.monotonic() + timeout_s
    try:
        for url in urls:
            wait_healthy(url + "/health", max(deadline - time.monotonic(), 0.0))
    except StartupError:
        return False
    return True


def _writes(client: http_sync.Client, url: str) -> float | None:
    for line in client.request("GET", url + "/metrics", timeout_s=5).raise_for_status().text.splitlines():
        if line.startswith("prfaas:kv_writes_submitted_total{"):
            return float(line.rsplit(" ", 1)[1])
    return None


def _pd(client: http_sync.Client, job: dict) -> dict:
    rng = random.Random(job["seed"])
    host, port = job["bootstrap"]
    body = {"input_ids": [rng.randrange(32_000) for _ in range(job["tokens"])], "sampling_params": {"max_new_tokens": 1},
            "bootstrap_host": host, "bootstrap_port": port, "bootstrap_room": rng.getrandbits(63)}
    answers: dict[str, http_sync.Response | http_sync.HttpError] = {}
    writes_before = _writes(client, job["prefill"])

    def leg(name: str, url: str) -> None:
        try:
            answers[name] = client.request("POST", url + "/generate", json_body=body, timeout_s=300)
        except http_sync.HttpError as err:
            answers[name] = err

    threads = [threading.Thread(target=leg, args=(name, job[name])) for name in ("prefill", "decode")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    prefill, decode = answers["prefill"], answers["decode"]
    if isinstance(prefill, Exception) or isinstance(decode, Exception) or prefill.status != 200 or decode.status != 200:
        detail = {k: (str(v) if isinstance(v, Exception) else f"{v.status} {v.text[:200]}") for k, v in answers.items()}
        return {"ok": False, "error": detail}
    meta = prefill.json()["meta_info"]["prfaas"]
    writes_after = _writes(client, job["prefill"])
    writes = None if writes_before is None or writes_after is None else int(writes_after - writes_before)
    return {"ok": True, "kv_bytes": meta["kv_bytes"], "kv_transfer_s": meta["kv_transfer_s"], "writes": writes}


def main() -> int:
    client = http_sync.Client()  # kept-alive connections: the same workers for every job
    try:
        for line in sys.stdin:
            job = json.loads(line)
            out = {"ok": _wait(job["wait"])} if "wait" in job else _pd(client, job)
            print(json.dumps(out), flush=True)
    finally:
        client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
