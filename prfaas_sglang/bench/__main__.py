"""``python -m prfaas_sglang.bench <name>``: run a benchmark, print Markdown (or --json) for BENCHMARKS.md.

Benchmarks:
  plan           planner search time (case study, 128- and 32-token grids), and the
                 case-study optimum under other values of the two calibrated MFUs
  mock-fidelity  emulated engine: measured TTFT vs profile prefill / speedup + KV transfer;
                 --load: each stage saturated, throughput vs the planner's Theta (eq. 3-6), TTFT at 50/80%
  kvindex        global KV index: event ingest rate, match latency for a 128K-token prompt
  state-events   what state events cost: SGLang's MambaRadixCache vs ours on the conversation
                 trace (events, bytes per second of trace, CPU time of cache calls + encoding)
  prefill-cache  a PrfaaS worker's prefix cache under each admission mode (all / shared / none) on
                 the trace's long requests: prefill tokens saved, tokens inserted, evictions
  bandwidth      router + emulated workers; the PrfaaS link throttled 10x (tbf, netns) mid-run (root)
  router-overhead  latency the router adds vs direct PD dispatch, at a fixed rate
  aiperf-check   the same trace through our router with AIPerf and with our client: TTFT agreement
  decode-affinity  conversations with and without decode affinity (emulated hybrid workers, decode radix
                 cache): KV the decode workers receive, the part over the PrfaaS link, latency
  compare        goodput: our router vs homogeneous, naive, sglang-router (two settings) and smg,
                 identical arrivals per seed, the PrfaaS link shaped (tbf, netns; root);
                 --capacity: capacity at an SLO (>= 90% / 99% of all arrivals) against every peer
                 at its best configuration (swept), by bisection on offered load
  transport      KV over Mooncake TCP across an emulated WAN link (rate, RTT, loss; netns + linkem;
                 root): our WAN profile vs SGLang's Mooncake settings, request size x lanes
  kv-runs        the request sizes SGLang's Mooncake sender makes once its allocators have served a
                 trace a while (SGLang's allocators and grouping on CPU), and the goodput they allow
  kv-staging     SGLang's Mooncake path on CPU across an emulated WAN link (netns + linkem; root), pages
                 scattered on both sides: adjacent entries vs the staging buffer vs the decode's reserve
  chaos          mixed load while each worker, the router and the PrfaaS link fail (seeded; root):
                 hung / truncated / typed errors, leaks at rest, time to recover, router RSS
  api-fuzz       schemathesis against the router's /openapi.json: server errors, survivors
  dashboard      the Grafana dashboard (launch --emit k8s) drawn from a live emulated run's /metrics
  gpu-bundle     build and verify the carry bundle for the lent GPU machine (SGLang, sglang-kernel,
                 Mooncake CUDA 13, what the server imports) and the tiny hybrid model
  profile        a cost profile measured on real SGLang (GPU machine, or its CPU engine here) beside the roofline
  predict        the router's TTFT predictions on real SGLang: roofline vs measured profile vs 2x off + calibration
  gpu-e2e        on the GPU machine: every role through our launcher, seven checks (PASS/FAIL lines)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import signal
import sys
from datetime import date
from pathlib import Path


def exit_on_sigterm() -> None:
    """SIGTERM unwinds this process like Ctrl-C: every benchmark stops its processes and removes its
    namespaces in ``finally``. A process forked from this one that has not exec'd inherits the handler;
    there it ends the process at once (``os._exit``), running none of the ``finally`` blocks it shares
    with its parent. pyroute2's netns helpers are such children, stopped with SIGTERM once they have
    answered: with ``sys.exit`` everywhere, 253 of 300 of them unwound into their parent's cleanup,
    and in ``gpu-e2e`` that cleanup SIGKILLed every server the harness had started (the reference
    server "died at start" in 3 of 7 runs)."""
    owner_pid = os.getpid()

    def on_sigterm(signum, _frame) -> None:
        if os.getpid() != owner_pid:
            os._exit(128 + signum)
        sys.exit(128 + signum)

    signal.signal(signal.SIGTERM, on_sigterm)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m prfaas_sglang.bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="name", required=True)
    plan = sub.add_parser("plan", help="planner search time and sensitivity")
    plan.add_argument("--repeat", type=int, default=20)
    plan.add_argument("--json", action="store_true")
    fidelity = sub.add_parser("mock-fidelity", help="emulated engine TTFT vs its profile")
    fidelity.add_argument("--speedup", type=float, default=1.0)
    fidelity.add_argument("--kv-scale", type=float, default=0.01)
    fidelity.add_argument("--load", action="store_true",
                          help="saturate each stage of a small deployment; throughput vs the planner's Theta, TTFT at 50/80%%")
    fidelity.add_argument("--json", action="store_true")
    kvi = sub.add_parser("kvindex", help="KV index ingest rate and match latency")
    kvi.add_argument("--held-blocks", type=int, default=None,
                     help="instead: an index holding this many page-1 blocks; its GC pause, tracked objects, memory")
    kvi.add_argument("--workers", type=int, default=4, help="with --held-blocks: workers holding them")
    kvi.add_argument("--page-sizes", default=None,
                     help="instead: one match's cost per worker page size (comma list), a 32K-token prompt held and new")
    kvi.add_argument("--json", action="store_true")
    se = sub.add_parser("state-events", help="state events' overhead: stock vs our hybrid cache on a trace")
    se.add_argument("--trace", default=None, help="Mooncake trace JSONL (default: PRFAAS_TRACE_PATH or ../shared/data)")
    se.add_argument("--requests", type=int, default=200)
    se.add_argument("--page-sizes", default="1,64", help="comma list (1: no_buffer; > 1: extra_buffer)")
    se.add_argument("--cache", choices=("mamba", "swa"), default="mamba",
                    help="mamba: MambaRadixCache vs ours; swa: SWARadixCache vs ours (per-page window events)")
    se.add_argument("--window-tokens", type=int, default=4096, help="--cache swa: the sliding window")
    se.add_argument("--json", action="store_true")
    pc = sub.add_parser("prefill-cache", help="a PrfaaS worker's prefix cache per admission mode on the trace's long requests")
    pc.add_argument("--trace", default=None, help="Mooncake trace JSONL (default: PRFAAS_TRACE_PATH or ../shared/data)")
    pc.add_argument("--min-tokens", type=int, default=16_384, help="the requests a length threshold sends to PrfaaS")
    pc.add_argument("--cache-tokens", default="262144,1048576,4194304,16777216", help="comma list of capacities, tokens")
    pc.add_argument("--requests", type=int, default=None, help="stop after this many long requests")
    pc.add_argument("--json", action="store_true")
    ro = sub.add_parser("router-overhead", help="latency added by the router")
    ro.add_argument("--rate", type=float, default=None, help="requests/s (default: 200, or 5 for prompts over 1K tokens)")
    ro.add_argument("--duration", type=float, default=10.0)
    ro.add_argument("--prompt-tokens", type=int, default=16)
    ro.add_argument("--prompt", choices=("ids", "text", "both"), default=None,
                    help="input_ids, /generate text, or both (default: ids, or both for prompts over 1K tokens)")
    ro.add_argument("--front", action="store_true", help="also a path through the router's front (router/front.py)")
    ro.add_argument("--peers", default="", help="comma list of PyPI PD routers to route the same requests too "
                                                "(sglang-router, smg): what a compiled proxy adds on this machine")
    ro.add_argument("--page-size", type=int, default=None,
                    help="the workers' page size (default: the emulated engine's 512; SGLang runs Kimi Linear at 1)")
    ro.add_argument("--wakeup-samples", type=int, default=0,
                    help="also measure this machine's cost of waking a process, this many round trips (0: not)")
    ro.add_argument("--router-cpu", type=int, default=None,
                    help="pin the router to this CPU and the workers and client to the others (its own core, as deployed)")
    ro.add_argument("--json", action="store_true")
    rg = sub.add_parser("router-gc", help="a full GC collection's pause in a router process, before and after freezing start-up objects")
    rg.add_argument("--no-tokenizer", action="store_true", help="without the shipped tokenizer loaded")
    rg.add_argument("--json", action="store_true")
    cmp_ = sub.add_parser("compare", help="goodput: our router vs every baseline, identical arrivals, several seeds, shaped link")
    cmp_.add_argument("--workload", default="case-study", help="case-study | trace:PATH (--capacity: also shift)")
    cmp_.add_argument("--seeds", type=int, default=None, help="seeds (default: 5; --capacity: 3)")
    cmp_.add_argument("--link", choices=("abundant", "scarce"), default="abundant")
    cmp_.add_argument("--load", default="0.8",
                      help="offered load as a fraction of the planned capacity; a comma list sweeps (e.g. 0.5,1,1.5,2)")
    cmp_.add_argument("--rows", default=None, help="comma list of rows (default: all)")
    cmp_.add_argument("--duration", type=float, default=30.0, help="arrival window per seed, wall seconds")
    cmp_.add_argument("--ttft-slo-s", type=float, default=None,
                      help="TTFT SLO, emulated seconds (default 5; --capacity: 5 on the abundant link, 10 on the scarce)")
    cmp_.add_argument("--speedup", type=float, default=None, help="emulated time's speedup (default 2; --capacity: 4)")
    cmp_.add_argument("--json", action="store_true")
    cap = cmp_.add_argument_group("capacity at an SLO (--capacity; bench/capacity.py)")
    cap.add_argument("--capacity", action="store_true", help="capacity at >= 90%% and >= 99%% attainment, every row")
    cap.add_argument("--quick", action="store_true", help="a smoke run: one seed, few arrivals, coarse bisection, "
                                                          "ours and sglang-router's default only (under 10 min)")
    cap.add_argument("--families", default=None,
                     help="peer families swept and bisected: comma list of sglang-router, smg, naive, homogeneous, "
                          "or none (default: all)")
    cap.add_argument("--ours", default=None, help="our rows (default: prfaas and its ablations)")
    cap.add_argument("--peers", default=None,
                     help="peer rows to bisect as given, one per family, without a sweep (e.g. the best another "
                          "condition's sweep found)")
    cap.add_argument("--start", action="append", default=[], metavar="ROW=X",
                     help="where ROW's bisection starts, x the planned capacity (repeatable; default: above the "
                          "sweep's best load that met 90%%, 0.9 without one), e.g. a capacity another run found")
    cap.add_argument("--link-drop", action="store_true", help="the link's capacity / 4 for one emulated minute")
    cap.add_argument("--bias", type=float, default=None,
                     help="the engines' prefill and decode take this x the profile (the study: ours with calibration "
                          "on, off, and with the true scale given; no peers)")
    cap.add_argument("--out", type=Path, default=None, help="also write the JSON result here (a piece to --merge)")
    cap.add_argument("--merge", type=Path, nargs="+", default=None,
                     help="merge pieces written with --out (no run) and print them")
    ap = sub.add_parser("aiperf-check", help="TTFT of one trace through our router: AIPerf vs our client")
    ap.add_argument("--aiperf", default=".venv-aiperf/bin/aiperf", help="the aiperf executable (make aiperf-env)")
    ap.add_argument("--load", type=float, default=0.5)
    ap.add_argument("--duration", type=float, default=40.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    bw = sub.add_parser("bandwidth", help="throttle the PrfaaS link 10x mid-run; the router's t over time")
    bw.add_argument("--nominal-mbit", type=float, default=400.0, help="the link's rate (tbf) before and after the throttle")
    bw.add_argument("--factor", type=float, default=10.0, help="throttled rate = nominal / factor")
    bw.add_argument("--load-rps", type=float, default=2.0,
                    help="Poisson arrivals/s; at 2 the old t overloads the throttled link 1.34x, at 3 2x")
    bw.add_argument("--phases", default="15,60,20", help="seconds clear, throttled, clear")
    bw.add_argument("--speedup", type=float, default=10.0)
    bw.add_argument("--seed", type=int, default=0)
    bw.add_argument("--plot", type=Path, default=None, help="write the time series as a PNG here")
    bw.add_argument("--series", type=Path, default=None, help="write the sampled /status series and the requests as JSON here")
    bw.add_argument("--json", action="store_true")
    tr = sub.add_parser("transport", help="Mooncake TCP over an emulated WAN link: WAN profile vs defaults")
    tr.add_argument("--rate-mbit", type=float, default=1000.0)
    tr.add_argument("--payload-mib", type=int, default=256)
    tr.add_argument("--request-mib", type=float, default=16.0, help="our coalesced request size (a 64 MiB chunk over 4 lanes)")
    tr.add_argument("--default-request-kib", type=int, default=128, help="SGLang's request on a fragmented pool")
    tr.add_argument("--lanes", type=int, default=None,
                    help="our lanes per peer, 1..16 (default: what the WAN profile gives this link)")
    tr.add_argument("--conditions", default="clean,lossy", help="comma list of: clean, lossy, lossy-cubic, lossy-bbr")
    tr.add_argument("--repeats", type=int, default=3)
    tr.add_argument("--no-table", action="store_true", help="skip the request size x lanes table")
    tr.add_argument("--no-slow-start-after-idle", action="store_true",
                    help="net.ipv4.tcp_slow_start_after_idle=0 on both ends: connections keep their window across idle gaps")
    tr.add_argument("--tcp-buffer-mib", type=int, default=None,
                    help="TCP buffers autotune up to this (net.ipv4.tcp_wmem/tcp_rmem max) on both ends, every row "
                         "(default: the host's)")
    tr.add_argument("--no-tcp-timestamps", action="store_true",
                    help="net.ipv4.tcp_timestamps=0 on both ends, every row: 12 more payload bytes per segment "
                         "(host advice, with its caveats: README)")
    tr.add_argument("--engine-queued-row", action="store_true",
                    help="add a row with every request handed to the engine at once (the kv-send hooks before they "
                         "kept the queue): what keeping it costs")
    tr.add_argument("--unpaced-row", action="store_true",
                    help="add a row of ours without lane pacing (PRFAAS_KV_LANE_PACING unset): what keeping the "
                         "lanes level buys")
    tr.add_argument("--headroom-row", type=float, default=None, metavar="H",
                    help="add a row of ours with its lanes' caps at headroom H (0..1) over the equal share, in a "
                         "sender of its own: the profile's headroom against H in the same run")
    tr.add_argument("--json", action="store_true")
    mk = sub.add_parser("mock-kv", help="the emulated engine's KV over an emulated WAN link: the hooks' sender vs "
                                        "SGLang's way")
    mk.add_argument("--rate-mbit", type=float, default=1000.0)
    mk.add_argument("--rtt-ms", type=float, default=20.0)
    mk.add_argument("--losses", default="0,0.001", help="comma list of random loss rates, one condition each")
    mk.add_argument("--payload-mib", type=int, default=64)
    mk.add_argument("--repeats", type=int, default=5)
    mk.add_argument("--json", action="store_true")
    kr = sub.add_parser("kv-runs", help="request sizes of SGLang's Mooncake sender on pools in steady state")
    kr.add_argument("--trace", default=None, help="Mooncake trace JSONL (default: PRFAAS_TRACE_PATH or ../shared/data)")
    kr.add_argument("--duration", type=float, default=600.0, help="seconds of the trace replayed")
    kr.add_argument("--warmup", type=float, default=120.0, help="seconds before requests are measured")
    kr.add_argument("--page-sizes", default="1,64")
    kr.add_argument("--decode-pool-tokens", type=int, default=1 << 20)
    kr.add_argument("--prefill-pool-tokens", type=int, default=1 << 19)
    kr.add_argument("--prefill-inflight", type=int, default=2, help="requests whose pages the PrfaaS worker still holds")
    kr.add_argument("--prefill-cache", action="store_true",
                    help="the PrfaaS worker keeps prompts in SGLang's radix cache (LRU eviction when short), so its "
                         "pages fragment too, instead of fresh pages freed after --prefill-inflight requests")
    kr.add_argument("--step-ms", type=float, default=30.0, help="one decode step (every running request, one token)")
    kr.add_argument("--bytes-per-token-layer", type=int, default=2048,
                    help="K (or V) of one token in one layer (2048: 8 KV heads of dim 128, bf16)")
    kr.add_argument("--lanes", type=int, default=4)
    kr.add_argument("--rtt-ms", type=float, default=20.0)
    kr.add_argument("--rate-gbps", type=float, default=1.0)
    kr.add_argument("--measure", type=int, default=0,
                    help="also send N sampled requests' transfers (page 1, both allocations) over real Mooncake TCP "
                         "on an emulated link of --rate-gbps and --rtt-ms (root, linkem)")
    kr.add_argument("--seed", type=int, default=0, help="which transfers --measure samples")
    kr.add_argument("--json", action="store_true")
    ks = sub.add_parser("kv-staging", help="SGLang's Mooncake path on CPU across an emulated WAN link, pages scattered "
                                           "on both sides: adjacent entries vs staging on either side (root)")
    ks.add_argument("--rate-mbit", type=float, default=1000.0)
    ks.add_argument("--rtt-ms", type=float, default=20.0)
    ks.add_argument("--requests", type=int, default=3, help="measured requests per mode and repeat")
    ks.add_argument("--repeats", type=int, default=3)
    ks.add_argument("--layers", type=int, default=4)
    ks.add_argument("--request-pages", type=int, default=4096)
    ks.add_argument("--page-bytes", type=int, default=2048, help="one page of one KV buffer (page 1, 8 heads of 128, bf16)")
    ks.add_argument("--mean-run", type=int, default=64, help="mean length of a run of consecutive pages, either side")
    ks.add_argument("--chunks", type=int, default=4)
    ks.add_argument("--staging-mib", type=int, default=256)
    ks.add_argument("--json", action="store_true")
    lw = sub.add_parser("layerwise", help="SGLang's Mooncake path on CPU over a shaped loopback: when the decode has the "
                                          "KV, layer-wise streaming off vs on (root)")
    lw.add_argument("--rate-mbit", type=float, default=400.0)
    lw.add_argument("--forward-s", type=float, default=0.3, help="the emulated forward's duration per chunk (wall)")
    lw.add_argument("--tokens", type=int, default=2048)
    lw.add_argument("--layers", type=int, default=8)
    lw.add_argument("--repeats", type=int, default=3)
    lw.add_argument("--json", action="store_true")
    ct = sub.add_parser("cache-transfer", help="a prefix cached on PrfaaS: TTFT moved vs recomputed on PD-P, per length "
                                               "and link rate, next to the cost model (shaped link; root)")
    ct.add_argument("--rates-gbps", default="2,10,50", help="modelled link rates, comma list")
    ct.add_argument("--lengths", default="8192,16384,32768,65536", help="cached prefix lengths, comma list (tokens)")
    ct.add_argument("--suffix-tokens", type=int, default=512, help="the new turn after the cached prefix")
    ct.add_argument("--repeats", type=int, default=3)
    ct.add_argument("--speedup", type=float, default=4.0)
    ct.add_argument("--seed", type=int, default=0)
    ct.add_argument("--json", action="store_true")
    da = sub.add_parser("decode-affinity", help="conversations with and without decode affinity: KV the decode workers "
                                                "receive (and over the PrfaaS link), latency; emulated, same arrivals")
    da.add_argument("--seeds", type=int, default=3)
    da.add_argument("--conversations", type=int, default=6)
    da.add_argument("--turns", type=int, default=4)
    da.add_argument("--decode-workers", type=int, default=2)
    da.add_argument("--models", default="kimi-linear-1t-hybrid,qwen3-235b-a22b", help="cost models, comma list")
    da.add_argument("--json", action="store_true")
    cs = sub.add_parser("chaos", help="mixed load while workers, the router and the PrfaaS link fail (seeded faults; root)")
    cs.add_argument("--duration", type=float, default=60.0, help="load window, seconds (the faults spread over it)")
    cs.add_argument("--rate", type=float, default=2.0, help="requests/s")
    cs.add_argument("--down-s", type=float, default=3.0, help="how long each fault lasts")
    cs.add_argument("--fuzz-requests", type=int, default=200)
    cs.add_argument("--rounds", type=int, default=None, help="every fault this many times (default: one per 200 s, at least 1)")
    cs.add_argument("--seed", type=int, default=0)
    cs.add_argument("--faults", default=None,
                    help="comma list of the faults to inject (default: all; e.g. all but kill-router to follow one "
                         "router process's memory over the whole run)")
    cs.add_argument("--front", action=argparse.BooleanOptionalAction, default=True,
                    help="clients reach the router through its front (python -m prfaas_sglang.router.front), which a "
                         "router kill leaves running, as in the Kubernetes deployment (default); --no-front: directly")
    cs.add_argument("--json", action="store_true")
    af = sub.add_parser("api-fuzz", help="schemathesis against the router's /openapi.json on an emulated deployment")
    af.add_argument("--max-examples", type=int, default=250, help="cases per operation")
    af.add_argument("--seed", type=int, default=0)
    af.add_argument("--max-time", type=float, default=900.0, help="seconds")
    af.add_argument("--json", action="store_true")
    sm = sub.add_parser("sim", help="the simulator: vs the analytic model, vs the emulated deployment, vs the paper, a workload shift, "
                             "calibration against a biased truth (bias), "
                             "its cost at scale")
    sm.add_argument("--study", choices=("analytic", "emulator", "paper", "shift", "scale", "bias"), required=True)
    sm.add_argument("--seeds", type=int, default=3)
    sm.add_argument("--trace", type=Path, default=None, help="scale: a Mooncake-format trace (one hour)")
    sm.add_argument("--json", action="store_true")
    db = sub.add_parser("dashboard", help="the Grafana dashboard drawn from a live emulated run's /metrics (PNG)")
    db.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals (the second half at 3x --rate)")
    db.add_argument("--rate", type=float, default=0.6, help="case-study arrivals per second (first half)")
    db.add_argument("--out", type=Path, default=Path("docs/dashboard.png"))
    db.add_argument("--seed", type=int, default=0)
    db.add_argument("--json", action="store_true")
    gb = sub.add_parser("gpu-bundle", help="build and verify the GPU carry bundle (SGLang and what it imports, tiny model)")
    gb.add_argument("--out", type=Path, required=True, help="output directory (keep it git-ignored, e.g. out/gpu-bundle)")
    gb.add_argument("--python-version", default=None, help="the GPU machine's Python (default 3.12)")
    gb.add_argument("--wheelhouse", type=Path, default=None, help="take wheels from this directory before the index")
    gb.add_argument("--budget-mib", type=float, default=None, help="packed-size budget (default: 64 MiB carry less 8 for the checkout)")
    gb.add_argument("--model-config", type=Path, default=None, help="a hybrid config.json (or its directory) instead of the tiny model's")
    gb.add_argument("--json", action="store_true")
    ge = sub.add_parser("gpu-e2e", help="on the GPU machine: real SGLang in every role behind our router; seven checks")
    ge.add_argument("--bundle", type=Path, default=None, help="the gpu-bundle output directory (bundle.tar.xz inside)")
    ge.add_argument("--model-config", type=Path, default=None, help="a hybrid model directory instead of the bundle's tiny model")
    ge.add_argument("--checks", default=None, help="comma list (default: all); wan-profile is another name for shaped-link")
    ge.add_argument("--engine", choices=("sglang", "sglang-cpu", "mock"), default="sglang",
                    help="sglang-cpu: real SGLang on this machine's CPU (a tiny Llama unless --model-config; every check but "
                         "state-events, which needs a hybrid; root for shaped-link); mock: the harness's own dry run with "
                         "emulated engines (shaped-link, routing, kv-index, failover; needs --model-config, root); it checks "
                         "the harness, not SGLang")
    ge.add_argument("--json", action="store_true")
    pf = sub.add_parser("profile", help="a cost profile measured on real SGLang (prefill, cached prefix, decode, pools) "
                                        "beside the roofline; writes the profile file the planner, router and emulator load")
    pf.add_argument("--engine", choices=("sglang", "sglang-cpu"), default="sglang",
                    help="sglang: the GPU machine, from --bundle (the tiny hybrid); sglang-cpu: this CPU, a tiny Llama "
                         "(proves the pipeline, not the numbers)")
    pf.add_argument("--bundle", type=Path, default=None, help="the gpu-bundle output directory (--engine sglang)")
    pf.add_argument("--model-config", type=Path, default=None, help="a model directory instead of the tiny model")
    pf.add_argument("--out", type=Path, required=True, help="the profile file to write (YAML)")
    pf.add_argument("--roofline-accelerator", default="h200x8", help="the accelerator file the roofline uses (its per-GPU specs)")
    pf.add_argument("--roofline-gpus", type=int, default=1, help="GPUs of it the roofline counts (the server's)")
    pf.add_argument("--json", action="store_true")
    pr = sub.add_parser("predict", help="the router's TTFT predictions vs the TTFTs real SGLang shows: roofline, "
                                        "measured, and measured x2 with online calibration")
    pr.add_argument("--engine", choices=("sglang", "sglang-cpu"), default="sglang")
    pr.add_argument("--bundle", type=Path, default=None, help="the gpu-bundle output directory (--engine sglang)")
    pr.add_argument("--measured", type=Path, required=True, help="the profile bench profile wrote for this engine")
    pr.add_argument("--requests", type=int, default=50, help="per router, one at a time")
    pr.add_argument("--variants", default="roofline,measured,off-2x")
    pr.add_argument("--roofline-accelerator", default="h200x8")
    pr.add_argument("--roofline-gpus", type=int, default=1)
    pr.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    exit_on_sigterm()
    if args.name == "predict":
        from prfaas_sglang.gpu.cli import predict_main

        return predict_main(args, parser)
    if args.name == "profile":
        from prfaas_sglang.gpu.cli import profile_main

        return profile_main(args, parser)
    if args.name == "gpu-bundle":
        from prfaas_sglang.gpu.cli import bundle_main

        return bundle_main(args, parser)
    if args.name == "gpu-e2e":
        from prfaas_sglang.gpu.cli import e2e_main

        return e2e_main(args, parser)
    machine = f"{platform.machine()}, {platform.python_implementation()} {platform.python_version()}"
    stamp = f"{date.today().isoformat()}; {machine}"
    if args.name == "plan":
        if args.repeat < 1:
            parser.error("--repeat must be >= 1")
        from prfaas_sglang.bench import plan as bench

        result = bench.run(args.repeat)
        header = f"<!-- python -m prfaas_sglang.bench plan --repeat {args.repeat}; {stamp} -->"
    elif args.name == "bandwidth":
        from prfaas_sglang.bench import bandwidth as bench

        phases = tuple(float(x) for x in args.phases.split(","))
        if len(phases) != 3 or min(phases) <= 0 or args.factor <= 1:
            parser.error("--phases needs three positive numbers and --factor must be > 1")
        result = bench.run(args.nominal_mbit, args.factor, args.load_rps, phases, args.speedup, seed=args.seed)
        if args.plot:
            bench.plot(result, args.plot)
        if args.series:
            args.series.write_text(json.dumps({k: result[k] for k in ("series", "history", "requests_log")}))
        header = (f"<!-- python -m prfaas_sglang.bench bandwidth --nominal-mbit {args.nominal_mbit:g} --factor {args.factor:g} "
                  f"--load-rps {args.load_rps:g} --seed {args.seed}; {stamp} -->")
        result = {k: v for k, v in result.items() if k not in ("series", "history", "requests_log")} | {"history": result["history"]}
        if not args.json:
            print(header)
            print(json.dumps(result, indent=2))
            return 0
    elif args.name == "compare" and (args.capacity or args.merge):
        from prfaas_sglang.bench import capacity as bench

        result, header = _capacity(args, parser, stamp)
        if args.out is not None:
            args.out.write_text(json.dumps(result, indent=1))
    elif args.name == "compare":
        from prfaas_sglang.bench import compare as bench

        args.seeds = args.seeds or 5
        args.speedup = args.speedup or 2.0
        args.ttft_slo_s = args.ttft_slo_s or 5.0
        try:
            loads = [float(x) for x in args.load.split(",")]
        except ValueError:
            parser.error(f"--load takes numbers, got {args.load!r}")
        rows = tuple(args.rows.split(",")) if args.rows else bench.ROWS
        if unknown := set(rows) - set(bench.ROWS):
            parser.error(f"unknown rows {sorted(unknown)}; choose from {', '.join(bench.ROWS)}")
        if args.seeds < 1 or min(loads) <= 0 or args.duration <= 0:
            parser.error("--seeds must be >= 1, --load and --duration > 0")
        from prfaas_sglang.demo.netns import available

        if (why := available()) is not None and any(bench.DEPLOYMENT_OF[r] != "homogeneous" for r in rows):
            parser.error(f"the shaped PrfaaS link {why}")
        runs = [bench.run(bench.Setting(args.workload, args.link, load, args.duration, args.speedup, ttft_slo_s=args.ttft_slo_s),
                          args.seeds, rows) for load in loads]
        result = runs[0] if len(runs) == 1 else {"loads": runs}
        header = (f"<!-- python -m prfaas_sglang.bench compare --workload {args.workload} --link {args.link} --load {args.load} "
                  f"--seeds {args.seeds} --duration {args.duration:g} --speedup {args.speedup:g}; {stamp} -->")
    elif args.name == "layerwise":
        from prfaas_sglang.bench import layerwise as bench
        from prfaas_sglang.demo.netns import available

        if args.rate_mbit <= 0 or args.forward_s < 0 or args.tokens < 1 or args.layers < 1 or args.repeats < 1:
            parser.error("--rate-mbit must be > 0, --forward-s >= 0, --tokens, --layers and --repeats >= 1")
        if (why := available()) is not None:
            parser.error(f"the shaped loopback {why}")
        result = bench.run(args.rate_mbit, args.forward_s, args.tokens, args.tokens, args.layers, repeats=args.repeats)
        header = (f"<!-- python -m prfaas_sglang.bench layerwise --rate-mbit {args.rate_mbit:g} --forward-s {args.forward_s:g} "
                  f"--tokens {args.tokens} --layers {args.layers} --repeats {args.repeats}; {stamp} -->")
    elif args.name == "kv-staging":
        from prfaas_sglang.bench import kv_staging as bench
        from prfaas_sglang.transport.linkem import unavailable

        if (args.rate_mbit <= 0 or args.rtt_ms < 0 or min(args.requests, args.repeats, args.layers, args.chunks,
                                                           args.mean_run + 1, args.staging_mib) < 1
                or args.request_pages < args.chunks or args.page_bytes < 64):
            parser.error("kv-staging: --rate-mbit > 0, --rtt-ms >= 0, counts >= 1, --mean-run >= 0, "
                         "--request-pages >= --chunks, --page-bytes >= 64")
        if (why := unavailable()) is not None:
            parser.error(f"the emulated link {why}")
        result = bench.run(args.rate_mbit, args.rtt_ms, args.requests, args.repeats, args.layers, args.request_pages,
                           args.page_bytes, args.mean_run, args.chunks, args.staging_mib)
        header = (f"<!-- python -m prfaas_sglang.bench kv-staging --rate-mbit {args.rate_mbit:g} --rtt-ms {args.rtt_ms:g} "
                  f"--requests {args.requests} --repeats {args.repeats} --layers {args.layers} --request-pages "
                  f"{args.request_pages} --page-bytes {args.page_bytes} --mean-run {args.mean_run} --chunks {args.chunks} "
                  f"--staging-mib {args.staging_mib}; {stamp} -->")
    elif args.name == "cache-transfer":
        from prfaas_sglang.bench import cache_transfer as bench
        from prfaas_sglang.demo.netns import available

        try:
            rates = tuple(float(x) for x in args.rates_gbps.split(","))
            lengths = tuple(int(x) for x in args.lengths.split(","))
        except ValueError:
            parser.error("--rates-gbps takes numbers and --lengths integers, comma separated")
        if min(rates) <= 0 or min(lengths) < 2 * bench.PAGE or args.suffix_tokens < 1 or args.repeats < 1:
            parser.error(f"rates must be > 0, lengths >= {2 * bench.PAGE}, --suffix-tokens and --repeats >= 1")
        if (why := available()) is not None:
            parser.error(f"the shaped PrfaaS link {why}")
        result = bench.run(rates, lengths, args.suffix_tokens, args.repeats, args.speedup, seed=args.seed)
        header = (f"<!-- python -m prfaas_sglang.bench cache-transfer --rates-gbps {args.rates_gbps} --lengths {args.lengths} "
                  f"--suffix-tokens {args.suffix_tokens} --repeats {args.repeats} --speedup {args.speedup:g}; {stamp} -->")
        if not args.json:
            print(header)
            print(bench.render_markdown(result))
            return 0
    elif args.name == "decode-affinity":
        from prfaas_sglang.bench import decode_affinity as bench

        if min(args.seeds, args.conversations, args.turns) < 1 or args.decode_workers < 2:
            parser.error("--seeds, --conversations and --turns must be >= 1, --decode-workers >= 2")
        result = bench.run(args.seeds, args.conversations, args.turns, args.decode_workers, tuple(args.models.split(",")))
        header = (f"<!-- python -m prfaas_sglang.bench decode-affinity --seeds {args.seeds} --conversations "
                  f"{args.conversations} --turns {args.turns} --decode-workers {args.decode_workers} "
                  f"--models {args.models}; {stamp} -->")
        if not args.json:
            print(header)
            print(bench.markdown(result))
            return 0
    elif args.name == "aiperf-check":
        from prfaas_sglang.bench import aiperf_check as bench

        result = bench.run(args.aiperf, args.load, args.duration, seed=args.seed)
        header = f"<!-- python -m prfaas_sglang.bench aiperf-check --load {args.load:g} --duration {args.duration:g}; {stamp} -->"
    elif args.name == "dashboard":
        from prfaas_sglang.bench import dashboard as bench

        if args.duration <= 0 or args.rate <= 0:
            parser.error("--duration and --rate must be > 0")
        result = bench.run(args.duration, args.rate, args.out, seed=args.seed)
        header = (f"<!-- python -m prfaas_sglang.bench dashboard --duration {args.duration:g} --rate {args.rate:g} "
                  f"--seed {args.seed} --out {args.out}; {stamp} -->")
    elif args.name == "router-overhead":
        from prfaas_sglang.bench import router as bench

        long = args.prompt_tokens > 1024
        rate = args.rate or (5.0 if long else 200.0)
        kinds = {"both": ("ids", "text"), None: ("ids", "text") if long else ("ids",)}.get(args.prompt, (args.prompt,))
        if args.prompt_tokens < 1 or rate <= 0:
            parser.error("--prompt-tokens must be >= 1 and --rate > 0")
        if args.router_cpu is not None and (why := bench.router_cpu_problem(args.router_cpu)):
            parser.error(f"--router-cpu: {why}")
        peers = tuple(p for p in args.peers.split(",") if p)
        if unknown := set(peers) - set(bench.PEER_ROUTERS):
            parser.error(f"--peers: unknown {sorted(unknown)}; choose from {', '.join(bench.PEER_ROUTERS)}")
        if args.wakeup_samples < 0:
            parser.error("--wakeup-samples must be >= 0")
        if args.page_size is not None and args.page_size < 1:
            parser.error("--page-size must be >= 1")
        result = {kind: bench.run(rate, args.duration, args.prompt_tokens, kind, front=args.front, router_cpu=args.router_cpu,
                                  peers=peers, wakeup_samples=args.wakeup_samples, page_size=args.page_size) for kind in kinds}
        result = result[kinds[0]] if len(kinds) == 1 else result
        header = (f"<!-- python -m prfaas_sglang.bench router-overhead --rate {rate:g} --prompt-tokens {args.prompt_tokens} "
                  f"--duration {args.duration:g}{' --front' if args.front else ''}"
                  f"{f' --peers {args.peers}' if peers else ''}"
                  f"{f' --wakeup-samples {args.wakeup_samples}' if args.wakeup_samples else ''}"
                  f"{f' --page-size {args.page_size}' if args.page_size is not None else ''}"
                  f"{f' --router-cpu {args.router_cpu}' if args.router_cpu is not None else ''}; {stamp} -->")
    elif args.name == "router-gc":
        from prfaas_sglang.bench import router as bench

        result = bench.gc_pause(None if args.no_tokenizer else bench.SHIPPED)
        header = f"<!-- python -m prfaas_sglang.bench router-gc{' --no-tokenizer' if args.no_tokenizer else ''}; {stamp} -->"
    elif args.name == "transport":
        from prfaas_sglang.bench import transport as bench
        from prfaas_sglang.transport.linkem import unavailable

        conditions = tuple(args.conditions.split(","))
        if unknown := set(conditions) - set(bench.CONDITIONS):
            parser.error(f"unknown conditions {sorted(unknown)}; choose from {', '.join(bench.CONDITIONS)}")
        if args.rate_mbit <= 0 or args.payload_mib < 1 or args.repeats < 1 or args.request_mib <= 0 or args.default_request_kib < 1:
            parser.error("--rate-mbit, --payload-mib, --repeats, --request-mib and --default-request-kib must be positive")
        if args.lanes is not None and not 1 <= args.lanes <= 16:
            parser.error("--lanes must be in 1..16 (Mooncake's range for MC_TCP_LANES_PER_PEER)")
        if args.tcp_buffer_mib is not None and not 1 <= args.tcp_buffer_mib <= 1024:
            parser.error("--tcp-buffer-mib must be in 1..1024")
        if args.headroom_row is not None and not 0 <= args.headroom_row <= 1:
            parser.error("--headroom-row must be in 0..1")
        if (why := unavailable()) is not None:
            parser.error(f"the emulated link {why}")
        result = bench.run(args.rate_mbit, args.payload_mib, args.request_mib, args.default_request_kib, conditions,
                           args.repeats, not args.no_table, not args.no_slow_start_after_idle, args.lanes,
                           args.tcp_buffer_mib << 20 if args.tcp_buffer_mib else None, args.engine_queued_row,
                           args.unpaced_row, not args.no_tcp_timestamps, args.headroom_row)
        header = (f"<!-- python -m prfaas_sglang.bench transport --rate-mbit {args.rate_mbit:g} --payload-mib {args.payload_mib} "
                  f"--request-mib {args.request_mib:g}{f' --lanes {args.lanes}' if args.lanes else ''} "
                  f"--conditions {args.conditions} --repeats {args.repeats}"
                  f"{' --no-slow-start-after-idle' if args.no_slow_start_after_idle else ''}"
                  f"{f' --tcp-buffer-mib {args.tcp_buffer_mib}' if args.tcp_buffer_mib else ''}"
                  f"{' --no-tcp-timestamps' if args.no_tcp_timestamps else ''}"
                  f"{' --engine-queued-row' if args.engine_queued_row else ''}"
                  f"{' --unpaced-row' if args.unpaced_row else ''}"
                  f"{f' --headroom-row {args.headroom_row:g}' if args.headroom_row is not None else ''}; {stamp} -->")
    elif args.name == "mock-kv":
        from prfaas_sglang.bench import mock_kv as bench
        from prfaas_sglang.transport.linkem import unavailable

        try:
            losses = tuple(float(x) for x in args.losses.split(","))
        except ValueError:
            parser.error("--losses must be a comma list of numbers")
        if args.rate_mbit <= 0 or args.rtt_ms < 0 or args.payload_mib < 1 or args.repeats < 1 or not all(0 <= x < 1 for x in losses):
            parser.error("--rate-mbit, --payload-mib and --repeats must be positive, --rtt-ms >= 0, losses in [0, 1)")
        if (why := unavailable()) is not None:
            parser.error(f"the emulated link {why}")
        result = bench.run(args.rate_mbit, args.rtt_ms, losses, args.payload_mib, args.repeats)
        header = (f"<!-- python -m prfaas_sglang.bench mock-kv --rate-mbit {args.rate_mbit:g} --rtt-ms {args.rtt_ms:g} "
                  f"--losses {args.losses} --payload-mib {args.payload_mib} --repeats {args.repeats}; {stamp} -->")
    elif args.name == "kv-runs":
        from prfaas_sglang.bench import kv_runs as bench

        try:
            pages = tuple(int(p) for p in args.page_sizes.split(","))
        except ValueError:
            parser.error("--page-sizes must be a comma list of integers")
        if (min(pages) < 1 or args.duration <= 0 or args.warmup < 0 or args.step_ms <= 0 or args.lanes < 1
                or min(args.decode_pool_tokens, args.prefill_pool_tokens, args.prefill_inflight,
                       args.bytes_per_token_layer) < 1 or args.rtt_ms < 0 or args.rate_gbps <= 0):
            parser.error("kv-runs: sizes, counts, --duration, --step-ms and --rate-gbps must be positive")
        if args.measure < 0:
            parser.error("--measure must be >= 0")
        if args.measure and 1 not in pages:
            parser.error("--measure compares the allocations at page size 1: include 1 in --page-sizes")
        if args.measure:
            from prfaas_sglang.transport.linkem import unavailable

            if (why := unavailable()) is not None:
                parser.error(f"--measure: the emulated link {why}")
        trace = _trace_path(args.trace)
        result = bench.run(Path(trace), pages, args.duration, measure_transfers=args.measure, seed=args.seed,
                           decode_pool_tokens=args.decode_pool_tokens,
                           prefill_pool_tokens=args.prefill_pool_tokens, step_s=args.step_ms / 1e3,
                           prefill_inflight=args.prefill_inflight, warmup_s=args.warmup,
                           bytes_per_token_layer=args.bytes_per_token_layer, prefill_cache=args.prefill_cache,
                           model=(args.lanes, args.rtt_ms, args.rate_gbps))
        header = (f"<!-- python -m prfaas_sglang.bench kv-runs{' --prefill-cache' if args.prefill_cache else ''} "
                  f"--duration {args.duration:g} --warmup {args.warmup:g} "
                  f"--page-sizes {args.page_sizes} --step-ms {args.step_ms:g} --decode-pool-tokens {args.decode_pool_tokens} "
                  f"--prefill-pool-tokens {args.prefill_pool_tokens}"
                  f"{f' --measure {args.measure} --seed {args.seed}' if args.measure else ''}; {stamp} -->")
    elif args.name == "state-events":
        from prfaas_sglang.bench import state_events as bench

        trace = _trace_path(args.trace)
        try:
            pages = tuple(int(p) for p in args.page_sizes.split(","))
        except ValueError:
            parser.error("--page-sizes must be a comma list of integers")
        if args.requests < 1 or any(p < 1 for p in pages):
            parser.error("--requests and every page size must be >= 1")
        if args.window_tokens < 1:
            parser.error("--window-tokens must be >= 1")
        result = bench.run(trace, args.requests, pages, cache=args.cache, window_tokens=args.window_tokens)
        header = (f"<!-- python -m prfaas_sglang.bench state-events --requests {args.requests} "
                  f"--page-sizes {args.page_sizes} --cache {args.cache}"
                  f"{f' --window-tokens {args.window_tokens}' if args.cache == 'swa' else ''}; {stamp} -->")
    elif args.name == "prefill-cache":
        from prfaas_sglang.bench import prefill_cache as bench

        try:
            caps = tuple(int(c) for c in args.cache_tokens.split(","))
        except ValueError:
            parser.error("--cache-tokens must be a comma list of integers")
        if args.min_tokens < 1 or any(c < 512 for c in caps) or (args.requests is not None and args.requests < 1):
            parser.error("--min-tokens and --requests must be >= 1 and every capacity >= 512")
        try:
            result = bench.run(_trace_path(args.trace), args.min_tokens, caps, args.requests)
        except ValueError as err:
            parser.error(str(err))
        header = (f"<!-- python -m prfaas_sglang.bench prefill-cache --min-tokens {args.min_tokens} "
                  f"--cache-tokens {args.cache_tokens}{f' --requests {args.requests}' if args.requests else ''}; {stamp} -->")
    elif args.name == "chaos":
        from prfaas_sglang.bench import chaos as bench
        from prfaas_sglang.demo.netns import available

        if args.duration < 20 or args.rate <= 0 or args.down_s <= 0 or args.fuzz_requests < 0:
            parser.error("--duration must be >= 20, --rate and --down-s > 0, --fuzz-requests >= 0")
        if (why := available()) is not None:
            parser.error(f"the PrfaaS link's namespace {why}")
        faults = bench.FAULTS if args.faults is None else tuple(f.strip() for f in args.faults.split(",") if f.strip())
        if not faults or set(faults) - set(bench.FAULTS):
            parser.error(f"--faults must name some of {', '.join(bench.FAULTS)}")
        rounds = args.rounds or max(int(args.duration // 200), 1)
        if rounds < 1 or args.duration / (rounds * len(faults)) < args.down_s + 2:
            parser.error(f"--rounds must be >= 1, with room for each fault (--duration / (rounds x {len(faults)}) "
                         f">= --down-s + 2)")
        result = bench.run(args.duration, args.rate, args.seed, args.down_s, args.fuzz_requests, faults=faults,
                           rounds=rounds, front=args.front)
        header = (f"<!-- python -m prfaas_sglang.bench chaos --duration {args.duration:g} --rate {args.rate:g} "
                  f"--down-s {args.down_s:g} --rounds {rounds} --seed {args.seed}"
                  f"{'' if args.faults is None else ' --faults ' + ','.join(faults)}{'' if args.front else ' --no-front'}; "
                  f"{stamp} -->")
    elif args.name == "api-fuzz":
        from prfaas_sglang.bench import api_fuzz as bench

        if args.max_examples < 1 or args.max_time <= 0:
            parser.error("--max-examples must be >= 1 and --max-time > 0")
        result = bench.run(args.max_examples, args.seed, args.max_time)
        header = (f"<!-- python -m prfaas_sglang.bench api-fuzz --max-examples {args.max_examples} --seed {args.seed}; "
                  f"{stamp} -->")
    elif args.name == "sim":
        from prfaas_sglang.bench import sim as bench

        if args.seeds < 1:
            parser.error("--seeds must be >= 1")
        if args.study == "scale" and (args.trace is None or not args.trace.is_file()):
            parser.error("--study scale needs --trace FILE (a Mooncake-format trace)")
        result = bench.run(args.study, args.seeds, args.trace)
        header = (f"<!-- python -m prfaas_sglang.bench sim --study {args.study} --seeds {args.seeds}"
                  f"{f' --trace {args.trace}' if args.trace else ''}; {stamp} -->")
    elif args.name == "kvindex":
        from prfaas_sglang.bench import kvindex as bench

        if args.page_sizes is not None:
            try:
                sizes = tuple(int(x) for x in args.page_sizes.split(","))
            except ValueError:
                parser.error("--page-sizes: a comma list of integers")
            if not sizes or min(sizes) < 1:
                parser.error("--page-sizes must be >= 1")
            result = bench.by_page_size(sizes)
            header = f"<!-- python -m prfaas_sglang.bench kvindex --page-sizes {args.page_sizes}; {stamp} -->"
        elif args.held_blocks is not None:
            if args.held_blocks < 1 or args.workers < 1:
                parser.error("--held-blocks and --workers must be >= 1")
            result = bench.held(args.held_blocks, args.workers)
            header = f"<!-- python -m prfaas_sglang.bench kvindex --held-blocks {args.held_blocks} --workers {args.workers}; {stamp} -->"
        else:
            result = bench.run()
            header = f"<!-- python -m prfaas_sglang.bench kvindex; {stamp} -->"
    else:
        if not args.speedup > 0 or not 0 < args.kv_scale <= 1:
            parser.error("--speedup must be > 0 and --kv-scale in (0, 1]")
        if args.load:
            from prfaas_sglang.bench import fidelity as bench

            speedup = args.speedup if args.speedup != 1.0 else 5.0
            result = bench.run(speedup, args.kv_scale)
            header = f"<!-- python -m prfaas_sglang.bench mock-fidelity --load --speedup {speedup:g}; {stamp} -->"
        else:
            from prfaas_sglang.bench import mock as bench

            result = bench.run(args.speedup, args.kv_scale)
            header = f"<!-- python -m prfaas_sglang.bench mock-fidelity --speedup {args.speedup:g}; {stamp} -->"
    if args.json:
        print(json.dumps({"date": date.today().isoformat(), "machine": machine, "result": result}, indent=2))
    else:
        print(header)
        print(bench.render_markdown(result))
    return 0



def _capacity(args: argparse.Namespace, parser: argparse.ArgumentParser, stamp: str) -> tuple[dict, str]:
    """``compare --capacity`` (or ``--merge``): the setting from the flags, the run, its header line."""
    from prfaas_sglang.bench import capacity, capacity_rows

    if args.merge:
        return capacity.merge([capacity.load(p) for p in args.merge]), f"<!-- merged {len(args.merge)} pieces; {stamp} -->"
    from prfaas_sglang.demo.netns import available

    if (why := available()) is not None:
        parser.error(f"the shaped PrfaaS link {why}")
    if args.workload not in ("case-study", "shift") and not args.workload.startswith("trace:"):
        parser.error("--workload: case-study, shift or trace:PATH")
    families = capacity_rows.FAMILIES if args.families is None else tuple(f for f in args.families.split(",") if f != "none")
    if unknown := set(families) - set(capacity_rows.FAMILIES):
        parser.error(f"unknown families {sorted(unknown)}")
    ours = tuple(args.ours.split(",")) if args.ours else None
    if args.ttft_slo_s is not None and not args.ttft_slo_s > 0:
        parser.error("--ttft-slo-s must be > 0")
    setting = capacity.CapacitySetting(workload=args.workload, link=args.link, link_drop=args.link_drop,
                                       speedup=args.speedup or 4.0, ttft_slo_s=args.ttft_slo_s)
    if args.seeds is not None:
        setting = dataclasses.replace(setting, seeds=args.seeds)
    if args.bias is not None:
        if not 0.1 <= args.bias <= 10:
            parser.error("--bias must be in [0.1, 10]")
        setting = dataclasses.replace(setting, prefill_bias=args.bias, decode_bias=args.bias)
        families = ()
        ours = ours or ("prfaas", "prfaas-no-calibration", capacity_rows.oracle_row(args.bias).name)
    if args.quick:
        setting = dataclasses.replace(setting, seeds=1, scored_per_seed=20, sweep_scored=16, warmup_s=10.0,
                                      resolution=0.5, resolution_99=1.0, max_rounds=4)
        families = tuple(f for f in families if f == "sglang-router")[:1]
        ours = ours or ("prfaas",)
    if ours and (unknown := [n for n in ours if n not in capacity_rows.ALL and not n.startswith("prfaas-measured-")]):
        parser.error(f"unknown rows {unknown}")
    peers = tuple(args.peers.split(",")) if args.peers else None
    if peers and (unknown := [n for n in peers if n not in capacity_rows.ALL or capacity_rows.ALL[n].family == "ours"]):
        parser.error(f"unknown peer rows {unknown}")
    starts = {}
    for item in args.start:
        name, _, value = item.partition("=")
        try:
            starts[name] = float(value)
        except ValueError:
            parser.error(f"--start: expected ROW=X, got {item!r}")
        if name not in capacity_rows.ALL or not 0 < starts[name] <= 4:
            parser.error(f"--start {item!r}: a known row and 0 < X <= 4")
    result = capacity.run(setting, families, ours, quick=args.quick, peers=peers, starts=starts,
                          partial=args.out.with_suffix(".partial.json") if args.out else None,
                          log=lambda m: print(m, file=sys.stderr, flush=True))
    header = (f"<!-- python -m prfaas_sglang.bench compare --capacity --workload {args.workload} --link {args.link}"
              f"{' --link-drop' if args.link_drop else ''}{f' --bias {args.bias:g}' if args.bias else ''}"
              f"{f' --ttft-slo-s {args.ttft_slo_s:g}' if args.ttft_slo_s else ''}"
              f"{' --quick' if args.quick else ''}{f' --peers {args.peers}' if args.peers else ''}"
              f"{f' --ours {args.ours}' if args.ours else ''}{''.join(f' --start {x}' for x in args.start)} --seeds {setting.seeds} --speedup {setting.speedup:g}; {stamp} -->")
    return result, header


def _trace_path(given: str | None) -> str:
    """``--trace``, else ``PRFAAS_TRACE_PATH``, else the shared data directory's conversation trace."""
    from prfaas_sglang.envs import envs

    return given or envs.TRACE_PATH.get() or str(Path(__file__).resolve().parents[2].parent / "shared" / "data"
                                                 / "mooncake_conversation_trace.jsonl")


if __name__ == "__main__":
    sys.exit(main())

