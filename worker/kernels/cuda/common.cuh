// specd/cuda/common.cuh: what every GPU op shares: error checking (every failure becomes a
// specd::Error naming the call), group/block reductions, element loads, the device-side
// weight view, and an owning device buffer.
#pragma once
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <utility>

#include "common/types.h"
#include "cuda/vendor.cuh"

namespace specd {
namespace gpu {

// Throws specd::Error("<what>: <gpu error string>") on failure. Use for every runtime call.
inline void check(gpuError_t e, const char* what) {
  if (e != gpuSuccess) throw Error(std::string(SPECD_GPU_NAME) + " error in " + what + ": " + gpuGetErrorString(e));
}
#define SPECD_GPU_CHECK(call) ::specd::gpu::check((call), #call)
// After every kernel launch: catches bad launch configurations at once (asynchronous
// faults surface at the next synchronising call, which is checked too).
#define SPECD_GPU_LAUNCHED(name) ::specd::gpu::check(gpuGetLastError(), name)

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// The environment variable `name`, or "" when unset (the SPECD_GPU_* benchmark switches).
inline std::string env_value(const char* name) {
  const char* e = std::getenv(name);
  return e ? e : "";
}

// What the launchers need of the current device, read once per device (device.cu).
struct DevLimits {
  size_t smem_per_block = 0;  // opt-in maximum of dynamic shared memory per block
  int sms = 0;                // multiprocessors
  bool pdl = false;           // programmatic dependent launch: sm_90+ and SPECD_GPU_PDL != "0"
  bool mma = false;           // tensor-core mma.sync with fp16 inputs (NVIDIA sm_80+)
  bool wgmma = false;         // warpgroup MMA: an sm_90 device and a build with sm_90a code (SPECD_SM90A)
  bool log = false;           // SPECD_GPU_LOG_LAUNCHES=1: every launch's kernel and grid on stderr
};
const DevLimits& dev_limits();

// kernel<<<grid, block, smem, s>>>(args...) through gpu_launch_kernel, with programmatic
// dependent launch where the device has it (every kernel calls gpu_grid_wait() first, see
// vendor.cuh), then the launch check.
template <class... P, class... A>
inline void gpu_launch(const char* name, void (*kernel)(P...), dim3 grid, dim3 block, size_t smem, gpuStream_t s,
                       A&&... args) {
  if (dev_limits().log) std::fprintf(stderr, "specd gpu launch: %s grid %u x %u\n", name, grid.x, grid.y);
  check(gpu_launch_kernel(dev_limits().pdl, kernel, grid, block, smem, s, std::forward<A>(args)...), name);
}

// ---- device helpers

// Orders a group's shared-memory traffic (copies landed, buffers free): __syncwarp, or on HIP
// a CTA barrier, so every thread of the CTA must reach it the same number of times.
__device__ __forceinline__ void group_sync() {
#if SPECD_HIP
  __syncthreads();
#else
  __syncwarp();
#endif
}

template <class T>
__device__ __forceinline__ T group_sum(T v) {  // sum over the 32 lanes of a group
#pragma unroll
  for (int m = kGroup / 2; m > 0; m >>= 1) v += gpu_shfl_xor(v, m);
  return v;
}

template <class T>
__device__ __forceinline__ T group_max(T v) {
#pragma unroll
  for (int m = kGroup / 2; m > 0; m >>= 1) v = fmaxf(v, gpu_shfl_xor(v, m));
  return v;
}

// Sum over the whole block (blockDim.x a multiple of 32, at most 1024). Every thread gets
// the result. `scratch` is __shared__ float[32]. Deterministic: fixed order.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
  const int lane = threadIdx.x % kGroup, g = threadIdx.x / kGroup, ng = blockDim.x / kGroup;
  v = group_sum(v);
  __syncthreads();  // scratch may be in use by an earlier call
  if (lane == 0) scratch[g] = v;
  __syncthreads();
  v = lane < ng ? scratch[lane] : 0.f;
  return group_sum(v);
}

// ss + v.x^2 + v.y^2 + v.z^2 + v.w^2, as fmas in that order
__device__ __forceinline__ float add_squares(const float4& v, float ss) {
  ss = fmaf(v.x, v.x, ss);
  ss = fmaf(v.y, v.y, ss);
  ss = fmaf(v.z, v.z, ss);
  return fmaf(v.w, v.w, ss);
}

// max(mx, |v.x w.x|, .., |v.w w.w|): the largest scaled activation (w: norm weights or ones)
__device__ __forceinline__ float max_abs_prod(const float4& v, const float4& w, float mx) {
  return fmaxf(fmaxf(mx, fabsf(__fmul_rn(v.x, w.x))),
               fmaxf(fabsf(__fmul_rn(v.y, w.y)), fmaxf(fabsf(__fmul_rn(v.z, w.z)), fabsf(__fmul_rn(v.w, w.w)))));
}

// 2^(top - floor(log2 m)) for finite m > 0, clamped to float's normal range (puts m in
// [2^top, 2^(top+1))); 1 for m = 0 or a non-finite m.
__device__ __forceinline__ float pow2_range_scale(float m, int top) {
  const int e = (int)((__float_as_uint(m) >> 23) & 0xFF) - 127;
  if (!(m > 0.f) || e == 128) return 1.f;
  const int se = min(127, max(-126, top - e));
  return __uint_as_float((uint32_t)(se + 127) << 23);
}

__device__ __forceinline__ float load_f16(const uint16_t* p) {
  return __half2float(*reinterpret_cast<const __half*>(p));
}
__device__ __forceinline__ float bf16_bits_to_f32(uint16_t h) { return __uint_as_float((uint32_t)h << 16); }
__device__ __forceinline__ uint16_t f32_to_f16_bits(float f) {  // round to nearest even
  const __half h = __float2half_rn(f);
  return *reinterpret_cast<const uint16_t*>(&h);
}

// ---- host side

// A 2-D weight on the device, same layout as the file (cpu/matmul.h WeightView): n_out rows
// of n_in elements, row_stride bytes apart.
struct GpuWeight {
  GgmlType type = GgmlType::F32;
  int64_t n_in = 0;
  int64_t n_out = 0;
  const uint8_t* data = nullptr;  // device pointer
  size_t row_stride = 0;
  const uint8_t* row(int64_t r) const { return data + (size_t)r * row_stride; }
};

// An owning device allocation (moveable, not copyable).
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(size_t bytes) { resize(bytes); }
  ~DeviceBuffer() { if (p_) (void)gpuFree(p_); }
  DeviceBuffer(DeviceBuffer&& o) noexcept : p_(o.p_), n_(o.n_) { o.p_ = nullptr; o.n_ = 0; }
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    if (this != &o) { if (p_) (void)gpuFree(p_); p_ = o.p_; n_ = o.n_; o.p_ = nullptr; o.n_ = 0; }
    return *this;
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  // Drops the old contents; throws Error with the sizes when the device is out of memory.
  void resize(size_t bytes) {
    if (bytes == n_) return;
    if (p_) { (void)gpuFree(p_); p_ = nullptr; n_ = 0; }
    if (bytes == 0) return;
    const gpuError_t e = gpuMalloc(&p_, bytes);
    if (e != gpuSuccess) {
      (void)gpuGetLastError();
      size_t free_b = 0, total_b = 0;
      (void)gpuMemGetInfo(&free_b, &total_b);
      throw Error(std::string(SPECD_GPU_NAME) + ": cannot allocate " + std::to_string(bytes >> 20) + " MiB (" +
                  std::to_string(free_b >> 20) + " MiB free of " + std::to_string(total_b >> 20) + " MiB): " +
                  gpuGetErrorString(e));
    }
    n_ = bytes;
  }
  // Grows (never shrinks); contents are lost when it grows.
  void reserve(size_t bytes) { if (bytes > n_) resize(bytes); }
  template <class T = void>
  T* get() const { return static_cast<T*>(p_); }
  size_t size() const { return n_; }

 private:
  void* p_ = nullptr;
  size_t n_ = 0;
};

// Host <-> device copies for the test entry points (synchronous, checked).
inline void to_device(void* dst, const void* src, size_t bytes) {
  if (bytes) SPECD_GPU_CHECK(gpuMemcpy(dst, src, bytes, gpuMemcpyHostToDevice));
}
inline void to_host(void* dst, const void* src, size_t bytes) {
  if (bytes) SPECD_GPU_CHECK(gpuMemcpy(dst, src, bytes, gpuMemcpyDeviceToHost));
}

}  // namespace gpu
}  // namespace specd
