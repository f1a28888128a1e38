"""Property-based tests (hypothesis) of the public Python API's bad calls: moe, prepare_weights,
prepare_bf16_weights, quantize_weights, AdapterRegistry, workspace_size and the enum names each raise
fp4moe.Fp4MoeError whose .argument is one of the call's parameters, never another exception type, never a crash,
and leave `out` (pre-filled with random bytes) and a registry as they were. Profiles and figures: test_fuzz_api.py.
"""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("hypothesis", reason="the fuzz tests need hypothesis (pip install hypothesis)")
pytest.importorskip("ml_dtypes", reason="ml_dtypes is needed for NumPy bfloat16")

from hypothesis import given, note  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from fuzz_support import BF16, E4M3, GATED, count_example, fp4moe, fuzz, same_bits  # noqa: E402
from fuzz_cases import DIMS, bf16_array, call_bad, good, make_layer, random_adapter  # noqa: E402
from fuzz_mutations import (BAD_INTS, BAD_NAMES, NOT_AN_INT, base_bad_case, moe_mutations, noncontig,  # noqa: E402
                            other_dtype, wrong_shape)


# ---- moe: bad calls ---------------------------------------------------------------------------------------------

@fuzz(8.0)
@given(case=base_bad_case(), data=st.data())
def test_moe_bad_argument_raises_named_error_and_leaves_out(case, data):
    """One bad argument of a valid moe call (dtype, shape, stride, type, range, enum name or int, optional argument
    present/absent/wrong) raises Fp4MoeError naming that argument, with out, activation_out and the inputs
    byte-identical; a legal variant (alias, int64 ids, scalar vs list, float32 out, ...) gives the base bits."""
    count_example("moe_bad")
    L, x, kw, out = case
    base = good(fp4moe.moe, x, L.weights, **{k: v for k, v in kw.items()})
    m, x2, kw2, allowed, same = moe_mutations(data.draw, L, x, kw, out)
    note(f"mutation {m}")
    weights = kw2.pop("_weights", L.weights)
    watch = [kw2.get("out"), kw2.get("activation_out"), x2 if isinstance(x2, np.ndarray) else None,
             kw2.get("routing_logits") if isinstance(kw2.get("routing_logits"), np.ndarray) else None]

    def accept(y):
        if same is None:
            raise AssertionError(f"mutation {m}: accepted a bad call")
        if same == "any":
            return
        if same == "f32":
            same_bits(np.asarray(y).astype(BF16), base, m)
        elif isinstance(same, tuple):
            kb = dict(kw2, out=None)
            kb[same[1]] = same[2]
            same_bits(np.asarray(y), good(fp4moe.moe, x, L.weights, **kb), m)
        else:
            same_bits(np.asarray(y), base, m)

    call_bad(fp4moe.moe, allowed, watch=watch, accept=accept, x=x2, weights=weights, **kw2)


# ---- prepare_weights / prepare_bf16_weights / quantize_weights: bad calls ------------------------------------

@st.composite
def prepare_case(draw):
    E, H, I = draw(st.integers(1, 4)), draw(DIMS), draw(DIMS)
    gated = draw(st.booleans())
    fmt = draw(st.sampled_from(["nvfp4", "bf16"]))
    L = make_layer(E, H, I, gated, fmt, "gate_first", bias=draw(st.booleans()), seed=6)
    return L


def moe_bits(weights, L, seed=0):
    rng = np.random.default_rng(seed)
    x = bf16_array(rng, (3, L.H))
    logits = rng.standard_normal((3, L.E)).astype(np.float32)
    return fp4moe.moe(x, weights, routing_logits=logits, top_k=1, routing_method="Renormalize",
                      activation="Swiglu" if L.gated else "Relu")


@fuzz(4.0)
@given(L=prepare_case(), data=st.data())
def test_prepare_bad_argument_raises_named_error(L, data):
    """One bad argument of prepare_weights / prepare_bf16_weights raises Fp4MoeError naming a parameter; legal
    variants (strided views, aliases of enum names, device='cpu') prepare the same weights (same moe bits)."""
    count_example("prepare_bad")
    draw = data.draw
    args = {k: v for k, v in L.args.items()}
    kw = dict(L.kw)
    fn = L.prepare
    nv = L.fmt == "nvfp4"
    tensors = [k for k, v in args.items() if v is not None] + ["bias1", "bias2"]
    m = draw(st.sampled_from(["tensor_dtype", "tensor_shape", "tensor_type", "tensor_noncontig", "scale_nan",
                              "scale2_value", "bias_nan", "order_missing", "order_bad", "order_alias",
                              "activation_bad", "gated_contradicts", "layout_bad", "device_bad", "device_cpu",
                              "experts_mismatch"]))
    name = draw(st.sampled_from(tensors))
    allowed, same = {name}, None
    derived = {"w1", "w1_scale", "w2", "w2_scale", "w1_scale2", "w2_scale2", "bias1", "bias2"}
    if m == "tensor_dtype":
        v = args.get(name)
        if v is None:
            v = np.zeros((L.E, L.N1 if name == "bias1" else L.H), np.float32)
        ok = {"w1_scale": (E4M3, np.uint8), "w2_scale": (E4M3, np.uint8), "bias1": (np.float32, BF16),
              "bias2": (np.float32, BF16), "w1": (np.uint8,) if nv else (BF16,), "w2": (np.uint8,) if nv else (BF16,)}
        args[name] = other_dtype(draw, v, allowed=ok.get(name, (np.float32,)))
    elif m == "tensor_shape":
        v = args.get(name)
        if v is None:
            v = np.zeros((L.E, L.N1 if name == "bias1" else L.H), np.float32)
        args[name] = wrong_shape(draw, v)
        allowed = derived & set(args)
        legal = {(L.E,), (L.E, 1)} | ({(L.E, 2)} if (name == "w1_scale2" and L.gated) else set())
        if name in ("w1_scale2", "w2_scale2") and tuple(args[name].shape) in legal:
            same = "any"  # another accepted layout of the global scales (its values differ)
    elif m == "tensor_type":
        args[name] = draw(st.sampled_from([[1, 2], "w", 1.0, object()]))
    elif m == "tensor_noncontig":
        v = args.get(name)
        if v is None:
            args[name] = noncontig(np.zeros((L.E, L.N1 if name == "bias1" else L.H), np.float32))
        else:
            args[name] = noncontig(v) if (np.asarray(v).ndim and np.asarray(v).shape[-1] > 1) else v
        same = "same"
    elif m == "scale_nan" and nv:
        name = draw(st.sampled_from(["w1_scale", "w2_scale"]))
        s = np.array(args[name]).view(np.uint8).copy()
        s.reshape(-1)[draw(st.integers(0, s.size - 1))] = draw(st.sampled_from([0x7F, 0xFF]))
        args[name], allowed = s.view(E4M3), {name}
    elif m == "scale2_value" and nv:
        name = draw(st.sampled_from(["w1_scale2", "w2_scale2"]))
        s = np.array(args[name], np.float32)
        s.reshape(-1)[draw(st.integers(0, s.size - 1))] = draw(st.sampled_from([0.0, -1.0, np.nan, np.inf]))
        args[name], allowed = s, {name}
    elif m == "bias_nan":
        name = draw(st.sampled_from(["bias1", "bias2"]))
        b = np.zeros((L.E, L.N1 if name == "bias1" else L.H), np.float32)
        b.reshape(-1)[draw(st.integers(0, b.size - 1))] = draw(st.sampled_from([np.nan, np.inf]))
        args[name], allowed = b, {name}
    elif m == "order_missing" and L.gated:
        kw["gate_up_order"], allowed = None, {"gate_up_order"}
    elif m == "order_bad":
        kw["gate_up_order"], allowed = draw(st.one_of(BAD_NAMES, BAD_INTS, st.just(2.0))), {"gate_up_order"}
    elif m == "order_alias":
        kw["gate_up_order"], same = draw(st.sampled_from(["GateFirst", "GATE_FIRST", "gate_up", 0,
                                                          fp4moe.GateUpOrder.GateFirst])), "same"
    elif m == "activation_bad":
        kw["activation"], allowed = draw(st.one_of(BAD_NAMES, BAD_INTS)), {"activation"}
    elif m == "gated_contradicts":
        kw["activation"], allowed = ("Relu" if L.gated else "Swiglu"), {"gated"}
    elif m == "layout_bad" and nv:
        kw["scale_layout"], allowed = draw(st.one_of(BAD_NAMES, BAD_INTS)), {"scale_layout"}
    elif m == "device_bad":
        kw["device"] = draw(st.sampled_from(["gpu", "cuda:x", "cuda:-1", 1.5, "tpu", "cuda:99", 99, object()]))
        allowed = {"device"}
    elif m == "device_cpu":
        kw["device"], same = draw(st.sampled_from(["cpu", "CPU", " cpu "])), "same"
    elif m == "experts_mismatch":
        name = draw(st.sampled_from([k for k, v in args.items() if v is not None and k != "w1"]))
        v = np.asarray(args[name])
        args[name] = np.concatenate([v, v[:1]], axis=0)
        allowed = {name}
    else:
        kw["gate_up_order"], allowed = "sideways", {"gate_up_order"}
    note(f"mutation {m} on {name}")
    watch = [v for v in args.values() if isinstance(v, np.ndarray)]
    ref_bits = moe_bits(L.weights, L)

    def accept(w):
        assert same is not None, f"{fn.__name__} accepted mutation {m} of {name}"
        if same == "same":
            same_bits(moe_bits(w, L), ref_bits, m)

    call_bad(fn, allowed, watch=watch, accept=accept, **args, **kw)


@fuzz(2.0)
@given(data=st.data())
def test_quantize_bad_argument_raises_named_error(data):
    """One bad argument of quantize_weights (non-float or non-finite weights, sizes not multiples of 16, mismatched
    experts, enum names) raises Fp4MoeError naming it; a strided view quantizes like its contiguous copy."""
    count_example("quantize_bad")
    draw = data.draw
    E, H, I = draw(st.integers(1, 3)), draw(DIMS), draw(DIMS)
    gated = draw(st.booleans())
    rng = np.random.default_rng(draw(st.integers(0, 1000)))
    args = dict(w1=rng.standard_normal((E, 2 * I if gated else I, H)).astype(np.float32),
                w2=rng.standard_normal((E, H, I)).astype(np.float32))
    kw = dict(gate_up_order="gate_first", gated=gated)
    m = draw(st.sampled_from(["dtype", "nonfinite", "size16", "ndim", "experts", "type", "format", "layout",
                              "order", "bias_nan", "bias_shape", "noncontig", "per_half_any"]))
    name = draw(st.sampled_from(["w1", "w2"]))
    allowed, same = {name}, None
    if m == "dtype":
        args[name] = args[name].astype(draw(st.sampled_from([np.int32, np.uint8, np.bool_, np.complex64])))
    elif m == "nonfinite":
        args[name].reshape(-1)[draw(st.integers(0, args[name].size - 1))] = draw(st.sampled_from([np.nan, np.inf]))
    elif m == "size16":
        cut = draw(st.integers(1, 15))
        if name == "w1":
            args["w1"], args["w2"] = args["w1"][..., :-cut], args["w2"][:, :-cut]
        else:
            args["w2"] = args["w2"][..., :-cut]
            args["w1"] = args["w1"][:, : (2 * (I - cut) if gated else I - cut)]
        allowed = {"w1", "w2"}
    elif m == "ndim":
        args[name] = args[name][0]
        allowed = {"w1", "w2"}
    elif m == "experts":
        args["w2"] = np.concatenate([args["w2"], args["w2"][:1]])
        allowed = {"w2"}
    elif m == "type":
        args[name] = draw(st.sampled_from([[[[1.0]]], "w", None, 3.0]))
    elif m in ("format", "layout", "order"):
        key = {"format": "format", "layout": "scale_layout", "order": "gate_up_order"}[m]
        kw[key], allowed = draw(st.one_of(BAD_NAMES, BAD_INTS, st.just(None) if key != "gate_up_order" or not gated
                                          else st.just(None))), {key}
        if kw[key] is None and (key != "gate_up_order" or not gated):
            kw[key] = "nope"
    elif m in ("bias_nan", "bias_shape"):
        name = draw(st.sampled_from(["bias1", "bias2"]))
        b = np.zeros((E, args["w1"].shape[1] if name == "bias1" else H), np.float32)
        if m == "bias_nan":
            b.reshape(-1)[0] = np.nan
        else:
            b = wrong_shape(draw, b)
        args[name], allowed = b, {name}
    elif m == "noncontig":
        args[name] = noncontig(args[name])
        same = "same"
    else:
        kw["per_half_scale2"], same = draw(st.sampled_from([1, "yes", None])), "any"
    ref = fp4moe.quantize_weights(**{k: np.ascontiguousarray(v) if isinstance(v, np.ndarray) and
                                     v.dtype == np.float32 else v for k, v in args.items()},
                                  **kw) if same == "same" else None

    def accept(q):
        assert same is not None, f"quantize_weights accepted mutation {m} of {name}"
        if ref is not None:
            for key in ref:
                same_bits(np.asarray(q[key]), np.asarray(ref[key]), f"{m}: {key}")

    call_bad(fp4moe.quantize_weights, allowed, watch=[v for v in args.values() if isinstance(v, np.ndarray)],
             accept=accept, **args, **kw)


# ---- AdapterRegistry ----------------------------------------------------------------------------------------------

LOAD_PARAMS = {"slot", "tensors", "layout", "rank", "lora_alpha", "use_rslora"}
ADAPTER_KEYS = {"a_gate", "a_up", "b_gate", "b_up", "a_gate_up", "b_gate_up", "a_down", "b_down", "shared_a_gate_up",
                "shared_b_gate_up", "shared_a_down", "shared_b_down"}


@fuzz(4.0)
@given(data=st.data())
def test_adapter_registry_bad_calls_leave_registry_as_it_was(data):
    """A bad AdapterRegistry(...), load(...) or unload(...) raises Fp4MoeError naming a parameter or a tensor key;
    after a failed load or unload the registry gives the same output bits as before."""
    count_example("registry_bad")
    draw = data.draw
    E, H, I = draw(st.integers(1, 4)), draw(st.sampled_from([16, 32])), draw(st.sampled_from([16, 32]))
    gated = draw(st.booleans())
    L = make_layer(E, H, I, gated, draw(st.sampled_from(["nvfp4", "bf16"])), "gate_first", seed=7)
    rng = np.random.default_rng(draw(st.integers(0, 1000)))
    where = draw(st.sampled_from(["ctor", "load", "unload"]))
    if where == "ctor":
        m = draw(st.sampled_from(["weights", "num_slots", "shared"]))
        kw = dict(weights=L.weights, num_slots=4)
        if m == "weights":
            kw["weights"] = draw(st.sampled_from([L.args, None, L.weights.native, "w"]))
        elif m == "num_slots":
            kw["num_slots"] = draw(st.sampled_from([0, -1, 10 ** 6, 2 ** 40, "4", 2.5, None]))
        else:
            kw["shared_expert"] = draw(st.sampled_from(
                [L.args, make_layer(1, 2 * H, 16, gated, "bf16", "gate_first", seed=3).weights,
                 make_layer(2, H, 16, gated, "bf16", "gate_first", seed=3).weights]))
            m = "shared_expert"
        call_bad(fp4moe.AdapterRegistry.__init__, {m}, extra_names=set(),
                 **dict(self=object.__new__(fp4moe.AdapterRegistry), **kw))
        return
    reg = fp4moe.AdapterRegistry(L.weights, num_slots=4)
    layout = draw(st.sampled_from(["per_expert", "peft_fused", "shared_outer"]))
    r = draw(st.sampled_from([2, 8]))
    t0 = random_adapter(rng, L, layout, r)
    reg.load(0, t0, layout=layout, lora_alpha=4.0)
    x = bf16_array(rng, (4, H))
    logits = rng.standard_normal((4, E)).astype(np.float32)
    run = lambda: fp4moe.moe(x, L.weights, routing_logits=logits, top_k=1, routing_method="TopK",
                             activation="Swiglu" if gated else "Relu", adapters=reg,
                             adapter_ids=np.array([0, -1, 0, 0], np.int32))
    before = run()
    if where == "unload":
        slot = draw(st.sampled_from([1, 3, 4, -1, 2 ** 31, "0", None, 0.5]))
        call_bad(reg.unload, {"slot"}, slot=slot)
        same_bits(run(), before, "after a failed unload")
        return
    t = dict(random_adapter(rng, L, layout, r))
    kw = dict(slot=0, layout=layout, lora_alpha=2.0)
    m = draw(st.sampled_from(["dtype", "shape", "missing_pair", "unknown_key", "wrong_layout_key", "slot", "layout",
                              "rank", "alpha", "tensors_type", "shared_without_expert", "type", "noncontig"]))
    key = draw(st.sampled_from(sorted(t)))
    allowed = {key}
    if m == "dtype":
        t[key] = other_dtype(draw, t[key], allowed=(BF16,))
    elif m == "shape":
        t[key] = wrong_shape(draw, t[key])
        allowed = set(t) | {"rank"}
    elif m == "missing_pair":
        partner = {"a": "b", "b": "a"}[key[0]] + key[1:]
        t.pop(key)
        allowed = {key, partner} | ({"a_gate", "a_up", "b_gate", "b_up"} if layout == "per_expert" else set())
        if not any(k.startswith("a_") for k in t):
            allowed |= {"rank"}
    elif m == "unknown_key":
        key = draw(st.sampled_from(["a_gateup", "lora_A", "A", "b_down_proj"]))
        t[key], allowed = t[sorted(t)[0]], {key}
    elif m == "wrong_layout_key":
        other = {"per_expert": "a_gate_up", "peft_fused": "a_gate", "shared_outer": "a_up"}[layout]
        t[other] = bf16_array(rng, (E, r, H))
        partner = "b" + other[1:]
        t[partner] = bf16_array(rng, (E, L.N1 if other == "a_gate_up" else I, r))
        allowed = {other, partner, "a_gate", "a_up", "b_gate", "b_up", "a_gate_up", "b_gate_up"}
    elif m == "slot":
        kw["slot"], allowed = draw(st.sampled_from([-1, 4, 2 ** 31, "0", None, 0.5])), {"slot"}
    elif m == "layout":
        kw["layout"], allowed = draw(st.one_of(BAD_NAMES, BAD_INTS)), {"layout"}
    elif m == "rank":
        kw["rank"], allowed = draw(st.sampled_from([0, -1, 65, r + 1, "2", 2.5])), {"rank"} | set(t)
    elif m == "alpha":
        kw["lora_alpha"], allowed = draw(st.sampled_from([None, np.nan, np.inf, "2", 1e39])), {"lora_alpha"}
    elif m == "tensors_type":
        t, allowed = draw(st.sampled_from([5, "a_down", [("a_down", 1)]])), {"tensors"}
    elif m == "shared_without_expert":
        t["shared_a_down"], t["shared_b_down"] = bf16_array(rng, (r, 16)), bf16_array(rng, (H, r))
        allowed = {"shared_a_down", "shared_b_down"}
    elif m == "type":
        t[key] = draw(st.sampled_from([[1.0], "a", 1.0, object()]))
        allowed = {key} | ({"rank"} if key.startswith("a") else set())
    else:  # a strided adapter tensor loads like its contiguous copy
        t[key] = noncontig(t[key])
        allowed = {key}
    note(f"load mutation {m} on {key}")

    def accept(_):
        assert m == "noncontig", f"load accepted mutation {m} of {key}"
        reg.load(1, {k: np.ascontiguousarray(v) for k, v in t.items()}, layout=layout, lora_alpha=2.0)
        ids1 = np.array([0, -1, 0, 0], np.int32)
        y0 = fp4moe.moe(x, L.weights, routing_logits=logits, top_k=1, routing_method="TopK",
                        activation="Swiglu" if gated else "Relu", adapters=reg, adapter_ids=ids1)
        y1 = fp4moe.moe(x, L.weights, routing_logits=logits, top_k=1, routing_method="TopK",
                        activation="Swiglu" if gated else "Relu", adapters=reg, adapter_ids=ids1 * 0 + 1)
        same_bits(y0[[0, 2, 3]], y1[[0, 2, 3]], "strided vs contiguous adapter")

    slot = kw.pop("slot")
    if isinstance(t, dict):
        e = call_bad(lambda slot, tensors, layout, lora_alpha, rank=None, use_rslora=False:
                     reg.load(slot, tensors, layout=layout, lora_alpha=lora_alpha, rank=rank, use_rslora=use_rslora),
                     allowed, extra_names=ADAPTER_KEYS | set(t),
                     watch=[v for v in t.values() if isinstance(v, np.ndarray)],
                     accept=accept, slot=slot, tensors=t, **kw)
    else:
        e = call_bad(lambda slot, tensors, layout, lora_alpha: reg.load(slot, tensors, layout=layout,
                                                                       lora_alpha=lora_alpha),
                     allowed, slot=slot, tensors=t, **kw)
    if e is not None:
        same_bits(run(), before, "after a failed load")


# ---- workspace_size, enums --------------------------------------------------------------------------------

@fuzz(1.0)
@given(data=st.data())
def test_workspace_size_checks_its_arguments(data):
    """workspace_size returns a non-negative int (0 on the CPU backend) that does not decrease with num_tokens, or
    raises Fp4MoeError naming a parameter for a bad enum name or a non-integer size."""
    count_example("workspace_size")
    L = make_layer(2, 32, 16, True, "nvfp4", "gate_first", seed=8)
    draw = data.draw
    T = draw(st.integers(0, 5000))
    good_kw = dict(activation=draw(st.sampled_from([None, "swiglu", 10, fp4moe.ActivationType.Situ])),
                   mode=draw(st.sampled_from(["a16", "w4a16", 0])))
    n0 = good(fp4moe.workspace_size, L.weights, T, 2, **good_kw)
    n1 = good(fp4moe.workspace_size, L.weights, T + draw(st.integers(0, 100)), 2, **good_kw)
    assert isinstance(n0, int) and 0 <= n0 <= n1
    if L.weights.device == "cpu":
        assert n0 == n1 == 0
    name = draw(st.sampled_from(["activation", "mode", "num_tokens", "top_k", "max_lora_rank", "workspace_budget",
                                 "n_group", "num_experts_total", "weights", "shared_expert"]))
    kw = dict(weights=L.weights, num_tokens=T, top_k=2)
    kw[name] = {"activation": draw(st.one_of(BAD_NAMES, BAD_INTS)), "mode": draw(st.one_of(BAD_NAMES, BAD_INTS)),
                "weights": draw(st.sampled_from([L.args, None, "w"])),
                "shared_expert": draw(st.sampled_from([L.args, "s", 1]))}.get(name, draw(NOT_AN_INT))
    if kw[name] is None and name not in ("weights",):
        kw[name] = "none"
    call_bad(fp4moe.workspace_size, {name}, **kw)


ENUM_CASES = [("routing_method", fp4moe.RoutingMethod), ("activation", fp4moe.ActivationType),
              ("mode", fp4moe.ActMode), ("precision", fp4moe._enums.Precision)]


def _norm(s):
    return s.replace("_", "").replace("-", "").lower()


@fuzz(2.0)
@given(data=st.data())
def test_moe_enum_arguments_parse_or_raise(data):
    """Any string or int given for moe's enum arguments either names a member (any case, with or without '_' or
    '-', or a documented alias) and gives that member's bits, or raises Fp4MoeError naming the argument."""
    count_example("enums")
    draw = data.draw
    L = make_layer(4, 16, 16, True, "bf16", "gate_first", seed=9)
    arg, cls = draw(st.sampled_from(ENUM_CASES))
    members = {m.name: m for m in cls}
    choice = draw(st.sampled_from(["name", "garbage", "int"]))
    if choice == "name":
        mem = draw(st.sampled_from(list(members)))
        v = "".join(draw(st.sampled_from([c.upper(), c.lower(), c + "_", "-" + c])) for c in mem)
    elif choice == "garbage":
        v = draw(st.text(alphabet="abcdefghijklmnopqrstuvwxyzAEIOU_- 0123456789", max_size=14))
    else:
        v = draw(st.integers(-3, 14))
    expect = None
    if isinstance(v, int):
        expect = cls(v) if v in [int(m) for m in cls] else None
    else:
        aliases = {"mode": fp4moe._enums.MODE_ALIASES, "precision": fp4moe._enums.PRECISION_ALIASES}.get(arg, {})
        for mem in cls:
            if _norm(mem.name) == _norm(v):
                expect = mem
        if _norm(v) in aliases:
            expect = cls(aliases[_norm(v)])
    defaults = dict(routing_method="Renormalize", activation="Swiglu", mode="a16", precision="fp32")
    if arg == "routing_method" and expect == fp4moe.RoutingMethod.Llama4:
        top_k = 1
    else:
        top_k = 2
    rng = np.random.default_rng(0)
    x, logits = bf16_array(rng, (3, 16)), rng.standard_normal((3, 4)).astype(np.float32)
    kw = dict(defaults, routing_logits=logits, top_k=top_k, fc1_input_scale=0.01, fc2_input_scale=0.01)
    bad_for_layer = expect is not None and arg == "activation" and expect.name not in GATED
    note(f"{arg}={v!r} -> {expect}")
    if expect is None or bad_for_layer:
        call_bad(fp4moe.moe, {arg}, x=x, weights=L.weights, **dict(kw, **{arg: v}))
        return
    y = good(fp4moe.moe, x, L.weights, **dict(kw, **{arg: v}))
    same_bits(y, good(fp4moe.moe, x, L.weights, **dict(kw, **{arg: expect})), f"{arg}={v!r}")
