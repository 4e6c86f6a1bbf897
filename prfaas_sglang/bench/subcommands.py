"""How a benchmark module plugs into ``python -m prfaas_sglang.bench``: its subcommands, registered there.

A module that runs as a subcommand ends with ``SUBCOMMANDS``: each name it serves, with a
:class:`Subcommand` (a function that adds the subcommand's flags to its parser, and one that runs it
from the parsed arguments). ``bench/__main__.py`` lists which module serves which name, imports only
the module of the name given (the others may need what this machine lacks: the GPU machine has no
SimPy), and calls its ``run``. Light on purpose: the standard library only.
"""

from __future__ import annotations

import argparse
import json
import platform
from collections.abc import Callable
from dataclasses import dataclass
from datetime import date
from pathlib import Path
from typing import Any, NoReturn


@dataclass(frozen=True)
class Invocation:
    """One run of the CLI, as a subcommand sees it: the top-level ``parser`` (its ``error`` is how a bad
    flag is reported), the ``machine`` and the ``stamp`` (today and the machine, taken before the run)
    that the report carries."""

    parser: argparse.ArgumentParser
    machine: str
    stamp: str

    @classmethod
    def now(cls, parser: argparse.ArgumentParser) -> Invocation:
        machine = f"{platform.machine()}, {platform.python_implementation()} {platform.python_version()}"
        return cls(parser, machine, f"{date.today().isoformat()}; {machine}")

    def error(self, message: str) -> NoReturn:
        self.parser.error(message)

    def report(self, args: argparse.Namespace, result: Any, header: str,
               render: Callable[[Any], str] | None) -> int:
        """Print ``result``: with ``--json`` as JSON with the date and machine, else the ``header`` line
        (the command that made it, for BENCHMARKS.md) and ``render(result)``. Returns 0. A benchmark
        without a Markdown report (``render`` None) reports JSON either way: its run is not lost to a
        missing flag."""
        if args.json or render is None:
            print(json.dumps({"date": date.today().isoformat(), "machine": self.machine, "result": result}, indent=2))
        else:
            print(header)
            print(render(result))
        return 0


@dataclass(frozen=True)
class Subcommand:
    """``add_arguments(parser)`` adds the subcommand's flags; ``run(args, invocation)`` runs it and
    returns the exit status."""

    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace, Invocation], int]


def trace_path(given: str | None) -> str:
    """``--trace``, else ``PRFAAS_TRACE_PATH``, else the shared data directory's conversation trace."""
    from prfaas_sglang.envs import envs

    return given or envs.TRACE_PATH.get() or str(Path(__file__).resolve().parents[2].parent / "shared" / "data"
                                                 / "mooncake_conversation_trace.jsonl")
