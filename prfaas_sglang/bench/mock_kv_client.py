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

import requests


def _wait(session: requests.Session, urls: list[str], timeout_s: float = 90.0) -> bool:
    deadline = time.monotonic() + timeout_s
    for url in urls:
        while True:
            try:
                if session.get(url + "/health", timeout=2).status_code == 200:
                    break
            except requests.RequestException:
                pass
            if time.monotonic() > deadline:
                return False
            time.sleep(0.2)
    return True


def _writes(session: requests.Session, url: str) -> float | None:
    for line in session.get(url + "/metrics", timeout=5).text.splitlines():
        if line.startswith("prfaas:kv_writes_submitted_total{"):
            return float(line.rsplit(" ", 1)[1])
    return None


def _pd(session: requests.Session, job: dict) -> dict:
    rng = random.Random(job["seed"])
    host, port = job["bootstrap"]
    body = {"input_ids": [rng.randrange(32_000) for _ in range(job["tokens"])], "sampling_params": {"max_new_tokens": 1},
            "bootstrap_host": host, "bootstrap_port": port, "bootstrap_room": rng.getrandbits(63)}
    answers: dict[str, requests.Response | Exception] = {}
    writes_before = _writes(session, job["prefill"])

    def leg(name: str, url: str) -> None:
        try:
            answers[name] = session.post(url + "/generate", json=body, timeout=300)
        except requests.RequestException as err:
            answers[name] = err

    threads = [threading.Thread(target=leg, args=(name, job[name])) for name in ("prefill", "decode")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    prefill, decode = answers["prefill"], answers["decode"]
    if isinstance(prefill, Exception) or isinstance(decode, Exception) or prefill.status_code != 200 or decode.status_code != 200:
        detail = {k: (str(v) if isinstance(v, Exception) else f"{v.status_code} {v.text[:200]}") for k, v in answers.items()}
        return {"ok": False, "error": detail}
    meta = prefill.json()["meta_info"]["prfaas"]
    writes_after = _writes(session, job["prefill"])
    writes = None if writes_before is None or writes_after is None else int(writes_after - writes_before)
    return {"ok": True, "kv_bytes": meta["kv_bytes"], "kv_transfer_s": meta["kv_transfer_s"], "writes": writes}


def main() -> int:
    session = requests.Session()
    for line in sys.stdin:
        job = json.loads(line)
        out = {"ok": _wait(session, job["wait"])} if "wait" in job else _pd(session, job)
        print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
