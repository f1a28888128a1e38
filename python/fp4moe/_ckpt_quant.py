"""Quantization configs (ModelOpt, compressed-tensors) and the tensors of one linear (fp4moe.checkpoint)."""
from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from ._ckpt_files import _FLOAT_DTYPES, Checkpoint, ErrorCode, _fail, _TensorRef


# ---- quantization configs --------------------------------------------------------------------------------

@dataclass
class _QuantConfig:
    method: str          # "modelopt" | "compressed-tensors" | "mxfp4" | "none"
    algo: str            # ModelOpt quant_algo ("NVFP4", "W4A16_NVFP4", "MIXED_PRECISION") or the CT format
    source: str          # the file it was read from
    a4: bool = False     # activations quantized to NVFP4 too (W4A4)
    exclude: list = field(default_factory=list)
    layers: Optional[dict] = None  # ModelOpt MIXED_PRECISION: module -> its algo
    ct_targets: list = field(default_factory=list)

    _MODELOPT_OK = {"NVFP4": True, "W4A16_NVFP4": False}  # algo -> activations in NVFP4

    @staticmethod
    def detect(ck: "Checkpoint") -> "_QuantConfig":
        hq = ck.hf_quant_config
        qc = (ck.config or {}).get("quantization_config") if isinstance(ck.config, dict) else None
        if hq is not None:
            q = hq.get("quantization", hq) if isinstance(hq, dict) else None
            return _QuantConfig._modelopt(q, str(ck.path / "hf_quant_config.json"))
        if qc is None:
            return _QuantConfig("none", "", str(ck.path / "config.json"))
        src = str(ck.path / "config.json")
        if not isinstance(qc, dict):
            raise _fail(f"{src}: expected \"quantization_config\" to be an object")
        method = str(qc.get("quant_method", "")).lower()
        if method == "modelopt":
            return _QuantConfig._modelopt(qc.get("quantization", qc), src)
        if method == "compressed-tensors":
            return _QuantConfig._compressed_tensors(qc, src)
        if method == "mxfp4":  # gpt-oss: the fused experts' *_blocks / *_scales, everything else unquantized
            return _QuantConfig("mxfp4", "MXFP4", src, False,
                                [str(x) for x in (qc.get("modules_to_not_convert") or [])])
        raise _fail(f"{src}: unknown quantization config quant_method={qc.get('quant_method')!r} (fp4moe reads "
                    f"'modelopt' NVFP4, 'compressed-tensors' nvfp4-pack-quantized and 'mxfp4' gpt-oss experts)",
                    ErrorCode.Unsupported)

    @staticmethod
    def _modelopt(q, src) -> "_QuantConfig":
        if not isinstance(q, dict) or "quant_algo" not in q:
            raise _fail(f"{src}: expected a ModelOpt quantization section with \"quant_algo\"")
        algo = str(q["quant_algo"]).upper()
        gs = q.get("group_size", 16)
        if gs not in (None, 16):
            raise _fail(f"{src}: expected NVFP4 group_size 16, got {gs}", ErrorCode.Unsupported)
        # "exclude_modules" in hf_quant_config.json, "ignore" in config.json (ModelOpt's export, as vLLM reads them)
        excl = [str(x) for x in (q.get("exclude_modules") or []) + (q.get("ignore") or [])]
        if algo == "MIXED_PRECISION":
            ql = q.get("quantized_layers")
            if not isinstance(ql, dict):
                raise _fail(f"{src}: MIXED_PRECISION needs a \"quantized_layers\" object")
            layers = {str(k): str(v.get("quant_algo", "")).upper() if isinstance(v, dict) else str(v).upper()
                      for k, v in ql.items()}
            a4 = any(v == "NVFP4" for v in layers.values())
            return _QuantConfig("modelopt", algo, src, a4, excl, layers)
        if algo not in _QuantConfig._MODELOPT_OK:
            raise _fail(f"{src}: unsupported ModelOpt quant_algo {q['quant_algo']!r} (fp4moe reads NVFP4, "
                        f"W4A16_NVFP4 and MIXED_PRECISION of those)", ErrorCode.Unsupported)
        return _QuantConfig("modelopt", algo, src, _QuantConfig._MODELOPT_OK[algo], excl)

    @staticmethod
    def _compressed_tensors(qc, src) -> "_QuantConfig":
        groups = qc.get("config_groups")
        if not isinstance(groups, dict) or not groups:
            raise _fail(f"{src}: compressed-tensors config without \"config_groups\"")
        top_fmt = qc.get("format")
        targets, a4s = [], set()
        for gname, g in groups.items():
            fmt = g.get("format", top_fmt) if isinstance(g, dict) else None
            w = g.get("weights") if isinstance(g, dict) else None
            if fmt != "nvfp4-pack-quantized":
                raise _fail(f"{src}: config group '{gname}': unsupported compressed-tensors format {fmt!r} "
                            f"(fp4moe reads nvfp4-pack-quantized)", ErrorCode.Unsupported)
            if not isinstance(w, dict) or w.get("num_bits") != 4 or w.get("type") != "float" or \
                    w.get("group_size") != 16:
                raise _fail(f"{src}: config group '{gname}': expected 4-bit float weights in groups of 16, "
                            f"got {w!r}", ErrorCode.Unsupported)
            ia = g.get("input_activations")
            if ia is None:
                a4s.add(False)
            elif ia.get("num_bits") == 4 and ia.get("type") == "float":
                a4s.add(True)
            else:
                raise _fail(f"{src}: config group '{gname}': activations of {ia.get('num_bits')} bits "
                            f"({ia.get('type')}) are not NVFP4 or 16-bit", ErrorCode.Unsupported)
            targets += [str(t) for t in g.get("targets", [])]
        return _QuantConfig("compressed-tensors", "nvfp4-pack-quantized", src, True in a4s,
                            [str(x) for x in (qc.get("ignore") or [])], None, targets)

    def describe(self) -> str:
        if self.method == "none":
            return "none (unquantized)"
        if self.method == "mxfp4":
            return "mxfp4 (W4A16)"
        return f"{self.method} {self.algo}" + (" (W4A4)" if self.a4 else " (W4A16)")

    def quantized(self, module: str) -> bool:
        """Whether the config says `module` (a linear's name, without .weight) is NVFP4."""
        if self.method in ("none", "mxfp4"):  # mxfp4 quantizes only gpt-oss's fused experts
            return False
        if self.method == "modelopt":
            if any(_modelopt_excludes(p, module) for p in self.exclude):
                return False
            if self.layers is not None:
                m = module
                while m:
                    if m in self.layers:
                        return self.layers[m] in ("NVFP4", "W4A16_NVFP4")
                    m = m.rpartition(".")[0]
                return False
            return True
        for p in self.exclude:  # compressed-tensors "ignore": names or "re:" patterns
            if (p.startswith("re:") and re.match(p[3:], module)) or module == p:
                return False
        for t in self.ct_targets:
            if t == "Linear" or (t.startswith("re:") and re.match(t[3:], module)) or module == t:
                return True
        return False


def _modelopt_excludes(pattern: str, module: str) -> bool:
    """Whether a ModelOpt exclude_modules / ignore entry covers `module` (a linear), as vLLM reads them: an fnmatch
    pattern naming the module or one that holds it (vLLM matches the MoE block `...mlp.experts`), and a trailing
    'path*' (ModelOpt's spelling) the module at path and what it holds, so 'model.layers.1*' is not layer 10."""
    if len(pattern) >= 2 and pattern[-1] == "*" and pattern[-2] != ".":
        pattern = pattern[:-1]
    m = module
    while m:
        if fnmatch.fnmatchcase(m, pattern):
            return True
        m = m.rpartition(".")[0]
    return False


# ---- one linear ------------------------------------------------------------------------------------------

@dataclass
class _Linear:
    """The tensors of one [N, K] linear: NVFP4 (weight, block scale, dequant scale2, input scale) or float."""
    module: str
    fmt: str                       # "nvfp4" | "bf16"
    weight: _TensorRef
    scale: Optional[_TensorRef] = None
    scale2: Optional[_TensorRef] = None
    scale2_inverse: bool = False   # compressed-tensors stores the encode scale
    input_scale: Optional[_TensorRef] = None
    input_inverse: bool = False
    input_name: str = ""           # the input scale's tensor name (NVFP4), present or not
    _scale2: Optional[np.float32] = field(default=None, repr=False)  # read once (checked, then used)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.weight, self.scale, self.scale2, self.input_scale) if t is not None)

    def read_scale2(self) -> np.float32:
        if self._scale2 is None:
            self._scale2 = _scalar_of(self.scale2, self.scale2_inverse)
        return self._scale2

    def read_input_scale(self) -> Optional[np.float32]:
        return None if self.input_scale is None else _scalar_of(self.input_scale, self.input_inverse)


def _scalar_of(ref: _TensorRef, inverse: bool) -> np.float32:
    v = np.float32(ref.read().reshape(-1)[0])
    if not np.isfinite(v) or v <= 0:
        raise _fail(f"{ref.ckpt.file_of(ref.name)}: tensor '{ref.name}': expected a finite positive scale, got {v}")
    return np.float32(np.float32(1.0) / v) if inverse else v


def _scalar_ref(ck: Checkpoint, name: str) -> _TensorRef:
    dt, sh = ck.meta(name)
    if dt != "F32" or int(np.prod(sh, dtype=np.int64)) != 1:
        raise _fail(f"{ck.file_of(name)}: tensor '{name}': expected an F32 scalar ([] or [1]), got {dt} {list(sh)}")
    return _TensorRef(ck, name, dt, sh)


def _nvfp4_linear(ck: Checkpoint, module: str, weight: str, scale2: str, input_name: str, read_input: bool,
                  inverse: bool, n: int, k: int, where: str) -> _Linear:
    """The NVFP4 tensors of module under one producer's names: packed values, block scales, global scale, input
    scale (read when asked and present; absent: the layer runs A16, _ckpt_read._a4_scales)."""
    w = ck.tensor(weight, ("U8",), (n, k // 2), where)
    s = ck.tensor(module + ".weight_scale", ("F8_E4M3",), (n, k // 16), where)
    s2 = _scalar_ref(ck, module + scale2)
    iname = module + input_name
    ins = _scalar_ref(ck, iname) if read_input and ck.has(iname) else None
    return _Linear(module, "nvfp4", w, s, s2, inverse, ins, inverse, iname)


def _linear(ck: Checkpoint, module: str, n: int, k: int) -> _Linear:
    """Finds and checks module's tensors for an [n, k] weight; the format comes from the tensors and must agree
    with the quantization config."""
    q = ck.quant
    want_q = q.quantized(module)
    where = f" for a [{n}, {k}] weight"
    if ck.has(module + ".weight_packed"):  # compressed-tensors
        if q.method != "compressed-tensors":
            raise _fail(f"{ck.file_of(module + '.weight_packed')}: tensor '{module}.weight_packed' is "
                        f"compressed-tensors NVFP4 but the checkpoint's quantization config is {q.describe()}")
        lin = _nvfp4_linear(ck, module, module + ".weight_packed", ".weight_global_scale", ".input_global_scale",
                            q.a4, True, n, k, where)
    elif ck.has(module + ".weight"):
        dt, _ = ck.meta(module + ".weight")
        if dt == "U8":
            if q.method != "modelopt":
                raise _fail(f"{ck.file_of(module + '.weight')}: tensor '{module}.weight' is packed uint8 (ModelOpt "
                            f"NVFP4) but the checkpoint's quantization config is {q.describe()}")
            lin = _nvfp4_linear(ck, module, module + ".weight", ".weight_scale_2", ".input_scale", True, False, n, k,
                                where)
            if ck.has(module + ".pre_quant_scale"):
                raise _fail(f"{ck.file_of(module + '.weight')}: tensor '{module}.pre_quant_scale': AWQ-smoothed "
                            f"NVFP4 experts are not supported", ErrorCode.Unsupported)
        elif dt in _FLOAT_DTYPES:
            if ck.has(module + ".weight_scale"):
                raise _fail(f"{ck.file_of(module + '.weight_scale')}: tensor '{module}.weight_scale' beside a {dt} "
                            f"weight: an unknown quantization (expected NVFP4 uint8 weights)", ErrorCode.Unsupported)
            lin = _Linear(module, "bf16", ck.tensor(module + ".weight", _FLOAT_DTYPES, (n, k), where))
        else:
            raise _fail(f"{ck.file_of(module + '.weight')}: tensor '{module}.weight': expected dtype U8 (NVFP4) or "
                        f"BF16/F16/F32, got {dt}")
    else:
        raise _fail(f"{ck.path}: tensor '{module}.weight' is missing", ErrorCode.NotFound)
    if (lin.fmt == "nvfp4") != want_q:
        state = "NVFP4" if lin.fmt == "nvfp4" else "unquantized"
        raise _fail(f"{ck.file_of(lin.weight.name)}: tensor '{lin.weight.name}' is {state} but {q.source} "
                    f"{'quantizes' if want_q else 'excludes'} module '{module}'")
    return lin
