// specd/cuda/sample.cu: what runs on the logits on the device, one block per row:
//  * argmax_rows: the lowest index of the largest logit, the result of the CPU sampler's
//    strict-greater scan (engine/sampler.cpp argmax). Each thread keeps the best (value, index)
//    of its elements under "greater value, or equal value and lower index"; the block then
//    reduces these pairs under the same order, which is total on non-NaN values, so the result
//    does not depend on the reduction order. NaN: the CPU scan never moves away from a NaN at
//    index 0 and never moves onto a NaN elsewhere; so here NaNs are skipped and a row whose
//    element 0 is NaN answers 0 (also when every element is NaN). -0 and +0 tie (lowest index).
//  * softmax_rows: y = exp(x - max) / sum, the sum of the float exps in double and one float
//    multiply by (float)(1 / sum), as cpu/softmax.cpp; x - max is taken exactly (TwoSum) and
//    exp is ~2 ulp, independent of |x - max|. -inf entries give 0.
#include <climits>
#include <string>

#include "cuda/sample.cuh"
#include "cuda/testing.h"

namespace specd {
namespace gpu {

namespace {

constexpr int kRowThreads = 1024;
constexpr int kRowGroups = kRowThreads / kGroup;

// exp(x - c) for x <= c (same helper as attention.cu's): x - c exact by TwoSum, 2^t
// corrected for the rounding of t = (x - c) log2 e; 0 below e^-104.
__device__ __forceinline__ float exp_diff(float x, float c) {
  constexpr float kLog2e = 1.44269502162933349609375f, kLog2eLo = 1.925963033500011e-08f;
  constexpr float kLn2 = 0.693147180559945309f;
  const float d = __fsub_rn(x, c);
  if (d < -104.f) return 0.f;
  const float bb = __fsub_rn(d, x);
  const float err = __fadd_rn(__fsub_rn(x, __fsub_rn(d, bb)), __fsub_rn(-c, bb));
  const float t = __fmul_rn(d, kLog2e);
  const float e = fmaf(err, kLog2e, fmaf(d, kLog2eLo, fmaf(d, kLog2e, -t)));
  const float y = exp2f(t);
  return fmaf(y, __fmul_rn(e, kLn2), y);
}

// NaN test on the bits (fast-math builds may fold x != x to false).
__device__ __forceinline__ bool is_nan(float v) { return (__float_as_uint(v) & 0x7fffffffu) > 0x7f800000u; }

// (v, i) beats (bv, bi): greater value, or the same value at a lower index; a NaN never does.
__device__ __forceinline__ bool beats(float v, int32_t i, float bv, int32_t bi) {
  return !is_nan(v) && (v > bv || (v == bv && i < bi));
}

__device__ __forceinline__ void consider(float v, int32_t i, float& bv, int32_t& bi) {
  if (beats(v, i, bv, bi)) {
    bv = v;
    bi = i;
  }
}

// ---- kernels

// grid = n rows, block = kRowThreads. VEC4: rows of a multiple of 4 floats, 16-byte aligned.
template <bool VEC4>
__global__ void __launch_bounds__(kRowThreads) argmax_kernel(const float* logits, int64_t nv, int32_t* out) {
  __shared__ float sv[kRowGroups];
  __shared__ int32_t si[kRowGroups];
  const float* x = logits + blockIdx.x * nv;
  float bv = -INFINITY;
  int32_t bi = INT_MAX;  // none yet: any non-NaN value beats it (-inf ties and wins on index)
  if (VEC4) {
    const float4* x4 = reinterpret_cast<const float4*>(x);
    for (int64_t k = threadIdx.x; k < nv / 4; k += kRowThreads) {
      const float4 v = x4[k];
      const int32_t i = (int32_t)(4 * k);
      consider(v.x, i, bv, bi);
      consider(v.y, i + 1, bv, bi);
      consider(v.z, i + 2, bv, bi);
      consider(v.w, i + 3, bv, bi);
    }
  } else {
    for (int64_t k = threadIdx.x; k < nv; k += kRowThreads) consider(x[k], (int32_t)k, bv, bi);
  }
#pragma unroll
  for (int m = kGroup / 2; m > 0; m >>= 1) {
    const float ov = gpu_shfl_xor(bv, m);
    const int32_t oi = gpu_shfl_xor(bi, m);
    consider(ov, oi, bv, bi);
  }
  const int lane = threadIdx.x % kGroup, g = threadIdx.x / kGroup;
  if (lane == 0) {
    sv[g] = bv;
    si[g] = bi;
  }
  __syncthreads();
  if (g == 0) {
    bv = sv[lane];  // kRowGroups == kGroup
    bi = si[lane];
#pragma unroll
    for (int m = kGroup / 2; m > 0; m >>= 1) {
      const float ov = gpu_shfl_xor(bv, m);
      const int32_t oi = gpu_shfl_xor(bi, m);
      consider(ov, oi, bv, bi);
    }
    if (lane == 0) out[blockIdx.x] = (is_nan(x[0]) || bi == INT_MAX) ? 0 : bi;  // NaN at 0: the CPU's 0
  }
}

// Max over the block (fmaxf ignores NaN), same value on every thread.
__device__ __forceinline__ float block_max(float v, float* scratch) {
  const int lane = threadIdx.x % kGroup, g = threadIdx.x / kGroup;
  v = group_max(v);
  __syncthreads();
  if (lane == 0) scratch[g] = v;
  __syncthreads();
  return group_max(scratch[lane]);  // kRowGroups == kGroup
}

__device__ __forceinline__ double block_sum_f64(double v, double* scratch) {
  const int lane = threadIdx.x % kGroup, g = threadIdx.x / kGroup;
  v = group_sum(v);
  __syncthreads();
  if (lane == 0) scratch[g] = v;
  __syncthreads();
  return group_sum(scratch[lane]);
}

template <bool VEC4>
__global__ void __launch_bounds__(kRowThreads) softmax_kernel(float* xs, int64_t nv) {
  __shared__ float smax[kRowGroups];
  __shared__ double ssum[kRowGroups];
  float* x = xs + blockIdx.x * nv;
  float4* x4 = reinterpret_cast<float4*>(x);
  float mx = -INFINITY;
  if (VEC4) {
    for (int64_t k = threadIdx.x; k < nv / 4; k += kRowThreads) {
      const float4 v = x4[k];
      mx = fmaxf(fmaxf(mx, v.x), fmaxf(v.y, fmaxf(v.z, v.w)));
    }
  } else {
    for (int64_t k = threadIdx.x; k < nv; k += kRowThreads) mx = fmaxf(mx, x[k]);
  }
  mx = block_max(mx, smax);
  double sum = 0.0;
  if (VEC4) {
    for (int64_t k = threadIdx.x; k < nv / 4; k += kRowThreads) {
      float4 v = x4[k];
      v = make_float4(exp_diff(v.x, mx), exp_diff(v.y, mx), exp_diff(v.z, mx), exp_diff(v.w, mx));
      x4[k] = v;
      sum += ((double)v.x + (double)v.y) + ((double)v.z + (double)v.w);
    }
  } else {
    for (int64_t k = threadIdx.x; k < nv; k += kRowThreads) {
      const float e = exp_diff(x[k], mx);
      x[k] = e;
      sum += (double)e;
    }
  }
  sum = block_sum_f64(sum, ssum);
  const float inv = (float)(1.0 / sum);
  if (VEC4) {
    for (int64_t k = threadIdx.x; k < nv / 4; k += kRowThreads) {
      const float4 v = x4[k];
      x4[k] = make_float4(v.x * inv, v.y * inv, v.z * inv, v.w * inv);
    }
  } else {
    for (int64_t k = threadIdx.x; k < nv; k += kRowThreads) x[k] *= inv;
  }
}

void check_rows(const char* op, const void* p, int64_t n, int64_t nv) {
  if (n < 0 || nv <= 0)
    throw Error(std::string(op) + ": needs n >= 0 rows of nv > 0 values, got n=" + std::to_string(n) +
                ", nv=" + std::to_string(nv));
  if (n > 0x7fffffff) throw Error(std::string(op) + ": at most 2^31-1 rows per call, got " + std::to_string(n));
  if (nv > INT_MAX - 3) throw Error(std::string(op) + ": rows longer than 2^31-4 values are not supported");
  if (n > 0 && !p) throw Error(std::string(op) + ": null device pointer");
}

}  // namespace

// ---- launchers

void argmax_rows(const float* logits, int64_t n, int64_t nv, int32_t* out, gpuStream_t s) {
  check_rows("argmax_rows", logits, n, nv);
  if (n == 0) return;
  if (!out) throw Error("argmax_rows: null output pointer");
  if (nv % 4 == 0 && (uintptr_t)logits % 16 == 0) argmax_kernel<true><<<(unsigned)n, kRowThreads, 0, s>>>(logits, nv, out);
  else argmax_kernel<false><<<(unsigned)n, kRowThreads, 0, s>>>(logits, nv, out);
  SPECD_GPU_LAUNCHED("argmax_kernel");
}

void softmax_rows(float* x, int64_t n, int64_t nv, gpuStream_t s) {
  check_rows("softmax_rows", x, n, nv);
  if (n == 0) return;
  if (nv % 4 == 0 && (uintptr_t)x % 16 == 0) softmax_kernel<true><<<(unsigned)n, kRowThreads, 0, s>>>(x, nv);
  else softmax_kernel<false><<<(unsigned)n, kRowThreads, 0, s>>>(x, nv);
  SPECD_GPU_LAUNCHED("softmax_kernel");
}

// ---- testing entry points (cuda/testing.h)

namespace testing {

void argmax_rows(const float* logits, int64_t n, int64_t nv, int32_t* out) {
  check_rows("argmax_rows", logits, n, nv);
  const size_t bytes = sizeof(float) * (size_t)(n * nv);
  DeviceBuffer dx(bytes), dout(sizeof(int32_t) * (size_t)n);
  to_device(dx.get(), logits, bytes);
  gpu::argmax_rows(dx.get<float>(), n, nv, dout.get<int32_t>(), nullptr);
  SPECD_GPU_CHECK(gpuDeviceSynchronize());
  to_host(out, dout.get(), sizeof(int32_t) * (size_t)n);
}

void softmax_rows(float* x, int64_t n, int64_t nv) {
  check_rows("softmax_rows", x, n, nv);
  const size_t bytes = sizeof(float) * (size_t)(n * nv);
  DeviceBuffer dx(bytes);
  to_device(dx.get(), x, bytes);
  gpu::softmax_rows(dx.get<float>(), n, nv, nullptr);
  SPECD_GPU_CHECK(gpuDeviceSynchronize());
  to_host(x, dx.get(), bytes);
}

}  // namespace testing
}  // namespace gpu
}  // namespace specd
