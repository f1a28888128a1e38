"""The Python API on the CPU backend, against a small independent NumPy implementation of SPEC §3/§5
(numpy_moe.py; dense: every expert computed for every token, then masked by the routing weights).

Runs against the extension found by the package: an installed wheel, or a CMake build with
-DFP4MOE_BUILD_PYTHON=ON in $FP4MOE_BUILD_DIR (default <repo>/build). Skips, saying so, when none is built.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

pytest.importorskip("ml_dtypes", reason="ml_dtypes is needed for NumPy bfloat16")

from fp4moe_under_test import import_fp4moe  # noqa: E402
from numpy_moe import (BF16, E4M3, GATED, assert_close, decode_nvfp4, np_combine, np_expert_outputs,  # noqa: E402
                       np_route)


fp4moe = import_fp4moe()


# ---- fixtures --------------------------------------------------------------------------------------------

def make_dense(rng, E, H, I, gated=True):
    N1 = 2 * I if gated else I
    w1 = (rng.standard_normal((E, N1, H)) / math.sqrt(H)).astype(np.float32)
    w2 = (rng.standard_normal((E, H, I)) / math.sqrt(I)).astype(np.float32)
    return w1, w2


def rand_x(rng, T, H):
    return rng.standard_normal((T, H)).astype(np.float32).astype(BF16)


def quantized(rng, E, H, I, gated=True, order="gate_first", **kw):
    w1, w2 = make_dense(rng, E, H, I, gated)
    act = "swiglu" if gated else "relu2"
    q = fp4moe.quantize_weights(w1, w2, gate_up_order=order, activation=act, **kw)
    return q


def values_of(q):
    """Decoded W1, W2 values (without global scales) of quantize_weights' output, via the test's decoder."""
    return decode_nvfp4(q["w1"], q["w1_scale"]), decode_nvfp4(q["w2"], q["w2_scale"])


# ---- enums, build info, tensors ---------------------------------------------------------------------------

def test_enum_values_are_flashinfer_0_6_18():
    assert {m.name: int(m) for m in fp4moe.RoutingMethod} == {
        "Default": 0, "Renormalize": 1, "DeepSeekV3": 2, "Llama4": 3, "RenormalizeNaive": 4, "TopK": 5,
        "SigmoidRenorm": 6, "MiniMax2": 7, "Sigmoid": 8, "TopKSigmoid": 9}
    assert {m.name: int(m) for m in fp4moe.ActivationType} == {
        "Gelu": 0, "Relu": 1, "Silu": 2, "Swiglu": 3, "Geglu": 4, "SwigluBias": 5, "Relu2": 6, "SwigluStep": 7,
        "GegluTanh": 8, "Identity": 9, "Situ": 10}
    assert int(fp4moe.ErrorCode.ArchMismatch) == 7


def test_build_info():
    info = fp4moe.build_info()
    for key in ("version", "source_hash", "cxx_compiler", "cuda_compiler", "cuda_archs", "with_cuda", "extension"):
        assert key in info, key
    assert info["version"] == fp4moe.__version__
    assert isinstance(info["cuda_archs"], list) and isinstance(info["with_cuda"], bool)
    assert (len(info["cuda_archs"]) > 0) == info["with_cuda"]
    meta = info["metadata"]
    if meta is not None:  # METADATA.json beside the binary agrees with the binary
        assert meta["version"] == info["version"] and meta["source_hash"] == info["source_hash"]
        assert meta["min_glibc"]
        # None only when libstdc++ is linked statically (as some GCC toolchains do).
        needs_libstdcxx = any(v.startswith("libstdc++") for v in meta["needed_versions"])
        assert bool(meta["min_glibcxx"]) == needs_libstdcxx


@pytest.mark.parametrize("make,dtype_name", [
    (lambda: np.zeros((2, 3), dtype=BF16), "bfloat16"),
    (lambda: np.zeros((2, 3), dtype=E4M3), "float8_e4m3fn"),
    (lambda: np.zeros((2, 3), dtype=np.uint8), "uint8"),
    (lambda: np.zeros((2, 3), dtype=np.int32), "int32"),
    (lambda: np.zeros((2, 3), dtype=np.float32), "float32"),
    (lambda: np.zeros((2, 3), dtype=np.float16), "float16"),
    (lambda: np.zeros((2, 3), dtype=np.int64), "int64"),
])
def test_tensor_dtypes(make, dtype_name):
    d = fp4moe._C._describe(fp4moe._tensors.as_arg(make(), "t"))
    assert d["dtype_name"] == dtype_name
    assert d["device"] == "cpu" and d["shape"] == (2, 3) and d["strides"] == (3, 1)


def test_tensor_strides_and_readonly():
    a = np.arange(4 * 6, dtype=np.float32).reshape(4, 6)
    v = a[1:, ::2]
    d = fp4moe._C._describe(v)
    assert d["shape"] == (3, 3) and d["strides"] == (6, 2)
    assert d["data_ptr"] == a.ctypes.data + 6 * 4
    a.setflags(write=False)  # inputs may be read-only
    assert fp4moe._C._describe(a)["shape"] == (4, 6)


def test_tensor_bad_type_names_argument():
    with pytest.raises(fp4moe.Fp4MoeError) as ei:
        fp4moe._tensors.as_arg(np.zeros(3, dtype=np.complex64), "w1")
    assert ei.value.argument == "w1"
    with pytest.raises(fp4moe.Fp4MoeError) as ei:
        fp4moe._tensors.as_arg("not a tensor", "x")
    assert ei.value.argument == "x"


# ---- the operator against NumPy ---------------------------------------------------------------------------

E, H, I, T, K = 4, 32, 16, 7, 2

CASES = [
    # activation, order, routing, params
    ("Swiglu", "gate_first", "Renormalize", {}),
    ("Swiglu", "up_first", "RenormalizeNaive", {}),
    ("SwigluBias", "gate_first", "Renormalize", {"alpha": 1.702, "beta": 1.0, "limit": 7.0}),
    ("Situ", "gate_first", "DeepSeekV3", {"alpha": 4.0, "beta": 25.0}),
    ("Geglu", "up_first", "Default", {}),
    ("Relu2", None, "Renormalize", {}),
]


@pytest.mark.parametrize("act,order,method,params", CASES, ids=[c[0] + "-" + str(c[1]) + "-" + c[2] for c in CASES])
def test_moe_nvfp4_matches_numpy(act, order, method, params):
    rng = np.random.default_rng(1234)
    gated = act in GATED
    w1, w2 = make_dense(rng, E, H, I, gated)
    q = fp4moe.quantize_weights(w1, w2, gate_up_order=order, activation=act)
    w = fp4moe.prepare_weights(**q, gate_up_order=order, activation=act)
    x = rand_x(rng, T, H)
    logits = rng.standard_normal((T, E)).astype(np.float32)
    bias = rng.standard_normal(E).astype(np.float32) * 0.1 if method == "DeepSeekV3" else None
    per = {k: np.full(E, v, np.float32) * np.linspace(0.8, 1.2, E, dtype=np.float32) for k, v in params.items()}
    y = fp4moe.moe(x, w, routing_logits=logits, routing_bias=bias, top_k=K, routing_method=method,
                   gemm1_alpha=per.get("alpha"), gemm1_beta=per.get("beta"), gemm1_clamp_limit=per.get("limit"))
    assert y.dtype == BF16 and y.shape == (T, H)
    W1, W2 = values_of(q)
    o, _ = np_expert_outputs(x.astype(np.float64), W1, q["w1_scale2"], W2, q["w2_scale2"], act, order or "gate_first",
                             per.get("alpha"), per.get("beta"), per.get("limit"))
    ids, rw = np_route(logits, method, K, bias)
    assert_close(y, np_combine(o, ids, rw, E), f"{act}/{order}/{method}")


def test_moe_wrong_half_order_would_be_caught():
    # The comparison is sharp enough to see a swapped gate/up order.
    rng = np.random.default_rng(7)
    w1, w2 = make_dense(rng, E, H, I)
    q = fp4moe.quantize_weights(w1, w2, gate_up_order="gate_first")
    w = fp4moe.prepare_weights(**q, gate_up_order="up_first", activation="swiglu")  # deliberately wrong
    x = rand_x(rng, T, H)
    logits = rng.standard_normal((T, E)).astype(np.float32)
    y = fp4moe.moe(x, w, routing_logits=logits, top_k=K, routing_method="Renormalize")
    W1, W2 = values_of(q)
    o, _ = np_expert_outputs(x.astype(np.float64), W1, q["w1_scale2"], W2, q["w2_scale2"], "Swiglu")
    ids, rw = np_route(logits, "Renormalize", K)
    with pytest.raises(AssertionError):
        assert_close(y, np_combine(o, ids, rw, E))


def test_moe_bf16_weights_bias_and_fp64_output():
    rng = np.random.default_rng(5)
    w1, w2 = make_dense(rng, E, H, I)
    w1b, w2b = w1.astype(BF16), w2.astype(BF16)
    b1 = rng.standard_normal((E, 2 * I)).astype(np.float32) * 0.1
    b2 = rng.standard_normal((E, H)).astype(np.float32) * 0.1
    w = fp4moe.prepare_bf16_weights(w1b, w2b, gate_up_order="gate_first", activation="swiglu", bias1=b1, bias2=b2)
    assert w.format == fp4moe.WeightFormat.BF16
    x = rand_x(rng, T, H)
    logits = rng.standard_normal((T, E)).astype(np.float32)
    y = fp4moe.moe(x, w, routing_logits=logits, top_k=K, routing_method="Renormalize")
    o, _ = np_expert_outputs(x.astype(np.float64), w1b.astype(np.float64), np.ones((E, 2)), w2b.astype(np.float64),
                             np.ones(E), "Swiglu", bias1=b1.astype(np.float64), bias2=b2.astype(np.float64))
    ids, rw = np_route(logits, "Renormalize", K)
    ref = np_combine(o, ids, rw, E)
    assert_close(y, ref, "bf16 weights")
    # The reference's Fp64 mode writes an unrounded float64 output: close to NumPy without the bf16 rounding.
    y64 = np.zeros((T, H), np.float64)
    fp4moe.moe(x, w, routing_logits=logits, top_k=K, routing_method="Renormalize", out=y64, precision="fp64")
    assert np.abs(y64 - ref).max() <= 2e-2 * np.abs(ref).max()


def test_moe_precomputed_topk_int64_and_expert_parallel():
    rng = np.random.default_rng(11)
    q = quantized(rng, E, H, I)
    w = fp4moe.prepare_weights(**q, gate_up_order="gate_first", activation="swiglu")
    x = rand_x(rng, T, H)
    E_total, off = 12, 4  # this rank holds experts [4, 8) of 12
    ids = np.stack([rng.permutation(E_total)[:K] for _ in range(T)]).astype(np.int64)  # torch.topk's dtype
    tw = rng.random((T, K)).astype(np.float32)
    y = fp4moe.moe(x, w, topk_ids=ids, topk_weights=tw, top_k=K, routing_method="TopK",
                   num_experts_total=E_total, local_expert_offset=off)
    W1, W2 = values_of(q)
    o, _ = np_expert_outputs(x.astype(np.float64), W1, q["w1_scale2"], W2, q["w2_scale2"], "Swiglu")
    ref = np_combine(o, ids, tw.astype(np.float64), E, off)
    rows_none = [t for t in range(T) if not any(off <= i < off + E for i in ids[t])]
    for t in rows_none:  # tokens routed only elsewhere get exact zeros
        assert np.all(np.asarray(y[t], dtype=np.float32) == 0)
    assert_close(y, ref, "expert parallel")


def swiglu_layer(seed):
    """A small gate-first SwiGLU layer, its x [T, H] and routing logits [T, E]."""
    rng = np.random.default_rng(seed)
    q = quantized(rng, E, H, I)
    w = fp4moe.prepare_weights(**q, gate_up_order="gate_first", activation="swiglu")
    return w, rand_x(rng, T, H), rng.standard_normal((T, E)).astype(np.float32)


def test_moe_out_param_zero_tokens_and_untouched_on_error():
    w, x, logits = swiglu_layer(3)
    out = np.full((T, H), 7.0, dtype=BF16)
    y = fp4moe.moe(x, w, routing_logits=logits, top_k=K, routing_method="Renormalize", out=out)
    assert y is out and not np.all(out.astype(np.float32) == 7.0)
    sentinel = np.full((T, H), 7.0, dtype=BF16)
    with pytest.raises(fp4moe.Fp4MoeError):
        fp4moe.moe(x, w, routing_logits=logits, top_k=E + 1, routing_method="Renormalize", out=sentinel)
    assert np.all(sentinel.astype(np.float32) == 7.0)  # SPEC §6: the output is left untouched
    y0 = fp4moe.moe(x[:0], w, routing_logits=logits[:0], top_k=K, routing_method="Renormalize")
    assert y0.shape == (0, H)


def test_moe_is_deterministic_and_batch_invariant():
    w, x, logits = swiglu_layer(9)
    kw = dict(top_k=K, routing_method="Renormalize")
    y1 = fp4moe.moe(x, w, routing_logits=logits, **kw)
    y2 = fp4moe.moe(x, w, routing_logits=logits, num_threads=1, **kw)
    y3 = fp4moe.moe(x[2:3], w, routing_logits=logits[2:3], **kw)
    assert y1.view(np.uint16).tobytes() == y2.view(np.uint16).tobytes()
    assert y1[2:3].view(np.uint16).tobytes() == y3.view(np.uint16).tobytes()


def test_gemm_tile_argument():
    # gemm_tile (the CUDA plan's tile, forced) never changes the bits; out of range it is refused by name, on the
    # CPU backend too, and the output is left untouched.
    w, x, logits = swiglu_layer(10)
    kw = dict(routing_logits=logits, top_k=K, routing_method="Renormalize")
    y = fp4moe.moe(x, w, **kw)
    for tile in (0, 1, 2, 4, "WeightsAsA32", "WeightsAsA16", fp4moe.GemmTile.TokensAsA64, "auto"):
        assert fp4moe.moe(x, w, gemm_tile=tile, **kw).view(np.uint16).tobytes() == y.view(np.uint16).tobytes()
    assert [t.name for t in fp4moe.GemmTile] == ["Auto", "SplitKDecode", "WeightsAsA32", "TokensAsA64", "Wgmma64",
                                               "WeightsAsA16", "WgmmaWs128", "WgmmaWs64", "WgmmaWs32"]
    sentinel = np.full((T, H), 7.0, dtype=BF16)
    for bad in (-2, 99, "tile4", 1.0):
        with pytest.raises(fp4moe.Fp4MoeError, match="gemm_tile"):
            fp4moe.moe(x, w, gemm_tile=bad, out=sentinel, **kw)
    assert np.all(sentinel.astype(np.float32) == 7.0)


def test_workspace_budget_argument():
    # workspace_budget (the CUDA plan's chunking bound) never changes the bits; negative it is refused by name, on
    # the CPU backend too, with the output untouched.
    w, x, logits = swiglu_layer(11)
    kw = dict(routing_logits=logits, top_k=K, routing_method="Renormalize")
    y = fp4moe.moe(x, w, **kw)
    for budget in (1, 1 << 20):
        assert fp4moe.moe(x, w, workspace_budget=budget, **kw).view(np.uint16).tobytes() == y.view(np.uint16).tobytes()
    sentinel = np.full((T, H), 7.0, dtype=BF16)
    with pytest.raises(fp4moe.Fp4MoeError, match="workspace_budget"):
        fp4moe.moe(x, w, workspace_budget=-1, out=sentinel, **kw)
    assert np.all(sentinel.astype(np.float32) == 7.0)


def test_shared_expert():
    rng = np.random.default_rng(21)
    q = quantized(rng, E, H, I)
    w = fp4moe.prepare_weights(**q, gate_up_order="gate_first", activation="swiglu")
    Is = 32
    qs = quantized(rng, 1, H, Is)
    ws = fp4moe.prepare_weights(**qs, gate_up_order="gate_first", activation="swiglu")
    x = rand_x(rng, T, H)
    logits = rng.standard_normal((T, E)).astype(np.float32)
    y = fp4moe.moe(x, w, routing_logits=logits, top_k=K, routing_method="Renormalize", shared_expert=ws)
    W1, W2 = values_of(q)
    o, _ = np_expert_outputs(x.astype(np.float64), W1, q["w1_scale2"], W2, q["w2_scale2"], "Swiglu")
    S1, S2 = values_of(qs)
    os_, _ = np_expert_outputs(x.astype(np.float64), S1, qs["w1_scale2"], S2, qs["w2_scale2"], "Swiglu")
    ids, rw = np_route(logits, "Renormalize", K)
    assert_close(y, np_combine(o, ids, rw, E) + os_[:, 0], "shared expert")


def test_bridges_activation_out_and_gate_up_delta():
    rng = np.random.default_rng(13)
    q = quantized(rng, E, H, I)
    w = fp4moe.prepare_weights(**q, gate_up_order="gate_first", activation="swiglu")
    x = rand_x(rng, T, H)
    ids = np.stack([rng.permutation(E)[:K] for _ in range(T)]).astype(np.int32)
    tw = rng.random((T, K)).astype(np.float32)
    delta = (rng.standard_normal((T, K, 2 * I)) * 0.5).astype(np.float32).astype(BF16)
    act_out = np.zeros((T, K, I), dtype=BF16)
    kw = dict(topk_ids=ids, topk_weights=tw, top_k=K, routing_method="TopK")
    y = fp4moe.moe(x, w, gate_up_lora_delta=delta, activation_out=act_out, **kw)
    W1, W2 = values_of(q)
    # Per slot: the delta of slot j goes to expert ids[t, j] only; compute slot by slot.
    ref = np.zeros((T, H))
    for j in range(K):
        d = np.zeros((T, E, 2 * I))
        for t in range(T):
            d[t, ids[t, j]] = delta[t, j].astype(np.float64)
        o, a = np_expert_outputs(x.astype(np.float64), W1, q["w1_scale2"], W2, q["w2_scale2"], "Swiglu", delta=d)
        for t in range(T):
            ref[t] += tw[t, j] * o[t, ids[t, j]]
            got = act_out[t, j].astype(np.float64)
            want = a[t, ids[t, j]]
            assert np.abs(got - want).max() <= 2e-2 * max(np.abs(want).max(), 1e-3), (t, j)
    assert_close(y, ref, "gate_up delta")
    # An all-zero bridge gives the bits of a run without it (SPEC §5).
    y0 = fp4moe.moe(x, w, **kw)
    y1 = fp4moe.moe(x, w, gate_up_lora_delta=np.zeros_like(delta), **kw)
    assert y0.view(np.uint16).tobytes() == y1.view(np.uint16).tobytes()


# ---- adapters -----------------------------------------------------------------------------------------------

def make_lora(rng, r, zero_b=False):
    A1 = (rng.standard_normal((E, r, H)) / math.sqrt(H)).astype(np.float32).astype(BF16)
    B1 = (rng.standard_normal((E, 2 * I, r)) * 0.3).astype(np.float32).astype(BF16)
    A2 = (rng.standard_normal((E, r, I)) / math.sqrt(I)).astype(np.float32).astype(BF16)
    B2 = (rng.standard_normal((E, H, r)) * 0.3).astype(np.float32).astype(BF16)
    if zero_b:
        B1[...] = 0
        B2[...] = 0
    return {"a_gate_up": A1, "b_gate_up": B1, "a_down": A2, "b_down": B2}


@pytest.mark.parametrize("order", ["gate_first", "up_first"])
def test_adapters_peft_fused_against_numpy(order):
    rng = np.random.default_rng(31)
    q = quantized(rng, E, H, I, order=order)
    w = fp4moe.prepare_weights(**q, gate_up_order=order, activation="swiglu")
    reg = fp4moe.AdapterRegistry(w, num_slots=4)
    r = 8
    lora = make_lora(rng, r)
    reg.load(2, lora, rank=r, lora_alpha=float(r))  # scale 1: the fold into B is exact
    assert reg.loaded(2) and not reg.loaded(0) and reg.num_slots == 4
    x = rand_x(rng, T, H)
    logits = rng.standard_normal((T, E)).astype(np.float32)
    aid = np.array([2, -1, 2, 2, -1, 2, 2], dtype=np.int32)
    kw = dict(routing_logits=logits, top_k=K, routing_method="Renormalize")
    y = fp4moe.moe(x, w, adapters=reg, adapter_ids=aid, **kw)
    ybase = fp4moe.moe(x, w, **kw)
    W1, W2 = values_of(q)
    ids, rw = np_route(logits, "Renormalize", K)
    L = {"A1": lora["a_gate_up"].astype(np.float64), "B1": lora["b_gate_up"].astype(np.float64),
         "A2": lora["a_down"].astype(np.float64), "B2": lora["b_down"].astype(np.float64), "s": 1.0}
    o, _ = np_expert_outputs(x.astype(np.float64), W1, q["w1_scale2"], W2, q["w2_scale2"], "Swiglu", order, lora=L)
    ref = np_combine(o, ids, rw, E)
    lo = aid >= 0
    assert_close(y[lo], ref[lo], "LoRA tokens")
    # Base tokens in a mixed batch are bit-identical to a run without adapters (SPEC §4/§5).
    assert y[~lo].view(np.uint16).tobytes() == ybase[~lo].view(np.uint16).tobytes()
    assert not np.array_equal(y[lo].view(np.uint16), ybase[lo].view(np.uint16))


def test_registry_of_another_layer_of_the_same_shape_is_refused():
    """Two layers of one shape with different gate/up orders: B's registry with A's weights would put the gate
    LoRA on the up half; it is refused naming `adapters`, `out` untouched, and A's own registry still works."""
    rng = np.random.default_rng(37)
    qa = quantized(rng, E, H, I, order="gate_first")
    qb = quantized(rng, E, H, I, order="up_first")
    wa = fp4moe.prepare_weights(**qa, gate_up_order="gate_first", activation="swiglu")
    wb = fp4moe.prepare_weights(**qb, gate_up_order="up_first", activation="swiglu")
    r = 8
    lora = make_lora(rng, r)
    reg_a, reg_b = fp4moe.AdapterRegistry(wa, num_slots=2), fp4moe.AdapterRegistry(wb, num_slots=2)
    reg_a.load(0, lora, rank=r, lora_alpha=float(r))
    reg_b.load(0, lora, rank=r, lora_alpha=float(r))
    x = rand_x(rng, T, H)
    kw = dict(routing_logits=rng.standard_normal((T, E)).astype(np.float32), top_k=K, routing_method="Renormalize",
              adapter_ids=np.zeros(T, dtype=np.int32))
    out = np.full((T, H), 7.0, dtype=np.float32).astype(BF16)
    before = out.view(np.uint16).copy()
    with pytest.raises(fp4moe.Fp4MoeError) as ei:
        fp4moe.moe(x, wa, adapters=reg_b, out=out, **kw)
    assert ei.value.argument == "adapters", str(ei.value)
    assert np.array_equal(out.view(np.uint16), before)
    # The same tensors prepared again are other weights too.
    wa2 = fp4moe.prepare_weights(**qa, gate_up_order="gate_first", activation="swiglu")
    with pytest.raises(fp4moe.Fp4MoeError) as ei:
        fp4moe.moe(x, wa2, adapters=reg_a, out=out, **kw)
    assert ei.value.argument == "adapters"
    assert np.array_equal(out.view(np.uint16), before)
    y = fp4moe.moe(x, wa, adapters=reg_a, **kw)
    assert np.isfinite(y.astype(np.float32)).all()


@pytest.mark.parametrize("name, value", [("gemm1_alpha", -1.0), ("gemm1_beta", 0.0), ("gemm1_alpha", [1.0] * 3 + [math.nan]),
                                         ("gemm1_clamp_limit", -2.0)])
def test_situ_parameters_given_as_numbers_are_checked(name, value):
    """Scalars and lists are known on the host, so they are checked there on every backend (SPEC §3.2: Situ α, β > 0)."""
    rng = np.random.default_rng(41)
    q = quantized(rng, 4, H, I)
    w = fp4moe.prepare_weights(**q, gate_up_order="gate_first", activation="situ")
    with pytest.raises(fp4moe.Fp4MoeError) as ei:
        fp4moe.moe(rand_x(rng, T, H), w, routing_logits=rng.standard_normal((T, 4)).astype(np.float32), top_k=2,
                   routing_method="Renormalize", **{name: value})
    assert ei.value.argument == name, str(ei.value)


def test_adapters_zero_b_is_base_and_slots():
    rng = np.random.default_rng(41)
    q = quantized(rng, E, H, I)
    w = fp4moe.prepare_weights(**q, gate_up_order="gate_first", activation="swiglu")
    reg = fp4moe.AdapterRegistry(w, num_slots=3)
    reg.load(0, **make_lora(rng, 4, zero_b=True), lora_alpha=16.0)  # keywords, rank inferred
    x = rand_x(rng, T, H)
    logits = rng.standard_normal((T, E)).astype(np.float32)
    kw = dict(routing_logits=logits, top_k=K, routing_method="Renormalize")
    y = fp4moe.moe(x, w, adapters=reg, adapter_ids=np.zeros(T, np.int32), **kw)
    assert y.view(np.uint16).tobytes() == fp4moe.moe(x, w, **kw).view(np.uint16).tobytes()
    reg.unload(0)
    assert not reg.loaded(0)
    with pytest.raises(fp4moe.Fp4MoeError) as ei:
        fp4moe.moe(x, w, adapters=reg, adapter_ids=np.zeros(T, np.int32), **kw)
    assert ei.value.argument == "adapter_ids" and ei.value.code == fp4moe.ErrorCode.NotFound
    with pytest.raises(fp4moe.Fp4MoeError) as ei:
        reg.unload(0)
    assert ei.value.code == fp4moe.ErrorCode.NotFound
    with pytest.raises(fp4moe.Fp4MoeError) as ei:
        reg.load(0, make_lora(rng, 4), rank=4)
    assert ei.value.argument == "lora_alpha"
    with pytest.raises(fp4moe.Fp4MoeError) as ei:
        reg.load(5, make_lora(rng, 4), lora_alpha=4.0)
    assert ei.value.argument == "slot"
    with pytest.raises(fp4moe.Fp4MoeError) as ei:
        reg.load(1, {"a_gate_upp": np.zeros((E, 4, H), BF16)}, lora_alpha=4.0)
    assert ei.value.argument == "a_gate_upp"
    bad = make_lora(rng, 4)
    bad["b_down"] = bad["b_down"][:, :-1]
    with pytest.raises(fp4moe.Fp4MoeError) as ei:
        reg.load(1, bad, lora_alpha=4.0)
    assert ei.value.argument == "b_down"


def test_peft_expert_matrices():
    r, n_in, n_out = 3, 5, 4
    rng = np.random.default_rng(0)
    A = rng.standard_normal((r * E, n_in))
    B = rng.standard_normal((n_out, r * E))
    a, b = fp4moe.peft_expert_matrices(A, B, E)
    assert a.shape == (E, r, n_in) and b.shape == (E, n_out, r)
    for e in range(E):
        np.testing.assert_array_equal(a[e], A[e * r:(e + 1) * r])
        for i in range(r):  # expert index inner in B: column i*E + e
            np.testing.assert_array_equal(b[e][:, i], B[:, i * E + e])


# ---- routing, quantization, HF import ----------------------------------------------------------------------

@pytest.mark.parametrize("method", ["Default", "Renormalize", "RenormalizeNaive", "DeepSeekV3", "Sigmoid", "TopK"])
def test_route_matches_numpy(method):
    rng = np.random.default_rng(17)
    Tn, En, k = 9, 16, 4
    logits = rng.standard_normal((Tn, En)).astype(np.float32)
    bias = (rng.standard_normal(En) * 0.2).astype(np.float32) if method == "DeepSeekV3" else None
    ng, tg = (4, 2) if method == "DeepSeekV3" else (1, 1)
    rsf = 2.5 if method == "DeepSeekV3" else 1.0
    ids, w = fp4moe.route(logits, top_k=k, routing_method=method, routing_bias=bias, n_group=ng, topk_group=tg,
                          routed_scaling_factor=rsf)
    assert ids.dtype == np.int32 and w.dtype == np.float32 and ids.shape == (Tn, k)
    rids, rw = np_route(logits, method, k, bias, ng, tg, rsf)
    np.testing.assert_array_equal(ids, rids)
    np.testing.assert_allclose(w, rw, rtol=1e-5, atol=1e-6)


def test_quantize_weights_independent_decode():
    rng = np.random.default_rng(23)
    w1, w2 = make_dense(rng, E, H, I)
    q = fp4moe.quantize_weights(w1, w2, gate_up_order="gate_first")
    assert q["w1"].dtype == np.uint8 and q["w1_scale"].dtype == E4M3 and q["w1_scale2"].shape == (E, 2)
    W1, W2 = values_of(q)
    for e in range(E):
        for half in range(2):
            rows = slice(half * I, (half + 1) * I)
            amax = np.abs(w1[e, rows]).max()
            np.testing.assert_allclose(q["w1_scale2"][e, half], amax / (448 * 6), rtol=1e-6)
            deq = W1[e, rows] * q["w1_scale2"][e, half]
            # NVFP4 keeps ~1 significant bit near the top of each block: error <= 1/4 of the block amax-ish.
            blocks = np.abs(w1[e, rows]).reshape(I, H // 16, 16).max(-1, keepdims=True)
            err = np.abs(deq - w1[e, rows]).reshape(I, H // 16, 16)
            assert np.all(err <= 0.25 * blocks + 1e-6)
    np.testing.assert_allclose(q["w2_scale2"], np.abs(w2).reshape(E, -1).max(1) / (448 * 6), rtol=1e-6)
    assert np.abs(W2 * q["w2_scale2"][:, None, None] - w2).max() <= 0.25 * np.abs(w2).max()
    qs = fp4moe.quantize_weights(w1, w2, gate_up_order="gate_first", scale_layout="swizzled")
    ws = fp4moe.prepare_weights(**qs, gate_up_order="gate_first", scale_layout="swizzled", activation="swiglu")
    wl = fp4moe.prepare_weights(**q, gate_up_order="gate_first", activation="swiglu")
    x = rand_x(rng, T, H)
    logits = rng.standard_normal((T, E)).astype(np.float32)
    kw = dict(routing_logits=logits, top_k=K, routing_method="Renormalize")
    assert fp4moe.moe(x, ws, **kw).tobytes() == fp4moe.moe(x, wl, **kw).tobytes()


def test_from_hf_experts():
    rng = np.random.default_rng(29)
    gate_up, down = make_dense(rng, E, H, I)
    w = fp4moe.from_hf_experts(gate_up, down)
    assert w.gate_up_order == fp4moe.GateUpOrder.GateFirst and w.format == fp4moe.WeightFormat.NVFP4
    q = fp4moe.quantize_weights(gate_up, down, gate_up_order="gate_first")
    w_ref = fp4moe.prepare_weights(**q, gate_up_order="gate_first", activation="swiglu")
    x = rand_x(rng, T, H)
    logits = rng.standard_normal((T, E)).astype(np.float32)
    kw = dict(routing_logits=logits, top_k=K, routing_method="Renormalize")
    assert fp4moe.moe(x, w, **kw).tobytes() == fp4moe.moe(x, w_ref, **kw).tobytes()
    wb = fp4moe.from_hf_experts(gate_up.astype(BF16), down.astype(BF16), quantize=False)
    assert wb.format == fp4moe.WeightFormat.BF16 and wb.activation == fp4moe.ActivationType.Swiglu
    with pytest.raises(fp4moe.Fp4MoeError) as ei:
        fp4moe.from_hf_experts(gate_up, down[:, :, :-1])
    assert ei.value.argument == "down_proj"


# ---- errors name the argument -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def small():
    rng = np.random.default_rng(99)
    q = quantized(rng, E, H, I)
    w = fp4moe.prepare_weights(**q, gate_up_order="gate_first", activation="swiglu")
    x = rand_x(rng, T, H)
    logits = rng.standard_normal((T, E)).astype(np.float32)
    return q, w, x, logits


@pytest.mark.parametrize("change,argument", [
    (dict(x="f32"), "x"),
    (dict(routing_logits="narrow"), "routing_logits"),
    (dict(top_k=E + 1), "top_k"),
    (dict(routing_method="NoSuchMethod"), "routing_method"),
    (dict(routing_method=42), "routing_method"),
    (dict(activation="relu2"), "activation"),
    (dict(gemm1_alpha=np.ones(E + 1, np.float32)), "gemm1_alpha"),
    (dict(gemm1_clamp_limit=-1.0), "gemm1_clamp_limit"),
    (dict(mode="a8"), "mode"),
    (dict(mode="a4"), "fc1_input_scale"),
    (dict(adapter_ids=np.zeros(T, np.int32)), "adapter_ids"),
    (dict(out="f16"), "out"),
    (dict(n_group=3), "n_group"),
])
def test_moe_errors_name_the_argument(small, change, argument):
    q, w, x, logits = small
    kw = dict(routing_logits=logits, top_k=K, routing_method="Renormalize")
    kw.update(change)
    if kw.get("x") == "f32":
        kw["x"] = x.astype(np.float32)
    else:
        kw["x"] = x
    if isinstance(kw.get("routing_logits"), str):
        kw["routing_logits"] = logits[:, :-1]
    if kw.get("out") == "f16":
        kw["out"] = np.zeros((T, H), np.float16)
    xx = kw.pop("x")
    with pytest.raises(fp4moe.Fp4MoeError) as ei:
        fp4moe.moe(xx, w, **kw)
    e = ei.value
    assert isinstance(e, ValueError)
    assert e.argument == argument, str(e)
    assert f"'{argument}'" in str(e)


def test_prepare_errors_name_the_argument(small):
    q = small[0]
    with pytest.raises(fp4moe.Fp4MoeError) as ei:
        fp4moe.prepare_weights(**q, activation="swiglu")  # no gate_up_order: no silent default
    assert ei.value.argument == "gate_up_order"
    bad = dict(q)
    bad["w1_scale2"] = -bad["w1_scale2"]
    with pytest.raises(fp4moe.Fp4MoeError) as ei:
        fp4moe.prepare_weights(**bad, gate_up_order="gate_first")
    assert ei.value.argument == "w1_scale2" and ei.value.code == fp4moe.ErrorCode.InvalidArgument
    bad = dict(q)
    bad["w2_scale"] = bad["w2_scale"][:, :-1]
    with pytest.raises(fp4moe.Fp4MoeError) as ei:
        fp4moe.prepare_weights(**bad, gate_up_order="gate_first")
    assert ei.value.argument == "w2_scale"
    with pytest.raises(fp4moe.Fp4MoeError) as ei:
        fp4moe.prepare_weights(**q, gate_up_order="sideways")
    assert ei.value.argument == "gate_up_order"
    with pytest.raises(fp4moe.Fp4MoeError) as ei:
        fp4moe.prepare_weights(**q, gate_up_order="gate_first", device="tpu")
    assert ei.value.argument == "device"
    with pytest.raises(fp4moe.Fp4MoeError) as ei:
        fp4moe.quantize_weights(np.zeros((E, 2 * I, 40), np.float32), np.zeros((E, 40, I), np.float32),
                                gate_up_order="gate_first")  # H = 40 is not a multiple of 16
    assert ei.value.argument in ("w1", "hidden")
    if not fp4moe.build_info()["with_cuda"]:
        with pytest.raises(fp4moe.Fp4MoeError) as ei:
            fp4moe.prepare_weights(**q, gate_up_order="gate_first", device="cuda")
        assert ei.value.code == fp4moe.ErrorCode.Unsupported and ei.value.argument == "device"


def test_error_is_picklable():
    import pickle
    e = fp4moe.Fp4MoeError("argument 'routing.logits': bad", 1, "routing.logits")
    assert e.argument == "routing_logits" and "'routing_logits'" in str(e)
    e2 = pickle.loads(pickle.dumps(e))
    assert e2.argument == e.argument and e2.code == e.code and str(e2) == str(e)
