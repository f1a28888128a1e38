#!/usr/bin/env bash
# Session 8 run 7: LoRA rows with tile 1 (the 32-row mma.sync tile) against tile 3 (wgmma) where the plan now takes
# tile 3; final-8 showed LoRA slower there than in final-7 on kimi, qwen3 T=1024 and qwen3_tp4.
set -u
R=$1; mkdir -p $R
B="bench --lora-only --quick --shapes kimi_k3_tp8,qwen3_30b_a3b,qwen3_30b_a3b_tp4,gpt_oss_120b,deepseek_v3_ep8 --tokens 1024,4096,16384"
for t in 1 3; do timeout 80 build-dev/fp4moe $B --tile $t --json $R/lora-tile-$t.json > $R/lora-tile-$t.log 2>&1; echo "tile $t rc $?"; done
python3 bench/compare_variants.py $R/lora-tile-3.json $R/lora-tile-1.json
