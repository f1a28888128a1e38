"""Entry points named and shaped like FlashInfer 0.6.18's fused-MoE functions, computed by fp4moe.

    from fp4moe.flashinfer_compat import trtllm_fp4_block_scale_moe, cutlass_fused_moe
    (out,) = trtllm_fp4_block_scale_moe(routing_logits, None, hidden_states, None, w13, w13_sf, None, None, None,
                                        None, w2, w2_sf, None, o1, o1_gate, o2, num_experts=E, top_k=8, n_group=None,
                                        topk_group=None, intermediate_size=I, local_expert_offset=0,
                                        local_num_experts=E, routed_scaling_factor=None, routing_method_type=4)

Arguments are FlashInfer's (flashinfer/fused_moe/core.py), positional order included; tensors may be PyTorch
(CPU or CUDA) or NumPy (CPU backend). The weights are prepared on first use and cached, keyed by the data pointers,
shapes and dtypes of every weight and scale tensor plus the conventions that change the preparation; later calls
with the same tensors reuse them. The cache holds references to those tensors (as FlashInfer's prepared weights
would): treat them as immutable after the first call, or call clear_cache(). Preparing reads the small per-expert
scale vectors on the host (one device-to-host copy at the first call); the cached calls do not synchronize.

Conventions (verified against FlashInfer's own tests and references, tests/moe/):

Half order. Both FlashInfer backends store W13 as [up (w3); gate (w1)]: their references split `x0 = first half`
(the linear/up branch) and `x1 = second half` (the gate): swiglu = silu(x1) * x0, SiTU = beta*tanh(x0/beta) *
alpha*tanh(x1/alpha)*sigmoid(x1). Here: gate_up_order = up_first.

trtllm weight layout. trtllm_fp4_block_scale_moe always runs FlashInfer's "shuffled" weights (use_shuffled_weight):
W13 rows interleaved up/gate (reorder_rows_for_gated_act_gemm) then permuted in blocks of 32 rows
(shuffle_matrix_a, epilogue_tile_m=128); block scales permuted the same way and then 128x4-swizzled
(block_scale_interleave); W2 and its scales shuffled without the interleave; biases permuted like their rows.
weight_layout="shuffled" (default) undoes exactly that; weight_layout="plain" takes unshuffled weights
([up; gate] row halves) with 128x4-swizzled scales (scale_layout="swizzled", default) or linear ones.
MXFP4 weights (one ue8m0 scale per 32) are refused.

trtllm scales. FlashInfer folds the per-tensor scales into three per-expert vectors. With s1[e] the real dequant
scale of GEMM1's fp32 accumulator (1 / (gs_w13[e] * gs_x)) and c the FC2 input's encode (global) scale:
    output1_scale_gate_scalar[e] = s1[e]
    output1_scale_scalar[e]      = c * s1[e]   (gated, non-SiTU: the up half carries the dequant)
                                 = c           (SiTU and non-gated: the kernel dequantizes inside the activation)
    output2_scale_scalar[e]      = 1 / (c * gs_w2[e])
so here: s_gate[e] = s_up[e] = output1_scale_gate_scalar[e]; c[e] = output1_scale_scalar[e] / s_gate[e]
(respectively output1_scale_scalar[e]); s_down[e] = output2_scale_scalar[e] * c[e]. An absent vector is all ones.
NVFP4 hidden states (uint8 [T, H/2] + hidden_states_scale e4m3 [T, H/16], linear) run in A4 mode: x is decoded to
its exact bf16 values e2m1*e4m3 (its global scale is inside s_gate) and re-encoded with fc1_input_scale = 1, which
reproduces the same codes and block scales whenever each 16-block's largest code is +-6 (what a round-to-nearest
encoder produces unless the block scale underflows to a subnormal e4m3); the FC2 input is quantized with
fc2_input_scale = 1 / c (c must then be the same for all experts, to 1e-5). bfloat16 hidden states run in A16 mode
(FlashInfer has no NVFP4-weight x bf16-activation trtllm mode; its references use c = 1 there).
gemm1_bias, gemm2_bias, gemm1_beta and gemm1_clamp_limit are in the raw accumulator domain for NVFP4
(FlashInfer's test recipe divides the biases, and SiTU's clamp, by the accumulator's dequant factor; SPEC §3.2
notes the same of beta and the clamp): here
    bias1_real[e] = gemm1_bias[e] * s1[e], beta_real[e] = gemm1_beta[e] * s1[e], L_real[e] = clamp[e] * s1[e],
    bias2_real[e] = gemm2_bias[e] * output2_scale_scalar[e].
gemm1_alpha multiplies the real gate inside the sigmoid and is taken as is.
Defaults as FlashInfer: alpha 1, beta 0 (Swiglu) / 1 (SiTU), no clamp.

cutlass (cutlass_fused_moe). Weights unshuffled, uint8 packed (FlashInfer passes them viewed as int64; any integer
view is accepted), block scales 128x4-swizzled ([E, round_up(N1,128), round_up(H/16,4)], any 1- or 4-byte view).
quant_scales = [a1_gs, w1_blockscale, w1_alpha, a2_gs, w2_blockscale, w2_alpha] with a*_gs the activations'
encode scales and w*_alpha = 1 / (a*_gs * gs_w*[e]): FlashInfer's NVFP4 path quantizes the activations (W4A4), so
this runs in A4 mode with fc1_input_scale = 1/a1_gs, fc2_input_scale = 1/a2_gs, s1 = w1_alpha * a1_gs,
s_down = w2_alpha * a2_gs (pre-quantized NVFP4 input with input_sf: decoded as above, s1 = w1_alpha,
fc1_input_scale = 1). Bfloat16 weights (quant_scales empty) run the bf16 path. swiglu_alpha/beta/limit and
situ_beta (SiTU's gate tanh scale, our alpha; default 4) / situ_linear_beta (its up tanh scale, our beta;
default 25) are real units. mode="a16" overrides the activation quantization (Hopper-friendly numerics).

Routing and activation enums are FlashInfer's values (fp4moe.RoutingMethod / fp4moe.ActivationType equal them);
norm_topk_prob=False turns SigmoidRenorm into Sigmoid, as FlashInfer's routing runner does. Unsupported here, each
refused naming the argument: do_finalize=False, per_token_scale, routing_replay_out, num_fused_shared_experts > 0,
min_latency_mode, enable_alltoall, tp_size > 1, FP8 / W4A8 / MXFP8 / MXFP4 flags.
"""
from __future__ import annotations

import threading
from typing import Any, List, Optional

import numpy as np

from . import _api
from ._enums import ActivationType, RoutingMethod, is_gated, parse_enum
from ._errors import ErrorCode, error
# The argument conversions live apart to keep this file short; the two row shuffles stay public here.
from ._flashinfer_args import (_bytes_u8, _decode_x, _device_str, _host, _is_bf16, _is_u8, _key_of, _unswizzle, _vec,
                               _x_like, shuffle_rows_for_trtllm, unshuffle_rows_for_trtllm)
from ._tensors import BF16, E4M3, _torch, is_torch

__all__ = ["trtllm_fp4_block_scale_moe", "trtllm_fp4_block_scale_routed_moe", "cutlass_fused_moe", "clear_cache",
           "cache_info", "shuffle_rows_for_trtllm", "unshuffle_rows_for_trtllm"]


# ---- the cache ---------------------------------------------------------------------------------------------

_cache_lock = threading.Lock()
_cache: dict = {}
_stats = {"prepared": 0, "hits": 0}


def clear_cache() -> None:
    """Drops every prepared weight set (and the references to the caller's tensors)."""
    with _cache_lock:
        _cache.clear()


def cache_info() -> dict:
    """{'entries': n, 'prepared': preparations so far, 'hits': cached calls so far}."""
    with _cache_lock:
        return {"entries": len(_cache), **_stats}


def _cached(key, build):
    with _cache_lock:
        hit = _cache.get(key)
        if hit is not None:
            _stats["hits"] += 1
            return hit[0]
    value, keep = build()
    with _cache_lock:
        _cache[key] = (value, keep)
        _stats["prepared"] += 1
    return value


# ---- trtllm_fp4_block_scale_moe ----------------------------------------------------------------------------------

def _trtllm_scales(act: ActivationType, E: int, o1, o1g, o2):
    """Per-expert (s1, c, s_down) from FlashInfer's three vectors (module docstring)."""
    s1 = _vec(o1g, "output1_scale_gate_scalar", E, 1.0)
    o1v = _vec(o1, "output1_scale_scalar", E, 1.0)
    o2v = _vec(o2, "output2_scale_scalar", E, 1.0)
    if not np.all(np.isfinite(s1)) or np.any(s1 <= 0):
        raise error("output1_scale_gate_scalar", "expected finite positive per-expert scales")
    if not np.all(np.isfinite(o1v)) or np.any(o1v <= 0):
        raise error("output1_scale_scalar", "expected finite positive per-expert scales")
    if not np.all(np.isfinite(o2v)) or np.any(o2v <= 0):
        raise error("output2_scale_scalar", "expected finite positive per-expert scales")
    if is_gated(act) and act != ActivationType.Situ:
        c = (o1v / s1).astype(np.float32)
    else:
        c = o1v
    s_down = (o2v * c).astype(np.float32)
    return s1, c, s_down, o2v


def _prepare_trtllm(w13, w13_sf, b1, w2, w2_sf, b2, o1, o1g, o2, E: int, H: int, I: int, act: ActivationType,
                    weight_layout: str, scale_layout: str, device: str):
    gated = is_gated(act)
    n1 = 2 * I if gated else I
    p1 = _bytes_u8(w13, "gemm1_weights").reshape(E, n1, H // 2)
    p2 = _bytes_u8(w2, "gemm2_weights").reshape(E, H, I // 2)
    s1b = _bytes_u8(w13_sf, "gemm1_weights_scale")
    s2b = _bytes_u8(w2_sf, "gemm2_weights_scale")
    if s1b.size == E * n1 * (H // 32) and s1b.size != E * n1 * (H // 16):
        raise error("gemm1_weights_scale", "MXFP4 weights (one ue8m0 scale per 32) are not supported; NVFP4 only",
                    ErrorCode.Unsupported)
    swizzled = weight_layout == "shuffled" or scale_layout == "swizzled"
    if swizzled:
        l1 = _unswizzle(s1b, E, n1, H // 16, "gemm1_weights_scale")
        l2 = _unswizzle(s2b, E, H, I // 16, "gemm2_weights_scale")
    else:
        l1 = s1b.reshape(E, n1, H // 16)
        l2 = s2b.reshape(E, H, I // 16)
    bias1 = None if b1 is None else _host(b1, "gemm1_bias").astype(np.float32).reshape(E, n1)
    bias2 = None if b2 is None else _host(b2, "gemm2_bias").astype(np.float32).reshape(E, H)
    if weight_layout == "shuffled":
        p1, l1 = unshuffle_rows_for_trtllm(p1, gated), unshuffle_rows_for_trtllm(l1, gated)
        p2, l2 = unshuffle_rows_for_trtllm(p2, False), unshuffle_rows_for_trtllm(l2, False)
        if bias1 is not None:
            bias1 = unshuffle_rows_for_trtllm(bias1, gated)
        if bias2 is not None:
            bias2 = unshuffle_rows_for_trtllm(bias2, False)
    s1, c, s_down, o2v = _trtllm_scales(act, E, o1, o1g, o2)
    if bias1 is not None:
        bias1 = (bias1 * s1[:, None]).astype(np.float32)
    if bias2 is not None:
        # FlashInfer adds the raw bias to the FC2 accumulator before output2_scale_scalar.
        bias2 = (bias2 * o2v[:, None]).astype(np.float32)
    scale2_1 = np.stack([s1, s1], axis=1) if gated else s1
    weights = _api.prepare_weights(
        np.ascontiguousarray(p1), np.ascontiguousarray(l1).view(E4M3), np.ascontiguousarray(scale2_1),
        np.ascontiguousarray(p2), np.ascontiguousarray(l2).view(E4M3), np.ascontiguousarray(s_down),
        gate_up_order="up_first", activation=act, bias1=bias1, bias2=bias2, device=device)
    return weights, s1, c


def _check_unsupported(**kw):
    for name, (value, ok) in kw.items():
        if not ok:
            raise error(name, f"{value!r} is not supported by fp4moe's FlashInfer-compatible entry",
                        ErrorCode.Unsupported)


def _trtllm_common(routing_logits, topk_ids, topk_weights, routing_bias, hidden_states, hidden_states_scale,
                   gemm1_weights, gemm1_weights_scale, gemm1_bias, gemm1_alpha, gemm1_beta, gemm1_clamp_limit,
                   gemm2_weights, gemm2_weights_scale, gemm2_bias, output1_scale_scalar, output1_scale_gate_scalar,
                   output2_scale_scalar, num_experts, top_k, n_group, topk_group, intermediate_size,
                   local_expert_offset, local_num_experts, routed_scaling_factor, routing_method_type, do_finalize,
                   activation_type, per_token_scale, output, norm_topk_prob, routing_replay_out,
                   num_fused_shared_experts, gemm1_lora_delta, weight_layout, scale_layout, mode):
    _check_unsupported(do_finalize=(do_finalize, bool(do_finalize)),
                       per_token_scale=(per_token_scale, per_token_scale is None),
                       routing_replay_out=(routing_replay_out, routing_replay_out is None),
                       num_fused_shared_experts=(num_fused_shared_experts, not num_fused_shared_experts))
    if weight_layout not in ("shuffled", "plain"):
        raise error("weight_layout", f"expected 'shuffled' (FlashInfer's prepared trtllm weights) or 'plain', got "
                                     f"{weight_layout!r}")
    if scale_layout not in ("swizzled", "linear"):
        raise error("scale_layout", f"expected 'swizzled' or 'linear', got {scale_layout!r}")
    act = parse_enum(ActivationType, activation_type, "activation_type")
    method = parse_enum(RoutingMethod, routing_method_type, "routing_method_type")
    if method == RoutingMethod.SigmoidRenorm and not norm_topk_prob:
        method = RoutingMethod.Sigmoid
    E = int(local_num_experts)
    I = int(intermediate_size)
    T = int(hidden_states.shape[0])
    nvfp4_x = _is_u8(hidden_states)
    H = int(hidden_states.shape[1]) * (2 if nvfp4_x else 1)
    if int(gemm2_weights.shape[0]) != E:
        raise error("local_num_experts", f"expected the weights' expert count {int(gemm2_weights.shape[0])}, got {E}")
    device = _device_str(gemm1_weights)
    key = ("trtllm", _key_of(gemm1_weights), _key_of(gemm1_weights_scale), _key_of(gemm1_bias),
           _key_of(gemm2_weights), _key_of(gemm2_weights_scale), _key_of(gemm2_bias), _key_of(output1_scale_scalar),
           _key_of(output1_scale_gate_scalar), _key_of(output2_scale_scalar), E, H, I, int(act), weight_layout,
           scale_layout, device)
    keep = (gemm1_weights, gemm1_weights_scale, gemm1_bias, gemm2_weights, gemm2_weights_scale, gemm2_bias,
            output1_scale_scalar, output1_scale_gate_scalar, output2_scale_scalar)
    weights, s1, c = _cached(key, lambda: (_prepare_trtllm(
        gemm1_weights, gemm1_weights_scale, gemm1_bias, gemm2_weights, gemm2_weights_scale, gemm2_bias,
        output1_scale_scalar, output1_scale_gate_scalar, output2_scale_scalar, E, H, I, act, weight_layout,
        scale_layout, device), keep))

    # Activation parameters: beta and clamp from the raw accumulator domain to real units.
    beta_default = 1.0 if act == ActivationType.Situ else 0.0
    alpha = None if gemm1_alpha is None else _vec(gemm1_alpha, "gemm1_alpha", E, 1.0)
    beta = None if gemm1_beta is None else (_vec(gemm1_beta, "gemm1_beta", E, beta_default) * s1).astype(np.float32)
    clamp = None if gemm1_clamp_limit is None else (
        _vec(gemm1_clamp_limit, "gemm1_clamp_limit", E, 0.0) * s1).astype(np.float32)

    x = hidden_states
    run_mode = "a16"
    fc1 = fc2 = 0.0
    if nvfp4_x:
        if hidden_states_scale is None:
            raise error("hidden_states_scale", "is required for NVFP4 (uint8) hidden states")
        x = _x_like(_decode_x(hidden_states, hidden_states_scale, T, H, False, "hidden_states_scale"), hidden_states)
        run_mode = "a4"
        fc1 = 1.0
        if np.max(np.abs(c - c[0])) > 1e-5 * abs(float(c[0])):
            raise error("output1_scale_scalar", "the FC2 input's global scale (output1_scale_scalar / "
                                                "output1_scale_gate_scalar) differs across experts; fp4moe's A4 mode "
                                                "takes one per tensor")
        fc2 = float(1.0 / c[0])
    elif not _is_bf16(hidden_states):
        raise error("hidden_states", f"expected bfloat16 [T, H] or NVFP4 uint8 [T, H/2], got {hidden_states.dtype}")
    if mode is not None:
        if str(mode).lower() != "a16":
            raise error("mode", f"only 'a16' may override FlashInfer's numerics here, got {mode!r}")
        run_mode = "a16"
    return _run(x, weights, dict(routing_logits=routing_logits, routing_bias=routing_bias, topk_ids=topk_ids,
                                 topk_weights=topk_weights),
                top_k, method, n_group, topk_group, routed_scaling_factor, act, alpha, beta, clamp,
                int(num_experts), int(local_expert_offset), run_mode, fc1, fc2, gemm1_lora_delta, output)


def _as_device_vec(v, like):
    if v is None:
        return None
    if is_torch(like):
        t = _torch()
        return t.from_numpy(np.ascontiguousarray(v, dtype=np.float32)).to(like.device)
    return np.ascontiguousarray(v, dtype=np.float32)


def _run(x, weights, routing, top_k, method, n_group, topk_group, routed_scaling_factor, act, alpha, beta, clamp,
         num_experts, local_expert_offset, mode, fc1, fc2, lora_delta, output):
    r = {k: v for k, v in routing.items() if v is not None}
    if "routing_bias" in r and is_torch(r["routing_bias"]):
        r["routing_bias"] = r["routing_bias"].float()
    elif "routing_bias" in r:
        r["routing_bias"] = np.asarray(r["routing_bias"], dtype=np.float32)
    y = _api.moe(x, weights, top_k=int(top_k), routing_method=method, n_group=int(n_group or 1),
                 topk_group=int(topk_group or 1),
                 routed_scaling_factor=1.0 if routed_scaling_factor is None else float(routed_scaling_factor),
                 activation=act, gemm1_alpha=_as_device_vec(alpha, x), gemm1_beta=_as_device_vec(beta, x),
                 gemm1_clamp_limit=_as_device_vec(clamp, x), num_experts_total=num_experts,
                 local_expert_offset=local_expert_offset, mode=mode, fc1_input_scale=fc1, fc2_input_scale=fc2,
                 gate_up_lora_delta=lora_delta, out=output, **r)
    return [y]


def trtllm_fp4_block_scale_moe(
        routing_logits, routing_bias, hidden_states, hidden_states_scale, gemm1_weights, gemm1_weights_scale,
        gemm1_bias, gemm1_alpha, gemm1_beta, gemm1_clamp_limit, gemm2_weights, gemm2_weights_scale, gemm2_bias,
        output1_scale_scalar, output1_scale_gate_scalar, output2_scale_scalar, num_experts: int, top_k: int,
        n_group: Optional[int], topk_group: Optional[int], intermediate_size: int, local_expert_offset: int,
        local_num_experts: int, routed_scaling_factor: Optional[float], routing_method_type: int = 0,
        do_finalize: bool = True, enable_pdl: Optional[bool] = None,
        activation_type: int = int(ActivationType.Swiglu), per_token_scale=None, output=None,
        tune_max_num_tokens: int = 8192, norm_topk_prob: bool = True, routing_replay_out=None,
        num_fused_shared_experts: Optional[int] = None, *, weight_layout: str = "shuffled",
        scale_layout: str = "swizzled", mode: Optional[str] = None) -> List[Any]:
    """FlashInfer's trtllm_fp4_block_scale_moe (0.6.18 signature) on fp4moe. Returns [output] ([T, H] bf16).

    Extra keywords: weight_layout ('shuffled' = FlashInfer's prepared trtllm weights, 'plain'), scale_layout for
    plain weights ('swizzled' | 'linear'), mode (None = FlashInfer's numerics; 'a16' to skip the FC2 input
    quantization of NVFP4 hidden states).
    enable_pdl and tune_max_num_tokens are accepted and ignored."""
    return _trtllm_common(routing_logits, None, None, routing_bias, hidden_states, hidden_states_scale,
                          gemm1_weights, gemm1_weights_scale, gemm1_bias, gemm1_alpha, gemm1_beta, gemm1_clamp_limit,
                          gemm2_weights, gemm2_weights_scale, gemm2_bias, output1_scale_scalar,
                          output1_scale_gate_scalar, output2_scale_scalar, num_experts, top_k, n_group, topk_group,
                          intermediate_size, local_expert_offset, local_num_experts, routed_scaling_factor,
                          routing_method_type, do_finalize, activation_type, per_token_scale, output, norm_topk_prob,
                          routing_replay_out, num_fused_shared_experts, None, weight_layout, scale_layout, mode)


def _unpack_topk(topk_ids):
    """FlashInfer's precomputed routing: a tuple (ids int32 [T, k], weights [T, k]) or packed int32
    (expert_id << 16) | bf16 bits of the weight."""
    if isinstance(topk_ids, tuple):
        ids, w = topk_ids
        if is_torch(w):
            w = w.float()
        else:
            w = np.asarray(w, dtype=np.float32)
        return ids, w
    if is_torch(topk_ids):
        t = _torch()
        packed = topk_ids.to(t.int32)
        ids = (packed >> 16).to(t.int32)
        bits = (packed & 0xFFFF).to(t.int32)
        w = (bits << 16).view(t.float32)
        return ids, w
    packed = np.asarray(topk_ids).astype(np.int32)
    ids = (packed >> 16).astype(np.int32)
    w = ((packed & 0xFFFF).astype(np.uint32) << 16).view(np.float32)
    return ids, w


def trtllm_fp4_block_scale_routed_moe(
        topk_ids, routing_bias, hidden_states, hidden_states_scale, gemm1_weights, gemm1_weights_scale, gemm1_bias,
        gemm1_alpha, gemm1_beta, gemm1_clamp_limit, gemm2_weights, gemm2_weights_scale, gemm2_bias,
        output1_scale_scalar, output1_scale_gate_scalar, output2_scale_scalar, num_experts: int, top_k: int,
        n_group: Optional[int], topk_group: Optional[int], intermediate_size: int, local_expert_offset: int,
        local_num_experts: int, routed_scaling_factor: Optional[float], routing_method_type: int = 0,
        do_finalize: bool = True, enable_pdl: Optional[bool] = None,
        activation_type: int = int(ActivationType.Swiglu), per_token_scale=None, output=None,
        tune_max_num_tokens: int = 8192, gemm1_lora_delta=None, *, weight_layout: str = "shuffled",
        scale_layout: str = "swizzled", mode: Optional[str] = None, **_ignored) -> List[Any]:
    """FlashInfer's routed variant: topk_ids packed int32 ((id << 16) | bf16 weight bits) or a tuple
    (ids, weights). gemm1_lora_delta [T, k, 2I] bf16 is added to GEMM1's real-valued output (up half first, the
    weights' order), SPEC §5's bridge."""
    ids, w = _unpack_topk(topk_ids)
    return _trtllm_common(None, ids, w, routing_bias, hidden_states, hidden_states_scale, gemm1_weights,
                          gemm1_weights_scale, gemm1_bias, gemm1_alpha, gemm1_beta, gemm1_clamp_limit, gemm2_weights,
                          gemm2_weights_scale, gemm2_bias, output1_scale_scalar, output1_scale_gate_scalar,
                          output2_scale_scalar, num_experts, top_k, n_group, topk_group, intermediate_size,
                          local_expert_offset, local_num_experts, routed_scaling_factor, routing_method_type,
                          do_finalize, activation_type, per_token_scale, output, True, None, None, gemm1_lora_delta,
                          weight_layout, scale_layout, mode)


# ---- cutlass_fused_moe ----------------------------------------------------------------------------------------

def _prepare_cutlass(fc1, fc2, quant_scales, b1, b2, E: int, H: int, I: int, act: ActivationType, nvfp4: bool,
                     prequantized_x: bool, device: str):
    gated = is_gated(act)
    n1 = 2 * I if gated else I
    bias1 = None if b1 is None else _host(b1, "fc1_expert_biases").astype(np.float32).reshape(E, n1)
    bias2 = None if b2 is None else _host(b2, "fc2_expert_biases").astype(np.float32).reshape(E, H)
    if not nvfp4:
        w1 = _host(fc1, "fc1_expert_weights").reshape(E, n1, H)
        w2 = _host(fc2, "fc2_expert_weights").reshape(E, H, I)
        if w1.dtype != BF16:
            w1 = w1.astype(np.float32).astype(BF16)
        if w2.dtype != BF16:
            w2 = w2.astype(np.float32).astype(BF16)
        return _api.prepare_bf16_weights(np.ascontiguousarray(w1), np.ascontiguousarray(w2), gate_up_order="up_first",
                                         activation=act, bias1=bias1, bias2=bias2, device=device), None
    if len(quant_scales) != 6:
        raise error("quant_scales", f"expected NVFP4's 6 entries [a1_gs, w1_blockscale, w1_alpha, a2_gs, "
                                    f"w2_blockscale, w2_alpha], got {len(quant_scales)}")
    a1_gs, w1_bs, w1_alpha, a2_gs, w2_bs, w2_alpha = quant_scales
    a1 = float(_vec(a1_gs, "quant_scales[0]", 1, 1.0)[0])
    a2 = float(_vec(a2_gs, "quant_scales[3]", 1, 1.0)[0])
    if not (np.isfinite(a1) and a1 > 0 and np.isfinite(a2) and a2 > 0):
        raise error("quant_scales", f"expected finite positive activation global scales, got {a1}, {a2}")
    al1 = _vec(w1_alpha, "quant_scales[2]", E, 1.0)
    al2 = _vec(w2_alpha, "quant_scales[5]", E, 1.0)
    p1 = _bytes_u8(fc1, "fc1_expert_weights").reshape(E, n1, H // 2)
    p2 = _bytes_u8(fc2, "fc2_expert_weights").reshape(E, H, I // 2)
    l1 = _unswizzle(_bytes_u8(w1_bs, "quant_scales[1]"), E, n1, H // 16, "quant_scales[1]")
    l2 = _unswizzle(_bytes_u8(w2_bs, "quant_scales[4]"), E, H, I // 16, "quant_scales[4]")
    s1 = (al1 if prequantized_x else al1 * np.float32(a1)).astype(np.float32)
    s2 = (al2 * np.float32(a2)).astype(np.float32)
    weights = _api.prepare_weights(
        np.ascontiguousarray(p1), np.ascontiguousarray(l1).view(E4M3),
        np.ascontiguousarray(np.stack([s1, s1], axis=1) if gated else s1), np.ascontiguousarray(p2),
        np.ascontiguousarray(l2).view(E4M3), np.ascontiguousarray(s2), gate_up_order="up_first", activation=act,
        bias1=bias1, bias2=bias2, device=device)
    return weights, (a1, a2)


def cutlass_fused_moe(
        input, token_selected_experts, token_final_scales, fc1_expert_weights, fc2_expert_weights, output_dtype,
        quant_scales, fc1_expert_biases=None, fc2_expert_biases=None, input_sf=None, swiglu_alpha=None,
        swiglu_beta=None, swiglu_limit=None, tp_size: int = 1, tp_rank: int = 0, ep_size: int = 1, ep_rank: int = 0,
        cluster_size: int = 1, cluster_rank: int = 0, output=None, enable_alltoall: bool = False,
        use_deepseek_fp8_block_scale: bool = False, use_w4_group_scaling: bool = False,
        use_mxfp8_act_scaling: bool = False, min_latency_mode: bool = False, use_packed_weights: bool = False,
        use_wfp4afp8_humming: bool = False, tune_max_num_tokens: int = 8192, enable_pdl: Optional[bool] = None,
        activation_type=ActivationType.Swiglu, swizzled_input_sf: bool = True, use_fused_finalize: bool = True,
        profile_ids=None, workspace_buffer=None, *, situ_beta=None, situ_linear_beta=None,
        mode: Optional[str] = None, intermediate_size: Optional[int] = None):
    """FlashInfer's cutlass_fused_moe (0.6.18 signature) on fp4moe: precomputed routing (token_selected_experts
    int [T, k], token_final_scales float [T, k]). Returns the output [T, H] bfloat16.

    Expert parallelism as FlashInfer: experts [ep_rank * E_loc, (ep_rank + 1) * E_loc) of E_loc * ep_size.
    Extra keywords: mode (None = FlashInfer's numerics: A4 for NVFP4 weights; 'a16' to force), intermediate_size
    (needed only when it cannot be read off fc2_expert_weights). workspace_buffer, tune_max_num_tokens,
    enable_pdl, profile_ids and use_fused_finalize are accepted and ignored (fp4moe's finalize is always
    deterministic)."""
    _check_unsupported(tp_size=(tp_size, tp_size == 1), cluster_size=(cluster_size, cluster_size == 1),
                       enable_alltoall=(enable_alltoall, not enable_alltoall),
                       use_deepseek_fp8_block_scale=(use_deepseek_fp8_block_scale, not use_deepseek_fp8_block_scale),
                       use_w4_group_scaling=(use_w4_group_scaling, not use_w4_group_scaling),
                       use_mxfp8_act_scaling=(use_mxfp8_act_scaling, not use_mxfp8_act_scaling),
                       min_latency_mode=(min_latency_mode, not min_latency_mode),
                       use_wfp4afp8_humming=(use_wfp4afp8_humming, not use_wfp4afp8_humming))
    t = _torch()
    if output_dtype is not None and t is not None and isinstance(output_dtype, t.dtype) and output_dtype != t.bfloat16:
        raise error("output_dtype", f"fp4moe outputs bfloat16, got {output_dtype}", ErrorCode.Unsupported)
    act = parse_enum(ActivationType, activation_type, "activation_type")
    nvfp4 = _is_u8(fc1_expert_weights) or (not _is_bf16(fc1_expert_weights) and quant_scales is not None
                                            and len(quant_scales) > 0)
    E = int(fc1_expert_weights.shape[0])
    H = int(fc2_expert_weights.shape[1])
    T = int(input.shape[0])
    if nvfp4:
        i_bytes = int(np.prod(fc2_expert_weights.shape[2:])) * int(getattr(fc2_expert_weights, "itemsize", 0) or
                                                                   fc2_expert_weights.dtype.itemsize)
        I = intermediate_size or 2 * i_bytes
    else:
        I = intermediate_size or int(fc2_expert_weights.shape[2])
    prequantized = _is_u8(input)
    device = _device_str(fc1_expert_weights)
    qs = list(quant_scales or [])
    key = ("cutlass", _key_of(fc1_expert_weights), _key_of(fc2_expert_weights),
           tuple(_key_of(q) if hasattr(q, "shape") else q for q in qs), _key_of(fc1_expert_biases),
           _key_of(fc2_expert_biases), E, H, I, int(act), nvfp4, prequantized, device)
    keep = (fc1_expert_weights, fc2_expert_weights, qs, fc1_expert_biases, fc2_expert_biases)
    weights, gscales = _cached(key, lambda: (_prepare_cutlass(
        fc1_expert_weights, fc2_expert_weights, qs, fc1_expert_biases, fc2_expert_biases, E, H, I, act, nvfp4,
        prequantized, device), keep))

    x = input
    run_mode, fc1, fc2 = "a16", 0.0, 0.0
    if nvfp4:
        a1, a2 = gscales
        run_mode, fc1, fc2 = "a4", 1.0 / a1, 1.0 / a2
        if prequantized:
            if input_sf is None:
                raise error("input_sf", "is required for NVFP4 (uint8) input")
            H_in = int(input.shape[1]) * 2
            x = _x_like(_decode_x(input, input_sf, T, H_in, bool(swizzled_input_sf), "input_sf"), input)
            fc1 = 1.0
    elif prequantized:
        raise error("input", "NVFP4 input needs NVFP4 weights")
    if mode is not None:
        run_mode = mode
    alpha = beta = clamp = None
    if act == ActivationType.Situ:
        alpha = _vec(situ_beta, "situ_beta", E, 4.0)          # FlashInfer's DEFAULT_SITU_BETA
        beta = _vec(situ_linear_beta, "situ_linear_beta", E, 25.0)  # DEFAULT_SITU_LINEAR_BETA
        if swiglu_limit is not None:
            clamp = _vec(swiglu_limit, "swiglu_limit", E, 0.0)
    else:
        if swiglu_alpha is not None:
            alpha = _vec(swiglu_alpha, "swiglu_alpha", E, 1.0)
        if swiglu_beta is not None:
            beta = _vec(swiglu_beta, "swiglu_beta", E, 0.0)
        if swiglu_limit is not None:
            clamp = _vec(swiglu_limit, "swiglu_limit", E, 0.0)
            clamp = np.where(clamp >= np.finfo(np.float32).max, np.float32(np.inf), clamp).astype(np.float32)
            if np.all(np.isinf(clamp)):
                clamp = None
    ids = token_selected_experts
    wts = token_final_scales
    if is_torch(wts):
        wts = wts.float()
    else:
        wts = np.asarray(wts, dtype=np.float32)
    routing = dict(topk_ids=ids, topk_weights=wts)
    k = int(ids.shape[1])
    (y,) = _run(x, weights, routing, k, RoutingMethod.TopK, 1, 1, 1.0, act, alpha, beta, clamp, E * int(ep_size),
                E * int(ep_rank), run_mode, fc1, fc2, None, output)
    return y
