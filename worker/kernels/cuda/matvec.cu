// specd/cuda/matvec.cu: linear() for n <= kMaxSmallBatch rows of x (decode, speculative
// verify), the argument checks and path choice of linear(), embed_rows, and the testing
// entry points of both (cuda/testing.h). The kernel here stages the weights through shared
// memory, which reads every type at any alignment; in engines that do not speculate, calls
// whose weights are all Q4_K / Q6_K, all Q8_0 (matvec_kq.cu) or all F16 / BF16
// (matvec_f16.cu) with 16-byte aligned rows go to the direct readers instead.
//
// Maths: y[r, o] = sum_k W[o, k] * x[r, k], float32 activations and accumulation, then
// bias and epilogue (cuda/linear.cuh). Two readers: floats (every type; fused RMSNorm: sum_k
// W[o,k] (x[r,k] inv_r nw[k]) is computed as inv_r * sum_k (W[o,k] nw[k]) x[r,k], so the norm
// weight is applied once per weight element and shared by all rows of x) and, for Q8_0 / Q4_K
// / Q6_K in engines that do not speculate, integer digits of x (its own section below: x nw
// rounded once per 32-element block, exact dp4a sums, inv_r at the end).
//
// Launch: 256 threads = 8 groups of 32 lanes; grid.x = persistent CTAs (as many as fit) over
// the blocks of rows of the weights, grid.y = tiles of NR rows of x (NR = 1 .. 16 by n).
// Each group owns 1, 2 or 4 weight rows (RPG) and streams their bytes through its own part
// of shared memory, 1024 elements (512 for F16/BF16, 256 for F32) per stage, with 16-byte
// coalesced copies (cp.async on sm_80+, 3 stages, two in flight while one is read); groups
// never wait for each other in the K loop.
//
// Batch invariance: in every stage, lane l of a group owns pieces l, l+32, l+64, l+96 (8
// weights each, quants.cuh; Q4_K: pieces 2m, 2m+1 of blocks l/16 and 2 + l/16, m = l % 16,
// so that one read of a block's scales serves 16 weights) and accumulates them in that order
// into its sum, which the group reduces with a fixed butterfly. A row's operation sequence
// depends only on its weights and K (and the stage size, fixed by the weight types of the
// call): not on n, NR, the tile, the other rows, RPG or which CTA takes the block. So row r
// of y is bit-identical whatever else is computed with it. The RMSNorm factor of a row is a
// fixed-order reduction over the whole CTA (float4 steps, then block_sum), the same in every
// CTA. (The digit reader: the same argument, its lane -> run mapping in quants.cuh.)
#include <algorithm>
#include <cstdlib>
#include <mutex>
#include <string>

#include "cuda/digits.cuh"
#include "cuda/linear.cuh"
#include "cuda/linear_params.cuh"
#include "cuda/mma.cuh"
#include "cuda/quants.cuh"
#include "cuda/testing.h"


namespace specd {
namespace gpu {

void matmul_large(const LinearArgs& a, gpuStream_t s);  // matmul.cu: n > kMaxSmallBatch
bool tc_linear(const LinearArgs& a, gpuStream_t s);     // matvec_tc.cu: tensor cores, n <= kMaxSmallBatch
bool kq_linear(const LinearArgs& a, gpuStream_t s);     // matvec_kq.cu: Q4_K / Q6_K digits, n <= kMaxSmallBatch
bool f16_linear(const LinearArgs& a, gpuStream_t s);    // matvec_f16.cu: F16 / BF16, n <= kMaxSmallBatch

namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / kGroup;  // groups per CTA
constexpr int kStages = 3;                 // staged buffers (2 copies in flight while one is read)

// Staging geometry: K elements per stage (one launch uses one value: 1024, or 512 / 256 when
// a float type is present so that a stage of a row stays near 1 KiB), bytes of one row per
// stage, and the shared-memory pitch of a row (one spare 16-byte chunk: a copy starts at the
// 16-byte boundary below the row's bytes).
constexpr int stage_elems_for(GgmlType t) {
  return t == GgmlType::F32 ? 256 : (t == GgmlType::F16 || t == GgmlType::BF16) ? 512 : 1024;
}
constexpr int stage_pitch(GgmlType t, int elems) { return 16 * ((elems / block_elems(t) * block_bytes(t) + 15) / 16 + 1); }
constexpr int max_pitch() {
  int m = 0;
  for (GgmlType t : {GgmlType::F32, GgmlType::F16, GgmlType::BF16, GgmlType::Q8_0, GgmlType::Q4_0, GgmlType::Q4_1,
                     GgmlType::Q5_0, GgmlType::Q5_1, GgmlType::Q4_K, GgmlType::Q5_K, GgmlType::Q6_K})
    m = std::max(m, stage_pitch(t, stage_elems_for(t)));  // (a launch's stage is at most its types' own)
  return m;
}
// The digit path's window (below): at most kDigitBytes for all rows of x of a CTA, each
// taking 3 bytes per element, a float per 32 (xs) and one per 16 (run sums).
constexpr int kDigitBytes = 64 << 10;
constexpr int digit_row_bytes(int win) { return kPlanes * win + win / 8 + win / 4; }
constexpr bool int_type(GgmlType t) { return t == GgmlType::Q8_0 || t == GgmlType::Q4_K || t == GgmlType::Q6_K; }
constexpr int kMaxDigitTile = 4;  // calls on the digit path take tiles of at most 4 rows of x
// Largest shared memory of a CTA with RPG rows per group: staging (52 KiB (Q8_0) per 2 rows)
// and the digit window.
constexpr size_t max_smem(int rpg) { return (size_t)kStages * kWarps * rpg * max_pitch() + kDigitBytes; }

// ---- asynchronous 16-byte copies global -> shared (plain copies where cp.async is absent)

__device__ __forceinline__ void cp16(uint8_t* dst, const uint8_t* src, int bytes) {
#if SPECD_MMA
  cp_async16_n(dst, src, bytes);  // bytes < 16 only at the very end of a weight
#else
  if (bytes == 16) {
    *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
  } else {
    for (int i = 0; i < bytes; ++i) dst[i] = src[i];
  }
#endif
}
__device__ __forceinline__ void cp16_all(uint8_t* dst, const uint8_t* src) {
#if SPECD_MMA
  cp_async16_all(dst, src);
#else
  *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
#endif
}
__device__ __forceinline__ void cp_commit() {
#if SPECD_MMA
  cp_async_commit();
#endif
}
template <int N>
__device__ __forceinline__ void cp_wait() {  // this thread's copies but the newest N groups are done
#if SPECD_MMA
  cp_async_wait<N>();
#endif
}

__device__ __forceinline__ float4 ldg4(const float* p) { return __ldg(reinterpret_cast<const float4*>(p)); }

// ---- kernel parameters

struct MvWeight : LinWeight {    // (cta0: first blockIdx.x of the weight)
  const uint8_t* end = nullptr;  // data + n_out * stride: copies never read past it
  int32_t stage_bytes = 0;       // bytes of one row per full stage
  int32_t last_bytes = 0;        // ... in the last stage
};

struct MvParams : LinParamsOf<MvWeight> {
  int32_t stage_elems = 1024;     // K elements per stage
  int32_t pitch = 0;              // shared bytes per staged row
  int32_t win = 0;                // K elements per digit window (0: no digit path in this call)
  int32_t ring_bytes = 0;         // staging buffers (the digit window follows them)
  int32_t n_cb = 0;               // blocks of rows (8 groups' rows each) to cover
};

// A group's staged row: where its bytes come from and how many per stage.
struct GroupRow {
  const uint8_t* src;  // the row
  const uint8_t* end;  // end of the weight
  int32_t sb, lb;      // bytes per full / last stage
  GgmlType type;
};

// Copies stage st of row g into dst (the 16-byte aligned chunks covering it; the row's
// misalignment mod 16 is kept), lanes over chunks.
__device__ __forceinline__ void stage_copy(const GroupRow& g, int st, bool last, uint8_t* dst, int lane) {
  const uint8_t* start = g.src + (size_t)st * g.sb;
  const uint8_t* a = reinterpret_cast<const uint8_t*>((uintptr_t)start & ~(uintptr_t)15);
  const int n_chunks = (int)(((uintptr_t)start & 15) + (last ? g.lb : g.sb) + 15) >> 4;
  if (a + 16 * n_chunks <= g.end) {  // (all but a weight's very last chunk: no size to work out)
    const uint8_t* src = a + 16 * lane;
    uint8_t* d = dst + 16 * lane;
    for (int c = lane; c < n_chunks; c += kGroup, src += 16 * kGroup, d += 16 * kGroup) cp16_all(d, src);
    return;
  }
  for (int c = lane; c < n_chunks; c += kGroup) {
    const uint8_t* src = a + 16 * c;
    const int64_t left = g.end - src;
    cp16(dst + 16 * c, src, left >= 16 ? 16 : (int)left);
  }
}

__device__ __forceinline__ void load8(const float* p, int gap, float (&v)[8]) {
  const float4 a = ldg4(p), b = ldg4(p + gap);
  v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w;
  v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
}

// acc += one piece's products with x: for Scaled, s_0 (q.x over run 0) then s_1 (q.x over
// run 1); otherwise the 8 exact weights in order. One accumulator per (weight row, x row).
template <bool kScaled>
__device__ __forceinline__ void piece_dot(const float (&w)[8], const float (&s)[2], const float (&x)[8], float& acc) {
  if constexpr (kScaled) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float t = w[4 * h] * x[4 * h];
      t = fmaf(w[4 * h + 1], x[4 * h + 1], t);
      t = fmaf(w[4 * h + 2], x[4 * h + 2], t);
      t = fmaf(w[4 * h + 3], x[4 * h + 3], t);
      acc = fmaf(s[h], t, acc);
    }
  } else {
#pragma unroll
    for (int e = 0; e < 8; ++e) acc = fmaf(w[e], x[e], acc);
  }
}

// One piece (8 weights at k, runs gap apart) of each of the group's RPG rows, w and s as
// piece_dot takes them: w <- w * nw (the fused norm weight, once per weight), then
// acc[rr][r] += its products with each of the NR rows of x.
template <bool kScaled, int NR, int RPG>
__device__ __forceinline__ void piece_rows(const MvParams& p, int64_t k, int gap, float (&w)[RPG][8],
                                           const float (&s)[RPG][2], const int32_t (&xoff)[NR],
                                           float (&acc)[RPG][NR]) {
  if (p.norm_w != nullptr) {
    float nw[8];
    load8(p.norm_w + k, gap, nw);
#pragma unroll
    for (int rr = 0; rr < RPG; ++rr)
#pragma unroll
      for (int e = 0; e < 8; ++e) w[rr][e] *= nw[e];
  }
#pragma unroll
  for (int r = 0; r < NR; ++r) {
    float xv[8];
    load8(p.x + xoff[r] + k, gap, xv);
#pragma unroll
    for (int rr = 0; rr < RPG; ++rr) piece_dot<kScaled>(w[rr], s[rr], xv, acc[rr][r]);
  }
}

// Pieces lane, lane+32, lane+64, lane+96 (< n_pc) of one stage (K elements k0..) of the
// group's RPG staged rows, all of type T, times NR rows of x.
template <GgmlType T, int NR, int RPG>
__device__ __forceinline__ void stage_dot(const MvParams& p, const uint8_t* const (&base)[RPG], int n_pc, int64_t k0,
                                          const int32_t (&xoff)[NR], float (&acc)[RPG][NR], int lane) {
  using D = Dec<T>;
  constexpr bool kScaled = D::kForm == Form::Scaled;
  constexpr int kUnroll = NR * RPG >= 4 ? 1 : 4 / (NR * RPG);  // loads of several pieces in flight
  if constexpr (T == GgmlType::Q4_K) {
    // lane -> pieces (2m, 2m + 1) of block 2i + lane / 16 (m = lane % 16): one read of the
    // scales per 16 weights (q4k_pair), the pieces in that order
    const int m = lane & 15;
#pragma unroll
    for (int i = 0; i < 1024 / 256 / 2; ++i) {
      const int blk = 2 * i + (lane >> 4);
      if (blk * D::kPieces >= n_pc) break;
      const int64_t k = k0 + blk * D::kElems + 64 * (m >> 2) + 8 * (m & 3);
      Q4kPair qp[RPG];
#pragma unroll
      for (int rr = 0; rr < RPG; ++rr) qp[rr] = q4k_pair(base[rr] + blk * D::kBytes, m);
      constexpr int kPieceUnroll = NR * RPG >= 8 ? 1 : 2;  // (registers of the wide tiles)
#pragma unroll kPieceUnroll
      for (int h = 0; h < 2; ++h) {  // piece 2m, then 2m + 1
        float w[RPG][8], s[RPG][2];
#pragma unroll
        for (int rr = 0; rr < RPG; ++rr) {
          Piece pc;
          q4k_piece(qp[rr], h, pc);
          dequant<D::kForm>(pc, w[rr]);
          s[rr][0] = s[rr][1] = 1.f;
        }
        piece_rows<false, NR, RPG>(p, k + 4 * h, D::kGap, w, s, xoff, acc);
      }
    }
  } else {
#pragma unroll kUnroll
    for (int i = 0; i < 1024 / 8 / kGroup; ++i) {
      const int pi = lane + kGroup * i;
      if (pi >= n_pc) break;
      const int blk = pi / D::kPieces, sub = pi % D::kPieces;
      const int64_t k = k0 + blk * D::kElems + D::pos(sub);
      float w[RPG][8], s[RPG][2];  // Scaled: q and the run scales; else the exact weights
#pragma unroll
      for (int rr = 0; rr < RPG; ++rr) {
        Piece pc;
        D::load(base[rr] + blk * D::kBytes, sub, pc);
        if constexpr (kScaled) {
#pragma unroll
          for (int e = 0; e < 8; ++e) w[rr][e] = pc.q[e];
          s[rr][0] = pc.s[0];
          s[rr][1] = pc.s[1];
        } else {
          dequant<D::kForm>(pc, w[rr]);
          s[rr][0] = s[rr][1] = 1.f;
        }
      }
      piece_rows<kScaled, NR, RPG>(p, k, D::kGap, w, s, xoff, acc);
    }
  }
}

// ---- the digit path (Q8_0, Q4_K, Q6_K): integer weights times x in exact integer digits
//
// x times the norm weight is rounded once per 32-element block to 23-bit integer digits in
// three byte planes (cuda/digits.cuh), and a run of 16 weights (IntRuns, quants.cuh) gives
// the exact integer sums S_t = sum q D_t, four dp4a per plane; S = S0 2^16 + S1 2^8 + S2 is
// rounded to float (at most twice), times xs_b = 2^(E_b-22) (exact), times the run's scale
// in the accumulating fma (one rounding), and Q4_K adds its minimum times the run's sum of X
// xs_b (one more fma). Integer sums are exact in any order, so a row's float operations
// still depend only on its weights and K: batch invariance holds as on the float path.
//
// Window: the digits of the tile's NR rows for `win` K elements (all of K where that fits
// in kDigitBytes) live in shared memory after the staging ring; all threads of the CTA
// write them at the window's first stage, between two barriers.


// The digits of 4 elements of one row (v: x times norm_w) into the window row d at unit u
// (elements 4u .. 4u + 3): 8 consecutive lanes hold a block, 4 a run; `on` = the unit exists
// (every lane takes part in the shuffles).
__device__ __forceinline__ void store_digits4(const float (&v)[4], bool on, int u, uint8_t* d, int win) {
  const Digits4 x = digits4(v);
  int sum = x.sum;  // over 16 elements: |sum| <= 2^26, exact
  sum += gpu_shfl_xor(sum, 1);
  sum += gpu_shfl_xor(sum, 2);
  if (on) {
    float* xs = reinterpret_cast<float*>(d + kPlanes * win);
#pragma unroll
    for (int t = 0; t < kPlanes; ++t) *reinterpret_cast<uint32_t*>(d + t * win + 4 * u) = x.d[t];
    if ((u & 7) == 0) xs[u / 8] = x.xsb;
    if ((u & 3) == 0) xs[win / 32 + u / 4] = (float)sum * x.xsb;  // the run sums follow xs
  }
}

// Digits of x[r, w0 .. w0 + len) (times norm_w) for the tile's NR rows: thread t takes the
// units (4 elements) t, t + 256, ... of every row, C of each row with all their loads in
// flight before any is used. With ss (len = K), also each row's sum of squares in the order of
// the norm loop (unit order per row: the same inv in every CTA, for every n).
template <int NR>
__device__ __forceinline__ void digits_prep(const MvParams& p, const int32_t (&xoff)[NR], int64_t w0, int len,
                                            uint8_t* dig, float* ss) {
  constexpr int C = NR >= 4 ? 1 : 4 / NR;
  const int win = p.win, units = len / 4;  // len: a multiple of 32, so units of 8
  for (int i0 = 0; i0 * kThreads < units; i0 += C) {  // (uniform trip count: whole groups shuffle)
    float4 a[C][NR], n[C];
#pragma unroll
    for (int c = 0; c < C; ++c) {
      const int u = (i0 + c) * kThreads + (int)threadIdx.x;
      n[c] = make_float4(1.f, 1.f, 1.f, 1.f);
      if (u < units && p.norm_w != nullptr) n[c] = ldg4(p.norm_w + w0 + 4 * u);
#pragma unroll
      for (int r = 0; r < NR; ++r) a[c][r] = u < units ? ldg4(p.x + xoff[r] + w0 + 4 * u) : make_float4(0.f, 0.f, 0.f, 0.f);
    }
#pragma unroll
    for (int c = 0; c < C; ++c) {
      const int u = (i0 + c) * kThreads + (int)threadIdx.x;
#pragma unroll
      for (int r = 0; r < NR; ++r) {
        if (ss != nullptr && u < units) ss[r] = add_squares(a[c][r], ss[r]);
        const float v[4] = {a[c][r].x * n[c].x, a[c][r].y * n[c].y, a[c][r].z * n[c].z, a[c][r].w * n[c].w};
        store_digits4(v, u < units, u, dig + (size_t)r * digit_row_bytes(win), win);
      }
    }
  }
}

// One stage (elements k0 .. k0 + elems of the window, kw = k0 relative to it) of the group's
// RPG staged rows of type T times the tile's NR rows of x in digits: lane's two runs per row.
template <GgmlType T, int NR, int RPG>
__device__ __forceinline__ void int_stage(const uint8_t* const (&base)[RPG], int elems, int kw, const uint8_t* dig,
                                          int win, float (&acc)[RPG][NR], int lane) {
  using D = IntDec<T>;
  if (!D::busy(lane, elems)) return;
  IntRuns w[RPG];
#pragma unroll
  for (int rr = 0; rr < RPG; ++rr) D::load(base[rr], lane, w[rr]);
#pragma unroll
  for (int r = 0; r < NR; ++r) {
    const uint8_t* d = dig + (size_t)r * digit_row_bytes(win);
    const float* xs = reinterpret_cast<const float*>(d + kPlanes * win);
    const float* rs = xs + win / 32;  // (digits4's layout)
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int k = kw + w[0].k[j];  // (the same for every row of the group)
      uint4 pl[kPlanes];
#pragma unroll
      for (int t = 0; t < kPlanes; ++t) pl[t] = *reinterpret_cast<const uint4*>(d + t * win + k);
      const float xsb = xs[k >> 5];
#pragma unroll
      for (int rr = 0; rr < RPG; ++rr) {
        const uint32_t* q = w[rr].q + 4 * j;
        int S[kPlanes] = {};
#pragma unroll
        for (int e = 0; e < 4; ++e)
#pragma unroll
          for (int t = 0; t < kPlanes; ++t) {
            const uint32_t x = e == 0 ? pl[t].x : e == 1 ? pl[t].y : e == 2 ? pl[t].z : pl[t].w;
            S[t] = t == 0 ? gpu_dot4<D::kSigned, true>(q[e], x, S[t]) : gpu_dot4<D::kSigned, false>(q[e], x, S[t]);
          }
        // (times x's grid step 2^k: exact); Q4_K's run j = 1 holds the high nibbles
        const float sum = (T == GgmlType::Q4_K ? digit_sum_q4(S, j == 1) : digit_sum(S)) * xsb;
        acc[rr][r] = fmaf(sum, w[rr].s[j], acc[rr][r]);
        if constexpr (T == GgmlType::Q4_K) acc[rr][r] = fmaf(w[rr].m[j], rs[k >> 4], acc[rr][r]);
      }
    }
  }
}

// A stage of RPG rows of type T, on the digit path where the call has one, else on floats.
template <GgmlType T, int NR, int RPG>
__device__ __forceinline__ void any_stage(const MvParams& p, const uint8_t* const (&base)[RPG], int n_pc, int64_t k0,
                                          const int32_t (&xoff)[NR], const uint8_t* dig, float (&acc)[RPG][NR],
                                          int lane) {
  if constexpr (int_type(T) && NR <= kMaxDigitTile) {
    if (p.win > 0) {
      int_stage<T, NR, RPG>(base, 8 * n_pc, (int)(k0 % p.win), dig, p.win, acc, lane);
      return;
    }
  }
  stage_dot<T, NR, RPG>(p, base, n_pc, k0, xoff, acc, lane);
}

// The same for a group whose rows have different types (SwiGLU of two types): each row on
// its own, with the arithmetic of stage_dot (so each row's result is the same as there).
template <int NR, int RPG>
__device__ __forceinline__ void stage_dot_mixed(const MvParams& p, const GgmlType (&type)[RPG],
                                                const uint8_t* const (&base)[RPG], int n_pc, int64_t k0,
                                                const int32_t (&xoff)[NR], const uint8_t* dig, float (&acc)[RPG][NR],
                                                int lane) {
#pragma unroll
  for (int rr = 0; rr < RPG; ++rr) {
    const uint8_t* const b1[1] = {base[rr]};
    float a1[1][NR];
#pragma unroll
    for (int r = 0; r < NR; ++r) a1[0][r] = acc[rr][r];
    with_type(type[rr], [&](auto tag) { any_stage<decltype(tag)::value, NR, 1>(p, b1, n_pc, k0, xoff, dig, a1, lane); });
#pragma unroll
    for (int r = 0; r < NR; ++r) acc[rr][r] = a1[0][r];
  }
}

// Blocks per multiprocessor the kernel is compiled for (registers per thread follow).
constexpr int mv_min_blocks(int nr, int rpg) { return nr * rpg == 1 ? 4 : nr == 1 ? 3 : nr * rpg >= 16 ? 1 : 2; }

// The staged rows of group `warp` in block cb (group_rows, linear_params.cuh): the copy
// stream's view.
template <int RPG>
__device__ __forceinline__ void stream_rows(const MvParams& p, int cb, int warp, GroupRow (&gr)[RPG]) {
  int j0;
  int64_t o_first;
  const uint8_t* src[RPG];
  group_rows<RPG>(p, cb, warp, kWarps, j0, o_first, src);
#pragma unroll
  for (int rr = 0; rr < RPG; ++rr) {
    const MvWeight& w = p.w[p.ep == Epilogue::SwiGLU ? (rr & 1) : j0];
    gr[rr] = GroupRow{src[rr], w.end, w.stage_bytes, w.last_bytes, w.type};
  }
}

// RPG weight rows per group (8*RPG staged rows per CTA) times NR rows of x, for the blocks
// of rows cb = blockIdx.x, blockIdx.x + gridDim.x, ... < p.n_cb (persistent CTAs: x's norm
// factor and digits are prepared once per CTA, not once per block of rows).
// Each group streams its own rows through its own part of shared memory (kStages buffers
// per row), so the groups never wait for each other inside the K loop; the stream runs on
// from one block of rows into the next (the next block's first stages are in flight while
// the last ones of this block are read).
//
// Programmatic dependent launch (sm_90): the weight copies of the first stages are issued
// before gpu_grid_wait(), so they overlap the end of the kernel this one depends on; x, the
// norm weight and y are touched only after it.
template <int NR, int RPG>
__global__ void __launch_bounds__(kThreads, mv_min_blocks(NR, RPG)) matvec_kernel(const MvParams p) {
  extern __shared__ __align__(16) uint8_t smem[];
  __shared__ float red[kGroup];
  __shared__ float inv[NR];  // fused RMSNorm factor of each row (1 without the norm)
  const int lane = threadIdx.x % kGroup, warp = threadIdx.x / kGroup;
  const int64_t K = p.K, row0 = (int64_t)blockIdx.y * NR;
  const bool swiglu = p.ep == Epilogue::SwiGLU;
  int32_t xoff[NR];  // x row offsets; rows past n repeat row n-1, their results are dropped
#pragma unroll
  for (int r = 0; r < NR; ++r) xoff[r] = (int32_t)(min(row0 + r, p.n - 1) * K);

  const int se = p.stage_elems, pitch = p.pitch, n_cb = p.n_cb, step = (int)gridDim.x;
  const int n_st = (int)((K + se - 1) / se);
  uint8_t* mine = smem + (size_t)warp * RPG * kStages * pitch;  // [RPG][kStages][pitch]
  // the copy stream: stage is_st of block is_cb (rows ig) into ring slot is_slot
  int is_cb = blockIdx.x, is_st = 0, is_slot = 0;
  GroupRow ig[RPG];
  stream_rows<RPG>(p, is_cb, warp, ig);
  auto issue = [&]() {
    if (is_cb < n_cb) {
#pragma unroll
      for (int rr = 0; rr < RPG; ++rr)
        stage_copy(ig[rr], is_st, is_st == n_st - 1, mine + (rr * kStages + is_slot) * pitch, lane);
      if (++is_st == n_st) {
        is_st = 0;
        is_cb += step;
        if (is_cb < n_cb) stream_rows<RPG>(p, is_cb, warp, ig);
      }
    }
    is_slot = is_slot + 1 == kStages ? 0 : is_slot + 1;
    cp_commit();  // (an empty group past the end keeps the count uniform)
  };
#pragma unroll
  for (int st = 0; st < kStages - 1; ++st) issue();  // weights only: before the wait

  gpu_grid_wait();
  gpu_grid_launch_dependents();

  // inv_r = 1/sqrt(mean(x_r^2) + eps): one fixed-order CTA reduction per row (threads over
  // K in float4 steps, every row's loads in flight together), the same in every CTA and for
  // every n. Digit path with one window: the digits are written here, in the same pass over x.
  uint8_t* dig = smem + p.ring_bytes;  // the digit window (p.win > 0)
  const bool one_window = p.win >= K;
  if (p.norm_w != nullptr) {
    float ss[NR];
#pragma unroll
    for (int r = 0; r < NR; ++r) ss[r] = 0.f;
    if (one_window) {
      if constexpr (NR <= kMaxDigitTile) digits_prep<NR>(p, xoff, 0, (int)K, dig, ss);
    } else {
      for (int64_t k = 4 * threadIdx.x; k < K; k += 4 * kThreads) {
#pragma unroll
        for (int r = 0; r < NR; ++r) ss[r] = add_squares(ldg4(p.x + xoff[r] + k), ss[r]);
      }
    }
#pragma unroll
    for (int r = 0; r < NR; ++r) {
      const float t = block_sum(ss[r], red);
      if (threadIdx.x == 0) inv[r] = rsqrtf(t / (float)K + p.eps);
    }
  } else {
    if constexpr (NR <= kMaxDigitTile)
      if (one_window) digits_prep<NR>(p, xoff, 0, (int)K, dig, nullptr);
    if (threadIdx.x < NR) inv[threadIdx.x] = 1.f;
  }
  __syncthreads();  // inv[] and the digits are visible

  int slot = 0;  // ring slot of the stage being read
  for (int cb = blockIdx.x; cb < n_cb; cb += step) {
    int j0;
    int64_t o_first;
    GgmlType type[RPG];
    int32_t mis[RPG], sb[RPG];  // a row's misalignment mod 16 at stage st: mis + st * sb
    {
      const uint8_t* src[RPG];
      group_rows<RPG>(p, cb, warp, kWarps, j0, o_first, src);
#pragma unroll
      for (int rr = 0; rr < RPG; ++rr) {
        const MvWeight& w = p.w[swiglu ? (rr & 1) : j0];
        type[rr] = w.type;
        mis[rr] = (int32_t)((uintptr_t)src[rr] & 15);
        sb[rr] = w.stage_bytes;
      }
    }
    bool mixed = false;
#pragma unroll
    for (int rr = 1; rr < RPG; ++rr) mixed |= type[rr] != type[0];
    float acc[RPG][NR];
#pragma unroll
    for (int rr = 0; rr < RPG; ++rr)
#pragma unroll
      for (int r = 0; r < NR; ++r) acc[rr][r] = 0.f;

    for (int st = 0; st < n_st; ++st) {
      const int64_t k0 = (int64_t)st * se;
      if (p.win > 0 && !one_window && k0 % p.win == 0) {  // a new digit window (every thread)
        __syncthreads();                                 // ... once everyone is done with the last
        if constexpr (NR <= kMaxDigitTile) digits_prep<NR>(p, xoff, k0, (int)min((int64_t)p.win, K - k0), dig, nullptr);
        __syncthreads();
      }
      cp_wait<kStages - 2>();  // stage st has landed (this lane's copies)
      group_sync();            // ... everyone's; and the slot read last is free again
      issue();
      const int n_pc = (int)(min((int64_t)se, K - k0) / 8);  // pieces in this stage
      const uint8_t* base[RPG];
#pragma unroll
      for (int rr = 0; rr < RPG; ++rr)
        base[rr] = mine + (rr * kStages + slot) * pitch + ((mis[rr] + st * sb[rr]) & 15);
      slot = slot + 1 == kStages ? 0 : slot + 1;
      if constexpr (RPG >= 2) {
        if (mixed) {
          stage_dot_mixed<NR, RPG>(p, type, base, n_pc, k0, xoff, dig, acc, lane);
          continue;
        }
      }
      with_type(type[0],
                [&](auto tag) { any_stage<decltype(tag)::value, NR, RPG>(p, base, n_pc, k0, xoff, dig, acc, lane); });
    }

    // ---- reduce over the group, epilogue (one lane per value)
#pragma unroll
    for (int rr = 0; rr < RPG; ++rr)
#pragma unroll
      for (int r = 0; r < NR; ++r) acc[rr][r] = group_sum(acc[rr][r]) * inv[r];
    group_store<RPG, NR>(p, lane, row0, j0, o_first, acc);
  }
  cp_wait<0>();
}

// ---- embed_rows: out[i, :] = dequantized row tokens[i]; one CTA per token, one piece per
// thread at a time, read straight from global memory.

template <GgmlType T>
__device__ __forceinline__ void embed_row(const GpuWeight& w, int64_t tok, float* out) {
  using D = Dec<T>;
  const uint8_t* row = w.data + (size_t)tok * w.row_stride;
  for (int64_t q = threadIdx.x; q < w.n_in / 8; q += blockDim.x) {
    const int64_t blk = q / D::kPieces;
    const int sub = (int)(q % D::kPieces);
    Piece pc;
    D::load(row + blk * D::kBytes, sub, pc);
    float v[8];
    dequant<D::kForm>(pc, v);
    float* o = out + blk * D::kElems + D::pos(sub);
    *reinterpret_cast<float4*>(o) = make_float4(v[0], v[1], v[2], v[3]);
    *reinterpret_cast<float4*>(o + D::kGap) = make_float4(v[4], v[5], v[6], v[7]);
  }
}

__global__ void __launch_bounds__(kThreads) embed_kernel(const GpuWeight w, const int32_t* tokens, float* out) {
  gpu_grid_wait();  // (programmatic dependent launch: vendor.cuh)
  gpu_grid_launch_dependents();
  const int64_t i = blockIdx.x;
  const int32_t tok = tokens[i];
  float* o = out + i * w.n_in;
  if (tok < 0 || tok >= w.n_out) {  // invalid token id: a NaN row (visible, never a wild read)
    for (int64_t k = threadIdx.x; k < w.n_in; k += blockDim.x) o[k] = __int_as_float(0x7fc00000);
    return;
  }
  with_type(w.type, [&](auto tag) { embed_row<decltype(tag)::value>(w, tok, o); });
}

// ---- host side

std::string type_name(GgmlType t) {
  return type_supported((int32_t)t) ? type_traits((int32_t)t).name : "id " + std::to_string((int)t);
}

// Checks one weight for the GPU readers; `what` names it in messages.
void check_weight(const GpuWeight* w, const std::string& what) {
  SPECD_CHECK(w != nullptr && w->data != nullptr, what + " is null");
  SPECD_CHECK(gpu_type_supported(w->type),
              what + " has type " + type_name(w->type) + ", which the GPU backend cannot decode (supported: " +
                  supported_type_names() + ")");
  const std::string tn = type_name(w->type);
  SPECD_CHECK(w->n_in >= 1 && w->n_out >= 1, what + " has an empty shape [" + std::to_string(w->n_out) + ", " +
                                                 std::to_string(w->n_in) + "]");
  SPECD_CHECK(w->n_in % block_elems(w->type) == 0,
              what + ": n_in = " + std::to_string(w->n_in) + " is not a multiple of " +
                  std::to_string(block_elems(w->type)) + " (" + tn +
                  (block_elems(w->type) == 8 ? " rows are read 8 elements at a time on the GPU)" : " block size)"));
  const size_t rb = (size_t)(w->n_in / block_elems(w->type)) * block_bytes(w->type);
  SPECD_CHECK(w->row_stride >= rb, what + ": row_stride " + std::to_string(w->row_stride) + " < row bytes " +
                                       std::to_string(rb));
  SPECD_CHECK((uintptr_t)w->data % 16 == 0 && w->row_stride % row_align(w->type) == 0,
              what + ": the data must be 16-byte aligned and rows " + std::to_string(row_align(w->type)) +
                  "-byte aligned for " + tn + " (got data % 16 = " + std::to_string((uintptr_t)w->data % 16) +
                  ", row_stride " + std::to_string(w->row_stride) + ")");
}

void check_linear(const LinearArgs& a) {
  const int ep = (int)a.ep;
  SPECD_CHECK(ep >= 0 && ep <= 2, "linear: unknown epilogue " + std::to_string(ep) +
                                      " (0 = Store, 1 = Accumulate, 2 = SwiGLU)");
  SPECD_CHECK(a.n >= 1, "linear: n (rows of x) must be >= 1, got " + std::to_string(a.n));
  SPECD_CHECK(a.n_w >= 1 && a.n_w <= 3, "linear: takes 1..3 weights, got " + std::to_string(a.n_w));
  for (int j = 0; j < a.n_w; ++j) check_weight(a.w[j], "linear: weight " + std::to_string(j));
  const int64_t K = a.w[0]->n_in;
  for (int j = 1; j < a.n_w; ++j)
    SPECD_CHECK(a.w[j]->n_in == K, "linear: all weights need the same n_in; weight " + std::to_string(j) +
                                       " has " + std::to_string(a.w[j]->n_in) + ", weight 0 has " + std::to_string(K));
  if (a.ep == Epilogue::Accumulate)
    SPECD_CHECK(a.n_w == 1, "linear: Accumulate (y += x W^T) takes exactly 1 weight, got " + std::to_string(a.n_w));
  if (a.ep == Epilogue::SwiGLU) {
    SPECD_CHECK(a.n_w == 2, "linear: SwiGLU takes exactly 2 weights (gate, up), got " + std::to_string(a.n_w));
    SPECD_CHECK(a.w[0]->n_out == a.w[1]->n_out, "linear: SwiGLU gate and up need the same shape; n_out " +
                                                    std::to_string(a.w[0]->n_out) + " vs " +
                                                    std::to_string(a.w[1]->n_out));
  }
  SPECD_CHECK(a.x != nullptr && a.y != nullptr, "linear: x and y must be device pointers, got null");
  SPECD_CHECK((uintptr_t)a.x % 16 == 0, "linear: x must be 16-byte aligned (rows are read as float4)");
  int64_t cols = a.w[0]->n_out;
  if (a.ep == Epilogue::Store)
    for (int j = 1; j < a.n_w; ++j) cols += a.w[j]->n_out;
  SPECD_CHECK(a.ldy >= cols, "linear: ldy = " + std::to_string(a.ldy) + " is smaller than the " +
                                 std::to_string(cols) + " output columns");
  SPECD_CHECK(a.norm_w == nullptr || a.n <= kMaxSmallBatch,
              "linear: the fused RMSNorm (norm_w) is only available for n <= " + std::to_string(kMaxSmallBatch) +
                  " rows, got n = " + std::to_string(a.n) + "; apply rmsnorm() first for larger batches");
  SPECD_CHECK(a.norm_w == nullptr || (uintptr_t)a.norm_w % 16 == 0, "linear: norm_w must be 16-byte aligned");
  const uintptr_t x0 = (uintptr_t)a.x, x1 = (uintptr_t)(a.x + a.n * K);
  const uintptr_t y0 = (uintptr_t)a.y, y1 = (uintptr_t)(a.y + (a.n - 1) * a.ldy + cols);
  SPECD_CHECK(x1 <= y0 || y1 <= x0, "linear: y must not overlap x");
}

template <int NR, int RPG>
void launch_matvec(const MvParams& p, int ctas, size_t smem, gpuStream_t s) {
  static std::once_flag once;  // allow the largest staging buffer once per kernel
  std::call_once(once, [] {
    SPECD_GPU_CHECK(gpuFuncSetAttribute((matvec_kernel<NR, RPG>), gpuFuncAttributeMaxDynamicSharedMemorySize,
                                        (int)max_smem(RPG)));
  });
  // persistent CTAs: as many as fit at once (SPECD_GPU_PERSIST=0: one per block of rows)
  static const bool persist = env_value("SPECD_GPU_PERSIST") != "0";
  if (persist) {
    int per_sm = 0;
    SPECD_GPU_CHECK(gpuOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, (matvec_kernel<NR, RPG>), kThreads, smem));
    ctas = (int)std::min<int64_t>(ctas, (int64_t)std::max(per_sm, 1) * dev_limits().sms);
  }
  const dim3 grid((unsigned)ctas, (unsigned)ceil_div(p.n, NR));
  gpu_launch("matvec_kernel", matvec_kernel<NR, RPG>, grid, dim3(kThreads), smem, s, p);
}

// The compiled (NR, RPG) pairs: RPG 1 or 2 for tiles of up to 4 rows of x, 2 or 4 for 8 and
// 16 (more weight rows share each x load there).
template <int NR>
void launch_matvec(const MvParams& p, int rpg, int ctas, size_t smem, gpuStream_t s) {
  if constexpr (NR <= 4) {
    if (rpg == 2) launch_matvec<NR, 2>(p, ctas, smem, s);
    else launch_matvec<NR, 1>(p, ctas, smem, s);
  } else {
    if (rpg == 4) launch_matvec<NR, 4>(p, ctas, smem, s);
    else launch_matvec<NR, 2>(p, ctas, smem, s);
  }
}

// Largest tile of x rows (1, 2, 4, 8 or 16; SPECD_GPU_MAX_TILE lowers it, for benchmarks).
int max_tile() {
  static const int v = [] {
    const std::string e = env_value("SPECD_GPU_MAX_TILE");
    const int t = e.empty() ? 16 : std::atoi(e.c_str());
    return t >= 16 ? 16 : t >= 8 ? 8 : t >= 4 ? 4 : t >= 2 ? 2 : 1;
  }();
  return v;
}

}  // namespace

void linear(const LinearArgs& a, gpuStream_t s) {
  check_linear(a);
  if (a.n > kMaxSmallBatch) {
    matmul_large(a, s);
    return;
  }
  if (tc_linear(a, s) || kq_linear(a, s) || f16_linear(a, s)) return;
  const int64_t K = a.w[0]->n_in;
  // The digit reader serves engines that do not speculate (a.tensor_cores false): one decode
  // step costs less there, a verify of 4-16 rows more (each CTA rounds every row of x).
  static const bool digits = env_value("SPECD_GPU_DIGITS") != "0";  // "0": the float reader for all types
  bool any_int = false;
  for (int j = 0; j < a.n_w; ++j) any_int |= int_type(a.w[j]->type);
  const bool use_digits = digits && any_int && !a.tensor_cores;  // (K % 32 == 0: the integer types' blocks)
  const int nr = std::min({max_tile(), use_digits ? kMaxDigitTile : 16,
                           a.n <= 1 ? 1 : a.n <= 2 ? 2 : a.n <= 4 ? 4 : a.n <= 8 ? 8 : 16});
  const int64_t tiles = ceil_div(a.n, nr);
  // Weight rows per group: tiles of up to 4 x rows take 2 (16 rows per CTA) unless that
  // leaves fewer than ~2 CTAs per SM; tiles of 8 and 16 take 4 (each x load feeds 4 rows)
  // unless that leaves fewer CTAs than SMs. SwiGLU counts gate and up rows: 2, or 4 for
  // tiles of 8 and 16.
  const int64_t sms = dev_limits().sms;
  const int hi = nr <= 4 ? 2 : 4;
  int rpg = cta_count(a, (int64_t)hi * kWarps) * tiles >= (nr <= 4 ? 2 * sms : sms) ? hi : hi / 2;
  if (a.ep == Epilogue::SwiGLU && nr <= 4) rpg = 2;  // a (gate, up) pair per group at least
  MvParams p;
  const int64_t ctas = fill_params(p, a, (int64_t)kWarps * rpg);
  int se = 1024;
  for (int j = 0; j < a.n_w; ++j) se = std::min(se, stage_elems_for(a.w[j]->type));
  p.stage_elems = se;
  const int64_t last = K - (ceil_div(K, se) - 1) * se;  // elements in the last stage
  for (int j = 0; j < a.n_w; ++j) {
    MvWeight& m = p.w[j];
    m.end = m.data + (size_t)m.n_out * m.stride;
    m.stage_bytes = se / block_elems(m.type) * block_bytes(m.type);
    m.last_bytes = (int32_t)(last / block_elems(m.type) * block_bytes(m.type));
    p.pitch = std::max(p.pitch, stage_pitch(m.type, se));
  }
  SPECD_CHECK(ctas < (int64_t)1 << 31, "linear: too many output rows");
  p.n_cb = (int32_t)ctas;
  SPECD_CHECK(a.n * K < (int64_t)1 << 31, "linear: x has more than 2^31 elements");
  p.ring_bytes = kStages * kWarps * rpg * p.pitch;
  size_t smem = (size_t)p.ring_bytes;
  if (use_digits) {
    const int64_t most = (int64_t)kDigitBytes * 8 / ((8 * kPlanes + 3) * nr) / se * se;  // digit_row_bytes(w)
    p.win = (int32_t)std::min(ceil_div(K, se) * se, most);
    smem += (size_t)nr * digit_row_bytes(p.win);
  }
  switch (nr) {
    case 1: launch_matvec<1>(p, rpg, (int)ctas, smem, s); break;
    case 2: launch_matvec<2>(p, rpg, (int)ctas, smem, s); break;
    case 4: launch_matvec<4>(p, rpg, (int)ctas, smem, s); break;
    case 8: launch_matvec<8>(p, rpg, (int)ctas, smem, s); break;
    default: launch_matvec<16>(p, rpg, (int)ctas, smem, s); break;
  }
}

void embed_rows(const GpuWeight& w, const int32_t* d_tokens, int64_t n, float* out, gpuStream_t s) {
  check_weight(&w, "embed_rows: weight");
  SPECD_CHECK(n >= 0, "embed_rows: n must be >= 0");
  if (n == 0) return;
  SPECD_CHECK(d_tokens != nullptr && out != nullptr, "embed_rows: tokens and out must be device pointers");
  SPECD_CHECK((uintptr_t)out % 16 == 0, "embed_rows: out must be 16-byte aligned");
  SPECD_CHECK(n < (int64_t)1 << 31, "embed_rows: too many tokens");
  gpu_launch("embed_kernel", embed_kernel, dim3((unsigned)n), dim3(kThreads), 0, s, w, d_tokens, out);
}

// ---- testing entry points (host arrays)

namespace testing {

namespace {
DeviceBuffer upload(const void* src, size_t bytes) {
  DeviceBuffer b(bytes ? bytes : 16);
  to_device(b.get(), src, bytes);
  return b;
}
GpuWeight upload_weight(const WeightView& w, std::vector<DeviceBuffer>& keep) {
  const size_t bytes = w.row_stride * (size_t)w.n_out;
  keep.push_back(upload(w.data, bytes));
  GpuWeight g;
  g.type = w.type;
  g.n_in = w.n_in;
  g.n_out = w.n_out;
  g.data = keep.back().get<uint8_t>();
  g.row_stride = w.row_stride;
  return g;
}
}  // namespace

void linear(const std::vector<WeightView>& ws, const std::vector<const float*>& biases, const float* x, int64_t n,
            const float* norm_w, float eps, int32_t epilogue, float* y, int64_t ldy, bool tensor_cores) {
  SPECD_CHECK(!ws.empty() && ws.size() <= 3, "linear takes 1..3 weights");
  SPECD_CHECK(biases.size() == ws.size(), "give one bias (or null) per weight");
  SPECD_CHECK(n >= 1, "linear: n (rows of x) must be >= 1, got " + std::to_string(n));
  std::vector<DeviceBuffer> keep;
  keep.reserve(16);
  GpuWeight gw[3];
  LinearArgs a;
  a.n_w = (int32_t)ws.size();
  const int64_t K = ws[0].n_in;
  for (size_t j = 0; j < ws.size(); ++j) {
    gw[j] = upload_weight(ws[j], keep);
    a.w[j] = &gw[j];
    if (biases[j]) {
      keep.push_back(upload(biases[j], sizeof(float) * (size_t)ws[j].n_out));
      a.bias[j] = keep.back().get<float>();
    }
  }
  keep.push_back(upload(x, sizeof(float) * (size_t)(n * K)));
  a.x = keep.back().get<float>();
  a.n = n;
  if (norm_w) {
    keep.push_back(upload(norm_w, sizeof(float) * (size_t)K));
    a.norm_w = keep.back().get<float>();
  }
  a.eps = eps;
  keep.push_back(upload(y, sizeof(float) * (size_t)(n * ldy)));  // Accumulate reads y
  a.y = keep.back().get<float>();
  a.ldy = ldy;
  a.ep = static_cast<Epilogue>(epilogue);
  a.tensor_cores = tensor_cores;
  int64_t rows = 0;  // room for the weights in fp16 too (the quantized prefill's path)
  for (const WeightView& w : ws) rows += w.n_out;
  if (const size_t wb = linear_work_bytes(n, K, rows)) {
    keep.push_back(DeviceBuffer(wb));
    a.work = keep.back().get();
    a.work_bytes = wb;
  }
  gpu::linear(a, nullptr);
  SPECD_GPU_CHECK(gpuStreamSynchronize(nullptr));
  to_host(y, a.y, sizeof(float) * (size_t)(n * ldy));
}

void embed_rows(const WeightView& w, const int32_t* tokens, int64_t n, float* out) {
  std::vector<DeviceBuffer> keep;
  keep.reserve(3);
  const GpuWeight g = upload_weight(w, keep);
  keep.push_back(upload(tokens, sizeof(int32_t) * (size_t)n));
  const int32_t* dt = keep.back().get<int32_t>();
  keep.push_back(DeviceBuffer(sizeof(float) * (size_t)(n * w.n_in) + 16));
  float* dout = keep.back().get<float>();
  gpu::embed_rows(g, dt, n, dout, nullptr);
  SPECD_GPU_CHECK(gpuStreamSynchronize(nullptr));
  to_host(out, dout, sizeof(float) * (size_t)(n * w.n_in));
}

}  // namespace testing
}  // namespace gpu
}  // namespace specd
