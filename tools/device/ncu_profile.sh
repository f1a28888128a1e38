#!/usr/bin/env bash
# Where a call's time goes (kind nvidia-h200): ncu's full section set, with per-SASS-line stall samples, for the
# kernels of one eager call of kimi_k3_tp8 (no LoRA) at each T in TOKENS. Runs beside an unpacked `git archive`
# with the binaries carried in BIN. Writes ncu_T<T>.txt (details page) and src_T<T>.csv (source page of the
# GEMM kernels: SASS with stall reasons) under $OUT.
set -u
TOKENS=${TOKENS:-1 64}
KERNELS=${KERNELS:-regex:routing|count_kernel|scan_kernel|place_kernel|gemm_kernel|combine_kernel}
BUDGET=${BUDGET:-400}
. "$(dirname "$0")/lib.sh"
export PATH=/usr/local/cuda/bin:$PATH
header
for T in $TOKENS; do
  step ncu_run_T$T 120 ncu --set full --import-source yes --launch-count 8 -k "$KERNELS" -o "/tmp/prof_T$T" -f \
    "$BIN/fp4moe" bench --shapes kimi_k3_tp8 --tokens "$T" --no-lora --runs 1 --max-runs 1 --min-time 0
  tail -3 "$OUT/ncu_run_T$T.log" >> "$S"
  ncu --import "/tmp/prof_T$T.ncu-rep" --page details --print-details all > "$OUT/ncu_T$T.txt" 2>&1
  ncu --import "/tmp/prof_T$T.ncu-rep" -k regex:gemm_kernel --page source --csv --print-source sass \
    > "$OUT/src_T$T.csv" 2>&1
  say "== T=$T: $(grep -c 'Duration' "$OUT/ncu_T$T.txt") kernels, $(wc -l < "$OUT/src_T$T.csv") source lines"
  rm -f "$OUT/ncu_run_T$T.log"
done
say "== total $(( $(date +%s) - t0 )) s"
