"""Import-time behaviour of the package with its real binary: a package whose recorded source hash differs
from the binary's refuses to import (FP4MOE_ALLOW_SOURCE_MISMATCH=1 overrides, loudly), and a package
without its binary says how to build it. Each case runs in a fresh interpreter on a copy of the package."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path


from fp4moe_under_test import REPO, import_fp4moe  # noqa: E402


def _built_extension_dir() -> Path:
    return Path(import_fp4moe()._C.__file__).resolve().parent


EXT_DIR = _built_extension_dir()


def _package_copy(tmp_path: Path, source_hash: str | None, with_binary: bool = True) -> Path:
    pkg = tmp_path / "site" / "fp4moe"
    pkg.mkdir(parents=True)
    for f in (REPO / "python" / "fp4moe").glob("*.py"):
        shutil.copy(f, pkg / f.name)
    if with_binary:
        for f in EXT_DIR.glob("_C.*"):
            shutil.copy(f, pkg / f.name)
        cfg = (EXT_DIR / "_build_config.py").read_text()
        if source_hash is not None:
            cfg = "\n".join(f'SOURCE_HASH = "{source_hash}"' if l.startswith("SOURCE_HASH") else l
                            for l in cfg.splitlines()) + "\n"
        (pkg / "_build_config.py").write_text(cfg)
    return pkg.parent


def _run(site: Path, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("FP4MOE_BUILD_DIR", "FP4MOE_ALLOW_SOURCE_MISMATCH")}
    env["PYTHONPATH"] = str(site)
    env.update(env_extra or {})
    code = "import fp4moe; print('OK', fp4moe.__file__, fp4moe._C.__file__)"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=site,
                          timeout=120)


def test_matching_copy_imports(tmp_path):
    site = _package_copy(tmp_path, None)
    r = _run(site)
    assert r.returncode == 0, r.stderr
    assert str(site) in r.stdout  # the copy's binary, not the build folder's


def test_source_mismatch_refuses_to_import(tmp_path):
    site = _package_copy(tmp_path, "0" * 40)
    r = _run(site)
    assert r.returncode != 0
    assert "ImportError" in r.stderr and "0" * 40 in r.stderr and "FP4MOE_ALLOW_SOURCE_MISMATCH" in r.stderr


def test_source_mismatch_override_warns(tmp_path):
    site = _package_copy(tmp_path, "0" * 40)
    r = _run(site, {"FP4MOE_ALLOW_SOURCE_MISMATCH": "1"})
    assert r.returncode == 0, r.stderr
    assert "WARNING" in r.stderr and "0" * 40 in r.stderr


def test_missing_binary_says_how_to_build(tmp_path):
    site = _package_copy(tmp_path, None, with_binary=False)
    r = _run(site)
    assert r.returncode != 0
    assert "not built" in r.stderr and "FP4MOE_BUILD_PYTHON" in r.stderr
