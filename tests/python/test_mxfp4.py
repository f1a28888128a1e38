"""MXFP4 weights (SPEC §2) through the Python API: quantize_weights(format="mxfp4") with triton_kernels' scale rule,
prepare_mxfp4_weights and its refusals, the CPU operator against a float64 NumPy computation on the decoded weights,
and gpt-oss's MXFP4 checkpoint layout (checkpoint_files.gpt_oss_mxfp4_model) read by load_moe_layer whole, as TP
and EP shards, with the C++ reader's inspect agreeing."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

from fp4moe_under_test import REPO, import_fp4moe

ml_dtypes = pytest.importorskip("ml_dtypes")
pytest.importorskip("safetensors", reason="checkpoint reading needs the safetensors package")
from checkpoint_files import BF16, gpt_oss_mxfp4_model, mxfp4_tensor  # noqa: E402
from numpy_moe import E2M1, np_combine, np_expert_outputs, np_route  # noqa: E402

fp4moe, ckpt = import_fp4moe("checkpoint")
Fp4MoeError = fp4moe.Fp4MoeError


def rel_l2(y, ref):
    y = np.asarray(y).astype(np.float64)
    return float(np.linalg.norm(y - ref) / np.linalg.norm(ref))


def np_moe(x, logits, w1, w2, bias1, bias2, k=2, offset=0):
    """float64 gpt-oss MoE on decoded weights (gate rows first), SwigluBias 1.702 / 1 / 7, Renormalize."""
    E = w1.shape[0]
    ids, wts = np_route(logits, "Renormalize", k)
    per_expert = lambda v: np.full(E, v)  # noqa: E731
    o, _ = np_expert_outputs(x.astype(np.float64), w1, np.ones((E, 2)), w2, np.ones(E), "SwigluBias",
                             alpha=per_expert(1.702), beta=per_expert(1.0), limit=per_expert(7.0), bias1=bias1,
                             bias2=bias2)
    return np_combine(o, ids, wts, E, offset)


def inputs(T, H, E, seed=7):
    rng = np.random.default_rng(seed)
    x = rng.uniform(-1, 1, (T, H)).astype(np.float32).astype(BF16)
    return x, rng.standard_normal((T, E)).astype(np.float32)


def test_quantize_weights_mxfp4_scale_rule_and_codes():
    rng = np.random.default_rng(1)
    w1 = (rng.standard_normal((2, 64, 96)) * 0.05).astype(np.float32)
    w2 = (rng.standard_normal((2, 96, 32)) * 0.05).astype(np.float32)
    q = fp4moe.quantize_weights(w1, w2, gate_up_order="gate_first", format="mxfp4")
    assert set(q) == {"w1", "w1_scale", "w2", "w2_scale"}
    assert q["w1"].shape == (2, 64, 48) and q["w1_scale"].shape == (2, 64, 3) and q["w1_scale"].dtype == np.uint8
    blocks = w1.reshape(2, 64, 3, 32)
    d = (np.abs(blocks).max(axis=-1) / np.float32(6)).astype(np.float32)  # amax / 6 in fp32
    m, ex = np.frexp(d.astype(np.float64))
    want_e = 127 + np.where(m == 0.5, ex - 1, ex)  # 2^ceil(log2(amax / 6))
    np.testing.assert_array_equal(q["w1_scale"], want_e)
    codes = np.stack([q["w1"] & 15, q["w1"] >> 4], axis=-1).reshape(2, 64, 3, 32)
    scaled = blocks / np.exp2(want_e.astype(np.float64) - 127)[..., None]
    dist = np.abs(np.abs(scaled)[..., None] - E2M1[:8])
    nearest = np.argmin(dist, axis=-1)  # ties: none with random normals
    np.testing.assert_array_equal(codes & 7, nearest)
    np.testing.assert_array_equal(codes >> 3, np.signbit(scaled))  # the sign kept, also of a zero code


def test_prepare_mxfp4_refuses_nan_scale_and_out_of_range_scales():
    rng = np.random.default_rng(2)
    b1, s1, _ = mxfp4_tensor(rng, 2, 64, 64)
    b2, s2, _ = mxfp4_tensor(rng, 2, 64, 32)
    w1, w2 = b1.reshape(2, 64, 32), b2.reshape(2, 64, 16)
    fp4moe.prepare_mxfp4_weights(w1, s1, w2, s2, gate_up_order="gate_first")
    bad = s1.copy()
    bad[1, 5, 1] = 255
    with pytest.raises(Fp4MoeError, match=r"NaN code 255 at expert 1, row 5, block 1") as e:
        fp4moe.prepare_mxfp4_weights(w1, bad, w2, s2, gate_up_order="gate_first")
    assert e.value.argument == "w1_scale"
    big = s2.copy()
    big[0, 0, 0] = 137
    w2z = w2.copy()
    w2z[0, 0, :16] = 0x88  # -0 everywhere in that block: any scale but 255 is fine
    fp4moe.prepare_mxfp4_weights(w1, s1, w2z, big, gate_up_order="gate_first")
    w2n = w2z.copy()
    w2n[0, 0, 3] = 0x10  # one nonzero code under 2^10: refused
    with pytest.raises(Fp4MoeError, match=r"E8M0 scales 10\.\.136") as e:
        fp4moe.prepare_mxfp4_weights(w1, s1, w2n, big, gate_up_order="gate_first")
    assert e.value.argument == "w2_scale"
    with pytest.raises(Fp4MoeError) as e:
        fp4moe.prepare_mxfp4_weights(w1[:, :, :24], s1[:, :, :1], w2, s2, gate_up_order="gate_first")  # H = 48
    assert e.value.argument == "w1"


def test_cpu_operator_matches_float64_on_decoded_weights():
    E, H, I, T = 4, 288, 288, 5  # 9 blocks of 32: not a power of two
    rng = np.random.default_rng(3)
    b1, s1, v1 = mxfp4_tensor(rng, E, 2 * I, H, 119, 121)
    b2, s2, v2 = mxfp4_tensor(rng, E, H, I, 119, 121)
    bias1 = rng.uniform(-0.5, 0.5, (E, 2 * I)).astype(np.float32)
    bias2 = rng.uniform(-0.2, 0.2, (E, H)).astype(np.float32)
    w = fp4moe.prepare_mxfp4_weights(b1.reshape(E, 2 * I, H // 2), s1, b2.reshape(E, H, I // 2), s2,
                                     gate_up_order="gate_first", activation="swiglubias", bias1=bias1, bias2=bias2)
    assert w.format == fp4moe.WeightFormat.MXFP4
    x, logits = inputs(T, H, E)
    y = fp4moe.moe(x, w, routing_logits=logits, top_k=2, routing_method="renormalize", activation="swiglubias",
                   gemm1_alpha=1.702, gemm1_beta=1.0, gemm1_clamp_limit=7.0, num_threads=2)
    ref = np_moe(x, logits, v1, v2, bias1, bias2)
    err = rel_l2(y, ref)
    assert err <= 2.5e-3, err
    assert np.abs(ref).max() > 0.1
    with pytest.raises(Fp4MoeError) as e:
        fp4moe.moe(x, w, routing_logits=logits, top_k=2, routing_method="renormalize", activation="swiglubias",
                   mode="a4", fc1_input_scale=1 / 2688, fc2_input_scale=1 / 2688)
    assert e.value.argument == "mode"


def test_gpt_oss_mxfp4_checkpoint_loads_as_written(tmp_path):
    d, truth = gpt_oss_mxfp4_model(tmp_path / "g")
    got = ckpt.read_moe_layer(d, 0)
    assert got["format"] == "mxfp4" and got["mode"] == "a16" and "MXFP4" in got["mode_reason"]
    assert got["quantization"] == "mxfp4 (W4A16)"
    for key, want in truth[0]["prepared"].items():
        np.testing.assert_array_equal(got["routed"][key], want, err_msg=key)
    np.testing.assert_array_equal(got["routed"]["bias1"], truth[0]["bias1"])
    layer = ckpt.load_moe_layer(d, 0)
    assert layer.weights.format == fp4moe.WeightFormat.MXFP4
    assert layer.activation == fp4moe.ActivationType.SwigluBias
    assert (layer.gemm1_alpha, layer.gemm1_beta, layer.gemm1_clamp_limit) == (1.702, 1.0, 7.0)
    assert layer.router.routing_method == fp4moe.RoutingMethod.Renormalize and layer.router.bias is not None
    x, _ = inputs(6, 64, 4, seed=9)
    logits = layer.router_logits(x.astype(np.float32))
    y = fp4moe.moe(x, layer.weights, routing_logits=logits, **layer.moe_kwargs())
    ref = np_moe(x, logits, truth[0]["w1"], truth[0]["w2"], truth[0]["bias1"], truth[0]["bias2"])
    assert rel_l2(y, ref) <= 2.5e-3


def test_gpt_oss_mxfp4_tp_and_ep_read_their_part(tmp_path):
    d, truth = gpt_oss_mxfp4_model(tmp_path / "g", E=5, I=128)
    full = ckpt.read_moe_layer(d, 0)
    P = truth[0]["prepared"]
    I = 128
    for rank in range(2):
        part = ckpt.read_moe_layer(d, 0, tp=(rank, 2))["routed"]
        rows = np.r_[rank * 64:(rank + 1) * 64, I + rank * 64:I + (rank + 1) * 64]
        np.testing.assert_array_equal(part["w1"], P["w1"][:, rows])
        np.testing.assert_array_equal(part["w1_scale"], P["w1_scale"][:, rows])
        np.testing.assert_array_equal(part["w2"], P["w2"][:, :, rank * 32:(rank + 1) * 32])
        np.testing.assert_array_equal(part["w2_scale"], P["w2_scale"][:, :, rank * 2:(rank + 1) * 2])
        np.testing.assert_array_equal(part["bias1"], truth[0]["bias1"][:, rows])
        assert ("bias2" in part) == (rank == 0)  # SPEC §8: bias2 on TP rank 0 only
    with pytest.raises(Fp4MoeError, match="multiple of 32") as e:
        ckpt.read_moe_layer(d, 0, tp=(0, 8))  # 16 a rank: not whole MXFP4 blocks
    assert e.value.argument == "tp"
    for rank, (e0, ne) in enumerate(((0, 3), (3, 2))):
        part = ckpt.read_moe_layer(d, 0, ep=(rank, 2))
        assert (part["local_expert_offset"], part["num_local_experts"]) == (e0, ne)
        np.testing.assert_array_equal(part["routed"]["w1"], full["routed"]["w1"][e0:e0 + ne])
        np.testing.assert_array_equal(part["routed"]["w2_scale"], full["routed"]["w2_scale"][e0:e0 + ne])


def test_mxfp4_config_and_tensors_must_agree(tmp_path):
    d, _ = gpt_oss_mxfp4_model(tmp_path / "g")
    cfg = (d / "config.json").read_text().replace('"quant_method": "mxfp4"', '"quant_method": "compressed-tensors"')
    (d / "config.json").write_text(cfg.replace('"quantization_config": {', '"quantization_config": {"config_groups":'
                                               ' {"g": {"format": "nvfp4-pack-quantized", "weights": {"num_bits": 4,'
                                               ' "type": "float", "group_size": 16}}},'))
    with pytest.raises(Fp4MoeError, match="gate_up_proj_blocks' is MXFP4 but"):
        ckpt.load_moe_layer(d, 0)


def test_cpp_inspect_agrees_with_python(tmp_path):
    d, _ = gpt_oss_mxfp4_model(tmp_path / "g", layers=2, E=4, H=64, I=96)
    py = ckpt.inspect_checkpoint(d)
    assert [r["format"] for r in py["layers"]] == ["mxfp4", "mxfp4"] and all(r["load"] for r in py["layers"])
    exe = Path(os.environ.get("FP4MOE_BUILD_DIR", REPO / "build")) / "fp4moe"
    if not exe.exists():
        pytest.skip("the C++ CLI is not built")
    out = subprocess.run([str(exe), "inspect", str(d)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    for r in py["layers"]:
        line = f"layer {r['layer']}: GPT-OSS, mxfp4, E={r['experts']} H={r['H']} I={r['I']}, {r['bytes']} bytes"
        assert line in out.stdout, out.stdout
    assert out.stdout.count("would load, mode a16 (MXFP4 experts run in A16 (SPEC §2))") == 2, out.stdout
