"""tools/device/ncu_summary.py: the per-kernel table of an Nsight Compute CSV (the H200 profile
kept in bench/results) adds up what ncu measured."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CSV = ROOT / "bench/results/gpu_nvidia-h200_20261130c_ncu-8b-q4km-decode.csv"


def test_summary_of_the_h200_decode_profile() -> None:
    out = subprocess.run([sys.executable, str(ROOT / "tools/device/ncu_summary.py"), str(CSV)],
                         capture_output=True, text=True, check=True).stdout.splitlines()
    rows = [ln.split() for ln in out[1:-1]]
    assert len(rows) == 14  # -c 14 kernels, the profiler's own lines dropped
    assert [r[1] for r in rows[:6]] == ["unnamed>::matvec_kernel<1,", "unnamed>::matvec_kernel<1,",
                                        "unnamed>::matvec_kernel<1,", "unnamed>::matvec_kernel<1,",
                                        "unnamed>::rope_kv_kernel", "named>::Cfg<128,"]
    gate_up = out[2]  # kernel 1 (gate/up): 71.9 µs, 56.71 MB -> 789 GB/s, issues on 70.8 % of cycles
    assert " 71.9 " in gate_up and " 56.71 " in gate_up and " 789 " in gate_up and "70.8" in gate_up
    assert out[-1] == "total 387.5 us, 312.7 MB, 807 GB/s"
