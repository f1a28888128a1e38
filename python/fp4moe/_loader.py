"""Finds and loads the extension fp4moe._C, then checks it (SPEC §7).

An installed wheel carries _C beside this file. In a source checkout the extension is built by CMake
(-DFP4MOE_BUILD_PYTHON=ON) into <build>/python/fp4moe/; that folder is appended to the package's
__path__ from $FP4MOE_BUILD_DIR, else from <repo>/build. The generated _build_config.py and
METADATA.json always come from the same folder as the binary.
"""
from __future__ import annotations

import glob
import importlib
import json
import os
import threading
from pathlib import Path

from . import _checks
from ._errors import ErrorCode, Fp4MoeError, error

_PKG_DIR = Path(__file__).resolve().parent
_PKG = __name__.rsplit(".", 1)[0]


def _has_extension(folder: Path) -> bool:
    return bool(glob.glob(str(folder / "_C.*so")) or glob.glob(str(folder / "_C.*pyd")))


def candidate_dirs() -> list[Path]:
    out = []
    env = os.environ.get("FP4MOE_BUILD_DIR")
    if env:
        out.append(Path(env) / "python" / "fp4moe")
    repo = _PKG_DIR.parents[1]
    if (repo / "CMakeLists.txt").is_file():
        out.append(repo / "build" / "python" / "fp4moe")
    return out


def _load():
    import sys
    pkg = sys.modules[_PKG]
    if not _has_extension(_PKG_DIR):
        searched = candidate_dirs()
        found = next((d for d in searched if _has_extension(d)), None)
        if found is None:
            raise ImportError(
                "fp4moe: the native extension fp4moe._C is not built. Install the package (pip install .) or "
                "build it with CMake (-DFP4MOE_BUILD_PYTHON=ON) and set FP4MOE_BUILD_DIR to the build folder; "
                "searched: " + ", ".join(str(d) for d in [_PKG_DIR] + searched))
        pkg.__path__.append(str(found))
    C = importlib.import_module(_PKG + "._C")
    ext_dir = Path(C.__file__).resolve().parent
    try:
        cfg = importlib.import_module(_PKG + "._build_config")
    except ImportError:
        cfg = None
    if cfg is not None and Path(cfg.__file__).resolve().parent != ext_dir:
        cfg = None  # a stale config from another folder says nothing about this binary
    meta = None
    meta_path = ext_dir / "METADATA.json"
    if meta_path.is_file():
        try:
            meta = json.loads(meta_path.read_text())
        except (OSError, ValueError):
            meta = None
    return C, cfg, meta, ext_dir


C, build_config, metadata, extension_dir = _load()
C._set_error_class(Fp4MoeError)
_binary_info = dict(C.build_info())

# The package's expected source hash (written at build time) against the one the binary embeds.
if build_config is not None:
    try:
        _checks.check_source_hash(build_config.SOURCE_HASH, _binary_info["source_hash"],
                                  where=f" ({extension_dir})")
    except Exception as e:  # Fp4MoeError: an import must fail as ImportError
        raise ImportError(str(e)) from e

_arch_checked: dict[int, str] = {}
_arch_lock = threading.Lock()


def binary_info() -> dict:
    return dict(_binary_info)


def ensure_arch(device_id: int) -> str:
    """Checks once per device that the binary carries a cubin for it; returns the architecture used."""
    with _arch_lock:
        if device_id in _arch_checked:
            return _arch_checked[device_id]
    if not _binary_info.get("with_cuda"):
        raise error("device", "this build of fp4moe has no CUDA backend (built without nvcc)",
                    ErrorCode.Unsupported)
    n = C.cuda_device_count()
    if not 0 <= device_id < n:
        raise error("device", f"expected a CUDA device in [0, {n}), got cuda:{device_id}")
    cc = tuple(C.device_compute_capability(device_id))
    arch = _checks.check_arch(cc, _checks.carried_archs(_binary_info, metadata), device=f"cuda:{device_id}")
    with _arch_lock:
        _arch_checked[device_id] = arch
    return arch
