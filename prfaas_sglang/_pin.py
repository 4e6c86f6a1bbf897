"""The pinned upstream, in one place.

This file imports nothing so that shell scripts and Dockerfiles can read it
before the package is installed: ``python3 prfaas_sglang/_pin.py`` prints the
pinned SGLang version. Tests check that pyproject.toml's ``engine`` extra and
the Docker images agree with it.
"""

PINNED_SGLANG_VERSION = "0.5.15"
# The release the upstream-rebase check tries by default ("newest at the time
# of writing"); `rebase-check --sglang-version latest` asks the index instead.
REBASE_TARGET_SGLANG_VERSION = "0.5.23"

if __name__ == "__main__":
    print(PINNED_SGLANG_VERSION)
