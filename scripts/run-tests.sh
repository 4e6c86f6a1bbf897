#!/usr/bin/env bash
# The suite's phases, then its own report (scripts/test_report.py): `make test` runs every phase,
# `make test-sglang SGLANG=<v>` the release leg of <v> alone.
#
#   scripts/run-tests.sh all            the pinned release's suite and every other supported release's leg
#   scripts/run-tests.sh leg VERSION    the tests marked sglang (tests/conftest.py: the release-dependent
#                                       ones, prfaas_sglang/_compat/release_tests.py) on VERSION's overlay
#
# Each phase runs on parallel workers (pytest-xdist), a group of tests per worker at a time (a file, or the
# files that share one deployment: tests/conftest.py), the groups longest first. `all` runs three at once: the
# pinned release's parallel phase, the other releases' legs and the tests marked `serial` (what other tests' load
# would skew). The first two run at a lower priority (nice 10, PHASE_NICE): the serial tests take the cores
# when they want them and the others fill the rest, so their wants no longer add up after the others' in wall
# time (runs 52-53: 5.3 min of serial phases at 0.6 of a core). Each picks its ports from its own third of the
# range. Every phase runs even after one fails; the exit status is the first failure's. PYTEST_ARGS (a path, -k
# ...) narrows every phase; a phase that selects no test (pytest's status 5) is not a failure.
set -uo pipefail
cd "$(dirname "$0")/.."

# Every process the suite starts (a thousand or so) imports this package, and every pytest process its test
# modules, whose assertions pytest rewrites: with PYTHONDONTWRITEBYTECODE set (as on this project's machines)
# each compiled them from source again. Unset, the first writes the bytecode and the others read it: one emulated
# deployment's test file took 56.4 CPU-s, then 50.5; one collection of the suite 21.2 CPU-s, then 13.0 (2026-11-30).
unset PYTHONDONTWRITEBYTECODE
VENV=${VENV:-.venv}
PY=$VENV/bin/python
JOBS=${PYTEST_JOBS:-4}
LEG_JOBS=${PYTEST_LEG_JOBS:-2}
REPORT_DIR=${TEST_REPORT_DIR:-$VENV/test-report}
read -r -a EXTRA <<< "${PYTEST_ARGS:-}"

# A parallel phase runs its workers and their servers beside the other phase's on two cores, where torch's
# intra-op threads (one per core in every process, by default) only wait at each other's barriers: a CPU
# SGLang server decoding 256 tokens took 1.2 CPU-s with two and 0.7 with one, in the same time, on an idle
# machine (2026-11-30). The serial tests, which now run beside both, are single-threaded too.
# Each release builds SGLang's native block hash (a torch extension the tests compare ours with) into a
# directory of its own: in one directory each release's build replaced the other's, on every run.
phase() {  # phase NAME PYTHONPATH-OVERLAY PORT-RANGE PYTEST-ARGS... (PHASE_THREADS: OMP_NUM_THREADS; PHASE_NICE: nice)
  local name=$1 overlay=$2 ports=$3 start rc
  shift 3
  echo "== $name"
  start=$(date +%s.%N)
  nice -n "${PHASE_NICE:-0}" env ${overlay:+PYTHONPATH=$overlay${PYTHONPATH:+:$PYTHONPATH}} ${ports:+PRFAAS_PORT_RANGE=$ports} \
    ${PHASE_THREADS:+OMP_NUM_THREADS=$PHASE_THREADS} \
    TORCH_EXTENSIONS_DIR="$VENV/torch-extensions/$(basename "${overlay:-pinned}")" PRFAAS_TEST_REPORT="$REPORT_DIR/$name.jsonl" \
    "$PY" -m pytest -q "$@" "${EXTRA[@]}"
  rc=$?
  [ "$rc" -eq 5 ] && rc=0
  echo "$name $start $(date +%s.%N) $rc" >> "$REPORT_DIR/phases"
}

parallel() { echo -n "-n $1 --dist loadgroup --no-loadscope-reorder"; }

# A leg's serial tests run beside its others: they are serial for the pinned phase's timing tests (none of
# which differ by release), and share one real-SGLang deployment in one worker (xdist group sglang-cpu).
leg() {  # leg VERSION PORT-RANGE JOBS: the tests that differ by release, on VERSION's overlay (make env builds it)
  local version=$1 overlay=$VENV/sglang-$1
  if [ ! -f "$overlay/.complete" ]; then
    echo "no overlay for sglang $version at $overlay (make env)" >&2
    echo "sglang-$version 0 0 2" >> "$REPORT_DIR/phases"
    return
  fi
  # Only the leg's files are collected (each worker collects what it is given: the whole suite took 15 CPU-s
  # a worker), unless PYTEST_ARGS names paths of its own.
  local files=()
  [ "${#EXTRA[@]}" -eq 0 ] && mapfile -t files < <("$PY" -m prfaas_sglang._compat.release_tests | cut -d: -f1 | sort -u)
  # shellcheck disable=SC2046
  phase "sglang-$version" "$overlay" "$2" $(parallel "$3") -m "sglang and not gpu" -rs "${files[@]}"
}

# The tests marked serial, at the parallel phases' side and at a higher priority than theirs: the real-SGLang
# deployment's group one test after another, and beside it the light timing tests (a few emulated engines each),
# two at a time (tests/conftest.py write_serial_plan: the pinned phase's collection writes the plan, which this
# waits for). Measured beside three spinning processes at nice 10 (2026-11-30): all seven passed, the group in
# 201 s (150 s alone), the timing tests in 172 s (165 s). Torch single-threaded, as beside the legs. Without the
# plan (the pinned phase ended without writing it), or with PYTEST_ARGS (which the plan's node ids would
# repeat), every serial test in one process.
serial() {  # serial PORT-RANGE PINNED-PID
  local plan=$REPORT_DIR/serial-plan alone=() beside=() alone_pid=
  if [ "${#EXTRA[@]}" -eq 0 ]; then
    while { [ ! -f "$plan/alone" ] || [ ! -f "$plan/beside" ]; } && kill -0 "$2" 2>/dev/null; do sleep 1; done
  fi
  if [ "${#EXTRA[@]}" -gt 0 ] || [ ! -f "$plan/alone" ] || [ ! -f "$plan/beside" ]; then
    phase pinned-serial "" "$1" -m serial
    return
  fi
  mapfile -t alone < "$plan/alone"
  mapfile -t beside < "$plan/beside"
  if [ "${#alone[@]}" -gt 0 ]; then
    phase pinned-serial "" "$1" -m serial "${alone[@]}" > "$REPORT_DIR/serial-alone.log" 2>&1 &
    alone_pid=$!
  fi
  # shellcheck disable=SC2046
  [ "${#beside[@]}" -gt 0 ] && phase pinned-serial-beside "" "$1" $(parallel 2) -m serial "${beside[@]}"
  if [ -n "$alone_pid" ]; then
    wait "$alone_pid"
    cat "$REPORT_DIR/serial-alone.log"
  fi
}

others() {  # every supported release but the pin, one after another
  local version
  for version in $(python3 prfaas_sglang/_pin.py --others); do leg "$version" "$1" "$LEG_JOBS"; done
}

rm -rf "$REPORT_DIR" && mkdir -p "$REPORT_DIR"
case "${1:-all}" in
  all)
    read -r low high < <("$PY" -c "from prfaas_sglang.demo.cluster import own_port_range; print(*own_port_range())")
    third=$(( (high - low) / 3 ))
    PHASE_NICE=10 PHASE_THREADS=1 others "$(( low + third ))-$(( low + 2 * third ))" > "$REPORT_DIR/legs.log" 2>&1 &
    legs=$!
    # shellcheck disable=SC2046
    PHASE_NICE=10 PHASE_THREADS=1 PRFAAS_TEST_SERIAL_PLAN="$REPORT_DIR/serial-plan" \
      phase pinned "" "$low-$(( low + third ))" $(parallel "$JOBS") -m "not serial" &
    pinned=$!
    PHASE_THREADS=1 serial "$(( low + 2 * third ))-$high" "$pinned" > "$REPORT_DIR/serial.log" 2>&1
    wait "$pinned"
    wait "$legs"
    cat "$REPORT_DIR/legs.log" "$REPORT_DIR/serial.log" ;;
  leg)
    leg "${2:?usage: scripts/run-tests.sh leg VERSION}" "" "$JOBS" ;;
  *)
    echo "usage: scripts/run-tests.sh [all | leg VERSION]" >&2; exit 2 ;;
esac
"$PY" scripts/test_report.py "$REPORT_DIR"
status=$(awk '$4 != 0 {print $4; exit}' "$REPORT_DIR/phases")
exit "${status:-0}"
