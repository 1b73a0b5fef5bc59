"""tools/device/ncu_source.py: per-opcode instructions and stalls of one launch from Nsight
Compute's source page (the H100 gate/up profile kept in bench/results, and small exports)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools/device"))
import ncu_source  # noqa: E402

KEPT = ROOT / "bench/results/gpu_nvidia-h100_20261207j_sass-gateup.csv.gz"


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "tools/device/ncu_source.py"), *args],
                          capture_output=True, text=True)


def test_the_gate_up_kernel_costs_26_instructions_per_mma() -> None:
    r = run(str(KEPT), "--top", "2")
    assert r.returncode == 0, r.stderr
    out = r.stdout.splitlines()
    assert out[0].startswith("void specd::gpu::<unnamed>::kq_mma_kernel<(specd::GgmlType)12, (int)2, (int)2")
    assert out[1] == "executed 31079628 warp instructions, 6420 stall samples, 26.3 per IMMA"
    table = {ln.split()[0]: ln.split() for ln in out[3:] if not ln.startswith(("top", " "))}
    assert table["IMMA"][1:3] == ["1179648", "3.8%"] and table["IMMA"][3] == "1.00"
    assert table["FFMA"][1] == "4718592" and table["FFMA"][3] == "4.00"  # 3 per output, 4 outputs per 3 IMMAs
    assert table["I2FP"][3] == "2.67"  # 2 conversions per output
    assert table["LOP3"][4] == "29.5%"  # the mask that first reads a loaded chunk
    assert out[-2] == "    793      24576  LOP3.LUT R55, R19, 0xf0f0f0f, RZ, 0xc0, !PT"


def export(tmp_path: Path, launches: list[tuple[str, list[tuple[str, int, int]]]], columns=None) -> Path:
    cols = columns or ["Address", "Source", ncu_source.STALLS, "Warp Stall Sampling (Not-issued Samples)",
                       ncu_source.EXECUTED]
    lines = []
    for name, rows in launches:
        lines.append(f'"Kernel Name","{name}",')
        lines.append(",".join(f'"{c}"' for c in cols))
        for i, (src, stalls, executed) in enumerate(rows):
            vals = {"Address": hex(16 * i), "Source": src, ncu_source.STALLS: stalls, ncu_source.EXECUTED: executed,
                    "Warp Stall Sampling (Not-issued Samples)": stalls}
            lines.append(",".join(f'"{vals[c]}"' for c in cols))
    p = tmp_path / "src.csv"
    p.write_text("==PROF== a line of the profiler's own\n" + "\n".join(lines) + "\n")
    return p


def test_launches_are_chosen_by_name_and_order(tmp_path: Path) -> None:
    p = export(tmp_path, [("void a<1>(P)", [("      IMMA.16832.U8.U8 R4, R8.ROW, R12.COL, RZ", 1, 10),
                                             ("      @!P0 FFMA.FTZ R1, R2, R3, R1", 3, 30)]),
                          ("void b<2>(P)", [("      LDG.E.64 R2, desc[UR4][R6.64]", 0, 5)]),
                          ("void a<1>(P)", [("      IMMA.16832.U8.U8 R4, R8.ROW, R12.COL, RZ", 2, 4),
                                             ("      FFMA R1, R2, R3, R1", 2, 8)])])
    listed = run(str(p), "--list").stdout.splitlines()
    assert [ln.split()[-1] for ln in listed] == ["a<1>(P)", "b<2>(P)", "a<1>(P)"]
    first = run(str(p), "--kernel", r"a<1>").stdout.splitlines()
    assert first[1] == "executed 40 warp instructions, 4 stall samples, 4.0 per IMMA"
    assert "FFMA                 30  75.0%       3.00   75.0%" in first  # the predicate is not the opcode
    second = run(str(p), "--kernel", r"a<1>", "--nth", "1").stdout.splitlines()
    assert second[1] == "executed 12 warp instructions, 4 stall samples, 3.0 per IMMA"
    assert run(str(p), "--kernel", "b<", "--per", "LDG").stdout.splitlines()[1] == \
        "executed 5 warp instructions, 0 stall samples, 1.0 per LDG"


def test_clear_errors(tmp_path: Path) -> None:
    p = export(tmp_path, [("void a(P)", [("      FFMA R1, R2, R3, R1", 1, 2)])])
    r = run(str(p), "--kernel", "a", "--nth", "1")
    assert r.returncode == 1 and "1 launches match 'a'; --nth 1 is past them" in r.stderr
    q = export(tmp_path, [("void a(P)", [("      FFMA R1, R2, R3, R1", 1, 2)])],
               columns=["Address", "Source", ncu_source.EXECUTED])
    r = run(str(q))
    assert r.returncode == 1 and "lacks columns ['Warp Stall Sampling (All Samples)']" in r.stderr


@pytest.mark.parametrize("line, op", [("LOP3.LUT R1, R2, 0xf, RZ, 0xc0, !PT", "LOP3"), ("@!P0 BRA 0x10", "BRA"),
                                      ("  IMMA.16832.U8.S8 R4, R8.ROW, R12.COL, RZ", "IMMA"), ("", "?")])
def test_opcode(line: str, op: str) -> None:
    assert ncu_source.opcode(line) == op
