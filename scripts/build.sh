#!/usr/bin/env bash
# Configures and builds fp4moe into ./build (CUDA backend for sm_90a when nvcc is found).
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v nvcc >/dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then export PATH=/usr/local/cuda/bin:$PATH; fi
jobs=${FP4MOE_JOBS:-$(nproc)}
py=""
# The Python extension (fp4moe._C) is built beside the C++ targets when nanobind is importable.
if python3 -c "import nanobind" 2>/dev/null; then py="-DFP4MOE_BUILD_PYTHON=ON"; fi
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release $py ${FP4MOE_CMAKE_ARGS:-} >/dev/null
cmake --build build -j"$jobs"
