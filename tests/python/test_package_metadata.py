"""tools/metadata.py (METADATA.json, SPEC §7) with fake inputs and real ELF binaries of this machine;
no extension needed."""
from __future__ import annotations

import importlib.util
import json
import re
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _load():
    spec = importlib.util.spec_from_file_location("_fp4moe_metadata_under_test", REPO / "tools/metadata.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


md = _load()


def _some_elf() -> Path:
    for p in (sys.executable, "/bin/ls", "/usr/bin/env"):
        p = Path(p).resolve()
        if p.is_file() and p.read_bytes()[:4] == b"\x7fELF":
            return p
    pytest.skip("no ELF binary found on this machine")


def _objdump_version_refs(path: Path) -> set[tuple[str, str]]:
    out = subprocess.run(["objdump", "-p", str(path)], capture_output=True, text=True, check=True).stdout
    refs, lib, inside = set(), None, False
    for line in out.splitlines():
        if line.startswith("Version References:"):
            inside = True
            continue
        if inside:
            m = re.match(r"\s+required from (\S+):", line)
            if m:
                lib = m.group(1)
                continue
            m = re.match(r"\s+0x[0-9a-f]+ 0x[0-9a-f]+ \d+ (\S+)", line)
            if m and lib:
                refs.add((lib, m.group(1)))
                continue
            if line.strip() == "" and refs:
                break
    return refs


def test_version_requirements_match_objdump():
    if not shutil.which("objdump"):
        pytest.skip("objdump (binutils) is not installed")
    elf = _some_elf()
    ours = set(md.read_version_requirements(elf.read_bytes()))
    theirs = _objdump_version_refs(elf)
    assert theirs, "objdump found no version references"
    assert ours == theirs


def test_version_requirements_of_a_real_binary():
    req = md.read_version_requirements(_some_elf().read_bytes())
    assert any(v.startswith("GLIBC_") for _lib, v in req)
    mins = md.minimum_versions(req)
    assert re.fullmatch(r"2\.\d+(\.\d+)?", mins["GLIBC"])


def test_minimum_versions_takes_the_newest_per_family():
    req = [("libc.so.6", "GLIBC_2.2.5"), ("libc.so.6", "GLIBC_2.17"), ("libc.so.6", "GLIBC_2.9"),
           ("libc.so.6", "GLIBC_PRIVATE"), ("libstdc++.so.6", "GLIBCXX_3.4.9"),
           ("libstdc++.so.6", "GLIBCXX_3.4.29"), ("libstdc++.so.6", "GLIBCXX_3.4.30"),
           ("libstdc++.so.6", "CXXABI_1.3.13"), ("libstdc++.so.6", "CXXABI_1.3.9"), ("libgcc_s.so.1", "GCC_3.0")]
    assert md.minimum_versions(req) == {"GLIBC": "2.17", "GLIBCXX": "3.4.30", "CXXABI": "1.3.13"}
    assert md.minimum_versions([]) == {"GLIBC": None, "GLIBCXX": None, "CXXABI": None}


def test_not_elf_and_truncated_elf_are_errors():
    with pytest.raises(md.ElfError):
        md.read_version_requirements(b"#!/bin/sh\necho hi\n")
    data = _some_elf().read_bytes()
    with pytest.raises(md.ElfError):
        md.read_version_requirements(data[:200])  # section headers cut off


def _tiny_elf64(needs: list[tuple[str, list[str]]]) -> bytes:
    """A minimal little-endian ELF64 image with a .gnu.version_r section (built by hand, no toolchain)."""
    strtab = b"\0"
    offs = {}

    def s(name):
        nonlocal strtab
        if name not in offs:
            offs[name] = len(strtab)
            strtab += name.encode() + b"\0"
        return offs[name]

    vr = b""
    for i, (lib, vers) in enumerate(needs):
        aux = b""
        for j, v in enumerate(vers):
            nxt = 16 if j + 1 < len(vers) else 0
            aux += struct.pack("<IHHII", 0, 0, 0, s(v), nxt)
        size = 16 + len(aux)
        nxt = size if i + 1 < len(needs) else 0
        vr += struct.pack("<HHIII", 1, len(vers), s(lib), 16, nxt) + aux
    hdr_size, sh_size = 64, 64
    str_off = hdr_size
    vr_off = str_off + len(strtab)
    sh_off = vr_off + len(vr)
    ehdr = b"\x7fELF" + bytes([2, 1, 1]) + bytes(9)
    ehdr += struct.pack("<HHIQQQIHHHHHH", 3, 62, 1, 0, 0, sh_off, 0, 64, 0, 0, sh_size, 3, 0)
    sh = bytes(64)  # null section
    sh += struct.pack("<IIQQQQIIQQ", 0, 3, 0, 0, str_off, len(strtab), 0, 0, 1, 0)              # [1] strtab
    sh += struct.pack("<IIQQQQIIQQ", 0, md.SHT_GNU_VERNEED, 0, 0, vr_off, len(vr), 1, len(needs), 8, 0)
    return ehdr + strtab + vr + sh


def test_handmade_elf():
    img = _tiny_elf64([("libc.so.6", ["GLIBC_2.2.5", "GLIBC_2.34"]), ("libstdc++.so.6", ["GLIBCXX_3.4.32"])])
    req = md.read_version_requirements(img)
    assert req == [("libc.so.6", "GLIBC_2.2.5"), ("libc.so.6", "GLIBC_2.34"), ("libstdc++.so.6", "GLIBCXX_3.4.32")]
    assert md.minimum_versions(req)["GLIBC"] == "2.34"


def test_parse_cuobjdump_list_elf():
    text = """
ELF file    1: _C.1.sm_90a.cubin
ELF file    2: _C.2.sm_90a.cubin
ELF file    3: _C.3.sm_80.cubin
ELF file    4: _C.4.sm_100a.cubin
PTX file    1: _C.1.sm_90a.ptx
"""
    assert md.parse_cuobjdump_list_elf(text) == {"100a": 1, "80": 1, "90a": 2}
    assert md.parse_cuobjdump_list_elf("") == {}


def test_files_hash(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "x.cpp").write_text("int x;\n")
    (tmp_path / "b.h").write_text("#pragma once\n")
    h1 = md.files_hash(tmp_path)
    assert h1.startswith("sha256:") and h1 == md.files_hash(tmp_path)
    (tmp_path / "b.h").write_text("#pragma once // changed\n")
    h2 = md.files_hash(tmp_path)
    assert h2 != h1
    (tmp_path / "b.h").rename(tmp_path / "c.h")  # same content, another name
    assert md.files_hash(tmp_path) != h2


def test_source_tree_hash_without_git(tmp_path):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "f.cpp").write_text("x")
    h, method = md.source_tree_hash(tmp_path)
    assert h == md.files_hash(tmp_path / "src") and "sha256" in method


def test_main_writes_metadata_json(tmp_path):
    elf = tmp_path / "prog"
    shutil.copy(_some_elf(), elf)
    out = tmp_path / "METADATA.json"
    assert md.main([str(elf), "--source-dir", str(REPO), "--output", str(out)]) == 0
    meta = json.loads(out.read_text())
    for key in ("version", "source_hash", "source_tree_hash", "cxx_compiler", "cuda_compiler", "cuda_archs",
                "cubins", "min_glibc", "min_glibcxx", "binary_sha256"):
        assert key in meta, key
    assert meta["min_glibc"]
    assert meta["cubins"] == "unknown" or isinstance(meta["cubins"], dict)
    assert md.main([str(tmp_path / "missing.so")]) == 2


def test_print_source_hash(tmp_path, capsys):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.cpp").write_text("int a;")
    assert md.main(["--print-source-hash", "--source-dir", str(tmp_path)]) == 0
    assert capsys.readouterr().out.strip() == md.files_hash(tmp_path / "src")


def test_fatbin_cubin_count_without_cuobjdump_on_a_built_extension():
    """The pure-Python fatbin reader counts the cubins of a real CUDA build of the extension."""
    import glob
    import os
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
    import metadata
    build = os.environ.get("FP4MOE_BUILD_DIR", "build")
    sos = glob.glob(os.path.join(build, "python", "fp4moe", "_C*.so"))
    if not sos:
        pytest.skip("no built extension under $FP4MOE_BUILD_DIR")
    data = Path(sos[0]).read_bytes()
    counts = metadata.fatbin_cubin_counts(data, ["90a"])
    if b".nv_fatbin" not in data:
        assert counts == {}
        pytest.skip("CPU-only build: no device code to count")
    assert counts and all(n > 0 for n in counts.values()), counts
    assert "90a" in counts, counts
    # Not an ELF: nothing counted.
    assert metadata.fatbin_cubin_counts(b"not an elf at all" * 4, ["90a"]) == {}
