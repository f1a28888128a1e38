"""Property-based tests (hypothesis) of the CUDA backend through the Python API: the same strategies as the CPU
properties (test_fuzz_api.py, test_fuzz_bad_calls.py) on PyTorch CUDA tensors, good calls against the CPU backend
and bad calls naming their argument. Skipped, saying why, without a CUDA build, a visible GPU or PyTorch.
"""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("hypothesis", reason="the fuzz tests need hypothesis (pip install hypothesis)")
pytest.importorskip("ml_dtypes", reason="ml_dtypes is needed for NumPy bfloat16")

from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from fuzz_support import (BF16, E4M3, FIG, Fp4MoeError, assert_close, count_example, fp4moe, fuzz,  # noqa: E402
                          same_bits)
from fuzz_cases import LAYER_OF, call_bad, good, moe_case  # noqa: E402
from fuzz_mutations import BAD_INTS, BAD_NAMES, NOT_AN_INT, base_bad_case  # noqa: E402


# ---- the CUDA backend ---------------------------------------------------------------------------------------------

def _cuda_ready():
    if not fp4moe.build_info()["with_cuda"]:
        return None, "fp4moe was built without the CUDA backend"
    if fp4moe.build_info()["cuda_devices"] == 0:
        return None, "no CUDA device visible"
    try:
        import torch
    except ImportError:
        return None, "PyTorch is not installed (the CUDA fuzz makes device tensors with it)"
    if not torch.cuda.is_available():
        return None, "PyTorch sees no CUDA device"
    return torch, ""


TORCH, NO_CUDA = _cuda_ready()
needs_cuda = pytest.mark.skipif(TORCH is None, reason=f"CUDA fuzz skipped: {NO_CUDA}")


def to_cuda(v):
    """NumPy arrays (ml_dtypes included) -> PyTorch CUDA tensors of the same dtype and values; others unchanged."""
    if not isinstance(v, np.ndarray):
        return v
    torch = TORCH
    a = np.ascontiguousarray(v)
    if a.dtype == BF16:  # exact: the values are bf16 already
        return torch.from_numpy(a.astype(np.float32)).to(torch.bfloat16).cuda()
    if a.dtype == E4M3:
        return torch.from_numpy(a.view(np.uint8)).cuda().view(torch.float8_e4m3fn)
    return torch.from_numpy(a).cuda()


def from_cuda(t):
    torch = TORCH
    if t.dtype == torch.bfloat16:
        return t.float().cpu().numpy().astype(BF16)
    return t.cpu().numpy()


_CUDA_WEIGHTS = {}


def cuda_weights(weights):
    """The CUDA-backend twin of a CPU layer made by make_layer (prepared once from the same tensors)."""
    L = LAYER_OF[id(weights)]
    if id(L) not in _CUDA_WEIGHTS:
        _CUDA_WEIGHTS[id(L)] = L.prepare(**{k: to_cuda(v) for k, v in L.args.items()}, **L.kw, device="cuda")
    return _CUDA_WEIGHTS[id(L)]


@needs_cuda
@fuzz(2.0)
@given(case=moe_case(allow_f64_out=False))
def test_cuda_moe_matches_cpu_backend(case):
    """moe on the CUDA backend (PyTorch CUDA tensors, the same strategies) matches the CPU backend to bf16
    tolerance, and is bit-identical across two calls."""
    count_example("cuda_vs_cpu")
    L, x, kw, ref = case
    kw = dict(kw)
    kw.pop("precision", None)
    kw["out"] = None
    y_cpu = good(fp4moe.moe, x, L.weights, **kw)
    wc = cuda_weights(L.weights)
    kc = {k: to_cuda(v) for k, v in kw.items()}
    if "shared_expert" in kw:
        kc["shared_expert"] = cuda_weights(kw["shared_expert"])
    y1 = good(fp4moe.moe, to_cuda(x), wc, **kc)
    y2 = good(fp4moe.moe, to_cuda(x), wc, **kc)
    TORCH.cuda.synchronize()
    fp4moe.check_device_errors(0)
    same_bits(from_cuda(y1), from_cuda(y2), "CUDA run twice")
    assert_close(from_cuda(y1), y_cpu, "CUDA vs CPU backend")


@needs_cuda
@fuzz(3.0)
@given(case=base_bad_case(), data=st.data())
def test_cuda_bad_argument_raises_named_error_and_leaves_out(case, data):
    """Bad arguments on the CUDA backend (host tensors in a device call, wrong dtypes/shapes/strides of device
    tensors, bad enums and scalars) raise Fp4MoeError naming the argument with out untouched; out-of-range ids that
    live only on the GPU are reported by the device error flag, naming the argument."""
    count_example("cuda_bad")
    torch = TORCH
    L, x, kw, out = case
    kw = dict(kw)
    wc = cuda_weights(L.weights)
    if "shared_expert" in kw:
        kw.pop("shared_expert")
    if "adapters" in kw:
        kw.pop("adapters"), kw.pop("adapter_ids")
    kc = {k: to_cuda(v) for k, v in kw.items()}
    xc, oc = to_cuda(x), to_cuda(out)
    good(fp4moe.moe, xc, wc, **kc, out=oc)
    oc = to_cuda(out)
    m = data.draw(st.sampled_from(["host_tensor", "dtype", "noncontig", "shape", "enum", "scalar", "device_ids"]))
    tensors = [k for k in ("routing_logits", "topk_ids", "topk_weights") if k in kc] + ["x", "out"]
    name = data.draw(st.sampled_from(tensors))
    allowed = {name}
    args = dict(kc, x=xc, out=oc)
    if m == "host_tensor":
        args[name] = args[name].cpu()
    elif m == "dtype":
        args[name] = args[name].to(data.draw(st.sampled_from([torch.float16, torch.float64, torch.int16])))
        if name == "topk_ids" and args[name].dtype == torch.int64:
            args[name] = args[name].float()
    elif m == "noncontig":
        t = args[name]
        dims = [i for i in range(t.dim()) if t.shape[i] > 1]
        if not dims:
            return  # a single element has no layout to get wrong
        idx = [slice(None)] * t.dim()
        idx[dims[-1]] = slice(None, None, 2)
        args[name] = torch.repeat_interleave(t, 2, dim=dims[-1])[tuple(idx)]
    elif m == "shape":
        args[name] = args[name][..., :-1] if args[name].shape[-1] > 1 else args[name][None]
        allowed = {name, "topk_ids", "topk_weights", "out", "x"}
    elif m == "enum":
        key = data.draw(st.sampled_from(["routing_method", "activation", "mode", "precision"]))
        args[key], allowed = data.draw(st.one_of(BAD_NAMES, BAD_INTS)), {key}
        if key == "precision" and data.draw(st.booleans()):
            args[key] = "fp64"  # a CPU-reference mode
    elif m == "scalar":
        key = data.draw(st.sampled_from(["top_k", "num_threads", "gemm_tile", "workspace_budget"]))
        args[key], allowed = data.draw(NOT_AN_INT), {key}
    else:
        if "topk_ids" not in args:
            lg = kw["routing_logits"]
            ids, w = fp4moe.route(lg, top_k=kw["top_k"], routing_method=kw["routing_method"],
                                  n_group=kw.get("n_group", 1), topk_group=kw.get("topk_group", 1))
            for k in ("routing_logits", "n_group", "topk_group"):
                args.pop(k, None)
            args["topk_ids"], args["topk_weights"] = to_cuda(ids), to_cuda(w)
        ids = args["topk_ids"].clone()
        ids[0, 0] = data.draw(st.sampled_from([-1, L.E, 2 ** 31 - 1]))
        args["topk_ids"] = ids
        try:
            fp4moe.moe(weights=wc, **args)
            torch.cuda.synchronize()
            fp4moe.check_device_errors(0)
        except Fp4MoeError as e:
            assert e.argument == "topk_ids", str(e)
            FIG["bad_calls"] += 1
            FIG["errors_by_argument"][e.argument] += 1
        else:
            raise AssertionError("an out-of-range device topk_id was not reported")
        fp4moe.check_device_errors(0)  # reported once, then clear
        return
    watch = [args["out"]]
    call_bad(fp4moe.moe, allowed, watch=watch, weights=wc, **args)
    torch.cuda.synchronize()
    fp4moe.check_device_errors(0)


def test_cuda_fuzz_is_reported_when_skipped():
    """Says in the run's output why the CUDA properties are skipped (or that they run)."""
    if TORCH is None:
        pytest.skip(f"CUDA fuzz skipped: {NO_CUDA}")
