"""What a loaded checkpoint layer means (issue 45): the A4 input scales under expert parallelism, the mode when
input scales are missing, exclusions in config.json, routing the config describes (or a refusal naming the key),
the router logits and the shared expert under EP, and inspect applying the checks of load. Checkpoints are written
by checkpoint_files.py; each test compares with the arrays they were written from or with the whole layer."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from fp4moe_under_test import REPO, import_fp4moe

ml_dtypes = pytest.importorskip("ml_dtypes")
pytest.importorskip("safetensors", reason="checkpoint reading needs the safetensors package")
from checkpoint_files import BF16, gpt_oss_model, modelopt_model, rewrite  # noqa: E402

fp4moe, ckpt = import_fp4moe("checkpoint")
Fp4MoeError = fp4moe.Fp4MoeError


def tokens(T: int, H: int, seed: int = 7):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((T, H)) * 0.5).astype(np.float32).astype(BF16)


def run_fp32(layer, x, logits, **kw):
    """The layer through the CPU operator as its moe_kwargs say, into an fp32 output (the unrounded combine)."""
    out = np.empty((x.shape[0], x.shape[1]), np.float32)
    fp4moe.moe(x, layer.weights, routing_logits=logits, out=out, num_threads=1, **{**layer.moe_kwargs(), **kw})
    return out


def rel_l2(a, b) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


# ---- 1. expert parallelism in A4 ------------------------------------------------------------------------------

def test_ep_a4_input_scales_are_the_whole_layers(tmp_path):
    E, world = 6, 3
    d, truth = modelopt_model(tmp_path / "m", layers=1, E=E)
    in1, in2 = truth[0]["in1"], truth[0]["in2"]  # in1: gate and up of each expert in turn; in2: down
    whole = (max(in1), max(in2))
    x = tokens(8, 64)
    logits = np.random.default_rng(3).standard_normal((8, E)).astype(np.float32)
    full = ckpt.load_moe_layer(d, 0)
    assert full.mode == "a4" and (full.fc1_input_scale, full.fc2_input_scale) == whole
    y_full = run_fp32(full, x, logits)
    own, y_sum = set(), np.zeros_like(y_full)
    for rank in range(world):
        part = ckpt.load_moe_layer(d, 0, ep=(rank, world))
        e0, ne = part.local_expert_offset, part.num_local_experts
        own.add((max(in1[2 * e0:2 * (e0 + ne)]), max(in2[e0:e0 + ne])))
        assert part.mode == "a4"
        assert (part.fc1_input_scale, part.fc2_input_scale) == whole, f"rank {rank}"
        y_sum += run_fp32(part, x, logits)
    assert len(own) > 1  # the ranks' own maxima differ, so the test tells the two rules apart
    assert rel_l2(y_sum, y_full) < 1e-6  # the same quantized activations on every rank: the sum is the layer


# ---- 2. an expert without an input scale ----------------------------------------------------------------------

@pytest.mark.parametrize("algo", ["NVFP4", "MIXED_PRECISION"])
def test_expert_without_input_scale_loads_a16_and_says_why(tmp_path, algo):
    d, truth = modelopt_model(tmp_path / "m", layers=1, algo=algo)
    gone = "model.layers.0.mlp.experts.2.up_proj.input_scale"  # an expert calibration never reached
    rewrite(d, lambda t: t.pop(gone))
    layer = ckpt.load_moe_layer(d, 0)
    assert layer.mode == "a16" and gone in layer.mode_reason
    kw = layer.moe_kwargs()
    assert kw["mode"] == "a16" and "fc1_input_scale" not in kw
    direct = fp4moe.prepare_weights(**{k: truth[0][k] for k in ("w1", "w1_scale", "w1_scale2", "w2", "w2_scale",
                                                                "w2_scale2")}, gate_up_order="gate_first",
                                    activation="swiglu")
    x = tokens(5, 64)
    logits = np.random.default_rng(4).standard_normal((5, 4)).astype(np.float32)
    y = fp4moe.moe(x, layer.weights, routing_logits=logits, num_threads=1, **kw)
    y_direct = fp4moe.moe(x, direct, routing_logits=logits, num_threads=1, **kw)
    np.testing.assert_array_equal(y.view(np.uint16), y_direct.view(np.uint16))
    with pytest.raises(Fp4MoeError, match=gone.replace(".", r"\.")) as ei:
        layer.moe_kwargs(mode="a4")
    assert ei.value.argument == "mode"
    row = ckpt.inspect_checkpoint(d)["layers"][0]
    assert row["load"] and row["mode"] == "a16" and gone in row["mode_reason"]
    assert f"mode a16 ({row['mode_reason']})" in ckpt.format_inspect(ckpt.inspect_checkpoint(d))


# ---- 3. a ModelOpt config only in config.json ------------------------------------------------------------------

def modelopt_in_config_json(d, ignore: list):
    """Moves the ModelOpt config into config.json's quantization_config, in the spelling ModelOpt's HF export and
    vLLM use there (flat, with "ignore" for exclude_modules)."""
    hq = json.loads((d / "hf_quant_config.json").read_text())["quantization"]
    (d / "hf_quant_config.json").unlink()
    cfg = json.loads((d / "config.json").read_text())
    fp4 = {"num_bits": 4, "type": "float", "group_size": 16, "dynamic": False}
    cfg["quantization_config"] = {"quant_method": "modelopt", "quant_algo": hq["quant_algo"], "kv_cache_scheme": None,
                                  "producer": {"name": "modelopt", "version": "0.39.0"}, "ignore": ignore,
                                  "config_groups": {"group_0": {"weights": fp4, "input_activations": fp4,
                                                                "targets": ["Linear"]}}}
    (d / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("pattern", ["model.layers.1.mlp.experts*", "model.layers.1.mlp.experts", "model.layers.1*"])
def test_config_json_ignore_excludes_experts(tmp_path, pattern):
    """'ignore' in config.json is read; an entry names a module or one that holds it, and ModelOpt's 'path*' is the
    module at path and what it holds, as vLLM reads it (so 'model.layers.1*' leaves layer 10 quantized)."""
    layers = 11 if pattern == "model.layers.1*" else 2
    d, truth = modelopt_model(tmp_path / "m", layers=layers, E=2, H=32, I=16, bf16_layers=(1,))
    modelopt_in_config_json(d, ["lm_head", "model.layers.*.mlp.gate", "*self_attn*", pattern])
    got = ckpt.read_moe_layer(d, 1)
    assert got["format"] == "bf16" and got["quantization"] == "modelopt NVFP4 (W4A4)"
    np.testing.assert_array_equal(got["routed"]["w1"].view(np.uint16), truth[1]["w1"].view(np.uint16))
    for L in {0, layers - 1} - {1}:  # layer 10 too when the pattern is 'model.layers.1*'
        other = ckpt.read_moe_layer(d, L)
        assert other["format"] == "nvfp4" and other["mode"] == "a4"
        np.testing.assert_array_equal(other["routed"]["w1"], truth[L]["w1"])
    assert all(r["load"] for r in ckpt.inspect_checkpoint(d)["layers"])


# ---- 4. routing the config describes ---------------------------------------------------------------------------

def set_config(d, **changes):
    cfg = json.loads((d / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (d / "config.json").write_text(json.dumps(cfg))


def deepseek_style_router(logits, bias, k, rsf, norm=True):
    """transformers' DeepSeek-V3 / GLM-4-MoE router with one expert group, in fp32: sigmoid scores, top-k of
    score + e_score_correction_bias (ties to the lower id), weights = the chosen scores (/ their sum when
    norm_topk_prob) * routed_scaling_factor."""
    s = (1.0 / (1.0 + np.exp(-logits.astype(np.float64)))).astype(np.float32)
    ids = np.argsort(-(s + bias.astype(np.float32)), axis=1, kind="stable")[:, :k].astype(np.int32)
    w = np.take_along_axis(s, ids, axis=1)
    if norm:
        w = w / (w.sum(axis=1, keepdims=True) + np.float32(1e-20))
    return ids, (w * np.float32(rsf)).astype(np.float32)


def test_glm4_moe_routes_as_deepseek_with_its_scaling_factor(tmp_path):
    d, truth = modelopt_model(tmp_path / "m", layers=1, arch="deepseek")
    set_config(d, model_type="glm4_moe", architectures=["Glm4MoeForCausalLM"], n_group=1, topk_group=1,
               routed_scaling_factor=2.5, norm_topk_prob=True, first_k_dense_replace=0)
    layer = ckpt.load_moe_layer(d, 0)
    r = layer.router
    assert (r.routing_method, r.n_group, r.topk_group, r.routed_scaling_factor, r.top_k) == \
        (fp4moe.RoutingMethod.DeepSeekV3, 1, 1, 2.5, 2)
    x = tokens(9, 64)
    logits = x.astype(np.float32) @ r.weight.astype(np.float32).T
    y = run_fp32(layer, x, logits, mode="a16")  # moe(**layer.moe_kwargs()) runs
    ids, w = deepseek_style_router(logits, r.e_score_correction_bias, 2, 2.5)
    kw = layer.moe_kwargs(mode="a16")
    del kw["routing_bias"]
    ref = np.empty_like(y)
    fp4moe.moe(x, layer.weights, topk_ids=ids, topk_weights=w, out=ref, num_threads=1, **kw)
    assert rel_l2(y, ref) < 1e-5


@pytest.mark.parametrize("model_type", ["deepseek_v3", "glm4_moe"])
def test_unnormalized_deepseek_style_routing_is_refused_naming_the_key(tmp_path, model_type):
    d, _ = modelopt_model(tmp_path / "m", layers=1, arch="deepseek")
    set_config(d, model_type=model_type, norm_topk_prob=False)
    with pytest.raises(Fp4MoeError, match=r"config\.json: norm_topk_prob false") as ei:
        ckpt.load_moe_layer(d, 0)
    assert ei.value.code == fp4moe.ErrorCode.Unsupported
    row = ckpt.inspect_checkpoint(d)["layers"][0]
    assert not row["load"] and "norm_topk_prob" in row["reason"]


@pytest.mark.parametrize("change, key", [({"model_type": "olmoe"}, "model_type"),
                                         ({"num_experts_per_tok": None}, "num_experts_per_tok"),
                                         ({"num_experts_per_tok": 5}, "num_experts_per_tok"),
                                         ({"n_group": 3}, "n_group"),
                                         ({"topk_group": 3}, "topk_group")])
def test_routing_the_operator_would_refuse_is_refused_at_load(tmp_path, change, key):
    """moe(**layer.moe_kwargs()) never fails after a load: what it would refuse is refused at load, naming the key."""
    d, _ = modelopt_model(tmp_path / "m", layers=1, arch="deepseek")  # E=4, n_group=2, topk_group=1, top_k=2
    set_config(d, **change)
    with pytest.raises(Fp4MoeError, match=rf"config\.json: {key}\b"):
        ckpt.load_moe_layer(d, 0)


def test_routing_defaults_are_transformers(tmp_path):
    """Keys a config leaves out take the model's transformers defaults: Qwen3-MoE does not renormalize
    (norm_topk_prob False) and DeepSeek-V3 scales by 2.5 in 8 groups (here 4 experts: the group keys are given)."""
    d, _ = modelopt_model(tmp_path / "q", layers=1)
    set_config(d, norm_topk_prob=None)
    assert ckpt.load_moe_layer(d, 0).router.routing_method == fp4moe.RoutingMethod.Default
    d, _ = modelopt_model(tmp_path / "d", layers=1, arch="deepseek")
    set_config(d, routed_scaling_factor=None)
    assert ckpt.load_moe_layer(d, 0).router.routed_scaling_factor == 2.5


# ---- 5. smaller ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("activation", [None, "swiglu"])
def test_missing_config_json_is_not_found_naming_it(tmp_path, activation):
    d, _ = modelopt_model(tmp_path / "m", layers=1)
    (d / "config.json").unlink()
    with pytest.raises(Fp4MoeError, match=r"config\.json: the file is missing") as ei:
        ckpt.load_moe_layer(d, 0, activation=activation)
    assert ei.value.code == fp4moe.ErrorCode.NotFound and ei.value.argument == "checkpoint"
    row = ckpt.inspect_checkpoint(d, activation=activation)["layers"][0]
    assert not row["load"] and "config.json: the file is missing" in row["reason"]


def test_mixed_nvfp4_and_bf16_experts_are_refused_naming_expert_and_tensor(tmp_path):
    d, _ = modelopt_model(tmp_path / "m", layers=1)
    rng = np.random.default_rng(8)
    odd = "model.layers.0.mlp.experts.3."

    def to_bf16(t):  # expert 3 left unquantized (excluded by the config below), the others NVFP4
        for proj, (n, k) in (("gate_proj", (32, 64)), ("up_proj", (32, 64)), ("down_proj", (64, 32))):
            for suffix in ("weight_scale", "weight_scale_2", "input_scale"):
                t.pop(odd + proj + "." + suffix)
            t[odd + proj + ".weight"] = (rng.standard_normal((n, k)) * 0.1).astype(np.float32).astype(BF16)

    rewrite(d, to_bf16)
    hq = json.loads((d / "hf_quant_config.json").read_text())
    hq["quantization"]["exclude_modules"].append("model.layers.0.mlp.experts.3*")
    (d / "hf_quant_config.json").write_text(json.dumps(hq))
    with pytest.raises(Fp4MoeError, match=rf"model\.safetensors: tensor '{odd}gate_proj\.weight' \(expert 3\) is BF16 "
                                          r"but .*experts\.0\.gate_proj\.weight' \(expert 0\) is NVFP4") as ei:
        ckpt.load_moe_layer(d, 0)
    assert ei.value.code == fp4moe.ErrorCode.InvalidArgument
    row = ckpt.inspect_checkpoint(d)["layers"][0]
    assert not row["load"] and f"'{odd}gate_proj.weight' (expert 3)" in row["reason"]


def test_inspect_runs_the_checks_of_load_and_exits_nonzero_on_a_refusal(tmp_path):
    d, _ = modelopt_model(tmp_path / "m", layers=2)
    zero = "model.layers.1.mlp.experts.2.down_proj.weight_scale_2"
    rewrite(d, lambda t: t.__setitem__(zero, np.array(0.0, np.float32)))
    with pytest.raises(Fp4MoeError, match=rf"tensor '{zero}': expected a finite positive scale, got 0\.0"):
        ckpt.load_moe_layer(d, 1)
    with pytest.raises(Fp4MoeError, match=zero):  # every EP rank refuses it, also one without expert 2
        ckpt.load_moe_layer(d, 1, ep=(0, 2))
    rows = ckpt.inspect_checkpoint(d)["layers"]
    assert rows[0]["load"] and not rows[1]["load"] and zero in rows[1]["reason"]
    assert rows[1]["format"] == "nvfp4"  # a refused layer is still described
    env = dict(os.environ, PYTHONPATH=str(REPO / "python"))
    run = lambda *a: subprocess.run([sys.executable, "-m", "fp4moe.checkpoint", "inspect", *map(str, a)],  # noqa: E731
                                    capture_output=True, text=True, env=env, timeout=60)
    out = run(d)
    assert out.returncode == 1 and "1 of 2 MoE layers would load" in out.stdout, out.stderr
    good, _ = modelopt_model(tmp_path / "g", layers=1)
    assert run(good).returncode == 0
    exe = Path(os.environ.get("FP4MOE_BUILD_DIR", REPO / "build")) / "fp4moe"
    if exe.exists():  # the C++ CLI the same way
        out = subprocess.run([str(exe), "inspect", str(d)], capture_output=True, text=True, timeout=60)
        assert out.returncode == 1 and zero in out.stdout, out.stdout + out.stderr
        assert subprocess.run([str(exe), "inspect", str(good)], capture_output=True, timeout=60).returncode == 0


def test_router_logits_include_the_router_bias(tmp_path):
    """layer.router_logits(hidden) is the model's router (GPT-OSS adds router.bias); the old recipe
    hidden @ layer.router.weight.T dropped the bias."""
    d, _ = gpt_oss_model(tmp_path / "g")
    layer = ckpt.load_moe_layer(d, 0)
    x = tokens(7, 32)
    W, b = layer.router.weight.astype(np.float64), layer.router.bias.astype(np.float64)
    ref = x.astype(np.float64) @ W.T + b
    got = layer.router_logits(x)
    assert got.dtype == np.float32 and got.shape == (7, 4)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)
    assert np.abs(ref - x.astype(np.float64) @ W.T).max() > 1e-3  # the bias matters here
    kw = layer.moe_kwargs()
    y = fp4moe.moe(x, layer.weights, routing_logits=got, num_threads=1, **kw)
    y_ref = fp4moe.moe(x, layer.weights, routing_logits=ref.astype(np.float32), num_threads=1, **kw)
    np.testing.assert_array_equal(y.view(np.uint16), y_ref.view(np.uint16))
    with pytest.raises(Fp4MoeError, match="hidden"):
        layer.router_logits(np.zeros((3, 16), np.float32))


def test_router_logits_of_torch_tensors(tmp_path):
    torch = pytest.importorskip("torch", reason="the torch path of router_logits needs PyTorch")
    d, _ = gpt_oss_model(tmp_path / "g")
    layer = ckpt.load_moe_layer(d, 0)
    x = tokens(7, 32)
    got = layer.router_logits(torch.from_numpy(x.astype(np.float32)).to(torch.bfloat16))
    assert isinstance(got, torch.Tensor) and got.dtype == torch.float32
    np.testing.assert_allclose(got.numpy(), layer.router_logits(x), rtol=1e-5, atol=1e-6)


def test_ep_ranks_sum_to_the_layer_with_the_shared_expert_once(tmp_path):
    """Under EP the shared expert is on rank 0 only (SPEC §8), so the sum of the ranks' moe outputs is the layer."""
    d, _ = modelopt_model(tmp_path / "m", layers=1, E=4, arch="deepseek")
    full = ckpt.load_moe_layer(d, 0)
    assert full.shared_expert is not None
    x = tokens(6, 64)
    logits = full.router_logits(x)
    y_full = run_fp32(full, x, logits)
    y_sum = np.zeros_like(y_full)
    for rank in range(2):
        part = ckpt.load_moe_layer(d, 0, ep=(rank, 2))
        assert (part.shared_expert is not None) == (rank == 0)
        assert ("shared_expert" in part.moe_kwargs()) == (rank == 0)
        y_sum += run_fp32(part, x, logits)
    assert rel_l2(y_sum, y_full) < 1e-6
