"""The fuzz tests' layers, calls and strategies (test_fuzz_*.py): prepared layers with their dense reference, a
good call and a bad one (which must raise Fp4MoeError naming an argument and change nothing), and the hypothesis
strategies that draw a routing, activation parameters, a whole moe call and a LoRA case.
"""
from __future__ import annotations

import functools
import inspect
import math
import sys

import hypothesis
import numpy as np

from hypothesis import assume, note
from hypothesis import strategies as st

from fuzz_support import (ACTIVATIONS, BF16, Dense, E4M3, FIG, Fp4MoeError, GATED, METHODS, decode_fp4, f64, fp4moe,
                          np_route, np_swizzle)


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
