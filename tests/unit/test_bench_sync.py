"""bench/bench_sync.py's table: each mode's cost per phase boundary is its median step time less
the barrier-free stream's, over the step's boundaries (phases - 1), and its share of the
bandwidth floor is floor / median."""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))  # bench_sync imports its sibling machine.py

import bench_sync  # noqa: E402

RES = {"phases": 181, "modes": {"kernels": {"median_us": 2900.0, "min_us": 2880.0},
                                "kernels+pdl": {"median_us": 2540.0, "min_us": 2531.0},
                                "barrier": {"median_us": 1820.0, "min_us": 1815.5},
                                "stream": {"median_us": 1100.0, "min_us": 1098.0}}}


def test_table_gives_each_mode_its_cost_per_boundary_and_share_of_the_floor():
    lines = bench_sync.table(RES, floor_us=1100.0)
    assert lines[0].split() == ["mode", "median", "us", "min", "us", "%", "floor", "us/boundary"]
    rows = {line.split()[0]: line.split()[1:] for line in lines[1:]}
    assert list(rows) == ["kernels", "kernels+pdl", "barrier", "stream"]
    assert rows["kernels"] == ["2900.0", "2880.0", "37.9%", "10.00"]  # (2900 - 1100) / 180
    assert rows["kernels+pdl"] == ["2540.0", "2531.0", "43.3%", "8.00"]
    assert rows["barrier"] == ["1820.0", "1815.5", "60.4%", "4.00"]
    assert rows["stream"] == ["1100.0", "1098.0", "100.0%", "0.00"]
