"""Perplexity of a model on a text, as llama.cpp's llama-perplexity measures it.

The text is tokenized whole (a BOS only when the model's metadata asks for one, through
encode(add_special=True)). Token i (i >= 1) is scored by the negative log-likelihood the
model gives it after tokens 0..i-1:  nll_i = logsumexp(z) - z[t_i],  z = logits at i-1,
computed in float64 from the engine's float32 logits; ppl = exp(mean nll).

Windows. When all N tokens fit the context (N <= n_ctx) they are one sequence and every
token 1..N-1 is scored with its full left context. Otherwise windows of n_ctx tokens slide
by half a window, s = n_ctx // 2: window k holds tokens [k*s, k*s + n_ctx) (the last one
is cut at N). The first window scores all its tokens; each later window scores only the
tokens after its first half (the first half is context, as in llama-perplexity), which are
exactly the tokens the previous window did not reach. So every token 1..N-1 is scored
once, each (beyond the first window) with at least n_ctx - s >= n_ctx / 2 tokens of
context. (llama-perplexity itself uses disjoint
chunks and drops the first half of each plus the leftover tail; ours scores them all.)
When the tokenizer put a BOS first, later windows get BOS in place of their first token,
as llama-perplexity does; that token is context only.

Prefill goes in chunks (default 256 positions) with all logits, so memory stays at
[chunk, n_vocab] float32 plus one float64 copy whatever the text length.
"""

from __future__ import annotations

import dataclasses
import math

from worker.errors import InvalidRequestError


@dataclasses.dataclass(frozen=True)
class PerplexityResult:
    ppl: float
    n_tokens: int          # tokens scored (N - 1)
    token_ids: list[int]   # [N] the tokenized text
    argmax: list[int]      # [N] the model's most likely next token after each position
    nll: list[float]       # [N - 1] nll[i - 1] = -log p(token i | its window's context), nats
    window: int            # the window size used (n_ctx)


def windows(n_tokens: int, n_ctx: int) -> list[tuple[int, int, int]]:
    """(start, end, first_scored): window tokens[start:end] scores tokens first_scored..end-1
    (each from the logits at the position before it). See the module header for the rule."""
    if n_ctx < 2:
        raise InvalidRequestError(f"perplexity needs a context of at least 2 tokens, got {n_ctx}")
    if n_tokens <= n_ctx:
        return [(0, n_tokens, 1)]
    stride = n_ctx // 2
    out = []
    start, scored_upto = 0, 1
    while scored_upto < n_tokens:
        end = min(start + n_ctx, n_tokens)
        out.append((start, end, scored_upto))
        scored_upto = end
        start += stride
    return out


def perplexity(generator, text: str, *, chunk: int = 256) -> PerplexityResult:
    """Scores `text` with a loaded worker.generate.Generator (its engine's n_ctx is the
    window). BOS comes from the tokenizer's own rule (encode(add_special=True))."""
    tok = generator.tokenizer
    ids = [int(t) for t in tok.encode(text, add_special=True, parse_special=False)]
    return score_tokens(generator.engine, ids, bos_id=tok.bos_id, chunk=chunk)


def score_tokens(engine, ids, *, bos_id: int | None = None, chunk: int = 256) -> PerplexityResult:
    """Perplexity of token ids under a worker.engine.Engine (window = engine.n_ctx).

    bos_id: when ids[0] == bos_id, later windows start with BOS too (see the header)."""
    import numpy as np

    if chunk < 1:
        raise InvalidRequestError(f"chunk must be >= 1, got {chunk}")
    ids = [int(t) for t in ids]
    n = len(ids)
    if n < 2:
        raise InvalidRequestError(f"perplexity needs a text of at least 2 tokens, got {n}")
    n_ctx = int(engine.n_ctx)
    bos = bos_id
    leading_bos = bos is not None and ids[0] == bos

    ids_np = np.asarray(ids, dtype=np.int64)  # [N]
    nll = np.zeros(n - 1, dtype=np.float64)   # [N-1] nats
    argmax = np.zeros(n, dtype=np.int64)       # [N]
    seq = engine.new_sequence()
    try:
        for w, (start, end, first) in enumerate(windows(n, n_ctx)):
            window_ids = ids[start:end]
            if w > 0 and leading_bos:
                window_ids[0] = bos
            if w > 0:
                seq.truncate(0)
            for c0 in range(0, end - start, chunk):
                c1 = min(c0 + chunk, end - start)
                logits = seq.prefill(window_ids[c0:c1], all_logits=True)  # [c1-c0, V] float32
                # Absolute positions p = start + c0 .. start + c1 - 1 predict token p + 1.
                pos = np.arange(start + c0, start + c1)
                # argmax[p] comes from the window that scores token p + 1 (the last
                # window for p = N - 1): later windows overwrite the earlier ones.
                mine = pos >= first - 1
                argmax[pos[mine]] = np.argmax(logits[mine], axis=1)
                keep = mine & (pos + 1 < end)
                if not keep.any():
                    continue
                z = logits[keep].astype(np.float64)                      # [m, V]
                zmax = z.max(axis=1)
                lse = zmax + np.log(np.exp(z - zmax[:, None]).sum(axis=1))
                targets = ids_np[pos[keep] + 1]
                nll[pos[keep]] = lse - z[np.arange(len(targets)), targets]
    finally:
        seq.close()
    mean = float(nll.mean())
    return PerplexityResult(
        ppl=math.exp(mean),
        n_tokens=n - 1,
        token_ids=ids,
        argmax=[int(a) for a in argmax],
        nll=[float(x) for x in nll],
        window=n_ctx,
    )
