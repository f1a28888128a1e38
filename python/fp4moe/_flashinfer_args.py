"""FlashInfer's tensor arguments as fp4moe reads them: host arrays, cache keys, and FlashInfer's weight, scale and
activation layouts undone (the conventions: fp4moe.flashinfer_compat's docstring)."""
from __future__ import annotations

import numpy as np

from ._dequant import E2M1_VALUES
from ._errors import error
from ._tensors import BF16, E4M3, _torch, is_torch

_EPILOGUE_TILE_M = 128
_SHUFFLE_BLOCK = 32  # FlashInfer's row-shuffle block for epilogue_tile_m = 128


# ---- tensors ------------------------------------------------------------------------------------------------

def _ptr(x) -> int:
    if x is None:
        return 0
    if is_torch(x):
        return int(x.data_ptr())
    if isinstance(x, np.ndarray):
        return int(x.__array_interface__["data"][0])
    return id(x)


def _key_of(x):
    if x is None:
        return None
    return (_ptr(x), tuple(int(s) for s in x.shape), str(x.dtype), str(getattr(x, "device", "cpu")))


def _host(x, name: str) -> np.ndarray:
    """Any tensor -> a host NumPy array (float8 / bfloat16 as uint8 / uint16 bit views where NumPy has no
    native type; ml_dtypes types are kept)."""
    if x is None:
        return None
    if is_torch(x):
        t = _torch()
        x = x.detach()
        if x.device.type != "cpu":
            x = x.cpu()
        if x.dtype == getattr(t, "float8_e4m3fn", None):
            return x.contiguous().view(t.uint8).numpy().view(E4M3)
        if x.dtype == t.bfloat16:
            return x.contiguous().view(t.int16).numpy().view(np.uint16).view(BF16)
        return x.contiguous().numpy()
    if isinstance(x, np.ndarray):
        return x
    if hasattr(x, "__array__"):
        return np.asarray(x)
    raise error(name, f"expected a tensor (PyTorch or NumPy), got {type(x).__name__}")


def _vec(x, name: str, n: int, default: float) -> np.ndarray:
    """A per-expert float32 vector [n] on the host (absent -> default; a scalar or [1] -> broadcast)."""
    if x is None:
        return np.full((n,), default, dtype=np.float32)
    if isinstance(x, (int, float)):
        return np.full((n,), float(x), dtype=np.float32)
    a = _host(x, name).astype(np.float32).reshape(-1)
    if a.size == 1:
        return np.full((n,), float(a[0]), dtype=np.float32)
    if a.size != n:
        raise error(name, f"expected {n} per-expert values (local experts), got {a.size}")
    return a


def _bytes_u8(x, name: str) -> np.ndarray:
    """Packed FP4 / e4m3 scales of any integer or float8 view -> uint8 host array (last dim in bytes)."""
    a = _host(x, name)
    if a.dtype.itemsize == 0:
        raise error(name, f"unsupported dtype {a.dtype}")
    a = np.ascontiguousarray(a)
    return a.view(np.uint8)


def _is_bf16(x) -> bool:
    if is_torch(x):
        return x.dtype == _torch().bfloat16
    return isinstance(x, np.ndarray) and BF16 is not None and x.dtype == BF16


def _is_u8(x) -> bool:
    if is_torch(x):
        return x.dtype == _torch().uint8
    return isinstance(x, np.ndarray) and x.dtype == np.uint8


def _device_str(x) -> str:
    if is_torch(x) and x.device.type == "cuda":
        return f"cuda:{x.device.index or 0}"
    return "cpu"


# ---- layouts ------------------------------------------------------------------------------------------------

def _swizzle_offsets(rows: int, cols: int) -> np.ndarray:
    """SPEC §2: the 128x4-swizzled offset of (row m, scale column c), [rows, cols] int64."""
    n_c = (cols + 3) // 4
    m = np.arange(rows, dtype=np.int64)[:, None]
    c = np.arange(cols, dtype=np.int64)[None, :]
    return (m // 128) * n_c * 512 + (c // 4) * 512 + (m % 32) * 16 + ((m % 128) // 32) * 4 + (c % 4)


def _unswizzle(sf: np.ndarray, E: int, rows: int, cols: int, name: str) -> np.ndarray:
    """[E, padded] swizzled e4m3 bytes (any shape with E leading) -> linear [E, rows, cols]."""
    flat = sf.reshape(E, -1)
    need = ((rows + 127) // 128) * 128 * ((cols + 3) // 4) * 4
    if flat.shape[1] < need:
        raise error(name, f"expected 128x4-swizzled block scales of at least {need} bytes per expert "
                          f"(rows {rows}, {cols} scale columns), got {flat.shape[1]}")
    return flat[:, _swizzle_offsets(rows, cols)]


def _trtllm_row_permutation(n_rows: int, gated: bool) -> np.ndarray:
    """perm with shuffled[j] = plain[perm[j]]: FlashInfer's gated-act row interleave (when gated) followed by its
    32-row block shuffle (epilogue_tile_m = 128), rebuilt from their definition."""
    if n_rows % _SHUFFLE_BLOCK:
        raise error("gemm1_weights", f"the shuffled layout needs rows in multiples of {_SHUFFLE_BLOCK}, got {n_rows}")
    if gated:
        half = n_rows // 2
        inter = np.empty(n_rows, dtype=np.int64)
        inter[0::2] = np.arange(half)          # up rows (the first half) at even positions
        inter[1::2] = half + np.arange(half)   # gate rows at odd positions
    else:
        inter = np.arange(n_rows, dtype=np.int64)
    # Within a block of 32, source row s moves to 8*(s % 4) + s // 4 (rows 0, 4, 8, ... first).
    src = np.arange(n_rows, dtype=np.int64)
    b = _SHUFFLE_BLOCK
    dst = (src // b) * b + 8 * (src % 4) + (src % b) // 4
    shuffle = np.empty(n_rows, dtype=np.int64)
    shuffle[dst] = src
    return inter[shuffle]


def shuffle_rows_for_trtllm(a: np.ndarray, gated: bool) -> np.ndarray:
    """[E, N, ...] rows in plain order -> FlashInfer's shuffled order (for tests and tooling)."""
    return a[:, _trtllm_row_permutation(a.shape[1], gated)]


def unshuffle_rows_for_trtllm(a: np.ndarray, gated: bool) -> np.ndarray:
    """Inverse of shuffle_rows_for_trtllm."""
    perm = _trtllm_row_permutation(a.shape[1], gated)
    out = np.empty_like(a)
    out[:, perm] = a
    return out


def _decode_x(packed, sf, T: int, H: int, swizzled: bool, name: str):
    """NVFP4 activations uint8 [T, H/2] + e4m3 block scales -> their exact values e2m1*e4m3 (no global scale)."""
    p = _bytes_u8(packed, "hidden_states").reshape(T, H // 2)
    s = _bytes_u8(sf, name)
    s = (_unswizzle(s.reshape(1, -1), 1, T, H // 16, name)[0] if swizzled else s.reshape(T, H // 16)).view(E4M3)
    codes = np.stack([p & 0xF, p >> 4], axis=-1).reshape(T, H)
    vals = E2M1_VALUES[codes] * np.repeat(s.astype(np.float32), 16, axis=-1)
    return vals.astype(BF16)  # exact: at most 5 significant bits


def _x_like(vals_bf16: np.ndarray, like):
    """The decoded activations in the framework/device of the original input."""
    if is_torch(like):
        t = _torch()
        return t.from_numpy(vals_bf16.view(np.uint16).view(np.int16)).view(t.bfloat16).to(like.device)
    return vals_bf16
