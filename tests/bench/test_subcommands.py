"""How a benchmark reports (bench/subcommands.py): a Markdown report with its command line, or JSON."""

from __future__ import annotations

import argparse
import json

from prfaas_sglang.bench.subcommands import Invocation


def test_a_report_is_markdown_under_its_command_unless_json_and_a_bench_without_markdown_reports_json(capsys):
    inv = Invocation.now(argparse.ArgumentParser())
    result = {"rows": 3}
    assert inv.report(argparse.Namespace(json=False, name="x"), result, "<!-- cmd -->", lambda r: f"| {r['rows']} |") == 0
    assert capsys.readouterr().out == "<!-- cmd -->\n| 3 |\n"
    for flag in (True, False):  # without a renderer the run is reported, not lost to a missing --json
        assert inv.report(argparse.Namespace(json=flag, name="layerwise"), result, "<!-- cmd -->", None) == 0
        printed = json.loads(capsys.readouterr().out)
        assert printed["result"] == result and printed["machine"] == inv.machine


def test_the_report_line_names_every_setting_the_run_had_and_runs_it_again():
    """Without a header of its own, a report is headed by the subcommand and each option's parsed value:
    defaults included, switches where set, empty and unset options and --json left out; parsing that
    line again gives the same settings."""
    from prfaas_sglang.bench.__main__ import build_parser
    from prfaas_sglang.bench.subcommands import command_line

    argv = ["compare", "--capacity", "--start", "ours=0.5", "--start", "naive=0.3", "--json"]
    parser, (_, subparser) = build_parser("compare")
    args = parser.parse_args(argv)
    line = command_line(subparser, args)
    assert line.startswith("python -m prfaas_sglang.bench compare --workload case-study --link abundant --load 0.8")
    assert " --capacity " in line and line.endswith("--start ours=0.5 --start naive=0.3") and "--json" not in line
    assert "--peers" not in line and "--merge" not in line  # empty, unset
    again = parser.parse_args(line.split()[3:])
    assert vars(again) == {**vars(args), "json": False}
