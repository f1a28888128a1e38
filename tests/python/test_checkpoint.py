"""Checkpoint import (issue 27): small checkpoints in each real format (ModelOpt NVFP4, ModelOpt MIXED_PRECISION,
compressed-tensors nvfp4-pack-quantized, bf16 fused GPT-OSS; written by checkpoint_files.py), one shard and sharded
with model.safetensors.index.json, loaded and compared with the arrays they were written from (bit for bit, and
through the CPU operator); bad files refused with errors naming the file and the tensor."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from fp4moe_under_test import REPO, import_fp4moe

ml_dtypes = pytest.importorskip("ml_dtypes")
pytest.importorskip("safetensors", reason="checkpoint reading needs the safetensors package")
from checkpoint_files import (BF16, ct_model, decode, gpt_oss_model, modelopt_model,  # noqa: E402
                              rewrite as _rewrite, write_checkpoint)

fp4moe, ckpt = import_fp4moe("checkpoint")
Fp4MoeError = fp4moe.Fp4MoeError


# ---- comparing -----------------------------------------------------------------------------------------------

def run_layer(weights, E, H, act="swiglu", seed=5, **kw):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((6, H)) * 0.5).astype(np.float32).astype(BF16)
    logits = rng.standard_normal((6, E)).astype(np.float32)
    return fp4moe.moe(x, weights, routing_logits=logits, top_k=2, routing_method="renormalize", activation=act,
                      num_threads=1, **kw)


def check_nvfp4_layer(d, L, truth, shards_label):
    got = ckpt.read_moe_layer(d, L)
    assert got["format"] == "nvfp4"
    r = got["routed"]
    for k in ("w1", "w2", "w1_scale2", "w2_scale2"):
        np.testing.assert_array_equal(r[k], truth[k], err_msg=f"{shards_label} layer {L} {k}")
    for k in ("w1_scale", "w2_scale"):
        np.testing.assert_array_equal(r[k].view(np.uint8), truth[k].view(np.uint8), err_msg=k)
    # Hand decoding of the files' per-expert linears against the decoded stacked weights.
    d1, d2 = fp4moe.dequantize_weights(**r)
    E, n1, _ = r["w1"].shape
    I = n1 // 2
    for e in range(E):
        ref_gate = decode(truth["w1"][e, :I], truth["w1_scale"][e, :I], truth["w1_scale2"][e, 0])
        ref_up = decode(truth["w1"][e, I:], truth["w1_scale"][e, I:], truth["w1_scale2"][e, 1])
        np.testing.assert_array_equal(d1[e], np.concatenate([ref_gate, ref_up]))
        np.testing.assert_array_equal(d2[e], decode(truth["w2"][e], truth["w2_scale"][e], truth["w2_scale2"][e]))
    if truth["in1"]:
        assert got["mode"] == "a4"
        assert got["fc1_input_scale"] == pytest.approx(max(truth["in1"]), rel=0, abs=0)
        assert got["fc2_input_scale"] == pytest.approx(max(truth["in2"]), rel=0, abs=0)
    # The operator on the CPU: loader's weights against weights prepared from the arrays directly, bit for bit.
    layer = ckpt.load_moe_layer(d, L)
    direct = fp4moe.prepare_weights(**{k: truth[k] for k in ("w1", "w1_scale", "w1_scale2", "w2", "w2_scale",
                                                             "w2_scale2")},
                                    gate_up_order="gate_first", activation="swiglu")
    H = r["w2"].shape[1]
    y1, y2 = run_layer(layer.weights, E, H), run_layer(direct, E, H)
    np.testing.assert_array_equal(y1.view(np.uint16), y2.view(np.uint16))
    assert np.abs(y1.astype(np.float32)).max() > 0
    return layer


# ---- formats -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("shards", [1, 3])
def test_modelopt_nvfp4_qwen3(tmp_path, shards):
    d, truth = modelopt_model(tmp_path / "m", shards=shards)
    assert (d / "model.safetensors.index.json").exists() == (shards > 1)
    for L in (0, 1):
        layer = check_nvfp4_layer(d, L, truth[L], f"{shards} shards")
        assert layer.architecture == "Qwen3-MoE" and layer.format == "nvfp4"
        assert layer.router.routing_method == fp4moe.RoutingMethod.RenormalizeNaive and layer.router.top_k == 2
        np.testing.assert_array_equal(layer.router.weight.view(np.uint16), truth[L]["router"].view(np.uint16))
        assert layer.activation == fp4moe.ActivationType.Swiglu and layer.mode == "a4"
        kw = layer.moe_kwargs()
        assert kw["mode"] == "a4" and kw["fc1_input_scale"] == layer.fc1_input_scale


def test_modelopt_w4a16_and_excluded_layer_loads_bf16(tmp_path):
    d, truth = modelopt_model(tmp_path / "m", a4=False, bf16_layers=(1,))
    layer0 = check_nvfp4_layer(d, 0, truth[0], "w4a16")
    assert layer0.mode == "a16" and layer0.quantization.startswith("modelopt W4A16_NVFP4")
    got = ckpt.read_moe_layer(d, 1)
    assert got["format"] == "bf16"
    np.testing.assert_array_equal(got["routed"]["w1"].view(np.uint16), truth[1]["w1"].view(np.uint16))
    np.testing.assert_array_equal(got["routed"]["w2"].view(np.uint16), truth[1]["w2"].view(np.uint16))
    layer1 = ckpt.load_moe_layer(d, 1)
    direct = fp4moe.prepare_bf16_weights(truth[1]["w1"], truth[1]["w2"], gate_up_order="gate_first",
                                         activation="swiglu")
    np.testing.assert_array_equal(run_layer(layer1.weights, 4, 64).view(np.uint16),
                                  run_layer(direct, 4, 64).view(np.uint16))


def test_modelopt_mixed_precision_deepseek_shared_expert(tmp_path):
    d, truth = modelopt_model(tmp_path / "m", arch="deepseek", algo="MIXED_PRECISION", shards=2)
    layer = check_nvfp4_layer(d, 1, truth[1], "mixed")
    assert layer.architecture == "DeepSeek-V3"
    r = layer.router
    assert (r.routing_method, r.n_group, r.topk_group, r.routed_scaling_factor) == \
        (fp4moe.RoutingMethod.DeepSeekV3, 2, 1, 2.5)
    np.testing.assert_array_equal(r.e_score_correction_bias, truth[1]["correction_bias"])
    assert layer.shared_expert is not None and layer.shared_expert.format == fp4moe.WeightFormat.BF16
    got = ckpt.read_moe_layer(d, 1)
    np.testing.assert_array_equal(got["shared"]["w1"].view(np.uint16), truth[1]["shared"]["w1"].view(np.uint16))
    np.testing.assert_array_equal(got["shared"]["w2"].view(np.uint16), truth[1]["shared"]["w2"].view(np.uint16))
    # The whole layer through the operator's own DeepSeekV3 routing with the shared expert, as moe_kwargs says.
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((5, 64)) * 0.5).astype(np.float32).astype(BF16)
    logits = rng.standard_normal((5, 4)).astype(np.float32)
    y = fp4moe.moe(x, layer.weights, routing_logits=logits, num_threads=1, **layer.moe_kwargs(mode="a16"))
    direct = fp4moe.prepare_weights(**{k: truth[1][k] for k in ("w1", "w1_scale", "w1_scale2", "w2", "w2_scale",
                                                                "w2_scale2")}, gate_up_order="gate_first",
                                    activation="swiglu")
    sh = fp4moe.prepare_bf16_weights(truth[1]["shared"]["w1"], truth[1]["shared"]["w2"],
                                     gate_up_order="gate_first", activation="swiglu")
    y2 = fp4moe.moe(x, direct, routing_logits=logits, top_k=2, routing_method="DeepSeekV3", n_group=2, topk_group=1,
                    routed_scaling_factor=2.5, routing_bias=truth[1]["correction_bias"], activation="swiglu",
                    shared_expert=sh, num_threads=1)
    np.testing.assert_array_equal(y.view(np.uint16), y2.view(np.uint16))


@pytest.mark.parametrize("shards", [1, 2])
def test_compressed_tensors_mixtral(tmp_path, shards):
    d, truth = ct_model(tmp_path / "c", shards=shards)
    for L in (0, 1):
        layer = check_nvfp4_layer(d, L, truth[L], f"ct {shards}")
        assert layer.architecture == "Mixtral" and layer.router.routing_method == fp4moe.RoutingMethod.Renormalize
        assert layer.quantization == "compressed-tensors nvfp4-pack-quantized (W4A4)"


def test_compressed_tensors_w4a16(tmp_path):
    d, truth = ct_model(tmp_path / "c", a4=False, layers=1)
    layer = check_nvfp4_layer(d, 0, truth[0], "ct w4a16")
    assert layer.mode == "a16" and "W4A16" in layer.quantization


def test_gpt_oss_fused_bf16(tmp_path):
    d, truth = gpt_oss_model(tmp_path / "g")
    got = ckpt.read_moe_layer(d, 0)
    r = got["routed"]
    np.testing.assert_array_equal(r["w1"].view(np.uint16), truth[0]["w1"].view(np.uint16))
    np.testing.assert_array_equal(r["w2"].view(np.uint16), truth[0]["w2"].view(np.uint16))
    np.testing.assert_array_equal(r["bias1"], truth[0]["bias1"])
    layer = ckpt.load_moe_layer(d, 0)
    assert layer.activation == fp4moe.ActivationType.SwigluBias
    assert (layer.gemm1_alpha, layer.gemm1_beta, layer.gemm1_clamp_limit) == (1.702, 1.0, 7.0)
    assert layer.router.bias is not None and layer.router.routing_method == fp4moe.RoutingMethod.Renormalize
    direct = fp4moe.prepare_bf16_weights(truth[0]["w1"], truth[0]["w2"], bias1=truth[0]["bias1"],
                                         bias2=truth[0]["bias2"], gate_up_order="gate_first", activation="swiglubias")
    kw = dict(gemm1_alpha=1.702, gemm1_beta=1.0, gemm1_clamp_limit=7.0)
    np.testing.assert_array_equal(run_layer(layer.weights, 4, 32, "swiglubias", **kw).view(np.uint16),
                                  run_layer(direct, 4, 32, "swiglubias", **kw).view(np.uint16))


# ---- parallel shards -----------------------------------------------------------------------------------------

def test_tp_and_ep_read_only_their_part(tmp_path):
    from fp4moe import distributed
    d, truth = modelopt_model(tmp_path / "m", E=5, I=64, layers=1)
    full = ckpt.read_moe_layer(d, 0)["routed"]
    for rank in range(2):
        part = ckpt.read_moe_layer(d, 0, tp=(rank, 2))
        ref = distributed.shard_tp(**full, rank=rank, world=2)
        for k in ("w1", "w1_scale", "w2", "w2_scale", "w1_scale2", "w2_scale2"):
            np.testing.assert_array_equal(np.asarray(part["routed"][k]).view(np.uint8),
                                          np.asarray(ref[k]).view(np.uint8), err_msg=f"tp rank {rank} {k}")
        assert part["bytes_read"] < ckpt.read_moe_layer(d, 0)["bytes_read"]
    for rank in range(3):
        part = ckpt.read_moe_layer(d, 0, ep=(rank, 3))
        ref, off, cnt = distributed.shard_ep(**full, rank=rank, world=3)
        assert (part["local_expert_offset"], part["num_local_experts"]) == (off, cnt)
        for k in ("w1", "w2", "w1_scale2"):
            np.testing.assert_array_equal(part["routed"][k], ref[k])
    with pytest.raises(Fp4MoeError, match="multiple of 16"):
        ckpt.read_moe_layer(d, 0, tp=(0, 8))



def test_missing_tensor_names_it(tmp_path):
    d, _ = modelopt_model(tmp_path / "m", layers=1)
    name = "model.layers.0.mlp.experts.2.up_proj.weight_scale"
    _rewrite(d, lambda t: t.pop(name))
    with pytest.raises(Fp4MoeError, match=name.replace(".", r"\.") + "' is missing") as ei:
        ckpt.load_moe_layer(d, 0)
    assert ei.value.code == fp4moe.ErrorCode.NotFound and ei.value.argument == "checkpoint"


def test_missing_shard_of_index(tmp_path):
    d, _ = modelopt_model(tmp_path / "m", layers=1, shards=2)
    (d / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(Fp4MoeError, match="model-00002-of-00002.safetensors: the file is missing"):
        ckpt.load_moe_layer(d, 0)


def test_truncated_file_names_file_and_tensor(tmp_path):
    d, _ = modelopt_model(tmp_path / "m", layers=1, shards=2)
    p = d / "model-00001-of-00002.safetensors"
    p.write_bytes(p.read_bytes()[:-100])
    with pytest.raises(Fp4MoeError, match=r"model-00001-of-00002\.safetensors.*truncated: tensor '") as ei:
        ckpt.load_moe_layer(d, 0)
    assert "not a valid safetensors file" in str(ei.value)


def test_wrong_dtype_names_tensor(tmp_path):
    d, _ = modelopt_model(tmp_path / "m", layers=1)
    name = "model.layers.0.mlp.experts.1.down_proj.weight_scale"
    _rewrite(d, lambda t: t.__setitem__(name, t[name].astype(np.float32).astype(BF16)))
    with pytest.raises(Fp4MoeError, match=rf"model\.safetensors: tensor '{name}': expected dtype F8_E4M3, got BF16"):
        ckpt.load_moe_layer(d, 0)


def test_mismatched_shape_names_tensor(tmp_path):
    d, _ = modelopt_model(tmp_path / "m", layers=1)
    name = "model.layers.0.mlp.experts.3.gate_proj.weight"
    _rewrite(d, lambda t: t.__setitem__(name, np.zeros((16, 32), np.uint8)))
    with pytest.raises(Fp4MoeError, match=rf"tensor '{name}': expected shape \[32, 32\] for a \[32, 64\] weight, "
                                          r"got \[16, 32\]"):
        ckpt.load_moe_layer(d, 0)


def test_unknown_quantization_config(tmp_path):
    d, _ = ct_model(tmp_path / "c", layers=1)
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "awq", "bits": 4}
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(Fp4MoeError, match=r"config\.json: unknown quantization config quant_method='awq'") as ei:
        ckpt.load_moe_layer(d, 0)
    assert ei.value.code == fp4moe.ErrorCode.Unsupported
    hq = tmp_path / "m"
    modelopt_model(hq, layers=1)
    (hq / "hf_quant_config.json").write_text(json.dumps({"quantization": {"quant_algo": "FP8"}}))
    with pytest.raises(Fp4MoeError, match=r"hf_quant_config\.json: unsupported ModelOpt quant_algo 'FP8'"):
        ckpt.load_moe_layer(hq, 0)


def test_config_and_tensors_disagree(tmp_path):
    d, _ = modelopt_model(tmp_path / "m", layers=2, bf16_layers=(1,))
    hq = json.loads((d / "hf_quant_config.json").read_text())
    hq["quantization"]["exclude_modules"] = ["lm_head"]  # now says layer 1's bf16 experts are NVFP4
    (d / "hf_quant_config.json").write_text(json.dumps(hq))
    with pytest.raises(Fp4MoeError, match=r"experts\.0\.gate_proj\.weight' is unquantized but .* quantizes"):
        ckpt.load_moe_layer(d, 1)
    ckpt.load_moe_layer(d, 0)  # the other layer still loads


def test_mxfp4_refused(tmp_path):
    t = {"model.layers.0.mlp.experts.gate_up_proj_blocks": np.zeros((2, 32, 1, 16), np.uint8),
         "model.layers.0.mlp.experts.down_proj_blocks": np.zeros((2, 16, 1, 16), np.uint8)}
    d = write_checkpoint(tmp_path / "x", t, config={"model_type": "gpt_oss", "num_local_experts": 2})
    with pytest.raises(Fp4MoeError, match="gate_up_proj_blocks' is MXFP4"):
        ckpt.load_moe_layer(d, 0)


def test_not_a_moe_layer(tmp_path):
    d, _ = modelopt_model(tmp_path / "m", layers=1)
    with pytest.raises(Fp4MoeError, match=r"layer 7 has no MoE experts \(MoE layers: \[0\]\)"):
        ckpt.load_moe_layer(d, 7)


# ---- inspect, memory and time ------------------------------------------------------------------------------------

def test_inspect_reports_loads_and_refusals(tmp_path):
    d, _ = modelopt_model(tmp_path / "m", layers=3, bf16_layers=(2,), shards=2)
    name = "model.layers.1.mlp.experts.0.down_proj.weight_scale_2"
    for f in d.glob("*.safetensors"):  # drop one tensor from whichever shard holds it
        from safetensors import safe_open
        with safe_open(str(f), framework="np") as h:
            if name in h.keys():
                idx = json.loads((d / "model.safetensors.index.json").read_text())
                del idx["weight_map"][name]
                (d / "model.safetensors.index.json").write_text(json.dumps(idx))
    info = ckpt.inspect_checkpoint(d)
    rows = {r["layer"]: r for r in info["layers"]}
    assert rows[0]["load"] and rows[0]["format"] == "nvfp4" and rows[0]["experts"] == 4
    assert not rows[1]["load"] and name in rows[1]["reason"]
    assert rows[2]["load"] and rows[2]["format"] == "bf16"
    text = ckpt.format_inspect(info)
    assert "2 of 3 MoE layers would load" in text and "refused:" in text
    out = subprocess.run([sys.executable, "-m", "fp4moe.checkpoint", "inspect", str(d)], capture_output=True,
                         text=True, env=dict(os.environ, PYTHONPATH=str(REPO / "python")), timeout=60)
    assert out.returncode == 1, out.stderr  # a layer would be refused
    assert "layer   0: Qwen3-MoE, nvfp4, E=4 H=64 I=32" in out.stdout


def test_cli_inspect_when_built(tmp_path):
    exe = Path(os.environ.get("FP4MOE_BUILD_DIR", REPO / "build")) / "fp4moe"
    if not exe.exists():
        pytest.skip(f"the fp4moe CLI is not built at {exe}")
    d, _ = ct_model(tmp_path / "c", shards=2)
    out = subprocess.run([str(exe), "inspect", str(d)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "compressed-tensors" in out.stdout and "2 of 2 MoE layers would load" in out.stdout


def test_load_time_and_memory_of_the_largest_layer(tmp_path):
    """A bounded measurement for the record: one layer of the largest test checkpoint (E=16, H=512, I=256)."""
    import tracemalloc
    d, truth = modelopt_model(tmp_path / "big", layers=2, E=16, H=512, I=256, shards=2)
    tracemalloc.start()
    t0 = time.perf_counter()
    got = ckpt.read_moe_layer(d, 1)
    dt = time.perf_counter() - t0
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    layer_bytes = sum(v.nbytes for v in got["routed"].values())
    print(f"\nload of one layer: {got['bytes_read']:,} bytes of tensors in {dt * 1e3:.1f} ms; traced peak "
          f"{peak:,} bytes ({peak / layer_bytes:.2f}x the layer's arrays)")
    np.testing.assert_array_equal(got["routed"]["w1"], truth[1]["w1"])
    assert peak < 3 * layer_bytes + (4 << 20)  # the stacked arrays plus slack: no whole-file reads


# ---- the HF drop-in ---------------------------------------------------------------------------------------------

def test_swap_moe_blocks_from_checkpoint(tmp_path):
    torch = pytest.importorskip("torch", reason="swap_moe_blocks(checkpoint=) needs PyTorch")
    transformers = pytest.importorskip("transformers", reason="swap_moe_blocks(checkpoint=) needs transformers >= 5")
    hf = pytest.importorskip("fp4moe.hf")
    E, H, I, layers = 4, 64, 32, 2
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=32, hidden_size=H, intermediate_size=2 * I, moe_intermediate_size=I, num_hidden_layers=layers,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, num_experts=E, num_experts_per_tok=2,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=64,
        tie_word_embeddings=False)
    model = transformers.Qwen3MoeForCausalLM(cfg).eval()
    d, truth = modelopt_model(tmp_path / "m", layers=layers, E=E, H=H, I=I, shards=2)
    # A bad checkpoint first: nothing may be swapped.
    bad, _ = modelopt_model(tmp_path / "bad", layers=1, E=E, H=H, I=I)
    with pytest.raises(Fp4MoeError, match="layer 1 has no MoE experts"):
        hf.swap_moe_blocks(model, checkpoint=bad)
    assert not any(isinstance(m, hf.Fp4MoeSparseMoeBlock) for m in model.modules())
    swap = hf.swap_moe_blocks(model, checkpoint=d, device="cpu")
    assert len(swap) == layers
    for L in range(layers):
        w = swap.blocks[f"model.layers.{L}.mlp"].weights
        direct = fp4moe.prepare_weights(**{k: truth[L][k] for k in ("w1", "w1_scale", "w1_scale2", "w2", "w2_scale",
                                                                    "w2_scale2")}, gate_up_order="gate_first",
                                        activation="swiglu")
        np.testing.assert_array_equal(run_layer(w, E, H).view(np.uint16), run_layer(direct, E, H).view(np.uint16))
    with torch.no_grad():
        out = model(input_ids=torch.randint(0, 32, (1, 5))).logits
    assert torch.isfinite(out).all()
    swap.restore()
