// specd/engine/accept.h: the accept rule of speculative decoding, for ONE verified
// position (the engine loops over positions, stopping at the first rejection). Pure:
// everything it reads is an argument, randomness comes in as uniforms.
//
// Greedy: the draft d is accepted iff d == argmax(p) (lowest id on ties); otherwise the
//   target's token argmax(p) replaces it. p may be the penalised logits or any monotone
//   transform of them. Output = plain greedy decoding, token for token.
// Sampling (Leviathan et al. 2023, Chen et al. 2023): p = the target's distribution, q =
//   the draft's (both after the same transforms), d ~ q.
//   accept d with probability min(1, p(d) / q(d))   <=>   u_accept * q(d) < p(d)
//   on rejection, draw from  r = normalize(max(0, p - q))  with u_resample.
//   Then P(token = x) = q(x) min(1, p(x)/q(x)) + (1 - sum_y min(p(y), q(y))) r(x) = p(x):
//   the output is distributed exactly as plain sampling from p.
//   q = null means a deterministic (one-hot) proposal: q(d) = 1, so d is accepted with
//   probability p(d), and r = p with p(d) zeroed.
//   If r sums to zero (only through rounding: rejection needs p(d) < q(d), which leaves
//   mass where p > q unless p and q differ only by rounding), it draws from p instead.
#pragma once
#include <cstdint>

namespace specd {

struct Verdict {
  bool accepted = false;
  int32_t token = -1;  // the draft when accepted, else the target's replacement
};

// p, q: [n_vocab] (q may be null = one-hot on `draft`); residual: scratch [n_vocab];
// u_accept, u_resample in [0, 1) (u_resample is read only on a sampled rejection).
Verdict verify_position(const float* p, const float* q, int64_t n_vocab, int32_t draft, bool greedy,
                        double u_accept, double u_resample, float* residual);

}  // namespace specd
