#!/usr/bin/env bash
# One H200 call for performance work, with binaries built on the developer machine and carried (BIN):
#   MODE=check  the GPU tests (FILTER), then `fp4moe bench --quick` on kimi_k3_tp8 and qwen3_30b_a3b
#   MODE=full   `fp4moe bench` on every shape of SPEC §1 and T = 1 .. 16384 with and without LoRA, the
#               torch._grouped_mm bf16 baseline in the same call (ratio table), and the plots (one tar)
# At most 8 files come back from a call, so only these are kept in $OUT: 0-summary.log (the important
# lines), gpu_tests.log, fp4moe.json, fp4moe_bench.log, torch.json, ratio.md, torch_baseline.log, plots.tar.
set -u
OUT=${OUT:-$PWD/perf-run-out}
mkdir -p "$OUT"
BIN=${BIN:-build-dev}
MODE=${MODE:-check}
FILTER=${FILTER:-*}
BUDGET=${BUDGET:-540}
t0=$(date +%s)
S="$OUT/0-summary.log"
. "$(dirname "$0")/lib.sh"
{
  echo "# date: $(date -u +%FT%TZ)  mode: $MODE"
  echo "# revision: $(cat .device-rev 2>/dev/null || echo unknown)"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader 2>&1
} >> "$S"

if [ "$MODE" = check ]; then
  step gpu_tests 260 "$BIN/fp4moe_gpu_tests" --gtest_filter="$FILTER"
  grep -E '^\[  (PASSED|FAILED|SKIPPED) |^\[==========\]|^\[  FAILED|^STAT (perf|lora concurrent)' "$OUT/gpu_tests.log" | tee -a "$S"
  step fp4moe_bench 90 "$BIN/fp4moe" bench --quick --shapes kimi_k3_tp8,qwen3_30b_a3b --json "$OUT/fp4moe.json"
  sed -n '/^| shape/,$p' "$OUT/fp4moe_bench.log" >> "$S"
else
  step fp4moe_bench 280 "$BIN/fp4moe" bench --json "$OUT/fp4moe.json"
  sed -n '/^| shape/,$p' "$OUT/fp4moe_bench.log" >> "$S"
  grep -E "^ceilings" "$OUT/fp4moe_bench.log" | head -3 >> "$S"
  FP=""
  [ -s "$OUT/fp4moe.json" ] && FP="--fp4moe $OUT/fp4moe.json --ratio $OUT/ratio.md"
  step torch_baseline 220 python3 bench/torch_baseline.py --json "$OUT/torch.json" $FP
  grep -E "^ceilings|error" "$OUT/torch_baseline.log" | head -5 >> "$S"
  [ -s "$OUT/ratio.md" ] && cat "$OUT/ratio.md" >> "$S"
  if [ -s "$OUT/fp4moe.json" ]; then
    TB=""
    [ -s "$OUT/torch.json" ] && TB="--torch $OUT/torch.json"
    python3 bench/plot.py "$OUT/fp4moe.json" $TB --out "$OUT/plots" > "$OUT/plot.log" 2>&1
    say "== plots rc=$?: $(ls "$OUT/plots" 2>/dev/null | tr '\n' ' ')"
    (cd "$OUT" && tar -cf plots.tar plots && rm -rf plots)
  fi
fi
say "== total $(( $(date +%s) - t0 )) s"
# Keep at most the 8 files named above.
find "$OUT" -maxdepth 1 -type f ! -name '0-summary.log' ! -name gpu_tests.log ! -name fp4moe.json \
  ! -name fp4moe_bench.log ! -name torch.json ! -name ratio.md ! -name torch_baseline.log ! -name plots.tar -delete
