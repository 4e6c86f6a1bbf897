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
