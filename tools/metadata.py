#!/usr/bin/env python3
"""Writes METADATA.json beside a built fp4moe binary (SPEC §7).

Records: version, the source-tree hash the binary embeds and the one of the tree now, CUDA and compiler
versions, the architecture list, the cubin count per architecture (from `cuobjdump --list-elf`, or
"unknown" without cuobjdump), and the minimum GLIBC / GLIBCXX / CXXABI versions the binary needs, read from
its ELF symbol-version requirements (.gnu.version_r) in pure Python.

Usage: tools/metadata.py BINARY [--source-dir DIR] [--output PATH] [--print]
       tools/metadata.py --print-source-hash [--source-dir DIR]   (the hash CMake can embed)
The functions are importable (tests/python/test_package_metadata.py tests them on fake inputs).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import struct
import subprocess
import sys
from pathlib import Path

SCHEMA = 1

# ---- ELF symbol-version requirements ------------------------------------------------------------------

SHT_GNU_VERNEED = 0x6FFFFFFE


class ElfError(ValueError):
    pass


def read_version_requirements(data: bytes) -> list[tuple[str, str]]:
    """(library, version) pairs of an ELF image's .gnu.version_r section, e.g. ("libc.so.6", "GLIBC_2.17")."""
    if len(data) < 16 or data[:4] != b"\x7fELF":
        raise ElfError("not an ELF file")
    ei_class, ei_data = data[4], data[5]
    if ei_class not in (1, 2) or ei_data not in (1, 2):
        raise ElfError(f"unsupported ELF class/data ({ei_class}, {ei_data})")
    end = "<" if ei_data == 1 else ">"
    is64 = ei_class == 2
    try:
        if is64:
            e_shoff, = struct.unpack_from(end + "Q", data, 0x28)
            e_shentsize, e_shnum = struct.unpack_from(end + "HH", data, 0x3A)
        else:
            e_shoff, = struct.unpack_from(end + "I", data, 0x20)
            e_shentsize, e_shnum = struct.unpack_from(end + "HH", data, 0x2E)
        sections = []
        for i in range(e_shnum):
            off = e_shoff + i * e_shentsize
            if is64:
                _name, sh_type, _flags, _addr, sh_offset, sh_size, sh_link, sh_info = struct.unpack_from(
                    end + "IIQQQQII", data, off)
            else:
                _name, sh_type, _flags, _addr, sh_offset, sh_size, sh_link, sh_info = struct.unpack_from(
                    end + "IIIIIIII", data, off)
            sections.append((sh_type, sh_offset, sh_size, sh_link, sh_info))
        out: list[tuple[str, str]] = []
        for sh_type, sh_offset, sh_size, sh_link, sh_info in sections:
            if sh_type != SHT_GNU_VERNEED:
                continue
            if sh_link >= len(sections):
                raise ElfError("version section links to a missing string table")
            str_off = sections[sh_link][1]

            def cstr(o: int) -> str:
                stop = data.index(b"\0", str_off + o)
                return data[str_off + o:stop].decode("ascii", "replace")

            pos = sh_offset
            for _ in range(sh_info):  # sh_info = number of Verneed entries
                _vn_version, vn_cnt, vn_file, vn_aux, vn_next = struct.unpack_from(end + "HHIII", data, pos)
                lib = cstr(vn_file)
                apos = pos + vn_aux
                for _ in range(vn_cnt):
                    _hash, _flags, _other, vna_name, vna_next = struct.unpack_from(end + "IHHII", data, apos)
                    out.append((lib, cstr(vna_name)))
                    if vna_next == 0:
                        break
                    apos += vna_next
                if vn_next == 0:
                    break
                pos += vn_next
        return out
    except (struct.error, ValueError, IndexError) as e:
        if isinstance(e, ElfError):
            raise
        raise ElfError(f"truncated or malformed ELF: {e}") from e


def _version_key(v: str) -> tuple[int, ...]:
    return tuple(int(p) for p in v.split(".") if p.isdigit())


def minimum_versions(requirements: list[tuple[str, str]]) -> dict[str, str | None]:
    """The newest version required per family = the oldest runtime that can load the binary."""
    best: dict[str, str | None] = {"GLIBC": None, "GLIBCXX": None, "CXXABI": None}
    for _lib, name in requirements:
        m = re.fullmatch(r"(GLIBC|GLIBCXX|CXXABI)_([0-9][0-9.]*)", name)
        if not m:
            continue  # GLIBC_PRIVATE and the like
        fam, ver = m.group(1), m.group(2)
        if best[fam] is None or _version_key(ver) > _version_key(best[fam]):
            best[fam] = ver
    return best


# ---- cubins -----------------------------------------------------------------------------------------

def parse_cuobjdump_list_elf(text: str) -> dict[str, int]:
    """Counts cubins per architecture in `cuobjdump --list-elf` output ("ELF file 1: x.sm_90a.cubin")."""
    counts: dict[str, int] = {}
    for line in text.splitlines():
        m = re.search(r"\bsm_([0-9]+[a-z]?)\b.*\.cubin", line)
        if m:
            counts[m.group(1)] = counts.get(m.group(1), 0) + 1
    return dict(sorted(counts.items()))


def fatbin_cubin_counts(data: bytes, archs: list[str]) -> dict[str, int]:
    """Counts the cubins (fatbin entries of kind 2, ELF) per SM version in the ELF section .nv_fatbin, without
    cuobjdump. The entry header carries the SM number (90), not the 'a' suffix: an SM listed as "<sm>a" in the
    build's architectures is reported with it."""
    counts: dict[str, int] = {}
    if data[:4] != b"\x7fELF" or data[4] != 2:
        return counts
    shoff = struct.unpack_from("<Q", data, 0x28)[0]
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    secs = [struct.unpack_from("<IIQQQQ", data, shoff + i * shentsize) for i in range(shnum)]
    stroff = secs[shstrndx][4]

    def name(o: int) -> str:
        return data[stroff + o:data.index(b"\0", stroff + o)].decode(errors="replace")

    for sec in secs:
        if name(sec[0]) != ".nv_fatbin":
            continue
        off, end = sec[4], sec[4] + sec[5]
        while off + 16 <= end:
            magic, _ver, hsize, fsize = struct.unpack_from("<IHHQ", data, off)
            if magic != 0xBA55ED50:
                off += 8  # fatbins are 8-byte aligned inside the section
                continue
            p, q = off + hsize, min(off + hsize + fsize, end)
            while p + 32 <= q:
                kind, _f, ehsize, psize = struct.unpack_from("<HHIQ", data, p)
                sm = struct.unpack_from("<I", data, p + 28)[0]
                if kind == 2:
                    label = f"{sm}a" if f"{sm}a" in archs else str(sm)
                    counts[label] = counts.get(label, 0) + 1
                if ehsize == 0:
                    break
                p += ehsize + psize
            off = max(q, off + 16)
    return dict(sorted(counts.items()))


def cubin_counts(binary: Path, archs: list[str] | None = None) -> dict[str, int] | str:
    tool = shutil.which("cuobjdump") or (
        "/usr/local/cuda/bin/cuobjdump" if os.access("/usr/local/cuda/bin/cuobjdump", os.X_OK) else None)
    if not tool:
        try:
            return fatbin_cubin_counts(Path(binary).read_bytes(), archs or [])
        except (OSError, struct.error, ValueError, IndexError):
            return "unknown"
    try:
        r = subprocess.run([tool, "--list-elf", str(binary)], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    if r.returncode != 0:
        # A binary without device code is not an error: it carries zero cubins.
        if "does not contain device code" in (r.stderr + r.stdout):
            return {}
        return "unknown"
    return parse_cuobjdump_list_elf(r.stdout)


# ---- source tree hash ---------------------------------------------------------------------------------

def files_hash(src_dir: Path) -> str:
    """sha256 over "relative/path:sha256(content)\n" of every file under src_dir, sorted (as CMakeLists.txt)."""
    lines = []
    for p in sorted((q for q in src_dir.rglob("*") if q.is_file()), key=lambda q: q.relative_to(src_dir).as_posix()):
        lines.append(f"{p.relative_to(src_dir).as_posix()}:{hashlib.sha256(p.read_bytes()).hexdigest()}\n")
    return "sha256:" + hashlib.sha256("".join(lines).encode()).hexdigest()


def source_tree_hash(source_dir: Path) -> tuple[str, str]:
    """(hash, method): the hash of the src/ files, as CMake embeds it in the binary."""
    src = source_dir / "src"
    if src.is_dir():
        return files_hash(src), "sha256 of src/ files"
    return "unknown", "none"


# ---- build info of the binary ------------------------------------------------------------------------

def binary_build_info(binary: Path) -> dict | None:
    """build_info() of a fp4moe Python extension, loaded in this process; None if it is not one."""
    import importlib.machinery
    import importlib.util
    name = binary.name.split(".")[0]
    if name != "_C":
        return None
    try:
        loader = importlib.machinery.ExtensionFileLoader(name, str(binary))
        spec = importlib.util.spec_from_file_location(name, str(binary), loader=loader)
        mod = importlib.util.module_from_spec(spec)
        loader.exec_module(mod)
        return dict(mod.build_info())
    except Exception:  # built for another interpreter, missing libraries...
        return None


def collect(binary: Path, source_dir: Path | None) -> dict:
    data = binary.read_bytes()
    try:
        req = read_version_requirements(data)
        mins = minimum_versions(req)
        elf_error = None
    except ElfError as e:
        req, mins, elf_error = [], {"GLIBC": None, "GLIBCXX": None, "CXXABI": None}, str(e)
    info = binary_build_info(binary) or {}
    tree_hash, method = source_tree_hash(source_dir) if source_dir else ("unknown", "none")
    meta = {
        "schema": SCHEMA,
        "name": "fp4moe",
        "binary": binary.name,
        "binary_sha256": hashlib.sha256(data).hexdigest(),
        "version": info.get("version", "unknown"),
        "source_hash": info.get("source_hash", tree_hash),
        "source_tree_hash": tree_hash,
        "source_tree_hash_method": method,
        "cxx_compiler": info.get("cxx_compiler", "unknown"),
        "cuda_compiler": info.get("cuda_compiler", "") if info else "unknown",
        "with_cuda": info.get("with_cuda", None),
        "cuda_archs": list(info.get("cuda_archs", [])),
        # A build without CUDA carries no cubins whether or not cuobjdump is installed.
        "cubins": {} if info.get("with_cuda") is False else cubin_counts(binary, list(info.get("cuda_archs", []))),
        "min_glibc": mins["GLIBC"],
        "min_glibcxx": mins["GLIBCXX"],
        "min_cxxabi": mins["CXXABI"],
        "needed_versions": sorted({f"{lib}:{v}" for lib, v in req}),
        "python": f"{sys.implementation.name}{sys.version_info[0]}.{sys.version_info[1]}",
    }
    if elf_error:
        meta["elf_error"] = elf_error
    return meta


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("binary", type=Path, nargs="?")
    ap.add_argument("--print-source-hash", action="store_true",
                    help="print the source-tree hash of --source-dir (what CMake may embed) and exit")
    ap.add_argument("--source-dir", type=Path, default=Path(__file__).resolve().parents[1])
    ap.add_argument("--output", type=Path, default=None, help="default: METADATA.json beside the binary")
    ap.add_argument("--print", action="store_true", help="also print the JSON")
    a = ap.parse_args(argv)
    if a.print_source_hash:
        print(source_tree_hash(a.source_dir)[0])
        return 0
    if a.binary is None:
        ap.error("BINARY is required")
    if not a.binary.is_file():
        print(f"metadata.py: no such file: {a.binary}", file=sys.stderr)
        return 2
    meta = collect(a.binary, a.source_dir)
    out = a.output or a.binary.parent / "METADATA.json"
    text = json.dumps(meta, indent=2, sort_keys=False) + "\n"
    tmp = out.with_suffix(".json.tmp")
    tmp.write_text(text)
    tmp.replace(out)  # atomic: a reader never sees half a file
    if a.print:
        print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
