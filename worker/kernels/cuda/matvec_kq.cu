// specd/cuda/matvec_kq.cu: linear() for n <= kMaxSmallBatch rows of x when every weight is
// Q4_K or Q6_K (or every weight Q8_0), in every engine (LinearArgs::tensor_cores is for F16):
// the digit reader with the weights loaded straight into registers. From 5 rows of x on
// (NVIDIA sm_80+) matvec_kq_mma.cu computes the same rows, bit for bit, on tensor cores.
//
// Why a kernel of its own: matvec.cu stages every weight byte through shared memory (cp.async
// into a ring of stages, a group barrier per stage) so that one kernel reads every type at
// any alignment, and two thirds of its instructions are that bookkeeping. Here each lane
// loads the bytes it sums itself: a Q4_K block is 144 = 9 x 16 bytes, so its header (d,
// dmin, 12 scale bytes) and qs are 16-byte aligned whenever the rows are (three 16-byte
// loads per chunk); a Q6_K block is 210 bytes, so block b of a row starting on a 4-byte
// boundary starts 2b mod 4 bytes past one: its fields (16-byte aligned within the block)
// are read as 4-byte words and re-aligned with one funnel shift per word; a Q8_0 chunk (two
// 34-byte blocks, 68 bytes) is 4-byte aligned: 17 words. (Q6_K and Q8_0 rows need only be
// 4-byte aligned: Qwen3-0.6B's Q6_K rows of 1024 and 3072 are 840 and 2520 bytes.) Those word
// loads touch a dozen lines each across a group, so on sm_80+ Q6_K-only and Q8_0-only calls
// whose steps are whole 16-byte pieces first copy each step's bytes to shared memory,
// coalesced (KqStaged), and read the same words from there.
//
// Work (cuda/matvec_direct.cuh: the kernel shared with matvec_f16.cu): lane l takes the
// chunks c = l + 32 i of its group's rows, i = 0, 1, ... (a chunk = 64 weights; Q4_K: qs
// group g = c % 4 of block c / 4, low nibbles = elements 64c .. 64c + 31 = sub-block 2g, high
// nibbles = 64c + 32 .. 64c + 63 = sub-block 2g + 1; Q6_K: quarter (h, m) = (c % 4 / 2, c % 2)
// of block c / 4, the four 16-element runs 128h + 16m + 32k, k < 4, which share their ql / qh
// bytes; Q8_0: blocks 2c, 2c + 1).
//
// Maths: x times the norm weight in 23-bit integer digits per 32-element block
// (cuda/digits.cuh), in shared memory once per CTA. Per run of weights (Q4_K: a 32-element
// sub-block, unsigned q with the high nibbles read in place as 16 q; Q6_K: 16 elements as
// signed 4 (q - 32), as matvec.cu's digit reader; Q8_0: a block, int8 q) and row of x: the
// exact sums S_t (dp4a per byte plane), S = S0 2^16 + (S1 2^8 + S2) (one or two roundings;
// Q4_K: one exact int32, one rounding, the high nibbles' 16 taken out of it: digit_sum_q4),
// times the block's grid step (exact), times the run's scale in the accumulating fma; Q4_K
// then adds its minimum -(dmin mn) times the sub-block's sum of x (one more fma). A lane adds
// its runs in order and the group reduces with a fixed butterfly, so a row's result depends
// only on its weights and K, not on n, NR, the tile or the other rows: batch invariance as on
// matvec.cu's paths (every row of such a call comes here, for any n; a Store mixing Q4_K and
// Q6_K, QKV with a Q6_K V, is one launch whose blocks of rows each have one type).
#include <algorithm>
#include <cstdlib>
#include <string>
#include <type_traits>

#include "cuda/digits.cuh"
#include "cuda/mma.cuh"
#include "cuda/matvec_direct.cuh"
#include "cuda/quants.cuh"

namespace specd {
namespace gpu {

bool kq_linear(const LinearArgs& a, gpuStream_t s);
bool kq_mma_linear(const LinearArgs& a, gpuStream_t s);  // matvec_kq_mma.cu

namespace {

using direct::kRpg;
using direct::kThreads;
constexpr int kSpan = 2048;  // elements the 32 lanes of a group cover in one step

struct KqParams : LinParams {
  int32_t plane = 0;  // bytes of one digit plane of a row of x (K rounded up to kSpan)
  int32_t n_cb = 0;   // blocks of rows (direct::kWarps * kRpg weight rows each, twice that with halves)
  int32_t halves = 0; // 1: groups of 16 lanes (matvec_direct.cuh)
  int32_t stage_off = 0;  // staged readers: where the staging area starts (matvec_direct.cuh)
};

// Digits of one row of x in shared memory: planes D0, D1, D2 (`plane` bytes each), element
// 64c + 16q + j (c = chunk, q < 4, j < 16) at byte ((c / 32) 4 + q) 512 + (c % 32) 16 + j of
// each, so the 32 lanes of a step read 32 consecutive 16-byte pieces (no bank conflicts);
// then per chunk a float4 {grid step of sub-block 2c, its sum of x, the same for 2c + 1}.
__host__ __device__ constexpr int digit_row_bytes(int plane) { return kPlanes * plane + plane / 4; }
// where the 16 digits of (chunk c, quarter q) start in each plane; of element e
__device__ __forceinline__ int digit_run(int c, int q) { return ((((c >> 5) << 2) + q) << 9) + ((c & 31) << 4); }
__device__ __forceinline__ int digit_at(int e) { return digit_run(e >> 6, (e >> 4) & 3) + (e & 15); }

// The digits of x[r] (times norm_w, when kNorm) for the tile's NR rows, all of K: thread t
// takes the units (4 elements) t, t + 256, ... of every row (8 consecutive lanes a 32-element
// block), C units of each row with all their loads in flight before any is used (kSkip: a
// round's units past K, none of which any thread holds, neither loaded nor converted); with
// ss, also each row's sum of squares in unit order (the same in every CTA, for every n).
template <int NR, int C, bool kNorm, bool kSkip>
__device__ __forceinline__ void prep_rounds(const KqParams& p, const int32_t (&xoff)[NR], uint8_t* dig, float* ss) {
  const int units = (int)(p.K / 4), plane = p.plane;
  for (int i0 = 0; i0 * kThreads < units; i0 += C) {  // (uniform trip count: whole groups shuffle)
    float4 a[C][NR], n[C];
#pragma unroll
    for (int c = 0; c < C; ++c) {
      if (kSkip && (i0 + c) * kThreads >= units) break;  // (uniform)
      const int u = (i0 + c) * kThreads + (int)threadIdx.x;
      n[c] = make_float4(1.f, 1.f, 1.f, 1.f);
      if (kNorm && u < units) n[c] = __ldg(reinterpret_cast<const float4*>(p.norm_w) + u);
#pragma unroll
      for (int r = 0; r < NR; ++r)
        a[c][r] = u < units ? __ldg(reinterpret_cast<const float4*>(p.x + xoff[r]) + u) : make_float4(0.f, 0.f, 0.f, 0.f);
    }
#pragma unroll
    for (int c = 0; c < C; ++c) {
      if (kSkip && (i0 + c) * kThreads >= units) break;  // (uniform)
      const int u = (i0 + c) * kThreads + (int)threadIdx.x;
#pragma unroll
      for (int r = 0; r < NR; ++r) {
        if (ss != nullptr && u < units) ss[r] = add_squares(a[c][r], ss[r]);
        const Digits4 d = block_digits4(a[c][r], n[c]);
        if (u < units) {
          uint8_t* row = dig + (size_t)r * digit_row_bytes(plane);
          const int at = digit_at(4 * u);
#pragma unroll
          for (int t = 0; t < kPlanes; ++t) *reinterpret_cast<uint32_t*>(row + t * plane + at) = d.d[t];
          if ((u & 7) == 0) {  // sub-block u / 8 = 2c + h: meta[4c + 2h], [4c + 2h + 1]
            float* meta = reinterpret_cast<float*>(row + kPlanes * plane);
            meta[u / 4] = d.xsb;
            meta[u / 4 + 1] = (float)d.sum * d.xsb;
          }
        }
      }
    }
  }
}

// prep_rounds for the tile (digits.cuh): kPrepNormUnits / NR units in flight with the norm
// (its weights' loads take registers too), kPrepUnits / NR without, skipping the units past
// K. kTight (kernels of 3 CTAs per SM, 80 registers: Q4_K with one row of x) keeps the
// rounds of kPrepNormUnits and no skip: both spilled there (Qwen3-8B Q4_K_M decode 3-5 %
// slower, tools/device/fwd_variants.py on the H200).
template <int NR, bool kTight>
__device__ __forceinline__ void prep_digits(const KqParams& p, const int32_t (&xoff)[NR], uint8_t* dig, float* ss) {
  constexpr int CN = kPrepNormUnits >= NR ? kPrepNormUnits / NR : 1, CX = kTight ? CN : kPrepUnits / NR;
  if (p.norm_w != nullptr) prep_rounds<NR, CN, true, !kTight>(p, xoff, dig, ss);
  else prep_rounds<NR, CX, false, !kTight>(p, xoff, dig, ss);
}

// Exact integer sums S_t of 16 weight bytes w (4 words; kWSigned: int8, else uint8) times the
// digit planes at d (planes `plane` bytes apart), added into S.
template <bool kWSigned>
__device__ __forceinline__ void dot16(const uint32_t (&w)[4], const uint8_t* d, int plane, int (&S)[kPlanes]) {
  if constexpr (kPlanes == 3) {  // (the same as the loop below; written out, the registers of the 8B's decode QKV)
    const uint4 p0 = *reinterpret_cast<const uint4*>(d);
    const uint4 p1 = *reinterpret_cast<const uint4*>(d + plane);
    const uint4 p2 = *reinterpret_cast<const uint4*>(d + 2 * plane);
    S[0] = gpu_dot4<kWSigned, true>(w[0], p0.x, S[0]);
    S[1] = gpu_dot4<kWSigned, false>(w[0], p1.x, S[1]);
    S[2] = gpu_dot4<kWSigned, false>(w[0], p2.x, S[2]);
    S[0] = gpu_dot4<kWSigned, true>(w[1], p0.y, S[0]);
    S[1] = gpu_dot4<kWSigned, false>(w[1], p1.y, S[1]);
    S[2] = gpu_dot4<kWSigned, false>(w[1], p2.y, S[2]);
    S[0] = gpu_dot4<kWSigned, true>(w[2], p0.z, S[0]);
    S[1] = gpu_dot4<kWSigned, false>(w[2], p1.z, S[1]);
    S[2] = gpu_dot4<kWSigned, false>(w[2], p2.z, S[2]);
    S[0] = gpu_dot4<kWSigned, true>(w[3], p0.w, S[0]);
    S[1] = gpu_dot4<kWSigned, false>(w[3], p1.w, S[1]);
    S[2] = gpu_dot4<kWSigned, false>(w[3], p2.w, S[2]);
    return;
  }
  uint4 pl[kPlanes];
#pragma unroll
  for (int t = 0; t < kPlanes; ++t) pl[t] = *reinterpret_cast<const uint4*>(d + t * plane);
  const auto dot = [&](uint32_t wk, int k) {
#pragma unroll
    for (int t = 0; t < kPlanes; ++t) {
      const uint32_t x = k == 0 ? pl[t].x : k == 1 ? pl[t].y : k == 2 ? pl[t].z : pl[t].w;
      S[t] = t == 0 ? gpu_dot4<kWSigned, true>(wk, x, S[t]) : gpu_dot4<kWSigned, false>(wk, x, S[t]);
    }
  };
  dot(w[0], 0);
  dot(w[1], 1);
  dot(w[2], 2);
  dot(w[3], 3);
}

template <GgmlType T>
struct Kq;

// Q4_K chunk c: the block's header and qs bytes 32g .. 32g + 31 (g = c % 4), 16-byte loads.
template <>
struct Kq<GgmlType::Q4_K> {
  static constexpr int kBytes = 144;
  struct Chunk {
    uint4 h, a, b;
  };
  __device__ static void load(const uint8_t* row, int c, Chunk& ch, GgmlType = GgmlType::Q4_K) {
    const uint4* blk = reinterpret_cast<const uint4*>(row + kBytes * (c >> 2));
    ch.h = __ldg(blk);
    ch.a = __ldg(blk + 1 + 2 * (c & 3));
    ch.b = __ldg(blk + 2 + 2 * (c & 3));
  }
  // The chunks (step i, this lane) of the group's kRpg rows times the tile's NR rows of x.
  template <int NR>
  __device__ static void dot(const Chunk (&ch)[kRpg], const uint8_t* dig, int plane, int i, int lane,
                             float (&acc)[kRpg][NR], GgmlType = GgmlType::Q4_K) {
    const int g = lane & 3, c = lane + kGroup * i;
    float s[kRpg][2], m[kRpg][2];
#pragma unroll
    for (int rr = 0; rr < kRpg; ++rr) {
      const uint32_t sh = 16 * (g & 1);  // scale bytes 2 (g % 2) .. of each 4
      uint32_t sc, mn;
      kquant_pair_of(ch[rr].h.y >> sh, ch[rr].h.z >> sh, ch[rr].h.w >> sh, g, sc, mn);
      kquant_sm(ch[rr].h.x, sc, mn, s[rr], m[rr]);
    }
#pragma unroll
    for (int r = 0; r < NR; ++r) {
      const uint8_t* row = dig + (size_t)r * digit_row_bytes(plane);
      int S[kRpg][2][kPlanes];
#pragma unroll
      for (int rr = 0; rr < kRpg; ++rr)
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
          for (int t = 0; t < kPlanes; ++t) S[rr][h][t] = 0;
#pragma unroll
      for (int q = 0; q < 4; ++q) {  // elements 64c + 16q ..: low nibbles of a, b, then high
#pragma unroll
        for (int rr = 0; rr < kRpg; ++rr) {
          const uint4 v = (q & 1) ? ch[rr].b : ch[rr].a;
          const uint32_t mask = q < 2 ? 0x0F0F0F0Fu : 0xF0F0F0F0u;
          const uint32_t w[4] = {v.x & mask, v.y & mask, v.z & mask, v.w & mask};
          dot16<false>(w, row + digit_run(c, q), plane, S[rr][q >> 1]);
        }
      }
      const float4 meta = *reinterpret_cast<const float4*>(row + kPlanes * plane + 16 * c);
#pragma unroll
      for (int rr = 0; rr < kRpg; ++rr) {
        acc[rr][r] = fmaf(digit_sum_q4(S[rr][0], false) * meta.x, s[rr][0], acc[rr][r]);
        acc[rr][r] = fmaf(m[rr][0], meta.y, acc[rr][r]);
        acc[rr][r] = fmaf(digit_sum_q4(S[rr][1], true) * meta.z, s[rr][1], acc[rr][r]);
        acc[rr][r] = fmaf(m[rr][1], meta.w, acc[rr][r]);
      }
    }
  }
};

// Q6_K chunk c = quarter (h, m) of block b = c / 4: ql bytes 64h + 16m and 64h + 32 + 16m
// (16 each), qh bytes 32h + 16m (16), scales 8h + m + 2k (k < 4) and d. Block b of a 4-byte
// aligned row starts 2b mod 4 bytes past a word boundary, so each 16-byte field is 5
// aligned words re-aligned by sh = 16 (b % 2) bits (b % 2 = (lane / 4) % 2: fixed per lane).
template <>
struct Kq<GgmlType::Q6_K> {
  static constexpr int kBytes = 210;
  struct Chunk {
    uint32_t w[3][5];  // ql (run 0, 2), ql (run 1, 3), qh: 5 aligned words each
    uint32_t s[3];     // scale bytes 8h .. 8h + 7 (3 aligned words)
    uint32_t d;
  };
  // The chunk's words from block blk (global memory, through the read-only path, or a copy
  // of the block in shared memory at the same address mod 4: the reads stay within bytes
  // -2 .. 211 of the block, and past 209 only for an even block, never a step's last).
  template <bool kGlobal>
  __device__ static void load_block(const uint8_t* blk, int c, Chunk& ch) {
    const auto word = [](const uint32_t* a) {
      if constexpr (kGlobal) return __ldg(a);
      else return *a;
    };
    const int h = (c >> 1) & 1, m = c & 1;
    const int off[3] = {64 * h + 16 * m, 64 * h + 32 + 16 * m, 128 + 32 * h + 16 * m};
#pragma unroll
    for (int f = 0; f < 3; ++f) {
      const uint32_t* a = reinterpret_cast<const uint32_t*>((uintptr_t)(blk + off[f]) & ~(uintptr_t)3);
#pragma unroll
      for (int k = 0; k < 5; ++k) ch.w[f][k] = word(a + k);
    }
    const uint32_t* a = reinterpret_cast<const uint32_t*>((uintptr_t)(blk + 192 + 8 * h) & ~(uintptr_t)3);
#pragma unroll
    for (int k = 0; k < 3; ++k) ch.s[k] = word(a + k);
    const unsigned short* d = reinterpret_cast<const unsigned short*>(blk + 208);
    if constexpr (kGlobal) ch.d = __ldg(d);
    else ch.d = *d;
  }
  __host__ __device__ static constexpr int chunk_offset(int j) { return kBytes * (j >> 2); }
  __device__ static void load(const uint8_t* row, int c, Chunk& ch, GgmlType = GgmlType::Q6_K) {
    load_block<true>(row + chunk_offset(c), c, ch);
  }
  template <int NR>
  __device__ static void dot(const Chunk (&ch)[kRpg], const uint8_t* dig, int plane, int i, int lane,
                             float (&acc)[kRpg][NR], GgmlType = GgmlType::Q6_K) {
    const int c = lane + kGroup * i, h = (c >> 1) & 1, m = c & 1;
    const uint32_t sh = 16 * ((lane >> 2) & 1);
    // 4 (q - 32) as int8 for the runs k of each row, and their scales d sc_k / 4
    uint32_t q[kRpg][4][4];
    float s[kRpg][4];
#pragma unroll
    for (int rr = 0; rr < kRpg; ++rr) {
      uint32_t ql[2][4], qh[4];
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        ql[0][k] = __funnelshift_r(ch[rr].w[0][k], ch[rr].w[0][k + 1], sh);
        ql[1][k] = __funnelshift_r(ch[rr].w[1][k], ch[rr].w[1][k + 1], sh);
        qh[k] = __funnelshift_r(ch[rr].w[2][k], ch[rr].w[2][k + 1], sh);
      }
#pragma unroll
      for (int k = 0; k < 4; ++k)  // run k: ql[k % 2], nibble k / 2; qh bits 2k, 2k + 1
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const uint32_t lo = (k < 2 ? ql[k & 1][j] << 2 : ql[k & 1][j] >> 2) & 0x3C3C3C3Cu;
          q[rr][k][j] = (lo | ((qh[j] << (6 - 2 * k)) & 0xC0C0C0C0u)) ^ 0x80808080u;
        }
      const uint32_t s01 = __funnelshift_r(ch[rr].s[0], ch[rr].s[1], sh);  // scale bytes 8h .. 8h + 3
      const uint32_t s23 = __funnelshift_r(ch[rr].s[1], ch[rr].s[2], sh);  // 8h + 4 .. 8h + 7
      const float d = f16_bits(ch[rr].d) * 0.25f;
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const uint32_t word = k < 2 ? s01 : s23;
        s[rr][k] = d * (float)(int8_t)(word >> (8 * (m + 2 * (k & 1))));
      }
    }
#pragma unroll
    for (int r = 0; r < NR; ++r) {
      const uint8_t* row = dig + (size_t)r * digit_row_bytes(plane);
#pragma unroll
      for (int k = 0; k < 4; ++k) {  // elements 256b + 128h + 16m + 32k: chunk cc, quarter m + 2 (k % 2)
        const int cc = 4 * (c >> 2) + 2 * h + (k >> 1);
        const uint8_t* d = row + digit_run(cc, m + 2 * (k & 1));
        const float xs = reinterpret_cast<const float*>(row + kPlanes * plane)[4 * cc + 2 * (k & 1)];
#pragma unroll
        for (int rr = 0; rr < kRpg; ++rr) {
          int S[kPlanes] = {};
          dot16<true>(q[rr][k], d, plane, S);
          acc[rr][r] = fmaf(digit_sum(S) * xs, s[rr][k], acc[rr][r]);
        }
      }
    }
  }
};

// Q8_0 chunk c = blocks 2c, 2c + 1 (68 bytes from 68c: 4-byte aligned in a 4-byte aligned
// row): 17 aligned words; block 2c's d and qs start 2 bytes into word 0 (qs re-aligned by a
// funnel shift of 16 bits), block 2c + 1's d is the high half of word 8 and its qs are words
// 9 .. 16. Runs = the two blocks (32 elements, scale d).
template <>
struct Kq<GgmlType::Q8_0> {
  static constexpr int kBytes = 34;
  struct Chunk {
    uint32_t w[17];
  };
  __host__ __device__ static constexpr int chunk_offset(int j) { return 2 * kBytes * j; }
  template <bool kGlobal>
  __device__ static void load_block(const uint8_t* at, int, Chunk& ch) {
    const uint32_t* a = reinterpret_cast<const uint32_t*>(at);
#pragma unroll
    for (int k = 0; k < 17; ++k) {
      if constexpr (kGlobal) ch.w[k] = __ldg(a + k);
      else ch.w[k] = a[k];
    }
  }
  __device__ static void load(const uint8_t* row, int c, Chunk& ch, GgmlType = GgmlType::Q8_0) {
    load_block<true>(row + chunk_offset(c), c, ch);
  }
  template <int NR>
  __device__ static void dot(const Chunk (&ch)[kRpg], const uint8_t* dig, int plane, int i, int lane,
                             float (&acc)[kRpg][NR], GgmlType = GgmlType::Q8_0) {
    const int c = lane + kGroup * i;
    uint32_t q[kRpg][2][8];  // int8 weights of block 2c + h
    float d[kRpg][2];
#pragma unroll
    for (int rr = 0; rr < kRpg; ++rr) {
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        q[rr][0][k] = __funnelshift_r(ch[rr].w[k], ch[rr].w[k + 1], 16);
        q[rr][1][k] = ch[rr].w[9 + k];
      }
      d[rr][0] = f16_bits(ch[rr].w[0] & 0xFFFF);
      d[rr][1] = f16_bits(ch[rr].w[8] >> 16);
    }
#pragma unroll
    for (int r = 0; r < NR; ++r) {
      const uint8_t* row = dig + (size_t)r * digit_row_bytes(plane);
      const float4 meta = *reinterpret_cast<const float4*>(row + kPlanes * plane + 16 * c);
#pragma unroll
      for (int h = 0; h < 2; ++h) {  // block 2c + h: quarters 2h, 2h + 1 of chunk c
        int S[kRpg][kPlanes];
#pragma unroll
        for (int rr = 0; rr < kRpg; ++rr)
#pragma unroll
          for (int t = 0; t < kPlanes; ++t) S[rr][t] = 0;
#pragma unroll
        for (int e = 0; e < 2; ++e) {
#pragma unroll
          for (int rr = 0; rr < kRpg; ++rr) {
            const uint32_t w[4] = {q[rr][h][4 * e], q[rr][h][4 * e + 1], q[rr][h][4 * e + 2], q[rr][h][4 * e + 3]};
            dot16<true>(w, row + digit_run(c, 2 * h + e), plane, S[rr]);
          }
        }
#pragma unroll
        for (int rr = 0; rr < kRpg; ++rr)
          acc[rr][r] = fmaf(digit_sum(S[rr]) * (h ? meta.z : meta.x), d[rr][h], acc[rr][r]);
      }
    }
  }
};

// A Store of both types (QKV with a Q6_K V) in one launch: each block of rows belongs to one
// weight, so has one type; a chunk's registers hold either type's loads (as words).
struct KqMix {
  using R4 = Kq<GgmlType::Q4_K>;
  using R6 = Kq<GgmlType::Q6_K>;
  static constexpr int kWords = 19;
  static_assert(sizeof(R4::Chunk) <= 4 * kWords && sizeof(R6::Chunk) == 4 * kWords, "chunk words");
  struct Chunk {
    uint32_t w[kWords];
  };
  template <class C>
  __device__ static void pack(const C& x, Chunk& ch) {
#pragma unroll
    for (int k = 0; k < (int)(sizeof(C) / 4); ++k) ch.w[k] = reinterpret_cast<const uint32_t*>(&x)[k];
  }
  template <class C>
  __device__ static void unpack(const Chunk& ch, C& x) {
#pragma unroll
    for (int k = 0; k < (int)(sizeof(C) / 4); ++k) reinterpret_cast<uint32_t*>(&x)[k] = ch.w[k];
  }
  __device__ static void load(const uint8_t* row, int c, Chunk& ch, GgmlType t) {
    if (t == GgmlType::Q4_K) {
      R4::Chunk x;
      R4::load(row, c, x);
      pack(x, ch);
    } else {
      R6::Chunk x;
      R6::load(row, c, x);
      pack(x, ch);
    }
  }
  template <int NR>
  __device__ static void dot(const Chunk (&ch)[kRpg], const uint8_t* dig, int plane, int i, int lane,
                             float (&acc)[kRpg][NR], GgmlType t) {
    if (t == GgmlType::Q4_K) {
      R4::Chunk x[kRpg];
#pragma unroll
      for (int rr = 0; rr < kRpg; ++rr) unpack(ch[rr], x[rr]);
      R4::dot<NR>(x, dig, plane, i, lane, acc);
    } else {
      R6::Chunk x[kRpg];
#pragma unroll
      for (int rr = 0; rr < kRpg; ++rr) unpack(ch[rr], x[rr]);
      R6::dot<NR>(x, dig, plane, i, lane, acc);
    }
  }
};

// The direct kernel's reader (cuda/matvec_direct.cuh) for chunks of type K (Kq<T> or KqMix).
template <class K>
struct KqReader {
  using Kind = K;
  static constexpr bool kMixed = std::is_same<K, KqMix>::value;
  // (mixed: a QKV whose V is Q6_K, read as words: its blocks are the slow ones)
  static bool last_is_slow(const KqParams& p) { return p.w[p.n_w - 1].type == GgmlType::Q6_K; }
  using Params = KqParams;
  using Chunk = typename K::Chunk;
  static constexpr const char* kName = "kq_kernel";
  static constexpr int kSpan = kGroup;  // chunks of a row per step
  // CTAs per SM the kernel is compiled for (registers per thread follow: no spills; Q8_0 and
  // Q6_K load ~19 words per row and buffer)
  static constexpr int min_blocks(int nr) {
    constexpr bool q4k = std::is_same<K, Kq<GgmlType::Q4_K>>::value, mix = std::is_same<K, KqMix>::value;
    return nr == 1 ? (q4k ? 3 : 2) : nr == 2 ? 2 : (q4k || mix ? 1 : 2);
  }
  __device__ static int units(const Params& p) { return (int)(p.K / 64); }
  static int64_t max_chunks(int64_t n_in) { return n_in / 64; }  // (one step: c = lane)
  __device__ static void load(const uint8_t* const (&rows)[kRpg], int nc, int lane, int i, Chunk (&ch)[kRpg],
                              GgmlType t) {
    const int c = lane + kGroup * i;
    if (c < nc) {
#pragma unroll
      for (int rr = 0; rr < kRpg; ++rr) K::load(rows[rr], c, ch[rr], t);
    }
  }
  template <int NR>
  __device__ static void prep(const Params& p, const int32_t (&xoff)[NR], uint8_t* smem, float* ss) {
    prep_digits<NR, (min_blocks(NR) >= 3)>(p, xoff, smem, ss);
  }
  template <int NR>
  __device__ static void dot(const Params& p, const Chunk (&ch)[kRpg], const uint8_t* smem, int nc, int i, int lane,
                             float (&acc)[kRpg][NR], GgmlType t) {
    if (lane + kGroup * i < nc) K::template dot<NR>(ch, smem, p.plane, i, lane, acc, t);
  }
};

// KqReader with the stream two steps ahead (matvec_direct.cuh, IsAhead) for one row of x: its
// two steps of chunks live through the x preparation, so 121 registers and 2 CTAs per SM.
template <class K>
struct KqAhead : KqReader<K> {
  static constexpr const char* kName = "kq_ahead_kernel";
  static constexpr bool kAhead = true;
  static constexpr int min_blocks(int) { return 2; }
  template <int NR>
  __device__ static void prep(const KqParams& p, const int32_t (&xoff)[NR], uint8_t* smem, float* ss) {
    prep_digits<NR, false>(p, xoff, smem, ss);
  }
};

// Whether a decode (one row of x) call of Q4_K weights takes KqAhead (SPECD_GPU_AHEAD=0: never):
// rows of two steps (2048 < K <= 4096) and at most one block of rows per SM, so that each CTA's
// every weight byte is in flight before the grid wait and the SM keeps room for the next
// launch's CTAs. Qwen3-0.6B's Q4_K ffn_down (K 3072, 64 blocks) takes it: its decode step
// 1.3-1.6 % shorter (H100, tools/device/ab_call.sh). Qwen3-8B's wo (256 blocks) does not: two
// 121-register CTAs per SM kept gate/up's CTAs from becoming resident early, and its loads
// during the decode attention slowed that; the step was level (...-h100_20261206_wo-ahead.md).
bool kq_ahead(const LinearArgs& a) {
  static const bool on = env_value("SPECD_GPU_AHEAD") != "0";
  const int64_t nc = a.w[0]->n_in / 64;
  return on && a.n == 1 && nc > kGroup && nc <= 2 * kGroup &&
         cta_count(a, (int64_t)direct::kWarps * kRpg) <= dev_limits().sms;
}

// Copies `bytes` (a multiple of 16) from global src to shared dst with the group's `lanes`
// lanes, 16 bytes per copy, asynchronously where the device has cp.async (sm_80+).
__device__ __forceinline__ void copy_to_shared(uint8_t* dst, const uint8_t* src, int bytes, int lane, int lanes) {
  for (int o = lane * 16; o < bytes; o += lanes * 16) {
#if SPECD_MMA
    cp_async16_all(dst + o, src + o);
#else
    *reinterpret_cast<uint4*>(dst + o) = __ldg(reinterpret_cast<const uint4*>(src + o));
#endif
  }
}

// The digit reader staged through shared memory (matvec_direct.cuh, IsStaged), for calls of
// one type whose steps are whole 16-byte pieces (kq_staged). A Q6_K lane's chunk is spread
// over 19 words of its block, and the 8 blocks of a step lie 210 bytes apart, so each of its
// loads straight from global memory touches ~12 lines for 128 useful bytes (ncu, Qwen3-8B's
// ffn_down: the L1 busy 86 % of the time, 7.5x the sectors of the bytes read). Here a group
// copies a step's bytes of its rows (the chunks' blocks: contiguous) in coalesced 16-byte
// pieces, kSlots - 1 steps ahead, and each lane reads its chunk from the copy: the same
// words, so the same sums.
template <class K, int kSlotsN>
struct KqStaged : KqReader<K> {
  using Base = KqReader<K>;
  using typename Base::Chunk;
  using typename Base::Params;
  static constexpr bool kStaged = true;
  static constexpr int kSlots = kSlotsN;
  static constexpr const char* kName = "kq_staged_kernel";
  static constexpr int min_blocks(int) { return 2; }
  __host__ __device__ static constexpr int region_bytes(int halves) { return K::chunk_offset(kGroup >> halves); }
  static size_t stage_bytes(int halves) {
    return (size_t)(direct::kWarps << halves) * kSlots * kRpg * region_bytes(halves);
  }
  // Step i of the group's rows into slot (kRpg regions).
  __device__ static void issue(const Params& p, const uint8_t* const (&rows)[kRpg], int nc, int lane, int lanes,
                               int i, uint8_t* slot) {
    const int bytes = K::chunk_offset(min(lanes, nc - lanes * i)), rb = region_bytes(p.halves);
#pragma unroll
    for (int rr = 0; rr < kRpg; ++rr)
      copy_to_shared(slot + rr * rb, rows[rr] + (size_t)K::chunk_offset(lanes) * i, bytes, lane, lanes);
  }
  __device__ static void commit() {
#if SPECD_MMA
    cp_async_commit();
#endif
  }
  template <int kPending>
  __device__ static void wait_groups() {
#if SPECD_MMA
    cp_async_wait<kPending>();
#endif
  }
  __device__ static void take(const Params& p, const uint8_t* slot, int nc, int lane, int i, Chunk (&ch)[kRpg]) {
    const int c = lane + kGroup * i;
    if (c >= nc) return;
    const int rb = region_bytes(p.halves);
#pragma unroll
    for (int rr = 0; rr < kRpg; ++rr)
      K::template load_block<false>(slot + rr * rb + K::chunk_offset(lane), c, ch[rr]);
  }
};

// Whether a call of one type takes the staged reader S (matvec_direct.cuh): on NVIDIA sm_80+
// (cp.async), for the types named in SPECD_GPU_STAGE (default "q6,q8"; "" none; names
// separated by ',' or '+'), when every row and every step's bytes of a row are whole 16-byte
// pieces and the largest tile's digits and the staging area fit the device. The same choice
// for every n: the sums do not depend on the reader. (Ring slots, H200, fwd1 against loads
// straight into registers: Q6_K with 2, Qwen3-8B Q4_K_M +4.9 %, 3 slots were slower; Q8_0 with
// 3, 0.6B +4-5 % and 8B +5.3 %, 3 even where only one CTA then fits an SM: 2 slots there lost.)
template <class S>
bool kq_staged(const LinearArgs& a, size_t row_bytes, const char* name) {
  static const std::string names = [] {
    std::string v = "," + (std::getenv("SPECD_GPU_STAGE") ? env_value("SPECD_GPU_STAGE") : std::string("q6,q8")) + ",";
    std::replace(v.begin(), v.end(), '+', ',');
    return v;
  }();
  if (names.find(std::string(",") + name + ",") == std::string::npos || !dev_limits().mma) return false;
  using K = typename S::Kind;
  const int64_t nc = a.w[0]->n_in / 64;  // chunks of a row
  const int halves = direct::halves_on() && S::max_chunks(a.w[0]->n_in) <= kGroup / 2;
  const int lanes = kGroup >> halves, last = (int)(nc - (nc - 1) / lanes * lanes);
  if (K::chunk_offset((int)std::min<int64_t>(lanes, nc)) % 16 != 0 || K::chunk_offset(last) % 16 != 0) return false;
  for (int j = 0; j < a.n_w; ++j)
    if (a.w[j]->row_stride % 16 != 0) return false;
  return (size_t)direct::kMaxTile * row_bytes + S::stage_bytes(halves) + direct::kStaticSmem <=
         dev_limits().smem_per_block;
}

}  // namespace

// Takes the call when the digit reader applies (SPECD_GPU_DIGITS and SPECD_GPU_DIRECT not
// "0"), every weight is Q4_K or Q6_K (one type for SwiGLU), or every
// weight Q8_0, with 16-byte aligned data, Q4_K rows a multiple of 16 bytes (always: 144-byte
// blocks) and Q6_K / Q8_0 rows of 4 (Q6_K: an even number of blocks, K a multiple of 512, as
// in Qwen3-0.6B's 1024 and 3072; the readers' word offsets assume it), n <= 64 and the digits
// of the largest tile fit the device's shared memory (never a choice by n: batch
// invariance); returns whether it did.
bool kq_linear(const LinearArgs& a, gpuStream_t s) {
  static const bool digits = env_value("SPECD_GPU_DIGITS") != "0";
  if (!digits || !direct::applies(a, /*any_engine=*/true, /*row_align=*/4)) return false;
  bool q4 = false, q6 = false, q8 = false;
  for (int j = 0; j < a.n_w; ++j) {
    const GgmlType t = a.w[j]->type;
    if (t == GgmlType::Q4_K) q4 = true;
    else if (t == GgmlType::Q6_K) q6 = true;
    else if (t == GgmlType::Q8_0) q8 = true;
    else return false;
    if (t == GgmlType::Q4_K && a.w[j]->row_stride % 16 != 0) return false;  // (16-byte loads)
  }
  if (q8 && (q4 || q6)) return false;
  if (a.w[0]->n_in % 64 != 0) return false;  // (whole chunks: Q8_0 rows of 32 x odd blocks)
  if (a.ep == Epilogue::SwiGLU && a.w[0]->type != a.w[1]->type) return false;
  const int64_t plane = ceil_div(a.w[0]->n_in, kSpan) * kSpan;
  if (plane >= (1 << 28)) return false;
  const size_t row_bytes = digit_row_bytes((int)plane);
  if (!direct::tile_fits(row_bytes)) return false;
  // from here on every n takes this file's order of operations; 5..64 rows may compute it on
  // tensor cores (matvec_kq_mma.cu), the same bits
  if (kq_mma_linear(a, s)) return true;
  const auto fill = [plane](KqParams& p) { p.plane = (int32_t)plane; };
  using Q8 = Kq<GgmlType::Q8_0>;
  using Q6 = Kq<GgmlType::Q6_K>;
  if (q8) {
    if (kq_staged<KqStaged<Q8, 3>>(a, row_bytes, "q8")) direct::launch<KqStaged<Q8, 3>>(a, row_bytes, s, fill);
    else direct::launch<KqReader<Q8>>(a, row_bytes, s, fill);
  } else if (q4 && q6) {
    direct::launch<KqReader<KqMix>>(a, row_bytes, s, fill);
  } else if (q4) {
    if (kq_ahead(a)) direct::launch<KqAhead<Kq<GgmlType::Q4_K>>>(a, row_bytes, s, fill);
    else direct::launch<KqReader<Kq<GgmlType::Q4_K>>>(a, row_bytes, s, fill);
  } else if (kq_staged<KqStaged<Q6, 2>>(a, row_bytes, "q6")) {
    direct::launch<KqStaged<Q6, 2>>(a, row_bytes, s, fill);
  } else {
    direct::launch<KqReader<Q6>>(a, row_bytes, s, fill);
  }
  return true;
}

}  // namespace gpu
}  // namespace specd
