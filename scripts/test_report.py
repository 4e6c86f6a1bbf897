"""The test suite's own report, printed at the end of `make test` (scripts/run-tests.sh).

    python scripts/test_report.py REPORT_DIR [--write-durations tests/durations.json]

REPORT_DIR holds one ``<phase>.jsonl`` per phase (a line per test: ``tests/conftest.py`` appends it
where ``PRFAAS_TEST_REPORT`` names the file) and ``phases`` (a line per phase: name, start and end in
epoch seconds, exit status, written by the runner; phases may overlap). Prints each phase's wall time
(from the first phase's start) and test count, the whole run's (first start to last end), every test
that failed, the ten slowest tests and the ten costliest in CPU. ``--write-durations`` stores each group's summed seconds (the
largest over the phases), which ``tests/conftest.py`` orders the groups by, longest first.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

SLOWEST = 10


def read_phases(report_dir: Path) -> list[tuple[str, float, float, int]]:
    """(name, start, end, exit status) per phase (epoch seconds), in the order they ended."""
    phases = []
    for line in (report_dir / "phases").read_text().splitlines():
        name, start, end, status = line.split()
        phases.append((name, float(start), float(end), int(status)))
    return phases


def read_tests(report_dir: Path, phase: str) -> list[dict]:
    path = report_dir / f"{phase}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def minutes(seconds: float) -> str:
    return f"{seconds / 60:.1f} min"


def render(report_dir: Path) -> tuple[str, dict[str, float]]:
    """The report's text, and each group's seconds (largest over the phases)."""
    lines, every, failed, durations = ["== the suite's own report"], [], [], {}
    phases = read_phases(report_dir)
    began = min((start for _, start, _, _ in phases if start), default=0.0)
    for name, start, end, status in phases:
        tests = read_tests(report_dir, name)
        outcomes = Counter(t["outcome"] for t in tests)
        said = ", ".join(f"{n} {o}" for o, n in sorted(outcomes.items()))
        window = f"{(start - began) / 60:4.1f}-{(end - began) / 60:4.1f} min" if start else "not run"
        cpu_min = sum(t.get("cpu_s", 0.0) for t in tests) / 60
        lines.append(f"{name:<16} {window:>13} ({minutes(end - start):>8}), {sum(t['s'] for t in tests) / 60:5.1f} "
                     f"test-min, {cpu_min:5.1f} CPU-min: {said or 'no test'}{'' if status == 0 else f' (exit {status})'}")
        per_group = Counter()
        for t in tests:
            per_group[t["group"]] += t["s"]
            every.append((t["s"], t.get("cpu_s"), name, t["test"]))
            if t["outcome"] in ("failed", "error"):
                failed.append((name, t["test"]))
        for group, seconds in per_group.items():
            durations[group] = round(max(durations.get(group, 0.0), seconds), 1)
    total_s = max((end for _, start, end, _ in phases if start), default=began) - began
    lines.append(f"{'the whole run':<16} {minutes(total_s):>13}, {len(every)} tests")
    lines += [f"failed: {phase:<16} {test}" for phase, test in failed]
    lines.append(f"the {SLOWEST} slowest tests (setup, call and teardown; wall and CPU seconds):")
    lines += [f"  {seconds:7.1f} s {cpu_s or 0:7.1f} CPU-s  {phase:<16} {test}"
              for seconds, cpu_s, phase, test in sorted(every, key=lambda e: e[0], reverse=True)[:SLOWEST]]
    lines.append(f"the {SLOWEST} costliest in CPU:")
    lines += [f"  {cpu_s or 0:7.1f} CPU-s  {phase:<16} {test}"
              for _, cpu_s, phase, test in sorted(every, key=lambda e: e[1] or 0, reverse=True)[:SLOWEST]]
    return "\n".join(lines), durations


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("report_dir", type=Path)
    parser.add_argument("--write-durations", type=Path, default=None, metavar="FILE")
    args = parser.parse_args(argv)
    if not (args.report_dir / "phases").is_file():
        print(f"no report in {args.report_dir}", file=sys.stderr)
        return 2
    text, durations = render(args.report_dir)
    print(text)
    if args.write_durations:
        args.write_durations.write_text(json.dumps(dict(sorted(durations.items())), indent=0) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
