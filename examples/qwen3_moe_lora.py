#!/usr/bin/env python3
"""fp4moe as a drop-in for HuggingFace transformers' Qwen3-MoE sparse block, with a PEFT LoRA on the experts.

Builds a small random-initialised Qwen3-MoE (no download), attaches a PEFT LoRA to the fused experts through
`target_parameters` (experts.gate_up_proj and experts.down_proj), then runs the model end to end twice on the
same tokens:

  1. with every Qwen3MoeSparseMoeBlock swapped for fp4moe's fused operator (NVFP4 experts, LoRA from the
     PEFT adapter loaded into an AdapterRegistry slot), and
  2. with transformers + PEFT themselves, after writing the decoded NVFP4 weights back into the HF experts
     (swap_moe_blocks(write_back=True), then restore()), so both runs use the same expert weights.

It prints the largest absolute logit difference (and the logits' scale for context). Exit status 0 when the
difference is within --tolerance (relative to the largest |logit|), 1 otherwise.

    python examples/qwen3_moe_lora.py                    # CPU, bf16
    python examples/qwen3_moe_lora.py --device cuda      # fp4moe CUDA backend (H200)

Needs torch, transformers >= 5 and peft; the fp4moe package on the path (pip install ., or a CMake build with
-DFP4MOE_BUILD_PYTHON=ON and FP4MOE_BUILD_DIR / PYTHONPATH=python).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _import_fp4moe():
    try:
        import fp4moe  # noqa: F401
    except ImportError:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
    import fp4moe.hf
    return fp4moe


def build_model(hidden: int, inter: int, experts: int, top_k: int, layers: int, vocab: int, dtype, seed: int):
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    heads = max(2, hidden // 64)
    config = Qwen3MoeConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * inter, moe_intermediate_size=inter,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=max(1, heads // 2),
        head_dim=hidden // heads, num_experts=experts, num_experts_per_tok=top_k, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=256, initializer_range=0.05,
        tie_word_embeddings=False)
    model = Qwen3MoeForCausalLM(config).to(dtype).eval()
    return model, config


def attach_lora(model, rank: int, alpha: float, seed: int):
    """A PEFT LoRA on the fused experts (target_parameters), with random non-zero B (a trained adapter)."""
    import torch
    from peft import LoraConfig, get_peft_model

    cfg = LoraConfig(r=rank, lora_alpha=alpha, target_modules=[],
                     target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    peft_model = get_peft_model(model, cfg).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_((torch.randn(p.shape, generator=g) * 0.05).to(p.dtype))
    return peft_model


def run(hidden=256, inter=128, experts=8, top_k=2, layers=2, vocab=512, batch=2, seq=8, rank=8, alpha=16.0,
        dtype="bfloat16", device="cpu", quantize=True, seed=0, verbose=True):
    """Returns (max |logit difference|, max |logit|, the number of blocks swapped)."""
    import torch

    fp4moe = _import_fp4moe()
    torch_dtype = getattr(torch, dtype)
    model, _config = build_model(hidden, inter, experts, top_k, layers, vocab, torch_dtype, seed)
    peft_model = attach_lora(model, rank, alpha, seed + 1).to(device)
    ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed + 2)).to(device)

    with torch.no_grad():
        swap = fp4moe.hf.swap_moe_blocks(peft_model, quantize=quantize, write_back=True)
        ours = peft_model(input_ids=ids).logits.float()
        blocks = len(swap)
        swap.restore()  # transformers' blocks again, now holding the decoded NVFP4 expert weights
        ref = peft_model(input_ids=ids).logits.float()

    diff = (ours - ref).abs().max().item()
    scale = ref.abs().max().item()
    if verbose:
        print(f"Qwen3-MoE: {layers} layers, hidden {hidden}, moe_intermediate {inter}, {experts} experts, "
              f"top-{top_k}; LoRA r={rank} alpha={alpha} on experts.gate_up_proj + experts.down_proj")
        print(f"swapped {blocks} Qwen3MoeSparseMoeBlock(s) for fp4moe ({'NVFP4' if quantize else 'bf16'} experts, "
              f"{dtype} model, device {device})")
        print(f"largest |logit difference| fp4moe vs transformers+PEFT: {diff:.6g} (largest |logit| {scale:.4g}, "
              f"relative {diff / max(scale, 1e-30):.3g})")
    return diff, scale, blocks


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--inter", type=int, default=128, help="moe_intermediate_size")
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=8)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--alpha", type=float, default=16.0)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--bf16-experts", action="store_true", help="keep the experts in bf16 (no NVFP4)")
    p.add_argument("--tolerance", type=float, default=0.05, help="max difference relative to the largest |logit|")
    a = p.parse_args(argv)
    diff, scale, _ = run(a.hidden, a.inter, a.experts, a.top_k, a.layers, a.vocab, a.batch, a.seq, a.rank, a.alpha,
                         a.dtype, a.device, not a.bf16_experts)
    return 0 if diff <= a.tolerance * max(scale, 1e-30) else 1


if __name__ == "__main__":
    sys.exit(main())
