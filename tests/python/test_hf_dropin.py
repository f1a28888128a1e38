"""fp4moe.hf: the drop-in for transformers 5's Qwen3-MoE / Mixtral sparse MoE blocks, with PEFT LoRA.

Runs examples/qwen3_moe_lora.py at a tiny size (fp4moe vs transformers + PEFT on the same decoded NVFP4 weights),
plus: block-level agreement with transformers' own block, the LoRA delta's effect, a mixed batch of two adapters
equal to each adapter run alone (bit for bit), a saved PEFT adapter read by the C++ reader equal to the live one,
Mixtral routing, and torch.compile of a swapped block. CPU backend (the tiny model runs in seconds); the same on
CUDA when a CUDA build and GPU are present. Skips without PyTorch, transformers >= 5 or peft.
"""
from __future__ import annotations

import sys

import pytest

torch = pytest.importorskip("torch", reason="needs PyTorch")
transformers = pytest.importorskip("transformers", reason="needs transformers >= 5")
peft = pytest.importorskip("peft", reason="needs peft")
if int(transformers.__version__.split(".")[0]) < 5:
    pytest.skip("needs transformers >= 5 (fused experts)", allow_module_level=True)

from fp4moe_under_test import REPO, import_fp4moe, torch_devices  # noqa: E402


fp4moe, _ = import_fp4moe("hf")
sys.path.insert(0, str(REPO / "examples"))
import qwen3_moe_lora as example  # noqa: E402
TINY = dict(hidden=64, inter=32, experts=4, top_k=2, layers=2, vocab=128, batch=2, seq=6, rank=4, alpha=8.0)


def _devices():
    return torch_devices(fp4moe, torch)


def _tiny_peft(seed=0, dtype=torch.float32, adapters=("default",)):
    model, _ = example.build_model(TINY["hidden"], TINY["inter"], TINY["experts"], TINY["top_k"], TINY["layers"],
                                   TINY["vocab"], dtype, seed)
    pm = example.attach_lora(model, TINY["rank"], TINY["alpha"], seed + 1)
    for i, name in enumerate(adapters[1:]):
        cfg = peft.LoraConfig(r=TINY["rank"], lora_alpha=TINY["alpha"] * (i + 2), target_modules=[],
                              target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
        pm.add_adapter(name, cfg)
        g = torch.Generator().manual_seed(100 + i)
        with torch.no_grad():
            for n, p in pm.named_parameters():
                if f"lora_A.{name}." in n or f"lora_B.{name}." in n:
                    p.copy_((torch.randn(p.shape, generator=g) * 0.05).to(p.dtype))
    return pm.eval()


def _ids(seed=2):
    return torch.randint(0, TINY["vocab"], (TINY["batch"], TINY["seq"]), generator=torch.Generator().manual_seed(seed))


def _needs_cuda_lora(device):
    """The CUDA backend may not run registry LoRA yet: skip (saying so) rather than fail on that."""
    if device != "cuda":
        return
    try:
        pm = _tiny_peft().to(device)
        with torch.no_grad():
            swap = fp4moe.hf.swap_moe_blocks(pm)
            pm(input_ids=_ids().to(device))
        swap.restore()
    except fp4moe.Fp4MoeError as e:
        if e.code == fp4moe.ErrorCode.Unsupported:
            pytest.skip(f"CUDA backend: {e}")
        raise


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_example_end_to_end(device, dtype):
    _needs_cuda_lora(device)
    diff, scale, blocks = example.run(**TINY, dtype=dtype, device=device, verbose=False)
    assert blocks == TINY["layers"]
    assert scale > 0.1
    # bf16 rounds every intermediate in transformers; fp32 leaves x's rounding to bf16 and PEFT's merged delta
    assert diff <= (0.03 if dtype == "bfloat16" else 0.01) * scale, (diff, scale)


def test_example_main_exit_code():
    assert example.main(["--hidden", "64", "--inter", "32", "--experts", "4", "--vocab", "128", "--seq", "4"]) == 0


def test_lora_is_applied_and_base_matches_disabled_adapter():
    pm = _tiny_peft()
    ids = _ids()
    with torch.no_grad():
        with pm.disable_adapter():
            hf_base = pm(input_ids=ids).logits
        swap = fp4moe.hf.swap_moe_blocks(pm, quantize=False)
        ours_lora = pm(input_ids=ids).logits
        fp4moe.hf.set_active_adapter(pm, None)
        ours_base = pm(input_ids=ids).logits
        swap.restore()
        hf_lora = pm(input_ids=ids).logits
    lora_effect = (hf_lora - hf_base).abs().max().item()
    assert lora_effect > 0.05
    assert (ours_lora - hf_lora).abs().max().item() < 0.1 * lora_effect
    assert (ours_base - hf_base).abs().max().item() < 0.1 * lora_effect


def test_block_matches_transformers_block_bf16_weights():
    """One swapped block against transformers' block on the same hidden states (bf16 expert weights)."""
    pm = _tiny_peft()
    with torch.no_grad():
        block = pm.base_model.model.model.layers[0].mlp
        h = torch.randn(3, 5, TINY["hidden"], generator=torch.Generator().manual_seed(4))
        swap = fp4moe.hf.swap_moe_blocks(pm, quantize=False, adapters=None)
        ours = pm.base_model.model.model.layers[0].mlp(h)
        swap.restore()
        experts = block.experts
        while hasattr(experts, "base_layer"):
            experts = experts.base_layer
        with pm.disable_adapter():
            ref_model_out = block(h)
    assert ours.shape == h.shape and ours.dtype == h.dtype
    # transformers' fp32 block with bf16-representable weights; ours rounds x and y to bf16
    err = (ours - ref_model_out).abs().max().item()
    assert err <= 0.02 * ref_model_out.abs().max().item() + 1e-6, err


def test_mixed_batch_two_adapters_bit_identical_to_single_runs():
    """Per-sequence adapters in one batch equal each sequence run alone with its adapter (SPEC §4, block level:
    the rest of the transformers model is not batch invariant on its own)."""
    pm = _tiny_peft(adapters=("default", "second"))
    h = torch.randn(2, TINY["seq"], TINY["hidden"], generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        swap = fp4moe.hf.swap_moe_blocks(pm)
        block = next(iter(swap.blocks.values()))
        assert set(block.adapter_slots) == {"default", "second"}
        fp4moe.hf.set_adapter_ids(pm, ["second", None])
        mixed = block(h)
        fp4moe.hf.set_adapter_ids(pm, None)
        fp4moe.hf.set_active_adapter(pm, "second")
        only_second = block(h[:1])
        fp4moe.hf.set_active_adapter(pm, None)
        only_base = block(h[1:])
        fp4moe.hf.set_active_adapter(pm, "default")
        first = block(h[:1])
    assert torch.equal(mixed[0], only_second[0])
    assert torch.equal(mixed[1], only_base[0])
    assert not torch.equal(first[0], only_second[0])


def test_saved_peft_adapter_via_cpp_reader(tmp_path):
    pm = _tiny_peft()
    pm.save_pretrained(str(tmp_path))
    prefixes = fp4moe.list_peft_expert_modules(str(tmp_path))
    assert len(prefixes) == TINY["layers"] and all(p.endswith("mlp.") for p in prefixes)
    with torch.no_grad():
        swap = fp4moe.hf.swap_moe_blocks(pm)
        name0 = sorted(swap.blocks)[0]
        block = swap.blocks[name0]
        h = torch.randn(7, TINY["hidden"], generator=torch.Generator().manual_seed(5)).unsqueeze(0)
        live = block(h)
        prefix = next(p for p in prefixes if p.endswith(f"layers.{name0.split('layers.')[1].split('.')[0]}.mlp."))
        block.adapters.load_peft(0, str(tmp_path), prefix)  # replace slot 0 with the file's adapter
        from_file = block(h)
    assert torch.equal(live, from_file)


def test_mixtral_block():
    cfg = transformers.MixtralConfig(vocab_size=128, hidden_size=64, intermediate_size=32, num_hidden_layers=1,
                                     num_attention_heads=2, num_key_value_heads=1, head_dim=32, num_local_experts=4,
                                     num_experts_per_tok=2, max_position_embeddings=64, initializer_range=0.1)
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(cfg).eval()
    ids = _ids()
    with torch.no_grad():
        ref = model(input_ids=ids).logits
        swap = fp4moe.hf.swap_moe_blocks(model, quantize=False)
        blk = next(iter(swap.blocks.values()))
        assert blk.routing_method == int(fp4moe.RoutingMethod.Renormalize)
        ours = model(input_ids=ids).logits
    assert (ours - ref).abs().max().item() <= 0.02 * ref.abs().max().item()


def test_compiled_block_equals_eager():
    pm = _tiny_peft()
    with torch.no_grad():
        swap = fp4moe.hf.swap_moe_blocks(pm)
        block = next(iter(swap.blocks.values()))
        h = torch.randn(2, 5, TINY["hidden"], generator=torch.Generator().manual_seed(8))
        eager = block(h)
        torch._dynamo.reset()
        compiled = torch.compile(block, backend="aot_eager", fullgraph=True)
        assert torch.equal(compiled(h), eager)


def test_refuses_model_without_moe_blocks():
    with pytest.raises(fp4moe.Fp4MoeError) as ei:
        fp4moe.hf.swap_moe_blocks(torch.nn.Linear(4, 4))
    assert ei.value.argument == "model"


@pytest.mark.parametrize("arch", ["qwen3_next", "qwen2_moe"])
@pytest.mark.parametrize("quantize", [False, True])
def test_gated_shared_expert_block(arch, quantize):
    """A Qwen3-Next / Qwen2-MoE block (routed experts + shared expert scaled by sigmoid(shared_expert_gate(x))) swapped
    and run by the fused op, against transformers' own block."""
    if arch == "qwen3_next":
        mod = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
        cfg = transformers.Qwen3NextConfig(hidden_size=64, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                                           num_experts=4, num_experts_per_tok=2, norm_topk_prob=True)
        block = mod.Qwen3NextSparseMoeBlock(cfg)
    else:
        mod = pytest.importorskip("transformers.models.qwen2_moe.modeling_qwen2_moe")
        cfg = transformers.Qwen2MoeConfig(hidden_size=64, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                                          num_experts=4, num_experts_per_tok=2, norm_topk_prob=False)
        block = mod.Qwen2MoeSparseMoeBlock(cfg)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():  # bf16-representable weights, so that only the op's roundings differ
        for p in block.parameters():
            p.copy_((torch.randn(p.shape, generator=g) * 0.2).to(torch.bfloat16).float())
    model = torch.nn.ModuleDict({"layers": torch.nn.ModuleList([torch.nn.ModuleDict({"mlp": block})])}).eval()
    h = torch.randn(2, 5, 64, generator=g).to(torch.bfloat16).float()
    with torch.no_grad():
        swap = fp4moe.hf.swap_moe_blocks(model, quantize=quantize, write_back=quantize)
        new = swap.blocks["layers.0.mlp"]
        assert new.shared_expert is not None and tuple(new.shared_expert_gate.shape) == (1, 64)
        ours = new(h)
        swap.restore()
        ref = block(h)  # with write_back: the decoded NVFP4 weights
        shared = block.shared_expert(h.reshape(-1, 64)).reshape(h.shape)
    err = (ours - ref).abs().max().item()
    assert err <= 0.03 * ref.abs().max().item() + 1e-6, err
    # The gate matters: the shared expert with weight 1 is farther than the tolerance.
    gate_effect = (shared * (1 - torch.sigmoid(block.shared_expert_gate(h)))).abs().max().item()
    assert gate_effect > 5 * err
