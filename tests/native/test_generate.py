"""worker.generate: stopping policy, multi-token steps, and generation on the demo model.

Three layers:
- StopMatcher alone (pure Python): exact cuts and hold-back on hand-made streams;
- the Generator loop over a scripted fake engine with the real demo tokenizer, so the
  speculative case (step() returning several tokens) is covered before the engine does it;
- the real engine on the demo model (loaded once per module): greedy facts, stop strings,
  max_tokens, seeds, the context check.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from worker.errors import InvalidRequestError
from worker.generate import Delta, Generator, StopMatcher
from worker.protocol import SamplingParams

GREEDY = SamplingParams(temperature=0.0)


# ---------------------------------------------------------------- StopMatcher

def feed(stops, pieces):
    m = StopMatcher(stops)
    out = []
    for p in pieces:
        text, hit = m.push(p)
        out.append(text)
        if hit:
            return out, True
    out.append(m.flush())
    return out, False


def test_stop_matcher_cuts_exactly_and_holds_back_prefixes():
    out, hit = feed(["END"], ["hello E", "N", "D and more"])
    assert hit and "".join(out) == "hello "
    # 'E' and 'EN' could start END: held back until settled, never emitted early.
    assert out == ["hello ", "", ""]
    out, hit = feed(["END"], ["hello E", "N", "d"])
    assert not hit and out == ["hello ", "", "ENd", ""]


def test_stop_matcher_spanning_many_pieces_and_earliest_of_several():
    out, hit = feed(["<|stop|>"], list("abc<|sto") + ["p|>xyz"])
    assert hit and "".join(out) == "abc"
    # Two stops complete in the same push: the earliest-starting one cuts.
    out, hit = feed(["lo wor", "wo"], ["hel", "lo world"])
    assert hit and "".join(out) == "hel"
    # A stop inside one piece, with text on both sides.
    out, hit = feed([", "], ["one, two"])
    assert hit and out == ["one"]


def test_stop_matcher_hold_back_is_bounded_and_no_stops_is_passthrough():
    m = StopMatcher(["abcdef"])
    text, hit = m.push("xxabcde")
    assert (text, hit) == ("xx", False)  # held 'abcde' = len(stop) - 1 chars
    text, hit = m.push("Z")
    assert (text, hit) == ("abcdeZ", False)
    m = StopMatcher([])
    assert m.push("anything") == ("anything", False) and m.flush() == ""
    with pytest.raises(InvalidRequestError, match="non-empty"):
        StopMatcher(["ok", ""])


# ---------------------------------------------------------------- the loop, scripted engine

@pytest.fixture(scope="module")
def gen(demo_model_path: Path):
    g = Generator(str(demo_model_path))
    yield g
    g.close()


@dataclasses.dataclass
class FakeSequence:
    script: list[list[int]]           # what each step() returns
    prompt: list[int] = dataclasses.field(default_factory=list)
    n_past: int = 0
    pending: int = 0
    truncated: list[int] = dataclasses.field(default_factory=list)
    closed: bool = False
    n_generated: int = 0

    def set_sampling(self, params):
        self.params = params

    def prefill(self, ids, all_logits=False):
        self.prompt = list(ids)
        self.n_past = len(ids)

    def step(self):
        # As the engine: the previous step's last token is forwarded now, the new last
        # token stays pending (outside the KV).
        self.n_past += self.pending
        toks = self.script.pop(0)
        self.n_past += len(toks) - 1
        self.pending = 1
        self.n_generated += len(toks)
        return list(toks)

    def truncate(self, n):
        assert n <= self.n_past
        self.truncated.append(n)
        self.n_past, self.pending = n, 0

    def stats(self):
        return dict(n_past=self.n_past, n_prompt=len(self.prompt), n_generated=self.n_generated,
                    n_steps=0, prefill_seconds=0.25, decode_seconds=2.0)

    def close(self):
        self.closed = True


class FakeEngine:
    n_ctx = 64

    def __init__(self, tokenizer, script):
        self.n_vocab = tokenizer.vocab_size
        self.seq = FakeSequence([list(s) for s in script])

    def new_sequence(self):
        return self.seq


@pytest.fixture(scope="module")
def tokenizer(gen):
    return gen.tokenizer  # the demo model's (parsing the file again costs seconds)


def scripted(tokenizer, script) -> Generator:
    g = object.__new__(Generator)  # skip loading: only the policy loop is under test
    g.engine = FakeEngine(tokenizer, script)
    g.tokenizer = tokenizer
    g._stop_ids = frozenset(int(t) for t in tokenizer.stop_ids)
    g._template = None
    return g


def in_steps(ids, k):
    return [ids[i:i + k] for i in range(0, len(ids), k)]


def test_multi_token_steps_stop_string_cuts_and_truncates(tokenizer):
    out_ids = list(tokenizer.encode(" the quick brown fox jumps over the lazy dog", add_special=False))
    prompt = list(tokenizer.encode("Say:", add_special=False))
    full = tokenizer.decode(out_ids)
    stop = "fox jum"  # ends inside the ' jumps' token (or spans tokens): either way a cut
    # Tokens kept: exactly those up to the one whose text completed the stop string.
    n_needed = next(i for i in range(1, len(out_ids) + 1) if stop in tokenizer.decode(out_ids[:i]))
    k = 3 if n_needed % 3 else 4  # steps of k tokens, the stop completing mid-step
    g = scripted(tokenizer, in_steps(out_ids, k))
    r = g.complete(prompt, max_tokens=40, params=GREEDY, stop=[stop])
    assert r.finish_reason == "stop"
    assert r.text == full[: full.index(stop)]
    assert r.tokens == out_ids[:n_needed] and r.n_generated == n_needed
    seq = g.engine.seq
    # The step's tokens after the stop leave the KV: it keeps prompt + accepted output.
    assert seq.truncated == [len(prompt) + n_needed]
    assert seq.closed
    # Timings use the definitions in worker/generate.py's header.
    assert r.prefill_tok_s == pytest.approx(len(prompt) / 0.25)
    assert r.decode_tok_s == pytest.approx((n_needed - 1) / 2.0)


def test_multi_token_steps_stop_token_and_length(tokenizer):
    words = list(tokenizer.encode(" one two three four five six", add_special=False))
    eos = sorted(tokenizer.stop_ids)[0]
    g = scripted(tokenizer, [words[:2], [words[2], eos, words[3]], words[4:]])
    deltas = list(g.generate([1, 2, 3], max_tokens=40, params=GREEDY))
    assert [d.finish_reason for d in deltas] == [None, "stop"]
    assert deltas[-1].token_ids == [words[2], eos]  # the stop token counts, what follows does not
    assert "".join(d.text for d in deltas) == tokenizer.decode(words[:3])
    assert g.engine.seq.truncated  # the step's token after EOS left the KV

    g = scripted(tokenizer, in_steps(words, 4))
    r = g.complete([1, 2, 3], max_tokens=5, params=GREEDY)
    assert r.finish_reason == "length" and r.tokens == words[:5]
    assert r.text == tokenizer.decode(words[:5])


def test_held_back_text_is_released_at_the_end(tokenizer):
    words = list(tokenizer.encode(" and so it ends with The E", add_special=False))
    g = scripted(tokenizer, [[w] for w in words])
    deltas = list(g.generate([5], max_tokens=len(words), params=GREEDY, stop=["The End"]))
    assert deltas[-1].finish_reason == "length"
    assert "".join(d.text for d in deltas) == tokenizer.decode(words)
    # 'The E' could have been the start of 'The End': held back until the last delta.
    assert deltas[-1].text.endswith("The E")


# ---------------------------------------------------------------- the demo model

def test_greedy_is_deterministic_and_knows_paris(gen):
    a = gen.complete("The capital of France is", max_tokens=8, params=GREEDY)
    b = gen.complete("The capital of France is", max_tokens=8, params=GREEDY)
    assert a.tokens == b.tokens and a.text == b.text
    assert a.text.startswith(" Paris"), a.text
    assert a.prompt_tokens == list(gen.tokenizer.encode("The capital of France is", add_special=True))
    assert a.n_prompt == len(a.prompt_tokens) and a.n_generated == len(a.tokens)
    assert a.prefill_tok_s > 0 and a.decode_tok_s > 0


def test_chat_answers_paris_and_stops_on_end_of_turn(gen):
    r = gen.complete("What is the capital of France?", chat=True, max_tokens=48, params=GREEDY)
    assert "Paris" in r.text, r.text
    assert r.finish_reason == "stop"
    assert r.tokens[-1] in gen.tokenizer.stop_ids  # ended by the model, not by max_tokens
    assert "<|im_end|>" not in r.text and "<|im_start|>" not in r.text


def test_stop_strings_cut_exactly(gen):
    prompt = "Once upon a time, in a small village,"
    free = gen.complete(prompt, max_tokens=16, params=GREEDY)
    assert len(free.tokens) >= 10, free.text
    pieces = [gen.tokenizer.decode(free.tokens[:i]) for i in range(len(free.tokens) + 1)]
    # A stop that spans a token boundary: the last 2 chars of token 5's text + the first 2
    # of token 6's (both tokens' texts are at least 2 chars in ordinary English).
    b = len(pieces[5])
    words = free.text.split()
    cases = [free.text[b - 2 : b + 2], words[len(words) // 2]]  # + a whole word mid-output
    for stop in cases:
        assert stop and stop in free.text
        cut = free.text.index(stop)
        n = next(i for i, p in enumerate(pieces) if stop in p)  # tokens up to the completing one
        streamed, tokens, last = "", [], None
        for d in gen.generate(prompt, max_tokens=16, params=GREEDY, stop=[stop]):
            streamed += d.text
            tokens += d.token_ids
            last = d
            assert free.text[:cut].startswith(streamed), (stop, streamed)  # never past the cut
        assert last.finish_reason == "stop", stop
        assert streamed == free.text[:cut], (stop, streamed)
        assert tokens == free.tokens[:n] and last.stats.n_generated == n


def test_max_tokens_gives_length_with_exactly_n_tokens(gen):
    prompt = "Here is a long list of fruits: apple, banana,"
    free = gen.complete(prompt, max_tokens=12, params=GREEDY)
    assert free.finish_reason == "length" and len(free.tokens) == 12
    r = gen.complete(prompt, max_tokens=5, params=GREEDY)
    assert r.finish_reason == "length"
    assert len(r.tokens) == 5 and r.tokens == free.tokens[:5]
    assert r.text == gen.tokenizer.decode(free.tokens[:5])


def test_seed_reproducibility_at_temperature_1(gen):
    prompt = "My favourite animal is"

    def run(seed=None):
        return gen.complete(prompt, max_tokens=8, params=SamplingParams(temperature=1.0, seed=seed))

    one, two = run(1), run(2)
    assert run(1).tokens == one.tokens and one.seed == 1
    # No seed: a random one is drawn and reported; reusing it reproduces the run.
    drawn = run()
    assert run(drawn.seed).tokens == drawn.tokens
    assert len({tuple(one.tokens), tuple(two.tokens), tuple(drawn.tokens)}) > 1, "seeds change nothing"


def test_context_overflow_and_bad_requests(gen):
    n_ctx = gen.n_ctx
    with pytest.raises(InvalidRequestError) as ei:
        gen.generate([1] * (n_ctx - 10), max_tokens=11)
    assert str(ei.value).startswith(
        f"context length exceeded: prompt has {n_ctx - 10} tokens + max_tokens 11 > context {n_ctx}")
    gen.generate([1] * (n_ctx - 10), max_tokens=10).close()  # exactly fits: accepted
    with pytest.raises(InvalidRequestError, match="max_tokens must be an integer >= 1"):
        gen.generate("hi", max_tokens=0)
    with pytest.raises(InvalidRequestError, match="temperature must be between 0 and 2"):
        gen.generate("hi", params=SamplingParams(temperature=5))
    with pytest.raises(InvalidRequestError, match=r"token ids must be in \[0, 49152\)"):
        gen.generate([1, 49152])


def test_closing_the_stream_early_frees_the_sequence(gen):
    it = gen.generate("Count: one, two, three,", max_tokens=30, params=GREEDY)
    first = next(it)
    assert isinstance(first, Delta) and first.finish_reason is None
    it.close()
    # The engine keeps working for the next request.
    assert gen.complete("The capital of France is", max_tokens=3, params=GREEDY).text.startswith(" Paris")


# ---- which reader a Generator's engine gets on a GPU (tensor_cores_pay)


def test_tensor_cores_only_for_long_verifies_of_f16_layers(tmp_path):
    from tests.helpers.tiny_gguf import write_tiny_model
    from worker.generate import TENSOR_CORE_MIN_POSITIONS, tensor_cores_pay
    from worker.model_file import open_model

    f16 = open_model(write_tiny_model(tmp_path / "f16.gguf", "llama", "F16", embd_type="Q8_0"))
    k_min = TENSOR_CORE_MIN_POSITIONS - 1
    assert tensor_cores_pay(f16, "ngram", k_min) and tensor_cores_pay(f16, "draft", 32)
    assert not tensor_cores_pay(f16, "ngram", k_min - 1)  # the default k = 4: CUDA cores
    assert not tensor_cores_pay(f16, "ngram", 4)
    assert not tensor_cores_pay(f16, "none", 32)  # no speculation, no verifies
    for other in ("BF16", "Q8_0", "Q4_0", "F32"):
        m = open_model(write_tiny_model(tmp_path / f"{other}.gguf", "llama", other))
        assert not tensor_cores_pay(m, "ngram", 16), other


@pytest.mark.parametrize("draft_k, expected", [(4, False), (8, True)])
def test_generator_gives_the_engine_the_reader_that_pays(tmp_path, monkeypatch, draft_k, expected):
    import worker.engine
    from tests.helpers.tiny_gguf import write_tiny_model

    seen = {}
    real = worker.engine.Engine

    class Recording(real):
        def __init__(self, *args, **kw):
            seen.update(kw)
            super().__init__(*args, **kw)

    monkeypatch.setattr(worker.engine, "Engine", Recording)
    path = write_tiny_model(tmp_path / "f16.gguf", "llama", "F16")
    with Generator(path, draft="ngram", draft_k=draft_k, n_ctx=64) as g:
        assert seen["tensor_cores"] is expected
        out = g.complete([5, 6, 7, 5, 6], max_tokens=4)  # (the CPU engine: either way the same tokens)
        assert len(out.tokens) == 4


# ---- adaptive speculation (SpeculationGovernor in the generation loop)


def test_adaptive_speculation_switches_modes_and_keeps_plain_greedy_output(gen, demo_model_path, monkeypatch):
    import worker.engine
    import worker.generate
    from worker.generate import SpeculationGovernor

    # a governor that changes mode every two steps, whatever the timings
    monkeypatch.setattr(worker.generate, "SpeculationGovernor",
                        lambda: SpeculationGovernor(warm=2, probe=2, period=2, max_period=2))
    calls = []
    real = worker.engine.Sequence.set_speculation

    def recording(self, mode="ngram", k=4, **kw):
        calls.append((mode, k))
        return real(self, mode, k, **kw)

    monkeypatch.setattr(worker.engine.Sequence, "set_speculation", recording)
    prompt = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef add(a, b):\n"
    plain = gen.complete(prompt, max_tokens=64, params=GREEDY)
    with Generator(str(demo_model_path), draft="ngram", draft_k=4) as spec:
        got = spec.complete(prompt, max_tokens=64, params=GREEDY)
        n_fixed = len(calls)
        spec.adaptive = False  # speculate on every step
        every_step = spec.complete(prompt, max_tokens=64, params=GREEDY)
    assert got.tokens == plain.tokens and got.text == plain.text
    assert every_step.tokens == plain.tokens
    assert calls[0] == ("ngram", 4) and ("none", 4) in calls[:n_fixed]  # it stepped plainly too
    assert sum(c == ("ngram", 4) for c in calls[:n_fixed]) >= 2       # and came back
    assert calls[n_fixed:] == [("ngram", 4)]                           # adaptive off: set once
    assert got.drafted > 0 and every_step.drafted > got.drafted


def test_sequence_says_whether_its_speculation_can_be_paused(gen):
    seq = gen.engine.new_sequence()
    try:
        assert not seq.speculation_pausable()
        seq.set_speculation("ngram", 4)
        assert seq.speculation_pausable()  # the governor may turn it off and on
        seq.set_speculation("none", 4)
        assert not seq.speculation_pausable()
    finally:
        seq.close()


def test_seeded_sampling_speculates_on_every_step_and_repeats_itself(demo_model_path, monkeypatch):
    import worker.generate
    from worker.generate import SpeculationGovernor

    made = []

    def governor():
        made.append(1)
        return SpeculationGovernor(warm=2, probe=2, period=2, max_period=2)

    monkeypatch.setattr(worker.generate, "SpeculationGovernor", governor)
    prompt = "def add(a, b):\n    return a + b\n\n\ndef add(a, b):\n"
    seeded = SamplingParams(temperature=1.0, seed=11)
    with Generator(str(demo_model_path), draft="ngram", draft_k=4) as g:
        a = g.complete(prompt, max_tokens=32, params=seeded)
        b = g.complete(prompt, max_tokens=32, params=seeded)
        assert made == []  # a seed of its own: no governor
        g.adaptive = False
        c = g.complete(prompt, max_tokens=32, params=seeded)
        g.adaptive = True
        g.complete(prompt, max_tokens=8, params=SamplingParams(temperature=1.0))  # no seed: governed
        assert made == [1]
    assert a.tokens == b.tokens == c.tokens and a.seed == 11


def test_draft_model_speculation_paused_and_resumed_keeps_plain_greedy_output(tmp_path, monkeypatch):
    import worker.generate
    from tests.helpers.tiny_gguf import write_tiny_model
    from worker.generate import SpeculationGovernor

    target = write_tiny_model(tmp_path / "target.gguf", "llama", "F32", seed=3)
    draft = write_tiny_model(tmp_path / "draft.gguf", "llama", "Q8_0", seed=3)  # the target, re-quantized
    prompt = [7, 8, 9, 10, 7, 8, 9, 10, 7, 8]
    with Generator(target, n_ctx=128) as plain_gen:
        plain = plain_gen.complete(prompt, max_tokens=48, params=GREEDY)
    # speculation off and on every two steps: the kept draft model catches up each time
    monkeypatch.setattr(worker.generate, "SpeculationGovernor",
                        lambda: SpeculationGovernor(warm=2, probe=2, period=2, max_period=2))
    with Generator(target, n_ctx=128, draft=draft, draft_k=3) as g:
        switched = g.complete(prompt, max_tokens=48, params=GREEDY)
        again = g.complete(prompt, max_tokens=48, params=GREEDY)  # a new sequence, same engine
        g.adaptive = False
        always = g.complete(prompt, max_tokens=48, params=GREEDY)
    assert switched.tokens == plain.tokens == again.tokens == always.tokens
    assert switched.accepted > 0 and always.drafted > switched.drafted > 0
