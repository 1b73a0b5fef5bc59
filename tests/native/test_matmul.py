"""Native matmul y[m, n_out] = x[m, n_in] @ W^T for every stored weight type, against float64
numpy on the weights as gguf dequantizes them; plus batch invariance (each output row is
bit-identical whatever m, the thread count, or dot_row) and the error messages.

Weights are fresh random raw blocks (finite fp16 scales); the seed is printed.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize

from helpers.weights import random_weight
from worker.engine import native, ops

EngineError = native.EngineError

ALL_TYPES = [T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q4_K, T.Q5_K, T.Q6_K]
U = 2.0**-24  # float32 unit roundoff



@pytest.fixture
def two_threads():
    native.set_num_threads(2)
    yield
    native.set_num_threads(0)


def n_in_for(qtype: T) -> int:
    """Reduction length: several blocks; off the 8-lane grid for float types (tails)."""
    block_elems = GGML_QUANT_SIZES[qtype][0]
    return 77 if block_elems == 1 else 3 * block_elems


def reference(qtype: T, w: np.ndarray, n_out: int, n_in: int, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(float64 x @ W^T, error bound per element).

    Dequantized weights are exact and products x*w are exact in float64; each native output is a
    recursive float32 sum with at most k = n_in/8 + 40 roundings per term (8 fma lanes of
    n_in/8 terms + 3 pairwise adds + <= 7 tail fmas on AVX2; 32-term pieces + n_in/32 piece
    adds on the scalar path), so |error| <= k * u * (|x| @ |W|^T).
    """
    wf = np.asarray(dequantize(w, qtype), dtype=np.float32).reshape(n_out, n_in).astype(np.float64)
    x64 = x.astype(np.float64)
    bound = 1.01 * (n_in / 8 + 40) * U * (np.abs(x64) @ np.abs(wf).T)
    return x64 @ wf.T, bound


@pytest.mark.parametrize("m", [1, 3, 5, 6, 17])
@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_matmul_matches_float64(qtype: T, m: int, rng: np.random.Generator, two_threads) -> None:
    # 37 rows over 2 threads (32 + 5): 8-, 4- and 1-row decode groups; 16-row panels, partial tiles
    n_out, n_in = 37, n_in_for(qtype)
    w = random_weight(rng, qtype, n_out, n_in)
    x = rng.standard_normal((m, n_in), dtype=np.float32)
    y = ops.matmul(int(qtype), w, n_in, n_out, x)
    assert y.shape == (m, n_out) and y.dtype == np.float32
    want, bound = reference(qtype, w, n_out, n_in, x)
    err = np.abs(y.astype(np.float64) - want)
    assert np.all(err <= bound), f"{qtype.name} m={m}: worst error/bound {np.max(err / bound):.3g}"
    # non-vacuous: the bound is positive and below one average term |x| @ |W|^T / n_in, so a
    # wrong or missing term breaks it
    assert np.all(bound > 0) and 1.01 * (n_in / 8 + 40) * U * n_in < 0.01


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_matmul_is_batch_invariant(qtype: T, rng: np.random.Generator) -> None:
    # Every output element is computed by the same float32 operation sequence whatever m, the
    # tile it lands in, the thread count, or whether dot_row computed it: bit-identical results
    # (speculative verify of k+1 tokens == k+1 decodes; prefill == decode).
    # m = 11 takes the dequantized-panel path, m <= 5 the fused decode path.
    n_out, n_in, m = 41, n_in_for(qtype), 11
    w = random_weight(rng, qtype, n_out, n_in)
    x = rng.standard_normal((m, n_in), dtype=np.float32)
    native.set_num_threads(2)
    try:
        batched = ops.matmul(int(qtype), w, n_in, n_out, x)
        fused = np.concatenate([ops.matmul(int(qtype), w, n_in, n_out, x[a:a + k]) for a, k in ((0, 5), (5, 2), (7, 4))])
        singles = np.concatenate([ops.matmul(int(qtype), w, n_in, n_out, x[a:a + 1]) for a in range(m)])
        native.set_num_threads(1)
        serial = ops.matmul(int(qtype), w, n_in, n_out, x)
    finally:
        native.set_num_threads(0)
    np.testing.assert_array_equal(batched.view(np.uint32), singles.view(np.uint32))
    np.testing.assert_array_equal(batched.view(np.uint32), fused.view(np.uint32))
    np.testing.assert_array_equal(batched.view(np.uint32), serial.view(np.uint32))
    row_bytes = w.size // n_out
    dots = np.array([[ops.dot_row(int(qtype), w[r * row_bytes:(r + 1) * row_bytes], x[a]) for r in range(n_out)]
                     for a in range(m)], dtype=np.float32)
    np.testing.assert_array_equal(batched.view(np.uint32), dots.view(np.uint32))


def test_matmul_larger_shape_across_panels(rng: np.random.Generator, two_threads) -> None:
    # More rows than one 16-row panel per thread, n_in with many blocks, m not a multiple of 3.
    qtype, n_out, n_in, m = T.Q4_1, 130, 1024, 8
    w = random_weight(rng, qtype, n_out, n_in)
    x = rng.standard_normal((m, n_in), dtype=np.float32)
    want, bound = reference(qtype, w, n_out, n_in, x)
    for rows in (x, x[:1]):
        y = ops.matmul(int(qtype), w, n_in, n_out, rows)
        assert np.all(np.abs(y - want[: len(rows)]) <= bound[: len(rows)])


def test_matmul_f32_unaligned_weight_buffer(rng: np.random.Generator) -> None:
    # F32 weights are used in place when float-aligned, copied otherwise: same results.
    n_out, n_in, m = 9, 45, 4
    w = random_weight(rng, T.F32, n_out, n_in)
    buf = np.zeros(w.size + 1, np.uint8)
    buf[1:] = w
    x = rng.standard_normal((m, n_in), dtype=np.float32)
    aligned = ops.matmul(int(T.F32), w, n_in, n_out, x)
    unaligned = ops.matmul(int(T.F32), buf[1:], n_in, n_out, x)
    np.testing.assert_array_equal(aligned, unaligned)
    want, bound = reference(T.F32, w, n_out, n_in, x)
    assert np.all(np.abs(aligned - want) <= bound)


def test_matmul_empty_batch() -> None:
    w = np.zeros(4 * 34, np.uint8)  # 4 rows of one Q8_0 block
    y = ops.matmul(int(T.Q8_0), w, 32, 4, np.zeros((0, 32), np.float32))
    assert y.shape == (0, 4)


def test_matmul_n_in_not_multiple_of_block_is_rejected() -> None:
    with pytest.raises(EngineError, match=r"not a multiple of the Q4_1 block size 32"):
        ops.matmul(int(T.Q4_1), np.zeros(40, np.uint8), 48, 1, np.zeros((1, 48), np.float32))


@pytest.mark.parametrize("type_id", [10, 99])
def test_matmul_unsupported_type_is_rejected(type_id: int) -> None:
    with pytest.raises(EngineError, match=r"unsupported tensor type id .*supported: F32, F16, BF16, Q8_0, Q4_0"):
        ops.matmul(type_id, np.zeros(64, np.uint8), 32, 2, np.zeros((1, 32), np.float32))


def test_matmul_shape_mismatches_are_rejected() -> None:
    w = np.zeros(2 * 34, np.uint8)  # 2 rows of one Q8_0 block
    with pytest.raises(EngineError, match=r"expected 102"):  # 3 rows need 102 bytes
        ops.matmul(int(T.Q8_0), w, 32, 3, np.zeros((1, 32), np.float32))
    with pytest.raises(EngineError, match=r"x must be \[m, n_in\]"):
        ops.matmul(int(T.Q8_0), w, 32, 2, np.zeros((1, 64), np.float32))


# Runs in a fresh interpreter with SPECD_SIMD=scalar: the portable (non-x86) matmul path.
_SCALAR_SCRIPT = textwrap.dedent("""
    import sys
    import numpy as np
    from worker.engine import native, ops
    assert native.simd_path() == "scalar", native.simd_path()
    data = np.load(sys.argv[1])
    out = {}
    for key in data.files:
        if key.startswith("w_"):
            tid, n_out, n_in = (int(v) for v in key[2:].split("_"))
            w, x = data[key], data["x_" + key[2:]]
            out["y_" + key[2:]] = ops.matmul(tid, w, n_in, n_out, x)
            out["y1_" + key[2:]] = np.concatenate([ops.matmul(tid, w, n_in, n_out, x[a:a + 1]) for a in range(len(x))])
            rb = w.size // n_out
            out["d_" + key[2:]] = np.array([[ops.dot_row_scalar(tid, w[r * rb:(r + 1) * rb], xa) for r in range(n_out)]
                                            for xa in x], dtype=np.float32)
    np.savez(sys.argv[2], **out)
""")


def test_scalar_path_matmul(rng: np.random.Generator, tmp_path) -> None:
    # The portable path (what non-x86 machines run) is forced with SPECD_SIMD=scalar in a
    # subprocess: same float64 bounds, and batch invariance (m = 5 == 5 x m = 1 == dot_row_scalar).
    cases, m = {}, 5
    for qtype in ALL_TYPES:
        n_out, n_in = 19, n_in_for(qtype)
        key = f"{int(qtype)}_{n_out}_{n_in}"
        cases["w_" + key] = random_weight(rng, qtype, n_out, n_in)
        cases["x_" + key] = rng.standard_normal((m, n_in), dtype=np.float32)
    np.savez(tmp_path / "in.npz", **cases)
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, SPECD_SIMD="scalar",
               PYTHONPATH=os.pathsep.join([repo] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    subprocess.run([sys.executable, "-c", _SCALAR_SCRIPT, str(tmp_path / "in.npz"), str(tmp_path / "out.npz")],
                   env=env, cwd=repo, check=True, timeout=120)
    out = np.load(tmp_path / "out.npz")
    for qtype in ALL_TYPES:
        n_out, n_in = 19, n_in_for(qtype)
        key = f"{int(qtype)}_{n_out}_{n_in}"
        y = out["y_" + key]
        want, bound = reference(qtype, cases["w_" + key], n_out, n_in, cases["x_" + key])
        assert np.all(np.abs(y - want) <= bound), qtype.name
        np.testing.assert_array_equal(y.view(np.uint32), out["y1_" + key].view(np.uint32))
        np.testing.assert_array_equal(y.view(np.uint32), out["d_" + key].view(np.uint32))
