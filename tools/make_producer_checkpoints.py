"""Makes tests/data/producers/: tiny MoE checkpoints written by the real NVFP4 and MXFP4 quantizers, for
tests/python/test_producer_checkpoints.py.

Each case builds a tiny random-init transformers model, quantizes it with the producer, saves the checkpoint
the producer's own way into <case>/checkpoint/, and writes beside that folder:

  reference.safetensors  x [T, H] (bf16 values as F32, seeded), the producer's output y [T, H] of one MoE
                         block (its quantized module's forward in bf16, fake-quantized weights and
                         activations; bf16 values as F32) and the block's router logits (the model's gate)
  versions.json          the versions of the tools, the case and the layer

The gpt-oss case quantizes the experts to MXFP4 with triton_kernels (the Triton repository's python/triton_kernels,
the quantizer transformers calls for gpt-oss; PyPI has it as tokenspeed-triton-kernels, a vendor build, while PyPI's
triton-kernels is another project), writes them in gpt-oss's release layout, and its y is transformers' GptOssMLP
(weights decoded, activations not quantized) running the experts as triton_kernels decodes them; its versions.json
also holds the sha256 of that decode.

Run on a CPU host (no GPU needed) with torch, transformers, nvidia-modelopt, llmcompressor,
compressed-tensors and triton_kernels installed:

  python tools/make_producer_checkpoints.py [--out tests/data/producers] [--only NAME ...]
"""
from __future__ import annotations

import argparse
import copy
import hashlib
import json
import os
import platform
import shutil
import sys
from importlib import metadata
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "python"))
from checkpoint_files import MXFP4_QUANT_CONFIG  # noqa: E402  gpt-oss's release quantization config

SEED = 1234
TOKENS = 16          # rows of the fixed reference input
CALIB_BATCHES = 8    # calibration forward passes of 2 x 32 random tokens
VOCAB = 128


def versions() -> dict:
    out = {"python": platform.python_version()}
    for pkg in ("torch", "transformers", "nvidia-modelopt", "llmcompressor", "compressed-tensors",
                "tokenspeed-triton-kernels", "triton", "safetensors", "accelerate"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            pass
    return out


def common(**kw):
    base = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                max_position_embeddings=128, tie_word_embeddings=False, torch_dtype="bfloat16")
    base.update(kw)
    return base


def qwen3_moe_model():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    cfg = Qwen3MoeConfig(**common(intermediate_size=128, moe_intermediate_size=64, num_experts=4,
                                  num_experts_per_tok=2, norm_topk_prob=True, head_dim=32,
                                  decoder_sparse_step=1, mlp_only_layers=[]))
    return Qwen3MoeForCausalLM(cfg), "model.layers.0.mlp", 0


def deepseek_v3_model():
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
    cfg = DeepseekV3Config(**common(num_hidden_layers=2, intermediate_size=128, moe_intermediate_size=32,
                                    n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=2,
                                    topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True,
                                    first_k_dense_replace=1, q_lora_rank=None, kv_lora_rank=32,
                                    qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=32))
    return DeepseekV3ForCausalLM(cfg), "model.layers.1.mlp", 1


def mixtral_model():
    from transformers import MixtralConfig, MixtralForCausalLM
    cfg = MixtralConfig(**common(intermediate_size=64, num_local_experts=4, num_experts_per_tok=2, head_dim=32))
    return MixtralForCausalLM(cfg), "model.layers.0.mlp", 0  # transformers 5 names the block mlp


def init_model(build):
    torch.manual_seed(SEED)
    model, block, layer = build()
    model = model.to(torch.bfloat16).eval()
    model.config.architectures = [type(model).__name__]  # what from_pretrained would have set
    with torch.no_grad():  # a random init that routes: the DeepSeek correction bias (a buffer) is zero by default
        for name, p in list(model.named_parameters()) + list(model.named_buffers()):
            if name.endswith("e_score_correction_bias"):
                p.copy_(torch.randn_like(p.float()).to(p.dtype) * 0.05)
    return model, block, layer


def calib_batches():
    g = torch.Generator().manual_seed(SEED + 1)
    return [torch.randint(0, VOCAB, (2, 32), generator=g) for _ in range(CALIB_BATCHES)]


def reference_input(H):
    g = torch.Generator().manual_seed(SEED + 2)
    return (torch.randn(TOKENS, H, generator=g) * 0.5).to(torch.bfloat16)


def block_forward(block, x):
    """The producer's MoE block on x [T, H]: (y [T, H], router logits [T, E])."""
    logits = []
    gate = block.router if hasattr(block, "router") else block.gate  # gpt-oss names it router
    hook = gate.register_forward_hook(lambda m, i, o: logits.append(o[0] if isinstance(o, tuple) else o))
    try:
        with torch.no_grad():
            y = block(x[None])
    finally:
        hook.remove()
    y = y[0] if isinstance(y, tuple) else y
    return y.reshape(x.shape).to(torch.bfloat16), logits[0].reshape(x.shape[0], -1).float()


def save_reference(out_dir: Path, x, y, logits, info: dict):
    from safetensors.torch import save_file
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file({"x": x.float().contiguous(), "y": y.float().contiguous(), "router_logits": logits.contiguous()},
              str(out_dir / "reference.safetensors"))
    (out_dir / "versions.json").write_text(json.dumps({**info, "versions": versions()}, indent=1) + "\n")


def get_module(model, name):
    m = model
    for part in name.split("."):
        m = getattr(m, part)
    return m


# ---- ModelOpt ------------------------------------------------------------------------------------------------

def modelopt_cpu_fake_quant(on_cuda: bool = False):
    """ModelOpt's NVFP4 fake quantization runs only as a CUDA/Triton kernel (tensor_quant's dynamic block op
    asserts a CUDA amax). On a CPU host, route that op through ModelOpt's own NVFP4QTensor quantize/dequantize,
    the code its HF export packs the weights with: per-tensor scale amax / (6 * 448), E4M3 block scales of 16
    elements, E2M1 rounding. Calibration (amax collection) and the export itself run unchanged. With on_cuda,
    CUDA tensors take that route too (where the kernel cannot run); calling again sets on_cuda anew."""
    from modelopt.torch.quantization import tensor_quant
    from modelopt.torch.quantization.qtensor import NVFP4QTensor

    def op(inputs, block_size, amax, num_bits, exponent_bits, scale_num_bits, scale_exponent_bits):
        if inputs.is_cuda and not op.on_cuda:
            return kernel(inputs, block_size, amax, num_bits, exponent_bits, scale_num_bits, scale_exponent_bits)
        assert (num_bits, exponent_bits, scale_num_bits, scale_exponent_bits) == (4, 2, 8, 4), "NVFP4 only"
        sf2 = amax.float().amax() / (6.0 * 448.0)
        q, sf, sf2 = NVFP4QTensor.quantize(inputs, block_size, weights_scaling_factor_2=sf2)
        return q.dequantize(dtype=inputs.dtype, scale=sf, double_scale=sf2, block_sizes={-1: block_size})

    kernel = tensor_quant.dynamic_block_quantize_op
    if hasattr(kernel, "on_cuda"):  # already routed
        kernel.on_cuda = on_cuda
        return
    op.on_cuda = on_cuda
    tensor_quant.dynamic_block_quantize_op = op


def modelopt_quantized(build, device="cpu"):
    """The case's model quantized by ModelOpt (NVFP4_DEFAULT_CFG, calibrated on `device`) and a copy prepared as
    the export prepares it, on which the reference forward runs: (model, ref_model, block name, layer)."""
    import modelopt.torch.quantization as mtq

    model, block_name, layer = init_model(build)
    model = model.to(device)
    batches = [b.to(device) for b in calib_batches()]

    def forward_loop(m):
        with torch.no_grad():
            for b in batches:
                m(b)

    if not torch.cuda.is_available():
        modelopt_cpu_fake_quant()
    mtq.quantize(model, mtq.NVFP4_DEFAULT_CFG, forward_loop)
    # The export first makes the quantizers of linears that share an input agree (as the exported scales do), then
    # replaces weights by packed ones: run the block on a copy that went through the same preparation.
    ref_model = copy.deepcopy(model)
    try:
        from modelopt.torch.export.quant_utils import preprocess_linear_fusion  # noqa: F401
        from modelopt.torch.export.unified_export_hf import requantize_resmooth_fused_llm_layers
        requantize_resmooth_fused_llm_layers(ref_model)
    except ImportError:
        pass
    return model, ref_model, block_name, layer


def modelopt_case(build, out_dir: Path, name: str, max_shard_size=None):
    from modelopt.torch.export import export_hf_checkpoint

    model, ref_model, block_name, layer = modelopt_quantized(build)
    x = reference_input(model.config.hidden_size)
    y, logits = block_forward(get_module(ref_model, block_name), x)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    export_hf_checkpoint(model, export_dir=str(out_dir / "checkpoint"), **({"max_shard_size": max_shard_size} if max_shard_size
                                                           else {}))
    save_reference(out_dir, x, y, logits, {"case": name, "producer": "nvidia-modelopt", "layer": layer,
                                           "block": block_name, "config": "NVFP4_DEFAULT_CFG",
                                           "export": "modelopt.torch.export.export_hf_checkpoint",
                                           "fake_quant": ("cuda kernel" if torch.cuda.is_available() else
                                                          "NVFP4QTensor quantize/dequantize on the CPU")})


def tiny_tokenizer():
    """A word-level tokenizer over the tiny vocabulary: oneshot wants a processor even for tokenized data."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", pad_token="t0")


# ---- llmcompressor ---------------------------------------------------------------------------------------------

def llmcompressor_case(build, out_dir: Path, name: str, ignore):
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier

    import tempfile
    from transformers import AutoModelForCausalLM
    model, block_name, layer = init_model(build)
    tmp = tempfile.mkdtemp()  # oneshot reads the model's config from model.config.name_or_path
    model.save_pretrained(tmp)
    model = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.bfloat16).eval()
    batches = calib_batches()
    ds = Dataset.from_list([{"input_ids": r.tolist()} for b in batches for r in b])
    recipe = QuantizationModifier(targets="Linear", scheme="NVFP4", ignore=ignore)
    oneshot(model=model, dataset=ds, recipe=recipe, max_seq_length=32, num_calibration_samples=len(ds),
            processor=tiny_tokenizer())
    x = reference_input(model.config.hidden_size)
    y, logits = block_forward(get_module(model, block_name), x)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    model.save_pretrained(str(out_dir / "checkpoint"), save_compressed=True)
    save_reference(out_dir, x, y, logits, {"case": name, "producer": "llmcompressor", "layer": layer,
                                           "block": block_name, "scheme": "NVFP4", "ignore": ignore,
                                           "save": "save_pretrained(save_compressed=True)"})


# ---- triton_kernels (gpt-oss MXFP4) ----------------------------------------------------------------------------


def gpt_oss_model():
    from transformers import GptOssConfig, GptOssForCausalLM
    cfg = GptOssConfig(**common(intermediate_size=64, num_local_experts=4, num_experts_per_tok=2, head_dim=32,
                                initializer_range=0.1, sliding_window=8, layer_types=["sliding_attention"]))
    return GptOssForCausalLM(cfg), "model.layers.0.mlp", 0


def triton_kernels_gpt_oss_case(out_dir: Path, name: str):
    """A tiny GptOssForCausalLM whose experts triton_kernels quantizes (downcast_to_mxfp_torch, its default
    ROUND_UP scales), written in gpt-oss's release layout; the reference is transformers' own loading of that
    checkpoint (Mxfp4Config(dequantize=True)) running the block, checked to hold triton_kernels' decode
    (upcast_from_mxfp_torch) bit for bit."""
    from safetensors.torch import save_file
    from transformers import GptOssForCausalLM, Mxfp4Config
    from triton_kernels.numerics_details.mxfp import downcast_to_mxfp_torch, upcast_from_mxfp_torch

    model, block_name, layer = init_model(gpt_oss_model)
    g = torch.Generator().manual_seed(SEED + 3)
    with torch.no_grad():  # nonzero biases (the init leaves them 0)
        for lyr in model.model.layers:
            for b in (lyr.mlp.experts.gate_up_proj_bias, lyr.mlp.experts.down_proj_bias, lyr.mlp.router.bias):
                b.copy_(torch.randn(b.shape, generator=g) * 0.1)
    tensors, decoded = {}, {}
    for name_, t in model.state_dict().items():
        if not name_.endswith(("experts.gate_up_proj", "experts.down_proj")):
            tensors[name_] = t.contiguous()
            continue
        # transformers keeps the experts as [E, K, N] (x @ W), triton_kernels' own orientation: quantized along
        # K (axis 1) into codes [E, K/2, N] and E8M0 scales [E, K/32, N].
        w, s = downcast_to_mxfp_torch(t, torch.uint8, axis=1)
        decoded[name_] = upcast_from_mxfp_torch(w, s, torch.bfloat16, axis=1)
        # The release layout, as transformers' Mxfp4ReverseDeserialize writes triton_kernels' (strided) tensors:
        # blocks [E, N, K/32, 16], scales [E, N, K/32].
        scales = s.transpose(-1, -2).contiguous()
        tensors[name_ + "_blocks"] = w.transpose(-1, -2).reshape(*scales.shape, -1).contiguous()
        tensors[name_ + "_scales"] = scales
    if out_dir.exists():
        shutil.rmtree(out_dir)
    ck = out_dir / "checkpoint"
    ck.mkdir(parents=True)
    save_file(tensors, str(ck / "model.safetensors"), metadata={"format": "pt"})
    model.config.quantization_config = MXFP4_QUANT_CONFIG
    model.config.save_pretrained(str(ck))
    model.generation_config.save_pretrained(str(ck))

    ref = GptOssForCausalLM.from_pretrained(str(ck), quantization_config=Mxfp4Config(dequantize=True),
                                            dtype=torch.bfloat16).eval()
    loaded = ref.state_dict()
    for name_, w in decoded.items():  # transformers' dequantized experts are triton_kernels' decode
        assert loaded[name_].dtype == torch.bfloat16 and torch.equal(loaded[name_], w), name_
    x = reference_input(model.config.hidden_size)
    y, logits = block_forward(get_module(ref, block_name), x)
    save_reference(out_dir, x, y, logits, {
        "case": name, "producer": "triton_kernels", "layer": layer, "block": block_name,
        "quantize": "triton_kernels.numerics_details.mxfp.downcast_to_mxfp_torch(w, torch.uint8, axis=1)",
        "decode": "upcast_from_mxfp_torch(w, s, torch.bfloat16, axis=1)",
        "reference": "GptOssForCausalLM.from_pretrained(Mxfp4Config(dequantize=True)), bf16",
        "decoded_bf16_sha256": {n: hashlib.sha256(w.contiguous().view(torch.int16).numpy().tobytes()).hexdigest()
                                for n, w in decoded.items() if n.startswith(f"model.layers.{layer}.")}})


CASES = {
    "modelopt_qwen3_moe": lambda d: modelopt_case(qwen3_moe_model, d, "modelopt_qwen3_moe"),
    "modelopt_deepseek_v3": lambda d: modelopt_case(deepseek_v3_model, d, "modelopt_deepseek_v3",
                                                                max_shard_size="40KB"),
    "modelopt_mixtral": lambda d: modelopt_case(mixtral_model, d, "modelopt_mixtral"),
    "llmcompressor_qwen3_moe": lambda d: llmcompressor_case(qwen3_moe_model, d, "llmcompressor_qwen3_moe",
                                                            ["lm_head", "re:.*mlp.gate$"]),
    "triton_kernels_gpt_oss": lambda d: triton_kernels_gpt_oss_case(d, "triton_kernels_gpt_oss"),
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "tests" / "data" / "producers"))
    ap.add_argument("--only", nargs="*", default=None)
    a = ap.parse_args(argv)
    torch.set_num_threads(min(8, os.cpu_count() or 1))
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    for name, fn in CASES.items():
        if a.only and name not in a.only:
            continue
        print(f"== {name}", flush=True)
        fn(out / name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
