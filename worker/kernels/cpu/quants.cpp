// specd/cpu/quants.cpp: the portable scalar reference for every GGUF block format
// (dequantization and row dot products) and the run-time choice of the AVX2 path.
//
// Exactness: every dequantized value is computed exactly in float32, matching
// gguf.quants.dequantize bit for bit. Products like d*q (fp16 d: 11 significant bits;
// q: at most 8) have at most 24 significant bits, so they are exact; the K-quant
// sub-block scale d*sc (11 + 6 bits) times q (4-5 bits) still fits in 24 bits, as does
// Q6_K's (d*sc: 11 + 8 bits) * (q-32: 6 bits). The only rounding is the single add of the
// offset (`+ m`, `- dmin*mn`), which a fused multiply-add performs identically.
#if SPECD_HAVE_X86
#include <cpuid.h>
#endif
#include "cpu/quants.h"

#include <cstdlib>
#include <cstring>

#include "cpu/quants_impl.h"

namespace specd {

bool cpu_supports_avx2_fma_f16c() {
#if SPECD_HAVE_X86
  static const bool ok = [] {
    __builtin_cpu_init();
    // F16C from CPUID (leaf 1, ECX bit 29): older clang (ROCm 5's hipcc) has no "f16c" name
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    const bool f16c = __get_cpuid(1, &eax, &ebx, &ecx, &edx) && (ecx & (1u << 29)) != 0;
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && f16c;
  }();
  return ok;
#else
  return false;
#endif
}

namespace {

constexpr int QK = 32;    // elements per block of the legacy formats

inline float half_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return fp16_to_fp32(h);
}

inline uint32_t u32_at(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// Nibble layout shared by Q4_0/Q4_1/Q5_x: byte j holds element j (low nibble) and
// element j+16 (high nibble).
inline int nib(const uint8_t* qs, int j) { return j < 16 ? (qs[j] & 0xF) : (qs[j - 16] >> 4); }

void block_q8_0(const uint8_t* b, float* y) {  // {d; int8 qs[32]}
  const float d = half_at(b);
  const int8_t* qs = reinterpret_cast<const int8_t*>(b + 2);
  for (int j = 0; j < QK; ++j) y[j] = (float)qs[j] * d;
}

void block_q4_0(const uint8_t* b, float* y) {  // {d; qs[16]}: d*(q-8)
  const float d = half_at(b);
  for (int j = 0; j < QK; ++j) y[j] = d * (float)(nib(b + 2, j) - 8);
}

void block_q4_1(const uint8_t* b, float* y) {  // {d; m; qs[16]}: d*q + m
  const float d = half_at(b), m = half_at(b + 2);
  for (int j = 0; j < QK; ++j) y[j] = d * (float)nib(b + 4, j) + m;
}

void block_q5_0(const uint8_t* b, float* y) {  // {d; qh[4]; qs[16]}: d*(q-16)
  const float d = half_at(b);
  const uint32_t qh = u32_at(b + 2);
  for (int j = 0; j < QK; ++j) {
    const int q = nib(b + 6, j) | (int)(((qh >> j) & 1u) << 4);
    y[j] = d * (float)(q - 16);
  }
}

void block_q5_1(const uint8_t* b, float* y) {  // {d; m; qh[4]; qs[16]}: d*q + m
  const float d = half_at(b), m = half_at(b + 2);
  const uint32_t qh = u32_at(b + 4);
  for (int j = 0; j < QK; ++j) {
    const int q = nib(b + 8, j) | (int)(((qh >> j) & 1u) << 4);
    y[j] = d * (float)q + m;
  }
}

// K-quant 6-bit scales and mins of the 8 sub-blocks, packed in 12 bytes:
//   bytes 0-3:  scale j (bits 0-5), bits 6-7 = bits 4-5 of scale j+4
//   bytes 4-7:  min j   (bits 0-5), bits 6-7 = bits 4-5 of min j+4
//   bytes 8-11: low nibble = bits 0-3 of scale j+4, high nibble = bits 0-3 of min j+4
void kquant_scales(const uint8_t* s, int sc[8], int mn[8]) {
  for (int j = 0; j < 4; ++j) {
    sc[j] = s[j] & 63;
    mn[j] = s[j + 4] & 63;
    sc[j + 4] = (s[j + 8] & 0xF) | ((s[j] >> 6) << 4);
    mn[j + 4] = (s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4);
  }
}

// {d; dmin; scales[12]; qs[128]}: sub-block j (32 elements) = d*sc_j*q - dmin*mn_j, with
// q the low nibbles of qs[32*(j/2) ..] for even j and the high nibbles for odd j.
void block_q4_k(const uint8_t* b, float* y) {
  const float d = half_at(b), dmin = half_at(b + 2);
  int sc[8], mn[8];
  kquant_scales(b + 4, sc, mn);
  const uint8_t* qs = b + 16;
  for (int j = 0; j < 8; ++j) {
    const float dl = d * (float)sc[j], ml = dmin * (float)mn[j];
    const uint8_t* q = qs + 32 * (j / 2);
    const int shift = 4 * (j & 1);
    for (int i = 0; i < 32; ++i) y[32 * j + i] = dl * (float)((q[i] >> shift) & 0xF) - ml;
  }
}

// {d; dmin; scales[12]; qh[32]; qs[128]}: as Q4_K plus bit j of qh[i] as bit 4 of element
// 32*j + i.
void block_q5_k(const uint8_t* b, float* y) {
  const float d = half_at(b), dmin = half_at(b + 2);
  int sc[8], mn[8];
  kquant_scales(b + 4, sc, mn);
  const uint8_t* qh = b + 16;
  const uint8_t* qs = b + 48;
  for (int j = 0; j < 8; ++j) {
    const float dl = d * (float)sc[j], ml = dmin * (float)mn[j];
    const uint8_t* q = qs + 32 * (j / 2);
    const int shift = 4 * (j & 1);
    for (int i = 0; i < 32; ++i) {
      const int v = ((q[i] >> shift) & 0xF) | (((qh[i] >> j) & 1) << 4);
      y[32 * j + i] = dl * (float)v - ml;
    }
  }
}

// {ql[128]; qh[64]; int8 scales[16]; d}: two halves of 128. In half h, element e has
// low 4 bits from ql[64h + e%64] (low nibble if e < 64), high 2 bits from
// qh[32h + e%32] >> 2*(e/32); value d*scales[(128h+e)/16]*(q-32).
void block_q6_k(const uint8_t* b, float* y) {
  const uint8_t* ql = b;
  const uint8_t* qh = b + 128;
  const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
  const float d = half_at(b + 208);
  for (int h = 0; h < 2; ++h) {
    for (int e = 0; e < 128; ++e) {
      const int lo = (ql[64 * h + e % 64] >> (4 * (e / 64))) & 0xF;
      const int hi = (qh[32 * h + e % 32] >> (2 * (e / 32))) & 3;
      const int idx = 128 * h + e;
      y[idx] = (d * (float)sc[idx / 16]) * (float)((lo | (hi << 4)) - 32);
    }
  }
}

using BlockFn = void (*)(const uint8_t*, float*);

BlockFn block_fn(GgmlType t) {
  switch (t) {
    case GgmlType::Q8_0: return block_q8_0;
    case GgmlType::Q4_0: return block_q4_0;
    case GgmlType::Q4_1: return block_q4_1;
    case GgmlType::Q5_0: return block_q5_0;
    case GgmlType::Q5_1: return block_q5_1;
    case GgmlType::Q4_K: return block_q4_k;
    case GgmlType::Q5_K: return block_q5_k;
    case GgmlType::Q6_K: return block_q6_k;
    default: return nullptr;
  }
}

// Checks the type id and the row length; returns the type's traits.
const TypeTraits& check_row(GgmlType type, int64_t n) {
  const TypeTraits& t = type_traits((int32_t)type);  // throws naming the supported types
  row_bytes(type, n);                                 // throws unless n % block == 0
  return t;
}

// Partial sum of one piece of at most 32 products (the scalar accumulation unit: the
// error bound is about (32 + n/32) * 2^-24 * sum|w*x| instead of n * 2^-24).
inline float piece_dot(const float* w, const float* x, int64_t len) {
  float part = 0.0f;
  for (int64_t i = 0; i < len; ++i) part += w[i] * x[i];
  return part;
}

// SPECD_SIMD=scalar forces the portable path (tests of the non-x86 code on x86 hosts).
bool detect_avx2() {
  const char* force = std::getenv("SPECD_SIMD");
  if (force != nullptr && std::strcmp(force, "scalar") == 0) return false;
  return cpu_supports_avx2_fma_f16c();
}

}  // namespace

namespace scalar {

void dequantize_row(GgmlType type, const uint8_t* src, float* dst, int64_t n) {
  switch (type) {
    case GgmlType::F32: std::memcpy(dst, src, (size_t)n * 4); return;
    case GgmlType::F16:
      for (int64_t i = 0; i < n; ++i) dst[i] = half_at(src + 2 * i);
      return;
    case GgmlType::BF16:
      for (int64_t i = 0; i < n; ++i) {
        uint16_t h;
        std::memcpy(&h, src + 2 * i, 2);
        dst[i] = bf16_to_fp32(h);
      }
      return;
    default: break;
  }
  const TypeTraits& t = type_traits((int32_t)type);
  const BlockFn fn = block_fn(type);
  for (int64_t b = 0; b < n / t.block_elems; ++b)
    fn(src + (size_t)b * t.block_bytes, dst + b * t.block_elems);
}

float dot_f32(const float* w, const float* x, int64_t n) {
  float total = 0.0f;
  for (int64_t i0 = 0; i0 < n; i0 += 32) total += piece_dot(w + i0, x + i0, n - i0 < 32 ? n - i0 : 32);
  return total;
}

}  // namespace scalar

void dequantize_row(GgmlType type, const void* src, float* dst, int64_t n) {
  check_row(type, n);
  const auto* p = static_cast<const uint8_t*>(src);
#if SPECD_HAVE_X86
  if (cpu_has_avx2()) return avx2::dequantize_row(type, p, dst, n);
#endif
  scalar::dequantize_row(type, p, dst, n);
}

float dot_row(GgmlType type, const void* row, const float* x, int64_t n) {
#if SPECD_HAVE_X86
  if (cpu_has_avx2()) {
    check_row(type, n);
    float y = 0.0f;
    avx2::dot_rows(type, static_cast<const uint8_t*>(row), 0, 1, x, 1, n, &y, 1);
    return y;
  }
#endif
  return dot_row_scalar(type, row, x, n);
}

// Dequantizes 256 elements at a time (a multiple of every block size) into a stack
// buffer and accumulates them with scalar::dot_f32's 32-element partial sums, so the
// result is the same as dequantize_row followed by scalar::dot_f32 on the whole row.
float dot_row_scalar(GgmlType type, const void* row, const float* x, int64_t n) {
  const TypeTraits& t = check_row(type, n);
  const auto* p = static_cast<const uint8_t*>(row);
  constexpr int64_t kChunk = 256;
  float buf[kChunk];  // [kChunk] dequantized weights
  float total = 0.0f;
  for (int64_t i0 = 0; i0 < n; i0 += kChunk) {
    const int64_t len = n - i0 < kChunk ? n - i0 : kChunk;
    scalar::dequantize_row(type, p + (size_t)(i0 / t.block_elems) * t.block_bytes, buf, len);
    for (int64_t j0 = 0; j0 < len; j0 += 32)
      total += piece_dot(buf + j0, x + i0 + j0, len - j0 < 32 ? len - j0 : 32);
  }
  return total;
}

bool cpu_has_avx2() {
  static const bool has = detect_avx2();
  return has;
}

const char* simd_path() { return cpu_has_avx2() ? "avx2" : "scalar"; }

}  // namespace specd
