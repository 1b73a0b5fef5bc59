// specd/cuda/quants.cuh: device decoders of the GGUF block formats (F32 F16 BF16 Q8_0 Q4_0
// Q4_1 Q5_0 Q5_1 Q4_K Q5_K Q6_K; layouts in cpu/quants.h), shared by linear()'s two paths
// (matvec.cu, matmul.cu) and embed_rows.
//
// Pieces. Every format is read in PIECES of 8 weights. Piece q of a row lies in block
// b = q / kPieces (sub-index s = q % kPieces) and holds the block positions
//   pos(s) .. pos(s)+3   and   pos(s)+kGap .. pos(s)+kGap+3,
// so its activations are two float4 loads. 256 consecutive elements are exactly 32 pieces
// for every type, so a group of 32 lanes covers them with one piece per lane. (Float types
// use blocks of 8 elements: one piece each.) The split follows the nibble layouts: a lane
// reads 4 bytes of qs and takes their low nibbles (first run) and high nibbles (second).
//
// Exactness. A piece comes back as small integers q (exact floats) and per-run scale s and
// offset m: w = s*q (Scaled) or w = fma(s, q, m) (Affine), or the raw values (Raw). As on
// the CPU (cpu/quants.cpp), s*q has <= 24 significant bits and is exact, and the affine form
// rounds once, exactly like the CPU's `d*q + m` / `dl*q - ml`: dequant() equals
// ops.dequantize bit for bit (signed zeros included).
//
// Integer -> float: for 0 <= v < 2^23, the bits 0x4B000000 | v are the float 2^23 + v, so
// one byte permute (PRMT) and one subtraction of (2^23 + bias) give v - bias exactly; this
// replaces the quarter-rate I2F instruction in the hot loop.
//
// Alignment: the readers need the block fields at their natural alignment (ld_u32 at
// multiples of 4, ld_u32_a2 / ld_u16 at multiples of 2, the float types' 16-byte loads at
// multiples of 16). That holds when rows start at multiples of row_align(type), which
// linear() and embed_rows() check (with a 16-byte aligned base).
#pragma once
#include <cstdint>

#include "cuda/common.cuh"

#if SPECD_HIP
// hipcc's -ffast-math allows reassociation; the kernels' fixed operation order is what
// makes them batch-invariant, so forbid it in every file that includes the decoders.
#pragma clang fp reassociate(off)
#endif

namespace specd {
namespace gpu {

enum class Form { Raw, Scaled, Affine };

// One piece: 8 weights of one row, in the two runs of 4 described above.
struct Piece {
  float q[8];      // Raw: the weights; else exact small integers
  float s[2];      // scale of run 0 (q[0..3]) and run 1 (q[4..7])   (Scaled, Affine)
  float m[2];      // offset of each run                              (Affine)
};

// ---- raw readers (generic pointers: shared or global memory)

__device__ __forceinline__ uint32_t ld_u16(const uint8_t* p) { return *reinterpret_cast<const uint16_t*>(p); }
__device__ __forceinline__ uint32_t ld_u32(const uint8_t* p) { return *reinterpret_cast<const uint32_t*>(p); }
// 4 bytes at a 2-aligned address: two 16-bit loads glued by one byte permute.
__device__ __forceinline__ uint32_t ld_u32_a2(const uint8_t* p) { return __byte_perm(ld_u16(p), ld_u16(p + 2), 0x5410); }
__device__ __forceinline__ uint4 ld_u128(const uint8_t* p) { return *reinterpret_cast<const uint4*>(p); }
__device__ __forceinline__ float f16_at(const uint8_t* p) { return load_f16(reinterpret_cast<const uint16_t*>(p)); }
__device__ __forceinline__ float f16_bits(uint32_t h) { return __half2float(__ushort_as_half((unsigned short)h)); }

constexpr float kMagic = 8388608.f;  // 2^23
// byte I of v (0..255), minus `bias`, as an exact float (the PRMT trick above).
template <int I>
__device__ __forceinline__ float byte_minus(uint32_t v, float magic_plus_bias) {
  return __int_as_float((int)__byte_perm(v, 0x4B000000u, 0x7540 | I)) - magic_plus_bias;
}
// the 4 bytes of v minus bias into q[0..3]
__device__ __forceinline__ void bytes4(uint32_t v, float magic_plus_bias, float* q) {
  q[0] = byte_minus<0>(v, magic_plus_bias);
  q[1] = byte_minus<1>(v, magic_plus_bias);
  q[2] = byte_minus<2>(v, magic_plus_bias);
  q[3] = byte_minus<3>(v, magic_plus_bias);
}
__device__ __forceinline__ float small_int(uint32_t v) { return __int_as_float((int)(0x4B000000u | v)) - kMagic; }
// bits 0..3 of v spread to bit 0 of each byte (shifted copies at 0, 7, 14, 21 never overlap).
__device__ __forceinline__ uint32_t spread4(uint32_t v) { return ((v & 0xF) * 0x00204081u) & 0x01010101u; }

// ---- the formats

template <GgmlType T>
struct Dec;

template <>
struct Dec<GgmlType::F32> {
  static constexpr int kElems = 8, kBytes = 32, kPieces = 1, kGap = 4;
  static constexpr Form kForm = Form::Raw;
  __device__ static int pos(int) { return 0; }
  __device__ static void load(const uint8_t* b, int, Piece& p) {
    const float4 a = *reinterpret_cast<const float4*>(b), c = *reinterpret_cast<const float4*>(b + 16);
    p.q[0] = a.x; p.q[1] = a.y; p.q[2] = a.z; p.q[3] = a.w;
    p.q[4] = c.x; p.q[5] = c.y; p.q[6] = c.z; p.q[7] = c.w;
  }
};

template <>
struct Dec<GgmlType::F16> {
  static constexpr int kElems = 8, kBytes = 16, kPieces = 1, kGap = 4;
  static constexpr Form kForm = Form::Raw;
  __device__ static int pos(int) { return 0; }
  __device__ static void load(const uint8_t* b, int, Piece& p) {
    const uint4 v = ld_u128(b);
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      p.q[2 * i] = f16_bits(w[i] & 0xFFFF);
      p.q[2 * i + 1] = f16_bits(w[i] >> 16);
    }
  }
};

template <>
struct Dec<GgmlType::BF16> {
  static constexpr int kElems = 8, kBytes = 16, kPieces = 1, kGap = 4;
  static constexpr Form kForm = Form::Raw;
  __device__ static int pos(int) { return 0; }
  __device__ static void load(const uint8_t* b, int, Piece& p) {
    const uint4 v = ld_u128(b);
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      p.q[2 * i] = __uint_as_float(w[i] << 16);
      p.q[2 * i + 1] = __uint_as_float(w[i] & 0xFFFF0000u);
    }
  }
};

// {d; int8 qs[32]}: piece s = elements 8s..8s+7; q = int8 (xor 0x80 makes it q+128 unsigned).
template <>
struct Dec<GgmlType::Q8_0> {
  static constexpr int kElems = 32, kBytes = 34, kPieces = 4, kGap = 4;
  static constexpr Form kForm = Form::Scaled;
  __device__ static int pos(int s) { return 8 * s; }
  __device__ static void load(const uint8_t* b, int s, Piece& p) {
    const float d = f16_at(b);
    bytes4(ld_u32_a2(b + 2 + 8 * s) ^ 0x80808080u, kMagic + 128.f, p.q);
    bytes4(ld_u32_a2(b + 6 + 8 * s) ^ 0x80808080u, kMagic + 128.f, p.q + 4);
    p.s[0] = p.s[1] = d;
  }
};

// {d; qs[16]}: byte j holds element j (low nibble) and j+16 (high); w = d*(q-8).
template <>
struct Dec<GgmlType::Q4_0> {
  static constexpr int kElems = 32, kBytes = 18, kPieces = 4, kGap = 16;
  static constexpr Form kForm = Form::Scaled;
  __device__ static int pos(int s) { return 4 * s; }
  __device__ static void load(const uint8_t* b, int s, Piece& p) {
    const float d = f16_at(b);
    const uint32_t v = ld_u32_a2(b + 2 + 4 * s);
    bytes4(v & 0x0F0F0F0Fu, kMagic + 8.f, p.q);
    bytes4((v >> 4) & 0x0F0F0F0Fu, kMagic + 8.f, p.q + 4);
    p.s[0] = p.s[1] = d;
  }
};

// {d; m; qs[16]}: w = d*q + m.
template <>
struct Dec<GgmlType::Q4_1> {
  static constexpr int kElems = 32, kBytes = 20, kPieces = 4, kGap = 16;
  static constexpr Form kForm = Form::Affine;
  __device__ static int pos(int s) { return 4 * s; }
  __device__ static void load(const uint8_t* b, int s, Piece& p) {
    const uint32_t dm = ld_u32(b);
    const uint32_t v = ld_u32(b + 4 + 4 * s);
    bytes4(v & 0x0F0F0F0Fu, kMagic, p.q);
    bytes4((v >> 4) & 0x0F0F0F0Fu, kMagic, p.q + 4);
    p.s[0] = p.s[1] = f16_bits(dm & 0xFFFF);
    p.m[0] = p.m[1] = f16_bits(dm >> 16);
  }
};

// {d; qh[4]; qs[16]}: bit j of qh (u32) is bit 4 of element j; w = d*(q-16).
template <>
struct Dec<GgmlType::Q5_0> {
  static constexpr int kElems = 32, kBytes = 22, kPieces = 4, kGap = 16;
  static constexpr Form kForm = Form::Scaled;
  __device__ static int pos(int s) { return 4 * s; }
  __device__ static void load(const uint8_t* b, int s, Piece& p) {
    const float d = f16_at(b);
    const uint32_t qh = ld_u32_a2(b + 2);
    const uint32_t v = ld_u32_a2(b + 6 + 4 * s);
    bytes4((v & 0x0F0F0F0Fu) | (spread4(qh >> (4 * s)) << 4), kMagic + 16.f, p.q);
    bytes4(((v >> 4) & 0x0F0F0F0Fu) | (spread4(qh >> (16 + 4 * s)) << 4), kMagic + 16.f, p.q + 4);
    p.s[0] = p.s[1] = d;
  }
};

// {d; m; qh[4]; qs[16]}: w = d*q + m.
template <>
struct Dec<GgmlType::Q5_1> {
  static constexpr int kElems = 32, kBytes = 24, kPieces = 4, kGap = 16;
  static constexpr Form kForm = Form::Affine;
  __device__ static int pos(int s) { return 4 * s; }
  __device__ static void load(const uint8_t* b, int s, Piece& p) {
    const uint32_t dm = ld_u32(b);
    const uint32_t qh = ld_u32(b + 4);
    const uint32_t v = ld_u32(b + 8 + 4 * s);
    bytes4((v & 0x0F0F0F0Fu) | (spread4(qh >> (4 * s)) << 4), kMagic, p.q);
    bytes4(((v >> 4) & 0x0F0F0F0Fu) | (spread4(qh >> (16 + 4 * s)) << 4), kMagic, p.q + 4);
    p.s[0] = p.s[1] = f16_bits(dm & 0xFFFF);
    p.m[0] = p.m[1] = f16_bits(dm >> 16);
  }
};

// K-quant 6-bit scales/mins of the sub-block pair (2g, 2g+1), packed as in cpu/quants.cpp
// (kquant_scales): low byte of the returned 16 bits = sub-block 2g, high byte = 2g+1.
__device__ __forceinline__ void kquant_pair_of(uint32_t lo, uint32_t mid, uint32_t hi, int g, uint32_t& sc,
                                               uint32_t& mn) {
  // lo, mid, hi: scale bytes p, p+1 / 4+p, 5+p / 8+p, 9+p (p = 2 (g % 2)) in their low 16
  // bits (higher bits are ignored). g < 2: the low 6 bits of bytes 0..7; else 4 low bits from
  // bytes 8..11 and the 2 high bits from bits 6-7 of bytes 0..7 (selects, not a branch:
  // lanes of one group differ in g)
  const uint32_t sc_hi = (hi & 0x0F0Fu) | ((lo >> 2) & 0x3030u);
  const uint32_t mn_hi = ((hi >> 4) & 0x0F0Fu) | ((mid >> 2) & 0x3030u);
  sc = g < 2 ? lo & 0x3F3Fu : sc_hi;
  mn = g < 2 ? mid & 0x3F3Fu : mn_hi;
}
__device__ __forceinline__ void kquant_pair(const uint8_t* scales, int g, uint32_t& sc, uint32_t& mn) {
  const int p = 2 * (g & 1);
  kquant_pair_of(ld_u16(scales + p), ld_u16(scales + 4 + p), ld_u16(scales + 8 + p), g, sc, mn);
}
// A K-quant sub-block pair's scales s = d sc and minimums m = -(dmin mn) (dd: d | dmin << 16,
// the block's first 4 bytes; sc, mn: kquant_pair's).
__device__ __forceinline__ void kquant_sm(uint32_t dd, uint32_t sc, uint32_t mn, float (&s)[2], float (&m)[2]) {
  const float d = f16_bits(dd & 0xFFFF), dmin = f16_bits(dd >> 16);
  s[0] = d * small_int(sc & 0xFF);
  s[1] = d * small_int(sc >> 8);
  m[0] = -(dmin * small_int(mn & 0xFF));
  m[1] = -(dmin * small_int(mn >> 8));
}

// {d; dmin; scales[12]; qs[128]}: sub-block j = d*sc_j*q - dmin*mn_j with q the low (even j)
// or high (odd j) nibbles of qs[32*(j/2) ..]. Piece s: g = s/8, bytes i0 = 4*(s%8) of the
// g-th 32-byte group: low nibbles = sub-block 2g, high = 2g+1.
template <>
struct Dec<GgmlType::Q4_K> {
  static constexpr int kElems = 256, kBytes = 144, kPieces = 32, kGap = 32;
  static constexpr Form kForm = Form::Affine;
  __device__ static int pos(int s) { return 64 * (s >> 3) + 4 * (s & 7); }
  __device__ static void load(const uint8_t* b, int s, Piece& p) {
    const int g = s >> 3, i0 = 4 * (s & 7);
    uint32_t sc, mn;
    kquant_pair(b + 4, g, sc, mn);
    kquant_sm(ld_u32(b), sc, mn, p.s, p.m);
    const uint32_t v = ld_u32(b + 16 + 32 * g + i0);
    bytes4(v & 0x0F0F0F0Fu, kMagic, p.q);
    bytes4((v >> 4) & 0x0F0F0F0Fu, kMagic, p.q + 4);
  }
};

// Pieces 2m and 2m + 1 of a Q4_K block (m < 16: the same sub-block pair, g = m / 4, and 8
// consecutive qs bytes) with one read of the scales: q4k_pair() reads them, q4k_piece(.., h)
// gives what load(b, 2m + h, p) gives.
struct Q4kPair {
  uint32_t v[2];  // the qs words of pieces 2m, 2m + 1
  float s[2], m[2];
};
__device__ __forceinline__ Q4kPair q4k_pair(const uint8_t* b, int m) {
  const int g = m >> 2, i0 = 8 * (m & 3);
  uint32_t sc, mn;
  kquant_pair(b + 4, g, sc, mn);
  Q4kPair q;
  kquant_sm(ld_u32(b), sc, mn, q.s, q.m);
  q.v[0] = ld_u32(b + 16 + 32 * g + i0);
  q.v[1] = ld_u32(b + 20 + 32 * g + i0);
  return q;
}
__device__ __forceinline__ void q4k_piece(const Q4kPair& q, int h, Piece& p) {
  bytes4(q.v[h] & 0x0F0F0F0Fu, kMagic, p.q);
  bytes4((q.v[h] >> 4) & 0x0F0F0F0Fu, kMagic, p.q + 4);
  p.s[0] = q.s[0];
  p.s[1] = q.s[1];
  p.m[0] = q.m[0];
  p.m[1] = q.m[1];
}

// {d; dmin; scales[12]; qh[32]; qs[128]}: as Q4_K, plus bit j of qh[i] = bit 4 of element
// 32j + i.
template <>
struct Dec<GgmlType::Q5_K> {
  static constexpr int kElems = 256, kBytes = 176, kPieces = 32, kGap = 32;
  static constexpr Form kForm = Form::Affine;
  __device__ static int pos(int s) { return 64 * (s >> 3) + 4 * (s & 7); }
  __device__ static void load(const uint8_t* b, int s, Piece& p) {
    const int g = s >> 3, i0 = 4 * (s & 7);
    uint32_t sc, mn;
    kquant_pair(b + 4, g, sc, mn);
    kquant_sm(ld_u32(b), sc, mn, p.s, p.m);
    const uint32_t qh = ld_u32(b + 16 + i0);
    const uint32_t v = ld_u32(b + 48 + 32 * g + i0);
    bytes4((v & 0x0F0F0F0Fu) | (((qh >> (2 * g)) & 0x01010101u) << 4), kMagic, p.q);
    bytes4(((v >> 4) & 0x0F0F0F0Fu) | (((qh >> (2 * g + 1)) & 0x01010101u) << 4), kMagic, p.q + 4);
  }
};

// {ql[128]; qh[64]; int8 scales[16]; d}: half h, element e < 128: low 4 bits from
// ql[64h + e%64] (nibble e/64), high 2 bits from qh[32h + e%32] >> 2*(e/32);
// w = (d*scales[(128h+e)/16]) * (q-32). Piece s: h = s/16, m = s%16 holds e = 4m..4m+3
// (low nibbles) and e+64 (high nibbles) of ql bytes 64h+4m.., the same 4 qh bytes.
template <>
struct Dec<GgmlType::Q6_K> {
  static constexpr int kElems = 256, kBytes = 210, kPieces = 32, kGap = 64;
  static constexpr Form kForm = Form::Scaled;
  __device__ static int pos(int s) { return 128 * (s >> 4) + 4 * (s & 15); }
  __device__ static void load(const uint8_t* b, int s, Piece& p) {
    const int h = s >> 4, m = s & 15, sh = 2 * (m >> 3);
    const uint32_t ql = ld_u32_a2(b + 64 * h + 4 * m);
    const uint32_t qh = ld_u32_a2(b + 128 + 32 * h + 4 * (m & 7));
    bytes4((ql & 0x0F0F0F0Fu) | (((qh >> sh) & 0x03030303u) << 4), kMagic + 32.f, p.q);
    bytes4(((ql >> 4) & 0x0F0F0F0Fu) | (((qh >> (sh + 4)) & 0x03030303u) << 4), kMagic + 32.f, p.q + 4);
    const float d = f16_at(b + 208);
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192 + 8 * h + (m >> 2));
    p.s[0] = d * (float)sc[0];
    p.s[1] = d * (float)sc[4];
  }
};

// ---- integer readers (matvec.cu's digit path: Q8_0, Q4_K, Q6_K)
//
// The small path multiplies these types' integer weights with x held as exact integer
// DIGITS (matvec.cu: each 32-element block of x is rounded to integers X of at most 23 bits
// on the block's power-of-two grid, X = D0 2^16 + D1 2^8 + D2 with D0 a signed and D1, D2
// unsigned bytes). A lane reads 32 weights of a row per stage as two RUNS of 16 consecutive
// elements (one scale each): q holds each run's bytes as four words of 4 consecutive
// elements, k[j] the run's first element relative to the stage. Per run, w = s*q (+ m for
// Q4_K's minimum): s includes the power of two the bytes carry (Q6_K's bytes are 4(q-32));
// Q4_K's high nibbles are read in place, 16q, and its run sums (digit_sum_q4) take the 16 out.
struct IntRuns {
  uint32_t q[8];  // run 0: q[0..3], run 1: q[4..7]
  float s[2], m[2];
  int k[2];
};

template <GgmlType T>
struct IntDec;  // kSigned: whether the bytes are int8 (else uint8); busy(lane, elems): the lane
                // has weights in a stage of `elems` elements; load(): its two runs

// n words at a 2-byte aligned address: n + 1 aligned loads and funnel shifts.
__device__ __forceinline__ void ld_words_a2(const uint8_t* p, uint32_t* out, int n) {
  const uint8_t* a = reinterpret_cast<const uint8_t*>((uintptr_t)p & ~(uintptr_t)3);
  const int sh = (int)((uintptr_t)p & 2) * 8;
  uint32_t lo = ld_u32(a);
  for (int i = 0; i < n; ++i) {
    const uint32_t hi = ld_u32(a + 4 * i + 4);
    out[i] = (uint32_t)((((uint64_t)hi << 32) | lo) >> sh);
    lo = hi;
  }
}

// Lane l: block l (34 bytes); runs = its two halves, scale d.
template <>
struct IntDec<GgmlType::Q8_0> {
  static constexpr bool kSigned = true;
  __device__ static bool busy(int lane, int elems) { return 32 * lane < elems; }
  __device__ static void load(const uint8_t* stage, int lane, IntRuns& r) {
    const uint8_t* b = stage + 34 * lane;
    ld_words_a2(b + 2, r.q, 8);
    r.s[0] = r.s[1] = f16_at(b);
    r.m[0] = r.m[1] = 0.f;
    r.k[0] = 32 * lane;
    r.k[1] = 32 * lane + 16;
  }
};

// Lane l: block l/8, qs group g = (l/2)%4, half h = l%2: bytes 16 + 32g + 16h .. +15, whose
// low nibbles are elements 64g + 16h .. (sub-block 2g) and high nibbles 64g + 32 + 16h ..
// (sub-block 2g + 1).
template <>
struct IntDec<GgmlType::Q4_K> {
  static constexpr bool kSigned = false;
  __device__ static bool busy(int lane, int elems) { return 256 * (lane >> 3) < elems; }
  __device__ static void load(const uint8_t* stage, int lane, IntRuns& r) {
    const int g = (lane >> 1) & 3, h = lane & 1;
    const uint8_t* b = stage + 144 * (lane >> 3);
    uint32_t sc, mn;
    kquant_pair(b + 4, g, sc, mn);
    kquant_sm(ld_u32(b), sc, mn, r.s, r.m);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const uint32_t v = ld_u32(b + 16 + 32 * g + 16 * h + 4 * i);
      r.q[i] = v & 0x0F0F0F0Fu;
      r.q[4 + i] = v & 0xF0F0F0F0u;  // 16q
    }
    r.k[0] = 256 * (lane >> 3) + 64 * g + 16 * h;
    r.k[1] = r.k[0] + 32;
  }
};

// Lane l: block l/8, half h = (l/4)%2, m = l%4: ql bytes 64h + 16m .. +15 (low nibbles:
// elements 128h + 16m .., high: 128h + 64 + 16m ..) and qh bytes 32h + 16(m%2) .. +15 (bits
// 2(m/2) and 2(m/2) + 4 of each). Byte = ((q << 2) ^ 0x80) as int8 = 4(q - 32).
template <>
struct IntDec<GgmlType::Q6_K> {
  static constexpr bool kSigned = true;
  __device__ static bool busy(int lane, int elems) { return 256 * (lane >> 3) < elems; }
  __device__ static void load(const uint8_t* stage, int lane, IntRuns& r) {
    const int h = (lane >> 2) & 1, m = lane & 3, sh = 2 * (m >> 1);
    const uint8_t* b = stage + 210 * (lane >> 3);
    uint32_t ql[4], qh[4];
    ld_words_a2(b + 64 * h + 16 * m, ql, 4);
    ld_words_a2(b + 128 + 32 * h + 16 * (m & 1), qh, 4);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      r.q[i] = (((ql[i] << 2) & 0x3C3C3C3Cu) | ((qh[i] << (6 - sh)) & 0xC0C0C0C0u)) ^ 0x80808080u;
      r.q[4 + i] = (((ql[i] >> 2) & 0x3C3C3C3Cu) | ((qh[i] << (2 - sh)) & 0xC0C0C0C0u)) ^ 0x80808080u;
    }
    const float d = f16_at(b + 208) * 0.25f;
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192 + 8 * h + m);
    r.s[0] = d * (float)sc[0];
    r.s[1] = d * (float)sc[4];
    r.m[0] = r.m[1] = 0.f;
    r.k[0] = 256 * (lane >> 3) + 128 * h + 16 * m;
    r.k[1] = r.k[0] + 64;
  }
};

// The exact weights of a piece (== ops.dequantize).
template <Form F>
__device__ __forceinline__ void dequant(const Piece& p, float* w) {
#pragma unroll
  for (int e = 0; e < 8; ++e) {
    if constexpr (F == Form::Raw) w[e] = p.q[e];
    else if constexpr (F == Form::Scaled) w[e] = p.s[e >> 2] * p.q[e];
    else w[e] = fmaf(p.s[e >> 2], p.q[e], p.m[e >> 2]);
  }
}

// Calls f(Tag<T>{}) for the runtime type t (a supported type; anything else does nothing).
template <GgmlType T>
struct Tag {
  static constexpr GgmlType value = T;
};
template <class F>
__device__ __forceinline__ void with_type(GgmlType t, F&& f) {
  switch (t) {
    case GgmlType::F32: f(Tag<GgmlType::F32>{}); break;
    case GgmlType::F16: f(Tag<GgmlType::F16>{}); break;
    case GgmlType::BF16: f(Tag<GgmlType::BF16>{}); break;
    case GgmlType::Q8_0: f(Tag<GgmlType::Q8_0>{}); break;
    case GgmlType::Q4_0: f(Tag<GgmlType::Q4_0>{}); break;
    case GgmlType::Q4_1: f(Tag<GgmlType::Q4_1>{}); break;
    case GgmlType::Q5_0: f(Tag<GgmlType::Q5_0>{}); break;
    case GgmlType::Q5_1: f(Tag<GgmlType::Q5_1>{}); break;
    case GgmlType::Q4_K: f(Tag<GgmlType::Q4_K>{}); break;
    case GgmlType::Q5_K: f(Tag<GgmlType::Q5_K>{}); break;
    case GgmlType::Q6_K: f(Tag<GgmlType::Q6_K>{}); break;
    default: break;
  }
}

// Block geometry on both sides (float types: blocks of 8 elements, one piece).
__host__ __device__ constexpr int block_elems(GgmlType t) {
  return t == GgmlType::F32 || t == GgmlType::F16 || t == GgmlType::BF16 ? 8
         : t == GgmlType::Q4_K || t == GgmlType::Q5_K || t == GgmlType::Q6_K ? 256 : 32;
}
__host__ __device__ constexpr int block_bytes(GgmlType t) {
  switch (t) {
    case GgmlType::F32: return 32;
    case GgmlType::F16: case GgmlType::BF16: return 16;
    case GgmlType::Q8_0: return 34;
    case GgmlType::Q4_0: return 18;
    case GgmlType::Q4_1: return 20;
    case GgmlType::Q5_0: return 22;
    case GgmlType::Q5_1: return 24;
    case GgmlType::Q4_K: return 144;
    case GgmlType::Q5_K: return 176;
    case GgmlType::Q6_K: return 210;
    default: return 0;
  }
}

// Host side: whether `type` has a decoder.
inline bool gpu_type_supported(GgmlType t) {
  switch (t) {
    case GgmlType::F32: case GgmlType::F16: case GgmlType::BF16: case GgmlType::Q8_0: case GgmlType::Q4_0:
    case GgmlType::Q4_1: case GgmlType::Q5_0: case GgmlType::Q5_1: case GgmlType::Q4_K: case GgmlType::Q5_K:
    case GgmlType::Q6_K: return true;
    default: return false;
  }
}
// Alignment (bytes) the readers need for the start of each row.
inline int row_align(GgmlType t) {
  switch (t) {
    case GgmlType::Q8_0: case GgmlType::Q4_0: case GgmlType::Q5_0: case GgmlType::Q6_K: return 2;
    case GgmlType::F32: case GgmlType::F16: case GgmlType::BF16: return 16;
    default: return 4;
  }
}

}  // namespace gpu
}  // namespace specd
