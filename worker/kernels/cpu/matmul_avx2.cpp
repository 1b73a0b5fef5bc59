// specd/cpu/matmul_avx2.cpp: the AVX2/FMA register-tiled kernel of the m > 1 matmul
// (prefill, speculative verify): float32 weight rows (already dequantized) times several
// activation rows. Compiled with -mavx2 -mfma -mf16c, called only after the run-time CPU
// check in matmul.cpp. No STL (see quants_avx2.cpp); templates are file-local.
#include <immintrin.h>

#include "cpu/quants_impl.h"

namespace specd {
namespace avx2 {
namespace {

// y[a*ldy + r] = w_r . x_a for a < RA activation rows and r < RW weight rows.
// RA*RW accumulators (<= 12) + RA x vectors + 1 w vector fit the 16 ymm registers;
// per 8-element chunk: RA + RW loads feed RA*RW fmas. Each (a, r) pair is one fma
// chain in k order finished by finish_dot: the batch-invariant sequence of
// quants_impl.h, bit-identical to the m = 1 path.
template <int RA, int RW>
void tile(const float* w, int64_t ldw, const float* x, int64_t ldx, int64_t n, float* y, int64_t ldy) {
  __m256 acc[RA][RW];
  for (int a = 0; a < RA; ++a)
    for (int r = 0; r < RW; ++r) acc[a][r] = _mm256_setzero_ps();
  const int64_t n8 = n / 8 * 8;
  for (int64_t k = 0; k < n8; k += 8) {
    __m256 xv[RA];
    for (int a = 0; a < RA; ++a) xv[a] = _mm256_loadu_ps(x + a * ldx + k);
    for (int r = 0; r < RW; ++r) {
      const __m256 wv = _mm256_loadu_ps(w + r * ldw + k);
      for (int a = 0; a < RA; ++a) acc[a][r] = _mm256_fmadd_ps(wv, xv[a], acc[a][r]);
    }
  }
  for (int a = 0; a < RA; ++a)
    for (int r = 0; r < RW; ++r)
      y[a * ldy + r] = finish_dot(acc[a][r], w + r * ldw + n8, x + a * ldx + n8, n - n8);
}

template <int RA>
void tile_rows(int rw, const float* w, int64_t ldw, const float* x, int64_t ldx, int64_t n, float* y,
               int64_t ldy) {
  switch (rw) {
    case 4: tile<RA, 4>(w, ldw, x, ldx, n, y, ldy); return;
    case 3: tile<RA, 3>(w, ldw, x, ldx, n, y, ldy); return;
    case 2: tile<RA, 2>(w, ldw, x, ldx, n, y, ldy); return;
    default: tile<RA, 1>(w, ldw, x, ldx, n, y, ldy); return;
  }
}

}  // namespace

// Weight sub-panel (4 rows) outermost: it stays in L1 while all m activation rows stream
// past it from L2, 3 at a time.
void gemm_f32(const float* w, int64_t ldw, int64_t n_rows, const float* x, int64_t ldx, int64_t m,
              int64_t n, float* y, int64_t ldy) {
  for (int64_t r0 = 0; r0 < n_rows; r0 += 4) {
    const int rw = n_rows - r0 < 4 ? (int)(n_rows - r0) : 4;
    const float* wr = w + r0 * ldw;
    int64_t a0 = 0;
    for (; a0 + 3 <= m; a0 += 3) tile_rows<3>(rw, wr, ldw, x + a0 * ldx, ldx, n, y + a0 * ldy + r0, ldy);
    if (m - a0 == 2) tile_rows<2>(rw, wr, ldw, x + a0 * ldx, ldx, n, y + a0 * ldy + r0, ldy);
    if (m - a0 == 1) tile_rows<1>(rw, wr, ldw, x + a0 * ldx, ldx, n, y + a0 * ldy + r0, ldy);
  }
}

}  // namespace avx2
}  // namespace specd
