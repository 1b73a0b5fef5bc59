"""Lossless greedy speculation with a DFlash block drafter on the real demo model
(SmolLM2-135M, llama, 30 layers, dim 576, vocab 49152).

A random DFlash checkpoint sized for the demo target (hidden 576, taps target layers
1, 15, 28; block_size 17, so up to 16 drafts a step) is written with the helpers of
tests/native/test_dflash.py, converted once with worker/dflash_convert.py and served through
worker.generate.Generator(draft=...). Whatever a random drafter proposes, greedy output must
be token-for-token the plain Generator's, for every k, including when EOS lands inside a
verified block (the tokens after it are dropped)."""

from __future__ import annotations

import numpy as np
import pytest

from tests.native.test_dflash import make_config, make_weights, write_checkpoint
from worker import dflash_convert as dc
from worker.protocol import SamplingParams

KS = (1, 2, 4, 8, 16)       # 16 = block_size - 1, the most a block drafts
N_NEW = 64
GREEDY = SamplingParams(temperature=0)
PROMPTS = (
    "The history of the printing press begins",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
)


@pytest.fixture(scope="module")
def dflash_path(tmp_path_factory):
    seed = int(np.random.default_rng().integers(1 << 31))
    print("dflash weights seed", seed)
    cfg = make_config(hidden_size=576, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=32, intermediate_size=256, vocab_size=49152,
                      dflash_config={"block_size": 17, "mask_token_id": 0, "target_layer_ids": [1, 15, 28]})
    d = tmp_path_factory.mktemp("dflash_demo")
    ckpt = write_checkpoint(d / "ckpt", cfg, make_weights(cfg, np.random.default_rng(seed)))
    return dc.convert(ckpt, d / "dflash-demo.gguf", progress=False)


@pytest.fixture(scope="module")
def plain(demo_model_path):
    from worker.generate import Generator

    with Generator(demo_model_path, n_ctx=512) as g:
        yield g


@pytest.fixture(scope="module")
def spec(demo_model_path, dflash_path):
    from worker.generate import Generator

    with Generator(demo_model_path, n_ctx=512, draft=dflash_path) as g:
        assert g.draft_mode == "dflash"
        yield g


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_dflash_equals_plain_greedy(plain, spec, prompt):
    ref = plain.complete(prompt, max_tokens=N_NEW, params=GREEDY)
    assert ref.drafted == 0 and ref.n_generated == N_NEW  # a long run: no early EOS
    for k in KS:
        r = spec.complete(prompt, max_tokens=N_NEW, params=GREEDY, draft_k=k)
        assert r.tokens == ref.tokens, (k, prompt)
        assert r.finish_reason == ref.finish_reason
        assert r.drafted > 0, k  # the drafter really ran


@pytest.mark.parametrize("k", (4, 16))
def test_greedy_dflash_stops_at_eos(plain, spec, k):
    """A short chat answer: EOS comes mid-run (with k=16 most likely inside a verified
    block); output stops there exactly as plain greedy does."""
    q = "What is the capital of France?"
    ref = plain.complete(q, chat=True, max_tokens=N_NEW, params=GREEDY)
    assert ref.finish_reason == "stop" and ref.n_generated < N_NEW
    assert ref.tokens[-1] in plain._stop_ids
    r = spec.complete(q, chat=True, max_tokens=N_NEW, params=GREEDY, draft_k=k)
    assert r.tokens == ref.tokens and r.text == ref.text and r.finish_reason == "stop"
    assert r.drafted > 0
