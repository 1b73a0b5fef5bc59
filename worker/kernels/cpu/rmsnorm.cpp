// specd/cpu/rmsnorm.cpp: RMSNorm, y = x / sqrt(mean(x^2) + eps) * w, one row at a time.
// The sum of squares is accumulated in double (four partial sums, so the adds overlap
// instead of waiting on each other); rows are spread over threads when there are many
// (prefill). y may alias x: each row is read in full before it is written.
#include <cmath>
#include "common/parallel.h"
#include "cpu/ops.h"

namespace specd {

void rmsnorm(const float* x, const float* w, float* y, int64_t n_rows, int64_t dim, float eps) {
  if (n_rows <= 0 || dim <= 0) return;
  const int64_t grain = std::max<int64_t>(1, 16384 / dim);  // >= ~16k elements per chunk
  parallel_for(n_rows, grain, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* xr = x + r * dim;
      float* yr = y + r * dim;
      double s[4] = {0.0, 0.0, 0.0, 0.0};
      int64_t i = 0;
      for (; i + 4 <= dim; i += 4)
        for (int j = 0; j < 4; ++j) s[j] += (double)xr[i + j] * xr[i + j];
      for (; i < dim; ++i) s[0] += (double)xr[i] * xr[i];
      const double ss = (s[0] + s[1]) + (s[2] + s[3]);
      const float inv = (float)(1.0 / std::sqrt(ss / (double)dim + (double)eps));
      for (int64_t k = 0; k < dim; ++k) yr[k] = xr[k] * inv * w[k];
    }
  });
}

}  // namespace specd
