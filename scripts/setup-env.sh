#!/usr/bin/env bash
# Create the CPU development/test environment from nothing.
#
#   scripts/setup-env.sh            -> .venv with everything `make test` needs
#   VENV=/path PYTHON=python3.11 scripts/setup-env.sh
#
# Idempotent: re-running only installs what changed. Needs root (or sudo) for
# apt-get the first time; needs only the package registries (PyPI, Debian).
# Python packages go in with uv (one resolver pass for the requirements and this
# project), from the indexes and wheel directories pip is configured with on this
# machine (torch's CUDA build lies on its disk; uv does not read pip's settings).
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}
WHEEL_CACHE=${PRFAAS_WHEEL_CACHE:-.cache/wheels}
PIN=$("$PYTHON" prfaas_sglang/_pin.py)
UV_VERSION=0.13.9

log() { printf '[setup-env] %s\n' "$*"; }

# 1. Debian's packages, in one update and one install:
#    libibverbs1  Mooncake's engine.so links libibverbs.so.1, even when it only uses TCP;
#    libssl-dev   SGLang builds its block-hash extension (torch cpp_extension, -lcrypto) on first use,
#                 and the tests compare our hash with it;
#    gcc          the launcher builds the bind shim (prfaas_sglang/native/bindshim.c), SGLang's extension too;
#    prometheus   Debian's 2.42: `bench dashboard` and the dashboard's end-to-end test start their own (a
#                 free port, a temp config and storage dir); nothing depends on its system service;
#    wireguard-tools  encrypted links (links[].encrypt; adapters/wireguard.py): `wg` configures the kernel's
#                 WireGuard or wireguard-go, the userspace one where the kernel has no module (step 1b);
#    nftables     the tunnel's netfilter lock: a peer's packets that routing would send outside the tunnel
#                 are dropped and counted, never sent in clear;
#    chromium     the documentation's test opens the built site headless and keeps a screenshot.
missing=()
/sbin/ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1' || missing+=(libibverbs1)
dpkg -s libssl-dev >/dev/null 2>&1 || missing+=(libssl-dev)
command -v cc >/dev/null 2>&1 || missing+=(gcc libc6-dev)
command -v prometheus >/dev/null 2>&1 || missing+=(prometheus)
command -v wg >/dev/null 2>&1 || missing+=(wireguard-tools)
command -v nft >/dev/null 2>&1 || missing+=(nftables)
command -v chromium >/dev/null 2>&1 || missing+=(chromium)
# Steps 1 and 1b run commands as root: directly, or through sudo where there is one.
can_root() { [ "$(id -u)" = 0 ] || command -v sudo >/dev/null; }
as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }
if [ "${#missing[@]}" -gt 0 ]; then
  log "installing ${missing[*]} (apt)"
  can_root || { echo "error: ${missing[*]} missing and this user cannot apt-get install" >&2; exit 1; }
  as_root apt-get update -qq
  DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# 1b. wireguard-go from Debian trixie into /usr/local/bin (bookworm's misses the tunnel's throughput target;
#     scripts/install-wireguard-go.sh says why); nothing when one as recent is there.
if ! bash scripts/install-wireguard-go.sh --check /usr/local/bin; then
  if can_root; then
    as_root bash scripts/install-wireguard-go.sh /usr/local/bin
  else
    log "warning: no recent wireguard-go in /usr/local/bin; as root: scripts/install-wireguard-go.sh"
  fi
fi

# 2. The virtual environment, with uv in it.
if [ ! -x "$VENV/bin/python" ]; then
  log "creating $VENV"
  "$PYTHON" -m venv "$VENV"
fi
if [ "$("$VENV/bin/uv" --version 2>/dev/null | cut -d' ' -f2)" != "$UV_VERSION" ]; then
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check "uv==$UV_VERSION"
fi

# pip's indexes, wheel directories and constraints on this machine, for uv.
UV=("$VENV/bin/uv" pip install --quiet --python "$VENV/bin/python" --index-strategy unsafe-best-match --compile-bytecode)
pip_setting() { "$VENV/bin/python" -m pip config get "global.$1" 2>/dev/null || true; }
for url in ${PIP_EXTRA_INDEX_URL:-$(pip_setting extra-index-url)}; do UV+=(--extra-index-url "$url"); done
for dir in ${PIP_FIND_LINKS:-$(pip_setting find-links)}; do UV+=(--find-links "$dir"); done
for file in ${PIP_CONSTRAINT:-$(pip_setting constraint)}; do [ -f "$file" ] && UV+=(--constraint "$file"); done

# 3. The CPU test requirements and this project, editable, with the test and docs extras: one resolution.
log "installing requirements/cpu-test.txt and prfaas-sglang (editable, [test,docs])"
"${UV[@]}" -r requirements/cpu-test.txt -e '.[test,docs]'

# 4. The pinned SGLang, pristine, without its GPU dependency set. The wheel is
#    kept in the cache that `python -m prfaas_sglang.patches` also reads.
mkdir -p "$WHEEL_CACHE"
if ! ls "$WHEEL_CACHE"/sglang-"$PIN"-*.whl >/dev/null 2>&1; then
  log "downloading sglang==$PIN"
  "$VENV/bin/python" -m pip download -q --disable-pip-version-check --no-deps -d "$WHEEL_CACHE" "sglang==$PIN"
fi
installed=$("$VENV/bin/python" -c "import importlib.metadata as m; print(m.version('sglang'))" 2>/dev/null || true)
if [ "$installed" != "$PIN" ]; then
  log "installing sglang==$PIN --no-deps"
  "${UV[@]}" --no-deps --reinstall "$(ls "$WHEEL_CACHE"/sglang-"$PIN"-*.whl | head -1)"
fi

# 5. The patch series (patches/series) onto the installed SGLang; idempotent. A
#    patch that does not apply stops here, naming the patch and hunk.
log "applying the patch series"
"$VENV/bin/python" -m prfaas_sglang.patches apply
log "done: $VENV"
