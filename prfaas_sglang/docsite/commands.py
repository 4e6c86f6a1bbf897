"""The commands a page shows as runnable, and whether each would be accepted, without running it.

A fenced block right after the line ``<!-- runnable -->`` holds commands a reader may paste. Each is
checked as far as can be without running it: ``python -m prfaas_sglang.X ARGS`` by X's own parser (the
parser its ``main`` builds, given ARGS: an unknown flag, a missing value or a bad choice fails), ``make
TARGET`` by the Makefile's targets, ``bash FILE`` by the file being there. Anything else in such a block
is refused: mark only what can be checked.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import re
import shlex
from pathlib import Path

from prfaas_sglang.docsite.reference import REPO_ROOT, capture_parser

MARKER = "<!-- runnable -->"
_BLOCK = re.compile(re.escape(MARKER) + r"\s*\n```[^\n]*\n(.*?)\n```", re.S)
_ENV_ASSIGNMENT = re.compile(r"^[A-Z_][A-Z0-9_]*=")


def runnable_commands(markdown: str) -> list[str]:
    """Every command of every block marked runnable in ``markdown``: continuation lines joined, comments
    and blank lines dropped, ``&&`` / ``;`` chains split (pure)."""
    commands = []
    for block in _BLOCK.findall(markdown):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" #", 1)[0].strip()
            if not line or line.startswith("#"):
                continue
            commands += [part.strip() for part in re.split(r"&&|;", line) if part.strip()]
    return commands


def _module_with_main(module: str) -> str:
    """``module``'s ``__main__`` when it is a package, else ``module``."""
    spec = importlib.util.find_spec(module)
    if spec is not None and spec.submodule_search_locations is not None:
        return f"{module}.__main__"
    return module


def _make_targets(makefile: Path) -> set[str]:
    return {m.group(1) for m in re.finditer(r"^([A-Za-z0-9_.-]+):", makefile.read_text(), re.M)}


def check_command(command: str, repo_root: Path = REPO_ROOT) -> str | None:
    """None when ``command`` would be accepted; else what is wrong with it."""
    try:
        words = shlex.split(command)
    except ValueError as err:
        return f"cannot split: {err}"
    while words and _ENV_ASSIGNMENT.match(words[0]):
        words = words[1:]
    if not words:
        return "no command"
    if words[0] == "make":
        targets = [w for w in words[1:] if not w.startswith("-") and "=" not in w]
        unknown = sorted(set(targets) - _make_targets(repo_root / "Makefile"))
        return f"no make target {', '.join(unknown)}" if unknown else None
    if words[0] == "bash" and len(words) > 1:
        return None if (repo_root / words[1]).is_file() else f"no file {words[1]}"
    if Path(words[0]).name.startswith("python") and words[1:2] == ["-m"] and len(words) > 2:
        module, argv = words[2], words[3:]
        if not module.startswith("prfaas_sglang"):
            return f"not one of this project's command lines: {module}"
        try:
            parser = capture_parser(_module_with_main(module), argv)
        except (ImportError, RuntimeError) as err:
            return f"{module}: {err}"
        with contextlib.redirect_stderr(io.StringIO()) as err, contextlib.redirect_stdout(io.StringIO()):
            try:
                argparse.ArgumentParser.parse_args(parser, argv)
            except SystemExit as stop:
                if stop.code:  # --help exits 0
                    return f"refused by its parser: {err.getvalue().strip().splitlines()[-1]}"
        return None
    return f"cannot be checked without running it: {words[0]}"
