// specd/cuda/digits.cuh: x rounded to integer digits per 32-element block, for the digit
// readers of linear() (matvec.cu for Q8_0 / Q4_K / Q6_K, matvec_kq.cu for Q4_K / Q6_K).
//
// Each 32-element block b of a row of x (times the norm weight, when fused) is rounded once
// to integers on the power-of-two grid of its largest element: X_k = round(x_k 2^(22-E_b))
// with |x_k| < 2^E_b over the block, so |X_k| <= 2^22 and the error is at most 2^(E_b-23)
// (the float32 rounding of the block's largest element). X = D0 2^16 + D1 2^8 + D2 is kept
// as three byte planes (D0 = X >> 16 signed, D1 and D2 unsigned); a reader's integer sums
// S_t = sum q D_t (dp4a) are exact in any order.
#pragma once
#include <cstdint>

#include "cuda/common.cuh"

namespace specd {
namespace gpu {

// Units of 4 elements of x a thread of a 256-thread CTA has in flight (all loads issued before
// any is used) when it turns rows of x into digits: kPrepUnits (12: K <= 12288, an 8B's down
// projection, takes one round of loads instead of three) for rows of x alone or where registers
// allow, kPrepNormUnits where the norm's weights take registers too; a tile of NR rows takes
// 1 / NR of that of each row. Rounds only change when loads are issued: the units, and the
// order in which a thread adds their squares, stay the same (so do the bits).
constexpr int kPrepUnits = 12, kPrepNormUnits = 4;

// Byte planes of x's digits: 3 (the default: 23-bit digits, float32-accurate) or, for
// experiments that measure what that precision costs (-DSPECD_X_PLANES=2|1, compile time,
// like SPECD_ATTN_CHUNK; tests/gpu's error bounds assume 3), 2 planes (15 bits: |X| <= 2^14)
// or 1 (7 bits: |X| <= 2^6). Every reader sums kPlanes planes; the bits change with the count.
#ifndef SPECD_X_PLANES
#define SPECD_X_PLANES 3
#endif
constexpr int kPlanes = SPECD_X_PLANES;
static_assert(kPlanes >= 1 && kPlanes <= 3, "SPECD_X_PLANES: 1, 2 or 3");
constexpr int kXBits = 8 * kPlanes - 2;  // |X_k| <= 2^kXBits

struct Digits4 {
  uint32_t d[kPlanes];  // the byte planes of 4 consecutive elements (element 0 in byte 0), D0 first
  float xsb;            // the block's grid step 2^(E_b - kXBits) (NaN for a block holding inf or NaN)
  int sum;              // X_0 + .. + X_3 (exact)
};

// The digits of 4 elements v (x times norm_w) of a 32-element block held by 8 consecutive
// lanes (4 elements each); every lane of the group takes part in the shuffles.
__device__ __forceinline__ Digits4 digits4(const float (&v)[4]) {
  // the block's largest |v| as bits (integer order: NaN > inf > finite, so both show)
  uint32_t big = 0;
#pragma unroll
  for (int e = 0; e < 4; ++e) big = max(big, __float_as_uint(v[e]) & 0x7FFFFFFFu);
  big = max(big, gpu_shfl_xor(big, 1));
  big = max(big, gpu_shfl_xor(big, 2));
  big = max(big, gpu_shfl_xor(big, 4));
  // biased exponent ef: |v| < 2^(ef-126), so v 2^(126+kXBits-ef) < 2^kXBits; xs =
  // 2^(ef-126-kXBits) (blocks below 2^(kXBits-126) share that grid: xs stays normal), NaN for
  // inf or NaN in the block
  const uint32_t ef = max(big >> 23, (uint32_t)kXBits);
  const float scale = __uint_as_float((253u + kXBits - ef) << 23);
  Digits4 r;
  r.xsb = ef == 255u ? __uint_as_float(0x7FC00000u) : __uint_as_float((ef + 1u - kXBits) << 23);
  uint32_t X[4];  // round(v scale): the bits of v scale + 1.5 * 2^23, minus those of 1.5 * 2^23
#pragma unroll
  for (int e = 0; e < 4; ++e) X[e] = __float_as_uint(fmaf(v[e], scale, 12582912.f)) - 0x4B400000u;
  if constexpr (kPlanes == 3) {
    const uint32_t b01 = __byte_perm(X[0], X[1], 0x5140), b23 = __byte_perm(X[2], X[3], 0x5140);
    const uint32_t t01 = __byte_perm(X[0], X[1], 0x0062), t23 = __byte_perm(X[2], X[3], 0x0062);
    r.d[0] = __byte_perm(t01, t23, 0x5410);
    r.d[1] = __byte_perm(b01, b23, 0x7632);
    r.d[2] = __byte_perm(b01, b23, 0x5410);
  } else {
#pragma unroll
    for (int t = 0; t < kPlanes; ++t) {  // plane t: byte kPlanes - 1 - t of each X
      const uint32_t b = kPlanes - 1 - t, sel = b | (b + 4) << 4;
      r.d[t] = __byte_perm(__byte_perm(X[0], X[1], sel), __byte_perm(X[2], X[3], sel), 0x5410);
    }
  }
  r.sum = (int)(X[0] + X[1] + X[2] + X[3]);
  return r;
}

// The digits of 4 elements a * n (x times the norm weight, or times ones) of a 32-element
// block held by 8 consecutive lanes, with sum = the whole block's X_0 + .. + X_31 (|sum| <=
// 2^27, exact); every lane of the group takes part in the shuffles.
__device__ __forceinline__ Digits4 block_digits4(const float4& a, const float4& n) {
  const float v[4] = {a.x * n.x, a.y * n.y, a.z * n.z, a.w * n.w};
  Digits4 d = digits4(v);
  d.sum += gpu_shfl_xor(d.sum, 1);
  d.sum += gpu_shfl_xor(d.sum, 2);
  d.sum += gpu_shfl_xor(d.sum, 4);
  return d;
}

// S0 2^16 + (S1 2^8 + S2) as a float, from a run's exact sums S_t = sum q D_t (one or two
// roundings; the second term fits int32); with 2 planes S0 2^8 + S1, with 1 S0 (one rounding).
// Every digit reader (dp4a or int8 MMA) ends a run here, or for Q4_K in digit_sum_q4.
__device__ __forceinline__ float digit_sum(const int (&S)[kPlanes]) {
  if constexpr (kPlanes == 3) return fmaf((float)S[0], 65536.f, (float)(S[1] * 256 + S[2]));
  else if constexpr (kPlanes == 2) return (float)(S[0] * 256 + S[1]);
  else return (float)S[0];
}

// The same for a run of Q4_K weights (0 <= q <= 15, at most 32 elements): |S0| <= 15 * 64 * 32
// = 30720, so S0 2^16 + S1 2^8 + S2 (|.| < 2.05e9) is one exact int32, rounded once. `high`:
// the run of a byte's high nibbles, read in place as 16 q (every S_t a multiple of 16): the same
// value, from S_t / 16 (exact). One int-to-float conversion per run instead of two and a fma;
// with 2 planes S0 2^8 + S1, with 1 S0. (Callers pass `high` as a constant of an unrolled loop.)
__device__ __forceinline__ float digit_sum_q4(const int (&S)[kPlanes], bool high) {
  const int sh = high ? 4 : 0, u = 1 << sh;  // (multiplications, not shifts: S0 may be negative)
  if constexpr (kPlanes == 3) return (float)(S[0] * (65536 / u) + S[1] * (256 / u) + (S[2] >> sh));
  else if constexpr (kPlanes == 2) return (float)(S[0] * (256 / u) + (S[1] >> sh));
  else return (float)(S[0] >> sh);
}

}  // namespace gpu
}  // namespace specd
