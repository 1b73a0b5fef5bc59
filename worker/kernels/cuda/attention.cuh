// specd/cuda/attention.cuh: causal grouped-query attention of n new queries over the KV
// cache (decode n = 1, speculative verify n = k+1, prefill chunks), flash-decoding style.
//
// Query r (position p = *d_pos0 + r) of head h reads KV head g = h / (n_heads/n_kv_heads)
// at positions 0..p. Positions are cut into chunks of kAttnChunk at FIXED boundaries
// (multiples of kAttnChunk); each (query, head, chunk) gives a partial (m = max score,
// l = sum exp(s - m), o = sum exp(s - m) V), and a query's partials are combined in
// ascending chunk order. So a query's output depends only on its position and the cache,
// never on n or on the launch shape: BATCH-INVARIANT (bit-identical for decode and verify),
// which lossless speculative decoding needs.
//
// Prefills (n > 64 queries) with an fp16 cache and head_dim 64 or 128 on NVIDIA sm_80+ take
// another kernel instead (attention_tc.cu: FlashAttention-2 on tensor cores, q and the
// softmax weights rounded to fp16, relative error ~1e-3, not batch-invariant; its rows only
// feed that prefill). SPECD_GPU_FLASH=0 keeps every n on the kernels above (benchmarks).
#pragma once
#include <cstddef>
#include <cstdint>

#include "cuda/common.cuh"

namespace specd {
namespace gpu {

constexpr int64_t kAttnChunk = 256;

struct AttnArgs {
  const float* q = nullptr;         // device [n, n_heads, hd]
  const void* k_cache = nullptr;    // device [n_ctx, n_kv_heads*hd], fp16 bits or float
  const void* v_cache = nullptr;
  bool kv_f16 = true;
  int64_t n_ctx = 0;
  int64_t n = 0;
  const int32_t* d_pos0 = nullptr;  // device scalar: position of query 0 (read on the device)
  int32_t n_heads = 0, n_kv_heads = 0, head_dim = 0;  // head_dim <= 256
  float scale = 1.f;
  float* out = nullptr;             // device [n, n_heads*hd]
  void* work = nullptr;             // device scratch of attention_workspace_bytes(...) bytes
};

// Scratch needed for these sizes (0 allowed for none).
size_t attention_workspace_bytes(int64_t n, int64_t n_ctx, int32_t n_heads, int32_t head_dim);

// Launch shapes depend only on (n, n_ctx, heads, head_dim): graph-capturable; chunks past
// the live length do no work.
void attention(const AttnArgs& a, gpuStream_t s);

}  // namespace gpu
}  // namespace specd
