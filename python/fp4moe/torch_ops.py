"""fp4moe as a PyTorch custom operator (torch.library), so that torch.compile and CUDA graphs see one opaque op.

    import fp4moe, fp4moe.torch_ops as ops
    w = fp4moe.prepare_weights(..., device="cuda")
    y = ops.moe(x, w, routing_logits=logits, top_k=8, routing_method="RenormalizeNaive", activation="swiglu")

Prepared weights and adapter registries are not tensors: the op refers to them by an integer handle
(registered on first use and kept alive by this module until release()). The fake (meta) implementation
only needs the output shape [T, H].
"""
from __future__ import annotations

import threading
from typing import Optional

import torch

from . import _api
from ._enums import MODE_ALIASES, ActivationType, ActMode, RoutingMethod, parse_enum

_lock = threading.Lock()
_objects: dict[int, object] = {}
_handles: dict[int, int] = {}  # id(obj) -> handle
_next = [1]


def handle_of(obj) -> int:
    """A stable integer handle for a MoeWeights or AdapterRegistry (0 for None)."""
    if obj is None:
        return 0
    with _lock:
        h = _handles.get(id(obj))
        if h is None or _objects.get(h) is not obj:
            h = _next[0]
            _next[0] += 1
            _objects[h] = obj
            _handles[id(obj)] = h
        return h


def release(obj) -> None:
    """Forgets the handle of obj (the op may no longer be called with it)."""
    with _lock:
        h = _handles.pop(id(obj), None)
        if h is not None:
            _objects.pop(h, None)


def _get(h: int):
    if h == 0:
        return None
    with _lock:
        obj = _objects.get(h)
    if obj is None:
        raise _api.error("weights", f"no fp4moe object is registered under handle {h}")
    return obj


@torch.library.custom_op("fp4moe::moe", mutates_args=())
def _moe_op(x: torch.Tensor, weights: int, routing_logits: Optional[torch.Tensor],
            routing_bias: Optional[torch.Tensor], topk_ids: Optional[torch.Tensor],
            topk_weights: Optional[torch.Tensor], top_k: int, routing_method: int, n_group: int, topk_group: int,
            routed_scaling_factor: float, activation: int, gemm1_alpha: Optional[torch.Tensor],
            gemm1_beta: Optional[torch.Tensor], gemm1_clamp_limit: Optional[torch.Tensor], num_experts_total: int,
            local_expert_offset: int, mode: int, fc1_input_scale: float, fc2_input_scale: float, shared_expert: int,
            adapters: int, adapter_ids: Optional[torch.Tensor]) -> torch.Tensor:
    return _api.moe(x, _get(weights), routing_logits=routing_logits, routing_bias=routing_bias, topk_ids=topk_ids,
                    topk_weights=topk_weights, top_k=top_k, routing_method=routing_method, n_group=n_group,
                    topk_group=topk_group, routed_scaling_factor=routed_scaling_factor, activation=activation,
                    gemm1_alpha=gemm1_alpha, gemm1_beta=gemm1_beta, gemm1_clamp_limit=gemm1_clamp_limit,
                    num_experts_total=num_experts_total, local_expert_offset=local_expert_offset, mode=mode,
                    fc1_input_scale=fc1_input_scale, fc2_input_scale=fc2_input_scale,
                    shared_expert=_get(shared_expert), adapters=_get(adapters), adapter_ids=adapter_ids)


@_moe_op.register_fake
def _moe_fake(x, weights, routing_logits, routing_bias, topk_ids, topk_weights, top_k, routing_method, n_group,
              topk_group, routed_scaling_factor, activation, gemm1_alpha, gemm1_beta, gemm1_clamp_limit,
              num_experts_total, local_expert_offset, mode, fc1_input_scale, fc2_input_scale, shared_expert,
              adapters, adapter_ids):
    w = _get(weights)
    return x.new_empty((x.shape[0], w.hidden), dtype=torch.bfloat16)


def moe(x: torch.Tensor, weights, *, routing_logits=None, routing_bias=None, topk_ids=None, topk_weights=None,
        top_k: int, routing_method, n_group: int = 1, topk_group: int = 1, routed_scaling_factor: float = 1.0,
        activation=None, gemm1_alpha=None, gemm1_beta=None, gemm1_clamp_limit=None, num_experts_total: int = 0,
        local_expert_offset: int = 0, mode="a16", fc1_input_scale: float = 0.0, fc2_input_scale: float = 0.0,
        shared_expert=None, adapters=None, adapter_ids=None) -> torch.Tensor:
    """fp4moe.moe through the registered op torch.ops.fp4moe.moe (PyTorch tensors only)."""
    if activation is None:
        activation = weights.activation
        if activation is None:
            raise _api.error("activation", "is required (the weights were prepared without an activation)")
    return torch.ops.fp4moe.moe(
        x, handle_of(weights), routing_logits, routing_bias, topk_ids, topk_weights, int(top_k),
        int(parse_enum(RoutingMethod, routing_method, "routing_method")), int(n_group), int(topk_group),
        float(routed_scaling_factor), int(parse_enum(ActivationType, activation, "activation")), gemm1_alpha,
        gemm1_beta, gemm1_clamp_limit, int(num_experts_total), int(local_expert_offset),
        int(parse_enum(ActMode, mode, "mode", MODE_ALIASES)), float(fc1_input_scale), float(fc2_input_scale),
        handle_of(shared_expert), handle_of(adapters), adapter_ids)
