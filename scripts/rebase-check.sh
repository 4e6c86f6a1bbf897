#!/usr/bin/env bash
# Upstream-rebase check, the same locally (`make rebase-check`) and in the
# scheduled workflow (.github/workflows/upstream-rebase.yml):
#   1. the patch series onto the new release's wheel (per-patch table);
#   2. tests/drift (hook targets and signatures) against the new release,
#      installed --no-deps into an overlay (scripts/sglang-overlay.sh) so .venv keeps the pin.
# Usage: scripts/rebase-check.sh [VERSION|latest]   (needs `make env` first)
# Writes out/rebase/{series.md,drift.txt}; exits non-zero if either check fails.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
REQUESTED=${1:-latest}
OUT=out/rebase
mkdir -p "$OUT"

"$PY" -m prfaas_sglang.patches rebase-check --sglang-version "$REQUESTED" | tee "$OUT/series.md"
series_rc=${PIPESTATUS[0]}
version=$(grep -oP 'onto sglang \K\S+' "$OUT/series.md" | head -1)
if [ -z "$version" ]; then echo "rebase-check did not run" >&2; exit 2; fi

overlay=$(VENV="$(dirname "$(dirname "$PY")")" bash scripts/sglang-overlay.sh "$version") || exit 2
PYTHONPATH="$overlay" PRFAAS_ALLOW_SGLANG_VERSION="$version" "$PY" -m pytest -q -p no:cacheprovider tests/drift 2>&1 | tail -40 | tee "$OUT/drift.txt"
drift_rc=${PIPESTATUS[0]}

echo "sglang $version: patch series rc=$series_rc, hook drift rc=$drift_rc"
[ "$series_rc" = 0 ] && [ "$drift_rc" = 0 ]
