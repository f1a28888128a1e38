#!/usr/bin/env bash
# Per-kernel times of one eager call (kind nvidia-h200): ncu's gpu__time_duration and instruction count for
# every kernel of the first moe_run of `fp4moe bench` on SHAPE at each T in TOKENS, with BENCH_FLAGS (default
# --lora-only --lora-cases per_expert8: the eight per-expert adapters; --no-lora for the base case) and NCU_FLAGS (e.g. --clock-control none). Writes ncu_<T>.txt (one line per kernel) under $LOGS.
set -u
TOKENS=${TOKENS:-64 1024}
SHAPE=${SHAPE:-kimi_k3_tp8}
BENCH_FLAGS=${BENCH_FLAGS:---lora-only --lora-cases per_expert8}
COUNT=${COUNT:-14}
BUDGET=${BUDGET:-300}
. "$(dirname "$0")/lib.sh"
export PATH=/usr/local/cuda/bin:$PATH
header "$SHAPE $BENCH_FLAGS"
for T in $TOKENS; do
  step ncu_$T 120 ncu ${NCU_FLAGS:-} --print-kernel-base function --metrics gpu__time_duration.sum,smsp__inst_executed.sum \
    --launch-count "$COUNT" -k "regex:routing|permute|count_kernel|scan_kernel|place_kernel|gemm_kernel|combine_kernel|lora|order|quantize" \
    "$BIN/fp4moe" bench --shapes "$SHAPE" --tokens "$T" $BENCH_FLAGS --sets 1 --runs 1 --max-runs 1 --min-time 0
  say "-- T=$T"
  awk '/^  [a-z_]+.*\(/ {name=$1} /gpu__time_duration.sum/ {d=$(NF-1) " " $NF} /smsp__inst_executed.sum/ {printf "%-32s %14s %16s instr\n", name, d, $NF}' \
    "$LOGS/ncu_$T.log" | tee -a "$S"
done
say "== total $(( $(date +%s) - t0 )) s"
