"""The accept rule of speculative decoding (engine/accept.h, one verified position) against
a numpy twin written here, on fresh random distributions (the seed is printed), plus its
edge cases: draft probability 0 for the target's token, a draft the target gives 0,
all-accepted and all-rejected sequences, p == q, and a residual that sums to zero.

The rule (sampling): accept draft d iff u_accept * q(d) < p(d) (probability min(1, p/q));
else draw from normalize(max(0, p - q)) with u_resample (q = None: one-hot on d).
Greedy: accept iff d == argmax(p); the replacement is argmax(p).
"""

from __future__ import annotations

import numpy as np
import pytest

from worker.engine import ops

ONE_MINUS = 1.0 - 2.0**-53  # the largest uniform Rng::uniform() can return


# ---------------------------------------------------------------- the numpy twin

def sample_from_twin(p: np.ndarray, u: float) -> int:
    """sampler.h sample_from: the smallest i with cumsum(p)[i] > u * sum(p), sums in
    sequential double (np.cumsum is sequential; zeros add nothing)."""
    p64 = p.astype(np.float32).astype(np.float64)
    cum = np.cumsum(p64)
    total = cum[-1]
    assert total > 0
    hit = np.nonzero(cum > u * total)[0]
    return int(hit[0]) if hit.size else int(np.nonzero(p64)[0][-1])


def verify_twin(p: np.ndarray, q: np.ndarray | None, d: int, greedy: bool, ua: float, ur: float) -> tuple[bool, int]:
    p = p.astype(np.float32)
    if greedy:
        best = int(np.argmax(p))  # first maximum = lowest id on ties
        return best == d, best
    qd = 1.0 if q is None else float(np.float32(q[d]))
    if ua * qd < float(p[d]):
        return True, d
    if q is None:
        r = p.copy()
        r[d] = 0.0
    else:
        r = p - q.astype(np.float32)  # float32 subtraction, as in C++
    r = np.maximum(r, np.float32(0.0))
    return False, sample_from_twin(r if (r > 0).any() else p, ur)


def verify_native(p, q, d, greedy, ua, ur) -> tuple[bool, int]:
    acc, tok = ops.verify_position(p.astype(np.float32), None if q is None else q.astype(np.float32), int(d),
                                   greedy, ua, ur)
    return bool(acc), int(tok)


def accept_sequence(verify, p_rows, q_rows, drafts, greedy, uniforms):
    """The engine's loop over positions: accepted drafts + the replacement / bonus token.
    p_rows: [n+1, V]; q_rows: [n, V] or None; uniforms: [2n+1] (two per position, one bonus)."""
    out = []
    for i, d in enumerate(drafts):
        acc, tok = verify(p_rows[i], None if q_rows is None else q_rows[i], d, greedy, uniforms[2 * i], uniforms[2 * i + 1])
        out.append(tok)
        if not acc:
            return out, i
    last = p_rows[len(drafts)]
    bonus = int(np.argmax(last)) if greedy else sample_from_twin(last, uniforms[-1])
    return out + [bonus], len(drafts)


def draw(rng, dist: np.ndarray) -> int:
    w = dist.astype(np.float64)
    return int(rng.choice(len(w), p=w / w.sum()))


def random_dist(rng, v: int, zeros: float = 0.3) -> np.ndarray:
    """A distribution over v tokens with some exact zeros (as after top-k / top-p)."""
    x = rng.exponential(size=v) ** 2
    x[rng.random(v) < zeros] = 0.0
    if not x.any():
        x[rng.integers(v)] = 1.0
    return (x / x.sum()).astype(np.float32)


# ---------------------------------------------------------------- twin agreement

@pytest.mark.parametrize("one_hot", [False, True])
def test_matches_twin_on_random_inputs(rng, one_hot):
    # Fresh random p, q, drafts (drawn from q, or anywhere for one-hot) and uniforms:
    # native and twin must agree exactly on the verdict and the token (same float ops).
    v = int(rng.integers(2, 200))
    n_acc = n_rej = 0
    # one-hot drafts anywhere are accepted with probability p[d], 1/v on average: 400 draws at
    # v ~ 200 saw no acceptance in ~4 % of runs (CI, seed 1238148551521922942, v = 172); 4000
    # leave ~e^-20
    for _ in range(4000):
        p, q = random_dist(rng, v), random_dist(rng, v)
        d = int(rng.integers(v)) if one_hot else draw(rng, q)
        qq = None if one_hot else q
        ua, ur = float(rng.random()), float(rng.random())
        got = verify_native(p, qq, d, False, ua, ur)
        assert got == verify_twin(p, qq, d, False, ua, ur), (v, d, ua, ur)
        n_acc += got[0]
        n_rej += not got[0]
        assert got[0] or p[got[1]] > 0  # a replacement always has target mass
    assert n_acc > 0 and n_rej > 0  # both branches were exercised


def test_greedy_matches_twin_and_breaks_ties_low(rng):
    v = 50
    for _ in range(200):
        logits = rng.standard_normal(v).astype(np.float32)
        d = int(rng.integers(v))
        assert verify_native(logits, None, d, True, 0.0, 0.0) == verify_twin(logits, None, d, True, 0.0, 0.0)
    tied = np.zeros(v, np.float32)
    tied[[7, 3, 9]] = 2.0
    assert verify_native(tied, None, 3, True, 0.0, 0.0) == (True, 3)
    assert verify_native(tied, None, 7, True, 0.0, 0.0) == (False, 3)


def test_acceptance_threshold_is_p_over_q(rng):
    # accepted iff u < p(d) / q(d): just below the ratio accepts, just above rejects.
    v = 16
    for _ in range(100):
        p, q = random_dist(rng, v, zeros=0.0), random_dist(rng, v, zeros=0.0)
        d = int(rng.integers(v))
        ratio = float(p[d]) / float(q[d])
        if ratio >= 1.0:
            assert verify_native(p, q, d, False, ONE_MINUS, 0.5)[0]
            continue
        assert verify_native(p, q, d, False, ratio * (1 - 1e-9), 0.5)[0]
        assert not verify_native(p, q, d, False, ratio * (1 + 1e-9), 0.5)[0]


# ---------------------------------------------------------------- edge cases

def test_draft_gives_zero_to_the_targets_token():
    # q(3) = 0 but p(3) = 0.7: a rejection must be able to produce 3 (the residual keeps it).
    p = np.array([0.1, 0.2, 0.0, 0.7], np.float32)
    q = np.array([0.0, 1.0, 0.0, 0.0], np.float32)
    # d = 1: accept probability p/q = 0.2
    assert verify_native(p, q, 1, False, 0.19, 0.0) == (True, 1)
    for ur in (0.0, 0.1, 0.5, ONE_MINUS):
        acc, tok = verify_native(p, q, 1, False, 0.5, ur)
        assert not acc and tok in (0, 3)  # residual = [0.1, 0, 0, 0.7] / 0.8
        assert (acc, tok) == verify_twin(p, q, 1, False, 0.5, ur)
    assert verify_native(p, q, 1, False, 0.5, 0.124)[1] == 0  # 0.124 * 0.8 < 0.1
    assert verify_native(p, q, 1, False, 0.5, 0.126)[1] == 3


def test_draft_the_target_excludes_is_always_rejected():
    p = np.array([0.5, 0.5, 0.0], np.float32)
    q = np.array([0.0, 0.0, 1.0], np.float32)
    for ua in (0.0, 0.5, ONE_MINUS):
        acc, tok = verify_native(p, q, 2, False, ua, 0.75)
        assert not acc and tok == 1
        acc, tok = verify_native(p, None, 2, False, ua, 0.25)  # one-hot: residual = p
        assert not acc and tok == 0


def test_zero_q_for_a_proposal_with_target_mass_accepts():
    # q(d) = 0 cannot be drawn honestly; the limit p/q = inf accepts (never divides by zero).
    p = np.array([0.5, 0.5], np.float32)
    q = np.array([1.0, 0.0], np.float32)
    assert verify_native(p, q, 1, False, ONE_MINUS, 0.0) == (True, 1)


def test_p_equal_q_accepts_everything(rng):
    v = 40
    for _ in range(100):
        p = random_dist(rng, v)
        d = draw(rng, p)
        assert verify_native(p, p.copy(), d, False, ONE_MINUS, 0.5) == (True, d)


def test_residual_summing_to_zero_falls_back_to_p():
    # p <= q everywhere and p(d) < q(d): only rounding can do this; the rule then draws
    # from p (its rejection has probability ~0 and p is the right target).
    q = np.array([0.25, 0.25, 0.5], np.float32)
    p = np.array([0.25, 0.25, 0.4999], np.float32)
    acc, tok = verify_native(p, q, 2, False, ONE_MINUS, 0.3)
    assert not acc
    assert tok == sample_from_twin(p, 0.3) == 1
    assert (acc, tok) == verify_twin(p, q, 2, False, ONE_MINUS, 0.3)


def test_rejects_bad_draft_id():
    p = np.array([0.5, 0.5], np.float32)
    with pytest.raises(Exception, match="draft token 2 outside"):
        ops.verify_position(p, None, 2, False, 0.5, 0.5)


# ---------------------------------------------------------------- whole-step sequences

def test_sequences_all_accepted_all_rejected_and_mixed(rng):
    v, n = 24, 6
    p_rows = np.stack([random_dist(rng, v) for _ in range(n + 1)])
    # all accepted: q = p and drafts drawn from it
    drafts = [draw(rng, p_rows[i]) for i in range(n)]
    u = rng.random(2 * n + 1)
    out, m = accept_sequence(verify_native, p_rows, p_rows[:n], drafts, False, u)
    assert m == n and out[:n] == drafts and len(out) == n + 1
    assert out == accept_sequence(verify_twin, p_rows, p_rows[:n], drafts, False, u)[0]
    # all rejected: the first draft has no target mass
    bad = p_rows.copy()
    bad[0, drafts[0]] = 0.0
    out, m = accept_sequence(verify_native, bad, None, drafts, False, u)
    assert m == 0 and len(out) == 1 and bad[0, out[0]] > 0
    # mixed, one-hot and with q: native == twin on fresh draws
    for _ in range(50):
        q_rows = np.stack([random_dist(rng, v) for _ in range(n)])
        drafts = [draw(rng, q_rows[i]) for i in range(n)]
        u = rng.random(2 * n + 1)
        for qs in (q_rows, None):
            assert accept_sequence(verify_native, p_rows, qs, drafts, False, u) == accept_sequence(
                verify_twin, p_rows, qs, drafts, False, u)
        assert accept_sequence(verify_native, p_rows, None, drafts, True, u) == accept_sequence(
            verify_twin, p_rows, None, drafts, True, u)
