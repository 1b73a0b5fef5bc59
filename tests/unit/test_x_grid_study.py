"""bench/x_grid_study.py's rounding is the CUDA digit readers' (worker/kernels/cuda/digits.cuh):
each block of x on the power-of-two grid of its largest element, X = round(x 2^(bits-1-E)) with
|x| < 2^E, ties to even; and its lost-bits measure is log2 of a 256 block's top over a 32
block's."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))  # x_grid_study imports its sibling machine.py

import x_grid_study as xg  # noqa: E402


@pytest.mark.parametrize("block,bits", [(32, 23), (256, 23), (32, 15), (64, 8)])
def test_rounding_is_each_blocks_grid_of_its_top(block: int, bits: int) -> None:
    rng = np.random.default_rng(7)
    x = rng.standard_normal((3, 1000)) * np.exp(rng.uniform(-8, 8, (3, 1000)))  # K = 1000: a short last block
    got = xg.round_to_grid(x, block, bits)
    assert got.shape == x.shape
    for r in range(3):
        for b0 in range(0, 1000, block):
            xb, gb = x[r, b0:b0 + block], got[r, b0:b0 + block]
            e = int(np.floor(np.log2(np.abs(xb).max()))) + 1  # |x| < 2^e over the block
            step = 2.0 ** (e - (bits - 1))
            digits = gb / step
            np.testing.assert_array_equal(digits, np.round(digits))  # on the grid
            assert np.abs(digits).max() <= 2.0 ** (bits - 1)
            assert np.abs(gb - xb).max() <= step / 2  # to nearest


def test_rounding_ties_go_to_even_and_zero_blocks_stay_zero() -> None:
    x = np.zeros((2, 32))
    x[0, 0] = 1.0  # top 1 < 2^1: step 2^(1 - 3) = 0.25 with 4-bit digits
    x[0, 1:4] = [0.125, 0.375, -0.625]  # halfway cases
    got = xg.round_to_grid(x, 32, 4)
    np.testing.assert_array_equal(got[0, :4], [1.0, 0.0, 0.5, -0.5])
    np.testing.assert_array_equal(got[1], 0.0)


def test_lost_bits_compare_each_32_block_with_its_256_block() -> None:
    x = np.ones((1, 512))
    x[0, 5] = 2.0**10  # the first 256 block's top: its other 7 blocks lose 10 bits
    x[0, 256 + 40] = 0.0  # (no change: a block's top is still 1)
    x[0, 256 + 64:256 + 96] = 0.0  # an all-zero block is left out
    got = xg.lost_bits(x)
    np.testing.assert_array_equal(np.sort(got), np.sort([0.0] + [10.0] * 7 + [0.0] * 7))
