// bench/mma_scaled_a.cu: a design probe, not part of the engine. What the inner loop of an
// int8 tensor-core Q4_K verify reader costs in instructions when the weights' sub-block
// scales are applied on the weight side, as integers, so that a super-block of 256 weights
// needs one float epilogue per output instead of one per 32-element run
// (bench/results/sass_mix_scaled-a_20261208.md says why; `bench/sass_mix.py --file
// bench/mma_scaled_a.cu` counts it against the engine's kq_mma_kernel).
//
// The arithmetic, exact until the super-block's end (x on one power-of-two grid per 256
// elements, X = 2^16 D0 + 2^8 D1 + D2 as today's three byte planes, D0 signed):
//   * Q4_K weight i of sub-block j: d sc_j q_i - dmin mn_j, q < 16, sc_j, mn_j < 64;
//   * sc_j = 16 h_j + l_j (h < 4, l < 16), so A_l = l_j q and A_h = h_j q are bytes (<= 225,
//     <= 45): one 32-bit multiply of four packed q makes four of them;
//   * P_(a,t) = sum over the super-block of A_a D_t: int8 MMAs chained through their s32
//     accumulator over the 8 runs (|P| <= 225 * 255 * 256 < 2^31);
//   * M = sum_t 2^(8(2-t)) (16 P_(h,t) + P_(l,t)) = sum_j sc_j sum_i q_i X_i;
//   * N = sum_j mn_j T_j, T_j = sum of run j's X (|T| < 2^27, four byte planes of the image):
//     one m16n8k16 MMA per plane, mn in k-slots 0..7 (lanes t = 0, 1) and zeros in 8..15;
//   * y += xs (d M - dmin N), xs the super-block's grid step.
// The float part rounds where it converts M and N; a decode reader forming the same integers
// with dp4a and running the same float part in the same order gives the same bits
// (sa_decode_kernel, below the verify's sa_kernel).
//
// Work (sa_kernel): as the engine's kq_mma_kernel splits it. A CTA of 8 H warps (SA_WARPS = 16:
// H = 2, at most 128 registers a thread; 8: H = 1) takes tiles of 16 H weight rows x 8 NT
// rows of x; warp (quad, half) takes m-tile `half` (lane g: its rows g, g + 8) and the
// super-blocks quad, quad + 8, ... of K, its weights streamed one chunk (two runs) ahead.
// x's image sits in shared memory: plane t, segment s of 16 elements, row r: 16 bytes at
// ((t S + s) NX + (r ^ f(s))) 16, S = K / 16; then per super-block and row its grid step, and
// T's four planes as two words each (sub-blocks 0..3, 4..7). The program's host part (main,
// at the end) makes random Q4_K rows and x, the image, a float64 reference and a step-for-step
// CPU replay of the kernel's arithmetic (also the decode kernel's way), and with a GPU times
// both kernels and checks them against it and each other (bench/bench_scaled_a.py runs it;
// it has not yet run on a GPU).
//
//   python3 bench/sass_mix.py --file bench/mma_scaled_a.cu --match sa_kernel --label scaled-a
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "cuda/mma.cuh"
#include "cuda/quants.cuh"

namespace specd {
namespace gpu {
namespace probe {

#ifndef SA_WARPS
#define SA_WARPS 16
#endif

constexpr int kWarpsPerCta = SA_WARPS;
static_assert(kWarpsPerCta == 8 || kWarpsPerCta == 16, "SA_WARPS: 8 or 16");

struct SaParams {
  const uint8_t* w = nullptr;  // Q4_K rows, `stride` bytes apart
  int64_t stride = 0;
  int64_t n_out = 0;
  int nsb = 0;                 // super-blocks per row (K / 256)
  const uint8_t* img = nullptr;  // x's image (global), copied to shared memory
  int64_t img_bytes = 0;
  float* y = nullptr;          // [NX][n_out]
};

__host__ __device__ __forceinline__ int seg_swizzle(int s) { return ((s & 1) << 2) | ((s >> 1) & 3); }

#if SPECD_MMA
// d += A B (s32, each element its own accumulator: the chain over a super-block's runs)
template <bool kBS>
__device__ __forceinline__ void mma_acc_k32(int (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  if constexpr (kBS)
    asm volatile("mma.sync.aligned.m16n8k32.row.col.s32.u8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  else
    asm volatile("mma.sync.aligned.m16n8k32.row.col.s32.u8.u8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void load_head(const uint8_t* const (&rows)[2], int sb, uint4 (&h)[2]) {
#pragma unroll
  for (int r = 0; r < 2; ++r) h[r] = __ldg(reinterpret_cast<const uint4*>(rows[r] + 144 * (size_t)sb));
}
__device__ __forceinline__ void load_chunk(const uint8_t* const (&rows)[2], int sb, int k, int t, uint2 (&q)[2]) {
#pragma unroll
  for (int r = 0; r < 2; ++r) q[r] = __ldg(reinterpret_cast<const uint2*>(rows[r] + 144 * (size_t)sb + 16 + 32 * k + 8 * t));
}
// lane g's rows g, g + 8 of m-tile `half` of a tile (clamped: their results are dropped)
__device__ __forceinline__ void tile_rows(const SaParams& p, int tile, int half, int g, const uint8_t* (&rows)[2]) {
  const int64_t r0 = (int64_t)tile * 16 * (kWarpsPerCta / 8) + 16 * half + g;
  rows[0] = p.w + (size_t)min(r0, p.n_out - 1) * p.stride;
  rows[1] = p.w + (size_t)min(r0 + 8, p.n_out - 1) * p.stride;
}
#endif  // SPECD_MMA

// A CTA of 8 H warps takes tiles of 16 H weight rows x 8 NT rows of x (persistent: tiles
// blockIdx.x, + gridDim.x, ...); warp (quad, half) takes m-tile `half` of the tile and its
// super-blocks quad, quad + 8, ... (as the engine's quads split K), with the stream of its
// weights one chunk ahead, on into its next tile; at a tile's end the 8 quads' partial sums
// meet in shared memory, added in quad order.
template <int NT>
__global__ void __launch_bounds__(32 * kWarpsPerCta, 1) sa_kernel(const SaParams p) {
#if SPECD_MMA
  constexpr int NX = 8 * NT, H = kWarpsPerCta / 8, TR = 16 * H;
  extern __shared__ __align__(16) uint8_t smem[];
  for (int64_t off = 16 * (int64_t)threadIdx.x; off < p.img_bytes; off += 16 * blockDim.x)
    cp_async16_all(smem + off, p.img + off);
  cp_async_commit();
  cp_async_wait<0>();
  __syncthreads();

  const int lane = threadIdx.x % 32, g = lane >> 2, t = lane & 3, warp = threadIdx.x / 32;
  const int quad = warp % 8, half = warp / 8;
  const int S = 16 * p.nsb;  // segments of 16 elements per row
  const int n_tiles = (int)((p.n_out + TR - 1) / TR), step = (int)gridDim.x;
  const uint8_t* dig = smem;
  const uint8_t* meta = smem + (size_t)3 * S * NX * 16;  // per super-block: NX grid steps, then T's planes
  float* part = reinterpret_cast<float*>(smem + p.img_bytes);  // [quad][TR rows][NX]

  // the stream: the header and first chunk of the warp's first super-block
  const uint8_t* crows[2];
  uint4 hcur[2], hnxt[2];
  uint2 qc[2], qn[2];
  tile_rows(p, blockIdx.x, half, g, crows);
  if ((int)blockIdx.x < n_tiles && quad < p.nsb) {
    load_head(crows, quad, hcur);
    load_chunk(crows, quad, 0, t, qc);
  }
  for (int tile = blockIdx.x; tile < n_tiles; tile += step) {
    float y[NT][4];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) y[nt][e] = 0.f;
    for (int sb = quad; sb < p.nsb; sb += 8) {
      // the stream's next super-block: this tile's, or the next tile's first
      const bool last = sb + 8 >= p.nsb;
      const int n_sb = last ? quad : sb + 8, n_tile = last ? tile + step : tile;
      const bool n_valid = n_tile < n_tiles;
      const uint8_t* nrows[2] = {crows[0], crows[1]};
      if (last) tile_rows(p, n_tile, half, g, nrows);
      if (n_valid) load_head(nrows, n_sb, hnxt);
      // the rows' scales and minimums of sub-blocks 0..7: sc's low parts as nibbles of one
      // word, its high parts as 2-bit fields of another (taken apart per run), mn packed as
      // four bytes (sub-blocks 4 u .. 4 u + 3) for the min MMA's k-slots
      uint32_t slw[2], shw[2], mnw[2][2];
      float d[2], dmin[2];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const uint4 hd = hcur[r];
        d[r] = f16_bits(hd.x & 0xFFFF);
        dmin[r] = f16_bits(hd.x >> 16);
        uint32_t scp[4], mnp[4];
#pragma unroll
        for (int pr = 0; pr < 4; ++pr) {  // sub-blocks 2 pr, 2 pr + 1
          const uint32_t sh16 = 16 * (pr & 1);
          kquant_pair_of(hd.y >> sh16, hd.z >> sh16, hd.w >> sh16, pr, scp[pr], mnp[pr]);
        }
        const uint32_t sc03 = __byte_perm(scp[0], scp[1], 0x5410), sc47 = __byte_perm(scp[2], scp[3], 0x5410);
        slw[r] = (sc03 & 0x0F0F0F0Fu) | (sc47 & 0x0F0F0F0Fu) << 4;  // nibble j: sub-block j % 4 (+4 high)
        shw[r] = (sc03 >> 4 & 0x03030303u) | (sc47 >> 2 & 0x0C0C0C0Cu);
        mnw[r][0] = __byte_perm(mnp[0], mnp[1], 0x5410);  // mn_0 mn_1 mn_2 mn_3
        mnw[r][1] = __byte_perm(mnp[2], mnp[3], 0x5410);
      }

      int P[2][NT][3][4];  // [A_h, A_l][n-tile][digit plane][D element]
#pragma unroll
      for (int a = 0; a < 2; ++a)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
          for (int pl = 0; pl < 3; ++pl)
#pragma unroll
            for (int e = 0; e < 4; ++e) P[a][nt][pl][e] = 0;
#pragma unroll
      for (int run = 0; run < 8; ++run) {
        const int k = run >> 1;
        if (!(run & 1)) {  // the next chunk: this super-block's, or the stream's next one's first
          if (k < 3) load_chunk(crows, sb, k + 1, t, qn);
          else if (n_valid) load_chunk(nrows, n_sb, 0, t, qn);
        }
        const uint2 w0 = qc[0], w1 = qc[1];
        // A fragment of q: rows g, g + 8 (k-slots 4t..), then the same at 16 + 4t..
        const int ns = 4 * (run & 1);
        const uint32_t q[4] = {(w0.x >> ns) & 0x0F0F0F0Fu, (w1.x >> ns) & 0x0F0F0F0Fu, (w0.y >> ns) & 0x0F0F0F0Fu,
                               (w1.y >> ns) & 0x0F0F0F0Fu};
        // sub-block run's l and h of each row (byte run % 4 of the words, its high half for run >= 4)
        const int bs = 8 * (run & 3) + 4 * (run >> 2), hs = 8 * (run & 3) + 2 * (run >> 2);
        const uint32_t l0 = slw[0] >> bs & 0xF, l1 = slw[1] >> bs & 0xF, h0 = shw[0] >> hs & 0x3, h1 = shw[1] >> hs & 0x3;
        const uint32_t al[4] = {q[0] * l0, q[1] * l1, q[2] * l0, q[3] * l1};
        const uint32_t ah[4] = {q[0] * h0, q[1] * h1, q[2] * h0, q[3] * h1};
        if (run & 1) {
          qc[0] = qn[0];
          qc[1] = qn[1];
        }
        const int s = 16 * sb + 2 * run + (t >> 1);
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          const uint8_t* b0 = dig + ((size_t)s * NX + ((8 * nt + g) ^ seg_swizzle(s))) * 16 + 8 * (t & 1);
          uint2 b[3];
#pragma unroll
          for (int pl = 0; pl < 3; ++pl) b[pl] = *reinterpret_cast<const uint2*>(b0 + (size_t)pl * S * NX * 16);
          mma_acc_k32<true>(P[0][nt][0], ah, b[0].x, b[0].y);
          mma_acc_k32<true>(P[1][nt][0], al, b[0].x, b[0].y);
#pragma unroll
          for (int pl = 1; pl < 3; ++pl) {
            mma_acc_k32<false>(P[0][nt][pl], ah, b[pl].x, b[pl].y);
            mma_acc_k32<false>(P[1][nt][pl], al, b[pl].x, b[pl].y);
          }
        }
      }
      // N = sum_j mn_j T_j (m16n8k16: rows g / g + 8 take k-slots 4t..4t+3; t >= 2 hold zeros)
      const uint32_t am0 = t < 2 ? mnw[0][t] : 0u, am1 = t < 2 ? mnw[1][t] : 0u;
      const uint8_t* sbmeta = meta + (size_t)sb * NX * (4 + 32);
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        int Nq[4][4];  // [T plane][D element]
#pragma unroll
        for (int tp = 0; tp < 4; ++tp) {
          const uint32_t bt =
              t < 2 ? *reinterpret_cast<const uint32_t*>(sbmeta + 4 * NX + ((tp * NX + 8 * nt + g) * 2 + t) * 4) : 0u;
          if (tp == 3) mma_i8_k16<false, true>(Nq[tp], am0, am1, bt);
          else mma_i8_k16<false, false>(Nq[tp], am0, am1, bt);
        }
        const float2 xs = *reinterpret_cast<const float2*>(sbmeta + 4 * (8 * nt + 2 * t));
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int r = e >> 1;
          const int q0 = 16 * P[0][nt][0][e] + P[1][nt][0][e];
          const int q1 = 16 * P[0][nt][1][e] + P[1][nt][1][e];
          const int q2 = 16 * P[0][nt][2][e] + P[1][nt][2][e];
          const float M = fmaf((float)q0, 65536.f, fmaf((float)q1, 256.f, (float)q2));
          // N as one exact 64-bit integer, rounded once: any reader that forms the same
          // integer gets the same float (the decode reader forms it from whole T_j)
          const int n321 = (Nq[3][e] * 256 + Nq[2][e]) * 256 + Nq[1][e];
          const float N = (float)((long long)n321 * 256 + Nq[0][e]);
          y[nt][e] = fmaf((e & 1) ? xs.y : xs.x, fmaf(-dmin[r], N, d[r] * M), y[nt][e]);
        }
      }
      hcur[0] = hnxt[0];
      hcur[1] = hnxt[1];
      if (last) {
        crows[0] = nrows[0];
        crows[1] = nrows[1];
      }
    }
    // the tile's end: the quads' partial sums, added in quad order
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        part[(quad * TR + 16 * half + g + 8 * (e >> 1)) * NX + 8 * nt + 2 * t + (e & 1)] = y[nt][e];
    __syncthreads();
    for (int o = threadIdx.x; o < TR * NX; o += blockDim.x) {
      const int wr = o / NX, xr = o % NX;
      float v = 0.f;
#pragma unroll
      for (int w = 0; w < 8; ++w) v += part[(w * TR + wr) * NX + xr];
      const int64_t out = (int64_t)tile * TR + wr;
      if (out < p.n_out) p.y[xr * p.n_out + out] = v;
    }
    __syncthreads();  // part[] is free for the next tile
  }
#endif  // SPECD_MMA
}

template __global__ void sa_kernel<1>(const SaParams);
template __global__ void sa_kernel<2>(const SaParams);

// The decode side (one row of x): the same outputs, bit for bit, from dp4a. A warp per weight
// row; lane 4 q + c takes chunk c (runs 2c, 2c + 1) of the super-blocks q, q + 8, ... (the
// verify's quads), forms sum_j sc_j S_(t,j) per plane and sum_j mn_j T_j (exact, so the four
// lanes of a quad add theirs in any order), and every lane of the quad then runs the verify's
// float part for the super-block, in the same order; the quads' sums meet in quad order.
// x's digits here: three planes of K bytes (D0 signed), the grid step per super-block and T
// per 32-element run, in global memory (the engine's reader would prepare them in shared
// memory, as it does its digits today).
struct SaDecParams {
  const uint8_t* w = nullptr;  // Q4_K rows, `stride` bytes apart
  int64_t stride = 0;
  int64_t n_out = 0;
  int nsb = 0;
  const uint8_t* dig = nullptr;  // [3][K]
  const float* xs = nullptr;     // [K / 256]
  const int32_t* tsum = nullptr;  // [K / 32]
  float* y = nullptr;            // [n_out]
};

__global__ void __launch_bounds__(256) sa_decode_kernel(const SaDecParams p) {
#if SPECD_MMA
  const int lane = threadIdx.x % 32, q = lane >> 2, c = lane & 3;
  const int64_t o = (int64_t)blockIdx.x * 8 + threadIdx.x / 32;
  if (o >= p.n_out) return;
  const int64_t K = (int64_t)p.nsb * 256;
  const uint8_t* row = p.w + (size_t)o * p.stride;
  float acc = 0.f;
  for (int sb = q; sb < p.nsb; sb += 8) {
    const uint8_t* blk = row + 144 * (size_t)sb;
    const uint4 hd = __ldg(reinterpret_cast<const uint4*>(blk));
    const uint4 qa = __ldg(reinterpret_cast<const uint4*>(blk + 16 + 32 * c));
    const uint4 qb = __ldg(reinterpret_cast<const uint4*>(blk + 32 + 32 * c));
    const uint32_t qw[8] = {qa.x, qa.y, qa.z, qa.w, qb.x, qb.y, qb.z, qb.w};
    uint32_t scp, mnp;  // sub-blocks 2c (low byte), 2c + 1
    const uint32_t sh16 = 16 * (c & 1);
    kquant_pair_of(hd.y >> sh16, hd.z >> sh16, hd.w >> sh16, c, scp, mnp);
    int P[3] = {0, 0, 0};
    long long n64 = 0;
#pragma unroll
    for (int run = 0; run < 2; ++run) {
      const int j = 2 * c + run;
      const int64_t e0 = 256 * (int64_t)sb + 32 * j;
      int S[3] = {0, 0, 0};
#pragma unroll
      for (int pl = 0; pl < 3; ++pl) {
        const uint4* dp = reinterpret_cast<const uint4*>(p.dig + pl * K + e0);
        const uint4 da = __ldg(dp), db = __ldg(dp + 1);
        const uint32_t dw[8] = {da.x, da.y, da.z, da.w, db.x, db.y, db.z, db.w};
#pragma unroll
        for (int k = 0; k < 8; ++k) {
          const uint32_t qn = run ? (qw[k] >> 4) & 0x0F0F0F0Fu : qw[k] & 0x0F0F0F0Fu;
          S[pl] = pl == 0 ? __dp4a((int)dw[k], (int)qn, S[pl]) : (int)__dp4a(dw[k], qn, (unsigned)S[pl]);
        }
      }
      const int scj = (int)((scp >> (8 * run)) & 0xFF), mnj = (int)((mnp >> (8 * run)) & 0xFF);
#pragma unroll
      for (int pl = 0; pl < 3; ++pl) P[pl] += scj * S[pl];
      n64 += (long long)mnj * __ldg(p.tsum + (e0 >> 5));
    }
    // the quad's four chunks (exact integers: any order)
#pragma unroll
    for (int m = 1; m < 4; m <<= 1) {
#pragma unroll
      for (int pl = 0; pl < 3; ++pl) P[pl] += __shfl_xor_sync(0xFFFFFFFFu, P[pl], m);
      n64 += __shfl_xor_sync(0xFFFFFFFFu, n64, m);
    }
    const float d = f16_bits(hd.x & 0xFFFF), dmin = f16_bits(hd.x >> 16);
    const float M = fmaf((float)P[0], 65536.f, fmaf((float)P[1], 256.f, (float)P[2]));
    const float N = (float)n64;
    acc = fmaf(__ldg(p.xs + sb), fmaf(-dmin, N, d * M), acc);
  }
  float v = 0.f;  // the quads in order, as the verify's tile end adds them
#pragma unroll
  for (int w = 0; w < 8; ++w) v += __shfl_sync(0xFFFFFFFFu, acc, 4 * w);
  if (lane == 0) p.y[o] = v;
#endif  // SPECD_MMA
}

// ---- host: random Q4_K rows and x, the probe's image, a float64 reference, the probe's
// arithmetic replayed on the CPU, and (with a GPU) the kernel timed and checked against both.

namespace {

struct Rng {  // splitmix64
  uint64_t s;
  uint64_t next() {
    uint64_t z = (s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  double uniform() { return (double)(next() >> 11) * 0x1.0p-53; }
  double normal() { return std::sqrt(-2.0 * std::log(1.0 - uniform())) * std::cos(6.283185307179586 * uniform()); }
};

// a Q4_K block's d and dmin (common/types.h's conversion)
void block_d(const uint8_t* blk, float& d, float& dmin) {
  uint16_t d16, m16;
  std::memcpy(&d16, blk, 2);
  std::memcpy(&m16, blk + 2, 2);
  d = fp16_to_fp32(d16);
  dmin = fp16_to_fp32(m16);
}

// sub-block j's 6-bit scale and minimum of a Q4_K block's 12 scale bytes (ggml's order; the
// CPU backend's kquant_scales, which is not exported from cpu/quants.cpp)
void scale_min(const uint8_t* q, int j, int& sc, int& mn) {
  if (j < 4) {
    sc = q[j] & 63;
    mn = q[j + 4] & 63;
  } else {
    sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    mn = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

struct Problem {
  int64_t K = 0, n_out = 0;
  int NX = 16;
  std::vector<uint8_t> w;    // [n_out][K / 256][144]
  std::vector<int32_t> X;    // [NX][K]: x's digits on its super-block's grid
  std::vector<float> xs;     // [NX][K / 256]: the grid steps
  std::vector<int32_t> T;    // [NX][K / 32]: the sum of each 32-element run's digits
  std::vector<uint8_t> img;  // the kernel's shared-memory image
};

// Random weights (d, dmin of a trained model's size, every scale byte random) and rows of x
// whose 32-element blocks span 2^-6 .. 2^6 in size (so grids differ across a super-block).
// extreme: every q 15, every scale and minimum 63, every element of x +-(1 - 2^-30), whose
// digit is +-2^22: the largest integers the bounds allow (rows of x alternate in sign).
Problem make_problem(int64_t K, int64_t n_out, int NX, uint64_t seed, bool extreme = false) {
  Problem pr;
  pr.K = K;
  pr.n_out = n_out;
  pr.NX = NX;
  Rng rng{seed};
  const int64_t nsb = K / 256, S = K / 16;
  pr.w.resize((size_t)(n_out * nsb * 144));
  for (int64_t b = 0; b < n_out * nsb; ++b) {
    uint8_t* blk = pr.w.data() + b * 144;
    const uint16_t d = fp32_to_fp16((float)(1e-3 * (0.5 + rng.uniform()))), dm = fp32_to_fp16((float)(1e-3 * rng.uniform()));
    std::memcpy(blk, &d, 2);
    std::memcpy(blk + 2, &dm, 2);
    for (int i = 4; i < 144; ++i) blk[i] = extreme ? 0xFF : (uint8_t)rng.next();
  }
  pr.X.resize((size_t)(NX * K));
  pr.xs.resize((size_t)(NX * nsb));
  std::vector<double> x((size_t)(NX * K));
  for (int64_t i = 0; i < NX * K; ++i)
    x[i] = extreme ? ((i / K) % 2 ? -1.0 : 1.0) * (1.0 - 0x1.0p-30) : rng.normal() * std::ldexp(1.0, (int)((i / 32) % 13) - 6);
  for (int r = 0; r < NX; ++r)
    for (int64_t sb = 0; sb < nsb; ++sb) {
      double top = 0;
      for (int i = 0; i < 256; ++i) top = std::max(top, std::fabs(x[r * K + 256 * sb + i]));
      int e = 0;
      std::frexp(top > 0 ? top : 1.0, &e);  // top < 2^e
      const double step = std::ldexp(1.0, e - 22);
      pr.xs[r * nsb + sb] = (float)step;
      for (int i = 0; i < 256; ++i) pr.X[r * K + 256 * sb + i] = (int32_t)std::nearbyint(x[r * K + 256 * sb + i] / step);
    }
  pr.T.assign((size_t)(NX * K / 32), 0);
  for (int64_t i = 0; i < NX * K; ++i) pr.T[i / 32] += pr.X[i];
  // the image: digit planes by segment and swizzled row, then per super-block the grid steps
  // and T's byte planes (sub-blocks 0..3, 4..7 as two words per plane and row)
  const size_t dig_bytes = (size_t)3 * S * NX * 16, meta_sb = (size_t)NX * (4 + 32);
  pr.img.assign(dig_bytes + (size_t)nsb * meta_sb, 0);
  for (int r = 0; r < NX; ++r)
    for (int64_t i = 0; i < K; ++i) {
      const int32_t v = pr.X[r * K + i];
      const int s = (int)(i / 16);
      const uint8_t dg[3] = {(uint8_t)(int8_t)(v >> 16), (uint8_t)(v >> 8), (uint8_t)v};
      for (int pl = 0; pl < 3; ++pl)
        pr.img[((size_t)(pl * S + s) * NX + (r ^ seg_swizzle(s))) * 16 + i % 16] = dg[pl];
    }
  for (int64_t sb = 0; sb < nsb; ++sb) {
    uint8_t* m = pr.img.data() + dig_bytes + sb * meta_sb;
    for (int r = 0; r < NX; ++r) {
      std::memcpy(m + 4 * r, &pr.xs[r * nsb + sb], 4);
      for (int j = 0; j < 8; ++j) {
        const int32_t T = pr.T[(r * K + 256 * sb) / 32 + j];
        for (int tp = 0; tp < 4; ++tp) m[4 * NX + ((tp * NX + r) * 2 + j / 4) * 4 + j % 4] = (uint8_t)(T >> (8 * tp));
      }
    }
  }
  return pr;
}

// y[xr][o] in float64 for the first `rows` outputs (o < rows, at stride n_out): the weights as
// dequantized, times x on its grid
std::vector<double> reference(const Problem& pr, int64_t rows) {
  const int64_t nsb = pr.K / 256;
  std::vector<double> y((size_t)(pr.NX * pr.n_out), 0.0);
  for (int64_t o = 0; o < rows; ++o)
    for (int64_t sb = 0; sb < nsb; ++sb) {
      const uint8_t* blk = pr.w.data() + (o * nsb + sb) * 144;
      float d, dmin;
      block_d(blk, d, dmin);
      double wv[256];
      for (int j = 0; j < 8; ++j) {
        int sc, mn;
        scale_min(blk + 4, j, sc, mn);
        for (int i = 0; i < 32; ++i) {
          const uint8_t b = blk[16 + 32 * (j / 2) + i];
          wv[32 * j + i] = (double)d * sc * ((j & 1) ? b >> 4 : b & 15) - (double)dmin * mn;
        }
      }
      for (int r = 0; r < pr.NX; ++r) {
        double acc = 0;
        for (int i = 0; i < 256; ++i) acc += wv[i] * pr.X[r * pr.K + 256 * sb + i];
        y[r * pr.n_out + o] += acc * pr.xs[r * nsb + sb];
      }
    }
  return y;
}

// The kernel's arithmetic on the CPU for the first `rows` outputs, step for step: the integers
// exact (checked in 64 bits against the 32 the kernel keeps), the float operations the
// kernel's, in its order.
// decode: the integers formed as the decode kernel forms them (sum_j sc_j S_(t,j) per plane,
// sum_j mn_j T_j whole) instead of the verify's weight and T planes; the float part the same.
std::vector<float> replay(const Problem& pr, int64_t rows, bool& overflow, bool decode = false) {
  const int64_t nsb = pr.K / 256;
  std::vector<float> y((size_t)(pr.NX * pr.n_out), 0.f);
  overflow = false;
  auto i32 = [&](int64_t v) {
    if (v != (int32_t)v) overflow = true;
    return (int32_t)v;
  };
  for (int64_t o = 0; o < rows; ++o)
    for (int r = 0; r < pr.NX; ++r) {
      float part[8] = {};  // the quads' partial sums: super-blocks quad, quad + 8, ...
      for (int64_t sb = 0; sb < nsb; ++sb) {
        float& acc = part[sb % 8];
        const uint8_t* blk = pr.w.data() + (o * nsb + sb) * 144;
        float d, dmin;
        block_d(blk, d, dmin);
        int64_t P[2][3] = {}, Nq[4] = {}, D[3] = {}, n64 = 0;
        for (int j = 0; j < 8; ++j) {
          int sc, mn;
          scale_min(blk + 4, j, sc, mn);
          int64_t T = 0, S[3] = {};
          for (int i = 0; i < 32; ++i) {
            const uint8_t b = blk[16 + 32 * (j / 2) + i];
            const int q = (j & 1) ? b >> 4 : b & 15;
            const int32_t v = pr.X[r * pr.K + 256 * sb + 32 * j + i];
            const int dg[3] = {v >> 16, (v >> 8) & 255, v & 255};
            for (int pl = 0; pl < 3; ++pl) {
              P[0][pl] += (int64_t)((sc >> 4) * q) * dg[pl];
              P[1][pl] += (int64_t)((sc & 15) * q) * dg[pl];
              S[pl] += (int64_t)q * dg[pl];
            }
            T += v;
          }
          for (int pl = 0; pl < 3; ++pl) D[pl] += sc * (int64_t)i32(S[pl]);
          n64 += (int64_t)mn * T;
          const int tb[4] = {(int)(T & 255), (int)((T >> 8) & 255), (int)((T >> 16) & 255), (int)(T >> 24)};
          for (int tp = 0; tp < 4; ++tp) Nq[tp] += (int64_t)mn * tb[tp];
        }
        int32_t q3[3];
        for (int pl = 0; pl < 3; ++pl)
          q3[pl] = decode ? i32(D[pl]) : i32(16 * (int64_t)i32(P[0][pl]) + i32(P[1][pl]));
        const float M = fmaf((float)q3[0], 65536.f, fmaf((float)q3[1], 256.f, (float)q3[2]));
        const int32_t n321 = i32((i32(Nq[3]) * 256 + i32(Nq[2])) * (int64_t)256 + i32(Nq[1]));
        const float N = (float)(decode ? n64 : (int64_t)n321 * 256 + i32(Nq[0]));
        const float dM = d * M;
        acc = fmaf(pr.xs[r * nsb + sb], fmaf(-dmin, N, dM), acc);
      }
      float v = 0.f;
      for (int q = 0; q < 8; ++q) v += part[q];
      y[r * pr.n_out + o] = v;
    }
  return y;
}

// The decode kernel's inputs for row r of x: its digit planes (plane-major), grid steps, and T
// per 32-element run.
void decode_inputs(const Problem& pr, int r, std::vector<uint8_t>& dig, std::vector<float>& xs,
                   std::vector<int32_t>& tsum) {
  const int64_t K = pr.K, nsb = K / 256;
  dig.resize((size_t)(3 * K));
  for (int64_t i = 0; i < K; ++i) {
    const int32_t v = pr.X[r * K + i];
    dig[i] = (uint8_t)(int8_t)(v >> 16);
    dig[K + i] = (uint8_t)(v >> 8);
    dig[2 * K + i] = (uint8_t)v;
  }
  tsum.assign(pr.T.begin() + r * K / 32, pr.T.begin() + (r + 1) * K / 32);
  xs.assign(pr.xs.begin() + r * nsb, pr.xs.begin() + (r + 1) * nsb);
}

// how many of the first `rows` outputs of each row of x differ in their bits
size_t unlike(const std::vector<float>& a, const std::vector<float>& b, int64_t n_out, int64_t rows) {
  size_t n = 0;
  for (size_t i = 0; i < a.size(); ++i)
    if ((int64_t)(i % n_out) < rows) n += std::memcmp(&a[i], &b[i], 4) != 0;
  return n;
}

// max |a - ref| / max |ref| over the first `rows` outputs of each row of x
double rel_err(const std::vector<float>& a, const std::vector<double>& ref, int64_t n_out, int64_t rows) {
  double top = 0, err = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    if ((int64_t)(i % n_out) >= rows) continue;
    top = std::max(top, std::fabs(ref[i]));
    err = std::max(err, std::fabs((double)a[i] - ref[i]));
  }
  return err / top;
}

#define SA_CHECK(call)                                                                                 \
  do {                                                                                                 \
    const cudaError_t e_ = (call);                                                                     \
    if (e_ != cudaSuccess) {                                                                           \
      std::fprintf(stderr, "mma_scaled_a: %s:%d %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_)); \
      std::exit(1);                                                                                    \
    }                                                                                                  \
  } while (0)

}  // namespace

}  // namespace probe
}  // namespace gpu
}  // namespace specd

// mma_scaled_a host|gpu [K] [n_out] [reps]: one JSON line on stdout. host: the replay against
// the float64 reference (no GPU). gpu: also the kernel (NT = 2: 16 rows of x), its outputs
// against the replay (bit for bit) and the reference, and its time (median of reps launches).
// The replay and reference cover the first 512 outputs; the kernel computes all n_out.
int main(int argc, char** argv) {
  using namespace specd::gpu::probe;
  const std::string mode = argc > 1 ? argv[1] : "host";
  const int64_t K = argc > 2 ? std::atoll(argv[2]) : 4096, n_out = argc > 3 ? std::atoll(argv[3]) : 512;
  const int reps = argc > 4 ? std::atoi(argv[4]) : 50;
  if (K % 256 != 0 || n_out % 16 != 0 || (mode != "host" && mode != "gpu")) {
    std::fprintf(stderr, "usage: mma_scaled_a host|gpu [K (a multiple of 256)] [n_out (of 16)] [reps]\n");
    return 2;
  }
#if defined(__CUDACC__)
  cudaDeviceProp prop;
  if (mode == "gpu") SA_CHECK(cudaGetDeviceProperties(&prop, 0));
#endif
  const Problem pr = make_problem(K, n_out, 16, 1234);
  const int64_t check = std::min<int64_t>(n_out, 512);  // outputs checked (the replay is slow)
  const std::vector<double> ref = reference(pr, check);
  bool overflow = false;
  const std::vector<float> rep = replay(pr, check, overflow);
  const Problem ex = make_problem(K, 16, 16, 1, true);
  bool ex_overflow = false;
  const std::vector<float> ex_rep = replay(ex, 16, ex_overflow);
  // the decode's way to the same integers, replayed: the same floats, bit for bit
  bool dec_overflow = false;
  const size_t dec_unlike = unlike(replay(pr, check, dec_overflow, true), rep, n_out, check) +
                            unlike(replay(ex, 16, dec_overflow, true), ex_rep, 16, 16);
  overflow = overflow || dec_overflow;
  std::printf("{\"mode\": \"%s\", \"K\": %lld, \"n_out\": %lld, \"rows_x\": 16, \"replay_rel_err\": %.3e, "
              "\"int32_overflow\": %s, \"extreme_rel_err\": %.3e, \"extreme_int32_overflow\": %s, "
              "\"decode_replay_unlike\": %zu",
              mode.c_str(), (long long)K, (long long)n_out, rel_err(rep, ref, n_out, check),
              overflow ? "true" : "false", rel_err(ex_rep, reference(ex, 16), 16, 16), ex_overflow ? "true" : "false", dec_unlike);
  if (mode == "gpu") {
#if defined(__CUDACC__)
    uint8_t *dw = nullptr, *dimg = nullptr;
    float* dy = nullptr;
    SA_CHECK(cudaMalloc(&dw, pr.w.size()));
    SA_CHECK(cudaMalloc(&dimg, pr.img.size()));
    SA_CHECK(cudaMalloc(&dy, sizeof(float) * rep.size()));
    SA_CHECK(cudaMemcpy(dw, pr.w.data(), pr.w.size(), cudaMemcpyHostToDevice));
    SA_CHECK(cudaMemcpy(dimg, pr.img.data(), pr.img.size(), cudaMemcpyHostToDevice));
    SaParams p;
    p.w = dw;
    p.stride = K / 256 * 144;
    p.n_out = n_out;
    p.nsb = (int)(K / 256);
    p.img = dimg;
    p.img_bytes = (int64_t)pr.img.size();
    p.y = dy;
    // shared memory: x's image, then the quads' partial sums of a tile; persistent CTAs, one
    // per SM (the image fills its shared memory)
    const int tile_rows_n = 16 * (kWarpsPerCta / 8);
    const size_t smem = pr.img.size() + sizeof(float) * 8 * tile_rows_n * 16;
    SA_CHECK(cudaFuncSetAttribute(sa_kernel<2>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    const int64_t n_tiles = (n_out + tile_rows_n - 1) / tile_rows_n;
    const dim3 grid((unsigned)std::min<int64_t>(n_tiles, prop.multiProcessorCount));
    cudaEvent_t a, b;
    SA_CHECK(cudaEventCreate(&a));
    SA_CHECK(cudaEventCreate(&b));
    // n launches after one untimed: their times in us, sorted
    auto timed = [&](int n, auto launch) {
      std::vector<float> t;
      for (int i = 0; i < n + 1; ++i) {
        SA_CHECK(cudaEventRecord(a));
        launch();
        SA_CHECK(cudaEventRecord(b));
        SA_CHECK(cudaEventSynchronize(b));
        SA_CHECK(cudaGetLastError());
        float ms = 0;
        SA_CHECK(cudaEventElapsedTime(&ms, a, b));
        if (i > 0) t.push_back(1e3f * ms);
      }
      std::sort(t.begin(), t.end());
      return t;
    };
    const std::vector<float> times = timed(reps, [&] { sa_kernel<2><<<grid, 32 * kWarpsPerCta, smem>>>(p); });
    std::vector<float> got(rep.size());
    SA_CHECK(cudaMemcpy(got.data(), dy, sizeof(float) * got.size(), cudaMemcpyDeviceToHost));
    const size_t differ = unlike(got, rep, n_out, check);
    // the decode kernel on each row of x: against the verify kernel's outputs, all of them
    uint8_t* ddig = nullptr;
    float* dxs = nullptr;
    int32_t* dts = nullptr;
    SA_CHECK(cudaMalloc(&ddig, 3 * K));
    SA_CHECK(cudaMalloc(&dxs, sizeof(float) * (K / 256)));
    SA_CHECK(cudaMalloc(&dts, sizeof(int32_t) * (K / 32)));
    std::vector<float> dec(got.size()), dtimes;
    for (int r = 0; r < 16; ++r) {
      std::vector<uint8_t> hdig;
      std::vector<float> hxs;
      std::vector<int32_t> hts;
      decode_inputs(pr, r, hdig, hxs, hts);
      SA_CHECK(cudaMemcpy(ddig, hdig.data(), hdig.size(), cudaMemcpyHostToDevice));
      SA_CHECK(cudaMemcpy(dxs, hxs.data(), sizeof(float) * hxs.size(), cudaMemcpyHostToDevice));
      SA_CHECK(cudaMemcpy(dts, hts.data(), sizeof(int32_t) * hts.size(), cudaMemcpyHostToDevice));
      SaDecParams dp;
      dp.w = dw;
      dp.stride = p.stride;
      dp.n_out = n_out;
      dp.nsb = p.nsb;
      dp.dig = ddig;
      dp.xs = dxs;
      dp.tsum = dts;
      dp.y = dy + r * n_out;  // (the verify's outputs are already copied back)
      const std::vector<float> t = timed(r == 0 ? reps : 0, [&] { sa_decode_kernel<<<(unsigned)((n_out + 7) / 8), 256>>>(dp); });
      if (r == 0) dtimes = t;
    }
    SA_CHECK(cudaMemcpy(dec.data(), dy, sizeof(float) * dec.size(), cudaMemcpyDeviceToHost));
    const size_t dec_vs_verify = unlike(dec, got, n_out, n_out);
    const double us = times[times.size() / 2], bytes = (double)pr.w.size(), dus = dtimes[dtimes.size() / 2];
    std::printf(", \"device\": \"%s\", \"sms\": %d, \"warps_per_cta\": %d, \"ctas\": %u, \"median_us\": %.2f, "
                "\"min_us\": %.2f, \"weight_gb_s\": %.1f, \"kernel_rel_err\": %.3e, \"outputs_unlike_replay\": %zu, "
                "\"decode_median_us\": %.2f, \"decode_weight_gb_s\": %.1f, \"decode_unlike_verify\": %zu",
                prop.name, prop.multiProcessorCount, kWarpsPerCta, grid.x, us, times[0], bytes / us * 1e-3,
                rel_err(got, ref, n_out, check), differ, dus, bytes / dus * 1e-3, dec_vs_verify);
#endif
  }
  std::printf("}\n");
  return 0;
}
