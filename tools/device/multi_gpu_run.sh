#!/usr/bin/env bash
# Two-GPU check and benchmark of tensor / expert parallelism over NCCL (issue 7), for one call on a 2xH200
# machine (run from the repository root). Every step has a hard time cap; the whole script stays under BUDGET.
#   1. fp4moe_parallel_check (C++, forks one process per GPU): TP=2 / EP=2 vs the single-GPU operator and the
#      CPU reference with eight rank-16 LoRA adapters (kimi_k3 full I=3072, qwen3_30b_a3b), bit-identity across
#      ranks and runs, ReduceScatter, failure agreement (no hang), timing (CUDA events, median of 20) at T=1,64,1024.
#      Uses $BIN/fp4moe_parallel_check when carried (default build-dev), else builds it (cmake -j16).
#   2. The Python path: the extension built here (background, cmake -j16), then tests/python/test_distributed.py
#      (python -m fp4moe.launch --nproc 2, TP=2 / EP=2 vs single GPU through fp4moe.distributed).
# Output in $LOGS (at most 8 files): summary.log (everything that matters), parallel_check.json, and the logs.
#   BIN     folder with a carried fp4moe_parallel_check (default build-dev)
#   BUDGET  seconds for the whole script after the start (default 480)
#   CHECK_ARGS  extra arguments of fp4moe_parallel_check (e.g. "--kimi-experts 128")
set -u
LOGS=${1:-${LOGS:-$PWD/multi-gpu-out}}
mkdir -p "$LOGS"
BIN=${BIN:-build-dev}
BUDGET=${BUDGET:-480}
CHECK_ARGS=${CHECK_ARGS:-}
t0=$(date +%s)
S="$LOGS/summary.log"
: > "$S"
. "$(dirname "$0")/lib.sh"
export PATH=/usr/local/cuda/bin:$PATH
# NVLink SHARP (multicast) must stay off: the GPUs' host is shared.
export NCCL_NVLS_ENABLE=0
export PYTHONUNBUFFERED=1
header
{
  nvidia-smi topo -m 2>&1 | head -4
  python3 -c "import torch; print('torch', torch.__version__, 'nccl', torch.cuda.nccl.version(), 'gpus', torch.cuda.device_count())" 2>&1 | tail -1
  echo "NCCL_NVLS_ENABLE=$NCCL_NVLS_ENABLE"
} >> "$S" 2>&1

export_nccl_library
say "FP4MOE_NCCL_LIBRARY=${FP4MOE_NCCL_LIBRARY:-(unset: loader path)}"

# The Python extension, built in the background on this machine (its Python is not the developer machine's).
( cmake -S . -B build-py-mgpu -DCMAKE_BUILD_TYPE=Release -DFP4MOE_BUILD_PYTHON=ON -DFP4MOE_BUILD_TESTS=OFF \
    -DFP4MOE_BUILD_TOOLS=OFF -DCMAKE_CUDA20_STANDARD_COMPILE_OPTION=-std=c++20 \
    -DCMAKE_CUDA20_EXTENSION_COMPILE_OPTION=-std=c++20 > "$LOGS/py_build.log" 2>&1 &&
  timeout -s KILL 330 nice cmake --build build-py-mgpu -j16 --target _C >> "$LOGS/py_build.log" 2>&1
  echo "rc=$?" >> "$LOGS/py_build.log" ) &
pybuild=$!

CHECK="$BIN/fp4moe_parallel_check"
if ! [ -x "$CHECK" ] || ! "$CHECK" --help > /dev/null 2>&1; then
  say "== $CHECK not carried (or does not run): building it"
  step build_check 330 bash -c "cmake -S . -B build-mgpu -DCMAKE_BUILD_TYPE=Release -DFP4MOE_BUILD_TESTS=OFF \
    -DCMAKE_CUDA20_STANDARD_COMPILE_OPTION=-std=c++20 -DCMAKE_CUDA20_EXTENSION_COMPILE_OPTION=-std=c++20 && \
    cmake --build build-mgpu -j16 --target fp4moe_parallel_check"
  tail -5 "$LOGS/build_check.log" | tee -a "$S"
  CHECK=build-mgpu/fp4moe_parallel_check
fi

if [ -x "$CHECK" ]; then
  step parallel_check 240 "$CHECK" --world 2 --timeout 220 --json "$LOGS/parallel_check.json" $CHECK_ARGS
  grep -E "^(PASS|FAIL|==|timing|kimi_k3 |qwen3_30b_a3b |fp4moe_parallel_check|ALL|SOME)|error|rank .* exited|killing" \
    "$LOGS/parallel_check.log" | tee -a "$S"
fi

wait $pybuild
say "== python build $(tail -1 "$LOGS/py_build.log")"
grep -E "error" "$LOGS/py_build.log" | head -5 | tee -a "$S"
if [ -e build-py-mgpu/python/fp4moe/METADATA.json ] || ls build-py-mgpu/python/fp4moe/_C*.so > /dev/null 2>&1; then
  export FP4MOE_BUILD_DIR=$PWD/build-py-mgpu
  step pytest_distributed 150 python3 -m pytest -q -rs -p no:cacheprovider tests/python/test_distributed.py
  tail -12 "$LOGS/pytest_distributed.log" | tee -a "$S"
fi
say "== total $(( $(date +%s) - t0 )) s"
