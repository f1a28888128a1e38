#!/usr/bin/env bash
# One call on a 2xH200 machine (nvidia-h200-x2) that does three jobs in sequence, each in its own folder of
# $LOGS: perf/ — the single-GPU tests and `fp4moe bench --quick` (tools/device/perf_run.sh) on GPU 0;
# mgpu/ — the two-GPU TP/EP check and the Python distributed test (tools/device/multi_gpu_run.sh); pkg/ — with
# the Python extension that multi_gpu_run.sh built: the package load time, the torch op / HF tests, and the
# multi-architecture wheel (built in the background from the start) with its METADATA.json.
# At most 8 files come back from a call: the scripts' extra logs are removed at the end.
set -u
ROOT=$LOGS
mkdir -p "$ROOT/perf" "$ROOT/mgpu" "$ROOT/pkg"
export PATH=/usr/local/cuda/bin:$PATH
P="$ROOT/pkg/pkg.log"
t0=$(date +%s)

( export FP4MOE_CUDA_ARCHS="90a;80;89;100a;103a;120a" CMAKE_BUILD_PARALLEL_LEVEL=8 CUDAFLAGS="--threads 3"
  s=$(date +%s)
  nice timeout -s KILL 420 python3 -m pip wheel -q --no-deps --no-build-isolation -w dist/multiarch . > /tmp/wheel-build.log 2>&1
  echo "multi-arch wheel: rc=$? in $(( $(date +%s) - s )) s" > /tmp/wheel-status.log ) &
wheel=$!

LOGS="$ROOT/perf" BUDGET=${PERF_BUDGET:-190} bash tools/device/perf_run.sh > /dev/null 2>&1
CUDA_VISIBLE_DEVICES=0,1 LOGS="$ROOT/mgpu" BUDGET=${MGPU_BUDGET:-300} bash tools/device/multi_gpu_run.sh > /dev/null 2>&1

{
  echo "# package checks on $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), $(date -u +%FT%TZ)"
  export FP4MOE_BUILD_DIR=$PWD/build-py-mgpu PYTHONPATH=$PWD/python PYTHONUNBUFFERED=1
  for i in 1 2 3; do
    timeout 60 python3 -c "import time; t=time.perf_counter(); import fp4moe; fp4moe.build_info(); \
print('load (import fp4moe + extension + arch/source-hash checks + build_info), cold CUDA: %.3f s' % (time.perf_counter()-t))" 2>&1 | tail -1
  done
  timeout 60 python3 -c "import torch; torch.zeros(1, device='cuda'); import time; t=time.perf_counter(); import fp4moe; \
i=fp4moe.build_info(); print('load with torch and CUDA already initialised: %.3f s' % (time.perf_counter()-t)); \
print({k: i[k] for k in ('version', 'source_hash', 'cuda_archs', 'with_cuda')})" 2>&1 | tail -2
  timeout 150 python3 -m pytest -q -rs -p no:cacheprovider tests/python/test_package_cuda.py \
    "tests/python/test_hf_dropin.py::test_saved_peft_adapter_via_cpp_reader" tests/python/test_torch_op.py 2>&1 | tail -6
  wait $wheel
  cat /tmp/wheel-status.log 2>/dev/null
  tail -3 /tmp/wheel-build.log
  whl=$(ls dist/multiarch/fp4moe-*.whl 2>/dev/null | head -1)
  if [ -n "$whl" ]; then
    d=$(mktemp -d); python3 -m zipfile -e "$whl" "$d"
    echo "wheel: $(basename "$whl") $(du -h "$whl" | cut -f1)"
    echo "METADATA.json:"; cat "$d/fp4moe/METADATA.json"; echo
    echo "cuobjdump --list-elf:"; cuobjdump --list-elf "$d"/fp4moe/_C*.so 2>&1 | sed 's/.*\.\(sm_[0-9a-z]*\)\..*/\1/' | sort | uniq -c
  fi
  echo "== total $(( $(date +%s) - t0 )) s"
} > "$P" 2>&1
# Keep: perf/0-summary.log, perf/gpu_tests.log, perf/fp4moe.json, mgpu/summary.log, mgpu/parallel_check.log,
# mgpu/parallel_check.json, mgpu/pytest_distributed.log, pkg/pkg.log.
rm -f "$ROOT/perf/fp4moe_bench.log"
find "$ROOT/mgpu" -maxdepth 1 -type f ! -name summary.log ! -name parallel_check.log ! -name parallel_check.json \
  ! -name pytest_distributed.log -delete
