"""Load-time checks of the binary (SPEC §7), pure Python so they can be tested with fake inputs.

- check_arch: the GPU's compute capability against the cubins the binary carries. A GPU without a
  matching cubin is a clear error naming both; fp4moe never relies on a silent PTX JIT.
- check_source_hash: the source-tree hash the package was built with against the one the binary embeds.
  FP4MOE_ALLOW_SOURCE_MISMATCH=1 turns the error into a loud warning.
"""
from __future__ import annotations

import os
import re
import sys
import warnings
from typing import Iterable, Mapping, Sequence

try:
    from ._errors import ErrorCode, Fp4MoeError, error
except ImportError:  # loaded as a standalone module (tests that run without the extension)
    import importlib.util as _ilu
    from pathlib import Path as _Path

    _spec = _ilu.spec_from_file_location("_fp4moe_errors_standalone", _Path(__file__).with_name("_errors.py"))
    _mod = _ilu.module_from_spec(_spec)
    _spec.loader.exec_module(_mod)
    ErrorCode, Fp4MoeError, error = _mod.ErrorCode, _mod.Fp4MoeError, _mod.error

ALLOW_MISMATCH_ENV = "FP4MOE_ALLOW_SOURCE_MISMATCH"

_ARCH_RE = re.compile(r"^(?:sm_|compute_)?([0-9]+)([0-9])([af]?)$")


def parse_arch(arch: str) -> tuple[int, int, str]:
    """'90a' / 'sm_90a' -> (9, 0, 'a'); '100f' -> (10, 0, 'f'); '89' -> (8, 9, '')."""
    m = _ARCH_RE.match(str(arch).strip())
    if not m:
        raise ValueError(f"not a CUDA architecture: {arch!r}")
    return int(m.group(1)), int(m.group(2)), m.group(3)


def arch_runs_on(arch: str, cc: tuple[int, int]) -> bool:
    """Whether a cubin for `arch` runs on a GPU of compute capability cc = (major, minor).

    Cubins are binary compatible within a major version for later minors (sm_80 runs on 8.6 and 8.9);
    arch-specific ones ('90a') only on exactly that GPU; family ones ('100f') on the family's later minors.
    """
    major, minor, suffix = parse_arch(arch)
    dev_major, dev_minor = int(cc[0]), int(cc[1])
    if suffix == "a":
        return (major, minor) == (dev_major, dev_minor)
    return major == dev_major and dev_minor >= minor


def carried_archs(build_info: Mapping, metadata: Mapping | None) -> list[str]:
    """The architectures the binary has cubins for: METADATA.json's cubin counts when known, else the
    build's architecture list."""
    if metadata:
        cubins = metadata.get("cubins")
        if isinstance(cubins, Mapping) and cubins:
            return [a for a, n in cubins.items() if int(n) > 0]
    return [str(a) for a in build_info.get("cuda_archs", [])]


def _fmt_archs(archs: Sequence[str]) -> str:
    return ", ".join("sm_" + re.sub(r"^sm_", "", a) for a in archs) if archs else "none"


def check_arch(cc: tuple[int, int], archs: Iterable[str], device: str = "cuda:0") -> str:
    """Returns the carried architecture used for cc; raises Fp4MoeError(ArchMismatch) naming both."""
    archs = list(archs)
    dev_arch = f"sm_{int(cc[0])}{int(cc[1])}"
    # Prefer the exact arch-specific cubin (the fast path), then the newest compatible one.
    exact = [a for a in archs if arch_runs_on(a, cc) and parse_arch(a)[2] == "a"]
    others = sorted((a for a in archs if arch_runs_on(a, cc) and parse_arch(a)[2] != "a"),
                    key=lambda a: parse_arch(a)[:2], reverse=True)
    if exact or others:
        return (exact or others)[0]
    hint = ""
    if (int(cc[0]), int(cc[1])) == (9, 0):
        hint = " (an sm_90 GPU needs a '90a' or '90' cubin)"
    raise error("device",
                f"this fp4moe binary carries cubins for {_fmt_archs(archs)}, but {device} is {dev_arch} "
                f"(compute capability {int(cc[0])}.{int(cc[1])}){hint}; rebuild with "
                f"FP4MOE_CUDA_ARCHS including \"{int(cc[0])}{int(cc[1])}{'a' if int(cc[0]) >= 9 else ''}\"",
                ErrorCode.ArchMismatch)


def check_source_hash(expected: str, actual: str, *, environ: Mapping[str, str] | None = None,
                      where: str = "") -> bool:
    """True when the hashes match. On a mismatch: raises Fp4MoeError, or, with
    FP4MOE_ALLOW_SOURCE_MISMATCH=1, warns loudly (RuntimeWarning and stderr) and returns False."""
    env = os.environ if environ is None else environ
    if str(expected) == str(actual):
        return True
    msg = (f"fp4moe: the Python package was built from source tree {expected} but its binary{where} "
           f"embeds {actual}; the package and the binary come from different builds")
    if env.get(ALLOW_MISMATCH_ENV, "") == "1":
        loud = f"WARNING: {msg} ({ALLOW_MISMATCH_ENV}=1: continuing anyway, results are not guaranteed)"
        print(loud, file=sys.stderr)
        warnings.warn(loud, RuntimeWarning, stacklevel=2)
        return False
    raise error("", msg + f"; reinstall the package (set {ALLOW_MISMATCH_ENV}=1 to override)",
                ErrorCode.InvalidArgument)
