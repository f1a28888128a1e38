#!/usr/bin/env bash
# The GEMM tiles side by side on one GPU: `fp4moe bench $BENCH_FLAGS` (default --no-lora) with every tile forced (--tile, MoeArgs::gemm_tile)
# on SHAPES at TOKENS, then bench/compare_variants.py: each tile's time against tile 2 (the 64-row mma.sync tile),
# the plan's choice (default) among them. JSON per tile in $LOGS/tile-<n>.json, the ratios in 0-summary.log.
set -u
BUDGET=${BUDGET:-200}
SHAPES=${SHAPES:-kimi_k3_tp8,qwen3_30b_a3b,mixtral_8x7b,deepseek_v3_ep8}
TOKENS=${TOKENS:-256,1024,4096,16384}
TILES=${TILES:-2 1 3 plan}
BENCH_FLAGS=${BENCH_FLAGS:---no-lora}
. "$(dirname "$0")/lib.sh"
header tile_bench "$SHAPES" "$TOKENS"
files=()
for t in $TILES; do
  flag=(--tile "$t"); [ "$t" = plan ] && flag=()
  step "tile-$t" 150 "$BIN/fp4moe" bench $BENCH_FLAGS --quick --shapes "$SHAPES" --tokens "$TOKENS" "${flag[@]}" \
    --json "$LOGS/tile-$t.json"
  [ -s "$LOGS/tile-$t.json" ] && files+=("$LOGS/tile-$t.json")
done
[ ${#files[@]} -ge 2 ] && python3 bench/compare_variants.py "${files[@]}" | tee -a "$S"
say "== total $(( $(date +%s) - t0 )) s"
