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
// The float part rounds where it converts M and N: a design would fix that order and the
// decode reader would follow it (its dp4a sums can form the same integers).
//
// Work: a warp owns 16 weight rows (lane g: rows g, g + 8) and 8 NT rows of x, the whole of K;
// x's image in shared memory (plane t, segment s of 16 elements, row r: 16 bytes at
// (t S + s) NX + (r ^ f(s)) times 16, S = K / 16; then per super-block and row: its grid
// step, and T's four planes as two words each, sub-blocks 0..3 and 4..7). Compile-time
// choices: SA_WARPS (warps per CTA: 16, at most 128 registers a thread, or 8) and SA_STREAM
// (1: the next super-block's header and the next chunk in flight; 0: all of the next
// super-block, 24 registers more). No host code launches it yet: its outputs have not been
// checked on a GPU.
//
//   python3 bench/sass_mix.py --file bench/mma_scaled_a.cu --match sa_kernel --label scaled-a
#include <cstdint>

#include "cuda/mma.cuh"
#include "cuda/quants.cuh"

namespace specd {
namespace gpu {
namespace probe {

#ifndef SA_WARPS
#define SA_WARPS 16
#endif
#ifndef SA_STREAM
#define SA_STREAM 1
#endif

constexpr int kWarpsPerCta = SA_WARPS;

struct SaParams {
  const uint8_t* w = nullptr;  // Q4_K rows, `stride` bytes apart
  int64_t stride = 0;
  int64_t n_out = 0;
  int nsb = 0;                 // super-blocks per row (K / 256)
  const uint8_t* img = nullptr;  // x's image (global), copied to shared memory
  int64_t img_bytes = 0;
  float* y = nullptr;          // [NX][n_out]
};

__device__ __forceinline__ int seg_swizzle(int s) { return ((s & 1) << 2) | ((s >> 1) & 3); }

#if SPECD_MMA
struct SbWeights {  // one super-block of the lane's two rows
  uint4 h[2];       // d, dmin, scales[12]
  uint2 q[2][4];    // [row][chunk k]: qs bytes 32 k + 8 t .. + 7
};

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

__device__ __forceinline__ void load_sb(const uint8_t* const (&rows)[2], int sb, int t, SbWeights& w) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const uint8_t* b = rows[r] + 144 * (size_t)sb;
    w.h[r] = __ldg(reinterpret_cast<const uint4*>(b));
#pragma unroll
    for (int k = 0; k < 4; ++k) w.q[r][k] = __ldg(reinterpret_cast<const uint2*>(b + 16 + 32 * k + 8 * t));
  }
}

template <int NT>
__global__ void __launch_bounds__(32 * kWarpsPerCta, 1) sa_kernel(const SaParams p) {
  constexpr int NX = 8 * NT;
  extern __shared__ __align__(16) uint8_t smem[];
  for (int64_t off = 16 * (int64_t)threadIdx.x; off < p.img_bytes; off += 16 * blockDim.x)
    cp_async16_all(smem + off, p.img + off);
  cp_async_commit();
  cp_async_wait<0>();
  __syncthreads();

  const int lane = threadIdx.x % 32, g = lane >> 2, t = lane & 3;
  const int64_t row0 = 16 * ((int64_t)blockIdx.x * kWarpsPerCta + threadIdx.x / 32);
  if (row0 >= p.n_out) return;
  const int S = 16 * p.nsb;  // segments of 16 elements per row
  const uint8_t* dig = smem;
  const uint8_t* meta = smem + (size_t)3 * S * NX * 16;  // per super-block: NX grid steps, then T's planes
  const uint8_t* rows[2] = {p.w + (size_t)min(row0 + g, p.n_out - 1) * p.stride,
                            p.w + (size_t)min(row0 + g + 8, p.n_out - 1) * p.stride};

  float y[NT][4];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) y[nt][e] = 0.f;

  // SA_STREAM 0: the next super-block's weights all in flight while one is summed (24 registers
  // more); 1: its header, and one chunk (two runs) ahead
#if SA_STREAM
  uint4 hcur[2], hnxt[2];
  uint2 qc[2], qn[2];
  load_head(rows, 0, hcur);
  load_chunk(rows, 0, 0, t, qc);
#else
  SbWeights cur, nxt;
  load_sb(rows, 0, t, cur);
#endif
  for (int sb = 0; sb < p.nsb; ++sb) {
#if SA_STREAM
    if (sb + 1 < p.nsb) load_head(rows, sb + 1, hnxt);
#else
    if (sb + 1 < p.nsb) load_sb(rows, sb + 1, t, nxt);
#endif
    // the rows' scales and minimums of sub-blocks 0..7: sc's low parts as nibbles of one word,
    // its high parts as 2-bit fields of another (taken apart per run), mn packed as four bytes
    // (sub-blocks 4 u .. 4 u + 3) for the min MMA's k-slots
    uint32_t slw[2], shw[2], mnw[2][2];
    float d[2], dmin[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
#if SA_STREAM
      const uint4 hd = hcur[r];
#else
      const uint4 hd = cur.h[r];
#endif
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
#if SA_STREAM
      if (!(run & 1)) {  // the next chunk: this super-block's, or the next one's first
        if (k < 3) load_chunk(rows, sb, k + 1, t, qn);
        else if (sb + 1 < p.nsb) load_chunk(rows, sb + 1, 0, t, qn);
      }
      const uint2 w0 = qc[0], w1 = qc[1];
#else
      const uint2 w0 = cur.q[0][k], w1 = cur.q[1][k];
#endif
      // A fragment of q: rows g, g + 8 (k-slots 4t..), then the same at 16 + 4t..
      const int ns = 4 * (run & 1);
      const uint32_t q[4] = {(w0.x >> ns) & 0x0F0F0F0Fu, (w1.x >> ns) & 0x0F0F0F0Fu, (w0.y >> ns) & 0x0F0F0F0Fu,
                             (w1.y >> ns) & 0x0F0F0F0Fu};
      // sub-block run's l and h of each row (byte run % 4 of the words, its high half for run >= 4)
      const int bs = 8 * (run & 3) + 4 * (run >> 2), hs = 8 * (run & 3) + 2 * (run >> 2);
      const uint32_t l0 = slw[0] >> bs & 0xF, l1 = slw[1] >> bs & 0xF, h0 = shw[0] >> hs & 0x3, h1 = shw[1] >> hs & 0x3;
      const uint32_t al[4] = {q[0] * l0, q[1] * l1, q[2] * l0, q[3] * l1};
      const uint32_t ah[4] = {q[0] * h0, q[1] * h1, q[2] * h0, q[3] * h1};
#if SA_STREAM
      if (run & 1) {
        qc[0] = qn[0];
        qc[1] = qn[1];
      }
#endif
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
        const uint32_t bt = t < 2 ? *reinterpret_cast<const uint32_t*>(sbmeta + 4 * NX + ((tp * NX + 8 * nt + g) * 2 + t) * 4) : 0u;
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
        const int n321 = (Nq[3][e] * 256 + Nq[2][e]) * 256 + Nq[1][e];
        const float N = fmaf((float)n321, 256.f, (float)Nq[0][e]);
        y[nt][e] = fmaf((e & 1) ? xs.y : xs.x, fmaf(-dmin[r], N, d[r] * M), y[nt][e]);
      }
    }
#if SA_STREAM
    hcur[0] = hnxt[0];
    hcur[1] = hnxt[1];
#else
    cur = nxt;
#endif
  }
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int64_t o = row0 + g + 8 * (e >> 1), xr = 8 * nt + 2 * t + (e & 1);
      if (o < p.n_out) p.y[xr * p.n_out + o] = y[nt][e];
    }
}

template __global__ void sa_kernel<1>(const SaParams);
template __global__ void sa_kernel<2>(const SaParams);
#endif  // SPECD_MMA

}  // namespace probe
}  // namespace gpu
}  // namespace specd
