#!/usr/bin/env python3
"""bf16 MoE baseline through torch._grouped_mm, timed the way `fp4moe bench` times the CUDA backend.

Per case (model shape of SPEC §1, T tokens): routing from fp32 logits in torch (the shape's method), sort of the
(token, slot) pairs by local expert, gather of x, grouped GEMM gate_up, the shape's activation in fp32, grouped GEMM
down, then the weighted sum over the k slots in fp32; a shape's shared expert (qwen3_next_80b_a3b) runs as two dense
GEMMs on every token, weighted by sigmoid(x . g) when gated, and is added in the same fp32 sum, as `fp4moe bench` runs
it (biases of SwigluBias shapes are left out, as before). With --lora (default on) the same plus eight rank-16 adapters,
every token adapted (adapter t % 8): the pairs are sorted by (expert, adapter) and the shrink / expand products run as
two more grouped GEMMs per projection over stacked per-(expert, adapter) matrices.

Timing: one CUDA graph per input set (3 sets of x and logits), CUDA events around each replay alone, a read-only pass
over 256 MB (torch.sum into a preallocated scalar) before each replay so the weights are not in the 60 MB L2, median
of >= 50 replays (more for short cases, up to --max-runs, until --min-time seconds of op time), p10 and p90. The copy
and bf16 GEMM ceilings are measured in this process.

  python3 bench/torch_baseline.py --selftest                      # numerics of the baseline vs a float64 loop
  python3 bench/torch_baseline.py --json torch.json --fp4moe fp4moe.json --ratio ratio.md

With --fp4moe (the JSON of `fp4moe bench --json`) it writes the ratio table: torch time / fp4moe time per case
(> 1: fp4moe is faster), into --ratio (Markdown) and into the JSON under "ratios".
"""
import argparse
import datetime
import json
import math
import os
import re
import sys
import time

import torch

from bench_cases import lora_case

# ---- model shapes (SPEC §1): read from include/fp4moe/model_shapes.h, the one home of the table ----------------
_FALLBACK_SHAPES = [
    # name, H, I, E, k, routing, n_group, topk_group, rsf, activation, alpha, beta, clamp, E_loc, shared_I, shared_gate
    ("kimi_k3_tp8", 3584, 384, 384, 8, "DeepSeekV3", 1, 1, 1.0, "Situ", 4.0, 25.0, 0.0, 384, 0, False),
    ("qwen3_30b_a3b", 2048, 768, 128, 8, "RenormalizeNaive", 1, 1, 1.0, "Swiglu", 1.0, 0.0, 0.0, 128, 0, False),
    ("qwen3_30b_a3b_tp4", 2048, 192, 128, 8, "RenormalizeNaive", 1, 1, 1.0, "Swiglu", 1.0, 0.0, 0.0, 128, 0, False),
    ("deepseek_v3_ep8", 7168, 2048, 256, 8, "DeepSeekV3", 8, 4, 2.5, "Swiglu", 1.0, 0.0, 0.0, 32, 0, False),
    ("mixtral_8x7b", 4096, 14336, 8, 2, "Renormalize", 1, 1, 1.0, "Swiglu", 1.0, 0.0, 0.0, 8, 0, False),
    ("gpt_oss_120b", 2880, 2880, 128, 4, "Renormalize", 1, 1, 1.0, "SwigluBias", 1.702, 1.0, 7.0, 128, 0, False),
    ("qwen3_next_80b_a3b", 2048, 512, 512, 10, "RenormalizeNaive", 1, 1, 1.0, "Swiglu", 1.0, 0.0, 0.0, 512, 512,
     True),
]
_FIELDS = ["name", "H", "I", "E", "k", "routing", "n_group", "topk_group", "rsf", "activation", "alpha", "beta",
           "clamp", "E_loc", "shared_I", "shared_gate"]
DEFAULT_TOKENS = [1, 8, 64, 256, 1024, 4096, 16384]
N_ADAPTERS, RANK = 8, 16
MAX_GROUPS = 1023  # groups per torch._grouped_mm call on CUDA: its check is group_count < 1024 ("Can't process more than 1024 groups")


def load_shapes():
    here = os.path.dirname(os.path.abspath(__file__))
    header = os.path.join(here, "..", "include", "fp4moe", "model_shapes.h")
    rows = []
    if os.path.exists(header):
        pat = re.compile(r'\{"(\w+)",\s*(\d+),\s*(\d+),\s*(\d+),\s*(\d+),\s*RoutingMethod::(\w+),\s*(\d+),\s*(\d+),\s*'
                         r'([\d.]+)f,\s*ActivationType::(\w+),\s*([\d.]+)f,\s*([\d.]+)f,\s*([\d.]+)f,\s*(\d+)'
                         r'(?:,\s*(\d+)(?:,\s*(true|false))?)?\s*\}')  # shared_I and shared_gate have defaults
        for m in pat.finditer(open(header).read()):
            g = m.groups()
            rows.append((g[0], int(g[1]), int(g[2]), int(g[3]), int(g[4]), g[5], int(g[6]), int(g[7]), float(g[8]),
                         g[9], float(g[10]), float(g[11]), float(g[12]), int(g[13]), int(g[14] or 0), g[15] == "true"))
        text = open(header).read()
        missed = len(re.findall(r'\{"\w+",\s*\d', text)) - len(rows)
        if missed:  # a row of another form would silently leave its shape out of every run
            raise ValueError(f"{header}: {missed} model shape row(s) not parsed; update load_shapes' pattern")
    if not rows:
        rows = _FALLBACK_SHAPES
    return {r[0]: dict(zip(_FIELDS, r)) for r in rows}


# ---- the operator in torch ---------------------------------------------------------------------------------------
def route(shape, logits, bias):
    """ids int64 [T, k] (global expert ids), weights fp32 [T, k]: SPEC §3.1 in fp32."""
    k, method = shape["k"], shape["routing"]
    logits = logits.float()
    if method == "Renormalize":
        top, ids = torch.topk(logits, k, dim=-1)
        return ids, torch.softmax(top, dim=-1)
    if method == "RenormalizeNaive":
        p = torch.softmax(logits, dim=-1)
        top, ids = torch.topk(p, k, dim=-1)
        return ids, top / top.sum(-1, keepdim=True)
    if method == "DeepSeekV3":
        s = torch.sigmoid(logits)
        b = s + (bias if bias is not None else 0.0)
        ng, tg = shape["n_group"], shape["topk_group"]
        if ng > 1:
            T, E = b.shape
            grp = b.view(T, ng, E // ng).topk(2, dim=-1).values.sum(-1)  # a group's score: its two best
            keep = torch.zeros_like(grp).scatter_(1, grp.topk(tg, dim=-1).indices, 1.0)
            # expand, not repeat_interleave: the latter sums its repeats on the host (a sync, no graph capture)
            b = b.masked_fill(keep[:, :, None].expand(T, ng, E // ng).reshape(T, E) == 0, float("-inf"))
        ids = torch.topk(b, k, dim=-1).indices
        sv = s.gather(1, ids)
        return ids, sv * shape["rsf"] / (sv.sum(-1, keepdim=True) + 1e-20)
    raise ValueError(f"routing {method} not in the baseline")


def activation(shape, h):
    """h fp32 [M, 2I] (gate rows first) -> a fp32 [M, I], real units (SPEC §3.2 step 3)."""
    I = h.shape[1] // 2
    g, u = h[:, :I], h[:, I:]
    act, al, be, L = shape["activation"], shape["alpha"], shape["beta"], shape["clamp"]
    if L > 0:
        g = torch.clamp(g, max=L)
        u = torch.clamp(u, -L, L)
    if act in ("Swiglu", "SwigluBias"):
        return g * torch.sigmoid(al * g) * (u + be)
    if act == "Situ":
        return (al * torch.tanh(g / al) * torch.sigmoid(g)) * (be * torch.tanh(u / be))
    raise ValueError(f"activation {act} not in the baseline")


class ChunkedGroups:
    """Stacked per-group matrices [G, K, N] (column-major views, as _grouped_mm wants them) for any G: calls of at
    most max_groups groups. Each call takes every row, with a leading group of zeros over the rows before its own
    groups; a row mask keeps its own rows. No host sync, so it can be captured in a CUDA graph (the zero group and
    the masks cost the baseline some work when G > max_groups)."""

    def __init__(self, w, max_groups=None):  # w: [G, N, K] row-major (the transposes are the B operands)
        self.max_groups = max_groups or MAX_GROUPS
        G = w.shape[0]
        self.whole = w.transpose(1, 2) if G <= self.max_groups else None
        self.chunks = []
        if self.whole is None:
            step = self.max_groups - 1
            zero = torch.zeros_like(w[:1])
            for g0 in range(0, G, step):
                g1 = min(G, g0 + step)
                self.chunks.append((g0, g1, torch.cat([zero, w[g0:g1]]).transpose(1, 2)))

    def mm(self, x, offs):
        if self.whole is not None:
            return torch._grouped_mm(x, self.whole, offs=offs)
        rows = torch.arange(x.shape[0], device=x.device)
        out = None
        for g0, g1, wt in self.chunks:
            start = offs[g0 - 1:g0] if g0 > 0 else torch.zeros(1, dtype=offs.dtype, device=offs.device)
            o = torch._grouped_mm(x, wt, offs=torch.cat([start, offs[g0:g1]]))
            keep = (rows >= start) & (rows < offs[g1 - 1])
            part = torch.where(keep[:, None], o, torch.zeros((), dtype=o.dtype, device=o.device))
            out = part if out is None else out + part
        return out


class TorchMoe:
    """bf16 experts [E_loc] of one shape (gate_first W1 [E, 2I, H], W2 [E, H, I]) and optional stacked adapters."""

    def __init__(self, shape, device, seed, lora, E_loc=None, H=None, I=None, max_groups=None):
        gen = torch.Generator(device=device).manual_seed(seed)
        self.shape = shape
        self.E_loc = E_loc or shape["E_loc"]
        self.E_total = shape["E"] if E_loc is None else max(shape["E"], self.E_loc)
        self.H, self.I = H or shape["H"], I or shape["I"]
        E, H, I = self.E_loc, self.H, self.I
        rn = lambda *s, sd: (torch.randn(*s, generator=gen, device=device, dtype=torch.float32) * sd).to(torch.bfloat16)
        self.w1 = rn(E, 2 * I, H, sd=1 / math.sqrt(H))
        self.w2 = rn(E, H, I, sd=1 / math.sqrt(I))
        # Column-major B operands [E, K, N] (the transposes are views: _grouped_mm reads them in place).
        self.w1t, self.w2t = self.w1.transpose(1, 2), self.w2.transpose(1, 2)
        self.bias = (torch.randn(self.E_total, generator=gen, device=device) * 0.1) if shape["routing"] == "DeepSeekV3" \
            else None
        self.shared_I = shape.get("shared_I", 0)
        if self.shared_I:
            Is = self.shared_I
            self.ws1t = rn(2 * Is, H, sd=1 / math.sqrt(H)).t()
            self.ws2t = rn(H, Is, sd=1 / math.sqrt(Is)).t()
            self.gate = rn(H, sd=0.05) if shape.get("shared_gate") else None
        self.lora = lora
        if lora:
            r, A = RANK, N_ADAPTERS
            # Group g = e * A + a (expert major): sorting by g keeps each expert's rows contiguous.
            self.a1 = rn(E * A, r, H, sd=1 / math.sqrt(H))
            self.b1 = rn(E * A, 2 * I, r, sd=0.1 / math.sqrt(r))   # scale lora_alpha / r = 2 folded in
            self.a2 = rn(E * A, r, I, sd=1 / math.sqrt(I))
            self.b2 = rn(E * A, H, r, sd=0.1 / math.sqrt(r))
            self.a1g, self.b1g = ChunkedGroups(self.a1, max_groups), ChunkedGroups(self.b1, max_groups)
            self.a2g, self.b2g = ChunkedGroups(self.a2, max_groups), ChunkedGroups(self.b2, max_groups)

    def forward(self, x, logits, adapter_ids=None, offset=0):
        ids, w = route(self.shape, logits, self.bias)
        return self.forward_routed(x, ids, w, adapter_ids, offset)

    def forward_routed(self, x, ids, w, adapter_ids=None, offset=0):
        T, k = ids.shape
        E, A = self.E_loc, N_ADAPTERS
        lora = adapter_ids is not None
        local = (ids >= offset) & (ids < offset + E)
        e = torch.where(local, ids - offset, E)  # E: not on this rank, sorted last
        groups = E * A if lora else E
        key = e * A + adapter_ids.view(T, 1) if lora else e
        key = torch.where(local, key, groups).flatten()
        order = torch.argsort(key, stable=True)
        tok = torch.div(order, k, rounding_mode="floor")
        counts = torch.zeros(groups + 1, dtype=torch.int32, device=x.device).index_add_(
            0, key, torch.ones_like(key, dtype=torch.int32))
        offs_g = torch.cumsum(counts[:groups], 0, dtype=torch.int32)
        offs_e = offs_g.view(E, A)[:, -1].contiguous() if lora else offs_g
        xs = x[tok]
        h = torch._grouped_mm(xs, self.w1t, offs=offs_e).float()
        if lora:
            h = h + self.b1g.mm(self.a1g.mm(xs, offs_g), offs_g).float()
        a = activation(self.shape, h).to(torch.bfloat16)
        o = torch._grouped_mm(a, self.w2t, offs=offs_e)
        if lora:
            o = o.float() + self.b2g.mm(self.a2g.mm(a, offs_g), offs_g).float()
        # Rows past the last offset (remote experts) were not computed: zero them before the combine.
        valid = torch.arange(T * k, device=x.device) < offs_g[-1]
        o = torch.where(valid[:, None], o.float(), 0.0)
        out = torch.empty_like(o)
        out[order] = o
        wl = torch.where(local, w, 0.0)
        y = (out.view(T, k, -1) * wl[..., None]).sum(1)
        if self.shared_I:
            y = y + self.shared_part(x)
        return y.to(torch.bfloat16)

    def shared_part(self, x):
        """The shared expert's output on every token, times sigmoid(x . g) when gated, fp32 [T, H]."""
        a = activation(self.shape, (x @ self.ws1t).float()).to(torch.bfloat16)
        o = (a @ self.ws2t).float()
        return o if self.gate is None else o * torch.sigmoid(x.float() @ self.gate.float())[:, None]


def reference_loop(m, x, ids, w, adapter_ids=None, offset=0):
    """float64, token by token: the independent check of forward_routed."""
    T, k = ids.shape
    y = torch.zeros(T, m.H, dtype=torch.float64)
    xd, w1, w2 = x.double().cpu(), m.w1.double().cpu(), m.w2.double().cpu()
    for t in range(T):
        for j in range(k):
            e = int(ids[t, j]) - offset
            if e < 0 or e >= m.E_loc:
                continue
            h = w1[e] @ xd[t]
            if adapter_ids is not None:
                g = e * N_ADAPTERS + int(adapter_ids[t])
                h = h + m.b1[g].double().cpu() @ (m.a1[g].double().cpu() @ xd[t])
            a = activation(m.shape, h.view(1, -1)).view(-1)
            o = w2[e] @ a
            if adapter_ids is not None:
                o = o + m.b2[g].double().cpu() @ (m.a2[g].double().cpu() @ a)
            y[t] += float(w[t, j]) * o
    if m.shared_I:
        a = activation(m.shape, xd @ m.ws1t.double().cpu())
        o = a @ m.ws2t.double().cpu()
        y += o if m.gate is None else o * torch.sigmoid(xd @ m.gate.double().cpu())[:, None]
    return y


def selftest(device):
    shapes = load_shapes()
    worst = 0.0
    ok = True
    for name, act_shape, E, E_loc, off in [("swiglu", "qwen3_30b_a3b", 8, 8, 0), ("swiglubias", "gpt_oss_120b", 8, 8, 0),
                                           ("situ", "kimi_k3_tp8", 8, 8, 0), ("ep", "deepseek_v3_ep8", 16, 4, 4),
                                           ("shared", "qwen3_next_80b_a3b", 8, 8, 0)]:
        sh = dict(shapes[act_shape])
        sh["E"], sh["k"] = E, min(sh["k"], 4)
        sh["shared_I"] = min(sh["shared_I"], 32)
        if sh["n_group"] > 1:
            sh["n_group"], sh["topk_group"] = 4, 2
        for lora in (False, True):
            torch.manual_seed(3)
            m = TorchMoe(sh, device, 7, lora, E_loc=E_loc, H=64, I=48)
            T = 37
            x = torch.randn(T, 64, device=device).to(torch.bfloat16)
            logits = torch.randn(T, E, device=device)
            ids, w = route(sh, logits, m.bias)
            aid = (torch.arange(T, device=device) % N_ADAPTERS) if lora else None
            y = m.forward_routed(x, ids, w, aid, off).double().cpu()
            ref = reference_loop(m, x, ids.cpu(), w.cpu(), aid.cpu() if lora else None, off)
            rel = float((y - ref).norm() / ref.norm().clamp_min(1e-30))
            good = math.isfinite(rel) and rel < 1e-2 and float(ref.norm()) > 0
            worst = max(worst, rel)
            ok &= good
            print(f"selftest {name:10s} lora={int(lora)}: rel L2 vs float64 loop {rel:.2e} {'ok' if good else 'FAIL'}")
            if lora:  # the same adapters through calls of at most 5 groups (on CUDA: MAX_GROUPS)
                torch.manual_seed(3)
                mc = TorchMoe(sh, device, 7, lora, E_loc=E_loc, H=64, I=48, max_groups=5)
                yc = mc.forward_routed(x, ids, w, aid, off).double().cpu()
                same = bool(torch.equal(yc, y)) and len(mc.a1g.chunks) > 1
                ok &= same
                print(f"selftest {name:10s} chunked groups ({len(mc.a1g.chunks)} calls): {'equal' if same else 'FAIL'}")
    # Routing against a per-token loop (random logits: no ties).
    for shname in ("qwen3_30b_a3b", "mixtral_8x7b", "deepseek_v3_ep8"):
        sh = shapes[shname]
        logits = torch.randn(5, sh["E"], device=device)
        bias = torch.randn(sh["E"], device=device) * 0.1
        ids, w = route(sh, logits, bias)
        for t in range(5):
            l = logits[t].double().cpu()
            if sh["routing"] == "Renormalize":
                top = sorted(range(sh["E"]), key=lambda i: -l[i])[:sh["k"]]
                ww = torch.softmax(l[top], 0)
            elif sh["routing"] == "RenormalizeNaive":
                p = torch.softmax(l, 0)
                top = sorted(range(sh["E"]), key=lambda i: -p[i])[:sh["k"]]
                ww = p[top] / p[top].sum()
            else:
                s = torch.sigmoid(l)
                b = s + bias.double().cpu()
                gs = sh["E"] // sh["n_group"]
                gscore = [sum(sorted(b[g * gs:(g + 1) * gs].tolist())[-2:]) for g in range(sh["n_group"])]
                keep = sorted(range(sh["n_group"]), key=lambda g: -gscore[g])[:sh["topk_group"]]
                cand = [i for i in range(sh["E"]) if i // gs in keep]
                top = sorted(cand, key=lambda i: -b[i])[:sh["k"]]
                ww = s[top] * sh["rsf"] / (s[top].sum() + 1e-20)
            same = ids[t].tolist() == top and torch.allclose(w[t].double().cpu(), ww, rtol=1e-5, atol=1e-6)
            ok &= same
            if not same:
                print(f"selftest routing {shname} token {t}: FAIL ({ids[t].tolist()} vs {top})")
    print(f"selftest routing: {'ok' if ok else 'FAIL'}")
    print(f"selftest {'passed' if ok else 'FAILED'} (worst rel L2 {worst:.2e})")
    return ok


# ---- timing ------------------------------------------------------------------------------------------------------
class Flusher:
    """A read-only pass over 256 MB: evicts the L2 without leaving dirty lines for the timed op to write back."""

    def __init__(self, device):
        self.buf = torch.full((64 << 20,), 0.5, device=device, dtype=torch.float32)
        self.out = torch.empty((), device=device, dtype=torch.float32)

    def __call__(self):
        torch.sum(self.buf, dim=0, out=self.out)


def percentile(v, p):
    s = sorted(v)
    pos = p / 100 * (len(s) - 1)
    lo = int(math.floor(pos))
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def time_replays(replays, flush, runs, max_runs, min_time_s):
    """replays: callables (one per input set), each one graph replay. Returns times in us."""
    for i in range(2 * len(replays)):
        flush()
        replays[i % len(replays)]()
    torch.cuda.synchronize()
    ts, done = [], 0
    while done < runs or (done < max_runs and sum(ts) * 1e-6 < min_time_s):
        n = min(50, (runs if done < runs else max_runs) - done)
        ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
        for i in range(n):
            flush()
            ev[i][0].record()
            replays[(done + i) % len(replays)]()
            ev[i][1].record()
        torch.cuda.synchronize()
        ts += [a.elapsed_time(b) * 1000.0 for a, b in ev]
        done += n
    return ts


def ceilings(device):
    out = {}
    for gb in (4, 1):
        try:
            n = gb << 30
            a = torch.full((n,), 0x5A, dtype=torch.uint8, device=device)
            b = torch.empty_like(a)
            ts = []
            for i in range(12):
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                b.copy_(a)
                e1.record()
                torch.cuda.synchronize()
                if i >= 2:
                    ts.append(e0.elapsed_time(e1))
            out["copy_gbps"] = 2 * n / (percentile(ts, 50) * 1e-3) / 1e9
            out["copy_bytes"] = n
            del a, b
            break
        except torch.OutOfMemoryError:
            continue
    n = 8192
    A = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    B = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    ts = []
    for i in range(23):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        torch.mm(A, B)
        e1.record()
        torch.cuda.synchronize()
        if i >= 3:
            ts.append(e0.elapsed_time(e1))
    out["gemm_tflops"] = 2 * n ** 3 / (percentile(ts, 50) * 1e-3) / 1e12
    out["gemm"] = "torch.mm bf16 8192^3 random N(0,1), median of 20"
    out["copy"] = "Tensor.copy_ device to device, bytes read + written, median of 10"
    return out


def count_case(sh, ids_list, lora, T):
    """Means over the input sets: local slots, touched experts, touched (expert, adapter) pairs."""
    E_loc = sh["E_loc"]
    slots = experts = pairs = 0.0
    aid = torch.arange(T) % N_ADAPTERS
    for ids in ids_list:
        ids = ids.cpu()
        local = ids < E_loc
        slots += float(local.sum())
        experts += float(torch.unique(ids[local]).numel())
        if lora:
            key = ids * N_ADAPTERS + aid.view(T, 1)
            pairs += float(torch.unique(key[local]).numel())
    n = len(ids_list)
    return slots / n, experts / n, pairs / n


def run(args):
    device = torch.device("cuda")
    shapes = load_shapes()
    names = args.shapes.split(",") if args.shapes else list(shapes)
    for n in names:
        if n not in shapes:
            sys.exit(f"--shapes: unknown model shape '{n}'")
    tokens = [int(t) for t in args.tokens.split(",")] if args.tokens else (
        [1, 64, 1024] if args.quick else DEFAULT_TOKENS)
    max_runs = args.runs if args.quick else max(args.max_runs, args.runs)
    t0 = time.time()
    prop = torch.cuda.get_device_properties(device)
    print(f"torch baseline: {prop.name}, {prop.multi_processor_count} SMs, torch {torch.__version__}")
    ceil = ceilings(device)
    print(f"ceilings: copy {ceil['copy_gbps']:.0f} GB/s, bf16 GEMM {ceil['gemm_tflops']:.0f} TFLOP/s [{time.time() - t0:.1f} s]")
    flush = Flusher(device)

    def make_doc(complete):
        doc = {"tool": "torch_baseline", "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
               "machine": {"gpu": prop.name, "sms": prop.multi_processor_count, "memory_bytes": prop.total_memory,
                           "torch": torch.__version__, "cuda": torch.version.cuda},
               "method": {"timing": "CUDA events around one torch.cuda.CUDAGraph replay",
                          "l2": "read of 256 MB (torch.sum) before each timed replay, not timed", "runs_min": args.runs,
                          "runs_max": max_runs, "input_sets": sets, "weights": "bf16",
                          "lora": "8 adapters rank 16 stacked per (expert, adapter), every token adapted (t % 8)"},
               "ceilings": ceil, "cases": cases}
        doc["complete"] = complete
        return doc

    def dump(complete):
        doc = make_doc(complete)
        if args.json:
            json.dump(doc, open(args.json, "w"), indent=1)
        return doc

    sets = args.sets
    cases = []
    for si, name in enumerate(names):
        sh = shapes[name]
        m = TorchMoe(sh, device, 100 + si, not args.no_lora)
        H, I, E, k = sh["H"], sh["I"], sh["E"], sh["k"]
        shared = f" shared_I={sh['shared_I']}{' gated' if sh['shared_gate'] else ''}" if sh["shared_I"] else ""
        print(f"== {name} (H={H} I={I} E={E} E_loc={sh['E_loc']} k={k}{shared}) [{time.time() - t0:.1f} s]", flush=True)
        for T in tokens:
            xs = [torch.randn(T, H, device=device).to(torch.bfloat16) for _ in range(sets)]
            ls = [torch.randn(T, E, device=device) for _ in range(sets)]
            aid = torch.arange(T, device=device) % N_ADAPTERS
            ids_list = [route(sh, l, m.bias)[0] for l in ls]
            for lora in ([False] if args.no_lora else [False, True]):
                rec = {"shape": name, "T": T, "lora": lora}
                try:
                    fn = lambda s, m=m, lora=lora: m.forward(xs[s], ls[s], aid if lora else None)
                    side = torch.cuda.Stream()  # eager warm-up on a side stream, as graph capture wants
                    side.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(side):
                        for s in range(sets):
                            fn(s)
                    torch.cuda.current_stream().wait_stream(side)
                    torch.cuda.synchronize()
                    pool = torch.cuda.graph_pool_handle()
                    graphs = []
                    for s in range(sets):
                        g = torch.cuda.CUDAGraph()
                        with torch.cuda.graph(g, pool=pool):
                            fn(s)
                        graphs.append(g)
                    ts = time_replays([g.replay for g in graphs], flush, args.runs, max_runs, args.min_time)
                    del graphs
                    slots, experts, pairs = count_case(sh, ids_list, lora, T)
                    wb = experts * 2 * (2 * I * H + H * I)
                    lb = pairs * 2 * RANK * (H + 2 * I + I + H) if lora else 0.0
                    flops = 2 * slots * (2 * I * H + H * I) + (2 * slots * RANK * (H + 2 * I + I + H) if lora else 0)
                    if m.shared_I:  # every token runs it (and the gate's dot product when gated)
                        gated = m.gate is not None
                        wb += 2 * 3 * m.shared_I * H + (2 * H if gated else 0)
                        flops += 2 * T * 3 * m.shared_I * H + (2 * T * H if gated else 0)
                    io = T * (2 * H + 2 * H + 4 * E + (4 if lora else 0))
                    med = percentile(ts, 50)
                    s_ = med * 1e-6
                    fm = (wb + lb + io) / (ceil["copy_gbps"] * 1e9) * 1e6
                    fc = flops / (ceil["gemm_tflops"] * 1e12) * 1e6
                    rec.update(status="ok", graph=True, runs=len(ts), median_us=med, p10_us=percentile(ts, 10),
                               p90_us=percentile(ts, 90), min_us=min(ts), mean_us=sum(ts) / len(ts), local_slots=slots,
                               touched_experts=experts, weight_bytes=wb, lora_bytes=lb, io_bytes=io, flops=flops,
                               gbps=(wb + lb) / s_ / 1e9, ratio_copy=(wb + lb) / s_ / 1e9 / ceil["copy_gbps"],
                               tflops=flops / s_ / 1e12, ratio_gemm=flops / s_ / 1e12 / ceil["gemm_tflops"],
                               floor_mem_us=fm, floor_compute_us=fc, floor_us=max(fm, fc),
                               time_over_floor=med / max(fm, fc))
                    print(f"  T={T:<6d} {'lora' if lora else 'base':5s} {med:10.1f} us  p10 {rec['p10_us']:9.1f}  "
                          f"p90 {rec['p90_us']:9.1f}  {rec['gbps']:6.0f} GB/s  {rec['tflops']:6.1f} TFLOP/s  "
                          f"floor {rec['floor_us']:8.1f} us  x{rec['time_over_floor']:.2f}", flush=True)
                except Exception as e:  # a case the baseline cannot run is recorded, not fatal
                    rec.update(status="error", message=f"{type(e).__name__}: {e}")
                    print(f"  T={T:<6d} {'lora' if lora else 'base':5s} error: {rec['message'][:200]}", flush=True)
                cases.append(rec)
                torch.cuda.empty_cache()
        del m
        torch.cuda.empty_cache()
        dump(False)  # after every shape: a run cut short keeps its cases
    doc = make_doc(True)
    if args.fp4moe:
        doc["ratios"] = ratios(json.load(open(args.fp4moe)), doc)
        table = ratio_table(doc["ratios"], doc, json.load(open(args.fp4moe)))
        print("\n" + table)
        if args.ratio:
            open(args.ratio, "w").write(table)
            print(f"wrote {args.ratio}")
    if args.json:
        json.dump(doc, open(args.json, "w"), indent=1)
        print(f"wrote {args.json}")
    print(f"torch baseline finished in {time.time() - t0:.1f} s")
    return 0 if all(c["status"] == "ok" for c in cases) else 1


def ratios(fp, tb):
    """torch time / fp4moe time for every (shape, T, LoRA case) both ran (the baseline's LoRA is per_expert8's)."""
    idx = {(c["shape"], c["T"], lora_case(c)): c for c in tb["cases"] if c.get("status") == "ok"}
    out = []
    for c in fp["cases"]:
        key = (c["shape"], c["T"], lora_case(c))
        row = {"shape": c["shape"], "T": c["T"], "lora": c["lora"], "lora_case": key[2], "fp4moe_us": c.get("median_us"),
               "fp4moe_status": c.get("status"), "torch_us": idx[key]["median_us"] if key in idx else None}
        if c.get("status") == "ok" and key in idx:
            row["speedup"] = idx[key]["median_us"] / c["median_us"]
        out.append(row)
    return out


def ratio_table(rows, tb, fp):
    fc, tc = fp.get("ceilings", {}), tb["ceilings"]
    t = ("| shape | T | LoRA | fp4moe us | torch bf16 us | torch / fp4moe |\n|---|---:|---|---:|---:|---:|\n")
    for r in rows:
        fpv = f"{r['fp4moe_us']:.1f}" if r["fp4moe_status"] == "ok" else r["fp4moe_status"]
        tv = f"{r['torch_us']:.1f}" if r["torch_us"] is not None else "-"
        sp = f"{r['speedup']:.2f}" if "speedup" in r else "-"
        t += f"| {r['shape']} | {r['T']} | {r['lora_case'] if r['lora'] else '-'} | {fpv} | {tv} | {sp} |\n"
    t += (f"\nceilings: fp4moe run copy {fc.get('copy_gbps', 0):.0f} GB/s, GEMM {fc.get('gemm_tflops', 0):.0f} TFLOP/s; "
          f"torch run copy {tc['copy_gbps']:.0f} GB/s, GEMM {tc['gemm_tflops']:.0f} TFLOP/s\n")
    return t


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", help="comma-separated model shapes (default: all of SPEC §1)")
    ap.add_argument("--tokens", help="comma-separated token counts (default 1,8,64,256,1024,4096,16384)")
    ap.add_argument("--runs", type=int, default=50, help="timed replays per case, at least (default 50)")
    ap.add_argument("--max-runs", type=int, default=400)
    ap.add_argument("--min-time", type=float, default=0.05, help="op seconds to reach before stopping (default 0.05)")
    ap.add_argument("--sets", type=int, default=3, help="input sets rotated between replays (default 3)")
    ap.add_argument("--no-lora", action="store_true")
    ap.add_argument("--quick", action="store_true", help="tokens 1,64,1024, no extra repeats")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--fp4moe", help="JSON of `fp4moe bench --json`: adds the ratio table")
    ap.add_argument("--ratio", help="write the ratio table (Markdown) here")
    ap.add_argument("--selftest", action="store_true", help="check the baseline's numerics, then exit")
    args = ap.parse_args()
    if args.runs < 1 or args.sets < 1 or args.max_runs < 1:
        ap.error("--runs, --max-runs and --sets must be positive")
    if args.selftest:
        dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return 0 if selftest(dev) else 1
    if not torch.cuda.is_available():
        sys.exit("torch_baseline: no CUDA device")
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
