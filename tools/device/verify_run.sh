#!/usr/bin/env bash
# One H200 call that verifies a committed revision: GPU tests, `fp4moe check` (CUDA) at qwen3_30b_a3b and
# kimi_k3_tp8, the GPU demo, `fp4moe bench --quick` (with and without LoRA), the Python extension built there
# with its torch.compile / CUDA-graph / HF+PEFT tests, the example's logit comparison, the package load time,
# and (in the background, on the machine's spare cores) the multi-architecture wheel with its METADATA.json.
# Run from a source tree (e.g. `git archive HEAD` unpacked); binaries built on the developer machine are
# carried in BIN (same nvcc 13.0; the device's glibc is newer). Every step has a time cap; logs go to $LOGS and
# only a few files come back, so the important lines are copied into $LOGS/summary.log.
#   BIN      folder with fp4moe and fp4moe_gpu_tests (default build-dev)
#   BUDGET   seconds for the whole script (default 520)
#   FILTER   gtest filter for the GPU tests (default *)
set -u
BUDGET=${BUDGET:-520}
. "$(dirname "$0")/lib.sh"
header
export PATH=/usr/local/cuda/bin:$PATH

# Background 1: the Python extension (for this machine's Python).
( cmake -S . -B build-py -DCMAKE_BUILD_TYPE=Release -DFP4MOE_BUILD_PYTHON=ON -DFP4MOE_BUILD_TESTS=OFF \
    -DFP4MOE_BUILD_TOOLS=OFF > "$LOGS/py-build.log" 2>&1 && nice cmake --build build-py -j6 --target _C >> "$LOGS/py-build.log" 2>&1
  echo "rc=$?" >> "$LOGS/py-build.log" ) &
pybuild=$!
# Background 2: the prebuilt wheel of SPEC §7 for every architecture (sm_90a fast path; the others compile-checked).
( export FP4MOE_CUDA_ARCHS="90a;80;89;100a;103a;120a" CMAKE_BUILD_PARALLEL_LEVEL=6 CUDAFLAGS="--threads 3"
  s=$(date +%s)
  nice timeout -s KILL 480 python3 -m pip wheel -v --no-deps --no-build-isolation -w dist/multiarch . > "$LOGS/wheel-build.log" 2>&1
  echo "rc=$? in $(( $(date +%s) - s )) s" >> "$LOGS/wheel-build.log"
  whl=$(ls dist/multiarch/fp4moe-*.whl 2>/dev/null | head -1)
  if [ -n "$whl" ]; then
    python3 -m zipfile -l "$whl" > "$LOGS/wheel-files.log" 2>&1
    so=$(mktemp -d); python3 -m zipfile -e "$whl" "$so"
    cp "$so/fp4moe/METADATA.json" "$LOGS/METADATA.json" 2>/dev/null
    cuobjdump --list-elf "$so"/fp4moe/_C*.so >> "$LOGS/wheel-files.log" 2>&1
  fi ) &
wheelbuild=$!

step gpu_tests 230 "$BIN/fp4moe_gpu_tests" --gtest_filter="$FILTER"
grep -E '^\[  (PASSED|FAILED|SKIPPED) |^\[==========\]|^\[  FAILED|^STAT (lora resident|lora concurrent|perf)' "$LOGS/gpu_tests.log" | tee -a "$S"
step demo 45 "$BIN/fp4moe" demo
tail -8 "$LOGS/demo.log" | tee -a "$S"
step check 70 "$BIN/fp4moe" check --backend cuda --shape qwen3_30b_a3b --tokens 32 --modes a16,a4 \
  --activations swiglu,situ --json "$LOGS/check.json"
grep -E "passed|FAIL" "$LOGS/check.log" | tail -6 | tee -a "$S"
step check_kimi 150 "$BIN/fp4moe" check --backend cuda --shape kimi_k3_tp8 --tokens 32 --modes a16,a4 \
  --activations swiglu,situ --json "$LOGS/check_kimi.json"
grep -E "passed|FAIL" "$LOGS/check_kimi.log" | tail -6 | tee -a "$S"
step bench 60 "$BIN/fp4moe" bench --quick --shapes kimi_k3_tp8,qwen3_30b_a3b --json "$LOGS/bench.json"
tail -30 "$LOGS/bench.log" >> "$S"
wait $pybuild
tail -1 "$LOGS/py-build.log" | sed 's/^/== python build /' | tee -a "$S"
export FP4MOE_BUILD_DIR=$PWD/build-py PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/python
for i in 1 2 3; do
  python3 -c "import time; t=time.perf_counter(); import fp4moe; fp4moe.build_info(); import torch; \
print('load (import + extension + checks + build_info): %.3f s' % (time.perf_counter()-t-0))" 2>&1 | tail -1 | tee -a "$S"
done
python3 -c "import time, torch; torch.zeros(1, device='cuda'); t=time.perf_counter(); import fp4moe; fp4moe.build_info(); \
print('load with CUDA already initialised: %.3f s' % (time.perf_counter()-t)); print(fp4moe.build_info())" 2>&1 | tail -2 | tee -a "$S"
step pytest_gpu 170 python3 -m pytest -v -rs -p no:cacheprovider tests/python/test_package_cuda.py \
  tests/python/test_torch_op.py tests/python/test_hf_dropin.py tests/python/test_flashinfer_compat.py
grep -E "PASSED|FAILED|SKIPPED|ERROR|passed|failed" "$LOGS/pytest_gpu.log" | tail -60 >> "$S"
step example 60 python3 examples/qwen3_moe_lora.py --device cuda
tail -8 "$LOGS/example.log" | tee -a "$S"
wait $wheelbuild
tail -1 "$LOGS/wheel-build.log" | sed 's/^/== multi-arch wheel /' | tee -a "$S"
grep -E "^ELF|sm_" "$LOGS/wheel-files.log" | sort | uniq -c | head -20 >> "$S"
cat "$LOGS/METADATA.json" >> "$S" 2>/dev/null
say "== total $(( $(date +%s) - t0 )) s"
