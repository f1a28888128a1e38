"""NVFP4 MoE layers read straight from real checkpoints (ModelOpt, compressed-tensors, bf16).

    import fp4moe
    layer = fp4moe.load_moe_layer("/models/Qwen3-30B-A3B-NVFP4", 3, device="cuda")
    y = fp4moe.moe(x, layer.weights, routing_logits=x @ layer.router.weight.T, **layer.moe_kwargs())

A checkpoint is a directory with safetensors shards (one file, several files, or shards listed by
model.safetensors.index.json), config.json, and for ModelOpt exports hf_quant_config.json. The format is read
from those files, never guessed; docs/checkpoints.md lists what is recognized and what is refused.
Only the tensors of the layer asked for are read, memory-mapped through the `safetensors` package.

    python -m fp4moe.checkpoint inspect CHECKPOINT     # layers, formats, shapes, bytes, what would load
"""
from __future__ import annotations

import fnmatch
import json
import os
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from ._enums import ActivationType, RoutingMethod, is_gated, parse_enum
from ._errors import ErrorCode, error
from ._tensors import BF16, E4M3

__all__ = ["Checkpoint", "MoeLayer", "Router", "load_moe_layer", "read_moe_layer", "inspect_checkpoint",
           "format_inspect"]

ARG = "checkpoint"

# safetensors dtype names -> NumPy dtypes (bf16 and e4m3 through ml_dtypes).
_NP_DTYPES = {"U8": np.dtype(np.uint8), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
              "F64": np.dtype(np.float64), "I32": np.dtype(np.int32), "I64": np.dtype(np.int64),
              "BF16": BF16, "F8_E4M3": E4M3}
_FLOAT_DTYPES = ("BF16", "F16", "F32")

# Projection names of one expert, per architecture family: (gate, up, down).
_PER_EXPERT_NAMES = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))


def _fail(what: str, code: ErrorCode = ErrorCode.InvalidArgument):
    return error(ARG, what, code)


def _safetensors():
    try:
        import safetensors  # noqa: F401
        from safetensors import safe_open
    except ImportError as e:  # an optional dependency: only checkpoint reading needs it
        raise _fail(f"reading checkpoints needs the 'safetensors' package (pip install safetensors): {e}",
                    ErrorCode.Unsupported) from None
    return safe_open


# ---- files ---------------------------------------------------------------------------------------------------

class _Shard:
    """One safetensors file: its header (validated by the safetensors package) and lazy tensor access."""

    def __init__(self, path: Path):
        safe_open = _safetensors()
        self.path = path
        try:
            self._f = safe_open(str(path), framework="np")
            self._keys = set(self._f.keys())
        except FileNotFoundError:
            raise _fail(f"{path}: the file is missing", ErrorCode.NotFound) from None
        except Exception as e:  # safetensors raises its own SafetensorError for malformed files
            raise _fail(f"{path}: not a valid safetensors file ({e}){_past_end(path)}") from None
        self._header = None

    def keys(self):
        return self._keys

    def meta(self, name: str) -> tuple[str, tuple[int, ...]]:
        sl = self._f.get_slice(name)
        return str(sl.get_dtype()), tuple(int(s) for s in sl.get_shape())

    def _offsets(self, name: str) -> tuple[int, int]:
        if self._header is None:
            with open(self.path, "rb") as f:
                n = int.from_bytes(f.read(8), "little")
                self._header = (8 + n, json.loads(f.read(n)))
        start, h = self._header
        b, e = h[name]["data_offsets"]
        return start + int(b), int(e) - int(b)

    def array(self, name: str, dtype: str, shape: tuple[int, ...]):
        """A read-only memory-mapped view of the tensor (nothing is read until it is indexed)."""
        try:
            if dtype == "F8_E4M3":
                # the safetensors package gives no NumPy view of float8 tensors: map the validated bytes directly
                off, nbytes = self._offsets(name)
                mm = np.memmap(self.path, dtype=np.uint8, mode="r", offset=off, shape=(nbytes,))
                return mm.view(E4M3).reshape(shape)
            return self._f.get_slice(name)
        except Exception as e:
            raise _fail(f"{self.path}: tensor '{name}' could not be mapped ({e})") from None


def _past_end(path: Path) -> str:
    """For a file the safetensors package refused: the tensors its header puts past the end, if any."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            h = json.loads(f.read(n)) if 0 < n < size else {}
        cut = [k for k, v in h.items() if k != "__metadata__" and 8 + n + int(v["data_offsets"][1]) > size]
    except Exception:  # the header itself is unreadable: the package's message says so
        return ""
    if not cut:
        return ""
    return f"; truncated: tensor '{cut[0]}'" + (f" and {len(cut) - 1} more" if len(cut) > 1 else "") + \
        f" end past the file's {size} bytes"


class Checkpoint:
    """A checkpoint directory: its config files and the table of its tensors (headers only, no tensor data)."""

    def __init__(self, path):
        p = Path(path)
        if p.is_file() and p.suffix == ".safetensors":
            root, files = p.parent, [p]
        elif p.is_dir():
            root, files = p, None
        else:
            raise _fail(f"{p}: expected a checkpoint directory (or a .safetensors file); it does not exist",
                        ErrorCode.NotFound)
        self.path = root
        self.config = self._json(root / "config.json")
        self.hf_quant_config = self._json(root / "hf_quant_config.json")
        self.quant = _QuantConfig.detect(self)
        self._shards: dict[str, _Shard] = {}
        self._where: dict[str, str] = {}
        index = root / "model.safetensors.index.json"
        if files is None and index.exists():
            doc = self._json(index)
            wm = doc.get("weight_map") if isinstance(doc, dict) else None
            if not isinstance(wm, dict):
                raise _fail(f"{index}: expected an object with a \"weight_map\" {{tensor: file}}")
            for name, fname in wm.items():
                if not isinstance(fname, str) or "/" in fname or "\\" in fname or fname.startswith("."):
                    raise _fail(f"{index}: tensor '{name}' maps to an unusable file name {fname!r}")
                self._where[name] = fname
            self.index = index
        else:
            if files is None:
                files = sorted(root.glob("*.safetensors"))
            if not files:
                raise _fail(f"{root}: no *.safetensors file and no model.safetensors.index.json",
                            ErrorCode.NotFound)
            for f in files:
                sh = self._shard(f.name)
                for k in sh.keys():
                    if k in self._where:
                        raise _fail(f"{f}: tensor '{k}' is also in {self._where[k]}")
                    self._where[k] = f.name
            self.index = None
        self.names = sorted(self._where)

    @staticmethod
    def _json(path: Path):
        if not path.exists():
            return None
        try:
            return json.loads(path.read_text())
        except (ValueError, UnicodeDecodeError) as e:
            raise _fail(f"{path}: not valid JSON ({e})") from None

    def _shard(self, fname: str) -> _Shard:
        sh = self._shards.get(fname)
        if sh is None:
            sh = self._shards[fname] = _Shard(self.path / fname)
        return sh

    def has(self, name: str) -> bool:
        return name in self._where

    def file_of(self, name: str) -> Path:
        return self.path / self._where[name]

    def meta(self, name: str) -> tuple[str, tuple[int, ...]]:
        """(dtype name as in the file, shape) of a tensor; errors name the file and the tensor."""
        if name not in self._where:
            raise _fail(f"{self.path}: tensor '{name}' is missing", ErrorCode.NotFound)
        sh = self._shard(self._where[name])
        if name not in sh.keys():
            raise _fail(f"{sh.path}: tensor '{name}' is missing (the index names this file for it)",
                        ErrorCode.NotFound)
        return sh.meta(name)

    def tensor(self, name: str, dtypes, shape=None, where=None) -> "_TensorRef":
        """A checked reference to a tensor: one of `dtypes`, of `shape` (None entries match anything)."""
        dt, sh = self.meta(name)
        f = self.file_of(name)
        if dt not in dtypes:
            raise _fail(f"{f}: tensor '{name}': expected dtype {' or '.join(dtypes)}, got {dt}")
        if shape is not None and (len(shape) != len(sh) or any(a is not None and a != b for a, b in zip(shape, sh))):
            want = "[" + ", ".join("*" if a is None else str(a) for a in shape) + "]"
            raise _fail(f"{f}: tensor '{name}': expected shape {want}{where or ''}, got {list(sh)}")
        return _TensorRef(self, name, dt, sh)

    def close(self) -> None:
        self._shards.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


@dataclass
class _TensorRef:
    ckpt: Checkpoint
    name: str
    dtype: str
    shape: tuple

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * _NP_DTYPES.get(self.dtype, np.dtype(np.uint8)).itemsize

    def read(self, index=None) -> np.ndarray:
        """The tensor (or `index` of it: a tuple of slices) as an owned NumPy array; only those bytes are read."""
        sh = self.ckpt._shard(self.ckpt._where[self.name])
        src = sh.array(self.name, self.dtype, self.shape)
        try:
            if index is None:
                out = src[...] if isinstance(src, np.ndarray) else (src[:] if self.shape else self._scalar(sh))
            else:
                out = src[index]
            out = np.array(out, copy=True)
        except Exception as e:  # a file shorter than its header says, or changed since it was opened
            raise _fail(f"{sh.path}: tensor '{self.name}' could not be read ({e})") from None
        if out.dtype.kind == "V" or (self.dtype in ("BF16", "F8_E4M3") and out.dtype != _NP_DTYPES[self.dtype]):
            out = out.view(np.uint8 if self.dtype == "F8_E4M3" else np.uint16).view(_NP_DTYPES[self.dtype])
        return out

    def _scalar(self, sh):
        return sh._f.get_tensor(self.name)


# ---- quantization configs --------------------------------------------------------------------------------

@dataclass
class _QuantConfig:
    method: str          # "modelopt" | "compressed-tensors" | "none"
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
        raise _fail(f"{src}: unknown quantization config quant_method={qc.get('quant_method')!r} (fp4moe reads "
                    f"'modelopt' NVFP4 and 'compressed-tensors' nvfp4-pack-quantized)", ErrorCode.Unsupported)

    @staticmethod
    def _modelopt(q, src) -> "_QuantConfig":
        if not isinstance(q, dict) or "quant_algo" not in q:
            raise _fail(f"{src}: expected a ModelOpt quantization section with \"quant_algo\"")
        algo = str(q["quant_algo"]).upper()
        gs = q.get("group_size", 16)
        if gs not in (None, 16):
            raise _fail(f"{src}: expected NVFP4 group_size 16, got {gs}", ErrorCode.Unsupported)
        excl = [str(x) for x in (q.get("exclude_modules") or [])]
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
        return f"{self.method} {self.algo}" + (" (W4A4)" if self.a4 else " (W4A16)")

    def quantized(self, module: str) -> bool:
        """Whether the config says `module` (a linear's name, without .weight) is NVFP4."""
        if self.method == "none":
            return False
        if self.method == "modelopt":
            if any(module == p or fnmatch.fnmatchcase(module, p) for p in self.exclude):
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

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.weight, self.scale, self.scale2, self.input_scale) if t is not None)

    def read_scale2(self) -> np.float32:
        return _scalar_of(self.scale2, self.scale2_inverse)

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
        w = ck.tensor(module + ".weight_packed", ("U8",), (n, k // 2), where)
        s = ck.tensor(module + ".weight_scale", ("F8_E4M3",), (n, k // 16), where)
        s2 = _scalar_ref(ck, module + ".weight_global_scale")
        ins = _scalar_ref(ck, module + ".input_global_scale") if q.a4 and ck.has(module + ".input_global_scale") \
            else None
        if q.a4 and ins is None:
            raise _fail(f"{ck.file_of(module + '.weight_packed')}: tensor '{module}.input_global_scale' is missing "
                        f"(the config quantizes activations)", ErrorCode.NotFound)
        lin = _Linear(module, "nvfp4", w, s, s2, True, ins, True)
    elif ck.has(module + ".weight"):
        dt, _ = ck.meta(module + ".weight")
        if dt == "U8":
            if q.method != "modelopt":
                raise _fail(f"{ck.file_of(module + '.weight')}: tensor '{module}.weight' is packed uint8 (ModelOpt "
                            f"NVFP4) but the checkpoint's quantization config is {q.describe()}")
            w = ck.tensor(module + ".weight", ("U8",), (n, k // 2), where)
            s = ck.tensor(module + ".weight_scale", ("F8_E4M3",), (n, k // 16), where)
            s2 = _scalar_ref(ck, module + ".weight_scale_2")
            ins = _scalar_ref(ck, module + ".input_scale") if ck.has(module + ".input_scale") else None
            if q.a4 and ins is None and q.algo != "MIXED_PRECISION":
                raise _fail(f"{ck.file_of(module + '.weight')}: tensor '{module}.input_scale' is missing "
                            f"(quant_algo {q.algo} quantizes activations)", ErrorCode.NotFound)
            if ck.has(module + ".pre_quant_scale"):
                raise _fail(f"{ck.file_of(module + '.weight')}: tensor '{module}.pre_quant_scale': AWQ-smoothed "
                            f"NVFP4 experts are not supported", ErrorCode.Unsupported)
            lin = _Linear(module, "nvfp4", w, s, s2, False, ins, False)
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


# ---- the layer plan (metadata only) -------------------------------------------------------------------------

@dataclass
class Router:
    """The router of an MoE layer and the routing that reproduces it (SPEC §3.1). weight [E, H] and bias [E]
    (added to the logits, GPT-OSS) are in the file's dtype; e_score_correction_bias [E] is the DeepSeek-V3
    selection bias (fp4moe's routing_bias)."""
    weight: Optional[np.ndarray]
    bias: Optional[np.ndarray]
    e_score_correction_bias: Optional[np.ndarray]
    routing_method: Optional[RoutingMethod]
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
    mode: str                     # "a4" when the checkpoint quantizes activations, else "a16"
    fc1_input_scale: float
    fc2_input_scale: float
    num_experts: int
    local_expert_offset: int
    num_local_experts: int
    bytes_read: int
    seconds: float

    def moe_kwargs(self, mode: Optional[str] = None) -> dict:
        """Keyword arguments of fp4moe.moe for this layer, besides x, weights and the routing logits. mode: the
        checkpoint's (None) or "a16" (the default on Hopper; input scales then unused)."""
        r = self.router
        kw = {"top_k": r.top_k, "routing_method": r.routing_method, "n_group": r.n_group,
              "topk_group": r.topk_group, "routed_scaling_factor": r.routed_scaling_factor,
              "activation": self.activation, "num_experts_total": self.num_experts,
              "local_expert_offset": self.local_expert_offset}
        if r.e_score_correction_bias is not None:
            kw["routing_bias"] = np.asarray(r.e_score_correction_bias, dtype=np.float32)
        for k in ("gemm1_alpha", "gemm1_beta", "gemm1_clamp_limit"):
            if getattr(self, k) is not None:
                kw[k] = getattr(self, k)
        if self.shared_expert is not None:
            kw["shared_expert"] = self.shared_expert
            if self.gemm1_alpha is not None or self.gemm1_beta is not None or self.gemm1_clamp_limit is not None:
                kw.update(shared_alpha=self.gemm1_alpha, shared_beta=self.gemm1_beta,
                          shared_clamp_limit=self.gemm1_clamp_limit)
        m = self.mode if mode is None else mode
        kw["mode"] = m
        if m == "a4":
            kw.update(fc1_input_scale=self.fc1_input_scale, fc2_input_scale=self.fc2_input_scale)
        return kw


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

    @property
    def nbytes(self) -> int:
        return self.routed.nbytes + (self.shared.nbytes if self.shared else 0) + sum(
            t.nbytes for t in (self.router_weight, self.router_bias, self.correction_bias) if t is not None)


def _model_type(ck: Checkpoint) -> str:
    c = ck.config if isinstance(ck.config, dict) else {}
    mt = str(c.get("model_type", ""))
    tc = c.get("text_config")
    if isinstance(tc, dict) and tc.get("model_type"):
        mt = str(tc["model_type"])
    return mt


def _text_config(ck: Checkpoint) -> dict:
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
    experts = []
    fmts = set()
    for e in (ids if ids else [None]):
        m = base if e is None else f"{base}{e}."
        gate = _linear(ck, m + g, I, H)
        up = _linear(ck, m + u, I, H) if gated else None
        down = _linear(ck, m + d, H, I)
        experts.append((gate, up, down))
        fmts |= {l.fmt for l in (gate, up, down) if l is not None}
    if len(fmts) > 1:
        raise _fail(f"{ck.path}: {what}: some experts are NVFP4 and some unquantized; one layer's experts must "
                    f"share one format")
    return _ExpertsPlan(fmts.pop(), gated, len(experts), H, I, experts)


def _plan_fused(ck: Checkpoint, base: str, layout: str, gated: bool) -> _ExpertsPlan:
    gu = base + "gate_up_proj"
    if ck.has(gu + "_blocks"):
        raise _fail(f"{ck.file_of(gu + '_blocks')}: tensor '{gu}_blocks' is MXFP4 (GPT-OSS release); fp4moe reads "
                    f"NVFP4 or bf16 experts", ErrorCode.Unsupported)
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
            arch = {"qwen3_moe": "Qwen3-MoE", "deepseek_v3": "DeepSeek-V3", "kimi_k2": "Kimi-K2",
                    "gpt_oss": "GPT-OSS"}.get(mt, mt or "per-expert MoE")
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
            if ck.has(mb + "shared_expert_gate.weight"):
                raise _fail(f"{ck.file_of(mb + 'shared_expert_gate.weight')}: tensor '{mb}shared_expert_gate.weight':"
                            f" a sigmoid-gated shared expert is not fp4moe's weight-1 shared expert",
                            ErrorCode.Unsupported)
            shared = _plan_experts(ck, sb, [], gated, f"layer {layer} shared expert")
            if shared.H != routed.H:
                raise _fail(f"{ck.path}: layer {layer}: the shared expert's H={shared.H} differs from the experts' "
                            f"H={routed.H}")
    H, E = routed.H, routed.E
    rw = rb = cb = None
    for rname in (mb + "gate.weight", mb + "router.weight"):
        if ck.has(rname):
            rw = ck.tensor(rname, _FLOAT_DTYPES, (E, H), " (the router [E, H])")
            bname = rname[:-len("weight")] + "bias"
            rb = ck.tensor(bname, _FLOAT_DTYPES, (E,)) if ck.has(bname) else None
    if ck.has(mb + "gate.e_score_correction_bias"):
        cb = ck.tensor(mb + "gate.e_score_correction_bias", _FLOAT_DTYPES, (E,))
    return _LayerPlan(layer, prefix, block, arch, routed, shared, rw, rb, cb)


# ---- configuration: routing and activation ----------------------------------------------------------------

def _routing_of(ck: Checkpoint, layer: int, E: int) -> dict:
    c = _text_config(ck)
    mt = _model_type(ck)
    k = int(c.get("num_experts_per_tok", c.get("experts_per_token", 0)) or 0)
    out = {"routing_method": None, "top_k": k, "num_experts": E, "n_group": 1, "topk_group": 1,
           "routed_scaling_factor": 1.0}
    if mt in ("qwen3_moe", "qwen2_moe", "qwen3_next"):
        out["routing_method"] = RoutingMethod.RenormalizeNaive if c.get("norm_topk_prob", True) else \
            RoutingMethod.Default
        out["num_experts"] = int(c.get("num_experts", E))
    elif mt in ("mixtral", "gpt_oss"):
        out["routing_method"] = RoutingMethod.Renormalize
        out["num_experts"] = int(c.get("num_local_experts", E))
    elif mt in ("deepseek_v3", "kimi_k2", "kimi_k25", "deepseek_v32"):
        if str(c.get("scoring_func", "sigmoid")) != "sigmoid":
            raise _fail(f"{ck.path / 'config.json'}: scoring_func {c.get('scoring_func')!r}: fp4moe's DeepSeekV3 "
                        f"routing scores with sigmoid", ErrorCode.Unsupported)
        out.update(routing_method=RoutingMethod.DeepSeekV3, num_experts=int(c.get("n_routed_experts", E)),
                   n_group=int(c.get("n_group", 1) or 1), topk_group=int(c.get("topk_group", 1) or 1),
                   routed_scaling_factor=float(c.get("routed_scaling_factor", 1.0) or 1.0))
    return out


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


# ---- reading ----------------------------------------------------------------------------------------------

def _window(E: int, ep) -> tuple[int, int]:
    if ep is None:
        return 0, E
    rank, world = (int(v) for v in ep)
    if world < 1 or not 0 <= rank < world or world > E:
        raise error("ep", f"expected (rank, world) with 0 <= rank < world <= E={E}, got {tuple(ep)}")
    base, extra = divmod(E, world)
    return rank * base + min(rank, extra), base + (1 if rank < extra else 0)


def _tp_slices(I: int, tp) -> tuple[int, int]:
    if tp is None:
        return 0, I
    rank, world = (int(v) for v in tp)
    if world < 1 or not 0 <= rank < world:
        raise error("tp", f"expected (rank, world) with 0 <= rank < world, got {tuple(tp)}")
    if I % world or (I // world) % 16:
        raise error("tp", f"I={I} split over world={world} must give a multiple of 16 per rank")
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
    in1, in2 = [], []
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
            if lin.input_scale is not None:
                in1.append(lin.read_input_scale())
        w2[i] = down.weight.read((slice(None), slice(t0 // 2, (t0 + ts) // 2)))
        s2[i] = down.scale.read((slice(None), slice(t0 // 16, (t0 + ts) // 16)))
        g2[i] = down.read_scale2()
        if down.input_scale is not None:
            in2.append(down.read_input_scale())
        prog.add(sum(l.nbytes for l in (gate, up, down) if l is not None) * ts // I)
    # A4: one per-tensor input scale for all experts, the largest (as vLLM's NVFP4 MoE loaders do).
    return {"w1": w1, "w1_scale": s1, "w1_scale2": g1, "w2": w2, "w2_scale": s2, "w2_scale2": g2,
            "fc1_input_scale": float(max(in1)) if in1 else 0.0, "fc2_input_scale": float(max(in2)) if in2 else 0.0}


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
            if plan.fused_layout == "gpt_oss_interleaved":  # columns g0 u0 g1 u1 ...
                gate_rows, up_rows = np.arange(0, 2 * I, 2), np.arange(1, 2 * I, 2)
            else:
                gate_rows, up_rows = np.arange(I), np.arange(I, 2 * I)
            dn = f["down"].read((es,)).transpose(0, 2, 1)
        else:
            gu = f["gate_up"].read((es,))
            gate_rows, up_rows = np.arange(I), np.arange(I, 2 * I)
            dn = f["down"].read((es,))
        sel = np.concatenate([gate_rows[t0:t0 + ts], up_rows[t0:t0 + ts]]) if plan.gated else np.arange(t0, t0 + ts)
        out = {"w1": np.ascontiguousarray(_to_bf16(gu[:, sel])),
               "w2": np.ascontiguousarray(_to_bf16(dn[:, :, t0:t0 + ts]))}
        if f["bias1"] is not None:
            out["bias1"] = np.ascontiguousarray(f["bias1"].read((es,)).astype(np.float32)[:, sel])
        if f["bias2"] is not None and rank0:
            out["bias2"] = np.ascontiguousarray(f["bias2"].read((es,)).astype(np.float32))
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


def read_moe_layer(checkpoint, layer: int, *, tp=None, ep=None, activation=None, fused_layout=None,
                   shared_expert: bool = True, progress=None) -> dict:
    """One MoE layer of a checkpoint as host NumPy arrays, before preparation (see load_moe_layer).

    Returns {"format": "nvfp4" | "bf16", "routed": prepare_weights (or prepare_bf16_weights) keyword
    arguments, "shared": the same for the shared expert or None, "router": Router, "activation": (type,
    alpha, beta, clamp_limit), "mode", "fc1_input_scale", "fc2_input_scale", "architecture", "quantization",
    "num_experts", "local_expert_offset", "num_local_experts", "bytes_read", "seconds"}."""
    t_start = time.perf_counter()
    own = not isinstance(checkpoint, Checkpoint)
    ck = Checkpoint(checkpoint) if own else checkpoint
    try:
        act = _activation_of(ck, activation)
        gated = is_gated(act[0])
        plan = _plan_layer(ck, int(layer), gated, fused_layout)
        R = plan.routed
        e0, ne = _window(R.E, ep)
        t0, ts = _tp_slices(R.I, tp)
        rank0 = tp is None or int(tp[0]) == 0
        sh_t = None
        if plan.shared is not None and shared_expert:
            sh_t = _tp_slices(plan.shared.I, tp)
        routing = _routing_of(ck, int(layer), R.E)
        if routing["num_experts"] != R.E:
            raise _fail(f"{ck.path / 'config.json'}: {routing['num_experts']} experts, but layer {layer} of the "
                        f"files has {R.E}")
        total = (R.nbytes * ne // R.E) * ts // R.I + (plan.shared.nbytes if sh_t else 0)
        prog = _Progress(total, progress, f"fp4moe: layer {layer}")
        local = R.experts[e0:e0 + ne]
        if R.fmt == "nvfp4":
            routed = _read_nvfp4(R, local, t0, ts, prog)
        else:
            routed = _read_bf16(R, local, e0, ne, t0, ts, rank0, prog)
        fc1 = routed.pop("fc1_input_scale", 0.0)
        fc2 = routed.pop("fc2_input_scale", 0.0)
        shared = None
        if sh_t is not None:
            S = plan.shared
            shared = (_read_nvfp4(S, S.experts, sh_t[0], sh_t[1], prog) if S.fmt == "nvfp4"
                      else _read_bf16(S, S.experts, 0, 1, sh_t[0], sh_t[1], rank0, prog))
            shared.pop("fc1_input_scale", None)
            shared.pop("fc2_input_scale", None)
        router = Router(plan.router_weight.read() if plan.router_weight else None,
                        plan.router_bias.read() if plan.router_bias else None,
                        plan.correction_bias.read() if plan.correction_bias else None, **routing)
        mode = "a4" if (R.fmt == "nvfp4" and ck.quant.a4 and fc1 > 0 and fc2 > 0) else "a16"
        return {"format": R.fmt, "routed": routed, "shared": shared, "router": router, "activation": act,
                "mode": mode, "fc1_input_scale": fc1, "fc2_input_scale": fc2, "architecture": plan.architecture,
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
    ep=(rank, world): this rank's experts (fp4moe.distributed.expert_window). Only those bytes are read.
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
                    d["seconds"])


# ---- inspect ------------------------------------------------------------------------------------------------

def inspect_checkpoint(checkpoint, *, activation=None, fused_layout=None) -> dict:
    """What a checkpoint holds and what load_moe_layer would do with each MoE layer (headers only)."""
    ck = Checkpoint(checkpoint) if not isinstance(checkpoint, Checkpoint) else checkpoint
    files = sorted(set(ck._where.values()))
    out = {"path": str(ck.path), "files": files, "index": ck.index is not None, "tensors": len(ck.names),
           "bytes": sum(os.path.getsize(ck.path / f) for f in files if (ck.path / f).exists()),
           "model_type": _model_type(ck) or None, "quantization": ck.quant.describe(), "layers": []}
    try:
        act = _activation_of(ck, activation)
        out["activation"] = act[0].name
    except Exception as e:
        act = None
        out["activation"] = f"unknown ({e})"
    for L in moe_layers(ck):
        row = {"layer": L}
        try:
            p = _plan_layer(ck, L, is_gated(act[0]) if act else True, fused_layout)
            R = p.routed
            row.update(architecture=p.architecture, format=R.fmt, experts=R.E, H=R.H, I=R.I, bytes=p.nbytes,
                       shared=None if p.shared is None else f"{p.shared.fmt} I={p.shared.I}",
                       router=p.router_weight is not None, correction_bias=p.correction_bias is not None)
            if act is None:
                raise _fail("no activation: pass activation=")
            routing = _routing_of(ck, L, R.E)
            row["routing"] = routing["routing_method"].name if routing["routing_method"] is not None else None
            row["top_k"] = routing["top_k"]
            row["load"] = True
        except Exception as e:  # inspect reports what load_moe_layer would refuse, it does not raise
            row["load"] = False
            row["reason"] = str(e).removeprefix(f"argument '{ARG}': ")
        out["layers"].append(row)
    return out


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
        lines.append("             would load" if r["load"] else f"             refused: {r['reason']}")
    n = sum(r["load"] for r in info["layers"])
    lines.append(f"  {n} of {len(info['layers'])} MoE layers would load")
    return "\n".join(lines)


def main(argv=None) -> int:
    import argparse
    ap = argparse.ArgumentParser(prog="python -m fp4moe.checkpoint")
    sub = ap.add_subparsers(dest="cmd", required=True)
    ip = sub.add_parser("inspect", help="layers, formats, shapes, bytes, what would load and what would be refused")
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
