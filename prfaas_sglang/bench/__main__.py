"""``python -m prfaas_sglang.bench <name>``: run a benchmark, print Markdown (or --json) for BENCHMARKS.md.

Benchmarks:
  plan           planner search time (case study, 128- and 32-token grids), and the
                 case-study optimum under other values of the two calibrated MFUs
  mock-fidelity  emulated engine: measured TTFT vs profile prefill / speedup + KV transfer
  kvindex        global KV index: event ingest rate, match latency for a 128K-token prompt
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from datetime import date


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
    fidelity.add_argument("--json", action="store_true")
    kvi = sub.add_parser("kvindex", help="KV index ingest rate and match latency")
    kvi.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    machine = f"{platform.machine()}, {platform.python_implementation()} {platform.python_version()}"
    stamp = f"{date.today().isoformat()}; {machine}"
    if args.name == "plan":
        if args.repeat < 1:
            parser.error("--repeat must be >= 1")
        from prfaas_sglang.bench import plan as bench

        result = bench.run(args.repeat)
        header = f"<!-- python -m prfaas_sglang.bench plan --repeat {args.repeat}; {stamp} -->"
    elif args.name == "kvindex":
        from prfaas_sglang.bench import kvindex as bench

        result = bench.run()
        header = f"<!-- python -m prfaas_sglang.bench kvindex; {stamp} -->"
    else:
        if not args.speedup > 0 or not 0 < args.kv_scale <= 1:
            parser.error("--speedup must be > 0 and --kv-scale in (0, 1]")
        from prfaas_sglang.bench import mock as bench

        result = bench.run(args.speedup, args.kv_scale)
        header = f"<!-- python -m prfaas_sglang.bench mock-fidelity --speedup {args.speedup:g}; {stamp} -->"
    if args.json:
        print(json.dumps({"date": date.today().isoformat(), "machine": machine, "result": result}, indent=2))
    else:
        print(header)
        print(bench.render_markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
