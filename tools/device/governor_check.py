"""Adaptive speculation on a GPU (tools/device: run on the GPU machine): greedy output and
tokens/s of plain decoding, n-gram speculation on every step, and the SpeculationGovernor
(worker/generate.py), on one model, from a repeating prompt of token ids.

    python3 tools/device/governor_check.py MODEL.gguf      (DEV=cpu for a dry run here)

Each Generator call is run twice, the second timed (wall clock of complete(), N tokens).
"identical" compares the tokens with plain greedy decoding's; the last line switches modes
every two steps (a governor forced to), which must leave them identical too.
"""
import os
import sys
import time

import worker.generate as G
from worker.generate import Generator
from worker.protocol import SamplingParams

path = sys.argv[1]
greedy = SamplingParams(temperature=0.0)
prompt = [100 + (i % 24) for i in range(64)]  # a repeating prompt: something for prompt lookup
N = 256
DEV = os.environ.get("DEV", "cuda:0")


def timed(g):
    t0 = time.perf_counter()
    r = g.complete(prompt, max_tokens=N, params=greedy)
    return r, N / (time.perf_counter() - t0)


with Generator(path, device=DEV, n_ctx=1024) as pg:
    timed(pg)
    ref, plain = timed(pg)
    print(f"plain: {plain:.1f} tok/s (engine {ref.decode_tok_s:.1f})", flush=True)
with Generator(path, device=DEV, n_ctx=1024, draft="ngram", draft_k=4) as g:
    for adaptive in (True, False, True, False):
        g.adaptive = adaptive
        timed(g)
        r, rate = timed(g)
        print(f"ngram k=4 adaptive={adaptive}: {rate:.1f} tok/s (engine {r.decode_tok_s:.1f}), identical={r.tokens == ref.tokens}, "
              f"drafted {r.drafted} accepted {r.accepted} tau {r.acceptance_length:.2f}", flush=True)
    orig = G.SpeculationGovernor
    G.SpeculationGovernor = lambda: orig(warm=2, probe=2, period=2, max_period=2)  # a switch every two steps
    g.adaptive = True
    r, rate = timed(g)
    print(f"switching every 2 steps: {rate:.1f} tok/s, identical={r.tokens == ref.tokens}, drafted {r.drafted}", flush=True)
