"""Turning user tensors into what the extension takes: DLPack-capable objects, with a dtype hint where
the framework cannot say the dtype itself (NumPy has no DLPack code for ml_dtypes' bfloat16 and
float8_e4m3fn; old PyTorch exports float8 poorly), plus allocation helpers."""
from __future__ import annotations

import math
import operator
import sys

import numpy as np

from ._enums import DType
from ._errors import error

try:
    import ml_dtypes as _ml
    BF16 = np.dtype(_ml.bfloat16)
    E4M3 = np.dtype(_ml.float8_e4m3fn)
except ImportError:  # ml_dtypes is a dependency; without it NumPy bf16 arrays cannot exist anyway
    _ml = None
    BF16 = E4M3 = None


def _torch():
    """torch if it is already imported (never import it ourselves: it costs seconds)."""
    return sys.modules.get("torch")


def is_torch(x) -> bool:
    t = _torch()
    return t is not None and isinstance(x, t.Tensor)


def as_arg(x, name: str):
    """x ready for the extension: None, an array, or (array, dtype_hint)."""
    if x is None:
        return None
    if isinstance(x, np.ndarray):
        if BF16 is not None and x.dtype == BF16:
            return (x.view(np.uint16), int(DType.BF16))
        if E4M3 is not None and x.dtype == E4M3:
            return (x.view(np.uint8), int(DType.E4M3))
        if x.dtype.kind not in "biuf" or x.dtype.itemsize not in (1, 2, 4, 8):
            raise error(name, f"unsupported NumPy dtype {x.dtype}")
        return x
    if is_torch(x):
        t = _torch()
        x = x.detach()  # torch refuses to export tensors that require grad
        if hasattr(t, "float8_e4m3fn") and x.dtype == t.float8_e4m3fn:
            return (x.view(t.uint8), int(DType.E4M3))
        return x
    if hasattr(x, "__dlpack__") or hasattr(x, "__array_interface__") or hasattr(x, "__buffer__"):
        return x
    if isinstance(x, memoryview):
        return x
    raise error(name, f"expected a tensor (an object with __dlpack__: PyTorch, NumPy, CuPy, JAX), "
                      f"got {type(x).__name__}")


def shape_of(x, name: str) -> tuple[int, ...]:
    s = getattr(x, "shape", None)
    if s is None:
        raise error(name, f"expected a tensor with a shape, got {type(x).__name__}")
    return tuple(int(v) for v in s)


def require_ndim(x, name: str, ndim: int, what: str) -> tuple[int, ...]:
    s = shape_of(x, name)
    if len(s) != ndim:
        raise error(name, f"expected a {ndim}-D tensor {what}, got shape {list(s)}")
    return s


def device_of(x, describe) -> tuple[str, int]:
    """('cpu' | 'cuda', device_id) of any DLPack tensor, through the extension's own conversion."""
    if isinstance(x, np.ndarray):
        return ("cpu", 0)
    if is_torch(x):
        d = x.device
        return ("cuda", d.index or 0) if d.type == "cuda" else ("cpu", 0)
    arg = as_arg(x, "tensor")
    d = describe(arg)
    return (d["device"], int(d["device_id"]))


def to_int32(x, name: str):
    """int64 ids (torch.topk's default) become int32 copies; anything else passes through."""
    if isinstance(x, np.ndarray) and x.dtype == np.int64:
        return x.astype(np.int32)
    if is_torch(x) and x.dtype == _torch().int64:
        return x.to(_torch().int32)
    return x


def to_host_float(x, name: str):
    """A host float32/bfloat16 array of x for the quantizer (copies device tensors to the host)."""
    if is_torch(x):
        t = _torch()
        x = x.detach()
        if x.device.type != "cpu":
            x = x.cpu()
        if x.dtype not in (t.float32, t.bfloat16):
            x = x.float()
        return x
    if isinstance(x, np.ndarray):
        if x.dtype == np.float32 or (BF16 is not None and x.dtype == BF16):
            return x
        if x.dtype.kind == "f":
            return x.astype(np.float32)
        raise error(name, f"expected float weights, got {x.dtype}")
    if hasattr(x, "__array__"):
        return to_host_float(np.asarray(x), name)
    raise error(name, f"expected a float tensor, got {type(x).__name__}")


INT32_RANGE = (-(1 << 31), (1 << 31) - 1)
INT64_RANGE = (-(1 << 63), (1 << 63) - 1)


def as_int(value, name: str, bounds: tuple[int, int] = INT64_RANGE) -> int:
    """An integer argument: an int, a NumPy integer, anything with __index__, or an integral float; never a bool,
    a string or a fractional float (which int() would accept or truncate silently). Must fit the native type."""
    if isinstance(value, (bool, np.bool_)):
        raise error(name, f"expected an integer, got {value!r}")
    if isinstance(value, (float, np.floating)) and math.isfinite(value) and float(value).is_integer():
        v = int(value)
    else:
        try:
            v = operator.index(value)
        except TypeError:
            raise error(name, f"expected an integer, got {type(value).__name__} {value!r}") from None
    lo, hi = bounds
    if not lo <= v <= hi:
        raise error(name, f"expected an integer in [{lo}, {hi}], got {v}")
    return v


def as_float(value, name: str) -> float:
    """A real-number argument (int, float, NumPy scalar, anything with __float__); never a bool or a string."""
    if isinstance(value, (bool, np.bool_, str, bytes)):
        raise error(name, f"expected a number, got {value!r}")
    try:
        return float(value)
    except (TypeError, ValueError, OverflowError) as e:
        raise error(name, f"expected a number, got {type(value).__name__} {value!r} ({e})") from None


def on_device(arr: np.ndarray, name: str, device: tuple[str, int], what: str = "a host array"):
    """A host float32 array where the operator reads it: itself on the CPU, a PyTorch copy on cuda:N (fp4moe
    allocates no device memory for its arguments; without PyTorch the caller passes a CUDA tensor)."""
    if device[0] == "cpu":
        return arr
    t = _torch()
    if t is None:
        raise error(name, f"{what} needs PyTorch to become a CUDA tensor; pass a float32 CUDA tensor of shape "
                          f"{list(arr.shape)}")
    return t.from_numpy(np.ascontiguousarray(arr, dtype=np.float32)).to(f"cuda:{device[1]}")


def per_expert(value, name: str, num_experts: int, device: tuple[str, int]):
    """Per-expert f32 [E_loc] parameters: a scalar is broadcast, a list becomes an array, a tensor passes."""
    if value is None:
        return None
    if isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, (bool, np.bool_)):
        return on_device(np.full((num_experts,), float(value), dtype=np.float32), name, device, "a scalar")
    if isinstance(value, (list, tuple)):
        try:
            arr = np.asarray(value, dtype=np.float32)
        except (TypeError, ValueError, OverflowError) as e:
            raise error(name, f"expected a list of {num_experts} numbers, got {value!r} ({e})") from None
        return on_device(arr, name, device, "a list")
    return value


def empty_bf16(shape: tuple[int, ...], like, device: tuple[str, int], name: str = "out"):
    """An uninitialized bf16 tensor in x's framework: torch for torch inputs, NumPy on the host."""
    if is_torch(like):
        t = _torch()
        return t.empty(shape, dtype=t.bfloat16, device=like.device)
    if device[0] == "cpu":
        if BF16 is None:
            raise error(name, "allocating a bfloat16 NumPy output needs ml_dtypes (pip install ml_dtypes)")
        return np.empty(shape, dtype=BF16)
    raise error(name, "for CUDA inputs that are not PyTorch tensors, pass a preallocated bfloat16 output")
