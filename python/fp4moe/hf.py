"""A drop-in for the sparse MoE blocks of HuggingFace transformers 5 (Qwen3-MoE, Mixtral, Qwen2-MoE, Qwen3-Next,
gpt-oss), with PEFT LoRA.

    import fp4moe.hf
    swap = fp4moe.hf.swap_moe_blocks(model, quantize=True)      # NVFP4 experts, fused op per MoE layer
    logits = model(input_ids).logits
    swap.restore()                                              # the original blocks back

What is replaced. Every module whose class is one of SUPPORTED_BLOCKS (or a subclass, or any class named in
`block_classes`) with a router `gate` and fused experts `experts.gate_up_proj` [E, 2I, H] (gate rows first) and
`experts.down_proj` [E, H, I] (gpt-oss: router `router`, transposed interleaved experts, below). transformers 5 routing, mapped onto RoutingMethod:

- Qwen3-MoE, Qwen2-MoE, Qwen3-Next: softmax over E, top-k, then / sum when `norm_topk_prob`
  -> RenormalizeNaive (4); without norm_topk_prob -> Default (0).
- Mixtral (`MixtralTopKRouter`): softmax, top-k, / sum, which equals top-k of the logits then softmax over the
  k chosen -> Renormalize (1).
- gpt-oss (`GptOssMLP`, router `mlp.router` with a bias): top-k of the logits, then softmax over the k chosen
  -> Renormalize (1). Its experts hold gate and up interleaved (`is_concatenated` False: gate j at column 2j, up j at
  2j+1 of `gate_up_proj` [E, H, 2I]) with biases; they are reordered gate rows first. The activation is SwigluBias
  with the experts' `alpha` (1.702), beta 1 (gpt-oss's `up + 1`) and clamp `limit` (7). The block returns
  (hidden_states, router_scores) as GptOssMLP does.

Qwen2-MoE and Qwen3-Next blocks also hold a `shared_expert` (gate_proj, up_proj, down_proj) scaled by
`sigmoid(shared_expert_gate(x))`: it runs inside the same op (fp4moe's shared expert with `shared_expert_gate`,
SPEC §3.3), quantized like the routed experts or read from the checkpoint.

The new block (Fp4MoeSparseMoeBlock) keeps the original router module and calls it, so transformers' router-logit
recording (`output_router_logits`) still sees it; routing itself runs inside the fused op from those logits
(`routing="fused"`, weights in fp32) or takes the router's own top-k ids and weights (`routing="hf"`). The
activation is read off `experts.act_fn` (silu -> Swiglu, gelu -> Geglu, gelu_pytorch_tanh -> GegluTanh).
Hidden states are cast to bfloat16 for the op and the output back to the input dtype.

PEFT. A PeftModel whose LoRA targets the experts through `target_parameters` (e.g.
["experts.gate_up_proj", "experts.down_proj"]) wraps `experts` in ParamWrappers; swap_moe_blocks unwraps them and
loads every adapter into an AdapterRegistry slot (SPEC §5, the PEFT fused layout: lora_A [r*E, in] expert-outer,
lora_B [out, r*E] expert-inner, scale lora_alpha / r or / sqrt(r) with rsLoRA). The block runs PEFT's active
adapter at swap time; `set_active_adapter(model, name_or_None)` switches it, `set_adapter_ids(model, ids)` gives
one adapter slot per sequence (a mixed batch; -1 = base). PEFT merges the delta into the bf16 weight
(W + s*B@A rounded to the weight dtype); fp4moe adds it unmerged, in fp32, before the activation (SPEC §5).

Checkpoints. `swap_moe_blocks(model, checkpoint=DIR)` fills the blocks from an NVFP4 checkpoint's own experts
(ModelOpt or compressed-tensors, read by fp4moe.checkpoint.load_moe_layer; layer N is the block whose module name
holds `layers.N.`) instead of quantizing the model's weights: the rest of the model stays as transformers loaded it.
gpt-oss runs from its MXFP4 release this way (the experts' E2M1 codes and E8M0 scales as they are, A16).
Every layer is read and prepared before any block is replaced, so a bad file leaves the model untouched.

Numerics vs transformers: the op accumulates in fp32 and rounds once to bf16 (SPEC §3.2); transformers rounds every
intermediate to the model dtype. With quantize=True the experts are NVFP4 (SPEC §2, per-half global scales);
`write_back=True` writes the decoded NVFP4 weights into the original experts so that the original model (after
restore()) computes with the same weights (rounded to its parameter dtype).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Optional

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from . import _api, _dequant, _peft
from . import torch_ops as _ops
from ._enums import ActivationType, RoutingMethod
from ._errors import error

__all__ = ["Fp4MoeSparseMoeBlock", "MoeSwap", "swap_moe_blocks", "set_active_adapter", "set_adapter_ids",
           "routing_method_of", "activation_of", "SUPPORTED_BLOCKS"]

SUPPORTED_BLOCKS = ("Qwen3MoeSparseMoeBlock", "MixtralSparseMoeBlock", "Qwen2MoeSparseMoeBlock",
                    "Qwen3NextSparseMoeBlock", "GptOssMLP")
# transformers' norm_topk_prob default where the block does not record it.
_NORM_TOPK_DEFAULT = {"Qwen3Moe": True, "Qwen2Moe": False, "Qwen3Next": True}


def _is_param_wrapper(m) -> bool:
    # peft.tuners.lora.ParamWrapper, recognized without importing peft
    return hasattr(m, "parameter_name") and hasattr(m, "base_layer") and hasattr(m, "lora_A")


def _unwrap_experts(experts):
    """(the transformers experts module, [ParamWrapper, ...] outermost first)."""
    wrappers = []
    m = experts
    while _is_param_wrapper(m):
        wrappers.append(m)
        m = m.base_layer
    if not (hasattr(m, "gate_up_proj") and hasattr(m, "down_proj")):
        raise error("experts", f"expected fused experts with gate_up_proj and down_proj (transformers 5), got "
                               f"{type(m).__name__}")
    return m, wrappers


def _router_of(block):
    """The block's router module: `gate` (Qwen, Mixtral) or `router` (gpt-oss)."""
    gate = getattr(block, "gate", None)
    return gate if gate is not None else getattr(block, "router", None)


def _is_gpt_oss(block) -> bool:
    return type(block).__name__.startswith("GptOss") or type(_router_of(block)).__name__.startswith("GptOss")


def routing_method_of(block) -> RoutingMethod:
    """The RoutingMethod that reproduces a transformers MoE block's router."""
    name = type(block).__name__
    router = _router_of(block)
    gate_name = type(router).__name__
    # Both take the top-k of the logits and softmax over the k chosen (Mixtral's softmax-top-k-renormalize equals it).
    if name.startswith(("Mixtral", "GptOss")) or gate_name.startswith(("Mixtral", "GptOss")):
        return RoutingMethod.Renormalize
    for family, default in _NORM_TOPK_DEFAULT.items():
        if name.startswith(family) or gate_name.startswith(family):
            norm = getattr(router, "norm_topk_prob", getattr(block, "norm_topk_prob", default))
            return RoutingMethod.RenormalizeNaive if norm else RoutingMethod.Default
    raise error("block", f"no known routing for {name} (router {gate_name}); pass routing_method explicitly")


def activation_of(act_fn) -> ActivationType:
    """The gated activation whose gate nonlinearity is act_fn, found by probing it (ACT2FN classes vary across
    transformers versions): silu -> Swiglu, gelu (erf) -> Geglu, gelu (tanh) -> GegluTanh."""
    t = torch.linspace(-6.0, 6.0, 97, dtype=torch.float32)
    with torch.no_grad():
        got = act_fn(t)
    for act, ref in ((ActivationType.Swiglu, F.silu(t)), (ActivationType.Geglu, F.gelu(t)),
                     (ActivationType.GegluTanh, F.gelu(t, approximate="tanh"))):
        if torch.allclose(got, ref, atol=1e-6, rtol=1e-5):
            return act
    raise error("act_fn", f"unsupported expert activation {type(act_fn).__name__} (expected silu or gelu)")


def _activation_params(block, experts):
    """(activation, (alpha, beta, clamp_limit) or None) of a block's experts: gpt-oss's SwigluBias with the experts'
    alpha and limit and beta 1 (its `(up + 1) * glu`), else activation_of(experts.act_fn) without parameters."""
    if _is_gpt_oss(block):
        return ActivationType.SwigluBias, (float(experts.alpha), 1.0, float(experts.limit))
    return activation_of(experts.act_fn), None


class Fp4MoeSparseMoeBlock(nn.Module):
    """A transformers sparse MoE block computed by the fused fp4moe operator (torch.ops.fp4moe.moe)."""

    def __init__(self, gate: nn.Module, weights: "_api.MoeWeights", *, top_k: int, routing_method,
                 num_experts: int, activation, adapters: Optional["_api.AdapterRegistry"] = None,
                 adapter_slots: Optional[dict] = None, active_adapter: Optional[str] = None, routing: str = "fused",
                 source: str = "", shared_expert: Optional["_api.MoeWeights"] = None,
                 shared_expert_gate: Optional[torch.Tensor] = None, activation_params=None,
                 returns_router_scores: bool = False):
        super().__init__()
        if routing not in ("fused", "hf"):
            raise error("routing", f"expected 'fused' or 'hf', got {routing!r}")
        self.gate = gate
        self.weights = weights
        self.shared_expert = shared_expert            # prepared, E = 1, or None
        self.shared_expert_gate = shared_expert_gate  # bf16 [1, H] on the weights' device, or None
        self.adapters = adapters
        self.adapter_slots = dict(adapter_slots or {})
        self.top_k = int(top_k)
        self.num_experts = int(num_experts)
        # ints resolved once, so that the traced forward reads constants
        self.routing_method = int(routing_method)
        self.activation = int(activation)
        self.routing = routing
        self.source = source
        # SwigluBias's (alpha, beta, clamp_limit) as floats, or None (the activation's defaults)
        self.activation_params = None if activation_params is None else tuple(float(v) for v in activation_params)
        self.returns_router_scores = bool(returns_router_scores)  # gpt-oss's block returns (y, router_scores)
        self.active_slot = -1
        self.adapter_ids: Optional[torch.Tensor] = None  # per sequence [B], int32 (set_adapter_ids)
        self.workspace: Optional[torch.Tensor] = None
        if active_adapter is not None:
            self.set_active_adapter(active_adapter)

    def set_active_adapter(self, name: Optional[str]) -> None:
        if name is None:
            self.active_slot = -1
            return
        if name not in self.adapter_slots:
            raise error("adapter", f"no adapter named {name!r} in this block; loaded: {sorted(self.adapter_slots)}")
        self.active_slot = int(self.adapter_slots[name])

    def extra_repr(self) -> str:
        return (f"experts={self.num_experts}, top_k={self.top_k}, routing={RoutingMethod(self.routing_method).name}, "
                f"activation={ActivationType(self.activation).name}, weights={self.weights!r}, "
                f"adapters={sorted(self.adapter_slots)}")

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shape = hidden_states.shape
        h = hidden_states.reshape(-1, shape[-1])
        routed = self.gate(h)  # transformers 5 routers give (logits, weights, ids); a plain Linear gives logits
        router_logits, router_weights, router_ids = routed if isinstance(routed, tuple) else (routed, None, None)
        x = h if h.dtype == torch.bfloat16 else h.to(torch.bfloat16)
        routing = {}
        if self.routing == "fused":
            logits = router_logits
            if logits.dtype not in (torch.float32, torch.bfloat16):
                logits = logits.float()
            routing["routing_logits"] = logits
        else:
            if router_ids is None:
                raise error("routing", f"{self.source}: the router gives logits only; use routing='fused'")
            routing["topk_ids"] = router_ids.to(torch.int32)
            routing["topk_weights"] = router_weights.float()
        ids = None
        adapters = None
        if self.adapters is not None:
            if self.adapter_ids is not None:
                tokens_per_seq = h.shape[0] // self.adapter_ids.shape[0]
                ids = self.adapter_ids.to(device=h.device, dtype=torch.int32).repeat_interleave(tokens_per_seq)
                adapters = self.adapters
            elif self.active_slot >= 0:
                ids = torch.full((h.shape[0],), self.active_slot, dtype=torch.int32, device=h.device)
                adapters = self.adapters
        params = {}
        if self.activation_params is not None:
            params = dict(zip(("gemm1_alpha", "gemm1_beta", "gemm1_clamp_limit"), self.activation_params))
        y = _ops.moe(x, self.weights, top_k=self.top_k, routing_method=self.routing_method,
                     activation=self.activation, num_experts_total=self.num_experts, adapters=adapters,
                     adapter_ids=ids, workspace=self.workspace, shared_expert=self.shared_expert,
                     shared_expert_gate=self.shared_expert_gate, **routing, **params)
        if y.dtype != hidden_states.dtype:
            y = y.to(hidden_states.dtype)
        y = y.reshape(shape)
        return (y, router_weights) if self.returns_router_scores else y


@dataclass
class MoeSwap:
    """What swap_moe_blocks did: the new blocks and the originals, by module name."""
    model: nn.Module
    blocks: dict = field(default_factory=dict)     # name -> Fp4MoeSparseMoeBlock
    originals: dict = field(default_factory=dict)  # name -> the replaced transformers block

    def restore(self) -> None:
        """Puts the original blocks back (the new ones are dropped)."""
        for name, orig in self.originals.items():
            _set_submodule(self.model, name, orig)
        self.blocks.clear()
        self.originals.clear()

    def __len__(self):
        return len(self.blocks)


def _set_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, module)


def _gate_first(t, interleaved: bool):
    """Rows (dim 1 of [E, 2I, ...], or the last dim of a bias [E, 2I]) reordered gate rows first when interleaved."""
    if not interleaved:
        return t
    return torch.cat([t[:, 0::2], t[:, 1::2]], 1)


def _expert_tensors(experts):
    """gate_up [E, 2I, H] (gate rows first), down [E, H, I], and the biases (gate_up [E, 2I], down [E, H]) or None
    of a transformers experts module (handles is_transposed, and gpt-oss's interleaved gate/up: is_concatenated
    False)."""
    gu, dn = experts.gate_up_proj.detach(), experts.down_proj.detach()
    if getattr(experts, "is_transposed", False):  # stored [E, H, 2I] / [E, I, H]
        gu, dn = gu.transpose(1, 2), dn.transpose(1, 2)
    interleaved = not getattr(experts, "is_concatenated", True)
    b1, b2 = getattr(experts, "gate_up_proj_bias", None), getattr(experts, "down_proj_bias", None)
    b1 = None if b1 is None else _gate_first(b1.detach(), interleaved)
    b2 = None if b2 is None else b2.detach()
    return _gate_first(gu, interleaved), dn, b1, b2


def _shared_tensors(block, name: str, act):
    """(gate_up [1, 2Is, H], down [1, H, Is], gate [1, H] or None) of a block's shared expert (Qwen2-MoE,
    Qwen3-Next: shared_expert.{gate,up,down}_proj and shared_expert_gate), or None when the block has none."""
    se = getattr(block, "shared_expert", None)
    if se is None:
        return None
    for part in ("gate_proj", "up_proj", "down_proj"):
        lin = getattr(se, part, None)
        if lin is None or not hasattr(lin, "weight"):
            raise error("shared_expert", f"{name}: expected shared_expert.gate_proj, up_proj and down_proj linears")
        if hasattr(lin, "lora_A"):
            raise error("adapters", f"{name}: LoRA on shared_expert.{part} is not carried over by swap_moe_blocks")
        if getattr(lin, "bias", None) is not None:
            raise error("shared_expert", f"{name}: shared_expert.{part} has a bias (fp4moe's shared expert has none)")
    if activation_of(se.act_fn) != act:
        raise error("shared_expert", f"{name}: the shared expert's activation differs from the routed experts'")
    gu = torch.cat([se.gate_proj.weight.detach(), se.up_proj.weight.detach()], 0)[None]
    dn = se.down_proj.weight.detach()[None]
    sg = getattr(block, "shared_expert_gate", None)
    gate = None
    if sg is not None:
        if hasattr(sg, "lora_A") or getattr(sg, "bias", None) is not None:
            raise error("shared_expert_gate", f"{name}: the gate must be a plain Linear(H, 1) without bias or LoRA "
                                              f"(fp4moe computes sigmoid(x . g))")
        gate = sg.weight.detach()
        if tuple(gate.shape) != (1, gu.shape[2]):
            raise error("shared_expert_gate", f"{name}: expected a [1, {gu.shape[2]}] weight, got {tuple(gate.shape)}")
    return gu, dn, gate


def _bf16_on(gate, device: str) -> torch.Tensor:
    """A gate [1, H] (torch, or NumPy bfloat16 from a checkpoint) as a contiguous bf16 torch tensor on `device`."""
    if isinstance(gate, np.ndarray):
        gate = torch.from_numpy(np.ascontiguousarray(gate).view(np.int16)).view(torch.bfloat16)
    return gate.to(device=device, dtype=torch.bfloat16).contiguous()


def _write_back(experts, w1: np.ndarray, w2: np.ndarray) -> None:
    with torch.no_grad():
        gu = torch.from_numpy(w1)
        dn = torch.from_numpy(w2)
        if not getattr(experts, "is_concatenated", True):  # back to gpt-oss's interleaved gate/up rows
            half = gu.shape[1] // 2
            gu = torch.stack([gu[:, :half], gu[:, half:]], 2).reshape(gu.shape)
        if getattr(experts, "is_transposed", False):
            gu, dn = gu.transpose(1, 2), dn.transpose(1, 2)
        experts.gate_up_proj.copy_(gu.to(experts.gate_up_proj.dtype))
        experts.down_proj.copy_(dn.to(experts.down_proj.dtype))


def _write_back_shared(se, w1: np.ndarray, w2: np.ndarray) -> None:
    """The decoded shared expert (w1 [1, 2Is, H] gate rows first, w2 [1, H, Is]) into its three linears."""
    Is = w2.shape[2]
    with torch.no_grad():
        for lin, v in ((se.gate_proj, w1[0, :Is]), (se.up_proj, w1[0, Is:]), (se.down_proj, w2[0])):
            lin.weight.copy_(torch.from_numpy(np.ascontiguousarray(v)).to(lin.weight.dtype))


def _adapter_tensors(wrappers, name: str, E: int):
    """One PEFT adapter's LoRA of one block -> (tensors for AdapterRegistry.load, rank, lora_alpha, rslora)."""
    parts = {}
    for wr in wrappers:
        if name not in wr.lora_A:
            continue
        if wr.parameter_name == "gate_up_proj":
            key = "gate_up"
        elif wr.parameter_name == "down_proj":
            key = "down"
        else:
            raise error("adapters", f"LoRA on experts.{wr.parameter_name} is not supported (gate_up_proj, down_proj)")
        if getattr(wr.get_base_layer(), "is_transposed", False):
            raise error("adapters", "PEFT LoRA on transposed expert storage (is_transposed) is not supported")
        A = wr.lora_A[name].weight.detach()
        B = wr.lora_B[name].weight.detach()
        a, b = _peft.peft_expert_matrices(A, B, E)  # [E, r, in], [E, out, r]
        parts[key] = (a, b, int(wr.r[name]), float(wr.lora_alpha[name]), bool(wr.use_rslora.get(name, False)),
                      float(wr.scaling[name]))
    if not parts:
        return None
    cfgs = {(p[2], p[3], p[4]) for p in parts.values()}
    ranks = {p[2] for p in parts.values()}
    if len(ranks) > 1:
        raise error("adapters", f"adapter {name!r}: gate_up and down LoRA ranks differ ({sorted(ranks)}); fp4moe takes "
                                "one rank per adapter")
    tensors = {}
    if len(cfgs) == 1:
        r, alpha, rslora = next(iter(cfgs))
        for key, (a, b, *_rest) in parts.items():
            tensors[f"a_{key}"] = a.to(torch.bfloat16)
            tensors[f"b_{key}"] = b.to(torch.bfloat16)
        return tensors, r, alpha, rslora
    # Different alphas per target: fold each scale into its B (fp32 product, one rounding to bf16, as the
    # registry itself does) and load with scale 1.
    r = next(iter(ranks))
    for key, (a, b, _r, _alpha, _rs, scaling) in parts.items():
        tensors[f"a_{key}"] = a.to(torch.bfloat16)
        tensors[f"b_{key}"] = (b.float() * scaling).to(torch.bfloat16)
    return tensors, r, float(r), False


def _peft_active_adapter(model) -> Optional[str]:
    act = getattr(model, "active_adapter", None)
    if callable(act):
        act = act()
    if isinstance(act, (list, tuple)):
        if len(act) > 1:
            raise error("adapters", f"several active PEFT adapters {list(act)}: fp4moe runs one adapter per token")
        act = act[0] if act else None
    return act


def swap_moe_blocks(model: nn.Module, *, quantize: bool = True, adapters="auto", num_slots: int = 8,
                    device=None, routing: str = "fused", write_back: bool = False,
                    block_classes: Iterable[str] = SUPPORTED_BLOCKS, use_workspace: bool = False,
                    max_tokens: int = 0, checkpoint=None) -> MoeSwap:
    """Replaces every supported sparse MoE block of `model` by an Fp4MoeSparseMoeBlock (in place).

    quantize: True -> NVFP4 experts (SPEC §2, per-half global scales); False -> the weights as bfloat16.
    adapters: "auto" (the PEFT LoRA found on the experts, if any), None/False (ignore LoRA), or a list of PEFT
      adapter names to load (in slot order). The block runs PEFT's active adapter.
    device: where the prepared weights live (default: the experts' device).
    routing: "fused" (routing from the router logits inside the op) or "hf" (the router's own top-k).
    write_back: write the decoded NVFP4 weights into the original experts (kept in MoeSwap.originals), so that
      the original blocks compute with the same weights after restore().
    use_workspace: give each block a workspace for up to max_tokens tokens (CUDA; allocation-free calls).
    checkpoint: a checkpoint directory (or fp4moe.checkpoint.Checkpoint) whose NVFP4 (or bf16) experts fill the
      blocks, read layer by layer; quantize and write_back do not apply then.
    Returns a MoeSwap (restore() undoes the swap)."""
    classes = tuple(block_classes)
    targets = [(n, m) for n, m in model.named_modules()
               if any(c.__name__ in classes for c in type(m).__mro__) and _router_of(m) is not None
               and hasattr(m, "experts")]
    if not targets:
        raise error("model", f"no MoE block of the classes {list(classes)} found")
    active = _peft_active_adapter(model) if adapters not in (None, False) else None
    swap = MoeSwap(model)
    ck = None
    if checkpoint is not None:
        from . import checkpoint as _ckpt
        if write_back:
            raise error("write_back", "does not apply with checkpoint= (the experts come from the checkpoint)")
        ck = checkpoint if isinstance(checkpoint, _ckpt.Checkpoint) else _ckpt.Checkpoint(checkpoint)
    new_blocks = []  # replaced only once every block is ready: an error leaves the model as it was
    for name, block in targets:
        experts, wrappers = _unwrap_experts(block.experts)
        gu, dn, b1, b2 = _expert_tensors(experts)
        E, n1, H = gu.shape
        act, act_params = _activation_params(block, experts)
        method = routing_method_of(block)
        router = _router_of(block)
        top_k = int(getattr(router, "top_k", getattr(block, "top_k", getattr(block, "num_experts_per_tok", 0))))
        if top_k <= 0:
            raise error("model", f"{name}: cannot find the router's top_k")
        dev = device
        if dev is None:
            dev = "cpu" if gu.device.type == "cpu" else f"cuda:{gu.device.index or 0}"
        st = _shared_tensors(block, name, act)
        shared = shared_gate = None
        if ck is not None:
            weights, shared, shared_gate = _checkpoint_weights(ck, name, act, act_params, dev, E, H, n1, st)
        elif quantize:
            q = _api.quantize_weights(gu, dn, gate_up_order="gate_first", activation=act, bias1=b1, bias2=b2)
            weights = _api.prepare_weights(**q, gate_up_order="gate_first", activation=act, device=dev)
            if write_back:
                w1, w2 = _dequant.dequantize_weights(**q)
                _write_back(experts, w1, w2)
        else:
            weights = _api.from_hf_experts(gu.to(torch.bfloat16), dn.to(torch.bfloat16), quantize=False,
                                           activation=act, device=dev, gate_up_bias=b1, down_bias=b2)
        if st is not None and ck is None:  # the shared expert prepared as the routed ones
            sgu, sdn, sgate = st
            if quantize:
                q = _api.quantize_weights(sgu, sdn, gate_up_order="gate_first", activation=act)
                shared = _api.prepare_weights(**q, gate_up_order="gate_first", activation=act, device=dev)
                if write_back:
                    w1, w2 = _dequant.dequantize_weights(**q)
                    _write_back_shared(block.shared_expert, w1, w2)
            else:
                shared = _api.from_hf_experts(sgu.to(torch.bfloat16), sdn.to(torch.bfloat16), quantize=False,
                                              activation=act, device=dev)
            shared_gate = None if sgate is None else _bf16_on(sgate, dev)
        registry = None
        slots = {}
        if adapters not in (None, False) and wrappers:
            if not getattr(experts, "is_concatenated", True):
                raise error("adapters", f"{name}: PEFT LoRA on interleaved gate/up experts (gpt-oss) is not supported")
            names = []
            for wr in wrappers:
                for n in wr.lora_A.keys():
                    if n not in names:
                        names.append(n)
            if adapters != "auto":
                wanted = list(adapters)
                missing = [n for n in wanted if n not in names]
                if missing:
                    raise error("adapters", f"{name}: no LoRA named {missing}; found {names}")
                names = wanted
            if len(names) > num_slots:
                raise error("num_slots", f"{len(names)} adapters do not fit in {num_slots} slots")
            registry = _api.AdapterRegistry(weights, num_slots)
            for slot, an in enumerate(names):
                got = _adapter_tensors(wrappers, an, E)
                if got is None:
                    continue
                tensors, r, alpha, rslora = got
                registry.load(slot, tensors, layout="peft_fused", rank=r, lora_alpha=alpha, use_rslora=rslora)
                slots[an] = slot
        new = Fp4MoeSparseMoeBlock(router, weights, top_k=top_k, routing_method=method, num_experts=E,
                                   activation=act, adapters=registry, adapter_slots=slots,
                                   active_adapter=active if active in slots else None, routing=routing,
                                   source=type(block).__name__, shared_expert=shared, shared_expert_gate=shared_gate,
                                   activation_params=act_params, returns_router_scores=_is_gpt_oss(block))
        if use_workspace and max_tokens > 0:
            new.workspace = _ops.workspace_for(weights, max_tokens, top_k, activation=act,
                                               routing_from_logits=routing == "fused", shared_expert=shared,
                                               max_lora_rank=64 if registry is not None else 0)
        new_blocks.append((name, new, block))
    for name, new, block in new_blocks:
        _set_submodule(model, name, new)
        swap.blocks[name] = new
        swap.originals[name] = block
    return swap


def _checkpoint_weights(ck, name: str, act, act_params, device, E: int, H: int, n1: int, shared_tensors):
    """(experts, shared expert or None, its gate or None) of block `name` from the checkpoint, checked against the
    block's shapes and activation parameters (shared_tensors: _shared_tensors of the block)."""
    import re
    from . import checkpoint as _ckpt
    m = re.search(r"(?:^|\.)layers\.(\d+)\.", name + ".")
    if m is None:
        raise error("checkpoint", f"{name}: cannot tell the block's layer index from its module name")
    # With parameters (gpt-oss) the checkpoint's own are read and compared below, not overridden by the model's.
    layer = _ckpt.load_moe_layer(ck, int(m.group(1)), device=device, activation=act if act_params is None else None,
                                 shared_expert=shared_tensors is not None)
    w = layer.weights
    if (w.num_experts, w.hidden, 2 * w.inter if w.gated else w.inter) != (E, H, n1):
        raise error("checkpoint", f"{name}: the checkpoint's layer {m.group(1)} has E={w.num_experts}, H={w.hidden}, "
                                  f"I={w.inter}; the model's block has E={E}, H={H}, N1={n1}")
    if act_params is not None:
        got = (layer.gemm1_alpha, layer.gemm1_beta, layer.gemm1_clamp_limit)
        if layer.activation != act or any(g is None or abs(g - p) > 1e-6 * abs(p) for g, p in zip(got, act_params)):
            raise error("checkpoint", f"{name}: the checkpoint's layer {m.group(1)} runs {layer.activation.name} "
                                      f"{got}; the model's experts {act.name} {act_params} (alpha, beta, limit)")
    if shared_tensors is None:
        return w, None, None
    s, g = layer.shared_expert, layer.shared_expert_gate
    want_I = shared_tensors[1].shape[2]
    L = m.group(1)
    if s is None or s.inter != want_I:
        got = "none" if s is None else f"I={s.inter}"
        raise error("checkpoint", f"{name}: the model's block has a shared expert of I={want_I}; the checkpoint's "
                                  f"layer {L} has {got}")
    if (g is None) != (shared_tensors[2] is None):
        have = "has no" if shared_tensors[2] is None else "has a"
        raise error("checkpoint", f"{name}: the model's block {have} shared_expert_gate, the checkpoint's layer {L} "
                                  f"{'has none' if g is None else 'has one'}")
    return w, s, None if g is None else _bf16_on(g, device)


def _blocks(model: nn.Module):
    return [m for m in model.modules() if isinstance(m, Fp4MoeSparseMoeBlock)]


def set_active_adapter(model: nn.Module, name: Optional[str]) -> None:
    """Every swapped block runs adapter `name` for all tokens (None = base)."""
    for b in _blocks(model):
        b.set_active_adapter(name)


def set_adapter_ids(model: nn.Module, ids) -> None:
    """A mixed batch: one adapter per sequence (int [B], a slot index as in block.adapter_slots; -1 = base),
    or a list of adapter names / None. None (the argument) clears it (back to the active adapter)."""
    for b in _blocks(model):
        if ids is None:
            b.adapter_ids = None
            continue
        if isinstance(ids, torch.Tensor):
            t = ids.to(torch.int32)
        else:
            vals = [-1 if v is None else (b.adapter_slots[v] if isinstance(v, str) else int(v)) for v in ids]
            t = torch.tensor(vals, dtype=torch.int32)
        b.adapter_ids = t.to(b.weights.device)  # on the weights' device now: no copy inside forward (graphs)
