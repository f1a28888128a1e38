#!/usr/bin/env bash
# Issue 8 on a 4- or 8-GPU machine (kinds nvidia-h200-x4 / nvidia-h200-x8), run from an unpacked `git archive`
# with a carried $BIN/fp4moe_parallel_check: the TP / EP check at the machine's world size, launched twice, and the
# two launches' output hashes compared (identical across two launches). Each launch's JSON also holds the
# timings of one GPU, TP and EP at T = 1, 64, 1024 (base and LoRA tokens).
#   4 GPUs: --world 4 --shapes qwen3_30b_a3b            TP=4: I = 768 over four ranks; EP=4: 32 experts a rank
#   8 GPUs: --world 8 --shapes kimi_k3,deepseek_v3_ep8 --kimi-experts 384
#                                                       TP=8: kimi I = 3072, 384 a rank; EP=8: deepseek_v3's 256
#                                                       experts, 32 a rank
# Output in $LOGS: 0-summary.log, check_1.log / check_2.log, parallel_check_1.json / parallel_check_2.json.
set -u
BUDGET=${BUDGET:-560}
. "$(dirname "$0")/lib.sh"
export PATH=/usr/local/cuda/bin:$PATH
export NCCL_NVLS_ENABLE=0  # NVLink SHARP (multicast) stays off: the GPUs' host is shared
header "multi_gpu_x48"
W=$(nvidia-smi -L | wc -l)
case $W in
  4) ARGS="--world 4 --shapes qwen3_30b_a3b" ;;
  8) ARGS="--world 8 --shapes kimi_k3,deepseek_v3_ep8 --kimi-experts 384" ;;
  *) say "== needs 4 or 8 GPUs, this machine has $W"; exit 2 ;;
esac
export_nccl_library
say "world $W: fp4moe_parallel_check $ARGS; FP4MOE_NCCL_LIBRARY=${FP4MOE_NCCL_LIBRARY:-(loader path)}"
cap=$(( (BUDGET - 20) / 2 ))
for i in 1 2; do
  step check_$i "$cap" "$BIN/fp4moe_parallel_check" $ARGS --timeout $(( cap - 10 )) --json "$LOGS/parallel_check_$i.json"
  grep -E "^(PASS|FAIL|ALL|SOME)|error|killing" "$LOGS/check_$i.log" | tee -a "$S"
done
python3 - "$LOGS/parallel_check_1.json" "$LOGS/parallel_check_2.json" << 'PY' 2>&1 | tee -a "$S"
import json, sys
try:
    a, b = (json.load(open(p)) for p in sys.argv[1:3])
except Exception as e:
    sys.exit(f"== launches not compared: {e}")
keys = sorted(k for k in a if k.endswith("_fnv1a"))
same = [k for k in keys if a[k] == b.get(k)]
for k in keys:
    print(f"{'SAME' if k in same else 'DIFF'} {k}: {a[k]} / {b.get(k)}")
print(f"== identical across two launches: {len(same)} of {len(keys)} outputs" + ("" if keys else " (no hashes)"))
PY
say "== total $(( $(date +%s) - t0 )) s"
