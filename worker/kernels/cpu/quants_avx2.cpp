// specd/cpu/quants_avx2.cpp: AVX2/FMA/F16C decoders of every GGUF block format, and the
// two kernels built on them: dequantize_row and the batch-1 (decode) row dots.
// Compiled with -mavx2 -mfma -mf16c; called only after the run-time CPU check in
// quants.cpp / matmul.cpp. No STL here (this file's flags differ from the others');
// the templates below live in an anonymous namespace, so they never merge with others.
//
// A decoder turns one "unit" of a block into kVecs vectors of 8 exactly dequantized
// floats (element order); a block is kUnits units. Dequantization is exact (see
// quants.cpp), so these values equal the scalar reference and gguf bit for bit; the
// offset is applied with one fma, which rounds like the reference's single add.
#include <immintrin.h>

#include <cstring>

#include "cpu/quants_impl.h"

namespace specd {
namespace avx2 {
namespace {

// 8 bytes at p, zero- or sign-extended to 8 int32 lanes.
inline __m256i u8x8(const uint8_t* p) {
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}
inline __m256i i8x8(const uint8_t* p) {
  return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}
inline float half_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}
// fp16 at p, converted and broadcast to 8 lanes (load, vcvtph2ps xmm, vbroadcastss).
inline __m256 half_bcast(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _mm256_broadcastss_ps(_mm_cvtph_ps(_mm_cvtsi32_si128(h)));
}
// Two adjacent fp16 {d, m} at p, each broadcast to 8 lanes: one 32-bit load and one
// conversion to [d m 0 0], then a broadcast and a lane permute.
inline void half_pair_bcast(const uint8_t* p, __m256& d, __m256& m) {
  int32_t dm;
  std::memcpy(&dm, p, 4);
  const __m128 v = _mm_cvtph_ps(_mm_cvtsi32_si128(dm));
  d = _mm256_broadcastss_ps(v);
  m = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(v), _mm256_set1_epi32(1));
}
inline __m256 cvt(__m256i v) { return _mm256_cvtepi32_ps(v); }
inline __m256i lo4(__m256i v) { return _mm256_and_si256(v, _mm256_set1_epi32(0xF)); }
inline __m256i hi4(__m256i v) { return _mm256_srli_epi32(v, 4); }  // v holds one byte

// v << k for k >= 0, v >> -k otherwise (k is a constant once the unit loop is unrolled).
inline __m256i shift_left(__m256i v, int k) {
  return k >= 0 ? _mm256_slli_epi32(v, k) : _mm256_srli_epi32(v, -k);
}

struct NoPrep {};

// ---- float types: a "block" is 8 elements; rows of any length (scalar tail) ----
struct DecF32 {
  static constexpr int kElems = 8, kBytes = 32, kUnits = 1, kVecs = 1, kRows = 8;
  using Prep = NoPrep;
  static void prep(const uint8_t*, Prep&) {}
  static void unit(const uint8_t* b, const Prep&, int, __m256* w) {
    w[0] = _mm256_loadu_ps(reinterpret_cast<const float*>(b));
  }
  static float one(const uint8_t* p, int64_t i) {
    float f;
    std::memcpy(&f, p + 4 * i, 4);
    return f;
  }
};

struct DecF16 {
  static constexpr int kElems = 8, kBytes = 16, kUnits = 1, kVecs = 1, kRows = 8;
  using Prep = NoPrep;
  static void prep(const uint8_t*, Prep&) {}
  static void unit(const uint8_t* b, const Prep&, int, __m256* w) {
    w[0] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b)));
  }
  static float one(const uint8_t* p, int64_t i) { return half_at(p + 2 * i); }
};

struct DecBF16 {  // bf16 = the high 16 bits of a float32
  static constexpr int kElems = 8, kBytes = 16, kUnits = 1, kVecs = 1, kRows = 8;
  using Prep = NoPrep;
  static void prep(const uint8_t*, Prep&) {}
  static void unit(const uint8_t* b, const Prep&, int, __m256* w) {
    const __m256i h = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b)));
    w[0] = _mm256_castsi256_ps(_mm256_slli_epi32(h, 16));
  }
  static float one(const uint8_t* p, int64_t i) {
    uint32_t bits = 0;
    std::memcpy(reinterpret_cast<uint8_t*>(&bits) + 2, p + 2 * i, 2);
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
  }
};

// ---- 32-element blocks. Nibble layout: byte j = element j (low) | element j+16 (high) ----
struct DecQ8_0 {  // {d; int8 qs[32]}: d*q
  static constexpr int kElems = 32, kBytes = 34, kUnits = 1, kVecs = 4, kRows = 8;
  using Prep = NoPrep;
  static void prep(const uint8_t*, Prep&) {}
  static void unit(const uint8_t* b, const Prep&, int, __m256* w) {
    const __m256 d = half_bcast(b);
    for (int i = 0; i < 4; ++i) w[i] = _mm256_mul_ps(cvt(i8x8(b + 2 + 8 * i)), d);
  }
};

struct DecQ4_0 {  // {d; qs[16]}: d*(q-8) (integer subtract, so q = 8 gives -0 for d < 0, as gguf)
  static constexpr int kElems = 32, kBytes = 18, kUnits = 1, kVecs = 4, kRows = 8;
  using Prep = NoPrep;
  static void prep(const uint8_t*, Prep&) {}
  static void unit(const uint8_t* b, const Prep&, int, __m256* w) {
    const __m256 d = half_bcast(b);
    const __m256i a = u8x8(b + 2), c = u8x8(b + 10), k8 = _mm256_set1_epi32(8);
    w[0] = _mm256_mul_ps(cvt(_mm256_sub_epi32(lo4(a), k8)), d);
    w[1] = _mm256_mul_ps(cvt(_mm256_sub_epi32(lo4(c), k8)), d);
    w[2] = _mm256_mul_ps(cvt(_mm256_sub_epi32(hi4(a), k8)), d);
    w[3] = _mm256_mul_ps(cvt(_mm256_sub_epi32(hi4(c), k8)), d);
  }
};

struct DecQ4_1 {  // {d; m; qs[16]}: d*q + m
  static constexpr int kElems = 32, kBytes = 20, kUnits = 1, kVecs = 4, kRows = 8;
  using Prep = NoPrep;
  static void prep(const uint8_t*, Prep&) {}
  static void unit(const uint8_t* b, const Prep&, int, __m256* w) {
    __m256 d, m;
    half_pair_bcast(b, d, m);
    const __m256i a = u8x8(b + 4), c = u8x8(b + 12);
    w[0] = _mm256_fmadd_ps(cvt(lo4(a)), d, m);
    w[1] = _mm256_fmadd_ps(cvt(lo4(c)), d, m);
    w[2] = _mm256_fmadd_ps(cvt(hi4(a)), d, m);
    w[3] = _mm256_fmadd_ps(cvt(hi4(c)), d, m);
  }
};

// Bit 4 of the Q5 elements: element j's bit is bit j of the 32-bit qh, i.e. bit j%8 of
// byte j/8. kQ5High.v[byte] holds, for the 8 elements of one qh byte, 8 bytes of 0 or 16,
// so one table load + zero-extension gives the high bits of 8 elements (2 KiB, in L1).
struct Q5HighTable {
  uint64_t v[256];
  constexpr Q5HighTable() : v() {
    for (int b = 0; b < 256; ++b)
      for (int i = 0; i < 8; ++i)
        if ((b >> i) & 1) v[b] |= (uint64_t)16 << (8 * i);
  }
};
constexpr Q5HighTable kQ5High{};

inline void q5_values(const uint8_t* qs, const uint8_t* qh, __m256i q[4]) {
  __m256i h[4];
  for (int v = 0; v < 4; ++v) h[v] = u8x8(reinterpret_cast<const uint8_t*>(&kQ5High.v[qh[v]]));
  const __m256i a = u8x8(qs), c = u8x8(qs + 8);
  q[0] = _mm256_or_si256(lo4(a), h[0]);
  q[1] = _mm256_or_si256(lo4(c), h[1]);
  q[2] = _mm256_or_si256(hi4(a), h[2]);
  q[3] = _mm256_or_si256(hi4(c), h[3]);
}

struct DecQ5_0 {  // {d; qh[4]; qs[16]}: d*(q-16)
  static constexpr int kElems = 32, kBytes = 22, kUnits = 1, kVecs = 4, kRows = 8;
  using Prep = NoPrep;
  static void prep(const uint8_t*, Prep&) {}
  static void unit(const uint8_t* b, const Prep&, int, __m256* w) {
    const __m256 d = half_bcast(b);
    __m256i q[4];
    q5_values(b + 6, b + 2, q);
    const __m256i k16 = _mm256_set1_epi32(16);
    for (int i = 0; i < 4; ++i) w[i] = _mm256_mul_ps(cvt(_mm256_sub_epi32(q[i], k16)), d);
  }
};

struct DecQ5_1 {  // {d; m; qh[4]; qs[16]}: d*q + m
  static constexpr int kElems = 32, kBytes = 24, kUnits = 1, kVecs = 4, kRows = 8;
  using Prep = NoPrep;
  static void prep(const uint8_t*, Prep&) {}
  static void unit(const uint8_t* b, const Prep&, int, __m256* w) {
    __m256 d, m;
    half_pair_bcast(b, d, m);
    __m256i q[4];
    q5_values(b + 8, b + 4, q);
    for (int i = 0; i < 4; ++i) w[i] = _mm256_fmadd_ps(cvt(q[i]), d, m);
  }
};

// ---- K-quants (256-element super-blocks) ----
// Per-block scales: sub-block j value = q * sc[j] + mn[j], sc = d*scale_j and
// mn = -(dmin*min_j), both exact products (11-bit fp16 x 6-bit integer).
struct KScales {
  alignas(32) float sc[8];
  alignas(32) float mn[8];
};

// Unpacks the 12-byte 6-bit scales/mins (layout: kquant_scales in quants.cpp) four at a
// time as 32-bit words, one byte per sub-block, then converts 8 at once.
inline void kquant_prep(const uint8_t* b, KScales& p) {  // b -> {d; dmin; scales[12]; ...}
  uint32_t s[3];
  std::memcpy(s, b + 4, 12);
  const uint32_t lo6 = 0x3f3f3f3fu, lo4 = 0x0f0f0f0fu, lo2 = 0x03030303u;
  const uint32_t sc03 = s[0] & lo6, mn03 = s[1] & lo6;
  const uint32_t sc47 = (s[2] & lo4) | (((s[0] >> 6) & lo2) << 4);   // + bits 4-5 from bytes 0-3
  const uint32_t mn47 = ((s[2] >> 4) & lo4) | (((s[1] >> 6) & lo2) << 4);  // + from bytes 4-7
  const __m256i sc = _mm256_cvtepu8_epi32(_mm_set_epi32(0, 0, (int)sc47, (int)sc03));
  const __m256i mn = _mm256_cvtepu8_epi32(_mm_set_epi32(0, 0, (int)mn47, (int)mn03));
  _mm256_store_ps(p.sc, _mm256_mul_ps(cvt(sc), _mm256_set1_ps(half_at(b))));
  _mm256_store_ps(p.mn, _mm256_mul_ps(cvt(mn), _mm256_set1_ps(-half_at(b + 2))));
}

struct DecQ4_K {  // {d; dmin; scales[12]; qs[128]}; unit u = sub-blocks 2u (low) and 2u+1 (high)
  static constexpr int kElems = 256, kBytes = 144, kUnits = 4, kVecs = 8, kRows = 4;
  using Prep = KScales;
  static void prep(const uint8_t* b, Prep& p) { kquant_prep(b, p); }
  static void unit(const uint8_t* b, const Prep& p, int u, __m256* w) {
    const uint8_t* qs = b + 16 + 32 * u;
    const __m256 s0 = _mm256_set1_ps(p.sc[2 * u]), m0 = _mm256_set1_ps(p.mn[2 * u]);
    const __m256 s1 = _mm256_set1_ps(p.sc[2 * u + 1]), m1 = _mm256_set1_ps(p.mn[2 * u + 1]);
    for (int i = 0; i < 4; ++i) {
      const __m256i v = u8x8(qs + 8 * i);
      w[i] = _mm256_fmadd_ps(cvt(lo4(v)), s0, m0);
      w[4 + i] = _mm256_fmadd_ps(cvt(hi4(v)), s1, m1);
    }
  }
};

struct DecQ5_K {  // {d; dmin; scales[12]; qh[32]; qs[128]}; bit j of qh[i] = bit 4 of element 32j+i
  static constexpr int kElems = 256, kBytes = 176, kUnits = 4, kVecs = 8, kRows = 4;
  using Prep = KScales;
  static void prep(const uint8_t* b, Prep& p) { kquant_prep(b, p); }
  static void unit(const uint8_t* b, const Prep& p, int u, __m256* w) {
    const uint8_t* qh = b + 16;
    const uint8_t* qs = b + 48 + 32 * u;
    const __m256 s0 = _mm256_set1_ps(p.sc[2 * u]), m0 = _mm256_set1_ps(p.mn[2 * u]);
    const __m256 s1 = _mm256_set1_ps(p.sc[2 * u + 1]), m1 = _mm256_set1_ps(p.mn[2 * u + 1]);
    const __m256i b16 = _mm256_set1_epi32(16);
    for (int i = 0; i < 4; ++i) {
      const __m256i v = u8x8(qs + 8 * i), h = u8x8(qh + 8 * i);
      const __m256i h0 = _mm256_and_si256(shift_left(h, 4 - 2 * u), b16);  // bit 2u   -> bit 4
      const __m256i h1 = _mm256_and_si256(shift_left(h, 3 - 2 * u), b16);  // bit 2u+1 -> bit 4
      w[i] = _mm256_fmadd_ps(cvt(_mm256_or_si256(lo4(v), h0)), s0, m0);
      w[4 + i] = _mm256_fmadd_ps(cvt(_mm256_or_si256(hi4(v), h1)), s1, m1);
    }
  }
};

// {ql[128]; qh[64]; int8 scales[16]; d}. Unit u (32 elements) = half h = u/4, quarter
// k = u%4 of it: low 4 bits from ql[64h + 32(k&1) + i] >> 4*(k/2), high 2 bits from
// qh[32h + i] >> 2k; sub-blocks of 16 -> scales 8h+2k (i < 16) and 8h+2k+1.
// value = s*(q-32), exact (s = d*scale has <= 19 bits, |q-32| <= 32).
struct DecQ6_K {
  static constexpr int kElems = 256, kBytes = 210, kUnits = 8, kVecs = 4, kRows = 4;
  struct Prep {
    alignas(32) float s[16];  // d*scale of the 16 sub-blocks
  };
  static void prep(const uint8_t* b, Prep& p) {
    const __m256 d = half_bcast(b + 208);
    _mm256_store_ps(p.s, _mm256_mul_ps(cvt(i8x8(b + 192)), d));
    _mm256_store_ps(p.s + 8, _mm256_mul_ps(cvt(i8x8(b + 200)), d));
  }
  static void unit(const uint8_t* b, const Prep& p, int u, __m256* w) {
    const int h = u >> 2, k = u & 3;
    const uint8_t* ql = b + 64 * h + 32 * (k & 1);
    const uint8_t* qh = b + 128 + 32 * h;
    const int sub = 8 * h + 2 * k;
    const __m256i m48 = _mm256_set1_epi32(0x30), k32 = _mm256_set1_epi32(32);
    for (int i = 0; i < 4; ++i) {
      const __m256i l = u8x8(ql + 8 * i), h = u8x8(qh + 8 * i);
      const __m256i lo = (k >> 1) ? hi4(l) : lo4(l);
      // bits 2k, 2k+1 of h moved to bits 4, 5
      const __m256i hi = _mm256_and_si256(k == 3 ? _mm256_srli_epi32(h, 2) : _mm256_slli_epi32(h, 4 - 2 * k), m48);
      const __m256i q = _mm256_sub_epi32(_mm256_or_si256(lo, hi), k32);
      w[i] = _mm256_mul_ps(cvt(q), _mm256_set1_ps(p.s[sub + (i >> 1)]));
    }
  }
};

// Calls f(Decoder{}) for the decoder of `type` (the caller validated the type).
template <class F>
void with_decoder(GgmlType type, F&& f) {
  switch (type) {
    case GgmlType::F32: f(DecF32{}); return;
    case GgmlType::F16: f(DecF16{}); return;
    case GgmlType::BF16: f(DecBF16{}); return;
    case GgmlType::Q8_0: f(DecQ8_0{}); return;
    case GgmlType::Q4_0: f(DecQ4_0{}); return;
    case GgmlType::Q4_1: f(DecQ4_1{}); return;
    case GgmlType::Q5_0: f(DecQ5_0{}); return;
    case GgmlType::Q5_1: f(DecQ5_1{}); return;
    case GgmlType::Q4_K: f(DecQ4_K{}); return;
    case GgmlType::Q5_K: f(DecQ5_K{}); return;
    case GgmlType::Q6_K: f(DecQ6_K{}); return;
  }
}

template <class D>
void dequantize_t(const uint8_t* src, float* dst, int64_t n) {
  const int64_t nb = n / D::kElems;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = src + b * D::kBytes;
    typename D::Prep p;
    D::prep(blk, p);
    for (int u = 0; u < D::kUnits; ++u) {
      __m256 v[D::kVecs];
      D::unit(blk, p, u, v);
      for (int i = 0; i < D::kVecs; ++i)
        _mm256_storeu_ps(dst + b * D::kElems + (u * D::kVecs + i) * 8, v[i]);
    }
  }
  if constexpr (D::kElems == 8)  // float types: scalar tail
    for (int64_t i = nb * 8; i < n; ++i) dst[i] = D::one(src, i);
}

// y[a*ldy + r] = row r . x_a for R weight rows and M activation rows (x_a = x + a*n) at
// once. The R*M fma chains (one accumulator per pair) are independent, which hides the fma
// latency (a lone chain would wait 4 cycles per fma), and every decoded weight vector is
// used M times from registers: a small batch (speculative verify) pays the decode once.
// Per (r, a) pair the arithmetic is exactly the batch-invariant sequence of
// quants_impl.h (one 8-lane chain in k order, finish_dot).
template <class D, int R, int M>
void dot_rows_t(const uint8_t* w, size_t stride, const float* x, int64_t n, float* y, int64_t ldy,
                size_t ahead) {
  const int64_t nb = n / D::kElems;
  __m256 acc[R][M];
  for (int r = 0; r < R; ++r)
    for (int a = 0; a < M; ++a) acc[r][a] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const float* xb = x + b * D::kElems;
    // Software prefetch `ahead` bytes down each row, one per 64 bytes of advance: the
    // rows are consumed too slowly (decode work per byte) for the hardware prefetcher,
    // which stops at 4 KiB pages, to keep DRAM busy on its own (2-3x on 30 MB weights).
    // Non-temporal: weights are read once per token; measured 5-15% faster than T1.
    if ((b * D::kBytes) % 64 < D::kBytes)
      for (int r = 0; r < R; ++r)
        for (int off = 0; off < D::kBytes; off += 64)
          _mm_prefetch(reinterpret_cast<const char*>(w + r * stride + b * D::kBytes + ahead + off), _MM_HINT_NTA);
    typename D::Prep p[R];
#pragma GCC unroll 8
    for (int u = 0; u < D::kUnits; ++u) {
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const uint8_t* blk = w + r * stride + b * D::kBytes;
        if (u == 0) D::prep(blk, p[r]);
        __m256 v[D::kVecs];
        D::unit(blk, p[r], u, v);
#pragma GCC unroll 8
        for (int i = 0; i < D::kVecs; ++i)
#pragma GCC unroll 8
          for (int a = 0; a < M; ++a)
            acc[r][a] = _mm256_fmadd_ps(v[i], _mm256_loadu_ps(xb + a * n + (u * D::kVecs + i) * 8), acc[r][a]);
      }
    }
  }
  const int64_t done = nb * D::kElems;
  for (int r = 0; r < R; ++r) {
    float tail[8];  // [n - done < 8] tail weights (float types only)
    int64_t nt = 0;
    if constexpr (D::kElems == 8)
      for (; done + nt < n; ++nt) tail[nt] = D::one(w + r * stride, done + nt);
    for (int a = 0; a < M; ++a) y[a * ldy + r] = finish_dot(acc[r][a], tail, x + a * n + done, nt);
  }
}

// Weight rows per call for M activation rows: about 8 accumulators (of the 16 ymm
// registers), fewer for the K-quants whose units hold 8 decoded vectors.
template <class D, int M>
constexpr int rows_per_call() {
  if (M == 1) return D::kRows;
  constexpr int r = M == 2 ? 4 : M <= 4 ? 2 : 1;
  return D::kVecs > 4 && r > 1 ? r / 2 : r;
}

template <class D, int M>
void dot_rows_m(const uint8_t* w, size_t stride, int64_t n_rows, const float* x, int64_t n, float* y,
                int64_t ldy) {
  // Prefetch distance: 8 rows (one 8-row group) ahead, at least 4 KiB (~400 ns of
  // decode work per core, a few DRAM latencies). 4-32 KiB measured alike; 0 is ~2x slower.
  const size_t ahead = 8 * stride < 4096 ? 4096 : 8 * stride;
  constexpr int R = rows_per_call<D, M>();
  int64_t r = 0;
  for (; r + R <= n_rows; r += R) dot_rows_t<D, R, M>(w + r * stride, stride, x, n, y + r, ldy, ahead);
  if constexpr (R > 4)
    for (; r + 4 <= n_rows; r += 4) dot_rows_t<D, 4, M>(w + r * stride, stride, x, n, y + r, ldy, ahead);
  if constexpr (R > 1)
    for (; r < n_rows; ++r) dot_rows_t<D, 1, M>(w + r * stride, stride, x, n, y + r, ldy, ahead);
}

}  // namespace

void dequantize_row(GgmlType type, const uint8_t* src, float* dst, int64_t n) {
  with_decoder(type, [&](auto dec) { dequantize_t<decltype(dec)>(src, dst, n); });
}

void dot_rows(GgmlType type, const uint8_t* w, size_t stride, int64_t n_rows, const float* x, int64_t m,
              int64_t n, float* y, int64_t ldy) {
  with_decoder(type, [&](auto dec) {
    using D = decltype(dec);
    switch (m) {
      case 1: return dot_rows_m<D, 1>(w, stride, n_rows, x, n, y, ldy);
      case 2: return dot_rows_m<D, 2>(w, stride, n_rows, x, n, y, ldy);
      case 3: return dot_rows_m<D, 3>(w, stride, n_rows, x, n, y, ldy);
      case 4: return dot_rows_m<D, 4>(w, stride, n_rows, x, n, y, ldy);
      default: return dot_rows_m<D, 5>(w, stride, n_rows, x, n, y, ldy);  // m <= kMaxFusedRows
    }
  });
}

}  // namespace avx2
}  // namespace specd
