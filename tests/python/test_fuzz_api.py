"""Property-based tests (hypothesis) of the public Python API over shapes, dtypes, strides, devices, enum names and
optional arguments.

Every call either matches an independent reference (a small NumPy implementation of SPEC §2/§3/§5 written here, or
an algebraic property of SPEC §4/§5) or raises fp4moe.Fp4MoeError whose .argument is one of the call's parameters;
never another exception type, never a crash, and never a changed `out` (pre-filled with random bytes) after an error.

Profiles: FP4MOE_FUZZ_PROFILE=ci (default: bounded, deterministic) or long; FP4MOE_FUZZ_EXAMPLES=N sets the
examples per property. FP4MOE_FUZZ_REPORT=path writes the figures (examples, good calls, bad calls, errors by
argument, bytes compared) as JSON; they are also printed at the end of the run. With a CUDA build, a visible GPU
and PyTorch, the CUDA properties run the same strategies on device tensors against the CPU backend.
"""
from __future__ import annotations

import collections
import functools
import inspect
import json
import math
import os
import sys
import time

import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis", reason="the fuzz tests need hypothesis (pip install hypothesis)")
ml_dtypes = pytest.importorskip("ml_dtypes", reason="ml_dtypes is needed for NumPy bfloat16")

from hypothesis import HealthCheck, assume, given, note, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from fp4moe_under_test import import_fp4moe  # noqa: E402

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


@pytest.fixture(scope="session", autouse=True)
def fuzz_figures(request):
    t0 = time.time()
    yield
    FIG["seconds"] = round(time.time() - t0, 2)
    report = {k: (dict(v) if isinstance(v, collections.Counter) else v) for k, v in FIG.items()}
    path = os.environ.get("FP4MOE_FUZZ_REPORT")
    if path:
        with open(path, "w") as f:
            json.dump(report, f, indent=2, sort_keys=True)
    tr = request.config.pluginmanager.get_plugin("terminalreporter")
    capman = request.config.pluginmanager.get_plugin("capturemanager")
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


# ---- layers -------------------------------------------------------------------------------------------------------

class Layer:
    """Prepared weights (CPU backend), the arguments they were prepared from, and their dense reference."""


LAYER_OF = {}  # id(prepared CPU weights) -> its Layer


@functools.lru_cache(maxsize=None)
def make_layer(E, H, I, gated, fmt="nvfp4", order="gate_first", layout="linear", bias=False, per_half=True,
               seed=0, activation=None):
    rng = np.random.default_rng(seed)
    N1 = 2 * I if gated else I
    w1 = (rng.standard_normal((E, N1, H)) * (2.0 / np.sqrt(H))).astype(np.float32)
    w2 = (rng.standard_normal((E, H, I)) * (1.5 / np.sqrt(I))).astype(np.float32)
    b1 = (0.1 * rng.standard_normal((E, N1))).astype(np.float32) if bias else None
    b2 = (0.1 * rng.standard_normal((E, H))).astype(np.float32) if bias else None
    L = Layer()
    L.E, L.H, L.I, L.N1, L.gated, L.fmt, L.order = E, H, I, N1, gated, fmt, order
    kw = dict(gate_up_order=order, gated=gated, activation=activation)
    if fmt == "nvfp4":
        q = fp4moe.quantize_weights(w1, w2, gate_up_order=order, gated=gated, per_half_scale2=per_half)
        if layout == "swizzled":  # the swizzle of SPEC §2, made here
            q["w1_scale"] = np.stack([np_swizzle(q["w1_scale"][e].view(np.uint8)) for e in range(E)]).view(E4M3)
            q["w2_scale"] = np.stack([np_swizzle(q["w2_scale"][e].view(np.uint8)) for e in range(E)]).view(E4M3)
        L.args = dict(q, bias1=b1, bias2=b2)
        L.kw = dict(kw, scale_layout=layout)
        L.prepare = fp4moe.prepare_weights
        s1 = np.asarray(q["w1_scale2"], np.float64).reshape(E, -1)
        rows1 = np.repeat(s1, N1 // s1.shape[1], axis=1) if s1.shape[1] > 1 else np.repeat(s1, N1, axis=1)
        lin1 = fp4moe.quantize_weights(w1, w2, gate_up_order=order, gated=gated, per_half_scale2=per_half)
        W1 = decode_fp4(lin1["w1"], lin1["w1_scale"], rows1)
        W2 = decode_fp4(lin1["w2"], lin1["w2_scale"], np.repeat(f64(q["w2_scale2"])[:, None], H, axis=1))
    else:
        L.args = dict(w1=w1.astype(BF16), w2=w2.astype(BF16), bias1=b1, bias2=b2)
        L.kw = kw
        L.prepare = fp4moe.prepare_bf16_weights
        W1, W2 = f64(L.args["w1"]), f64(L.args["w2"])
    L.weights = L.prepare(**L.args, **L.kw)
    LAYER_OF[id(L.weights)] = L
    L.dense = Dense(W1, W2, gated, order, None if b1 is None else f64(b1), None if b2 is None else f64(b2))
    return L


def bf16_array(rng, shape, scale=1.0):
    return (scale * rng.standard_normal(shape)).astype(np.float32).astype(BF16)


def sentinel_like(shape, dtype, seed):
    """An array filled with random bytes (NaN bit patterns included), to see any write."""
    dt = np.dtype(dtype)
    n = int(np.prod(shape)) * dt.itemsize
    return np.frombuffer(np.random.default_rng(seed).bytes(n), dtype=np.uint8).copy().view(dt).reshape(shape)


def snapshot(arrays):
    return [None if a is None else (np.asarray(a).tobytes() if isinstance(a, np.ndarray) else _torch_bytes(a))
            for a in arrays]


def _torch_bytes(t):
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(t, torch.Tensor):
        return t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()
    return None


def params_of(fn):
    return set(inspect.signature(fn).parameters)


def call_bad(fn, allowed, *, watch=(), accept=None, extra_names=(), **kw):
    """Calls fn(**kw), which must raise Fp4MoeError naming an argument in `allowed` (a subset of fn's parameters) and
    leave every array in `watch` byte-identical; `accept`, when given, is called with the result of a call that
    succeeds (a variant that is legal: it checks the result against the base call)."""
    names = params_of(fn) | set(extra_names)
    assert set(allowed) <= names, (fn.__name__, set(allowed) - names)
    before = snapshot(watch)
    try:
        r = fn(**kw)
    except Fp4MoeError as e:
        if hypothesis.control.currently_in_test_context():
            note(f"{fn.__name__} raised: {e}")
        assert e.argument, f"{fn.__name__}: error names no argument: {e}"
        assert e.argument in names, f"{fn.__name__}: error names {e.argument!r}, not a parameter: {e}"
        assert e.argument in allowed, \
            f"{fn.__name__}: error names {e.argument!r}, expected one of {sorted(allowed)}: {e}"
        after = snapshot(watch)
        for i, (b, a) in enumerate(zip(before, after)):
            assert b == a, f"{fn.__name__}: watched array {i} changed by a call that failed ({e})"
            if b is not None:
                FIG["bytes_compared"] += len(b)
        FIG["bad_calls"] += 1
        FIG["errors_by_argument"][e.argument] += 1
        return e
    assert accept is not None, f"{fn.__name__} accepted a bad call"
    FIG["bad_calls_accepted"] += 1
    accept(r)
    return None


def good(fn, *a, **kw):
    r = fn(*a, **kw)
    FIG["good_calls"] += 1
    return r


# ---- strategies -----------------------------------------------------------------------------------------------

DIMS = st.sampled_from([16, 32, 48, 64])


@st.composite
def routing_setup(draw, E_total, allow_llama4=True):
    methods = METHODS if allow_llama4 else [m for m in METHODS if m != "Llama4"]
    method = draw(st.sampled_from(methods))
    n_group, topk_group = 1, 1
    if method == "DeepSeekV3":
        divs = [g for g in range(2, E_total + 1) if E_total % g == 0 and E_total // g >= 2]
        if divs and draw(st.booleans()):
            n_group = draw(st.sampled_from(divs))
            topk_group = draw(st.integers(1, n_group))
    kmax = min(E_total, 4, topk_group * (E_total // n_group))
    k = 1 if method == "Llama4" else draw(st.integers(1, kmax))
    rsf = draw(st.sampled_from([1.0, 2.5, 0.5]))
    return method, k, n_group, topk_group, rsf


def act_params(draw, act, E):
    """Optional per-expert alpha, beta, clamp limit in one of the accepted spellings (None, scalar, list, array)."""
    def spell(values):
        kind = draw(st.sampled_from(["none", "scalar", "list", "array"]))
        if kind == "none":
            return None
        if kind == "scalar":
            return float(values[0])
        return [float(v) for v in values] if kind == "list" else np.asarray(values, dtype=np.float32)

    if act not in GATED or act in ("Geglu", "GegluTanh"):
        return None, None, None
    f = lambda lo, hi: [np.float32(draw(st.floats(lo, hi))) for _ in range(E)]
    if act == "Situ":
        return spell(f(0.5, 30.0)), spell(f(0.5, 30.0)), spell(f(0.5, 8.0))
    if act == "SwigluStep":
        return None, None, spell(f(0.5, 8.0))
    lim = f(0.5, 8.0)
    if draw(st.booleans()):
        lim[0] = np.float32(np.inf)
    return spell(f(0.5, 2.0)), spell(f(-1.0, 1.0)), spell(lim)


@st.composite
def moe_case(draw, allow_f64_out=True):
    """A good moe call on the CPU backend: the layer, the call's keyword arguments, and what the reference needs."""
    E = draw(st.integers(1, 8))
    H, I = draw(DIMS), draw(DIMS)
    act = draw(st.sampled_from(ACTIVATIONS))
    gated = act in GATED
    fmt = draw(st.sampled_from(["nvfp4", "bf16"]))
    order = draw(st.sampled_from(["gate_first", "up_first"]))
    layout = draw(st.sampled_from(["linear", "swizzled"])) if fmt == "nvfp4" else "linear"
    bias = draw(st.booleans())
    per_half = draw(st.booleans())
    L = make_layer(E, H, I, gated, fmt, order, layout, bias, per_half, seed=draw(st.integers(0, 3)))
    T = draw(st.integers(0, 9))
    E_total = draw(st.integers(E, min(E + 4, 10))) if draw(st.booleans()) else E
    offset = draw(st.integers(0, E_total - E))
    method, k, n_group, topk_group, rsf = draw(routing_setup(E_total))
    seed = draw(st.integers(0, 2 ** 16))
    rng = np.random.default_rng(seed)
    x = bf16_array(rng, (T, H))
    kw = dict(top_k=k, routing_method=draw(st.sampled_from([method, METHODS.index(method), method.lower()])),
              activation=act)
    ref = {}
    source = draw(st.sampled_from(["logits_f32", "logits_bf16", "topk"]))
    if source == "topk":
        ids = rng.integers(0, E_total, size=(T, k)).astype(np.int32)
        w = rng.uniform(-1.5, 1.5, size=(T, k)).astype(np.float32)
        kw.update(topk_ids=ids if draw(st.booleans()) else ids.astype(np.int64), topk_weights=w)
    else:
        logits = (rng.standard_normal((T, E_total)) * 2).astype(np.float32)
        if source == "logits_bf16":
            logits = logits.astype(BF16)
        kw["routing_logits"] = logits
        b = None
        if draw(st.booleans()):
            b = (0.3 * rng.standard_normal(E_total)).astype(np.float32)
            kw["routing_bias"] = b
        uses_bias = method in ("DeepSeekV3", "MiniMax2")
        ids, w, amb = np_route(logits, method, k, b if uses_bias else None, n_group, topk_group, rsf)
        assume(not amb)
    if n_group > 1:
        kw.update(n_group=n_group, topk_group=topk_group)
    if rsf != 1.0:
        kw["routed_scaling_factor"] = rsf
    if E_total != E or draw(st.booleans()):
        kw["num_experts_total"] = E_total
    if offset:
        kw["local_expert_offset"] = offset
    alpha, beta, limit = act_params(draw, act, E)
    for name, v in (("gemm1_alpha", alpha), ("gemm1_beta", beta), ("gemm1_clamp_limit", limit)):
        if v is not None:
            kw[name] = v
    shared = None
    if draw(st.booleans()):
        Is = draw(st.sampled_from([16, 32]))
        S = make_layer(1, H, Is, gated, draw(st.sampled_from(["nvfp4", "bf16"])),
                       draw(st.sampled_from(["gate_first", "up_first"])), seed=5)
        kw["shared_expert"] = S.weights
        sa = sb = sl = None
        if gated and act not in ("Geglu", "GegluTanh") and draw(st.booleans()):
            if act == "Situ":
                sa, sb = draw(st.sampled_from([None, 4.0, 0.7])), draw(st.sampled_from([None, 25.0, 2.0]))
            elif act != "SwigluStep":
                sa, sb = draw(st.sampled_from([None, 1.702, 0.8])), draw(st.sampled_from([None, 1.0, -0.5]))
            sl = draw(st.sampled_from([None, 7.0, 2.0, math.inf]))
            for name, v in (("shared_alpha", sa), ("shared_beta", sb), ("shared_clamp_limit", sl)):
                if v is not None:
                    kw[name] = v
        shared = (S.dense, sa, sb, sl)
    out_kind = draw(st.sampled_from(["none", "bf16", "f32"] + (["f64"] if allow_f64_out else [])))
    if out_kind != "none":
        kw["out"] = sentinel_like((T, H), {"bf16": BF16, "f32": np.float32, "f64": np.float64}[out_kind], seed)
    if draw(st.booleans()):
        kw["precision"] = draw(st.sampled_from(["fp32", "fp64"]))
    ref.update(x=f64(x), ids=ids, w=w, act=act, alpha=alpha, beta=beta, limit=limit, offset=offset, shared=shared)
    return L, x, kw, ref


# ---- routing ------------------------------------------------------------------------------------------------------

@fuzz(1.5)
@given(data=st.data())
def test_route_matches_numpy_reference(data):
    """fp4moe.route equals the NumPy routing of SPEC §3.1 (ids exactly, weights to 1e-5) for every method."""
    count_example("route")
    E = data.draw(st.integers(1, 12))
    T = data.draw(st.integers(0, 12))
    method, k, n_group, topk_group, rsf = data.draw(routing_setup(E))
    rng = np.random.default_rng(data.draw(st.integers(0, 2 ** 16)))
    logits = (rng.standard_normal((T, E)) * data.draw(st.sampled_from([0.5, 2.0, 8.0]))).astype(np.float32)
    if data.draw(st.booleans()):
        logits = logits.astype(BF16)
    if data.draw(st.booleans()):  # ties: ids must go to the lower expert
        h = E // 2
        logits[:, E - h:] = logits[:, :h]
    bias = (0.3 * rng.standard_normal(E)).astype(np.float32) if data.draw(st.booleans()) else None
    ids_ref, w_ref, amb = np_route(logits, method, k, bias if method in ("DeepSeekV3", "MiniMax2") else None,
                                   n_group, topk_group, rsf)
    assume(not amb)
    ids, w = good(fp4moe.route, logits, top_k=k, routing_method=method, routing_bias=bias, n_group=n_group,
                  topk_group=topk_group, routed_scaling_factor=rsf)
    assert ids.dtype == np.int32 and w.dtype == np.float32 and ids.shape == w.shape == (T, k)
    np.testing.assert_array_equal(ids, ids_ref, err_msg=method)
    np.testing.assert_allclose(w, w_ref, rtol=1e-5, atol=1e-6, err_msg=method)
    count_bytes(ids, w)


# ---- quantize_weights ---------------------------------------------------------------------------------------

@fuzz(1.0)
@given(data=st.data())
def test_quantize_weights_matches_numpy_quantizer(data):
    """quantize_weights gives the NVFP4 codes, block scales, global scales and swizzle of SPEC §2 bit for bit
    (bf16 format: the round-to-nearest-even bits)."""
    count_example("quantize")
    E, H, I = data.draw(st.integers(1, 4)), data.draw(DIMS), data.draw(DIMS)
    gated = data.draw(st.booleans())
    N1 = 2 * I if gated else I
    rng = np.random.default_rng(data.draw(st.integers(0, 2 ** 16)))
    scale = data.draw(st.sampled_from([1e-3, 1.0, 300.0]))
    w1 = (rng.standard_normal((E, N1, H)) * scale).astype(np.float32)
    w2 = (rng.standard_normal((E, H, I)) * scale).astype(np.float32)
    if data.draw(st.booleans()):  # blocks of zeros and one tiny block: zero and subnormal block scales
        w1[0, 0, :16] = 0
        w2[0, 0, :16] *= 1e-6
    if data.draw(st.booleans()):
        w1, w2 = w1.astype(BF16), w2.astype(BF16)
    fmt = data.draw(st.sampled_from(["nvfp4", "bf16"]))
    per_half = data.draw(st.booleans())
    layout = data.draw(st.sampled_from(["linear", "swizzled"]))
    q = good(fp4moe.quantize_weights, w1, w2, gate_up_order=data.draw(st.sampled_from(["gate_first", "up_first"])),
             gated=gated, format=fmt, per_half_scale2=per_half, scale_layout=layout)
    if fmt == "bf16":
        same_bits(q["w1"], np.asarray(w1, np.float32).astype(BF16), "w1 bf16")
        same_bits(q["w2"], np.asarray(w2, np.float32).astype(BF16), "w2 bf16")
        return
    x1, x2 = np.asarray(w1, np.float32), np.asarray(w2, np.float32)
    for e in range(E):
        halves = [(0, I), (I, N1)] if (gated and per_half) else [(0, N1)]
        s2 = np.asarray(q["w1_scale2"][e], np.float32).reshape(-1)
        assert s2.size == len(halves)
        p1, f1 = [], []
        for hi, (r0, r1) in enumerate(halves):
            gs = np_global_scale(x1[e, r0:r1])
            assert s2[hi] == np.float32(1) / gs, (e, hi, s2[hi], 1 / gs)
            pk, sf = np_quantize(x1[e, r0:r1], gs)
            p1.append(pk)
            f1.append(sf)
        gs2 = np_global_scale(x2[e])
        assert np.float32(q["w2_scale2"][e]) == np.float32(1) / gs2
        p2, f2 = np_quantize(x2[e], gs2)
        p1, f1 = np.concatenate(p1), np.concatenate(f1)
        same_bits(q["w1"][e], p1, f"w1 codes expert {e}")
        same_bits(q["w2"][e], p2, f"w2 codes expert {e}")
        if layout == "swizzled":
            f1, f2 = np_swizzle(f1), np_swizzle(f2)
        same_bits(np.asarray(q["w1_scale"][e]).view(np.uint8).reshape(-1), f1.reshape(-1), f"w1 scales {e}")
        same_bits(np.asarray(q["w2_scale"][e]).view(np.uint8).reshape(-1), f2.reshape(-1), f"w2 scales {e}")


# ---- moe: good calls against the reference --------------------------------------------------------------------

def reference_of(L, kw, ref):
    return np_moe(L.dense, ref["x"], ref["ids"], ref["w"], ref["act"], ref["alpha"], ref["beta"], ref["limit"],
                  ref["offset"], ref["shared"])


@fuzz(3.0)
@given(case=moe_case())
def test_moe_matches_numpy_reference(case):
    """moe on the CPU backend equals the NumPy operator of SPEC §3 (all routing methods, activations, formats, half
    orders, scale layouts, biases, per-expert parameters, EP windows, shared expert, out dtypes) to bf16 tolerance;
    a given out is the returned object; a float32 out rounded to bf16 equals the bf16 output bit for bit."""
    count_example("moe_reference")
    L, x, kw, ref = case
    out = kw.get("out")
    y = good(fp4moe.moe, x, L.weights, **kw)
    if out is not None:
        assert y is out
    else:
        assert y.dtype == BF16 and y.shape == (x.shape[0], L.H)
    y_ref, _ = reference_of(L, kw, ref)
    assert_close(y, y_ref, "moe vs reference")
    if y.dtype == np.float32 and kw.get("precision", "fp32") == "fp32":
        kw16 = dict(kw, out=None)
        y16 = good(fp4moe.moe, x, L.weights, **kw16)
        same_bits(np.asarray(y).astype(BF16), y16, "bf16(float32 out) vs bf16 out")


@fuzz(1.0)
@given(case=moe_case(allow_f64_out=False), data=st.data())
def test_moe_precomputed_routing_equals_logits_routing(case, data):
    """moe with topk_ids/topk_weights from fp4moe.route equals moe routing from the same logits, bit for bit."""
    count_example("route_vs_logits")
    L, x, kw, ref = case
    assume("routing_logits" in kw)
    kw = dict(kw, out=None)
    y = good(fp4moe.moe, x, L.weights, **kw)
    ids, w = good(fp4moe.route, kw["routing_logits"], top_k=kw["top_k"], routing_method=kw["routing_method"],
                  routing_bias=kw.get("routing_bias"), n_group=kw.get("n_group", 1),
                  topk_group=kw.get("topk_group", 1), routed_scaling_factor=kw.get("routed_scaling_factor", 1.0),
                  num_experts_total=kw.get("num_experts_total", 0))
    pre = {k: v for k, v in kw.items() if k not in ("routing_logits", "routing_bias", "n_group", "topk_group")}
    y2 = good(fp4moe.moe, x, L.weights, **pre, topk_ids=ids, topk_weights=w)
    same_bits(y2, y, "precomputed vs logits routing")


@fuzz(1.0)
@given(case=moe_case(allow_f64_out=False), data=st.data())
def test_moe_token_output_independent_of_batch(case, data):
    """A token's output bits do not depend on the other tokens of the batch (SPEC §4): a permuted batch gives the
    permuted rows, a sub-batch gives the same rows, and a NaN token changes only its own row (SPEC §6)."""
    count_example("batch_invariance")
    L, x, kw, ref = case
    T = x.shape[0]
    assume(T >= 1)
    kw = dict(kw, out=None)
    row_args = ("routing_logits", "topk_ids", "topk_weights")
    y = good(fp4moe.moe, x, L.weights, **kw)
    perm = np.asarray(data.draw(st.permutations(range(T))), dtype=np.int64)
    sub = perm[: data.draw(st.integers(1, T))]
    for rows, what in ((perm, "permuted"), (sub, "sub-batch")):
        kr = {k: (np.ascontiguousarray(np.asarray(v)[rows]) if k in row_args else v) for k, v in kw.items()}
        yr = good(fp4moe.moe, np.ascontiguousarray(x[rows]), L.weights, **kr)
        same_bits(yr, y[rows], what)
    t = data.draw(st.integers(0, T - 1))
    xn = x.copy()
    xn[t, data.draw(st.integers(0, L.H - 1))] = np.nan
    yn = good(fp4moe.moe, xn, L.weights, **kw)
    others = np.arange(T) != t
    same_bits(yn[others], y[others], "rows of the other tokens with a NaN token in the batch")


# ---- LoRA ---------------------------------------------------------------------------------------------------------

def random_adapter(rng, L, layout, r, zero_b=False, parts=("gate_up", "down")):
    E, H, I, N1 = L.E, L.H, L.I, L.N1
    A = lambda *s: bf16_array(rng, s, 0.5 / np.sqrt(s[-1]))
    B = lambda *s: (np.zeros(s, BF16) if zero_b else bf16_array(rng, s, 0.5 / np.sqrt(s[-1])))
    t = {}
    if "gate_up" in parts:
        if layout == "per_expert":
            t.update(a_gate=A(E, r, H), b_gate=B(E, I, r))
            if L.gated:
                t.update(a_up=A(E, r, H), b_up=B(E, I, r))
        elif layout == "peft_fused":
            t.update(a_gate_up=A(E, r, H), b_gate_up=B(E, N1, r))
        else:
            t.update(a_gate_up=A(r, H), b_gate_up=B(E, N1, r))
    if "down" in parts:
        t.update(a_down=A(E, r, I), b_down=B(H, r) if layout == "shared_outer" else B(E, H, r))
    return t


@st.composite
def lora_case(draw):
    E = draw(st.integers(1, 6))
    H, I = draw(DIMS), draw(DIMS)
    act = draw(st.sampled_from(["Swiglu", "Situ", "Relu2", "SwigluBias", "Gelu", "Geglu"]))
    gated = act in GATED
    L = make_layer(E, H, I, gated, draw(st.sampled_from(["nvfp4", "bf16"])),
                   draw(st.sampled_from(["gate_first", "up_first"])), seed=draw(st.integers(0, 2)))
    return L, act, draw(st.integers(1, 9)), draw(st.integers(0, 2 ** 16))


@fuzz(1.5)
@given(case=lora_case(), data=st.data())
def test_lora_matches_reference_and_zero_b_equals_base(case, data):
    """Multi-LoRA (per_expert, peft_fused, shared_outer; mixed ranks; scale alpha/r or alpha/sqrt(r)) equals the
    NumPy deltas of SPEC §5; a zero-B adapter and base tokens equal the no-LoRA output bit for bit; loading another
    slot never changes the output."""
    count_example("lora")
    L, act, T, seed = case
    rng = np.random.default_rng(seed)
    reg = good(fp4moe.AdapterRegistry, L.weights, num_slots=data.draw(st.integers(4, 8)))
    R = LoraRef(L.dense)
    for slot in range(2):
        layout = data.draw(st.sampled_from(["per_expert", "peft_fused", "shared_outer"]))
        r = data.draw(st.sampled_from([1, 4, 16, 64]))
        parts = data.draw(st.sampled_from([("gate_up", "down"), ("gate_up",), ("down",)]))
        t = random_adapter(rng, L, layout, r, parts=parts)
        alpha, rs = data.draw(st.sampled_from([1.0, 8.0, 32.0])), data.draw(st.booleans())
        good(reg.load, slot, t, layout=layout, lora_alpha=alpha, use_rslora=rs,
             rank=r if data.draw(st.booleans()) else None)
        R.slots[slot] = (layout, {k: f64(v) for k, v in t.items()}, alpha / (math.sqrt(r) if rs else r))
    zlay = data.draw(st.sampled_from(["per_expert", "peft_fused", "shared_outer"]))
    good(reg.load, 2, random_adapter(rng, L, zlay, 8, zero_b=True), layout=zlay, lora_alpha=16.0)
    x = bf16_array(rng, (T, L.H))
    logits = (rng.standard_normal((T, L.E)) * 2).astype(np.float32)
    k = data.draw(st.integers(1, min(L.E, 3)))
    ids, w, amb = np_route(logits, "Renormalize", k)
    assume(not amb)
    aids = rng.integers(-1, 3, size=T).astype(np.int32)
    kw = dict(routing_logits=logits, top_k=k, routing_method="Renormalize", activation=act)
    y = good(fp4moe.moe, x, L.weights, **kw, adapters=reg, adapter_ids=aids)
    y_ref, _ = np_moe(L.dense, f64(x), ids, w, act, lora=R, adapter_ids=aids)
    assert_close(y, y_ref, "LoRA vs reference")
    y_base = good(fp4moe.moe, x, L.weights, **kw)
    plain = aids < 0
    plain |= aids == 2
    same_bits(y[plain], y_base[plain], "base and zero-B tokens vs no LoRA")
    good(reg.load, data.draw(st.integers(3, reg.num_slots - 1)), random_adapter(rng, L, "peft_fused", 4),
         layout="peft_fused", lora_alpha=4.0)
    same_bits(good(fp4moe.moe, x, L.weights, **kw, adapters=reg, adapter_ids=aids), y, "after loading another slot")


@fuzz(1.0)
@given(data=st.data())
def test_per_expert_parameter_spellings_agree(data):
    """gemm1_alpha / gemm1_beta / gemm1_clamp_limit given as a Python scalar, a NumPy scalar, a list or a float32
    array of the same values give the same bits, and differ from the defaults when the value does."""
    count_example("param_spellings")
    E = data.draw(st.integers(1, 6))
    act = data.draw(st.sampled_from(["Swiglu", "SwigluBias", "Situ", "SwigluStep"]))
    L = make_layer(E, 32, 16, True, data.draw(st.sampled_from(["nvfp4", "bf16"])), "gate_first", seed=14)
    name = data.draw(st.sampled_from(["gemm1_clamp_limit"] if act == "SwigluStep" else
                                     ["gemm1_alpha", "gemm1_beta", "gemm1_clamp_limit"]))
    val = float(np.float32(data.draw(st.floats(0.25, 3.0))))
    rng = np.random.default_rng(data.draw(st.integers(0, 1000)))
    x = bf16_array(rng, (5, 32), 2.0)
    kw = dict(routing_logits=rng.standard_normal((5, E)).astype(np.float32), top_k=1, routing_method="TopK",
              activation=act)
    ys = [good(fp4moe.moe, x, L.weights, **kw, **{name: v})
          for v in (val, np.float32(val), np.float64(val), [val] * E, (val,) * E, np.full(E, val, np.float32))]
    for y in ys[1:]:
        same_bits(y, ys[0], f"{name} spellings")
    y_ref, _ = np_moe(L.dense, f64(x), *np_route(kw["routing_logits"], "TopK", 1)[:2], act,
                      **{name.replace("gemm1_", "").replace("clamp_", ""): np.full(E, val)})
    assert_close(ys[0], y_ref, f"{name}={val}", rtol=4e-3, atol_frac=4e-3)


# ---- moe: bad calls ---------------------------------------------------------------------------------------------

BAD_NAMES = st.sampled_from(["", "softmax", "renormalise", "Renormalize ", "swi glu", "a8", "fp16", "none", "0",
                             "deepseek_v4", "gate-up-down", "\u00e9", "Relu3", "linear2"])
BAD_INTS = st.sampled_from([-1, 11, 99, 2 ** 31, -(2 ** 40)])
NOT_A_NUMBER = st.sampled_from(["1.0", None, [1.0], object(), b"1", 1 + 2j, True])
NOT_AN_INT = st.sampled_from(["2", None, 2.5, [2], object(), True, 2 ** 64, -(2 ** 70), float("nan")])


def noncontig(a):
    """The same values in a view that is not row-major contiguous when a has more than one element (stride 2 along
    the last axis longer than 1)."""
    a = np.asarray(a)
    axes = [i for i in range(a.ndim) if a.shape[i] > 1] or [a.ndim - 1]
    ax = axes[-1]
    idx = [slice(None)] * a.ndim
    idx[ax] = slice(None, None, 2)
    return np.repeat(a, 2, axis=ax)[tuple(idx)]


def wrong_shape(draw, a):
    a = np.asarray(a)
    choice = draw(st.sampled_from(["grow", "shrink", "ndim+", "ndim-"]))
    if choice == "ndim+" or (choice == "shrink" and a.shape[-1] <= 1) or a.ndim == 0:
        return a[None]
    if choice == "ndim-":
        return a.reshape(-1) if a.ndim > 1 else a.reshape(1, -1, 1)
    if choice == "grow":
        return np.concatenate([a, a[..., :1]], axis=-1)
    return np.ascontiguousarray(a[..., :-1])


def other_dtype(draw, a, allowed=()):
    a = np.asarray(a)
    cands = [d for d in (np.float16, np.float64, np.int32, np.int8, np.uint8, np.int16, np.float32, BF16, np.bool_)
             if np.dtype(d) != a.dtype and np.dtype(d) not in [np.dtype(t) for t in allowed]]
    return np.asarray(a, dtype=np.float32).astype(draw(st.sampled_from(cands)))


@st.composite
def base_bad_case(draw):
    """A valid moe call (small, logits or precomputed routing, sometimes LoRA and a shared expert) to mutate."""
    E = draw(st.integers(1, 6))
    H, I = draw(st.sampled_from([16, 32])), draw(st.sampled_from([16, 32]))
    act = draw(st.sampled_from(["Swiglu", "Situ", "Relu", "SwigluBias", "Identity"]))
    L = make_layer(E, H, I, act in GATED, draw(st.sampled_from(["nvfp4", "bf16"])), "gate_first",
                   bias=draw(st.booleans()), seed=1)
    T = draw(st.integers(1, 6))
    rng = np.random.default_rng(draw(st.integers(0, 2 ** 16)))
    method, k, n_group, topk_group, rsf = draw(routing_setup(E))
    x = bf16_array(rng, (T, H))
    kw = dict(top_k=k, routing_method=method, activation=act, routed_scaling_factor=rsf)
    logits = (rng.standard_normal((T, E)) * 2).astype(np.float32)
    if draw(st.booleans()):
        kw.update(routing_logits=logits, n_group=n_group, topk_group=topk_group)
    else:
        ids, w = fp4moe.route(logits, top_k=k, routing_method=method, n_group=n_group, topk_group=topk_group)
        kw.update(topk_ids=ids, topk_weights=w)
    if draw(st.booleans()):
        reg = fp4moe.AdapterRegistry(L.weights, num_slots=4)
        reg.load(0, random_adapter(rng, L, "peft_fused", 4), layout="peft_fused", lora_alpha=8.0)
        kw.update(adapters=reg, adapter_ids=rng.integers(-1, 1, size=T).astype(np.int32))
    if draw(st.booleans()):
        kw["shared_expert"] = make_layer(1, H, 16, act in GATED, "bf16", "up_first", seed=2).weights
    out = sentinel_like((T, H), BF16, draw(st.integers(0, 2 ** 16)))
    return L, x, kw, out


def moe_mutations(draw, L, x, kw, out):
    """One mutation of a valid moe call: (name, mutated x, mutated kw, allowed error arguments, 'same' when the
    variant is legal and must give the base call's bits, or None)."""
    T, H, E, k = x.shape[0], L.H, L.E, kw["top_k"]
    pre = "topk_ids" in kw
    kw = dict(kw)
    kw["out"] = out
    m = draw(st.sampled_from([
        "x_dtype", "x_shape", "x_noncontig", "x_negstride", "x_type", "x_readonly", "weights_type",
        "logits_dtype", "logits_shape", "logits_noncontig", "logits_type", "routing_absent", "routing_both",
        "bias_shape", "bias_dtype", "bias_nan", "topk_ids_range", "topk_ids_dtype", "topk_ids_shape",
        "topk_weights_absent", "topk_ids_absent", "topk_weights_dtype", "topk_ids_int64",
        "top_k_value", "top_k_type", "method_name", "method_int", "method_type", "method_alias", "llama4_k",
        "n_group", "topk_group", "rsf_value", "rsf_type", "activation_name", "activation_int", "activation_gating",
        "activation_alias", "param_shape", "param_dtype", "param_nan", "param_list_bad", "param_type",
        "param_noncontig", "situ_param_nonpositive", "clamp_nonpositive", "param_same_spelling",
        "e_total_small", "e_total_large", "offset_range", "mode_name", "a4_no_scales", "a4_bad_fc2", "a4_bad_fc1",
        "fc_scale_type", "precision_name", "precision_alias", "num_threads_bad", "num_threads_same",
        "gemm_tile_bad", "gemm_tile_same", "budget_bad", "budget_same", "workspace_cpu", "stream_cpu",
        "shared_type", "shared_hidden", "shared_experts", "shared_gating", "shared_param_bad",
        "adapters_type", "ids_without_adapters", "adapters_without_ids", "adapter_ids_shape", "adapter_ids_dtype",
        "adapter_ids_range", "adapter_ids_empty_slot", "adapters_other_shape", "adapter_ids_int64",
        "delta_shape", "delta_dtype", "delta_zero", "act_out_shape", "act_out_dtype", "act_out_readonly",
        "act_out_overlap", "out_dtype", "out_shape", "out_noncontig", "out_readonly", "out_is_x", "out_type",
        "out_f32"]))
    allowed, same = set(), None
    param = draw(st.sampled_from(["gemm1_alpha", "gemm1_beta", "gemm1_clamp_limit"]))
    gated = L.gated
    if m == "x_dtype":
        x = other_dtype(draw, x)
        allowed = {"x"}
    elif m == "x_shape":
        x = wrong_shape(draw, x)
        allowed = {"x", "out", "routing_logits", "topk_ids", "topk_weights", "adapter_ids"}
    elif m == "x_noncontig":
        x, allowed = noncontig(x), {"x"}
    elif m == "x_negstride":
        x, allowed = x[::-1], {"x"}
        if T == 1:
            same = "same"
    elif m == "x_type":
        x, allowed = draw(st.sampled_from([x.tolist(), "x", None, 3.0, object()])), {"x"}
    elif m == "x_readonly":
        x = x.copy()
        x.setflags(write=False)
        same = "same"
    elif m == "weights_type":
        kw["_weights"] = draw(st.sampled_from([L.args, None, "weights", L.weights.native]))
        allowed = {"weights"}
    elif m.startswith("logits") or m in ("routing_absent", "routing_both", "bias_shape", "bias_dtype", "bias_nan"):
        lg = kw.pop("routing_logits", None)
        if lg is None:
            lg = (np.random.default_rng(0).standard_normal((T, E))).astype(np.float32)
            for key in ("topk_ids", "topk_weights"):
                kw.pop(key)
        allowed = {"routing_logits"}
        if m == "logits_dtype":
            lg = other_dtype(draw, lg, allowed=(np.float32, BF16))
        elif m == "logits_shape":
            lg = wrong_shape(draw, lg)
        elif m == "logits_noncontig":
            lg = noncontig(lg) if draw(st.booleans()) else lg[::-1]
            if T == 1 and lg.strides[0] < 0:
                lg = noncontig(lg)
            if lg.size <= 1:  # a single element has no layout to get wrong
                same = "any" if pre else "same"  # logits made here route unlike the base's precomputed ids
        elif m == "logits_type":
            lg = draw(st.sampled_from([lg.tolist(), "logits", 1.0]))
        elif m == "routing_absent":
            lg = None
            allowed = {"routing_logits", "topk_ids", "topk_weights"}
        elif m == "routing_both":
            ids, w = fp4moe.route(lg, top_k=k, routing_method="Renormalize")
            kw.update(topk_ids=ids, topk_weights=w)
            allowed = {"routing_logits", "topk_ids", "topk_weights"}
        else:
            b = np.zeros(E, np.float32)
            if m == "bias_shape":
                b = wrong_shape(draw, b)
            elif m == "bias_dtype":
                b = other_dtype(draw, b)
            else:
                b[draw(st.integers(0, E - 1))] = draw(st.sampled_from([np.nan, np.inf, -np.inf]))
            kw["routing_bias"] = b
            allowed = {"routing_bias"}
        kw["routing_logits"] = lg
    elif m.startswith("topk_") and m not in ("topk_group",):
        if not pre:
            lg = kw.pop("routing_logits")
            kw.pop("routing_bias", None)
            kw["topk_ids"], kw["topk_weights"] = fp4moe.route(lg, top_k=k, routing_method=kw["routing_method"],
                                                              n_group=kw.pop("n_group", 1),
                                                              topk_group=kw.pop("topk_group", 1),
                                                              routed_scaling_factor=kw["routed_scaling_factor"])
            same = None
        ids, w = np.array(kw["topk_ids"]), np.array(kw["topk_weights"])
        if m == "topk_ids_range":
            ids[draw(st.integers(0, T - 1)), draw(st.integers(0, k - 1))] = draw(
                st.sampled_from([-1, E, E + 7, 2 ** 31 - 1, -(2 ** 31)]))
            allowed = {"topk_ids"}
        elif m == "topk_ids_dtype":
            ids = other_dtype(draw, ids, allowed=(np.int32, np.int64))
            allowed = {"topk_ids"}
        elif m == "topk_ids_shape":
            ids = wrong_shape(draw, ids)
            allowed = {"topk_ids", "topk_weights"}
        elif m == "topk_weights_absent":
            w, allowed = None, {"topk_weights"}
        elif m == "topk_ids_absent":
            ids, allowed = None, {"topk_ids"}
        elif m == "topk_weights_dtype":
            w, allowed = other_dtype(draw, w, allowed=(np.float32,)), {"topk_weights"}
        else:  # topk_ids_int64: converted to int32
            ids, same = ids.astype(np.int64), "same"
        kw["topk_ids"], kw["topk_weights"] = ids, w
    elif m == "top_k_value":
        kw["top_k"] = draw(st.sampled_from([0, -1, 65, 2 ** 62, E + 1]))
        allowed = {"top_k", "topk_ids", "topk_weights"}
    elif m == "top_k_type":
        kw["top_k"], allowed = draw(NOT_AN_INT), {"top_k"}
    elif m == "method_name":
        kw["routing_method"], allowed = draw(BAD_NAMES), {"routing_method"}
    elif m == "method_int":
        kw["routing_method"], allowed = draw(BAD_INTS), {"routing_method"}
    elif m == "method_type":
        kw["routing_method"], allowed = draw(st.sampled_from([None, 1.0, [1], object(), b"TopK"])), {"routing_method"}
    elif m == "method_alias":
        name = kw["routing_method"]
        kw["routing_method"] = draw(st.sampled_from([name.upper(), name.lower(), "_".join(name),
                                                     np.int64(METHODS.index(name)),
                                                     getattr(fp4moe.RoutingMethod, name)]))
        same = "same"
    elif m == "llama4_k":
        if k == 1:
            kw["top_k"] = 2
            if pre:
                kw["topk_ids"] = np.zeros((T, 2), np.int32)
                kw["topk_weights"] = np.zeros((T, 2), np.float32)
        kw["routing_method"] = "llama4"
        allowed = {"top_k", "topk_ids"} if E >= 2 else {"top_k"}
        if pre:  # precomputed routing takes no method-specific check: only k <= E matters
            same = "any" if E >= 2 else None
    elif m == "n_group":
        if pre:
            kw["routing_logits"] = np.zeros((T, E), np.float32)
            kw.pop("topk_ids"), kw.pop("topk_weights")
        kw["n_group"] = draw(st.sampled_from([0, -1] + [g for g in range(2, E + 2) if E % g]))
        allowed = {"n_group"}
    elif m == "topk_group":
        divs = [g for g in range(2, E + 1) if E % g == 0 and E // g >= 2]
        if pre or not divs:
            kw["routing_method"], allowed = "bogus", {"routing_method"}
        else:
            g = draw(st.sampled_from(divs))
            kw.update(routing_method="DeepSeekV3", n_group=g, topk_group=draw(st.sampled_from([0, -1, g + 1])),
                      top_k=1)
            allowed = {"topk_group"}
    elif m == "rsf_value":
        kw["routed_scaling_factor"] = draw(st.sampled_from([np.nan, np.inf, -np.inf, 1e39, 10 ** 400]))
        allowed = {"routed_scaling_factor"}
        if pre:
            same = "any"  # not used by precomputed routing
    elif m == "rsf_type":
        kw["routed_scaling_factor"], allowed = draw(NOT_A_NUMBER), {"routed_scaling_factor"}
    elif m == "activation_name":
        kw["activation"], allowed = draw(BAD_NAMES), {"activation"}
    elif m == "activation_int":
        kw["activation"], allowed = draw(BAD_INTS), {"activation"}
    elif m == "activation_gating":
        kw["activation"] = draw(st.sampled_from(["Relu", "Gelu", "Identity"] if gated else ["Swiglu", "Situ", 4]))
        allowed = {"activation"}
    elif m == "activation_alias":
        name = kw["activation"]
        kw["activation"] = draw(st.sampled_from([name.upper(), "_".join(name), ACTIVATIONS.index(name),
                                                 getattr(fp4moe.ActivationType, name)]))
        same = "same"
    elif m.startswith("param") or m in ("situ_param_nonpositive", "clamp_nonpositive"):
        v = np.ones(E, np.float32)
        allowed = {param}
        if m == "param_shape":
            v = wrong_shape(draw, v)
        elif m == "param_dtype":
            v = other_dtype(draw, v)
        elif m == "param_nan":
            v[draw(st.integers(0, E - 1))] = np.nan
            if param != "gemm1_clamp_limit" and draw(st.booleans()):
                v[-1] = np.inf
        elif m == "param_list_bad":
            v = draw(st.sampled_from([["a"] * E, [[1.0, 2.0]] * E, [None] * E]))
            if v == [None] * E:
                v = ["x"] * E
        elif m == "param_type":
            v = draw(st.sampled_from(["1.0", object(), b"1", True, {"a": 1}]))
        elif m == "param_noncontig":
            v = noncontig(v)
            if E == 1:
                v = np.ones(2, np.float32)[::2]
                same = "any"
        elif m == "situ_param_nonpositive":
            kw["activation"] = "Situ" if gated else "Relu"
            param = draw(st.sampled_from(["gemm1_alpha", "gemm1_beta"]))
            v = np.full(E, draw(st.sampled_from([0.0, -1.0, -np.inf])), np.float32)
            allowed = {param} if gated else {param}
            if not gated:
                same = "any" if draw(st.booleans()) else None
                v[0] = np.nan  # a NaN is refused for every activation
        elif m == "clamp_nonpositive":
            param = "gemm1_clamp_limit"
            v = np.full(E, draw(st.sampled_from([0.0, -1.0, -np.inf])), np.float32)
            allowed = {param}
        else:  # param_same_spelling: scalar, list and array of the same values give the same bits
            val = 0.75 if kw["activation"] != "Situ" else 3.0
            v = draw(st.sampled_from([val, [val] * E, np.full(E, val, np.float32), np.float32(val)]))
            kw[param] = np.full(E, val, np.float32)
            same = ("same_as", param, np.full(E, val, np.float32))
        kw[param] = v
    elif m == "e_total_small":
        kw["num_experts_total"] = draw(st.sampled_from([-1, -5] + ([E - 1] if E > 1 else [])))
        allowed = {"num_experts_total"}
    elif m == "e_total_large":
        kw["num_experts_total"] = E + draw(st.integers(1, 4))
        allowed = {"routing_logits"} if not pre else {"topk_ids"}
        if pre:
            same = "any"  # precomputed ids < E are valid in a larger expert space
    elif m == "offset_range":
        kw["local_expert_offset"] = draw(st.sampled_from([-1, 1, 2 ** 40]))
        allowed = {"local_expert_offset"}
    elif m == "mode_name":
        kw["mode"] = draw(st.one_of(BAD_NAMES, BAD_INTS, st.just(None)))
        allowed = {"mode"}
    elif m == "a4_no_scales":
        kw["mode"] = draw(st.sampled_from(["a4", "w4a4", 1, fp4moe.ActMode.A4]))
        allowed = {"fc1_input_scale", "fc2_input_scale"}
    elif m == "a4_bad_fc2":
        kw.update(mode="a4", fc1_input_scale=0.01, fc2_input_scale=draw(st.sampled_from([0.0, -1.0, np.nan, np.inf])))
        allowed = {"fc2_input_scale"}
    elif m == "a4_bad_fc1":
        kw.update(mode="a4", fc2_input_scale=0.01, fc1_input_scale=draw(st.sampled_from([0.0, -1.0, np.nan, np.inf])))
        allowed = {"fc1_input_scale"}
    elif m == "fc_scale_type":
        name = draw(st.sampled_from(["fc1_input_scale", "fc2_input_scale"]))
        kw.update(mode="a4", fc1_input_scale=0.01, fc2_input_scale=0.01)
        kw[name], allowed = draw(NOT_A_NUMBER), {name}
    elif m == "precision_name":
        kw["precision"] = draw(st.one_of(BAD_NAMES, BAD_INTS, st.just(None)))
        allowed = {"precision"}
    elif m == "precision_alias":
        kw["precision"] = draw(st.sampled_from(["fp32", "FP32", "float32", 0, fp4moe._enums.Precision.Fp32]))
        same = "same"
    elif m == "num_threads_bad":
        kw["num_threads"], allowed = draw(st.sampled_from([-1, 2 ** 31, "2", 1.5, None])), {"num_threads"}
    elif m == "num_threads_same":
        kw["num_threads"], same = draw(st.sampled_from([1, 2, 3, np.int32(2)])), "same"
    elif m == "gemm_tile_bad":
        kw["gemm_tile"], allowed = draw(st.sampled_from([-2, 1000, 2 ** 31, "0", 0.5])), {"gemm_tile"}
    elif m == "gemm_tile_same":
        kw["gemm_tile"], same = draw(st.sampled_from([-1, 0, 1])), "same"
    elif m == "budget_bad":
        kw["workspace_budget"], allowed = draw(st.sampled_from([-1, 2 ** 63, "1", 1.5])), {"workspace_budget"}
    elif m == "budget_same":
        kw["workspace_budget"], same = draw(st.sampled_from([0, 1 << 20, 1])), "same"
    elif m == "workspace_cpu":
        kw["workspace"], allowed = np.zeros(draw(st.sampled_from([0, 1024])), np.uint8), {"workspace"}
    elif m == "stream_cpu":  # the CPU backend takes no stream
        kw["stream"], same = draw(st.sampled_from([0, 12345, None])), "same"
    elif m.startswith("shared"):
        allowed = {"shared_expert"}
        if m == "shared_type":
            kw["shared_expert"] = draw(st.sampled_from([L.args, "shared", 1, L.weights.native]))
        elif m == "shared_hidden":
            kw["shared_expert"] = make_layer(1, 2 * H, 16, gated, "bf16", "gate_first", seed=3).weights
        elif m == "shared_experts":
            kw["shared_expert"] = make_layer(2, H, 16, gated, "bf16", "gate_first", seed=3).weights
        elif m == "shared_gating":
            kw["shared_expert"] = make_layer(1, H, 16, not gated, "bf16", "gate_first", seed=3).weights
        else:
            kw.setdefault("shared_expert", make_layer(1, H, 16, gated, "bf16", "gate_first", seed=3).weights)
            name = draw(st.sampled_from(["shared_alpha", "shared_beta", "shared_clamp_limit"]))
            bad = {"shared_clamp_limit": [np.nan, -1.0, "7"]}.get(name, [np.nan, np.inf, "1", None])
            kw[name] = draw(st.sampled_from(bad))
            allowed = {name}
            if kw[name] is None:
                kw[name], same = None, "any"
    elif m.startswith("adapter") or m in ("ids_without_adapters",):
        if "adapters" not in kw:
            reg = fp4moe.AdapterRegistry(L.weights, num_slots=4)
            reg.load(0, random_adapter(np.random.default_rng(1), L, "peft_fused", 2), layout="peft_fused",
                     lora_alpha=2.0)
            kw.update(adapters=reg, adapter_ids=np.zeros(T, np.int32))
        aids = np.array(kw["adapter_ids"])
        allowed = {"adapter_ids"}
        if m == "adapters_type":
            kw["adapters"], allowed = draw(st.sampled_from([kw["adapters"].native, "reg", 0, L.weights])), {"adapters"}
        elif m == "ids_without_adapters":
            kw.pop("adapters")
        elif m == "adapters_without_ids":
            kw.pop("adapter_ids")
        elif m == "adapter_ids_shape":
            kw["adapter_ids"] = wrong_shape(draw, aids)
        elif m == "adapter_ids_dtype":
            kw["adapter_ids"] = other_dtype(draw, aids, allowed=(np.int32, np.int64))
        elif m == "adapter_ids_range":
            aids[draw(st.integers(0, T - 1))] = draw(st.sampled_from([-2, 4, 2 ** 31 - 1, -(2 ** 31)]))
            kw["adapter_ids"] = aids
        elif m == "adapter_ids_empty_slot":
            aids[draw(st.integers(0, T - 1))] = draw(st.sampled_from([1, 2, 3]))
            kw["adapter_ids"] = aids
        elif m == "adapters_other_shape":
            other = make_layer(E, H, 32 if L.I == 16 else 16, gated, "bf16", "gate_first", seed=4)
            reg = fp4moe.AdapterRegistry(other.weights, num_slots=4)
            reg.load(0, random_adapter(np.random.default_rng(2), other, "peft_fused", 2), layout="peft_fused",
                     lora_alpha=2.0)
            kw["adapters"], allowed = reg, {"adapters"}
        else:  # adapter_ids_int64: converted to int32 (the registry may be new: compare with int32 ids)
            kw["adapter_ids"], same = aids.astype(np.int64), ("same_as", "adapter_ids", aids)
    elif m.startswith("delta"):
        N1 = L.N1
        d = np.zeros((T, k, N1), BF16)
        allowed = {"gate_up_lora_delta"}
        if m == "delta_shape":
            d = wrong_shape(draw, d)
        elif m == "delta_dtype":
            d = other_dtype(draw, d)
        else:
            same = "same"
        kw["gate_up_lora_delta"] = d
    elif m.startswith("act_out"):
        a = sentinel_like((T, k, L.I), BF16, 7)
        allowed = {"activation_out"}
        if m == "act_out_shape":
            a = wrong_shape(draw, a)
        elif m == "act_out_dtype":
            a = sentinel_like((T, k, L.I), draw(st.sampled_from([np.float32, np.float16, np.uint16])), 7)
        elif m == "act_out_readonly":
            a.setflags(write=False)
        else:
            n = max(T * H, T * k * L.I)
            buf = sentinel_like((n,), BF16, 9)
            kw["out"] = out = buf[: T * H].reshape(T, H)
            a = buf[: T * k * L.I].reshape(T, k, L.I)
        kw["activation_out"] = a
    elif m.startswith("out"):
        allowed = {"out"}
        if m == "out_dtype":
            o = sentinel_like((T, H), draw(st.sampled_from([np.float16, np.int16, np.uint16, np.int32])), 5)
        elif m == "out_shape":
            o = sentinel_like(wrong_shape(draw, out).shape, BF16, 5)
        elif m == "out_noncontig":
            o = noncontig(out)
        elif m == "out_readonly":
            o = out.copy()
            o.setflags(write=False)
        elif m == "out_is_x":
            o = x
            if not x.flags.writeable:
                x = x.copy()
                o = x
        elif m == "out_type":
            o = draw(st.sampled_from([out.tolist(), "out", 0]))
        else:  # out_f32: the fp32 sum, which rounds to the bf16 output
            o = sentinel_like((T, H), np.float32, 5)
            same = "f32"
        kw["out"] = out = o
    return m, x, kw, allowed, same


@fuzz(8.0)
@given(case=base_bad_case(), data=st.data())
def test_moe_bad_argument_raises_named_error_and_leaves_out(case, data):
    """One bad argument of a valid moe call (dtype, shape, stride, type, range, enum name or int, optional argument
    present/absent/wrong) raises Fp4MoeError naming that argument, with out, activation_out and the inputs
    byte-identical; a legal variant (alias, int64 ids, scalar vs list, float32 out, ...) gives the base bits."""
    count_example("moe_bad")
    L, x, kw, out = case
    base = good(fp4moe.moe, x, L.weights, **{k: v for k, v in kw.items()})
    m, x2, kw2, allowed, same = moe_mutations(data.draw, L, x, kw, out)
    note(f"mutation {m}")
    weights = kw2.pop("_weights", L.weights)
    watch = [kw2.get("out"), kw2.get("activation_out"), x2 if isinstance(x2, np.ndarray) else None,
             kw2.get("routing_logits") if isinstance(kw2.get("routing_logits"), np.ndarray) else None]

    def accept(y):
        if same is None:
            raise AssertionError(f"mutation {m}: accepted a bad call")
        if same == "any":
            return
        if same == "f32":
            same_bits(np.asarray(y).astype(BF16), base, m)
        elif isinstance(same, tuple):
            kb = dict(kw2, out=None)
            kb[same[1]] = same[2]
            same_bits(np.asarray(y), good(fp4moe.moe, x, L.weights, **kb), m)
        else:
            same_bits(np.asarray(y), base, m)

    call_bad(fp4moe.moe, allowed, watch=watch, accept=accept, x=x2, weights=weights, **kw2)


# ---- prepare_weights / prepare_bf16_weights / quantize_weights: bad calls ------------------------------------

@st.composite
def prepare_case(draw):
    E, H, I = draw(st.integers(1, 4)), draw(DIMS), draw(DIMS)
    gated = draw(st.booleans())
    fmt = draw(st.sampled_from(["nvfp4", "bf16"]))
    L = make_layer(E, H, I, gated, fmt, "gate_first", bias=draw(st.booleans()), seed=6)
    return L


def moe_bits(weights, L, seed=0):
    rng = np.random.default_rng(seed)
    x = bf16_array(rng, (3, L.H))
    logits = rng.standard_normal((3, L.E)).astype(np.float32)
    return fp4moe.moe(x, weights, routing_logits=logits, top_k=1, routing_method="Renormalize",
                      activation="Swiglu" if L.gated else "Relu")


@fuzz(4.0)
@given(L=prepare_case(), data=st.data())
def test_prepare_bad_argument_raises_named_error(L, data):
    """One bad argument of prepare_weights / prepare_bf16_weights raises Fp4MoeError naming a parameter; legal
    variants (strided views, aliases of enum names, device='cpu') prepare the same weights (same moe bits)."""
    count_example("prepare_bad")
    draw = data.draw
    args = {k: v for k, v in L.args.items()}
    kw = dict(L.kw)
    fn = L.prepare
    nv = L.fmt == "nvfp4"
    tensors = [k for k, v in args.items() if v is not None] + ["bias1", "bias2"]
    m = draw(st.sampled_from(["tensor_dtype", "tensor_shape", "tensor_type", "tensor_noncontig", "scale_nan",
                              "scale2_value", "bias_nan", "order_missing", "order_bad", "order_alias",
                              "activation_bad", "gated_contradicts", "layout_bad", "device_bad", "device_cpu",
                              "experts_mismatch"]))
    name = draw(st.sampled_from(tensors))
    allowed, same = {name}, None
    derived = {"w1", "w1_scale", "w2", "w2_scale", "w1_scale2", "w2_scale2", "bias1", "bias2"}
    if m == "tensor_dtype":
        v = args.get(name)
        if v is None:
            v = np.zeros((L.E, L.N1 if name == "bias1" else L.H), np.float32)
        ok = {"w1_scale": (E4M3, np.uint8), "w2_scale": (E4M3, np.uint8), "bias1": (np.float32, BF16),
              "bias2": (np.float32, BF16), "w1": (np.uint8,) if nv else (BF16,), "w2": (np.uint8,) if nv else (BF16,)}
        args[name] = other_dtype(draw, v, allowed=ok.get(name, (np.float32,)))
    elif m == "tensor_shape":
        v = args.get(name)
        if v is None:
            v = np.zeros((L.E, L.N1 if name == "bias1" else L.H), np.float32)
        args[name] = wrong_shape(draw, v)
        allowed = derived & set(args)
        legal = {(L.E,), (L.E, 1)} | ({(L.E, 2)} if (name == "w1_scale2" and L.gated) else set())
        if name in ("w1_scale2", "w2_scale2") and tuple(args[name].shape) in legal:
            same = "any"  # another accepted layout of the global scales (its values differ)
    elif m == "tensor_type":
        args[name] = draw(st.sampled_from([[1, 2], "w", 1.0, object()]))
    elif m == "tensor_noncontig":
        v = args.get(name)
        if v is None:
            args[name] = noncontig(np.zeros((L.E, L.N1 if name == "bias1" else L.H), np.float32))
        else:
            args[name] = noncontig(v) if (np.asarray(v).ndim and np.asarray(v).shape[-1] > 1) else v
        same = "same"
    elif m == "scale_nan" and nv:
        name = draw(st.sampled_from(["w1_scale", "w2_scale"]))
        s = np.array(args[name]).view(np.uint8).copy()
        s.reshape(-1)[draw(st.integers(0, s.size - 1))] = draw(st.sampled_from([0x7F, 0xFF]))
        args[name], allowed = s.view(E4M3), {name}
    elif m == "scale2_value" and nv:
        name = draw(st.sampled_from(["w1_scale2", "w2_scale2"]))
        s = np.array(args[name], np.float32)
        s.reshape(-1)[draw(st.integers(0, s.size - 1))] = draw(st.sampled_from([0.0, -1.0, np.nan, np.inf]))
        args[name], allowed = s, {name}
    elif m == "bias_nan":
        name = draw(st.sampled_from(["bias1", "bias2"]))
        b = np.zeros((L.E, L.N1 if name == "bias1" else L.H), np.float32)
        b.reshape(-1)[draw(st.integers(0, b.size - 1))] = draw(st.sampled_from([np.nan, np.inf]))
        args[name], allowed = b, {name}
    elif m == "order_missing" and L.gated:
        kw["gate_up_order"], allowed = None, {"gate_up_order"}
    elif m == "order_bad":
        kw["gate_up_order"], allowed = draw(st.one_of(BAD_NAMES, BAD_INTS, st.just(2.0))), {"gate_up_order"}
    elif m == "order_alias":
        kw["gate_up_order"], same = draw(st.sampled_from(["GateFirst", "GATE_FIRST", "gate_up", 0,
                                                          fp4moe.GateUpOrder.GateFirst])), "same"
    elif m == "activation_bad":
        kw["activation"], allowed = draw(st.one_of(BAD_NAMES, BAD_INTS)), {"activation"}
    elif m == "gated_contradicts":
        kw["activation"], allowed = ("Relu" if L.gated else "Swiglu"), {"gated"}
    elif m == "layout_bad" and nv:
        kw["scale_layout"], allowed = draw(st.one_of(BAD_NAMES, BAD_INTS)), {"scale_layout"}
    elif m == "device_bad":
        kw["device"] = draw(st.sampled_from(["gpu", "cuda:x", "cuda:-1", 1.5, "tpu", "cuda:99", 99, object()]))
        allowed = {"device"}
    elif m == "device_cpu":
        kw["device"], same = draw(st.sampled_from(["cpu", "CPU", " cpu "])), "same"
    elif m == "experts_mismatch":
        name = draw(st.sampled_from([k for k, v in args.items() if v is not None and k != "w1"]))
        v = np.asarray(args[name])
        args[name] = np.concatenate([v, v[:1]], axis=0)
        allowed = {name}
    else:
        kw["gate_up_order"], allowed = "sideways", {"gate_up_order"}
    note(f"mutation {m} on {name}")
    watch = [v for v in args.values() if isinstance(v, np.ndarray)]
    ref_bits = moe_bits(L.weights, L)

    def accept(w):
        assert same is not None, f"{fn.__name__} accepted mutation {m} of {name}"
        if same == "same":
            same_bits(moe_bits(w, L), ref_bits, m)

    call_bad(fn, allowed, watch=watch, accept=accept, **args, **kw)


@fuzz(2.0)
@given(data=st.data())
def test_quantize_bad_argument_raises_named_error(data):
    """One bad argument of quantize_weights (non-float or non-finite weights, sizes not multiples of 16, mismatched
    experts, enum names) raises Fp4MoeError naming it; a strided view quantizes like its contiguous copy."""
    count_example("quantize_bad")
    draw = data.draw
    E, H, I = draw(st.integers(1, 3)), draw(DIMS), draw(DIMS)
    gated = draw(st.booleans())
    rng = np.random.default_rng(draw(st.integers(0, 1000)))
    args = dict(w1=rng.standard_normal((E, 2 * I if gated else I, H)).astype(np.float32),
                w2=rng.standard_normal((E, H, I)).astype(np.float32))
    kw = dict(gate_up_order="gate_first", gated=gated)
    m = draw(st.sampled_from(["dtype", "nonfinite", "size16", "ndim", "experts", "type", "format", "layout",
                              "order", "bias_nan", "bias_shape", "noncontig", "per_half_any"]))
    name = draw(st.sampled_from(["w1", "w2"]))
    allowed, same = {name}, None
    if m == "dtype":
        args[name] = args[name].astype(draw(st.sampled_from([np.int32, np.uint8, np.bool_, np.complex64])))
    elif m == "nonfinite":
        args[name].reshape(-1)[draw(st.integers(0, args[name].size - 1))] = draw(st.sampled_from([np.nan, np.inf]))
    elif m == "size16":
        cut = draw(st.integers(1, 15))
        if name == "w1":
            args["w1"], args["w2"] = args["w1"][..., :-cut], args["w2"][:, :-cut]
        else:
            args["w2"] = args["w2"][..., :-cut]
            args["w1"] = args["w1"][:, : (2 * (I - cut) if gated else I - cut)]
        allowed = {"w1", "w2"}
    elif m == "ndim":
        args[name] = args[name][0]
        allowed = {"w1", "w2"}
    elif m == "experts":
        args["w2"] = np.concatenate([args["w2"], args["w2"][:1]])
        allowed = {"w2"}
    elif m == "type":
        args[name] = draw(st.sampled_from([[[[1.0]]], "w", None, 3.0]))
    elif m in ("format", "layout", "order"):
        key = {"format": "format", "layout": "scale_layout", "order": "gate_up_order"}[m]
        kw[key], allowed = draw(st.one_of(BAD_NAMES, BAD_INTS, st.just(None) if key != "gate_up_order" or not gated
                                          else st.just(None))), {key}
        if kw[key] is None and (key != "gate_up_order" or not gated):
            kw[key] = "nope"
    elif m in ("bias_nan", "bias_shape"):
        name = draw(st.sampled_from(["bias1", "bias2"]))
        b = np.zeros((E, args["w1"].shape[1] if name == "bias1" else H), np.float32)
        if m == "bias_nan":
            b.reshape(-1)[0] = np.nan
        else:
            b = wrong_shape(draw, b)
        args[name], allowed = b, {name}
    elif m == "noncontig":
        args[name] = noncontig(args[name])
        same = "same"
    else:
        kw["per_half_scale2"], same = draw(st.sampled_from([1, "yes", None])), "any"
    ref = fp4moe.quantize_weights(**{k: np.ascontiguousarray(v) if isinstance(v, np.ndarray) and
                                     v.dtype == np.float32 else v for k, v in args.items()},
                                  **kw) if same == "same" else None

    def accept(q):
        assert same is not None, f"quantize_weights accepted mutation {m} of {name}"
        if ref is not None:
            for key in ref:
                same_bits(np.asarray(q[key]), np.asarray(ref[key]), f"{m}: {key}")

    call_bad(fp4moe.quantize_weights, allowed, watch=[v for v in args.values() if isinstance(v, np.ndarray)],
             accept=accept, **args, **kw)


# ---- AdapterRegistry ----------------------------------------------------------------------------------------------

LOAD_PARAMS = {"slot", "tensors", "layout", "rank", "lora_alpha", "use_rslora"}
ADAPTER_KEYS = {"a_gate", "a_up", "b_gate", "b_up", "a_gate_up", "b_gate_up", "a_down", "b_down", "shared_a_gate_up",
                "shared_b_gate_up", "shared_a_down", "shared_b_down"}


@fuzz(4.0)
@given(data=st.data())
def test_adapter_registry_bad_calls_leave_registry_as_it_was(data):
    """A bad AdapterRegistry(...), load(...) or unload(...) raises Fp4MoeError naming a parameter or a tensor key;
    after a failed load or unload the registry gives the same output bits as before."""
    count_example("registry_bad")
    draw = data.draw
    E, H, I = draw(st.integers(1, 4)), draw(st.sampled_from([16, 32])), draw(st.sampled_from([16, 32]))
    gated = draw(st.booleans())
    L = make_layer(E, H, I, gated, draw(st.sampled_from(["nvfp4", "bf16"])), "gate_first", seed=7)
    rng = np.random.default_rng(draw(st.integers(0, 1000)))
    where = draw(st.sampled_from(["ctor", "load", "unload"]))
    if where == "ctor":
        m = draw(st.sampled_from(["weights", "num_slots", "shared"]))
        kw = dict(weights=L.weights, num_slots=4)
        if m == "weights":
            kw["weights"] = draw(st.sampled_from([L.args, None, L.weights.native, "w"]))
        elif m == "num_slots":
            kw["num_slots"] = draw(st.sampled_from([0, -1, 10 ** 6, 2 ** 40, "4", 2.5, None]))
        else:
            kw["shared_expert"] = draw(st.sampled_from(
                [L.args, make_layer(1, 2 * H, 16, gated, "bf16", "gate_first", seed=3).weights,
                 make_layer(2, H, 16, gated, "bf16", "gate_first", seed=3).weights]))
            m = "shared_expert"
        call_bad(fp4moe.AdapterRegistry.__init__, {m}, extra_names=set(),
                 **dict(self=object.__new__(fp4moe.AdapterRegistry), **kw))
        return
    reg = fp4moe.AdapterRegistry(L.weights, num_slots=4)
    layout = draw(st.sampled_from(["per_expert", "peft_fused", "shared_outer"]))
    r = draw(st.sampled_from([2, 8]))
    t0 = random_adapter(rng, L, layout, r)
    reg.load(0, t0, layout=layout, lora_alpha=4.0)
    x = bf16_array(rng, (4, H))
    logits = rng.standard_normal((4, E)).astype(np.float32)
    run = lambda: fp4moe.moe(x, L.weights, routing_logits=logits, top_k=1, routing_method="TopK",
                             activation="Swiglu" if gated else "Relu", adapters=reg,
                             adapter_ids=np.array([0, -1, 0, 0], np.int32))
    before = run()
    if where == "unload":
        slot = draw(st.sampled_from([1, 3, 4, -1, 2 ** 31, "0", None, 0.5]))
        call_bad(reg.unload, {"slot"}, slot=slot)
        same_bits(run(), before, "after a failed unload")
        return
    t = dict(random_adapter(rng, L, layout, r))
    kw = dict(slot=0, layout=layout, lora_alpha=2.0)
    m = draw(st.sampled_from(["dtype", "shape", "missing_pair", "unknown_key", "wrong_layout_key", "slot", "layout",
                              "rank", "alpha", "tensors_type", "shared_without_expert", "type", "noncontig"]))
    key = draw(st.sampled_from(sorted(t)))
    allowed = {key}
    if m == "dtype":
        t[key] = other_dtype(draw, t[key], allowed=(BF16,))
    elif m == "shape":
        t[key] = wrong_shape(draw, t[key])
        allowed = set(t) | {"rank"}
    elif m == "missing_pair":
        partner = {"a": "b", "b": "a"}[key[0]] + key[1:]
        t.pop(key)
        allowed = {key, partner} | ({"a_gate", "a_up", "b_gate", "b_up"} if layout == "per_expert" else set())
        if not any(k.startswith("a_") for k in t):
            allowed |= {"rank"}
    elif m == "unknown_key":
        key = draw(st.sampled_from(["a_gateup", "lora_A", "A", "b_down_proj"]))
        t[key], allowed = t[sorted(t)[0]], {key}
    elif m == "wrong_layout_key":
        other = {"per_expert": "a_gate_up", "peft_fused": "a_gate", "shared_outer": "a_up"}[layout]
        t[other] = bf16_array(rng, (E, r, H))
        partner = "b" + other[1:]
        t[partner] = bf16_array(rng, (E, L.N1 if other == "a_gate_up" else I, r))
        allowed = {other, partner, "a_gate", "a_up", "b_gate", "b_up", "a_gate_up", "b_gate_up"}
    elif m == "slot":
        kw["slot"], allowed = draw(st.sampled_from([-1, 4, 2 ** 31, "0", None, 0.5])), {"slot"}
    elif m == "layout":
        kw["layout"], allowed = draw(st.one_of(BAD_NAMES, BAD_INTS)), {"layout"}
    elif m == "rank":
        kw["rank"], allowed = draw(st.sampled_from([0, -1, 65, r + 1, "2", 2.5])), {"rank"} | set(t)
    elif m == "alpha":
        kw["lora_alpha"], allowed = draw(st.sampled_from([None, np.nan, np.inf, "2", 1e39])), {"lora_alpha"}
    elif m == "tensors_type":
        t, allowed = draw(st.sampled_from([5, "a_down", [("a_down", 1)]])), {"tensors"}
    elif m == "shared_without_expert":
        t["shared_a_down"], t["shared_b_down"] = bf16_array(rng, (r, 16)), bf16_array(rng, (H, r))
        allowed = {"shared_a_down", "shared_b_down"}
    elif m == "type":
        t[key] = draw(st.sampled_from([[1.0], "a", 1.0, object()]))
        allowed = {key} | ({"rank"} if key.startswith("a") else set())
    else:  # a strided adapter tensor loads like its contiguous copy
        t[key] = noncontig(t[key])
        allowed = {key}
    note(f"load mutation {m} on {key}")

    def accept(_):
        assert m == "noncontig", f"load accepted mutation {m} of {key}"
        reg.load(1, {k: np.ascontiguousarray(v) for k, v in t.items()}, layout=layout, lora_alpha=2.0)
        ids1 = np.array([0, -1, 0, 0], np.int32)
        y0 = fp4moe.moe(x, L.weights, routing_logits=logits, top_k=1, routing_method="TopK",
                        activation="Swiglu" if gated else "Relu", adapters=reg, adapter_ids=ids1)
        y1 = fp4moe.moe(x, L.weights, routing_logits=logits, top_k=1, routing_method="TopK",
                        activation="Swiglu" if gated else "Relu", adapters=reg, adapter_ids=ids1 * 0 + 1)
        same_bits(y0[[0, 2, 3]], y1[[0, 2, 3]], "strided vs contiguous adapter")

    slot = kw.pop("slot")
    if isinstance(t, dict):
        e = call_bad(lambda slot, tensors, layout, lora_alpha, rank=None, use_rslora=False:
                     reg.load(slot, tensors, layout=layout, lora_alpha=lora_alpha, rank=rank, use_rslora=use_rslora),
                     allowed, extra_names=ADAPTER_KEYS | set(t),
                     watch=[v for v in t.values() if isinstance(v, np.ndarray)],
                     accept=accept, slot=slot, tensors=t, **kw)
    else:
        e = call_bad(lambda slot, tensors, layout, lora_alpha: reg.load(slot, tensors, layout=layout,
                                                                       lora_alpha=lora_alpha),
                     allowed, slot=slot, tensors=t, **kw)
    if e is not None:
        same_bits(run(), before, "after a failed load")


# ---- workspace_size, enums --------------------------------------------------------------------------------

@fuzz(1.0)
@given(data=st.data())
def test_workspace_size_checks_its_arguments(data):
    """workspace_size returns a non-negative int (0 on the CPU backend) that does not decrease with num_tokens, or
    raises Fp4MoeError naming a parameter for a bad enum name or a non-integer size."""
    count_example("workspace_size")
    L = make_layer(2, 32, 16, True, "nvfp4", "gate_first", seed=8)
    draw = data.draw
    T = draw(st.integers(0, 5000))
    good_kw = dict(activation=draw(st.sampled_from([None, "swiglu", 10, fp4moe.ActivationType.Situ])),
                   mode=draw(st.sampled_from(["a16", "w4a16", 0])))
    n0 = good(fp4moe.workspace_size, L.weights, T, 2, **good_kw)
    n1 = good(fp4moe.workspace_size, L.weights, T + draw(st.integers(0, 100)), 2, **good_kw)
    assert isinstance(n0, int) and 0 <= n0 <= n1
    if L.weights.device == "cpu":
        assert n0 == n1 == 0
    name = draw(st.sampled_from(["activation", "mode", "num_tokens", "top_k", "max_lora_rank", "workspace_budget",
                                 "n_group", "num_experts_total", "weights", "shared_expert"]))
    kw = dict(weights=L.weights, num_tokens=T, top_k=2)
    kw[name] = {"activation": draw(st.one_of(BAD_NAMES, BAD_INTS)), "mode": draw(st.one_of(BAD_NAMES, BAD_INTS)),
                "weights": draw(st.sampled_from([L.args, None, "w"])),
                "shared_expert": draw(st.sampled_from([L.args, "s", 1]))}.get(name, draw(NOT_AN_INT))
    if kw[name] is None and name not in ("weights",):
        kw[name] = "none"
    call_bad(fp4moe.workspace_size, {name}, **kw)


ENUM_CASES = [("routing_method", fp4moe.RoutingMethod), ("activation", fp4moe.ActivationType),
              ("mode", fp4moe.ActMode), ("precision", fp4moe._enums.Precision)]


def _norm(s):
    return s.replace("_", "").replace("-", "").lower()


@fuzz(2.0)
@given(data=st.data())
def test_moe_enum_arguments_parse_or_raise(data):
    """Any string or int given for moe's enum arguments either names a member (any case, with or without '_' or
    '-', or a documented alias) and gives that member's bits, or raises Fp4MoeError naming the argument."""
    count_example("enums")
    draw = data.draw
    L = make_layer(4, 16, 16, True, "bf16", "gate_first", seed=9)
    arg, cls = draw(st.sampled_from(ENUM_CASES))
    members = {m.name: m for m in cls}
    choice = draw(st.sampled_from(["name", "garbage", "int"]))
    if choice == "name":
        mem = draw(st.sampled_from(list(members)))
        v = "".join(draw(st.sampled_from([c.upper(), c.lower(), c + "_", "-" + c])) for c in mem)
    elif choice == "garbage":
        v = draw(st.text(alphabet="abcdefghijklmnopqrstuvwxyzAEIOU_- 0123456789", max_size=14))
    else:
        v = draw(st.integers(-3, 14))
    expect = None
    if isinstance(v, int):
        expect = cls(v) if v in [int(m) for m in cls] else None
    else:
        aliases = {"mode": fp4moe._enums.MODE_ALIASES, "precision": fp4moe._enums.PRECISION_ALIASES}.get(arg, {})
        for mem in cls:
            if _norm(mem.name) == _norm(v):
                expect = mem
        if _norm(v) in aliases:
            expect = cls(aliases[_norm(v)])
    defaults = dict(routing_method="Renormalize", activation="Swiglu", mode="a16", precision="fp32")
    if arg == "routing_method" and expect == fp4moe.RoutingMethod.Llama4:
        top_k = 1
    else:
        top_k = 2
    rng = np.random.default_rng(0)
    x, logits = bf16_array(rng, (3, 16)), rng.standard_normal((3, 4)).astype(np.float32)
    kw = dict(defaults, routing_logits=logits, top_k=top_k, fc1_input_scale=0.01, fc2_input_scale=0.01)
    bad_for_layer = expect is not None and arg == "activation" and expect.name not in GATED
    note(f"{arg}={v!r} -> {expect}")
    if expect is None or bad_for_layer:
        call_bad(fp4moe.moe, {arg}, x=x, weights=L.weights, **dict(kw, **{arg: v}))
        return
    y = good(fp4moe.moe, x, L.weights, **dict(kw, **{arg: v}))
    same_bits(y, good(fp4moe.moe, x, L.weights, **dict(kw, **{arg: expect})), f"{arg}={v!r}")


# ---- regressions found by the fuzzer ------------------------------------------------------------------------------

SMALL = make_layer(2, 32, 16, True, "nvfp4", "gate_first", seed=11)
SMALL_X = bf16_array(np.random.default_rng(1), (3, 32))
SMALL_LOGITS = np.random.default_rng(2).standard_normal((3, 2)).astype(np.float32)


@pytest.mark.parametrize("name,value", [
    ("top_k", None), ("top_k", "2"), ("top_k", 2.5), ("top_k", 2 ** 64), ("n_group", "1"), ("topk_group", None),
    ("routed_scaling_factor", "x"), ("routed_scaling_factor", 10 ** 400), ("routed_scaling_factor", None),
    ("num_experts_total", 1.5), ("local_expert_offset", "0"), ("num_threads", 2 ** 40), ("gemm_tile", "a"),
    ("workspace_budget", 2 ** 64), ("fc1_input_scale", "0.1"), ("shared_alpha", "a"), ("gemm1_alpha", ["a", "b"]),
    ("gemm1_beta", [[1.0, 2.0], [3.0]]),
])
def test_moe_scalar_argument_of_wrong_type_is_named(name, value):
    """A scalar argument of the wrong type or out of the native range raises Fp4MoeError naming it (it used to raise
    TypeError / ValueError / OverflowError from int() / float() or the binding, or to truncate 2.5 and '2' silently)."""
    out = sentinel_like((3, 32), BF16, 3)
    kw = dict(routing_logits=SMALL_LOGITS, top_k=1, routing_method="Renormalize", activation="swiglu", out=out)
    if name == "shared_alpha":
        kw["shared_expert"] = make_layer(1, 32, 16, True, "bf16", "gate_first", seed=3).weights
    kw[name] = value
    call_bad(fp4moe.moe, {name}, watch=[out], x=SMALL_X, weights=SMALL.weights, **kw)


@pytest.mark.parametrize("call,name", [
    (lambda: fp4moe.AdapterRegistry(SMALL.weights, num_slots="x"), "num_slots"),
    (lambda: fp4moe.AdapterRegistry(SMALL.weights, num_slots=2 ** 40), "num_slots"),
    (lambda: fp4moe.AdapterRegistry(SMALL.weights, num_slots=4).unload("x"), "slot"),
    (lambda: fp4moe.AdapterRegistry(SMALL.weights, num_slots=4).unload(None), "slot"),
    (lambda: fp4moe.AdapterRegistry(SMALL.weights, num_slots=4).unload(2 ** 40), "slot"),
    (lambda: fp4moe.AdapterRegistry(SMALL.weights, num_slots=4).loaded("0"), "slot"),
    (lambda: fp4moe.AdapterRegistry(SMALL.weights, num_slots=4).load(0, 5, lora_alpha=1.0), "tensors"),
    (lambda: fp4moe.AdapterRegistry(SMALL.weights, num_slots=4).load(0, lora_alpha="x"), "lora_alpha"),
    (lambda: fp4moe.AdapterRegistry(SMALL.weights, num_slots=4).load(0, rank="x", lora_alpha=1.0), "rank"),
    (lambda: fp4moe.workspace_size(SMALL.weights, 4, 2, activation="nope"), "activation"),
    (lambda: fp4moe.workspace_size(SMALL.weights, "x", 2), "num_tokens"),
    (lambda: fp4moe.route(SMALL_LOGITS, top_k=None, routing_method=1), "top_k"),
    (lambda: fp4moe.route(SMALL_LOGITS, top_k=2 ** 40, routing_method=1), "top_k"),
    (lambda: fp4moe.prepare_weights(**dict(SMALL.args, w1=SMALL.args["w1"][:, :, :4].copy(),
                                           w1_scale=SMALL.args["w1_scale"][:, :, :0].copy()),
                                    gate_up_order="gate_first"), "w1"),
    (lambda: fp4moe.prepare_weights(**{k: v[:0] if v is not None else None for k, v in SMALL.args.items()},
                                    gate_up_order="gate_first"), "w1"),
    (lambda: fp4moe.prepare_bf16_weights(np.zeros((2, 32, 8), BF16), np.zeros((2, 8, 16), BF16),
                                         gate_up_order="gate_first"), "w1"),
])
def test_other_calls_name_the_bad_argument(call, name):
    """Bad scalars of AdapterRegistry / workspace_size / route, and sizes that prepare_weights derives from a tensor,
    raise Fp4MoeError naming the Python parameter (not TypeError, nor the C++ field 'hidden' / 'num_experts')."""
    with pytest.raises(Fp4MoeError) as ei:
        call()
    assert ei.value.argument == name, str(ei.value)


def test_shared_expert_parameter_given_alone_keeps_the_other_defaults():
    """A shared expert's activation parameter given alone keeps the activation's defaults for the others (SiTU's
    beta = 1 instead of a refused 0; SwigluBias' beta = 1 and limit 7 instead of 0 and none)."""
    rng = np.random.default_rng(4)
    L = make_layer(2, 32, 16, True, "bf16", "gate_first", seed=12)
    S = make_layer(1, 32, 16, True, "bf16", "gate_first", seed=13)
    x = bf16_array(rng, (4, 32), 3.0)
    logits = rng.standard_normal((4, 2)).astype(np.float32)
    for act, given_kw, full in (("Situ", dict(shared_alpha=4.0), dict(shared_alpha=4.0, shared_beta=1.0)),
                                ("SwigluBias", dict(shared_alpha=1.702),
                                 dict(shared_alpha=1.702, shared_beta=1.0, shared_clamp_limit=7.0))):
        kw = dict(routing_logits=logits, top_k=1, routing_method="TopK", activation=act, shared_expert=S.weights)
        y = fp4moe.moe(x, L.weights, **kw, **given_kw)
        same_bits(y, fp4moe.moe(x, L.weights, **kw, **full), act)
        if act == "SwigluBias":  # 1.702 is its default alpha: the same as giving none
            same_bits(y, fp4moe.moe(x, L.weights, **kw), act + " (all defaults)")


def test_renamed_error_survives_pickling():
    """An error whose argument the Python layer renamed keeps that name through pickling."""
    import pickle
    with pytest.raises(Fp4MoeError) as ei:
        fp4moe.prepare_bf16_weights(np.zeros((2, 32, 8), BF16), np.zeros((2, 8, 16), BF16), gate_up_order="gate_first")
    e = pickle.loads(pickle.dumps(ei.value))
    assert e.argument == "w1" and e.cpp_argument == "hidden" and str(e) == str(ei.value)


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
