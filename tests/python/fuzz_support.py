"""The fuzz tests' settings, figures and independent NumPy reference (test_fuzz_*.py).

Profiles: FP4MOE_FUZZ_PROFILE=ci (default: bounded, deterministic) or long; FP4MOE_FUZZ_EXAMPLES=N sets the
examples per property. The figures (examples, good calls, bad calls, errors by argument, bytes compared) are printed
at the end of a run and written as JSON to $FP4MOE_FUZZ_REPORT when set. The reference is a small NumPy
implementation of SPEC §2/§3/§5: NVFP4 codes and scales, every routing method, every activation, the experts
densely in float64 with the SPEC's rounding points, LoRA.
"""
from __future__ import annotations

import collections
import json
import math
import os

import ml_dtypes
import numpy as np
import pytest

from hypothesis import HealthCheck, settings

from fp4moe_under_test import import_fp4moe

fp4moe = import_fp4moe()
Fp4MoeError = fp4moe.Fp4MoeError
BF16 = np.dtype(ml_dtypes.bfloat16)
E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)

# ---- settings profiles ------------------------------------------------------------------------------------------

_COMMON = dict(deadline=None, database=None, print_blob=True,
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much])
settings.register_profile("ci", max_examples=25, derandomize=True, **_COMMON)
settings.register_profile("long", max_examples=400, derandomize=False, **_COMMON)
PROFILE = os.environ.get("FP4MOE_FUZZ_PROFILE", "ci")
if PROFILE not in ("ci", "long"):
    raise pytest.UsageError(f"FP4MOE_FUZZ_PROFILE={PROFILE!r}: expected 'ci' or 'long'")
_BASE = settings.get_profile(PROFILE)
_EXAMPLES = int(os.environ.get("FP4MOE_FUZZ_EXAMPLES", "0")) or _BASE.max_examples


def fuzz(weight: float = 1.0):
    """The profile's settings with `weight` times its examples per property."""
    return settings(_BASE, max_examples=max(1, int(round(_EXAMPLES * weight))))


# ---- figures --------------------------------------------------------------------------------------------------------

FIG = {"profile": PROFILE, "examples": 0, "good_calls": 0, "bad_calls": 0, "bad_calls_accepted": 0,
       "errors_by_argument": collections.Counter(), "bytes_compared": 0, "examples_by_test": collections.Counter(),
       "seconds": 0.0}


def count_example(name: str):
    FIG["examples"] += 1
    FIG["examples_by_test"][name] += 1


def count_bytes(*arrays):
    for a in arrays:
        FIG["bytes_compared"] += int(np.asarray(a).nbytes)


def report_figures(config, seconds):
    """Writes the figures to $FP4MOE_FUZZ_REPORT (when set) and prints them: called once, at the end of a pytest
    run that ran fuzz tests (tests/python/conftest.py)."""
    FIG["seconds"] = round(seconds, 2)
    report = {k: (dict(v) if isinstance(v, collections.Counter) else v) for k, v in FIG.items()}
    path = os.environ.get("FP4MOE_FUZZ_REPORT")
    if path:
        with open(path, "w") as f:
            json.dump(report, f, indent=2, sort_keys=True)
    tr = config.pluginmanager.get_plugin("terminalreporter")
    capman = config.pluginmanager.get_plugin("capturemanager")
    if tr is not None and capman is not None:
        with capman.global_and_fixture_disabled():
            _print_figures(tr, report)


def _print_figures(tr, report):
    errs = ", ".join(f"{k}={v}" for k, v in sorted(report["errors_by_argument"].items()))
    tr.write_line("")
    tr.write_line(f"fp4moe fuzz ({PROFILE}): {report['examples']} examples, {report['good_calls']} good calls, "
                  f"{report['bad_calls']} bad calls raised ({report['bad_calls_accepted']} legal variants accepted), "
                  f"{report['bytes_compared']} bytes compared, {report['seconds']} s")
    tr.write_line(f"fp4moe fuzz errors by argument: {errs}")


# ---- an independent NumPy reference ----------------------------------------------------------------------------

E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], dtype=np.float64)
E2M1_SIGNED = np.concatenate([E2M1, -E2M1])


def bf16(a):
    """Round to bfloat16 (nearest even), returned as float64."""
    return np.asarray(a, dtype=np.float64).astype(np.float32).astype(BF16).astype(np.float64)


def f64(a):
    return np.asarray(a).astype(np.float64)


def decode_fp4(packed, sf, scale2_rows):
    """uint8 [E, N, K/2] (low nibble first) x e4m3 [E, N, K/16] x per-row global scale [E, N] -> float64 [E, N, K]."""
    p = np.asarray(packed, dtype=np.uint8)
    codes = np.stack([p & 0xF, p >> 4], axis=-1).reshape(*p.shape[:-1], p.shape[-1] * 2)
    scales = np.asarray(sf).view(np.uint8).view(E4M3).astype(np.float64)
    return E2M1_SIGNED[codes] * np.repeat(scales, 16, axis=-1) * np.asarray(scale2_rows, np.float64)[..., None]


def e2m1_codes(v):
    """float32 values -> E2M1 codes, round to nearest, ties to the even code, saturating at 6; sign bit 8."""
    v = np.asarray(v, dtype=np.float32)
    a = np.abs(v).astype(np.float64)
    hi = np.clip(np.searchsorted(E2M1, a), 0, 7)
    lo = np.clip(hi - 1, 0, 7)
    dlo, dhi = a - E2M1[lo], E2M1[hi] - a
    code = np.where((dhi < dlo) | ((dhi == dlo) & (hi % 2 == 0)), hi, lo)
    code = np.where(a >= 6, 7, code)
    return (code | np.where(np.signbit(v), 8, 0)).astype(np.uint8)


def np_quantize(x, gs):
    """SPEC §2 quantization of rows x float32 [N, K] with encode scale gs: (packed [N, K/2], e4m3 codes [N, K/16])."""
    N, K = x.shape
    blocks = x.reshape(N, K // 16, 16).astype(np.float32)
    amax = np.abs(blocks).max(axis=-1)
    t = (np.float32(gs) * amax).astype(np.float32) / np.float32(6)
    sf = np.minimum(t, np.float32(448)).astype(E4M3)  # RNE, satfinite (t <= 448 up to rounding)
    sfv = sf.astype(np.float32)
    scaled = (blocks * np.float32(gs)).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        q = e2m1_codes(scaled / np.where(sfv == 0, np.float32(1), sfv)[..., None])
    q = np.where((sfv == 0)[..., None], 0, q).reshape(N, K)
    return (q[:, 0::2] | (q[:, 1::2] << 4)).astype(np.uint8), sf.view(np.uint8)


def np_global_scale(x):
    amax = np.float32(np.abs(np.asarray(x, np.float32)).max())
    return np.float32(1) if amax == 0 else np.float32(2688) / amax


def np_swizzle(linear):
    """[N, C] scale codes -> the 128x4 swizzled buffer of SPEC §2 (padding zero)."""
    N, C = linear.shape
    nC = (C + 3) // 4
    out = np.zeros(((N + 127) // 128) * 128 * nC * 4, dtype=np.uint8)
    m = np.arange(N)[:, None]
    c = np.arange(C)[None, :]
    off = (m // 128) * nC * 512 + (c // 4) * 512 + (m % 32) * 16 + ((m % 128) // 32) * 4 + (c % 4)
    out[off] = linear
    return out


def sigmoid(v):
    return 1.0 / (1.0 + np.exp(-v))


_erf = np.vectorize(math.erf, otypes=[np.float64])


def gelu_erf(v):
    return 0.5 * v * (1.0 + _erf(v / math.sqrt(2.0)))


def gelu_tanh(v):
    return 0.5 * v * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (v + 0.044715 * v ** 3)))


METHODS = ["Default", "Renormalize", "DeepSeekV3", "Llama4", "RenormalizeNaive", "TopK", "SigmoidRenorm", "MiniMax2",
           "Sigmoid", "TopKSigmoid"]
ACTIVATIONS = ["Gelu", "Relu", "Silu", "Swiglu", "Geglu", "SwigluBias", "Relu2", "SwigluStep", "GegluTanh",
               "Identity", "Situ"]
GATED = {"Swiglu", "Geglu", "SwigluBias", "SwigluStep", "GegluTanh", "Situ"}
AMBIGUOUS = 1e-5  # selection scores closer than this (relative) may order differently in fp32: not compared


def np_route(logits, method, k, bias=None, n_group=1, topk_group=1, rsf=1.0):
    """SPEC §3.1 in float64: (ids [T, k], weights [T, k], ambiguous: whether an fp32 ordering could differ)."""
    l = f64(logits)
    T, E = l.shape
    b = np.zeros(E) if bias is None else f64(bias)
    s = sigmoid(l)
    p = np.exp(l - l.max(1, keepdims=True)) if T else l
    p = p / p.sum(1, keepdims=True) if T else p
    sel = {"Default": p, "RenormalizeNaive": p, "Renormalize": l, "TopK": l, "Llama4": l, "TopKSigmoid": l,
           "Sigmoid": s, "SigmoidRenorm": s, "DeepSeekV3": s + b, "MiniMax2": s + b}[method].copy()
    ambiguous = False

    def close(a, c):
        return a != c and abs(a - c) <= AMBIGUOUS * (1 + abs(a) + abs(c))

    if method == "DeepSeekV3" and n_group > 1:
        g = sel.reshape(T, n_group, E // n_group)
        top2 = -np.sort(-g, axis=2, kind="stable")[:, :, :2]
        gscore = top2.sum(2)
        order = np.argsort(-gscore, axis=1, kind="stable")
        for t in range(T):
            gs = gscore[t, order[t]]
            if topk_group < n_group and close(gs[topk_group - 1], gs[topk_group]):
                ambiguous = True
        keep = np.zeros((T, n_group), dtype=bool)
        np.put_along_axis(keep, order[:, :topk_group], True, axis=1)
        sel = np.where(np.repeat(keep, E // n_group, axis=1), sel, -np.inf)
    ids = np.argsort(-sel, axis=1, kind="stable")[:, :k]
    for t in range(T):
        srt = -np.sort(-sel[t], kind="stable")
        if any(close(srt[i], srt[i + 1]) for i in range(min(k, E - 1))):
            ambiguous = True
    take = lambda a: np.take_along_axis(a, ids, axis=1)
    if method == "Default" or method == "Sigmoid":
        w = take(p if method == "Default" else s)
    elif method == "Renormalize":
        c = take(l)
        w = np.exp(c - c.max(1, keepdims=True)) if T else c
        w = w / w.sum(1, keepdims=True) if T else w
    elif method == "RenormalizeNaive":
        c = take(p)
        w = c / c.sum(1, keepdims=True)
    elif method == "TopK":
        w = take(l)
    elif method in ("Llama4", "TopKSigmoid"):
        w = sigmoid(take(l))
    elif method == "SigmoidRenorm":
        c = take(s)
        w = c / (c.sum(1, keepdims=True) + 1e-20)
    else:  # DeepSeekV3, MiniMax2
        c = take(s)
        w = c * rsf / (c.sum(1, keepdims=True) + 1e-20)
    return ids.astype(np.int32), w, ambiguous


ACT_DEFAULTS = {"SwigluBias": (1.702, 1.0, 7.0), "SwigluStep": (1.0, 0.0, 7.0), "Situ": (1.0, 1.0, None)}


def np_activation(name, g, u, alpha=None, beta=None, limit=None):
    """SPEC §3.2 activations on real-valued halves (float64); alpha/beta/limit broadcast against g; None = default."""
    da, db, dl = ACT_DEFAULTS.get(name, (1.0, 0.0, None))
    al = da if alpha is None else alpha
    be = db if beta is None else beta
    L = dl if limit is None else limit
    if L is not None:
        L = np.where(np.isinf(L), np.nan, L)  # +inf = no clamp
    if name in ("Swiglu", "SwigluBias", "Situ") and L is not None:
        g = np.where(np.isnan(L), g, np.minimum(g, L))
        u = np.where(np.isnan(L), u, np.clip(u, -L, L))
    if name in ("Swiglu", "SwigluBias"):
        return g * sigmoid(al * g) * (u + be)
    if name == "Situ":
        return (al * np.tanh(g / al) * sigmoid(g)) * (be * np.tanh(u / be))
    if name == "SwigluStep":
        silu = g * sigmoid(g)
        if L is None:
            return silu * u
        return np.where(np.isnan(L), silu * u, np.minimum(silu, L) * np.clip(u, -L, L))
    if name == "Geglu":
        return gelu_erf(g) * u
    if name == "GegluTanh":
        return gelu_tanh(g) * u
    return {"Gelu": gelu_erf, "Relu": lambda h: np.maximum(h, 0), "Silu": lambda h: h * sigmoid(h),
            "Relu2": lambda h: np.maximum(h, 0) ** 2, "Identity": lambda h: h}[name](g)


class Dense:
    """One layer's dense float64 values for the reference: W1 [E, N1, H] in the weights' half order with per-row
    global scales applied, W2 [E, H, I] likewise, optional biases, and its conventions."""

    def __init__(self, W1, W2, gated, order, bias1=None, bias2=None):
        self.W1, self.W2, self.gated, self.order = W1, W2, gated, order
        self.E, self.N1, self.H = W1.shape
        self.I = W2.shape[2]
        self.bias1, self.bias2 = bias1, bias2


def per_e(v, E):
    """A per-expert parameter as given to moe (None, scalar, list, array) -> float64 [E] or None."""
    if v is None:
        return None
    return np.broadcast_to(np.asarray(v, dtype=np.float64), (E,)).copy()


def lora_fold(b, s):
    return bf16(np.float32(s) * f64(b))


def np_expert(D, x, e, act, alpha, beta, limit, lora=None, lora_e=None, delta=None):
    """Step 1-5 of SPEC §3.2 for tokens x [T, H] through experts e [T] (valid ids): (o [T, H], a [T, I])."""
    h = np.einsum("th,tnh->tn", x, D.W1[e])
    if D.bias1 is not None:
        h = h + D.bias1[e]
    if delta is not None:
        h = h + delta
    I = D.I
    pick = lambda v: None if v is None else v[e][:, None]
    if D.gated:
        first, second = h[:, :I], h[:, I:]
        g, u = (first, second) if D.order == "gate_first" else (second, first)
        if lora is not None:
            dg, du = lora.gate_up(x, e, lora_e)
            g, u = g + dg, u + du
        a = np_activation(act, g, u, pick(alpha), pick(beta), pick(limit))
    else:
        if lora is not None:
            h = h + lora.gate_up(x, e, lora_e)[0]
        a = np_activation(act, h, None)
    a = bf16(a)
    o = np.einsum("ti,thi->th", a, D.W2[e])
    if D.bias2 is not None:
        o = o + D.bias2[e]
    if lora is not None:
        o = o + lora.down(a, e, lora_e)
    return o, a


def np_moe(D, x, ids, w, act, alpha=None, beta=None, limit=None, offset=0, shared=None, lora=None,
           adapter_ids=None, delta=None):
    """y [T, H] float64 (before the final bf16 rounding) and a [T, k, I] (rows of dropped slots are NaN)."""
    T, k = ids.shape
    y = np.zeros((T, D.H))
    a_all = np.full((T, k, D.I), np.nan)
    al, be, li = per_e(alpha, D.E), per_e(beta, D.E), per_e(limit, D.E)
    z = {}  # token -> sum_j w_j t2_j of a shared-outer down adapter
    for j in range(k):
        e = ids[:, j].astype(np.int64) - offset
        valid = (e >= 0) & (e < D.E)
        if not valid.any():
            continue
        rows = np.nonzero(valid)[0]
        le = None if adapter_ids is None else adapter_ids[rows]
        o, a = np_expert(D, x[rows], e[rows], act, al, be, li, lora, le,
                         None if delta is None else f64(delta)[rows, j])
        y[rows] += f64(w)[rows, j][:, None] * o
        a_all[rows, j] = a
        if lora is not None:
            for i, t2 in lora.outer_t2.items():
                t = int(rows[i])
                z[t] = z.get(t, 0.0) + float(f64(w)[t, j]) * t2
    for t, zt in z.items():
        y[t] += lora.outer_delta(zt, int(adapter_ids[t]))
    if shared is not None:
        SD, s_alpha, s_beta, s_limit = shared
        o, _ = np_expert(SD, x, np.zeros(T, dtype=np.int64), act, per_e(s_alpha, 1), per_e(s_beta, 1),
                         per_e(s_limit, 1))
        y += o
    return y, a_all


class LoraRef:
    """The resident adapters of a registry, for the reference: slot -> (layout, dict of float64 matrices, scale).
    Deltas per SPEC §5 with the bf16 roundings of docs/numerics.md: t = bf16(x A1^T), dh = bf16(t B1^T),
    t2 = bf16(a A2^T), do = bf16(t2 B2^T); shared-outer down: dy = bf16(bf16(sum_j w_j t2_j) B2^T)."""

    def __init__(self, D):
        self.D = D
        self.slots = {}
        self.outer_t2 = {}  # row -> t2 of the last down() call, for shared-outer adapters

    def outer_delta(self, z, slot):
        lay, m, s = self.slots[slot]
        return bf16(bf16(z) @ lora_fold(m["b_down"], s).T)

    def gate_up(self, x, e, ids):
        T, I = x.shape[0], self.D.I
        dg, du = np.zeros((T, I)), np.zeros((T, I))
        dh = np.zeros((T, I))
        for t in range(T):
            ad = self.slots.get(int(ids[t])) if ids[t] >= 0 else None
            if ad is None:
                continue
            lay, m, s = ad
            et = e[t]
            if lay == "per_expert":
                if "a_gate" not in m:
                    continue
                g = bf16(bf16(x[t] @ m["a_gate"][et].T) @ lora_fold(m["b_gate"][et], s).T)
                if self.D.gated:
                    dg[t] = g
                    du[t] = bf16(bf16(x[t] @ m["a_up"][et].T) @ lora_fold(m["b_up"][et], s).T)
                else:
                    dh[t] = g
            else:
                if "a_gate_up" not in m:
                    continue
                A = m["a_gate_up"] if lay == "shared_outer" else m["a_gate_up"][et]
                d = bf16(bf16(x[t] @ A.T) @ lora_fold(m["b_gate_up"][et], s).T)  # gate rows first
                if self.D.gated:
                    dg[t], du[t] = d[:I], d[I:]
                else:
                    dh[t] = d
        return (dg, du) if self.D.gated else (dh, None)

    def down(self, a, e, ids):
        T = a.shape[0]
        out = np.zeros((T, self.D.H))
        self.outer_t2 = {}
        for t in range(T):
            ad = self.slots.get(int(ids[t])) if ids[t] >= 0 else None
            if ad is None or "a_down" not in ad[1]:
                continue
            lay, m, s = ad
            t2 = bf16(a[t] @ m["a_down"][e[t]].T)
            if lay == "shared_outer":
                self.outer_t2[t] = t2
            else:
                out[t] = bf16(t2 @ lora_fold(m["b_down"][e[t]], s).T)
        return out


def assert_close(y, ref, what, rtol=1e-2, atol_frac=1e-2):
    """|y - ref| <= atol_frac * max|ref| + rtol * |ref| elementwise (bf16 output and bf16-rounded intermediates)."""
    y = f64(y)
    ref = f64(ref)
    assert y.shape == ref.shape, (what, y.shape, ref.shape)
    if ref.size == 0:
        return
    scale = max(float(np.nanmax(np.abs(ref))), 1e-6)
    err = np.abs(y - ref)
    bad = ~(err <= atol_frac * scale + rtol * np.abs(ref))
    assert not bad.any(), (f"{what}: {int(bad.sum())} of {bad.size} elements off; max err {np.nanmax(err):.4g}, "
                           f"scale {scale:.4g}; first at {np.argwhere(bad)[0]}")
    count_bytes(y)


def same_bits(a, b, what):
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape and a.dtype == b.dtype, (what, a.shape, a.dtype, b.shape, b.dtype)
    assert a.tobytes() == b.tobytes(), f"{what}: outputs differ in bits"
    count_bytes(a)
