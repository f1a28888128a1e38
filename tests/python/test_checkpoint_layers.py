"""What a loaded checkpoint layer means (issue 45): the A4 input scales under expert parallelism, the mode when
input scales are missing, exclusions in config.json, routing the config describes (or a refusal naming the key),
the router logits and the shared expert under EP, and inspect applying the checks of load. Checkpoints are written
by checkpoint_files.py; each test compares with the arrays they were written from or with the whole layer."""
from __future__ import annotations

import json

import numpy as np
import pytest

from fp4moe_under_test import import_fp4moe

ml_dtypes = pytest.importorskip("ml_dtypes")
pytest.importorskip("safetensors", reason="checkpoint reading needs the safetensors package")
from checkpoint_files import BF16, modelopt_model  # noqa: E402

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
