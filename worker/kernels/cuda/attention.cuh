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
// One query (decode, n = 1) runs attn_decode_kernel instead where it applies (GQA groups of up
// to 8, shared memory for a ring of 4 K/V sub-tiles or a whole chunk's): the same arithmetic in
// the same order, so the same bits, with the work spread for one query and the chunk's cached
// rows copied before the grid wait (attention.cu). SPECD_GPU_DEC_ATTN=0 keeps decode on the
// general kernel (benchmarks).
//
// Prefills (n > 64 queries) with an fp16 cache and head_dim 64 or 128 on NVIDIA sm_80+ take
// another kernel instead (attention_tc.cu: FlashAttention-2 on tensor cores, q and the
// softmax weights rounded to fp16, relative error ~1e-3, not batch-invariant; its rows only
// feed that prefill). SPECD_GPU_FLASH=0 keeps every n on the kernels above (benchmarks).
#pragma once
#include <cstddef>
#include <cstdint>

#include "cuda/common.cuh"
#include "cuda/rope_kv.cuh"

namespace specd {
namespace gpu {

#ifndef SPECD_ATTN_CHUNK
#define SPECD_ATTN_CHUNK 256
#endif
constexpr int64_t kAttnChunk = SPECD_ATTN_CHUNK;  // (a multiple of 64; -D for experiments)
static_assert(kAttnChunk % 64 == 0 && kAttnChunk <= 256, "attention chunk");
#ifndef SPECD_ATTN_APART_FROM
#define SPECD_ATTN_APART_FROM 256
#endif
// The position from which a decode step combines the chunks in a launch of its own
// (AttnArgs::combine_apart; -D for experiments; past kAttnChunk only: before it there is one
// chunk and nothing to combine). Below it the decode kernel's last block of a KV head combines
// them. Chunks of 64 positions (combined apart from 64; H100, 2026-12-07,
// `..._20261207_chunks.md`) made steps at 1000 positions 6.5 % (8B Q4_K_M) and 17 % (0.6B
// Q8_0) shorter, but those at 64 5-7 % longer, and were level at 4000.
constexpr int64_t kAttnApartFrom = SPECD_ATTN_APART_FROM;
// Calls of at most this many queries take rope_kv's step inside the attention kernel (below):
// decode. (Measured on the H200, 20261201: fused 16-row verifies were 5-15 % slower, the block's
// eight warps norming and roping up to 96 heads one after another.)
constexpr int64_t kAttnMaxFusedRows = 1;

struct AttnArgs {
  const float* q = nullptr;         // device: query r's heads at q + r*ld_q, [n_heads, hd]
  int64_t ld_q = 0;                 // floats between query rows (0: n_heads*hd)
  void* k_cache = nullptr;          // device [n_ctx, n_kv_heads*hd], fp16 bits or float
  void* v_cache = nullptr;          // (written only with `rope`)
  bool kv_f16 = true;
  int64_t n_ctx = 0;
  int64_t n = 0;
  const int32_t* d_pos0 = nullptr;  // device scalar: position of query 0 (read on the device)
  int32_t n_heads = 0, n_kv_heads = 0, head_dim = 0;  // head_dim <= 256
  float scale = 1.f;
  float* out = nullptr;             // device [n, n_heads*hd]
  void* work = nullptr;             // device scratch of attention_workspace_bytes(...) bytes,
                                    // zeroed once when allocated (its counters come back to 0)
  // Set: rope_kv(*rope) comes first, as part of this call (q = rope->qkv, ld_q = rope->ld_qkv,
  // the same rows, positions, heads and caches). With at most kAttnMaxFusedRows queries
  // (decode) it runs inside the attention kernel, saving a launch: each block tables the
  // position's angles before waiting for the QKV product, norms and ropes the q heads it stages
  // and the new K/V row of its chunk with rope_kv's own device code (rope_head), substitutes
  // that row for the cache's, and the block whose tile holds a query's first head writes its
  // K/V row to the cache. Bits equal rope_kv then attention. Otherwise (or where shared memory
  // is short) rope_kv's kernel runs first.
  const RopeKvArgs* rope = nullptr;
  // Decode (one query) past the first chunk: the chunks' combine in its own launch rather than
  // folded into the decode kernel (the last block of a KV head combining): the combine's blocks
  // start early and spread over the heads (H200, 8B Q4_K_M: steps 1.2-2.7 % shorter at 300-4000
  // positions), but before position kAttnChunk the launch has nothing to do (2.9 % longer
  // steps), so the caller, which knows the position, sets it (its decode graphs keyed on it).
  // The same bits either way.
  bool combine_apart = false;
};

// The arguments of attention over rope_kv(r)'s rows: q = r.qkv at its stride, the same rows,
// positions, heads and caches, rope = &r (which must outlive the call). The caller adds scale,
// out and work.
AttnArgs attention_args(const RopeKvArgs& r);

// Scratch needed for these sizes (0 allowed for none).
size_t attention_workspace_bytes(int64_t n, int64_t n_ctx, int32_t n_heads, int32_t head_dim);

// Launch shapes depend only on (n, n_ctx, heads, head_dim): graph-capturable; chunks past
// the live length do no work.
void attention(const AttnArgs& a, gpuStream_t s);

}  // namespace gpu
}  // namespace specd
