"""The sigmoid-gated shared expert (SPEC §3.3, `shared_expert_gate`: y += sigmoid(x . g) * shared(x)) on the CPU
backend: fp4moe.moe against an independent float64 NumPy computation, bad gates refused naming the keyword, and
Qwen3-Next / Qwen2-MoE checkpoints (written here) loaded by fp4moe.checkpoint with the gate in moe_kwargs(), whole
layer and TP / EP parts, against the same float64 computation from the arrays they were written from."""
from __future__ import annotations

import math

import numpy as np
import pytest

pytest.importorskip("ml_dtypes", reason="ml_dtypes is needed for NumPy bfloat16")

from fp4moe_under_test import import_fp4moe  # noqa: E402
from numpy_moe import BF16, assert_close, decode_nvfp4, np_combine, np_expert_outputs, np_route  # noqa: E402

fp4moe = import_fp4moe()

E, H, I, Is, K, T = 8, 64, 32, 64, 2, 6


def sigmoid(z):
    return 1.0 / (1.0 + np.exp(-z))


def quantized(rng, n, inter):
    w1 = (rng.standard_normal((n, 2 * inter, H)) / math.sqrt(H)).astype(np.float32)
    w2 = (rng.standard_normal((n, H, inter)) / math.sqrt(inter)).astype(np.float32)
    return fp4moe.quantize_weights(w1, w2, gate_up_order="gate_first", activation="swiglu")


def np_layer(x, q, qs, gate, logits, method="RenormalizeNaive", k=K):
    """float64: the routed experts plus sigmoid(x . g) times the shared expert (from the decoded tensors)."""
    xd = x.astype(np.float64)
    o, _ = np_expert_outputs(xd, decode_nvfp4(q["w1"], q["w1_scale"]), q["w1_scale2"],
                             decode_nvfp4(q["w2"], q["w2_scale"]), q["w2_scale2"], "Swiglu")
    os_, _ = np_expert_outputs(xd, decode_nvfp4(qs["w1"], qs["w1_scale"]), qs["w1_scale2"],
                               decode_nvfp4(qs["w2"], qs["w2_scale"]), qs["w2_scale2"], "Swiglu")
    ids, rw = np_route(logits, method, k)
    g = np.asarray(gate).astype(np.float64).reshape(-1)
    return np_combine(o, ids, rw, o.shape[1]) + sigmoid(xd @ g)[:, None] * os_[:, 0]


@pytest.fixture(scope="module")
def layer():
    rng = np.random.default_rng(5)
    q, qs = quantized(rng, E, I), quantized(rng, 1, Is)
    w = fp4moe.prepare_weights(**q, gate_up_order="gate_first", activation="swiglu")
    ws = fp4moe.prepare_weights(**qs, gate_up_order="gate_first", activation="swiglu")
    x = rng.standard_normal((T, H)).astype(np.float32).astype(BF16)
    logits = rng.standard_normal((T, E)).astype(np.float32)
    gate = (rng.standard_normal((1, H)) * 0.3).astype(np.float32).astype(BF16)
    return dict(q=q, qs=qs, w=w, ws=ws, x=x, logits=logits, gate=gate)


def run(L, **kw):
    return fp4moe.moe(L["x"], L["w"], routing_logits=L["logits"], top_k=K, routing_method="RenormalizeNaive",
                      shared_expert=L["ws"], **kw)


def test_gated_shared_expert_matches_float64(layer):
    L = layer
    y = run(L, shared_expert_gate=L["gate"])
    ref = np_layer(L["x"], L["q"], L["qs"], L["gate"], L["logits"])
    assert_close(y, ref, "gated shared expert")
    # The gate matters: the weight-1 shared expert is far from it.
    ungated = run(L).astype(np.float64)
    assert np.abs(ungated - ref).max() > 0.2 * np.abs(ref).max()
    # [H] and [1, H] are the same gate, bit for bit.
    y1 = run(L, shared_expert_gate=L["gate"].reshape(-1))
    assert y1.view(np.uint16).tobytes() == y.view(np.uint16).tobytes()


def test_bad_gates_are_refused_naming_the_keyword(layer):
    L = layer
    out = np.full((T, H), 7.0, dtype=BF16)
    bad = {
        "float32": L["gate"].astype(np.float32),
        "wrong length": L["gate"][:, :H - 16],
        "two rows": np.concatenate([L["gate"], L["gate"]]),
        "nan": np.where(np.arange(H) == 3, np.float32("nan"), L["gate"].astype(np.float32)).astype(BF16),
        "inf": np.where(np.arange(H) == 5, np.float32("inf"), L["gate"].astype(np.float32)).astype(BF16),
        "strided": np.repeat(L["gate"], 2, axis=1)[:, ::2],
    }
    for what, g in bad.items():
        with pytest.raises(fp4moe.Fp4MoeError) as ei:
            run(L, shared_expert_gate=g, out=out)
        assert ei.value.argument == "shared_expert_gate", what
    with pytest.raises(fp4moe.Fp4MoeError) as ei:  # a gate without a shared expert
        fp4moe.moe(L["x"], L["w"], routing_logits=L["logits"], top_k=K, routing_method="RenormalizeNaive",
                   shared_expert_gate=L["gate"], out=out)
    assert ei.value.argument == "shared_expert_gate" and "shared expert" in str(ei.value)
    assert np.all(out.astype(np.float32) == 7.0), "out untouched"


# ---- checkpoints -------------------------------------------------------------------------------------------

pytest.importorskip("safetensors", reason="checkpoint reading needs the safetensors package")
from checkpoint_files import nvfp4_linear, write_checkpoint  # noqa: E402

ckpt = import_fp4moe("checkpoint")[1]


def gated_checkpoint(d, model_type="qwen3_next", gate_dtype=BF16, norm=None, seed=3, with_shared=True,
                     gate_shape=(1, H)):
    """One ModelOpt NVFP4 MoE layer with Qwen3-Next / Qwen2-MoE names: routed and shared experts NVFP4 (W4A16), the
    gate [1, H] in `gate_dtype`. Returns (dir, truth) with prepare_weights-style arrays and the gate as bf16."""
    rng = np.random.default_rng(seed)
    mb = "model.layers.0.mlp."
    t = {mb + "gate.weight": (rng.standard_normal((E, H)) * 0.1).astype(np.float32).astype(BF16)}

    def expert(prefix, inter):
        halves = []
        for proj, (n, k) in (("gate_proj", (inter, H)), ("up_proj", (inter, H)), ("down_proj", (H, inter))):
            w, s, s2 = nvfp4_linear(rng, n, k)
            t[prefix + proj + ".weight"], t[prefix + proj + ".weight_scale"] = w, s
            t[prefix + proj + ".weight_scale_2"] = s2
            halves.append((w, s, s2))
        (gw, gs, g2), (uw, us, u2), (dw, ds, d2) = halves
        return {"w1": np.concatenate([gw, uw]), "w1_scale": np.concatenate([gs, us]),
                "w1_scale2": np.array([g2, u2], np.float32), "w2": dw, "w2_scale": ds, "w2_scale2": np.float32(d2)}

    per = [expert(f"{mb}experts.{e}.", I) for e in range(E)]
    truth = {k: np.stack([p[k] for p in per]) for k in per[0]}
    if with_shared:
        s = expert(mb + "shared_expert.", Is)
        truth["shared"] = {k: np.asarray(v)[None] for k, v in s.items()}
    g = (rng.standard_normal((1, H)) * 0.3).astype(np.float32)
    t[mb + "shared_expert_gate.weight"] = np.ascontiguousarray(g.astype(gate_dtype).reshape(gate_shape))
    truth["gate"] = g.astype(gate_dtype).astype(np.float32).astype(BF16)
    truth["router"] = t[mb + "gate.weight"]
    config = {"model_type": model_type, "hidden_act": "silu", "hidden_size": H, "num_experts": E,
              "num_experts_per_tok": K, "moe_intermediate_size": I, "shared_expert_intermediate_size": Is}
    if norm is not None:
        config["norm_topk_prob"] = norm
    hq = {"producer": {"name": "modelopt"}, "quantization": {"quant_algo": "W4A16_NVFP4", "group_size": 16,
                                                             "exclude_modules": ["lm_head", "*mlp.gate",
                                                                                 "*shared_expert_gate"]}}
    return write_checkpoint(d, t, config=config, hf_quant=hq), truth


def run_layer(layer, x, out_dtype=np.float32):
    out = np.empty(x.shape, out_dtype)
    fp4moe.moe(x, layer.weights, routing_logits=layer.router_logits(x), out=out, num_threads=1,
               **layer.moe_kwargs())
    return out


def x_tokens(seed=7):
    return (np.random.default_rng(seed).standard_normal((T, H)) * 0.5).astype(np.float32).astype(BF16)


@pytest.mark.parametrize("gate_dtype", [BF16, np.float32, np.float16])
def test_qwen3_next_checkpoint_loads_the_gate_and_runs_the_layer(tmp_path, gate_dtype):
    d, tr = gated_checkpoint(tmp_path / "m", gate_dtype=gate_dtype)
    layer = ckpt.load_moe_layer(d, 0)
    assert layer.architecture == "Qwen3-Next"
    assert layer.router.routing_method == fp4moe.RoutingMethod.RenormalizeNaive  # norm_topk_prob defaults to true
    assert layer.shared_expert is not None and layer.shared_expert.inter == Is
    assert layer.shared_expert_gate.dtype == BF16 and layer.shared_expert_gate.shape == (1, H)
    assert layer.shared_expert_gate.view(np.uint16).tobytes() == tr["gate"].view(np.uint16).tobytes()
    kw = layer.moe_kwargs()
    assert kw["shared_expert_gate"] is layer.shared_expert_gate
    x = x_tokens()
    y = run_layer(layer, x, BF16)
    logits = x.astype(np.float32) @ tr["router"].astype(np.float32).T
    ref = np_layer(x, tr, tr["shared"], tr["gate"], logits)
    assert_close(y, ref, "qwen3_next layer")
    info = ckpt.format_inspect(ckpt.inspect_checkpoint(d))
    assert "sigmoid-gated" in info and "would load" in info


def test_qwen2_moe_routing_default_is_unnormalized(tmp_path):
    d, _ = gated_checkpoint(tmp_path / "a", model_type="qwen2_moe")
    layer = ckpt.load_moe_layer(d, 0)
    assert layer.architecture == "Qwen2-MoE"
    assert layer.router.routing_method == fp4moe.RoutingMethod.Default
    assert "shared_expert_gate" in layer.moe_kwargs()
    d2, _ = gated_checkpoint(tmp_path / "b", model_type="qwen2_moe", norm=True)
    assert ckpt.load_moe_layer(d2, 0).router.routing_method == fp4moe.RoutingMethod.RenormalizeNaive


def test_tp_and_ep_parts_sum_to_the_layer(tmp_path):
    d, tr = gated_checkpoint(tmp_path / "m")
    x = x_tokens(8)
    full = run_layer(ckpt.load_moe_layer(d, 0), x)
    for world in (2,):
        tp = [ckpt.load_moe_layer(d, 0, tp=(r, world)) for r in range(world)]
        for part in tp:  # the gate whole on every TP rank; the shared expert sharded
            assert part.shared_expert.inter == Is // world
            assert part.shared_expert_gate.view(np.uint16).tobytes() == tr["gate"].view(np.uint16).tobytes()
        y = sum(run_layer(p, x) for p in tp)
        assert np.linalg.norm(y - full) <= 1e-5 * np.linalg.norm(full)
        ep = [ckpt.load_moe_layer(d, 0, ep=(r, world)) for r in range(world)]
        assert [("shared_expert_gate" in p.moe_kwargs()) for p in ep] == [True, False]
        y = sum(run_layer(p, x) for p in ep)
        assert np.linalg.norm(y - full) <= 1e-5 * np.linalg.norm(full)


def test_bad_gates_in_files_are_refused_naming_the_tensor(tmp_path):
    name = "model.layers.0.mlp.shared_expert_gate.weight"
    d, _ = gated_checkpoint(tmp_path / "a", with_shared=False)
    with pytest.raises(fp4moe.Fp4MoeError, match="without a shared expert") as ei:
        ckpt.load_moe_layer(d, 0)
    assert name in str(ei.value) and "model.safetensors" in str(ei.value)
    for i, shape in enumerate([(2, H // 2), (H,)]):
        d, _ = gated_checkpoint(tmp_path / f"b{i}", gate_shape=shape)
        with pytest.raises(fp4moe.Fp4MoeError, match=r"\[1, 64\]") as ei:
            ckpt.load_moe_layer(d, 0)
        assert name in str(ei.value)
