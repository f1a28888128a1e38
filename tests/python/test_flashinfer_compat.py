"""fp4moe.flashinfer_compat: FlashInfer-shaped entry points give the native API's output on the same weights.

The FlashInfer-layout inputs are built here independently of the compat module: up-first W13 rows, FlashInfer's
row shuffle written out from its documented 32-row map, 128x4 swizzling from SPEC §2, and the three per-expert
output scales from FlashInfer's test recipe. CPU backend, NumPy inputs (PyTorch CPU tensors too when installed).
Skips without the built extension.
"""
from __future__ import annotations


import numpy as np
import pytest

ml_dtypes = pytest.importorskip("ml_dtypes", reason="ml_dtypes is needed for NumPy bfloat16")
from fp4moe_under_test import import_fp4moe  # noqa: E402


fp4moe, fic = import_fp4moe("flashinfer_compat")
BF16 = np.dtype(ml_dtypes.bfloat16)
E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
E, H, I, T, K = 8, 64, 64, 16, 2  # I = 64 so that 2I and H are multiples of the 32-row shuffle block

# FlashInfer's srcToDstBlk32RowMap (flashinfer/utils.py): source row s of a 32-row block goes to row MAP[s].
MAP32 = [0, 8, 16, 24, 1, 9, 17, 25, 2, 10, 18, 26, 3, 11, 19, 27, 4, 12, 20, 28, 5, 13, 21, 29, 6, 14, 22, 30,
         7, 15, 23, 31]


def fi_shuffle(a, gated):
    """FlashInfer's weight preparation on rows of [E, N, ...]: gated interleave (up0, gate0, up1, gate1, ...),
    then each 32-row block's row s moved to MAP32[s]."""
    n = a.shape[1]
    if gated:
        inter = np.empty_like(a)
        inter[:, 0::2] = a[:, : n // 2]
        inter[:, 1::2] = a[:, n // 2:]
        a = inter
    out = np.empty_like(a)
    for blk in range(0, n, 32):
        for s in range(32):
            out[:, blk + MAP32[s]] = a[:, blk + s]
    return out


def swizzle(linear):
    """[E, rows, cols] linear block scales -> [E, padded] 128x4-swizzled (SPEC §2 formula), zero padded."""
    e, rows, cols = linear.shape
    rp, cp = -(-rows // 128) * 128, -(-cols // 4) * 4
    out = np.zeros((e, rp * cp), dtype=np.uint8)
    nC = cp // 4
    for m in range(rows):
        for c in range(cols):
            off = (m // 128) * nC * 512 + (c // 4) * 512 + (m % 32) * 16 + ((m % 128) // 32) * 4 + (c % 4)
            out[:, off] = linear[:, m, c].view(np.uint8)
    return out


def up_first(a, n1):
    """Gate-first rows [E, 2I, ...] -> up-first."""
    return np.concatenate([a[:, n1 // 2:], a[:, : n1 // 2]], axis=1)


@pytest.fixture(scope="module")
def model():
    rng = np.random.default_rng(7)
    w1 = (rng.standard_normal((E, 2 * I, H)) * 0.2).astype(np.float32)  # gate rows first
    w2 = (rng.standard_normal((E, H, I)) * 0.2).astype(np.float32)
    # One global scale per expert for W13 (FlashInfer's convention), gate-first codes.
    q = fp4moe.quantize_weights(w1, w2, gate_up_order="gate_first", per_half_scale2=False)
    x = (rng.standard_normal((T, H))).astype(np.float32).astype(BF16)
    logits = rng.standard_normal((T, E)).astype(np.float32)
    return q, x, logits


def trtllm_inputs(q, c, act_gated=True, shuffled=True):
    n1 = 2 * I if act_gated else I
    p1 = up_first(q["w1"], n1) if act_gated else q["w1"]
    l1 = up_first(q["w1_scale"], n1) if act_gated else q["w1_scale"]
    p2, l2 = q["w2"], q["w2_scale"]
    if shuffled:
        p1, l1 = fi_shuffle(p1, act_gated), fi_shuffle(l1, act_gated)
        p2, l2 = fi_shuffle(p2, False), fi_shuffle(l2, False)
    s1 = q["w1_scale2"].astype(np.float32)  # 1/gs_w1 (bf16 x: no activation global scale)
    return dict(w13=p1, w13_sf=swizzle(l1).view(E4M3), w2=p2, w2_sf=swizzle(l2).view(E4M3), s1=s1,
                o1=(np.float32(c) * s1).astype(np.float32), o1g=s1,
                o2=(q["w2_scale2"] / np.float32(c)).astype(np.float32))


def call_trtllm(t, x, logits, method, act=3, beta=None, clamp=None, alpha=None, **kw):
    (y,) = fic.trtllm_fp4_block_scale_moe(
        logits, None, x, None, t["w13"], t["w13_sf"], None, alpha, beta, clamp, t["w2"], t["w2_sf"], None, t["o1"],
        t["o1g"], t["o2"], E, K, None, None, I, 0, E, None, routing_method_type=method, activation_type=act, **kw)
    return y


def bits(y):
    return np.asarray(y).view(np.uint16)


def test_row_shuffle_roundtrip_and_matches_flashinfer_map():
    a = np.arange(2 * 128).reshape(2, 128, 1)
    for gated in (True, False):
        s = fi_shuffle(a, gated)
        assert np.array_equal(fic.shuffle_rows_for_trtllm(a, gated), s)
        assert np.array_equal(fic.unshuffle_rows_for_trtllm(s, gated), a)


@pytest.mark.parametrize("method", [1, 4])
@pytest.mark.parametrize("shuffled", [True, False])
def test_trtllm_bf16_hidden_matches_native(model, method, shuffled):
    q, x, logits = model
    fic.clear_cache()
    c = 0.5  # FC2 input global scale folded into output1/output2 scales (a power of two: exact here)
    t = trtllm_inputs(q, c, shuffled=shuffled)
    y = call_trtllm(t, x, logits, method, weight_layout="shuffled" if shuffled else "plain")
    native = fp4moe.prepare_weights(**q, gate_up_order="gate_first", activation="swiglu")
    ref = fp4moe.moe(x, native, routing_logits=logits, top_k=K, routing_method=method)
    assert np.abs(np.asarray(ref, dtype=np.float32)).max() > 0
    assert np.array_equal(bits(y), bits(ref))


def test_trtllm_swiglu_bias_raw_domain_params(model):
    """gemm1_beta and gemm1_clamp_limit are raw-domain in FlashInfer: converted with output1_scale_gate_scalar."""
    q, x, logits = model
    fic.clear_cache()
    t = trtllm_inputs(q, 1.0)
    rng = np.random.default_rng(3)
    beta_raw = rng.uniform(0.5, 2.0, E).astype(np.float32)
    clamp_raw = rng.uniform(1.0, 4.0, E).astype(np.float32)
    alpha = np.full(E, 1.702, np.float32)
    y = call_trtllm(t, x, logits, 1, act=3, alpha=alpha, beta=beta_raw, clamp=clamp_raw)
    native = fp4moe.prepare_weights(**q, gate_up_order="gate_first", activation="swiglu")
    ref = fp4moe.moe(x, native, routing_logits=logits, top_k=K, routing_method=1, gemm1_alpha=alpha,
                     gemm1_beta=(beta_raw * t["s1"]).astype(np.float32),
                     gemm1_clamp_limit=(clamp_raw * t["s1"]).astype(np.float32))
    assert np.array_equal(bits(y), bits(ref))
    plain = fp4moe.moe(x, native, routing_logits=logits, top_k=K, routing_method=1)
    assert not np.array_equal(bits(y), bits(plain))  # the parameters did something


def test_trtllm_situ_scale_mapping(model):
    """SiTU: output1_scale_scalar is c alone (FlashInfer dequantizes inside the activation)."""
    q, x, logits = model
    fic.clear_cache()
    c = 2.0
    t = trtllm_inputs(q, c)
    t["o1"] = np.full(E, c, np.float32)
    y = call_trtllm(t, x, logits, 4, act=10)
    native = fp4moe.prepare_weights(**q, gate_up_order="gate_first", activation="situ")
    ref = fp4moe.moe(x, native, routing_logits=logits, top_k=K, routing_method=4)
    assert np.array_equal(bits(y), bits(ref))


def test_trtllm_nvfp4_hidden_states_a4(model):
    """NVFP4 hidden states (FlashInfer's W4A4 mode) against the native A4 mode on the bf16 x they encode."""
    q, x, logits = model
    fic.clear_cache()
    # Quantize x [T, H] with the package's own NVFP4 quantizer (x as a one-expert non-gated "weight").
    xq = fp4moe.quantize_weights(np.asarray(x, np.float32)[None], np.zeros((1, H, T), np.float32), gated=False,
                                 activation="relu")
    x_codes, x_sf, x_s2 = xq["w1"][0], xq["w1_scale"][0], np.float32(xq["w1_scale2"][0])
    c = 0.25
    t = trtllm_inputs(q, c)
    t["o1g"] = (t["s1"] * x_s2).astype(np.float32)
    t["o1"] = (np.float32(c) * t["o1g"]).astype(np.float32)
    (y,) = fic.trtllm_fp4_block_scale_moe(
        logits, None, x_codes, x_sf, t["w13"], t["w13_sf"], None, None, None, None, t["w2"], t["w2_sf"], None,
        t["o1"], t["o1g"], t["o2"], E, K, None, None, I, 0, E, None, routing_method_type=4)
    native = fp4moe.prepare_weights(**q, gate_up_order="gate_first", activation="swiglu")
    ref = fp4moe.moe(x, native, routing_logits=logits, top_k=K, routing_method=4, mode="a4",
                     fc1_input_scale=float(x_s2), fc2_input_scale=1.0 / c)
    yf, rf = np.asarray(y, np.float32), np.asarray(ref, np.float32)
    assert np.abs(rf).max() > 0
    np.testing.assert_allclose(yf, rf, atol=2e-2 * np.abs(rf).max(), rtol=2e-2)


def test_trtllm_cache_reuses_prepared_weights(model):
    q, x, logits = model
    fic.clear_cache()
    t = trtllm_inputs(q, 1.0)
    y1 = call_trtllm(t, x, logits, 4)
    info = fic.cache_info()
    y2 = call_trtllm(t, x, logits, 4)
    info2 = fic.cache_info()
    assert info["prepared"] + 0 == info2["prepared"] and info2["hits"] == info["hits"] + 1
    assert np.array_equal(bits(y1), bits(y2))
    t2 = dict(t, w2=t["w2"].copy())  # a different tensor: prepared anew
    call_trtllm(t2, x, logits, 4)
    assert fic.cache_info()["prepared"] == info2["prepared"] + 1


def test_trtllm_routed_packed_topk(model):
    q, x, logits = model
    fic.clear_cache()
    t = trtllm_inputs(q, 1.0)
    ids, w = fp4moe.route(logits, top_k=K, routing_method=1)
    wb = w.astype(BF16)  # FlashInfer packs bf16 weights
    packed = (ids.astype(np.int32) << 16) | wb.view(np.uint16).astype(np.int32)
    (y,) = fic.trtllm_fp4_block_scale_routed_moe(
        packed, None, x, None, t["w13"], t["w13_sf"], None, None, None, None, t["w2"], t["w2_sf"], None, t["o1"],
        t["o1g"], t["o2"], E, K, None, None, I, 0, E, None, routing_method_type=1)
    native = fp4moe.prepare_weights(**q, gate_up_order="gate_first", activation="swiglu")
    ref = fp4moe.moe(x, native, topk_ids=ids, topk_weights=wb.astype(np.float32), top_k=K, routing_method=1)
    assert np.array_equal(bits(y), bits(ref))


def test_trtllm_refuses_unsupported(model):
    q, x, logits = model
    t = trtllm_inputs(q, 1.0)
    with pytest.raises(fp4moe.Fp4MoeError) as ei:
        call_trtllm(t, x, logits, 4, do_finalize=False)
    assert ei.value.argument == "do_finalize"
    with pytest.raises(fp4moe.Fp4MoeError) as ei:
        call_trtllm(t, x, logits, 4, weight_layout="blocked")
    assert ei.value.argument == "weight_layout"


def cutlass_inputs(q, a1, a2):
    n1 = 2 * I
    return dict(fc1=up_first(q["w1"], n1).view(np.int64), fc2=q["w2"].view(np.int64),
                qs=[np.float32(a1), swizzle(up_first(q["w1_scale"], n1)).view(np.int32),
                    (q["w1_scale2"] / np.float32(a1)).astype(np.float32), np.float32(a2),
                    swizzle(q["w2_scale"]).view(np.int32), (q["w2_scale2"] / np.float32(a2)).astype(np.float32)])


def test_cutlass_nvfp4_matches_native_a4(model):
    q, x, logits = model
    fic.clear_cache()
    ids, w = fp4moe.route(logits, top_k=K, routing_method=1)
    a1, a2 = 4.0, 0.5  # activation encode scales (powers of two: the derived scales are exact)
    c = cutlass_inputs(q, a1, a2)
    y = fic.cutlass_fused_moe(x, ids, w, c["fc1"], c["fc2"], None, c["qs"])
    native = fp4moe.prepare_weights(**q, gate_up_order="gate_first", activation="swiglu")
    ref = fp4moe.moe(x, native, topk_ids=ids, topk_weights=w, top_k=K, routing_method=5, mode="a4",
                     fc1_input_scale=1.0 / a1, fc2_input_scale=1.0 / a2)
    assert np.abs(np.asarray(ref, np.float32)).max() > 0
    assert np.array_equal(bits(y), bits(ref))
    y16 = fic.cutlass_fused_moe(x, ids, w, c["fc1"], c["fc2"], None, c["qs"], mode="a16")
    ref16 = fp4moe.moe(x, native, topk_ids=ids, topk_weights=w, top_k=K, routing_method=5)
    assert np.array_equal(bits(y16), bits(ref16))


def test_cutlass_bf16_weights_and_expert_parallel(model):
    q, x, logits = model
    fic.clear_cache()
    rng = np.random.default_rng(11)
    w1 = (rng.standard_normal((E, 2 * I, H)) * 0.2).astype(BF16)  # gate first
    w2 = (rng.standard_normal((E, H, I)) * 0.2).astype(BF16)
    ids_all, w = fp4moe.route(np.tile(logits, (1, 2)), top_k=K, routing_method=1)  # 2E experts, 2 ranks
    half = E
    y = fic.cutlass_fused_moe(x, ids_all, w, up_first(w1, 2 * I), w2, None, [], ep_size=2, ep_rank=1)
    native = fp4moe.prepare_bf16_weights(w1, w2, gate_up_order="gate_first", activation="swiglu")
    ref = fp4moe.moe(x, native, topk_ids=ids_all, topk_weights=w, top_k=K, routing_method=5,
                     num_experts_total=2 * E, local_expert_offset=half)
    assert np.array_equal(bits(y), bits(ref))


def test_cutlass_situ_defaults_are_flashinfer_s(model):
    q, x, logits = model
    fic.clear_cache()
    ids, w = fp4moe.route(logits, top_k=K, routing_method=1)
    c = cutlass_inputs(q, 1.0, 1.0)
    y = fic.cutlass_fused_moe(x, ids, w, c["fc1"], c["fc2"], None, c["qs"], activation_type=10, mode="a16")
    native = fp4moe.prepare_weights(**q, gate_up_order="gate_first", activation="situ")
    ref = fp4moe.moe(x, native, topk_ids=ids, topk_weights=w, top_k=K, routing_method=5, gemm1_alpha=4.0,
                     gemm1_beta=25.0)
    assert np.array_equal(bits(y), bits(ref))


def test_torch_inputs_match_numpy(model):
    torch = pytest.importorskip("torch")
    q, x, logits = model
    fic.clear_cache()
    t = trtllm_inputs(q, 0.5)
    y_np = call_trtllm(t, x, logits, 4)
    tt = {k: (torch.from_numpy(np.ascontiguousarray(v).view(np.uint8)).view(torch.float8_e4m3fn)
              if k.endswith("_sf") else torch.from_numpy(np.ascontiguousarray(v))) for k, v in t.items()}
    xt = torch.from_numpy(np.asarray(x).view(np.int16)).view(torch.bfloat16)
    y_t = call_trtllm(tt, xt, torch.from_numpy(logits), 4)
    assert isinstance(y_t, torch.Tensor) and y_t.dtype == torch.bfloat16
    assert np.array_equal(y_t.view(torch.int16).numpy().view(np.uint16), bits(y_np))
