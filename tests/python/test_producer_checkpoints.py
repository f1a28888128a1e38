"""Checkpoints written by the real NVFP4 and MXFP4 quantizers (tests/data/producers, made by
tools/make_producer_checkpoints.py; each case's versions.json names the tools and their versions): each loads with
fp4moe.load_moe_layer and fp4moe.moe on the CPU reproduces the producer's own output of the MoE block on the same
fixed inputs (reference.safetensors: x, the producer's y and its router logits). The MXFP4 case, gpt-oss quantized
by triton_kernels, has its own test below.

The producer's y is its fake-quantized forward in bf16: weights NVFP4-decoded, and the activations (ModelOpt
NVFP4_DEFAULT_CFG is W4A4) quantized to NVFP4 with each linear's own calibrated input scale, each linear's output
rounded to bf16. fp4moe's A4 mode quantizes the activations with one input scale per layer (the largest over the
experts, as vLLM does), which moves the E4M3 block scales and so the FP4 rounding of some blocks; its A16 mode does
not quantize the activations at all. llmcompressor (scheme NVFP4) likewise fake-quantizes weights and inputs with
per-linear global scales. Measured relative L2 errors ||y - y_ref|| / ||y_ref|| (ModelOpt 0.47.0, llmcompressor
0.14.0.1 with compressed-tensors 0.19.0, transformers 5.17.0, torch 2.14.0; the DeepSeek-V3 case with torch 2.11.0):

    case                      A4      A16
    modelopt_qwen3_moe        0.044   0.164
    modelopt_deepseek_v3      0.062   0.154
    modelopt_mixtral          0.041   0.159
    llmcompressor_qwen3_moe   0.065   0.164

The bounds below are about twice those (A4 0.10, 0.14 for llmcompressor; A16 0.32). A wrong nibble order, a swapped gate/up, a missing
weight_scale_2 or a misread router gives errors of order 1. The router logits must agree to bf16 rounding and
choose the same experts."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from fp4moe_under_test import REPO, import_fp4moe

ml_dtypes = pytest.importorskip("ml_dtypes")
pytest.importorskip("safetensors", reason="checkpoint reading needs the safetensors package")
from safetensors.numpy import load_file  # noqa: E402

from checkpoint_files import mxfp4_decode  # noqa: E402

fp4moe, ckpt = import_fp4moe("checkpoint")
BF16 = ml_dtypes.bfloat16
DATA = REPO / "tests" / "data" / "producers"
CASES = {  # case: (architecture, shared expert, sharded, A4 bound, A16 bound)
    "modelopt_qwen3_moe": ("Qwen3-MoE", False, False, 0.10, 0.32),
    "modelopt_deepseek_v3": ("DeepSeek-V3", True, True, 0.10, 0.32),
    "modelopt_mixtral": ("Mixtral", False, False, 0.10, 0.32),
    "llmcompressor_qwen3_moe": ("Qwen3-MoE", False, False, 0.14, 0.32),
}


def rel_l2(y, ref):
    return float(np.linalg.norm(y - ref) / np.linalg.norm(ref))


def producer_case(case, *, required=False):
    """(folder, versions.json, reference arrays) of a case; a missing file skips the test, or fails it if required."""
    d = DATA / case
    need = [d / "versions.json", d / "reference.safetensors", d / "checkpoint" / "config.json"]
    missing = [str(p.relative_to(REPO)) for p in need if not p.is_file()]
    if missing:
        msg = f"producer data missing: {', '.join(missing)} (made by tools/make_producer_checkpoints.py)"
        pytest.fail(msg) if required else pytest.skip(msg)
    return d, json.loads((d / "versions.json").read_text()), load_file(str(d / "reference.safetensors"))


@pytest.mark.parametrize("case", sorted(CASES))
def test_producer_checkpoint_matches_producer(case):
    d, info, ref = producer_case(case)
    arch, shared, sharded, bound_a4, bound_a16 = CASES[case]
    assert (d / "checkpoint" / "model.safetensors.index.json").is_file() == sharded

    layer = ckpt.load_moe_layer(d / "checkpoint", info["layer"])
    assert layer.format == "nvfp4" and layer.mode == "a4"
    assert arch.lower() in layer.architecture.lower()
    assert (layer.shared_expert is not None) == shared
    if shared:  # DeepSeek-V3: a selection bias that changes the experts chosen (checked below)
        assert np.abs(np.asarray(layer.router.e_score_correction_bias, dtype=np.float32)).max() > 0

    x = ref["x"].astype(BF16)
    logits = layer.router_logits(x)
    np.testing.assert_allclose(logits, ref["router_logits"], rtol=0, atol=2e-3)
    k = layer.router.top_k
    if layer.router.e_score_correction_bias is None:  # plain top-k routers: the same experts chosen
        pick = lambda a: np.sort(np.argsort(-a, axis=1, kind="stable")[:, :k], axis=1)  # noqa: E731
        np.testing.assert_array_equal(pick(logits), pick(ref["router_logits"]))

    y_ref = ref["y"]
    assert np.abs(y_ref).max() > 0
    for mode, bound in (("a4", bound_a4), ("a16", bound_a16)):
        y = fp4moe.moe(x, layer.weights, routing_logits=logits, num_threads=1,
                       **layer.moe_kwargs(mode=mode)).astype(np.float32)
        err = rel_l2(y, y_ref)
        assert err < bound, f"{case} {mode}: relative L2 {err:.4f} against the producer's output (bound {bound})"
    if shared:  # the file exercises the routing bias: without it the output is far off (1.1)
        kw = {**layer.moe_kwargs(mode="a16"), "routing_bias": np.zeros(layer.num_experts, np.float32)}
        y = fp4moe.moe(x, layer.weights, routing_logits=logits, num_threads=1, **kw).astype(np.float32)
        assert rel_l2(y, y_ref) > 2 * bound_a16


GPT_OSS_BOUND = 0.012


def test_triton_kernels_gpt_oss_checkpoint_matches_producer():
    """gpt-oss's release layout written from triton_kernels' MXFP4 quantizer (downcast_to_mxfp_torch, the one
    transformers calls for gpt-oss; blocks and scales laid out as transformers serializes its tensors). The producer's
    y is transformers' GptOssMLP in bf16 on the checkpoint as transformers itself loads it (Mxfp4Config(dequantize=
    True)), whose experts the maker checked to be triton_kernels' decode (upcast_from_mxfp_torch) bit for bit.

    The weights are the same bits on both sides, so what is left is transformers' bf16 arithmetic (bf16 GEMM outputs,
    gate, softmax and the sum over the top-k), which fp4moe does in fp32: measured 0.0058 relative L2
    (tokenspeed-triton-kernels 1.0.0.post20260510, transformers 5.25.0, torch 2.15.0); the bound is about twice. Read
    up first instead of gate first the error is 1.08, nibbles swapped 1.29, the biases alone 0.91."""
    d, info, ref = producer_case("triton_kernels_gpt_oss", required=True)
    L = info["layer"]
    layer = ckpt.load_moe_layer(d / "checkpoint", L)
    assert layer.format == "mxfp4" and layer.mode == "a16" and "gpt-oss" in layer.architecture.lower()
    assert layer.activation == fp4moe.ActivationType.SwigluBias
    assert (layer.gemm1_alpha, layer.gemm1_beta, layer.gemm1_clamp_limit) == pytest.approx((1.702, 1.0, 7.0))
    with pytest.raises(fp4moe.Fp4MoeError, match="mode"):  # MXFP4 runs A16 only (SPEC §2)
        layer.moe_kwargs(mode="a4")

    # The codes and scales fp4moe reads (gate rows first) decode to triton_kernels' own decode: the sha256 of its bf16
    # output in transformers' [E, K, N] expert layout (gate and up columns interleaved), bit for bit.
    r = ckpt.read_moe_layer(d / "checkpoint", L)["routed"]
    E, N, _ = r["w1"].shape
    interleave = np.stack([np.arange(N // 2), np.arange(N // 2) + N // 2], axis=1).reshape(-1)
    decoded = {"gate_up_proj": mxfp4_decode(r["w1"].reshape(E, N, -1, 16), r["w1_scale"])[:, interleave],
               "down_proj": mxfp4_decode(r["w2"].reshape(E, r["w2"].shape[1], -1, 16), r["w2_scale"])}
    for name, w in decoded.items():
        got = hashlib.sha256(np.ascontiguousarray(w.transpose(0, 2, 1).astype(BF16)).tobytes()).hexdigest()
        assert got == info["decoded_bf16_sha256"][f"model.layers.{L}.mlp.experts.{name}"], name

    x = ref["x"].astype(BF16)
    logits = layer.router_logits(x)  # fp32; transformers' are bf16
    np.testing.assert_allclose(logits, ref["router_logits"], rtol=0, atol=4e-3)
    pick = lambda a: np.sort(np.argsort(-a, axis=1, kind="stable")[:, :layer.router.top_k], axis=1)  # noqa: E731
    np.testing.assert_array_equal(pick(logits), pick(ref["router_logits"]))
    y = fp4moe.moe(x, layer.weights, routing_logits=logits, num_threads=1,
                   **layer.moe_kwargs(mode="a16")).astype(np.float32)
    err = rel_l2(y, ref["y"])
    assert err < GPT_OSS_BOUND, f"relative L2 {err:.4f} against the producer's output (bound {GPT_OSS_BOUND})"


class _DeviceCopy:
    """What the stand-in torch below gives for torch.from_numpy(a).to(device): the array and where it went."""

    def __init__(self, a, device=None):
        self.array, self.device = a, device

    def to(self, device):
        return _DeviceCopy(self.array, device)


def test_moe_kwargs_give_the_routing_bias_on_the_weights_device(monkeypatch):
    """fp4moe.moe reads routing_bias on the weights' device: a layer loaded with device="cuda" must not hand it over
    as a host array (the operator refuses it: "routing.bias: expected a tensor on cuda:0"). Checked without a GPU:
    the layer's weights say cuda:1, torch is a stand-in that records the copy, then absent."""
    import dataclasses
    import sys
    import types
    d = DATA / "modelopt_deepseek_v3"
    if not (d / "checkpoint" / "config.json").is_file():
        pytest.skip("producer data missing")
    layer = ckpt.load_moe_layer(d / "checkpoint", 1)
    bias = np.asarray(layer.router.e_score_correction_bias, dtype=np.float32)
    assert isinstance(layer.moe_kwargs()["routing_bias"], np.ndarray)  # on the host for host weights

    on_gpu = dataclasses.replace(layer, weights=types.SimpleNamespace(_device=("cuda", 1), device="cuda:1"),
                                 _device_copies={})
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(from_numpy=_DeviceCopy))
    got = on_gpu.moe_kwargs(mode="a16")["routing_bias"]
    assert isinstance(got, _DeviceCopy) and got.device == "cuda:1"
    np.testing.assert_array_equal(got.array, bias)
    assert on_gpu.moe_kwargs(mode="a16")["routing_bias"] is got  # copied once

    monkeypatch.setitem(sys.modules, "torch", None)  # no PyTorch: say so, naming the argument
    with pytest.raises(fp4moe.Fp4MoeError, match="routing_bias"):
        dataclasses.replace(on_gpu, _device_copies={}).moe_kwargs(mode="a16")
