// specd/cuda/rope_kv.cuh: the step between the QKV projection and attention, in one kernel:
// per-head RMSNorm of q and k (qwen3), RoPE on q and k, and the K/V cache write.
#pragma once
#include <cstdint>

#include "cpu/ops.h"  // RopeParams, RopeMode
#include "cuda/common.cuh"

namespace specd {
namespace gpu {

struct RopeKvArgs {
  // Row r (r < n) of qkv holds [q (n_heads*hd) | k (n_kv_heads*hd) | v (n_kv_heads*hd)]
  // for position *d_pos0 + r; rows are ld_qkv floats apart. q is normed/roped IN PLACE.
  float* qkv = nullptr;             // device
  int64_t ld_qkv = 0;
  int64_t n = 0;
  const int32_t* d_pos0 = nullptr;  // device scalar (read on the device: graph-capturable)
  int32_t n_heads = 0, n_kv_heads = 0, head_dim = 0;
  const float* q_norm = nullptr;    // optional device [hd]: RMSNorm of each q head, then * q_norm
  const float* k_norm = nullptr;    // optional device [hd], given together with q_norm
  float eps = 0.f;
  RopeParams rope;                  // rope.freq_factors, if set, is a DEVICE pointer [n_dims/2]
  // This layer's cache: row p = position p, n_kv_heads*hd elements, fp16 bits or float.
  void* k_cache = nullptr;
  void* v_cache = nullptr;
  bool kv_f16 = true;
  int64_t n_ctx = 0;                // rows in the cache (positions must stay below it)
};

// ---- one head, on the device (rope_kv_kernel, and attention.cu where it takes this step over)

constexpr int kRopeMaxHeadDim = 256;
constexpr int kRopeMaxPairs = kRopeMaxHeadDim / 2;

struct RopeShape {
  int32_t hd = 0, n_dims = 0;
  bool neox = false;
  float eps = 0.f;
};

// freq_scale * base^(-2i/n_dims) for i < n_dims/2, with the CPU's expression (cpu/rope.cpp,
// same libm): identical doubles.
void rope_base_freq(const RopeParams& p, double* out /* [kRopeMaxPairs] */);

// Theta of pair i at position pos, its cos and sin (double): pos * (base_freq[i] / factor_i).
__device__ __forceinline__ void rope_angle(const double* base_freq, const float* factors, int64_t pos, int i,
                                           double& c, double& s) {
  const double factor = factors ? (double)factors[i] : 1.0;
  sincos((double)pos * (base_freq[i] / factor), &s, &c);
}

// One q or k head x [hd] through the optional per-head RMSNorm (nw [hd]; sum of squares and
// 1/rms in double, x * inv * w in float) and RoPE (rotation in double without fused
// multiply-adds, rounded to float once), by the 32 lanes of a group: lane owns pairs
// i = lane + 32 j and pass-through dims n_dims + lane + 32 j. cossin(i, c, s) gives pair i's
// angle; out(d, value) receives every output element d < hd once. Every lane of the group
// must call it (the norm's sum is a group reduction). MAX_HD >= hd bounds the registers (the
// sums only gain exact zeros from a larger one: the same bits).
template <int MAX_HD = kRopeMaxHeadDim, class CosSin, class Out>
__device__ __forceinline__ void rope_head(const RopeShape& R, const float* x, const float* nw, int lane,
                                          CosSin cossin, Out out) {
  constexpr int kRopePairsPerLane = (MAX_HD / 2 + kGroup - 1) / kGroup;  // pairs lane + 32 j
  constexpr int kRopePassPerLane = (MAX_HD + kGroup - 1) / kGroup;       // pass-through dims (n_dims >= 2)
  const int half = R.n_dims / 2, hd = R.hd;
  // Element indices of pair i: Normal (2i, 2i+1), Neox (i, i + half).
  const int stride_i = R.neox ? 1 : 2, partner = R.neox ? half : 1;
  float a[kRopePairsPerLane], b[kRopePairsPerLane], t[kRopePassPerLane];
#pragma unroll
  for (int j = 0; j < kRopePairsPerLane; ++j) {
    const int i = lane + kGroup * j;
    a[j] = i < half ? x[i * stride_i] : 0.f;
    b[j] = i < half ? x[i * stride_i + partner] : 0.f;
  }
#pragma unroll
  for (int j = 0; j < kRopePassPerLane; ++j) {
    const int d = R.n_dims + lane + kGroup * j;
    t[j] = d < hd ? x[d] : 0.f;
  }
  if (nw) {  // per-head RMSNorm before RoPE (qwen3)
    double ss = 0.0;
#pragma unroll
    for (int j = 0; j < kRopePairsPerLane; ++j) ss = fma((double)a[j], (double)a[j], fma((double)b[j], (double)b[j], ss));
#pragma unroll
    for (int j = 0; j < kRopePassPerLane; ++j) ss = fma((double)t[j], (double)t[j], ss);
    ss = group_sum(ss);
    const float inv = (float)(1.0 / sqrt(ss / (double)hd + (double)R.eps));
#pragma unroll
    for (int j = 0; j < kRopePairsPerLane; ++j) {
      const int i = lane + kGroup * j;
      if (i < half) {
        a[j] = a[j] * inv * nw[i * stride_i];
        b[j] = b[j] * inv * nw[i * stride_i + partner];
      }
    }
#pragma unroll
    for (int j = 0; j < kRopePassPerLane; ++j) {
      const int d = R.n_dims + lane + kGroup * j;
      if (d < hd) t[j] = t[j] * inv * nw[d];
    }
  }
#pragma unroll
  for (int j = 0; j < kRopePairsPerLane; ++j) {
    const int i = lane + kGroup * j;
    if (i < half) {
      double c, s;
      cossin(i, c, s);
      const double da = a[j], db = b[j];
      out(i * stride_i, (float)__dsub_rn(__dmul_rn(da, c), __dmul_rn(db, s)));
      out(i * stride_i + partner, (float)__dadd_rn(__dmul_rn(da, s), __dmul_rn(db, c)));
    }
  }
#pragma unroll
  for (int j = 0; j < kRopePassPerLane; ++j) {
    const int d = R.n_dims + lane + kGroup * j;
    if (d < hd) out(d, t[j]);
  }
}

// ---- launcher

// Angles and rotation as the CPU reference (cpu/rope.cpp): theta = pos * freq_scale *
// base^(-2i/n_dims) / factor_i, cos/sin and the rotation in double (q and k come out bit-equal
// to the CPU's); fp16 cache values round to nearest even.
void rope_kv(const RopeKvArgs& a, gpuStream_t s);

// rope_kv's argument checks alone (attention.cu, which can take this step over): throws
// specd::Error saying what is wrong.
void rope_kv_check(const RopeKvArgs& a);

namespace testing {

// rope_kv's host inputs copied to the device, for the tests' entry points (cuda/testing.h:
// rope_kv, rope_attention); args points into the owned buffers. Throws, naming `op`, when the
// positions pos0 .. pos0 + n do not fit the cache's n_ctx rows or a size is not positive.
struct DeviceRopeKv {
  DeviceBuffer qkv, k_cache, v_cache, pos, q_norm, k_norm, factors;
  RopeKvArgs args;

  DeviceRopeKv(const char* op, const float* qkv, int64_t ld_qkv, int64_t n, int32_t pos0, int32_t n_heads,
               int32_t n_kv_heads, int32_t head_dim, const float* q_norm, const float* k_norm, float eps,
               const RopeParams& rope, const void* k_cache, const void* v_cache, bool kv_f16, int64_t n_ctx);
  void caches_to_host(void* k_cache, void* v_cache) const;  // [n_ctx, n_kv*hd] each
};

}  // namespace testing

}  // namespace gpu
}  // namespace specd
