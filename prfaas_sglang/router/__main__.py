"""``python -m prfaas_sglang.router``: the PrfaaS global scheduler for the workers of a topology.

    python -m prfaas_sglang.router --config launch/local-two-cluster.yaml --port 8000 [--threshold 19400]

Without ``--threshold`` the planner picks it for the topology's instance counts
and the case-study workload. Exits 2 with a one-line reason on bad input.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from prfaas_sglang.errors import ConfigError, PrfaasError


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m prfaas_sglang.router", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", type=Path, required=True, help="topology YAML listing the workers")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--threshold", type=float, help="routing threshold t, tokens (default: from the planner)")
    p.add_argument("--bandwidth-mode", default="scarce", help="scarce | abundant (paper section 3.4.3)")
    p.add_argument("--profile-prfaas", default="kimi-linear-1t-hybrid@h200x8", help="prefill cost model of the PrfaaS class")
    p.add_argument("--profile-pd", default="kimi-linear-1t-hybrid@h20x8", help="prefill cost model of the PD class")
    p.add_argument("--page-size", type=int, default=512, help="the workers' KV page size, tokens")
    p.add_argument("--phase-timeout-s", type=float, default=600.0)
    p.add_argument("--served-model-name", action="append", default=None,
                   help="model name(s) clients may ask for (repeatable); requests naming another get 404. "
                        "Unset: any name is accepted and /v1/models lists 'prfaas'")
    p.add_argument("--max-ttft-s", type=float, default=None,
                   help="reject (503 + Retry-After) when the best route's estimated TTFT exceeds this")
    p.add_argument("--raise-after-s", type=float, default=0.5, help="sustained saturation before t is raised")
    p.add_argument("--lower-after-s", type=float, default=5.0, help="sustained recovery before t is lowered")
    return p


def make_state(args: argparse.Namespace):
    from prfaas_sglang.engine.mock.timing import load_timing
    from prfaas_sglang.kvindex.index import KvIndex
    from prfaas_sglang.launch.topology import load_topology
    from prfaas_sglang.plan.model import Deployment
    from prfaas_sglang.plan.profiles import DecodeProfile, InstanceClass
    from prfaas_sglang.plan.search import best_threshold_for_split
    from prfaas_sglang.plan.workload import TruncatedLogNormal
    from prfaas_sglang.router.policy import BandwidthMode
    from prfaas_sglang.router.server import RouterState
    from prfaas_sglang.router.threshold import ThresholdController
    from prfaas_sglang.router.workers import link_from_topology, workers_from_topology

    try:
        mode = BandwidthMode(args.bandwidth_mode)
    except ValueError:
        raise ConfigError("--bandwidth-mode", f"expected scarce or abundant, got {args.bandwidth_mode!r}") from None
    if args.max_ttft_s is not None and not args.max_ttft_s > 0:
        raise ConfigError("--max-ttft-s", f"must be > 0, got {args.max_ttft_s}")
    if args.threshold is not None and not args.threshold > 0:
        raise ConfigError("--threshold", f"must be > 0, got {args.threshold}")
    topology = load_topology(args.config)
    workers = workers_from_topology(topology)
    link = link_from_topology(topology)
    prfaas_t = load_timing(args.profile_prfaas, 1.0, 1.0, None)
    pd_t = load_timing(args.profile_pd, 1.0, 1.0, None)
    workload = TruncatedLogNormal(9.90, 1.00, 128, 131_072)
    count = {(w.cluster, w.role): 0 for w in workers.values()}
    for w in workers.values():
        count[(w.cluster, w.role)] += 1
    n_prfaas, n_p, n_d = count.get(("prfaas", "prefill"), 0), count.get(("pd", "prefill"), 0), count.get(("pd", "decode"), 0)
    dep = Deployment(InstanceClass("prfaas", 8, prfaas_t.prefill), n_prfaas,
                     InstanceClass("pd", 8, pd_t.prefill, DecodeProfile(pd_t.max_batch, 0.025)), n_p + n_d, link.capacity_bps, 1024)

    def research(capacity_bps: float) -> float:
        thin = Deployment(dep.prfaas, dep.n_prfaas, dep.pd, dep.n_pd, max(capacity_bps, 1.0), dep.output_tokens)
        return best_threshold_for_split(thin, workload, n_p, 512).threshold_tokens

    baseline = args.threshold if args.threshold is not None else research(link.capacity_bps)
    for flag, value in (("--raise-after-s", args.raise_after_s), ("--lower-after-s", args.lower_after_s)):
        if value < 0:
            raise ConfigError(flag, f"must be >= 0, got {value}")
    controller = ThresholdController(baseline, research, workload.max_tokens,
                                     raise_after_s=args.raise_after_s, lower_after_s=args.lower_after_s)
    hybrid = pd_t.hybrid
    return RouterState(workers=workers, index=KvIndex(hybrid=hybrid), controller=controller,
                       prefill_cost={"prfaas": prfaas_t.prefill, "pd": pd_t.prefill}, kv_bytes=pd_t.prefill.kv_bytes,
                       link=link, mode=mode, page_size=args.page_size, phase_timeout_s=args.phase_timeout_s,
                       model_name=(args.served_model_name or ["prfaas"])[0],
                       served_models=frozenset(args.served_model_name or ()), max_ttft_s=args.max_ttft_s)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        state = make_state(args)
    except PrfaasError as err:
        print(f"error: {err}", file=sys.stderr)
        return err.exit_code
    import asyncio

    from aiohttp import web

    from prfaas_sglang.router.server import build_app

    try:  # uvloop when installed (it is with the engine and mock environments): a faster event loop
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    except ImportError:
        pass
    # handler_cancellation: a client that disconnects cancels its request, and with it both PD legs.
    web.run_app(build_app(state), host=args.host, port=args.port, access_log=None, print=None, handler_cancellation=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
