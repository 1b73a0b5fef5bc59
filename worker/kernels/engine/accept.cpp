// specd/engine/accept.cpp: the accept rule (see accept.h for the maths).
#include "engine/accept.h"

#include <string>

#include "common/types.h"
#include "engine/sampler.h"

namespace specd {

Verdict verify_position(const float* p, const float* q, int64_t n_vocab, int32_t draft, bool greedy,
                        double u_accept, double u_resample, float* residual) {
  SPECD_CHECK(draft >= 0 && draft < n_vocab,
              "verify_position: draft token " + std::to_string(draft) + " outside [0, " + std::to_string(n_vocab) + ")");
  if (greedy) {
    const int32_t best = argmax(p, n_vocab);
    return {best == draft, best};
  }
  const double qd = q ? (double)q[draft] : 1.0;
  // u < p/q without dividing (q(d) = 0: accepted iff p(d) > 0, the limit of the ratio).
  if (u_accept * qd < (double)p[draft]) return {true, draft};
  // residual r = max(0, p - q); for one-hot q that is p with p(d) zeroed (p(d) - 1 <= 0).
  bool any = false;
  for (int64_t i = 0; i < n_vocab; ++i) {
    const float r = q ? p[i] - q[i] : (i == draft ? 0.f : p[i]);
    residual[i] = r > 0.f ? r : 0.f;
    any = any || residual[i] > 0.f;
  }
  return {false, sample_from(any ? residual : p, n_vocab, u_resample)};
}

}  // namespace specd
