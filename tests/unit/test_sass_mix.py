"""bench/sass_mix.py reads cuobjdump's listing as the GPU runs it: a backward branch closes a
loop, the inner loop is the innermost one holding tensor-core / dot instructions, and its
instructions are counted per such instruction by kind."""
from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import sass_mix as sm  # noqa: E402


def listing(name: str, insns: list[str]) -> str:
    """A cuobjdump -sass function: each instruction at the next 16-byte address, with the
    encoding comments cuobjdump prints."""
    lines = [f"\t\tFunction : {name}", '\t.headerflags\t@"EF_CUDA_SM90"']
    for i, text in enumerate(insns):
        lines.append(f"        /*{16 * i:04x}*/                   {text} ;   /* 0x000fe20000000800 */")
        lines.append("                                                         /* 0x000fe20000000800 */")
    return "\n".join(lines) + "\n"


# An outer loop (positions 1..10) around an inner one (3..7) that holds the IMMAs, and a later
# loop (11..13) with no tensor-core instruction.
KERNEL = listing("_Z6kernelv", [
    "S2R R0, SR_TID.X",                          # 0
    "LDC R1, c[0x0][0x300]",                     # 1  outer loop head
    "ISETP.GE.AND P0, PT, R0, R1, PT",           # 2
    "LDS.64 R4, [R2]",                           # 3  inner loop head
    "IMMA.16832.U8.S8 R8, R4.ROW, R6.COL, RZ",   # 4
    "IMMA.16832.U8.U8 R12, R4.ROW, R6.COL, RZ",  # 5
    "@!P0 IMAD R8, R12, 0x100, R8",              # 6
    "@P0 BRA 0x30",                              # 7  -> 3
    "I2FP.F32.S32 R9, R8",                       # 8
    "FFMA.FTZ R20, R9, R10, R20",                # 9
    "BRA 0x10",                                  # 10 -> 1
    "FADD R1, R1, R2",                           # 11 work-free loop
    "ISETP.NE.AND P1, PT, R1, RZ, PT",           # 12
    "@P1 BRA 0xb0",                              # 13 -> 11
    "EXIT",                                      # 14
])


def test_opcode_drops_the_guard_and_modifiers() -> None:
    assert sm.opcode("@!P0 IMAD.WIDE.U32 R4, R2, 0x10, R6") == "IMAD"
    assert sm.opcode("@P3 BRA 0x1cc0") == "BRA"
    assert sm.opcode("@!UPT UIADD3 UR4, UR4, 0x1, URZ") == "UIADD3"
    assert sm.opcode("IMMA.16832.U8.S8 R52, R48.ROW, R52.COL, RZ") == "IMMA"
    assert sm.kind("IMMA") == "tensor" and sm.kind("I2FP") == "convert" and sm.kind("ULEA") == "uniform"
    assert sm.kind("IDP") == "dot" and sm.kind("LDC") == "const" and sm.kind("WHATEVER") == "other"


def test_loops_are_backward_branches_and_the_inner_work_loop_is_chosen() -> None:
    (f,) = sm.parse_sass(KERNEL)
    assert f.name == "_Z6kernelv" and len(f.insns) == 15
    assert sorted(f.loops()) == [(1, 10), (3, 7), (11, 13)]
    assert f.work_loop() == (3, 7)  # not the outer loop that holds it, nor the loop without IMMAs
    mix = f.mix(3, 7)
    assert mix == {"LDS": 1, "IMMA": 2, "IMAD": 1, "BRA": 1}
    assert sm.work_count(mix) == 2


def test_rows_count_the_loop_per_work_instruction_with_resources() -> None:
    res = ("\nResource usage:\n Common:\n  GLOBAL:0\n Function _Z6kernelv:\n"
           "  REG:128 STACK:8 SHARED:1088 LOCAL:16 CONSTANT[0]:800 TEXTURE:0 SURFACE:0 SAMPLER:0\n")
    assert sm.parse_res_usage(res) == {"_Z6kernelv": {"regs": 128, "stack": 8, "shared": 1088, "local": 16}}
    (row,) = sm.kernel_rows(KERNEL, res, "kernel")
    assert row["loop_instructions"] == 5 and row["loop_work"] == 2 and row["per_work"] == 2.5
    assert row["kinds"] == {"tensor": 2, "load": 1, "int": 1, "control": 1}
    assert row["regs"] == 128 and row["local"] == 16 and row["instructions"] == 15
    assert sm.kernel_rows(KERNEL, res, "no such kernel") == []


def test_a_function_without_a_work_loop_has_no_loop_columns() -> None:
    text = listing("_Z4copyv", ["LDG.E R2, desc[UR4][R2.64]", "STG.E desc[UR4][R4.64], R2", "BRA 0x0", "EXIT"])
    (row,) = sm.kernel_rows(text, "", "copy")
    assert "per_work" not in row and row["instructions"] == 4


def test_compare_pairs_kernels_by_name() -> None:
    before = {"kernels": [{"kernel": "a", "per_work": 30.0, "regs": 128, "stack": 8},
                          {"kernel": "b", "per_work": 20.0, "regs": 100, "stack": 0}]}
    after = {"kernels": [{"kernel": "a", "per_work": 27.0, "regs": 126, "stack": 0},
                         {"kernel": "c", "per_work": 10.0}]}
    assert sm.compare(before, after) == [
        {"kernel": "a", "before": 30.0, "after": 27.0, "change": -0.1, "regs": (128, 126), "stack": (8, 0)}]


@pytest.mark.skipif(shutil.which("c++filt") is None, reason="no c++filt")
def test_kernel_names_read_as_their_templates() -> None:
    name = ("_ZN5specd3gpu49_GLOBAL__N__7f6b5dac_16_matvec_kq_mma_cu_bb0b5f5c13kq_mma_kernelILNS_8GgmlTypeE12ELi2E"
            "Li2ELb0ELi2EEEvNS1_9MmaParamsE")
    assert sm.demangle([name]) == {name: "kq_mma_kernel<Q4_K, 2, 2, false, 2>"}


def test_macs_come_from_the_instruction_shape() -> None:
    assert sm.macs("IMMA.16832.U8.S8 R52, R48.ROW, R52.COL, RZ") == 16 * 8 * 32
    assert sm.macs("@P0 IMMA.16816.S8.S8 R4, R8.ROW, R12.COL, R4") == 16 * 8 * 16
    assert sm.macs("HMMA.16816.F32 R4, R8, R12, R4") == 16 * 8 * 16
    assert sm.macs("IDP.4A.S8.U8 R4, R5, R6, R4") == 128
    assert sm.macs("IMAD R4, R5, R6, R7") == 0
    (row,) = sm.kernel_rows(KERNEL, "", "kernel")
    assert row["macs_per_insn"] == round(2 * 4096 / 5, 1)
