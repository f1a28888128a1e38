#!/usr/bin/env bash
# One short call on the H200 with binaries built on the developer machine (same nvcc 13.0, sm_90a) and carried:
# GPU tests (FILTER), fp4moe demo, fp4moe check (CUDA), fp4moe bench --quick, and, when time is left, the Python
# extension built there plus the torch / HF / package GPU tests. Every step has a time cap; logs land in $OUT.
#   BIN      folder with fp4moe and fp4moe_gpu_tests (default build-dev)
#   BUDGET   seconds for the whole script (default 230)
set -u
OUT=${OUT:-$PWD/final-run-out}
mkdir -p "$OUT"
BIN=${BIN:-build-dev}
BUDGET=${BUDGET:-230}
FILTER=${FILTER:-*}
t0=$(date +%s)
S="$OUT/summary.log"
say() { echo "$*" | tee -a "$S"; }
left() { echo $(( BUDGET - ($(date +%s) - t0) )); }
# step NAME CAP CMD...: runs CMD with min(CAP, time left) seconds, output to $OUT/NAME.log.
step() {
  local name=$1 cap=$2; shift 2
  local l; l=$(left); [ "$l" -lt "$cap" ] && cap=$l
  if [ "$cap" -le 5 ]; then say "== $name: skipped (no time left)"; return; fi
  local s=$(date +%s)
  timeout -s KILL "$cap" "$@" > "$OUT/$name.log" 2>&1
  say "== $name: rc=$? in $(( $(date +%s) - s )) s (cap $cap s)"
}
{
  echo "# date: $(date -u +%FT%TZ)"
  echo "# revision: $(cat .device-rev 2>/dev/null || echo unknown)"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader 2>&1
} >> "$S"
export PATH=/usr/local/cuda/bin:$PATH

# The Python extension builds in the background on the machine's cores (its Python is not this machine's).
( cmake -S . -B build-py-dev -DCMAKE_BUILD_TYPE=Release -DFP4MOE_BUILD_PYTHON=ON -DFP4MOE_BUILD_TESTS=OFF \
    -DFP4MOE_BUILD_TOOLS=OFF > "$OUT/py-build.log" 2>&1 && nice cmake --build build-py-dev -j12 --target _C >> "$OUT/py-build.log" 2>&1
  echo "rc=$?" >> "$OUT/py-build.log" ) &
pybuild=$!

step gpu_tests 100 "$BIN/fp4moe_gpu_tests" --gtest_filter="$FILTER"
grep -E '^\[  (PASSED|FAILED|SKIPPED) |^\[==========\]|^\[  FAILED|^STAT' "$OUT/gpu_tests.log" | tee -a "$S"
if command -v compute-sanitizer > /dev/null; then
  step racecheck 30 compute-sanitizer --tool racecheck --error-exitcode 17 "$BIN/fp4moe_gpu_tests" \
    --gtest_filter='GpuDeviceErrors.*:GpuWorkspace.*'
  grep -E "ERROR SUMMARY|RACECHECK SUMMARY|hazard" "$OUT/racecheck.log" | tail -3 | tee -a "$S"
fi
step demo 30 "$BIN/fp4moe" demo
tail -6 "$OUT/demo.log" | tee -a "$S"
step check 50 "$BIN/fp4moe" check --backend cuda --shape qwen3_30b_a3b --tokens 32 --modes a16,a4 \
  --activations swiglu,situ --json "$OUT/check.json"
grep -E "passed|FAIL" "$OUT/check.log" | tail -8 | tee -a "$S"
step check_kimi 40 "$BIN/fp4moe" check --backend cuda --shape kimi_k3_tp8 --tokens 32 --modes a16,a4 \
  --activations situ --json "$OUT/check_kimi.json"
grep -E "passed|FAIL" "$OUT/check_kimi.log" | tail -8 | tee -a "$S"
step bench 45 "$BIN/fp4moe" bench --quick --shapes kimi_k3_tp8,qwen3_30b_a3b --json "$OUT/bench.json"
tail -25 "$OUT/bench.log" | tee -a "$S"
wait $pybuild
tail -1 "$OUT/py-build.log" | sed 's/^/== python build /' | tee -a "$S"
export FP4MOE_BUILD_DIR=$PWD/build-py-dev PYTHONUNBUFFERED=1
step pytest_gpu 60 python3 -m pytest -q -rs -p no:cacheprovider tests/python/test_package_cuda.py \
  tests/python/test_torch_op.py tests/python/test_hf_dropin.py
tail -15 "$OUT/pytest_gpu.log" | tee -a "$S"
say "== total $(( $(date +%s) - t0 )) s"
