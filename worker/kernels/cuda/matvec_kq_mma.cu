// specd/cuda/matvec_kq_mma.cu: the digit reader of matvec_kq.cu for 5..64 rows of x (a
// speculative verify, a short prompt; SPECD_GPU_MMA_MIN) on TENSOR CORES (NVIDIA sm_80+): the
// same rows, bit for bit, with the weights read once for 8 or 16 rows of x instead of once per 4.
//
// Why it can be bit-identical: matvec_kq.cu's sums are exact integers until a run ends (x in
// 23-bit digits per 32-element block, three byte planes D_t; S_t = sum q D_t), and int8 MMAs
// (m16n8k32 / m16n8k16, s32 accumulation) give the same S_t exactly. What follows is float,
// and this file performs the same float operations in the same order per output:
//   * a run's term: acc = fma(digit_sum(S) * grid step, scale, acc) (Q4_K: digit_sum_q4;
//     + its minimum
//     acc = fma(m, sum of x, acc)), the runs of a chunk (64 weights) in the reader's order;
//   * class l = chunk c mod 32 (the lane of matvec_kq.cu that sums chunk c) adds its chunks in
//     ascending c: here warp w (quad w < 8) takes the chunks c = w + 8 j in ascending order and
//     keeps the four classes w + 8 q (q = j mod 4) apart;
//   * the group's butterfly (group_sum: lanes xor 16, 8, 4, 2, 1) is a fixed tree over the 32
//     classes: quad w's value is (A0 + A2) + (A1 + A3) (A_q = class w + 8 q), then the quads
//     meet as ((Q0 + Q4) + (Q2 + Q6)) + ((Q1 + Q5) + (Q3 + Q7)) (a + b == b + a exactly);
//   * times the fused norm's factor inv_r (the same per-thread unit order and block_sum), then
//     the same epilogue (store_value / store_swiglu).
//
// Work: a tile = 16 MT weight rows (MT m-tiles of 16; SwiGLU: 8 MT gate rows over the same up
// rows) times NX = 8 NT rows of x (n-tiles of 8); the 8 warps of a persistent CTA take the
// tile's 8 quads (tiles of two m-tiles of Q4_K / Q6_K: 16 warps, one m-tile each; tiles of one
// m-tile: 16 warps, two per quad splitting its chunks; so that an SM runs 16 warps of at most
// 128 registers), each loading its chunks' bytes straight from global
// memory one chunk ahead (Q8_0: three; the stream runs on into the CTA's next tile), and meet
// in shared memory at the tile's end.
// x is turned into digits once per call (digits_kernel: a CTA per 1024 elements of a row, into
// the workspace: 3 bytes per element plus a grid step and a sum per 32-element block, laid out
// as the CTAs' shared memory wants it); each CTA copies its NX rows' image into shared memory
// (NX (3.25 K + 512 MT) bytes with the partial sums: K up to ~4096 for 16 rows on a 227 KiB
// device) or, when that does not fit, reads it through L1 (the 8B's down projection, K = 12288).
//
// Lane (g = lane / 4, t = lane % 4) of a warp: weight rows g, g + 8 of each m-tile, x rows
// 2t, 2t + 1 of each n-tile (the D fragment). The MMA's k-slots are a permutation of a run's
// elements shared by A and B: for a 32-element run, slots 4t.. = elements 8t .. 8t + 3 and
// slots 16 + 4t.. = 8t + 4 .. 8t + 7 (Q4_K: qs bytes 8t .. 8t + 7 of the chunk's 32, low
// nibbles one run and high nibbles the next; Q8_0: qs bytes 8t .. 8t + 7 of a block); for a
// 16-element Q6_K run (m16n8k16), slots 4t.. = elements 4t .. 4t + 3.
#include <algorithm>
#include <mutex>

#include "cuda/digits.cuh"
#include "cuda/linear.cuh"
#include "cuda/linear_params.cuh"
#include "cuda/mma.cuh"
#include "cuda/quants.cuh"
#include "cuda/trace.cuh"

namespace specd {
namespace gpu {

bool kq_mma_linear(const LinearArgs& a, gpuStream_t s);
size_t kq_mma_work_bytes(int64_t n, int64_t K);

namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / kGroup;  // = the 8 quads of a tile
constexpr size_t kStaticSmem = 1024;       // room left for the kernel's static shared memory

struct MmaParams : LinParams {
  int32_t n_tiles = 0;  // tiles of 16 MT weight rows (SwiGLU: 8 MT gate + 8 MT up rows)
  int32_t nc = 0;       // chunks (64 elements) per row
  // LinearArgs::work: per tile of NX rows of x its shared-memory image (digits and meta, see
  // mma_smem), img_bytes each, written by digits_kernel; then inv_r of every row
  uint8_t* img = nullptr;
  float* inv = nullptr;
  int64_t img_bytes = 0;
};

// Shared memory for NX rows of x: the digit planes (plane t of segment s (16 elements) of row
// r: 16 bytes at t * K NX + (s NX + r) 16), then per 32-element block b and row r a float2 {grid
// step, grid step * sum of the digits} at (b NX + r), then the tile's partial sums
// [8 quads][16 MT weight rows][NX].
__host__ __device__ constexpr size_t image_bytes(int64_t K, int NX) { return (size_t)NX * (size_t)(kPlanes * K + K / 4); }
// Warps of a quad that split its chunks (each keeping its own partial sums) in a kernel of MT
// m-tiles and H warps per quad (kq_mma_kernel): 2 for one m-tile in two warps, else 1.
__host__ __device__ constexpr int quad_split(int MT, int H) { return H > MT ? H / MT : 1; }
// (KS: quad_split of the kernel)
__host__ __device__ constexpr size_t mma_smem(int64_t K, int NX, int MT, int KS = 1) {
  return image_bytes(K, NX) + (size_t)NX * (size_t)(4 * kWarps * KS * 16 * MT);
}

// The tile's weight and first output: Store / Accumulate rows o_first + i of weight j0
// (i < 16 MT); SwiGLU gate and up rows o_first + i (i < 8 MT).
template <int MT>
__device__ __forceinline__ void tile_of(const MmaParams& p, int tile, int& j0, int64_t& o_first) {
  j0 = 0;
  if (p.ep == Epilogue::SwiGLU) {
    o_first = (int64_t)tile * 8 * MT;
    return;
  }
  if (p.n_w > 1 && tile >= p.w[1].cta0) j0 = 1;
  if (p.n_w > 2 && tile >= p.w[2].cta0) j0 = 2;
  o_first = (int64_t)(tile - p.w[j0].cta0) * 16 * MT;
}

// Tile row i = 16 mt + g + 8 h (lane g's rows of m-tile mt): Store / Accumulate output
// o_first + i of weight j0; SwiGLU gate row o_first + i for i < 8 MT, else up row i - 8 MT.
template <int MT>
__device__ __forceinline__ const uint8_t* tile_row(const MmaParams& p, int j0, int64_t o_first, int i) {
  const bool swiglu = p.ep == Epilogue::SwiGLU;
  const bool up = swiglu && i >= 8 * MT;
  const LinWeight& w = p.w[swiglu ? (up ? 1 : 0) : j0];
  const int64_t o = min(o_first + (up ? i - 8 * MT : i), w.n_out - 1);  // (clamped: results dropped)
  return w.data + (size_t)o * w.stride;
}

// The lane's weight rows of a tile (MT m-tiles) in its warp's MW m-tiles from m0: [m-tile][g, g + 8].
template <int MT, int MW>
__device__ __forceinline__ void lane_rows(const MmaParams& p, int tile, int g, int m0, const uint8_t* (&rows)[MW][2]) {
  int j0;
  int64_t o_first;
  tile_of<MT>(p, tile, j0, o_first);
#pragma unroll
  for (int mt = 0; mt < MW; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) rows[mt][h] = tile_row<MT>(p, j0, o_first, 16 * (m0 + mt) + g + 8 * h);
}

// Plane `plane` of row r's segment s in shared memory (see mma_smem): row r sits in slot
// r ^ f(s) of its segment, f(s) = 4 (s % 2) + (s / 2) % 4 (a permutation of s % 8), so that
// the 8 segments a group of 32 threads writes (consecutive elements of one row) fall in
// different banks, as do the 8 rows a warp reads of one segment, and the two segments 2k,
// 2k + 1 that the lanes of a 32-element run read as 8 bytes each (half a warp per phase:
// rows 0..3 or 4..7 of both segments) fall in opposite 64-byte halves of the banks.
__device__ __forceinline__ int seg_swizzle(int s) { return ((s & 1) << 2) | ((s >> 1) & 3); }
template <int NX>
__device__ __forceinline__ uint8_t* seg_ptr(uint8_t* dig, int64_t K, int plane, int s, int r) {
  return dig + (size_t)plane * (size_t)(K * NX) + (size_t)(s * NX + (r ^ seg_swizzle(s))) * 16;
}
template <int NX>
__device__ __forceinline__ const uint8_t* seg_at(const uint8_t* dig, int64_t K, int plane, int s, int r) {
  return seg_ptr<NX>(const_cast<uint8_t*>(dig), K, plane, s, r);
}

#if SPECD_MMA
// 4 bytes at a 2-byte aligned address p: the aligned words below and above, shifted
__device__ __forceinline__ void ld_a2(const uint8_t* p, uint32_t& w0, uint32_t& w1) {
  const uint32_t* a = reinterpret_cast<const uint32_t*>((uintptr_t)p & ~(uintptr_t)3);
  w0 = __ldg(a);
  w1 = __ldg(a + 1);
}

// x's digits and meta: from shared memory, or (G) from the call's image in global memory
template <bool G, class V>
__device__ __forceinline__ V ldx(const void* p) {
  if constexpr (G) return __ldg(reinterpret_cast<const V*>(p));
  else return *reinterpret_cast<const V*>(p);
}

// A run's B fragments, plane by plane: the bytes at seg_at(segment, row) + off (V: uint2 for a
// 32-element run, 8 bytes of two segments; uint32_t for a 16-element run).
template <bool G, int NX, class V>
__device__ __forceinline__ void run_planes(const uint8_t* dig, int64_t K, int seg, int row, int off, V (&b)[kPlanes]) {
#pragma unroll
  for (int pl = 0; pl < kPlanes; ++pl) b[pl] = ldx<G, V>(seg_at<NX>(dig, K, pl, seg, row) + off);
}
// A 32-element run's exact sums S_t (D_0 signed, D_1, D_2 unsigned digits; kAS: signed weights)
template <bool kAS>
__device__ __forceinline__ void run_sums(const uint32_t (&a)[4], const uint2 (&b)[kPlanes], int (&D)[kPlanes][4]) {
  mma_i8_k32<kAS, true>(D[0], a, b[0].x, b[0].y);
#pragma unroll
  for (int pl = 1; pl < kPlanes; ++pl) mma_i8_k32<kAS, false>(D[pl], a, b[pl].x, b[pl].y);
}
// The same for a 16-element run of signed weights (rows g: a[0], g + 8: a[1])
template <bool kAS>
__device__ __forceinline__ void run_sums(const uint32_t (&a)[2], const uint32_t (&b)[kPlanes], int (&D)[kPlanes][4]) {
  static_assert(kAS, "16-element runs hold signed weights (Q6_K)");
  mma_i8_k16<true, true>(D[0], a[0], a[1], b[0]);
#pragma unroll
  for (int pl = 1; pl < kPlanes; ++pl) mma_i8_k16<true, false>(D[pl], a[0], a[1], b[pl]);
}

// One run (x's segment seg, 32-element block blk) of the MT weight fragments a[mt] against
// every tile of x (NT tiles of 8 rows, B fragments of type V at byte off): for each output
// fin(acc[mt][nt][e], mt, e, S, xs, xsum), S the exact sums S_t of the run (digit planes),
// xs and xsum the scale and block sum of its row of x (2t + (e & 1) of the tile).
template <bool kAS, bool G, int NX, class V, int NT, int MT, class Frag, class Fin>
__device__ __forceinline__ void run_tiles(const Frag (&a)[MT], const uint8_t* dig, const float* meta, int64_t K,
                                          int seg, int blk, int g, int t, int off, float (&acc)[MT][NT][4], Fin fin) {
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    V b[kPlanes];
    run_planes<G, NX>(dig, K, seg, 8 * nt + g, off, b);
    const float4 mx = ldx<G, float4>(meta + 2 * (blk * NX + 8 * nt + 2 * t));
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      int D[kPlanes][4];
      run_sums<kAS>(a[mt], b, D);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        int S[kPlanes];
#pragma unroll
        for (int pl = 0; pl < kPlanes; ++pl) S[pl] = D[pl][e];
        fin(acc[mt][nt][e], mt, e, S, (e & 1) ? mx.z : mx.x, (e & 1) ? mx.w : mx.y);
      }
    }
  }
}

template <GgmlType T, int MT>
struct Mq;

// Q4_K chunk c (matvec_kq.cu): block c / 4's header and its qs bytes 32 (c % 4) ..: the lane
// reads qs bytes 8t .. 8t + 7 (low nibbles: elements 8t.. of sub-block 2 (c % 4), high: of the
// next) and the 16-byte header of each of its rows.
template <int MT>
struct Mq<GgmlType::Q4_K, MT> {
  // 2: a ring of 4 (the header shared by shuffles, to fit the registers) made the 8B's verify
  // slower on the H200 (8.6-9.0 against 8.1 ms for 16 rows; bench/results/..._20261203_verify.md)
  static constexpr int kDepth = 2;
  struct Chunk {
    uint2 q[MT][2];
    uint4 h[MT][2];
  };
  __device__ static void load(const uint8_t* const (&rows)[MT][2], int c, int t, Chunk& ch) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const uint8_t* blk = rows[mt][h] + 144 * (c >> 2);
        ch.h[mt][h] = __ldg(reinterpret_cast<const uint4*>(blk));
        ch.q[mt][h] = __ldg(reinterpret_cast<const uint2*>(blk + 16 + 32 * (c & 3) + 8 * t));
      }
  }
  template <int NT, bool G>
  __device__ static void step(const Chunk& ch, int c, const uint8_t* dig, const float* meta, int64_t K, int g, int t,
                              float (&acc)[MT][NT][4]) {
    constexpr int NX = 8 * NT;
    const int gi = c & 3;
    const uint32_t sh = 16 * (gi & 1);
    float s[MT][2][2], m[MT][2][2];  // [m-tile][row g, g + 8][run]
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const uint4 hd = ch.h[mt][h];
        uint32_t sc, mn;
        kquant_pair_of(hd.y >> sh, hd.z >> sh, hd.w >> sh, gi, sc, mn);
        kquant_sm(hd.x, sc, mn, s[mt][h], m[mt][h]);
      }
#pragma unroll
    for (int run = 0; run < 2; ++run) {  // sub-blocks 2c (low nibbles), 2c + 1 (high)
      const uint32_t mask = run ? 0xF0F0F0F0u : 0x0F0F0F0Fu;
      uint32_t a[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        a[mt][0] = ch.q[mt][0].x & mask;
        a[mt][1] = ch.q[mt][1].x & mask;
        a[mt][2] = ch.q[mt][0].y & mask;
        a[mt][3] = ch.q[mt][1].y & mask;
      }
      const int seg = 4 * c + 2 * run + (t >> 1), blk = 2 * c + run;
      run_tiles<false, G, NX, uint2>(a, dig, meta, K, seg, blk, g, t, 8 * (t & 1), acc,
                                     [&](float& r, int mt, int e, const int (&S)[kPlanes], float xs, float xsum) {
                                       r = fmaf(digit_sum_q4(S, run == 1) * xs, s[mt][e >> 1][run], r);
                                       r = fmaf(m[mt][e >> 1][run], xsum, r);
                                     });
    }
  }
};

// Q6_K chunk c = quarter (h, m) = ((c % 4) / 2, c % 2) of block b = c / 4 (matvec_kq.cu): runs
// k < 4 of 16 elements 256 b + 128 h + 32 k + 16 m + j; the lane reads bytes 4t .. 4t + 3 of the
// chunk's ql / ql / qh fields (2-byte aligned: the words around them), the 8 scale bytes of
// the half (3 words) and d.
template <int MT>
struct Mq<GgmlType::Q6_K, MT> {
  static constexpr int kDepth = 2;  // (a ring of 4 spills at MT = 2: 40 registers a chunk)
  struct Chunk {
    uint32_t f[MT][2][3][2];  // [m-tile][row][field][word]
    uint32_t sc[MT][2][3];
    uint32_t d[MT][2];
  };
  __device__ static void load(const uint8_t* const (&rows)[MT][2], int c, int t, Chunk& ch) {
    const int h = (c >> 1) & 1, m = c & 1;
    const int off[3] = {64 * h + 16 * m, 64 * h + 32 + 16 * m, 128 + 32 * h + 16 * m};
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const uint8_t* blk = rows[mt][r] + 210 * (c >> 2);
#pragma unroll
        for (int f = 0; f < 3; ++f) ld_a2(blk + off[f] + 4 * t, ch.f[mt][r][f][0], ch.f[mt][r][f][1]);
        const uint32_t* a = reinterpret_cast<const uint32_t*>((uintptr_t)(blk + 192 + 8 * h) & ~(uintptr_t)3);
#pragma unroll
        for (int k = 0; k < 3; ++k) ch.sc[mt][r][k] = __ldg(a + k);
        ch.d[mt][r] = __ldg(reinterpret_cast<const unsigned short*>(blk + 208));
      }
  }
  template <int NT, bool G>
  __device__ static void step(const Chunk& ch, int c, const uint8_t* dig, const float* meta, int64_t K, int g, int t,
                              float (&acc)[MT][NT][4]) {
    constexpr int NX = 8 * NT;
    const int b = c >> 2, h = (c >> 1) & 1, m = c & 1;
    const uint32_t sh = 16 * (b & 1);  // block b starts 2b mod 4 bytes past a word
    uint32_t ql[MT][2][2], qh[MT][2];  // [m-tile][row]([field])
    float s[MT][2][4];                 // [m-tile][row][run]: d sc_k / 4
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        ql[mt][r][0] = __funnelshift_r(ch.f[mt][r][0][0], ch.f[mt][r][0][1], sh);
        ql[mt][r][1] = __funnelshift_r(ch.f[mt][r][1][0], ch.f[mt][r][1][1], sh);
        qh[mt][r] = __funnelshift_r(ch.f[mt][r][2][0], ch.f[mt][r][2][1], sh);
        const uint32_t s01 = __funnelshift_r(ch.sc[mt][r][0], ch.sc[mt][r][1], sh);
        const uint32_t s23 = __funnelshift_r(ch.sc[mt][r][1], ch.sc[mt][r][2], sh);
        const float d = f16_bits(ch.d[mt][r]) * 0.25f;
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          const uint32_t word = k < 2 ? s01 : s23;
          s[mt][r][k] = d * (float)(int8_t)(word >> (8 * (m + 2 * (k & 1))));
        }
      }
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      uint32_t a[MT][2];  // 4 (q - 32) as int8: [m-tile][row]
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const uint32_t lo = (k < 2 ? ql[mt][r][k & 1] << 2 : ql[mt][r][k & 1] >> 2) & 0x3C3C3C3Cu;
          a[mt][r] = (lo | ((qh[mt][r] << (6 - 2 * k)) & 0xC0C0C0C0u)) ^ 0x80808080u;
        }
      const int seg = 16 * b + 8 * h + 2 * k + m, blk = 8 * b + 4 * h + k;
      run_tiles<true, G, NX, uint32_t>(a, dig, meta, K, seg, blk, g, t, 4 * t, acc,
                                       [&](float& r, int mt, int e, const int (&S)[kPlanes], float xs, float) {
                                         r = fmaf(digit_sum(S) * xs, s[mt][e >> 1][k], r);
                                       });
    }
  }
};

// Q8_0 chunk c = blocks 2c, 2c + 1 (68 bytes from 68c, 4-byte aligned): the lane reads qs
// bytes 8t .. 8t + 7 of each block (block 2c's 2 bytes past a word: three words, shifted) and
// lanes t = 0, 1 the words holding the scales of blocks 2c, 2c + 1 (shared by shuffles in step).
template <int MT>
struct Mq<GgmlType::Q8_0, MT> {
  static constexpr int kDepth = 4;  // (0.6B Q8_0, 16 rows on the H200: ~0.1 of 1.9 ms faster than 2)
  struct Chunk {
    uint32_t w[MT][2][6];  // block 2c: 3 words; block 2c + 1: 2 words; lane t < 2: the word of d_t
  };
  __device__ static void load(const uint8_t* const (&rows)[MT][2], int c, int t, Chunk& ch) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const uint32_t* a = reinterpret_cast<const uint32_t*>(rows[mt][r] + 68 * c);
        uint32_t* w = ch.w[mt][r];
        w[0] = __ldg(a + 2 * t);
        w[1] = __ldg(a + 2 * t + 1);
        w[2] = __ldg(a + 2 * t + 2);
        w[3] = __ldg(a + 9 + 2 * t);
        w[4] = __ldg(a + 10 + 2 * t);
        w[5] = __ldg(a + 8 * (t & 1));
      }
  }
  template <int NT, bool G>
  __device__ static void step(const Chunk& ch, int c, const uint8_t* dig, const float* meta, int64_t K, int g, int t,
                              float (&acc)[MT][NT][4]) {
    constexpr int NX = 8 * NT;
#pragma unroll
    for (int run = 0; run < 2; ++run) {  // blocks 2c, 2c + 1
      uint32_t a[MT][4];
      float d[MT][2];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        uint32_t q[2][2];  // [row][word]
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const uint32_t* w = ch.w[mt][r];
          q[r][0] = run ? w[3] : __funnelshift_r(w[0], w[1], 16);
          q[r][1] = run ? w[4] : __funnelshift_r(w[1], w[2], 16);
          const uint32_t dw = __shfl_sync(0xFFFFFFFFu, w[5], run, 4);
          d[mt][r] = run ? f16_bits(dw >> 16) : f16_bits(dw & 0xFFFF);
        }
        a[mt][0] = q[0][0];
        a[mt][1] = q[1][0];
        a[mt][2] = q[0][1];
        a[mt][3] = q[1][1];
      }
      const int seg = 4 * c + 2 * run + (t >> 1), blk = 2 * c + run;
      run_tiles<true, G, NX, uint2>(a, dig, meta, K, seg, blk, g, t, 8 * (t & 1), acc,
                                    [&](float& r, int mt, int e, const int (&S)[kPlanes], float xs, float) {
                                      r = fmaf(digit_sum(S) * xs, d[mt][e >> 1], r);
                                    });
    }
  }
};

#endif  // SPECD_MMA

// Units (4 elements) s 256 + threadIdx.x of row blockIdx.x of x (times the norm weight) in
// digits, s = blockIdx.y, into its tile's image (row r % NX of tile r / NX), as matvec_kq.cu's
// prep_digits computes them (cuda/digits.cuh: 8 consecutive threads a 32-element block): one
// unit a thread, so that a call's digits take one round of loads on n K / 1024 CTAs rather
// than K / 1024 rounds on n (16 CTAs for a verify: 3 and 8 us at K = 4096 and 12288 on the
// H200). CTA 0 of a row also takes inv_r from the row's sum of squares in the direct reader's
// per-thread unit order (units t, t + 256, ..., ascending) and block_sum, so every value is the
// float the direct reader uses. Once per call, shared by its launches.
template <int NX>
__global__ void __launch_bounds__(kThreads) digits_kernel(const MmaParams p) {
  __shared__ float red[kGroup];
  SPECD_TRACE_DECL;
  SPECD_TRACE_MARK(0);
  const int64_t K = p.K;
  const int units = (int)(K / 4), r = (int)blockIdx.x % NX;
  const int u = (int)blockIdx.y * kThreads + (int)threadIdx.x;
  const float4* x = reinterpret_cast<const float4*>(p.x + (int64_t)blockIdx.x * K);
  const float4* nw = reinterpret_cast<const float4*>(p.norm_w);
  // the norm weights (not the kernel before's output) are loaded before the wait
  float4 n = make_float4(1.f, 1.f, 1.f, 1.f);
  if (u < units && nw != nullptr) n = __ldg(nw + u);
  gpu_grid_wait();
  gpu_grid_launch_dependents();
  SPECD_TRACE_MARK(1);
  const float4 a = u < units ? __ldg(x + u) : make_float4(0.f, 0.f, 0.f, 0.f);
  const Digits4 d = block_digits4(a, n);  // (every thread: whole groups shuffle)
  if (u < units) {
    uint8_t* img = p.img + (size_t)(blockIdx.x / NX) * (size_t)p.img_bytes;
    float* meta = reinterpret_cast<float*>(img + kPlanes * (size_t)(K * NX));
    uint8_t* at = seg_ptr<NX>(img, K, 0, u >> 2, r) + 4 * (u & 3);
#pragma unroll
    for (int pl = 0; pl < kPlanes; ++pl) *reinterpret_cast<uint32_t*>(at + pl * (size_t)(K * NX)) = d.d[pl];
    if ((u & 7) == 0) *reinterpret_cast<float2*>(meta + 2 * ((u >> 3) * NX + r)) = make_float2(d.xsb, (float)d.sum * d.xsb);
  }
  if (blockIdx.y == 0) {
    if (nw != nullptr) {
      constexpr int C = kPrepUnits;  // units in flight (digits.cuh)
      float ss = 0.f;
      for (int i0 = 0; i0 * kThreads < units; i0 += C) {
        float4 v[C];
#pragma unroll
        for (int c = 0; c < C; ++c) {
          const int w = (i0 + c) * kThreads + (int)threadIdx.x;
          if (w < units) v[c] = c == 0 && i0 == 0 ? a : __ldg(x + w);
        }
#pragma unroll
        for (int c = 0; c < C; ++c)
          if ((i0 + c) * kThreads + (int)threadIdx.x < units) ss = add_squares(v[c], ss);
      }
      const float tot = block_sum(ss, red);
      if (threadIdx.x == 0) p.inv[blockIdx.x] = rsqrtf(tot / (float)K + p.eps);
    } else if (threadIdx.x == 0) {
      p.inv[blockIdx.x] = 1.f;
    }
  }
  SPECD_TRACE_MARK(2);
  SPECD_TRACE_MARK(3);
  SPECD_TRACE_RECORD(kTraceKqDigits, (unsigned long long)(uintptr_t)p.img ^ (unsigned long long)K << 48);
}

// G: x's image stays in global memory (read through the L1 cache; for K whose image does not
// fit shared memory), else it is copied into shared memory first. H: warps per quad (1, or 2,
// so that an SM runs 16 warps instead of 8):
//   * a tile of two m-tiles (MT = 2, H = 2): warp quad + 8 h takes m-tile h, so each warp holds
//     half the registers; every output's sums stay in one warp, in the same order;
//   * a tile of one m-tile (MT = 1, H = 2: KS = 2 warps split the quad's chunks): warp quad + 8 h
//     takes the quad's chunks c = quad + 8 j of j = h mod 2, that is the classes h and h + 2
//     (j % 4 = h + 2 (j / 2 % 2)), each in ascending c, and writes A_h + A_(h+2); the quad's
//     value is then (A0 + A2) + (A1 + A3) as before. Half the steps a tile per warp and half the
//     accumulators: the same bits.
template <GgmlType T, int NT, int MT, bool G, int H>
__global__ void __launch_bounds__(kThreads * H, 1) kq_mma_kernel(const MmaParams p) {
#if SPECD_MMA
  static_assert(MT % H == 0 || (MT == 1 && H == 2), "a warp takes whole m-tiles, or half a quad's chunks");
  constexpr int KS = quad_split(MT, H);    // warps splitting a quad's chunks
  constexpr int MW = MT * KS / H;          // m-tiles per warp
  constexpr int NC = 4 / KS;               // classes (accumulator sets) per warp
  using R = Mq<T, MW>;
  constexpr int NX = 8 * NT, TR = 16 * MT;  // rows of x, weight rows of a tile
  extern __shared__ __align__(16) uint8_t smem[];
  __shared__ float inv[NX];
  const int lane = threadIdx.x % kGroup, warp = (threadIdx.x / kGroup) % kWarps, g = lane >> 2, t = lane & 3;
  const int half = (int)(threadIdx.x / (kGroup * kWarps));  // (0 .. H - 1)
  const int m0 = half / KS * MW, hk = half % KS;  // the warp's first m-tile; its share of the quad's chunks
  const int64_t K = p.K, row0 = (int64_t)blockIdx.y * NX;
  const uint8_t* img = p.img + (size_t)blockIdx.y * (size_t)p.img_bytes;  // this tile of x's image
  const uint8_t* dig = G ? img : smem;
  const float* meta = reinterpret_cast<const float*>(dig + kPlanes * (size_t)(K * NX));
  float* part = reinterpret_cast<float*>(smem + (G ? 0 : p.img_bytes));  // [quad][TR weight rows][NX]
  const int nc = p.nc, n_tiles = p.n_tiles, grid = (int)gridDim.x;
  const int njq = warp < nc ? (nc - warp + kWarps - 1) / kWarps : 0;  // this quad's chunks per tile
  // this warp's chunks and its slot j's chunk (KS == 1 spelled as before the split: the general
  // form moved ptxas' allocation, the Q6_K x-through-L1 kernel's spills 32 / 40 -> 72 / 88 bytes)
  const int nj = KS == 1 ? njq : njq > hk ? (njq - hk + KS - 1) / KS : 0;
  auto chunk = [&](int j) { return warp + kWarps * (KS == 1 ? j : KS * j + hk); };

  // The load stream: slot l_j of tile l_tile holds chunk(l_j) (l_j < nj). kDepth
  // 2: each step first loads the next chunk. kDepth 4: a ring of 4 chunks, 3 in flight while a
  // step reads one (each step first refills the buffer the step before it read); the slots up
  // to nj4 = nj rounded up to a multiple of 4 are empty, so that a slot's buffer is its class
  // q = l_j % 4 and every index is a constant.
  constexpr int PD = R::kDepth;
  static_assert(PD == 2 || PD == 4, "kDepth: 2 or 4");
  const int nj4 = PD == 2 ? nj : (nj + 3) & ~3;
  int l_tile = blockIdx.x, l_j = 0;
  const uint8_t* lrows[MW][2];
  if (l_tile < n_tiles) lane_rows<MT, MW>(p, l_tile, g, m0, lrows);
  auto fetch = [&](typename R::Chunk& dst) {
    if (l_tile >= n_tiles || nj == 0) return;
    if (PD == 2 || l_j < nj) R::load(lrows, chunk(l_j), t, dst);
    if (++l_j == nj4) {
      l_j = 0;
      l_tile += grid;
      if (l_tile < n_tiles) lane_rows<MT, MW>(p, l_tile, g, m0, lrows);
    }
  };
  // (kDepth 2 keeps two named chunks, not a ring of 2: written as an array, the same loads gave
  // other code and an 8B verify 9 % slower on the H200)
  typename R::Chunk cur, nxt;                // kDepth 2: the chunk a step reads and the next
  typename R::Chunk ring[PD == 4 ? 4 : 1];  // kDepth 4: slot l_j in ring[l_j % 4]
  SPECD_TRACE_DECL;
  SPECD_TRACE_MARK(0);
  if constexpr (PD == 2) {
    fetch(cur);
  } else {
    fetch(ring[0]);
    fetch(ring[1]);
    fetch(ring[2]);
  }

  gpu_grid_wait();
  gpu_grid_launch_dependents();
  SPECD_TRACE_MARK(1);
  if (!G) {  // the tile's image of x (digits_kernel) into shared memory
    for (int64_t off = 16 * (int64_t)threadIdx.x; off < p.img_bytes; off += 16 * kThreads * H) cp_async16_all(smem + off, img + off);
    cp_async_commit();
  }
  if (threadIdx.x < NX) inv[threadIdx.x] = p.inv[min(row0 + (int64_t)threadIdx.x, p.n - 1)];
  if (!G) cp_async_wait<0>();
  __syncthreads();  // digits, meta and inv[] are visible
  SPECD_TRACE_MARK(2);

  for (int tile = blockIdx.x; tile < n_tiles; tile += grid) {
    float acc[NC][MW][NT][4];  // [slot j % NC (class (KS j + hk) % 4)][m-tile m0 + ..][n-tile][D element]
#pragma unroll
    for (int q = 0; q < NC; ++q)
#pragma unroll
      for (int mt = 0; mt < MW; ++mt)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[q][mt][nt][e] = 0.f;
    // (not Q6_K with x read through L1: the swapped loop spills there, 276 bytes a thread at 16
    // warps, and the 8B's verify(16) was 0.8 % slower on the H200)
    constexpr bool kSwap = PD == 2 && !(G && T == GgmlType::Q6_K);
    if constexpr (kSwap) {
      // cur and nxt swap roles every step (by name: no chunk is copied, so a step waits for
      // its chunk's loads where it first uses them, not at a copy), four steps a round; the
      // last nj % 4 steps after the rounds, leaving the stream's next chunk in cur
      auto take = [&](typename R::Chunk& now, typename R::Chunk& next, int j, float(&aq)[MW][NT][4]) {
        fetch(next);
        R::template step<NT, G>(now, chunk(j), dig, meta, K, g, t, aq);
      };
      int j0 = 0;
      for (; j0 + 4 <= nj; j0 += 4) {
        take(cur, nxt, j0, acc[0]);
        take(nxt, cur, j0 + 1, acc[1]);
        take(cur, nxt, j0 + 2, acc[2 % NC]);
        take(nxt, cur, j0 + 3, acc[3 % NC]);
      }
      const int rest = nj - j0;  // (uniform over the warp)
      if (rest >= 2) {
        take(cur, nxt, j0, acc[0]);
        take(nxt, cur, j0 + 1, acc[1]);
      }
      if (rest == 1) {
        take(cur, nxt, j0, acc[0]);
        cur = nxt;
      } else if (rest == 3) {
        take(cur, nxt, j0 + 2, acc[2 % NC]);
        cur = nxt;
      }
    } else if constexpr (PD == 2) {
      for (int j0 = 0; j0 < nj; j0 += 4) {
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          if (j0 + q < nj) {  // (uniform over the warp)
            fetch(nxt);
            R::template step<NT, G>(cur, chunk(j0 + q), dig, meta, K, g, t, acc[q % NC]);
            cur = nxt;
          }
        }
      }
    } else {
      for (int j0 = 0; j0 < nj; j0 += 4) {
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          fetch(ring[(q + 3) % 4]);  // (uniform over the warp, both)
          if (j0 + q < nj) R::template step<NT, G>(ring[q], chunk(j0 + q), dig, meta, K, g, t, acc[q % NC]);
        }
      }
    }
    // the quad's value (group_sum's levels xor 16 and 8 over its classes) into shared memory
#pragma unroll
    for (int mt = 0; mt < MW; ++mt)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          float v[2];
#pragma unroll
          for (int e2 = 0; e2 < 2; ++e2) {
            const int e = 2 * h + e2;
            if constexpr (NC == 4) v[e2] = (acc[0][mt][nt][e] + acc[2][mt][nt][e]) + (acc[1][mt][nt][e] + acc[3][mt][nt][e]);
            else v[e2] = acc[0][mt][nt][e] + acc[1][mt][nt][e];  // A_hk + A_(hk+2)
          }
          const int wr = 16 * (m0 + mt) + g + 8 * h;
          *reinterpret_cast<float2*>(part + ((warp + kWarps * hk) * TR + wr) * NX + 8 * nt + 2 * t) = make_float2(v[0], v[1]);
        }
    __syncthreads();
    int j0;
    int64_t o_first;
    tile_of<MT>(p, tile, j0, o_first);
    auto total = [&](int wr, int xr) {  // the remaining levels (xor 4, 2, 1) over the 8 quads
      float q[kWarps];
#pragma unroll
      for (int w = 0; w < kWarps; ++w) {
        q[w] = part[(w * TR + wr) * NX + xr];
        if constexpr (KS == 2) q[w] += part[((w + kWarps) * TR + wr) * NX + xr];  // (A0 + A2) + (A1 + A3)
      }
      return (((q[0] + q[4]) + (q[2] + q[6])) + ((q[1] + q[5]) + (q[3] + q[7]))) * inv[xr];
    };
    if (p.ep == Epilogue::SwiGLU) {
      for (int o = threadIdx.x; o < (TR / 2) * NX; o += kThreads * H) {
        const int wr = o / NX, xr = o % NX;
        const int64_t out = o_first + wr;
        if (row0 + xr >= p.n || out >= p.w[0].n_out) continue;
        store_swiglu(p, p.y + (row0 + xr) * p.ldy, out, total(wr, xr), total(wr + TR / 2, xr));
      }
    } else {
      const LinWeight& w = p.w[j0];
      for (int o = threadIdx.x; o < TR * NX; o += kThreads * H) {
        const int wr = o / NX, xr = o % NX;
        const int64_t out = o_first + wr;
        if (row0 + xr >= p.n || out >= w.n_out) continue;
        store_value(p.ep, w, p.y + (row0 + xr) * p.ldy, out, total(wr, xr));
      }
    }
    __syncthreads();  // part[] is free for the next tile
  }
  SPECD_TRACE_MARK(3);
  SPECD_TRACE_RECORD(kTraceKqMma, (unsigned long long)(uintptr_t)p.y ^ (unsigned long long)K << 48 ^
                                      (unsigned long long)T << 40);  // (a QKV's Q4_K and Q6_K launches apart)
#endif
}

template <GgmlType T, int NT, int MT, bool G, int H>
void launch_nt(const MmaParams& p, size_t smem, gpuStream_t s) {
  static std::once_flag once;  // allow the device's largest shared memory once per kernel
  std::call_once(once, [] {
    SPECD_GPU_CHECK(gpuFuncSetAttribute((kq_mma_kernel<T, NT, MT, G, H>), gpuFuncAttributeMaxDynamicSharedMemorySize,
                                        (int)(dev_limits().smem_per_block - kStaticSmem)));
  });
  int per_sm = 0;  // persistent CTAs: as many as fit at once
  SPECD_GPU_CHECK(
      gpuOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, (kq_mma_kernel<T, NT, MT, G, H>), kThreads * H, smem));
  const int64_t ctas = std::min<int64_t>(p.n_tiles, (int64_t)std::max(per_sm, 1) * dev_limits().sms);
  const dim3 grid((unsigned)ctas, (unsigned)ceil_div(p.n, (int64_t)(8 * NT)));
  gpu_launch("kq_mma_kernel", kq_mma_kernel<T, NT, MT, G, H>, grid, dim3(kThreads * H), smem, s, p);
}

// mt: m-tiles per tile; split: 16 warps, one m-tile each (mt = 2) or half a quad's chunks each (mt = 1)
template <GgmlType T, int NT, bool G>
void launch_mt(const MmaParams& p, int mt, bool split, size_t smem, gpuStream_t s) {
  if (mt == 1) split ? launch_nt<T, NT, 1, G, 2>(p, smem, s) : launch_nt<T, NT, 1, G, 1>(p, smem, s);
  else if (split) launch_nt<T, NT, 2, G, 2>(p, smem, s);
  else launch_nt<T, NT, 2, G, 1>(p, smem, s);
}

template <GgmlType T>
void launch_type(const MmaParams& p, int nt, int mt, bool split, bool global, size_t smem, gpuStream_t s) {
  if (global) nt == 1 ? launch_mt<T, 1, true>(p, mt, split, smem, s) : launch_mt<T, 2, true>(p, mt, split, smem, s);
  else nt == 1 ? launch_mt<T, 1, false>(p, mt, split, smem, s) : launch_mt<T, 2, false>(p, mt, split, smem, s);
}

// The call's weights of `type` (each keeping its output columns) in tiles of 16 mt rows; the
// number of tiles (0: none of that type).
int64_t type_params(const MmaParams& base, const LinearArgs& a, GgmlType type, int mt, MmaParams& p) {
  p = base;
  p.n_w = 0;
  int64_t tiles = 0;
  for (int j = 0; j < a.n_w; ++j) {
    if (base.w[j].type != type) continue;
    p.w[p.n_w] = base.w[j];
    p.w[p.n_w].cta0 = (int32_t)tiles;
    if (a.ep != Epilogue::SwiGLU) tiles += ceil_div(base.w[j].n_out, (int64_t)(16 * mt));
    ++p.n_w;
  }
  if (p.n_w > 0 && a.ep == Epilogue::SwiGLU) tiles = ceil_div(base.w[0].n_out, (int64_t)(8 * mt));
  SPECD_CHECK(tiles < (int64_t)1 << 31, "linear: too many output rows");
  p.n_tiles = (int32_t)tiles;
  return tiles;
}

}  // namespace

// Bytes of LinearArgs::work the tensor-core digit reader needs for n rows of K inputs: the
// images of the tiles of x (for tiles of 16 rows, which covers tiles of 8) and inv_r per row.
size_t kq_mma_work_bytes(int64_t n, int64_t K) {
  if (n < 2 || n > kMaxSmallBatch || K % 64 != 0) return 0;
  const int64_t rows = ceil_div(n, (int64_t)16) * 16;
  return (size_t)ceil_div(n, (int64_t)16) * image_bytes(K, 16) + sizeof(float) * (size_t)rows;
}

// Takes a call of kq_linear()'s digit reader (matvec_kq.cu has checked the types, K and the
// alignment) when it has at least SPECD_GPU_MMA_MIN rows of x (default 5: up to 4 rows, the
// direct reader's single tile reads the weights once and is faster; "0" never) on an
// NVIDIA sm_80+ device, the images of 8 rows fit in shared memory and the call brings the
// workspace (kq_mma_work_bytes). One digits_kernel, then one launch per weight type (QKV with
// a Q6_K V: two); tiles of 16 or 32 weight rows, whichever takes fewer rounds of the
// persistent CTAs, in 16 warps (SPECD_GPU_MMA_WARPS, SPECD_GPU_MMA_KSPLIT: fewer). The rows are those of the direct reader, bit for bit, so every such choice
// may depend on n.
bool kq_mma_linear(const LinearArgs& a, gpuStream_t s) {
  static const int min_rows = [] {
    const std::string v = env_value("SPECD_GPU_MMA_MIN");
    return v.empty() ? 5 : std::atoi(v.c_str());
  }();
  if (min_rows <= 0 || a.n < min_rows || !dev_limits().mma) return false;
  const int64_t K = a.w[0]->n_in;
  const size_t room = dev_limits().smem_per_block - kStaticSmem;
  static const bool force_global = env_value("SPECD_GPU_MMA_GLOBAL") == "1";
  // tiles of 32 rows in 16 warps of one m-tile each (default: the K-quants; "8": never, "16":
  // every type)
  static const std::string warps = env_value("SPECD_GPU_MMA_WARPS");
  // tiles of 16 rows in 16 warps, two per quad splitting its chunks (default where a quad has
  // at least two chunks; "0": 8 warps)
  static const bool ksplit = env_value("SPECD_GPU_MMA_KSPLIT") != "0";
  const int nt = a.n > 8 ? 2 : 1, nx = 8 * nt;
  const bool global = force_global || mma_smem(K, nx, 2) > room;  // x's image read from L1 / L2
  if (a.work == nullptr || a.work_bytes < kq_mma_work_bytes(a.n, K) || (uintptr_t)a.work % 16 != 0) return false;
  SPECD_CHECK(a.n * K < (int64_t)1 << 31, "linear: x has more than 2^31 elements");
  MmaParams base;
  fill_params(base, a, 32);  // (the LinParams part; tiles are counted per type below)
  base.nc = (int32_t)(K / 64);
  base.img = static_cast<uint8_t*>(a.work);
  base.img_bytes = (int64_t)image_bytes(K, nx);
  base.inv = reinterpret_cast<float*>(base.img + (size_t)ceil_div(a.n, (int64_t)nx) * image_bytes(K, nx));
  const dim3 dgrid((unsigned)a.n, (unsigned)ceil_div(K / 4, (int64_t)kThreads));
  if (nt == 1) gpu_launch("kq_mma_digits", digits_kernel<8>, dgrid, dim3(kThreads), 0, s, base);
  else gpu_launch("kq_mma_digits", digits_kernel<16>, dgrid, dim3(kThreads), 0, s, base);
  const int64_t sms = dev_limits().sms;
  for (GgmlType type : {GgmlType::Q4_K, GgmlType::Q6_K, GgmlType::Q8_0}) {
    MmaParams p;
    const int64_t t2 = type_params(base, a, type, 2, p);
    if (t2 == 0) continue;
    // rounds of one CTA per SM, a 32-row tile costing two of 16 rows
    const int mt = ceil_div(2 * t2, sms) < 2 * ceil_div(t2, sms) ? 1 : 2;
    if (mt == 1) type_params(base, a, type, 1, p);
    const bool split = mt == 2 ? warps == "16" || (warps != "8" && type != GgmlType::Q8_0) : ksplit && base.nc >= 2 * kWarps;
    const size_t smem = mma_smem(K, nx, mt, quad_split(mt, split ? 2 : 1)) - (global ? image_bytes(K, nx) : 0);
    if (type == GgmlType::Q4_K) launch_type<GgmlType::Q4_K>(p, nt, mt, split, global, smem, s);
    else if (type == GgmlType::Q6_K) launch_type<GgmlType::Q6_K>(p, nt, mt, split, global, smem, s);
    else launch_type<GgmlType::Q8_0>(p, nt, mt, split, global, smem, s);
  }
  return true;
}

}  // namespace gpu
}  // namespace specd
