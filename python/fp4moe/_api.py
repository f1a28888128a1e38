"""The Python API: FlashInfer-like plain functions over the extension (SPEC §3-§5)."""
from __future__ import annotations

import math
import sys
from typing import Mapping

import numpy as np

from . import _loader
from ._enums import (FORMAT_ALIASES, GATE_UP_ORDER_ALIASES, LORA_LAYOUT_ALIASES, MODE_ALIASES,
                     PRECISION_ALIASES, SCALE_LAYOUT_ALIASES, ActivationType, ActMode, GateUpOrder, LoraLayout,
                     Precision, RoutingMethod, ScaleLayout, WeightFormat, is_gated, parse_enum)
from ._errors import ErrorCode, error
from ._tensors import (BF16, E4M3, as_arg, device_of, empty_bf16, is_torch, per_expert, require_ndim, shape_of,
                       to_host_float, to_int32)

_C = _loader.C


# ---- devices ------------------------------------------------------------------------------------------

def _parse_device(device, default: tuple[str, int]) -> tuple[str, int]:
    if device is None:
        return default
    if isinstance(device, int) and not isinstance(device, bool):
        return ("cuda", device)
    s = str(device).strip().lower()  # also torch.device
    if s == "cpu":
        return ("cpu", 0)
    if s == "cuda":
        return ("cuda", default[1] if default[0] == "cuda" else 0)
    if s.startswith("cuda:") and s[5:].isdigit():
        return ("cuda", int(s[5:]))
    raise error("device", f"expected 'cpu', 'cuda' or 'cuda:N', got {device!r}")


def _backend(device: tuple[str, int]) -> int:
    if device[0] == "cuda":
        _loader.ensure_arch(device[1])  # SPEC §7: a clear error before any kernel could JIT or fail
        return 1
    return 0


def _describe(x):
    return _C._describe(x)


# ---- weights --------------------------------------------------------------------------------------------

class MoeWeights:
    """Expert weights prepared for one backend (immutable). Made by prepare_weights and friends."""

    def __init__(self, native, device: tuple[str, int], activation: ActivationType | None):
        self._native = native
        self._device = device
        self.activation = activation  # the activation given at preparation (moe's default), or None

    native = property(lambda self: self._native)
    device = property(lambda self: "cpu" if self._device[0] == "cpu" else f"cuda:{self._device[1]}")
    format = property(lambda self: WeightFormat(self._native.format))
    gate_up_order = property(lambda self: GateUpOrder(self._native.order))
    gated = property(lambda self: bool(self._native.gated))
    num_experts = property(lambda self: int(self._native.num_experts))
    hidden = property(lambda self: int(self._native.hidden))
    inter = property(lambda self: int(self._native.inter))

    def __repr__(self):
        return (f"fp4moe.MoeWeights({self.format.name}, E={self.num_experts}, H={self.hidden}, I={self.inter}, "
                f"gated={self.gated}, order={self.gate_up_order.name}, device={self.device})")


def _gated_and_order(activation, gate_up_order, gated=None):
    act = None if activation is None else parse_enum(ActivationType, activation, "activation")
    if gated is None:
        gated = True if act is None else is_gated(act)
    elif act is not None and is_gated(act) != bool(gated):
        raise error("gated", f"gated={gated} contradicts activation {act.name}")
    if gated:
        if gate_up_order is None:
            raise error("gate_up_order", "is required for gated weights: 'gate_first' (HuggingFace, vLLM, "
                                         "ModelOpt checkpoints) or 'up_first' (FlashInfer trtllm layout); "
                                         "there is no default")
        order = parse_enum(GateUpOrder, gate_up_order, "gate_up_order", GATE_UP_ORDER_ALIASES)
    else:
        order = GateUpOrder.GateFirst if gate_up_order is None else parse_enum(
            GateUpOrder, gate_up_order, "gate_up_order", GATE_UP_ORDER_ALIASES)
    return act, bool(gated), order


def prepare_weights(w1, w1_scale, w1_scale2, w2, w2_scale, w2_scale2, *, gate_up_order=None,
                    scale_layout="linear", activation=None, gated=None, bias1=None, bias2=None,
                    device=None) -> MoeWeights:
    """Prepares ModelOpt NVFP4 expert weights (SPEC §2) for the operator.

    w1 uint8 [E, N1, H/2] (N1 = 2I gated, I otherwise), w1_scale float8_e4m3fn (or uint8) [E, N1, H/16]
    (or 128x4-swizzled with scale_layout='swizzled'), w1_scale2 float32 [E] or [E, 2] (per half, in the
    weights' half order), w2 uint8 [E, H, I/2], w2_scale [E, H, I/16], w2_scale2 float32 [E].
    gate_up_order ('gate_first' | 'up_first') is required for gated activations. device defaults to w1's.
    """
    act, gated, order = _gated_and_order(activation, gate_up_order, gated)
    layout = parse_enum(ScaleLayout, scale_layout, "scale_layout", SCALE_LAYOUT_ALIASES)
    E, n1, h2 = require_ndim(w1, "w1", 3, "[E, N1, H/2] uint8")
    w2s = require_ndim(w2, "w2", 3, "[E, H, I/2] uint8")
    H, I = 2 * h2, 2 * w2s[2]
    dev = _parse_device(device, device_of(w1, _describe))
    tensors = {"w1": as_arg(w1, "w1"), "w1_scale": as_arg(w1_scale, "w1_scale"),
               "w1_scale2": as_arg(w1_scale2, "w1_scale2"), "w2": as_arg(w2, "w2"),
               "w2_scale": as_arg(w2_scale, "w2_scale"), "w2_scale2": as_arg(w2_scale2, "w2_scale2"),
               "bias1": as_arg(bias1, "bias1"), "bias2": as_arg(bias2, "bias2")}
    native = _C.prepare_weights(tensors, int(WeightFormat.NVFP4), int(order), int(layout), gated, E, H, I,
                                _backend(dev), dev[1])
    return MoeWeights(native, dev, act)


def prepare_bf16_weights(w1, w2, *, gate_up_order=None, activation=None, gated=None, bias1=None, bias2=None,
                         device=None) -> MoeWeights:
    """Prepares bfloat16 expert weights: w1 [E, N1, H], w2 [E, H, I]."""
    act, gated, order = _gated_and_order(activation, gate_up_order, gated)
    E, n1, H = require_ndim(w1, "w1", 3, "[E, N1, H] bfloat16")
    I = require_ndim(w2, "w2", 3, "[E, H, I] bfloat16")[2]
    dev = _parse_device(device, device_of(w1, _describe))
    tensors = {"w1": as_arg(w1, "w1"), "w2": as_arg(w2, "w2"), "bias1": as_arg(bias1, "bias1"),
               "bias2": as_arg(bias2, "bias2")}
    native = _C.prepare_weights(tensors, int(WeightFormat.BF16), int(order), int(ScaleLayout.Linear), gated, E, H, I,
                                _backend(dev), dev[1])
    return MoeWeights(native, dev, act)


def quantize_weights(w1, w2, *, gate_up_order=None, activation=None, gated=None, format="nvfp4",
                     per_half_scale2=True, scale_layout="linear", bias1=None, bias2=None) -> dict:
    """Dense float32/bfloat16 expert weights -> NVFP4 (SPEC §2) through the C++ quantizer.

    w1 [E, N1, H], w2 [E, H, I] (device tensors are copied to the host). Returns NumPy arrays with the
    keys prepare_weights takes (w1, w1_scale (float8_e4m3fn), w1_scale2, w2, w2_scale, w2_scale2 and
    bias1/bias2 when given), so `prepare_weights(**q, gate_up_order=...)` prepares them. With
    format='bf16' the keys are w1 and w2 (bfloat16), for prepare_bf16_weights.
    """
    _act, gated, order = _gated_and_order(activation, gate_up_order, gated)
    fmt = parse_enum(WeightFormat, format, "format", FORMAT_ALIASES)
    layout = parse_enum(ScaleLayout, scale_layout, "scale_layout", SCALE_LAYOUT_ALIASES)
    tensors = {"w1": as_arg(to_host_float(w1, "w1"), "w1"), "w2": as_arg(to_host_float(w2, "w2"), "w2")}
    if bias1 is not None:
        tensors["bias1"] = as_arg(to_host_float(bias1, "bias1"), "bias1")
    if bias2 is not None:
        tensors["bias2"] = as_arg(to_host_float(bias2, "bias2"), "bias2")
    out = dict(_C.quantize_weights(tensors, int(fmt), int(order), gated, bool(per_half_scale2), int(layout)))
    if fmt == WeightFormat.NVFP4:
        if E4M3 is not None:
            out["w1_scale"] = out["w1_scale"].view(E4M3)
            out["w2_scale"] = out["w2_scale"].view(E4M3)
    elif BF16 is not None:
        out["w1"] = out["w1"].view(BF16)
        out["w2"] = out["w2"].view(BF16)
    return out


def from_hf_experts(gate_up_proj, down_proj, *, quantize=True, activation=ActivationType.Swiglu,
                    gate_up_bias=None, down_bias=None, device=None) -> MoeWeights:
    """Weights from HuggingFace transformers 5 fused experts: gate_up_proj [E, 2I, H] (gate rows first),
    down_proj [E, H, I]. quantize=True makes NVFP4 (per-half global scales), False keeps bfloat16."""
    E, n1, H = require_ndim(gate_up_proj, "gate_up_proj", 3, "[E, 2I, H]")
    e2, h2, I = require_ndim(down_proj, "down_proj", 3, "[E, H, I]")
    act = parse_enum(ActivationType, activation, "activation")
    if (e2, h2) != (E, H) or n1 != (2 * I if is_gated(act) else I):
        raise error("down_proj", f"expected shape [{E}, {H}, {n1 // 2 if is_gated(act) else n1}] to match "
                                 f"gate_up_proj {list(shape_of(gate_up_proj, 'gate_up_proj'))}, got {[e2, h2, I]}")
    if device is None:
        device = device_of(gate_up_proj, _describe)
        device = "cpu" if device[0] == "cpu" else f"cuda:{device[1]}"
    if quantize:
        q = quantize_weights(gate_up_proj, down_proj, gate_up_order="gate_first", activation=act,
                             bias1=gate_up_bias, bias2=down_bias)
        return prepare_weights(**q, gate_up_order="gate_first", activation=act, device=device)
    w1, w2 = gate_up_proj, down_proj
    if not _is_bf16(w1) or not _is_bf16(w2):
        q = quantize_weights(w1, w2, gate_up_order="gate_first", activation=act, format="bf16",
                             bias1=gate_up_bias, bias2=down_bias)
        return prepare_bf16_weights(**q, gate_up_order="gate_first", activation=act, device=device)
    return prepare_bf16_weights(w1, w2, gate_up_order="gate_first", activation=act, bias1=gate_up_bias,
                                bias2=down_bias, device=device)


def _is_bf16(x) -> bool:
    if isinstance(x, np.ndarray):
        return BF16 is not None and x.dtype == BF16
    if is_torch(x):
        import torch
        return x.dtype == torch.bfloat16
    return False


# ---- adapters -------------------------------------------------------------------------------------------

_ADAPTER_KEYS = ("a_gate", "a_up", "b_gate", "b_up", "a_gate_up", "b_gate_up", "a_down", "b_down",
                 "shared_a_gate_up", "shared_b_gate_up", "shared_a_down", "shared_b_down")


class AdapterRegistry:
    """Slots of resident LoRA adapters for one MoE layer (SPEC §5). Thread-safe; a running call sees the
    adapters as they were when it started."""

    def __init__(self, weights: MoeWeights, num_slots: int = 64, shared_expert: MoeWeights | None = None):
        if not isinstance(weights, MoeWeights):
            raise error("weights", f"expected fp4moe.MoeWeights, got {type(weights).__name__}")
        if shared_expert is not None and not isinstance(shared_expert, MoeWeights):
            raise error("shared_expert", f"expected fp4moe.MoeWeights, got {type(shared_expert).__name__}")
        self.weights = weights
        self.shared_expert = shared_expert
        self._native = _C.AdapterRegistry(weights.native, int(num_slots),
                                          None if shared_expert is None else shared_expert.native)

    native = property(lambda self: self._native)
    num_slots = property(lambda self: int(self._native.num_slots))

    def load(self, slot: int, tensors: Mapping | None = None, /, *, layout="peft_fused", rank: int | None = None,
             lora_alpha: float | None = None, use_rslora: bool = False, **kw) -> None:
        """Loads an adapter into `slot` (replacing what it held). Tensors (bfloat16) by name, as a dict
        and/or keywords: a_gate, a_up, b_gate, b_up (layout='per_expert'); a_gate_up, b_gate_up
        ('peft_fused', 'shared_outer'); a_down, b_down; shared_* for the shared expert's own LoRA.
        The scale lora_alpha / rank (/ sqrt(rank) with use_rslora) is required; rank defaults to the
        A matrices' rank dimension."""
        t = dict(tensors or {})
        for k, v in kw.items():
            if k in t:
                raise error(k, "given both in the tensor dict and as a keyword")
            t[k] = v
        for k in t:
            if k not in _ADAPTER_KEYS:
                raise error(k, f"unknown adapter tensor; expected one of {list(_ADAPTER_KEYS)}")
        lay = parse_enum(LoraLayout, layout, "layout", LORA_LAYOUT_ALIASES)
        if lora_alpha is None:
            raise error("lora_alpha", "is required (the adapter's scale is lora_alpha / rank)")
        if rank is None:
            for k in ("a_gate_up", "a_gate", "a_down", "shared_a_gate_up", "shared_a_down"):
                if t.get(k) is not None:
                    s = shape_of(t[k], k)
                    if len(s) < 2:
                        raise error(k, f"expected a matrix stack [..., r, in], got shape {list(s)}")
                    rank = s[-2]
                    break
            else:
                raise error("rank", "cannot be inferred: no A matrix given")
        args = {k: as_arg(v, k) for k, v in t.items() if v is not None}
        self._native._load(int(slot), args, int(lay), int(rank), float(lora_alpha), bool(use_rslora))

    def unload(self, slot: int) -> None:
        self._native.unload(int(slot))

    def loaded(self, slot: int) -> bool:
        return bool(self._native.loaded(int(slot)))

    def __repr__(self):
        n = sum(self.loaded(i) for i in range(self.num_slots))
        return f"fp4moe.AdapterRegistry({n}/{self.num_slots} slots loaded, weights={self.weights!r})"


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


# ---- the operator -------------------------------------------------------------------------------------------

def _stream_of(stream, x, device):
    if device[0] != "cuda":
        return 0
    if stream is None:
        t = sys.modules.get("torch")
        if t is not None and t.cuda.is_available():  # PyTorch's current stream on the weights' device
            return int(t.cuda.current_stream(device[1]).cuda_stream)
        return 0  # the legacy default stream
    if isinstance(stream, int):
        return stream
    for attr in ("cuda_stream", "ptr", "handle"):  # torch.cuda.Stream, cupy.cuda.Stream
        if hasattr(stream, attr):
            return int(getattr(stream, attr))
    raise error("stream", f"expected a CUDA stream (int handle, torch.cuda.Stream or cupy Stream), got "
                          f"{type(stream).__name__}")


def moe(x, weights: MoeWeights, *, routing_logits=None, routing_bias=None, topk_ids=None, topk_weights=None,
        top_k: int, routing_method, n_group: int = 1, topk_group: int = 1, routed_scaling_factor: float = 1.0,
        activation=None, gemm1_alpha=None, gemm1_beta=None, gemm1_clamp_limit=None, num_experts_total: int = 0,
        local_expert_offset: int = 0, mode="a16", fc1_input_scale: float = 0.0, fc2_input_scale: float = 0.0,
        per_token_x_scale: bool = False, shared_expert: MoeWeights | None = None, shared_alpha=None,
        shared_beta=None, shared_clamp_limit=None, adapters: AdapterRegistry | None = None, adapter_ids=None,
        gate_up_lora_delta=None, activation_out=None, out=None, workspace=None, stream=None,
        precision="fp32", num_threads: int = 0):
    """The fused MoE layer (SPEC §3): y [T, H] bfloat16 = Σ_j w_tj · expert_e(x_t) (+ shared expert).

    Routing from routing_logits [T, E] (+ routing_bias [E]) or precomputed topk_ids int32 [T, k] and
    topk_weights float32 [T, k]. Per-expert activation parameters gemm1_alpha/beta/clamp_limit (float32
    [E_loc], or a scalar for all experts), in real units. Returns `out` when given, else a new tensor in
    x's framework (NumPy for host arrays, PyTorch for torch tensors).
    """
    if not isinstance(weights, MoeWeights):
        raise error("weights", f"expected fp4moe.MoeWeights (from prepare_weights), got {type(weights).__name__}")
    if activation is None:
        if weights.activation is None:
            raise error("activation", "is required (the weights were prepared without an activation)")
        activation = weights.activation
    act = parse_enum(ActivationType, activation, "activation")
    method = parse_enum(RoutingMethod, routing_method, "routing_method")
    md = parse_enum(ActMode, mode, "mode", MODE_ALIASES)
    prec = parse_enum(Precision, precision, "precision", PRECISION_ALIASES)
    if adapters is not None and not isinstance(adapters, AdapterRegistry):
        raise error("adapters", f"expected fp4moe.AdapterRegistry, got {type(adapters).__name__}")
    if shared_expert is not None and not isinstance(shared_expert, MoeWeights):
        raise error("shared_expert", f"expected fp4moe.MoeWeights, got {type(shared_expert).__name__}")
    xs = require_ndim(x, "x", 2, "[T, H] bfloat16")
    dev = weights._device
    E_loc = weights.num_experts
    if out is None:
        out = empty_bf16((xs[0], weights.hidden), x, device_of(x, _describe), "out")
    shared_given = any(v is not None for v in (shared_alpha, shared_beta, shared_clamp_limit))
    tensors = {
        "x": as_arg(x, "x"),
        "routing_logits": as_arg(routing_logits, "routing_logits"),
        "routing_bias": as_arg(routing_bias, "routing_bias"),
        "topk_ids": as_arg(to_int32(topk_ids, "topk_ids"), "topk_ids"),
        "topk_weights": as_arg(topk_weights, "topk_weights"),
        "gemm1_alpha": as_arg(per_expert(gemm1_alpha, "gemm1_alpha", E_loc, dev), "gemm1_alpha"),
        "gemm1_beta": as_arg(per_expert(gemm1_beta, "gemm1_beta", E_loc, dev), "gemm1_beta"),
        "gemm1_clamp_limit": as_arg(per_expert(gemm1_clamp_limit, "gemm1_clamp_limit", E_loc, dev),
                                    "gemm1_clamp_limit"),
        "adapter_ids": as_arg(to_int32(adapter_ids, "adapter_ids"), "adapter_ids"),
        "gate_up_lora_delta": as_arg(gate_up_lora_delta, "gate_up_lora_delta"),
        "activation_out": as_arg(activation_out, "activation_out"),
        "y": as_arg(out, "out"),
        "workspace": as_arg(workspace, "workspace"),
    }
    _C.moe_run(weights.native, tensors, int(method), int(top_k), int(n_group), int(topk_group),
               float(routed_scaling_factor), int(act), int(num_experts_total), int(local_expert_offset), int(md),
               float(fc1_input_scale), float(fc2_input_scale), bool(per_token_x_scale),
               None if shared_expert is None else shared_expert.native,
               1.0 if shared_alpha is None else float(shared_alpha),
               0.0 if shared_beta is None else float(shared_beta),
               _clamp_value(shared_clamp_limit), shared_given,
               None if adapters is None else adapters.native,
               _stream_of(stream, x, dev), int(prec), int(num_threads))
    return out


def _clamp_value(v) -> float:
    if v is None:
        return 0.0  # 0 = no clamp (C++ convention)
    v = float(v)
    if math.isinf(v) and v > 0:
        return 0.0
    return v


def route(routing_logits, *, top_k: int, routing_method, routing_bias=None, n_group: int = 1, topk_group: int = 1,
          routed_scaling_factor: float = 1.0, num_experts_total: int = 0):
    """Routing alone (SPEC §3.1) on the host: returns (topk_ids int32 [T, k], topk_weights float32 [T, k]),
    NumPy arrays (PyTorch tensors for torch inputs; device tensors are copied to the host)."""
    method = parse_enum(RoutingMethod, routing_method, "routing_method")
    T, E = require_ndim(routing_logits, "routing_logits", 2, "[T, E]")
    torch_in = is_torch(routing_logits)
    logits, bias = routing_logits, routing_bias
    if torch_in:
        logits = logits.detach().cpu()
        if bias is not None and is_torch(bias):
            bias = bias.detach().cpu()
    k = int(top_k)
    ids = np.zeros((T, max(k, 0)), dtype=np.int32)
    w = np.zeros((T, max(k, 0)), dtype=np.float32)
    _C.route({"routing_logits": as_arg(logits, "routing_logits"), "routing_bias": as_arg(bias, "routing_bias"),
              "topk_ids_out": ids, "topk_weights_out": w}, int(method), k, int(n_group), int(topk_group),
             float(routed_scaling_factor), int(num_experts_total) or E)
    if torch_in:
        import torch
        return torch.from_numpy(ids), torch.from_numpy(w)
    return ids, w


def check_device_errors(device=0) -> None:
    """Raises Fp4MoeError(DeviceFault) if a GPU-only value (a topk or adapter id) was bad in an earlier call."""
    d = _parse_device(device, ("cuda", 0))
    if d[0] == "cuda":
        _C.check_device_errors(d[1])


def build_info() -> dict:
    """What this binary is (SPEC §7): version, source hash, compilers, architectures, plus where it lives,
    its METADATA.json (when present) and the CUDA devices seen."""
    info = _loader.binary_info()
    info["extension"] = str(_C.__file__)
    info["metadata"] = _loader.metadata
    info["cuda_devices"] = int(_C.cuda_device_count())
    return info
