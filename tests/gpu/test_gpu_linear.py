"""GPU linear() and embed_rows (cuda/linear.cuh) against float64 numpy and the CPU ops.

Every stored type (F32 F16 BF16 Q8_0 Q4_0 Q4_1 Q5_0 Q5_1 Q4_K Q5_K Q6_K), both paths: n <= 64
(float32-accurate, batch-invariant: rows must be BIT-identical whatever n; with
tensor_cores=False Q8_0 / Q4_K / Q6_K take the digit reader, with True the float reader) and
n > 64 (fp16 tensor cores), every epilogue, biases, the fused RMSNorm, three weights of mixed
types in one launch, x of any range per block and NaN / inf in x, embed_rows bit-equal to
ops.dequantize, and the argument errors.

Weights are fresh random blocks every run (seed printed by the `rng` fixture): raw random
payload with finite fp16 scales (every nibble / sign pattern, like tests/native), plus gguf's
own quantizer for the types it can write. The ground truth is float64 numpy on the weights as
ops.dequantize (== gguf.quants.dequantize, tests/native/test_quants.py) decodes them.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T
from gguf.quants import quantize

from helpers.weights import random_weight
from worker.engine import native, ops
from worker.errors import SpecdError

G = getattr(native, "gpu_ops", None)  # None in CPU builds: conftest skips every test here
ALL_TYPES = [T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q4_K, T.Q5_K, T.Q6_K]
GGUF_QUANTIZABLE = [T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1]
U = 2.0**-24  # float32 unit roundoff
MAX_SMALL = 64  # kMaxSmallBatch


# ---- inputs

def gguf_weight(rng: np.random.Generator, qtype: T, n_out: int, n_in: int) -> np.ndarray:
    """A realistic weight: gguf's quantizer applied to Gaussian data (as in model files)."""
    data = (rng.standard_normal((n_out, n_in)) * rng.uniform(0.01, 0.5)).astype(np.float32)
    return np.asarray(quantize(data, qtype)).reshape(-1).view(np.uint8)


def dequant(qtype: T, w: np.ndarray, n_out: int, n_in: int) -> np.ndarray:
    """float64 [n_out, n_in] of the weight exactly as the CPU decodes it."""
    return ops.dequantize(int(qtype), w, n_out * n_in).reshape(n_out, n_in).astype(np.float64)


def wabs(qtype: T, w: np.ndarray, n_out: int, n_in: int) -> np.ndarray:
    """What the error bounds multiply: |w|, except for Q4_K (w = s q + m), which the small
    path's digit reader sums as s * sum(q x) + m * sum(x): |s| q + |m| (the weight decoded with
    d made positive and dmin negative)."""
    if qtype != T.Q4_K:
        return np.abs(dequant(qtype, w, n_out, n_in))
    blocks = w.reshape(-1, GGML_QUANT_SIZES[qtype][1]).copy()
    blocks[:, 1] &= 0x7F  # d >= 0
    blocks[:, 3] |= 0x80  # dmin <= 0: - dmin * mn >= 0
    return dequant(qtype, blocks.reshape(-1), n_out, n_in)


def n_ins(qtype: T) -> tuple[int, int]:
    """(short, long) reductions: off the 256-element grid where the block allows it, and past
    one 1024-element stage with a partial last stage."""
    be = GGML_QUANT_SIZES[qtype][0]
    if be == 256:
        return 256, 2304
    if be == 32:
        return 96, 2080
    return 40, 1800


def gpu(ws, biases, x, norm_w=None, eps=0.0, epilogue=0, y=None, tensor_cores=False) -> np.ndarray:
    """ws: [(qtype, bytes, n_out, n_in)]."""
    return G.linear(weights=[(int(t), w, n_in, n_out) for t, w, n_out, n_in in ws], biases=biases,
                    x=np.ascontiguousarray(x, dtype=np.float32), norm_w=norm_w, eps=eps, epilogue=epilogue, y=y,
                    tensor_cores=tensor_cores)


# ---- error bounds (all derived for float32 / fp16 rounding; the float64 reference is exact
# to ~1e-16 and is ignored)

def block_max(ax: np.ndarray) -> np.ndarray:
    """Each element replaced by the largest of its 32-element block along K."""
    n, k = ax.shape
    pad = np.zeros((n, -k % 32))
    m = np.concatenate([ax, pad], 1).reshape(n, -1, 32).max(2)
    return np.repeat(m, 32, 1)[:, :k]


def small_bound(ax: np.ndarray, aw: np.ndarray, extra: float = 0.0) -> np.ndarray:
    """|float32 GPU - exact| for the n <= 64 path, elementwise (aw: wabs of the weight).

    CUDA-core path (matvec.cu): each lane accumulates K/32 elements into one sum (K/256
    pieces of 8: 8 fmas, or for a Scaled piece two 4-term partials each added by one scale
    fma: K/32 roundings per term at most), then a 5-level butterfly: at most K/32 + 16
    roundings per product. Tensor-core path (matvec_tc.cu: F16, and Q8_0, Q4_K, Q6_K with
    SPECD_GPU_TC=all; K % 32 == 0): x keeps 22 bits (4 roundings), then K/64 MMA accumulations per warp, a scale fma per
    16 elements (Q4_K: per 128, after 16 MMAs, and an offset fma per 32) and 7 warp sums: fewer. So |err| <= (K/32 +
    20) u |x||W|^T for both.
    `extra` adds roundings (fused norm: w*nw or x*nw, the inv factor's own error).
    Digit path (Q8_0, Q4_K, Q6_K on the CUDA cores): x is first rounded to the power-of-two
    grid of its 32-element block, 23 bits below the block's bound 2^E <= 2 max|x_block|: an
    error of at most 2^-22 max|x_block| per element, the last term. The integer sums are
    exact; the conversions, scale fmas and butterfly stay within the first term.
    """
    k = ax.shape[1]
    return 1.01 * ((k / 32 + 20 + extra) * U * (ax @ aw.T) + 2.0**-22 * (block_max(ax) @ aw.T))


def fp16_bound(ax: np.ndarray, aw: np.ndarray) -> np.ndarray:
    """|fp16 tensor-core GEMM - exact| for the n > 64 path, elementwise.

    x and w are rounded to fp16: relative 2^-11 each (product 2^-10 + 2^-22), plus an absolute
    2^-25 where a value lands in fp16's subnormal range; products are exact in fp32 and summed in
    fp32 by the tensor cores (allow 2K roundings: their adders may truncate).
    """
    k = ax.shape[1]
    rel = (2.0**-10 + 2.0**-21 + 2 * (k + 16) * U) * (ax @ aw.T)
    sub = 2.0**-24 * (ax.sum(1)[:, None] + aw.sum(1)[None, :])
    return 1.01 * (rel + sub)


def check(got: np.ndarray, want: np.ndarray, bound: np.ndarray, what: str) -> None:
    assert got.shape == want.shape and got.dtype == np.float32, what
    assert np.all(np.isfinite(got)), f"{what}: non-finite output"
    err = np.abs(got.astype(np.float64) - want)
    bad = np.argwhere(err > bound)
    assert bad.size == 0, (f"{what}: {len(bad)} elements out of bound, first {bad[:3].tolist()}: "
                           f"worst err/bound {np.max(err / bound):.3g}")


def check_store(y: np.ndarray, x: np.ndarray, ws, biases, bound_of, what: str) -> None:
    """y = x W_j^T + b_j side by side (Store) against float64, within bound_of(x64, wabs) plus
    2 u |result| (the bias add and the final rounding)."""
    x64, col = x.astype(np.float64), 0
    for (t, w, m, n_in), b in zip(ws, biases):
        wf = dequant(t, w, m, n_in)
        want = x64 @ wf.T + (0 if b is None else b.astype(np.float64))
        check(y[:, col:col + m], want, bound_of(x64, wabs(t, w, m, n_in)) + 2 * U * np.abs(want), f"{t.name} {what}")
        col += m


def bound_for(n: int, ax, aw, extra: float = 0.0) -> np.ndarray:
    return small_bound(ax, aw, extra) if n <= MAX_SMALL else fp16_bound(ax, aw)


# ---- every type, both paths, Store

@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_linear_every_type_matches_float64(qtype: T, rng: np.random.Generator) -> None:
    # odd n_out (last CTA / tile partial); n covers every small tile size (1, 2, 4) and partial
    # tiles, and the tensor-core path at 65 and 300 rows.
    for n_in in n_ins(qtype):
        n_out = 133
        w = random_weight(rng, qtype, n_out, n_in)
        wf, aw = dequant(qtype, w, n_out, n_in), wabs(qtype, w, n_out, n_in)
        for n in (1, 2, 3, 5, 17, 64, 65, 300):
            x = rng.standard_normal((n, n_in), dtype=np.float32)
            y = gpu([(qtype, w, n_out, n_in)], [None], x)
            x64 = x.astype(np.float64)
            check(y, x64 @ wf.T, bound_for(n, np.abs(x64), aw), f"{qtype.name} K={n_in} n={n}")
        # non-vacuous: the float32 bound is far below one average term |x||w|
        assert (n_in / 64 + 16) * U * n_in < 0.01


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_small_path_agrees_with_cpu_matmul(qtype: T, rng: np.random.Generator) -> None:
    # The CPU op (tests/native/test_matmul.py: within (K/8 + 40) u |x||W|^T of exact) and the GPU
    # (within small_bound) must agree within the sum of the two bounds.
    n_in, n_out, n = n_ins(qtype)[1], 37, 3
    w = random_weight(rng, qtype, n_out, n_in)
    x = rng.standard_normal((n, n_in), dtype=np.float32)
    cpu = ops.matmul(int(qtype), w, n_in, n_out, x)
    y = gpu([(qtype, w, n_out, n_in)], [None], x)
    wf, x64 = dequant(qtype, w, n_out, n_in), x.astype(np.float64)
    mag = np.abs(x64) @ np.abs(wf).T
    tol = small_bound(np.abs(x64), wabs(qtype, w, n_out, n_in)) + 1.01 * (n_in / 8 + 40) * U * mag
    assert np.all(np.abs(y.astype(np.float64) - cpu) <= tol)


@pytest.mark.parametrize("qtype", GGUF_QUANTIZABLE, ids=lambda t: t.name)
def test_linear_gguf_quantized_weights(qtype: T, rng: np.random.Generator) -> None:
    # Realistic blocks as gguf's quantizer writes them; both paths.
    n_out, n_in = 67, 512
    w = gguf_weight(rng, qtype, n_out, n_in)
    wf = dequant(qtype, w, n_out, n_in)
    for n in (1, 7, 100):
        x = rng.standard_normal((n, n_in), dtype=np.float32)
        x64 = x.astype(np.float64)
        check(gpu([(qtype, w, n_out, n_in)], [None], x), x64 @ wf.T, bound_for(n, np.abs(x64), np.abs(wf)),
              f"{qtype.name} n={n}")


def test_large_path_big_shape_relative_error(rng: np.random.Generator) -> None:
    # A model-sized prefill GEMM (K = 4096, several tiles in both directions): relative
    # Frobenius error of the fp16 path < 2e-3 (fp16 inputs: ~2^-11 per factor, ~5e-4 typical).
    n, n_in, n_out = 320, 4096, 1000
    for qtype in (T.Q4_K, T.Q6_K, T.Q8_0, T.F16, T.BF16):
        w = random_weight(rng, qtype, n_out, n_in)
        wf = dequant(qtype, w, n_out, n_in)
        x = rng.standard_normal((n, n_in), dtype=np.float32)
        want = x.astype(np.float64) @ wf.T
        y = gpu([(qtype, w, n_out, n_in)], [None], x)
        rel = np.linalg.norm(y - want) / np.linalg.norm(want)
        assert rel < 2e-3, f"{qtype.name}: relative Frobenius error {rel:.3g}"


# ---- the digit path's rounding of x (Q8_0, Q4_K, Q6_K on the CUDA cores)

@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_K, T.Q6_K, T.Q5_K], ids=lambda t: t.name)
def test_small_path_blocks_of_any_range(qtype: T, rng: np.random.Generator) -> None:
    # Every 32-element block of x on its own grid: blocks of 1e-30, 1e-3, 1 and 1e20, all-zero
    # blocks, signed zeros, subnormals, and blocks whose largest element is 1e6 times the rest
    # (each rounded to 23 bits below its block's largest). Within small_bound of float64, with
    # the fused norm and 1 % of elements 1e4 times the rest too. (Q5_K: the float path.)
    n_in, n_out, n = 1024, 40, 5
    w = random_weight(rng, qtype, n_out, n_in)
    wf, aw = dequant(qtype, w, n_out, n_in), wabs(qtype, w, n_out, n_in)
    blocks = rng.standard_normal((n, n_in // 32, 32))
    blocks *= 10.0 ** rng.choice([-30.0, -3.0, 0.0, 20.0], (n, n_in // 32, 1))
    blocks[:, ::7] = 0.0
    blocks[:, 3::7, 5] = -0.0
    blocks[:, 4::7] *= 1e-12  # 1e-42 .. 1e8: some subnormal in float32
    blocks[:, 5::7, 0] *= 1e6
    x = blocks.reshape(n, n_in).astype(np.float32)
    x64 = x.astype(np.float64)
    check(gpu([(qtype, w, n_out, n_in)], [None], x), x64 @ wf.T, small_bound(np.abs(x64), aw), f"{qtype.name}")
    norm_w = rng.uniform(0.5, 2.0, n_in).astype(np.float32)
    xo = (rng.standard_normal((n, n_in)) * np.where(rng.random((n, n_in)) < 0.01, 1e4, 1.0)).astype(np.float32)
    xn = xo.astype(np.float64) / np.sqrt((xo.astype(np.float64) ** 2).mean(1, keepdims=True) + 1e-6) * norm_w
    y = gpu([(qtype, w, n_out, n_in)], [None], xo, norm_w=norm_w, eps=1e-6)
    check(y, xn @ wf.T, small_bound(np.abs(xn), aw, n_in / 256 + 48), f"{qtype.name} norm")


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_K, T.Q6_K, T.F16], ids=lambda t: t.name)
def test_small_path_nan_in_x_gives_nan_row(qtype: T, rng: np.random.Generator) -> None:
    # One NaN or inf in a row of x: that row of y is all NaN (or inf / NaN on the float
    # path), never a finite wrong number; the other rows are untouched (bit-equal to alone).
    n_in, n_out = 512, 24
    w = random_weight(rng, qtype, n_out, n_in)
    x = rng.standard_normal((4, n_in), dtype=np.float32)
    x[1, 300] = np.nan
    x[2, 7] = np.inf
    ws = [(qtype, w, n_out, n_in)]
    y = gpu(ws, [None], x)
    assert np.all(np.isnan(y[1])) and not np.any(np.isfinite(y[2]))
    for r in (0, 3):
        np.testing.assert_array_equal(y[r].view(np.uint32), gpu(ws, [None], x[r:r + 1])[0].view(np.uint32))


# ---- batch invariance (what makes speculative decoding lossless)

def rows_alone(ws, biases, x, **kw) -> np.ndarray:
    return np.concatenate([gpu(ws, biases, x[r:r + 1], **kw) for r in range(len(x))])


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_small_path_is_batch_invariant(qtype: T, rng: np.random.Generator) -> None:
    # Row r of y is bit-identical whether computed alone (n = 1) or in a batch of 5, 17, 33 or
    # 64 rows, at any position of the batch, whatever the other rows hold.
    n_in, n_out = n_ins(qtype)[1], 133
    w = random_weight(rng, qtype, n_out, n_in)
    b = rng.standard_normal(n_out, dtype=np.float32)
    x = rng.standard_normal((MAX_SMALL, n_in), dtype=np.float32)
    ws = [(qtype, w, n_out, n_in)]
    alone = rows_alone(ws, [b], x)
    np.testing.assert_array_equal(gpu(ws, [b], x).view(np.uint32), alone.view(np.uint32))
    for lo, hi in ((0, 5), (3, 20), (30, 63), (11, 44)):
        np.testing.assert_array_equal(gpu(ws, [b], x[lo:hi]).view(np.uint32), alone[lo:hi].view(np.uint32))
    other = x.copy()
    other[1:] = rng.standard_normal((MAX_SMALL - 1, n_in), dtype=np.float32) * 100
    np.testing.assert_array_equal(gpu(ws, [b], other)[0].view(np.uint32), alone[0].view(np.uint32))


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K, T.Q8_0, T.Q5_0, T.F16], ids=lambda t: t.name)
def test_batch_invariant_across_cta_shapes(qtype: T, rng: np.random.Generator) -> None:
    # 3201 rows: 8 or 16 weight rows per CTA for tiles of up to 4 rows of x, 16 or 32 for tiles
    # of 8 and 16 (n = 12: one tile of 16; n = 4: one of 4; the digit reader of Q4_K, Q6_K and
    # Q8_0 takes tiles of at most 4): the launch shape changes, the rows must not.
    n_in, n_out = 256, 3201
    w = random_weight(rng, qtype, n_out, n_in)
    x = rng.standard_normal((40, n_in), dtype=np.float32)
    ws = [(qtype, w, n_out, n_in)]
    alone = rows_alone(ws, [None], x)
    for lo, hi in ((0, 40), (0, 12), (5, 13), (0, 4)):  # 3 tiles of 16, 1 of 16, 1 of 8, 1 of 4
        np.testing.assert_array_equal(gpu(ws, [None], x[lo:hi]).view(np.uint32), alone[lo:hi].view(np.uint32))


@pytest.mark.parametrize("types", [(T.Q4_K, T.Q4_K), (T.Q4_K, T.Q6_K), (T.BF16, T.BF16)],
                         ids=lambda ts: "-".join(t.name for t in ts))
def test_swiglu_batch_invariant_across_cta_shapes(types: tuple[T, T], rng: np.random.Generator) -> None:
    # 1000 output rows: 1 gate + 1 up row per group for tiles of up to 4 rows of x (and for a
    # single tile of 16), 2 + 2 for three tiles of 16 (n = 40); mixed types decode row by row.
    n_in, n_out = 512, 1000
    ws = [(t, random_weight(rng, t, n_out, n_in), n_out, n_in) for t in types]
    x = rng.standard_normal((40, n_in), dtype=np.float32) / np.sqrt(n_in)
    norm_w = rng.uniform(0.5, 1.5, n_in).astype(np.float32)
    kw = dict(norm_w=norm_w, eps=1e-6, epilogue=2)
    alone = rows_alone(ws, [None, None], x, **kw)
    for lo, hi in ((0, 40), (3, 19), (1, 7)):
        np.testing.assert_array_equal(gpu(ws, [None, None], x[lo:hi], **kw).view(np.uint32),
                                      alone[lo:hi].view(np.uint32))


def test_fused_norm_and_swiglu_are_batch_invariant(rng: np.random.Generator) -> None:
    n_in, n_out = 512, 77
    norm_w = rng.uniform(0.5, 1.5, n_in).astype(np.float32)
    x = rng.standard_normal((33, n_in), dtype=np.float32)
    qkv = [(T.Q4_K, random_weight(rng, T.Q4_K, 40, n_in), 40, n_in),
           (T.Q6_K, random_weight(rng, T.Q6_K, 24, n_in), 24, n_in),
           (T.Q8_0, random_weight(rng, T.Q8_0, 24, n_in), 24, n_in)]
    ffn = [(T.Q4_K, random_weight(rng, T.Q4_K, n_out, n_in), n_out, n_in),
           (T.Q5_K, random_weight(rng, T.Q5_K, n_out, n_in), n_out, n_in)]  # mixed types
    for ws, ep in ((qkv, 0), (ffn, 2)):
        kw = dict(norm_w=norm_w, eps=1e-5, epilogue=ep)
        batched = gpu(ws, [None] * len(ws), x, **kw)
        alone = rows_alone(ws, [None] * len(ws), x, **kw)
        np.testing.assert_array_equal(batched.view(np.uint32), alone.view(np.uint32))


# ---- the direct readers (matvec_direct.cuh): every weight Q4_K / Q6_K or every weight Q8_0
# (matvec_kq.cu, digits of x; rows of whole 4-byte words: K a multiple of 512 for Q6_K, of 64
# for Q8_0) or every weight F16 / BF16 (matvec_f16.cu, 16-byte rows); persistent CTAs taking
# blocks of 16 rows (32 in half groups: K <= 1024 for the digit reader), tiles of 1, 2 or 4
# rows of x

DIRECT_CASES = {
    "q4k-k256-many-blocks": ((T.Q4_K,) * 3, 256, (9001, 2250, 33)),
    "q4k-k2304": ((T.Q4_K,) * 3, 2304, (700, 70, 5)),
    "q4k-k12288": ((T.Q4_K,) * 3, 12288, (40, 9, 3)),
    "q6k-k2048-many-blocks": ((T.Q6_K,) * 3, 2048, (7001, 300, 17)),
    "q6k-k12288": ((T.Q6_K,) * 3, 12288, (40, 9, 3)),
    "q6k-k3072": ((T.Q6_K,) * 3, 3072, (300, 33, 9)),    # 2520-byte rows (8 mod 16): Qwen3-0.6B's down
    "q6k-k1280": ((T.Q6_K,) * 3, 1280, (40, 9, 3)),      # 1050-byte rows (2 mod 4): the staged reader
    "q4k-q6k-q4k-k4096": ((T.Q4_K, T.Q6_K, T.Q4_K), 4096, (130, 40, 33)),
    "q4k-q6k-q4k-k1024": ((T.Q4_K, T.Q6_K, T.Q4_K), 1024, (2048, 130, 33)),  # 840-byte Q6_K rows: 0.6B's QKV
    "q8_0-k1024-many-blocks": ((T.Q8_0,) * 3, 1024, (7001, 70, 5)),
    "q8_0-k576": ((T.Q8_0,) * 3, 576, (300, 9, 3)),      # 612-byte rows (4 mod 16)
    "q8_0-k2304": ((T.Q8_0,) * 3, 2304, (300, 9, 3)),
    # half groups (K <= 1024: 16 lanes a row, blocks of 32 rows): row counts not multiples of
    # 32, more blocks than CTAs, SwiGLU over 6001 outputs, 8 chunks (lanes 8..15 idle)
    "q6k-k1024-many-blocks": ((T.Q6_K,) * 3, 1024, (5001, 40, 17)),
    "q4k-k1024": ((T.Q4_K,) * 3, 1024, (33, 6001, 9)),
    "q8_0-k512": ((T.Q8_0,) * 3, 512, (77, 3001, 5)),
    "f16-k4096-many-blocks": ((T.F16,) * 3, 4096, (7001, 70, 5)),
    "f16-k1800": ((T.F16,) * 3, 1800, (300, 9, 3)),
    "bf16-k12288": ((T.BF16,) * 3, 12288, (40, 9, 3)),
}


def side_by_side(rng: np.random.Generator, types, n_in: int, rows):
    """Three weights of `types` with `rows` output rows, biases on the first and the last."""
    ws = [(t, random_weight(rng, t, m, n_in), m, n_in) for t, m in zip(types, rows)]
    biases = [rng.standard_normal(rows[0], dtype=np.float32), None, rng.standard_normal(rows[2], dtype=np.float32)]
    return ws, biases


@pytest.mark.parametrize("case", list(DIRECT_CASES))
def test_direct_store_accumulate_swiglu(case: str, rng: np.random.Generator) -> None:
    # Three weights side by side (more blocks of rows than persistent CTAs, a partial last
    # 2048-element step for Q4_K at K = 2304, 12288 = the 8B's down projection, Q4_K and Q6_K
    # mixed in one launch), two biases; then Accumulate and SwiGLU with the fused norm.
    # Against float64, and every row bit-equal to the same row computed alone (n = 6 takes
    # tiles of 4 and 2, n = 1 tiles of 1).
    types, n_in, rows = DIRECT_CASES[case]
    x = rng.standard_normal((6, n_in), dtype=np.float32)
    ws, biases = side_by_side(rng, types, n_in, rows)
    y = gpu(ws, biases, x)
    check_store(y, x, ws, biases, lambda x64, aw: small_bound(np.abs(x64), aw), case)
    np.testing.assert_array_equal(y[:2].view(np.uint32), rows_alone(ws, biases, x[:2]).view(np.uint32))
    np.testing.assert_array_equal(y[1:3].view(np.uint32), gpu(ws, biases, x[1:3]).view(np.uint32))
    qtype = types[1]
    check_norm_swiglu_accumulate(rng, 5, n_in, qtype, lambda x64, aw, e: small_bound(np.abs(x64), aw, e), 0, case)
    m = rows[1]
    gate_up = [ws[1], (qtype, random_weight(rng, qtype, m, n_in), m, n_in)]
    norm_w = rng.uniform(0.5, 1.5, n_in).astype(np.float32)
    kw = dict(norm_w=norm_w, eps=1e-6, epilogue=2)
    xs = x / np.sqrt(n_in)
    np.testing.assert_array_equal(gpu(gate_up, [None, None], xs, **kw)[4:].view(np.uint32),
                                  rows_alone(gate_up, [None, None], xs[4:], **kw).view(np.uint32))


# Q6_K-only and Q8_0-only calls on NVIDIA sm_80+ copy each step's weight bytes to shared
# memory first (KqStaged: coalesced 16-byte copies, where every step of a row is whole 16-byte
# pieces; SPECD_GPU_STAGE names the types, default "q6,q8"); the same words reach the same
# sums, so SPECD_GPU_STAGE="" (loads straight into registers) must give the same bits. Q6_K:
# K = 12288 (6 steps), 4096, 2048, and 3072 / 1024 (steps of 4 blocks, 840 bytes: not staged);
# Q8_0: 3072 (a last step of 16 chunks), 1024 (half groups), 576 (612-byte rows: not staged).
STAGED_CASES = [(T.Q6_K, 12288, (40, 300)), (T.Q6_K, 4096, (77, 9)), (T.Q6_K, 2048, (5001, 40)),
                (T.Q6_K, 3072, (300, 33)), (T.Q6_K, 1024, (33, 700)), (T.Q8_0, 3072, (300, 9)),
                (T.Q8_0, 1024, (7001, 70)), (T.Q8_0, 576, (300, 9))]


def gpu_call(c: dict) -> np.ndarray:
    """gpu() of a call as linear_in_subprocess takes it (y copied: Accumulate adds into it)."""
    return gpu(c["ws"], [None] * len(c["ws"]), c["x"], norm_w=c.get("norm_w"), eps=c.get("eps", 0.0),
               epilogue=c.get("epilogue", 0), y=None if c.get("y") is None else c["y"].copy())


def linear_in_subprocess(calls: list[dict], tmp_path, **env: str) -> list[np.ndarray]:
    """Each call's gpu() (dict: ws, x and optionally norm_w, eps, epilogue, y) in a fresh process
    whose environment adds env (the kernel choices are read once per process)."""
    return launches_in_subprocess(calls, tmp_path, **env)[0]


def launches_in_subprocess(calls: list[dict], tmp_path, **env: str) -> tuple[list[np.ndarray], list[list[str]]]:
    """linear_in_subprocess's outputs and, per call, the kernels it launched (with
    SPECD_GPU_LOG_LAUNCHES=1 in env; empty lists without)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    for i, c in enumerate(calls):
        np.savez(tmp_path / f"call{i}.npz", x=c["x"], w=np.concatenate([w for _, w, _, _ in c["ws"]]),
                 shapes=np.array([(int(t), m, k, len(w)) for t, w, m, k in c["ws"]]), epilogue=c.get("epilogue", 0),
                 y=c.get("y", np.zeros(0, np.float32)), norm_w=c.get("norm_w", np.zeros(0, np.float32)),
                 eps=c.get("eps", 0.0))
    script = (
        "import sys, numpy as np\n"
        "from worker.engine import native\n"
        "for i in range(%d):\n"
        "    z = np.load(sys.argv[1] + f'/call{i}.npz')\n"
        "    ws, at = [], 0\n"
        "    for t, m, k, nb in z['shapes']:\n"
        "        ws.append((int(t), z['w'][at:at + nb], int(k), int(m)))\n"
        "        at += nb\n"
        "    print(f'call {i}', file=sys.stderr, flush=True)\n"
        "    ep = int(z['epilogue'])\n"
        "    y = native.gpu_ops.linear(weights=ws, biases=[None] * len(ws), x=z['x'],\n"
        "                              norm_w=z['norm_w'] if z['norm_w'].size else None, eps=float(z['eps']),\n"
        "                              epilogue=ep, y=z['y'].copy() if ep == 1 else None, tensor_cores=False)\n"
        "    np.save(sys.argv[1] + f'/out{i}.npy', y)\n" % len(calls)
    )
    run = subprocess.run([sys.executable, "-c", script, str(tmp_path)], env=dict(os.environ, **env),
                         stderr=subprocess.PIPE, text=True)
    assert run.returncode == 0, run.stderr[-4000:]
    launched: list[list[str]] = []
    for line in run.stderr.splitlines():
        if line.startswith("call "):
            launched.append([])
        elif line.startswith("specd gpu launch: ") and launched:
            launched[-1].append(line.split()[3])
    return [np.load(tmp_path / f"out{i}.npy") for i in range(len(calls))], launched


def test_staged_digit_readers_give_the_same_bits(rng: np.random.Generator, tmp_path) -> None:
    calls = []
    for qtype, n_in, (m0, m1) in STAGED_CASES:
        w0, w1 = (random_weight(rng, qtype, m, n_in) for m in (m0, m1))
        x = rng.standard_normal((4, n_in), dtype=np.float32)
        norm_w = rng.uniform(0.5, 1.5, n_in).astype(np.float32)
        y0 = rng.standard_normal((4, m1), dtype=np.float32)
        for n in (1, 2, 4):
            calls.append(dict(ws=[(qtype, w0, m0, n_in), (qtype, w1, m1, n_in)], x=x[:n]))
            calls.append(dict(ws=[(qtype, w1, m1, n_in)], x=x[:n], epilogue=1, y=y0[:n]))
            calls.append(dict(ws=[(qtype, w1, m1, n_in)] * 2, x=x[:n] / np.sqrt(n_in),
                              norm_w=norm_w, eps=1e-6, epilogue=2))
    staged = [gpu_call(c) for c in calls]
    refs = linear_in_subprocess(calls, tmp_path, SPECD_GPU_STAGE="")
    for i, (c, y, ref) in enumerate(zip(calls, staged, refs)):
        what = f"call {i}: {c['ws'][0][0].name} K={c['ws'][0][3]} n={len(c['x'])} epilogue={c.get('epilogue', 0)}"
        np.testing.assert_array_equal(y.view(np.uint32), ref.view(np.uint32), what)


# A decode call (one row of x) of Q4_K weights with rows of two steps of 32 chunks (2048 < K <=
# 4096) and at most one block of 16 rows per SM (Qwen3-0.6B's ffn_down, K 3072, 64 blocks)
# loads both steps before the grid wait (KqAhead, kq_ahead_kernel); the same chunks reach the
# same sums, so SPECD_GPU_AHEAD=0 (kq_kernel) must give the same bits. Two rows of x, one-step
# rows (K 2048) and more blocks than SMs (16384 rows: 1024 blocks) keep kq_kernel. (The other
# calls have at most 19 blocks: any GPU these tests run on has that many SMs.)
def test_ahead_reader_gives_the_same_bits(rng: np.random.Generator, tmp_path) -> None:
    calls, ahead = [], []
    for n_in, m in ((4096, 150), (3072, 100), (2304, 77), (2048, 150), (4096, 16384)):
        w0, w1 = (random_weight(rng, T.Q4_K, m, n_in) for _ in range(2))
        x = rng.standard_normal((2, n_in), dtype=np.float32) / np.sqrt(n_in)
        norm_w = rng.uniform(0.5, 1.5, n_in).astype(np.float32)
        y0 = rng.standard_normal((2, m), dtype=np.float32)
        takes = n_in > 2048 and m < 16384
        for n in (1, 2):
            calls.append(dict(ws=[(T.Q4_K, w0, m, n_in)], x=x[:n]))
            calls.append(dict(ws=[(T.Q4_K, w1, m, n_in)], x=x[:n], epilogue=1, y=y0[:n]))
            calls.append(dict(ws=[(T.Q4_K, w0, m, n_in), (T.Q4_K, w1, m, n_in)], x=x[:n], norm_w=norm_w,
                              eps=1e-6, epilogue=2))
            ahead += [takes and n == 1] * 3
    now, kernels = launches_in_subprocess(calls, tmp_path / "now", SPECD_GPU_LOG_LAUNCHES="1")
    refs, ref_kernels = launches_in_subprocess(calls, tmp_path / "ref", SPECD_GPU_LOG_LAUNCHES="1",
                                               SPECD_GPU_AHEAD="0")
    for i, (c, y, ref) in enumerate(zip(calls, now, refs)):
        what = f"call {i}: K={c['ws'][0][3]} rows={c['ws'][0][2]} n={len(c['x'])} epilogue={c.get('epilogue', 0)}"
        assert kernels[i] == ["kq_ahead_kernel" if ahead[i] else "kq_kernel"], (what, kernels[i])
        assert ref_kernels[i] == ["kq_kernel"], (what, ref_kernels[i])
        np.testing.assert_array_equal(y.view(np.uint32), ref.view(np.uint32), what)
        assert np.isfinite(y).all(), what


# A launch mixing Q4_K and Q6_K rows (QKV with a Q6_K V, whose rows are read as words: the
# slow blocks) takes the Q6_K blocks in CTAs that take no second block (SPECD_GPU_MIX_ORDER=0:
# the plain order). It applies where the blocks outnumber the CTAs by fewer than the CTAs left
# over, as Qwen3-8B's QKV does on an H200 (384 blocks of 16 rows, 64 of them Q6_K, 264 CTAs
# for one or two rows of x), and changes no row's sums.
def test_mixed_block_order_gives_the_same_bits(rng: np.random.Generator, tmp_path) -> None:
    n_in, specs = 4096, [(T.Q4_K, 4096), (T.Q4_K, 1024), (T.Q6_K, 1024)]
    ws = [(t, random_weight(rng, t, m, n_in), m, n_in) for t, m in specs]
    x = rng.standard_normal((4, n_in), dtype=np.float32) / np.sqrt(n_in)
    norm_w = rng.uniform(0.5, 1.5, n_in).astype(np.float32)
    calls = [dict(ws=ws, x=x[:n], **extra) for n in (1, 2, 4) for extra in ({}, dict(norm_w=norm_w, eps=1e-6))]
    now = [gpu_call(c) for c in calls]
    refs = linear_in_subprocess(calls, tmp_path, SPECD_GPU_MIX_ORDER="0")
    for i, (c, y, ref) in enumerate(zip(calls, now, refs)):
        what = f"call {i}: n={len(c['x'])} norm={'norm_w' in c}"
        np.testing.assert_array_equal(y.view(np.uint32), ref.view(np.uint32), what)
        assert np.isfinite(y).all(), what


# ---- the prefill GEMM on Hopper's warpgroup MMA (matmul.cu wgmma_kernel: builds with sm_90a
# code, on sm_90 devices; every weight F16, as stored or decoded once per call from 256 rows of
# x): against float64 within the fp16 bound. Its tiles of 128 and 256 weight rows (forced by
# SPECD_GPU_WGMMA_BN in a subprocess), its 4- and 5-stage rings and the mma.sync kernel
# (SPECD_GPU_GEMM=mma) sum every output's 16-element tensor-core products in the same K order,
# so all of them give the same bits. Partial tiles in every direction: n % 128 != 0, n_out %
# 128 != 0 (and < 256), K % 64 != 0 (1000: a last step of 40 elements); three weights side by
# side, SwiGLU, Accumulate, quantized weights decoded first.
WGMMA_CASES = [  # (epilogue, [(type, n_out)], K, n)
    (0, [(T.F16, 333)], 1000, 65),
    (0, [(T.F16, 128), (T.F16, 70), (T.F16, 200)], 512, 300),
    (0, [(T.F16, 1000)], 4096, 520),
    (2, [(T.F16, 200), (T.F16, 200)], 4096, 257),
    (1, [(T.F16, 130)], 2048, 129),
    (0, [(T.Q4_K, 300)], 4096, 300),
    (2, [(T.BF16, 64), (T.Q6_K, 64)], 768, 256),
]
WGMMA_SETTINGS = {"mma.sync": dict(SPECD_GPU_GEMM="mma"), "256-wide": dict(SPECD_GPU_WGMMA_BN="256"),
                  "4 stages": dict(SPECD_GPU_WGMMA_BN="128", SPECD_GPU_WGMMA_STAGES="4")}


def test_wgmma_gemm_matches_float64_and_the_other_gemms_bit_for_bit(rng: np.random.Generator, tmp_path) -> None:
    if not G.wgmma():
        pytest.skip("the device or the build has no sm_90a warpgroup MMA (the mma.sync GEMM is tested above)")
    calls, wants = [], []
    for epilogue, specs, n_in, n in WGMMA_CASES:
        ws = [(t, random_weight(rng, t, m, n_in), m, n_in) for t, m in specs]
        scale = 1 / np.sqrt(n_in) if epilogue == 2 else 1.0  # moderate gate values
        x = (rng.standard_normal((n, n_in)) * scale).astype(np.float32)
        x64, ax = x.astype(np.float64), np.abs(x.astype(np.float64))
        prods = [(x64 @ dequant(t, w, m, k).T, fp16_bound(ax, np.abs(dequant(t, w, m, k)))) for t, w, m, k in ws]
        c = dict(ws=ws, x=x, epilogue=epilogue)
        if epilogue == 0:
            want = np.concatenate([p for p, _ in prods], axis=1)
            bound = np.concatenate([b for _, b in prods], axis=1) + 2 * U * np.abs(want)
        elif epilogue == 1:
            c["y"] = rng.standard_normal((n, specs[0][1]), dtype=np.float32) * 10
            want = c["y"] + prods[0][0]
            bound = prods[0][1] + 2 * U * (np.abs(want) + np.abs(c["y"]))
        else:
            (g, bg), (u, bu) = prods
            want, bound = swiglu64(g, u), swiglu_tol(g, u, bg + 2 * U * np.abs(g), bu + 2 * U * np.abs(u))
        calls.append(c)
        wants.append((want, bound))
    ys = [gpu_call(c) for c in calls]
    others = {}
    for i, (name, env) in enumerate(WGMMA_SETTINGS.items()):
        (tmp_path / str(i)).mkdir()
        others[name] = linear_in_subprocess(calls, tmp_path / str(i), **env)
    for i, ((epilogue, specs, n_in, n), y, (want, bound)) in enumerate(zip(WGMMA_CASES, ys, wants)):
        what = f"epilogue {epilogue} {[(t.name, m) for t, m in specs]} K={n_in} n={n}"
        check(y, want, bound, what)
        for name, refs in others.items():
            np.testing.assert_array_equal(y.view(np.uint32), refs[i].view(np.uint32), f"{name}: {what}")


# ---- the digit reader on tensor cores (matvec_kq_mma.cu): 5..64 rows of x of the calls above
# (NVIDIA sm_80+), the rows of the direct reader bit for bit (exact int8 MMA sums, the same float
# order), with the weights read once per 8 or 16 rows of x; tiles of 32 weight rows where a
# type has at least one per SM (the 5001 / 9001-row weights: Store, Accumulate and SwiGLU), else 16

MMA_CASES = {
    "q4k-k4096": ((T.Q4_K,) * 3, 4096, (130, 40, 33)),   # 16 rows of x: ~224 KiB of digits
    "q4k-k256": ((T.Q4_K,) * 3, 256, (70, 9001, 9)),     # 4 chunks: quads 4..7 hold no class
    "q4k-k2304": ((T.Q4_K,) * 3, 2304, (90, 31, 64)),    # 36 chunks: quads of 5 and 4
    "q4k-k1536": ((T.Q4_K,) * 3, 1536, (130, 40, 33)),   # 24 chunks: quads of 3 (a round's last 3 steps)
    "q6k-k3584": ((T.Q6_K,) * 3, 3584, (64, 33, 5)),     # 56 chunks: quads of 7 (a round, then 3)
    "q6k-k2048": ((T.Q6_K,) * 3, 2048, (17, 5001, 32)),
    "q6k-k4096": ((T.Q6_K,) * 3, 4096, (64, 33, 5)),
    "q6k-k1024": ((T.Q6_K,) * 3, 1024, (64, 5001, 5)),   # 840-byte rows (8 mod 16)
    "q4k-q6k-q4k-k4096": ((T.Q4_K, T.Q6_K, T.Q4_K), 4096, (130, 40, 33)),  # one launch per type
    "q4k-q6k-q4k-k1024": ((T.Q4_K, T.Q6_K, T.Q4_K), 1024, (130, 40, 33)),
    "q8_0-k576": ((T.Q8_0,) * 3, 576, (40, 9, 3)),       # 612-byte rows (4 mod 16)
    "q8_0-k1024": ((T.Q8_0,) * 3, 1024, (70, 5001, 5)),
    "q8_0-k2304": ((T.Q8_0,) * 3, 2304, (40, 9, 3)),
    "q6k-k12288": ((T.Q6_K,) * 3, 12288, (40, 300, 9)),  # x's digits too big for shared memory: read from L2
}


def test_mma_only_where_the_direct_reader_takes_one_row(rng: np.random.Generator) -> None:
    # K = 18944 (a 7B-class down projection): the digits of a tile of 4 rows of x no longer fit
    # a 227 KiB device, so one row takes the staged reader (matvec.cu) and so must 5..64 rows
    # (the tensor-core digit reader reproduces the direct reader's order, not the staged one's).
    n_in, n_out = 18944, 40
    ws = [(T.Q4_K, random_weight(rng, T.Q4_K, n_out, n_in), n_out, n_in)]
    x = rng.standard_normal((17, n_in), dtype=np.float32)
    alone = rows_alone(ws, [None], x)
    np.testing.assert_array_equal(gpu(ws, [None], x).view(np.uint32), alone.view(np.uint32))
    np.testing.assert_array_equal(gpu(ws, [None], x[3:9]).view(np.uint32), alone[3:9].view(np.uint32))


@pytest.mark.parametrize("case", list(MMA_CASES))
def test_mma_rows_equal_direct_rows(case: str, rng: np.random.Generator) -> None:
    # Store (three weights, two biases), Accumulate, and SwiGLU with the fused norm, for batches
    # of 2 (still the direct reader's tile), 7 (tiles of 8 rows of x), 9, 16, 33 (tiles of 16;
    # 33: three tiles, rows past n) and 64: every row bit-equal to the same row computed alone
    # (n = 1: the direct reader).
    types, n_in, rows = MMA_CASES[case]
    x = rng.standard_normal((64, n_in), dtype=np.float32)
    ws, biases = side_by_side(rng, types, n_in, rows)
    alone = rows_alone(ws, biases, x)
    check_store(alone[:3], x[:3], ws, biases, lambda x64, aw: small_bound(np.abs(x64), aw), case)
    qtype, m = types[1], rows[1]
    acc_w = [ws[1]]
    y0 = rng.standard_normal((64, m), dtype=np.float32)
    acc_alone = np.concatenate([gpu(acc_w, [None], x[r:r + 1], epilogue=1, y=y0[r:r + 1]) for r in range(64)])
    gate_up = [ws[1], (qtype, random_weight(rng, qtype, m, n_in), m, n_in)]
    norm_w = rng.uniform(0.5, 1.5, n_in).astype(np.float32)
    kw = dict(norm_w=norm_w, eps=1e-6, epilogue=2)
    xs = x / np.sqrt(n_in)
    swiglu_alone = rows_alone(gate_up, [None, None], xs, **kw)
    for lo, hi in ((5, 7), (0, 7), (20, 29), (3, 19), (31, 64), (0, 64)):
        what = f"{case} rows {lo}..{hi - 1}"
        np.testing.assert_array_equal(gpu(ws, biases, x[lo:hi]).view(np.uint32), alone[lo:hi].view(np.uint32), what)
        np.testing.assert_array_equal(gpu(acc_w, [None], x[lo:hi], epilogue=1, y=y0[lo:hi]).view(np.uint32),
                                      acc_alone[lo:hi].view(np.uint32), "accumulate " + what)
        np.testing.assert_array_equal(gpu(gate_up, [None, None], xs[lo:hi], **kw).view(np.uint32),
                                      swiglu_alone[lo:hi].view(np.uint32), "swiglu " + what)


# Tiles of 32 weight rows of the K-quants run in 16 warps per CTA (one m-tile each);
# SPECD_GPU_MMA_WARPS=8 keeps 8 warps (two m-tiles each), "16" takes 16 for Q8_0 too. Tiles of
# 16 rows run in 16 warps, two per quad splitting its chunks; SPECD_GPU_MMA_KSPLIT=0 keeps 8.
# Every layout gives the same bits, with x's image in shared memory or read through L1
# (K = 12288). The shapes take tiles of 32 rows (4096 outputs) and 16 rows (1024) on a 132-SM
# H100 / H200 (the rule in kq_mma_linear: 128 and 256 tiles of 32 rows, ~1 and 2 rounds; 32).
def test_mma_warp_layouts_give_the_same_bits(rng: np.random.Generator, tmp_path) -> None:
    calls = []
    for qtype, n_in, n_out in ((T.Q4_K, 4096, 4096), (T.Q6_K, 2048, 4096), (T.Q8_0, 1024, 8192),
                               (T.Q6_K, 12288, 4096), (T.Q8_0, 12288, 4096), (T.Q4_K, 4096, 1024),
                               (T.Q6_K, 1536, 1024), (T.Q8_0, 2048, 1024), (T.Q6_K, 12288, 1024)):
        w0, w1 = (random_weight(rng, qtype, n_out // 2, n_in) for _ in range(2))
        w = random_weight(rng, qtype, n_out, n_in)
        x = rng.standard_normal((33, n_in), dtype=np.float32) / np.sqrt(n_in)
        norm_w = rng.uniform(0.5, 1.5, n_in).astype(np.float32)
        y0 = rng.standard_normal((33, n_out), dtype=np.float32)
        for n in (7, 16, 33):
            calls.append(dict(ws=[(qtype, w, n_out, n_in)], x=x[:n]))
            calls.append(dict(ws=[(qtype, w, n_out, n_in)], x=x[:n], epilogue=1, y=y0[:n]))
            calls.append(dict(ws=[(qtype, w0, n_out // 2, n_in), (qtype, w1, n_out // 2, n_in)], x=x[:n],
                              norm_w=norm_w, eps=1e-6, epilogue=2))
    now = [gpu_call(c) for c in calls]
    for env in ({"SPECD_GPU_MMA_WARPS": "8"}, {"SPECD_GPU_MMA_WARPS": "16"}, {"SPECD_GPU_MMA_KSPLIT": "0"}):
        refs = linear_in_subprocess(calls, tmp_path, **env)
        for i, (c, y, ref) in enumerate(zip(calls, now, refs)):
            what = f"{env} call {i}: {c['ws'][0][0].name} K={c['ws'][0][3]} n_out={c['ws'][0][2]} " \
                   f"n={len(c['x'])} epilogue={c.get('epilogue', 0)}"
            np.testing.assert_array_equal(y.view(np.uint32), ref.view(np.uint32), what)
            assert np.isfinite(y).all(), what


# ---- epilogues, biases, several weights, fused norm (both paths)

def swiglu64(g: np.ndarray, u: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):  # exp(-g) = inf for very negative g: silu -> -0, as on the GPU
        return g / (1.0 + np.exp(-g)) * u


def swiglu_tol(g, u, bg, bu) -> np.ndarray:
    """|d silu(g) u| <= 1.1 |u| |dg| + |silu(g)| |du| (silu' <= 1.1), plus 1e-5 relative for the
    fast-math exp and division."""
    y = swiglu64(g, u)
    return 1.1 * np.abs(u) * bg + (np.abs(g) + 1e-30) * bu + 1e-5 * np.abs(y) + 1e-30


def check_store_three(rng: np.random.Generator, n: int, n_in: int, specs) -> None:
    """Three weights (type, n_out) stored side by side, biases on the first and the last,
    against float64 within bound_for(n)."""
    ws, biases = side_by_side(rng, [t for t, _ in specs], n_in, [m for _, m in specs])
    x = rng.standard_normal((n, n_in), dtype=np.float32)
    y = gpu(ws, biases, x)
    assert y.shape == (n, sum(m for _, m in specs))
    check_store(y, x, ws, biases, lambda x64, wf: bound_for(n, np.abs(x64), np.abs(wf)), f"n={n}")


@pytest.mark.parametrize("n", [1, 4, 9, 64, 65, 200])
def test_store_three_mixed_weights_with_biases(n: int, rng: np.random.Generator) -> None:
    # QKV-style: three weights of different types and sizes, outputs concatenated, two biases.
    check_store_three(rng, n, 512, [(T.Q4_K, 96), (T.Q6_K, 33), (T.Q8_0, 65)])


@pytest.mark.parametrize("n", [65, 300])
def test_large_path_three_f16_weights(n: int, rng: np.random.Generator) -> None:
    # All weights F16: the large path copies them as stored (no decode). Output rows across
    # tile edges (128, 70, 200), K = 1000 (a partial last 64-wide step), two biases.
    check_store_three(rng, n, 1000, [(T.F16, 128), (T.F16, 70), (T.F16, 200)])


@pytest.mark.parametrize("n", [1, 3, 64, 65, 130])
def test_accumulate_adds_into_y(n: int, rng: np.random.Generator) -> None:
    n_in, n_out = 544, 75
    w = random_weight(rng, T.Q5_1, n_out, n_in)
    b = rng.standard_normal(n_out, dtype=np.float32)
    x = rng.standard_normal((n, n_in), dtype=np.float32)
    y0 = rng.standard_normal((n, n_out), dtype=np.float32) * 10
    y = gpu([(T.Q5_1, w, n_out, n_in)], [b], x, epilogue=1, y=y0)
    wf, x64 = dequant(T.Q5_1, w, n_out, n_in), x.astype(np.float64)
    want = y0 + (x64 @ wf.T + b)
    bound = bound_for(n, np.abs(x64), np.abs(wf)) + 2 * U * (np.abs(want) + np.abs(y0) + np.abs(b))
    check(y, want, bound, f"accumulate n={n}")


@pytest.mark.parametrize("types", [(T.Q4_K, T.Q4_K), (T.Q4_0, T.Q8_0), (T.F16, T.BF16), (T.F16, T.F16)],
                         ids=lambda ts: "-".join(t.name for t in ts))
@pytest.mark.parametrize("n", [1, 5, 64, 70, 129])
def test_swiglu(types: tuple[T, T], n: int, rng: np.random.Generator) -> None:
    # gate and up of the same or of different types (two decoders in one group), with biases.
    n_in, n_out = 512, 45
    ws = [(t, random_weight(rng, t, n_out, n_in), n_out, n_in) for t in types]
    biases = [rng.standard_normal(n_out, dtype=np.float32), rng.standard_normal(n_out, dtype=np.float32)]
    x = rng.standard_normal((n, n_in), dtype=np.float32) / np.sqrt(n_in)  # moderate gate values
    y = gpu(ws, biases, x, epilogue=2)
    assert y.shape == (n, n_out)
    x64 = x.astype(np.float64)
    wg, wu = (dequant(t, w, m, k) for t, w, m, k in ws)
    g, u = x64 @ wg.T + biases[0], x64 @ wu.T + biases[1]
    ag, au = (wabs(t, w, m, k) for t, w, m, k in ws)
    bg = bound_for(n, np.abs(x64), ag) + 2 * U * np.abs(g)
    bu = bound_for(n, np.abs(x64), au) + 2 * U * np.abs(u)
    check(y, swiglu64(g, u), swiglu_tol(g, u, bg, bu), f"swiglu {types} n={n}")


@pytest.mark.parametrize("n", [1, 2, 6, 64])
def test_fused_rmsnorm(n: int, rng: np.random.Generator) -> None:
    # y = (x_r / rms(x_r) * nw) W^T for Store (3 weights) and SwiGLU, against float64.
    n_in, eps = 768, 1e-6
    x = (rng.standard_normal((n, n_in)) * rng.uniform(0.1, 30, (n, 1))).astype(np.float32)
    norm_w = rng.uniform(-2, 2, n_in).astype(np.float32)
    x64 = x.astype(np.float64)
    xn = x64 / np.sqrt((x64 * x64).mean(1, keepdims=True) + eps) * norm_w
    # the inv factor: K/256 + 8 rounded sum terms, a division and rsqrt (a few ulp): 48 roundings
    extra = n_in / 256 + 48
    ws = [(t, random_weight(rng, t, m, n_in), m, n_in) for t, m in ((T.Q5_K, 50), (T.Q4_1, 19), (T.BF16, 8))]
    y = gpu(ws, [None] * 3, x, norm_w=norm_w, eps=eps)
    col = 0
    for t, w, m, _ in ws:
        wf = dequant(t, w, m, n_in)
        check(y[:, col:col + m], xn @ wf.T, small_bound(np.abs(xn), np.abs(wf), extra), f"norm {t.name} n={n}")
        col += m
    gate, up = (random_weight(rng, t, 31, n_in) for t in (T.Q6_K, T.Q6_K))
    y = gpu([(T.Q6_K, gate, 31, n_in), (T.Q6_K, up, 31, n_in)], [None, None], x / 8, norm_w=norm_w, eps=eps,
            epilogue=2)
    wg, wu = dequant(T.Q6_K, gate, 31, n_in), dequant(T.Q6_K, up, 31, n_in)
    xn8 = x64 / 8
    xn8 = xn8 / np.sqrt((xn8 * xn8).mean(1, keepdims=True) + eps) * norm_w
    g, u = xn8 @ wg.T, xn8 @ wu.T
    bg, bu = small_bound(np.abs(xn8), np.abs(wg), extra), small_bound(np.abs(xn8), np.abs(wu), extra)
    check(y, swiglu64(g, u), swiglu_tol(g, u, bg, bu), f"norm swiglu n={n}")


# ---- embed_rows

@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_embed_rows_bit_equal_to_dequantize(qtype: T, rng: np.random.Generator) -> None:
    # Tolerance 0, signed zeros included: the GPU decoders compute the same exact float32
    # values as the CPU (quants.cuh header).
    for n_in in n_ins(qtype):
        n_out = 37
        w = random_weight(rng, qtype, n_out, n_in)
        table = ops.dequantize(int(qtype), w, n_out * n_in).reshape(n_out, n_in)
        tokens = np.concatenate([[0, n_out - 1], rng.integers(0, n_out, 20)]).astype(np.int32)
        got = G.embed_rows((int(qtype), w, n_in, n_out), tokens)
        assert got.shape == (len(tokens), n_in) and got.dtype == np.float32
        np.testing.assert_array_equal(got.view(np.uint32), table[tokens].view(np.uint32))
        assert np.count_nonzero(got) > got.size // 2  # real values were compared


def test_embed_rows_edge_cases(rng: np.random.Generator) -> None:
    w = random_weight(rng, T.Q4_K, 5, 256)
    assert G.embed_rows((int(T.Q4_K), w, 256, 5), np.zeros(0, np.int32)).shape == (0, 256)
    got = G.embed_rows((int(T.Q4_K), w, 256, 5), np.array([1, 5, -1, 4], np.int32))
    # an out-of-range id gives a NaN row (never a read outside the table); others are exact
    assert np.all(np.isnan(got[1])) and np.all(np.isnan(got[2]))
    table = ops.dequantize(int(T.Q4_K), w, 5 * 256).reshape(5, 256)
    np.testing.assert_array_equal(got[[0, 3]].view(np.uint32), table[[1, 4]].view(np.uint32))


# ---- argument errors

def test_engine_error_is_a_specd_error() -> None:
    assert issubclass(native.EngineError, SpecdError)


def _w(rng, qtype=T.Q8_0, n_out=4, n_in=64):
    return (qtype, random_weight(rng, qtype, n_out, n_in), n_out, n_in)


def test_linear_rejects_bad_arguments(rng: np.random.Generator) -> None:
    x = rng.standard_normal((2, 64), dtype=np.float32)
    a, b, c = _w(rng), _w(rng, T.Q4_0), _w(rng, T.Q4_K, 4, 256)
    y = np.zeros((2, 4), np.float32)
    with pytest.raises(SpecdError, match=r"Accumulate .*exactly 1 weight, got 2"):
        gpu([a, b], [None, None], x, epilogue=1, y=y)
    with pytest.raises(SpecdError, match=r"SwiGLU takes exactly 2 weights .*got 1"):
        gpu([a], [None], x, epilogue=2)
    with pytest.raises(SpecdError, match=r"SwiGLU takes exactly 2 weights .*got 3"):
        gpu([a, b, a], [None] * 3, x, epilogue=2)
    with pytest.raises(SpecdError, match=r"SwiGLU gate and up need the same shape"):
        gpu([a, _w(rng, T.Q8_0, 5)], [None, None], x, epilogue=2)
    with pytest.raises(SpecdError, match=r"unknown epilogue 7"):
        gpu([a], [None], x, epilogue=7)
    with pytest.raises(SpecdError, match=r"same n_in; weight 1 has 256, weight 0 has 64"):
        gpu([a, c], [None, None], x)
    with pytest.raises(SpecdError, match=r"n \(rows of x\) must be >= 1, got 0"):
        gpu([a], [None], x[:0])
    big = rng.standard_normal((MAX_SMALL + 1, 64), dtype=np.float32)
    with pytest.raises(SpecdError, match=r"fused RMSNorm .*only available for n <= 64.*got n = 65"):
        gpu([a], [None], big, norm_w=np.ones(64, np.float32))
    with pytest.raises(SpecdError, match=r"not a multiple of 8"):
        gpu([(T.F32, rng.standard_normal((3, 12), dtype=np.float32).view(np.uint8).reshape(-1), 3, 12)], [None],
            x[:, :12])
    with pytest.raises(SpecdError, match=r"unsupported tensor type id 10"):  # Q2_K: no decoder anywhere
        G.linear(weights=[(10, np.zeros(84, np.uint8), 256, 1)], biases=[None], x=np.zeros((1, 256), np.float32))


def test_trace_is_off_in_plain_builds() -> None:
    # cuda/trace.cuh: only a SPECD_GPU_TRACE=1 build (tools/device/trace_decode.py) records
    # kernel phases; the test build records nothing and says so.
    assert G.trace_begin(16) is False
    rec = G.trace_end()
    assert rec.shape == (0, 8) and rec.dtype == np.uint64
    with pytest.raises(SpecdError, match="cap must be"):
        G.trace_begin(0)


def test_errors_leave_the_device_usable(rng: np.random.Generator) -> None:
    # A rejected call launches nothing: the next call works and is exact.
    a = _w(rng)
    x = rng.standard_normal((1, 64), dtype=np.float32)
    with pytest.raises(SpecdError):
        gpu([a], [None], x, epilogue=1, y=None)
    y = gpu([a], [None], x)
    wf = dequant(a[0], a[1], 4, 64)
    check(y, x.astype(np.float64) @ wf.T, small_bound(np.abs(x.astype(np.float64)), np.abs(wf)), "after error")


# ---- the tensor-core small path (tensor_cores=True; F16 weights, K a multiple of 32, NVIDIA
# sm_80+; other devices take the CUDA-core path, which passes the same tests): x split into
# two fp16 halves after a power-of-two scaling per row, float32 MMA accumulation

@pytest.mark.parametrize("n", [1, 3, 9, 17, 40, 64])
def test_tensor_core_f16_matches_float64(n: int, rng: np.random.Generator) -> None:
    # Rows of x from 1e-7 to 1e7 in size: the per-row scaling keeps every one in fp16's range.
    n_in = 2080
    specs = [(T.F16, 96), (T.F16, 40), (T.F16, 72)]
    ws = [(t, random_weight(rng, t, m, n_in), m, n_in) for t, m in specs]
    biases = [rng.standard_normal(96, dtype=np.float32), None, rng.standard_normal(72, dtype=np.float32)]
    mags = 10.0 ** rng.uniform(-7, 7, (n, 1))
    x = (rng.standard_normal((n, n_in)) * mags).astype(np.float32)
    y = gpu(ws, biases, x, tensor_cores=True)
    # the split keeps 22 bits of each scaled x: 4 more roundings per product
    check_store(y, x, ws, biases, lambda x64, wf: small_bound(np.abs(x64), np.abs(wf), 4), f"tc n={n}")


@pytest.mark.parametrize("n", [1, 6, 33])
def test_tensor_core_f16_norm_swiglu_accumulate(n: int, rng: np.random.Generator) -> None:
    def small(x64: np.ndarray, wf: np.ndarray, extra: float) -> np.ndarray:
        return small_bound(np.abs(x64), np.abs(wf), extra)

    check_norm_swiglu_accumulate(rng, n, 1024, T.F16, small, 4, "tc", tensor_cores=True)


def check_norm_swiglu_accumulate(rng, n: int, n_in: int, qtype: T, bound_of, acc_extra: float, what: str,
                                 **path) -> None:
    """SwiGLU with the fused RMSNorm, then Accumulate, on the small path `path` selects, against
    float64: bound_of(x64, w64, extra roundings) (+ 2 u |result|)."""
    n_out, eps = 80, 1e-6
    x = (rng.standard_normal((n, n_in)) * rng.uniform(0.1, 300, (n, 1))).astype(np.float32)
    norm_w = rng.uniform(-2, 2, n_in).astype(np.float32)
    wg, wu = (random_weight(rng, qtype, n_out, n_in) for _ in range(2))
    ws = [(qtype, wg, n_out, n_in), (qtype, wu, n_out, n_in)]
    x64 = x.astype(np.float64)
    xn = x64 / np.sqrt((x64 * x64).mean(1, keepdims=True) + eps) * norm_w
    y = gpu(ws, [None, None], x, norm_w=norm_w, eps=eps, epilogue=2, **path)
    gf, uf = dequant(qtype, wg, n_out, n_in), dequant(qtype, wu, n_out, n_in)
    g64, u64 = xn @ gf.T, xn @ uf.T
    extra = n_in / 256 + 48 + 4
    ag, au = wabs(qtype, wg, n_out, n_in), wabs(qtype, wu, n_out, n_in)
    bg = bound_of(xn, ag, extra) + 2 * U * np.abs(g64)
    bu = bound_of(xn, au, extra) + 2 * U * np.abs(u64)
    check(y, swiglu64(g64, u64), swiglu_tol(g64, u64, bg, bu), f"{what} swiglu n={n}")
    y0 = rng.standard_normal((n, n_out), dtype=np.float32)
    y = gpu(ws[:1], [None], x, epilogue=1, y=y0, **path)
    want = y0 + x64 @ gf.T
    check(y, want, bound_of(x64, ag, acc_extra) + 2 * U * (np.abs(want) + np.abs(y0)), f"{what} acc n={n}")


@pytest.mark.parametrize("epilogue", [0, 2])
def test_tensor_core_f16_batch_invariant(epilogue: int, rng: np.random.Generator) -> None:
    # 4800 rows: 32 weight rows per CTA (two m-tiles share the x fragments) for Store, 16 for
    # SwiGLU's 2400; rows of x in every column of 1 to 8 MMA column tiles.
    n_in = 256
    n_out = 4800 if epilogue == 0 else 2400
    ws = [(T.F16, random_weight(rng, T.F16, n_out, n_in), n_out, n_in) for _ in range(1 + (epilogue == 2))]
    x = (rng.standard_normal((MAX_SMALL, n_in)) * 10.0 ** rng.uniform(-3, 3, (MAX_SMALL, 1))).astype(np.float32)
    kw = dict(norm_w=rng.uniform(0.5, 1.5, n_in).astype(np.float32), eps=1e-6, epilogue=epilogue, tensor_cores=True)
    alone = rows_alone(ws, [None] * len(ws), x, **kw)
    for lo, hi in ((0, 64), (5, 14), (20, 37), (0, 8), (63, 64)):
        np.testing.assert_array_equal(gpu(ws, [None] * len(ws), x[lo:hi], **kw).view(np.uint32),
                                      alone[lo:hi].view(np.uint32))


@pytest.mark.parametrize("qtype", [T.F16, T.Q4_K, T.Q6_K, T.Q8_0], ids=lambda t: t.name)
def test_tensor_core_staged_and_streamed_x_agree(qtype: T, rng: np.random.Generator) -> None:
    # K = 4096: up to 5 rows of x fit the CTA's shared-memory staging (converted once before
    # the K loop), 6 or more are converted by each warp as it goes; a row gets the same bits
    # either way. (Quantized types take the tensor cores with SPECD_GPU_TC=all, the CUDA cores
    # otherwise: both must hold.)
    n_in, n_out = 4096, 48
    ws = [(qtype, random_weight(rng, qtype, n_out, n_in), n_out, n_in)]
    x = (rng.standard_normal((12, n_in)) * 10.0 ** rng.uniform(-3, 3, (12, 1))).astype(np.float32)
    for kw in (dict(tensor_cores=True), dict(norm_w=rng.uniform(0.5, 1.5, n_in).astype(np.float32), eps=1e-6,
                                              tensor_cores=True)):
        alone = rows_alone(ws, [None], x, **kw)  # staged
        np.testing.assert_array_equal(gpu(ws, [None], x, **kw).view(np.uint32), alone.view(np.uint32))  # streamed
        np.testing.assert_array_equal(gpu(ws, [None], x[2:6], **kw).view(np.uint32), alone[2:6].view(np.uint32))


@pytest.mark.parametrize("n", [1, 7, 20, 64])
def test_tensor_core_many_tiles_per_cta(n: int, rng: np.random.Generator) -> None:
    # 9,600 rows of three types side by side (300 tiles of 32 rows, more than the CTAs that fit
    # an H200 at once): persistent CTAs take several tiles, of different types, through one
    # ring of weight stages. Against float64, and each row of x computed alone gives the same
    # bits. (Quantized types take the tensor cores with SPECD_GPU_TC=all, the CUDA cores
    # otherwise: both must hold.)
    n_in = 512
    specs = [(T.Q4_K, 4000), (T.Q6_K, 2400), (T.Q8_0, 3200)]
    ws = [(t, random_weight(rng, t, m, n_in), m, n_in) for t, m in specs]
    biases = [rng.standard_normal(4000, dtype=np.float32), None, None]
    x = (rng.standard_normal((n, n_in)) * 10.0 ** rng.uniform(-3, 3, (n, 1))).astype(np.float32)
    y = gpu(ws, biases, x, tensor_cores=True)
    check_store(y, x, ws, biases, lambda x64, wf: small_bound(np.abs(x64), np.abs(wf), 4), f"tiles n={n}")
    alone = rows_alone(ws, biases, x[:3], tensor_cores=True)
    np.testing.assert_array_equal(y[:3].view(np.uint32), alone.view(np.uint32))
