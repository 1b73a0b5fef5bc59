"""The GPU small ops (cuda/norm, rope_kv, attention, sample) against the CPU ops (`ops.*`,
themselves checked against float64 in tests/native/test_ops.py) and float64 numpy twins, on
fresh random inputs (the seed is printed; a failure shows it).

Tolerances are in units of float32's unit roundoff U = 2^-24 and are justified next to each
check. Attention's batch invariance (a query's output bit-identical whatever the batch) is
checked with np.array_equal, as lossless speculative decoding needs it exactly.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from worker.engine import native, ops

U = 2.0**-24  # float32 unit roundoff


def gpu():
    """native.gpu_ops (only in GPU builds; conftest skips this module's tests otherwise)."""
    return native.gpu_ops


def f32(x) -> np.float64:
    """A parameter as the C++ side sees it: rounded to float32, then exact in float64."""
    return np.float64(np.float32(x))


# ---------------------------------------------------------------- rmsnorm


@pytest.mark.parametrize("dim", [1, 7, 64, 576, 2048, 4099, 8192])
def test_rmsnorm(rng, dim):
    rows = 37
    x = (rng.standard_normal((rows, dim)) * rng.uniform(0.01, 100, (rows, 1))).astype(np.float32)
    x[0] = 0.0  # an all-zero row: y = 0 (inv = 1/sqrt(eps))
    w = rng.standard_normal(dim).astype(np.float32)
    y = gpu().rmsnorm(x, w, 1e-5)
    x64 = x.astype(np.float64)
    ref = x64 / np.sqrt(np.mean(x64 * x64, axis=1, keepdims=True) + f32(1e-5)) * w.astype(np.float64)
    # As the CPU: the sum of squares in double, 1/rms in double rounded once, then two float
    # multiplies: three roundings of <= U/2 each... plus the double sum: 4U leaves room.
    err = np.abs(y - ref) / np.maximum(np.abs(ref), 1e-300)
    print(f"rmsnorm dim={dim}: max rel err {err.max() / U:.2f} U")
    assert (np.abs(y - ref) <= 4 * U * np.abs(ref)).all()
    assert (y[0] == 0).all()
    # Same arithmetic as cpu/rmsnorm.cpp: rows differ only if the two double sums (different
    # order, ~1e-16 apart) round 1/rms to different floats, which is vanishingly rare.
    cpu = ops.rmsnorm(x, w, 1e-5)
    same_rows = np.all(y == cpu, axis=1).mean()
    assert same_rows >= 0.9, f"only {same_rows:.0%} of rows bit-identical to the CPU"


def test_rmsnorm_rejects_bad_shapes():
    with pytest.raises(native.EngineError, match="dim"):
        gpu().rmsnorm(np.zeros((2, 4), np.float32), np.zeros(5, np.float32), 1e-5)


# ---------------------------------------------------------------- rope_kv


def rope_inputs(rng, n, nh, nkv, hd, pad, pos0, n_ctx, f16):
    ld = (nh + 2 * nkv) * hd + pad
    qkv = rng.standard_normal((n, ld)).astype(np.float32)
    dt = np.float16 if f16 else np.float32
    kc = rng.standard_normal((n_ctx, nkv * hd)).astype(dt)
    vc = rng.standard_normal((n_ctx, nkv * hd)).astype(dt)
    return qkv, kc, vc


def rope_params(rng, mode, hd, n_dims, base, scale, with_factors, qk_norm):
    """A ROPE_CASES row's RoPE settings (fresh llama3-style factors) and qwen3 q/k norm weights."""
    rope = {"n_dims": n_dims, "freq_base": base, "freq_scale": scale, "mode": mode}
    if with_factors:
        rope["freq_factors"] = rng.uniform(1.0, 32.0, n_dims // 2).astype(np.float32)
    q_norm = k_norm = None
    if qk_norm:
        q_norm = rng.uniform(0.5, 2.0, hd).astype(np.float32)
        k_norm = rng.uniform(0.5, 2.0, hd).astype(np.float32)
    return rope, q_norm, k_norm


def rope_reference(qkv, pos0, nh, nkv, hd, q_norm, k_norm, eps, rope):
    """model.cpp's order with the CPU ops: per-head RMSNorm (qwen3), then RoPE."""
    n = qkv.shape[0]
    q = np.ascontiguousarray(qkv[:, : nh * hd]).reshape(n, nh, hd)
    k = np.ascontiguousarray(qkv[:, nh * hd : (nh + nkv) * hd]).reshape(n, nkv, hd)
    v = np.ascontiguousarray(qkv[:, (nh + nkv) * hd : (nh + 2 * nkv) * hd])
    if q_norm is not None:
        q = ops.rmsnorm(q.reshape(-1, hd), q_norm, eps).reshape(n, nh, hd)
        k = ops.rmsnorm(k.reshape(-1, hd), k_norm, eps).reshape(n, nkv, hd)
    pos = np.arange(pos0, pos0 + n, dtype=np.int32)
    args = (rope["n_dims"], rope["freq_base"], rope["freq_scale"], rope["mode"], rope.get("freq_factors"))
    q = ops.rope(q, pos, *args)
    k = ops.rope(k, pos, *args)
    return q.reshape(n, nh * hd), k.reshape(n, nkv * hd), v


def rope_close(y, ref, hd):
    """|y - ref| <= 2U |ref| + 1e-9 |head|: both sides rotate in double and round once, from
    the same double angle; only the device's and the host's double sin/cos may differ in the
    last bit (~1e-16 of the head's norm), which can move a float rounding by one ulp."""
    n = y.shape[0]
    yh, rh = y.reshape(n, -1, hd).astype(np.float64), ref.reshape(n, -1, hd).astype(np.float64)
    norm = np.sqrt((rh**2).sum(-1, keepdims=True))
    err = np.abs(yh - rh)
    print(f"    max abs err {err.max():.2e}, max rel {(err / np.maximum(np.abs(rh), 1e-30)).max() / U:.2f} U")
    return bool((err <= 2 * U * np.abs(rh) + 1e-9 * norm).all())


ROPE_CASES = [
    # n_heads, n_kv, head_dim, n_dims, base, scale, factors, qk_norm
    (9, 3, 64, 64, 1e5, 1.0, False, False),  # SmolLM2 (llama, GQA 3)
    (16, 8, 128, 128, 1e6, 1.0, False, True),  # qwen3: per-head q/k RMSNorm before RoPE
    (8, 2, 128, 64, 5e5, 0.25, True, False),  # partial rotary, linear scaling, llama3 factors
    (14, 2, 80, 80, 1e4, 1.0, True, True),  # head_dim 80, GQA 7, norm and factors
    (4, 4, 256, 256, 1e4, 1.0, False, True),  # head_dim 256
    (6, 2, 96, 2, 1e4, 3.0, False, False),  # a single rotated pair
]


@pytest.mark.parametrize("mode", ["normal", "neox"])
@pytest.mark.parametrize("nh,nkv,hd,n_dims,base,scale,with_factors,qk_norm", ROPE_CASES)
@pytest.mark.parametrize("n,pos0", [(1, 0), (5, 253), (33, 3000)])
def test_rope_kv(rng, mode, nh, nkv, hd, n_dims, base, scale, with_factors, qk_norm, n, pos0):
    n_ctx = pos0 + n + 3
    qkv, kc, vc = rope_inputs(rng, n, nh, nkv, hd, 5, pos0, n_ctx, f16=False)
    rope, q_norm, k_norm = rope_params(rng, mode, hd, n_dims, base, scale, with_factors, qk_norm)
    eps = 1e-6
    rq, rk, rv = rope_reference(qkv, pos0, nh, nkv, hd, q_norm, k_norm, eps, rope)
    rows = slice(pos0, pos0 + n)

    # float cache
    out, k32, v32 = gpu().rope_kv(qkv, pos0, nh, nkv, hd, q_norm, k_norm, eps, rope, kc, vc)
    print(f"rope_kv {mode} {nh}/{nkv} hd={hd} n_dims={n_dims} n={n} pos0={pos0}: q")
    assert rope_close(out[:, : nh * hd], rq, hd)
    print("  k")
    assert rope_close(k32[rows], rk, hd)
    assert np.array_equal(v32[rows], rv)  # a copy
    assert np.array_equal(out[:, nh * hd :], qkv[:, nh * hd :])  # k, v columns and padding untouched
    others = np.ones(n_ctx, bool)
    others[rows] = False
    assert np.array_equal(k32[others], kc[others]) and np.array_equal(v32[others], vc[others])

    # fp16 cache: the same float k/v rounded to nearest even, bit for bit
    kc16, vc16 = kc.astype(np.float16), vc.astype(np.float16)
    out16, k16, v16 = gpu().rope_kv(qkv, pos0, nh, nkv, hd, q_norm, k_norm, eps, rope, kc16, vc16)
    assert k16.dtype == np.float16
    assert np.array_equal(out16, out)
    assert np.array_equal(k16[rows].view(np.uint16), k32[rows].astype(np.float16).view(np.uint16))
    assert np.array_equal(v16[rows].view(np.uint16), rv.astype(np.float16).view(np.uint16))
    assert np.array_equal(k16[others].view(np.uint16), kc16[others].view(np.uint16))
    assert np.array_equal(v16[others].view(np.uint16), vc16[others].view(np.uint16))


def test_rope_kv_far_position(rng):
    # Angles of ~1e5 rad: the double angle, sin and cos keep q and k at float rounding.
    nh, nkv, hd, pos0, n = 2, 1, 64, 70000, 3
    qkv, kc, vc = rope_inputs(rng, n, nh, nkv, hd, 0, pos0, pos0 + n, f16=True)
    for mode in ("normal", "neox"):
        rope = {"n_dims": 64, "freq_base": 1e4, "freq_scale": 1.0, "mode": mode}
        out, k16, _ = gpu().rope_kv(qkv, pos0, nh, nkv, hd, None, None, 0.0, rope, kc, vc)
        rq, rk, _ = rope_reference(qkv, pos0, nh, nkv, hd, None, None, 0.0, rope)
        assert rope_close(out[:, : nh * hd], rq, hd)
        # fp16 rows within half an fp16 ulp (2^-11 relative) of the float reference, plus the
        # float tolerance above
        k = k16[pos0:].astype(np.float64)
        assert (np.abs(k - rk) <= 2.0**-11 * np.abs(rk) + 1e-6).all()


def test_rope_kv_position_zero_is_identity(rng):
    nh, nkv, hd = 4, 2, 64
    qkv, kc, vc = rope_inputs(rng, 1, nh, nkv, hd, 0, 0, 4, f16=False)
    for mode in ("normal", "neox"):
        out, k32, _ = gpu().rope_kv(qkv, 0, nh, nkv, hd, None, None, 0.0, {"n_dims": 64, "mode": mode}, kc, vc)
        assert np.array_equal(out, qkv)
        assert np.array_equal(k32[0], qkv[0, nh * hd : (nh + nkv) * hd])


def test_rope_kv_rejects_bad_arguments(rng):
    nh, nkv, hd = 4, 2, 64
    qkv, kc, vc = rope_inputs(rng, 2, nh, nkv, hd, 0, 0, 8, f16=True)
    rope = {"n_dims": 64, "mode": "neox"}
    w = np.ones(hd, np.float32)
    cases = [
        (dict(rope={"n_dims": 63}), "n_dims"),
        (dict(rope={"n_dims": 66}), "n_dims"),
        (dict(pos0=7), "do not fit"),  # positions 7..9 past the 8-row cache
        (dict(q_norm=w), "together"),
        (dict(qkv=qkv[:, :-1]), "ld_qkv"),
        (dict(rope={"n_dims": 64, "freq_base": -1.0}), "freq_base"),
    ]
    for over, msg in cases:
        a = dict(qkv=qkv, pos0=0, n_heads=nh, n_kv_heads=nkv, head_dim=hd, rope=rope, k_cache=kc, v_cache=vc)
        a.update(over)
        with pytest.raises(native.EngineError, match=msg):
            gpu().rope_kv(**a)
    big = np.zeros((1, 3 * 264), np.float32)
    with pytest.raises(native.EngineError, match="head_dim"):
        gpu().rope_kv(big, 0, 1, 1, 264, rope={"n_dims": 64}, k_cache=np.zeros((2, 264), np.float16),
                      v_cache=np.zeros((2, 264), np.float16))


# ---------------------------------------------------------------- attention


def attention_twin(q, k, v, pos0, scale):
    """Causal GQA in float64 on the cache's own (possibly fp16-rounded) values.
    q [n, nh, hd]; k, v [n_ctx, nkv, hd]."""
    n, nh, hd = q.shape
    group = nh // k.shape[1]
    K, V = k.astype(np.float64), v.astype(np.float64)
    out = np.zeros((n, nh, hd))
    for t in range(n):
        m = pos0 + t + 1
        for h in range(nh):
            s = f32(scale) * (K[:m, h // group] @ q[t, h].astype(np.float64))
            p = np.exp(s - s.max())
            out[t, h] = (p / p.sum()) @ V[:m, h // group]
    return out


def attention_tolerance(q, k, v, pos0, scale):
    """Bound on |out - twin| per element for float32 arithmetic (as tests/native's, doubled).

    A score is a float32 dot over head_dim (four interleaved fmaf chains): error a few U times
    scale * sum_d |q_d k_jd|, which moves the weights p_j by about that much relative and the
    output by that times max|V|. The weighted sums (fmaf chains of up to 256 positions, then
    the chunks combined in float) add rounding that grows like sqrt(n) (random walk). The
    CPU's bound is doubled because its chunks are 128 long and combined in double.
    """
    n, nh, hd = q.shape
    group = nh // k.shape[1]
    n_ctx = pos0 + n
    kk = np.repeat(np.abs(k[:n_ctx].astype(np.float64)), group, axis=1)
    dots = np.einsum("thd,jhd->thj", np.abs(q.astype(np.float64)), kk)
    vmax = np.abs(v[:n_ctx].astype(np.float64)).max()
    return 2 * U * vmax * (8.0 + np.sqrt(n_ctx) + scale * dots.max())


def attention_inputs(rng, n, pos0, nh, nkv, hd, dtype, extra=2, q_scale=2.0):
    q = (rng.standard_normal((n, nh * hd)) * q_scale).astype(np.float32)  # sharp-ish softmax
    n_ctx = pos0 + n
    k = rng.standard_normal((n_ctx + extra, nkv * hd)).astype(dtype)
    v = rng.standard_normal((n_ctx + extra, nkv * hd)).astype(dtype)
    # Rows past the last query's position hold NaN: reading them would poison the output.
    k[n_ctx:] = np.nan
    v[n_ctx:] = np.nan
    return q, k, v


ATT_CASES = [
    # n, pos0, n_heads, n_kv_heads, head_dim
    (1, 0, 4, 4, 64),  # first token: one key
    (1, 300, 9, 3, 64),  # SmolLM2 decode (GQA 3), two chunks
    (5, 37, 8, 2, 64),  # speculative verify of 5 tokens (GQA 4)
    (5, 0, 4, 4, 128),  # prefill from scratch (MHA)
    (1, 1500, 32, 8, 128),  # long decode, qwen3-8B-like (GQA 4)
    (17, 250, 14, 2, 128),  # GQA 7, queries straddling the chunk boundary at 256
    (3, 50, 14, 2, 80),  # head_dim 80 (padded to 128), GQA 7
    (4, 700, 4, 1, 256),  # head_dim 256, GQA 4
    (48, 0, 6, 2, 64),  # prefill of 48 tokens
    (40, 3000, 8, 8, 128),  # a prefill chunk at a long context (MHA): 12 chunks, 2 launches
    (64, 200, 28, 4, 128),  # 448 query rows (GQA 7) over 14 row tiles
    (1, 40, 16, 1, 64),  # decode with a GQA group of 16 (past the decode kernel's 8)
    (1, 255, 32, 8, 128),  # decode at the end of the first chunk (qwen3-8B heads)
]


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
@pytest.mark.parametrize("n,pos0,nh,nkv,hd", ATT_CASES)
def test_attention(rng, dtype, n, pos0, nh, nkv, hd):
    scale = 1.0 / np.sqrt(hd)
    q, k, v = attention_inputs(rng, n, pos0, nh, nkv, hd, dtype)
    out = gpu().attention(q, k, v, pos0, nh, nkv, hd, scale)
    assert out.shape == (n, nh * hd) and np.isfinite(out).all()
    q3, k3, v3 = q.reshape(n, nh, hd), k.reshape(-1, nkv, hd), v.reshape(-1, nkv, hd)
    ref = attention_twin(q3, k3, v3, pos0, scale)
    cpu = ops.attention(q3, k3, v3, pos0, scale)
    tol = attention_tolerance(q3, k3, v3, pos0, scale)
    err = np.abs(out.reshape(n, nh, hd) - ref).max()
    err_cpu = np.abs(out.reshape(n, nh, hd) - cpu).max()
    print(f"attention {dtype.__name__} {n=} {pos0=} {nh}/{nkv} {hd=}: max err {err / U:.1f} U "
          f"(vs CPU {err_cpu / U:.1f} U, tol {tol / U:.0f} U)")
    assert err <= tol
    # The CPU op is within its own (half as large) bound of the twin.
    assert err_cpu <= 1.5 * tol


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
@pytest.mark.parametrize("nh,nkv,hd", [(8, 2, 128), (14, 2, 64), (4, 4, 256), (7, 7, 80)])
@pytest.mark.parametrize("pos0", [0, 1, 239, 240, 255, 256, 257, 511, 3000])
def test_attention_batch_invariant(rng, dtype, nh, nkv, hd, pos0):
    # A query's output must not depend on how many queries share the call (decode n=1,
    # verify n=17, prefill n=64), on where it sits in the batch or on the cache's length.
    scale = 1.0 / np.sqrt(hd)
    q, k, v = attention_inputs(rng, 64, pos0, nh, nkv, hd, dtype, extra=300)
    att = gpu().attention
    full = att(q, k, v, pos0, nh, nkv, hd, scale)
    first = att(q[:17], k, v, pos0, nh, nkv, hd, scale)
    assert np.array_equal(first, full[:17])
    singles = np.concatenate([att(q[i : i + 1], k, v, pos0 + i, nh, nkv, hd, scale) for i in range(17)])
    assert np.array_equal(singles, first)
    middle = att(q[5:22], k, v, pos0 + 5, nh, nkv, hd, scale)  # other row tiles / launch split
    assert np.array_equal(middle, full[5:22])
    short = att(q[:17], k[: pos0 + 17], v[: pos0 + 17], pos0, nh, nkv, hd, scale)  # fewer chunks launched
    assert np.array_equal(short, first)
    # ...and stays a correct attention
    q3, k3, v3 = q[:17].reshape(17, nh, hd), k.reshape(-1, nkv, hd), v.reshape(-1, nkv, hd)
    ref = attention_twin(q3, k3, v3, pos0, scale)
    assert np.abs(first.reshape(17, nh, hd) - ref).max() <= attention_tolerance(q3, k3, v3, pos0, scale)


def test_attention_long_decode_matches_prefill(rng):
    # A long context (n_ctx 8300, 33 chunks): decode steps equal the prefill rows bit for bit,
    # and 64 queries take two launches (32 each) through the bounded workspace.
    nh, nkv, hd, pos0 = 8, 2, 128, 8200
    q, k, v = attention_inputs(rng, 64, pos0, nh, nkv, hd, np.float16, extra=36)
    att = gpu().attention
    full = att(q, k, v, pos0, nh, nkv, hd, 0.09)
    for i in (0, 31, 32, 63):
        assert np.array_equal(att(q[i : i + 1], k, v, pos0 + i, nh, nkv, hd, 0.09), full[i : i + 1])
    q3, k3, v3 = q[:2].reshape(2, nh, hd), k.reshape(-1, nkv, hd), v.reshape(-1, nkv, hd)
    ref = attention_twin(q3, k3, v3, pos0, 0.09)
    assert np.abs(full[:2].reshape(2, nh, hd) - ref).max() <= attention_tolerance(q3, k3, v3, pos0, 0.09)


PREFILL_CASES = [
    # n (> 64: the prefill path), pos0, n_heads, n_kv_heads, head_dim
    (65, 0, 8, 2, 128),  # one row past the small path, from scratch
    (200, 37, 14, 2, 64),  # GQA 7, head_dim 64, partial last query tile
    (300, 700, 4, 4, 128),  # a later prefill chunk (MHA)
    (130, 3000, 32, 8, 128),  # qwen3-8B heads at a long context
    (100, 20, 3, 1, 80),  # head_dim 80: not a tensor-core shape, the flash-decoding kernels
]


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
@pytest.mark.parametrize("n,pos0,nh,nkv,hd", PREFILL_CASES)
def test_attention_prefill(rng, dtype, n, pos0, nh, nkv, hd):
    # n > 64 with an fp16 cache and head_dim 64 / 128 runs on tensor cores (attention_tc.cu):
    # q and the weights p_j are rounded to fp16 (relative 2^-11 each). A score moves by at most
    # 2^-11 scale sum_d |q_d k_jd|, every weight p_j / l by about twice that plus 2^-10 (its own
    # rounding and the sum's), so |out - exact| <= max|V| (2^-10 scale max dots + 2^-8), on top
    # of the float32 bound of the other kernels (float caches and other head sizes take those).
    scale = 1.0 / np.sqrt(hd)
    q, k, v = attention_inputs(rng, n, pos0, nh, nkv, hd, dtype, extra=70)
    out = gpu().attention(q, k, v, pos0, nh, nkv, hd, scale)
    assert out.shape == (n, nh * hd) and np.isfinite(out).all()
    q3, k3, v3 = q.reshape(n, nh, hd), k.reshape(-1, nkv, hd), v.reshape(-1, nkv, hd)
    ref = attention_twin(q3, k3, v3, pos0, scale)
    tol = attention_tolerance(q3, k3, v3, pos0, scale)
    if dtype == np.float16:
        group, n_ctx = nh // nkv, pos0 + n
        kk = np.repeat(np.abs(k3[:n_ctx].astype(np.float64)), group, axis=1)
        dots = np.einsum("thd,jhd->thj", np.abs(q3.astype(np.float64)), kk).max()
        tol += np.abs(v3[:n_ctx].astype(np.float64)).max() * (2.0**-10 * scale * dots + 2.0**-8)
    err = np.abs(out.reshape(n, nh, hd) - ref).max()
    print(f"prefill attention {dtype.__name__} {n=} {pos0=} {nh}/{nkv} {hd=}: max err {err:.3g} (tol {tol:.3g})")
    assert err <= tol
    # and the CPU op (within 1.5x the float32 bound of the twin, test_attention): triangle
    cpu = ops.attention(q3, k3, v3, pos0, scale)
    assert np.abs(out.reshape(n, nh, hd) - cpu).max() <= tol + 1.5 * attention_tolerance(q3, k3, v3, pos0, scale)
    # causal: keys and values after query i's position change no bit of rows <= i
    i = n // 2
    k2, v2 = k.copy(), v.copy()
    k2[pos0 + i + 1 : pos0 + n] += 3.0
    v2[pos0 + i + 1 : pos0 + n] -= 3.0
    moved = gpu().attention(q, k2, v2, pos0, nh, nkv, hd, scale)
    assert np.array_equal(moved[: i + 1], out[: i + 1])
    assert not np.allclose(moved[i + 1 :], out[i + 1 :])


def test_attention_is_causal(rng):
    # Changing keys/values after a query's position must not change that query's output (bit
    # for bit); changing an earlier one must.
    nh, nkv, hd, pos0 = 4, 2, 64, 300
    q, k, v = attention_inputs(rng, 4, pos0, nh, nkv, hd, np.float32, extra=0)
    base = gpu().attention(q, k, v, pos0, nh, nkv, hd, 0.2)  # queries at positions 300..303
    k2, v2 = k.copy(), v.copy()
    k2[302:] += 5.0
    v2[302:] -= 5.0  # positions 302, 303: visible only to queries 2, 3
    moved = gpu().attention(q, k2, v2, pos0, nh, nkv, hd, 0.2)
    assert np.array_equal(moved[:2], base[:2])
    assert not np.allclose(moved[2:], base[2:])


def test_attention_peaked_scores(rng):
    # Scores up to ~100 apart: exp(s - m) of the losers underflows to 0 and the winner's
    # weight is 1; the output is V at the best key, to the tolerance above.
    nh, nkv, hd, pos0, n = 4, 1, 64, 600, 2
    q, k, v = attention_inputs(rng, n, pos0, nh, nkv, hd, np.float32, extra=0, q_scale=30.0)
    out = gpu().attention(q, k, v, pos0, nh, nkv, hd, 0.5)
    q3, k3, v3 = q.reshape(n, nh, hd), k.reshape(-1, nkv, hd), v.reshape(-1, nkv, hd)
    ref = attention_twin(q3, k3, v3, pos0, 0.5)
    assert np.abs(out.reshape(n, nh, hd) - ref).max() <= attention_tolerance(q3, k3, v3, pos0, 0.5)


def test_attention_rejects_bad_arguments():
    att = gpu().attention
    kv = np.zeros((8, 4 * 16), np.float32)
    with pytest.raises(native.EngineError, match="multiple of n_kv_heads"):
        att(np.zeros((1, 6 * 16), np.float32), kv, kv, 0, 6, 4, 16, 1.0)
    with pytest.raises(native.EngineError, match="multiple of 8"):
        att(np.zeros((1, 4 * 20), np.float32), np.zeros((8, 4 * 20), np.float32),
            np.zeros((8, 4 * 20), np.float32), 0, 4, 4, 20, 1.0)
    with pytest.raises(native.EngineError, match="multiple of 8"):
        att(np.zeros((1, 264), np.float32), np.zeros((8, 264), np.float32), np.zeros((8, 264), np.float32),
            0, 1, 1, 264, 1.0)
    with pytest.raises(native.EngineError, match="do not fit"):
        att(np.zeros((2, 4 * 16), np.float32), kv, kv, 7, 4, 4, 16, 1.0)  # positions 7, 8 of 8 rows
    with pytest.raises(native.EngineError, match="same type"):
        att(np.zeros((1, 4 * 16), np.float32), kv, kv.astype(np.float16), 0, 4, 4, 16, 1.0)


# ---------------------------------------------------------------- argmax, softmax


@pytest.mark.parametrize("nv", [1, 7, 1000, 32003, 151936])
def test_argmax_rows(rng, nv):
    n = 6
    x = (rng.standard_normal((n, nv)) * 5).astype(np.float32)
    if nv > 10:
        best = x.max()
        x[1, [nv - 1, 3, nv // 2]] = best + 1.0  # a three-way tie: the lowest index wins
        x[2] = -np.inf  # all -inf: index 0
        x[3, rng.integers(0, nv, 5)] = np.nan  # NaNs elsewhere are skipped...
        x[3, 0] = -1e30
        x[4, 0] = np.nan  # ...but a NaN at 0 stays the answer (the strict-greater scan)
        x[5, :] = 0.0
        x[5, 7] = -0.0  # -0 and +0 tie
    out = gpu().argmax_rows(x)
    expect = [ops.argmax(row) for row in x]
    assert out.dtype == np.int32
    assert list(out) == expect
    if nv > 10:
        assert out[1] == 3 and out[2] == 0 and out[4] == 0 and out[5] == 0


@pytest.mark.parametrize("nv", [2048, 2053])  # float4 loads / 2053: not a multiple of 4, scalar loads
def test_argmax_rows_every_position(rng, nv):
    # The single maximum at every position of a row (each lane, vector slot and group).
    x = rng.standard_normal((nv, nv)).astype(np.float32)
    np.fill_diagonal(x, 10.0)
    assert np.array_equal(gpu().argmax_rows(x), np.arange(nv))


def test_argmax_rows_across_segments(rng):
    # Rows are split over blocks of 8192 logits: the maximum on either side of each boundary,
    # and a tie between segments (the lower index wins whichever block finishes last).
    nv = 3 * 8192 + 5
    spots = [0, 8191, 8192, 16383, 16384, 24575, 24576, nv - 1]
    x = rng.standard_normal((len(spots) + 1, nv)).astype(np.float32)
    for r, k in enumerate(spots):
        x[r, k] = 50.0
    x[-1, [20000, 9000, 8193]] = 50.0
    for _ in range(3):  # repeated calls: each call leaves the workspace ready for the next
        assert list(gpu().argmax_rows(x)) == spots + [8193]


def test_argmax_rows_all_nan():
    x = np.full((2, 100), np.nan, np.float32)
    assert list(gpu().argmax_rows(x)) == [0, 0] == [ops.argmax(r) for r in x]


@pytest.mark.parametrize("nv,scale", [(1, 1.0), (7, 1.0), (1000, 3.0), (49157, 10.0), (151936, 8.0), (333, 1e4)])
def test_softmax_rows(rng, nv, scale):
    n = 3
    x = (rng.standard_normal((n, nv)) * scale).astype(np.float32)
    if nv > 10:
        x[:, rng.integers(0, nv, 3)] = -np.inf  # masked entries
        x[:, rng.integers(0, nv)] = x.max()  # a tie at the max
    y = gpu().softmax_rows(x)
    x64 = x.astype(np.float64)
    ref = np.exp(x64 - x64.max(axis=1, keepdims=True))
    ref /= ref.sum(axis=1, keepdims=True)
    assert np.isfinite(y).all()
    # exp(x - max) within ~2-3 ulp (x - max kept exact, exp2 corrected), the sum in double,
    # one multiply by the rounded 1/sum: 8U relative. Results below FLT_MIN may flush to 0.
    err = np.abs(y - ref)
    rel = (err / np.maximum(ref, 1e-300))[ref > 1e-30]
    print(f"softmax nv={nv} scale={scale:g}: max rel err {rel.max() / U:.2f} U")
    assert (err <= 8 * U * ref + 1.2e-38).all()
    assert (np.abs(y.astype(np.float64).sum(axis=1) - 1.0) <= 1e-6).all()
    assert (y[x == -np.inf] == 0).all()
    cpu = np.stack([ops.softmax(r) for r in x])
    assert (np.abs(y - cpu) <= 14 * U * ref + 1.2e-38).all()  # both within their bounds of ref


def test_sample_rejects_empty_rows():
    with pytest.raises(native.EngineError, match="nv > 0"):
        gpu().argmax_rows(np.zeros((2, 0), np.float32))
    with pytest.raises(native.EngineError, match="nv > 0"):
        gpu().softmax_rows(np.zeros((2, 0), np.float32))


# ---------------------------------------------------------------- rope_kv fused into attention


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
@pytest.mark.parametrize("mode", ["normal", "neox"])
@pytest.mark.parametrize("nh,nkv,hd,n_dims,base,scale,with_factors,qk_norm", ROPE_CASES)
@pytest.mark.parametrize("n,pos0", [(1, 0), (1, 700), (2, 255), (5, 250), (16, 3000), (17, 60), (40, 500)])
def test_rope_attention_equals_rope_kv_then_attention(rng, dtype, mode, nh, nkv, hd, n_dims, base, scale,
                                                      with_factors, qk_norm, n, pos0):
    # The engine's call (AttnArgs::rope): a decode (n = 1) norms/ropes q and the new K/V row
    # inside the attention kernel, one block per KV head and chunk writing its cache row; more
    # rows run rope_kv's kernel first (rows straddling a chunk, GQA 7 queries straddling row
    # tiles). Output and both caches must be the same BITS as the two kernels run apart
    # (speculation compares decode with verify). The cache's rows from pos0 on start as NaN:
    # neither path may read them before writing them.
    n_ctx = pos0 + n + 3
    qkv, kc, vc = rope_inputs(rng, n, nh, nkv, hd, 4, pos0, n_ctx, f16=dtype is np.float16)
    kc[pos0:] = np.nan
    vc[pos0:] = np.nan
    rope, q_norm, k_norm = rope_params(rng, mode, hd, n_dims, base, scale, with_factors, qk_norm)
    att_scale = 1.0 / np.sqrt(hd)
    roped, k2, v2 = gpu().rope_kv(qkv, pos0, nh, nkv, hd, q_norm, k_norm, 1e-6, rope, kc, vc)
    want = gpu().attention(np.ascontiguousarray(roped[:, : nh * hd]), k2, v2, pos0, nh, nkv, hd, att_scale)
    out, k1, v1 = gpu().rope_attention(qkv, pos0, nh, nkv, hd, q_norm, k_norm, 1e-6, rope, kc, vc, att_scale)
    assert np.isfinite(out).all()
    assert np.array_equal(out, want)
    bits = np.uint16 if dtype is np.float16 else np.uint32
    assert np.array_equal(k1.view(bits), k2.view(bits)) and np.array_equal(v1.view(bits), v2.view(bits))
    assert np.isfinite(k1[: pos0 + n]).all() and np.isnan(k1[pos0 + n :]).all()


@pytest.mark.parametrize("variant", ["SPECD_GPU_FOLD=0", "SPECD_GPU_DEC_BUFS=4", "SPECD_GPU_DEC_BUFS=5",
                                     "SPECD_GPU_DEC_ATTN=0", "SPECD_GPU_ATTN_SPREAD=0"])
def test_attention_variants_give_the_same_bits(rng, tmp_path, variant):
    # The launch variants compute the same maths in the same order, so the same BITS, decode and
    # verify, fp16 and float caches:
    # - SPECD_GPU_FOLD=0: the chunk combine (queries past position 256) in its own kernel
    #   instead of the last block of the partial kernel (the fold);
    # - SPECD_GPU_DEC_BUFS=4/5: the decode kernel's ring of K/V sub-tiles too small for a chunk,
    #   refilled as it is consumed (as on ~100 KiB shared-memory devices), instead of copied
    #   whole before the grid wait;
    # - SPECD_GPU_DEC_ATTN=0: decode (one query) on the general kernel;
    # - SPECD_GPU_ATTN_SPREAD=0: a verify's rows over a short context in tiles of 32 rows (Big)
    #   instead of the 8-row tiles (Dec) that keep more multiprocessors busy.
    cases = []
    for dtype, n, pos0, nh, nkv, hd in [(np.float16, 1, 700, 32, 8, 128), (np.float32, 5, 1000, 14, 2, 64),
                                         (np.float16, 17, 250, 16, 8, 128), (np.float16, 3, 5000, 8, 2, 256),
                                         (np.float16, 1, 0, 16, 8, 128), (np.float16, 1, 64, 16, 8, 128),
                                         (np.float16, 1, 127, 32, 8, 128), (np.float16, 1, 128, 14, 2, 64),
                                         (np.float32, 1, 255, 8, 2, 128), (np.float16, 1, 256, 8, 2, 80),
                                         (np.float32, 1, 3000, 4, 1, 256), (np.float16, 1, 5000, 28, 4, 128),
                                         (np.float16, 16, 64, 32, 8, 128), (np.float32, 16, 64, 16, 8, 128),
                                         (np.float16, 16, 2000, 32, 8, 128)]:
        q, k, v = attention_inputs(rng, n, pos0, nh, nkv, hd, dtype)
        cases.append((q, k, v, pos0, nh, nkv, hd))
        np.savez(tmp_path / f"case{len(cases)}.npz", q=q, k=k, v=v, meta=np.array([pos0, nh, nkv, hd]))
    script = (
        "import sys, numpy as np\n"
        "from worker.engine import native\n"
        "for i in range(1, %d):\n"
        "    z = np.load(sys.argv[1] + f'/case{i}.npz')\n"
        "    pos0, nh, nkv, hd = (int(x) for x in z['meta'])\n"
        "    out = native.gpu_ops.attention(z['q'], z['k'], z['v'], pos0, nh, nkv, hd, 1.0 / np.sqrt(hd))\n"
        "    np.save(sys.argv[1] + f'/out{i}.npy', out)\n" % (len(cases) + 1)
    )
    name, value = variant.split("=")
    env = dict(os.environ, **{name: value})
    subprocess.run([sys.executable, "-c", script, str(tmp_path)], env=env, check=True)
    for i, (q, k, v, pos0, nh, nkv, hd) in enumerate(cases, 1):
        out = gpu().attention(q, k, v, pos0, nh, nkv, hd, 1.0 / np.sqrt(hd))
        assert np.isfinite(out).all()
        assert np.array_equal(out, np.load(tmp_path / f"out{i}.npy")), f"case {i}"
