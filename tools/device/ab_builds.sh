#!/usr/bin/env bash
# Builds side by side on one GPU (the A/B of a change; the base run twice gives the spread): TESTS of the GPU suite on
# each build but the first (the base) that holds them, then `fp4moe bench` of every build shape by shape (the builds
# interleaved, so that drift hits them alike) and the ratios of each to the first (bench/compare_variants.py), one
# table a shape in $LOGS/ratios.md. The defaults are the decode path's.
#   usage: tools/device/ab_builds.sh OUTDIR BUILD_DIR...   (each BUILD_DIR holds fp4moe, most also fp4moe_gpu_tests)
#   SHAPES (default: the six SPEC shapes), BENCH_FLAGS (default --no-lora --tokens 1,2,8,64,128),
#   TESTS (gtest filter, default batch invariance, models, determinism; empty: no tests), BUDGET (seconds, 540)
set -u
LOGS=${1:?usage: ab_builds.sh OUTDIR BUILD_DIR...}; shift
[ $# -ge 1 ] || { echo "usage: ab_builds.sh OUTDIR BUILD_DIR..." >&2; exit 2; }
. "$(dirname "$0")/lib.sh" "$LOGS"
header ab_builds "$@"
SHAPES=${SHAPES:-kimi_k3_tp8,qwen3_30b_a3b,qwen3_30b_a3b_tp4,deepseek_v3_ep8,mixtral_8x7b,gpt_oss_120b}
FLAGS=${BENCH_FLAGS:---no-lora --tokens 1,2,8,64,128}
TESTS=${TESTS-GpuBatchInvariance.*:GpuModels.*:GpuDeterminism.*}
builds=("$@")
name() { basename "$1"; }
for b in "${builds[@]:1}"; do  # the base build's tests ran where it was measured
  [ -n "$TESTS" ] && [ -x "$b/fp4moe_gpu_tests" ] || continue
  step "tests-$(name "$b")" 180 "$b/fp4moe_gpu_tests" --gtest_filter="$TESTS"
  grep -E "PASSED|FAILED" "$LOGS/tests-$(name "$b").log" | tail -3 >> "$S"
done
for s in ${SHAPES//,/ }; do
  files=()
  for b in "${builds[@]}"; do
    f="$LOGS/$(name "$b")-$s.json"
    step "bench-$(name "$b")-$s" 90 "$b/fp4moe" bench --shapes "$s" $FLAGS --json "$f"
    [ -s "$f" ] && files+=("$f")  # a failed output check still times (rc in the summary)
  done
  [ ${#files[@]} -ge 2 ] && python3 "$(dirname "$0")/../../bench/compare_variants.py" "${files[@]}" >> "$LOGS/ratios.md"
done
[ -f "$LOGS/ratios.md" ] && cat "$LOGS/ratios.md" >> "$S"
say "== total $(( $(date +%s) - t0 )) s"
