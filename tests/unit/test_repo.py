"""Repository-level contracts: CI runs the README's test command, one pin, one envs module."""

from __future__ import annotations

import re

import tomllib
from helpers import REPO_ROOT

from prfaas_sglang._pin import PINNED_SGLANG_VERSION
from prfaas_sglang.envs import Envs

README = (REPO_ROOT / "README.md").read_text()


def readme_test_command() -> str:
    match = re.search(r"<!-- test-command -->\s*```(?:bash|sh)?\n(.+?)\n```", README, re.S)
    assert match, "README must mark its test command with <!-- test-command -->"
    return match.group(1).strip()


def test_ci_runs_the_readme_test_command():
    command = readme_test_command()
    ci = (REPO_ROOT / ".ci" / "run").read_text()
    assert command in [line.strip() for line in ci.splitlines()]


def test_pyproject_pins_the_same_sglang():
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    assert f"sglang=={PINNED_SGLANG_VERSION}" in project["optional-dependencies"]["engine"]
    assert project["entry-points"]["sglang.srt.plugins"] == {"prfaas": "prfaas_sglang.plugin:register"}


def test_every_prfaas_variable_is_declared_in_envs():
    declared = {var.name for var in Envs.all()}
    used: set[str] = set()
    for path in (REPO_ROOT / "prfaas_sglang").rglob("*.py"):
        used |= set(re.findall(r"\bPRFAAS_[A-Z_]+\b", path.read_text()))
    assert used - declared == set()


def test_only_envs_reads_prfaas_variables():
    offenders = []
    for path in (REPO_ROOT / "prfaas_sglang").rglob("*.py"):
        if path.name == "envs.py":
            continue
        if re.search(r"environ(?:\.get)?\(?\[?[\"']PRFAAS_", path.read_text()):
            offenders.append(str(path.relative_to(REPO_ROOT)))
    assert offenders == []


def test_ruff_is_clean():
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    assert ruff, "ruff comes with the test extra"
    proc = subprocess.run([ruff, "check", "--output-format", "concise", str(REPO_ROOT)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout
