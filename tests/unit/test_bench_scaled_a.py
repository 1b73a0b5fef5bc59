"""The scaled-weights design probe (bench/mma_scaled_a.cu) keeps its promises on the CPU: its
integers stay within 32 bits even where every q, scale, minimum and digit of x is at its
largest, and its arithmetic, replayed step for step, lands within float32 rounding of the
float64 reference on the 8B's verify shapes; and a decode reader's way to the same integers
(dp4a-sized sums, whole T_j) gives the same floats bit for bit. (Its kernels against that
replay and each other need a GPU: `bench/bench_scaled_a.py --gpu`.)"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import bench_scaled_a  # noqa: E402
import sass_mix  # noqa: E402


def have_nvcc() -> bool:
    try:
        sass_mix.find_nvcc()
        return True
    except SystemExit:
        return False


@pytest.mark.skipif(not have_nvcc(), reason="no nvcc")
def test_the_probe_arithmetic_is_exact_until_its_float_epilogue(tmp_path: Path) -> None:
    assert bench_scaled_a.main(["--out", str(tmp_path)]) == 0
    (out,) = tmp_path.glob("scaled_a_*.json")
    rows = json.loads(out.read_text())["rows"]
    assert [r["shape"] for r in rows] == list(bench_scaled_a.SHAPES)
    for r in rows:
        assert (r["K"], r["n_out"]) == bench_scaled_a.SHAPES[r["shape"]]
        assert r["int32_overflow"] is False and r["extreme_int32_overflow"] is False
        # float32 rounding of M and N and of the sum over 16 super-blocks: a few ulps of the output
        assert 0 < r["replay_rel_err"] < 1e-6
        assert r["extreme_rel_err"] < 1e-6
        # the decode reader's way to the same integers gives the same floats: speculation stays exact
        assert r["decode_replay_unlike"] == 0
