"""The sampler (engine/sampler.cpp) against numpy twins written here: penalties, the
sampling distribution (temperature -> top-k -> top-p -> min-p -> renormalise; ties keep
lower ids), argmax, sample_from, the xoshiro256** generator, and parameter validation.
Inputs are fresh random (the seed is printed; a failure shows it).
"""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest

from worker.engine import native, ops

U = 2.0**-24  # float32 unit roundoff



def f32(x) -> np.float64:
    """A parameter as the C++ side sees it: rounded to float32, then exact in float64."""
    return np.float64(np.float32(x))


# ---------------------------------------------------------------- validate()

BAD_PARAMS = [
    ({"temperature": -1.0}, "temperature must be >= 0 and finite.*got -1"),
    ({"temperature": float("nan")}, "temperature must be >= 0 and finite.*got -?nan"),
    ({"temperature": float("inf")}, "temperature must be >= 0 and finite.*got inf"),
    ({"top_k": -1}, r"top_k must be >= 0.*got -1"),
    ({"top_p": 0.0}, r"top_p must be in \(0, 1\].*got 0"),
    ({"top_p": 1.5}, r"top_p must be in \(0, 1\].*got 1.5"),
    ({"top_p": float("nan")}, r"top_p must be in \(0, 1\].*got -?nan"),
    ({"min_p": -0.25}, r"min_p must be in \[0, 1\].*got -0.25"),
    ({"min_p": 1.5}, r"min_p must be in \[0, 1\].*got 1.5"),
    ({"repetition_penalty": 0.0}, r"repetition_penalty must be > 0 and finite.*got 0"),
    ({"repetition_penalty": -1.5}, r"repetition_penalty must be > 0 and finite.*got -1.5"),
    ({"repetition_penalty": float("inf")}, r"repetition_penalty must be > 0 and finite.*got inf"),
    ({"presence_penalty": 2.5}, r"presence_penalty must be in \[-2, 2\].*got 2.5"),
    ({"presence_penalty": -3.0}, r"presence_penalty must be in \[-2, 2\].*got -3"),
    ({"frequency_penalty": 2.25}, r"frequency_penalty must be in \[-2, 2\].*got 2.25"),
    ({"frequency_penalty": float("nan")}, r"frequency_penalty must be in \[-2, 2\].*got -?nan"),
    ({"temprature": 1.0}, "unknown sampling parameter 'temprature'"),
]


@pytest.mark.parametrize("params,message", BAD_PARAMS)
def test_validate_rejects(params, message):
    with pytest.raises(native.EngineError, match=message):
        ops.sampling_probs(np.zeros(4, np.float32), params)


def test_validate_accepts_the_edges():
    edges = [
        {"temperature": 0.0},
        {"top_k": 0, "top_p": 1.0, "min_p": 0.0},
        {"top_p": 1e-6, "min_p": 1.0},
        {"presence_penalty": 2.0, "frequency_penalty": -2.0},
        {"repetition_penalty": 1e-3, "seed": 2**64 - 1},
    ]
    for p in edges:
        probs = ops.sampling_probs(np.arange(4, dtype=np.float32), p)
        assert abs(float(probs.sum()) - 1.0) < 1e-6


# ---------------------------------------------------------------- penalties


def penalties_twin(logits, rep, presence, frequency, prompt, generated):
    y = logits.astype(np.float64).copy()
    for t in set(prompt.tolist()) | set(generated.tolist()):
        y[t] = y[t] / f32(rep) if y[t] > 0 else y[t] * f32(rep)
    for t, c in Counter(generated.tolist()).items():
        y[t] -= f32(presence) + f32(frequency) * c
    return y


@pytest.mark.parametrize("rep,presence,frequency", [(1.3, 0.0, 0.0), (0.7, 0.0, 0.0), (1.0, 0.5, 0.25), (1.25, -0.4, 1.5)])
def test_penalties(rng, rep, presence, frequency):
    n = 500
    logits = (rng.standard_normal(n) * 4).astype(np.float32)  # both signs
    prompt = rng.integers(0, 60, 40).astype(np.int32)  # many repeats
    generated = rng.integers(30, 90, 50).astype(np.int32)  # overlaps the prompt
    params = {"repetition_penalty": rep, "presence_penalty": presence, "frequency_penalty": frequency}
    y = ops.apply_penalties(logits, params, prompt, generated)
    ref = penalties_twin(logits, rep, presence, frequency, prompt, generated)
    touched = np.zeros(n, bool)
    touched[np.concatenate([prompt, generated])] = True
    assert np.array_equal(y[~touched], logits[~touched])  # the rest stay bit for bit
    # One float division (or product) then one subtraction: each rounds once.
    err = np.abs(y - ref)
    bound = 2 * U * (np.abs(logits) * max(rep, 1 / rep) + np.abs(ref))
    print(f"penalties: max err {err.max():.2e}")
    assert (err <= bound).all()


def test_repetition_penalty_direction():
    # CTRL rule: positive logits are divided, negative multiplied: both become less likely.
    logits = np.array([2.0, -2.0, 3.0, -3.0], np.float32)
    y = ops.apply_penalties(logits, {"repetition_penalty": 2.0}, np.array([0, 1], np.int32), np.array([], np.int32))
    assert y.tolist() == [1.0, -4.0, 3.0, -3.0]


def test_presence_frequency_count_only_generated():
    logits = np.zeros(6, np.float32)
    prompt = np.array([0, 0, 0, 1], np.int32)
    generated = np.array([1, 2, 2, 2, 5], np.int32)
    y = ops.apply_penalties(logits, {"presence_penalty": 0.5, "frequency_penalty": 0.25}, prompt, generated)
    # token 0: prompt only -> untouched; 1: once; 2: three times; 5: once
    assert y.tolist() == [0.0, -0.75, -1.25, 0.0, 0.0, -0.75]


def test_penalties_reject_out_of_range_tokens():
    with pytest.raises(native.EngineError, match="token id 9 is outside"):
        ops.apply_penalties(np.zeros(4, np.float32), {"repetition_penalty": 1.1}, np.array([9], np.int32), np.array([], np.int32))


# ---------------------------------------------------------------- sampling_probs

# Inputs whose top-p / min-p decision lies this close to its edge are redrawn: the C++
# side works with float32 probabilities (each within ~3U relative, so a cumulative mass or
# a ratio to p_max within ~6U = 3.6e-7) and may legitimately decide the other way there.
MARGIN = 1e-6


class Ambiguous(Exception):
    pass


def probs_twin(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
    """temperature -> top-k -> top-p -> min-p -> renormalise, ties to the lower id."""
    n = logits.size
    if temperature == 0:
        out = np.zeros(n)
        out[int(np.argmax(logits))] = 1.0  # numpy's argmax: first maximum
        return out
    z = (logits.astype(np.float32) / np.float32(temperature)).astype(np.float64)  # as C++: float32
    order = np.lexsort((np.arange(n), -z))  # z descending, then id ascending
    keep = np.zeros(n, bool)
    keep[order[: top_k if 0 < top_k < n else n]] = True
    p = np.where(keep, np.exp(z - z[keep].max()), 0.0)
    p /= p.sum()
    if top_p < 1.0:
        c = np.cumsum(p[order])
        tp = f32(top_p)
        if np.any(np.abs(c - tp) < MARGIN):
            raise Ambiguous
        cut = int(np.argmax(c >= tp)) + 1 if np.any(c >= tp) else n
        in_prefix = np.zeros(n, bool)
        in_prefix[order[:cut]] = True
        keep &= in_prefix
    if min_p > 0.0:
        ratio = p / p.max()
        if np.any(np.abs(ratio - f32(min_p)) < MARGIN):
            raise Ambiguous
        keep &= ratio >= f32(min_p)
    out = np.where(keep, p, 0.0)
    return out / out.sum()


def check_probs(logits, params):
    ref = probs_twin(logits, **params)
    y = ops.sampling_probs(logits, params)
    assert y.dtype == np.float32
    # Exactly the twin's kept set (up to kept values below FLT_MIN, which may flush to
    # 0), exactly zero elsewhere.
    assert (y[ref == 0] == 0).all()
    assert (y[ref > 1e-30] > 0).all()
    # softmax in float32 (~3U), one renormalisation: 8U relative; probabilities below
    # FLT_MIN may flush to zero.
    err = np.abs(y - ref)
    assert (err <= 8 * U * ref + 1e-37).all(), f"max rel err {(err / np.maximum(ref, 1e-300)).max() / U:.1f} U"
    assert abs(float(y.astype(np.float64).sum()) - 1.0) <= 1e-6
    return y, ref


def draw(rng, n, scale, grid=False):
    x = rng.standard_normal(n) * scale
    if grid:  # many exact ties
        x = np.round(x * 2) / 2
    return x.astype(np.float32)


PARAM_SETS = [
    {"temperature": 1.0},
    {"temperature": 0.7},
    {"temperature": 1.8},
    {"top_k": 1},
    {"top_k": 40},
    {"top_k": 999},
    {"top_p": 0.9},
    {"top_p": 0.3},
    {"min_p": 0.05},
    {"min_p": 0.5},
    {"temperature": 0.8, "top_k": 50, "top_p": 0.9},
    {"temperature": 1.3, "top_k": 200, "min_p": 0.02},
    {"temperature": 0.6, "top_p": 0.95, "min_p": 0.1},
    {"temperature": 1.1, "top_k": 100, "top_p": 0.8, "min_p": 0.01},
]


def check_redrawing(rng, params, n, scale, grid=False):
    for _ in range(20):
        try:
            return check_probs(draw(rng, n, scale, grid), params)
        except Ambiguous:
            continue
    pytest.fail("20 draws in a row had a top-p/min-p decision within MARGIN of its edge")


@pytest.mark.parametrize("params", PARAM_SETS, ids=lambda p: ",".join(f"{k}={v}" for k, v in p.items()))
@pytest.mark.parametrize("n,scale,grid", [(1000, 1.0, False), (1000, 3.0, True), (49152, 4.0, False)])
def test_sampling_probs(rng, params, n, scale, grid):
    y, ref = check_redrawing(rng, params, n, scale, grid)
    kept = int((y > 0).sum())
    if "top_k" in params:
        assert kept <= params["top_k"]
    if params.get("top_p", 1.0) < 1.0 or params.get("min_p", 0.0) > 0 or "top_k" in params:
        assert kept < n  # the filters did something: the test is not vacuous


def test_sampling_probs_large_vocab_top_p(rng):
    # 152k vocab with a flat-ish distribution: top-p must sort far past its first block.
    y, _ = check_redrawing(rng, {"top_p": 0.7}, 151936, 0.5)
    assert 1000 < (y > 0).sum() < 151936


@pytest.mark.parametrize("pad", [0, 200])  # top-k by nth_element (small vocab) / by a heap
def test_ties_keep_lower_ids(pad):
    logits = np.array([1.0, 3.0, 2.0, 3.0, 3.0, 0.0] + [-9.0] * pad, np.float32)
    # top-k = 2 among three tied 3.0s (ids 1, 3, 4): ids 1 and 3 stay.
    y = ops.sampling_probs(logits, {"top_k": 2})
    assert y[:6].tolist() == [0.0, 0.5, 0.0, 0.5, 0.0, 0.0] and not y[6:].any()
    logits = logits[:6]
    # top-p: each tied token holds mass ~0.28; 0.5 needs two of them: ids 1 and 3.
    y = ops.sampling_probs(logits, {"top_p": 0.5})
    assert (y > 0).tolist() == [False, True, False, True, False, False]
    # Mass exactly at top_p: four equal logits give p = 0.25 exactly; 0.5 is reached
    # (>=) after two tokens, so exactly ids 0 and 1 stay.
    y = ops.sampling_probs(np.zeros(4, np.float32), {"top_p": 0.5})
    assert y.tolist() == [0.5, 0.5, 0.0, 0.0]


def test_greedy_is_one_hot_argmax(rng):
    logits = draw(rng, 5000, 2.0)
    logits[[17, 4000]] = logits.max() + 1.0  # tie at the max: the lower id wins
    for params in ({"temperature": 0.0}, {"temperature": 0.0, "top_k": 5, "top_p": 0.5, "min_p": 0.3}):
        y = ops.sampling_probs(logits, params)
        assert y[17] == 1.0 and np.count_nonzero(y) == 1
    assert ops.argmax(logits) == 17


def test_argmax_ties_and_negatives():
    assert ops.argmax(np.array([-5.0, -1.0, -1.0, -3.0], np.float32)) == 1
    assert ops.argmax(np.array([-np.inf, -np.inf, 0.0], np.float32)) == 2
    assert ops.argmax(np.array([7.0], np.float32)) == 0


def test_temperature_limit_is_greedy():
    # A temperature so small that logits / T overflows float: still the argmax, no NaN.
    logits = np.array([1.0, 5.0, 5.0, 2.0], np.float32)
    y = ops.sampling_probs(logits, {"temperature": 1e-38})
    assert y.tolist() == [0.0, 1.0, 0.0, 0.0]


def test_all_masked_logits_raise():
    with pytest.raises(native.EngineError, match="every logit is -inf"):
        ops.sampling_probs(np.full(8, -np.inf, np.float32), {"temperature": 1.0})


# ---------------------------------------------------------------- sample_from


def sample_twin(probs, u):
    c = np.cumsum(probs.astype(np.float64))  # sequential, like the C++ loop
    i = int(np.searchsorted(c, u * c[-1], side="right"))  # smallest i with c[i] > u * total
    return i if i < probs.size else int(np.flatnonzero(probs)[-1])


def test_sample_from_matches_twin(rng):
    probs = rng.random(3000).astype(np.float32)
    probs[rng.random(3000) < 0.7] = 0.0  # sparse, like after top-k / top-p
    probs[:5] = 0.0  # leading zeros are never drawn, even at u = 0
    us = np.concatenate([rng.random(3000), [0.0, 0.5, 1.0 - 2.0**-53]])
    got = np.array([ops.sample_from(probs, float(u)) for u in us])
    ref = np.array([sample_twin(probs, u) for u in us])
    assert np.array_equal(got, ref)
    assert (probs[got] > 0).all()
    assert got.min() >= 5


def test_sample_from_frequencies(rng):
    # Sampled through the generator, frequencies match the distribution (chi-square, 9 dof,
    # threshold 40: false-alarm probability ~6e-6 for a correct sampler).
    probs = ops.sampling_probs(draw(rng, 10, 1.0), {"temperature": 1.0})
    us = ops.rng_uniform(int(rng.integers(0, 2**63)), 20000)
    counts = np.bincount([ops.sample_from(probs, float(u)) for u in us], minlength=10)
    expected = probs.astype(np.float64) * us.size
    assert ((counts - expected) ** 2 / expected).sum() < 40.0


def test_sample_from_rejects_bad_input():
    with pytest.raises(native.EngineError, match=r"u must be in \[0, 1\)"):
        ops.sample_from(np.ones(3, np.float32), 1.0)
    with pytest.raises(native.EngineError, match="sum to 0"):
        ops.sample_from(np.zeros(3, np.float32), 0.5)


# ---------------------------------------------------------------- Rng

M64 = (1 << 64) - 1


def xoshiro_twin(seed: int, n: int) -> list[float]:
    """xoshiro256** seeded by splitmix64, straight from the reference definitions."""
    s, x = [], seed
    for _ in range(4):
        x = (x + 0x9E3779B97F4A7C15) & M64
        z = x
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
        s.append(z ^ (z >> 31))

    def rotl(v, k):
        return ((v << k) | (v >> (64 - k))) & M64

    out = []
    for _ in range(n):
        r = (rotl((s[1] * 5) & M64, 7) * 9) & M64
        t = (s[1] << 17) & M64
        s[2] ^= s[0]
        s[3] ^= s[1]
        s[1] ^= s[2]
        s[0] ^= s[3]
        s[2] ^= t
        s[3] = rotl(s[3], 45)
        out.append((r >> 11) * 2.0**-53)
    return out


@pytest.mark.parametrize("seed", [0, 1, 42, 2**64 - 1, "fresh"])
def test_rng_matches_reference(rng, seed):
    seed = int(rng.integers(0, 2**63)) if seed == "fresh" else seed
    assert ops.rng_uniform(seed, 500).tolist() == xoshiro_twin(seed, 500)


def test_rng_deterministic_and_seed_dependent(rng):
    seed = int(rng.integers(0, 2**63))
    a, b = ops.rng_uniform(seed, 1000), ops.rng_uniform(seed, 1000)
    c = ops.rng_uniform(seed + 1, 1000)
    assert np.array_equal(a, b)
    assert not np.any(a == c)  # 1000 53-bit draws: a chance collision is ~1e-13
    assert ((a >= 0) & (a < 1)).all()
    assert np.array_equal(a * 2.0**53, np.floor(a * 2.0**53))  # multiples of 2^-53


def test_rng_uniformity(rng):
    # 200k draws in 64 equal bins from a fresh seed. Under uniformity the statistic is
    # chi-square with 63 dof; 131.7 is its 1 - 1e-6 quantile (Wilson-Hilferty), so a
    # correct generator fails this once in a million runs. The mean gets a 6-sigma bound.
    n, bins = 200_000, 64
    u = ops.rng_uniform(int(rng.integers(0, 2**63)), n)
    counts = np.bincount((u * bins).astype(int), minlength=bins)
    chi2 = float(((counts - n / bins) ** 2 / (n / bins)).sum())
    k, z = bins - 1, 4.753
    threshold = k * (1 - 2 / (9 * k) + z * math.sqrt(2 / (9 * k))) ** 3
    assert abs(threshold - 131.7) < 0.5
    assert chi2 < threshold, chi2
    assert abs(u.mean() - 0.5) < 6 * math.sqrt(1 / 12 / n)
