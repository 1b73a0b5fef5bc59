"""GGUF block formats in the native engine: dequantization against gguf's numpy code, and row
dot products (fast AVX2 path and portable scalar path) against float64 numpy.

Inputs are fresh random blocks every run (seed printed by the `rng` fixture). K-quants cannot
be produced by gguf's quantizer, so every quantized type is also tested on raw random bytes
with finite fp16 scale fields: gguf.quants.dequantize on the same bytes is the ground truth.
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize, quantize

from worker.engine import native, ops

EngineError = native.EngineError

ALL_TYPES = [T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q4_K, T.Q5_K, T.Q6_K]
GGUF_QUANTIZABLE = [T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1]
# byte offsets of the fp16 fields (d, m / dmin) inside one block
HALF_FIELDS = {T.Q8_0: (0,), T.Q4_0: (0,), T.Q5_0: (0,), T.Q4_1: (0, 2), T.Q5_1: (0, 2),
               T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,)}
U = 2.0**-24  # float32 unit roundoff



def random_halves(rng: np.random.Generator, count: int) -> np.ndarray:
    """Finite fp16 scales over a wide range, both signs, with some zeros and subnormals."""
    v = rng.uniform(0.5, 1.0, count) * 2.0 ** rng.integers(-12, 2, count) * rng.choice([-1.0, 1.0], count)
    v[1:][rng.random(count - 1) < 0.05] = 0.0  # the first block always has normal scales,
    v[1:][rng.random(count - 1) < 0.05] = 3e-6  # so no row is all zeros; 3e-6 is fp16-subnormal
    return v.astype(np.float16)


def raw_row(rng: np.random.Generator, qtype: T, n: int) -> np.ndarray:
    """One row of n elements as raw bytes: random payload, sane fp16 scales."""
    if qtype == T.F32:
        return rng.standard_normal(n, dtype=np.float32).view(np.uint8)
    if qtype == T.F16:
        return rng.standard_normal(n).astype(np.float16).view(np.uint8)
    if qtype == T.BF16:
        return (rng.standard_normal(n, dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    block_elems, block_bytes = GGML_QUANT_SIZES[qtype]
    nblk = n // block_elems
    blocks = rng.integers(0, 256, size=(nblk, block_bytes), dtype=np.uint8)
    for off in HALF_FIELDS[qtype]:
        blocks[:, off:off + 2] = random_halves(rng, nblk).view(np.uint8).reshape(nblk, 2)
    return blocks.reshape(-1)


def lengths(qtype: T) -> list[int]:
    """Row lengths: one block, several blocks; float types also get lengths off the 8-lane grid."""
    be = GGML_QUANT_SIZES[qtype][0]
    return [1, 7, 8, 37, 300] if be == 1 else [be, 5 * be]


def ref_values(qtype: T, row: np.ndarray) -> np.ndarray:
    return np.asarray(dequantize(row, qtype), dtype=np.float32).reshape(-1)


def dot_tolerance(n: int, w: np.ndarray, x: np.ndarray) -> float:
    """Rigorous bound on |float32 dot - exact dot|.

    The dequantized weights are exact, so only the summation rounds. AVX2: each of 8 lanes
    accumulates n/8 fma products, then 3 pairwise adds and <= 7 scalar tail fmas; scalar:
    partial sums of <= 32 products, then n/32 piece additions. Both are recursive sums with
    at most k = n/8 + 40 roundings per term, so |error| <= k * u * sum|x*w| (plus the tiny
    float64 reference error, < n * 2^-53 relative).
    """
    k = n / 8 + 40
    return 1.01 * k * U * float(np.abs(w.astype(np.float64) * x.astype(np.float64)).sum()) + 1e-30


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_dequantize_random_bytes_matches_gguf_exactly(qtype: T, rng: np.random.Generator) -> None:
    # Tolerance 0 (bit-identical, signed zeros included): every dequantized value is an exact
    # float32 product (<= 24 significant bits) plus at most one rounded offset add.
    nonzero = 0
    for n in lengths(qtype):
        for _ in range(3):
            row = raw_row(rng, qtype, n)
            want = ref_values(qtype, row)
            got = ops.dequantize(int(qtype), row, n)
            assert got.dtype == np.float32 and got.shape == (n,)
            assert np.all(np.isfinite(want))
            nonzero += int(np.count_nonzero(want))
            bad = np.flatnonzero(got.view(np.uint32) != want.view(np.uint32))[:5]
            assert bad.size == 0, f"{qtype.name} n={n}: mismatch at {bad}: {got[bad]} vs {want[bad]}"
    assert nonzero > 100  # the comparison saw real values


@pytest.mark.parametrize("qtype", GGUF_QUANTIZABLE, ids=lambda t: t.name)
def test_dequantize_gguf_quantized_rows(qtype: T, rng: np.random.Generator) -> None:
    # Realistic blocks (what gguf's quantizer writes, as in real model files); exact match.
    be = GGML_QUANT_SIZES[qtype][0]
    data = (rng.standard_normal(8 * max(be, 32)) * rng.uniform(0.01, 3)).astype(np.float32)
    row = np.asarray(quantize(data, qtype)).reshape(-1).view(np.uint8)
    want = ref_values(qtype, row)
    got = ops.dequantize(int(qtype), row, data.size)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    assert np.abs(want - data).max() < 0.2 * np.abs(data).max()  # really a quantized copy


@pytest.mark.parametrize("scalar", [False, True], ids=["dot_row", "dot_row_scalar"])
@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_dot_row_matches_float64(qtype: T, scalar: bool, rng: np.random.Generator) -> None:
    dot = ops.dot_row_scalar if scalar else ops.dot_row
    for n in lengths(qtype) + [4 * 1024 if GGML_QUANT_SIZES[qtype][0] > 1 else 1029]:
        row = raw_row(rng, qtype, n)
        w = ref_values(qtype, row)
        x = rng.standard_normal(n, dtype=np.float32)
        want = float(w.astype(np.float64) @ x.astype(np.float64))
        tol = dot_tolerance(n, w, x)
        got = dot(int(qtype), row, x)
        assert abs(got - want) <= tol, f"{qtype.name} n={n}: got {got}, want {want}, tol {tol}"
        # non-vacuous: dropping or corrupting one average-sized term would exceed the tolerance
        assert tol < float(np.abs(w.astype(np.float64) * x).mean())


def test_dot_row_fast_path_is_active() -> None:
    # On x86 with AVX2 the fast path must really be used (else the tests above only test scalar).
    assert native.simd_path() in ("avx2", "scalar")
    if native.simd_path() == "avx2":
        rng = np.random.default_rng(1)
        row, x = raw_row(rng, T.Q4_1, 4096), rng.standard_normal(4096, dtype=np.float32)
        # different summation orders: the two paths agree closely but (almost surely) not bitwise
        results = {ops.dot_row(int(T.Q4_1), row, x), ops.dot_row_scalar(int(T.Q4_1), row, x)}
        assert len(results) == 2


@pytest.mark.parametrize("fn", ["dequantize", "dot_row", "dot_row_scalar"])
def test_length_not_multiple_of_block_is_rejected(fn: str) -> None:
    row = np.zeros(GGML_QUANT_SIZES[T.Q4_K][1], np.uint8)  # one Q4_K block (256 elements)
    with pytest.raises(EngineError, match=r"not a multiple of the Q4_K block size 256"):
        if fn == "dequantize":
            ops.dequantize(int(T.Q4_K), row, 100)
        else:
            getattr(ops, fn)(int(T.Q4_K), row, np.zeros(100, np.float32))


@pytest.mark.parametrize("type_id", [10, 11, 16, 99, -1])  # Q2_K, Q3_K, IQ2_XXS, nonsense
def test_unsupported_type_is_rejected_with_supported_list(type_id: int) -> None:
    with pytest.raises(EngineError, match=r"unsupported tensor type id .*supported: F32, F16, BF16, Q8_0.*Q6_K"):
        ops.dequantize(type_id, np.zeros(64, np.uint8), 32)
    with pytest.raises(EngineError, match=r"supported: F32"):
        ops.dot_row(type_id, np.zeros(64, np.uint8), np.zeros(32, np.float32))


def test_buffer_size_mismatch_is_rejected() -> None:
    with pytest.raises(EngineError):
        ops.dequantize(int(T.Q8_0), np.zeros(33, np.uint8), 32)  # one Q8_0 block is 34 bytes
