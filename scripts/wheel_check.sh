#!/usr/bin/env bash
# Builds the wheel (pip wheel ., sm_90a when nvcc is found), installs it into a scratch folder and checks, away from
# the source tree, that it imports, runs the CPU backend and refuses GPU work with a clear error when there is no GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v nvcc >/dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then export PATH=/usr/local/cuda/bin:$PATH; fi
export FP4MOE_CUDA_ARCHS="${FP4MOE_CUDA_ARCHS:-90a}"
export CMAKE_BUILD_PARALLEL_LEVEL="${FP4MOE_JOBS:-$(nproc)}"
rm -rf dist/wheel-check
python3 -m pip wheel -q --no-deps --no-build-isolation -w dist/wheel-check .
site="$(mktemp -d)"
python3 -m pip install -q --no-deps --target "$site" dist/wheel-check/fp4moe-*.whl
cd "$site"
PYTHONPATH="$site" FP4MOE_BUILD_DIR=/nonexistent python3 - <<'PY'
import json, pathlib, numpy as np, ml_dtypes
import fp4moe
print("wheel:", pathlib.Path(fp4moe.__file__).parent)
info = fp4moe.build_info()
print("build info:", {k: info[k] for k in ("version", "source_hash", "with_cuda", "cuda_archs")})
meta = json.loads((pathlib.Path(fp4moe.__file__).parent / "METADATA.json").read_text())
print("METADATA.json:", json.dumps(meta, sort_keys=True))
rng = np.random.default_rng(0)
E, H, I, T, K = 4, 64, 32, 3, 2
w = fp4moe.quantize_weights(rng.standard_normal((E, 2 * I, H)).astype(np.float32),
                            rng.standard_normal((E, H, I)).astype(np.float32), gate_up_order="gate_first")
weights = fp4moe.prepare_weights(**w, activation="Swiglu", gate_up_order="gate_first")
x = rng.standard_normal((T, H)).astype(ml_dtypes.bfloat16)
y = fp4moe.moe(x, weights, routing_logits=rng.standard_normal((T, E)).astype(np.float32), top_k=K,
               routing_method="Renormalize", activation="Swiglu")
assert y.shape == (T, H) and np.isfinite(y.astype(np.float32)).all()
print("CPU backend: ok, y[0,:4] =", y[0, :4].astype(np.float32))
try:
    fp4moe.prepare_weights(**w, activation="Swiglu", gate_up_order="gate_first", device="cuda")
    print("GPU: a device was usable")
except Exception as e:  # no GPU here: the error must say so clearly
    print("GPU call without a GPU raised:", type(e).__name__, "-", e)
    assert isinstance(e, fp4moe.Fp4MoeError), type(e)
print("wheel check: ok")
PY
