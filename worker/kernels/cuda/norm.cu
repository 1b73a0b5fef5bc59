// specd/cuda/norm.cu: RMSNorm of rows on the GPU (the prefill path; decode fuses the norm
// into linear()), the twin of cpu/rmsnorm.cpp:
//   y[r] = x[r] * inv_r * w,   inv_r = (float)(1 / sqrt(sum_i x[r,i]^2 / dim + eps))
// One block per row. The sum of squares is accumulated in double (each thread sums its
// strided elements in order, then a fixed butterfly/group order across the block), and inv_r
// is computed in double and rounded once, so y matches the CPU to float rounding (and bit
// for bit whenever the two double sums round to the same inv_r, which is nearly always).
// Deterministic: the reduction order depends only on dim. y may alias x: every read of the
// sum happens before the block barrier, and each element is then re-read and written by the
// same thread.
#include <cmath>
#include <string>

#include "cuda/norm.cuh"
#include "cuda/testing.h"

namespace specd {
namespace gpu {

namespace {

constexpr int kNormThreads = 256;

// Sum of a double over the block (blockDim.x == kNormThreads), same result on every thread.
// scratch: __shared__ double[kNormThreads / kGroup].
__device__ __forceinline__ double block_sum_f64(double v, double* scratch) {
  constexpr int ng = kNormThreads / kGroup;
  const int lane = threadIdx.x % kGroup, g = threadIdx.x / kGroup;
  v = group_sum(v);
  __syncthreads();
  if (lane == 0) scratch[g] = v;
  __syncthreads();
  double t = 0.0;
#pragma unroll
  for (int i = 0; i < ng; ++i) t += scratch[i];  // fixed order
  return t;
}

// ---- kernels

// grid = rows, block = kNormThreads. VEC4: dim % 4 == 0 (rows stay 16-byte aligned).
template <bool VEC4>
__global__ void __launch_bounds__(kNormThreads) rmsnorm_kernel(const float* x, const float* w, float* y,
                                                               int64_t dim, float eps) {
  gpu_grid_wait();  // (programmatic dependent launch: vendor.cuh)
  gpu_grid_launch_dependents();
  __shared__ double scratch[kNormThreads / kGroup];
  const float* xr = x + blockIdx.x * dim;
  float* yr = y + blockIdx.x * dim;
  double ss = 0.0;
  if (VEC4) {
    const float4* x4 = reinterpret_cast<const float4*>(xr);
    for (int64_t i = threadIdx.x; i < dim / 4; i += kNormThreads) {
      const float4 v = x4[i];
      ss = fma((double)v.x, (double)v.x, ss);
      ss = fma((double)v.y, (double)v.y, ss);
      ss = fma((double)v.z, (double)v.z, ss);
      ss = fma((double)v.w, (double)v.w, ss);
    }
  } else {
    for (int64_t i = threadIdx.x; i < dim; i += kNormThreads) ss = fma((double)xr[i], (double)xr[i], ss);
  }
  ss = block_sum_f64(ss, scratch);
  const float inv = (float)(1.0 / sqrt(ss / (double)dim + (double)eps));
  if (VEC4) {
    const float4* x4 = reinterpret_cast<const float4*>(xr);
    const float4* w4 = reinterpret_cast<const float4*>(w);
    float4* y4 = reinterpret_cast<float4*>(yr);
    for (int64_t i = threadIdx.x; i < dim / 4; i += kNormThreads) {
      const float4 v = x4[i], g = w4[i];
      y4[i] = make_float4(v.x * inv * g.x, v.y * inv * g.y, v.z * inv * g.z, v.w * inv * g.w);
    }
  } else {
    for (int64_t i = threadIdx.x; i < dim; i += kNormThreads) yr[i] = xr[i] * inv * w[i];
  }
}

}  // namespace

// ---- launcher

void rmsnorm(const float* x, const float* w, float* y, int64_t rows, int64_t dim, float eps, gpuStream_t s) {
  if (rows < 0 || dim <= 0)
    throw Error("rmsnorm: rows must be >= 0 and dim > 0, got rows=" + std::to_string(rows) +
                ", dim=" + std::to_string(dim));
  if (rows > 0x7fffffff) throw Error("rmsnorm: at most 2^31-1 rows per call, got " + std::to_string(rows));
  if (!(eps >= 0.f)) throw Error("rmsnorm: eps must be >= 0, got " + std::to_string(eps));
  if (rows == 0) return;
  if (!x || !w || !y) throw Error("rmsnorm: x, w and y must be device pointers, got a null one");
  const bool vec4 = dim % 4 == 0 && ((uintptr_t)x % 16 == 0) && ((uintptr_t)y % 16 == 0) && ((uintptr_t)w % 16 == 0);
  gpu_launch("rmsnorm_kernel", vec4 ? rmsnorm_kernel<true> : rmsnorm_kernel<false>, dim3((unsigned)rows),
             dim3(kNormThreads), 0, s, x, w, y, dim, eps);
}

// ---- testing entry point (cuda/testing.h)

namespace testing {

void rmsnorm(const float* x, const float* w, float* y, int64_t rows, int64_t dim, float eps) {
  const size_t bytes = sizeof(float) * (size_t)(rows * dim);
  DeviceBuffer dx(bytes), dw(sizeof(float) * (size_t)dim);
  to_device(dx.get(), x, bytes);
  to_device(dw.get(), w, sizeof(float) * (size_t)dim);
  gpu::rmsnorm(dx.get<float>(), dw.get<float>(), dx.get<float>(), rows, dim, eps, nullptr);  // in place
  SPECD_GPU_CHECK(gpuDeviceSynchronize());
  to_host(y, dx.get(), bytes);
}

}  // namespace testing
}  // namespace gpu
}  // namespace specd
