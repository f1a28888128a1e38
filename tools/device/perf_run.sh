#!/usr/bin/env bash
# A check of a kernel change on the H200, with binaries built on the developer machine and carried (BIN):
# the GPU tests (FILTER), then `fp4moe bench --quick` on kimi_k3_tp8 and qwen3_30b_a3b. (The full suite with
# the torch baseline and plots is tools/device/final_bench_run.sh.) Kept in $LOGS: 0-summary.log (the
# important lines), gpu_tests.log, fp4moe.json, fp4moe_bench.log.
set -u
BUDGET=${BUDGET:-540}
. "$(dirname "$0")/lib.sh"
header

step gpu_tests 260 "$BIN/fp4moe_gpu_tests" --gtest_filter="$FILTER"
grep -E '^\[  (PASSED|FAILED|SKIPPED) |^\[==========\]|^\[  FAILED|^STAT (perf|lora concurrent)' "$LOGS/gpu_tests.log" | tee -a "$S"
step fp4moe_bench 90 "$BIN/fp4moe" bench --quick --shapes kimi_k3_tp8,qwen3_30b_a3b --json "$LOGS/fp4moe.json"
sed -n '/^| shape/,$p' "$LOGS/fp4moe_bench.log" >> "$S"
say "== total $(( $(date +%s) - t0 )) s"
