"""The pinned upstream, in one place.

This file imports nothing so that shell scripts and Dockerfiles can read it
before the package is installed: ``python3 prfaas_sglang/_pin.py`` prints the
pinned SGLang version. Tests check that pyproject.toml's ``engine`` extra and
the Docker images agree with it.
"""

PINNED_SGLANG_VERSION = "0.5.15"
# Every release this distribution runs on (its hooks, backends and patches ported to each; what
# upstream does itself on a release is retired there, by its marker). The pin is the default
# environment's and the GPU bundle's (the lent GPU's torch 2.11 fits 0.5.15 only).
SUPPORTED_SGLANG_VERSIONS = (PINNED_SGLANG_VERSION, "0.5.23")
# The release the upstream-rebase check tries by default ("newest at the time
# of writing"); `rebase-check --sglang-version latest` asks the index instead.
REBASE_TARGET_SGLANG_VERSION = "0.5.23"

if __name__ == "__main__":
    import sys

    # no argument: the pin (setup-env.sh); --others: the other supported releases (the Makefile's overlays)
    others = [v for v in SUPPORTED_SGLANG_VERSIONS if v != PINNED_SGLANG_VERSION]
    print(" ".join(others) if sys.argv[1:] == ["--others"] else PINNED_SGLANG_VERSION)
