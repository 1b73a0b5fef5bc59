"""Whole-model exactness on tiny random GGUFs: engine logits vs the float64 reference.

Every supported architecture (llama untied/tied, qwen2 with QKV biases, qwen3 with per-head
Q/K norms and head_dim != dim / n_heads) x every weight type, with an fp32 and the default
fp16 KV cache, plus llama's rope_freqs and linear rope scaling, chunked prefill, and a check
that the tolerances below actually catch a wrong model (so these tests cannot pass vacuously).

Tolerances (errors are max |engine - reference| / max |reference logit|):
- F32_KV_TOL = 1e-4. The engine computes in float32 with float32 accumulation on the same
  dequantized weights, so it differs from float64 only by rounding: ~6e-8 per operation,
  growing like sqrt(n) over dot products of <= 512 terms and through 2 layers, i.e. ~1e-6
  (llama.cpp on F32 weights measures 2e-7 against this reference, the engine <= 1e-6).
  1e-4 leaves room for any summation order; a modelling error (RoPE pairing, a missing bias or norm, rope scaling)
  moves logits by > 1e-2 (see test_tolerance_catches_model_errors).
- F16_KV_TOL = 2e-3 against the reference whose K and V are rounded to fp16 too: the two
  round slightly different values (float32 vs float64), so an element near an fp16 rounding
  boundary may land one fp16 ulp (~2^-11 relative) apart, and random weights amplify that.
  Simulated with the reference (float32-sized noise before the fp16 rounding, 264 random
  models): median 7e-6, 99th percentile 1.6e-4, max 2.1e-4; the engine measures <= 2.4e-4.
- F16_KV_EXACT_TOL = 1e-2 against the exact reference: fp16 keeps 11 significant bits
  (relative error <= 2^-12 per K/V element, ~2.4e-4), and the random weights amplify it
  through 2 layers: the reference alone measures <= 2e-3 (132 random models), and a
  modelling error moves logits by > 5e-2.
- top-1: identical wherever the reference's top-2 gap exceeds twice the measured max error
  (closer pairs may legitimately swap); at least 80 % of positions must be that decisive.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import zlib

import numpy as np
import pytest

from helpers.reference import ReferenceModel
from helpers.tiny_gguf import K_QUANTS, WEIGHT_TYPES, write_tiny_model

F32_KV_TOL = 1e-4
F16_KV_TOL = 2e-3
F16_KV_EXACT_TOL = 1e-2
N_TOKENS = 20

# Fresh inputs each run; SPECD_TEST_SEED=<n> replays a failure (the seed is in every message).
SEED = int(os.environ.get("SPECD_TEST_SEED", secrets.randbits(31)))

ARCHS = {
    "llama": dict(arch="llama"),
    "llama_tied": dict(arch="llama", tied=True),
    "qwen2": dict(arch="qwen2"),
    "qwen3": dict(arch="qwen3"),  # head_dim set in _shape: != dim / n_heads
}


def _shape(arch: str, weight_type: str) -> dict:
    """Tiny shapes whose row lengths fit the weight type's block (32, or 256 for K-quants)."""
    if weight_type in K_QUANTS:
        shape = dict(dim=256, ffn=512, n_heads=4, n_kv_heads=2)
        if arch == "qwen3":
            shape["head_dim"] = 128  # q width 512 != dim 256
    else:
        shape = dict(dim=64, ffn=96, n_heads=4, n_kv_heads=2)
        if arch == "qwen3":
            shape["head_dim"] = 32  # q width 128 != dim 64
    return shape


def _engine_logits(path: str, tokens: np.ndarray, kv_type: str, chunks=None, **engine_kw) -> np.ndarray:
    """Engine logits float64 [n, n_vocab] for tokens prefilled in one call (or in `chunks`)."""
    from worker.engine import Engine
    from worker.model_file import open_model

    # one thread: tiny models gain nothing from more, and it keeps the suite fast on a busy
    # machine (the chunked-prefill test and the demo test run multi-threaded)
    engine_kw.setdefault("n_threads", 1)
    engine = Engine(open_model(path), kv_type=kv_type, **engine_kw)
    try:
        seq = engine.new_sequence()
        try:
            parts = np.split(tokens, np.cumsum(chunks)[:-1]) if chunks else [tokens]
            out = [np.asarray(seq.prefill([int(t) for t in part], all_logits=True)) for part in parts]
        finally:
            seq.close()
    finally:
        engine.close()
    logits = np.concatenate(out, axis=0)
    assert logits.dtype == np.float32 and logits.ndim == 2 and logits.shape[0] == len(tokens)
    assert np.isfinite(logits).all()
    return logits.astype(np.float64)


def rel_err(got: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(got - ref).max() / np.abs(ref).max())


def assert_close(got: np.ndarray, ref: np.ndarray, tol: float, what: str) -> float:
    assert got.shape == ref.shape, f"{what}: engine logits {got.shape}, reference {ref.shape}"
    err = rel_err(got, ref)
    assert err <= tol, f"{what}: max rel logit error {err:.3g} > {tol:g} (SPECD_TEST_SEED={SEED})"
    # top-1 must match wherever the reference's top-2 gap exceeds twice the measured error
    # (only closer near-ties may legitimately swap), and that must be nearly every position
    top2 = np.sort(ref, axis=-1)[:, -2:]
    decisive = (top2[:, 1] - top2[:, 0]) > 2 * np.abs(got - ref).max()
    assert decisive.mean() >= 0.8, (
        f"{what}: the error blurs top-1 at {np.count_nonzero(~decisive)} of {len(ref)} positions (SPECD_TEST_SEED={SEED})")
    same = got.argmax(-1) == ref.argmax(-1)
    assert same[decisive].all(), (
        f"{what}: top-1 differs at positions {np.flatnonzero(decisive & ~same).tolist()} (SPECD_TEST_SEED={SEED})")
    return err


def _case(tmp_path, name: str, arch_kw: dict, weight_type: str, **extra):
    rng = np.random.default_rng([SEED, zlib.crc32(name.encode())])
    kw = {**arch_kw, **_shape(arch_kw["arch"], weight_type), **extra}
    path = write_tiny_model(tmp_path / f"{name}.gguf", weight_type=weight_type,
                            seed=int(rng.integers(1 << 31)), **kw)
    tokens = rng.integers(0, 300, size=N_TOKENS).astype(np.int32)
    return path, tokens


@pytest.mark.parametrize("weight_type", WEIGHT_TYPES)
@pytest.mark.parametrize("arch", list(ARCHS))
def test_logits_match_reference(tmp_path, arch, weight_type):
    path, tokens = _case(tmp_path, f"{arch}_{weight_type}", ARCHS[arch], weight_type)
    exact = ReferenceModel(path).logits(tokens)
    kv16 = ReferenceModel(path, kv_round="f16").logits(tokens)

    e32 = assert_close(_engine_logits(path, tokens, "f32"), exact, F32_KV_TOL, f"{arch} {weight_type} kv f32")
    got16 = _engine_logits(path, tokens, "f16")
    e16 = assert_close(got16, kv16, F16_KV_TOL, f"{arch} {weight_type} kv f16 vs f16-rounded reference")
    e16x = assert_close(got16, exact, F16_KV_EXACT_TOL, f"{arch} {weight_type} kv f16 vs exact reference")
    print(f"{arch} {weight_type}: kv f32 {e32:.2e}; kv f16 {e16:.2e} (vs exact {e16x:.2e})")


ROPE_CASES = {
    "rope_freqs": dict(rope_freqs=True),
    "linear_x4": dict(rope_linear_factor=4.0),
    "freqs_and_linear": dict(rope_freqs=True, rope_linear_factor=2.0, rope_base=500000.0),
}


@pytest.mark.parametrize("weight_type", ["F32", "Q4_0", "Q6_K"])
@pytest.mark.parametrize("case", list(ROPE_CASES))
def test_llama_rope_variants(tmp_path, case, weight_type):
    path, tokens = _case(tmp_path, f"{case}_{weight_type}", ARCHS["llama"], weight_type, **ROPE_CASES[case])
    exact = ReferenceModel(path).logits(tokens)
    err = assert_close(_engine_logits(path, tokens, "f32"), exact, F32_KV_TOL, f"llama {case} {weight_type}")
    print(f"llama {case} {weight_type}: kv f32 {err:.2e}")


@pytest.mark.parametrize("kv_type", ["f32", "f16"])
@pytest.mark.parametrize("arch", list(ARCHS))
def test_chunked_prefill_matches_one_shot(tmp_path, arch, kv_type):
    """Prefill in pieces (and with a max_batch that forces the engine to split) reads the KV
    cache written by earlier calls: logits must still match the one-shot reference."""
    path, tokens = _case(tmp_path, f"chunks_{arch}", ARCHS[arch], "Q8_0")
    ref = ReferenceModel(path, kv_round="f16" if kv_type == "f16" else None).logits(tokens)
    tol = F16_KV_TOL if kv_type == "f16" else F32_KV_TOL
    assert_close(_engine_logits(path, tokens, kv_type, chunks=[7, 1, 12], n_threads=2), ref, tol,
                 f"{arch} chunks 7+1+12")
    assert_close(_engine_logits(path, tokens, kv_type, max_batch=6, n_threads=2), ref, tol, f"{arch} max_batch=6")


def test_tolerance_catches_model_errors(tmp_path):
    """Each feature these tests exercise changes the logits by far more than F32_KV_TOL, so a
    forward pass that got it wrong could not pass them."""
    cases = {
        "qwen3": dict(arch="qwen3", **_shape("qwen3", "Q8_0")),
        "qwen2": dict(arch="qwen2", **_shape("qwen2", "Q8_0")),
        "llama": dict(arch="llama", rope_freqs=True, rope_linear_factor=4.0, **_shape("llama", "Q8_0")),
    }
    rng = np.random.default_rng(SEED)
    tokens = rng.integers(0, 300, size=N_TOKENS)
    for name, kw in cases.items():
        path = write_tiny_model(tmp_path / f"{name}.gguf", weight_type="Q8_0", seed=int(rng.integers(1 << 31)), **kw)
        ref = ReferenceModel(path)
        good = ref.logits(tokens)
        wrong = {}
        cfg = ref.cfg
        other_mode = "neox" if cfg.rope_mode == "normal" else "normal"
        ref.cfg = dataclasses.replace(cfg, rope_mode=other_mode)
        wrong["rope pairing"] = ref.logits(tokens)
        ref.cfg = cfg
        if name == "qwen3":
            ref.cfg = dataclasses.replace(cfg, arch="llama")  # same rope mode, no Q/K norms
            wrong["no q/k norm"] = ref.logits(tokens)
            ref.cfg = cfg
        if name == "qwen2":
            saved = dict(ref.w)
            for k in [k for k in ref.w if k.endswith(".bias")]:
                del ref.w[k]
            wrong["no qkv bias"] = ref.logits(tokens)
            ref.w = saved
        if name == "llama":
            factors, ref.rope_factors = ref.rope_factors, None
            wrong["no rope_freqs"] = ref.logits(tokens)
            ref.rope_factors = factors
            ref.cfg = dataclasses.replace(cfg, rope_scale=1.0)
            wrong["no linear scaling"] = ref.logits(tokens)
            ref.cfg = cfg
        for what, logits in wrong.items():
            err = rel_err(logits, good)
            print(f"{name}: {what} moves logits by {err:.2e}")
            assert err > 100 * F32_KV_TOL and err > 2 * F16_KV_EXACT_TOL, (
                f"{name}: {what} only moves logits by {err:.3g} (SPECD_TEST_SEED={SEED})")
