"""NVFP4 expert weights decoded to dense float32 on the host (SPEC §2): for tests, tools and the HF bridge."""
from __future__ import annotations

import sys

import numpy as np

from ._enums import SCALE_LAYOUT_ALIASES, ScaleLayout, parse_enum
from ._tensors import E4M3, is_torch, require_ndim

E2M1_VALUES = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=np.float32)


def _decode_nvfp4(packed, scales, scale2, n_rows: int, k: int, swizzled: bool, half_rows: int | None):
    """[E, N, K/2] codes + block scales + per-expert (or per-half) global scales -> float32 [E, N, K]."""
    packed = np.asarray(packed, dtype=np.uint8)
    E = packed.shape[0]
    codes = np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(E, n_rows, k)
    sf = np.asarray(scales)
    sf = (sf.view(np.uint8).view(E4M3) if sf.dtype != E4M3 else sf).astype(np.float32)
    if swizzled:
        sf = sf.reshape(E, -1)
        nC = (k // 16 + 3) // 4
        m = np.arange(n_rows)[:, None]
        c = np.arange(k // 16)[None, :]
        off = (m // 128) * nC * 512 + (c // 4) * 512 + (m % 32) * 16 + ((m % 128) // 32) * 4 + (c % 4)
        sf = sf[:, off]
    else:
        sf = sf.reshape(E, n_rows, k // 16)
    vals = E2M1_VALUES[codes] * np.repeat(sf, 16, axis=-1)
    s2 = np.asarray(scale2, dtype=np.float32)
    if s2.ndim == 2:  # per half
        per_row = np.concatenate([np.repeat(s2[:, :1], half_rows, axis=1), np.repeat(s2[:, 1:2], half_rows, axis=1)],
                                 axis=1)
        return vals * per_row[:, :, None]
    return vals * s2.reshape(E, 1, 1)


def dequantize_weights(w1, w1_scale, w1_scale2, w2, w2_scale, w2_scale2, *, scale_layout="linear", **_ignored):
    """NVFP4 expert weights (prepare_weights' arguments, e.g. quantize_weights' output) -> dense float32
    NumPy (w1 [E, N1, H], w2 [E, H, I]) with value e2m1 * e4m3 * scale2 (SPEC §2), in the weights' own
    half order. Host arrays only (device tensors are copied). Extra keys (bias1, ...) are ignored."""
    layout = parse_enum(ScaleLayout, scale_layout, "scale_layout", SCALE_LAYOUT_ALIASES)
    arrs = []
    for name, v in (("w1", w1), ("w1_scale", w1_scale), ("w1_scale2", w1_scale2), ("w2", w2),
                    ("w2_scale", w2_scale), ("w2_scale2", w2_scale2)):
        if is_torch(v):
            t = sys.modules["torch"]
            v = v.detach().cpu()
            if v.dtype == getattr(t, "float8_e4m3fn", None):
                v = v.view(t.uint8)
            v = v.numpy()
        arrs.append(np.asarray(v))
    w1, w1_scale, w1_scale2, w2, w2_scale, w2_scale2 = arrs
    E, n1, h2 = require_ndim(w1, "w1", 3, "[E, N1, H/2] uint8")
    _, H, i2 = require_ndim(w2, "w2", 3, "[E, H, I/2] uint8")
    sw = layout == ScaleLayout.Swizzled128x4
    d1 = _decode_nvfp4(w1, w1_scale, w1_scale2, n1, 2 * h2, sw, n1 // 2)
    d2 = _decode_nvfp4(w2, w2_scale, w2_scale2, H, 2 * i2, sw, None)
    return d1, d2
