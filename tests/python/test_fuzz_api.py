"""Property-based tests (hypothesis) of the public Python API over shapes, dtypes, strides, devices, enum names and
optional arguments.

Every call either matches an independent reference (a small NumPy implementation of SPEC §2/§3/§5 in
fuzz_support.py, or an algebraic property of SPEC §4/§5) or raises fp4moe.Fp4MoeError whose .argument is one of the
call's parameters; never another exception type, never a crash, and never a changed `out` (pre-filled with random
bytes) after an error.

Profiles: FP4MOE_FUZZ_PROFILE=ci (default: bounded, deterministic) or long; FP4MOE_FUZZ_EXAMPLES=N sets the
examples per property. FP4MOE_FUZZ_REPORT=path writes the figures (examples, good calls, bad calls, errors by
argument, bytes compared) as JSON; they are also printed at the end of the run. With a CUDA build, a visible GPU
and PyTorch, the CUDA properties run the same strategies on device tensors against the CPU backend.

This file: good calls against the reference and the properties, and the regressions the fuzzer found. Bad calls:
test_fuzz_bad_calls.py; the CUDA backend: test_fuzz_cuda.py; their shared parts: fuzz_support.py, fuzz_cases.py,
fuzz_mutations.py.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

pytest.importorskip("hypothesis", reason="the fuzz tests need hypothesis (pip install hypothesis)")
pytest.importorskip("ml_dtypes", reason="ml_dtypes is needed for NumPy bfloat16")

from hypothesis import assume, given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from fuzz_support import (BF16, Fp4MoeError, LoraRef, assert_close, count_bytes, count_example, f64,  # noqa: E402
                          fp4moe, fuzz, np_global_scale, np_moe, np_quantize, np_route, np_swizzle, same_bits)
from fuzz_cases import (DIMS, bf16_array, call_bad, good, lora_case, make_layer, moe_case,  # noqa: E402
                        random_adapter, routing_setup, sentinel_like)


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
