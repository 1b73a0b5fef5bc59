"""Lossless speculative decoding (engine/engine.cpp speculative_step, engine/accept.h,
engine/draft_model.cpp, engine/ngram.cpp, worker/generate.py's draft options).

- Batch invariance of the target forward: a position's logits are BIT-identical whether
  computed in one prefill, one position at a time or in chunks, with 1 or 2 threads
  (this is what makes greedy speculation token-for-token exact).
- Greedy exactness on the demo model, through Generator (so stop/max_tokens policy is
  covered): drafts = a Q4_0 copy, the first 25 of 30 layers, n-gram lookup; k in
  {1, 2, 4, 8, 16}; >= 64 new tokens; prompts that stop on EOS and on max_tokens mid-step.
- A draft identical to the target accepts every draft (tau = k + 1), greedy and sampling,
  also after truncation and a new prompt turn (the draft KV stays in step).
- KV rollback: after rejections, the next logits equal a fresh run's on the same tokens.
- Sampling exactness on a tiny model: the joint distribution of generated tokens 2 and 3
  (the first ones the speculative rule produces) over many seeds matches the exact
  distribution computed from the engine's own logits (chi-square, false-alarm rate 1e-4).
- Errors: mismatched vocabularies, k out of range, draft mode without a draft, unknown
  mode; k clamped at the end of the context.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from helpers.tiny_gguf import write_tiny_model
from worker.engine import Engine, EngineError, native, ops
from worker.errors import InvalidRequestError, ModelLoadError
from worker.model_file import open_model
from worker.protocol import SamplingParams

GREEDY = SamplingParams(temperature=0.0)
MAX_TOKENS = 67  # >= 64, and prime: steps of 2..17 tokens rarely end exactly on it
PROMPTS = {
    "chat": "Write a short story about a robot who learns to paint.",
    "code": "Write a Python function that returns the n-th Fibonacci number, with a docstring.",
    "repeat": "Count from 1 to 40, separated by commas.",
    "eos": "What is the capital of France? Answer in one short sentence.",
}
KS = (1, 2, 4, 8, 16)
FALSE_ALARM = 1e-4  # chi-square tests reject a correct sampler with this probability


# ---------------------------------------------------------------- fixtures

@pytest.fixture(scope="module")
def drafts(demo_model_path, tmp_path_factory):
    """Test drafts derived from the demo model once: a Q4_0 copy, the first 25 layers."""
    from worker.derive import derive_gguf

    d = tmp_path_factory.mktemp("drafts")
    return {
        "q4_0": derive_gguf(demo_model_path, d / "q4_0.gguf", weight_type="Q4_0", progress=False),
        "l25": derive_gguf(demo_model_path, d / "l25.gguf", n_layers=25, progress=False),
    }


@pytest.fixture(scope="module")
def generators(demo_model_path, drafts):
    import functools

    import worker.model_file
    from worker.generate import Generator

    # Each Generator opens its files; parse each GGUF once (read-only memmaps, shareable).
    mp = pytest.MonkeyPatch()
    mp.setattr(worker.model_file, "open_model", functools.lru_cache(maxsize=None)(worker.model_file.open_model))
    gens = {
        "plain": Generator(demo_model_path),
        "q4_0": Generator(demo_model_path, draft=drafts["q4_0"]),
        "l25": Generator(demo_model_path, draft=drafts["l25"]),
        "ngram": Generator(demo_model_path, draft="ngram"),
        "same": Generator(demo_model_path, draft=demo_model_path),
    }
    mp.undo()
    yield gens
    for g in gens.values():
        g.close()


@pytest.fixture(scope="module")
def plain_greedy(generators):
    """Plain greedy results per prompt (the reference every drafter must reproduce)."""
    g = generators["plain"]
    out = {name: g.complete(text, chat=True, max_tokens=MAX_TOKENS, params=GREEDY) for name, text in PROMPTS.items()}
    assert out["eos"].finish_reason == "stop" and out["eos"].n_generated < MAX_TOKENS
    assert all(out[n].finish_reason == "length" and out[n].n_generated == MAX_TOKENS for n in ("chat", "code", "repeat"))
    return out


# ---------------------------------------------------------------- batch invariance

def test_forward_is_batch_invariant(demo_model_path, generators):
    # 140 positions, so attention crosses its fixed 128-position chunk boundary. Logits from
    # one prefill, from 7-position chunks, and from a 100-position prefill followed by
    # one-position (decode-sized) forwards must be bit-identical, with 1 and 2 threads.
    model = generators["plain"].model_file
    tok = generators["plain"].tokenizer
    ids = np.array(tok.encode(" ".join(PROMPTS.values()) * 3, add_special=True, parse_special=False)[:140], np.int32)
    assert len(ids) == 140
    before = native.num_threads()
    results = {}
    try:
        for threads in (1, 2):
            for max_batch in (256, 7):
                with Engine(model, n_threads=threads, max_batch=max_batch, n_ctx=256) as eng:
                    results[threads, f"max_batch={max_batch}"] = eng.new_sequence().prefill(ids, all_logits=True)
            with Engine(model, n_threads=threads, n_ctx=256) as eng:
                seq = eng.new_sequence()
                rows = [seq.prefill(ids[:100], all_logits=True)]
                rows += [seq.prefill(ids[i : i + 1])[None] for i in range(100, len(ids))]
                results[threads, "100 + one by one"] = np.concatenate(rows)
    finally:
        native.set_num_threads(before)
    ref = results[1, "max_batch=256"]
    assert ref.shape == (140, model.config.n_vocab) and np.isfinite(ref).all()
    for key, val in results.items():
        assert np.array_equal(val, ref), f"{key}: logits differ from one 140-position prefill with 1 thread"


# ---------------------------------------------------------------- greedy exactness

# Prompts per k (to keep the file's time down, each k runs some of them; together every
# drafter sees every prompt; long k run on the repetitive prompt, where drafts get
# accepted, and on the EOS prompt, which is short). The 3 long prompts give 67 tokens.
PROMPTS_FOR = {
    "model": {1: ("chat",), 2: ("code",), 4: ("chat", "eos"), 8: ("repeat",), 16: ("repeat", "eos")},
    "ngram": {1: ("chat", "eos"), 2: ("code", "repeat"), 4: ("chat", "eos"), 8: ("code", "repeat"),
              16: ("repeat", "eos")},
}


@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("drafter", ["q4_0", "l25", "ngram"])
def test_greedy_identical_to_plain(generators, plain_greedy, drafter, k):
    g = generators[drafter]
    names = PROMPTS_FOR["ngram" if drafter == "ngram" else "model"][k]
    total_drafted = 0
    for name in names:
        r = g.complete(PROMPTS[name], chat=True, max_tokens=MAX_TOKENS, params=GREEDY, draft_k=k)
        ref = plain_greedy[name]
        assert r.tokens == ref.tokens, f"{drafter} k={k} '{name}': differs from plain greedy"
        assert (r.text, r.finish_reason, r.n_generated) == (ref.text, ref.finish_reason, ref.n_generated)
        assert 0 <= r.accepted <= r.drafted and r.acceptance_length >= 1.0
        total_drafted += r.drafted
    assert total_drafted > 0  # speculation really ran


def test_eos_mid_step_is_cut(generators, plain_greedy):
    # With the identical draft every step returns k + 1 tokens; on the EOS prompt the EOS
    # lands inside a step, and Generator must stop there, dropping the rest.
    g = generators["same"]
    ref = plain_greedy["eos"]
    eos_at = len(ref.tokens) - 1
    k = 8
    assert (eos_at - 1) % (k + 1) != k  # EOS is not the last token of its step (deterministic)
    r = g.complete(PROMPTS["eos"], chat=True, max_tokens=MAX_TOKENS, params=GREEDY, draft_k=k)
    assert r.tokens == ref.tokens and r.finish_reason == "stop"
    r = g.complete(PROMPTS["code"], chat=True, max_tokens=MAX_TOKENS, params=GREEDY, draft_k=k)
    assert r.tokens == plain_greedy["code"].tokens and r.n_generated == MAX_TOKENS  # length cut mid-step


# ---------------------------------------------------------------- identical draft: tau = k + 1

@pytest.mark.parametrize("k,params", [(4, {"temperature": 0.0}),
                                      (6, {"temperature": 0.8, "top_p": 0.95, "seed": 7, "frequency_penalty": 0.3})])
def test_identical_draft_accepts_everything(generators, k, params):
    # The draft's logits are bit-identical to the target's (same file, batch-invariant
    # forward), so greedy drafts match the argmax and sampled drafts have q == p: every
    # draft is accepted. After a truncation and a new prompt turn the draft KV resyncs.
    g = generators["same"]
    eng = g.engine
    ids = g.prompt_ids(PROMPTS["code"], chat=True)
    with eng.new_sequence() as seq:
        seq.set_sampling(params)
        seq.set_speculation("draft", k)
        seq.prefill(ids)
        out = seq.step()  # sampled from the prefill's logits: no forward, not speculative
        for _ in range(6):
            step = seq.step()
            assert len(step) == k + 1
            out += step
        seq.truncate(len(ids) + 10)  # back into the output: draft positions beyond are stale
        seq.prefill(g.tokenizer.encode(" Now in C:", add_special=False, parse_special=False))
        for _ in range(4):
            assert len(seq.step()) in (1, k + 1)  # the first step after a prefill samples only
        st = seq.stats()
    assert st["drafted"] == st["accepted"] == 9 * k
    assert st["spec_steps"] == 9 and st["acceptance_length"] == k + 1
    assert st["accepted_per_position"] == [9] * k and st["drafted_per_position"] == [9] * k


# ---------------------------------------------------------------- KV rollback

@pytest.mark.parametrize("mode", ["draft", "ngram"])
def test_rollback_next_logits_equal_fresh_run(generators, mode):
    # A poor draft (25 of 30 layers) gets rejected often; after the steps, forwarding one
    # more token must give exactly the logits of a fresh prefill of the same tokens.
    g = generators["l25" if mode == "draft" else "ngram"]
    ids = g.prompt_ids(PROMPTS["repeat"], chat=True)
    extra = 42
    with g.engine.new_sequence() as seq:
        seq.set_sampling({"temperature": 0.0})
        seq.set_speculation(mode, 4)
        seq.prefill(ids)
        out: list[int] = []
        while len(out) < 40:
            out += seq.step()
        st = seq.stats()
        assert st["accepted"] < st["drafted"], "no rejection happened: the test would prove nothing"
        assert st["n_past"] == len(ids) + len(out) - 1  # the last token is pending
        after = seq.prefill([extra])  # forwards the pending token and `extra`
    with g.engine.new_sequence() as fresh:
        ref = fresh.prefill(ids + out + [extra])
    assert np.array_equal(after, ref)


# ---------------------------------------------------------------- sampling exactness (tiny model)

def chi2_sf(x: float, dof: int) -> float:
    """P(X > x) for X ~ chi-square(dof): the regularized upper incomplete gamma Q(dof/2, x/2),
    by its series (x < a + 1) or its continued fraction (modified Lentz), to ~1e-14."""
    a, z = dof / 2.0, x / 2.0
    if z <= 0:
        return 1.0
    log_pre = -z + a * math.log(z) - math.lgamma(a)
    if z < a + 1:
        term = total = 1.0 / a
        n = 1
        while abs(term) > 1e-16 * abs(total):
            term *= z / (a + n)
            total += term
            n += 1
        return max(0.0, 1.0 - total * math.exp(log_pre))
    tiny = 1e-300
    b = z + 1.0 - a
    c, d = 1.0 / tiny, 1.0 / b
    h = d
    for i in range(1, 10000):
        an = -i * (i - a)
        b += 2.0
        d = an * d + b
        d = tiny if abs(d) < tiny else d
        c = b + an / c
        c = tiny if abs(c) < tiny else c
        d = 1.0 / d
        h *= d * c
        if abs(d * c - 1.0) < 1e-15:
            break
    return math.exp(log_pre) * h


def test_chi2_sf_known_values():
    # Tabulated quantiles (0.05 at 3.841459 with dof 1, 0.01 at 23.209251 with dof 10) and
    # values from scipy.stats.chi2.sf (series and continued-fraction branches).
    assert abs(chi2_sf(3.841459, 1) - 0.05) < 1e-6
    assert abs(chi2_sf(23.209251, 10) - 0.01) < 1e-6
    assert abs(chi2_sf(2.0, 10) - 0.9963401531726563) < 1e-12
    assert abs(chi2_sf(149.449, 115) / 0.016979692118252947 - 1) < 1e-9
    assert abs(chi2_sf(400.0, 300) / 9.678621994933555e-05 - 1) < 1e-9


def chi_square_p(counts: np.ndarray, expected_prob: np.ndarray) -> float:
    """p-value of observed counts against exact cell probabilities; cells expecting < 5
    are pooled into one. A count in a probability-0 cell is an outright failure (p = 0)."""
    counts = counts.ravel().astype(np.float64)
    prob = expected_prob.ravel()
    if counts[prob == 0].sum() > 0:
        return 0.0
    n = counts.sum()
    exp = n * prob
    big = exp >= 5
    obs_cells = np.append(counts[big], counts[~big].sum())
    exp_cells = np.append(exp[big], exp[~big].sum())
    keep = exp_cells > 0
    obs_cells, exp_cells = obs_cells[keep], exp_cells[keep]
    stat = float(((obs_cells - exp_cells) ** 2 / exp_cells).sum())
    return chi2_sf(stat, len(obs_cells) - 1)


def exact_joint_23(eng: Engine, prompt: list[int], params: dict) -> np.ndarray:
    """P(token2 = a, token3 = b) of plain sampling, [V, V] float64, from the engine's logits:
    sum over token1 of P(t1) P(t2 | t1) P(t3 | t1, t2), each after penalties (history =
    prompt + the tokens generated so far) and the sampling transforms."""
    v = eng.n_vocab
    p = {k: val for k, val in params.items() if k != "seed"}
    pr = np.array(prompt, np.int32)

    def dist(logits, generated):
        work = ops.apply_penalties(logits, p, pr, np.array(generated, np.int32))
        return ops.sampling_probs(work, p).astype(np.float64)

    joint = np.zeros((v, v))
    with eng.new_sequence() as seq:
        p1 = dist(seq.prefill(prompt), [])
        for t1 in np.nonzero(p1)[0]:
            seq.truncate(len(prompt))
            p2 = dist(seq.prefill([int(t1)]), [t1])
            for t2 in np.nonzero(p2)[0]:
                seq.truncate(len(prompt) + 1)
                joint[t2] += p1[t1] * p2[t2] * dist(seq.prefill([int(t2)]), [t1, t2])
    return joint


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    """A tiny target (F32) and a draft that differs from it (the same weights in Q4_0:
    ~55 % of draws accepted at T = 1, so both accept and residual paths run)."""
    d = tmp_path_factory.mktemp("tiny")
    kw = dict(n_layers=2, dim=64, n_heads=4, n_kv_heads=2, vocab=259, seed=11, ctx=512)
    target = open_model(write_tiny_model(d / "target.gguf", "llama", "F32", **kw))
    draft = open_model(write_tiny_model(d / "draft.gguf", "llama", "Q4_0", **kw))
    return target, draft


SAMPLING_CASES = [
    # mode, k, params: a small top_k keeps the support (and the exact sum) small
    ("draft", 2, {"temperature": 1.0, "top_k": 6, "repetition_penalty": 1.2}),
    ("ngram", 3, {"temperature": 0.9, "top_k": 8, "top_p": 0.9, "presence_penalty": 0.4,
                  "frequency_penalty": 0.3}),
]


@pytest.mark.parametrize("mode,k,params", SAMPLING_CASES)
def test_sampling_distribution_matches_plain(tiny_pair, mode, k, params):
    target, draft = tiny_pair
    n_samples = 20000
    with Engine(target, draft_model=draft, n_ctx=256) as eng:
        # The prompt is the target's own greedy text, so n-gram lookup finds matches whose
        # continuations the target often agrees with (both verdicts then happen).
        with eng.new_sequence() as seq:
            prompt = [5, 9, 3, 17]
            seq.set_sampling({"temperature": 0.0})
            seq.prefill(prompt)
            while len(prompt) < 120:
                prompt += seq.step()
        prompt = prompt[:120]
        joint = exact_joint_23(eng, prompt, params)
        assert abs(joint.sum() - 1.0) < 1e-5
        counts = np.zeros_like(joint)
        with eng.new_sequence() as seq:
            seq.set_speculation(mode, k)
            seq.prefill(prompt[:-1])
            for seed in range(n_samples):
                # Keep the prompt's KV; re-forward its last token to get fresh logits.
                seq.truncate(len(prompt) - 1)
                seq.set_sampling({**params, "seed": seed})
                seq.prefill(prompt[-1:])
                out = seq.step()
                while len(out) < 3:
                    out += seq.step()
                counts[out[1], out[2]] += 1
            st = seq.stats()
    # Both verdicts happened many times (the test exercises the rule, not a shortcut).
    assert st["spec_steps"] >= n_samples and 0.05 * st["drafted"] < st["accepted"] < 0.95 * st["drafted"]
    p = chi_square_p(counts, joint)
    print(f"{mode} k={k}: tau={st['acceptance_length']:.2f} accepted {st['accepted']}/{st['drafted']}, p={p:.3g}")
    assert p > FALSE_ALARM, f"speculative sampling does not follow the target's distribution (p={p:.3g})"
    if mode == "draft":
        # Power check: the same test rejects the draft model's own distribution.
        with Engine(draft, n_ctx=256) as deng:
            wrong = exact_joint_23(deng, prompt, params)
        assert chi_square_p(counts, wrong) < FALSE_ALARM


# ---------------------------------------------------------------- context end and errors

@pytest.mark.parametrize("mode", ["draft", "ngram"])
def test_k_is_clamped_at_the_end_of_the_context(tiny_pair, mode):
    # n_ctx 40, k 16: the last steps must shrink k (n_past + k + 1 <= n_ctx) and still give
    # plain greedy's tokens, until the context is full (then the same error as plain).
    target, draft = tiny_pair
    prompt = [5, 9, 3, 17, 5, 9, 3, 17, 8, 8]

    def run(spec: bool) -> tuple[list[int], str]:
        with Engine(target, draft_model=draft, n_ctx=40) as eng, eng.new_sequence() as seq:
            seq.set_sampling({"temperature": 0.0})
            if spec:
                seq.set_speculation(mode, 16)
            seq.prefill(prompt)
            out: list[int] = []
            with pytest.raises(EngineError, match="context length exceeded") as err:
                while True:
                    out += seq.step()
                    assert seq.n_past <= 40
            assert (seq.stats()["drafted"] > 0) == spec
            return out, str(err.value)

    plain, plain_err = run(False)
    spec, spec_err = run(True)
    assert len(plain) == 40 - len(prompt) + 1  # n_ctx positions + the pending token
    assert spec == plain and spec_err == plain_err


def test_mismatched_vocabularies(tiny_pair, tmp_path):
    target, _ = tiny_pair
    other = open_model(write_tiny_model(tmp_path / "v300.gguf", "llama", "F32", vocab=300, seed=1))
    with pytest.raises(ModelLoadError, match="draft model vocabulary differs from the target's: 300 tokens"):
        Engine(target, draft_model=other)
    tokens = list(target.metadata["tokenizer.ggml.tokens"])
    tokens[100] = "changed"
    renamed = dataclasses.replace(target, metadata={**target.metadata, "tokenizer.ggml.tokens": tokens})
    with pytest.raises(ModelLoadError, match="token 100 is 'changed'"):
        Engine(target, draft_model=renamed)
    # The C++ check on n_vocab alone (the Python check runs first in the API).
    with pytest.raises(EngineError, match="draft model vocabulary differs from the target's: 300 tokens vs 259"):
        native.Engine(target.config.to_native(), target.tensors, {},
                      draft_config=other.config.to_native(), draft_tensors=other.tensors)


def test_speculation_setting_errors(tiny_pair):
    target, draft = tiny_pair
    with Engine(target, n_ctx=64) as eng, eng.new_sequence() as seq:
        for k in (0, 33, -1):
            with pytest.raises(InvalidRequestError, match=r"k must be in 1\.\.32"):
                seq.set_speculation("ngram", k)
        with pytest.raises(EngineError, match=r"k must be in 1\.\.32"):  # the C++ check
            eng._native.set_speculation(seq.id, {"mode": "ngram", "k": 40})
        with pytest.raises(InvalidRequestError, match="mode 'draft' needs a draft model"):
            seq.set_speculation("draft", 4)
        with pytest.raises(InvalidRequestError, match="unknown speculation mode 'medusa'; available: none, draft, ngram"):
            seq.set_speculation("medusa", 4)
        with pytest.raises(InvalidRequestError, match="ngram_min <= ngram_max"):
            seq.set_speculation("ngram", 4, ngram_min=3, ngram_max=2)
        seq.set_speculation("ngram", 4)
        seq.set_speculation("none")  # off again: plain steps
        seq.prefill([5, 9, 5, 9])
        assert len(seq.step()) == 1 and len(seq.step()) == 1
        assert seq.stats()["spec_steps"] == 0


def test_generator_draft_options(demo_model_path, generators):
    from worker.generate import Generator

    with pytest.raises(InvalidRequestError, match=r"draft_k must be an integer in 1\.\.32"):
        Generator(demo_model_path, draft="ngram", draft_k=0)
    g = generators["ngram"]
    with pytest.raises(InvalidRequestError, match=r"draft_k must be an integer in 1\.\.32"):
        g.generate("hi", draft_k=40)
    r = g.complete(PROMPTS["repeat"], chat=True, max_tokens=8, params=GREEDY, draft_k=0)  # 0 = off for this call
    assert r.drafted == 0 and r.acceptance_length == 0.0
