"""``bench router-overhead`` and ``bench router-gc``: their structure end to end, and the pinning that gives
the router its own core."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from prfaas_sglang.bench import router as bench

CHILD = r"""
import os, subprocess, sys, threading, time
threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
print(grandchild.pid, flush=True)
time.sleep(60)
"""


def _threads(pid: int) -> list[int]:
    return [int(t) for t in os.listdir(f"/proc/{pid}/task")]


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to pin apart")
def test_pin_moves_every_thread_of_the_process_and_its_children():
    cpu = max(os.sched_getaffinity(0))
    proc = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True)
    try:
        grandchild = int(proc.stdout.readline())
        assert len(_threads(proc.pid)) >= 2  # the main thread and the sleeper
        moved = bench.pin(proc.pid, {cpu})
        tids = _threads(proc.pid) + _threads(grandchild)
        assert moved == len(tids)
        assert all(os.sched_getaffinity(tid) == {cpu} for tid in tids)
    finally:
        proc.kill()
        proc.wait()
        subprocess.run(["kill", "-9", str(grandchild)], capture_output=True)


def test_a_cpu_the_router_cannot_have_alone_is_refused_with_the_reason():
    allowed = os.sched_getaffinity(0)
    assert "not one this process may run on" in bench.router_cpu_problem(max(allowed) + 64)
    if len(allowed) == 1:
        assert "leaves no other CPU" in bench.router_cpu_problem(next(iter(allowed)))
    else:
        assert bench.router_cpu_problem(min(allowed)) is None
    proc = subprocess.run([sys.executable, "-m", "prfaas_sglang.bench", "router-overhead", "--router-cpu",
                           str(max(allowed) + 64)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--router-cpu: CPU" in proc.stderr


@pytest.mark.slow
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to pin apart")
def test_bench_router_overhead_smoke_with_the_router_on_its_own_cpu():
    """A short run through a real router and two emulated workers: every request answered on both
    paths, the router's own timings and the per-request added time reported, and this process's
    affinity given back afterwards."""
    before = os.sched_getaffinity(0)
    result = bench.run(rate=20.0, duration_s=1.5, prompt_tokens=256, prompt="ids", router_cpu=max(before))
    assert os.sched_getaffinity(0) == before
    assert result["router_cpu"] == max(before)
    for path in ("direct", "router"):
        assert result[path]["requests"] >= 20 and result[path]["failed"] == 0, result[path]
    assert {"parse", "route"} <= set(result["router_own_ms"])
    added = result["added_per_request_ms"]
    assert added is not None and 0 < added["p50"] <= added["p99"] <= added["max"]
    assert result["legs_ms"]["p50"] > 0


@pytest.mark.slow
def test_bench_router_overhead_routes_the_same_requests_through_a_compiled_peer():
    """``--peers``: the same body, interleaved with the other paths, through smg (PD mode over the
    same two workers), every request answered; ``--wakeup-samples``: the machine's local round
    trips, back to back and after the bench's gap, for a byte and for the parsed body."""
    result = bench.run(rate=10.0, duration_s=2.0, prompt_tokens=256, prompt="ids", peers=("smg",), wakeup_samples=20)
    smg = result["peers"]["smg"]
    assert smg["requests"] >= 15 and smg["failed"] == 0, smg
    assert smg["p50_ms"] > 0 and smg["added_p50_ms"] == pytest.approx(smg["p50_ms"] - result["direct"]["p50_ms"])
    wake = result["wakeup"]
    assert wake["gap_s"] == pytest.approx(1 / 30) and wake["body_bytes"] > 256
    for key in ("byte_busy_ms", "byte_after_gap_ms", "body_parsed_busy_ms", "body_parsed_after_gap_ms"):
        assert 0 < wake[key]["p50"] <= wake[key]["p99"], key
    assert "through smg (compiled peer)" in bench.render_markdown(result)
    with pytest.raises(ValueError, match="unknown peer routers"):
        bench.run(peers=("nginx",))


def test_bench_router_gc_freezes_what_a_router_process_holds_at_start():
    """A fresh process holding the router's modules (one collection, no tokenizer, about a second): after
    ``freeze_startup_objects`` the collector no longer tracks what start-up made, and the report says so."""
    result = bench.gc_pause(None, collections=1)
    before, after = result["before"], result["after"]
    assert result["frozen_objects"] > 0 and after["tracked_objects"] < before["tracked_objects"] - result["frozen_objects"] / 2
    assert f"({result['frozen_objects']:,} frozen)" in bench.render_markdown(result)
