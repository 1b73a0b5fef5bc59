// specd/cpu/attention_avx2.cpp: AVX2/FMA/F16C kernels of the small ops (compiled with
// -mavx2 -mfma -mf16c; only called after a run-time CPU check in attention.cpp,
// softmax.cpp and swiglu.cpp, which hold the scalar references and declare these).
//   - one attention head over n cache positions (fp16 or fp32 K/V),
//   - exp(x - shift) in place with a double sum (softmax and attention weights),
//   - swiglu.
// Plain functions with intrinsics only (no STL): this file's code must not be merged
// with code compiled for the baseline ISA.
#include <immintrin.h>
#include <cstdint>

namespace specd {
namespace avx2 {

namespace {

// exp(x) for 8 floats, max relative error about 2 ulp (tests compare with float64).
//   x = n*ln2 + r, n = round(x/ln2), |r| <= ln2/2; ln2 split in a short high part (n*hi is
//   exact) and a low correction (Cody-Waite). exp(r) by its Taylor series to r^7:
//   truncation error (ln2/2)^8/8! ~ 5e-9 < 2^-24. Then 2^n is built in the exponent field.
//   x < -87.336 (exp(x) < FLT_MIN) gives 0, x > 88.376 gives +inf (saturated, the true
//   value there is within 1.5x of FLT_MAX); NaN stays NaN.
inline __m256 exp8(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.3365447505531f), hi = _mm256_set1_ps(88.3762626647949f);
  const __m256 xc = _mm256_min_ps(_mm256_max_ps(x, lo), hi);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(xc, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), xc);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.f / 5040.f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 720.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 120.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 24.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 6.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  // 2^n for n in [-126, 128]; n = 128 gives the all-ones exponent = +inf times p: +inf.
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  __m256 y = _mm256_mul_ps(p, _mm256_castsi256_ps(e));
  y = _mm256_blendv_ps(y, _mm256_setzero_ps(), _mm256_cmp_ps(x, lo, _CMP_LT_OQ));
  y = _mm256_blendv_ps(y, _mm256_set1_ps(__builtin_inff()), _mm256_cmp_ps(x, hi, _CMP_GT_OQ));
  return _mm256_blendv_ps(y, x, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
}

inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline __m256d widen_sum(__m256d acc, __m256 v) {
  acc = _mm256_add_pd(acc, _mm256_cvtps_pd(_mm256_castps256_ps128(v)));
  return _mm256_add_pd(acc, _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1)));
}

inline double hsum4d(__m256d v) {
  __m128d s = _mm_add_pd(_mm256_castpd256_pd128(v), _mm256_extractf128_pd(v, 1));
  return _mm_cvtsd_f64(_mm_add_sd(s, _mm_unpackhi_pd(s, s)));
}

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// s[j] = scale * q . K_j for j < n; K_j = k + j*stride, hd a multiple of 8.
template <class T>
inline void scores(const float* q, const T* k, int64_t stride, int64_t n, int64_t hd, float scale,
                   float* s) {
  for (int64_t j = 0; j < n; ++j) {
    const T* kj = k + j * stride;
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    int64_t d = 0;
    for (; d + 16 <= hd; d += 16) {
      a0 = _mm256_fmadd_ps(load8(q + d), load8(kj + d), a0);
      a1 = _mm256_fmadd_ps(load8(q + d + 8), load8(kj + d + 8), a1);
    }
    if (d < hd) a0 = _mm256_fmadd_ps(load8(q + d), load8(kj + d), a0);
    s[j] = hsum8(_mm256_add_ps(a0, a1)) * scale;
  }
}

// out[d] = inv * sum_j p[j] * V_j[d]. Blocks of 64 dims keep 8 accumulators in registers
// over all positions; a remainder (hd % 64, a multiple of 8) goes 8 dims at a time.
template <class T>
inline void weighted_sum(const float* p, const T* v, int64_t stride, int64_t n, int64_t hd, float inv,
                         float* out) {
  int64_t d0 = 0;
  const __m256 vinv = _mm256_set1_ps(inv);
  for (; d0 + 64 <= hd; d0 += 64) {
    __m256 a[8];
    for (int i = 0; i < 8; ++i) a[i] = _mm256_setzero_ps();
    for (int64_t j = 0; j < n; ++j) {
      const __m256 pj = _mm256_set1_ps(p[j]);
      const T* vj = v + j * stride + d0;
      for (int i = 0; i < 8; ++i) a[i] = _mm256_fmadd_ps(pj, load8(vj + 8 * i), a[i]);
    }
    for (int i = 0; i < 8; ++i) _mm256_storeu_ps(out + d0 + 8 * i, _mm256_mul_ps(a[i], vinv));
  }
  for (; d0 < hd; d0 += 8) {
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    int64_t j = 0;
    for (; j + 2 <= n; j += 2) {
      a0 = _mm256_fmadd_ps(_mm256_set1_ps(p[j]), load8(v + j * stride + d0), a0);
      a1 = _mm256_fmadd_ps(_mm256_set1_ps(p[j + 1]), load8(v + (j + 1) * stride + d0), a1);
    }
    if (j < n) a0 = _mm256_fmadd_ps(_mm256_set1_ps(p[j]), load8(v + j * stride + d0), a0);
    _mm256_storeu_ps(out + d0, _mm256_mul_ps(_mm256_add_ps(a0, a1), vinv));
  }
}

inline float max_of(const float* x, int64_t n) {
  __m256 m = _mm256_set1_ps(-__builtin_inff());
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(x + i));
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  h = _mm_max_ss(h, _mm_movehdup_ps(h));
  float r = _mm_cvtss_f32(h);
  for (; i < n; ++i) r = x[i] > r ? x[i] : r;
  return r;
}

}  // namespace

// x[i] = exp(x[i] - shift) for i < n; returns the sum in double. The tail (n % 8) goes
// through the same vector exp on a padded copy, so every element gets the same rounding.
double exp_shift_sum(float* x, int64_t n, float shift) {
  const __m256 sh = _mm256_set1_ps(shift);
  __m256d acc = _mm256_setzero_pd();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(x + i), sh));
    _mm256_storeu_ps(x + i, e);
    acc = widen_sum(acc, e);
  }
  if (i < n) {
    float tmp[8];
    for (int j = 0; j < 8; ++j) tmp[j] = i + j < n ? x[i + j] - shift : -__builtin_inff();
    const __m256 e = exp8(_mm256_loadu_ps(tmp));
    _mm256_storeu_ps(tmp, e);
    acc = widen_sum(acc, e);  // padding lanes are exp(-inf) = 0
    for (int j = 0; i + j < n; ++j) x[i + j] = tmp[j];
  }
  return hsum4d(acc);
}

// In-place softmax: max subtracted (no overflow), sum in double.
void softmax(float* x, int64_t n) {
  const float mx = max_of(x, n);
  const double sum = exp_shift_sum(x, n, mx);
  const __m256 inv = _mm256_set1_ps((float)(1.0 / sum));
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(x + i, _mm256_mul_ps(_mm256_loadu_ps(x + i), inv));
  for (; i < n; ++i) x[i] *= (float)(1.0 / sum);
}

// out[i] = gate[i] / (1 + exp(-gate[i])) * up[i]
void swiglu(const float* gate, const float* up, float* out, int64_t n) {
  const __m256 one = _mm256_set1_ps(1.f), zero = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 g = _mm256_loadu_ps(gate + i);
    const __m256 e = exp8(_mm256_sub_ps(zero, g));
    _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(one, e)), _mm256_loadu_ps(up + i)));
  }
  if (i < n) {
    float g[8] = {0}, u[8] = {0}, o[8];
    for (int j = 0; i + j < n; ++j) g[j] = gate[i + j], u[j] = up[i + j];
    const __m256 gv = _mm256_loadu_ps(g);
    const __m256 e = exp8(_mm256_sub_ps(zero, gv));
    _mm256_storeu_ps(o, _mm256_mul_ps(_mm256_div_ps(gv, _mm256_add_ps(one, e)), _mm256_loadu_ps(u)));
    for (int j = 0; i + j < n; ++j) out[i + j] = o[j];
  }
}

namespace {
template <class T>
inline void head(const float* q, const T* k, const T* v, int64_t stride, int64_t n, int64_t hd,
                 float scale, float* s, float* out) {
  scores(q, k, stride, n, hd, scale, s);
  const float mx = max_of(s, n);
  const double sum = exp_shift_sum(s, n, mx);  // >= 1: the max term is exp(0)
  weighted_sum(s, v, stride, n, hd, (float)(1.0 / sum), out);
}
}  // namespace

// One query head against cache positions 0..n-1 of its KV head (see attention.cpp):
// q, out: [hd]; K_j = k + j*stride (likewise V); s: scratch [n]; hd % 8 == 0.
void attention_head_f16(const float* q, const uint16_t* k, const uint16_t* v, int64_t stride,
                        int64_t n, int64_t hd, float scale, float* s, float* out) {
  head(q, k, v, stride, n, hd, scale, s, out);
}
void attention_head_f32(const float* q, const float* k, const float* v, int64_t stride, int64_t n,
                        int64_t hd, float scale, float* s, float* out) {
  head(q, k, v, stride, n, hd, scale, s, out);
}

}  // namespace avx2
}  // namespace specd
