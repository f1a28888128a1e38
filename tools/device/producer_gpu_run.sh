#!/usr/bin/env bash
# The producer-made test files (tests/data/producers) on a GPU host with PyTorch and transformers but no network
# (run from the repository root): tools/producer_gpu_check.py installs the carried wheels (fp4moe built with the
# CUDA backend, nvidia-modelopt and whichever of its runtime requirements the host lacks) into $SITE, then
#   swap        fp4moe.hf.swap_moe_blocks(model, checkpoint=...) on the GPU with the ModelOpt Qwen3-MoE file: the
#               whole model's logits against transformers on the same decoded weights, ModelOpt's fake-quantized
#               model and the unquantized model
#   blocks      fp4moe.moe (CUDA, A4 and A16) of every producer file against the producer's output and the CPU backend
#   references  ModelOpt's CUDA fake quantization re-makes each ModelOpt case: the committed CPU-made output and
#               checkpoint tensors against the GPU-made ones
# and writes results.json and summary.md beside the logs in $LOGS (the first argument; seven files in all). Exits 1
# when a step failed.
#   WHEELS   folder of the carried wheels (default .whl-gpuhost)
#   BUDGET   seconds for the whole script (default 235)
set -u
BUDGET=${BUDGET:-235}
. "$(dirname "$0")/lib.sh"
header "producer files"
WHEELS=${WHEELS:-.whl-gpuhost}
SITE=${SITE:-/tmp/producer-site}
WORK=${WORK:-/tmp/producer-gpu-check}
rm -rf "$SITE" "$WORK"
mkdir -p "$SITE" "$WORK"
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false \
  TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/producer-triton}
check="python3 tools/producer_gpu_check.py --work $WORK"
say "# wheels: $(ls "$WHEELS" 2>/dev/null | tr '\n' ' ')"
failed=""
run() { step "$@" || failed="$failed $1"; grep -E '^-- |Error|error' "$LOGS/$1.log" 2>/dev/null | tail -8 >> "$S"; }

run setup 90 bash -c "$check install --wheels '$WHEELS' --target '$SITE' && $check environment"
run swap 90 $check swap
run blocks 60 $check blocks
run references 120 $check references
timeout 30 $check summary --out "$LOGS" >> "$S" 2>&1 || failed="$failed summary"
[ -f "$LOGS/summary.md" ] && cat "$LOGS/summary.md"
say "== failed:${failed:- none}; total $(( $(date +%s) - t0 )) s"
[ -z "$failed" ]
