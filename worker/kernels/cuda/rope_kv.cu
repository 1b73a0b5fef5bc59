// specd/cuda/rope_kv.cu: the step between the QKV projection and attention, one kernel
// (twin of model.cpp's rmsnorm(q), rmsnorm(k), rope(q), rope(k), kv.write):
//   row r of qkv = [q (n_heads heads) | k (n_kv heads) | v (n_kv heads)], position p = *d_pos0 + r
//   q, k heads: optional per-head RMSNorm (qwen3): x = x * inv * norm_w, inv = 1/sqrt(mean(x^2)+eps)
//               then RoPE, pair i < n_dims/2 rotated by theta_i = p * freq_i (cpu/rope.cpp):
//                 freq_i = freq_scale * base^(-2i/n_dims) / factor_i
//                 (a, b) -> (a cos - b sin, a sin + b cos)
//                 (a, b) = (x[2i], x[2i+1]) Normal, (x[i], x[i+n_dims/2]) Neox; dims >= n_dims pass
//   q is written back in place; k and v go to row p of the cache (fp16 round-to-nearest-even
//   or float).
// Arithmetic as the CPU: the RMSNorm sum of squares and 1/rms in double, x * inv * w in float;
// freq_scale * base^(-2i/n_dims) is computed on the host with the CPU's expression (same libm),
// the division by the factor, theta, cos/sin and the rotation in double (no fused multiply-add,
// like the CPU's), rounded to float once. So q/k agree with cpu/rope.cpp to float rounding, bit
// for bit unless the device's double sin/cos differs from the host's in the last bit and that
// moves a float rounding (rare).
//
// Launch: grid (ceil(heads/8), n), 256 threads = 8 groups of 32 lanes, one head per group,
// heads = n_heads + 2 n_kv (q, k, then v). Lane l owns pairs i = l + 32j and pass-through dims
// n_dims + l + 32j. The position is read on the device, so the launch shape depends only on
// n and the sizes (graph-capturable). A position outside [0, n_ctx) writes no cache row.
#include <cmath>
#include <string>

#include "cuda/rope_kv.cuh"
#include "cuda/testing.h"

namespace specd {
namespace gpu {

namespace {

constexpr int kRopeThreads = 256;
constexpr int kHeadsPerBlock = kRopeThreads / kGroup;  // one head per group of 32 lanes

struct RopeKvParams {
  float* qkv;
  int64_t ld;
  const int32_t* d_pos0;
  int32_t n_heads, n_kv, hd, n_dims;
  bool neox;
  const float* q_norm;   // null: no per-head norm
  const float* k_norm;
  float eps;
  const float* factors;  // device [n_dims/2] or null
  void* k_cache;
  void* v_cache;
  bool f16;
  int64_t n_ctx;
  double base_freq[kRopeMaxPairs];  // freq_scale * base^(-2i/n_dims), host-computed as cpu/rope.cpp
};

__device__ __forceinline__ void store_kv(void* cache, bool f16, int64_t idx, float v) {
  if (f16) static_cast<uint16_t*>(cache)[idx] = f32_to_f16_bits(v);
  else static_cast<float*>(cache)[idx] = v;
}

// ---- kernel

__global__ void __launch_bounds__(kRopeThreads) rope_kv_kernel(const RopeKvParams P) {
  // The position and its cos / sin table come before gpu_grid_wait() (programmatic dependent
  // launch, vendor.cuh), overlapping the end of the QKV product: d_pos0 is a forward input,
  // written before its first kernel, never by the kernel this one follows.
  __shared__ double cs[2 * kRopeMaxPairs];  // [half, (cos, sin)] of this row's position
  const int64_t r = blockIdx.y;
  const int64_t pos = (int64_t)*P.d_pos0 + r;
  const int half = P.n_dims / 2, hd = P.hd;
  const int head0 = blockIdx.x * kHeadsPerBlock;
  const int n_roped = P.n_heads + P.n_kv;  // q and k heads
  if (head0 < n_roped) {
    for (int i = threadIdx.x; i < half; i += kRopeThreads)
      rope_angle(P.base_freq, P.factors, pos, i, cs[2 * i], cs[2 * i + 1]);
  }
  gpu_grid_wait();
  gpu_grid_launch_dependents();
  __syncthreads();

  const int head = head0 + threadIdx.x / kGroup, lane = threadIdx.x % kGroup;
  if (head >= n_roped + P.n_kv) return;
  float* row = P.qkv + r * P.ld;
  const int64_t kvd = (int64_t)P.n_kv * hd;
  const bool cache_ok = pos >= 0 && pos < P.n_ctx;

  if (head >= n_roped) {  // v head: a plain copy into the cache
    const int g = head - n_roped;
    const float* src = row + (int64_t)head * hd;
    if (cache_ok)
      for (int d = lane; d < hd; d += kGroup) store_kv(P.v_cache, P.f16, pos * kvd + (int64_t)g * hd + d, src[d]);
    return;
  }

  const bool is_q = head < P.n_heads;
  if (!is_q && !cache_ok) return;
  const RopeShape R{hd, P.n_dims, P.neox, P.eps};
  auto table = [&](int i, double& c, double& s) {
    c = cs[2 * i];
    s = cs[2 * i + 1];
  };
  float* x = row + (int64_t)head * hd;
  if (is_q) {
    rope_head(R, x, P.q_norm, lane, table, [&](int d, float v) { x[d] = v; });
  } else {
    const int64_t kbase = pos * kvd + (int64_t)(head - P.n_heads) * hd;
    rope_head(R, x, P.k_norm, lane, table, [&](int d, float v) { store_kv(P.k_cache, P.f16, kbase + d, v); });
  }
}

}  // namespace

// ---- launcher

void rope_base_freq(const RopeParams& p, double* out) {
  const double log_base = std::log((double)p.freq_base);
  for (int i = 0; i < p.n_dims / 2; ++i) out[i] = (double)p.freq_scale * std::exp(-(double)(2 * i) / p.n_dims * log_base);
}

void rope_kv_check(const RopeKvArgs& a) {
  const RopeParams& p = a.rope;
  const std::string at = "rope_kv: ";
  if (a.n < 0) throw Error(at + "n must be >= 0, got " + std::to_string(a.n));
  if (a.n > 65535) throw Error(at + "at most 65535 rows per call, got " + std::to_string(a.n));
  if (a.n_heads <= 0 || a.n_kv_heads <= 0)
    throw Error(at + "n_heads and n_kv_heads must be > 0, got " + std::to_string(a.n_heads) + " and " +
                std::to_string(a.n_kv_heads));
  if (a.head_dim <= 0 || a.head_dim > kRopeMaxHeadDim)
    throw Error(at + "head_dim must be in [1, " + std::to_string(kRopeMaxHeadDim) + "], got " +
                std::to_string(a.head_dim));
  if (p.n_dims <= 0 || p.n_dims % 2 != 0 || p.n_dims > a.head_dim)
    throw Error(at + "rope n_dims must be even and in [2, head_dim=" + std::to_string(a.head_dim) + "], got " +
                std::to_string(p.n_dims));
  if (!(p.freq_base > 0.f) || !std::isfinite(p.freq_base) || !(p.freq_scale > 0.f) || !std::isfinite(p.freq_scale))
    throw Error(at + "freq_base and freq_scale must be positive and finite, got " + std::to_string(p.freq_base) +
                " and " + std::to_string(p.freq_scale));
  if (p.mode != RopeMode::Normal && p.mode != RopeMode::Neox)
    throw Error(at + "unknown rope mode " + std::to_string((int)p.mode) + " (0 = normal, 2 = neox)");
  const int64_t width = ((int64_t)a.n_heads + 2 * (int64_t)a.n_kv_heads) * a.head_dim;
  if (a.ld_qkv < width)
    throw Error(at + "ld_qkv (" + std::to_string(a.ld_qkv) + ") is shorter than a row of q|k|v (" +
                std::to_string(width) + " floats)");
  if ((a.q_norm == nullptr) != (a.k_norm == nullptr))
    throw Error(at + "q_norm and k_norm must be given together (qwen3) or not at all");
  if (!(a.eps >= 0.f)) throw Error(at + "eps must be >= 0, got " + std::to_string(a.eps));
  if (a.n_ctx <= 0) throw Error(at + "n_ctx must be > 0, got " + std::to_string(a.n_ctx));
  if (a.n > 0 && (!a.qkv || !a.d_pos0 || !a.k_cache || !a.v_cache))
    throw Error(at + "qkv, d_pos0, k_cache and v_cache must be device pointers, got a null one");
}

void rope_kv(const RopeKvArgs& a, gpuStream_t s) {
  rope_kv_check(a);
  if (a.n == 0) return;
  const RopeParams& p = a.rope;

  RopeKvParams P{};
  P.qkv = a.qkv;
  P.ld = a.ld_qkv;
  P.d_pos0 = a.d_pos0;
  P.n_heads = a.n_heads;
  P.n_kv = a.n_kv_heads;
  P.hd = a.head_dim;
  P.n_dims = p.n_dims;
  P.neox = p.mode == RopeMode::Neox;
  P.q_norm = a.q_norm;
  P.k_norm = a.k_norm;
  P.eps = a.eps;
  P.factors = p.freq_factors;
  P.k_cache = a.k_cache;
  P.v_cache = a.v_cache;
  P.f16 = a.kv_f16;
  P.n_ctx = a.n_ctx;
  rope_base_freq(p, P.base_freq);

  const int heads = a.n_heads + 2 * a.n_kv_heads;
  const dim3 grid((unsigned)ceil_div(heads, kHeadsPerBlock), (unsigned)a.n);
  gpu_launch("rope_kv_kernel", rope_kv_kernel, grid, dim3(kRopeThreads), 0, s, P);
}

// ---- testing entry point (cuda/testing.h)

namespace testing {

DeviceRopeKv::DeviceRopeKv(const char* op, const float* qkv_h, int64_t ld_qkv, int64_t n, int32_t pos0,
                           int32_t n_heads, int32_t n_kv_heads, int32_t head_dim, const float* q_norm_h,
                           const float* k_norm_h, float eps, const RopeParams& rope, const void* k_cache_h,
                           const void* v_cache_h, bool kv_f16, int64_t n_ctx) {
  if (pos0 < 0 || n < 0 || pos0 + n > n_ctx)
    throw Error(std::string(op) + ": positions " + std::to_string(pos0) + ".." + std::to_string(pos0 + n) +
                " do not fit the cache's " + std::to_string(n_ctx) + " rows");
  if (head_dim <= 0 || n_kv_heads <= 0) throw Error(std::string(op) + ": head_dim and n_kv_heads must be > 0");
  const size_t qkv_bytes = sizeof(float) * (size_t)(n * ld_qkv);
  const size_t cache_bytes = (kv_f16 ? 2 : 4) * (size_t)(n_ctx * n_kv_heads * head_dim);
  auto upload = [](DeviceBuffer& d, const void* h, size_t bytes) -> void* {
    if (!h || bytes == 0) return nullptr;
    d.resize(bytes);
    to_device(d.get(), h, bytes);
    return d.get();
  };
  args.qkv = static_cast<float*>(upload(qkv, qkv_h, qkv_bytes));
  args.ld_qkv = ld_qkv;
  args.n = n;
  args.d_pos0 = static_cast<const int32_t*>(upload(pos, &pos0, sizeof(int32_t)));
  args.n_heads = n_heads;
  args.n_kv_heads = n_kv_heads;
  args.head_dim = head_dim;
  args.q_norm = static_cast<const float*>(upload(q_norm, q_norm_h, sizeof(float) * (size_t)head_dim));
  args.k_norm = static_cast<const float*>(upload(k_norm, k_norm_h, sizeof(float) * (size_t)head_dim));
  args.eps = eps;
  args.rope = rope;
  args.rope.freq_factors =
      static_cast<const float*>(upload(factors, rope.freq_factors, sizeof(float) * (size_t)(rope.n_dims / 2)));
  args.k_cache = upload(k_cache, k_cache_h, cache_bytes);
  args.v_cache = upload(v_cache, v_cache_h, cache_bytes);
  args.kv_f16 = kv_f16;
  args.n_ctx = n_ctx;
}

void DeviceRopeKv::caches_to_host(void* k_cache_h, void* v_cache_h) const {
  to_host(k_cache_h, k_cache.get(), k_cache.size());
  to_host(v_cache_h, v_cache.get(), v_cache.size());
}

void rope_kv(float* qkv, int64_t ld_qkv, int64_t n, int32_t pos0, int32_t n_heads, int32_t n_kv_heads,
             int32_t head_dim, const float* q_norm, const float* k_norm, float eps, const RopeParams& rope,
             void* k_cache, void* v_cache, bool kv_f16, int64_t n_ctx) {
  DeviceRopeKv d("rope_kv", qkv, ld_qkv, n, pos0, n_heads, n_kv_heads, head_dim, q_norm, k_norm, eps, rope, k_cache,
                 v_cache, kv_f16, n_ctx);
  gpu::rope_kv(d.args, nullptr);
  SPECD_GPU_CHECK(gpuDeviceSynchronize());
  to_host(qkv, d.qkv.get(), d.qkv.size());
  d.caches_to_host(k_cache, v_cache);
}

}  // namespace testing
}  // namespace gpu
}  // namespace specd
