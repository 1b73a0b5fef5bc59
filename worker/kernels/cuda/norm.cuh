// specd/cuda/norm.cuh: RMSNorm rows (the prefill path; decode fuses the norm into linear()).
#pragma once
#include <cstdint>

#include "cuda/common.cuh"

namespace specd {
namespace gpu {

// y[r] = x[r] * (1 / sqrt(mean(x[r]^2) + eps)) * w   x, y: device [rows, dim] (y may alias x).
void rmsnorm(const float* x, const float* w, float* y, int64_t rows, int64_t dim, float eps, gpuStream_t s);

}  // namespace gpu
}  // namespace specd
