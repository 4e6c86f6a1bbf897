#!/usr/bin/env bash
# Create the CPU development/test environment from nothing.
#
#   scripts/setup-env.sh            -> .venv with everything `make test` needs
#   VENV=/path PYTHON=python3.11 scripts/setup-env.sh
#
# Idempotent: re-running only installs what changed. Needs root (or sudo) for
# apt-get the first time; needs only the package registries (PyPI, Debian).
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}
WHEEL_CACHE=${PRFAAS_WHEEL_CACHE:-.cache/wheels}
PIN=$("$PYTHON" prfaas_sglang/_pin.py)

log() { printf '[setup-env] %s\n' "$*"; }

# 1. Mooncake's engine.so links libibverbs.so.1, even when it only uses TCP.
if ! /sbin/ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1'; then
  log "installing libibverbs1 (apt)"
  SUDO=""
  if [ "$(id -u)" != 0 ]; then
    command -v sudo >/dev/null || { echo "error: libibverbs1 is missing and this user cannot apt-get install it" >&2; exit 1; }
    SUDO=sudo
  fi
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq libibverbs1 >/dev/null
fi

# 1b. SGLang builds its block-hash extension (torch cpp_extension, -lcrypto) on
#     first use; the tests compare our hash with it.
if ! dpkg -s libssl-dev >/dev/null 2>&1; then
  log "installing libssl-dev (apt)"
  SUDO=""; [ "$(id -u)" != 0 ] && SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq libssl-dev >/dev/null
fi

# 1c. A C compiler: the launcher builds the bind shim (prfaas_sglang/native/bindshim.c) with it,
#     and SGLang's extension above needs one too.
if ! command -v cc >/dev/null 2>&1; then
  log "installing gcc (apt)"
  SUDO=""; [ "$(id -u)" != 0 ] && SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq gcc libc6-dev >/dev/null
fi

# 1d. Prometheus (Debian's, 2.42): `bench dashboard` and the dashboard's end-to-end test start their
#     own (a free port, a temp config and storage dir) and evaluate every panel's query through it.
#     Nothing here depends on the package's system service.
if ! command -v prometheus >/dev/null 2>&1; then
  log "installing prometheus (apt)"
  SUDO=""; [ "$(id -u)" != 0 ] && SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends prometheus >/dev/null
fi

# 2. The virtual environment and the CPU test requirements.
if [ ! -x "$VENV/bin/python" ]; then
  log "creating $VENV"
  "$PYTHON" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip
fi
PIP=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)
log "installing requirements/cpu-test.txt"
"${PIP[@]}" -r requirements/cpu-test.txt

# 3. The pinned SGLang, pristine, without its GPU dependency set. The wheel is
#    kept in the cache that `python -m prfaas_sglang.patches` also reads.
mkdir -p "$WHEEL_CACHE"
if ! ls "$WHEEL_CACHE"/sglang-"$PIN"-*.whl >/dev/null 2>&1; then
  log "downloading sglang==$PIN"
  "$VENV/bin/python" -m pip download -q --disable-pip-version-check --no-deps -d "$WHEEL_CACHE" "sglang==$PIN"
fi
installed=$("$VENV/bin/python" -c "import importlib.metadata as m; print(m.version('sglang'))" 2>/dev/null || true)
if [ "$installed" != "$PIN" ]; then
  log "installing sglang==$PIN --no-deps"
  "${PIP[@]}" --no-deps --force-reinstall "$WHEEL_CACHE"/sglang-"$PIN"-*.whl
fi

# 4. This project, editable, with the test extra.
log "installing prfaas-sglang (editable, [test])"
"${PIP[@]}" -e '.[test]'

# 5. The patch series (patches/series) onto the installed SGLang; idempotent. A
#    patch that does not apply stops here, naming the patch and hunk.
log "applying the patch series"
"$VENV/bin/python" -m prfaas_sglang.patches apply
log "done: $VENV"
