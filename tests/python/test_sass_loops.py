"""tools/sass_loops.py: finds a kernel's tensor-core loop in cuobjdump text (no GPU needed)."""
import importlib.util
import pathlib

import pytest

_TOOL = pathlib.Path(__file__).resolve().parents[2] / "tools" / "sass_loops.py"
_spec = importlib.util.spec_from_file_location("sass_loops", _TOOL)
sass_loops = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sass_loops)

# A kernel with an outer loop (0x0010 .. 0x0090) around a dense inner loop (0x0020 .. 0x0060) holding two HMMAs,
# and a sparse loop after it (0x00a0 .. 0x00e0: one HMMA in five instructions).
_SASS = """
        Function : _Z6kernelv
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   IADD3 R2, R2, 0x1, RZ ;
        /*0020*/                   LDS R4, [R3] ;
        /*0030*/                   HMMA.16816.F32.BF16 R8, R4, R6, R8 ;
        /*0040*/                   HMMA.16816.F32.BF16 R12, R4, R6, R12 ;
        /*0050*/                   ISETP.GE.AND P0, PT, R2, 0x10, PT ;
        /*0060*/              @!P0 BRA 0x20 ;
        /*0070*/                   IADD3 R5, R5, 0x1, RZ ;
        /*0080*/                   ISETP.GE.AND P1, PT, R5, 0x4, PT ;
        /*0090*/              @!P1 BRA 0x10 ;
        /*00a0*/                   LDG.E R7, desc[UR4][R10.64] ;
        /*00b0*/                   HMMA.16816.F32.BF16 R16, R4, R6, R16 ;
        /*00c0*/                   IADD3 R9, R9, 0x1, RZ ;
        /*00d0*/                   ISETP.GE.AND P2, PT, R9, 0x4, PT ;
        /*00e0*/              @!P2 BRA 0xa0 ;
        /*00f0*/                   EXIT ;
        Function : _Z5otherv
        /*0000*/                   EXIT ;
"""


def test_finds_the_dense_inner_loop_first():
    (name, ins), (other, _) = list(sass_loops.functions(_SASS))
    assert (name, other) == ("_Z6kernelv", "_Z5otherv")
    assert len(ins) == 16
    loops = sass_loops.mma_loops(ins)
    assert sorted((a, b) for _, a, b, _ in loops) == [(1, 9), (2, 6), (10, 14)]
    loops.sort(key=lambda l: -sum(sass_loops.opcode(x) == "HMMA" for x in l[3]) / l[0])
    assert (loops[0][1], loops[0][2], loops[0][0]) == (2, 6, 5)


def test_opcode_drops_predicates_and_modifiers():
    assert sass_loops.opcode("@!P0 BRA 0x20") == "BRA"
    assert sass_loops.opcode("@P1 HMMA.16816.F32.BF16 R8, R4, R6, R8") == "HMMA"
    assert sass_loops.opcode("@!UP0 UIADD3 UR4, UR4, 0x1, URZ") == "UIADD3"


def test_main_reports_and_refuses_unknown_kernels(tmp_path, capsys):
    f = tmp_path / "k.sass"
    f.write_text(_SASS)
    sass_loops.main(["sass_loops.py", str(f), "kernel"])
    out = capsys.readouterr().out
    assert "_Z6kernelv: 16 instructions" in out
    assert "loop [2, 6]: 5 instructions" in out
    with pytest.raises(SystemExit):
        sass_loops.main(["sass_loops.py", str(f), "nomatch"])
