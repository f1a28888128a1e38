"""fp4moe: fused Mixture-of-Experts with NVFP4 expert weights and multi-LoRA (Hopper sm_90a and a CPU
reference).

    import fp4moe
    w = fp4moe.prepare_weights(w1, w1_scale, w1_scale2, w2, w2_scale, w2_scale2,
                               gate_up_order="gate_first", activation="swiglu", device="cuda")
    y = fp4moe.moe(x, w, routing_logits=logits, top_k=8, routing_method="RenormalizeNaive")

Tensors are taken through DLPack (PyTorch, NumPy with ml_dtypes, CuPy, JAX). Errors raise
fp4moe.Fp4MoeError (a ValueError) with .code and .argument.
"""
from ._errors import ErrorCode, Fp4MoeError
from ._enums import (ActivationType, RoutingMethod, GateUpOrder, GemmTile, LoraLayout, ScaleLayout, WeightFormat,
                     ActMode)
from . import _loader  # loads and checks the extension; raises ImportError when it is missing or mismatched
from ._api import (AdapterRegistry, MoeWeights, build_info, check_device_errors, from_hf_experts, moe,
                   object_of_handle, prepare_bf16_weights, prepare_mxfp4_weights, prepare_weights, quantize_weights,
                   route, workspace_size)
from ._dequant import dequantize_weights
from ._peft import list_peft_expert_modules, peft_expert_matrices, read_peft_experts_lora

_CHECKPOINT_NAMES = ("MoeLayer", "inspect_checkpoint", "load_moe_layer", "read_moe_layer")


def __getattr__(name):
    # fp4moe.checkpoint is imported on first use, so that `python -m fp4moe.checkpoint` runs it unimported
    if name in _CHECKPOINT_NAMES:
        from . import checkpoint
        return getattr(checkpoint, name)
    raise AttributeError(f"module 'fp4moe' has no attribute {name!r}")

__version__ = _loader.binary_info()["version"]

__all__ = [
    "ActivationType", "ActMode", "AdapterRegistry", "ErrorCode", "Fp4MoeError", "GateUpOrder", "GemmTile", "LoraLayout",
    "MoeWeights", "RoutingMethod", "ScaleLayout", "WeightFormat", "build_info", "check_device_errors",
    "dequantize_weights", "from_hf_experts", "inspect_checkpoint", "list_peft_expert_modules",
    "load_moe_layer", "moe", "MoeLayer", "read_moe_layer", "object_of_handle",
    "peft_expert_matrices", "prepare_bf16_weights", "prepare_mxfp4_weights", "prepare_weights", "quantize_weights",
    "read_peft_experts_lora", "route", "workspace_size",
]
