// specd/cpu/quants_impl.h: private interface between the quantized-format code
// (quants.cpp, quants_avx2.cpp) and the matrix multiply (matmul.cpp, matmul_avx2.cpp).
// Not part of the engine API; include only from cpu/quants*.cpp and cpu/matmul*.cpp.
//
// Batch invariance: every dot product of one stored row with one activation row is
// computed by the same sequence of float32 operations whatever the call (dot_row,
// matmul with m = 1, matmul with m > 1, any tile position, any thread count):
//   acc[8]  = 0;  for each 8-element chunk c in k order: acc = fma(w_c, x_c, acc)
//   s       = hsum8(acc) (fixed pairwise order);  for each tail element: s = fma(w, x, s)
// where w are the exactly dequantized weights (dequantization is exact in float32, see
// quants.cpp). So y[i] depends only on x[i] and W: a speculative verify (m = k+1) gives
// bit-identical logits to k+1 separate decodes, and prefill matches decode.
#pragma once
#include <cstddef>
#include <cstdint>

#include "common/types.h"

namespace specd {

// Portable scalar reference (quants.cpp); also the non-x86 path.
namespace scalar {
// dst[0..n) = row values; n a multiple of the block size (checked by the caller).
void dequantize_row(GgmlType type, const uint8_t* src, float* dst, int64_t n);
// sum_k w[k] * x[k] over float32 values: 32-element partial sums added in order.
float dot_f32(const float* w, const float* x, int64_t n);
}  // namespace scalar

#if SPECD_HAVE_X86
// AVX2 + FMA + F16C paths (quants_avx2.cpp, matmul_avx2.cpp). Call only when
// cpu_has_avx2() is true.
namespace avx2 {
void dequantize_row(GgmlType type, const uint8_t* src, float* dst, int64_t n);
// Largest activation batch dot_rows takes. Up to 5 (a verify of 4 drafted tokens), one
// decode serving all rows beats dequantizing a panel (m = 2: 1.1x a decode vs 1.6x;
// m = 5: 2.0x vs 2.3x); from 6 on the panel path is as fast and spills no registers.
constexpr int64_t kMaxFusedRows = 5;
// y[a * ldy + r] = row r . x_a for r in [0, n_rows), a in [0, m), 1 <= m <= kMaxFusedRows:
// weight rows `stride` bytes apart decoded in registers, activations x [m, n] contiguous.
// Interleaves several weight rows so the fma chains overlap; each decoded weight vector
// serves all m activation rows (decode m = 1, and small speculative-verify batches).
void dot_rows(GgmlType type, const uint8_t* w, size_t stride, int64_t n_rows, const float* x, int64_t m,
              int64_t n, float* y, int64_t ldy);
// y[a * ldy + r] = w_r . x_a for a in [0, m), r in [0, n_rows): float32 weight rows w
// ([n_rows, n], rows ldw floats apart) times activations x ([m, n], rows ldx apart).
// Register tiles of 3 activation rows x 4 weight rows (the m > kMaxFusedRows path).
void gemm_f32(const float* w, int64_t ldw, int64_t n_rows, const float* x, int64_t ldx, int64_t m,
              int64_t n, float* y, int64_t ldy);
}  // namespace avx2
#endif

}  // namespace specd

// ---- shared AVX2 reduction: visible only to the files compiled with -mavx2 -mfma ----
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

namespace specd {
namespace avx2 {

// The one horizontal sum every AVX2 dot uses (fixed order: lanes i and i+4, then
// i and i+2, then 0 and 1), followed by the scalar tail (float types only have one).
static inline float finish_dot(__m256 acc, const float* w_tail, const float* x_tail, int64_t n_tail) {
  __m128 v = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  v = _mm_add_ps(v, _mm_movehl_ps(v, v));
  v = _mm_add_ss(v, _mm_movehdup_ps(v));
  float s = _mm_cvtss_f32(v);
  for (int64_t i = 0; i < n_tail; ++i) s = __builtin_fmaf(w_tail[i], x_tail[i], s);
  return s;
}

}  // namespace avx2
}  // namespace specd
#endif
