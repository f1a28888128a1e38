"""PEFT adapters of fused MoE experts: the C++ reader's output as NumPy, and PEFT's fused-expert LoRA as
per-expert stacks (SPEC §5)."""
from __future__ import annotations

import numpy as np

from . import _loader
from ._errors import error
from ._tensors import BF16, is_torch, require_ndim


def read_peft_experts_lora(adapter_dir: str, module_prefix: str, *, num_experts: int = 0, expert_offset: int = 0,
                           num_local_experts: int = 0) -> dict:
    """A saved PEFT adapter's LoRA for one MoE layer (the C++ reader, include/fp4moe/peft.h): a dict with
    a_gate_up [E, r, H], b_gate_up [E, 2I, r] (gate rows first), a_down [E, r, I], b_down [E, H, r] as
    NumPy bfloat16 (the targets present), plus E, H, I, N1, rank, lora_alpha, use_rslora."""
    d = dict(_loader.C.read_peft_experts_lora(str(adapter_dir), str(module_prefix), int(num_experts), int(expert_offset),
                                       int(num_local_experts)))
    if BF16 is not None:
        for k in ("a_gate_up", "b_gate_up", "a_down", "b_down"):
            if k in d:
                d[k] = d[k].view(BF16)
    return d


def list_peft_expert_modules(adapter_dir: str) -> list:
    """The module prefixes (for read_peft_experts_lora / AdapterRegistry.load_peft) that carry fused-expert
    LoRA in a saved PEFT adapter."""
    return list(_loader.C.list_peft_expert_modules(str(adapter_dir)))


def peft_expert_matrices(lora_A, lora_B, num_experts: int):
    """PEFT `target_parameters` LoRA of HF fused experts -> per-expert stacks (SPEC §5).

    lora_A [r*E, in] and lora_B [out, r*E] (the expert index is outer in A, inner in B) become
    A [E, r, in] and B [E, out, r], in the framework of the inputs (NumPy or PyTorch)."""
    ra, n_in = require_ndim(lora_A, "lora_A", 2, "[r*E, in]")
    n_out, rb = require_ndim(lora_B, "lora_B", 2, "[out, r*E]")
    E = int(num_experts)
    if E <= 0 or ra % E or ra != rb:
        raise error("lora_B", f"expected lora_A [r*E, in] and lora_B [out, r*E] with E={E}, got "
                              f"{[ra, n_in]} and {[n_out, rb]}")
    r = ra // E
    A = lora_A.reshape(E, r, n_in)
    B3 = lora_B.reshape(n_out, r, E)
    B = B3.permute(2, 0, 1) if is_torch(B3) else np.transpose(B3, (2, 0, 1))
    if is_torch(B):
        return A.contiguous(), B.contiguous()
    return np.ascontiguousarray(A), np.ascontiguousarray(B)
