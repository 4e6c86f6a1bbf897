"""``python -m prfaas_sglang.bench <name>``: run a benchmark, print Markdown (or --json) for BENCHMARKS.md.

Benchmarks:
  plan    planner search time (case study, 128- and 32-token grids), and the
          case-study optimum under other values of the two calibrated MFUs
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
    args = parser.parse_args(argv)
    if args.repeat < 1:
        parser.error("--repeat must be >= 1")

    from prfaas_sglang.bench import plan as plan_bench

    result = plan_bench.run(args.repeat)
    machine = f"{platform.machine()}, {platform.python_implementation()} {platform.python_version()}"
    if args.json:
        print(json.dumps({"date": date.today().isoformat(), "machine": machine, **result}, indent=2))
    else:
        print(f"<!-- python -m prfaas_sglang.bench plan --repeat {args.repeat}; {date.today().isoformat()}; {machine} -->")
        print(plan_bench.render_markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
