#!/usr/bin/env bash
# The benchmark suite on the GPU machine, from the repository root: build the CLI (CUDA on), `fp4moe bench`,
# the torch._grouped_mm bf16 baseline (selftest first), the ratio table and the plots. Everything lands in $LOGS.
#   QUICK=1          tokens 1,64,1024 only (both tools)
#   BENCH_ARGS=...   extra arguments for `fp4moe bench` (e.g. "--shapes qwen3_30b_a3b --no-lora")
#   TORCH_ARGS=...   extra arguments for bench/torch_baseline.py
#   SKIP_TORCH=1     the fp4moe bench alone
set -u
LOGS=${1:-${LOGS:-$PWD/bench-out}}
mkdir -p "$LOGS"
BUILD=${BUILD:-build-bench-gpu}
t0=$(date +%s)
say() { echo "$*" | tee -a "$LOGS/summary.log"; }
: > "$LOGS/summary.log"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm,clocks.mem --format=csv > "$LOGS/env.log" 2>&1
cat "$LOGS/env.log" >> "$LOGS/summary.log"

# CMake < 3.26 does not know nvcc's C++20 flag: give it (harmless for newer CMake).
cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DFP4MOE_WITH_CUDA=ON -DFP4MOE_BUILD_TESTS=OFF \
  -DCMAKE_CUDA20_STANDARD_COMPILE_OPTION=-std=c++20 -DCMAKE_CUDA20_EXTENSION_COMPILE_OPTION=-std=c++20 \
  > "$LOGS/configure.log" 2>&1 || { say "CONFIGURE FAILED"; tail -30 "$LOGS/configure.log"; exit 1; }
cmake --build "$BUILD" -j16 --target fp4moe > "$LOGS/build.log" 2>&1 || { say "BUILD FAILED"; grep -E "error" "$LOGS/build.log" | head -30; exit 1; }
say "== build done after $(( $(date +%s) - t0 )) s"

BENCH="$BUILD/fp4moe"
if "$BENCH" bench --runs 0 2>&1 | grep -q "not available"; then
  # main.cpp does not dispatch `bench` yet: link a two-line driver against the same library.
  say "== note: 'fp4moe bench' not wired in main.cpp; using a driver linked against $BUILD/libfp4moe_core.a"
  CUDA_HOME=${CUDA_HOME:-$(dirname "$(dirname "$(command -v nvcc)")")}
  printf '#include "bench.h"\nint main(int c, char** v) { return fp4moe::run_bench(c - 2, v + 2); }\n' > "$LOGS/bench_driver.cpp"
  g++ -std=c++20 -O2 -I include -I src -I tools/fp4moe -I "$CUDA_HOME/include" -DFP4MOE_WITH_CUDA=1 -DFP4MOE_BENCH_HAVE_CUBLAS=1 \
    tools/fp4moe/bench*.cpp "$LOGS/bench_driver.cpp" "$(find "$BUILD" -name libfp4moe_core.a | head -1)" \
    -L"$CUDA_HOME/lib64" -lcudart_static -lcublas -lpthread -ldl -lrt -o "$BUILD/fp4moe_bench_driver" \
    >> "$LOGS/build.log" 2>&1 || { say "DRIVER BUILD FAILED"; tail -20 "$LOGS/build.log"; exit 1; }
  BENCH="$BUILD/fp4moe_bench_driver"
fi

Q=""
[ "${QUICK:-0}" = 1 ] && Q="--quick"
timeout -s KILL 240 "$BENCH" bench $Q --json "$LOGS/fp4moe.json" ${BENCH_ARGS:-} > "$LOGS/fp4moe_bench.log" 2>&1
say "== fp4moe bench rc=$? after $(( $(date +%s) - t0 )) s"
sed -n '/^| shape/,$p' "$LOGS/fp4moe_bench.log" | tee -a "$LOGS/summary.log"
grep -E "^ceilings|error|unsupported" "$LOGS/fp4moe_bench.log" | head -8 | tee -a "$LOGS/summary.log"

if [ "${SKIP_TORCH:-0}" != 1 ]; then
  timeout -s KILL 90 python3 bench/torch_baseline.py --selftest > "$LOGS/torch_selftest.log" 2>&1
  say "== torch selftest rc=$?: $(tail -1 "$LOGS/torch_selftest.log")"
  FP=""
  [ -s "$LOGS/fp4moe.json" ] && FP="--fp4moe $LOGS/fp4moe.json --ratio $LOGS/ratio.md"
  timeout -s KILL 200 python3 bench/torch_baseline.py $Q --json "$LOGS/torch.json" $FP ${TORCH_ARGS:-} \
    > "$LOGS/torch_baseline.log" 2>&1
  say "== torch baseline rc=$? after $(( $(date +%s) - t0 )) s"
  grep -E "^ceilings|error" "$LOGS/torch_baseline.log" | head -8 | tee -a "$LOGS/summary.log"
  [ -s "$LOGS/ratio.md" ] && tee -a "$LOGS/summary.log" < "$LOGS/ratio.md"
fi

if [ -s "$LOGS/fp4moe.json" ]; then
  TB=""
  [ -s "$LOGS/torch.json" ] && TB="--torch $LOGS/torch.json"
  python3 bench/plot.py "$LOGS/fp4moe.json" $TB --out "$LOGS/plots" > "$LOGS/plot.log" 2>&1
  say "== plots rc=$?: $(ls "$LOGS/plots" 2>/dev/null | tr '\n' ' ')"
fi
say "== total $(( $(date +%s) - t0 )) s"
