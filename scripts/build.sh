#!/usr/bin/env bash
# Configures and builds fp4moe into ./build (CUDA backend for sm_90a when nvcc is found).
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v nvcc >/dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then export PATH=/usr/local/cuda/bin:$PATH; fi
jobs=${FP4MOE_JOBS:-$(nproc)}
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release ${FP4MOE_CMAKE_ARGS:-} >/dev/null
cmake --build build -j"$jobs"
