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

// Angles and rotation as the CPU reference (cpu/rope.cpp): theta = pos * freq_scale *
// base^(-2i/n_dims) / factor_i, cos/sin and the rotation in double (q and k come out bit-equal
// to the CPU's); fp16 cache values round to nearest even.
void rope_kv(const RopeKvArgs& a, gpuStream_t s);

}  // namespace gpu
}  // namespace specd
