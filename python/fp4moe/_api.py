"""The Python API: FlashInfer-like plain functions over the extension (SPEC §3-§5)."""
from __future__ import annotations

import itertools
import math
import sys
import threading
import weakref
from typing import Mapping

import numpy as np

from . import _loader
from ._enums import (FORMAT_ALIASES, GATE_UP_ORDER_ALIASES, LORA_LAYOUT_ALIASES, MODE_ALIASES,
                     PRECISION_ALIASES, SCALE_LAYOUT_ALIASES, GEMM_TILE_ALIASES, ActivationType, ActMode, GateUpOrder,
                     GemmTile, LoraLayout,
                     Precision, RoutingMethod, ScaleLayout, WeightFormat, is_gated, parse_enum)
from ._errors import ErrorCode, Fp4MoeError, error, renamed
from ._tensors import (BF16, E4M3, INT32_RANGE, as_arg, as_float, as_int, device_of, empty_bf16, is_torch, per_expert,
                       require_ndim, shape_of, to_host_float, to_int32)

from ._peft import read_peft_experts_lora

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


# ---- handles --------------------------------------------------------------------------------------------
# Prepared weights and adapter registries are not tensors; graph-level consumers (the PyTorch custom op,
# torch.compile, CUDA graphs) refer to them by a small integer handle, fixed at construction. The table
# holds weak references: the object lives as long as its owner (a module, the caller) keeps it.
_handle_lock = threading.Lock()
_handle_counter = itertools.count(1)
_by_handle: "weakref.WeakValueDictionary[int, object]" = weakref.WeakValueDictionary()


def _new_handle(obj) -> int:
    with _handle_lock:
        h = next(_handle_counter)
        _by_handle[h] = obj
    return h


def object_of_handle(handle: int, argument: str = "weights"):
    """The MoeWeights / AdapterRegistry registered under `handle` (0 -> None)."""
    h = int(handle)
    if h == 0:
        return None
    obj = _by_handle.get(h)
    if obj is None:
        raise error(argument, f"no live fp4moe object has handle {h} (it was garbage-collected or never existed)")
    return obj


# ---- weights --------------------------------------------------------------------------------------------

class MoeWeights:
    """Expert weights prepared for one backend (immutable). Made by prepare_weights and friends."""

    def __init__(self, native, device: tuple[str, int], activation: ActivationType | None):
        self._native = native
        self._device = device
        self.activation = activation  # the activation given at preparation (moe's default), or None
        self.handle = _new_handle(self)  # an int naming this object in graphs (fp4moe.torch_ops)
        # Plain attributes (not properties over the extension) so that torch.compile can read them while tracing.
        self.gated = bool(native.gated)
        self.num_experts = int(native.num_experts)
        self.hidden = int(native.hidden)
        self.inter = int(native.inter)

    native = property(lambda self: self._native)
    device = property(lambda self: "cpu" if self._device[0] == "cpu" else f"cuda:{self._device[1]}")
    format = property(lambda self: WeightFormat(self._native.format))
    gate_up_order = property(lambda self: GateUpOrder(self._native.order))

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


# prepare_weights' C++ fields that the Python layer derives from a tensor's shape (or from `device`).
_PREPARE_NAMES = {"hidden": "w1", "num_experts": "w1", "inter": "w2", "backend": "device", "device_id": "device"}


def _prepare_native(tensors, fmt, order, layout, gated, E, H, I, dev):
    try:
        return _C.prepare_weights(tensors, int(fmt), int(order), int(layout), gated, E, H, I, _backend(dev), dev[1])
    except Fp4MoeError as e:
        raise renamed(e, _PREPARE_NAMES) from None


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
    native = _prepare_native(tensors, WeightFormat.NVFP4, order, layout, gated, E, H, I, dev)
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
    native = _prepare_native(tensors, WeightFormat.BF16, order, ScaleLayout.Linear, gated, E, H, I, dev)
    return MoeWeights(native, dev, act)


def prepare_mxfp4_weights(w1, w1_scale, w2, w2_scale, *, gate_up_order=None, activation=None, gated=None,
                          bias1=None, bias2=None, device=None) -> MoeWeights:
    """Prepares MXFP4 expert weights (SPEC §2): E2M1 codes packed as NVFP4's, one E8M0 scale per 32 along K, no
    global scale.

    w1 uint8 [E, N1, H/2], w1_scale uint8 [E, N1, H/32], w2 uint8 [E, H, I/2], w2_scale uint8 [E, H, I/32]; gpt-oss's
    `*_blocks` [E, N, K/32, 16] reshape to the packed form as they are. H and I are multiples of 32.
    """
    act, gated, order = _gated_and_order(activation, gate_up_order, gated)
    E, n1, h2 = require_ndim(w1, "w1", 3, "[E, N1, H/2] uint8")
    w2s = require_ndim(w2, "w2", 3, "[E, H, I/2] uint8")
    H, I = 2 * h2, 2 * w2s[2]
    dev = _parse_device(device, device_of(w1, _describe))
    tensors = {"w1": as_arg(w1, "w1"), "w1_scale": as_arg(w1_scale, "w1_scale"), "w2": as_arg(w2, "w2"),
               "w2_scale": as_arg(w2_scale, "w2_scale"), "bias1": as_arg(bias1, "bias1"),
               "bias2": as_arg(bias2, "bias2")}
    native = _prepare_native(tensors, WeightFormat.MXFP4, order, ScaleLayout.Linear, gated, E, H, I, dev)
    return MoeWeights(native, dev, act)


def quantize_weights(w1, w2, *, gate_up_order=None, activation=None, gated=None, format="nvfp4",
                     per_half_scale2=True, scale_layout="linear", bias1=None, bias2=None) -> dict:
    """Dense float32/bfloat16 expert weights -> NVFP4 (SPEC §2) through the C++ quantizer.

    w1 [E, N1, H], w2 [E, H, I] (device tensors are copied to the host). Returns NumPy arrays with the
    keys prepare_weights takes (w1, w1_scale (float8_e4m3fn), w1_scale2, w2, w2_scale, w2_scale2 and
    bias1/bias2 when given), so `prepare_weights(**q, gate_up_order=...)` prepares them. With
    format='bf16' the keys are w1 and w2 (bfloat16), for prepare_bf16_weights; with format='mxfp4' w1, w1_scale,
    w2, w2_scale (E8M0 codes, uint8; triton_kernels' scale rule, SPEC §2) for prepare_mxfp4_weights.
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
    elif fmt == WeightFormat.BF16 and BF16 is not None:
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
        self._native = _C.AdapterRegistry(weights.native, as_int(num_slots, "num_slots", INT32_RANGE),
                                          None if shared_expert is None else shared_expert.native)
        self.handle = _new_handle(self)

    native = property(lambda self: self._native)
    num_slots = property(lambda self: int(self._native.num_slots))

    def load(self, slot: int, tensors: Mapping | None = None, /, *, layout="peft_fused", rank: int | None = None,
             lora_alpha: float | None = None, use_rslora: bool = False, **kw) -> None:
        """Loads an adapter into `slot` (replacing what it held). Tensors (bfloat16) by name, as a dict
        and/or keywords: a_gate, a_up, b_gate, b_up (layout='per_expert'); a_gate_up, b_gate_up
        ('peft_fused', 'shared_outer'); a_down, b_down; shared_* for the shared expert's own LoRA.
        The scale lora_alpha / rank (/ sqrt(rank) with use_rslora) is required; rank defaults to the
        A matrices' rank dimension."""
        slot = as_int(slot, "slot", INT32_RANGE)
        if tensors is not None and not isinstance(tensors, Mapping):
            raise error("tensors", f"expected a dict of adapter tensors by name, got {type(tensors).__name__}")
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
        lora_alpha = as_float(lora_alpha, "lora_alpha")
        if rank is not None:
            rank = as_int(rank, "rank")
        else:
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
        self._native._load(slot, args, int(lay), int(rank), lora_alpha, bool(use_rslora))

    def load_peft(self, slot: int, adapter_dir: str, module_prefix: str, *, expert_offset: int = 0) -> None:
        """Loads one MoE layer's expert LoRA from a saved PEFT adapter (adapter_config.json +
        adapter_model.safetensors, `target_parameters` on transformers 5 fused experts, SPEC §5) into `slot`.

        module_prefix names the MoE block up to "experts.", e.g. "base_model.model.model.layers.3.mlp."
        (list_peft_expert_modules(adapter_dir) lists them). With expert parallelism, expert_offset selects
        this rank's experts [offset, offset + E_loc)."""
        d = read_peft_experts_lora(adapter_dir, module_prefix, num_experts=0, expert_offset=expert_offset,
                                   num_local_experts=self.weights.num_experts)
        t = {k: d[k] for k in ("a_gate_up", "b_gate_up", "a_down", "b_down") if k in d}
        self.load(slot, t, layout="peft_fused", rank=d["rank"], lora_alpha=d["lora_alpha"],
                  use_rslora=d["use_rslora"])

    def unload(self, slot: int) -> None:
        self._native.unload(as_int(slot, "slot", INT32_RANGE))

    def loaded(self, slot: int) -> bool:
        return bool(self._native.loaded(as_int(slot, "slot", INT32_RANGE)))

    def __repr__(self):
        n = sum(self.loaded(i) for i in range(self.num_slots))
        return f"fp4moe.AdapterRegistry({n}/{self.num_slots} slots loaded, weights={self.weights!r})"


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


def _check_known_params(value, name: str, positive: bool, allow_inf: bool) -> None:
    """A scalar or list of per-expert parameters is known here: checked as validate.cpp checks host tensors, before
    it becomes a device tensor that only the GPU could check."""
    if isinstance(value, bool) or not isinstance(value, (int, float, list, tuple)):
        return
    try:
        vals = np.asarray(value, dtype=np.float64).ravel()
    except (TypeError, ValueError):
        raise error(name, f"expected numbers, got {value!r}") from None
    for i, v in enumerate(vals):
        if np.isnan(v) or (not allow_inf and np.isinf(v)) or (positive and not v > 0):
            want = ("positive " if positive else "") + ("number (inf = none)" if allow_inf else "finite number")
            raise error(name, f"element {i} is {v}; expected a {want}")


def moe(x, weights: MoeWeights, *, routing_logits=None, routing_bias=None, topk_ids=None, topk_weights=None,
        top_k: int, routing_method, n_group: int = 1, topk_group: int = 1, routed_scaling_factor: float = 1.0,
        activation=None, gemm1_alpha=None, gemm1_beta=None, gemm1_clamp_limit=None, num_experts_total: int = 0,
        local_expert_offset: int = 0, mode="a16", fc1_input_scale: float = 0.0, fc2_input_scale: float = 0.0,
        per_token_x_scale: bool = False, shared_expert: MoeWeights | None = None, shared_alpha=None,
        shared_beta=None, shared_clamp_limit=None, shared_expert_gate=None, adapters: AdapterRegistry | None = None,
        adapter_ids=None,
        gate_up_lora_delta=None, activation_out=None, out=None, workspace=None, stream=None,
        precision="fp32", num_threads: int = 0, gemm_tile="auto", workspace_budget: int = 0, _runner=None):
    """The fused MoE layer (SPEC §3): y [T, H] bfloat16 = Σ_j w_tj · expert_e(x_t) (+ shared expert).

    Routing from routing_logits [T, E] (+ routing_bias [E]) or precomputed topk_ids int32 [T, k] and
    topk_weights float32 [T, k]. Per-expert activation parameters gemm1_alpha/beta/clamp_limit (float32
    [E_loc], or a scalar for all experts), in real units. Returns `out` when given, else a new tensor in
    x's framework (NumPy for host arrays, PyTorch for torch tensors). gemm_tile forces one of the CUDA
    backend's GEMM tiles (a GemmTile, its name or value: SplitKDecode, WeightsAsA16, WeightsAsA32,
    TokensAsA64, Wgmma64, WgmmaWs128; "auto", the default: the plan's choice) for benchmarking; every tile gives
    the same bits (SPEC §4), so it never changes the output.
    shared_expert_gate: the shared expert's sigmoid gate g, bfloat16 [H] or [1, H] (Qwen2-MoE / Qwen3-Next
    `mlp.shared_expert_gate.weight`): the shared expert's output is scaled by sigmoid(x_t . g) instead of 1.
    workspace_budget: bytes the token-proportional workspace buffers may take (0, the default: 4 GiB); a
    larger batch runs in equal chunks that fit (same bits). A given `workspace` must be sized by
    workspace_size with the same budget.
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
    top_k, n_group, topk_group = as_int(top_k, "top_k"), as_int(n_group, "n_group"), as_int(topk_group, "topk_group")
    num_experts_total = as_int(num_experts_total, "num_experts_total")
    local_expert_offset = as_int(local_expert_offset, "local_expert_offset")
    num_threads = as_int(num_threads, "num_threads", INT32_RANGE)
    gemm_tile = int(parse_enum(GemmTile, gemm_tile, "gemm_tile", GEMM_TILE_ALIASES))
    workspace_budget = as_int(workspace_budget, "workspace_budget")
    routed_scaling_factor = as_float(routed_scaling_factor, "routed_scaling_factor")
    fc1_input_scale = as_float(fc1_input_scale, "fc1_input_scale")
    fc2_input_scale = as_float(fc2_input_scale, "fc2_input_scale")
    # The native call takes the shared expert's three parameters together; one that is not given keeps the
    # activation's default (docs/api.md), as it does when none is given.
    shared_given = any(v is not None for v in (shared_alpha, shared_beta, shared_clamp_limit))
    d_alpha, d_beta, d_clamp = _SHARED_DEFAULTS.get(act, (1.0, 0.0, None))
    shared_alpha = d_alpha if shared_alpha is None else as_float(shared_alpha, "shared_alpha")
    shared_beta = d_beta if shared_beta is None else as_float(shared_beta, "shared_beta")
    shared_clamp = _clamp_value(d_clamp if shared_clamp_limit is None else shared_clamp_limit)
    if shared_expert is not None and shared_given:  # each named for itself (the native check names shared_alpha)
        positive = act == ActivationType.Situ
        for name, v in (("shared_alpha", shared_alpha), ("shared_beta", shared_beta)):
            if not math.isfinite(v) or (positive and v <= 0):
                raise error(name, f"expected a finite{' positive' if positive else ''} number, got {v}")
        if math.isnan(shared_clamp) or shared_clamp < 0:
            raise error("shared_clamp_limit", f"expected a limit >= 0 (0 or inf: none), got {shared_clamp_limit}")
    situ = act == ActivationType.Situ
    _check_known_params(gemm1_alpha, "gemm1_alpha", situ, False)
    _check_known_params(gemm1_beta, "gemm1_beta", situ, False)
    _check_known_params(gemm1_clamp_limit, "gemm1_clamp_limit", True, True)
    xs = require_ndim(x, "x", 2, "[T, H] bfloat16")
    dev = weights._device
    E_loc = weights.num_experts
    if out is None:
        out = empty_bf16((xs[0], weights.hidden), x, device_of(x, _describe), "out")
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
        "shared_expert_gate": as_arg(shared_expert_gate, "shared_expert_gate"),
        "adapter_ids": as_arg(to_int32(adapter_ids, "adapter_ids"), "adapter_ids"),
        "gate_up_lora_delta": as_arg(gate_up_lora_delta, "gate_up_lora_delta"),
        "activation_out": as_arg(activation_out, "activation_out"),
        "y": as_arg(out, "out"),
        "workspace": as_arg(workspace, "workspace"),
    }
    # _runner: fp4moe.distributed's moe_tp / moe_ep (same arguments, the parallel native call).
    (_runner or _C.moe_run)(weights.native, tensors, int(method), top_k, n_group, topk_group,
               routed_scaling_factor, int(act), num_experts_total, local_expert_offset, int(md),
               fc1_input_scale, fc2_input_scale, bool(per_token_x_scale),
               None if shared_expert is None else shared_expert.native,
               shared_alpha, shared_beta, shared_clamp, shared_given,
               None if adapters is None else adapters.native,
               _stream_of(stream, x, dev), int(prec), num_threads, gemm_tile, workspace_budget)
    return out


def workspace_size(weights: MoeWeights, num_tokens: int, top_k: int, *, routing_from_logits: bool = True,
                   num_experts_total: int = 0, n_group: int = 1, activation=None, mode="a16",
                   shared_expert: MoeWeights | None = None, max_lora_rank: int = 0,
                   workspace_budget: int = 0, gemm_tile="auto") -> int:
    """Bytes of `workspace` the CUDA backend uses for a call with up to num_tokens tokens (0 on the CPU
    backend, which takes no workspace). The size does not decrease with num_tokens, so a buffer sized for
    the largest batch serves every smaller one; passing it makes the call allocation-free (CUDA graphs).
    workspace_budget and gemm_tile: as moe's (the size depends on both: ask with the call's values).
    max_lora_rank: the largest adapter rank the calls will see (0: no LoRA)."""
    if not isinstance(weights, MoeWeights):
        raise error("weights", f"expected fp4moe.MoeWeights, got {type(weights).__name__}")
    if shared_expert is not None and not isinstance(shared_expert, MoeWeights):
        raise error("shared_expert", f"expected fp4moe.MoeWeights, got {type(shared_expert).__name__}")
    # The arguments' types and names are checked on every backend; their ranges by the CUDA plan.
    T, k = as_int(num_tokens, "num_tokens"), as_int(top_k, "top_k")
    e_total, groups = as_int(num_experts_total, "num_experts_total"), as_int(n_group, "n_group")
    rank, budget = as_int(max_lora_rank, "max_lora_rank"), as_int(workspace_budget, "workspace_budget")
    tile = int(parse_enum(GemmTile, gemm_tile, "gemm_tile", GEMM_TILE_ALIASES))
    if activation is None:
        activation = weights.activation if weights.activation is not None else ActivationType.Swiglu
    act = parse_enum(ActivationType, activation, "activation")
    md = parse_enum(ActMode, mode, "mode", MODE_ALIASES)
    if weights._device[0] != "cuda":
        return 0
    try:
        return int(_C.workspace_size(weights.native, T, k, bool(routing_from_logits), e_total, groups, int(act),
                                     int(md), None if shared_expert is None else shared_expert.native, rank, budget,
                                     tile))
    except Fp4MoeError as e:
        raise renamed(e, _WORKSPACE_NAMES) from None


# workspace_size's ProblemShape fields -> its Python parameters.
_WORKSPACE_NAMES = {"T": "num_tokens", "H": "weights", "I": "weights", "E_loc": "weights",
                    "E_total": "num_experts_total", "k": "top_k", "format": "weights", "routing.top_k": "top_k", "routing.n_group": "n_group",
                    "shared_inter": "shared_expert"}


# (alpha, beta, clamp limit) an activation takes when they are not given (SPEC §3.2, docs/api.md).
_SHARED_DEFAULTS = {ActivationType.SwigluBias: (1.702, 1.0, 7.0), ActivationType.SwigluStep: (1.0, 0.0, 7.0),
                    ActivationType.Situ: (1.0, 1.0, None)}


def _clamp_value(v) -> float:
    if v is None:
        return 0.0  # 0 = no clamp (C++ convention)
    v = as_float(v, "shared_clamp_limit")
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
    k = as_int(top_k, "top_k")
    n_group, topk_group = as_int(n_group, "n_group"), as_int(topk_group, "topk_group")
    routed_scaling_factor = as_float(routed_scaling_factor, "routed_scaling_factor")
    num_experts_total = as_int(num_experts_total, "num_experts_total")
    if not 1 <= k <= 64:  # before allocating [T, k] outputs; the native check gives the exact bound
        raise error("top_k", f"expected 1 <= top_k <= min(64, the number of experts), got {k}")
    ids = np.zeros((T, k), dtype=np.int32)
    w = np.zeros((T, k), dtype=np.float32)
    _C.route({"routing_logits": as_arg(logits, "routing_logits"), "routing_bias": as_arg(bias, "routing_bias"),
              "topk_ids_out": ids, "topk_weights_out": w}, int(method), k, n_group, topk_group,
             routed_scaling_factor, num_experts_total or E)
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
