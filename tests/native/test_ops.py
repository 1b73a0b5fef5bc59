"""The CPU backend's small ops (rmsnorm, rope, attention, softmax, swiglu) against float64
numpy twins written here, on fresh random inputs (the seed is printed; a failure shows it).

Tolerances are in units of float32's unit roundoff U = 2^-24 and are justified next to
each check. The AVX2 paths are taken when the CPU has them (head_dim % 8 == 0 for
attention); head_dim 20 forces attention's scalar reference path.
"""

from __future__ import annotations

import numpy as np
import pytest

from worker.engine import native, ops

U = 2.0**-24  # float32 unit roundoff



def f32(x) -> np.float64:
    """A parameter as the C++ side sees it: rounded to float32, then exact in float64."""
    return np.float64(np.float32(x))


# ---------------------------------------------------------------- rmsnorm


def rmsnorm_twin(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    x = x.astype(np.float64)
    return x / np.sqrt(np.mean(x * x, axis=1, keepdims=True) + f32(eps)) * w.astype(np.float64)


@pytest.mark.parametrize("dim", [1, 7, 64, 576, 2048])
def test_rmsnorm(rng, dim):
    rows = 70  # enough rows of 576+ to be split over threads
    x = (rng.standard_normal((rows, dim)) * rng.uniform(0.01, 100, (rows, 1))).astype(np.float32)
    w = rng.standard_normal(dim).astype(np.float32)
    y = ops.rmsnorm(x, w, 1e-5)
    ref = rmsnorm_twin(x, w, 1e-5)
    # The sum of squares is in double; then three float roundings (1/rms, x*inv, *w),
    # each <= U relative: 4U leaves a little room.
    err = np.abs(y - ref) / np.abs(ref)
    print(f"rmsnorm dim={dim}: max rel err {err.max() / U:.2f} U")
    assert err.max() <= 4 * U


# ---------------------------------------------------------------- rope


def rope_twin(x, pos, n_dims, base, scale, mode, factors):
    """theta_i = pos * scale * base^(-2i/n_dims) / factor_i (ggml_rope_ext, ext_factor 0)."""
    y = x.astype(np.float64).copy()
    half = n_dims // 2
    freq = f32(scale) * f32(base) ** (-2.0 * np.arange(half) / n_dims)
    if factors is not None:
        freq = freq / factors.astype(np.float64)
    theta = pos.astype(np.float64)[:, None] * freq[None, :]  # [n_tok, half]
    c, s = np.cos(theta)[:, None, :], np.sin(theta)[:, None, :]  # [n_tok, 1, half]
    if mode == "normal":
        ia, ib = np.arange(0, n_dims, 2), np.arange(1, n_dims, 2)  # (x[2i], x[2i+1])
    else:
        ia, ib = np.arange(half), np.arange(half, n_dims)  # (x[i], x[i+half])
    a, b = y[..., ia].copy(), y[..., ib].copy()
    y[..., ia] = a * c - b * s
    y[..., ib] = a * s + b * c
    return y


@pytest.mark.parametrize("mode", ["normal", "neox"])
@pytest.mark.parametrize(
    "head_dim,n_dims,base,scale,with_factors",
    [
        (64, 64, 1e5, 1.0, False),  # SmolLM2 (llama, normal)
        (128, 128, 1e6, 1.0, False),  # qwen3-like
        (64, 32, 1e4, 1.0, False),  # partial rotary: dims >= n_dims pass through
        (96, 64, 5e5, 0.37, False),  # linear scaling
        (128, 128, 5e5, 0.25, True),  # llama3-style rope_freqs factors
        (80, 2, 1e4, 3.0, True),
    ],
)
def test_rope(rng, mode, head_dim, n_dims, base, scale, with_factors):
    n_tok, n_heads = 9, 3
    x = rng.standard_normal((n_tok, n_heads, head_dim)).astype(np.float32)
    pos = np.array([0, 1, 2, 17, 255, 1000, 5000, 32767, 200000], dtype=np.int32)
    rng.shuffle(pos)
    factors = rng.uniform(1.0, 32.0, n_dims // 2).astype(np.float32) if with_factors else None
    y = ops.rope(x, pos, n_dims, base, scale, mode, factors)
    ref = rope_twin(x, pos, n_dims, base, scale, mode, factors)
    assert np.array_equal(y[..., n_dims:], x[..., n_dims:])  # untouched, bit for bit
    # Angles, cos/sin and the rotation are double, rounded once: <= U/2 relative per
    # element. The angle itself may differ from numpy's by ~1e-16 * |theta| (|theta| up to
    # 2e5 here), i.e. ~1e-10 of the pair's norm: that is the 1e-9 absolute term.
    norm = np.sqrt((x.astype(np.float64) ** 2).sum(-1, keepdims=True))
    err = np.abs(y - ref) - (1e-9 * norm)
    rel = np.abs(y - ref) / np.maximum(np.abs(ref), 1e-30)
    print(f"rope {mode} n_dims={n_dims}: max rel err {rel.max() / U:.3f} U, max abs {np.abs(y - ref).max():.2e}")
    assert (err <= U * np.abs(ref)).all()
    # Rotations keep each pair's norm: a gross check that would catch a wrong pairing.
    assert np.allclose(np.linalg.norm(y, axis=-1), np.linalg.norm(x, axis=-1), rtol=1e-5)


@pytest.mark.parametrize("mode", ["normal", "neox"])
def test_rope_prefill(rng, mode):
    # A prefill-sized batch (tokens are split over threads in chunks of 16).
    x = rng.standard_normal((100, 9, 64)).astype(np.float32)
    pos = np.arange(3000, 3100, dtype=np.int32)
    y = ops.rope(x, pos, 64, 1e5, 1.0, mode)
    ref = rope_twin(x, pos, 64, 1e5, 1.0, mode, None)
    norm = np.sqrt((x.astype(np.float64) ** 2).sum(-1, keepdims=True))
    assert (np.abs(y - ref) <= U * np.abs(ref) + 1e-9 * norm).all()


def test_rope_position_zero_is_identity(rng):
    x = rng.standard_normal((2, 4, 64)).astype(np.float32)
    for mode in ("normal", "neox"):
        y = ops.rope(x, np.zeros(2, np.int32), 64, 1e4, 1.0, mode)
        assert np.array_equal(y, x)


def test_rope_modes_differ(rng):
    # Not vacuous: the two modes pair different elements.
    x = rng.standard_normal((1, 1, 64)).astype(np.float32)
    pos = np.array([7], np.int32)
    assert not np.allclose(ops.rope(x, pos, 64, 1e4, 1.0, "normal"), ops.rope(x, pos, 64, 1e4, 1.0, "neox"))


def test_rope_rejects_bad_n_dims():
    x = np.zeros((1, 1, 64), np.float32)
    pos = np.zeros(1, np.int32)
    for bad in (0, 3, 66):
        with pytest.raises(native.EngineError, match="n_dims"):
            ops.rope(x, pos, bad, 1e4, 1.0, "normal")


# ---------------------------------------------------------------- attention


def attention_twin(q, k, v, pos0, scale):
    """Causal GQA in float64 on the cache's own (possibly fp16-rounded) values."""
    n_tok, n_heads, hd = q.shape
    group = n_heads // k.shape[1]
    K, V = k.astype(np.float64), v.astype(np.float64)
    out = np.zeros((n_tok, n_heads, hd))
    for t in range(n_tok):
        n = pos0 + t + 1  # keys 0 .. pos0+t
        for h in range(n_heads):
            s = f32(scale) * (K[:n, h // group] @ q[t, h].astype(np.float64))
            p = np.exp(s - s.max())
            out[t, h] = (p / p.sum()) @ V[:n, h // group]
    return out


def attention_tolerance(q, k, v, pos0, scale):
    """Bound on |out - twin| for the float32-accumulating path, per output element.

    A score s_j is a float32 dot product over head_dim terms: its error is at most a few
    U times scale * sum_d |q_d k_jd|; the weights p_j change by about that much relative,
    moving the output by <= ~that * max|V|. The weighted sum of n positions adds rounding
    that grows like sqrt(n) (random walk; the worst case n is never approached with
    random data). Observed maxima sit 7x or more below this bound (at most ~29 U).
    """
    n_tok, n_heads, hd = q.shape
    group = n_heads // k.shape[1]
    n_ctx = pos0 + n_tok
    kk = np.repeat(np.abs(k[:n_ctx].astype(np.float64)), group, axis=1)  # [n_ctx, n_heads, hd]
    dots = np.einsum("thd,jhd->thj", np.abs(q.astype(np.float64)), kk)  # sum_d |q_d k_jd|
    vmax = np.abs(v[:n_ctx].astype(np.float64)).max()
    return U * vmax * (8.0 + np.sqrt(n_ctx) + scale * dots.max())


ATT_CASES = [
    # n_tok, pos0, n_heads, n_kv_heads, head_dim
    (1, 0, 4, 4, 64),  # first token: one key
    (1, 300, 9, 3, 64),  # SmolLM2 decode (GQA 3)
    (5, 37, 8, 2, 64),  # speculative verify of k+1 = 5 tokens (GQA 4)
    (5, 0, 4, 4, 128),  # prefill from scratch (MHA)
    (1, 1500, 16, 4, 128),  # long decode, qwen-like (GQA 4), position split across threads
    (5, 200, 12, 4, 96),  # head_dim % 64 != 0 (remainder blocks), GQA 3
    (3, 50, 14, 2, 24),  # GQA 7: query heads in blocks of 4 + 3
    (5, 40, 9, 3, 20),  # head_dim % 8 != 0: the scalar reference path
    (48, 0, 6, 2, 64),  # prefill of 48 tokens: work dealt round-robin to threads
    (48, 3, 6, 2, 20),  # the same on the scalar path
]


@pytest.mark.parametrize("kv_dtype", [np.float16, np.float32])
@pytest.mark.parametrize("n_tok,pos0,n_heads,n_kv,hd", ATT_CASES)
def test_attention(rng, kv_dtype, n_tok, pos0, n_heads, n_kv, hd):
    scale = 1.0 / np.sqrt(hd)
    q = (rng.standard_normal((n_tok, n_heads, hd)) * 2.0).astype(np.float32)  # sharp-ish softmax
    n_ctx = pos0 + n_tok
    # Two extra cache rows past pos0 + n_tok hold NaN: reading them would poison the output.
    k = rng.standard_normal((n_ctx + 2, n_kv, hd)).astype(kv_dtype)
    v = rng.standard_normal((n_ctx + 2, n_kv, hd)).astype(kv_dtype)
    k[n_ctx:] = np.nan
    v[n_ctx:] = np.nan
    out = ops.attention(q, k, v, pos0, scale)
    ref = attention_twin(q, k, v, pos0, scale)
    tol = attention_tolerance(q, k, v, pos0, scale)
    err = np.abs(out - ref).max()
    print(f"attention {kv_dtype.__name__} {n_tok=} {pos0=} {n_heads}/{n_kv} {hd=}: max err {err:.2e} = {err / U:.1f} U (tol {tol / U:.0f} U)")
    assert np.isfinite(out).all()
    assert err <= tol


@pytest.mark.parametrize(
    "threads,n_tok,pos0,n_heads,n_kv",
    [
        (1, 1, 1999, 9, 3),  # decode: 3 units < 8 per thread -> positions split in 7 chunks
        (3, 1, 1999, 9, 3),
        (2, 5, 700, 8, 2),  # verify of 5 tokens, split in 2 chunks, causal end inside one
        (40, 300, 212, 2, 1),  # many threads: chunk 2 (positions 256..511) is empty for early tokens
    ],
)
def test_attention_position_split(rng, threads, n_tok, pos0, n_heads, n_kv):
    # The AVX2 path splits positions into chunks depending on the thread count; every
    # split must give the same maths. (Restores the thread count afterwards.)
    before = native.num_threads()
    try:
        native.set_num_threads(threads)
        q = rng.standard_normal((n_tok, n_heads, 64)).astype(np.float32)
        k = rng.standard_normal((pos0 + n_tok, n_kv, 64)).astype(np.float16)
        v = rng.standard_normal((pos0 + n_tok, n_kv, 64)).astype(np.float16)
        out = ops.attention(q, k, v, pos0, 0.125)
    finally:
        native.set_num_threads(before)
    ref = attention_twin(q, k, v, pos0, 0.125)
    assert np.abs(out - ref).max() <= attention_tolerance(q, k, v, pos0, 0.125)


def test_attention_is_causal(rng):
    # Changing keys/values after a query's position must not change that query's output;
    # changing an earlier one must.
    q = rng.standard_normal((4, 2, 32)).astype(np.float32)
    k = rng.standard_normal((10, 1, 32)).astype(np.float32)
    v = rng.standard_normal((10, 1, 32)).astype(np.float32)
    base = ops.attention(q, k, v, 6, 0.2)  # tokens at positions 6..9
    k2, v2 = k.copy(), v.copy()
    k2[8:] += 5.0
    v2[8:] -= 5.0  # positions 8, 9: visible only to tokens 2, 3
    moved = ops.attention(q, k2, v2, 6, 0.2)
    assert np.array_equal(moved[:2], base[:2])
    assert not np.allclose(moved[2:], base[2:])


def test_attention_rejects_bad_shapes():
    q = np.zeros((1, 6, 16), np.float32)
    kv = np.zeros((4, 4, 16), np.float32)
    with pytest.raises(native.EngineError, match="multiple of n_kv_heads"):
        ops.attention(q, kv, kv, 0, 1.0)  # 6 heads over 4 KV heads
    with pytest.raises(native.EngineError, match="cache shorter"):
        ops.attention(np.zeros((2, 4, 16), np.float32), kv, kv, 3, 1.0)


# ---------------------------------------------------------------- softmax, swiglu


@pytest.mark.parametrize("n,scale", [(1, 1.0), (7, 1.0), (1000, 3.0), (49157, 10.0), (333, 1e4), (64, 1e30)])
def test_softmax(rng, n, scale):
    x = (rng.standard_normal(n) * scale).astype(np.float32)
    if n > 10:
        x[rng.integers(0, n, 3)] = -np.inf  # masked entries
        x[rng.integers(0, n)] = x.max()  # a tie at the max
    y = ops.softmax(x)
    x64 = x.astype(np.float64)
    ref = np.exp(x64 - x64.max())
    ref /= ref.sum()
    assert np.isfinite(y).all()
    # exp() within ~2U (vector kernel; x - max is kept exact), normalisation by a double
    # sum, one multiply: 6U relative. Values below FLT_MIN may flush to 0: 1e-37 absolute.
    err = np.abs(y - ref)
    print(f"softmax n={n} scale={scale:g}: max rel err {(err / np.maximum(ref, 1e-300))[ref > 1e-30].max() / U:.2f} U")
    assert (err <= 6 * U * ref + 1e-37).all()
    assert abs(float(y.astype(np.float64).sum()) - 1.0) <= 1e-6
    assert (y[x == -np.inf] == 0).all()


@pytest.mark.parametrize("n", [4099, 100003])  # odd tails; the larger one is split over threads
def test_swiglu(rng, n):
    g = (rng.standard_normal(n) * 8).astype(np.float32)
    g[:6] = [0.0, -100.0, 100.0, -88.5, 88.5, 1e-30]  # saturation of exp(-g)
    u = rng.standard_normal(n).astype(np.float32)
    y = ops.swiglu(g, u)
    g64, u64 = g.astype(np.float64), u.astype(np.float64)
    ref = g64 / (1.0 + np.exp(-g64)) * u64
    # exp ~2U, then 1 + e, the division and the product each round once: 6U relative.
    # Where exp(-g) overflows float (g < -88.4) the result is -0 instead of ~1e-37 or less.
    err = np.abs(y - ref)
    print(f"swiglu: max rel err {(err / np.maximum(np.abs(ref), 1e-300))[np.abs(ref) > 1e-30].max() / U:.2f} U")
    assert (err <= 6 * U * np.abs(ref) + 1e-36).all()
