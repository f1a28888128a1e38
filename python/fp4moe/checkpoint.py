"""NVFP4 MoE layers read straight from real checkpoints (ModelOpt, compressed-tensors, bf16).

    import fp4moe
    layer = fp4moe.load_moe_layer("/models/Qwen3-30B-A3B-NVFP4", 3, device="cuda")
    y = fp4moe.moe(x, layer.weights, routing_logits=layer.router_logits(x), **layer.moe_kwargs())

A checkpoint is a directory with safetensors shards (one file, several files, or shards listed by
model.safetensors.index.json), config.json, and for ModelOpt exports hf_quant_config.json. The format is read
from those files, never guessed; docs/checkpoints.md lists what is recognized and what is refused.
Only the tensors of the layer asked for are read, memory-mapped through the `safetensors` package.

    python -m fp4moe.checkpoint inspect CHECKPOINT     # layers, formats, shapes, bytes, what would load (exit 1:
                                                       # a layer would be refused)
"""
from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from ._ckpt_files import ARG, Checkpoint, _Shard  # noqa: F401  (_Shard: for tests that rewrite shards)
from ._ckpt_plan import _activation_of, _model_type, _plan_layer, moe_layers
from ._ckpt_read import _check_layer, _Progress, _read_bf16, _read_mxfp4, _read_nvfp4, _to_bf16, _tp_slices, _window
from ._enums import ActivationType, RoutingMethod
from ._errors import error
from ._tensors import on_device

__all__ = ["Checkpoint", "MoeLayer", "Router", "load_moe_layer", "read_moe_layer", "inspect_checkpoint",
           "format_inspect"]


# ---- what load_moe_layer returns -----------------------------------------------------------------------------

@dataclass
class Router:
    """The router of an MoE layer and the routing that reproduces it (SPEC §3.1). weight [E, H] and bias [E]
    (added to the logits, GPT-OSS) are in the file's dtype; e_score_correction_bias [E] is the DeepSeek-V3
    selection bias (fp4moe's routing_bias)."""
    weight: Optional[np.ndarray]
    bias: Optional[np.ndarray]
    e_score_correction_bias: Optional[np.ndarray]
    routing_method: RoutingMethod  # a config whose routing no method reproduces is refused at load
    top_k: int
    num_experts: int
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0


@dataclass
class MoeLayer:
    """What load_moe_layer returns: the prepared weights of this rank and how to run them."""
    layer: int
    architecture: str
    format: str                   # "nvfp4" or "bf16" (the routed experts)
    quantization: str             # the checkpoint's quantization config, in words
    weights: object               # fp4moe.MoeWeights
    shared_expert: object         # fp4moe.MoeWeights or None
    router: Router
    activation: ActivationType
    gemm1_alpha: Optional[float]
    gemm1_beta: Optional[float]
    gemm1_clamp_limit: Optional[float]
    mode: str                     # "a4" when the config quantizes activations and every expert has input scales
    fc1_input_scale: float
    fc2_input_scale: float
    num_experts: int
    local_expert_offset: int
    num_local_experts: int
    bytes_read: int
    seconds: float
    mode_reason: Optional[str] = None  # why the layer runs A16 (None in A4): e.g. the expert missing an input scale
    # Qwen2-MoE / Qwen3-Next: the shared expert's sigmoid gate, bfloat16 [1, H] (host), or None.
    shared_expert_gate: Optional[np.ndarray] = None
    # device -> the router's (weight, bias) in fp32; ("routing_bias", *device) -> the routing bias there;
    # "gate:<device>" -> the shared expert's gate there
    _device_copies: dict = field(default_factory=dict, repr=False, compare=False)

    def router_logits(self, hidden):
        """The router logits [T, E] float32 of hidden states [T, H], as the model's router computes them:
        hidden @ router.weight.T + router.bias (GPT-OSS has a bias), in fp32. NumPy in, NumPy out; a torch tensor
        in, a torch tensor on its device out. Give them to fp4moe.moe(x, layer.weights, routing_logits=...)."""
        r = self.router
        if r.weight is None:
            raise error("router", f"layer {self.layer} of the checkpoint has no router weight")
        E, H = r.weight.shape
        if len(getattr(hidden, "shape", ())) != 2 or int(hidden.shape[1]) != H:
            raise error("hidden", f"expected hidden states [T, {H}], got shape {tuple(getattr(hidden, 'shape', ()))}")
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(hidden, torch.Tensor):
            as_t = lambda a: None if a is None else torch.from_numpy(a.astype(np.float32)).to(hidden.device)  # noqa: E731
            w, b = self._once(str(hidden.device), lambda: (as_t(r.weight), as_t(r.bias)))
            return torch.nn.functional.linear(hidden.float(), w, b)
        wt, b = self._once("np", lambda: (np.ascontiguousarray(r.weight.astype(np.float32).T),
                                          None if r.bias is None else r.bias.astype(np.float32)))
        out = np.asarray(hidden).astype(np.float32) @ wt
        return out if b is None else out + b

    def _once(self, key, make):
        """The cached value under key, made by make() on first use: each host array is copied to a device once."""
        if key not in self._device_copies:
            self._device_copies[key] = make()
        return self._device_copies[key]

    def _routing_bias(self):
        """e_score_correction_bias as float32 on the weights' device, where the operator reads it (a torch CUDA
        tensor for a layer loaded on a GPU), copied there once."""
        dev = tuple(getattr(self.weights, "_device", ("cpu", 0)))
        return self._once(("routing_bias",) + dev, lambda: on_device(
            np.asarray(self.router.e_score_correction_bias, dtype=np.float32), "routing_bias", dev,
            "the layer's routing bias"))

    def _gate_on(self, device: str):
        """The shared expert's gate on the weights' device: the host array, or (CUDA) a torch tensor made once."""
        if device == "cpu":
            return self.shared_expert_gate

        def to_device():
            import torch
            bits = np.ascontiguousarray(self.shared_expert_gate).view(np.int16)
            return torch.from_numpy(bits).view(torch.bfloat16).to(device)
        return self._once("gate:" + device, to_device)

    def moe_kwargs(self, mode: Optional[str] = None) -> dict:
        """Keyword arguments of fp4moe.moe for this layer, besides x, weights and the routing logits. mode: the
        checkpoint's (None) or "a16" (the default on Hopper; input scales then unused)."""
        r = self.router
        kw = {"top_k": r.top_k, "routing_method": r.routing_method, "n_group": r.n_group,
              "topk_group": r.topk_group, "routed_scaling_factor": r.routed_scaling_factor,
              "activation": self.activation, "num_experts_total": self.num_experts,
              "local_expert_offset": self.local_expert_offset}
        if r.e_score_correction_bias is not None:
            kw["routing_bias"] = self._routing_bias()
        for k in ("gemm1_alpha", "gemm1_beta", "gemm1_clamp_limit"):
            if getattr(self, k) is not None:
                kw[k] = getattr(self, k)
        if self.shared_expert is not None:
            kw["shared_expert"] = self.shared_expert
            if self.shared_expert_gate is not None:
                kw["shared_expert_gate"] = self._gate_on(self.shared_expert.device)
            if self.gemm1_alpha is not None or self.gemm1_beta is not None or self.gemm1_clamp_limit is not None:
                kw.update(shared_alpha=self.gemm1_alpha, shared_beta=self.gemm1_beta,
                          shared_clamp_limit=self.gemm1_clamp_limit)
        m = self.mode if mode is None else mode
        if m == "a4" and self.mode != "a4":
            raise error("mode", f"layer {self.layer} cannot run A4: {self.mode_reason}")
        kw["mode"] = m
        if m == "a4":
            kw.update(fc1_input_scale=self.fc1_input_scale, fc2_input_scale=self.fc2_input_scale)
        return kw


def read_moe_layer(checkpoint, layer: int, *, tp=None, ep=None, activation=None, fused_layout=None,
                   shared_expert: bool = True, progress=None) -> dict:
    """One MoE layer of a checkpoint as host NumPy arrays, before preparation (see load_moe_layer).

    Returns {"format": "nvfp4" | "mxfp4" | "bf16", "routed": prepare_weights (prepare_mxfp4_weights,
    prepare_bf16_weights) keyword arguments, "shared": the same for the shared expert or None,
    "shared_expert_gate": its sigmoid gate (bfloat16 [1, H], Qwen2-MoE / Qwen3-Next) or None, "router": Router,
    "activation": (type, alpha, beta, clamp_limit), "mode", "mode_reason" (why A16, None in A4), "fc1_input_scale",
    "fc2_input_scale", "architecture", "quantization", "num_experts", "local_expert_offset",
    "num_local_experts", "bytes_read", "seconds"}."""
    t_start = time.perf_counter()
    own = not isinstance(checkpoint, Checkpoint)
    ck = Checkpoint(checkpoint) if own else checkpoint
    try:
        c = _check_layer(ck, int(layer), activation, fused_layout, shared_expert)
        act, plan, routing = c.activation, c.plan, c.routing
        R = plan.routed
        e0, ne = _window(R.E, ep)
        t0, ts = _tp_slices(R.I, tp, 32 if R.fmt == "mxfp4" else 16)
        rank0 = tp is None or int(tp[0]) == 0
        sh_t = None
        if plan.shared is not None and shared_expert and (ep is None or int(ep[0]) == 0):  # EP: rank 0 (SPEC §8)
            sh_t = _tp_slices(plan.shared.I, tp)
        total = (R.nbytes * ne // R.E) * ts // R.I + (plan.shared.nbytes if sh_t else 0)
        prog = _Progress(total, progress, f"fp4moe: layer {layer}")
        local = R.experts[e0:e0 + ne]
        if R.fmt == "nvfp4":
            routed = _read_nvfp4(R, local, t0, ts, prog)
        elif R.fmt == "mxfp4":
            routed = _read_mxfp4(R, e0, ne, t0, ts, rank0, prog)
        else:
            routed = _read_bf16(R, local, e0, ne, t0, ts, rank0, prog)
        shared = gate = None
        if sh_t is not None:
            S = plan.shared
            shared = (_read_nvfp4(S, S.experts, sh_t[0], sh_t[1], prog) if S.fmt == "nvfp4"
                      else _read_bf16(S, S.experts, 0, 1, sh_t[0], sh_t[1], rank0, prog))
            if plan.shared_gate is not None:  # whole on every TP rank: x . g runs over the full H
                gate = _to_bf16(plan.shared_gate.read())
                total += plan.shared_gate.nbytes
        router = Router(plan.router_weight.read() if plan.router_weight else None,
                        plan.router_bias.read() if plan.router_bias else None,
                        plan.correction_bias.read() if plan.correction_bias else None, **routing)
        return {"format": R.fmt, "routed": routed, "shared": shared, "shared_expert_gate": gate, "router": router,
                "activation": act,
                "mode": c.mode, "mode_reason": c.mode_reason, "fc1_input_scale": c.fc1_input_scale,
                "fc2_input_scale": c.fc2_input_scale, "architecture": plan.architecture,
                "quantization": ck.quant.describe(), "num_experts": R.E, "local_expert_offset": e0,
                "num_local_experts": ne, "bytes_read": total, "seconds": time.perf_counter() - t_start}
    finally:
        if own:
            ck.close()


def load_moe_layer(checkpoint, layer: int, *, device="cpu", tp=None, ep=None, activation=None, fused_layout=None,
                   shared_expert: bool = True, progress=None) -> MoeLayer:
    """One MoE layer of a checkpoint, prepared for fp4moe.moe.

    checkpoint: a directory (safetensors shards, model.safetensors.index.json, config.json,
      hf_quant_config.json) or a fp4moe.checkpoint.Checkpoint. layer: the decoder layer index.
    tp=(rank, world): this rank's tensor-parallel shard (I/world intermediate rows, a multiple of 16);
    ep=(rank, world): this rank's experts (fp4moe.distributed.expert_window), and the shared expert on rank 0
      only (SPEC §8), so that the sum of the ranks' outputs counts it once. Only those bytes are read.
    activation: overrides the config's (an ActivationType, or {"type", "alpha", "beta", "clamp_limit"}).
    fused_layout: for fused expert tensors without a config that fixes it: 'gpt_oss_interleaved',
      'gpt_oss_blocked' or 'hf'. progress: None (a bar on a terminal for long loads), True, False, or a
      callable(done_bytes, total_bytes).
    Raises Fp4MoeError naming the file and the tensor for a missing, truncated or mistyped tensor, a
    mismatched shape or an unknown quantization config; nothing is prepared then."""
    from . import _api
    d = read_moe_layer(checkpoint, layer, tp=tp, ep=ep, activation=activation, fused_layout=fused_layout,
                       shared_expert=shared_expert, progress=progress)
    act, alpha, beta, clamp = d["activation"]

    def prep(kw):
        if d["format"] == "nvfp4":
            return _api.prepare_weights(**kw, gate_up_order="gate_first", activation=act, device=device)
        if d["format"] == "mxfp4":
            return _api.prepare_mxfp4_weights(**kw, gate_up_order="gate_first", activation=act, device=device)
        return _api.prepare_bf16_weights(**kw, gate_up_order="gate_first", activation=act, device=device)

    weights = prep(d["routed"])
    shared = None
    if d["shared"] is not None:
        fmt = "nvfp4" if "w1_scale" in d["shared"] else "bf16"
        shared = (_api.prepare_weights(**d["shared"], gate_up_order="gate_first", activation=act, device=device)
                  if fmt == "nvfp4" else
                  _api.prepare_bf16_weights(**d["shared"], gate_up_order="gate_first", activation=act, device=device))
    return MoeLayer(int(layer), d["architecture"], d["format"], d["quantization"], weights, shared, d["router"],
                    act, alpha, beta, clamp, d["mode"], d["fc1_input_scale"], d["fc2_input_scale"],
                    d["num_experts"], d["local_expert_offset"], d["num_local_experts"], d["bytes_read"],
                    d["seconds"], d["mode_reason"], d["shared_expert_gate"])


# ---- inspect ------------------------------------------------------------------------------------------------

def inspect_checkpoint(checkpoint, *, activation=None, fused_layout=None) -> dict:
    """What a checkpoint holds and what load_moe_layer would do with each MoE layer: the checks of load run on each
    (headers, config, every scalar scale of the layer; no weight data is read)."""
    ck = Checkpoint(checkpoint) if not isinstance(checkpoint, Checkpoint) else checkpoint
    files = sorted(set(ck._where.values()))
    out = {"path": str(ck.path), "files": files, "index": ck.index is not None, "tensors": len(ck.names),
           "bytes": sum(os.path.getsize(ck.path / f) for f in files if (ck.path / f).exists()),
           "model_type": _model_type(ck) or None, "quantization": ck.quant.describe(), "layers": []}
    try:
        out["activation"] = _activation_of(ck, activation)[0].name
    except Exception as e:  # each layer is refused for it below
        out["activation"] = f"unknown ({e})"
    for L in moe_layers(ck):
        row = {"layer": L}
        try:
            c = _check_layer(ck, L, activation, fused_layout)  # the checks of load_moe_layer
        except Exception as e:  # inspect reports what load_moe_layer would refuse, it does not raise
            row.update(load=False, reason=str(e).removeprefix(f"argument '{ARG}': "))
            try:  # and describes the layer as far as its tensors go
                row.update(_describe(_plan_layer(ck, L, True, fused_layout)))
            except Exception:
                pass
        else:
            row.update(_describe(c.plan), routing=c.routing["routing_method"].name, top_k=c.routing["top_k"],
                       mode=c.mode, mode_reason=c.mode_reason, load=True)
        out["layers"].append(row)
    return out


def _describe(p) -> dict:
    R = p.routed
    return dict(architecture=p.architecture, format=R.fmt, experts=R.E, H=R.H, I=R.I, bytes=p.nbytes,
                shared=None if p.shared is None else f"{p.shared.fmt} I={p.shared.I}" + (
                    ", sigmoid-gated" if p.shared_gate is not None else ""),
                router=p.router_weight is not None, correction_bias=p.correction_bias is not None)


def format_inspect(info: dict) -> str:
    lines = [f"checkpoint {info['path']}",
             f"  files: {len(info['files'])} safetensors{' (model.safetensors.index.json)' if info['index'] else ''}"
             f", {info['tensors']} tensors, {info['bytes']:,} bytes",
             f"  model_type: {info['model_type']}; quantization: {info['quantization']}; "
             f"activation: {info['activation']}",
             f"  MoE layers: {len(info['layers'])}"]
    for r in info["layers"]:
        if "format" in r:
            lines.append(f"  layer {r['layer']:3d}: {r['architecture']}, {r['format']}, E={r['experts']} H={r['H']} "
                         f"I={r['I']}, {r['bytes']:,} bytes, shared expert: {r['shared'] or 'none'}, router: "
                         f"{'yes' if r['router'] else 'no'}{' + e_score_correction_bias' if r['correction_bias'] else ''}"
                         f"{', routing ' + str(r.get('routing')) + ' top_k ' + str(r.get('top_k')) if r['load'] else ''}")
        else:
            lines.append(f"  layer {r['layer']:3d}:")
        if r["load"]:
            why = f" ({r['mode_reason']})" if r["mode_reason"] else ""
            lines.append(f"             would load, mode {r['mode']}{why}")
        else:
            lines.append(f"             refused: {r['reason']}")
    n = sum(r["load"] for r in info["layers"])
    lines.append(f"  {n} of {len(info['layers'])} MoE layers would load")
    return "\n".join(lines)


def main(argv=None) -> int:
    import argparse
    ap = argparse.ArgumentParser(prog="python -m fp4moe.checkpoint")
    sub = ap.add_subparsers(dest="cmd", required=True)
    ip = sub.add_parser("inspect", help="layers, formats, shapes, bytes, what would load and what would be refused "
                                        "(exit status 1 when a layer would be refused)")
    ip.add_argument("checkpoint")
    ip.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    from ._errors import Fp4MoeError
    try:
        info = inspect_checkpoint(a.checkpoint)
    except Fp4MoeError as e:
        print(f"fp4moe inspect: error: {e}", file=sys.stderr)
        return 1
    print(json.dumps(info, indent=1) if a.json else format_inspect(info))
    return 0 if all(r["load"] for r in info["layers"]) else 1


if __name__ == "__main__":
    sys.exit(main())
