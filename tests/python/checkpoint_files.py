"""Small checkpoints written here in the real layouts (ModelOpt NVFP4 and MIXED_PRECISION, compressed-tensors
nvfp4-pack-quantized, bf16 fused GPT-OSS, MXFP4 GPT-OSS), with the arrays they were written from, for the checkpoint tests.
Imported by test modules after they have checked that ml_dtypes and safetensors are installed."""
from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

BF16 = np.dtype(ml_dtypes.bfloat16)
E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)


def write_checkpoint(d: Path, tensors: dict, *, shards: int = 1, config=None, hf_quant=None) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    names = list(tensors)
    if shards == 1:
        save_file({n: tensors[n] for n in names}, str(d / "model.safetensors"))
    else:
        wm = {}
        for i in range(shards):
            part = names[i::shards]
            fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
            save_file({n: tensors[n] for n in part}, str(d / fname))
            wm.update({n: fname for n in part})
        (d / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": int(sum(t.nbytes for t in tensors.values()))}, "weight_map": wm}))
    if config is not None:
        (d / "config.json").write_text(json.dumps(config))
    if hf_quant is not None:
        (d / "hf_quant_config.json").write_text(json.dumps(hf_quant))
    return d


def nvfp4_linear(rng, n: int, k: int):
    """Random NVFP4 tensors of an [n, k] weight: packed codes, e4m3 block scales, a positive global scale."""
    w = rng.integers(0, 256, (n, k // 2), dtype=np.uint8)
    s = rng.uniform(0.25, 8.0, (n, k // 16)).astype(np.float32).astype(E4M3)
    s2 = np.array(rng.uniform(0.001, 0.01), np.float32)
    return w, s, s2


def bf16(rng, *shape, scale=0.1):
    return (rng.standard_normal(shape) * scale).astype(np.float32).astype(BF16)


def decode(w, s, s2):
    """Hand decoding of one linear (SPEC §2): e2m1 * e4m3 * scale2, fp32."""
    codes = np.stack([w & 0xF, w >> 4], -1).reshape(w.shape[0], -1)
    return E2M1[codes] * np.repeat(s.astype(np.float32), 16, -1) * np.float32(s2)


def filler(rng, pre: str, H: int) -> dict:
    """Non-MoE tensors of a decoder layer (attention, norm), which the loader must leave unread."""
    return {pre + "self_attn.q_proj.weight": bf16(rng, H, H), pre + "input_layernorm.weight": bf16(rng, H)}


def modelopt_model(d: Path, *, layers=2, E=4, H=64, I=32, shards=1, a4=True, bf16_layers=(), arch="qwen3",
                   algo=None, seed=0):
    """A ModelOpt NVFP4 checkpoint (Qwen3-MoE names, or DeepSeek-V3 with shared experts and correction bias).
    Returns (dir, truth): truth[layer] = prepare_weights-style stacked arrays of the routed experts."""
    rng = np.random.default_rng(seed)
    t, truth = {"model.embed_tokens.weight": bf16(rng, 32, H), "lm_head.weight": bf16(rng, 32, H)}, {}
    excl = ["lm_head", "model.layers.*.mlp.gate", "*self_attn*"]
    for L in range(layers):
        pre = f"model.layers.{L}."
        t.update(filler(rng, pre, H))
        mb = pre + "mlp."
        t[mb + "gate.weight"] = bf16(rng, E, H)
        tr = {"w1": [], "w1_scale": [], "w1_scale2": [], "w2": [], "w2_scale": [], "w2_scale2": [], "in1": [],
              "in2": []}
        is_bf16 = L in bf16_layers
        if is_bf16:
            excl.append(f"{mb}experts.*")
        for e in range(E):
            eb = f"{mb}experts.{e}."
            if is_bf16:
                g, u, dn = bf16(rng, I, H), bf16(rng, I, H), bf16(rng, H, I)
                t[eb + "gate_proj.weight"], t[eb + "up_proj.weight"], t[eb + "down_proj.weight"] = g, u, dn
                tr["w1"].append(np.concatenate([g, u]))
                tr["w2"].append(dn)
                continue
            halves = []
            for proj, (n, k) in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I))):
                w, s, s2 = nvfp4_linear(rng, n, k)
                t[eb + proj + ".weight"], t[eb + proj + ".weight_scale"], t[eb + proj + ".weight_scale_2"] = w, s, s2
                if a4:
                    ins = np.array(rng.uniform(0.01, 0.05), np.float32)
                    t[eb + proj + ".input_scale"] = ins
                    tr["in2" if proj == "down_proj" else "in1"].append(float(ins))
                halves.append((w, s, s2))
            tr["w1"].append(np.concatenate([halves[0][0], halves[1][0]]))
            tr["w1_scale"].append(np.concatenate([halves[0][1], halves[1][1]]))
            tr["w1_scale2"].append([halves[0][2], halves[1][2]])
            tr["w2"].append(halves[2][0])
            tr["w2_scale"].append(halves[2][1])
            tr["w2_scale2"].append(halves[2][2])
        truth[L] = {k: np.array(v, dtype=np.float32 if k.endswith("scale2") else None) for k, v in tr.items()
                    if v and not k.startswith("in")}
        truth[L]["in1"], truth[L]["in2"] = tr["in1"], tr["in2"]
        truth[L]["router"] = t[mb + "gate.weight"]
        if arch == "deepseek":
            t[mb + "gate.e_score_correction_bias"] = rng.standard_normal(E).astype(np.float32)
            sb = mb + "shared_experts."
            sg, su, sd = bf16(rng, 2 * I, H), bf16(rng, 2 * I, H), bf16(rng, H, 2 * I)
            t[sb + "gate_proj.weight"], t[sb + "up_proj.weight"], t[sb + "down_proj.weight"] = sg, su, sd
            excl.append(f"{mb}shared_experts*")
            truth[L]["shared"] = {"w1": np.concatenate([sg, su])[None], "w2": sd[None]}
            truth[L]["correction_bias"] = t[mb + "gate.e_score_correction_bias"]
    if arch == "deepseek":
        config = {"model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"], "hidden_act": "silu",
                  "hidden_size": H, "moe_intermediate_size": I, "n_routed_experts": E, "num_experts_per_tok": 2,
                  "n_group": 2, "topk_group": 1, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid",
                  "topk_method": "noaux_tc", "n_shared_experts": 1, "num_hidden_layers": layers}
    else:
        config = {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "hidden_act": "silu",
                  "hidden_size": H, "moe_intermediate_size": I, "num_experts": E, "num_experts_per_tok": 2,
                  "norm_topk_prob": True, "num_hidden_layers": layers}
    algo = algo or ("NVFP4" if a4 else "W4A16_NVFP4")
    hq = {"producer": {"name": "modelopt", "version": "0.37.0"},
          "quantization": {"quant_algo": algo, "kv_cache_quant_algo": None, "group_size": 16,
                           "exclude_modules": excl}}
    if algo == "MIXED_PRECISION":
        ql = {}
        for L in range(layers):
            if L in bf16_layers:
                continue
            for e in range(E):
                for proj in ("gate_proj", "up_proj", "down_proj"):
                    ql[f"model.layers.{L}.mlp.experts.{e}.{proj}"] = {"quant_algo": "NVFP4", "group_size": 16}
        hq["quantization"] = {"quant_algo": "MIXED_PRECISION", "kv_cache_quant_algo": None, "quantized_layers": ql}
    return write_checkpoint(d, t, shards=shards, config=config, hf_quant=hq), truth


def ct_model(d: Path, *, layers=2, E=4, H=48, I=32, shards=1, a4=True, seed=1):
    """A compressed-tensors nvfp4-pack-quantized checkpoint with Mixtral names (w1 gate, w3 up, w2 down)."""
    rng = np.random.default_rng(seed)
    t, truth = {"model.embed_tokens.weight": bf16(rng, 32, H)}, {}
    for L in range(layers):
        pre = f"model.layers.{L}."
        t.update(filler(rng, pre, H))
        mb = pre + "block_sparse_moe."
        t[mb + "gate.weight"] = bf16(rng, E, H)
        tr = {k: [] for k in ("w1", "w1_scale", "w1_scale2", "w2", "w2_scale", "w2_scale2", "in1", "in2")}
        for e in range(E):
            eb = f"{mb}experts.{e}."
            parts = []
            for proj, (n, k) in (("w1", (I, H)), ("w3", (I, H)), ("w2", (H, I))):
                w, s, s2 = nvfp4_linear(rng, n, k)
                gs = np.array([np.float32(1) / s2], np.float32)  # the encode scale, shape [1]
                t[eb + proj + ".weight_packed"], t[eb + proj + ".weight_scale"] = w, s
                t[eb + proj + ".weight_global_scale"] = gs
                if a4:
                    igs = np.array([rng.uniform(20, 100)], np.float32)
                    t[eb + proj + ".input_global_scale"] = igs
                    tr["in2" if proj == "w2" else "in1"].append(float(np.float32(1) / igs[0]))
                parts.append((w, s, np.float32(1) / gs[0]))
            tr["w1"].append(np.concatenate([parts[0][0], parts[1][0]]))
            tr["w1_scale"].append(np.concatenate([parts[0][1], parts[1][1]]))
            tr["w1_scale2"].append([parts[0][2], parts[1][2]])
            tr["w2"].append(parts[2][0])
            tr["w2_scale"].append(parts[2][1])
            tr["w2_scale2"].append(parts[2][2])
        truth[L] = {k: np.array(v, dtype=np.float32 if k.endswith("scale2") else None) for k, v in tr.items()
                    if not k.startswith("in")}
        truth[L]["in1"], truth[L]["in2"] = tr["in1"], tr["in2"]
    wq = {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16, "symmetric": True,
          "dynamic": False, "observer": "minmax"}
    group = {"targets": ["Linear"], "weights": wq, "format": "nvfp4-pack-quantized",
             "input_activations": dict(wq, dynamic="local") if a4 else None}
    config = {"model_type": "mixtral", "architectures": ["MixtralForCausalLM"], "hidden_act": "silu",
              "hidden_size": H, "intermediate_size": I, "num_local_experts": E, "num_experts_per_tok": 2,
              "quantization_config": {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized",
                                      "config_groups": {"group_0": group},
                                      "ignore": ["lm_head", "re:.*block_sparse_moe.gate$", "re:.*self_attn.*"]}}
    return write_checkpoint(d, t, shards=shards, config=config), truth


def gpt_oss_model(d: Path, *, layers=1, E=4, H=32, I=16, seed=2):
    rng = np.random.default_rng(seed)
    t, truth = {}, {}
    for L in range(layers):
        mb = f"model.layers.{L}.mlp."
        gu, dn = bf16(rng, E, H, 2 * I), bf16(rng, E, I, H)
        b1, b2 = bf16(rng, E, 2 * I), bf16(rng, E, H)
        t.update({mb + "experts.gate_up_proj": gu, mb + "experts.gate_up_proj_bias": b1,
                  mb + "experts.down_proj": dn, mb + "experts.down_proj_bias": b2,
                  mb + "router.weight": bf16(rng, E, H), mb + "router.bias": bf16(rng, E)})
        w1 = np.concatenate([gu[:, :, 0::2], gu[:, :, 1::2]], axis=2).transpose(0, 2, 1)  # gate rows, then up
        bias1 = np.concatenate([b1[:, 0::2], b1[:, 1::2]], axis=1).astype(np.float32)
        truth[L] = {"w1": w1, "w2": dn.transpose(0, 2, 1), "bias1": bias1, "bias2": b2.astype(np.float32)}
    config = {"model_type": "gpt_oss", "num_local_experts": E, "experts_per_token": 2, "num_experts_per_tok": 2,
              "hidden_size": H, "intermediate_size": I, "swiglu_limit": 7.0, "hidden_act": "silu"}
    return write_checkpoint(d, t, config=config), truth


def mxfp4_decode(blocks, scales):
    """float64 [..., n, k] of MXFP4 blocks U8 [..., n, k/32, 16] (element 2i in the low nibble) and E8M0 scales."""
    codes = np.stack([blocks & 15, blocks >> 4], axis=-1).reshape(*blocks.shape[:-1], 32)
    vals = E2M1.astype(np.float64)[codes] * np.exp2(scales.astype(np.float64) - 127)[..., None]
    return vals.reshape(*blocks.shape[:-2], -1)


def mxfp4_tensor(rng, E: int, n: int, k: int, e_lo: int = 118, e_hi: int = 124):
    """Random MXFP4 tensors in gpt-oss's layout: blocks U8 [E, n, k/32, 16] (element 2i in the low nibble), E8M0
    scales U8 [E, n, k/32], and the values they decode to (float64 [E, n, k])."""
    blocks = rng.integers(0, 256, (E, n, k // 32, 16), dtype=np.uint8)
    scales = rng.integers(e_lo, e_hi + 1, (E, n, k // 32), dtype=np.uint8)
    return blocks, scales, mxfp4_decode(blocks, scales)


# gpt-oss's release quantization config (the router, attention, embeddings and head stay bf16).
MXFP4_QUANT_CONFIG = {"quant_method": "mxfp4",
                      "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                 "model.embed_tokens", "lm_head"]}


def gpt_oss_mxfp4_layer(L: int, b1, s1, bias1, b2, s2, bias2, router_w, router_b) -> dict:
    """Layer L's MoE tensors in gpt-oss's release layout: gate_up blocks, scales and bias with the rows as given
    (interleaved in the release: gate j at row 2j, up j at 2j+1), down the same, the router weight and bias."""
    mb = f"model.layers.{L}.mlp."
    return {mb + "experts.gate_up_proj_blocks": b1, mb + "experts.gate_up_proj_scales": s1,
            mb + "experts.gate_up_proj_bias": bias1, mb + "experts.down_proj_blocks": b2,
            mb + "experts.down_proj_scales": s2, mb + "experts.down_proj_bias": bias2,
            mb + "router.weight": router_w, mb + "router.bias": router_b}


def gpt_oss_mxfp4_model(d: Path, *, layers=1, E=4, H=64, I=64, seed=3, swiglu_limit=7.0):
    """gpt-oss's release layout: quantization_config.quant_method "mxfp4", mlp.experts.{gate_up,down}_proj_{blocks,
    scales,bias} with gate and up rows interleaved (gate j at row 2j, up j at 2j+1), router weight and bias. truth[L]:
    w1 [E, 2I, H] (gate rows first) and w2 [E, H, I] decoded in float64, and the prepare_mxfp4_weights arrays."""
    rng = np.random.default_rng(seed)
    t, truth = {}, {}
    for L in range(layers):
        b1, s1, v1 = mxfp4_tensor(rng, E, 2 * I, H)
        b2, s2, v2 = mxfp4_tensor(rng, E, H, I)
        bias1, bias2 = bf16(rng, E, 2 * I), bf16(rng, E, H)
        t.update(gpt_oss_mxfp4_layer(L, b1, s1, bias1, b2, s2, bias2, bf16(rng, E, H), bf16(rng, E)))
        order = np.concatenate([np.arange(0, 2 * I, 2), np.arange(1, 2 * I, 2)])  # gate rows, then up
        truth[L] = {"w1": v1[:, order], "w2": v2, "bias1": bias1[:, order].astype(np.float32),
                    "bias2": bias2.astype(np.float32),
                    "prepared": {"w1": b1[:, order].reshape(E, 2 * I, H // 2), "w1_scale": s1[:, order],
                                 "w2": b2.reshape(E, H, I // 2), "w2_scale": s2}}
    config = {"model_type": "gpt_oss", "num_local_experts": E, "experts_per_token": 2, "num_experts_per_tok": 2,
              "hidden_size": H, "intermediate_size": I, "swiglu_limit": swiglu_limit, "hidden_act": "silu",
              "quantization_config": MXFP4_QUANT_CONFIG}
    return write_checkpoint(d, t, config=config), truth


def rewrite(d: Path, edit):
    """Loads the one shard, applies edit(dict) and writes it back (the config files stay)."""
    from safetensors import safe_open

    from fp4moe.checkpoint import _Shard
    p = d / "model.safetensors"
    t = {}
    with safe_open(str(p), framework="np") as f:
        for k in f.keys():
            dt = f.get_slice(k).get_dtype()
            if dt == "F8_E4M3":
                t[k] = _Shard(p).array(k, dt, tuple(f.get_slice(k).get_shape())).copy()
            else:
                t[k] = f.get_tensor(k)
    edit(t)
    save_file(t, str(p))

