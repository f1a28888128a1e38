"""fp4moe as PyTorch custom operators (torch.library), so that torch.compile and CUDA graphs see one opaque op.

    import fp4moe, fp4moe.torch_ops as ops
    w = fp4moe.prepare_weights(..., activation="swiglu", device="cuda")
    ws = ops.workspace_for(w, max_tokens=256, top_k=8)         # optional: makes the call allocation-free
    y = ops.moe(x, w, routing_logits=logits, top_k=8, routing_method="RenormalizeNaive", workspace=ws)

Two operators are registered (schemas: `torch.ops.fp4moe.moe.default._schema`):

- `fp4moe::moe(x, weights, ...) -> Tensor` allocates y [T, H] bfloat16 with PyTorch's allocator (graph-safe)
  and returns it (no workspace argument: the backend allocates its own, see below). Its fake (meta) implementation gives the shape [T, H] (T may be symbolic), so
  `torch.compile(fullgraph=True)` traces through it with any backend (eager, aot_eager, inductor).
- `fp4moe::moe_out(out, x, weights, ...)` writes into a caller-owned `out` (declared mutated).

`moe_out` takes an optional `workspace` (uint8, >= fp4moe.workspace_size(...) bytes; declared mutated, it is
scratch); the wrapper `moe(..., workspace=ws)` uses moe_out on a fresh output. With a workspace the CUDA backend allocates nothing; without one it allocates with
cudaMallocAsync on the current stream, which stream capture also records. Both run on
`torch.cuda.current_stream()` of x's device and never synchronize with the host, so CUDA graphs capture them.

Handles. Prepared weights, the shared expert and adapter registries are not tensors: the ops take the int
`handle` each fp4moe.MoeWeights / fp4moe.AdapterRegistry gets at construction (0 = none). On torch 2.11 an int
argument is the simplest opaque reference that every tracing path supports (dynamo bakes it into the graph
as a constant and guards on it; torch.library's opaque-object support is newer and not needed here). The
handle table holds weak references: keep the objects alive (an nn.Module attribute does) for as long as a
compiled graph or a captured CUDA graph may run; a dead handle is an Fp4MoeError, never a dangling pointer.
A captured CUDA graph replays the kernels with the device pointers of its capture: the weights must not be
freed while it may replay.

Per-expert gemm1_alpha/beta/clamp_limit: a Python scalar becomes a device fill (graph-safe); a list is copied
from the host (not graph-safe: pass a float32 tensor inside captured or compiled regions).

No autograd formula is registered: these are inference ops (run under torch.no_grad / inference_mode).
"""
from __future__ import annotations

from typing import Optional

import torch

from . import _api
from ._enums import MODE_ALIASES, ActivationType, ActMode, RoutingMethod, parse_enum

__all__ = ["moe", "moe_out", "workspace_for", "handle_of", "release"]


def handle_of(obj) -> int:
    """The int handle of a MoeWeights or AdapterRegistry (0 for None)."""
    if obj is None:
        return 0
    h = getattr(obj, "handle", None)
    if not isinstance(h, int):
        raise _api.error("weights", f"expected fp4moe.MoeWeights or fp4moe.AdapterRegistry, got {type(obj).__name__}")
    return h


def release(obj) -> None:
    """Kept for compatibility: handles are weak, an object is forgotten when it is garbage-collected."""
    return None


def _obj(h: int, argument: str):
    return _api.object_of_handle(h, argument)


def _run(out, x, weights, routing_logits, routing_bias, topk_ids, topk_weights, top_k, routing_method, n_group,
         topk_group, routed_scaling_factor, activation, gemm1_alpha, gemm1_beta, gemm1_clamp_limit,
         num_experts_total, local_expert_offset, act_mode, fc1_input_scale, fc2_input_scale, shared_expert,
         shared_alpha, shared_beta, shared_clamp_limit, shared_params_given, shared_expert_gate, adapters, adapter_ids,
         gate_up_lora_delta, workspace):
    w = _obj(weights, "weights")
    kw = {}
    if shared_params_given:
        kw = dict(shared_alpha=shared_alpha, shared_beta=shared_beta, shared_clamp_limit=shared_clamp_limit)
    _api.moe(x, w, routing_logits=routing_logits, routing_bias=routing_bias, topk_ids=topk_ids,
             topk_weights=topk_weights, top_k=top_k, routing_method=routing_method, n_group=n_group,
             topk_group=topk_group, routed_scaling_factor=routed_scaling_factor, activation=activation,
             gemm1_alpha=gemm1_alpha, gemm1_beta=gemm1_beta, gemm1_clamp_limit=gemm1_clamp_limit,
             num_experts_total=num_experts_total, local_expert_offset=local_expert_offset, mode=act_mode,
             fc1_input_scale=fc1_input_scale, fc2_input_scale=fc2_input_scale,
             shared_expert=_obj(shared_expert, "shared_expert"), shared_expert_gate=shared_expert_gate,
             adapters=_obj(adapters, "adapters"), adapter_ids=adapter_ids, gate_up_lora_delta=gate_up_lora_delta,
             out=out, workspace=workspace,
             **kw)


@torch.library.custom_op("fp4moe::moe", mutates_args=())
def _moe_op(x: torch.Tensor, weights: int, routing_logits: Optional[torch.Tensor],
            routing_bias: Optional[torch.Tensor], topk_ids: Optional[torch.Tensor],
            topk_weights: Optional[torch.Tensor], top_k: int, routing_method: int, n_group: int, topk_group: int,
            routed_scaling_factor: float, activation: int, gemm1_alpha: Optional[torch.Tensor],
            gemm1_beta: Optional[torch.Tensor], gemm1_clamp_limit: Optional[torch.Tensor], num_experts_total: int,
            local_expert_offset: int, act_mode: int, fc1_input_scale: float, fc2_input_scale: float, shared_expert: int,
            shared_alpha: float, shared_beta: float, shared_clamp_limit: float, shared_params_given: bool,
            shared_expert_gate: Optional[torch.Tensor], adapters: int, adapter_ids: Optional[torch.Tensor],
            gate_up_lora_delta: Optional[torch.Tensor]) -> torch.Tensor:
    w = _obj(weights, "weights")
    out = torch.empty((x.shape[0], w.hidden), dtype=torch.bfloat16, device=x.device)
    _run(out, x, weights, routing_logits, routing_bias, topk_ids, topk_weights, top_k, routing_method, n_group,
         topk_group, routed_scaling_factor, activation, gemm1_alpha, gemm1_beta, gemm1_clamp_limit,
         num_experts_total, local_expert_offset, act_mode, fc1_input_scale, fc2_input_scale, shared_expert,
         shared_alpha, shared_beta, shared_clamp_limit, shared_params_given, shared_expert_gate, adapters, adapter_ids,
         gate_up_lora_delta, None)
    return out


@_moe_op.register_fake
def _moe_fake(x, weights, *args):
    # Only the shape is needed: [T, H] bfloat16 on x's device (T may be symbolic).
    return x.new_empty((x.shape[0], _obj(weights, "weights").hidden), dtype=torch.bfloat16)


@torch.library.custom_op("fp4moe::moe_out", mutates_args=("out", "workspace"))
def _moe_out_op(out: torch.Tensor, x: torch.Tensor, weights: int, routing_logits: Optional[torch.Tensor],
                routing_bias: Optional[torch.Tensor], topk_ids: Optional[torch.Tensor],
                topk_weights: Optional[torch.Tensor], top_k: int, routing_method: int, n_group: int, topk_group: int,
                routed_scaling_factor: float, activation: int, gemm1_alpha: Optional[torch.Tensor],
                gemm1_beta: Optional[torch.Tensor], gemm1_clamp_limit: Optional[torch.Tensor],
                num_experts_total: int, local_expert_offset: int, act_mode: int, fc1_input_scale: float,
                fc2_input_scale: float, shared_expert: int, shared_alpha: float, shared_beta: float,
                shared_clamp_limit: float, shared_params_given: bool, shared_expert_gate: Optional[torch.Tensor],
                adapters: int, adapter_ids: Optional[torch.Tensor], gate_up_lora_delta: Optional[torch.Tensor],
                workspace: Optional[torch.Tensor]) -> None:
    _run(out, x, weights, routing_logits, routing_bias, topk_ids, topk_weights, top_k, routing_method, n_group,
         topk_group, routed_scaling_factor, activation, gemm1_alpha, gemm1_beta, gemm1_clamp_limit,
         num_experts_total, local_expert_offset, act_mode, fc1_input_scale, fc2_input_scale, shared_expert,
         shared_alpha, shared_beta, shared_clamp_limit, shared_params_given, shared_expert_gate, adapters, adapter_ids,
         gate_up_lora_delta, workspace)


@_moe_out_op.register_fake
def _moe_out_fake(out, x, weights, *args):
    return None


def _name_table(enum_cls, aliases=None) -> dict:
    t = {m.name.replace("_", "").lower(): int(m) for m in enum_cls}
    t.update(aliases or {})
    return t


# Precomputed so that dynamo traces a name lookup as a constant dict access (iterating an Enum class breaks
# the graph).
_NAMES = {RoutingMethod: _name_table(RoutingMethod), ActivationType: _name_table(ActivationType),
          ActMode: _name_table(ActMode, MODE_ALIASES)}


def _enum_value(enum_cls, value, argument, aliases=None) -> int:
    if isinstance(value, str):
        v = _NAMES[enum_cls].get(value.replace("_", "").replace("-", "").lower())
        if v is not None:
            return v
    # ints, IntEnum members, foreign enums, or an unknown name (raises, naming the argument)
    return int(parse_enum(enum_cls, value, argument, aliases))


def _per_expert(value, name: str, weights, x: torch.Tensor):
    """Scalars and lists -> float32 [E_loc] tensors on x's device; tensors pass (made float32)."""
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        return value if value.dtype == torch.float32 else value.float()
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return torch.full((weights.num_experts,), float(value), dtype=torch.float32, device=x.device)
    if isinstance(value, (list, tuple)):
        return torch.tensor([float(v) for v in value], dtype=torch.float32, device=x.device)
    raise _api.error(name, f"expected a float, a list or a float32 tensor [E_loc], got {type(value).__name__}")


def _ids32(t):
    if t is not None and t.dtype == torch.int64:
        return t.to(torch.int32)
    return t


def _args(x, weights, routing_logits, routing_bias, topk_ids, topk_weights, top_k, routing_method, n_group,
          topk_group, routed_scaling_factor, activation, gemm1_alpha, gemm1_beta, gemm1_clamp_limit,
          num_experts_total, local_expert_offset, mode, fc1_input_scale, fc2_input_scale, shared_expert,
          shared_alpha, shared_beta, shared_clamp_limit, shared_expert_gate, adapters, adapter_ids, gate_up_lora_delta,
          workspace):
    if not isinstance(weights, _api.MoeWeights):
        raise _api.error("weights", f"expected fp4moe.MoeWeights, got {type(weights).__name__}")
    if activation is None:
        activation = weights.activation
        if activation is None:
            raise _api.error("activation", "is required (the weights were prepared without an activation)")
    shared_given = any(v is not None for v in (shared_alpha, shared_beta, shared_clamp_limit))
    clamp = 0.0 if shared_clamp_limit is None else float(shared_clamp_limit)
    if clamp == float("inf"):
        clamp = 0.0
    return (x, handle_of(weights), routing_logits, routing_bias, _ids32(topk_ids), topk_weights, int(top_k),
            _enum_value(RoutingMethod, routing_method, "routing_method"), int(n_group), int(topk_group),
            float(routed_scaling_factor), _enum_value(ActivationType, activation, "activation"),
            _per_expert(gemm1_alpha, "gemm1_alpha", weights, x), _per_expert(gemm1_beta, "gemm1_beta", weights, x),
            _per_expert(gemm1_clamp_limit, "gemm1_clamp_limit", weights, x), int(num_experts_total),
            int(local_expert_offset), _enum_value(ActMode, mode, "mode", MODE_ALIASES), float(fc1_input_scale),
            float(fc2_input_scale), handle_of(shared_expert), 1.0 if shared_alpha is None else float(shared_alpha),
            0.0 if shared_beta is None else float(shared_beta), clamp, bool(shared_given), shared_expert_gate,
            handle_of(adapters), _ids32(adapter_ids), gate_up_lora_delta, workspace)


def moe(x: torch.Tensor, weights, *, routing_logits=None, routing_bias=None, topk_ids=None, topk_weights=None,
        top_k: int, routing_method, n_group: int = 1, topk_group: int = 1, routed_scaling_factor: float = 1.0,
        activation=None, gemm1_alpha=None, gemm1_beta=None, gemm1_clamp_limit=None, num_experts_total: int = 0,
        local_expert_offset: int = 0, mode="a16", fc1_input_scale: float = 0.0, fc2_input_scale: float = 0.0,
        shared_expert=None, shared_alpha=None, shared_beta=None, shared_clamp_limit=None, shared_expert_gate=None,
        adapters=None, adapter_ids=None, gate_up_lora_delta=None, workspace=None) -> torch.Tensor:
    """fp4moe.moe through torch.ops.fp4moe.moe (PyTorch tensors only); same keywords as fp4moe.moe.

    With a workspace the call goes through torch.ops.fp4moe.moe_out on a fresh output (an Optional tensor
    that an op both returns beside and mutates trips inductor on torch 2.11, so the functional op has none)."""
    args = _args(x, weights, routing_logits, routing_bias, topk_ids, topk_weights, top_k, routing_method, n_group,
                 topk_group, routed_scaling_factor, activation, gemm1_alpha, gemm1_beta, gemm1_clamp_limit,
                 num_experts_total, local_expert_offset, mode, fc1_input_scale, fc2_input_scale, shared_expert,
                 shared_alpha, shared_beta, shared_clamp_limit, shared_expert_gate, adapters, adapter_ids,
                 gate_up_lora_delta, workspace)
    if workspace is None:
        return torch.ops.fp4moe.moe(*args[:-1])
    out = torch.empty((x.shape[0], weights.hidden), dtype=torch.bfloat16, device=x.device)
    torch.ops.fp4moe.moe_out(out, *args)
    return out


def moe_out(out: torch.Tensor, x: torch.Tensor, weights, *, routing_logits=None, routing_bias=None, topk_ids=None,
            topk_weights=None, top_k: int, routing_method, n_group: int = 1, topk_group: int = 1,
            routed_scaling_factor: float = 1.0, activation=None, gemm1_alpha=None, gemm1_beta=None,
            gemm1_clamp_limit=None, num_experts_total: int = 0, local_expert_offset: int = 0, mode="a16",
            fc1_input_scale: float = 0.0, fc2_input_scale: float = 0.0, shared_expert=None, shared_alpha=None,
            shared_beta=None, shared_clamp_limit=None, shared_expert_gate=None, adapters=None, adapter_ids=None,
            gate_up_lora_delta=None, workspace=None) -> torch.Tensor:
    """Like moe(), writing into `out` ([T, H] bfloat16) through torch.ops.fp4moe.moe_out; returns out."""
    torch.ops.fp4moe.moe_out(out, *_args(
        x, weights, routing_logits, routing_bias, topk_ids, topk_weights, top_k, routing_method, n_group,
        topk_group, routed_scaling_factor, activation, gemm1_alpha, gemm1_beta, gemm1_clamp_limit,
        num_experts_total, local_expert_offset, mode, fc1_input_scale, fc2_input_scale, shared_expert,
        shared_alpha, shared_beta, shared_clamp_limit, shared_expert_gate, adapters, adapter_ids,
        gate_up_lora_delta, workspace))
    return out


def workspace_for(weights, max_tokens: int, top_k: int, **kw) -> Optional[torch.Tensor]:
    """A uint8 workspace tensor on the weights' device for calls of up to max_tokens tokens (None on the
    CPU backend, which needs none). Keyword arguments as fp4moe.workspace_size. Allocated once, outside
    any graph; pass it to every call (one per stream that runs concurrently)."""
    n = _api.workspace_size(weights, max_tokens, top_k, **kw)
    if n == 0:
        return None
    # torch.empty on CUDA is aligned to 512 bytes, more than the backend's 256.
    return torch.empty((n,), dtype=torch.uint8, device=weights.device)
