#!/usr/bin/env bash
# Another supported SGLang beside the environment's pinned one, as an overlay directory:
#   scripts/sglang-overlay.sh 0.5.23 [VENV]   -> prints the directory; PYTHONPATH=<it> runs on that release
# sglang==VERSION and requirements/sglang-VERSION.txt (what it imports beyond the base environment) are
# installed --no-deps into $VENV/sglang-VERSION (idempotent). The base environment (make env) keeps its
# pin; `make test SGLANG=VERSION` and `make rebase-check` put the overlay first on the path.
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=${1:?usage: scripts/sglang-overlay.sh VERSION [VENV]}
VENV=${2:-${VENV:-.venv}}
OVERLAY=$VENV/sglang-$VERSION
PY=$VENV/bin/python
if [ ! -f "$OVERLAY/.complete" ]; then
  rm -rf "$OVERLAY"
  printf '[sglang-overlay] installing sglang==%s into %s\n' "$VERSION" "$OVERLAY" >&2
  reqs=()
  [ -f "requirements/sglang-$VERSION.txt" ] && reqs=(-r "requirements/sglang-$VERSION.txt")
  # uv where make env put it (scripts/setup-env.sh), in one pass; pip otherwise
  if [ -x "$VENV/bin/uv" ]; then
    "$VENV/bin/uv" pip install --quiet --python "$PY" --compile-bytecode --no-deps --target "$OVERLAY" "sglang==$VERSION" "${reqs[@]}"
  else
    "$PY" -m pip install -q --disable-pip-version-check --no-deps --target "$OVERLAY" "sglang==$VERSION" "${reqs[@]}"
  fi
  touch "$OVERLAY/.complete"
fi
seen=$(PYTHONPATH="$OVERLAY" "$PY" -c "import importlib.metadata as m; print(m.version('sglang'))")
if [ "$seen" != "$VERSION" ]; then echo "the overlay imports sglang $seen, not $VERSION" >&2; exit 2; fi
echo "$OVERLAY"
