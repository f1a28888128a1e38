"""The bad moe calls of the fuzz tests (test_fuzz_bad_calls.py, test_fuzz_cuda.py): a base call and the mutations of
one of its arguments (a wrong shape, dtype, stride, device, name, number or type), each with the argument names the
error may give and whether `out` must stay unchanged.
"""
from __future__ import annotations

import numpy as np

from hypothesis import strategies as st

from fuzz_support import ACTIVATIONS, BF16, GATED, METHODS, fp4moe
from fuzz_cases import bf16_array, make_layer, random_adapter, routing_setup, sentinel_like


# ---- moe: bad calls ---------------------------------------------------------------------------------------------

BAD_NAMES = st.sampled_from(["", "softmax", "renormalise", "Renormalize ", "swi glu", "a8", "fp16", "none", "0",
                             "deepseek_v4", "gate-up-down", "\u00e9", "Relu3", "linear2"])
BAD_INTS = st.sampled_from([-1, 11, 99, 2 ** 31, -(2 ** 40)])
NOT_A_NUMBER = st.sampled_from(["1.0", None, [1.0], object(), b"1", 1 + 2j, True])
NOT_AN_INT = st.sampled_from(["2", None, 2.5, [2], object(), True, 2 ** 64, -(2 ** 70), float("nan")])


def noncontig(a):
    """The same values in a view that is not row-major contiguous when a has more than one element (stride 2 along
    the last axis longer than 1)."""
    a = np.asarray(a)
    axes = [i for i in range(a.ndim) if a.shape[i] > 1] or [a.ndim - 1]
    ax = axes[-1]
    idx = [slice(None)] * a.ndim
    idx[ax] = slice(None, None, 2)
    return np.repeat(a, 2, axis=ax)[tuple(idx)]


def wrong_shape(draw, a):
    a = np.asarray(a)
    choice = draw(st.sampled_from(["grow", "shrink", "ndim+", "ndim-"]))
    if choice == "ndim+" or (choice == "shrink" and a.shape[-1] <= 1) or a.ndim == 0:
        return a[None]
    if choice == "ndim-":
        return a.reshape(-1) if a.ndim > 1 else a.reshape(1, -1, 1)
    if choice == "grow":
        return np.concatenate([a, a[..., :1]], axis=-1)
    return np.ascontiguousarray(a[..., :-1])


def other_dtype(draw, a, allowed=()):
    a = np.asarray(a)
    cands = [d for d in (np.float16, np.float64, np.int32, np.int8, np.uint8, np.int16, np.float32, BF16, np.bool_)
             if np.dtype(d) != a.dtype and np.dtype(d) not in [np.dtype(t) for t in allowed]]
    return np.asarray(a, dtype=np.float32).astype(draw(st.sampled_from(cands)))


@st.composite
def base_bad_case(draw):
    """A valid moe call (small, logits or precomputed routing, sometimes LoRA and a shared expert) to mutate."""
    E = draw(st.integers(1, 6))
    H, I = draw(st.sampled_from([16, 32])), draw(st.sampled_from([16, 32]))
    act = draw(st.sampled_from(["Swiglu", "Situ", "Relu", "SwigluBias", "Identity"]))
    L = make_layer(E, H, I, act in GATED, draw(st.sampled_from(["nvfp4", "bf16"])), "gate_first",
                   bias=draw(st.booleans()), seed=1)
    T = draw(st.integers(1, 6))
    rng = np.random.default_rng(draw(st.integers(0, 2 ** 16)))
    method, k, n_group, topk_group, rsf = draw(routing_setup(E))
    x = bf16_array(rng, (T, H))
    kw = dict(top_k=k, routing_method=method, activation=act, routed_scaling_factor=rsf)
    logits = (rng.standard_normal((T, E)) * 2).astype(np.float32)
    if draw(st.booleans()):
        kw.update(routing_logits=logits, n_group=n_group, topk_group=topk_group)
    else:
        ids, w = fp4moe.route(logits, top_k=k, routing_method=method, n_group=n_group, topk_group=topk_group)
        kw.update(topk_ids=ids, topk_weights=w)
    if draw(st.booleans()):
        reg = fp4moe.AdapterRegistry(L.weights, num_slots=4)
        reg.load(0, random_adapter(rng, L, "peft_fused", 4), layout="peft_fused", lora_alpha=8.0)
        kw.update(adapters=reg, adapter_ids=rng.integers(-1, 1, size=T).astype(np.int32))
    if draw(st.booleans()):
        kw["shared_expert"] = make_layer(1, H, 16, act in GATED, "bf16", "up_first", seed=2).weights
    out = sentinel_like((T, H), BF16, draw(st.integers(0, 2 ** 16)))
    return L, x, kw, out


def moe_mutations(draw, L, x, kw, out):
    """One mutation of a valid moe call: (name, mutated x, mutated kw, allowed error arguments, 'same' when the
    variant is legal and must give the base call's bits, or None)."""
    T, H, E, k = x.shape[0], L.H, L.E, kw["top_k"]
    pre = "topk_ids" in kw
    kw = dict(kw)
    kw["out"] = out
    m = draw(st.sampled_from([
        "x_dtype", "x_shape", "x_noncontig", "x_negstride", "x_type", "x_readonly", "weights_type",
        "logits_dtype", "logits_shape", "logits_noncontig", "logits_type", "routing_absent", "routing_both",
        "bias_shape", "bias_dtype", "bias_nan", "topk_ids_range", "topk_ids_dtype", "topk_ids_shape",
        "topk_weights_absent", "topk_ids_absent", "topk_weights_dtype", "topk_ids_int64",
        "top_k_value", "top_k_type", "method_name", "method_int", "method_type", "method_alias", "llama4_k",
        "n_group", "topk_group", "rsf_value", "rsf_type", "activation_name", "activation_int", "activation_gating",
        "activation_alias", "param_shape", "param_dtype", "param_nan", "param_list_bad", "param_type",
        "param_noncontig", "situ_param_nonpositive", "clamp_nonpositive", "param_same_spelling",
        "e_total_small", "e_total_large", "offset_range", "mode_name", "a4_no_scales", "a4_bad_fc2", "a4_bad_fc1",
        "fc_scale_type", "precision_name", "precision_alias", "num_threads_bad", "num_threads_same",
        "gemm_tile_bad", "gemm_tile_same", "budget_bad", "budget_same", "workspace_cpu", "stream_cpu",
        "shared_type", "shared_hidden", "shared_experts", "shared_gating", "shared_param_bad",
        "adapters_type", "ids_without_adapters", "adapters_without_ids", "adapter_ids_shape", "adapter_ids_dtype",
        "adapter_ids_range", "adapter_ids_empty_slot", "adapters_other_shape", "adapter_ids_int64",
        "delta_shape", "delta_dtype", "delta_zero", "act_out_shape", "act_out_dtype", "act_out_readonly",
        "act_out_overlap", "out_dtype", "out_shape", "out_noncontig", "out_readonly", "out_is_x", "out_type",
        "out_f32"]))
    allowed, same = set(), None
    param = draw(st.sampled_from(["gemm1_alpha", "gemm1_beta", "gemm1_clamp_limit"]))
    gated = L.gated
    if m == "x_dtype":
        x = other_dtype(draw, x)
        allowed = {"x"}
    elif m == "x_shape":
        x = wrong_shape(draw, x)
        allowed = {"x", "out", "routing_logits", "topk_ids", "topk_weights", "adapter_ids"}
    elif m == "x_noncontig":
        x, allowed = noncontig(x), {"x"}
    elif m == "x_negstride":
        x, allowed = x[::-1], {"x"}
        if T == 1:
            same = "same"
    elif m == "x_type":
        x, allowed = draw(st.sampled_from([x.tolist(), "x", None, 3.0, object()])), {"x"}
    elif m == "x_readonly":
        x = x.copy()
        x.setflags(write=False)
        same = "same"
    elif m == "weights_type":
        kw["_weights"] = draw(st.sampled_from([L.args, None, "weights", L.weights.native]))
        allowed = {"weights"}
    elif m.startswith("logits") or m in ("routing_absent", "routing_both", "bias_shape", "bias_dtype", "bias_nan"):
        lg = kw.pop("routing_logits", None)
        if lg is None:
            lg = (np.random.default_rng(0).standard_normal((T, E))).astype(np.float32)
            for key in ("topk_ids", "topk_weights"):
                kw.pop(key)
        allowed = {"routing_logits"}
        if m == "logits_dtype":
            lg = other_dtype(draw, lg, allowed=(np.float32, BF16))
        elif m == "logits_shape":
            lg = wrong_shape(draw, lg)
        elif m == "logits_noncontig":
            lg = noncontig(lg) if draw(st.booleans()) else lg[::-1]
            if T == 1 and lg.strides[0] < 0:
                lg = noncontig(lg)
            if lg.size <= 1:  # a single element has no layout to get wrong
                same = "any" if pre else "same"  # logits made here route unlike the base's precomputed ids
        elif m == "logits_type":
            lg = draw(st.sampled_from([lg.tolist(), "logits", 1.0]))
        elif m == "routing_absent":
            lg = None
            allowed = {"routing_logits", "topk_ids", "topk_weights"}
        elif m == "routing_both":
            ids, w = fp4moe.route(lg, top_k=k, routing_method="Renormalize")
            kw.update(topk_ids=ids, topk_weights=w)
            allowed = {"routing_logits", "topk_ids", "topk_weights"}
        else:
            b = np.zeros(E, np.float32)
            if m == "bias_shape":
                b = wrong_shape(draw, b)
            elif m == "bias_dtype":
                b = other_dtype(draw, b)
            else:
                b[draw(st.integers(0, E - 1))] = draw(st.sampled_from([np.nan, np.inf, -np.inf]))
            kw["routing_bias"] = b
            allowed = {"routing_bias"}
        kw["routing_logits"] = lg
    elif m.startswith("topk_") and m not in ("topk_group",):
        if not pre:
            lg = kw.pop("routing_logits")
            kw.pop("routing_bias", None)
            kw["topk_ids"], kw["topk_weights"] = fp4moe.route(lg, top_k=k, routing_method=kw["routing_method"],
                                                              n_group=kw.pop("n_group", 1),
                                                              topk_group=kw.pop("topk_group", 1),
                                                              routed_scaling_factor=kw["routed_scaling_factor"])
            same = None
        ids, w = np.array(kw["topk_ids"]), np.array(kw["topk_weights"])
        if m == "topk_ids_range":
            ids[draw(st.integers(0, T - 1)), draw(st.integers(0, k - 1))] = draw(
                st.sampled_from([-1, E, E + 7, 2 ** 31 - 1, -(2 ** 31)]))
            allowed = {"topk_ids"}
        elif m == "topk_ids_dtype":
            ids = other_dtype(draw, ids, allowed=(np.int32, np.int64))
            allowed = {"topk_ids"}
        elif m == "topk_ids_shape":
            ids = wrong_shape(draw, ids)
            allowed = {"topk_ids", "topk_weights"}
        elif m == "topk_weights_absent":
            w, allowed = None, {"topk_weights"}
        elif m == "topk_ids_absent":
            ids, allowed = None, {"topk_ids"}
        elif m == "topk_weights_dtype":
            w, allowed = other_dtype(draw, w, allowed=(np.float32,)), {"topk_weights"}
        else:  # topk_ids_int64: converted to int32
            ids, same = ids.astype(np.int64), "same"
        kw["topk_ids"], kw["topk_weights"] = ids, w
    elif m == "top_k_value":
        kw["top_k"] = draw(st.sampled_from([0, -1, 65, 2 ** 62, E + 1]))
        allowed = {"top_k", "topk_ids", "topk_weights"}
    elif m == "top_k_type":
        kw["top_k"], allowed = draw(NOT_AN_INT), {"top_k"}
    elif m == "method_name":
        kw["routing_method"], allowed = draw(BAD_NAMES), {"routing_method"}
    elif m == "method_int":
        kw["routing_method"], allowed = draw(BAD_INTS), {"routing_method"}
    elif m == "method_type":
        kw["routing_method"], allowed = draw(st.sampled_from([None, 1.0, [1], object(), b"TopK"])), {"routing_method"}
    elif m == "method_alias":
        name = kw["routing_method"]
        kw["routing_method"] = draw(st.sampled_from([name.upper(), name.lower(), "_".join(name),
                                                     np.int64(METHODS.index(name)),
                                                     getattr(fp4moe.RoutingMethod, name)]))
        same = "same"
    elif m == "llama4_k":
        if k == 1:
            kw["top_k"] = 2
            if pre:
                kw["topk_ids"] = np.zeros((T, 2), np.int32)
                kw["topk_weights"] = np.zeros((T, 2), np.float32)
        kw["routing_method"] = "llama4"
        allowed = {"top_k", "topk_ids"} if E >= 2 else {"top_k"}
        if pre:  # precomputed routing takes no method-specific check: only k <= E matters
            same = "any" if E >= 2 else None
    elif m == "n_group":
        if pre:
            kw["routing_logits"] = np.zeros((T, E), np.float32)
            kw.pop("topk_ids"), kw.pop("topk_weights")
        kw["n_group"] = draw(st.sampled_from([0, -1] + [g for g in range(2, E + 2) if E % g]))
        allowed = {"n_group"}
    elif m == "topk_group":
        divs = [g for g in range(2, E + 1) if E % g == 0 and E // g >= 2]
        if pre or not divs:
            kw["routing_method"], allowed = "bogus", {"routing_method"}
        else:
            g = draw(st.sampled_from(divs))
            kw.update(routing_method="DeepSeekV3", n_group=g, topk_group=draw(st.sampled_from([0, -1, g + 1])),
                      top_k=1)
            allowed = {"topk_group"}
    elif m == "rsf_value":
        kw["routed_scaling_factor"] = draw(st.sampled_from([np.nan, np.inf, -np.inf, 1e39, 10 ** 400]))
        allowed = {"routed_scaling_factor"}
        if pre:
            same = "any"  # not used by precomputed routing
    elif m == "rsf_type":
        kw["routed_scaling_factor"], allowed = draw(NOT_A_NUMBER), {"routed_scaling_factor"}
    elif m == "activation_name":
        kw["activation"], allowed = draw(BAD_NAMES), {"activation"}
    elif m == "activation_int":
        kw["activation"], allowed = draw(BAD_INTS), {"activation"}
    elif m == "activation_gating":
        kw["activation"] = draw(st.sampled_from(["Relu", "Gelu", "Identity"] if gated else ["Swiglu", "Situ", 4]))
        allowed = {"activation"}
    elif m == "activation_alias":
        name = kw["activation"]
        kw["activation"] = draw(st.sampled_from([name.upper(), "_".join(name), ACTIVATIONS.index(name),
                                                 getattr(fp4moe.ActivationType, name)]))
        same = "same"
    elif m.startswith("param") or m in ("situ_param_nonpositive", "clamp_nonpositive"):
        v = np.ones(E, np.float32)
        allowed = {param}
        if m == "param_shape":
            v = wrong_shape(draw, v)
        elif m == "param_dtype":
            v = other_dtype(draw, v)
        elif m == "param_nan":
            v[draw(st.integers(0, E - 1))] = np.nan
            if param != "gemm1_clamp_limit" and draw(st.booleans()):
                v[-1] = np.inf
        elif m == "param_list_bad":
            v = draw(st.sampled_from([["a"] * E, [[1.0, 2.0]] * E, [None] * E]))
            if v == [None] * E:
                v = ["x"] * E
        elif m == "param_type":
            v = draw(st.sampled_from(["1.0", object(), b"1", True, {"a": 1}]))
        elif m == "param_noncontig":
            v = noncontig(v)
            if E == 1:
                v = np.ones(2, np.float32)[::2]
                same = "any"
        elif m == "situ_param_nonpositive":
            kw["activation"] = "Situ" if gated else "Relu"
            param = draw(st.sampled_from(["gemm1_alpha", "gemm1_beta"]))
            v = np.full(E, draw(st.sampled_from([0.0, -1.0, -np.inf])), np.float32)
            allowed = {param} if gated else {param}
            if not gated:
                same = "any" if draw(st.booleans()) else None
                v[0] = np.nan  # a NaN is refused for every activation
        elif m == "clamp_nonpositive":
            param = "gemm1_clamp_limit"
            v = np.full(E, draw(st.sampled_from([0.0, -1.0, -np.inf])), np.float32)
            allowed = {param}
        else:  # param_same_spelling: scalar, list and array of the same values give the same bits
            val = 0.75 if kw["activation"] != "Situ" else 3.0
            v = draw(st.sampled_from([val, [val] * E, np.full(E, val, np.float32), np.float32(val)]))
            kw[param] = np.full(E, val, np.float32)
            same = ("same_as", param, np.full(E, val, np.float32))
        kw[param] = v
    elif m == "e_total_small":
        kw["num_experts_total"] = draw(st.sampled_from([-1, -5] + ([E - 1] if E > 1 else [])))
        allowed = {"num_experts_total"}
    elif m == "e_total_large":
        kw["num_experts_total"] = E + draw(st.integers(1, 4))
        allowed = {"routing_logits"} if not pre else {"topk_ids"}
        if pre:
            same = "any"  # precomputed ids < E are valid in a larger expert space
    elif m == "offset_range":
        kw["local_expert_offset"] = draw(st.sampled_from([-1, 1, 2 ** 40]))
        allowed = {"local_expert_offset"}
    elif m == "mode_name":
        kw["mode"] = draw(st.one_of(BAD_NAMES, BAD_INTS, st.just(None)))
        allowed = {"mode"}
    elif m == "a4_no_scales":
        kw["mode"] = draw(st.sampled_from(["a4", "w4a4", 1, fp4moe.ActMode.A4]))
        allowed = {"fc1_input_scale", "fc2_input_scale"}
    elif m == "a4_bad_fc2":
        kw.update(mode="a4", fc1_input_scale=0.01, fc2_input_scale=draw(st.sampled_from([0.0, -1.0, np.nan, np.inf])))
        allowed = {"fc2_input_scale"}
    elif m == "a4_bad_fc1":
        kw.update(mode="a4", fc2_input_scale=0.01, fc1_input_scale=draw(st.sampled_from([0.0, -1.0, np.nan, np.inf])))
        allowed = {"fc1_input_scale"}
    elif m == "fc_scale_type":
        name = draw(st.sampled_from(["fc1_input_scale", "fc2_input_scale"]))
        kw.update(mode="a4", fc1_input_scale=0.01, fc2_input_scale=0.01)
        kw[name], allowed = draw(NOT_A_NUMBER), {name}
    elif m == "precision_name":
        kw["precision"] = draw(st.one_of(BAD_NAMES, BAD_INTS, st.just(None)))
        allowed = {"precision"}
    elif m == "precision_alias":
        kw["precision"] = draw(st.sampled_from(["fp32", "FP32", "float32", 0, fp4moe._enums.Precision.Fp32]))
        same = "same"
    elif m == "num_threads_bad":
        kw["num_threads"], allowed = draw(st.sampled_from([-1, 2 ** 31, "2", 1.5, None])), {"num_threads"}
    elif m == "num_threads_same":
        kw["num_threads"], same = draw(st.sampled_from([1, 2, 3, np.int32(2)])), "same"
    elif m == "gemm_tile_bad":
        kw["gemm_tile"], allowed = draw(st.sampled_from([-2, 1000, 2 ** 31, "0", 0.5])), {"gemm_tile"}
    elif m == "gemm_tile_same":
        kw["gemm_tile"], same = draw(st.sampled_from([-1, 0, 1])), "same"
    elif m == "budget_bad":
        kw["workspace_budget"], allowed = draw(st.sampled_from([-1, 2 ** 63, "1", 1.5])), {"workspace_budget"}
    elif m == "budget_same":
        kw["workspace_budget"], same = draw(st.sampled_from([0, 1 << 20, 1])), "same"
    elif m == "workspace_cpu":
        kw["workspace"], allowed = np.zeros(draw(st.sampled_from([0, 1024])), np.uint8), {"workspace"}
    elif m == "stream_cpu":  # the CPU backend takes no stream
        kw["stream"], same = draw(st.sampled_from([0, 12345, None])), "same"
    elif m.startswith("shared"):
        allowed = {"shared_expert"}
        if m == "shared_type":
            kw["shared_expert"] = draw(st.sampled_from([L.args, "shared", 1, L.weights.native]))
        elif m == "shared_hidden":
            kw["shared_expert"] = make_layer(1, 2 * H, 16, gated, "bf16", "gate_first", seed=3).weights
        elif m == "shared_experts":
            kw["shared_expert"] = make_layer(2, H, 16, gated, "bf16", "gate_first", seed=3).weights
        elif m == "shared_gating":
            kw["shared_expert"] = make_layer(1, H, 16, not gated, "bf16", "gate_first", seed=3).weights
        else:
            kw.setdefault("shared_expert", make_layer(1, H, 16, gated, "bf16", "gate_first", seed=3).weights)
            name = draw(st.sampled_from(["shared_alpha", "shared_beta", "shared_clamp_limit"]))
            bad = {"shared_clamp_limit": [np.nan, -1.0, "7"]}.get(name, [np.nan, np.inf, "1", None])
            kw[name] = draw(st.sampled_from(bad))
            allowed = {name}
            if kw[name] is None:
                kw[name], same = None, "any"
    elif m.startswith("adapter") or m in ("ids_without_adapters",):
        if "adapters" not in kw:
            reg = fp4moe.AdapterRegistry(L.weights, num_slots=4)
            reg.load(0, random_adapter(np.random.default_rng(1), L, "peft_fused", 2), layout="peft_fused",
                     lora_alpha=2.0)
            kw.update(adapters=reg, adapter_ids=np.zeros(T, np.int32))
        aids = np.array(kw["adapter_ids"])
        allowed = {"adapter_ids"}
        if m == "adapters_type":
            kw["adapters"], allowed = draw(st.sampled_from([kw["adapters"].native, "reg", 0, L.weights])), {"adapters"}
        elif m == "ids_without_adapters":
            kw.pop("adapters")
        elif m == "adapters_without_ids":
            kw.pop("adapter_ids")
        elif m == "adapter_ids_shape":
            kw["adapter_ids"] = wrong_shape(draw, aids)
        elif m == "adapter_ids_dtype":
            kw["adapter_ids"] = other_dtype(draw, aids, allowed=(np.int32, np.int64))
        elif m == "adapter_ids_range":
            aids[draw(st.integers(0, T - 1))] = draw(st.sampled_from([-2, 4, 2 ** 31 - 1, -(2 ** 31)]))
            kw["adapter_ids"] = aids
        elif m == "adapter_ids_empty_slot":
            aids[draw(st.integers(0, T - 1))] = draw(st.sampled_from([1, 2, 3]))
            kw["adapter_ids"] = aids
        elif m == "adapters_other_shape":
            other = make_layer(E, H, 32 if L.I == 16 else 16, gated, "bf16", "gate_first", seed=4)
            reg = fp4moe.AdapterRegistry(other.weights, num_slots=4)
            reg.load(0, random_adapter(np.random.default_rng(2), other, "peft_fused", 2), layout="peft_fused",
                     lora_alpha=2.0)
            kw["adapters"], allowed = reg, {"adapters"}
        else:  # adapter_ids_int64: converted to int32 (the registry may be new: compare with int32 ids)
            kw["adapter_ids"], same = aids.astype(np.int64), ("same_as", "adapter_ids", aids)
    elif m.startswith("delta"):
        N1 = L.N1
        d = np.zeros((T, k, N1), BF16)
        allowed = {"gate_up_lora_delta"}
        if m == "delta_shape":
            d = wrong_shape(draw, d)
        elif m == "delta_dtype":
            d = other_dtype(draw, d)
        else:
            same = "same"
        kw["gate_up_lora_delta"] = d
    elif m.startswith("act_out"):
        a = sentinel_like((T, k, L.I), BF16, 7)
        allowed = {"activation_out"}
        if m == "act_out_shape":
            a = wrong_shape(draw, a)
        elif m == "act_out_dtype":
            a = sentinel_like((T, k, L.I), draw(st.sampled_from([np.float32, np.float16, np.uint16])), 7)
        elif m == "act_out_readonly":
            a.setflags(write=False)
        else:
            n = max(T * H, T * k * L.I)
            buf = sentinel_like((n,), BF16, 9)
            kw["out"] = out = buf[: T * H].reshape(T, H)
            a = buf[: T * k * L.I].reshape(T, k, L.I)
        kw["activation_out"] = a
    elif m.startswith("out"):
        allowed = {"out"}
        if m == "out_dtype":
            o = sentinel_like((T, H), draw(st.sampled_from([np.float16, np.int16, np.uint16, np.int32])), 5)
        elif m == "out_shape":
            o = sentinel_like(wrong_shape(draw, out).shape, BF16, 5)
        elif m == "out_noncontig":
            o = noncontig(out)
        elif m == "out_readonly":
            o = out.copy()
            o.setflags(write=False)
        elif m == "out_is_x":
            o = x
            if not x.flags.writeable:
                x = x.copy()
                o = x
        elif m == "out_type":
            o = draw(st.sampled_from([out.tolist(), "out", 0]))
        else:  # out_f32: the fp32 sum, which rounds to the bf16 output
            o = sentinel_like((T, H), np.float32, 5)
            same = "f32"
        kw["out"] = out = o
    return m, x, kw, allowed, same
