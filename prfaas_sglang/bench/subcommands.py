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
class CommaList:
    """An option's ``type``: a comma list of ``kind`` (``int`` or ``float``) parsed to a tuple, or the
    usage error naming the option (exit 2) where an item is not one."""

    kind: Callable[[str], Any]

    def __call__(self, text: str) -> tuple:
        try:
            return tuple(self.kind(x) for x in text.split(","))
        except ValueError:
            raise argparse.ArgumentTypeError(f"a comma list of {self.kind.__name__}s, got {text!r}") from None


def command_line(parser: argparse.ArgumentParser, args: argparse.Namespace) -> str:
    """The command that gives ``args``: ``parser.prog`` (for a subcommand's parser, the CLI and the
    subcommand's name) and each of its options, in its order, with the value parsed, defaults included, so that a report says
    every setting it ran with. A switch appears where it differs from its default; an option whose value
    is None or empty, ``--help`` and ``--json`` do not; a list repeats an appended option per item (a
    :class:`CommaList`'s is one comma list)."""
    words = [parser.prog]
    for action in parser._actions:  # argparse keeps no public list of a parser's options
        value = getattr(args, action.dest, None)
        if not action.option_strings or action.dest in ("help", "json") or value is None or value == "":
            continue
        flag = max(action.option_strings, key=len)
        if action.nargs == 0:  # store_true / store_false / store_const
            words += [flag] if value != action.default else []
            continue
        items = value if isinstance(value, (list, tuple)) else [value]
        text = [f"{x:g}" if isinstance(x, float) else str(x) for x in items]
        if isinstance(action.type, CommaList):
            words += [flag, ",".join(text)]
        elif isinstance(action, argparse._AppendAction):
            words += [w for x in text for w in (flag, x)]
        elif text:
            words += [flag, *text]
    return " ".join(words)


@dataclass(frozen=True)
class Invocation:
    """One run of the CLI, as a subcommand sees it: the top-level ``parser`` (its ``error`` is how a bad
    flag is reported), the ``machine`` and the ``stamp`` (today and the machine, taken before the run)
    that the report carries, and the subcommand's own parser (``subparser``: the report's command line)."""

    parser: argparse.ArgumentParser
    machine: str
    stamp: str
    subparser: argparse.ArgumentParser | None = None

    @classmethod
    def now(cls, parser: argparse.ArgumentParser, subparser: argparse.ArgumentParser | None = None) -> Invocation:
        machine = f"{platform.machine()}, {platform.python_implementation()} {platform.python_version()}"
        return cls(parser, machine, f"{date.today().isoformat()}; {machine}", subparser)

    def error(self, message: str) -> NoReturn:
        self.parser.error(message)

    def report(self, args: argparse.Namespace, result: Any, header: str | None,
               render: Callable[[Any], str] | None) -> int:
        """Print ``result``: with ``--json`` as JSON with the date and machine, else the ``header`` line
        (the command that made it, for BENCHMARKS.md; None: :func:`command_line` of ``args`` and the
        stamp, as an HTML comment) and ``render(result)``. Returns 0. A benchmark without a Markdown
        report (``render`` None) reports JSON either way: its run is not lost to a missing flag."""
        if args.json or render is None:
            print(json.dumps({"date": date.today().isoformat(), "machine": self.machine, "result": result}, indent=2))
        else:
            print(header or f"<!-- {command_line(self.subparser or self.parser, args)}; {self.stamp} -->")
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
