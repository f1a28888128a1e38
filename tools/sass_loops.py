#!/usr/bin/env python3
"""The hot loops of a kernel's SASS, counted without a GPU: for each kernel whose mangled name matches PATTERN,
the innermost loops (backward branches) that hold tensor-core instructions, with their static instruction count and
the most frequent opcodes. A decode GEMM's time follows its loop's instructions per weight byte (bench/NOTES.md),
so this is the first check of a mainloop change before any device time is spent.

Usage:
  nvcc -O3 -DNDEBUG -Xcompiler=-fPIC --expt-relaxed-constexpr -gencode=arch=compute_90a,code=sm_90a -std=c++20 \\
       -DFP4MOE_WITH_CUDA=1 -Iinclude -Isrc -c src/cuda/gemm/gemm_nvfp4.cu -o /tmp/g.o
  cuobjdump -sass /tmp/g.o > /tmp/g.sass
  python3 tools/sass_loops.py /tmp/g.sass 'Li8ELi128.*Epilogue2' [--list]

--list prints the loop's instructions too. (cuobjdump ships with the CUDA toolkit; Triton's pip wheel carries one.)
"""
import re
import sys


def functions(text):
    for part in re.split(r"\n\s+Function : ", text)[1:]:
        name = part.split("\n", 1)[0].strip()
        ins = []
        for line in part.split("\n"):
            m = re.match(r"\s+/\*([0-9a-f]{4,6})\*/\s+(.*?)\s*;", line)
            if m:
                ins.append((int(m.group(1), 16), m.group(2)))
        yield name, ins


def opcode(instr):
    return re.sub(r"^@!?U?P\w+\s+", "", instr).split()[0].split(".")[0]


def mma_loops(ins):
    """(length, first, last) of every backward branch's body that holds an HMMA / HGMMA."""
    index = {addr: i for i, (addr, _) in enumerate(ins)}
    loops = []
    for i, (addr, s) in enumerate(ins):
        m = re.search(r"BRA(?:\.\w+)*\s+(?:`\(\.L_x_\d+\)|0x([0-9a-f]+))", s)
        if not m or not m.group(1):
            continue
        target = int(m.group(1), 16)
        if target <= addr and target in index:
            body = [x for _, x in ins[index[target]:i + 1]]
            if any(opcode(x) in ("HMMA", "HGMMA") for x in body):
                loops.append((len(body), index[target], i, body))
    return loops


def main(argv):
    if len(argv) < 3:
        sys.exit(__doc__)
    text = open(argv[1]).read()
    pattern = re.compile(argv[2])
    listing = "--list" in argv[3:]
    found = False
    for name, ins in functions(text):
        if not pattern.search(name):
            continue
        found = True
        print(f"{name}: {len(ins)} instructions")
        loops = mma_loops(ins)
        # The mainloop first: the densest in tensor-core instructions (outer loops and the LoRA epilogue's are sparse).
        loops.sort(key=lambda l: -sum(opcode(x) in ("HMMA", "HGMMA") for x in l[3]) / l[0])
        for n, a, b, body in loops[:2]:
            ops = {}
            for x in body:
                ops[opcode(x)] = ops.get(opcode(x), 0) + 1
            top = ", ".join(f"{k} {v}" for k, v in sorted(ops.items(), key=lambda t: -t[1])[:16])
            print(f"  loop [{a}, {b}]: {n} instructions; {top}")
            if listing:
                print("\n".join("    " + x for x in body))
    if not found:
        sys.exit(f"no kernel matches {argv[2]!r}")


if __name__ == "__main__":
    main(sys.argv)
