"""The fp4moe package the Python tests run against, imported once the same way by every test file.

The source package (python/, which finds the extension in $FP4MOE_BUILD_DIR, default <repo>/build) unless
FP4MOE_TEST_INSTALLED=1 asks for the installed one (a wheel). A test module whose package cannot be imported
is skipped, saying why."""
from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def import_fp4moe(*submodules: str):
    """fp4moe, or (fp4moe, fp4moe.<sub>, ...) when submodules are named; skips the calling module when the
    extension is not built."""
    if os.environ.get("FP4MOE_TEST_INSTALLED") != "1" and str(REPO / "python") not in sys.path:
        sys.path.insert(0, str(REPO / "python"))
    try:
        import fp4moe
        subs = [importlib.import_module(f"fp4moe.{s}") for s in submodules]
    except ImportError as e:
        pytest.skip(f"fp4moe extension not built ({e}); build with -DFP4MOE_BUILD_PYTHON=ON and set "
                    f"FP4MOE_BUILD_DIR, or pip install .", allow_module_level=True)
    return (fp4moe, *subs) if subs else fp4moe


def torch_devices(fp4moe, torch) -> list:
    """"cpu", and "cuda" when this build has the CUDA backend and a GPU is usable (tests of the torch integrations)."""
    info = fp4moe.build_info()
    if torch.cuda.is_available() and info["with_cuda"] and info["cuda_devices"] > 0:
        return ["cpu", "cuda"]
    return ["cpu"]
