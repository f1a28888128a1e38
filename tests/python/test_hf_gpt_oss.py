"""fp4moe.hf on transformers 5's gpt-oss (GptOssMLP): a tiny random-init GptOssForCausalLM whose experts are quantized
to MXFP4 and written in gpt-oss's release layout (checkpoint_files), swapped with `swap_moe_blocks(checkpoint=...)`
and compared, block and logits, with transformers running the decoded MXFP4 weights; plus the bf16 and NVFP4 swaps of
the same model (interleaved gate/up with biases) and the refusal of a checkpoint whose clamp differs from the model's.
CPU backend; the same on CUDA when a CUDA build and GPU are present. Skips without PyTorch or transformers >= 5."""
from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="needs PyTorch")
transformers = pytest.importorskip("transformers", reason="needs transformers >= 5")
pytest.importorskip("ml_dtypes")
pytest.importorskip("safetensors", reason="checkpoint reading needs the safetensors package")
if int(transformers.__version__.split(".")[0]) < 5:
    pytest.skip("needs transformers >= 5", allow_module_level=True)

from checkpoint_files import (BF16, MXFP4_QUANT_CONFIG, gpt_oss_mxfp4_layer, mxfp4_decode,  # noqa: E402
                              write_checkpoint)
from fp4moe_under_test import import_fp4moe, torch_devices  # noqa: E402

fp4moe, _ = import_fp4moe("hf")
H, I, E, K, LAYERS, VOCAB = 64, 64, 4, 2, 2, 128


def _devices():
    return torch_devices(fp4moe, torch)


def _bf16_np(t):
    return t.detach().float().numpy().astype(BF16)


def _tiny_model(seed=0):
    cfg = transformers.GptOssConfig(vocab_size=VOCAB, hidden_size=H, intermediate_size=I, num_hidden_layers=LAYERS,
                                    num_attention_heads=2, num_key_value_heads=1, head_dim=32, num_local_experts=E,
                                    num_experts_per_tok=K, max_position_embeddings=64, initializer_range=0.1,
                                    sliding_window=8, layer_types=["sliding_attention", "full_attention"])
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.GptOssForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # nonzero biases (init leaves them 0), bf16-representable as the checkpoint stores them
        for blk in _mlps(model):
            for b in (blk.experts.gate_up_proj_bias, blk.experts.down_proj_bias):
                b.copy_((torch.randn(b.shape, generator=g) * 0.5).to(torch.bfloat16).float())
            for p in (blk.router.weight, blk.router.bias):
                p.copy_(p.to(torch.bfloat16).float())
    return model


def _mlps(model):
    return [layer.mlp for layer in model.model.layers]


def _write_mxfp4_checkpoint(model, d, swiglu_limit=None):
    """The model's experts quantized to MXFP4 (fp4moe's quantizer, triton_kernels' scale rule) in gpt-oss's release
    layout; the model's experts are replaced by the decoded values, so that transformers runs the same weights."""
    tensors = {}
    for L, blk in enumerate(_mlps(model)):
        ex = blk.experts
        rows1 = ex.gate_up_proj.detach().transpose(1, 2).contiguous()  # [E, 2I, H], gate/up interleaved as stored
        rows2 = ex.down_proj.detach().transpose(1, 2).contiguous()     # [E, H, I]
        q = fp4moe.quantize_weights(rows1.numpy(), rows2.numpy(), gate_up_order="gate_first", format="mxfp4")
        b1 = q["w1"].reshape(E, 2 * I, H // 32, 16)
        b2 = q["w2"].reshape(E, H, I // 32, 16)
        tensors.update(gpt_oss_mxfp4_layer(L, b1, q["w1_scale"], _bf16_np(ex.gate_up_proj_bias), b2, q["w2_scale"],
                                           _bf16_np(ex.down_proj_bias), _bf16_np(blk.router.weight),
                                           _bf16_np(blk.router.bias)))
        with torch.no_grad():
            ex.gate_up_proj.copy_(torch.from_numpy(mxfp4_decode(b1, q["w1_scale"])).transpose(1, 2))
            ex.down_proj.copy_(torch.from_numpy(mxfp4_decode(b2, q["w2_scale"])).transpose(1, 2))
    config = json.loads(model.config.to_json_string())
    config["quantization_config"] = MXFP4_QUANT_CONFIG
    if swiglu_limit is not None:
        config["swiglu_limit"] = swiglu_limit
    return write_checkpoint(d, tensors, config=config)


def _ids(seed=2):
    return torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(seed))


def _close(ours, ref, rel):
    err = (ours - ref).abs().max().item()
    scale = ref.abs().max().item()
    assert scale > 0.05 and err <= rel * scale, (err, scale)


@pytest.mark.parametrize("device", _devices())
def test_mxfp4_checkpoint_swap_matches_transformers(tmp_path, device):
    model = _tiny_model()
    d = _write_mxfp4_checkpoint(model, tmp_path / "ckpt")
    model = model.to(device)
    ids = _ids().to(device)
    h = torch.randn(2, 5, H, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16).float().to(device)
    with torch.no_grad():
        ref_logits = model(input_ids=ids).logits
        ref_y, ref_scores = _mlps(model)[0](h)
        swap = fp4moe.hf.swap_moe_blocks(model, checkpoint=d)
        assert len(swap) == LAYERS
        blk = swap.blocks["model.layers.0.mlp"]
        assert blk.weights.format == fp4moe.WeightFormat.MXFP4
        assert blk.routing_method == int(fp4moe.RoutingMethod.Renormalize)
        assert blk.activation == int(fp4moe.ActivationType.SwigluBias)
        assert blk.activation_params == pytest.approx((1.702, 1.0, 7.0))
        y, scores = blk(h)
        logits = model(input_ids=ids).logits
        swap.restore()
    assert torch.equal(scores, ref_scores)  # the router's own output, passed through as GptOssMLP returns it
    # transformers computes in fp32 on the same decoded weights; the op rounds x and y to bf16
    _close(y, ref_y, 0.02)
    _close(logits, ref_logits, 0.02)


def test_hf_routing_equals_fused_routing(tmp_path):
    """routing='hf' (the router's own top-k ids and softmax weights) gives what the fused Renormalize gives."""
    model = _tiny_model(seed=5)
    d = _write_mxfp4_checkpoint(model, tmp_path / "ckpt")
    h = torch.randn(3, 4, H, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16).float()
    with torch.no_grad():
        fused = fp4moe.hf.swap_moe_blocks(model, checkpoint=d)
        y_fused, _ = fused.blocks["model.layers.1.mlp"](h)
        fused.restore()
        hf = fp4moe.hf.swap_moe_blocks(model, checkpoint=d, routing="hf")
        y_hf, _ = hf.blocks["model.layers.1.mlp"](h)
        hf.restore()
    assert (y_fused - y_hf).abs().max().item() <= 1e-2 * y_fused.abs().max().item()


@pytest.mark.parametrize("quantize", [False, True])
def test_bf16_and_nvfp4_swaps_of_interleaved_experts(quantize):
    """Without a checkpoint: the model's interleaved gate/up experts with biases, as bf16 or quantized to NVFP4 (with
    write_back, transformers then runs the decoded NVFP4 weights in its interleaved storage)."""
    model = _tiny_model(seed=7)
    with torch.no_grad():  # bf16-representable expert weights, so that quantize=False compares like for like
        for blk in _mlps(model):
            for p in (blk.experts.gate_up_proj, blk.experts.down_proj):
                p.copy_(p.to(torch.bfloat16).float())
    ids = _ids(8)
    with torch.no_grad():
        swap = fp4moe.hf.swap_moe_blocks(model, quantize=quantize, write_back=quantize)
        ours = model(input_ids=ids).logits
        swap.restore()
        ref = model(input_ids=ids).logits
    _close(ours, ref, 0.03)


def test_checkpoint_with_another_clamp_is_refused(tmp_path):
    model = _tiny_model(seed=9)
    d = _write_mxfp4_checkpoint(model, tmp_path / "ckpt", swiglu_limit=5.0)
    before = [type(m).__name__ for m in _mlps(model)]
    with pytest.raises(fp4moe.Fp4MoeError, match="limit") as e:
        fp4moe.hf.swap_moe_blocks(model, checkpoint=d)
    assert e.value.argument == "checkpoint"
    assert [type(m).__name__ for m in _mlps(model)] == before


def test_peft_lora_on_interleaved_experts_is_refused():
    peft = pytest.importorskip("peft", reason="needs peft")
    model = _tiny_model(seed=11)
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=[],
                          target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    pm = peft.get_peft_model(model, cfg)
    with pytest.raises(fp4moe.Fp4MoeError, match="interleaved") as e:
        fp4moe.hf.swap_moe_blocks(pm)
    assert e.value.argument == "adapters"
    assert np.all([type(layer.mlp).__name__ == "GptOssMLP" for layer in pm.base_model.model.model.layers])
