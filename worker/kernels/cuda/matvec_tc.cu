// specd/cuda/matvec_tc.cu: linear() for n <= kMaxSmallBatch rows of x on TENSOR CORES, for
// F16, Q8_0, Q4_K and Q6_K weights with K % 32 == 0 on NVIDIA sm_80+ (other types, HIP and
// older GPUs take matvec.cu; taken when LinearArgs::tensor_cores asks, for F16; SPECD_GPU_TC
// overrides: see tc_type()). Same
// contract as matvec.cu: float32-accurate and BATCH-INVARIANT, so decode (n = 1) and a
// speculative verify (n = k + 1) give bit-identical rows; but the weights are read once for
// all rows of x and the MMAs take the products, so a verify of 16 positions costs ~2 decode
// steps instead of ~5 (H200; see "History" below for what still limits one step).
//
// Maths, per row r of x (a token) and output o:
//   v_r[k] = x_r[k] * f_r, or (x_r[k] * nw[k]) * f_r with the fused RMSNorm, where
//            f_r = inv_r * s_r, inv_r = 1/sqrt(mean(x_r^2) + eps) (1 without the norm) and
//            s_r = 2^(14 - floor(log2 max_k |x_r[k] (nw[k]) inv_r|)): a power of two that
//            puts the row's largest value in [2^14, 2^15), inside fp16's range;
//   v = hi + lo, hi = fp16(v), lo = fp16(v - hi) (v - hi is exact in float32): 22 significant
//            bits, or an absolute 2^-25 below fp16's normal range (2^-39 of the row's max);
//   y[r, o] = (sum over warps w = 0..7, in order, of P_w[o, r]) / s_r  (+ bias, epilogue)
//   P_w     = the float32 tensor-core accumulation (mma m16n8k16, fp16 x fp16 -> f32, exact
//            products) over the K units of 32 elements u = w, w + 8, w + 16, ... in
//            ascending order, each unit as 4 MMAs: hi of its first 16, lo of them, hi of its
//            last 16, lo of them. F16 weights are the A operand as stored; Q8_0 / Q6_K
//            weights w = s q enter as their small integers q (exact in fp16): each
//            16-element half goes through its own 2 MMAs from zero, D, and then
//            P += s * D (s the scale of those 16 elements: Q8_0 d, Q6_K d sc of its
//            16-element sub-block). Q4_K (w = d sc q - dmin mn) takes its units by halves of
//            super-blocks instead (q4k_stage: warp w the 4 units of half w % 2 of the
//            stage's super-block w / 2): A = sc q (exact in fp16), the half's 16 MMAs from
//            zero into D in unit order, P += m * (sum of the unit's scaled x) per unit
//            (m = -dmin mn), then P += d * D.
// Nothing in it depends on n, on the other rows of x, on which column of the MMA a row sits
// in, or on the launch shape (rows per CTA): a row's result is bit-identical whatever else
// is computed with it (the tests check this on the device).
//
// Fragments: a lane (g = lane / 4, c = lane % 4) reads weight rows g and g + 8 of its m-tile
// at the unit's elements 4c .. 4c + 3 and 16 + 4c .. 16 + 4c + 3 (x_off), and the same 8
// positions of x row g of each n-tile (8 rows of x). A dot product does not care in which
// order its k are summed as long as A and B agree, so these 8 elements are the lane's k-slots
// of two MMAs: MMA h holds the unit's elements 16h .. 16h + 15 (Q6_K's 16-element scales),
// elements 0-1 and 2-3 of each 4 in slots (2c, 2c+1) and (2c+8, 2c+9).
//
// Tiles and CTAs: a tile is 16 * MT weight rows (MT m-tiles of 16; SwiGLU: 8 gate rows over
// the same 8 up rows per m-tile) times all n <= 8 * NT rows of x; its 8 warps split K by
// units as above, and their partial sums meet in shared memory. The CTAs are persistent (as
// many as fit the device at once, CTA b takes tiles b, b + grid, ...): they stream their
// tiles' weight bytes through one ring of 3 shared-memory stages (cp.async, ~0.3-1 KiB per row
// and stage, F16 16 units by default, two stages in flight, the ring running on across tile
// boundaries), and prepare
// x once: f_r for every row (K cut into clamp(K / 1024, 1, 8) slices, each summed by one warp
// in a fixed butterfly order, the slices added in order: it depends on K only), and, where n
// rows of converted x fit in 96 KiB of shared memory (one decode row up to K ~ 23k), the
// B fragments (x_frag, 128 bytes per row and unit); otherwise each warp converts its units'
// x as it goes. Same arithmetic either way (rounded operations only), so the choice changes
// no bit.
//
// History (H200, 8B Q4_K_M with SPECD_GPU_TC=all): reading each lane's 4- and 16-byte pieces
// straight from global memory a unit ahead kept too few bytes in flight (one step 9.1 ms);
// staging the rows through shared memory gave 7.2 ms, persistent CTAs 6.5 ms (CUDA cores:
// 5.0 ms). What limited it then was instructions (ncu: ~360 per warp and unit of 16 * MT rows,
// most of them decoding the per-row scales, which each of a row's 4 lanes repeats), not the
// MMAs (tensor pipe 4-8 % busy) or the bytes. Q4_K's scales, decoded once per half
// super-block and folded into the weights (q4k_stage), took the step from 6.4 to 5.4 ms
// (2026-12-06, against 2.2 on the CUDA cores; 16 positions 11.6 -> 11.3 ms): past 5 rows of x
// (K = 4096) what limits it is x, converted to fp16 halves per unit in every tile
// (bench/results/gpu_nvidia-h200_20261206d_tc-q4k-halves.md).
#include <algorithm>
#include <cstdlib>
#include <mutex>
#include <string>

#include "cuda/linear.cuh"
#include "cuda/linear_params.cuh"
#include "cuda/mma.cuh"
#include "cuda/quants.cuh"

namespace specd {
namespace gpu {

namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / kGroup;
constexpr int kUnit = 32;  // K elements per unit

using TcWeight = LinWeight;  // cta0: first blockIdx.x of the weight

struct TcParams : LinParams {
  // 1: each CTA converts x once into shared memory (the MMA's hi/lo fragments and, for Q4_K,
  // the unit sums) before the K loop; 0: every warp converts the x of its units as it goes.
  // Same arithmetic either way (x_frag), so the choice never changes a result.
  int32_t xstage = 0;
  int32_t f16_units = 8;  // K units per weight stage of F16 rows (8, 16 or 32: tc_f16_units())
  int32_t n_tiles = 0;  // tiles of 16 * MT weight rows (the old CTAs; cta0 counts them)
  int32_t pitch = 0;    // shared bytes of a staged row: the widest of the call's types
  int32_t red_off = 0;  // shared-memory offsets of the partial sums and the staged x
  int32_t xst_off = 0;
};

// Shared-memory staging of x (xstage): per row, K/32 units of 128 bytes (lane c's 4 hi then 4
// lo half2 at 32c), plus 16 bytes of padding so that rows of a warp's loads fall in different
// banks; then the unit sums, one float per (row, unit).
__host__ __device__ constexpr int64_t xstage_pitch(int64_t n_units) { return 128 * n_units + 16; }
__host__ __device__ constexpr size_t xstage_bytes(int64_t n, int64_t n_units) {
  return (size_t)(n * xstage_pitch(n_units) + 4 * n * n_units);
}
constexpr size_t kXStageMax = 96 << 10;  // largest staged x (with the weight stages and red: < 227 KiB)

// ---- weight staging: the CTA copies the bytes of its 16 * MT weight rows into shared memory
// (cp.async, kStages buffers, two stages in flight while one is read), stage_units(T) units of
// K per stage: ~0.3-1 KiB per row, so a CTA has ~20-60 KiB in flight. Read straight from global
// memory a unit at a time, the quantized rows had too few bytes in flight to reach the
// bandwidth (small loads, one unit ahead).
constexpr int kStages = 3;
// K units per stage (a multiple of 8: stages start at super-block boundaries; for F16 the
// call's TcParams::f16_units). Warp w takes the units w, w + 8, ... of every stage, so the
// stage size changes which barrier a unit waits behind, never the order of a row's sums.
__host__ __device__ constexpr int stage_units(GgmlType t, int f16_units) {
  return t == GgmlType::F16 ? f16_units : t == GgmlType::Q4_K ? 32 : 16;
}
// bytes of 8 units (256 elements) of a row
__host__ __device__ constexpr int unit8_bytes(GgmlType t) {
  return t == GgmlType::F16 ? 512 : t == GgmlType::Q8_0 ? 272 : t == GgmlType::Q4_K ? 144 : 210;
}
// bytes of a row's `units` units (a multiple of 8 for the K-quants, whose K is a multiple of 256)
__host__ __device__ constexpr int64_t units_bytes(GgmlType t, int64_t units) { return units * unit8_bytes(t) / 8; }
// shared bytes of a staged row: one spare 16-byte chunk, as a copy starts at the 16-byte
// boundary below the row's bytes
__host__ __device__ constexpr int stage_pitch(GgmlType t, int f16_units) {
  return 16 * ((int)(units_bytes(t, stage_units(t, f16_units)) + 15) / 16 + 1);
}

#if SPECD_MMA
__device__ __forceinline__ uint32_t pack_half2(__half a, __half b) {
  return (uint32_t)__half_as_ushort(a) | ((uint32_t)__half_as_ushort(b) << 16);
}

// v -> (hi, lo) halves of two values, packed as the MMA wants them (first value low).
__device__ __forceinline__ void split2(float v0, float v1, uint32_t& hi, uint32_t& lo) {
  const __half h0 = __float2half_rn(v0), h1 = __float2half_rn(v1);
  const __half l0 = __float2half_rn(__fsub_rn(v0, __half2float(h0))), l1 = __float2half_rn(__fsub_rn(v1, __half2float(h1)));
  hi = pack_half2(h0, h1);
  lo = pack_half2(l0, l1);
}

// The lane's 8 activations of row r in unit k0 / 32 (elements k0 + xo[0] + 0..3 and k0 +
// xo[1] + 0..3), scaled (v = (x nw) f, or x f without the norm weight), as the hi / lo fp16
// halves of its B fragments, and their plain sum (v0 + v1 + ... + v7, in order); zeros for
// r >= n. Rounded operations only (no contraction), so that the staged and the streaming
// conversion give the same bits.
__device__ __forceinline__ void x_frag(const TcParams& p, int64_t r, int64_t k0, const int (&xo)[2], float f,
                                       const float (&nw)[8], uint32_t (&bh)[4], uint32_t (&bl)[4], float& sum) {
  float v[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  if (r < p.n) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float4 a = __ldg(reinterpret_cast<const float4*>(p.x + r * p.K + k0 + xo[h]));
      v[4 * h] = a.x; v[4 * h + 1] = a.y; v[4 * h + 2] = a.z; v[4 * h + 3] = a.w;
    }
    if (p.norm_w != nullptr) {
#pragma unroll
      for (int i = 0; i < 8; ++i) v[i] = __fmul_rn(__fmul_rn(v[i], nw[i]), f);
    } else {
#pragma unroll
      for (int i = 0; i < 8; ++i) v[i] = __fmul_rn(v[i], f);
    }
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) split2(v[2 * i], v[2 * i + 1], bh[i], bl[i]);
  sum = v[0];
#pragma unroll
  for (int i = 1; i < 8; ++i) sum = __fadd_rn(sum, v[i]);
}

// The norm weights at the lane's 8 elements of the unit at k0 (ones without the norm).
__device__ __forceinline__ void nw_frag(const TcParams& p, int64_t k0, const int (&xo)[2], float (&nw)[8]) {
#pragma unroll
  for (int i = 0; i < 8; ++i) nw[i] = 1.f;
  if (p.norm_w == nullptr) return;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const float4 a = __ldg(reinterpret_cast<const float4*>(p.norm_w + k0 + xo[h]));
    nw[4 * h] = a.x; nw[4 * h + 1] = a.y; nw[4 * h + 2] = a.z; nw[4 * h + 3] = a.w;
  }
}

// ---- per-type readers of one unit (32 elements of K) of one weight row, for lane c.
// fetch(): the bytes (from the staged row: `row` is where the stage's bytes start, u the unit
// within the stage); frag(): the
// lane's 8 weights, or small integers q, as fp16 pairs in MMA order (a[0], a[1]: slots
// (2c, 2c+1) and (2c+8, 2c+9) of the unit's first MMA; a[2], a[3]: its second), and for
// quantized types the scale of each MMA's 16 elements (w = s q) and the unit's offset
// (w = s q + m, Q4_K). The lane's elements of MMA h are the 4 consecutive k at
// 32u + x_off(c, h): its activations are one float4.
// Integers to fp16: the bytes 0x64 and v (0..255) make the half 1024 + v exactly, so one
// byte permute builds two and one half2 subtraction removes the bias.

__device__ __forceinline__ uint32_t bytes01_h2(uint32_t v) { return __byte_perm(v, 0x64646464u, 0x5140); }
__device__ __forceinline__ uint32_t bytes23_h2(uint32_t v) { return __byte_perm(v, 0x64646464u, 0x7362); }
__device__ __forceinline__ uint32_t h2_sub(uint32_t a, float bias) {
  const __half2 r = __hsub2(*reinterpret_cast<const __half2*>(&a), __float2half2_rn(bias));
  return *reinterpret_cast<const uint32_t*>(&r);
}

// The lane's elements of MMA h in every unit: 4 consecutive k at 32u + x_off(c, h), so that
// MMA h holds the unit's 16 elements 16h .. 16h + 15 (Q6_K's 16-element scales).
__device__ __forceinline__ int x_off(int c, int h) { return 4 * c + 16 * h; }

template <GgmlType T>
struct TcRow;

template <>
struct TcRow<GgmlType::F16> {  // 8 halves, no scale
  static constexpr bool kScaled = false;
  struct Raw { uint2 lo, hi; };
  __device__ static void fetch(const uint8_t* row, int u, int c, Raw& r) {
    r.lo = *reinterpret_cast<const uint2*>(row + 64 * u + 8 * c);
    r.hi = *reinterpret_cast<const uint2*>(row + 64 * u + 32 + 8 * c);
  }
  __device__ static void frag(const Raw& r, int64_t, uint32_t (&a)[4], float (&s)[2]) {
    a[0] = r.lo.x; a[1] = r.lo.y; a[2] = r.hi.x; a[3] = r.hi.y;
    s[0] = s[1] = 1.f;
  }
};

template <>
struct TcRow<GgmlType::Q8_0> {  // {d; q[32] int8}: w = d q
  static constexpr bool kScaled = true;
  struct Raw { uint32_t q0, q1, d; };
  __device__ static void fetch(const uint8_t* row, int u, int c, Raw& r) {
    const uint8_t* b = row + 34 * u;
    r.d = ld_u16(b);
    r.q0 = ld_u32_a2(b + 2 + 4 * c);
    r.q1 = ld_u32_a2(b + 18 + 4 * c);
  }
  __device__ static void frag(const Raw& r, int64_t, uint32_t (&a)[4], float (&s)[2]) {
    const uint32_t q0 = r.q0 ^ 0x80808080u, q1 = r.q1 ^ 0x80808080u;  // q + 128
    a[0] = h2_sub(bytes01_h2(q0), 1152.f);
    a[1] = h2_sub(bytes23_h2(q0), 1152.f);
    a[2] = h2_sub(bytes01_h2(q1), 1152.f);
    a[3] = h2_sub(bytes23_h2(q1), 1152.f);
    s[0] = s[1] = f16_bits(r.d);
  }
};

template <>
struct TcRow<GgmlType::Q6_K> {  // unit u: l = 0..31 of quarter u % 4 of half (u % 8) / 4; two 16-element scales
  static constexpr bool kScaled = true;
  struct Raw { uint32_t la, lb, ha, hb, sc, d; };
  __device__ static void fetch(const uint8_t* row, int u, int c, Raw& r) {
    const uint8_t* b = row + 210 * (u / 8);
    const int j = u % 8, hf = j / 4, qt = j % 4;
    const uint8_t* ql = b + 64 * hf + 32 * (qt & 1) + 4 * c;
    r.la = ld_u32_a2(ql);
    r.lb = ld_u32_a2(ql + 16);
    r.ha = ld_u32_a2(b + 128 + 32 * hf + 4 * c);
    r.hb = ld_u32_a2(b + 128 + 32 * hf + 16 + 4 * c);
    r.sc = ld_u16(b + 192 + 8 * hf + 2 * qt);
    r.d = ld_u16(b + 208);
  }
  __device__ static void frag(const Raw& r, int64_t u, uint32_t (&a)[4], float (&s)[2]) {
    const int qt = (int)(u % 4), ns = 4 * (qt >> 1), hs = 2 * qt;
    const uint32_t qa = ((r.la >> ns) & 0x0F0F0F0Fu) | (((r.ha >> hs) & 0x03030303u) << 4);
    const uint32_t qb = ((r.lb >> ns) & 0x0F0F0F0Fu) | (((r.hb >> hs) & 0x03030303u) << 4);
    a[0] = h2_sub(bytes01_h2(qa), 1056.f);  // 1024 + 32: q - 32
    a[1] = h2_sub(bytes23_h2(qa), 1056.f);
    a[2] = h2_sub(bytes01_h2(qb), 1056.f);
    a[3] = h2_sub(bytes23_h2(qb), 1056.f);
    const float d = f16_bits(r.d);
    s[0] = d * (float)(int8_t)(r.sc & 0xFF);
    s[1] = d * (float)(int8_t)(r.sc >> 8);
  }
};
#endif

#if SPECD_MMA
__device__ __forceinline__ __half2 as_h2(uint32_t v) { return *reinterpret_cast<const __half2*>(&v); }
__device__ __forceinline__ uint32_t h2_bits(__half2 v) { return *reinterpret_cast<const uint32_t*>(&v); }

// ---- Q4_K, a stage's 32 units (4 super-blocks) per CTA: warp w takes the 4 units of half hb =
// w % 2 of super-block w / 2 (sub-blocks j = 4 hb + i, i < 4, one d and one dmin). The
// sub-block scales go into the weights: A = sc_j q, an integer <= 945, exact in fp16, so the
// warp's MMAs run on through its 4 units (i ascending, per unit hi and lo of its first 16
// elements, then of its last 16) from zero into D, and only then P += d D; before that, per
// unit, P += m_j xsum_j (m_j = -(dmin mn_j), xsum_j the unit's sum of the scaled x).
// The half's 6-bit scales and minima come from the 12 scale bytes once per row: for j < 4
// sc_j = byte j & 63, mn_j = byte 4 + j & 63; for j >= 4 sc_j = (byte 4 + j & 15) | (byte
// j - 4 >> 6) << 4, mn_j = (byte 4 + j >> 4) | (byte j >> 6) << 4 (kquant_pair, quants.cuh).
// Nibbles to fp16: the byte 0x64 above a byte v makes the half 1024 + v, and hfma2(1024 + v, s,
// -1024 s) = v s exactly (a fused operation rounding an exact small integer); low nibbles (v
// = q) take s = sc, high nibbles kept in place (v = 16 q) s = sc / 16 (exact in fp16).
template <int MT, int NT, class RowAt, class LoadB>
__device__ __forceinline__ void q4k_stage(int64_t stage_u0, int64_t n_units, int warp, int c, RowAt&& row_at,
                                          LoadB&& load_b, float (&acc)[MT][NT][4]) {
  const int hb = warp & 1;
  const int64_t u0 = stage_u0 + 4 * warp;
  if (u0 >= n_units) return;
  uint32_t sc4[MT][2], mn4[MT][2];  // [m-tile][row g, g + 8]: the half's 4 scales and minima, a byte each
  float d[MT][2], dmin[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const uint8_t* b = row_at(mt, h) + 144 * (warp >> 1);
      const uint32_t dm = ld_u32(b), w0 = ld_u32(b + 4), w1 = ld_u32(b + 8), w2 = ld_u32(b + 12);
      sc4[mt][h] = hb ? ((w2 & 0x0F0F0F0Fu) | ((w0 >> 2) & 0x30303030u)) : (w0 & 0x3F3F3F3Fu);
      mn4[mt][h] = hb ? (((w2 >> 4) & 0x0F0F0F0Fu) | ((w1 >> 2) & 0x30303030u)) : (w1 & 0x3F3F3F3Fu);
      d[mt][h] = f16_bits(dm & 0xFFFF);
      dmin[mt][h] = f16_bits(dm >> 16);
    }
  float D[MT][NT][4];
  zero_tiles(D);
#pragma unroll
  for (int pp = 0; pp < 2; ++pp) {  // the pair of sub-blocks 4 hb + 2 pp (low nibbles), + 1 (high)
    uint32_t qw[MT][2][2];  // its bytes 4c .. 4c + 3 and 16 + 4c .. 16 + 4c + 3
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const uint8_t* qs = row_at(mt, h) + 144 * (warp >> 1) + 16 + 64 * hb + 32 * pp + 4 * c;
        qw[mt][h][0] = ld_u32(qs);
        qw[mt][h][1] = ld_u32(qs + 16);
      }
#pragma unroll
    for (int hi = 0; hi < 2; ++hi) {
      const int i = 2 * pp + hi;
      uint32_t bh[NT][4], bl[NT][4];
      float xs[NT][2];
      load_b(u0 + i, bh, bl, xs);
      const uint32_t keep = hi ? 0xFFF0FFF0u : 0xFF0FFF0Fu;
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        uint32_t a[2][4];  // [row g, g + 8][fragment register]
        float mneg[2];     // -(dmin mn_j)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          mneg[h] = -(dmin[mt][h] * small_int((mn4[mt][h] >> (8 * i)) & 0xFFu));
          const __half2 s1 = __hsub2(as_h2(__byte_perm(sc4[mt][h], 0x64646464u, 0x4040u | (i << 8) | i)),
                                     __float2half2_rn(1024.f));
          const __half2 sv = hi ? __hmul2(s1, __float2half2_rn(0.0625f)) : s1;
          const __half2 nb = __hmul2(sv, __float2half2_rn(-1024.f));
#pragma unroll
          for (int k = 0; k < 4; ++k) {  // q0 bytes 01, 23, q1 bytes 01, 23 as halves 1024 + byte
            const uint32_t w = qw[mt][h][k >> 1];
            a[h][k] = h2_bits(__hfma2(as_h2((k & 1 ? bytes23_h2(w) : bytes01_h2(w)) & keep), sv, nb));
          }
        }
#pragma unroll
        for (int t = 0; t < NT; ++t) {
          mma16816(D[mt][t], a[0][0], a[1][0], a[0][1], a[1][1], bh[t][0], bh[t][1]);
          mma16816(D[mt][t], a[0][0], a[1][0], a[0][1], a[1][1], bl[t][0], bl[t][1]);
          mma16816(D[mt][t], a[0][2], a[1][2], a[0][3], a[1][3], bh[t][2], bh[t][3]);
          mma16816(D[mt][t], a[0][2], a[1][2], a[0][3], a[1][3], bl[t][2], bl[t][3]);
          acc[mt][t][0] = fmaf(mneg[0], xs[t][0], acc[mt][t][0]);
          acc[mt][t][1] = fmaf(mneg[0], xs[t][1], acc[mt][t][1]);
          acc[mt][t][2] = fmaf(mneg[1], xs[t][0], acc[mt][t][2]);
          acc[mt][t][3] = fmaf(mneg[1], xs[t][1], acc[mt][t][3]);
        }
      }
    }
  }
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int t = 0; t < NT; ++t) {
      acc[mt][t][0] = fmaf(d[mt][0], D[mt][t][0], acc[mt][t][0]);
      acc[mt][t][1] = fmaf(d[mt][0], D[mt][t][1], acc[mt][t][1]);
      acc[mt][t][2] = fmaf(d[mt][1], D[mt][t][2], acc[mt][t][2]);
      acc[mt][t][3] = fmaf(d[mt][1], D[mt][t][3], acc[mt][t][3]);
    }
}

// A tile: 16 * MT weight rows of one weight (SwiGLU: 8 * MT gate rows over the same up rows).
struct Tile {
  const TcWeight* w0;  // its weight (SwiGLU: the gate)
  int64_t o0;          // first output row
};
__device__ __forceinline__ Tile tile_at(const TcParams& p, int t, int rows) {
  if (p.ep == Epilogue::SwiGLU) return Tile{&p.w[0], (int64_t)t * (rows / 2)};
  const TcWeight* w = &p.w[0];
  if (p.n_w > 1 && t >= p.w[1].cta0) w = &p.w[1];
  if (p.n_w > 2 && t >= p.w[2].cta0) w = &p.w[2];
  return Tile{w, (int64_t)(t - w->cta0) * rows};
}
// Row slot i (= 16 mt + 8 h + g) of a tile: the weight row that the lanes g read as rp[mt][h]
// (clamped to the weight; the results of clamped rows are dropped), and its weight.
__device__ __forceinline__ const uint8_t* slot_row(const TcParams& p, const Tile& tl, int i, const TcWeight*& w) {
  const int mt = i / 16, h = (i / 8) & 1, gg = i % 8;
  const bool swiglu = p.ep == Epilogue::SwiGLU;
  w = swiglu && h ? &p.w[1] : tl.w0;
  const int64_t o = swiglu ? tl.o0 + 8 * mt + gg : tl.o0 + 16 * mt + 8 * h + gg;
  return w->data + (size_t)min(o, w->n_out - 1) * w->stride;
}
__device__ __forceinline__ int64_t stages_of(GgmlType t, int64_t n_units, int f16_units) {
  return (n_units + stage_units(t, f16_units) - 1) / stage_units(t, f16_units);
}

// The K loop of one tile of weights of type T: stages q0 .. q0 + n_st - 1 of the CTA's ring,
// then the warps' partial sums into red. issue() copies the ring's next stage (whatever tile it
// belongs to) and must run once per stage consumed.
template <GgmlType T, int MT, int NT, class Issue>
__device__ __forceinline__ void tile_body(const TcParams& p, const Tile& tl, int64_t& q, Issue&& issue,
                                          const uint8_t* stg, int pitch, float* red, const float* fac,
                                          const uint8_t* xst) {
  using R = TcRow<T>;
  const int lane = threadIdx.x % kGroup, warp = threadIdx.x / kGroup, g = lane / 4, c = lane % 4;
  const int64_t K = p.K, n = p.n, n_units = K / kUnit;
  constexpr int kRows = 16 * MT, kCols = 8 * NT;
  const int ups = stage_units(T, p.f16_units);
  const int64_t sb = units_bytes(T, ups);
  const int xo[2] = {x_off(c, 0), x_off(c, 1)};
  const uint8_t* rp[MT][2];  // the lane's rows g and g + 8 of each m-tile (SwiGLU: gate row, up row)
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const TcWeight* w;
      rp[mt][h] = slot_row(p, tl, 16 * mt + 8 * h + g, w);
    }
  const int64_t xpitch = xstage_pitch(n_units);
  const float* xsum = reinterpret_cast<const float*>(xst + n * xpitch);

  float acc[MT][NT][4];
  zero_tiles(acc);

  const int64_t n_st = stages_of(T, n_units, p.f16_units);
  for (int64_t st = 0; st < n_st; ++st, ++q) {
    cp_async_wait<kStages - 2>();  // ring stage q has landed (this thread's copies)
    __syncthreads();               // ... everyone's; and stage q - 1's buffer is free again
    issue();
    const uint8_t* buf = stg + (size_t)(q % kStages) * kRows * pitch;
    // the lane's staged bytes of row slot (mt, h) in this stage
    auto row_at = [&](int mt, int h) {
      return buf + (16 * mt + 8 * h + g) * pitch + ((uintptr_t)(rp[mt][h] + st * sb) & 15);
    };
    // B fragments of every n-tile for unit u: x row 8t + g at the lane's elements of MMA 0 and
    // 1; for Q4_K also the unit's sum of the scaled x of the rows in this lane's C columns
    auto load_b = [&](int64_t u, uint32_t (&bh)[NT][4], uint32_t (&bl)[NT][4], float (&xs)[NT][2]) {
      const int64_t k0 = kUnit * u;
      if (p.xstage) {
#pragma unroll
        for (int t = 0; t < NT; ++t) {
          const int64_t r = 8 * t + g;
          uint4 a = make_uint4(0u, 0u, 0u, 0u), b = a;
          if (r < n) {
            const uint8_t* src = xst + r * xpitch + 128 * u + 32 * c;
            a = *reinterpret_cast<const uint4*>(src);
            b = *reinterpret_cast<const uint4*>(src + 16);
          }
          bh[t][0] = a.x; bh[t][1] = a.y; bh[t][2] = a.z; bh[t][3] = a.w;
          bl[t][0] = b.x; bl[t][1] = b.y; bl[t][2] = b.z; bl[t][3] = b.w;
          if constexpr (T == GgmlType::Q4_K) {
            const int64_t r0 = 8 * t + 2 * c;
            xs[t][0] = r0 < n ? xsum[r0 * n_units + u] : 0.f;
            xs[t][1] = r0 + 1 < n ? xsum[(r0 + 1) * n_units + u] : 0.f;
          }
        }
      } else {
        float nw[8];
        nw_frag(p, k0, xo, nw);
#pragma unroll
        for (int t = 0; t < NT; ++t) {
          const int64_t r = 8 * t + g;
          float sum;
          x_frag(p, r, k0, xo, r < n ? fac[r] : 0.f, nw, bh[t], bl[t], sum);
          if constexpr (T == GgmlType::Q4_K) {
            sum += gpu_shfl_xor(sum, 1);  // the 4 lanes of row g: fixed butterfly
            sum += gpu_shfl_xor(sum, 2);
            xs[t][0] = __shfl_sync(0xffffffffu, sum, 4 * (2 * c));
            xs[t][1] = __shfl_sync(0xffffffffu, sum, 4 * (2 * c + 1));
          }
        }
      }
    };
    if constexpr (T == GgmlType::Q4_K) {
      q4k_stage<MT, NT>(st * ups, n_units, warp, c, row_at, load_b, acc);
    } else {
      // warp w: units w, w + 8, ... of the stage (so over the stages w, w + 8, w + 16, ... of K)
#pragma unroll 1
      for (int i = 0; i < ups / kWarps; ++i) {
        const int ul = warp + kWarps * i;
        const int64_t u = st * ups + ul;
        if (u >= n_units) break;
        typename R::Raw raw[MT][2];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
          for (int h = 0; h < 2; ++h) R::fetch(row_at(mt, h), ul, c, raw[mt][h]);
        uint32_t bh[NT][4], bl[NT][4];
        float xs[NT][2];  // (unused: no offset)
        load_b(u, bh, bl, xs);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          uint32_t a0[4], a1[4];
          float s0[2], s1[2];
          R::frag(raw[mt][0], u, a0, s0);  // row g
          R::frag(raw[mt][1], u, a1, s1);  // row g + 8
#pragma unroll
          for (int t = 0; t < NT; ++t) {
            if constexpr (!R::kScaled) {
              mma16816(acc[mt][t], a0[0], a1[0], a0[1], a1[1], bh[t][0], bh[t][1]);
              mma16816(acc[mt][t], a0[0], a1[0], a0[1], a1[1], bl[t][0], bl[t][1]);
              mma16816(acc[mt][t], a0[2], a1[2], a0[3], a1[3], bh[t][2], bh[t][3]);
              mma16816(acc[mt][t], a0[2], a1[2], a0[3], a1[3], bl[t][2], bl[t][3]);
            } else {
#pragma unroll
              for (int h = 0; h < 2; ++h) {  // q.x of MMA h's 16 elements, then its scale
                float d[4] = {0.f, 0.f, 0.f, 0.f};
                mma16816(d, a0[2 * h], a1[2 * h], a0[2 * h + 1], a1[2 * h + 1], bh[t][2 * h], bh[t][2 * h + 1]);
                mma16816(d, a0[2 * h], a1[2 * h], a0[2 * h + 1], a1[2 * h + 1], bl[t][2 * h], bl[t][2 * h + 1]);
                acc[mt][t][0] = fmaf(s0[h], d[0], acc[mt][t][0]);
                acc[mt][t][1] = fmaf(s0[h], d[1], acc[mt][t][1]);
                acc[mt][t][2] = fmaf(s1[h], d[2], acc[mt][t][2]);
                acc[mt][t][3] = fmaf(s1[h], d[3], acc[mt][t][3]);
              }
            }
          }
        }
      }
    }
  }

  // partial sums -> red: acc[mt][t] = rows (16mt + g, 16mt + g + 8), columns (8t + 2c,
  // 8t + 2c + 1). (The previous tile's sums were read before this tile's first barrier.)
  float* mine = red + (size_t)warp * kRows * kCols;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int t = 0; t < NT; ++t) {
      const int row = 16 * mt + g, col = 8 * t + 2 * c;
      mine[row * kCols + col] = acc[mt][t][0];
      mine[row * kCols + col + 1] = acc[mt][t][1];
      mine[(row + 8) * kCols + col] = acc[mt][t][2];
      mine[(row + 8) * kCols + col + 1] = acc[mt][t][3];
    }
}
#endif

// Persistent CTAs: CTA b takes the tiles b, b + grid, b + 2 grid, ...; its weight bytes stream
// through one ring of kStages shared-memory stages across the tile boundaries, and x is
// prepared once per CTA (f_r, and the staged fragments) instead of once per tile.
template <int MT, int NT>
__global__ void __launch_bounds__(kThreads, NT >= 4 ? 1 : 2) tc_kernel(const TcParams p) {
#if SPECD_MMA
  // [kStages][16 * MT][pitch] weight stages | [kWarps][16 * MT][8 * NT] partial sums | staged x
  extern __shared__ __align__(16) uint8_t smem[];
  __shared__ float fac[kMaxSmallBatch], unscale[kMaxSmallBatch];
  __shared__ float part[kWarps][kMaxSmallBatch][2];  // f_r: the slices' sums and maxima
  constexpr int kRows = 16 * MT, kCols = 8 * NT, kTpr = kThreads / kRows;
  uint8_t* stg = smem;
  float* red = reinterpret_cast<float*>(smem + p.red_off);
  uint8_t* xst = smem + p.xst_off;
  const int lane = threadIdx.x % kGroup, warp = threadIdx.x / kGroup, g = lane / 4, c = lane % 4;
  const int64_t K = p.K, n = p.n, n_units = K / kUnit;
  const int pitch = p.pitch;

  // ---- the copier: the kTpr threads of row slot cslot copy its 16-byte chunks of each stage in
  // turn, from the 16-byte boundary below the slot's first byte of the stage (the
  // misalignment is kept in place); ct / cst: the tile and stage it copies next
  const int cslot = threadIdx.x / kTpr, c0 = threadIdx.x % kTpr;
  int ct = blockIdx.x;
  int64_t cst = 0, cn_st = 0, csb = 0, qi = 0;
  GgmlType ctype = GgmlType::F16;
  const uint8_t *crow = nullptr, *cend = nullptr;
  auto copy_tile = [&]() {  // the copier's state for tile ct
    if (ct >= p.n_tiles) return;
    const Tile tl = tile_at(p, ct, kRows);
    const TcWeight* w;
    crow = slot_row(p, tl, cslot, w);
    cend = w->data + (size_t)w->n_out * w->stride;
    ctype = tl.w0->type;
    cn_st = stages_of(ctype, n_units, p.f16_units);
    csb = units_bytes(ctype, stage_units(ctype, p.f16_units));
    cst = 0;
  };
  auto issue = [&]() {
    if (ct < p.n_tiles) {
      const int64_t ups = stage_units(ctype, p.f16_units);
      const int64_t units = min(ups, n_units - cst * ups);
      const int64_t bytes = units_bytes(ctype, units);
      uint8_t* dst = stg + ((size_t)(qi % kStages) * kRows + cslot) * pitch;
      const uint8_t* start = crow + cst * csb;
      const uint8_t* a = reinterpret_cast<const uint8_t*>((uintptr_t)start & ~(uintptr_t)15);
      const int need = (int)(((uintptr_t)start & 15) + bytes + 15) >> 4;
      for (int ch = c0; ch < need; ch += kTpr) {
        const int64_t left = cend - (a + 16 * ch);
        cp_async16_n(dst + 16 * ch, a + 16 * ch, left >= 16 ? 16 : (int)left);
      }
      if (++cst == cn_st) {
        ct += gridDim.x;
        copy_tile();
      }
    }
    cp_async_commit();  // (an empty group past the end keeps the count uniform)
    ++qi;
  };
  copy_tile();
  // the first stages: immutable weights, copied before waiting for the previous kernel
#pragma unroll
  for (int st = 0; st < kStages - 1; ++st) issue();

  gpu_grid_wait();
  gpu_grid_launch_dependents();

  // ---- f_r and 1/s_r of every row of x: K is cut into ns = clamp(K / 1024, 1, 8) slices;
  // (row, slice) pairs go round the warps, each summed and maxed by one warp (lanes over
  // float4 steps, then the butterfly), and a row's slices meet in order. The arithmetic
  // depends on K only: the same for every n and in every CTA.
  const int xo[2] = {x_off(c, 0), x_off(c, 1)};
  const int ns = (int)max((int64_t)1, min((int64_t)kWarps, K / 1024));
  {
    const int64_t ks = (K / kUnit + ns - 1) / ns * kUnit;  // slice length (a multiple of 32)
    for (int64_t pr = warp; pr < n * ns; pr += kWarps) {
      const int64_t r = pr / ns, k_lo = (pr % ns) * ks, k_hi = min(K, k_lo + ks);
      const float* xr = p.x + r * K;
      float ss = 0.f, mx = 0.f;
      for (int64_t k = k_lo + 4 * lane; k < k_hi; k += 4 * kGroup) {
        const float4 v = __ldg(reinterpret_cast<const float4*>(xr + k));
        float4 nw = make_float4(1.f, 1.f, 1.f, 1.f);
        if (p.norm_w != nullptr) nw = __ldg(reinterpret_cast<const float4*>(p.norm_w + k));
        ss = add_squares(v, ss);
        mx = max_abs_prod(v, nw, mx);
      }
      ss = group_sum(ss);
      mx = group_max(mx);
      if (lane == 0) {
        part[pr % ns][r][0] = ss;
        part[pr % ns][r][1] = mx;
      }
    }
  }
  __syncthreads();
  for (int64_t r = threadIdx.x; r < n; r += kThreads) {
    float ss = part[0][r][0], mx = part[0][r][1];
    for (int sl = 1; sl < ns; ++sl) {
      ss += part[sl][r][0];
      mx = fmaxf(mx, part[sl][r][1]);
    }
    const float inv = p.norm_w != nullptr ? rsqrtf(ss / (float)K + p.eps) : 1.f;
    const float sc = pow2_range_scale(mx * inv, 14);  // the largest |v| in [2^14, 2^15): fp16's range
    fac[r] = inv * sc;
    unscale[r] = 1.f / sc;
  }
  __syncthreads();

  // ---- staged x: every (row, unit) converted once, 8 per warp at a time (lane g's pair, lane
  // c's 8 elements), with the unit sums' butterfly of the streaming path
  if (p.xstage) {
    const int64_t xpitch = xstage_pitch(n_units);
    float* xsum = reinterpret_cast<float*>(xst + n * xpitch);
    const int64_t pairs = n * n_units;
    for (int64_t q0 = (int64_t)warp * 8; q0 < pairs; q0 += kWarps * 8) {  // warp-uniform
      const int64_t qq = q0 + g;
      const bool ok = qq < pairs;
      const int64_t r = ok ? qq / n_units : n, u = ok ? qq % n_units : 0;
      float nw[8];
      nw_frag(p, kUnit * u, xo, nw);
      uint32_t bh[4], bl[4];
      float sum;
      x_frag(p, r, kUnit * u, xo, ok ? fac[r] : 0.f, nw, bh, bl, sum);
      sum += gpu_shfl_xor(sum, 1);
      sum += gpu_shfl_xor(sum, 2);
      if (ok) {
        uint8_t* dst = xst + r * xpitch + 128 * u + 32 * c;
        *reinterpret_cast<uint4*>(dst) = make_uint4(bh[0], bh[1], bh[2], bh[3]);
        *reinterpret_cast<uint4*>(dst + 16) = make_uint4(bl[0], bl[1], bl[2], bl[3]);
        if (c == 0) xsum[r * n_units + u] = sum;
      }
    }
    // (visible to every warp after the first stage's barrier)
  }

  // ---- the tiles
  const bool swiglu = p.ep == Epilogue::SwiGLU;
  int64_t q = 0;  // ring stages consumed
  for (int t = blockIdx.x; t < p.n_tiles; t += gridDim.x) {
    const Tile tl = tile_at(p, t, kRows);
    switch (tl.w0->type) {
      case GgmlType::Q8_0: tile_body<GgmlType::Q8_0, MT, NT>(p, tl, q, issue, stg, pitch, red, fac, xst); break;
      case GgmlType::Q4_K: tile_body<GgmlType::Q4_K, MT, NT>(p, tl, q, issue, stg, pitch, red, fac, xst); break;
      case GgmlType::Q6_K: tile_body<GgmlType::Q6_K, MT, NT>(p, tl, q, issue, stg, pitch, red, fac, xst); break;
      default: tile_body<GgmlType::F16, MT, NT>(p, tl, q, issue, stg, pitch, red, fac, xst); break;
    }
    __syncthreads();

    // sum over the warps in order, unscale, epilogue: thread -> (row of x, output row)
    const TcWeight& w0 = *tl.w0;
    const int64_t o0 = tl.o0;
    const int out_rows = swiglu ? 8 * MT : kRows;
    for (int i = threadIdx.x; i < (int)n * out_rows; i += kThreads) {
      const int r = i / out_rows, j = i % out_rows;
      float* yr = p.y + (int64_t)r * p.ldy;
      auto total = [&](int row) {
        float v = 0.f;
#pragma unroll
        for (int w = 0; w < kWarps; ++w) v += red[((size_t)w * kRows + row) * kCols + r];
        return v * unscale[r];
      };
      if (swiglu) {
        const int mt = j / 8, jj = j % 8;
        const int64_t o = o0 + j;
        if (o >= p.w[0].n_out) continue;
        store_swiglu(p, yr, o, total(16 * mt + jj), total(16 * mt + 8 + jj));
      } else {
        const int64_t o = o0 + j;
        if (o >= w0.n_out) continue;
        store_value(p.ep, w0, yr, o, total(j));
      }
    }
    // (red is written again only after the next tile's first barrier)
  }
  cp_async_wait<0>();  // (only empty groups can be left)
#else
  // (never launched: tc_linear() takes this path only on sm_80+ NVIDIA devices)
  (void)p;
#endif
}

constexpr size_t red_smem(int mt, int nt) { return sizeof(float) * (size_t)kWarps * 16 * mt * 8 * nt; }
// The widest staged row of the call's types, and of any call.
int call_pitch(const LinearArgs& a, int f16_units) {
  int b = 16;
  for (int j = 0; j < a.n_w; ++j) b = std::max(b, stage_pitch(a.w[j]->type, f16_units));
  return b;
}
constexpr int kMaxF16Units = 32;
constexpr int kMaxPitch = std::max(std::max(stage_pitch(GgmlType::F16, kMaxF16Units), stage_pitch(GgmlType::Q8_0, 8)),
                                   std::max(stage_pitch(GgmlType::Q4_K, 8), stage_pitch(GgmlType::Q6_K, 8)));
// The kernel's static shared memory (fac, unscale, part), and what is left for the dynamic.
constexpr size_t kTcStatic = sizeof(float) * (2 * kMaxSmallBatch + kWarps * kMaxSmallBatch * 2);
size_t tc_room() { return dev_limits().smem_per_block - kTcStatic; }
// Shared bytes of a launch: the weight stages, the partial sums, the staged x.
size_t tc_smem(int mt, int nt, int pitch, bool xstage, int64_t n, int64_t K) {
  return (size_t)kStages * 16 * mt * pitch + red_smem(mt, nt) + (xstage ? xstage_bytes(n, K / kUnit) : 0);
}

template <int MT, int NT>
void launch_tc(TcParams& p, gpuStream_t s) {
  static std::once_flag once;
  std::call_once(once, [] {
    const size_t most = std::min((size_t)kStages * 16 * MT * kMaxPitch + red_smem(MT, NT) + kXStageMax,
                                 tc_room());
    SPECD_GPU_CHECK(gpuFuncSetAttribute((tc_kernel<MT, NT>), gpuFuncAttributeMaxDynamicSharedMemorySize, (int)most));
  });
  p.red_off = kStages * 16 * MT * p.pitch;
  p.xst_off = p.red_off + (int32_t)red_smem(MT, NT);
  const size_t smem = tc_smem(MT, NT, p.pitch, p.xstage, p.n, p.K);
  // as many CTAs as fit on the device at once, at most one per tile
  int per_sm = 0;
  SPECD_GPU_CHECK(gpuOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, (tc_kernel<MT, NT>), kThreads, smem));
  const int ctas = std::max(1, std::min(p.n_tiles, std::max(per_sm, 1) * dev_limits().sms));
  gpu_launch("tc_kernel", tc_kernel<MT, NT>, dim3((unsigned)ctas), dim3(kThreads), smem, s, p);
}

template <int MT>
void launch_tc(TcParams& p, int nt, gpuStream_t s) {
  switch (nt) {
    case 1: launch_tc<MT, 1>(p, s); break;
    case 2: launch_tc<MT, 2>(p, s); break;
    case 4: launch_tc<MT, 4>(p, s); break;
    default: launch_tc<MT, 8>(p, s); break;
  }
}

// SPECD_GPU_TC (read once): unset: LinearArgs::tensor_cores decides, for F16; "0": never;
// "f16": F16 always; "all": F16, Q8_0, Q4_K and Q6_K always. (Measured on an H200,
// 2026-11-30, bench/results/gpu_nvidia-h200_20261130f.md: on tensor cores a 16-position verify
// costs 1.9-2.2 decode steps instead of 4.4-5.1, but one decode step is 10-29 % slower (the
// quantized readers spend more instructions per weight than the CUDA cores do, see above).
// So F16 only, and only for engines that speculate.)
enum class TcMode { Option, Off, F16, All };

// K units per stage of F16 weights: SPECD_GPU_TC_F16_UNITS (8, 16 or 32; read once), else 16
// (H200, 0.6B F16 decode: 762 tok/s against 685 with 8; bench/results/..._20261201_tc-f16-units).
int tc_f16_units() {
  static const int u = [] {
    const std::string v = env_value("SPECD_GPU_TC_F16_UNITS");
    return v == "8" ? 8 : v == "32" ? 32 : 16;
  }();
  return u;
}
TcMode tc_mode() {
  static const TcMode m = [] {
    const std::string v = env_value("SPECD_GPU_TC");
    return v == "0" ? TcMode::Off : v == "f16" ? TcMode::F16 : v == "all" ? TcMode::All : TcMode::Option;
  }();
  return m;
}

bool tc_type(GgmlType t, bool asked) {
  const TcMode m = tc_mode();
  if (t == GgmlType::F16) return m == TcMode::F16 || m == TcMode::All || (m == TcMode::Option && asked);
  return m == TcMode::All && (t == GgmlType::Q8_0 || t == GgmlType::Q4_K || t == GgmlType::Q6_K);
}

}  // namespace

// Takes the call (returns true) when asked (a.tensor_cores, or SPECD_GPU_TC), every weight has a
// tensor-core reader and the device has the MMAs; the choice never depends on n, so a model
// reads a weight the same way for decode and verify. Arguments checked by linear().
bool tc_linear(const LinearArgs& a, gpuStream_t s) {
  if (SPECD_HIP || a.n > kMaxSmallBatch || !dev_limits().mma) return false;
  const int64_t K = a.w[0]->n_in;
  if (K % kUnit != 0) return false;
  for (int j = 0; j < a.n_w; ++j)
    if (!tc_type(a.w[j]->type, a.tensor_cores)) return false;
  if (a.ep == Epilogue::SwiGLU && a.w[0]->type != a.w[1]->type) return false;  // one type per CTA
  TcParams p;
  const int nt = a.n <= 8 ? 1 : a.n <= 16 ? 2 : a.n <= 32 ? 4 : 8;
  // 32 rows per CTA (each x fragment feeds two m-tiles) unless that leaves fewer CTAs than SMs
  const int mt = cta_count(a, 32) >= dev_limits().sms ? 2 : 1;
  const int64_t tiles = fill_params(p, a, 16 * mt);
  SPECD_CHECK(tiles < (int64_t)1 << 31, "linear: too many output rows");
  p.n_tiles = (int32_t)tiles;
  // F16 stages as asked where the ring fits (bigger ones need ~100-200 KiB for 32 rows), else
  // halved (the same sums in the same order: no bit changes)
  p.f16_units = tc_f16_units();
  p.pitch = call_pitch(a, p.f16_units);
  while (p.f16_units > 8 && tc_smem(mt, nt, p.pitch, false, a.n, K) > tc_room()) {
    p.f16_units /= 2;
    p.pitch = call_pitch(a, p.f16_units);
  }
  SPECD_CHECK(tc_smem(mt, nt, p.pitch, false, a.n, K) <= tc_room(),
              "linear: the tensor-core reader's stages do not fit this device's shared memory");
  // x converted once per CTA where it fits (SPECD_GPU_TC_XSTAGE=0: never, for benchmarks)
  static const bool xstage_on = env_value("SPECD_GPU_TC_XSTAGE") != "0";
  p.xstage = xstage_on && xstage_bytes(a.n, K / kUnit) <= kXStageMax &&
             tc_smem(mt, nt, p.pitch, true, a.n, K) <= tc_room();
  if (mt == 2) launch_tc<2>(p, nt, s);
  else launch_tc<1>(p, nt, s);
  return true;
}

}  // namespace gpu
}  // namespace specd
