#!/usr/bin/env bash
# Reliability checks on a CUDA host (SPEC §6): the GPU suite, the soak driver, compute-sanitizer (memcheck,
# racecheck, synccheck, initcheck) over every GPU test, and the long profile of the Python API fuzzer.
#   usage: tools/device/reliability_run.sh OUTDIR
#   BIN     folder holding fp4moe_gpu_tests and fp4moe_soak (default build; built here when absent)
#   STEPS   any of: tests soak sanitize fuzz (default all four)
#   BUDGET  seconds for the whole script (default 560)
#   TESTS_CAP (seconds for the plain GPU suite, default 300), SOAK_FLAGS,
#   SAN_TOOLS (default: memcheck racecheck synccheck initcheck), SAN_SHARDS (processes a tool, default 4),
#   SAN_CAP (seconds a process, default 420), SAN_BARRIERS (synccheck's --num-cuda-barriers: per block, default 16),
#   FUZZ_EXAMPLES (examples a fuzz property, default 2000)
# Every step's log is in OUTDIR; the lines that matter are copied into OUTDIR/0-summary.log.
set -u
LOGS=${1:?usage: reliability_run.sh OUTDIR}
mkdir -p "$LOGS"
BUDGET=${BUDGET:-560}
BIN=${BIN:-build}
STEPS=${STEPS:-tests soak sanitize fuzz}
SAN_SHARDS=${SAN_SHARDS:-4}
SAN_CAP=${SAN_CAP:-420}
SAN_TOOLS=${SAN_TOOLS:-memcheck racecheck synccheck initcheck}
SAN_BARRIERS=${SAN_BARRIERS:-16}
. "$(dirname "$0")/lib.sh"
header reliability_run
export PATH=/usr/local/cuda/bin:$PATH
has() { case " $STEPS " in *" $1 "*) return 0 ;; esac; return 1; }

if [ ! -x "$BIN/fp4moe_gpu_tests" ]; then
  step build 300 bash -c "cmake -S . -B '$BIN' -DCMAKE_BUILD_TYPE=Release >/dev/null && cmake --build '$BIN' -j16 \
    --target fp4moe_gpu_tests fp4moe_soak"
fi
# The Python extension for this host's Python, in the background (the fuzz step needs it).
if has fuzz; then
  ( cmake -S . -B build-py -DCMAKE_BUILD_TYPE=Release -DFP4MOE_BUILD_PYTHON=ON -DFP4MOE_BUILD_TESTS=OFF \
      -DFP4MOE_BUILD_TOOLS=OFF > "$LOGS/py-build.log" 2>&1 && nice cmake --build build-py -j8 --target _C >> "$LOGS/py-build.log" 2>&1
    echo "rc=$?" >> "$LOGS/py-build.log" ) &
  pybuild=$!
fi

if has tests; then
  step gpu_tests "${TESTS_CAP:-300}" "$BIN/fp4moe_gpu_tests"
  grep -E '^\[  (PASSED|FAILED|SKIPPED) |^\[==========\]|^GpuFaults' "$LOGS/gpu_tests.log" | tee -a "$S"
fi

if has soak; then
  step soak 330 "$BIN/fp4moe_soak" --backend cuda --calls 100000 --seconds 290 --json "$LOGS/soak.json" ${SOAK_FLAGS:-}
  tail -25 "$LOGS/soak.log" | tee -a "$S"
fi

if has sanitize; then
  # Every GPU test under each tool, the suite split into shards that share the GPU; the test that fills the
  # device's memory runs alone afterwards, since it would starve the others.
  # The tests' light mode (gpu_harness.h) keeps every test but few repeats of one kind of case.
  alone=GpuFaults.DeviceMemoryExhausted
  export FP4MOE_TEST_WATCHDOG_SCALE=20 FP4MOE_TEST_LIGHT=1
  ntools=$(echo $SAN_TOOLS | wc -w)
  cap=$(( $(left) - 70 * ntools - 20 )); [ "$cap" -gt "$SAN_CAP" ] && cap=$SAN_CAP
  say "== sanitizers: $SAN_TOOLS, $SAN_SHARDS shards each, $cap s a process"
  pids=()
  for tool in $SAN_TOOLS; do
    flags=""
    [ "$tool" = synccheck ] && flags="--num-cuda-barriers $SAN_BARRIERS"
    for ((i = 0; i < SAN_SHARDS; i++)); do
      ( GTEST_TOTAL_SHARDS=$SAN_SHARDS GTEST_SHARD_INDEX=$i timeout -s KILL "$cap" \
          compute-sanitizer --tool "$tool" $flags --print-limit 20 "$BIN/fp4moe_gpu_tests" --gtest_filter="-$alone" \
          > "$LOGS/san-$tool-$i.log" 2>&1; echo "rc=$?" >> "$LOGS/san-$tool-$i.log" ) &
      pids+=($!)
    done
  done
  wait "${pids[@]}"
  for tool in $SAN_TOOLS; do
    timeout -s KILL 60 compute-sanitizer --tool "$tool" "$BIN/fp4moe_gpu_tests" --gtest_filter="$alone" \
      > "$LOGS/san-$tool-alone.log" 2>&1; echo "rc=$?" >> "$LOGS/san-$tool-alone.log"
  done
  for f in "$LOGS"/san-*.log; do
    say "$(basename "$f" .log): $(grep -h 'ERROR SUMMARY' "$f" | tail -1) | $(grep -hE '^\[  (PASSED|FAILED) ' "$f" | tr '\n' ' ') $(tail -1 "$f")"
  done
  unset FP4MOE_TEST_WATCHDOG_SCALE FP4MOE_TEST_LIGHT
  # The sanitizer logs are many: one archive of them comes back.
  tar -cJf "$LOGS/sanitizer-logs.tar.xz" -C "$LOGS" $(cd "$LOGS" && ls san-*.log) && rm -f "$LOGS"/san-*.log
fi

if has fuzz; then
  wait "$pybuild"
  tail -1 "$LOGS/py-build.log" | sed 's/^/== python build /' | tee -a "$S"
  export FP4MOE_BUILD_DIR=$PWD/build-py PYTHONUNBUFFERED=1 FP4MOE_FUZZ_PROFILE=long \
    FP4MOE_FUZZ_EXAMPLES=${FUZZ_EXAMPLES:-2000} FP4MOE_FUZZ_REPORT="$LOGS/fuzz.json"
  step fuzz "$(left)" python3 -m pytest -q -p no:cacheprovider tests/python/test_fuzz_*.py
  tail -5 "$LOGS/fuzz.log" | tee -a "$S"
fi
say "== total $(( $(date +%s) - t0 )) s"
