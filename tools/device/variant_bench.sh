#!/usr/bin/env bash
# SiTU vs SwiGLU and A4 vs A16 (issue #5's last target) on one GPU: `fp4moe bench --no-lora` on kimi_k3_tp8 and
# qwen3_30b_a3b at T = 1, 64, 1024, 4096 for each variant, in the order swiglu, situ, a4, swiglu again (the
# repeat shows run-to-run spread), each writing its JSON to $LOGS/variant-<name>.json and its table to
# $LOGS/variants.log. Then bench/compare_variants.py prints the ratios to the first swiglu run.
set -u
BUDGET=${BUDGET:-200}
. "$(dirname "$0")/lib.sh"
header variant_bench
B="$BIN/fp4moe bench --no-lora --shapes kimi_k3_tp8,qwen3_30b_a3b --tokens 1,64,1024,4096"
for v in "swiglu:--activation swiglu" "situ:--activation situ" "a4:--mode a4" "swiglu2:--activation swiglu"; do
  name=${v%%:*}; flags=${v#*:}
  step "variant-$name" 60 $B $flags --json "$LOGS/variant-$name.json"
  sed -n '/^| shape/,$p' "$LOGS/variant-$name.log" >> "$LOGS/variants.log"
  rm -f "$LOGS/variant-$name.log"
done
python3 bench/compare_variants.py "$LOGS"/variant-swiglu.json "$LOGS"/variant-situ.json "$LOGS"/variant-a4.json \
  "$LOGS"/variant-swiglu2.json | tee -a "$S"
