"""Checks the producer-made test files of tests/data/producers on a GPU host (run by tools/device/producer_gpu_run.sh).

  install     installs carried wheels into a target folder (pip, no index), each only when the host's Python lacks
              that distribution or has a version the carried wheels' requirements exclude; fp4moe and
              nvidia-modelopt always
  environment the versions, fp4moe's build and the fake-quantization route ModelOpt takes here
  references  re-makes each ModelOpt case with ModelOpt's CUDA fake quantization (same tiny models, seeds and
              calibration as tools/make_producer_checkpoints.py) and reports how far the committed CPU-made
              reference output of the MoE block and the committed checkpoint's tensors are from the GPU-made ones
  blocks      loads every producer checkpoint with fp4moe.load_moe_layer on the GPU and runs fp4moe.moe (A4 and A16)
              on the committed inputs: against the producer's output and against fp4moe's CPU backend
  swap        the ModelOpt Qwen3-MoE checkpoint loaded into a transformers model (NVFP4 linears decoded to bf16),
              its MoE blocks swapped by fp4moe.hf.swap_moe_blocks(model, checkpoint=...): the whole model's logits
              on fixed token ids against the same model run by transformers, ModelOpt's fake-quantized model of the
              same weights and the unquantized model
  summary     merges the JSON of the steps into results.json and summary.md

Each step writes <step>.json into --work and prints it; a step exits 1 when any of its parts raised (the others
still run and are reported). Runs on a CPU host too (fp4moe's CPU backend, ModelOpt's CPU path), for trying it.

  python3 tools/producer_gpu_check.py {install,environment,swap,blocks,references,summary} [--work DIR] ...
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "tests" / "data" / "producers"
MODELOPT_CASES = ("modelopt_qwen3_moe", "modelopt_deepseek_v3", "modelopt_mixtral")
ALL_CASES = MODELOPT_CASES + ("llmcompressor_qwen3_moe",)
SWAP_CASE = "modelopt_qwen3_moe"
ALWAYS_INSTALL = ("fp4moe", "nvidia-modelopt")


def norm_name(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


# ---- install ---------------------------------------------------------------------------------------------------

def wheel_dist(path: Path) -> tuple[str, str]:
    name, version = path.name.split("-")[:2]
    return norm_name(name), version


def wheel_requirements(wheels) -> dict:
    """{distribution: SpecifierSet} of the runtime requirements (no extras) of the carried wheels, merged."""
    import zipfile
    from packaging.requirements import Requirement
    from packaging.specifiers import SpecifierSet
    out = {}
    for w in wheels:
        with zipfile.ZipFile(w) as z:
            meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
            for line in z.read(meta).decode().splitlines():
                if not line.startswith("Requires-Dist:"):
                    continue
                req = Requirement(line.split(":", 1)[1].strip())
                if req.marker is None or req.marker.evaluate({"extra": ""}):
                    name = norm_name(req.name)
                    out[name] = out.get(name, SpecifierSet()) & req.specifier
    return out


def cmd_install(a) -> dict:
    from importlib import metadata
    wheels = sorted(Path(a.wheels).glob("*.whl"))
    reqs = wheel_requirements(wheels)
    chosen, skipped = [], {}
    for w in wheels:
        dist = wheel_dist(w)[0]
        have = None
        try:
            have = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
        if dist not in ALWAYS_INSTALL and have is not None and (dist not in reqs or
                                                                reqs[dist].contains(have, prereleases=True)):
            skipped[dist] = f"host has {have}"
            continue
        chosen.append(w)
    res = {"installed": [w.name for w in chosen], "skipped": skipped, "target": a.target,
           "missing_requirements": []}
    if chosen:
        cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
               "--target", a.target] + [str(w) for w in chosen]
        has_pip = subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True).returncode == 0
        if not has_pip or subprocess.run(cmd).returncode != 0:  # a wheel is a zip of the installed files
            import zipfile
            res["installer"] = f"zipfile (pip {'failed' if has_pip else 'missing'})"
            for w in chosen:
                with zipfile.ZipFile(w) as z:
                    z.extractall(a.target)
    # What the carried wheels require and neither the host nor the carried wheels have (see stand_ins()).
    carried = {wheel_dist(w)[0] for w in wheels}
    for dist in sorted(reqs):
        try:
            metadata.version(dist)
        except metadata.PackageNotFoundError:
            if dist not in carried:
                res["missing_requirements"].append(dist)
    return res


STAND_IN = ("scipy", "pulp")


class _StandInFinder:
    """Imports scipy and pulp (and their submodules) as stand-ins whose every attribute raises when used.

    ModelOpt imports them at import time (scipy.stats for its histogram calibrator, pulp for its search
    algorithms, scipy.interpolate for NAS) and uses neither for NVFP4 with max calibration; scipy's wheel alone is
    about 35 MB, too much to carry. Installed only for a package the host lacks; the results name them."""

    def __init__(self, names):
        self.names = tuple(names)

    def find_spec(self, fullname, path=None, target=None):
        import importlib.machinery
        if fullname.split(".")[0] not in self.names:
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec):
        import types
        mod = types.ModuleType(spec.name)
        mod.__path__ = []

        def missing(attr, _name=spec.name):
            if attr.startswith("__"):
                raise AttributeError(attr)

            def fail(*_a, **_k):
                raise RuntimeError(f"{_name}.{attr} is a stand-in: {_name.split('.')[0]} is not installed here")
            # a class, so that it also works as an exception type (except QhullError) and in annotations
            return type(attr, (Exception,), {"__init__": fail, "__call__": fail})

        mod.__getattr__ = missing
        return mod

    def exec_module(self, module):
        pass


def stand_ins() -> list:
    """Installs the stand-ins for those of STAND_IN that this Python cannot import; returns their names."""
    import importlib.util
    absent = [n for n in STAND_IN if importlib.util.find_spec(n) is None]
    if absent:
        sys.meta_path.append(_StandInFinder(absent))
    return absent


# ---- shared ----------------------------------------------------------------------------------------------------

def device():
    import torch
    return "cuda" if torch.cuda.is_available() else "cpu"


def compare(a, b) -> dict:
    """a against the reference b: max abs difference, relative L2 ||a - b|| / ||b||."""
    import torch
    a = torch.as_tensor(a).detach().double().cpu()
    b = torch.as_tensor(b).detach().double().cpu()
    d = a - b
    return {"max_abs": float(d.abs().max()), "rel_l2": float(d.norm() / b.norm()), "ref_max_abs": float(b.abs().max())}


def compare_logits(a, b) -> dict:
    out = compare(a, b)
    out["top1"] = float((a.argmax(-1).cpu() == b.argmax(-1).cpu()).double().mean())
    return out


def producer_tools():
    """tools/make_producer_checkpoints.py as a module (the models, seeds and inputs of the committed files)."""
    sys.path.insert(0, str(REPO / "tools"))
    import make_producer_checkpoints as mpc
    return mpc


def builders(mpc) -> dict:
    return {"modelopt_qwen3_moe": mpc.qwen3_moe_model, "modelopt_deepseek_v3": mpc.deepseek_v3_model,
            "modelopt_mixtral": mpc.mixtral_model, "llmcompressor_qwen3_moe": mpc.qwen3_moe_model}


def environment() -> dict:
    import torch
    info = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
            "capability": list(torch.cuda.get_device_capability(0)) if torch.cuda.is_available() else None}
    from importlib import metadata
    for pkg in ("transformers", "nvidia-modelopt", "safetensors", "accelerate", "triton", "numpy"):
        try:
            info[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            pass
    try:
        import fp4moe
        b = fp4moe.build_info()
        info["fp4moe"] = {k: b.get(k) for k in ("version", "source_hash", "with_cuda", "cuda_archs")}
        pkg = Path(fp4moe.__file__).parent
        info["fp4moe"]["from"] = str(pkg)
        # the wheel's Python against this tree's (the wheel may have been built from another revision)
        info["fp4moe"]["python_differs_from_tree"] = sorted(
            f.name for f in (REPO / "python" / "fp4moe").glob("*.py")
            if not (pkg / f.name).is_file() or (pkg / f.name).read_bytes() != f.read_bytes())
    except Exception as e:  # noqa: BLE001 - reported, not fatal here
        info["fp4moe"] = f"import failed: {e}"
        info.setdefault("errors", []).append("fp4moe")
    try:
        import modelopt.torch.quantization  # noqa: F401
        info["modelopt_path"] = modelopt_path()
    except Exception as e:  # noqa: BLE001
        traceback.print_exc()
        info["modelopt_path"] = f"import failed: {type(e).__name__}: {e}"
        info.setdefault("errors", []).append("modelopt")
    return info


def part(res: dict, key: str, fn):
    """Runs one part of a step; an exception is recorded under res[key] and in res['errors']."""
    t = time.time()
    try:
        res[key] = fn()
    except Exception as e:  # noqa: BLE001 - every part is reported
        traceback.print_exc()
        res[key] = {"error": f"{type(e).__name__}: {e}"}
        res.setdefault("errors", []).append(key)
    print(f"-- {key}: {time.time() - t:.1f} s", flush=True)


def modelopt_path() -> dict:
    """Which fake-quantization code ModelOpt runs here for NVFP4 (its Triton kernel on a GPU of compute >= 8.9)."""
    from modelopt.torch.kernels.quantization import gemm as triton_kernel
    return {"triton_available": bool(triton_kernel.IS_AVAILABLE),
            "fp4_fake_quant_block": hasattr(triton_kernel, "fp4_fake_quant_block")}


FALLBACK = {}  # set once ModelOpt's kernel raised (or cannot run) on the GPU: {"reason": ...}


def with_modelopt(mpc, fn) -> dict:
    """fn() (a dict) with ModelOpt's own CUDA fake quantization (its Triton kernel). Where that kernel is missing or
    raises, fn() once more with ModelOpt's NVFP4QTensor code on the GPU tensors (the route the CPU-made files took,
    see make_producer_checkpoints.modelopt_cpu_fake_quant), so that the other comparisons still run; the result
    says which ran. ModelOpt's other CUDA route, an extension it compiles with nvcc at first use, is not tried: it
    takes minutes."""
    if device() == "cpu":
        out = fn()
        out["fake_quant"] = "ModelOpt NVFP4QTensor on the CPU"
        return out
    if not FALLBACK:
        path = modelopt_path()
        if path["triton_available"] and path["fp4_fake_quant_block"]:
            try:
                out = fn()
                out["fake_quant"] = "ModelOpt CUDA kernel (Triton fp4_fake_quant_block)"
                return out
            except Exception as e:  # noqa: BLE001 - retried below, reported
                traceback.print_exc()
                FALLBACK["reason"] = f"the kernel raised {type(e).__name__}: {e}"
        else:
            FALLBACK["reason"] = f"no Triton kernel ({path})"
    mpc.modelopt_cpu_fake_quant(on_cuda=True)
    out = fn()
    out["fake_quant"] = f"ModelOpt NVFP4QTensor on the GPU: {FALLBACK['reason']}"
    return out


# ---- references ------------------------------------------------------------------------------------------------

def tensor_diff(mine: dict, theirs: dict) -> dict:
    """The GPU-exported checkpoint's tensors (mine) against the committed ones, by kind."""
    import torch
    out = {"only_gpu": sorted(set(mine) - set(theirs)), "only_committed": sorted(set(theirs) - set(mine)),
           "tensors": 0, "identical": 0}
    packed = [0, 0]
    scales = [0, 0, 0.0]
    worst = {}
    for k in sorted(set(mine) & set(theirs)):
        a, b = mine[k], theirs[k]
        out["tensors"] += 1
        if a.dtype != b.dtype or a.shape != b.shape:
            out.setdefault("mismatched", []).append(f"{k}: {a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}")
            continue
        if torch.equal(a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a,
                       b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b):
            out["identical"] += 1
        if a.dtype == torch.uint8:  # packed E2M1 pairs
            na = torch.stack([a & 15, a >> 4], -1)
            nb = torch.stack([b & 15, b >> 4], -1)
            packed[0] += int((na != nb).sum())
            packed[1] += na.numel()
        elif a.dtype == torch.float8_e4m3fn:  # block scales
            fa, fb = a.float(), b.float()
            scales[0] += int((fa != fb).sum())
            scales[1] += fa.numel()
            scales[2] = max(scales[2], float(((fa - fb).abs() / fb.abs().clamp_min(1e-30)).max()))
        else:
            kind = k.rsplit(".", 1)[-1] if a.dtype == torch.float32 else "float weights"
            d = (a.double() - b.double()).abs().max()
            rel = float(d / b.double().abs().max().clamp_min(1e-30))
            worst[kind] = max(worst.get(kind, 0.0), rel)
    out["packed_nibbles_differing"] = packed[0] / max(1, packed[1])
    out["block_scales_differing"] = scales[0] / max(1, scales[1])
    out["block_scales_max_rel"] = scales[2]
    out["max_rel_by_kind"] = worst
    return out


def read_checkpoint(d: Path) -> dict:
    from safetensors.torch import load_file
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def reference_case(mpc, case: str, work: Path) -> dict:
    import torch
    from safetensors.torch import load_file
    from modelopt.torch.export import export_hf_checkpoint
    dev = device()
    d = DATA / case
    info = json.loads((d / "versions.json").read_text())
    committed = load_file(str(d / "reference.safetensors"))
    model, ref_model, block_name, layer = mpc.modelopt_quantized(builders(mpc)[case], dev)
    assert block_name == info["block"], (block_name, info["block"])
    x = mpc.reference_input(model.config.hidden_size)
    res = {"x_identical": bool(torch.equal(x.float(), committed["x"]))}
    y, logits = mpc.block_forward(mpc.get_module(ref_model, block_name), x.to(dev))
    res["y"] = compare(committed["y"], y.float())  # the committed CPU-made output against the GPU-made one
    res["router_logits"] = compare(committed["router_logits"], logits)
    export = work / "export" / case
    shutil.rmtree(export, ignore_errors=True)  # a first try may have written it
    export_hf_checkpoint(model, export_dir=str(export))
    res["checkpoint"] = tensor_diff(read_checkpoint(export), read_checkpoint(d / "checkpoint"))
    torch.save({"y": y.float().cpu(), "router_logits": logits.cpu()}, work / f"gpu_reference_{case}.pt")
    return res


def cmd_references(a) -> dict:
    mpc = producer_tools()
    work = Path(a.work)
    res = {"device": device()}
    if res["device"] == "cuda":
        part(res, "modelopt_path", modelopt_path)
    for case in MODELOPT_CASES:
        part(res, case, lambda c=case: with_modelopt(mpc, lambda: reference_case(mpc, c, work)))
    return res


# ---- blocks ----------------------------------------------------------------------------------------------------

def block_case(case: str) -> dict:
    import torch
    import fp4moe
    from safetensors.torch import load_file
    d = DATA / case
    info = json.loads((d / "versions.json").read_text())
    ref = load_file(str(d / "reference.safetensors"))
    dev = device()
    x = ref["x"].to(torch.bfloat16)
    res = {}
    outs = {}
    for where in ([dev, "cpu"] if dev != "cpu" else ["cpu"]):
        layer = fp4moe.load_moe_layer(d / "checkpoint", info["layer"], device=where)
        xin = x.to(where)
        logits = layer.router_logits(xin)  # a torch tensor on x's device
        for mode in ("a4", "a16"):
            y = fp4moe.moe(xin, layer.weights, routing_logits=logits, **layer.moe_kwargs(mode=mode))
            outs[(where, mode)] = y.float().cpu()
        res[f"router_logits_{where}"] = compare(logits, ref["router_logits"])
    for mode in ("a4", "a16"):
        res[f"{dev}_{mode}_vs_producer"] = compare(outs[(dev, mode)], ref["y"])
        if dev != "cpu":
            res[f"{dev}_{mode}_vs_cpu_backend"] = compare(outs[(dev, mode)], outs[("cpu", mode)])
            res[f"cpu_{mode}_vs_producer"] = compare(outs[("cpu", mode)], ref["y"])
    return res


def cmd_blocks(a) -> dict:
    res = {"device": device()}
    for case in ALL_CASES:
        part(res, case, lambda c=case: block_case(c))
    return res


# ---- swap ------------------------------------------------------------------------------------------------------

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def decode_nvfp4(packed, block_scale, scale2):
    """A ModelOpt NVFP4 linear's weight [N, K] in fp32: E2M1 codes (element 2i in the low nibble) times the E4M3
    block scale of each 16 elements times the per-tensor weight_scale_2."""
    import torch
    lut = torch.tensor(E2M1, dtype=torch.float32)
    codes = torch.stack([packed & 15, packed >> 4], -1).reshape(packed.shape[0], -1).long()
    vals = lut[codes]
    s = block_scale.float().repeat_interleave(16, dim=1)
    return vals * s * scale2.float()


def load_into_transformers(ckdir: Path):
    """A transformers model of the checkpoint's config whose weights are the checkpoint's: float tensors as
    stored, NVFP4 linears decoded to bf16, the experts' linears stacked into the fused gate_up_proj / down_proj."""
    import re
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    cfg = AutoConfig.from_pretrained(str(ckdir))
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    raw = read_checkpoint(ckdir)
    dense, experts = {}, {}
    for k, t in raw.items():
        if k.endswith((".weight_scale", ".weight_scale_2", ".input_scale")):
            continue
        if t.dtype == torch.uint8:
            base = k[:-len(".weight")]
            t = decode_nvfp4(t, raw[base + ".weight_scale"], raw[base + ".weight_scale_2"])
        t = t.to(torch.bfloat16)
        m = re.fullmatch(r"(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight", k)
        if m:
            experts.setdefault(m.group(1), {})[(int(m.group(2)), m.group(3))] = t
        else:
            dense[k] = t
    for prefix, parts in experts.items():
        E = 1 + max(e for e, _ in parts)
        dense[prefix + ".gate_up_proj"] = torch.stack(
            [torch.cat([parts[(e, "gate_proj")], parts[(e, "up_proj")]], 0) for e in range(E)])
        dense[prefix + ".down_proj"] = torch.stack([parts[(e, "down_proj")] for e in range(E)])
    params = dict(model.named_parameters())
    for k, t in dense.items():
        if k in params and getattr(model.get_submodule(k.rsplit(".", 1)[0]), "is_transposed", False):
            dense[k] = t.transpose(1, 2).contiguous()
    missing, unexpected = model.load_state_dict(dense, strict=False)
    if missing or unexpected:
        raise RuntimeError(f"checkpoint -> model: missing {missing}, unexpected {unexpected}")
    return model


def token_ids(vocab: int):
    import torch
    g = torch.Generator().manual_seed(4321)
    return torch.randint(0, vocab, (2, 24), generator=g)


def run_logits(model, ids):
    import torch
    with torch.no_grad():
        return model(input_ids=ids.to(next(model.parameters()).device)).logits.float().cpu()


def cmd_swap(a) -> dict:
    import fp4moe.hf
    mpc = producer_tools()
    dev = device()
    ckdir = DATA / SWAP_CASE / "checkpoint"
    res = {"device": dev, "case": SWAP_CASE, "tokens": [2, 24]}
    logits = {}

    def unquantized():
        model, _, _ = mpc.init_model(mpc.qwen3_moe_model)
        logits["unquantized"] = run_logits(model.to(dev), token_ids(model.config.vocab_size))
        return {"shape": list(logits["unquantized"].shape)}

    def modelopt_fake_quant():
        _, ref_model, _, _ = mpc.modelopt_quantized(mpc.qwen3_moe_model, dev)
        logits["modelopt"] = run_logits(ref_model, token_ids(ref_model.config.vocab_size))
        return {}

    swapped = {}

    def fp4moe_swap():
        model = load_into_transformers(ckdir)
        ids = token_ids(model.config.vocab_size)
        model_cpu = copy.deepcopy(model)
        model = model.to(dev)
        logits["transformers"] = run_logits(model, ids)  # the decoded weights, run by transformers
        swap = fp4moe.hf.swap_moe_blocks(model, checkpoint=ckdir)
        blocks = {n: repr(b) for n, b in swap.blocks.items()}
        logits["fp4moe"] = run_logits(model, ids)
        swapped["device"] = str(next(iter(swap.blocks.values())).weights.device) if swap.blocks else None
        if dev != "cpu":  # the same swap on fp4moe's CPU backend
            fp4moe.hf.swap_moe_blocks(model_cpu, checkpoint=ckdir, device="cpu")
            logits["fp4moe_cpu"] = run_logits(model_cpu, ids)
        swap.restore()
        logits["restored"] = run_logits(model, ids)
        return {"blocks": blocks, "weights_device": swapped["device"]}

    part(res, "unquantized", unquantized)
    part(res, "fp4moe_swap", fp4moe_swap)
    part(res, "modelopt_fake_quant", lambda: with_modelopt(mpc, modelopt_fake_quant))
    pairs = [("fp4moe", "modelopt"), ("fp4moe", "transformers"), ("fp4moe", "unquantized"),
             ("fp4moe", "fp4moe_cpu"), ("transformers", "modelopt"), ("modelopt", "unquantized"),
             ("transformers", "unquantized"), ("restored", "transformers")]
    res["logits"] = {f"{p} vs {q}": compare_logits(logits[p], logits[q]) for p, q in pairs
                     if p in logits and q in logits}
    return res


# ---- summary ---------------------------------------------------------------------------------------------------

def fmt(c) -> str:
    if not isinstance(c, dict) or "rel_l2" not in c:
        return str(c)
    s = f"rel L2 {c['rel_l2']:.3g}, max abs {c['max_abs']:.3g} (ref max {c['ref_max_abs']:.3g})"
    return s + (f", top-1 {c['top1']:.3f}" if "top1" in c else "")


def cmd_summary(a) -> dict:
    work = Path(a.work)
    res = {}
    for step in ("install", "environment", "references", "blocks", "swap"):
        f = work / f"{step}.json"
        res[step] = json.loads(f.read_text()) if f.is_file() else "not run"
    lines = ["# Producer files on the GPU host", "", "```", json.dumps(res.get("environment"), indent=1), "```", ""]
    ref = res["references"]
    if isinstance(ref, dict):
        lines += ["## References: committed (ModelOpt CPU path) against ModelOpt's CUDA path", "",
                  f"ModelOpt fake-quant path: {ref.get('modelopt_path')}", ""]
        for case in MODELOPT_CASES:
            r = ref.get(case, {})
            if "error" in r:
                lines.append(f"- {case}: ERROR {r['error']}")
                continue
            ck = r.get("checkpoint", {})
            lines += [f"- {case} ({r.get('fake_quant')}): y {fmt(r.get('y'))}; router logits "
                      f"{fmt(r.get('router_logits'))}",
                      f"  checkpoint: {ck.get('identical')}/{ck.get('tensors')} tensors identical, packed nibbles "
                      f"differing {ck.get('packed_nibbles_differing', 0):.4g}, block scales differing "
                      f"{ck.get('block_scales_differing', 0):.4g} (max rel {ck.get('block_scales_max_rel', 0):.3g}), "
                      f"max rel by kind {ck.get('max_rel_by_kind')}"]
        lines.append("")
    blk = res["blocks"]
    if isinstance(blk, dict):
        lines += ["## fp4moe.moe on the committed inputs", ""]
        for case in ALL_CASES:
            r = blk.get(case, {})
            if "error" in r:
                lines.append(f"- {case}: ERROR {r['error']}")
                continue
            for k, v in r.items():
                lines.append(f"- {case} {k}: {fmt(v)}")
        lines.append("")
    sw = res["swap"]
    if isinstance(sw, dict):
        lines += [f"## swap_moe_blocks({SWAP_CASE}) whole-model logits, tokens {sw.get('tokens')}", ""]
        for k in ("unquantized", "modelopt_fake_quant", "fp4moe_swap"):
            if isinstance(sw.get(k), dict) and "error" in sw[k]:
                lines.append(f"- {k}: ERROR {sw[k]['error']}")
        lines.append(f"- ModelOpt: {sw.get('modelopt_fake_quant', {}).get('fake_quant')}; fp4moe weights on "
                     f"{sw.get('fp4moe_swap', {}).get('weights_device')}")
        for k, v in sw.get("logits", {}).items():
            lines.append(f"- {k}: {fmt(v)}")
        lines.append("")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(res, indent=1) + "\n")
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    return {}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("step", choices=("install", "environment", "references", "blocks", "swap", "summary"))
    ap.add_argument("--work", default=os.path.join(tempfile.gettempdir(), "producer-gpu-check"))
    ap.add_argument("--out", default=".", help="summary: where results.json and summary.md go")
    ap.add_argument("--wheels", default=".whl-gpuhost", help="install: the folder of wheels")
    ap.add_argument("--target", default=os.path.join(tempfile.gettempdir(), "site"), help="install: the target")
    a = ap.parse_args(argv)
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    t = time.time()
    fn = {"install": cmd_install, "environment": lambda _: environment(), "references": cmd_references,
          "blocks": cmd_blocks, "swap": cmd_swap, "summary": cmd_summary}[a.step]
    absent = stand_ins() if a.step in ("environment", "references", "swap") else []
    res = fn(a)
    if a.step == "summary":
        return 0
    if absent:
        res["stand_ins"] = absent
    res["seconds"] = round(time.time() - t, 1)
    text = json.dumps(res, indent=1)
    (work / f"{a.step}.json").write_text(text + "\n")
    print(text)
    return 1 if res.get("errors") else 0


if __name__ == "__main__":
    sys.exit(main())
