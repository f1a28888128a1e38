#!/usr/bin/env bash
# The reference run on a CUDA host with two GPUs (from a source tree with prebuilt binaries in BIN): the
# single-GPU tests (FILTER), per-kernel times of one call at T=1 and T=64 (ncu), the full
# `fp4moe bench` (every SPEC §1 shape, T = 1 .. 16384, with and without LoRA), the torch._grouped_mm bf16 baseline
# in the same call with the ratio table, the plots, SiTU vs SwiGLU and A4 vs A16 (variant_bench.sh: its table goes to
# the summary, its JSON with the plots into plots.tar), and — on the second GPU's machine — the Python distributed
# test (extension built in the background). The results are kept to a few files; the rest is removed.
set -u
BUDGET=${BUDGET:-540}
. "$(dirname "$0")/lib.sh"
export PATH=/usr/local/cuda/bin:$PATH NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
header

( cmake -S . -B build-py -DCMAKE_BUILD_TYPE=Release -DFP4MOE_BUILD_PYTHON=ON -DFP4MOE_BUILD_TESTS=OFF \
    -DFP4MOE_BUILD_TOOLS=OFF > /tmp/py-build.log 2>&1 && nice cmake --build build-py -j8 --target _C >> /tmp/py-build.log 2>&1
  echo "python build rc=$?" >> /tmp/py-build.log ) &
pybuild=$!

step gpu_tests 150 "$BIN/fp4moe_gpu_tests" --gtest_filter="$FILTER"
grep -E '^\[  (PASSED|FAILED|SKIPPED) |^\[==========\]|^\[  FAILED|^STAT perf' "$LOGS/gpu_tests.log" | tee -a "$S"

# Per-kernel GPU time and instructions of the first (eager) call at T=1 and T=64, kimi_k3_tp8, no LoRA.
if command -v ncu > /dev/null; then
  LOGS="$LOGS" S="$S" BIN="$BIN" t0="$t0" BUDGET="$BUDGET" TOKENS="1 64" BENCH_FLAGS=--no-lora COUNT=8 \
    bash "$(dirname "$0")/ncu_times.sh" > /dev/null
fi

step fp4moe_bench 230 "$BIN/fp4moe" bench --json "$LOGS/fp4moe.json"
sed -n '/^| shape/,$p' "$LOGS/fp4moe_bench.log" >> "$S"
grep -E "^ceilings|copy|gemm" "$LOGS/fp4moe_bench.log" | head -3 >> "$S"
FP=""
[ -s "$LOGS/fp4moe.json" ] && FP="--fp4moe $LOGS/fp4moe.json --ratio $LOGS/ratio.md"
step torch_baseline 170 python3 bench/torch_baseline.py --json "$LOGS/torch.json" $FP
grep -E "^ceilings|error|Error" "$LOGS/torch_baseline.log" | head -5 >> "$S"
[ -s "$LOGS/ratio.md" ] && cat "$LOGS/ratio.md" >> "$S"
if [ -s "$LOGS/fp4moe.json" ]; then
  TB=""
  [ -s "$LOGS/torch.json" ] && TB="--torch $LOGS/torch.json"
  python3 bench/plot.py "$LOGS/fp4moe.json" $TB --out "$LOGS/plots" > "$LOGS/plot.log" 2>&1
  say "== plots rc=$?: $(ls "$LOGS/plots" 2>/dev/null | tr '\n' ' ')"
fi
LOGS="$LOGS/variants" S="$S" BIN="$BIN" t0="$t0" BUDGET="$BUDGET" bash "$(dirname "$0")/variant_bench.sh" > /dev/null
(cd "$LOGS" && tar -cf plots.tar $(ls -d plots variants 2>/dev/null) && rm -rf plots variants)

wait $pybuild
tail -1 /tmp/py-build.log | tee -a "$S"
if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
  export_nccl_library
  FP4MOE_BUILD_DIR=$PWD/build-py step pytest_distributed 60 python3 -m pytest -q -rs -p no:cacheprovider \
    tests/python/test_distributed.py
  tail -4 "$LOGS/pytest_distributed.log" | tee -a "$S"
fi
say "== total $(( $(date +%s) - t0 )) s"
find "$LOGS" -maxdepth 1 -type f ! -name '0-summary.log' ! -name gpu_tests.log ! -name fp4moe.json \
  ! -name fp4moe_bench.log ! -name torch.json ! -name ratio.md ! -name torch_baseline.log ! -name plots.tar -delete
