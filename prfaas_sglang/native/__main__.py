"""``python -m prfaas_sglang.native build``: build the native helpers now (engine images do, so a
container never compiles at start); prints the shim's path."""

from __future__ import annotations

import argparse
import sys

from prfaas_sglang.native import NativeBuildError, build_bind_shim


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m prfaas_sglang.native")
    parser.add_argument("action", choices=("build",),
                        help="build: compile the bind shim if not yet built; print its path")
    parser.parse_args(argv)
    try:
        print(build_bind_shim())
    except NativeBuildError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
