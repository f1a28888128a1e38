#!/usr/bin/env bash
# One-shot check of the CUDA backend on the GPU machine (run from the repository root):
# configure + build (CUDA on, tests on), the GPU test suite, the CPU plan sweep, SASS check for HMMA,
# and compute-sanitizer memcheck on a reduced filter. Logs go to $LOGS (default ./gpu-check-out).
# GoogleTest is not installed there: copy /usr/src/googletest to .deps/googletest before the run; where nlohmann/json
# is not installed either, copy /usr/include/nlohmann to .deps/nlohmann_json/include/nlohmann (CMakeLists.txt looks there).
#   FILTER        gtest filter for the GPU suite (default: all)
#   TEST_TIMEOUT  seconds for the GPU suite (default 300)
#   MEMCHECK_FILTER, MEMCHECK_TIMEOUT  (defaults: a few small tests, 60 s); MEMCHECK=0 skips it
set -u
LOGS=${1:-${LOGS:-$PWD/gpu-check-out}}
mkdir -p "$LOGS"
BUILD=${BUILD:-build-gpu}
FILTER=${FILTER:-*}
TEST_TIMEOUT=${TEST_TIMEOUT:-300}
MEMCHECK=${MEMCHECK:-1}
MEMCHECK_FILTER=${MEMCHECK_FILTER:-GpuDeviceErrors.*:GpuWorkspace.*:GpuSharedExpert.*}
MEMCHECK_TIMEOUT=${MEMCHECK_TIMEOUT:-60}
summary="$LOGS/summary.log"
: > "$summary"
say() { echo "$*" | tee -a "$summary"; }
t_start=$(date +%s)

{
  echo "== date: $(date -u +%FT%TZ)"
  echo "== host: $(hostname)"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>&1
  nvcc --version 2>&1 | tail -2
  cmake --version 2>&1 | head -1
  nproc
} > "$LOGS/env.log" 2>&1
cat "$LOGS/env.log" >> "$summary"

# CMake < 3.26 does not know nvcc's C++20 flag: give it (harmless for newer CMake).
cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DFP4MOE_WITH_CUDA=ON -DFP4MOE_BUILD_TESTS=ON \
  -DCMAKE_CUDA20_STANDARD_COMPILE_OPTION=-std=c++20 -DCMAKE_CUDA20_EXTENSION_COMPILE_OPTION=-std=c++20 \
  > "$LOGS/configure.log" 2>&1 || { say "CONFIGURE FAILED"; tail -30 "$LOGS/configure.log" | tee -a "$summary"; exit 1; }
if ! cmake --build "$BUILD" -j16 --target fp4moe_gpu_tests fp4moe_tests > "$LOGS/build.log" 2>&1; then
  say "BUILD FAILED"
  grep -E "error|Error" "$LOGS/build.log" | head -40 | tee -a "$summary"
  # The GPU suite alone may still build when another area's CPU test is broken.
  cmake --build "$BUILD" -j16 --target fp4moe_gpu_tests >> "$LOGS/build.log" 2>&1 || exit 1
fi
say "== build done after $(( $(date +%s) - t_start )) s"

# SASS: the GEMMs must run on tensor cores (HMMA); spills are reported by ptxas in the build log.
lib=$(find "$BUILD" -name 'libfp4moe_core.a' | head -1)
if command -v cuobjdump > /dev/null; then
  cuobjdump --dump-sass "$lib" > "$LOGS/sass.txt" 2>&1
  say "== SASS: $(grep -c HMMA "$LOGS/sass.txt") HMMA instructions, $(grep -c 'Function :' "$LOGS/sass.txt") functions; \
$(grep -c 'Function : .*grouped_gemm' "$LOGS/sass.txt") grouped GEMM kernels"
  grep -E "HMMA" "$LOGS/sass.txt" | sed 's/^ *//' | awk '{$1=""; print}' | sort | uniq -c | sort -rn | head -5 | tee -a "$summary"
fi
grep -i "spill" "$LOGS/build.log" | grep -v " 0 bytes spill" | head -5 | tee -a "$summary"

# CPU plan sweep.
if [ -x "$BUILD/fp4moe_tests" ]; then
  timeout 120 "$BUILD/fp4moe_tests" --gtest_filter='Plan.*' > "$LOGS/plan_tests.log" 2>&1
  say "== plan tests rc=$?: $(grep -E '^\[  (PASSED|FAILED)' "$LOGS/plan_tests.log" | tr '\n' ' ')"
fi

# GPU suite.
timeout -s KILL "$TEST_TIMEOUT" "$BUILD/fp4moe_gpu_tests" --gtest_filter="$FILTER" > "$LOGS/gpu_tests.log" 2>&1
rc=$?
say "== gpu tests rc=$rc after $(( $(date +%s) - t_start )) s"
grep -E '^\[  (PASSED|FAILED|SKIPPED) |^\[==========\]|tests? FAILED|^\[  FAILED' "$LOGS/gpu_tests.log" | tee -a "$summary"
grep -E '^\[       OK \]' "$LOGS/gpu_tests.log" | tee -a "$summary"
grep -E 'Failure|error:|WATCHDOG|Expected|Which is|actual' "$LOGS/gpu_tests.log" | head -40 | tee -a "$summary"
grep -E '^STAT (worst|perf|random)' "$LOGS/gpu_tests.log" | tee -a "$summary"

# compute-sanitizer memcheck on a reduced filter.
if [ "$MEMCHECK" = 1 ] && command -v compute-sanitizer > /dev/null; then
  timeout -s KILL "$MEMCHECK_TIMEOUT" compute-sanitizer --tool memcheck --error-exitcode 17 \
    "$BUILD/fp4moe_gpu_tests" --gtest_filter="$MEMCHECK_FILTER" > "$LOGS/memcheck.log" 2>&1
  say "== memcheck rc=$? ($(grep -E 'ERROR SUMMARY' "$LOGS/memcheck.log" | tail -1))"
fi
say "== total $(( $(date +%s) - t_start )) s"
