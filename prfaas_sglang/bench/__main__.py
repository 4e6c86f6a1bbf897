"""``python -m prfaas_sglang.bench <name>``: run a benchmark, print Markdown (or --json) for BENCHMARKS.md.

Benchmarks:
  plan           planner search time (case study, 128- and 32-token grids), and the
                 case-study optimum under other values of the two calibrated MFUs
  mock-fidelity  emulated engine: measured TTFT vs profile prefill / speedup + KV transfer
  kvindex        global KV index: event ingest rate, match latency for a 128K-token prompt
  state-events   what state events cost: SGLang's MambaRadixCache vs ours on the conversation
                 trace (events, bytes per second of trace, CPU time of cache calls + encoding)
  prefill-cache  a PrfaaS worker's prefix cache under each admission mode (all / shared / none) on
                 the trace's long requests: prefill tokens saved, tokens inserted, evictions
  bandwidth      router + emulated workers; the PrfaaS link throttled 10x (tbf, netns) mid-run (root)
  router-overhead  latency the router adds vs direct PD dispatch, at a fixed rate
  decode-affinity  conversations with and without decode affinity (emulated hybrid workers, decode radix
                 cache): KV the decode workers receive, the part over the PrfaaS link, latency
  decode-reuse   a hybrid decode radix cache on real SGLang pools: prompt tokens held per turn
                 (0.5.15: ours, and a state-aware match on the same tree; 0.5.23: upstream's own)
  compare        goodput: our router vs homogeneous, naive, sglang-router (two settings) and smg,
                 identical arrivals per seed, the PrfaaS link shaped (tbf, netns; root);
                 --capacity: capacity at an SLO (>= 90% / 99% of all arrivals) against every peer
                 at its best configuration (swept), by bisection on offered load
  transport      KV over Mooncake TCP across an emulated WAN link (rate, RTT, loss; netns + linkem;
                 root): our WAN profile vs SGLang's Mooncake settings, request size x lanes
  tunnel         KV through an encrypted link's WireGuard tunnel vs in clear, same link, turns alternating;
                 the tunnel daemons' CPU per Gbit (netns + linkem + wireguard-go; root)
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
import importlib
import os
import signal
import sys

from prfaas_sglang.bench.subcommands import Invocation, Subcommand


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


# Every subcommand, in --help's order: its name, its one-line help, and the module that registers it
# (its ``SUBCOMMANDS``: the flags and the run, ``bench/subcommands.py``). Only the module of the
# subcommand given is imported.
COMMANDS: tuple[tuple[str, str, str], ...] = (
    ("plan", "planner search time and sensitivity", "prfaas_sglang.bench.plan"),
    ("mock-fidelity", "emulated engine TTFT vs its profile", "prfaas_sglang.bench.mock"),
    ("kvindex", "KV index ingest rate and match latency", "prfaas_sglang.bench.kvindex"),
    ("state-events",
     "state events' overhead: stock vs our hybrid cache on a trace",
     "prfaas_sglang.bench.state_events"),
    ("prefill-cache",
     "a PrfaaS worker's prefix cache per admission mode on the trace's long requests",
     "prfaas_sglang.bench.prefill_cache"),
    ("router-overhead", "latency added by the router", "prfaas_sglang.bench.router"),
    ("router-gc",
     "a full GC collection's pause in a router process, before and after freezing start-up "
     "objects",
     "prfaas_sglang.bench.router"),
    ("compare",
     "goodput: our router vs every baseline, identical arrivals, several seeds, shaped link",
     "prfaas_sglang.bench.capacity"),
    ("bandwidth", "throttle the PrfaaS link 10x mid-run; the router's t over time", "prfaas_sglang.bench.bandwidth"),
    ("transport", "Mooncake TCP over an emulated WAN link: WAN profile vs defaults", "prfaas_sglang.bench.transport"),
    ("tunnel",
     "KV through an encrypted link's WireGuard tunnel vs in clear, side by side on an emulated WAN link (root)",
     "prfaas_sglang.bench.tunnel"),
    ("mock-kv",
     "the emulated engine's KV over an emulated WAN link: the hooks' sender vs SGLang's way",
     "prfaas_sglang.bench.mock_kv"),
    ("kv-runs", "request sizes of SGLang's Mooncake sender on pools in steady state", "prfaas_sglang.bench.kv_runs"),
    ("kv-staging",
     "SGLang's Mooncake path on CPU across an emulated WAN link, pages scattered on both sides: "
     "adjacent entries vs staging on either side (root)",
     "prfaas_sglang.bench.kv_staging"),
    ("layerwise",
     "SGLang's Mooncake path on CPU over a shaped loopback: when the decode has the KV, "
     "layer-wise streaming off vs on (root)",
     "prfaas_sglang.bench.layerwise_bench"),
    ("cache-transfer",
     "a prefix cached on PrfaaS: TTFT moved vs recomputed on PD-P, per length and link rate, "
     "next to the cost model (shaped link; root)",
     "prfaas_sglang.bench.cache_transfer"),
    ("decode-affinity",
     "conversations with and without decode affinity: KV the decode workers receive (and over "
     "the PrfaaS link), latency; emulated, same arrivals",
     "prfaas_sglang.bench.decode_affinity"),
    ("decode-reuse",
     "a hybrid model's decode radix cache on the installed SGLang's real pools: prompt tokens it held "
     "per conversation turn (0.5.15: ours and a state-aware match on it; 0.5.23: upstream's)",
     "prfaas_sglang.bench.decode_reuse"),
    ("chaos",
     "mixed load while workers, the router and the PrfaaS link fail (seeded faults; root)",
     "prfaas_sglang.bench.chaos"),
    ("api-fuzz",
     "schemathesis against the router's /openapi.json on an emulated deployment",
     "prfaas_sglang.bench.api_fuzz"),
    ("sim",
     "the simulator: vs the analytic model, vs the emulated deployment, vs the paper, a workload "
     "shift, calibration against a biased truth (bias), its cost at scale",
     "prfaas_sglang.bench.sim"),
    ("dashboard",
     "the Grafana dashboard drawn from a live emulated run's /metrics (PNG)",
     "prfaas_sglang.bench.dashboard"),
    ("gpu-bundle",
     "build and verify the GPU carry bundle (SGLang and what it imports, tiny model)",
     "prfaas_sglang.gpu.cli"),
    ("gpu-e2e",
     "on the GPU machine: real SGLang in every role behind our router; seven checks",
     "prfaas_sglang.gpu.cli"),
    ("profile",
     "a cost profile measured on real SGLang (prefill, cached prefix, decode, pools) beside the "
     "roofline; writes the profile file the planner, router and emulator load",
     "prfaas_sglang.gpu.cli"),
    ("predict",
     "the router's TTFT predictions vs the TTFTs real SGLang shows: roofline, measured, and "
     "measured x2 with online calibration",
     "prfaas_sglang.gpu.cli"),
)


def build_parser(chosen: str | None = None) -> tuple[argparse.ArgumentParser,
                                                    tuple[Subcommand, argparse.ArgumentParser] | None]:
    """The CLI's parser: every subcommand with its help, and the flags of ``chosen`` (whose module is the
    only one imported); with ``chosen``'s registration and its parser (None when it names no subcommand)."""
    parser = argparse.ArgumentParser(prog="python -m prfaas_sglang.bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="name", required=True)
    registered = None
    for name, help_, module in COMMANDS:
        subparser = sub.add_parser(name, help=help_)
        if name == chosen:
            registered = importlib.import_module(module).SUBCOMMANDS[name], subparser
            registered[0].add_arguments(subparser)
    return parser, registered


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    # the subcommand is the first argument that is not an option (the top level has none but --help)
    parser, registered = build_parser(next((a for a in argv if not a.startswith("-")), None))
    args = parser.parse_args(argv)  # exits on --help or without a known subcommand: registered is set past here
    subcommand, subparser = registered
    exit_on_sigterm()
    return subcommand.run(args, Invocation.now(parser, subparser))


if __name__ == "__main__":
    sys.exit(main())
