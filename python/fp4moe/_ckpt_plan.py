"""The plan of one MoE layer (its tensors, checked from the headers) and the routing and activation its config
gives (fp4moe.checkpoint)."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

import numpy as np

from ._ckpt_files import _FLOAT_DTYPES, Checkpoint, ErrorCode, _fail, _TensorRef, error
from ._ckpt_quant import _linear
from ._enums import ActivationType, RoutingMethod, parse_enum

# Projection names of one expert, per architecture family: (gate, up, down).
_PER_EXPERT_NAMES = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))

_LAYER_RE = re.compile(r"^(?P<prefix>(?:.*\.)?layers\.(?P<layer>\d+)\.)(?P<block>mlp|block_sparse_moe)\.")


@dataclass
class _ExpertsPlan:
    fmt: str
    gated: bool
    E: int
    H: int
    I: int
    experts: list                 # per expert (gate, up, down) _Linear (up None when not gated), or fused refs
    fused: Optional[dict] = None  # GPT-OSS / transformers-5 fused tensors
    fused_layout: str = ""

    @property
    def nbytes(self) -> int:
        if self.fused is not None:
            return sum(t.nbytes for t in self.fused.values() if t is not None)
        return sum(l.nbytes for e in self.experts for l in e if l is not None)


@dataclass
class _LayerPlan:
    layer: int
    prefix: str
    block: str
    architecture: str
    routed: _ExpertsPlan
    shared: Optional[_ExpertsPlan]
    router_weight: Optional[_TensorRef]
    router_bias: Optional[_TensorRef]
    correction_bias: Optional[_TensorRef]
    shared_gate: Optional[_TensorRef] = None  # Qwen2-MoE / Qwen3-Next: sigmoid(x . g) scales the shared expert

    @property
    def nbytes(self) -> int:
        return self.routed.nbytes + (self.shared.nbytes if self.shared else 0) + sum(
            t.nbytes for t in (self.router_weight, self.router_bias, self.correction_bias, self.shared_gate)
            if t is not None)


def _model_type(ck: Checkpoint) -> str:
    c = ck.config if isinstance(ck.config, dict) else {}
    mt = str(c.get("model_type", ""))
    tc = c.get("text_config")
    if isinstance(tc, dict) and tc.get("model_type"):
        mt = str(tc["model_type"])
    return mt


def _text_config(ck: Checkpoint) -> dict:
    """config.json (its text_config for multimodal models), which load needs for the routing and activation."""
    if ck.config is None:
        raise _fail(f"{ck.path / 'config.json'}: the file is missing (it gives the model type, the routing and the "
                    f"activation)", ErrorCode.NotFound)
    c = ck.config if isinstance(ck.config, dict) else {}
    tc = c.get("text_config")
    return tc if isinstance(tc, dict) else c


def moe_layers(ck: Checkpoint) -> dict:
    """{layer index: (prefix, block)} of the layers whose tensors include experts."""
    found = {}
    for n in ck.names:
        m = _LAYER_RE.match(n)
        if m and n[m.end():].startswith("experts."):
            L = int(m.group("layer"))
            key = (m.group("prefix"), m.group("block"))
            if L in found and found[L] != key:
                raise _fail(f"{ck.path}: layer {L} has experts under two prefixes ({found[L][0]}, {key[0]})")
            found[L] = key
    return dict(sorted(found.items()))


def _expert_ids(ck: Checkpoint, base: str) -> list:
    ids = set()
    pat = re.compile(re.escape(base) + r"(\d+)\.")
    for n in ck.names:
        m = pat.match(n)
        if m:
            ids.add(int(m.group(1)))
    return sorted(ids)


def _plan_experts(ck: Checkpoint, base: str, ids: list, gated: bool, what: str) -> _ExpertsPlan:
    """Per-expert linears under `base` (…experts.) for expert ids `ids` (or a shared expert: base is its module)."""
    names = None
    probe = f"{base}{ids[0]}." if ids else base
    for cand in _PER_EXPERT_NAMES:
        if any(ck.has(f"{probe}{cand[2]}.{s}") for s in ("weight", "weight_packed")):
            names = cand
            break
    if names is None:
        raise _fail(f"{ck.path}: {what}: no down projection ('{probe}down_proj.weight' or '{probe}w2.weight')",
                    ErrorCode.NotFound)
    g, u, d = names
    # H, I from the first expert's down projection: [H, I] float or [H, I/2] packed.
    lin_names = [probe + d + ".weight_packed", probe + d + ".weight"]
    dn = next(n for n in lin_names if ck.has(n))
    dt, sh = ck.meta(dn)
    if len(sh) != 2:
        raise _fail(f"{ck.file_of(dn)}: tensor '{dn}': expected a 2-D weight, got shape {list(sh)}")
    H, I = sh[0], sh[1] * (2 if dt == "U8" else 1)
    if H % 16 or I % 16:
        raise _fail(f"{ck.file_of(dn)}: tensor '{dn}': H={H} and I={I} must be multiples of 16")
    experts, first = [], None
    for e in (ids if ids else [None]):
        m = base if e is None else f"{base}{e}."
        gate = _linear(ck, m + g, I, H)
        up = _linear(ck, m + u, I, H) if gated else None
        down = _linear(ck, m + d, H, I)
        experts.append((gate, up, down))
        for lin in (gate, up, down):
            if lin is None:
                continue
            if first is None:
                first = (lin, e)
            elif lin.fmt != first[0].fmt:
                raise _fail(f"{ck.file_of(lin.weight.name)}: tensor '{lin.weight.name}' ({_who(e)}) is "
                            f"{_fmt_name(lin)} but '{first[0].weight.name}' ({_who(first[1])}) is "
                            f"{_fmt_name(first[0])}: the linears of {what} must share one format")
    return _ExpertsPlan(first[0].fmt, gated, len(experts), H, I, experts)


def _who(expert) -> str:
    return "the shared expert" if expert is None else f"expert {expert}"


def _fmt_name(lin) -> str:
    return "NVFP4" if lin.fmt == "nvfp4" else lin.weight.dtype


def _plan_mxfp4(ck: Checkpoint, base: str, layout: str, gated: bool) -> _ExpertsPlan:
    """gpt-oss's MXFP4 experts: `*_blocks` U8 [E, N, K/32, 16] (E2M1 pairs, element 2i in the low nibble),
    `*_scales` U8 [E, N, K/32] (E8M0), `*_bias` [E, N]; gate_up rows N = 2I interleaved (gate j at 2j, up j at
    2j+1) unless fused_layout='gpt_oss_blocked'."""
    gu, dn = base + "gate_up_proj", base + "down_proj"
    if ck.quant.method != "mxfp4":
        raise _fail(f"{ck.file_of(gu + '_blocks')}: tensor '{gu}_blocks' is MXFP4 but {ck.quant.source} says "
                    f"{ck.quant.describe()} (MXFP4 experts need quantization_config.quant_method 'mxfp4')")
    if not layout.startswith("gpt_oss"):
        raise _fail(f"{ck.file_of(gu + '_blocks')}: tensor '{gu}_blocks': MXFP4 experts are gpt-oss's; "
                    f"fused_layout={layout!r} does not apply", ErrorCode.Unsupported)
    dt, sh = ck.meta(gu + "_blocks")
    if len(sh) != 4 or sh[3] != 16:
        raise _fail(f"{ck.file_of(gu + '_blocks')}: tensor '{gu}_blocks': expected [E, 2I, H/32, 16], got {list(sh)}")
    E, n1, H = sh[0], sh[1], 32 * sh[2]
    I = n1 // 2 if gated else n1
    dsh = ck.meta(dn + "_blocks")[1]
    if len(dsh) != 4 or dsh[0] != E or dsh[1] != H:
        raise _fail(f"{ck.file_of(dn + '_blocks')}: tensor '{dn}_blocks': expected [{E}, {H}, I/32, 16] to match "
                    f"'{gu}_blocks' {list(sh)}, got {list(dsh)}")
    if 32 * dsh[2] != I:
        raise _fail(f"{ck.file_of(dn + '_blocks')}: tensor '{dn}_blocks': I={32 * dsh[2]} differs from the I={I} of "
                    f"'{gu}_blocks' {list(sh)}")
    refs = {"w1": ck.tensor(gu + "_blocks", ("U8",), (E, n1, H // 32, 16)),
            "w1_scale": ck.tensor(gu + "_scales", ("U8",), (E, n1, H // 32), f" to match '{gu}_blocks'"),
            "w2": ck.tensor(dn + "_blocks", ("U8",), (E, H, I // 32, 16)),
            "w2_scale": ck.tensor(dn + "_scales", ("U8",), (E, H, I // 32), f" to match '{dn}_blocks'")}
    for key, name, shape in (("bias1", gu + "_bias", (E, n1)), ("bias2", dn + "_bias", (E, H))):
        refs[key] = ck.tensor(name, _FLOAT_DTYPES, shape) if ck.has(name) else None
    return _ExpertsPlan("mxfp4", gated, E, H, I, [], refs, layout)


def _plan_fused(ck: Checkpoint, base: str, layout: str, gated: bool) -> _ExpertsPlan:
    gu = base + "gate_up_proj"
    if ck.has(gu + "_blocks"):
        return _plan_mxfp4(ck, base, layout, gated)
    if ck.quant.method == "mxfp4":
        raise _fail(f"{ck.file_of(gu)}: tensor '{gu}': {ck.quant.source} says MXFP4 but the experts are not "
                    f"'{gu}_blocks' / '_scales'")
    dt, sh = ck.meta(gu)
    if dt not in _FLOAT_DTYPES:
        raise _fail(f"{ck.file_of(gu)}: tensor '{gu}': fused expert tensors are read in BF16/F16/F32, got {dt} "
                    f"(quantized checkpoints store experts one by one)", ErrorCode.Unsupported)
    if len(sh) != 3:
        raise _fail(f"{ck.file_of(gu)}: tensor '{gu}': expected [E, H, 2I] or [E, 2I, H], got {list(sh)}")
    dshape = ck.meta(base + "down_proj")[1]
    E = sh[0]
    if layout.startswith("gpt_oss"):  # [E, H, 2I], down [E, I, H]
        H, n1 = sh[1], sh[2]
    else:  # transformers 5: [E, 2I, H], down [E, H, I]
        n1, H = sh[1], sh[2]
    I = n1 // 2 if gated else n1
    refs = {"gate_up": ck.tensor(gu, _FLOAT_DTYPES, (E, H, n1) if layout.startswith("gpt_oss") else (E, n1, H)),
            "down": ck.tensor(base + "down_proj", _FLOAT_DTYPES,
                              (E, I, H) if layout.startswith("gpt_oss") else (E, H, I),
                              f" to match '{gu}' {list(sh)}")}
    for key, name, shape in (("bias1", gu + "_bias", (E, n1)), ("bias2", base + "down_proj_bias", (E, H))):
        refs[key] = ck.tensor(name, _FLOAT_DTYPES, shape) if ck.has(name) else None
    del dshape
    if H % 16 or I % 16:
        raise _fail(f"{ck.file_of(gu)}: tensor '{gu}': H={H} and I={I} must be multiples of 16")
    return _ExpertsPlan("bf16", gated, E, H, I, [], refs, layout)


def _plan_layer(ck: Checkpoint, layer: int, gated: bool, fused_layout: Optional[str]) -> _LayerPlan:
    layers = moe_layers(ck)
    if layer not in layers:
        have = list(layers)
        raise _fail(f"{ck.path}: layer {layer} has no MoE experts (MoE layers: "
                    f"{have[:8]}{' ...' if len(have) > 8 else ''})", ErrorCode.NotFound)
    prefix, block = layers[layer]
    mb = prefix + block + "."
    base = mb + "experts."
    mt = _model_type(ck)
    ids = _expert_ids(ck, base)
    if ids:
        if ids != list(range(len(ids))):
            missing = sorted(set(range(ids[-1] + 1)) - set(ids))
            raise _fail(f"{ck.path}: tensor '{base}{missing[0]}.*' is missing (experts {ids[0]}..{ids[-1]} "
                        f"expected)", ErrorCode.NotFound)
        routed = _plan_experts(ck, base, ids, gated, f"layer {layer} experts")
        arch = {"mixtral": "Mixtral"}.get(mt, "") or ("Mixtral" if block == "block_sparse_moe" else "")
        if not arch:
            arch = {"qwen3_moe": "Qwen3-MoE", "qwen2_moe": "Qwen2-MoE", "qwen3_next": "Qwen3-Next",
                    "deepseek_v3": "DeepSeek-V3", "kimi_k2": "Kimi-K2", "gpt_oss": "GPT-OSS"}.get(
                        mt, mt or "per-expert MoE")
    elif ck.has(base + "gate_up_proj") or ck.has(base + "gate_up_proj_blocks"):
        layout = fused_layout or ("gpt_oss_interleaved" if mt == "gpt_oss" else "")
        if not layout and ck.has(base + "gate_up_proj"):
            raise _fail(f"{ck.path}: tensor '{base}gate_up_proj': fused experts without a config.json model_type "
                        f"that fixes their layout; pass fused_layout='gpt_oss_interleaved', 'gpt_oss_blocked' or "
                        f"'hf'")
        routed = _plan_fused(ck, base, layout, gated)
        arch = "GPT-OSS" if layout.startswith("gpt_oss") else (mt or "fused experts")
    else:
        raise _fail(f"{ck.path}: layer {layer}: no expert tensors under '{base}'", ErrorCode.NotFound)
    shared = None
    for sname in ("shared_experts.", "shared_expert."):
        sb = mb + sname
        if ck.has(sb + "down_proj.weight") or ck.has(sb + "down_proj.weight_packed"):
            shared = _plan_experts(ck, sb, [], gated, f"layer {layer} shared expert")
            if shared.H != routed.H:
                raise _fail(f"{ck.path}: layer {layer}: the shared expert's H={shared.H} differs from the experts' "
                            f"H={routed.H}")
    H, E = routed.H, routed.E
    sg = None
    gname = mb + "shared_expert_gate.weight"
    if ck.has(gname):
        if shared is None:
            raise _fail(f"{ck.file_of(gname)}: tensor '{gname}': a shared-expert gate without a shared expert "
                        f"('{mb}shared_expert.down_proj.weight')")
        sg = ck.tensor(gname, _FLOAT_DTYPES, (1, H), " (the shared expert's gate [1, H])")
    rw = rb = cb = None
    for rname in (mb + "gate.weight", mb + "router.weight"):
        if ck.has(rname):
            rw = ck.tensor(rname, _FLOAT_DTYPES, (E, H), " (the router [E, H])")
            bname = rname[:-len("weight")] + "bias"
            rb = ck.tensor(bname, _FLOAT_DTYPES, (E,)) if ck.has(bname) else None
    if ck.has(mb + "gate.e_score_correction_bias"):
        cb = ck.tensor(mb + "gate.e_score_correction_bias", _FLOAT_DTYPES, (E,))
    return _LayerPlan(layer, prefix, block, arch, routed, shared, rw, rb, cb, sg)


# ---- configuration: routing and activation ----------------------------------------------------------------

# Model types with transformers' DeepSeek-V3 router (sigmoid scores, e_score_correction_bias, expert groups) and the
# defaults of their transformers config classes for the keys a config may leave out.
_DEEPSEEK_STYLE = {
    "deepseek_v3": {"n_group": 8, "topk_group": 4, "routed_scaling_factor": 2.5},
    "deepseek_v32": {"n_group": 8, "topk_group": 4, "routed_scaling_factor": 2.5},
    "kimi_k2": {"n_group": 8, "topk_group": 4, "routed_scaling_factor": 2.5},
    "kimi_k25": {"n_group": 8, "topk_group": 4, "routed_scaling_factor": 2.5},
    "glm4_moe": {"n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.0},
}
_SOFTMAX_TOPK = ("qwen3_moe", "qwen2_moe", "qwen3_next")  # softmax, top-k, / sum when norm_topk_prob
_NORM_TOPK_DEFAULT = {"qwen3_next": True}                  # transformers' default, else False
_RENORMALIZE = ("mixtral", "gpt_oss")                      # top-k of the logits, softmax over the k


def _routing_of(ck: Checkpoint, layer: int, E: int) -> dict:
    """The routing (SPEC §3.1) that reproduces the model's router, from config.json (keys it leaves out take the
    model's transformers defaults). What the operator could not run is refused here, naming the config key, so
    that fp4moe.moe(**layer.moe_kwargs()) does not fail after a load."""
    c = _text_config(ck)
    mt = _model_type(ck)
    src = ck.path / "config.json"

    def refuse(key, why, code=ErrorCode.InvalidArgument):
        return _fail(f"{src}: {key} {why}", code)

    kkey = "num_experts_per_tok" if "num_experts_per_tok" in c or "experts_per_token" not in c else "experts_per_token"
    out = {"routing_method": None, "top_k": c.get(kkey), "num_experts": E, "n_group": 1, "topk_group": 1,
           "routed_scaling_factor": 1.0}
    if mt in _SOFTMAX_TOPK:
        out["routing_method"] = RoutingMethod.RenormalizeNaive if \
            c.get("norm_topk_prob", _NORM_TOPK_DEFAULT.get(mt, False)) else \
            RoutingMethod.Default
        ekey = "num_experts"
    elif mt in _RENORMALIZE:
        out["routing_method"] = RoutingMethod.Renormalize
        ekey = "num_local_experts"
    elif mt in _DEEPSEEK_STYLE:
        if str(c.get("scoring_func", "sigmoid")) != "sigmoid":
            raise refuse("scoring_func", f"{c.get('scoring_func')!r}: fp4moe's DeepSeekV3 routing scores with sigmoid",
                         ErrorCode.Unsupported)
        if not c.get("norm_topk_prob", True):
            raise refuse("norm_topk_prob", "false: the router then leaves the chosen weights unnormalized, which no "
                         "routing method of fp4moe computes (DeepSeekV3 divides them by their sum, SPEC §3.1)",
                         ErrorCode.Unsupported)
        dflt = _DEEPSEEK_STYLE[mt]
        out.update(routing_method=RoutingMethod.DeepSeekV3, **{k: c.get(k, v) for k, v in dflt.items()})
        ekey = "n_routed_experts"
    else:
        raise refuse("model_type", f"{mt!r}: fp4moe does not know this model's router (it reads "
                     f"{', '.join(sorted(_SOFTMAX_TOPK + _RENORMALIZE + tuple(_DEEPSEEK_STYLE)))})",
                     ErrorCode.Unsupported)
    out["num_experts"] = _int_key(c, ekey, E, refuse)
    if out["num_experts"] != E:
        raise refuse(ekey, f"{out['num_experts']}, but layer {layer} of the files has {E} experts")
    k = out["top_k"] = _int_key(c, kkey, None, refuse)
    if not 1 <= k <= E:
        raise refuse(kkey, f"{k}: expected 1 <= top_k <= {E} (the layer's experts)")
    if out["routing_method"] == RoutingMethod.DeepSeekV3:
        g = out["n_group"] = _int_key(c, "n_group", out["n_group"], refuse)
        tg = out["topk_group"] = _int_key(c, "topk_group", out["topk_group"], refuse)
        if g < 1 or E % g or (g > 1 and E // g < 2):
            raise refuse("n_group", f"{g}: expected a divisor of the {E} experts leaving at least two per group")
        if not 1 <= tg <= g:
            raise refuse("topk_group", f"{tg}: expected 1 <= topk_group <= n_group={g}")
        if k > tg * (E // g):
            raise refuse(kkey, f"{k}: more than the {tg * (E // g)} experts of topk_group={tg} groups")
        rsf = c.get("routed_scaling_factor", out["routed_scaling_factor"])
        if isinstance(rsf, bool) or not isinstance(rsf, (int, float)) or not np.isfinite(rsf):
            raise refuse("routed_scaling_factor", f"{rsf!r}: expected a finite number")
        out["routed_scaling_factor"] = float(rsf)
    return out


def _int_key(c: dict, key: str, default, refuse) -> int:
    v = c.get(key, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or int(v) != v:
        raise refuse(key, f"{v!r}: expected an integer" if v is not None else "is missing")
    return int(v)


def _activation_of(ck: Checkpoint, activation) -> tuple[ActivationType, Optional[float], Optional[float],
                                                        Optional[float]]:
    """(type, alpha, beta, clamp_limit): `activation` (a type or a dict with "type", "alpha", "beta",
    "clamp_limit") overrides the config."""
    if activation is not None:
        if isinstance(activation, dict):
            d = dict(activation)
            t = parse_enum(ActivationType, d.pop("type"), "activation")
            a, b, l = d.pop("alpha", None), d.pop("beta", None), d.pop("clamp_limit", None)
            if d:
                raise error("activation", f"unknown keys {sorted(d)} (type, alpha, beta, clamp_limit)")
            return t, a, b, l
        return parse_enum(ActivationType, activation, "activation"), None, None, None
    c = _text_config(ck)
    if _model_type(ck) == "gpt_oss":
        return ActivationType.SwigluBias, 1.702, 1.0, float(c.get("swiglu_limit", 7.0))
    act = c.get("hidden_act", c.get("hidden_activation"))
    table = {"silu": ActivationType.Swiglu, "swish": ActivationType.Swiglu, "gelu": ActivationType.Geglu,
             "gelu_pytorch_tanh": ActivationType.GegluTanh, "gelu_new": ActivationType.GegluTanh}
    if act is None:
        raise error("activation", f"{ck.path}: config.json names no hidden_act; pass activation=")
    if act not in table:
        raise error("activation", f"{ck.path / 'config.json'}: hidden_act {act!r} has no fp4moe gated activation; "
                                  f"pass activation=", ErrorCode.Unsupported)
    return table[act], None, None, None
