#!/usr/bin/env bash
# Where a call's time goes (kind nvidia-h200): ncu's full section set, with per-SASS-line stall samples, for the
# kernels of one eager call of SHAPE (default kimi_k3_tp8; no LoRA) at each T in TOKENS. Runs beside an unpacked
# `git archive` with the binaries carried in BIN. Writes ncu_<shape>_T<T>.txt (details page: stall reasons,
# instruction-cache stalls among them) and src_<shape>_T<T>.csv (source page of the kernels matching SRC_KERNELS:
# SASS with stall reasons) under $LOGS. BENCH_FLAGS: more `fp4moe bench` flags (e.g. --tile 3); COUNT: kernels profiled (8).
set -u
TOKENS=${TOKENS:-1 64}
SHAPE=${SHAPE:-kimi_k3_tp8}
KERNELS=${KERNELS:-regex:routing|permute|count_kernel|scan_kernel|place_kernel|gemm_kernel|combine_kernel}
SRC_KERNELS=${SRC_KERNELS:-regex:gemm_kernel}
BENCH_FLAGS=${BENCH_FLAGS:-}
BUDGET=${BUDGET:-400}
. "$(dirname "$0")/lib.sh"
export PATH=/usr/local/cuda/bin:$PATH
header "$SHAPE"
for T in $TOKENS; do
  tag=${SHAPE}_T$T
  step ncu_run_$tag 120 ncu --set full --import-source yes --launch-count ${COUNT:-8} -k "$KERNELS" -o "/tmp/prof_$tag" -f \
    "$BIN/fp4moe" bench --shapes "$SHAPE" --tokens "$T" --no-lora --runs 1 --max-runs 1 --min-time 0 $BENCH_FLAGS
  tail -3 "$LOGS/ncu_run_$tag.log" >> "$S"
  ncu --import "/tmp/prof_$tag.ncu-rep" --page details --print-details all > "$LOGS/ncu_$tag.txt" 2>&1
  ncu --import "/tmp/prof_$tag.ncu-rep" -k "$SRC_KERNELS" --page source --csv --print-source sass \
    > "$LOGS/src_$tag.csv" 2>&1
  say "== $tag: $(grep -c 'Duration' "$LOGS/ncu_$tag.txt") kernels, $(wc -l < "$LOGS/src_$tag.csv") source lines"
  rm -f "$LOGS/ncu_run_$tag.log"
done
say "== total $(( $(date +%s) - t0 )) s"
