"""An independent NumPy implementation of SPEC §3/§5 for the Python tests: NVFP4 decoding, the routing methods,
the activations, the experts computed densely (every expert for every token, then masked by the routing
weights) in float64 with the SPEC's bf16 rounding points, and the tolerance the API tests compare with."""
from __future__ import annotations

import math

import ml_dtypes
import numpy as np

BF16 = np.dtype(ml_dtypes.bfloat16)
E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)

E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=np.float64)


def bf16(a):
    return np.asarray(a, dtype=np.float64).astype(np.float32).astype(BF16).astype(np.float64)


def decode_nvfp4(packed, sf):
    """[..., N, K/2] uint8 codes and [..., N, K/16] e4m3 block scales -> e2m1 * e4m3 values [..., N, K]."""
    packed = np.asarray(packed, dtype=np.uint8)
    codes = np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)
    scales = np.asarray(sf).view(np.uint8).view(E4M3).astype(np.float64)
    return E2M1[codes] * np.repeat(scales, 16, axis=-1)


def sigmoid(v):
    return 1.0 / (1.0 + np.exp(-v))


_erf = np.vectorize(math.erf)


def gelu_erf(v):
    return 0.5 * v * (1.0 + _erf(v / math.sqrt(2.0)))


def np_route(logits, method, k, bias=None, n_group=1, topk_group=1, rsf=1.0):
    """(ids [T, k], weights [T, k]) per SPEC §3.1; ties to the lower id (stable sort)."""
    l = np.asarray(logits, dtype=np.float64)
    T, E = l.shape

    def topk(score):
        return np.argsort(-score, axis=1, kind="stable")[:, :k]

    def take(a, ids):
        return np.take_along_axis(a, ids, axis=1)

    if method == "Default":
        p = np.exp(l - l.max(1, keepdims=True))
        p /= p.sum(1, keepdims=True)
        ids = topk(p)
        return ids, take(p, ids)
    if method == "Renormalize":
        ids = topk(l)
        c = take(l, ids)
        w = np.exp(c - c.max(1, keepdims=True))
        return ids, w / w.sum(1, keepdims=True)
    if method == "RenormalizeNaive":
        p = np.exp(l - l.max(1, keepdims=True))
        p /= p.sum(1, keepdims=True)
        ids = topk(p)
        c = take(p, ids)
        return ids, c / c.sum(1, keepdims=True)
    if method == "DeepSeekV3":
        s = sigmoid(l)
        b = s + (0 if bias is None else np.asarray(bias, dtype=np.float64))
        sel = b.copy()
        if n_group > 1:
            g = b.reshape(T, n_group, E // n_group)
            gscore = np.sort(g, axis=2)[:, :, -2:].sum(2)
            keep = np.argsort(-gscore, axis=1, kind="stable")[:, :topk_group]
            mask = np.zeros((T, n_group), dtype=bool)
            np.put_along_axis(mask, keep, True, axis=1)
            sel = np.where(np.repeat(mask, E // n_group, axis=1), b, -np.inf)
        ids = topk(sel)
        c = take(s, ids)
        return ids, c * rsf / (c.sum(1, keepdims=True) + 1e-20)
    if method == "Sigmoid":
        s = sigmoid(l)
        ids = topk(s)
        return ids, take(s, ids)
    if method == "TopK":
        ids = topk(l)
        return ids, take(l, ids)
    raise NotImplementedError(method)


def np_activation(name, g, u=None, alpha=None, beta=None, limit=None):
    if name == "Swiglu" or name == "SwigluBias":
        al = 1.0 if alpha is None else alpha
        be = 0.0 if beta is None else beta
        if limit is not None:
            g = np.minimum(g, limit)
            u = np.clip(u, -limit, limit)
        return g * sigmoid(al * g) * (u + be)
    if name == "Situ":
        al = 1.0 if alpha is None else alpha
        be = 1.0 if beta is None else beta
        return (al * np.tanh(g / al) * sigmoid(g)) * (be * np.tanh(u / be))
    if name == "Geglu":
        return gelu_erf(g) * u
    if name == "Relu2":
        return np.maximum(g, 0) ** 2
    if name == "Silu":
        return g * sigmoid(g)
    raise NotImplementedError(name)


GATED = {"Swiglu", "SwigluBias", "Situ", "Geglu"}


def np_expert_outputs(x, W1, s1, W2, s2, act, order="gate_first", alpha=None, beta=None, limit=None,
                      bias1=None, bias2=None, lora=None, delta=None):
    """o [T, E, H] and a [T, E, I] of every expert for every token (float64, a rounded to bf16).

    W1 [E, N1, H], W2 [E, H, I]: e2m1*e4m3 (or bf16) values; s1 [E, 2] or [E] and s2 [E] global scales.
    lora: dict(A1 [E, r, H], B1 [E, N1, r] gate rows first, A2 [E, r, I], B2 [E, H, r], s).
    delta: [T, E, N1] gate_up delta in the weights' half order."""
    E, N1, H = W1.shape
    I = W2.shape[2]
    h = np.einsum("th,enh->ten", x, W1)  # [T, E, N1]
    gated = act in GATED
    if gated:
        first, second = h[..., :I], h[..., I:]
        s1 = np.asarray(s1, dtype=np.float64).reshape(E, -1)
        s_first = s1[:, 0][None, :, None]
        s_second = s1[:, -1][None, :, None]
        first, second = first * s_first, second * s_second
        if bias1 is not None:
            first = first + bias1[None, :, :I]
            second = second + bias1[None, :, I:]
        if delta is not None:
            first = first + delta[..., :I]
            second = second + delta[..., I:]
        g, u = (first, second) if order == "gate_first" else (second, first)
        if lora is not None:
            t = np.einsum("th,erh->ter", x, lora["A1"])
            d = lora["s"] * np.einsum("ter,enr->ten", t, lora["B1"])  # gate rows first
            g, u = g + d[..., :I], u + d[..., I:]
        pe = lambda v: None if v is None else np.asarray(v, dtype=np.float64)[None, :, None]
        a = np_activation(act, g, u, pe(alpha), pe(beta), pe(limit))
    else:
        g = h * np.asarray(s1, dtype=np.float64).reshape(E)[None, :, None]
        if bias1 is not None:
            g = g + bias1[None]
        if lora is not None:
            t = np.einsum("th,erh->ter", x, lora["A1"])
            g = g + lora["s"] * np.einsum("ter,enr->ten", t, lora["B1"])
        a = np_activation(act, g)
    a = bf16(a)
    o = np.einsum("tei,ehi->teh", a, W2) * np.asarray(s2, dtype=np.float64)[None, :, None]
    if bias2 is not None:
        o = o + bias2[None]
    if lora is not None:
        t = np.einsum("tei,eri->ter", a, lora["A2"])
        o = o + lora["s"] * np.einsum("ter,ehr->teh", t, lora["B2"])
    return o, a


def np_combine(o, ids, w, E_loc, offset=0):
    T = o.shape[0]
    mask = np.zeros((T, E_loc))
    for t in range(T):
        for j in range(ids.shape[1]):
            e = int(ids[t, j]) - offset
            if 0 <= e < E_loc:
                mask[t, e] += w[t, j]
    return np.einsum("te,teh->th", mask, o)


def assert_close(y, ref, what=""):
    y = np.asarray(y).astype(np.float64)
    scale = max(np.abs(ref).max(), 1e-3)
    err = np.abs(y - ref)
    tol = 2e-2 * scale + 1.6e-2 * np.abs(ref)
    bad = err > tol
    assert not bad.any(), (f"{what}: {bad.sum()} of {bad.size} elements off; max err {err.max():.4g}, "
                           f"scale {scale:.4g}; first at {np.argwhere(bad)[0]}")
    # The test must be able to fail: outputs are not trivially zero.
    assert np.abs(ref).max() > 1e-2
