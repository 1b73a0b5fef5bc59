// specd/cuda/attention.cu: causal grouped-query attention over the KV cache, flash-decoding
// with FIXED chunk boundaries (see attention.cuh). For query row r (position p = *d_pos0 + r),
// head h, KV head g = h / group and chunk c (positions j in [256c, min(256c + 256, p + 1))):
//   s_j = scale * dot(q, K_j)        dot = (a0 + a1) + (a2 + a3), a_k = sequential fmaf chain
//                                     over the dims d = k mod 4, ascending
//   m   = max_j s_j                   (exact)
//   p_j = exp(s_j - m)                (s_j - m taken exactly, ~2 ulp; 0 past the causal end)
//   l   = butterfly over 32 lanes of each lane's ascending sum of p_{lane + 32k}, k < 8
//   o   = sum_j p_j V_j               sequential fmaf chain over j ascending
// A query with one chunk (p < 256) is finished in place: out = o / l. Otherwise the partials
// (m_c, l_c, o_c) go to the workspace and the last block to finish a (row tile, KV head)'s
// chunks combines its rows (an atomic count per tile; a separate combine kernel where the
// block's shared memory is too small for the chunk count, or with SPECD_GPU_FOLD=0):
//   M = max_c m_c,  w_c = exp(m_c - M),  out = (sum_c w_c o_c) / (sum_c w_c l_c)
// each sum taken as K interleaved fmaf chains (c = k mod K, ascending) added in k order,
// K = 256 / (head_dim/4). Every step's order is fixed by the query's position, its head and
// head_dim alone, never by n, by the other rows sharing a block, by the block shape or by the
// launch shape: outputs are BATCH-INVARIANT (bit-identical for decode, speculative verify and
// prefill), which lossless speculative decoding needs.
//
// Partial kernel: a persistent grid of min(items, 2 blocks per SM), 256 threads; an item is
// (chunk, KV head, tile of up to RMAX "rows" = (query, query head of this KV head) pairs), so
// each K/V element is loaded and converted once for the whole GQA group and all queries of the
// tile. Items run chunk-major and a block stops at the first chunk past the last position, so
// dead chunks cost nothing while the grid depends only on (n, n_ctx, heads, head_dim) and the
// device; positions are read on the device (graph-capturable). The chunk is streamed through
// shared memory in sub-tiles of ST positions (K, then V), each loaded to registers one step
// ahead of its use (the next item's first K sub-tile during the current item's last step):
//   phase 1  scores S[row, j]: a thread holds NI rows x 2 positions (lane + 32u); with fewer
//            than 8 rows, the warps also split the positions
//   phase 2  softmax statistics: a warp per row, lane -> positions lane + 32k
//   phase 3  o[row, 4 dims]: thread -> dims 4*(t % (HD/4)), rows t / (HD/4) + SLOTS*i
// head_dim is padded to HD in {64, 128, 256} with zeros (exact: 0 * 0 adds nothing). Block
// shapes (RMAX, ST): "Dec" for <= 8-16 rows (decode, short verify: long sub-tiles), "Big" for
// more rows (sm_80+), "Small" where shared memory is 64 KiB (sm_75, AMD); none changes a result.
// Combine (combine_row; in the decode kernel combine_rows, a KV head's query heads together, the
// same operations per head): 256 threads per (query, head), in the partial kernel's last block of
// the tile or in its own kernel, grid (n_heads, queries).
//
// Decode (one query) takes attn_decode_kernel where it applies (see its comment): the same
// steps in the same order, its work spread over a block per (chunk, KV head) for one query.
//
// Long prefills are cut into launches of at most kMaxQueriesPerLaunch queries (fewer for very
// long contexts) so the workspace stays bounded; queries are independent, so this changes no
// result either.
#include <algorithm>
#include <string>

#include "cuda/attention.cuh"
#include "cuda/mma.cuh"
#include "cuda/testing.h"
#include "cuda/trace.cuh"

namespace specd {
namespace gpu {

// attention_tc.cu: a prefill (n > kMaxSmallBatch) with an fp16 cache and head_dim 64 or 128
// on NVIDIA sm_80+ (SPECD_GPU_FLASH=0: never), FlashAttention-2 on tensor cores; false when
// it does not apply (then the kernels below run).
bool attention_prefill_tc(const AttnArgs& a, gpuStream_t s);

namespace {

constexpr int kAttnThreads = 256;
constexpr int kWarps = kAttnThreads / kGroup;   // 8 groups of 32 lanes
constexpr int kChunk = (int)kAttnChunk;         // 256 positions
constexpr int kMaxQueriesPerLaunch = 32;
constexpr size_t kWorkBudget = size_t(64) << 20;  // workspace bytes aimed at for long contexts

constexpr float kLog2e = 1.44269502162933349609375f;  // float(log2 e)
constexpr float kLog2eLo = 1.925963033500011e-08f;     // log2 e - kLog2e
constexpr float kLn2 = 0.693147180559945309f;

// exp(x - c) for x <= c, with x - c taken exactly (TwoSum) and 2^t corrected for the rounding
// of t = (x - c) log2 e: about 2 ulp (exp2f's), independent of |x - c|. 0 below e^-104.
__device__ __forceinline__ float exp_diff(float x, float c) {
  const float d = __fsub_rn(x, c);
  if (d < -104.f) return 0.f;
  const float bb = __fsub_rn(d, x);
  const float err = __fadd_rn(__fsub_rn(x, __fsub_rn(d, bb)), __fsub_rn(-c, bb));  // (x - c) - d, exact
  const float t = __fmul_rn(d, kLog2e);
  const float e = fmaf(err, kLog2e, fmaf(d, kLog2eLo, fmaf(d, kLog2e, -t)));      // (x - c) log2 e - t
  const float y = exp2f(t);
  return fmaf(y, __fmul_rn(e, kLn2), y);
}

__device__ __forceinline__ int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

__device__ __forceinline__ void fma4(float4& a, float s, const float4& v) {
  a.x = fmaf(s, v.x, a.x);
  a.y = fmaf(s, v.y, a.y);
  a.z = fmaf(s, v.z, a.z);
  a.w = fmaf(s, v.w, a.w);
}
__device__ __forceinline__ float comp(const float4& v, int k) { return k == 0 ? v.x : k == 1 ? v.y : k == 2 ? v.z : v.w; }

// Block shape per (head_dim padding HD, rows per block RMAX, positions per sub-tile ST,
// blocks per multiprocessor the registers are budgeted for MINB).
template <int HD_, int RMAX_, int ST_, int MINB_ = 2>
struct Cfg {
  static constexpr int HD = HD_, RMAX = RMAX_, ST = ST_ < kChunk ? ST_ : kChunk, MINB = MINB_;
  static constexpr int HDP = HD + 4;
  // loop unrolling where the registers allow it (few rows per thread)
  static constexpr int UNROLL1 = RMAX <= 16 ? 2 : 1, UNROLL3 = RMAX <= 16 ? 2 : 1;          // padded row of a K/V tile in floats (no bank conflicts)
  static constexpr int NU = ST / kGroup;      // phase 1: positions per thread
  static constexpr int NI1 = RMAX / kWarps;   // phase 1/2: rows per warp
  static constexpr int SLOTS = kAttnThreads / (HD / 4);  // phase 3: row slots
  static constexpr int NI3 = RMAX / SLOTS;    // phase 3: rows per thread
  // shared floats: q [RMAX, HD] | S [RMAX, 256] | tile [ST, HDP] | m, l [RMAX, 2]
  static constexpr int kQ = 0, kS = RMAX * HD, kTile = kS + RMAX * kChunk, kMl = kTile + ST * HDP;
  static constexpr size_t kSmemBytes = sizeof(float) * (size_t)(kMl + 2 * RMAX) + sizeof(int) * 2 * RMAX;
  static_assert(NI1 >= 1 && NI3 >= 1 && NU >= 1 && RMAX % kWarps == 0 && RMAX % SLOTS == 0, "block shape");
};

struct AttnParams {
  const float* q;      // query r at q + r*ld_q: [n_heads, hd] (fuse: the raw row [q | k | v])
  int64_t ld_q;
  const void* k;       // [n_ctx, n_kv*hd]
  const void* v;
  float* out;          // [n, n_heads, hd]
  float* work_o;       // [nq, n_heads, n_chunks, hd] partial o (multi-chunk queries)
  float* work_ml;      // [nq, n_heads, n_chunks, 2] partial (m, l)
  const int32_t* d_pos0;
  int32_t n_ctx;       // <= 2^21
  int32_t r0;          // first query row of this launch
  int32_t nq;          // query rows in this launch
  int32_t n_heads, n_kv, group, hd, n_chunks;
  int32_t n_tiles;     // row tiles of the block shape in use
  float scale;
  int32_t fold;        // 1: the partial kernel combines (the last block of a tile's chunks)
  int32_t apart;       // decode: never fold (AttnArgs::combine_apart)
  int* counters;       // [n_tiles, n_kv] blocks done per (row tile, KV head); 0 between launches
  // rope_kv's step fused in (attention.cuh: AttnArgs::rope), when fuse != 0
  int32_t fuse;
  RopeShape rs;
  const float* q_norm;  // [hd] or null
  const float* k_norm;
  const float* factors; // [n_dims/2] or null
  void* kw;             // the caches, written: the new rows
  void* vw;
  double base_freq[kRopeMaxPairs];
};

// Shared memory of the fused step past the block shape's own: the angles (cos, sin) of the
// position [kRopeMaxPairs, 2] (double), then the new K and V rows, [kAttnMaxFusedRows, hd]
// each, as the cache stores them (fp16 bits or float).
template <class C, class KvT>
struct Fresh {
  static constexpr size_t kOff = (C::kSmemBytes + 15) / 16 * 16;
  static constexpr size_t kAngles = 2 * kRopeMaxPairs * sizeof(double);
  static constexpr size_t kRow = (size_t)C::HD * sizeof(KvT);
  static constexpr size_t kBytes = kAngles + 2 * (size_t)kAttnMaxFusedRows * kRow;
};

template <class KvT>
__device__ __forceinline__ KvT to_kv(float v);
template <>
__device__ __forceinline__ uint16_t to_kv<uint16_t>(float v) { return f32_to_f16_bits(v); }  // nearest even
template <>
__device__ __forceinline__ float to_kv<float>(float v) { return v; }

// 16 bytes of cache elements (8 fp16 or 4 float) as floats, exactly.
template <class KvT>
__device__ __forceinline__ void kv_unit_floats(const uint4& x, float (&f)[16 / sizeof(KvT)]) {
  if constexpr (sizeof(KvT) == 2) {
    const uint32_t w[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const float2 t = __half22float2(*reinterpret_cast<const __half2*>(&w[k]));
      f[2 * k] = t.x;
      f[2 * k + 1] = t.y;
    }
  } else {
    f[0] = __uint_as_float(x.x);
    f[1] = __uint_as_float(x.y);
    f[2] = __uint_as_float(x.z);
    f[3] = __uint_as_float(x.w);
  }
}

// A sub-tile of ST cache rows (one KV head, dims padded to HD) in registers, 16 bytes a load,
// then converted to float into shared memory. Rows >= jend and dims >= hd are zeros.
template <class C, class KvT>
struct TileRegs {
  static constexpr int VEC = 16 / (int)sizeof(KvT);       // elements per 16-byte load
  static constexpr int VPR = C::HD / VEC;                 // loads per (padded) row
  static constexpr int NV = C::ST * VPR / kAttnThreads;   // loads per thread
  static_assert(NV >= 1 && C::ST * VPR % kAttnThreads == 0, "tile loads");
  uint4 r[NV];

  __device__ __forceinline__ void load(const KvT* cache, int ld, int col0, int hd, int j0, int jend) {
#pragma unroll
    for (int i = 0; i < NV; ++i) {
      const int v = threadIdx.x + kAttnThreads * i, jj = v / VPR, d = (v % VPR) * VEC;
      const int j = j0 + jj;
      r[i] = (j < jend && d < hd) ? *reinterpret_cast<const uint4*>(cache + (int64_t)j * ld + col0 + d)
                                  : make_uint4(0, 0, 0, 0);
    }
  }
  // fresh (fused step): rows j in [jnew, jend) of this sub-tile (first row j0) are taken from
  // fresh [j - jnew, hd] instead (the loads stopped at jnew).
  __device__ __forceinline__ void store(float* tile, const KvT* fresh, int hd, int j0, int jnew, int jend) const {
#pragma unroll
    for (int i = 0; i < NV; ++i) {
      const int v = threadIdx.x + kAttnThreads * i, jj = v / VPR, d = (v % VPR) * VEC;
      float* dst = tile + jj * C::HDP + d;
      uint4 x = r[i];
      if (fresh != nullptr && j0 + jj >= jnew && j0 + jj < jend)
        x = d < hd ? *reinterpret_cast<const uint4*>(fresh + (int64_t)(j0 + jj - jnew) * hd + d) : make_uint4(0, 0, 0, 0);
      float f[VEC];
      kv_unit_floats<KvT>(x, f);
#pragma unroll
      for (int k = 0; k < VEC; k += 4) *reinterpret_cast<float4*>(dst + k) = make_float4(f[k], f[k + 1], f[k + 2], f[k + 3]);
    }
  }
};

// Phase 1 for NI rows rb + rs*i and the positions lane + 32u of a sub-tile at offset joff,
// u = u_first, u_first + u_step, ... (two at a time for registers; u_step 2*k).
template <class C, int NI>
__device__ __forceinline__ void scores(const float* qs, const float* tile, float* S, int rb, int rs, int u_first,
                                       int u_step, int lane, int joff, float scale) {
  constexpr int UB = C::NU < 2 ? C::NU : 2;
#pragma unroll 1
  for (int u0 = u_first; u0 < C::NU; u0 += u_step) {
    float4 acc[NI][UB];
#pragma unroll
    for (int i = 0; i < NI; ++i)
#pragma unroll
      for (int u = 0; u < UB; ++u) acc[i][u] = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll C::UNROLL1
    for (int d = 0; d < C::HD; d += 4) {
      float4 k[UB];
#pragma unroll
      for (int u = 0; u < UB; ++u)
        k[u] = *reinterpret_cast<const float4*>(tile + (lane + kGroup * (u0 + u)) * C::HDP + d);
#pragma unroll
      for (int i = 0; i < NI; ++i) {
        const float4 q = *reinterpret_cast<const float4*>(qs + (rb + rs * i) * C::HD + d);
#pragma unroll
        for (int u = 0; u < UB; ++u) {
          acc[i][u].x = fmaf(q.x, k[u].x, acc[i][u].x);
          acc[i][u].y = fmaf(q.y, k[u].y, acc[i][u].y);
          acc[i][u].z = fmaf(q.z, k[u].z, acc[i][u].z);
          acc[i][u].w = fmaf(q.w, k[u].w, acc[i][u].w);
        }
      }
    }
#pragma unroll
    for (int i = 0; i < NI; ++i)
#pragma unroll
      for (int u = 0; u < UB; ++u) {
        const float4 a = acc[i][u];
        S[(rb + rs * i) * kChunk + joff + lane + kGroup * (u0 + u)] =
            __fmul_rn(__fadd_rn(__fadd_rn(a.x, a.y), __fadd_rn(a.z, a.w)), scale);
      }
  }
}

// Phase 3 for NI rows (slot + SLOTS i), 4 dims at d: acc[i] += sum_j p[row, joff + j] V_j, j ascending.
template <class C, int NI>
__device__ __forceinline__ void weighted(const float* S, const float* tile, float4* acc, int slot, int d, int joff) {
#pragma unroll C::UNROLL3
  for (int j = 0; j < C::ST; j += 4) {
    float4 p[NI];
#pragma unroll
    for (int i = 0; i < NI; ++i) p[i] = *reinterpret_cast<const float4*>(S + (slot + C::SLOTS * i) * kChunk + joff + j);
#pragma unroll
    for (int jj = 0; jj < 4; ++jj) {
      const float4 v = *reinterpret_cast<const float4*>(tile + (j + jj) * C::HDP + d);
#pragma unroll
      for (int i = 0; i < NI; ++i) fma4(acc[i], comp(p[i], jj), v);
    }
  }
}

// Phase 2 of both kernels, one row of a chunk's scores by a warp: Sr [256] holds the scores of
// the row's `valid` live positions; m = their max, p_j = exp(s_j - m) in place (0 past valid),
// l = butterfly over the lanes of each lane's ascending sum of p_{lane + 32k}; ml = (m, l).
// kCompact re-reads the scores instead of keeping them in registers (attn_decode_kernel's code
// stays small); the same operations either way.
template <bool kCompact>
__device__ __forceinline__ void chunk_softmax(float* Sr, int valid, int lane, float* ml) {
  constexpr int kPer = kChunk / kGroup, kUnroll = kCompact ? 1 : kPer;
  float sv[kCompact ? 1 : kPer];
  float m = -INFINITY;
#pragma unroll kUnroll
  for (int k = 0; k < kPer; ++k) {
    const int j = lane + kGroup * k;
    const float x = j < valid ? Sr[j] : -INFINITY;
    if constexpr (!kCompact) sv[k] = x;
    m = fmaxf(m, x);
  }
  m = group_max(m);
  float l = 0.f;
#pragma unroll kUnroll
  for (int k = 0; k < kPer; ++k) {
    const int j = lane + kGroup * k;
    float x;
    if constexpr (kCompact) x = Sr[j];
    else x = sv[k];
    const float p = j < valid ? exp_diff(x, m) : 0.f;
    Sr[j] = p;
    l = __fadd_rn(l, p);
  }
  l = group_sum(l);
  if (lane == 0) {
    ml[0] = m;
    ml[1] = l;
  }
}

// The fold's arrival (threadFenceReduction): every thread of the block calls it once its
// partials are written; true, in every thread, in the last of n blocks to arrive at *count,
// which it resets to 0 for the next launch. Partials are fenced before the count and must be
// read from L2 after it (gpu_load_l2). flag: a shared int the block may overwrite.
__device__ __forceinline__ bool fold_last(int* count, int n, int* flag) {
  __threadfence();
  __syncthreads();  // every partial of this block written (and shared memory free)
  if (threadIdx.x == 0) {
    const bool last = atomicAdd(count, 1) == n - 1;
    if (last) *count = 0;  // every other block is done with it: ready for the next launch
    *flag = last;
  }
  __syncthreads();
  const bool last = *flag != 0;
  if (last) __threadfence();
  return last;
}

// ---- kernels

// One work item: (chunk c, KV head g, row tile) of a launch. Items run chunk-major, so the live
// ones (c <= the last position's chunk) come first and spread evenly over the persistent grid.
struct Item {
  int c, g, row0, R;  // rows [row0, row0 + R) of (query, head within the group), query-major
  int j0, jend;       // chunk start; cache rows the item reads end at jend
  int nsub;           // sub-tiles of ST positions
};

template <class C>
__device__ __forceinline__ bool item_of(const AttnParams& P, int64_t item, int pos0, Item& it) {
  const int per_c = P.n_kv * P.n_tiles;
  it.c = (int)(item / per_c);
  const int rest = (int)(item % per_c);
  it.g = rest % P.n_kv;
  it.row0 = (rest / P.n_kv) * C::RMAX;
  it.R = min(C::RMAX, P.nq * P.group - it.row0);
  it.j0 = it.c * kChunk;
  const int p_max = pos0 + (it.row0 + it.R - 1) / P.group;  // the tile's last position
  if (it.j0 > p_max) return false;                           // past every row's causal end
  it.jend = min(p_max + 1, P.n_ctx);
  it.nsub = (min(kChunk, it.jend - it.j0) + C::ST - 1) / C::ST;
  return true;
}

// The fused step for one item (a warp per head): the q heads of its rows, normed and roped into
// qs (zero-padded to HD), and the new K / V rows of its chunk (positions from pos0, the
// launch's first query, to jend) into fk / fv [query, hd] as the cache stores them. The tile
// holding a query's first head writes that query's K / V row of KV head g to the cache: one
// writer per row, and no block reads a new row from the cache (the loads stop at pos0).
__host__ __device__ constexpr int64_t combine_floats(int64_t n_chunks, int64_t hd);
__device__ void combine_row(const AttnParams& P, int r, int h, float* csm);

// The angles of the (one) new position were tabled in cs before the grid wait.
template <class C, class KvT>
__device__ __forceinline__ void stage_fused(const AttnParams& P, const Item& it, int pos0, float* qs, KvT* fk,
                                            KvT* fv, const double* cs, int warp, int lane) {
  const int jn0 = max(it.j0, pos0), nk = max(0, it.jend - jn0);
  const int tasks = it.R + 2 * nk;
  const int64_t ld = (int64_t)P.n_kv * P.hd;
  auto angle = [cs](int i, double& c, double& s) {
    c = cs[2 * i];
    s = cs[2 * i + 1];
  };
  static_assert(kAttnMaxFusedRows == 1, "one position's angles are tabled");
  for (int t = warp; t < tasks; t += kWarps) {
    if (t < it.R) {
      const int gr = it.row0 + t, qi = gr / P.group, h = it.g * P.group + gr % P.group;
      float* dst = qs + t * C::HD;
      rope_head<C::HD>(P.rs, P.q + qi * P.ld_q + (int64_t)h * P.hd, P.q_norm, lane, angle,
                       [&](int d, float v) { dst[d] = v; });
      for (int d = P.hd + lane; d < C::HD; d += kGroup) dst[d] = 0.f;
    } else {
      const bool is_k = t < it.R + nk;
      const int j = jn0 + t - it.R - (is_k ? 0 : nk), qi = j - pos0;
      const float* x = P.q + qi * P.ld_q + (int64_t)(P.n_heads + (is_k ? 0 : P.n_kv) + it.g) * P.hd;
      KvT* f = (is_k ? fk : fv) + qi * P.hd;
      KvT* cache = static_cast<KvT*>(is_k ? P.kw : P.vw) + j * ld + it.g * P.hd;
      const bool writer = qi * P.group >= it.row0 && qi * P.group < it.row0 + it.R;
      auto put = [&](int d, float v) {
        const KvT b = to_kv<KvT>(v);
        f[d] = b;
        if (writer) cache[d] = b;
      };
      if (is_k) {
        rope_head<C::HD>(P.rs, x, P.k_norm, lane, angle, put);
      } else {
        for (int d = lane; d < P.hd; d += kGroup) put(d, x[d]);
      }
    }
  }
}

// Persistent grid of min(items, resident blocks); a block takes items blockIdx.x + k*gridDim.x
// and stops at the first chunk past the launch's last position. The next live item's first K
// sub-tile is loaded while the current one finishes.
template <class C, class KvT>
__global__ void __launch_bounds__(kAttnThreads, C::MINB) attn_chunk_kernel(const AttnParams P) {
  // (programmatic dependent launch: vendor.cuh) Fused, the first K sub-tile's cache rows (all
  // older than this forward) are loaded before the wait, overlapping the QKV product's end.
  const bool fuse = P.fuse != 0;
  bool waited = !fuse;
  SPECD_TRACE_DECL;
  SPECD_TRACE_MARK(0);
  if (waited) {
    gpu_grid_wait();
    gpu_grid_launch_dependents();
    SPECD_TRACE_MARK(1);
  }
  extern __shared__ float4 smem4[];
  float* smem = reinterpret_cast<float*>(smem4);
  float* qs = smem + C::kQ;
  float* S = smem + C::kS;
  float* tile = smem + C::kTile;
  float* ml = smem + C::kMl;
  int* row_valid = reinterpret_cast<int*>(ml + 2 * C::RMAX);  // [RMAX] positions of this chunk a row sees
  int* row_qh = row_valid + C::RMAX;                          // [RMAX] query * n_heads + head
  double* cs = reinterpret_cast<double*>(reinterpret_cast<char*>(smem4) + Fresh<C, KvT>::kOff);  // fused
  KvT* fk = reinterpret_cast<KvT*>(reinterpret_cast<char*>(cs) + Fresh<C, KvT>::kAngles);  // new K rows
  KvT* fv = fk + kAttnMaxFusedRows * C::HD;                                                // and V rows
  const KvT* fresh_k = fuse ? fk : nullptr;
  const KvT* fresh_v = fuse ? fv : nullptr;

  const int pos0 = *P.d_pos0 + P.r0;  // position of this launch's query 0 (positions < n_ctx <= 2^21)
  const int64_t total = (int64_t)P.n_chunks * P.n_kv * P.n_tiles;
  const int c_last = (pos0 + P.nq - 1) / kChunk;
  const int ld = P.n_kv * P.hd;
  const KvT* kc = static_cast<const KvT*>(P.k);
  const KvT* vc = static_cast<const KvT*>(P.v);
  const int warp = threadIdx.x / kGroup, lane = threadIdx.x % kGroup;
  const int d = (threadIdx.x % (C::HD / 4)) * 4, slot = threadIdx.x / (C::HD / 4);  // phase 3

  TileRegs<C, KvT> regs;
  bool prefetched = false;
  // Cache rows an item reads end at jend, or, fused, at the launch's first new row.
  auto load_end = [&](const Item& x) { return fuse ? min(x.jend, pos0) : x.jend; };
  if (fuse)  // (read after the first item's barrier)
    for (int i = threadIdx.x; i < P.rs.n_dims / 2; i += kAttnThreads)
      rope_angle(P.base_freq, P.factors, pos0, i, cs[2 * i], cs[2 * i + 1]);
  for (int64_t item = blockIdx.x; item < total; item += gridDim.x) {
    Item it;
    if (item / (P.n_kv * P.n_tiles) > c_last) break;
    if (!item_of<C>(P, item, pos0, it)) continue;
    const int col0 = it.g * P.hd, jl = load_end(it);
    if (!prefetched) regs.load(kc, ld, col0, P.hd, it.j0, jl);  // K sub-tile 0
    if (!waited) {
      gpu_grid_wait();
      gpu_grid_launch_dependents();
      SPECD_TRACE_MARK(1);
      waited = true;
    }
    __syncthreads();  // the previous item is done with shared memory

    // Stage q rows (zero-padded to HD) and each row's causal length in this chunk.
    if (fuse) {
      stage_fused<C, KvT>(P, it, pos0, qs, fk, fv, cs, warp, lane);
    } else {
      for (int e = threadIdx.x; e < it.R * (C::HD / 4); e += kAttnThreads) {
        const int row = e / (C::HD / 4), dd = (e % (C::HD / 4)) * 4;
        const int gr = it.row0 + row, qi = gr / P.group, h = it.g * P.group + gr % P.group;
        float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
        if (dd < P.hd) v = *reinterpret_cast<const float4*>(P.q + (int64_t)(P.r0 + qi) * P.ld_q + h * P.hd + dd);
        *reinterpret_cast<float4*>(qs + row * C::HD + dd) = v;
      }
    }
    if (threadIdx.x < C::RMAX) {
      const int row = threadIdx.x, gr = it.row0 + row, qi = gr / P.group;
      const int p = pos0 + qi;
      row_valid[row] = row < it.R ? max(0, min(kChunk, min(p + 1, P.n_ctx) - it.j0)) : 0;
      row_qh[row] = (P.r0 + qi) * P.n_heads + it.g * P.group + gr % P.group;
    }

    // ---- phase 1: scores of K sub-tiles. Warp w takes rows w%WR + WR*i and, when there are
    // fewer than 8 rows, the part w/WR of the positions (every warp busy in decode).
    const int WR = C::RMAX >= 32 ? kWarps : min(kWarps, it.R);  // (prefill shapes: fixed, fewer registers)
    const int PU = kWarps / WR, wr = warp % WR, part = warp / WR;
    const int ni1 = part < PU ? min(C::NI1, (it.R - wr + WR - 1) / WR) : 0;  // rows of this warp
    constexpr int UB = C::NU < 2 ? C::NU : 2;
    for (int st = 0; st < it.nsub; ++st) {
      __syncthreads();  // the tile is free (and, at st = 0, the staging is visible)
      regs.store(tile, fresh_k, P.hd, it.j0 + st * C::ST, pos0, it.jend);
      if (st + 1 < it.nsub) regs.load(kc, ld, col0, P.hd, it.j0 + (st + 1) * C::ST, jl);
      else regs.load(vc, ld, col0, P.hd, it.j0, jl);  // V sub-tile 0, in flight through phase 2
      __syncthreads();
      const int joff = st * C::ST, uf = part * UB, us = PU * UB;
      switch (ni1) {
        case 1: scores<C, 1>(qs, tile, S, wr, WR, uf, us, lane, joff, P.scale); break;
        case 2: if constexpr (C::NI1 >= 2) scores<C, 2>(qs, tile, S, wr, WR, uf, us, lane, joff, P.scale); break;
        case 3: if constexpr (C::NI1 >= 3) scores<C, 3>(qs, tile, S, wr, WR, uf, us, lane, joff, P.scale); break;
        case 4: if constexpr (C::NI1 >= 4) scores<C, 4>(qs, tile, S, wr, WR, uf, us, lane, joff, P.scale); break;
        default: break;
      }
    }
    __syncthreads();

    // ---- phase 2: m, p = exp(s - m), l per row (a warp per row)
    for (int i = 0; i < C::NI1; ++i) {
      const int row = warp + kWarps * i;
      if (row >= it.R) break;
      chunk_softmax<false>(S + row * kChunk, row_valid[row], lane, ml + 2 * row);
    }

    // ---- phase 3: o = sum_j p_j V_j over V sub-tiles
    const int ni3 = slot < it.R ? min(C::NI3, (it.R - slot + C::SLOTS - 1) / C::SLOTS) : 0;
    float4 acc[C::NI3];
#pragma unroll
    for (int i = 0; i < C::NI3; ++i) acc[i] = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int st = 0; st < it.nsub; ++st) {
      __syncthreads();  // S is final (st == 0) / the tile is free
      regs.store(tile, fresh_v, P.hd, it.j0 + st * C::ST, pos0, it.jend);
      if (st + 1 < it.nsub) {
        regs.load(vc, ld, col0, P.hd, it.j0 + (st + 1) * C::ST, jl);
      } else {  // the next live item's K sub-tile 0
        Item nx;
        const int64_t next = item + gridDim.x;
        prefetched = next < total && next / (P.n_kv * P.n_tiles) <= c_last && item_of<C>(P, next, pos0, nx);
        if (prefetched) regs.load(kc, ld, nx.g * P.hd, P.hd, nx.j0, load_end(nx));
      }
      __syncthreads();
      const int joff = st * C::ST;
      switch (ni3) {
        case 1: weighted<C, 1>(S, tile, acc, slot, d, joff); break;
        case 2: if constexpr (C::NI3 >= 2) weighted<C, 2>(S, tile, acc, slot, d, joff); break;
        case 3: if constexpr (C::NI3 >= 3) weighted<C, 3>(S, tile, acc, slot, d, joff); break;
        case 4: if constexpr (C::NI3 >= 4) weighted<C, 4>(S, tile, acc, slot, d, joff); break;
        default: break;
      }
    }

    // ---- output: finished rows (one chunk) normalised in place, the others as partials
    if (d < P.hd) {
#pragma unroll
      for (int i = 0; i < C::NI3; ++i) {
        const int row = slot + C::SLOTS * i;
        if (i >= ni3 || row_valid[row] == 0) continue;
        const int qh = row_qh[row];
        const int p = pos0 + (it.row0 + row) / P.group;
        const float m = ml[2 * row], l = ml[2 * row + 1];
        if (p < kChunk || P.n_chunks == 1) {
          *reinterpret_cast<float4*>(P.out + (int64_t)qh * P.hd + d) = make_float4(
              __fdiv_rn(acc[i].x, l), __fdiv_rn(acc[i].y, l), __fdiv_rn(acc[i].z, l), __fdiv_rn(acc[i].w, l));
        } else {
          const int64_t u = ((int64_t)(qh - P.r0 * P.n_heads)) * P.n_chunks + it.c;  // launch-local partial
          *reinterpret_cast<float4*>(P.work_o + u * P.hd + d) = acc[i];
          if (d == 0) {
            P.work_ml[2 * u] = m;
            P.work_ml[2 * u + 1] = l;
          }
        }
      }
    }

    // ---- fold: the last block done with this (row tile, KV head)'s chunks combines its rows
    // (threadFenceReduction: partials fenced before the count, read from L2 after it)
    const int tile_chunks = min(P.n_chunks - 1, (pos0 + (it.row0 + it.R - 1) / P.group) / kChunk) + 1;
    if (P.fold && tile_chunks > 1 &&
        fold_last(P.counters + (it.row0 / C::RMAX) * P.n_kv + it.g, tile_chunks, row_valid)) {
      for (int row = 0; row < it.R; ++row) {
        const int gr = it.row0 + row;
        combine_row(P, gr / P.group, it.g * P.group + gr % P.group, smem);
      }
    }
  }
  SPECD_TRACE_MARK(2);
  SPECD_TRACE_MARK(3);
  if (waited) SPECD_TRACE_RECORD(kTraceAttnChunk, (unsigned long long)(uintptr_t)P.out);  // (uniform)
}

// Combines the partials of launch-local query r, head h, when it has more than one chunk; all
// kAttnThreads threads call it (uniform early return). Thread t -> dims d = 4 (t % (hd/4)) and
// chunk class k = t / (hd/4) < K = 256/(hd/4):
//   M = max_c m_c,  w_c = exp(m_c - M)
//   A_k = sum_{c = k mod K, ascending} w_c o_c,  L_k likewise with l_c   (fmaf chains)
//   out = (A_0 + A_1 + ... + A_{K-1}) / (L_0 + ... + L_{K-1})           (k ascending)
// Fixed by (head_dim, the query's chunk count) alone. csm: combine_floats(n_chunks, hd) shared
// floats. The partials are read from L2 (gpu_load_l2): other blocks of the same launch wrote them.
__host__ __device__ constexpr int64_t combine_floats(int64_t n_chunks, int64_t hd) {
  return kWarps + ((n_chunks + 3) & ~int64_t(3)) + (kAttnThreads / (hd / 4)) * (hd + 1);
}

__device__ void combine_row(const AttnParams& P, int r, int h, float* csm) {
  const int64_t p = (int64_t)*P.d_pos0 + P.r0 + r;
  const int nc = (int)min64(P.n_chunks, p / kChunk + 1);
  if (nc <= 1) return;  // finished by the partial kernel
  const int64_t u0 = ((int64_t)r * P.n_heads + h) * P.n_chunks;
  const float* mlp = P.work_ml + 2 * u0;
  const int d4s = P.hd / 4, K = kAttnThreads / d4s;
  float* red = csm;                              // [kWarps]
  float* w = csm + kWarps;                       // [n_chunks, rounded up to 4]
  float* partA = w + ((P.n_chunks + 3) & ~3);    // [K, hd] (16-byte aligned)
  float* partL = partA + K * P.hd;               // [K]

  float m = -INFINITY;
  for (int c = threadIdx.x; c < nc; c += kAttnThreads) m = fmaxf(m, gpu_load_l2(mlp + 2 * c));
  m = group_max(m);
  if (threadIdx.x % kGroup == 0) red[threadIdx.x / kGroup] = m;
  __syncthreads();
  float M = red[0];
#pragma unroll
  for (int i = 1; i < kWarps; ++i) M = fmaxf(M, red[i]);
  for (int c = threadIdx.x; c < nc; c += kAttnThreads) w[c] = exp_diff(gpu_load_l2(mlp + 2 * c), M);
  __syncthreads();

  const int k = threadIdx.x / d4s, d = (threadIdx.x % d4s) * 4;
  if (k < K) {
    float4 a = make_float4(0.f, 0.f, 0.f, 0.f);
    float l = 0.f;
#pragma unroll 4
    for (int c = k; c < nc; c += K) {
      const float wc = w[c];
      fma4(a, wc, gpu_load_l2(reinterpret_cast<const float4*>(P.work_o + (u0 + c) * P.hd + d)));
      l = fmaf(wc, gpu_load_l2(mlp + 2 * c + 1), l);
    }
    *reinterpret_cast<float4*>(partA + k * P.hd + d) = a;
    if (d == 0) partL[k] = l;
  }
  __syncthreads();
  if ((int)threadIdx.x < d4s) {
    float4 a = *reinterpret_cast<const float4*>(partA + d);
    float L = partL[0];
    for (int i = 1; i < K; ++i) {
      const float4 b = *reinterpret_cast<const float4*>(partA + i * P.hd + d);
      a = make_float4(__fadd_rn(a.x, b.x), __fadd_rn(a.y, b.y), __fadd_rn(a.z, b.z), __fadd_rn(a.w, b.w));
      L = __fadd_rn(L, partL[i]);
    }
    *reinterpret_cast<float4*>(P.out + ((int64_t)(P.r0 + r) * P.n_heads + h) * P.hd + d) =
        make_float4(__fdiv_rn(a.x, L), __fdiv_rn(a.y, L), __fdiv_rn(a.z, L), __fdiv_rn(a.w, L));
  }
  __syncthreads();  // csm is free again
}

// combine_row for the R (<= kDecMaxRows) query heads h0 .. h0 + R - 1 of launch-local query r
// at once (attn_decode_kernel's fold: one block, the heads of a KV head): per head exactly
// combine_row's operations in its order (the same bits as a verify's rows), with the heads'
// L2 reads in flight together instead of one head's after another's (a head's combine is a
// few dependent L2 round trips: 8B decode at >= 256 positions paid them 4 times per layer).
// Warp i < R takes head i's statistics; thread (k, d) its chunk class k for every head; the
// last sums a thread per (head, 4 dims). csm: combine_rows_floats(R, n_chunks, hd) floats.
__host__ __device__ constexpr int64_t combine_rows_floats(int64_t rows, int64_t n_chunks, int64_t hd) {
  return rows * (((n_chunks + 3) & ~int64_t(3)) + (kAttnThreads / (hd / 4)) * (hd + 1));
}

constexpr int kDecMaxRows = 8;  // query heads per KV head the decode kernel takes

__device__ void combine_rows(const AttnParams& P, int r, int h0, int R, float* csm) {
  const int64_t p = (int64_t)*P.d_pos0 + P.r0 + r;
  const int nc = (int)min64(P.n_chunks, p / kChunk + 1);
  if (nc <= 1) return;  // finished by the partial kernel
  const int nc4 = (P.n_chunks + 3) & ~3, d4s = P.hd / 4, K = kAttnThreads / d4s;
  const int64_t ur = (int64_t)r * P.n_heads + h0;  // (query r, head h0): head i's partials at (ur + i) * n_chunks
  float* w = csm;                          // [R, nc4]
  float* partA = w + R * nc4;              // [R, K, hd] (16-byte aligned: nc4 % 4 == 0)
  float* partL = partA + R * K * P.hd;     // [R, K]
  const int warp = threadIdx.x / kGroup, lane = threadIdx.x % kGroup;

  if (warp < R) {  // M = max_c m_c (exact in any order), then w_c = exp(m_c - M)
    const float* mlp = P.work_ml + 2 * (ur + warp) * P.n_chunks;
    float m = -INFINITY;
    for (int c = lane; c < nc; c += kGroup) {
      const float x = gpu_load_l2(mlp + 2 * c);
      w[warp * nc4 + c] = x;
      m = fmaxf(m, x);
    }
    m = group_max(m);
    for (int c = lane; c < nc; c += kGroup) w[warp * nc4 + c] = exp_diff(w[warp * nc4 + c], m);
  }
  __syncthreads();

  const int k = threadIdx.x / d4s, d = (threadIdx.x % d4s) * 4;
  if (k < K) {
    float4 a[kDecMaxRows];
    float l[kDecMaxRows];
#pragma unroll
    for (int i = 0; i < kDecMaxRows; ++i) {
      a[i] = make_float4(0.f, 0.f, 0.f, 0.f);
      l[i] = 0.f;
    }
    for (int c = k; c < nc; c += K) {
#pragma unroll
      for (int i = 0; i < kDecMaxRows; ++i) {
        if (i >= R) break;
        const int64_t u = (ur + i) * P.n_chunks + c;
        const float wc = w[i * nc4 + c];
        fma4(a[i], wc, gpu_load_l2(reinterpret_cast<const float4*>(P.work_o + u * P.hd + d)));
        l[i] = fmaf(wc, gpu_load_l2(P.work_ml + 2 * u + 1), l[i]);
      }
    }
#pragma unroll
    for (int i = 0; i < kDecMaxRows; ++i) {
      if (i >= R) break;
      *reinterpret_cast<float4*>(partA + (i * K + k) * P.hd + d) = a[i];
      if (d == 0) partL[i * K + k] = l[i];
    }
  }
  __syncthreads();
  for (int t = threadIdx.x; t < R * d4s; t += kAttnThreads) {
    const int i = t / d4s, dd = (t % d4s) * 4;
    const float* A = partA + i * K * P.hd;
    float4 a = *reinterpret_cast<const float4*>(A + dd);
    float L = partL[i * K];
    for (int j = 1; j < K; ++j) {
      const float4 b = *reinterpret_cast<const float4*>(A + j * P.hd + dd);
      a = make_float4(__fadd_rn(a.x, b.x), __fadd_rn(a.y, b.y), __fadd_rn(a.z, b.z), __fadd_rn(a.w, b.w));
      L = __fadd_rn(L, partL[i * K + j]);
    }
    *reinterpret_cast<float4*>(P.out + ((int64_t)(P.r0 + r) * P.n_heads + h0 + i) * P.hd + dd) =
        make_float4(__fdiv_rn(a.x, L), __fdiv_rn(a.y, L), __fdiv_rn(a.z, L), __fdiv_rn(a.w, L));
  }
  __syncthreads();  // csm is free again
}

// grid (n_heads, nq): one block per (query, head), where the partial kernel cannot combine
// (fold = 0: its shared memory is too small for the chunk count). Dynamic shared memory:
// combine_floats(n_chunks, hd) floats.
__global__ void __launch_bounds__(kAttnThreads) attn_combine_kernel(const AttnParams P) {
  gpu_grid_wait();  // (programmatic dependent launch: vendor.cuh)
  gpu_grid_launch_dependents();
  extern __shared__ float4 csm4[];
  combine_row(P, blockIdx.y, blockIdx.x, reinterpret_cast<float*>(csm4));
}

// ---- decode: one query (attn_decode_kernel)
//
// The same arithmetic as attn_chunk_kernel, step for step (bit-equal outputs: decode and a
// verify's rows must agree), with the work spread for one query: block (c, g) takes chunk c of
// KV head g for the group's R query heads, 256 threads.
//   before the grid wait: the chunk's cache rows older than the query (every row but the new
//     one) are copied to shared memory asynchronously (cp.async on sm_80+), K and V in
//     sub-tiles of kDecST rows through a ring of nb buffers; fused, the angles are tabled
//   stage: warp t < R norms / ropes query head t into qs; the block holding the query's
//     position takes the new K / V row from the QKV product (fused: normed, roped, rounded as
//     the cache stores it, and written to the cache) or from the cache (rope_kv ran first)
//   phase 1: a warp per (query head, 32 positions): lane -> one position's score
//   phase 2: a warp per query head (chunk_softmax, as attn_chunk_kernel)
//   phase 3: thread -> two dims of up to HD/64 query heads, positions ascending
// The new row is the chunk's last live position: phases 1 and 3 read it from its own buffer.
// When the ring holds the whole chunk (nb >= 2 * sub-tiles) every copy is issued before the
// wait; otherwise buffers are refilled as they are consumed.
constexpr int kDecST = 64;                            // positions per sub-tile
constexpr int kDecMaxBufs = 8;                        // a whole chunk's K and V (dec_wait)
constexpr int kDecMinBufs = 4;                        // fewer: the general kernel (launch_dec_hd)

template <int HD, class KvT>
struct DecShape {
  static constexpr int kVec = 16 / (int)sizeof(KvT);  // elements per 16-byte unit
  static constexpr int kUnits = HD / kVec;            // units per (padded) row
  static constexpr int kLd = HD + kVec;               // elements per buffer row: an odd number of
                                                      // units, so per-row reads are conflict-free
  static constexpr size_t kBufElems = (size_t)kDecST * kLd;
  static constexpr size_t kBuf = kBufElems * sizeof(KvT);
  // after the ring: qs [kDecMaxRows, HD] | S [kDecMaxRows, 256] | ml [kDecMaxRows, 2] (floats)
  //   | angles [kRopeMaxPairs, 2] (double) | new K row, new V row [HD] (KvT)
  static constexpr size_t kTail = sizeof(float) * (kDecMaxRows * (HD + kChunk + 2)) +
                                  sizeof(double) * 2 * kRopeMaxPairs + 2 * sizeof(KvT) * HD;
  static_assert(kDecST % kGroup == 0 && kChunk % kDecST == 0 && HD % kVec == 0, "decode shape");
};

// 16 bytes global -> shared: asynchronous on sm_80+ (dec_commit / dec_wait order them),
// a plain copy elsewhere (the waits are then no-ops).
__device__ __forceinline__ void dec_copy16(void* dst, const void* src) {
#if SPECD_MMA
  cp_async16_all(dst, src);
#else
  *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
#endif
}
__device__ __forceinline__ void dec_commit() {
#if SPECD_MMA
  cp_async_commit();
#endif
}
__device__ __forceinline__ void dec_wait_all() {
#if SPECD_MMA
  cp_async_wait<0>();
#endif
}
// Waits until at most `pending` (< kDecMaxBufs) of this thread's copy groups are in flight.
__device__ __forceinline__ void dec_wait(int pending) {
#if SPECD_MMA
  switch (pending) {
    case 0: cp_async_wait<0>(); break;
    case 1: cp_async_wait<1>(); break;
    case 2: cp_async_wait<2>(); break;
    case 3: cp_async_wait<3>(); break;
    case 4: cp_async_wait<4>(); break;
    case 5: cp_async_wait<5>(); break;
    case 6: cp_async_wait<6>(); break;
    default: cp_async_wait<7>(); break;
  }
#else
  (void)pending;
#endif
}

// Phase 1 of attn_decode_kernel: query head row qr (qs + r*HD) against K row krow (hu units):
// the four fmaf chains over the dims, as attn_chunk_kernel's scores.
template <class D, class KvT>
__device__ __forceinline__ float dec_score(const KvT* krow, const float* qr, int hu, float scale) {
  float4 a = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 2
  for (int u = 0; u < hu; ++u) {
    float kf[D::kVec];
    kv_unit_floats<KvT>(*reinterpret_cast<const uint4*>(krow + u * D::kVec), kf);
#pragma unroll
    for (int e = 0; e < D::kVec; e += 4) {
      const float4 q = *reinterpret_cast<const float4*>(qr + u * D::kVec + e);
      a.x = fmaf(q.x, kf[e], a.x);
      a.y = fmaf(q.y, kf[e + 1], a.y);
      a.z = fmaf(q.z, kf[e + 2], a.z);
      a.w = fmaf(q.w, kf[e + 3], a.w);
    }
  }
  return __fmul_rn(__fadd_rn(__fadd_rn(a.x, a.y), __fadd_rn(a.z, a.w)), scale);
}

template <class KvT>
__device__ __forceinline__ float2 kv_float2(const KvT* p) {
  if constexpr (sizeof(KvT) == 2) return __half22float2(*reinterpret_cast<const __half2*>(p));
  else return *reinterpret_cast<const float2*>(p);
}

// Phase 3 of attn_decode_kernel over one V sub-tile for NR query heads rs + slots*i and dims
// d, d+1: acc += p_j V_j for the ring's rows [jb, jo) (buffer vbuf, row 0 = position jb), then
// the new row (fv) when jo < je. Positions ascending: attn_chunk_kernel's fmaf chains.
template <class D, class KvT, int NR>
__device__ __forceinline__ void dec_weighted(const KvT* vbuf, const KvT* fv, const float* S, float2* acc, int rs,
                                             int slots, int d, int jb, int jo, int je) {
  int j = jb;
#pragma unroll 1
  for (; j + 4 <= jo; j += 4) {
    float4 p[NR];
#pragma unroll
    for (int i = 0; i < NR; ++i) p[i] = *reinterpret_cast<const float4*>(S + (rs + slots * i) * kChunk + j);
#pragma unroll
    for (int jj = 0; jj < 4; ++jj) {
      const float2 v = kv_float2<KvT>(vbuf + (j - jb + jj) * D::kLd + d);
#pragma unroll
      for (int i = 0; i < NR; ++i) {
        acc[i].x = fmaf(comp(p[i], jj), v.x, acc[i].x);
        acc[i].y = fmaf(comp(p[i], jj), v.y, acc[i].y);
      }
    }
  }
  auto one = [&](const KvT* row, int jj) {
    const float2 v = kv_float2<KvT>(row + d);
#pragma unroll
    for (int i = 0; i < NR; ++i) {
      const float pj = S[(rs + slots * i) * kChunk + jj];
      acc[i].x = fmaf(pj, v.x, acc[i].x);
      acc[i].y = fmaf(pj, v.y, acc[i].y);
    }
  };
#pragma unroll 1
  for (; j < jo; ++j) one(vbuf + (j - jb) * D::kLd, j);
  if (jo < je) one(fv, jo);  // the new row (position jo = old_end), last
}

// rows x (hu 16-byte units) of the cache from src (rows ld elements apart) into a ring buffer
// (rows D::kLd apart): thread -> unit tid % kUnits of rows tid / kUnits + kStep k. Out of line:
// the kernel's code stays small (it runs once per layer, its instructions fetched cold).
template <class D, class KvT>
__device__ __noinline__ void dec_copy_rows(const KvT* src, int ld, int rows, int hu, KvT* dst) {
  constexpr int kStep = kAttnThreads / D::kUnits;
  static_assert(kAttnThreads % D::kUnits == 0, "copy layout");
  const int u = threadIdx.x % D::kUnits, r = threadIdx.x / D::kUnits;
  if (u >= hu) return;
  src += (int64_t)r * ld + u * D::kVec;
  dst += r * D::kLd + u * D::kVec;
  for (int k = r; k < rows; k += kStep, src += (int64_t)kStep * ld, dst += kStep * D::kLd) dec_copy16(dst, src);
}

// grid n_chunks * n_kv blocks, chunk-major (chunks past the query's position return at once);
// dynamic shared memory nb * DecShape::kBuf + DecShape::kTail.
template <int HD, class KvT>
__global__ void __launch_bounds__(kAttnThreads) attn_decode_kernel(const AttnParams P, const int nb) {
  using D = DecShape<HD, KvT>;
  extern __shared__ float4 smem4[];
  char* base = reinterpret_cast<char*>(smem4);
  KvT* ring = reinterpret_cast<KvT*>(base);
  float* qs = reinterpret_cast<float*>(base + (size_t)nb * D::kBuf);
  float* S = qs + kDecMaxRows * HD;
  float* ml = S + kDecMaxRows * kChunk;
  double* cs = reinterpret_cast<double*>(ml + 2 * kDecMaxRows);
  KvT* fk = reinterpret_cast<KvT*>(cs + 2 * kRopeMaxPairs);
  KvT* fv = fk + HD;
  SPECD_TRACE_DECL;
  SPECD_TRACE_MARK(0);

  const int c = blockIdx.x / P.n_kv, g = blockIdx.x % P.n_kv;
  const int pos0 = *P.d_pos0;  // (set before the forward)
  const int j0 = c * kChunk;
  if (j0 > pos0) return;  // past the query: nothing to read or write
  const int live = min(kChunk, pos0 + 1 - j0);    // positions of this chunk the query sees
  const bool holds_new = pos0 < j0 + kChunk;     // the new row (pos0) is the last live one
  const int old_end = holds_new ? live - 1 : live;  // rows [0, old_end) come from the cache
  const int ns = (live + kDecST - 1) / kDecST;    // sub-tiles
  const int nload = 2 * ns;                       // K sub-tiles, then V sub-tiles
  const bool all_in = nload <= nb;
  const int ld = P.n_kv * P.hd, col0 = g * P.hd, hu = P.hd / D::kVec;  // live units of a row
  const KvT* kc = static_cast<const KvT*>(P.k);
  const KvT* vc = static_cast<const KvT*>(P.v);
  const int tid = threadIdx.x, warp = tid / kGroup, lane = tid % kGroup;
  const int R = P.group;

  auto buf = [&](int i) {  // the ring buffer of load i, i % nb (i < 2 * kDecMaxBufs: no division)
    while (i >= nb) i -= nb;
    return i;
  };
  // Load i: K (i < ns) or V sub-tile i % ns, rows below old_end, into buffer i % nb; a group
  // is committed for every i (empty past the last load) so that waits count uniformly.
  auto issue = [&](int i) {
    if (i < nload) {
      const bool isv = i >= ns;
      const int r0 = (isv ? i - ns : i) * kDecST;
      dec_copy_rows<D, KvT>((isv ? vc : kc) + (int64_t)(j0 + r0) * ld + col0, ld, min(kDecST, old_end - r0), hu,
                            ring + (size_t)buf(i) * D::kBufElems);
    }
    dec_commit();
  };
  // K row j (< live) of the chunk, where it sits now (phase 3 walks V's buffers itself).
  auto krow_of = [&](int j) -> const KvT* {
    if (j == old_end && holds_new) return fk;
    return ring + (size_t)buf(j / kDecST) * D::kBufElems + (j % kDecST) * D::kLd;
  };

  if (P.fuse)
    for (int i = tid; i < P.rs.n_dims / 2; i += kAttnThreads)
      rope_angle(P.base_freq, P.factors, pos0, i, cs[2 * i], cs[2 * i + 1]);
  for (int i = 0; i < nb; ++i) issue(i);
  __syncthreads();  // the angles
  gpu_grid_wait();  // (programmatic dependent launch: vendor.cuh) the QKV product is done
  gpu_grid_launch_dependents();
  SPECD_TRACE_MARK(1);

  // ---- stage: q heads into qs; the new K / V row into fk / fv
  {
    auto angle = [cs](int i, double& co, double& si) {
      co = cs[2 * i];
      si = cs[2 * i + 1];
    };
    const int tasks = R + (holds_new ? 2 : 0);
    for (int t = warp; t < tasks; t += kWarps) {
      const bool is_q = t < R, is_k = t == R;
      const float* x = P.q + (int64_t)(is_q ? g * R + t : P.n_heads + (is_k ? 0 : P.n_kv) + g) * P.hd;
      KvT* f = is_k ? fk : fv;
      float* dst = qs + t * HD;
      if (P.fuse) {  // (one rope_head call site: the kernel's code stays small)
        KvT* cache = static_cast<KvT*>(is_k ? P.kw : P.vw) + (int64_t)pos0 * ld + col0;
        auto put = [&](int d, float v) {
          if (is_q) {
            dst[d] = v;
          } else {
            const KvT b = to_kv<KvT>(v);
            f[d] = b;
            cache[d] = b;
          }
        };
        if (t <= R) {
          rope_head<HD>(P.rs, x, is_q ? P.q_norm : P.k_norm, lane, angle, put);
        } else {
#pragma unroll
          for (int k = 0; k < HD / kGroup; ++k)
            if (lane + kGroup * k < P.hd) put(lane + kGroup * k, x[lane + kGroup * k]);
        }
      } else if (is_q) {
#pragma unroll
        for (int k = 0; k < HD / kGroup; ++k)
          if (lane + kGroup * k < P.hd) dst[lane + kGroup * k] = x[lane + kGroup * k];
      } else {  // rope_kv wrote the new row (the kernel before this one): read after the wait
        const KvT* src = (is_k ? kc : vc) + (int64_t)pos0 * ld + col0;
#pragma unroll
        for (int k = 0; k < HD / kGroup; ++k)
          if (lane + kGroup * k < P.hd) f[lane + kGroup * k] = src[lane + kGroup * k];
      }
    }
  }

  SPECD_TRACE_MARK(2);  // (the trace's "prep": the stage)

  // ---- phase 1: scores, sub-tile by sub-tile (all at once when the ring holds the chunk); an
  // item is (32 positions, one query head)
  const int n_kg = (live + kGroup - 1) / kGroup;  // groups of 32 positions
  for (int s0 = 0; s0 < ns;) {
    const int s1 = all_in ? ns : s0 + 1;
    if (all_in) dec_wait_all();
    else dec_wait(nb - 1);
    __syncthreads();  // the copies of loads <= s1 - 1 (and, at first, the stage) are visible
    const int kg0 = s0 * (kDecST / kGroup), kg1 = min(n_kg, s1 * (kDecST / kGroup));
    for (int it = warp; it < (kg1 - kg0) * R; it += kWarps) {
      const int r = it % R, j = (kg0 + it / R) * kGroup + lane;
      if (j < live) S[r * kChunk + j] = dec_score<D, KvT>(krow_of(j), qs + r * HD, hu, P.scale);
    }
    if (!all_in) {
      __syncthreads();  // buffer s0 is free
      issue(s0 + nb);
    }
    s0 = s1;
  }
  __syncthreads();

  // ---- phase 2: m, p = exp(s - m), l per query head (a warp each)
  if (warp < R) chunk_softmax<true>(S + warp * kChunk, live, lane, ml + 2 * warp);
  SPECD_TRACE_MARK(3);  // (the trace's "loop": phases 1 and 2; its "tail": phase 3 on)

  // ---- phase 3: o = sum_j p_j V_j, j ascending; thread -> dims d, d+1 of query heads
  // rs + kSlots3 * i
  constexpr int kPairs = HD / 2, kSlots3 = kAttnThreads / kPairs;
  constexpr int kRPT = (kDecMaxRows + kSlots3 - 1) / kSlots3;  // query heads per thread, at most
  const int d = 2 * (tid % kPairs), rs = tid / kPairs;
  const int nr = d < P.hd && rs < R ? (R - rs + kSlots3 - 1) / kSlots3 : 0;
  float2 acc[kRPT];
#pragma unroll
  for (int i = 0; i < kRPT; ++i) acc[i] = make_float2(0.f, 0.f);
  for (int s = 0; s < ns; ++s) {
    if (!all_in) dec_wait(nb - 1);
    __syncthreads();  // p is final (s = 0); this V sub-tile's copies are visible
    const int jb = s * kDecST, je = min(live, jb + kDecST), jo = min(je, old_end);  // ring rows [jb, jo)
    const KvT* vbuf = ring + (size_t)buf(ns + s) * D::kBufElems;
    switch (nr) {
      case 1: dec_weighted<D, KvT, 1>(vbuf, fv, S, acc, rs, kSlots3, d, jb, jo, je); break;
      case 2: if constexpr (kRPT >= 2) dec_weighted<D, KvT, 2>(vbuf, fv, S, acc, rs, kSlots3, d, jb, jo, je); break;
      case 3: if constexpr (kRPT >= 3) dec_weighted<D, KvT, 3>(vbuf, fv, S, acc, rs, kSlots3, d, jb, jo, je); break;
      case 4: if constexpr (kRPT >= 4) dec_weighted<D, KvT, 4>(vbuf, fv, S, acc, rs, kSlots3, d, jb, jo, je); break;
      default: break;
    }
    if (!all_in) {
      __syncthreads();  // buffer ns + s is free
      issue(ns + s + nb);
    }
  }

  // ---- output: one chunk finished in place, else this chunk's partial
  const bool one = pos0 < kChunk || P.n_chunks == 1;
#pragma unroll
  for (int i = 0; i < kRPT; ++i) {
    if (i >= nr) continue;
    const int r = rs + kSlots3 * i, h = g * R + r;
    const float m = ml[2 * r], l = ml[2 * r + 1];
    if (one) {
      *reinterpret_cast<float2*>(P.out + (int64_t)h * P.hd + d) =
          make_float2(__fdiv_rn(acc[i].x, l), __fdiv_rn(acc[i].y, l));
    } else {
      const int64_t u = (int64_t)h * P.n_chunks + c;
      *reinterpret_cast<float2*>(P.work_o + u * P.hd + d) = acc[i];
      if (d == 0) {
        P.work_ml[2 * u] = m;
        P.work_ml[2 * u + 1] = l;
      }
    }
  }

  // ---- fold: the last of this KV head's chunks combines its query heads (as attn_chunk_kernel)
  // (the flag in ml, read above: fold_last's first barrier orders it)
  const int n_live = min(P.n_chunks - 1, pos0 / kChunk) + 1;
  if (P.fold && n_live > 1 && fold_last(P.counters + g, n_live, reinterpret_cast<int*>(ml)))
    combine_rows(P, 0, g * R, R, reinterpret_cast<float*>(smem4));
  SPECD_TRACE_RECORD(kTraceAttnDecode, (unsigned long long)(uintptr_t)P.out);
}

// ---- host side

int n_chunks_of(int64_t n_ctx) { return (int)ceil_div(n_ctx, kChunk); }

// The fold's counters: one per (row tile, KV head); tiles hold >= 8 rows and a KV head's rows
// are its query heads, so nq * n_heads / 8 + n_kv covers every block shape.
size_t counter_count(int64_t nq, int32_t n_heads) { return (size_t)(nq * n_heads / 8 + n_heads); }

// The counters sit first in the workspace, sized for the most queries a launch takes, so they
// stay where they are whatever n a call has: a verify's partials (more queries, a longer
// work_o) must never land on the decode steps' counters, which have to be 0 when a launch
// starts (they were, before 20261201, placed after the call's own partials: a decode step
// past the first chunk after a verify there read the verify's partials as its count, so its
// fold combined too early or never, and speculative greedy output left plain greedy's).
size_t counter_bytes(int32_t n_heads) {
  return (sizeof(int) * counter_count(kMaxQueriesPerLaunch, n_heads) + 15) / 16 * 16;
}

// Queries per launch: all of them when no workspace is needed, else at most
// kMaxQueriesPerLaunch and few enough for the workspace to stay near kWorkBudget.
int64_t queries_per_launch(int64_t n, int64_t n_ctx, int32_t n_heads, int32_t head_dim) {
  const int64_t nc = n_chunks_of(n_ctx);
  if (nc <= 1) return n;
  const int64_t per_query = (int64_t)n_heads * nc * (head_dim + 2) * (int64_t)sizeof(float);
  const int64_t fit = std::max<int64_t>(1, (int64_t)kWorkBudget / per_query);
  return std::max<int64_t>(1, std::min<int64_t>({n, (int64_t)kMaxQueriesPerLaunch, fit}));
}

// Launches the partial kernel in block shape C (and the combine kernel where the partial one
// cannot fold the combine in), or, with s == kDryRun, only returns the shared memory it would
// take (the fused step's included).
const gpuStream_t kDryRun = reinterpret_cast<gpuStream_t>(~uintptr_t(0));

// SPECD_GPU_FOLD=0: the combine always in its own launch (benchmarks).
bool fold_off() {
  static const bool off = env_value("SPECD_GPU_FOLD") == "0";
  return off;
}

template <class C, class KvT>
size_t launch_cfg(AttnParams P, int64_t rows, gpuStream_t s) {
  const size_t smem = P.fuse ? Fresh<C, KvT>::kOff + Fresh<C, KvT>::kBytes : C::kSmemBytes;
  if (s == kDryRun) return smem;
  auto kern = attn_chunk_kernel<C, KvT>;
  SPECD_GPU_CHECK(gpuFuncSetAttribute(kern, gpuFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
  P.n_tiles = (int32_t)ceil_div(rows, C::RMAX);
  P.fold = P.n_chunks > 1 && !fold_off() && combine_floats(P.n_chunks, P.hd) <= C::kMl;
  const int64_t items = (int64_t)P.n_chunks * P.n_kv * P.n_tiles;
  const int64_t grid = std::min<int64_t>(items, (int64_t)dev_limits().sms * C::MINB);
  gpu_launch("attn_chunk_kernel", kern, dim3((unsigned)grid), dim3(kAttnThreads), smem, s, P);
  if (P.n_chunks > 1 && !P.fold)
    gpu_launch("attn_combine_kernel", attn_combine_kernel, dim3((unsigned)P.n_heads, (unsigned)P.nq),
               dim3(kAttnThreads), sizeof(float) * (size_t)combine_floats(P.n_chunks, P.hd), s, P);
  return smem;
}

// The first block shape that fits the device's shared memory: Dec (few rows: decode and
// short verify; long sub-tiles), Big (sm_80+), Small (sm_75 and AMD: 64 KiB). Dec also takes
// more rows where Big's items of a chunk would leave most multiprocessors idle (a verify over
// a short context: 16 queries of Qwen3-8B are 64 rows per KV head, 2 items per KV head and
// chunk in Big, 8 in Dec; the live chunks are known on the device only);
// SPECD_GPU_ATTN_SPREAD=0: never (benchmarks). The shapes give the same bits.
template <class Dec, class Big, class Small, class KvT>
size_t launch_hd(const AttnParams& P, int64_t rows, gpuStream_t s) {
  static const bool spread = env_value("SPECD_GPU_ATTN_SPREAD") != "0";
  const size_t smem = dev_limits().smem_per_block;
  const int64_t big_items = (int64_t)P.n_kv * ceil_div(rows, (int64_t)Big::RMAX);  // per chunk
  const bool few = spread && 2 * big_items <= dev_limits().sms;
  if ((rows <= Dec::RMAX || few) && Dec::kSmemBytes <= smem) return launch_cfg<Dec, KvT>(P, rows, s);
  if (Big::kSmemBytes <= smem) return launch_cfg<Big, KvT>(P, rows, s);
  return launch_cfg<Small, KvT>(P, rows, s);
}

// Float caches take shorter sub-tiles where the staging registers would not fit, and one
// block per multiprocessor at head_dim 256.
size_t launch_partial(const AttnParams& P, bool f16, int64_t rows, gpuStream_t s) {
  if (f16) {
    if (P.hd <= 64) return launch_hd<Cfg<64, 16, 128>, Cfg<64, 32, 64>, Cfg<64, 16, 64>, uint16_t>(P, rows, s);
    if (P.hd <= 128) return launch_hd<Cfg<128, 8, 128>, Cfg<128, 32, 64>, Cfg<128, 16, 64>, uint16_t>(P, rows, s);
    return launch_hd<Cfg<256, 8, 32>, Cfg<256, 16, 32>, Cfg<256, 8, 32>, uint16_t>(P, rows, s);
  }
  if (P.hd <= 64) return launch_hd<Cfg<64, 16, 64>, Cfg<64, 32, 32>, Cfg<64, 16, 64>, float>(P, rows, s);
  if (P.hd <= 128) return launch_hd<Cfg<128, 8, 32>, Cfg<128, 32, 32>, Cfg<128, 16, 32>, float>(P, rows, s);
  return launch_hd<Cfg<256, 8, 32, 1>, Cfg<256, 16, 32, 1>, Cfg<256, 8, 32, 1>, float>(P, rows, s);
}

// The decode kernel in head_dim padding HD: false where it does not apply (a ring of
// kDecMinBufs buffers, or a whole chunk's, and the rest do not fit the device's shared memory).
// With s == kDryRun it only says.
// SPECD_GPU_DEC_BUFS=n caps the ring at n buffers (benchmarks).
template <int HD, class KvT>
bool launch_dec_hd(AttnParams P, gpuStream_t s) {
  using D = DecShape<HD, KvT>;
  const size_t limit = dev_limits().smem_per_block;
  const int need = 2 * (int)ceil_div(std::min<int64_t>(P.n_ctx, kChunk), kDecST);  // a chunk's loads
  static_assert(2 * kChunk / kDecST <= kDecMaxBufs, "dec_wait's pending counts");
  int nb = (int)std::min<size_t>((size_t)need, limit > D::kTail ? (limit - D::kTail) / D::kBuf : 0);
  static const int cap = std::atoi(env_value("SPECD_GPU_DEC_BUFS").c_str());
  if (cap > 0) nb = std::min(nb, cap);
  // A ring of fewer than 4 sub-tiles (where shared memory is 64 KiB) refills too often: the
  // general kernel is faster there (H200, SPECD_GPU_DEC_BUFS=2: 8B Q4_K_M steps 12 % longer
  // than the general kernel's at positions 300-4000; `..._20261201_decode-attn-rings.json`).
  if (nb < std::min(need, kDecMinBufs)) return false;
  if (s == kDryRun) return true;
  const size_t smem = (size_t)nb * D::kBuf + D::kTail;
  // the fold's combine works in the ring, q and S (not past them: ml holds its flag)
  const size_t fold_room = (size_t)nb * D::kBuf + sizeof(float) * kDecMaxRows * (HD + kChunk);
  P.fold = P.n_chunks > 1 && !fold_off() && !P.apart &&
           sizeof(float) * (size_t)combine_rows_floats(P.group, P.n_chunks, P.hd) <= fold_room;
  auto kern = attn_decode_kernel<HD, KvT>;
  SPECD_GPU_CHECK(gpuFuncSetAttribute(kern, gpuFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
  gpu_launch("attn_decode_kernel", kern, dim3((unsigned)(P.n_chunks * P.n_kv)), dim3(kAttnThreads), smem, s, P, nb);
  if (P.n_chunks > 1 && !P.fold)
    gpu_launch("attn_combine_kernel", attn_combine_kernel, dim3((unsigned)P.n_heads, 1u), dim3(kAttnThreads),
               sizeof(float) * (size_t)combine_floats(P.n_chunks, P.hd), s, P);
  return true;
}

// One query on attn_decode_kernel: false where it does not apply (GQA groups above
// kDecMaxRows, too little shared memory, SPECD_GPU_DEC_ATTN=0), and nothing is launched.
bool launch_decode(const AttnParams& P, bool f16, gpuStream_t s) {
  static const bool off = env_value("SPECD_GPU_DEC_ATTN") == "0";
  if (off || P.group > kDecMaxRows) return false;
  if (f16) {
    if (P.hd <= 64) return launch_dec_hd<64, uint16_t>(P, s);
    if (P.hd <= 128) return launch_dec_hd<128, uint16_t>(P, s);
    return launch_dec_hd<256, uint16_t>(P, s);
  }
  if (P.hd <= 64) return launch_dec_hd<64, float>(P, s);
  if (P.hd <= 128) return launch_dec_hd<128, float>(P, s);
  return launch_dec_hd<256, float>(P, s);
}

// The fused step's checks: `r` must describe this call's rows, positions, heads and caches.
void check_rope(const AttnArgs& a, const RopeKvArgs& r) {
  rope_kv_check(r);
  const int64_t ld_q = a.ld_q ? a.ld_q : (int64_t)a.n_heads * a.head_dim;
  if (r.qkv != a.q || r.ld_qkv != ld_q || r.n != a.n || r.d_pos0 != a.d_pos0 || r.n_heads != a.n_heads ||
      r.n_kv_heads != a.n_kv_heads || r.head_dim != a.head_dim || r.k_cache != a.k_cache ||
      r.v_cache != a.v_cache || r.kv_f16 != a.kv_f16 || r.n_ctx != a.n_ctx)
    throw Error("attention: its rope_kv step must cover the same rows (q = qkv, ld_q = ld_qkv, n, d_pos0), "
                "heads and caches as the attention");
}

}  // namespace

size_t attention_workspace_bytes(int64_t n, int64_t n_ctx, int32_t n_heads, int32_t head_dim) {
  if (n <= 0 || n_ctx <= 0 || n_heads <= 0 || head_dim <= 0) return 0;
  const int64_t nc = n_chunks_of(n_ctx);
  if (nc <= 1) return 0;
  const int64_t nq = queries_per_launch(n, n_ctx, n_heads, head_dim);
  return counter_bytes(n_heads) + sizeof(float) * (size_t)(nq * n_heads * nc * (head_dim + 2));
}

AttnArgs attention_args(const RopeKvArgs& r) {
  AttnArgs a;
  a.q = r.qkv;
  a.ld_q = r.ld_qkv;
  a.k_cache = r.k_cache;
  a.v_cache = r.v_cache;
  a.kv_f16 = r.kv_f16;
  a.n_ctx = r.n_ctx;
  a.n = r.n;
  a.d_pos0 = r.d_pos0;
  a.n_heads = r.n_heads;
  a.n_kv_heads = r.n_kv_heads;
  a.head_dim = r.head_dim;
  a.rope = &r;
  return a;
}

void attention(const AttnArgs& a, gpuStream_t s) {
  const std::string at = "attention: ";
  if (a.n_heads <= 0 || a.n_kv_heads <= 0 || a.n_heads % a.n_kv_heads != 0)
    throw Error(at + "n_heads (" + std::to_string(a.n_heads) + ") must be a positive multiple of n_kv_heads (" +
                std::to_string(a.n_kv_heads) + ")");
  if (a.head_dim <= 0 || a.head_dim > 256 || a.head_dim % 8 != 0)
    throw Error(at + "head_dim must be a multiple of 8 in [8, 256], got " + std::to_string(a.head_dim));
  if (a.n < 0 || a.n_ctx <= 0)
    throw Error(at + "n must be >= 0 and n_ctx > 0, got n=" + std::to_string(a.n) + ", n_ctx=" +
                std::to_string(a.n_ctx));
  if (a.n_ctx > (int64_t(1) << 21))
    throw Error(at + "n_ctx " + std::to_string(a.n_ctx) + " is above the 2097152 positions supported");
  if (a.n == 0) return;
  if (!a.q || !a.k_cache || !a.v_cache || !a.out || !a.d_pos0)
    throw Error(at + "q, k_cache, v_cache, out and d_pos0 must be device pointers, got a null one");
  if (a.ld_q != 0 && (a.ld_q < (int64_t)a.n_heads * a.head_dim || a.ld_q % 4 != 0))
    throw Error(at + "ld_q (" + std::to_string(a.ld_q) + ") must be 0 or a multiple of 4 >= n_heads*head_dim");
  if (a.rope) check_rope(a, *a.rope);
  const int64_t nc = n_chunks_of(a.n_ctx);
  const int32_t group = a.n_heads / a.n_kv_heads;
  const int64_t nq = queries_per_launch(a.n, a.n_ctx, a.n_heads, a.head_dim);
  if (a.n_kv_heads > 65535) throw Error(at + "n_kv_heads must be <= 65535");

  AttnParams P{};
  P.q = a.q;
  P.ld_q = a.ld_q ? a.ld_q : (int64_t)a.n_heads * a.head_dim;
  P.k = a.k_cache;
  P.v = a.v_cache;
  P.out = a.out;
  P.counters = static_cast<int*>(a.work);
  P.work_o = a.work ? reinterpret_cast<float*>(static_cast<char*>(a.work) + counter_bytes(a.n_heads)) : nullptr;
  P.work_ml = P.work_o ? P.work_o + (size_t)nq * a.n_heads * nc * a.head_dim : nullptr;
  P.d_pos0 = a.d_pos0;
  P.n_ctx = (int32_t)a.n_ctx;
  P.n_heads = a.n_heads;
  P.n_kv = a.n_kv_heads;
  P.group = group;
  P.hd = a.head_dim;
  P.n_chunks = (int32_t)nc;
  P.scale = a.scale;
  // One query: attn_decode_kernel where it applies (its launch: r0 = 0, one query).
  P.r0 = 0;
  P.nq = 1;
  P.apart = a.combine_apart ? 1 : 0;
  const bool dec = a.n == 1 && launch_decode(P, a.kv_f16, kDryRun);
  // The fused step: one launch of at most kAttnMaxFusedRows queries whose block shape has the
  // shared memory for the new rows (SPECD_GPU_FUSE_ROPE=0: never, for benchmarks).
  static const bool fuse_off = env_value("SPECD_GPU_FUSE_ROPE") == "0";
  if (a.rope && !fuse_off && a.n <= kAttnMaxFusedRows && nq == a.n) {
    const RopeKvArgs& r = *a.rope;
    P.fuse = 1;
    P.rs = RopeShape{r.head_dim, r.rope.n_dims, r.rope.mode == RopeMode::Neox, r.eps};
    P.q_norm = r.q_norm;
    P.k_norm = r.k_norm;
    P.factors = r.rope.freq_factors;
    P.kw = a.k_cache;
    P.vw = a.v_cache;
    rope_base_freq(r.rope, P.base_freq);
    if (!dec && launch_partial(P, a.kv_f16, a.n * group, kDryRun) > dev_limits().smem_per_block) P.fuse = 0;
  }
  if (a.rope && !P.fuse) rope_kv(*a.rope, s);
  if (attention_prefill_tc(a, s)) return;  // prefills on tensor cores where they can
  if (nc > 1 && !a.work)
    throw Error(at + "a workspace of attention_workspace_bytes(...) = " +
                std::to_string(attention_workspace_bytes(a.n, a.n_ctx, a.n_heads, a.head_dim)) +
                " bytes is needed (n_ctx > " + std::to_string(kChunk) + ")");
  if (dec) {
    launch_decode(P, a.kv_f16, s);
    return;
  }
  for (int64_t r0 = 0; r0 < a.n; r0 += nq) {
    P.r0 = (int32_t)r0;
    P.nq = (int32_t)std::min<int64_t>(nq, a.n - r0);
    const int64_t rows = (int64_t)P.nq * group;
    launch_partial(P, a.kv_f16, rows, s);
  }
}

// ---- testing entry point (cuda/testing.h)

namespace testing {

void attention(const float* q, const void* k_cache, const void* v_cache, bool kv_f16, int64_t n_ctx, int64_t n,
               int32_t pos0, int32_t n_heads, int32_t n_kv_heads, int32_t head_dim, float scale, float* out) {
  if (pos0 < 0 || n < 0 || pos0 + n > n_ctx)
    throw Error("attention: positions " + std::to_string(pos0) + ".." + std::to_string(pos0 + n) +
                " do not fit the cache's " + std::to_string(n_ctx) + " rows");
  if (n_heads <= 0 || n_kv_heads <= 0 || head_dim <= 0)
    throw Error("attention: n_heads, n_kv_heads and head_dim must be > 0");
  const size_t q_bytes = sizeof(float) * (size_t)(n * n_heads * head_dim);
  const size_t cache_bytes = (kv_f16 ? 2 : 4) * (size_t)(n_ctx * n_kv_heads * head_dim);
  DeviceBuffer dq(q_bytes), dk(cache_bytes), dv(cache_bytes), dout(q_bytes), dpos(sizeof(int32_t));
  DeviceBuffer work(attention_workspace_bytes(n, n_ctx, n_heads, head_dim));
  if (work.size()) SPECD_GPU_CHECK(gpuMemset(work.get(), 0, work.size()));
  to_device(dq.get(), q, q_bytes);
  to_device(dk.get(), k_cache, cache_bytes);
  to_device(dv.get(), v_cache, cache_bytes);
  to_device(dpos.get(), &pos0, sizeof(int32_t));
  AttnArgs a;
  a.q = dq.get<float>();
  a.k_cache = dk.get();
  a.v_cache = dv.get();
  a.kv_f16 = kv_f16;
  a.n_ctx = n_ctx;
  a.n = n;
  a.d_pos0 = dpos.get<int32_t>();
  a.n_heads = n_heads;
  a.n_kv_heads = n_kv_heads;
  a.head_dim = head_dim;
  a.scale = scale;
  a.out = dout.get<float>();
  a.work = work.get();
  gpu::attention(a, nullptr);
  SPECD_GPU_CHECK(gpuMemset(dout.get(), 0xff, q_bytes));  // NaN: the second run must write every output
  gpu::attention(a, nullptr);  // on the same workspace: the fold's counters must be back at 0
  SPECD_GPU_CHECK(gpuDeviceSynchronize());
  to_host(out, dout.get(), q_bytes);
}

void rope_attention(const float* qkv, int64_t ld_qkv, int64_t n, int32_t pos0, int32_t n_heads, int32_t n_kv_heads,
                    int32_t head_dim, const float* q_norm, const float* k_norm, float eps, const RopeParams& rope,
                    void* k_cache, void* v_cache, bool kv_f16, int64_t n_ctx, float scale, float* out) {
  if (n_heads <= 0 || ld_qkv < (int64_t)(n_heads + 2 * n_kv_heads) * head_dim)
    throw Error("rope_attention: n_heads must be > 0 and ld_qkv hold a row of q|k|v");
  DeviceRopeKv d("rope_attention", qkv, ld_qkv, n, pos0, n_heads, n_kv_heads, head_dim, q_norm, k_norm, eps, rope,
                 k_cache, v_cache, kv_f16, n_ctx);
  const size_t out_bytes = sizeof(float) * (size_t)(n * n_heads * head_dim);
  DeviceBuffer dout(out_bytes), work(attention_workspace_bytes(n, n_ctx, n_heads, head_dim));
  if (work.size()) SPECD_GPU_CHECK(gpuMemset(work.get(), 0, work.size()));
  AttnArgs a = attention_args(d.args);
  a.scale = scale;
  a.out = dout.get<float>();
  a.work = work.get();
  gpu::attention(a, nullptr);
  SPECD_GPU_CHECK(gpuDeviceSynchronize());
  to_host(out, dout.get(), out_bytes);
  d.caches_to_host(k_cache, v_cache);
}

}  // namespace testing
}  // namespace gpu
}  // namespace specd
