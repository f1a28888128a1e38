"""The load-time checks of python/fp4moe/_checks.py with fake inputs (no extension, no GPU needed):
compute capability against carried cubins, source-hash match with the FP4MOE_ALLOW_SOURCE_MISMATCH
override."""
from __future__ import annotations

import importlib.util
import warnings
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _load_checks():
    # Standalone: python/fp4moe/__init__.py would need the built extension.
    spec = importlib.util.spec_from_file_location("_fp4moe_checks_under_test", REPO / "python/fp4moe/_checks.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


checks = _load_checks()


@pytest.mark.parametrize("arch,parsed", [
    ("90a", (9, 0, "a")), ("sm_90a", (9, 0, "a")), ("90", (9, 0, "")), ("89", (8, 9, "")),
    ("100a", (10, 0, "a")), ("100f", (10, 0, "f")), ("120", (12, 0, "")), ("compute_80", (8, 0, "")),
])
def test_parse_arch(arch, parsed):
    assert checks.parse_arch(arch) == parsed


@pytest.mark.parametrize("bad", ["", "sm_", "9", "abc", "90x"])
def test_parse_arch_rejects(bad):
    with pytest.raises(ValueError):
        checks.parse_arch(bad)


@pytest.mark.parametrize("arch,cc,runs", [
    ("90a", (9, 0), True),
    ("90", (9, 0), True),
    ("90a", (10, 0), False),   # arch-specific cubins run on exactly that GPU
    ("90", (10, 0), False),    # no cross-major compatibility
    ("80", (8, 9), True),      # later minor of the same major
    ("80", (8, 6), True),
    ("89", (8, 0), False),     # never an earlier minor
    ("100a", (10, 3), False),
    ("100f", (10, 3), True),   # family-portable
    ("100a", (10, 0), True),
    ("120", (9, 0), False),
])
def test_arch_runs_on(arch, cc, runs):
    assert checks.arch_runs_on(arch, cc) is runs


def test_check_arch_picks_exact_cubin_first():
    assert checks.check_arch((9, 0), ["80", "90", "90a"]) == "90a"
    assert checks.check_arch((9, 0), ["80", "90"]) == "90"
    assert checks.check_arch((8, 9), ["80", "89", "90a"]) == "89"
    assert checks.check_arch((8, 6), ["80", "90a"]) == "80"


def test_check_arch_mismatch_names_both():
    with pytest.raises(ValueError) as ei:
        checks.check_arch((9, 0), ["80", "100a"], device="cuda:1")
    e = ei.value
    msg = str(e)
    assert "sm_80" in msg and "sm_100a" in msg, msg    # what the binary carries
    assert "sm_90" in msg and "cuda:1" in msg, msg     # what the GPU is
    assert "'90a' or '90'" in msg
    assert int(e.code) == 7 and e.argument == "device"  # ErrorCode.ArchMismatch
    assert type(e).__name__ == "Fp4MoeError"
    with pytest.raises(ValueError, match="carries cubins for none"):
        checks.check_arch((9, 0), [])


def test_carried_archs_prefers_metadata_cubins():
    info = {"cuda_archs": ["90a", "80"]}
    assert checks.carried_archs(info, None) == ["90a", "80"]
    assert checks.carried_archs(info, {"cubins": "unknown"}) == ["90a", "80"]
    assert checks.carried_archs(info, {"cubins": {}}) == ["90a", "80"]
    # A listed arch without a cubin (e.g. PTX only) does not count.
    assert checks.carried_archs(info, {"cubins": {"90a": 14, "80": 0}}) == ["90a"]


def test_source_hash_match_and_mismatch():
    assert checks.check_source_hash("abc123", "abc123", environ={}) is True
    with pytest.raises(ValueError) as ei:
        checks.check_source_hash("abc123", "def456", environ={})
    msg = str(ei.value)
    assert "abc123" in msg and "def456" in msg and "FP4MOE_ALLOW_SOURCE_MISMATCH" in msg
    # "0" or anything but "1" does not override.
    with pytest.raises(ValueError):
        checks.check_source_hash("abc123", "def456", environ={"FP4MOE_ALLOW_SOURCE_MISMATCH": "0"})


def test_source_hash_override_warns_loudly(capsys):
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        ok = checks.check_source_hash("abc123", "def456", environ={"FP4MOE_ALLOW_SOURCE_MISMATCH": "1"})
    assert ok is False
    assert any(issubclass(x.category, RuntimeWarning) and "def456" in str(x.message) for x in w)
    assert "WARNING" in capsys.readouterr().err


def test_source_hash_reads_the_process_environment(monkeypatch):
    monkeypatch.setenv("FP4MOE_ALLOW_SOURCE_MISMATCH", "1")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert checks.check_source_hash("a", "b") is False
    monkeypatch.delenv("FP4MOE_ALLOW_SOURCE_MISMATCH")
    with pytest.raises(ValueError):
        checks.check_source_hash("a", "b")
