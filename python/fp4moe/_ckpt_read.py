"""Reading a planned layer into the stacked arrays of prepare_weights: TP rows, EP experts, progress
(fp4moe.checkpoint)."""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import Optional

import numpy as np

from ._ckpt_files import BF16, E4M3, error
from ._ckpt_plan import _activation_of, _ExpertsPlan, _LayerPlan, _plan_layer, _routing_of
from ._enums import is_gated


# ---- reading ----------------------------------------------------------------------------------------------

def _window(E: int, ep) -> tuple[int, int]:
    if ep is None:
        return 0, E
    rank, world = (int(v) for v in ep)
    if world < 1 or not 0 <= rank < world or world > E:
        raise error("ep", f"expected (rank, world) with 0 <= rank < world <= E={E}, got {tuple(ep)}")
    base, extra = divmod(E, world)
    return rank * base + min(rank, extra), base + (1 if rank < extra else 0)


def _tp_slices(I: int, tp, block: int = 16) -> tuple[int, int]:
    if tp is None:
        return 0, I
    rank, world = (int(v) for v in tp)
    if world < 1 or not 0 <= rank < world:
        raise error("tp", f"expected (rank, world) with 0 <= rank < world, got {tuple(tp)}")
    if I % world or (I // world) % block:
        raise error("tp", f"I={I} split over world={world} must give a multiple of {block} per rank")
    Is = I // world
    return rank * Is, Is


class _Progress:
    def __init__(self, total: int, enabled, label: str):
        self.total, self.done, self.label = max(int(total), 1), 0, label
        self.cb = enabled if callable(enabled) else None
        if enabled is None:  # automatic: a bar on a terminal for loads above 256 MiB
            enabled = total > (256 << 20) and sys.stderr.isatty()
        self.bar = bool(enabled) and self.cb is None
        self.t0 = time.perf_counter()

    def add(self, n: int) -> None:
        self.done += int(n)
        if self.cb is not None:
            self.cb(self.done, self.total)
        elif self.bar:
            f = min(self.done / self.total, 1.0)
            sys.stderr.write(f"\r{self.label} [{'#' * int(30 * f):<30}] {100 * f:5.1f}% "
                             f"{self.done / 2**20:.0f}/{self.total / 2**20:.0f} MiB")
            if self.done >= self.total:
                sys.stderr.write(f" {time.perf_counter() - self.t0:.1f} s\n")
            sys.stderr.flush()


def _read_nvfp4(plan: _ExpertsPlan, experts: list, t0: int, ts: int, prog: _Progress) -> dict:
    """Stacked prepare_weights arguments of `experts` (lists of (gate, up, down) linears), TP rows [t0, t0+ts)."""
    E, H, I = len(experts), plan.H, plan.I
    n1 = 2 * ts if plan.gated else ts
    w1 = np.empty((E, n1, H // 2), np.uint8)
    s1 = np.empty((E, n1, H // 16), E4M3)
    w2 = np.empty((E, H, ts // 2), np.uint8)
    s2 = np.empty((E, H, ts // 16), E4M3)
    g1 = np.empty((E, 2) if plan.gated else (E,), np.float32)
    g2 = np.empty((E,), np.float32)
    rows = slice(t0, t0 + ts)
    for i, (gate, up, down) in enumerate(experts):
        halves = [gate, up] if plan.gated else [gate]
        for h, lin in enumerate(halves):
            w1[i, h * ts:(h + 1) * ts] = lin.weight.read((rows,))
            s1[i, h * ts:(h + 1) * ts] = lin.scale.read((rows,))
            v = lin.read_scale2()
            if plan.gated:
                g1[i, h] = v
            else:
                g1[i] = v
        w2[i] = down.weight.read((slice(None), slice(t0 // 2, (t0 + ts) // 2)))
        s2[i] = down.scale.read((slice(None), slice(t0 // 16, (t0 + ts) // 16)))
        g2[i] = down.read_scale2()
        prog.add(sum(l.nbytes for l in (gate, up, down) if l is not None) * ts // I)
    return {"w1": w1, "w1_scale": s1, "w1_scale2": g1, "w2": w2, "w2_scale": s2, "w2_scale2": g2}


def _fused_rows(plan: _ExpertsPlan, t0: int, ts: int) -> np.ndarray:
    """The rows of a fused gate_up tensor that make this rank's W1, gate rows first: gpt-oss interleaves the halves
    (gate j at row 2j, up j at 2j+1), gpt_oss_blocked and transformers 5 keep them in blocks."""
    I = plan.I
    if not plan.gated:
        return np.arange(t0, t0 + ts)
    if plan.fused_layout == "gpt_oss_interleaved":
        gate_rows, up_rows = np.arange(0, 2 * I, 2), np.arange(1, 2 * I, 2)
    else:
        gate_rows, up_rows = np.arange(I), np.arange(I, 2 * I)
    return np.concatenate([gate_rows[t0:t0 + ts], up_rows[t0:t0 + ts]])


def _read_biases(f: dict, es: slice, sel: np.ndarray, rank0: bool, out: dict) -> dict:
    if f["bias1"] is not None:
        out["bias1"] = np.ascontiguousarray(f["bias1"].read((es,)).astype(np.float32)[:, sel])
    if f["bias2"] is not None and rank0:
        out["bias2"] = np.ascontiguousarray(f["bias2"].read((es,)).astype(np.float32))
    return out


def _read_mxfp4(plan: _ExpertsPlan, e0: int, ne: int, t0: int, ts: int, rank0: bool, prog: _Progress) -> dict:
    """prepare_mxfp4_weights arguments of experts [e0, e0+ne), TP rows [t0, t0+ts) (whole blocks of 32): the
    codes and E8M0 scales as they are in the file, rows reordered gate first, W2's columns cut at block edges."""
    f, H = plan.fused, plan.H
    es = slice(e0, e0 + ne)
    sel = _fused_rows(plan, t0, ts)
    cols = slice(t0 // 32, (t0 + ts) // 32)
    out = {"w1": np.ascontiguousarray(f["w1"].read((es,))[:, sel].reshape(ne, len(sel), H // 2)),
           "w1_scale": np.ascontiguousarray(f["w1_scale"].read((es,))[:, sel]),
           "w2": np.ascontiguousarray(f["w2"].read((es, slice(None), cols)).reshape(ne, H, ts // 2)),
           "w2_scale": np.ascontiguousarray(f["w2_scale"].read((es, slice(None), cols)))}
    prog.add(plan.nbytes * ne * ts // max(plan.E * plan.I, 1))
    return _read_biases(f, es, sel, rank0, out)


def _a4_scales(quant, plan: _ExpertsPlan) -> tuple[str, Optional[str], float, float]:
    """(mode, why not A4 or None, fc1_input_scale, fc2_input_scale) of a layer. The operator takes one per-tensor
    input scale per GEMM for all experts: the largest over every expert of the layer, as vLLM's and SGLang's NVFP4
    MoE loaders take it. An EP rank reads them all (a few bytes each), so that every rank quantizes the
    activations alike and the ranks' sum is the layer's output. A4 only when every expert carries its input
    scales; otherwise A16 (the default on Hopper), and the reason says which tensor is missing."""
    lins = [l for e in plan.experts for l in e if l is not None]
    in1 = [l.read_input_scale() for e in plan.experts for l in e[:2] if l is not None and l.input_scale is not None]
    in2 = [e[2].read_input_scale() for e in plan.experts if e[2].input_scale is not None]
    fc1, fc2 = (float(max(in1)) if in1 else 0.0), (float(max(in2)) if in2 else 0.0)
    missing = [l.input_name for l in lins if l.fmt == "nvfp4" and l.input_scale is None]
    if plan.fmt == "mxfp4":
        return "a16", "MXFP4 experts run in A16 (SPEC §2)", fc1, fc2
    if plan.fmt != "nvfp4":
        return "a16", "the experts are not quantized", fc1, fc2
    if not quant.a4:
        return "a16", f"{quant.describe()} does not quantize activations", fc1, fc2
    if missing:
        return "a16", (f"tensor '{missing[0]}' is missing ({len(missing)} of the layer's {len(lins)} expert linears "
                       f"have no input scale): A4 needs every expert's"), fc1, fc2
    return "a4", None, fc1, fc2


def _to_bf16(a: np.ndarray) -> np.ndarray:
    return a if a.dtype == BF16 else a.astype(np.float32).astype(BF16)


def _read_bf16(plan: _ExpertsPlan, experts: list, e0: int, ne: int, t0: int, ts: int, rank0: bool,
               prog: _Progress) -> dict:
    H, I = plan.H, plan.I
    n1 = 2 * ts if plan.gated else ts
    if plan.fused is not None:
        f = plan.fused
        es = slice(e0, e0 + ne)
        if plan.fused_layout.startswith("gpt_oss"):
            gu = f["gate_up"].read((es,)).transpose(0, 2, 1)  # [E, 2I, H] in the file's column order
            dn = f["down"].read((es,)).transpose(0, 2, 1)
        else:
            gu = f["gate_up"].read((es,))
            dn = f["down"].read((es,))
        sel = _fused_rows(plan, t0, ts)
        out = _read_biases(f, es, sel, rank0, {"w1": np.ascontiguousarray(_to_bf16(gu[:, sel])),
                                               "w2": np.ascontiguousarray(_to_bf16(dn[:, :, t0:t0 + ts]))})
        prog.add(plan.nbytes * ne * ts // max(plan.E * I, 1))
        return out
    E = len(experts)
    w1 = np.empty((E, n1, H), BF16)
    w2 = np.empty((E, H, ts), BF16)
    rows = slice(t0, t0 + ts)
    for i, (gate, up, down) in enumerate(experts):
        for h, lin in enumerate([gate, up] if plan.gated else [gate]):
            w1[i, h * ts:(h + 1) * ts] = _to_bf16(lin.weight.read((rows,)))
        w2[i] = _to_bf16(down.weight.read((slice(None), rows)))
        prog.add(sum(l.nbytes for l in (gate, up, down) if l is not None) * ts // I)
    return {"w1": w1, "w2": w2}


@dataclass
class _Checked:
    """A layer that passed every check of _check_layer, and what the checks found."""
    plan: _LayerPlan
    activation: tuple             # (type, alpha, beta, clamp_limit)
    routing: dict
    mode: str
    mode_reason: Optional[str]
    fc1_input_scale: float
    fc2_input_scale: float


def _check_layer(ck, layer: int, activation, fused_layout, shared_expert: bool = True) -> _Checked:
    """Every check load_moe_layer makes before it reads the weights, and all that inspect runs: the config
    (activation, routing), the tensors' headers (the layer plan) and every scalar scale of the layer (weight_scale_2
    and the input scales of all its experts and of the shared expert, a few bytes each, so that every EP rank
    refuses the same layers). Preparing the weights then checks their block scales (no NaN code) and biases."""
    act = _activation_of(ck, activation)
    plan = _plan_layer(ck, int(layer), is_gated(act[0]), fused_layout)
    routing = _routing_of(ck, int(layer), plan.routed.E)
    for p in (plan.routed, plan.shared if shared_expert else None):
        for lin in (l for e in (p.experts if p else []) for l in e if l is not None and l.fmt == "nvfp4"):
            lin.read_scale2()
    mode, why, fc1, fc2 = _a4_scales(ck.quant, plan.routed)
    return _Checked(plan, act, routing, mode, why, fc1, fc2)
