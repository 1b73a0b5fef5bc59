// specd/cpu/rope.cpp: rotary position embedding, in place, as ggml_rope_ext with
// ext_factor = 0 and attn_factor = 1 (no YaRN). For pair i in [0, n_dims/2):
//   theta_i = pos * freq_scale * base^(-2i/n_dims) / factor_i     (factor_i = freq_factors[i] or 1)
//   (a, b) -> (a cos theta_i - b sin theta_i,  a sin theta_i + b cos theta_i)
// where (a, b) = (x[2i], x[2i+1]) in Normal mode and (x[i], x[i + n_dims/2]) in Neox mode;
// dims >= n_dims pass through. Angles, cos/sin and the rotation are computed in double and
// rounded once, so results agree with float64 math to float rounding even at large pos.
#include <cmath>
#include <string>
#include <vector>

#include "common/parallel.h"
#include "cpu/ops.h"

namespace specd {

void rope(float* x, const int32_t* pos, int64_t n_tok, int64_t n_heads, int64_t head_dim,
          const RopeParams& p) {
  if (p.n_dims <= 0 || p.n_dims % 2 != 0 || p.n_dims > head_dim)
    throw Error("rope: n_dims must be even and in [2, head_dim=" + std::to_string(head_dim) +
                "], got " + std::to_string(p.n_dims));
  if (!(p.freq_base > 0.f) || !std::isfinite(p.freq_base) || !(p.freq_scale > 0.f) ||
      !std::isfinite(p.freq_scale))
    throw Error("rope: freq_base and freq_scale must be positive and finite, got " +
                std::to_string(p.freq_base) + " and " + std::to_string(p.freq_scale));
  if (p.mode != RopeMode::Normal && p.mode != RopeMode::Neox)
    throw Error("rope: unknown mode " + std::to_string((int)p.mode) + " (0 = normal, 2 = neox)");
  if (n_tok <= 0 || n_heads <= 0) return;

  const int64_t half = p.n_dims / 2;
  // freq[i] = freq_scale * base^(-2i/n_dims) / factor_i (rad per position)     [half]
  std::vector<double> freq((size_t)half);
  const double log_base = std::log((double)p.freq_base);
  for (int64_t i = 0; i < half; ++i) {
    const double factor = p.freq_factors ? (double)p.freq_factors[i] : 1.0;
    freq[i] = (double)p.freq_scale * std::exp(-(double)(2 * i) / p.n_dims * log_base) / factor;
  }
  // Normal: pair i is (2i, 2i+1); Neox: (i, i + half).
  const int64_t stride_i = p.mode == RopeMode::Neox ? 1 : 2;
  const int64_t partner = p.mode == RopeMode::Neox ? half : 1;
  std::vector<double> cs((size_t)(n_tok * half * 2));  // [n_tok, half, (cos, sin)]

  parallel_for(n_tok, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      double* c = cs.data() + t * half * 2;
      for (int64_t i = 0; i < half; ++i) {
        const double th = (double)pos[t] * freq[i];
        c[2 * i] = std::cos(th);
        c[2 * i + 1] = std::sin(th);
      }
      for (int64_t h = 0; h < n_heads; ++h) {
        float* xh = x + (t * n_heads + h) * head_dim;
        for (int64_t i = 0; i < half; ++i) {
          float* pa = xh + i * stride_i;
          float* pb = pa + partner;
          const double a = *pa, b = *pb, co = c[2 * i], si = c[2 * i + 1];
          *pa = (float)(a * co - b * si);
          *pb = (float)(a * si + b * co);
        }
      }
    }
  });
}

}  // namespace specd
