// specd/cpu/attention_avx2.cpp: AVX2/FMA/F16C kernels of the small ops (compiled with
// -mavx2 -mfma -mf16c; only called after a run-time CPU check in attention.cpp,
// softmax.cpp and swiglu.cpp, which hold the scalar references and declare these):
//   - attention of up to 4 query rows sharing one KV head over a range of cache positions
//     (fp16 or fp32 K/V), returning the un-normalised partial result (max, sum, sum p*V),
//   - exp(x - shift) in place with a double sum, softmax, swiglu.
// Plain functions with intrinsics; the helpers and templates have internal linkage, so
// nothing compiled for AVX2 can be merged with code built for the baseline ISA.
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

// exp(x - shift) for 8 floats with x - shift kept exact: the float difference d plus its
// rounding error err (TwoSum, exact), then exp(d + err) = exp(d) * (1 + err) to float
// rounding. Without this, rounding x - shift alone costs up to |x - shift| * 2^-24 of
// relative error, e.g. 4e-6 at a logit gap of 60.
inline __m256 exp_shifted8(__m256 x, __m256 minus_shift) {
  const __m256 d = _mm256_add_ps(x, minus_shift);
  const __m256 bb = _mm256_sub_ps(d, x);
  __m256 err = _mm256_add_ps(_mm256_sub_ps(x, _mm256_sub_ps(d, bb)), _mm256_sub_ps(minus_shift, bb));
  // Only where exp(d) is a normal finite number (elsewhere err may be NaN: -inf - -inf).
  const __m256 ok = _mm256_and_ps(_mm256_cmp_ps(d, _mm256_set1_ps(-87.0f), _CMP_GT_OQ),
                                  _mm256_cmp_ps(d, _mm256_set1_ps(88.0f), _CMP_LT_OQ));
  err = _mm256_and_ps(err, ok);
  const __m256 e = exp8(d);
  return _mm256_fmadd_ps(e, err, e);
}

inline __m256d widen_sum(__m256d acc, __m256 v) {
  acc = _mm256_add_pd(acc, _mm256_cvtps_pd(_mm256_castps256_ps128(v)));
  return _mm256_add_pd(acc, _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1)));
}

inline double hsum4d(__m256d v) {
  __m128d s = _mm_add_pd(_mm256_castpd256_pd128(v), _mm256_extractf128_pd(v, 1));
  return _mm_cvtsd_f64(_mm_add_sd(s, _mm_unpackhi_pd(s, s)));
}

// The 4 horizontal sums of a0..a3 as one __m128 (lane r = sum of ar).
inline __m128 hsum8x4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
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

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// s[r*n + j] = scale * q_r . K_j for R query rows (q_r = q + r*hd), j < n, K_j = k + j*stride.
// Each K row is loaded (and converted) once for all R rows.
template <int R, class T>
void scores(const float* q, const T* k, int64_t stride, int64_t n, int64_t hd, float scale,
            float* s) {
  const __m128 vscale = _mm_set1_ps(scale);
  for (int64_t j = 0; j < n; ++j) {
    const T* kj = k + j * stride;
    __m256 a[4][2];
    for (int r = 0; r < 4; ++r) a[r][0] = a[r][1] = _mm256_setzero_ps();
    int64_t d = 0;
    for (; d + 16 <= hd; d += 16) {
      const __m256 k0 = load8(kj + d), k1 = load8(kj + d + 8);
      for (int r = 0; r < R; ++r) {
        a[r][0] = _mm256_fmadd_ps(load8(q + r * hd + d), k0, a[r][0]);
        a[r][1] = _mm256_fmadd_ps(load8(q + r * hd + d + 8), k1, a[r][1]);
      }
    }
    if (d < hd) {
      const __m256 k0 = load8(kj + d);
      for (int r = 0; r < R; ++r) a[r][0] = _mm256_fmadd_ps(load8(q + r * hd + d), k0, a[r][0]);
    }
    float out[4];
    _mm_storeu_ps(out, _mm_mul_ps(hsum8x4(_mm256_add_ps(a[0][0], a[0][1]), _mm256_add_ps(a[1][0], a[1][1]),
                                          _mm256_add_ps(a[2][0], a[2][1]), _mm256_add_ps(a[3][0], a[3][1])),
                                  vscale));
    for (int r = 0; r < R; ++r) s[r * n + j] = out[r];
  }
}

// o[r*hd + d] = sum_j p[r*n + j] * V_j[d] for R rows, dims d in [d0, d0 + 8*NB): R*NB
// accumulators stay in registers over all positions; each V block is converted once.
template <int R, int NB, class T>
void weighted_block(const float* p, const T* v, int64_t stride, int64_t n, int64_t hd, int64_t d0,
                    float* o) {
  __m256 a[R][NB];
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < NB; ++b) a[r][b] = _mm256_setzero_ps();
  for (int64_t j = 0; j < n; ++j) {
    const T* vj = v + j * stride + d0;
    __m256 pr[R];
    for (int r = 0; r < R; ++r) pr[r] = _mm256_broadcast_ss(p + r * n + j);
    for (int b = 0; b < NB; ++b) {
      const __m256 vb = load8(vj + 8 * b);
      for (int r = 0; r < R; ++r) a[r][b] = _mm256_fmadd_ps(pr[r], vb, a[r][b]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < NB; ++b) _mm256_storeu_ps(o + r * hd + d0 + 8 * b, a[r][b]);
}

// Block widths that fit the 16 ymm registers: R*NB accumulators + R broadcasts + 1 load.
template <int R, class T>
void weighted(const float* p, const T* v, int64_t stride, int64_t n, int64_t hd, float* o) {
  constexpr int NB = R == 1 ? 8 : R == 4 ? 2 : 4;
  int64_t d0 = 0;
  for (; d0 + 8 * NB <= hd; d0 += 8 * NB) weighted_block<R, NB>(p, v, stride, n, hd, d0, o);
  for (; d0 < hd; d0 += 8) weighted_block<R, 1>(p, v, stride, n, hd, d0, o);
}

double exp_shift_sum_impl(float* x, int64_t n, float shift) {
  const __m256 msh = _mm256_set1_ps(-shift);
  __m256d acc = _mm256_setzero_pd();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 e = exp_shifted8(_mm256_loadu_ps(x + i), msh);
    _mm256_storeu_ps(x + i, e);
    acc = widen_sum(acc, e);
  }
  if (i < n) {  // tail through the same vector code on a padded copy: same rounding
    float tmp[8];
    for (int j = 0; j < 8; ++j) tmp[j] = i + j < n ? x[i + j] : -__builtin_inff();
    const __m256 e = exp_shifted8(_mm256_loadu_ps(tmp), msh);
    _mm256_storeu_ps(tmp, e);
    acc = widen_sum(acc, e);  // padding lanes are exp(-inf) = 0
    for (int j = 0; i + j < n; ++j) x[i + j] = tmp[j];
  }
  return hsum4d(acc);
}

template <int R, class T>
void rows(const float* q, const T* k, const T* v, int64_t stride, int64_t n, int64_t hd,
          float scale, float* s, float* m, double* l, float* o) {
  scores<R>(q, k, stride, n, hd, scale, s);
  for (int r = 0; r < R; ++r) {
    m[r] = max_of(s + r * n, n);
    l[r] = exp_shift_sum_impl(s + r * n, n, m[r]);
  }
  weighted<R>(s, v, stride, n, hd, o);
}

template <class T>
void rows_any(const float* q, int32_t R, const T* k, const T* v, int64_t stride, int64_t n,
              int64_t hd, float scale, float* s, float* m, double* l, float* o) {
  switch (R) {
    case 1: rows<1>(q, k, v, stride, n, hd, scale, s, m, l, o); break;
    case 2: rows<2>(q, k, v, stride, n, hd, scale, s, m, l, o); break;
    case 3: rows<3>(q, k, v, stride, n, hd, scale, s, m, l, o); break;
    default: rows<4>(q, k, v, stride, n, hd, scale, s, m, l, o); break;
  }
}

}  // namespace

// x[i] = exp(x[i] - shift) for i < n; returns the sum in double.
double exp_shift_sum(float* x, int64_t n, float shift) { return exp_shift_sum_impl(x, n, shift); }

// In-place softmax: max subtracted (no overflow), sum in double.
void softmax(float* x, int64_t n) {
  const float mx = max_of(x, n);
  const double sum = exp_shift_sum_impl(x, n, mx);
  const __m256 inv = _mm256_set1_ps((float)(1.0 / sum));
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(x + i, _mm256_mul_ps(_mm256_loadu_ps(x + i), inv));
  for (; i < n; ++i) x[i] *= (float)(1.0 / sum);
}

// out[i] = gate[i] / (1 + exp(-gate[i])) * up[i]   (out may alias gate)
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

// Partial attention of R (1..4) query rows that share one KV head, over n > 0 cache
// positions (see attention.cpp):
//   q: [R, hd]; K_j = k + j*stride, V_j likewise (j < n); hd % 8 == 0; s: scratch [R, n]
//   m[r] = max_j s_rj,  l[r] = sum_j exp(s_rj - m[r]) (double),  o: [R, hd] = sum_j exp(s_rj - m[r]) V_j
void attention_rows_f16(const float* q, int32_t R, const uint16_t* k, const uint16_t* v,
                        int64_t stride, int64_t n, int64_t hd, float scale, float* s, float* m,
                        double* l, float* o) {
  rows_any(q, R, k, v, stride, n, hd, scale, s, m, l, o);
}
void attention_rows_f32(const float* q, int32_t R, const float* k, const float* v, int64_t stride,
                        int64_t n, int64_t hd, float scale, float* s, float* m, double* l, float* o) {
  rows_any(q, R, k, v, stride, n, hd, scale, s, m, l, o);
}

}  // namespace avx2
}  // namespace specd
