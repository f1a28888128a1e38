"""Checkpoint files: the safetensors shards of a directory, their tensor table and lazy, checked tensor reads
(fp4moe.checkpoint)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ._errors import ErrorCode, error
from ._tensors import BF16, E4M3

ARG = "checkpoint"

# safetensors dtype names -> NumPy dtypes (bf16 and e4m3 through ml_dtypes).
_NP_DTYPES = {"U8": np.dtype(np.uint8), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
              "F64": np.dtype(np.float64), "I32": np.dtype(np.int32), "I64": np.dtype(np.int64),
              "BF16": BF16, "F8_E4M3": E4M3}
_FLOAT_DTYPES = ("BF16", "F16", "F32")


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
        from ._ckpt_quant import _QuantConfig  # the configs' module reads tensors of this one
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
