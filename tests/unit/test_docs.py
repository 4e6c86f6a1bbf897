"""The documentation: a short README, a site that builds in strict mode, reference pages generated from
the code and never stale, runnable commands accepted by their parsers, a benchmarks page that leads
with its summary table, and a built site a browser can read."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from prfaas_sglang.docsite import reference
from prfaas_sglang.docsite.__main__ import build_site
from prfaas_sglang.docsite.commands import check_command, runnable_commands

REPO_ROOT = reference.REPO_ROOT
DOCS = REPO_ROOT / "docs"
README = REPO_ROOT / "README.md"
README_MAX_LINES = 200


def _pages() -> list[Path]:
    return [README, *sorted(DOCS.rglob("*.md"))]


def _nav_pages(nav: list) -> list[str]:
    out = []
    for entry in nav:
        value = next(iter(entry.values())) if isinstance(entry, dict) else entry
        out += _nav_pages(value) if isinstance(value, list) else [value]
    return out


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    built = build_site(out)
    assert built.returncode == 0, built.stdout + built.stderr
    return out


def test_the_readme_is_short_and_links_a_newcomers_three_questions_into_the_site():
    lines = README.read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines (at most {README_MAX_LINES})"
    links = set(re.findall(r"\]\((docs/[^)#\s]+)", README.read_text()))
    for page in links:
        assert (REPO_ROOT / page).is_file(), f"README links {page}, which does not exist"
    # how do I run it on my machine; how do I deploy two clusters; what does it gain over sglang-router
    assert {"docs/quickstart.md", "docs/deployment.md", "docs/benchmarks/index.md"} <= links


def test_every_generated_reference_page_is_current():
    assert reference.stale_pages() == [], "a reference page is stale: python -m prfaas_sglang.docsite write"


def test_every_flag_of_every_command_line_says_what_it_does():
    undocumented = [line for line in (DOCS / "reference" / "cli.md").read_text().splitlines() if line.endswith("|  |")]
    assert undocumented == [], "give these flags a help= (the reference page shows it)"


def test_the_topology_reference_names_every_key_the_parser_accepts():
    """Each key ``parse_topology`` checks for (its ``check_keys`` sets) is a field of the schema the
    reference page is rendered from, so a new field cannot reach users undocumented."""
    import ast

    from prfaas_sglang import topology

    tree = ast.parse(Path(topology.__file__).read_text())
    accepted = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "_check_keys" and isinstance(node.args[1], ast.Set):
            accepted |= {e.value for e in node.args[1].elts}
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "_NODE_KEYS" for t in node.targets):
            accepted |= {e.value for e in node.value.elts}
    documented = {re.split(r"[.\[\]]+", f.path.replace("[]", ""))[-1] for f in reference.schema_fields(topology.__doc__)}
    documented |= {"cpu", "memory"}  # kubernetes.requests.<role>'s keys, shown in its example
    assert accepted - documented == set()


def test_the_site_builds_in_strict_mode_with_every_page_in_its_nav(site):
    config = yaml.unsafe_load((REPO_ROOT / "mkdocs.yml").read_text())
    for page in _nav_pages(config["nav"]):
        assert (site / page.replace(".md", ".html")).is_file(), page
    for generated in reference.PAGES:
        assert (site / "reference" / generated.replace(".md", ".html")).is_file()


def test_a_broken_link_fails_the_build(tmp_path):
    shutil.copytree(DOCS, tmp_path / "docs")
    shutil.copy(REPO_ROOT / "mkdocs.yml", tmp_path / "mkdocs.yml")
    with (tmp_path / "docs" / "quickstart.md").open("a") as page:
        page.write("\nSee [the missing page](no-such-page.md).\n")
    built = build_site(tmp_path / "site", config=tmp_path / "mkdocs.yml")
    assert built.returncode != 0
    assert "no-such-page.md" in built.stdout + built.stderr


def test_every_command_marked_runnable_is_accepted_by_its_parser():
    commands = {(page.relative_to(REPO_ROOT), c) for page in _pages() for c in runnable_commands(page.read_text())}
    assert len(commands) >= 10, "the pages mark their commands <!-- runnable -->"
    problems = [f"{page}: {command}: {problem}" for page, command in sorted(commands)
                if (problem := check_command(command))]
    assert problems == []


def test_a_command_its_parser_refuses_is_reported():
    assert "unrecognized arguments: --no-such-flag" in check_command("python -m prfaas_sglang.plan --no-such-flag")
    assert check_command("make no-such-target") == "no make target no-such-target"
    assert check_command("curl http://localhost:8000").startswith("cannot be checked")


def test_the_benchmarks_page_leads_with_its_summary_table():
    text = (DOCS / "benchmarks" / "index.md").read_text()
    body = re.split(r"^# .*$", text, maxsplit=1, flags=re.M)[1].lstrip("\n")  # past the H1
    assert body.startswith("|"), "the first thing under the title is the summary table"
    for archived in sorted((DOCS / "benchmarks" / "archive").glob("*.md")):
        assert '!!! note "Archive"' in archived.read_text() or archived.name == "index.md", archived


def test_a_headless_browser_reads_the_built_home_and_reference_pages(site, tmp_path):
    assert shutil.which("chromium"), "make env installs chromium (scripts/setup-env.sh)"
    report_dir = Path(os.environ.get("PRFAAS_TEST_REPORT", tmp_path / "report")).parent
    for page, heading in (("index.html", "prfaas-sglang"), ("reference/cli.html", "Command lines")):
        shot = report_dir / f"docs-{page.replace('/', '-')}.png"
        argv = ["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--window-size=1280,900",
                f"--user-data-dir={tmp_path / 'profile'}"]
        dom = subprocess.run([*argv, "--dump-dom", (site / page).as_uri()], capture_output=True, text=True, timeout=120)
        assert re.search(rf"<h1[^>]*>\s*{re.escape(heading)}", dom.stdout), (page, dom.stderr[-2000:])
        subprocess.run([*argv, f"--screenshot={shot}", (site / page).as_uri()], capture_output=True, timeout=120)
        assert shot.stat().st_size > 10_000, shot  # a rendered page, kept as the test's artefact


def test_the_kv_efficiency_figure_draws_each_row_and_condition_across_the_recorded_rates():
    from prfaas_sglang.docsite.figures import kv_efficiency_svg

    docs = [{"result": {"rate_mbit": rate, "payload_mib": 64, "conditions": [
        {"condition": c, "goodput_fraction": 0.9, "default_goodput_fraction": 0.2} for c in ("clean", "lossy")]}}
        for rate in (1000, 200, 500)]
    svg = kv_efficiency_svg(docs)
    assert svg.count("<polyline") == 4 and svg.count("<circle") == 12  # ours and SGLang's, clean and lossy; 3 rates
    assert svg.count('stroke-dasharray="5,4"') == 2 * 2  # SGLang's two lines and their legend entries
    xs = [float(p.split(",")[0]) for p in re.search(r'<polyline points="([^"]+)"', svg).group(1).split()]
    assert xs == sorted(xs)  # drawn in order of rate, whatever the order the documents came in


def test_the_attainment_figure_draws_every_row_through_its_probes_with_their_intervals_and_the_target():
    from prfaas_sglang.docsite.figures import attainment_svg, ticks

    doc = {"conditions": [{"condition": "abundant-5s", "link": "abundant", "ttft_slo_s": 5, "setting": {"output_tokens": 64}, "rows": {
        "ours (defaults)": {"probes": [{"load_rps": 0.8, "attainment": 0.95, "arrivals": 200},
                                       {"load_rps": 1.2, "attainment": 0.80, "arrivals": 200}]},
        "naive at its best (cache_aware)": {"probes": [{"load_rps": 0.5, "attainment": 0.91, "arrivals": 20}]}}}]}
    svg = attainment_svg(doc)
    assert svg.count("<polyline") == 2 and svg.count("<circle") == 3 and "ours</text>" in svg and "naive at its best</text>" in svg
    bars = re.findall(r'<line x1="([\d.]+)" y1="([\d.]+)" x2="\1" y2="([\d.]+)" stroke="#[0-9a-f]+" stroke-width="1" opacity', svg)
    spans = [float(y1) - float(y2) for _, y1, y2 in sorted(bars, key=lambda b: float(b[0]))]
    assert len(spans) == 3 and spans[0] > 2 * max(spans[1:])  # naive's probe, at the lowest load, had 20 arrivals
    assert "90% of arrivals within the SLO" in svg and 'stroke-dasharray="6,4"' in svg
    assert "64-token outputs" in svg and "SLO 5 s" in svg  # what was measured is on the figure
    assert ticks(0.0, 1.26) == [0.0, 0.25, 0.5, 0.75, 1.0, 1.25]
    assert ticks(0.7, 1.0) == [0.7, 0.75, 0.8, 0.85, 0.9, 0.95, 1.0]
