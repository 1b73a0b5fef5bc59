// specd/cuda/sample.cu: what runs on the logits on the device:
//  * argmax_rows (blocks over segments of each row, the last to finish reduces the row): the lowest index of the largest logit, the result of the CPU sampler's
//    strict-greater scan (engine/sampler.cpp argmax). Each thread keeps the best (value, index)
//    of its elements under "greater value, or equal value and lower index"; the block then
//    reduces these pairs under the same order (and the row's segments after it), which is total on non-NaN values, so the result
//    does not depend on the reduction order. NaN: the CPU scan never moves away from a NaN at
//    index 0 and never moves onto a NaN elsewhere; so here NaNs are skipped and a row whose
//    element 0 is NaN answers 0 (also when every element is NaN). -0 and +0 tie (lowest index).
//  * softmax_rows (one block per row): y = exp(x - max) / sum, the sum of the float exps in double and one float
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
constexpr int kArgThreads = 256;
constexpr int kArgGroups = kArgThreads / kGroup;
constexpr int64_t kArgSegment = 8192;  // logits per argmax block

// Where the argmax blocks of a row meet. Row r owns bytes [r * stride, (r + 1) * stride) of
// the workspace: its counter, then a pair per segment. The layout does not depend on n, so
// a call with fewer rows never writes over the counters of rows a later call uses.
struct ArgmaxWork {
  uint8_t* base;
  int64_t stride;  // bytes per row
  __device__ unsigned* count(int64_t r) const { return reinterpret_cast<unsigned*>(base + r * stride); }
  __device__ float* val(int64_t r) const { return reinterpret_cast<float*>(base + r * stride + 16); }
  __device__ int32_t* idx(int64_t r, int64_t segs) const { return reinterpret_cast<int32_t*>(val(r) + segs); }
};
int64_t argmax_segments(int64_t nv) { return (nv + kArgSegment - 1) / kArgSegment; }
int64_t argmax_row_bytes(int64_t nv) { return 16 * ((16 + 8 * argmax_segments(nv) + 15) / 16); }

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

// Pairs (v, i) -> the best of the group under `beats` (total on non-NaN values: the result
// does not depend on the order).
__device__ __forceinline__ void group_best(float& bv, int32_t& bi) {
#pragma unroll
  for (int m = kGroup / 2; m > 0; m >>= 1) {
    const float ov = gpu_shfl_xor(bv, m);
    const int32_t oi = gpu_shfl_xor(bi, m);
    consider(ov, oi, bv, bi);
  }
}

// The same over the block (kArgThreads), on every thread.
__device__ __forceinline__ void block_best(float& bv, int32_t& bi, float* sv, int32_t* si) {
  const int lane = threadIdx.x % kGroup, g = threadIdx.x / kGroup;
  group_best(bv, bi);
  __syncthreads();
  if (lane == 0) {
    sv[g] = bv;
    si[g] = bi;
  }
  __syncthreads();
  bv = lane < kArgGroups ? sv[lane] : -INFINITY;
  bi = lane < kArgGroups ? si[lane] : INT_MAX;
  group_best(bv, bi);
}

// grid = (segments of kArgSegment elements, n rows), block = kArgThreads. Each block writes
// the best pair of its segment to the workspace; the last block of a row to finish (a ticket
// from the row's counter) reduces the row's pairs, writes out[row] and sets the counter back
// to 0 for the next call. VEC4: rows of a multiple of 4 floats, 16-byte aligned.
template <bool VEC4>
__global__ void __launch_bounds__(kArgThreads) argmax_kernel(const float* logits, int64_t nv, int32_t* out,
                                                            ArgmaxWork w) {
  gpu_grid_wait();  // (programmatic dependent launch: vendor.cuh)
  gpu_grid_launch_dependents();
  __shared__ float sv[kArgGroups];
  __shared__ int32_t si[kArgGroups];
  __shared__ bool last;
  const int64_t row = blockIdx.y, seg = blockIdx.x, n_seg = gridDim.x;
  const float* x = logits + row * nv;
  const int64_t k0 = seg * kArgSegment, k1 = min(nv, k0 + kArgSegment);
  float bv = -INFINITY;
  int32_t bi = INT_MAX;  // none yet: any non-NaN value beats it (-inf ties and wins on index)
  if (VEC4) {
    const float4* x4 = reinterpret_cast<const float4*>(x);
    for (int64_t k = k0 / 4 + threadIdx.x; k < k1 / 4; k += kArgThreads) {
      const float4 v = x4[k];
      const int32_t i = (int32_t)(4 * k);
      consider(v.x, i, bv, bi);
      consider(v.y, i + 1, bv, bi);
      consider(v.z, i + 2, bv, bi);
      consider(v.w, i + 3, bv, bi);
    }
  } else {
    for (int64_t k = k0 + threadIdx.x; k < k1; k += kArgThreads) consider(x[k], (int32_t)k, bv, bi);
  }
  block_best(bv, bi, sv, si);
  if (threadIdx.x == 0) {
    w.val(row)[seg] = bv;
    w.idx(row, n_seg)[seg] = bi;
    __threadfence();  // the pair is visible before the ticket is taken
    const unsigned ticket = atomicAdd(w.count(row), 1u);
    last = ticket == (unsigned)(n_seg - 1);
  }
  __syncthreads();
  if (!last) return;
  __threadfence();
  bv = -INFINITY;
  bi = INT_MAX;
  for (int64_t j = threadIdx.x; j < n_seg; j += kArgThreads) {
    const volatile float* vv = w.val(row);
    const volatile int32_t* vi = w.idx(row, n_seg);
    consider(vv[j], vi[j], bv, bi);
  }
  block_best(bv, bi, sv, si);
  if (threadIdx.x == 0) {
    out[row] = (is_nan(x[0]) || bi == INT_MAX) ? 0 : bi;  // NaN at 0: the CPU's 0
    *w.count(row) = 0;
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
  gpu_grid_wait();  // (programmatic dependent launch: vendor.cuh)
  gpu_grid_launch_dependents();
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

size_t argmax_workspace_bytes(int64_t n, int64_t nv) {
  if (n <= 0 || nv <= 0) return 0;
  return (size_t)(n * argmax_row_bytes(nv));
}

void argmax_rows(const float* logits, int64_t n, int64_t nv, int32_t* out, void* work, gpuStream_t s) {
  check_rows("argmax_rows", logits, n, nv);
  if (n == 0) return;
  if (!out) throw Error("argmax_rows: null output pointer");
  if (!work) throw Error("argmax_rows: null workspace (argmax_workspace_bytes(n, nv) bytes, zeroed once)");
  SPECD_CHECK(n <= 65535, "argmax_rows: at most 65535 rows per call, got " + std::to_string(n));
  const int64_t segs = argmax_segments(nv);
  const ArgmaxWork w{static_cast<uint8_t*>(work), argmax_row_bytes(nv)};
  const bool vec4 = nv % 4 == 0 && (uintptr_t)logits % 16 == 0;
  gpu_launch("argmax_kernel", vec4 ? argmax_kernel<true> : argmax_kernel<false>, dim3((unsigned)segs, (unsigned)n),
             dim3(kArgThreads), 0, s, logits, nv, out, w);
}

void softmax_rows(float* x, int64_t n, int64_t nv, gpuStream_t s) {
  check_rows("softmax_rows", x, n, nv);
  if (n == 0) return;
  const bool vec4 = nv % 4 == 0 && (uintptr_t)x % 16 == 0;
  gpu_launch("softmax_kernel", vec4 ? softmax_kernel<true> : softmax_kernel<false>, dim3((unsigned)n),
             dim3(kRowThreads), 0, s, x, nv);
}

// ---- testing entry points (cuda/testing.h)

namespace testing {

void argmax_rows(const float* logits, int64_t n, int64_t nv, int32_t* out) {
  check_rows("argmax_rows", logits, n, nv);
  const size_t bytes = sizeof(float) * (size_t)(n * nv);
  DeviceBuffer dx(bytes), dout(sizeof(int32_t) * (size_t)n), work(argmax_workspace_bytes(n, nv) + 16);
  to_device(dx.get(), logits, bytes);
  SPECD_GPU_CHECK(gpuMemset(work.get(), 0, work.size()));
  for (int rep = 0; rep < 2; ++rep)  // twice: the second call finds the counters back at 0
    gpu::argmax_rows(dx.get<float>(), n, nv, dout.get<int32_t>(), work.get(), nullptr);
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
