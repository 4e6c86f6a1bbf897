"""Bandwidth awareness end to end: throttle the PrfaaS link mid-run, watch the router move t.

Topology (this machine only): the emulated PrfaaS prefill worker runs in its
own network namespace behind a veth pair; the PD-P and PD-D workers and the
router run in the root namespace. The router follows the PrfaaS worker's link
telemetry. Phases: ``clear`` (no qdisc), ``throttled`` (tbf at ``rate_mbit``
on the PrfaaS worker's egress), ``clear`` again. A Poisson load of long
prompts runs throughout; the router's /status is sampled every 0.25 s.
Needs root and iproute2 (``ip``, ``tc``).
"""

from __future__ import annotations

import asyncio
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from prfaas_sglang.demo.cluster import ProcessGroup, free_port, start_mock_worker, start_router

PROFILE_PRFAAS = "kimi-linear-1t-hybrid@h200x8"
PROFILE_PD = "kimi-linear-1t-hybrid@h20x8"


def _sh(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True)


class Netns:
    """A namespace joined to the root namespace by a veth pair (removed on exit)."""

    def __init__(self, tag: int):
        self.ns, self.inner, self.outer = f"prfaas-bw{tag}", f"pbi{tag}", f"pbo{tag}"
        self.inner_ip, self.outer_ip = f"10.214.{tag}.1", f"10.214.{tag}.2"

    def __enter__(self) -> Netns:
        _sh("ip", "netns", "add", self.ns)
        _sh("ip", "link", "add", self.outer, "type", "veth", "peer", "name", self.inner)
        _sh("ip", "link", "set", self.inner, "netns", self.ns)
        _sh("ip", "addr", "add", f"{self.outer_ip}/30", "dev", self.outer)
        _sh("ip", "link", "set", self.outer, "up")
        _sh("ip", "netns", "exec", self.ns, "ip", "addr", "add", f"{self.inner_ip}/30", "dev", self.inner)
        _sh("ip", "netns", "exec", self.ns, "ip", "link", "set", self.inner, "up")
        _sh("ip", "netns", "exec", self.ns, "ip", "link", "set", "lo", "up")
        return self

    def throttle(self, rate_mbit: float | None) -> None:
        subprocess.run(["ip", "netns", "exec", self.ns, "tc", "qdisc", "del", "dev", self.inner, "root"], capture_output=True)
        if rate_mbit is not None:
            _sh("ip", "netns", "exec", self.ns, "tc", "qdisc", "add", "dev", self.inner, "root", "tbf",
                "rate", f"{rate_mbit}mbit", "burst", "64kb", "latency", "500ms")

    def __exit__(self, *exc) -> None:
        subprocess.run(["ip", "netns", "del", self.ns], capture_output=True)
        subprocess.run(["ip", "link", "del", self.outer], capture_output=True)


async def _load(url: str, rate: float, until: float, rng: random.Random, results: list) -> None:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        tasks = []
        while time.monotonic() < until:
            await asyncio.sleep(rng.expovariate(rate))
            n = rng.randint(16_000, 48_000)
            body = {"input_ids": [rng.randrange(32_000) for _ in range(n)], "sampling_params": {"max_new_tokens": 4}}

            sent = time.monotonic()

            async def one(body=body, sent=sent):
                async with session.post(url + "/generate", json=body) as resp:
                    await resp.read()
                    results.append({"t": sent, "status": resp.status, "route": resp.headers.get("x-prfaas-route", "")})

            tasks.append(asyncio.create_task(one()))
        await asyncio.gather(*tasks, return_exceptions=True)


async def _sample(url: str, until: float, t0: float, series: list) -> None:
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < until:
            async with session.get(url + "/status?telemetry=1") as resp:
                status = await resp.json()
            tel = status["telemetry"][-1] if status["telemetry"] else {}
            series.append({"t_s": time.monotonic() - t0, "threshold_tokens": status["threshold_tokens"],
                           "utilization": tel.get("utilization"), "egress_mbps": (tel.get("egress_bps") or 0) / 1e6,
                           "capacity_mbps": (tel.get("capacity_bps") or 0) / 1e6})
            await asyncio.sleep(0.25)


def run(rate_mbit: float = 40.0, load_rps: float = 3.0, phases_s: tuple[float, float, float] = (8.0, 12.0, 12.0),
        speedup: float = 20.0, kv_scale: float = 0.01, seed: int = 0, log_dir: Path | None = None) -> dict:
    tag = random.Random().randrange(16, 250)
    log_dir = log_dir or Path(tempfile.mkdtemp(prefix="prfaas-bw-"))
    group = ProcessGroup(log_dir)
    with Netns(tag) as net:
        try:
            extra = ["--speedup", str(speedup), "--kv-scale", str(kv_scale), "--bootstrap-timeout-s", "60"]
            p_port, p_boot, p_tel = free_port(), free_port(), free_port()
            prfaas = group.start("prfaas", ["ip", "netns", "exec", net.ns, sys.executable, "-m", "prfaas_sglang.engine.mock",
                                            "--role", "prfaas", "--host", net.inner_ip, "--port", str(p_port), "--bootstrap-port", str(p_boot),
                                            "--telemetry-port", str(p_tel), "--profile", PROFILE_PRFAAS, *extra])
            group.wait_healthy(f"http://{net.inner_ip}:{p_port}/health", prfaas)
            pd_p = start_mock_worker(group, "pd-prefill", "pd-prefill", PROFILE_PD, extra, host=net.outer_ip)
            pd_d = start_mock_worker(group, "pd-decode", "pd-decode", PROFILE_PD, extra, host=net.outer_ip)
            topology = {"version": 1, "clusters": {
                "b": {"kind": "prfaas", "nodes": [{"name": "prfaas", "role": "prfaas", "host": net.inner_ip, "port": p_port,
                                                   "bootstrap_port": p_boot, "telemetry_port": p_tel}]},
                "a": {"kind": "pd", "nodes": [
                    {"name": "pd-prefill", "role": "pd-prefill", "host": net.outer_ip, "port": pd_p.port, "bootstrap_port": pd_p.bootstrap_port},
                    {"name": "pd-decode", "role": "pd-decode", "host": net.outer_ip, "port": pd_d.port}]}},
                "links": [{"from": "b", "to": "a", "bandwidth_gbps": 100}]}
            url = start_router(group, topology, "--threshold", "12000", "--lower-after-s", "3").url
            return asyncio.run(_experiment(url, net, rate_mbit, load_rps, phases_s, seed))
        finally:
            group.stop()


async def _experiment(url, net: Netns, rate_mbit, load_rps, phases_s, seed) -> dict:
    t0 = time.monotonic()
    end = t0 + sum(phases_s)
    series: list = []
    results: list = []
    load = asyncio.create_task(_load(url, load_rps, end, random.Random(seed), results))
    sampler = asyncio.create_task(_sample(url, end + 2, t0, series))
    await asyncio.sleep(phases_s[0])
    throttled_at = time.monotonic() - t0
    await asyncio.to_thread(net.throttle, rate_mbit)
    await asyncio.sleep(phases_s[1])
    cleared_at = time.monotonic() - t0
    await asyncio.to_thread(net.throttle, None)
    await asyncio.gather(load, sampler)
    async with aiohttp.ClientSession() as session:
        async with session.get(url + "/status?telemetry=100000") as resp:
            final = await resp.json()
    base = series[0]["threshold_tokens"] if series else None
    # Router clock (CLOCK_MONOTONIC is shared by processes on one host): its samples and its decisions.
    throttle_mono, clear_mono = t0 + throttled_at, t0 + cleared_at
    router_series = final["telemetry"]
    # "Saturation" as the controller sees it: the link busy >= 90% or PrfaaS queueing >= 2 s.
    first_over = next((x for x in router_series if x["mono_s"] >= throttle_mono and (x["utilization"] >= 0.9 or x["queue_s"] >= 2.0)), None)
    saturated = first_over["mono_s"] if first_over else None
    raises = [h for h in final["threshold_history"] if h["why"].startswith("raise") and h["t_s"] >= throttle_mono]
    lowers = [h for h in final["threshold_history"] if h["why"].startswith("lower") and h["t_s"] >= clear_mono]
    raised = raises[0]["t_s"] - t0 if raises else None
    lowered = lowers[0]["t_s"] - t0 if lowers else None
    saturated = saturated - t0 if saturated is not None else None

    def phase(lo, hi, key):
        values = [s[key] for s in series if lo <= s["t_s"] < hi and s[key] is not None]
        return sum(values) / len(values) if values else None

    return {
        "rate_mbit": rate_mbit, "load_rps": load_rps, "phases_s": phases_s,
        "baseline_threshold": base,
        "throttled_at_s": throttled_at, "first_saturated_sample_s": saturated, "threshold_raised_s": raised,
        "saturation_signal": None if first_over is None else ("busy link" if first_over["utilization"] >= 0.9 else "PrfaaS queueing"),
        "raise_delay_after_saturation_s": (raised - saturated) if raised is not None and saturated is not None else None,
        "cleared_at_s": cleared_at, "threshold_back_s": lowered,
        "egress_mbps_clear": phase(2.0, throttled_at, "egress_mbps"),
        "egress_mbps_throttled_after_raise": phase(raised + 2.0, cleared_at, "egress_mbps") if raised else None,
        "utilization_throttled_after_raise": phase(raised + 2.0, cleared_at, "utilization") if raised else None,
        "requests": len(results), "requests_failed": sum(r["status"] != 200 for r in results),
        "offloaded_clear": _share(results, t0, 0, throttled_at), "offloaded_throttled": _share(results, t0, throttled_at + 2, cleared_at),
        "series": series,
    }


def _share(results, t0, lo, hi) -> float | None:
    window = [r for r in results if lo <= r["t"] - t0 < hi and r["status"] == 200]
    return sum(r["route"].startswith("prfaas") for r in window) / len(window) if window else None


def plot(result: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = result["series"]
    ts = [x["t_s"] for x in s]
    fig, (a, b) = plt.subplots(2, 1, figsize=(7, 5), sharex=True)
    a.plot(ts, [x["threshold_tokens"] / 1000 for x in s], label="threshold t (K tokens)")
    a.set_ylabel("t (K tokens)")
    b.plot(ts, [x["utilization"] or 0 for x in s], label="PrfaaS link busy fraction")
    b.plot(ts, [min(x["egress_mbps"] / result["rate_mbit"], 2) for x in s], label="egress / throttled rate")
    b.set_ylabel("fraction")
    b.set_xlabel("seconds")
    for ax in (a, b):
        ax.axvspan(result["throttled_at_s"], result["cleared_at_s"], color="orange", alpha=0.15, label="tbf throttle")
        ax.legend(fontsize=7, loc="upper right")
    a.set_title(f"PrfaaS link throttled to {result['rate_mbit']:g} Mbit/s mid-run")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
