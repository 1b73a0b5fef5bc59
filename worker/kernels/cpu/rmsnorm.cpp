// specd/cpu/rmsnorm.cpp: RMSNorm, sum of squares accumulated in double.
#include <cmath>
#include "cpu/ops.h"

namespace specd {

void rmsnorm(const float* x, const float* w, float* y, int64_t n_rows, int64_t dim, float eps) {
  for (int64_t r = 0; r < n_rows; ++r) {
    const float* xr = x + r * dim;
    float* yr = y + r * dim;
    double ss = 0.0;
    for (int64_t i = 0; i < dim; ++i) ss += (double)xr[i] * xr[i];
    const float inv = (float)(1.0 / std::sqrt(ss / (double)dim + (double)eps));
    for (int64_t i = 0; i < dim; ++i) yr[i] = xr[i] * inv * w[i];
  }
}

}  // namespace specd
