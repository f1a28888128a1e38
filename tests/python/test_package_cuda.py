"""The Python package on the CUDA backend (PyTorch tensors): the load-time arch check on a real GPU,
METADATA.json's cubins, and the operator against the package's own CPU reference. Skips, saying why,
without a CUDA build, a GPU or PyTorch."""
from __future__ import annotations


import numpy as np
import pytest

from fp4moe_under_test import import_fp4moe  # noqa: E402
ml_dtypes = pytest.importorskip("ml_dtypes", reason="ml_dtypes is needed for NumPy bfloat16")


def _import():
    fp4moe = import_fp4moe()
    if not fp4moe.build_info()["with_cuda"]:
        pytest.skip("fp4moe was built without the CUDA backend", allow_module_level=True)
    if fp4moe.build_info()["cuda_devices"] == 0:
        pytest.skip("no CUDA device visible", allow_module_level=True)
    return fp4moe


fp4moe = _import()
torch = pytest.importorskip("torch", reason="the CUDA tests make device tensors with PyTorch")
if not torch.cuda.is_available():
    pytest.skip("PyTorch sees no CUDA device", allow_module_level=True)

BF16 = np.dtype(ml_dtypes.bfloat16)
E, H, I, T, K = 8, 64, 32, 33, 2


def _np_to_torch(a, device="cuda"):
    if a.dtype == BF16:  # exact: the values are bf16 already
        return torch.from_numpy(a.astype(np.float32)).to(torch.bfloat16).to(device)
    return torch.from_numpy(np.ascontiguousarray(a)).to(device)


def _close(y_gpu, y_cpu, what):
    a = y_gpu.float().cpu().numpy().astype(np.float64)
    b = np.asarray(y_cpu).astype(np.float64)
    scale = max(np.abs(b).max(), 1e-3)
    err = np.abs(a - b)
    assert np.all(err <= 1e-2 * scale + 1.6e-2 * np.abs(b)), f"{what}: max err {err.max():.4g} (scale {scale:.4g})"
    assert np.abs(b).max() > 1e-2


@pytest.fixture(scope="module")
def layer():
    rng = np.random.default_rng(2024)
    w1 = (rng.standard_normal((E, 2 * I, H)) / np.sqrt(H)).astype(np.float32)
    w2 = (rng.standard_normal((E, H, I)) / np.sqrt(I)).astype(np.float32)
    q = fp4moe.quantize_weights(w1, w2, gate_up_order="gate_first")
    x = rng.standard_normal((T, H)).astype(np.float32).astype(BF16)
    logits = rng.standard_normal((T, E)).astype(np.float32)
    return q, x, logits


def test_arch_check_and_metadata():
    from fp4moe import _loader
    arch = _loader.ensure_arch(0)
    cc = tuple(fp4moe._C.device_compute_capability(0))
    assert fp4moe._checks.arch_runs_on(arch, cc)
    meta = fp4moe.build_info()["metadata"]
    assert meta is not None
    if isinstance(meta["cubins"], dict):
        assert meta["cubins"].get(arch, 0) > 0, meta["cubins"]


def test_describe_cuda_tensor():
    t = torch.zeros((3, 4), dtype=torch.bfloat16, device="cuda")[:, 1:]
    d = fp4moe._C._describe(t)
    assert d["device"] == "cuda" and d["dtype_name"] == "bfloat16" and d["strides"] == (4, 1)
    f8 = torch.zeros((2, 16), dtype=torch.float8_e4m3fn, device="cuda")
    assert fp4moe._C._describe(fp4moe._tensors.as_arg(f8, "s"))["dtype_name"] == "float8_e4m3fn"


@pytest.mark.parametrize("src", ["numpy", "torch_cuda", "torch_f8"])
def test_moe_cuda_matches_cpu(layer, src):
    q, x, logits = layer
    w_cpu = fp4moe.prepare_weights(**q, gate_up_order="gate_first", activation="swiglu")
    if src == "numpy":  # host tensors, prepared onto the GPU
        w_gpu = fp4moe.prepare_weights(**q, gate_up_order="gate_first", activation="swiglu", device="cuda")
    else:
        tq = {k: _np_to_torch(v.view(np.uint8) if v.dtype.itemsize == 1 else v) for k, v in q.items()}
        if src == "torch_f8":
            tq["w1_scale"] = tq["w1_scale"].view(torch.float8_e4m3fn)
            tq["w2_scale"] = tq["w2_scale"].view(torch.float8_e4m3fn)
        w_gpu = fp4moe.prepare_weights(**tq, gate_up_order="gate_first", activation="swiglu")
    assert w_gpu.device == "cuda:0"
    kw = dict(top_k=K, routing_method="Renormalize")
    y_cpu = fp4moe.moe(x, w_cpu, routing_logits=logits, **kw)
    xg, lg = _np_to_torch(x), _np_to_torch(logits)
    y_gpu = fp4moe.moe(xg, w_gpu, routing_logits=lg, **kw)
    torch.cuda.synchronize()
    assert isinstance(y_gpu, torch.Tensor) and y_gpu.is_cuda and y_gpu.dtype == torch.bfloat16
    _close(y_gpu, y_cpu, src)
    # Deterministic across calls and streams (SPEC §4).
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        y2 = fp4moe.moe(xg, w_gpu, routing_logits=lg, **kw)
    s.synchronize()
    assert torch.equal(y_gpu.view(torch.int16), y2.view(torch.int16))


def test_moe_cuda_lora_matches_cpu(layer):
    q, x, logits = layer
    rng = np.random.default_rng(5)
    r = 8
    lora = {"a_gate_up": (rng.standard_normal((E, r, H)) / np.sqrt(H)).astype(np.float32).astype(BF16),
            "b_gate_up": (rng.standard_normal((E, 2 * I, r)) * 0.3).astype(np.float32).astype(BF16),
            "a_down": (rng.standard_normal((E, r, I)) / np.sqrt(I)).astype(np.float32).astype(BF16),
            "b_down": (rng.standard_normal((E, H, r)) * 0.3).astype(np.float32).astype(BF16)}
    aid = (np.arange(T) % 3 - 1).astype(np.int32)  # -1, 0, 1, ...
    outs = {}
    for dev in ("cpu", "cuda"):
        w = fp4moe.prepare_weights(**q, gate_up_order="gate_first", activation="swiglu", device=dev)
        reg = fp4moe.AdapterRegistry(w, num_slots=2)
        try:
            reg.load(0, lora, lora_alpha=16.0)
            reg.load(1, {k: _np_to_torch(v) for k, v in lora.items()}, lora_alpha=4.0, use_rslora=True)
        except fp4moe.Fp4MoeError as e:
            if e.code == fp4moe.ErrorCode.Unsupported:
                pytest.skip(f"the CUDA backend does not take registry LoRA yet: {e}")
            raise
        if dev == "cpu":
            outs[dev] = fp4moe.moe(x, w, routing_logits=logits, top_k=K, routing_method="Renormalize",
                                   adapters=reg, adapter_ids=aid)
        else:
            try:
                outs[dev] = fp4moe.moe(_np_to_torch(x), w, routing_logits=_np_to_torch(logits), top_k=K,
                                       routing_method="Renormalize", adapters=reg, adapter_ids=_np_to_torch(aid))
            except fp4moe.Fp4MoeError as e:
                if e.code == fp4moe.ErrorCode.Unsupported:
                    pytest.skip(f"the CUDA backend does not take registry LoRA yet: {e}")
                raise
    _close(outs["cuda"], outs["cpu"], "LoRA")


def test_cuda_errors_name_the_argument(layer):
    q, x, logits = layer
    w = fp4moe.prepare_weights(**q, gate_up_order="gate_first", activation="swiglu", device="cuda")
    with pytest.raises(fp4moe.Fp4MoeError) as ei:  # x on the host, weights on the GPU
        fp4moe.moe(_np_to_torch(x, "cpu"), w, routing_logits=_np_to_torch(logits), top_k=K,
                   routing_method="Renormalize")
    assert ei.value.argument == "x"
    with pytest.raises(fp4moe.Fp4MoeError) as ei:
        fp4moe.moe(_np_to_torch(x), w, routing_logits=_np_to_torch(logits[:, :-1]), top_k=K,
                   routing_method="Renormalize")
    assert ei.value.argument == "routing_logits"


def test_torch_custom_op(layer):
    import fp4moe.torch_ops as ops
    q, x, logits = layer
    w = fp4moe.prepare_weights(**q, gate_up_order="gate_first", activation="swiglu", device="cuda")
    xg, lg = _np_to_torch(x), _np_to_torch(logits)
    kw = dict(top_k=K, routing_method="Renormalize")
    y_ref = fp4moe.moe(xg, w, routing_logits=lg, **kw)
    y_op = ops.moe(xg, w, routing_logits=lg, **kw)
    assert torch.equal(y_ref.view(torch.int16), y_op.view(torch.int16))
    h = ops.handle_of(w)

    def f(a, b):
        return torch.ops.fp4moe.moe(a, h, b, None, None, None, K, int(fp4moe.RoutingMethod.Renormalize), 1, 1, 1.0,
                                    int(fp4moe.ActivationType.Swiglu), None, None, None, 0, 0, 0, 0.0, 0.0,
                                    0, 1.0, 0.0, 0.0, False, 0, None, None) * 2
    y_c = torch.compile(f, backend="aot_eager", fullgraph=True)(xg, lg)
    assert torch.equal(y_c.view(torch.int16), (y_ref * 2).view(torch.int16))
