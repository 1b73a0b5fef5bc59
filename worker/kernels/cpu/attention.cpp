// specd/cpu/attention.cpp: causal grouped-query attention of new queries over the KV cache.
// For query token t (absolute position pos0 + t) and head h, with g = h / (n_heads/n_kv_heads):
//   s_j   = scale * q[t,h] . K[j,g]              j = 0 .. pos0 + t   (causal: no later keys)
//   p_j   = exp(s_j - max s) / sum exp(s - max s)
//   out   = sum_j p_j V[j,g]
// Scalar path (the reference; double accumulation): one (token, head) at a time.
// AVX2 path (attention_avx2.cpp; F16C, FMA, vector exp, float32 accumulation): a work unit
// is (token, KV head, chunk of positions) and serves all query heads of that KV head, so
// each K/V row is loaded and converted once per group. At decode, few tokens x KV heads
// would leave threads idle, so positions are split into chunks (flash-decoding): each
// chunk returns (m = max s, l = sum exp(s - m), o = sum exp(s - m) V) and chunks combine as
//   out = sum_c e^(m_c - M) o_c / sum_c e^(m_c - M) l_c,   M = max_c m_c.
// Units (and scalar items) are dealt round-robin to threads, so the causal cost (later
// tokens see more keys) spreads evenly during prefill and speculative verify.
#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "common/parallel.h"
#include "cpu/ops.h"

namespace specd {

#if SPECD_HAVE_X86
namespace avx2 {  // defined in attention_avx2.cpp
// R (1..4) query rows sharing one KV head over n > 0 positions; q, o: [R, hd]; s: scratch
// [R, n]; K_j = k + j*stride; hd % 8 == 0. Writes m[r], l[r] and un-normalised o rows.
void attention_rows_f16(const float* q, int32_t R, const uint16_t* k, const uint16_t* v,
                        int64_t stride, int64_t n, int64_t hd, float scale, float* s, float* m,
                        double* l, float* o);
void attention_rows_f32(const float* q, int32_t R, const float* k, const float* v, int64_t stride,
                        int64_t n, int64_t hd, float scale, float* s, float* m, double* l, float* o);
}  // namespace avx2
#endif

namespace {

inline float load(const float* p) { return *p; }
inline float load(const uint16_t* p) { return fp16_to_fp32(*p); }

// Reference for one (token, head): q, out: [hd]; K_j = k + j*stride, j < n;
// s: scratch [n] (scores, then weights); acc: scratch [hd].
template <class T>
void head_scalar(const float* q, const T* k, const T* v, int64_t stride, int64_t n, int64_t hd,
                 float scale, float* s, double* acc, float* out) {
  float mx = -INFINITY;
  for (int64_t j = 0; j < n; ++j) {
    const T* kj = k + j * stride;
    double dot = 0.0;
    for (int64_t d = 0; d < hd; ++d) dot += (double)q[d] * load(kj + d);
    s[j] = (float)(dot * scale);
    mx = std::max(mx, s[j]);
  }
  double sum = 0.0;
  for (int64_t j = 0; j < n; ++j) {
    s[j] = (float)std::exp((double)s[j] - mx);
    sum += s[j];
  }
  std::fill(acc, acc + hd, 0.0);
  for (int64_t j = 0; j < n; ++j) {
    const T* vj = v + j * stride;
    const double pj = s[j];
    for (int64_t d = 0; d < hd; ++d) acc[d] += pj * load(vj + d);
  }
  for (int64_t d = 0; d < hd; ++d) out[d] = (float)(acc[d] / sum);
}

#if SPECD_HAVE_X86
bool use_avx2() {
  static const bool ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                         __builtin_cpu_supports("f16c");
  return ok;
}

// The AVX2 path (see the header comment). Units u = (t * n_kv_heads + g) * n_chunks + c.
void attention_fast(const float* q, const KvView& k, const KvView& v, int64_t n_tok, int64_t pos0,
                    int64_t n_heads, int64_t n_kv_heads, int64_t hd, float scale, float* out) {
  const int64_t group = n_heads / n_kv_heads, stride = k.row_stride;
  const int64_t n_ctx = pos0 + n_tok;
  const int64_t nt = std::max(1, num_threads());
  // Split positions only when tokens x KV heads give fewer than ~8 units per thread, and
  // keep chunks >= 256 positions so the split and the combine stay cheap.
  int64_t n_chunks = 1;
  if (n_tok * n_kv_heads < 8 * nt)
    n_chunks = std::min((8 * nt + n_tok * n_kv_heads - 1) / (n_tok * n_kv_heads),
                        std::max<int64_t>(1, n_ctx / 256));
  const int64_t chunk = (n_ctx + n_chunks - 1) / n_chunks;
  n_chunks = (n_ctx + chunk - 1) / chunk;
  const int64_t n_units = n_tok * n_kv_heads * n_chunks;
  const int64_t lanes = std::min(nt, n_units);
  const bool split = n_chunks > 1;

  std::vector<float> s_buf((size_t)(lanes * 4 * chunk));  // [lanes, 4 rows, chunk] scores
  // Partial results per unit and query head of its group; without a split, o is written
  // straight into `out` and m, l live in small per-lane arrays.
  std::vector<float> m_buf((size_t)(split ? n_units * group : lanes * group));   // [., group]
  std::vector<double> l_buf(m_buf.size());                                        // [., group]
  std::vector<float> o_buf((size_t)(split ? n_units * group * hd : 0));          // [n_units, group, hd]

  parallel_for(lanes, 1, [&](int64_t l0, int64_t l1) {
    for (int64_t lane = l0; lane < l1; ++lane) {
      float* s = s_buf.data() + lane * 4 * chunk;
      for (int64_t u = lane; u < n_units; u += lanes) {
        const int64_t c = u % n_chunks, g = (u / n_chunks) % n_kv_heads, t = u / n_chunks / n_kv_heads;
        const int64_t j0 = c * chunk, j1 = std::min(j0 + chunk, pos0 + t + 1);  // causal end
        const int64_t slot = split ? u : lane;
        float* m = m_buf.data() + slot * group;
        double* l = l_buf.data() + slot * group;
        float* o = split ? o_buf.data() + u * group * hd : out + (t * n_heads + g * group) * hd;
        if (j0 >= j1) {  // chunk entirely after this token's position: contributes nothing
          std::fill(m, m + group, -INFINITY);
          std::fill(l, l + group, 0.0);
          continue;
        }
        const float* qg = q + (t * n_heads + g * group) * hd;
        for (int64_t r0 = 0; r0 < group; r0 += 4) {
          const int32_t R = (int32_t)std::min<int64_t>(4, group - r0);
          const int64_t off = j0 * stride + g * hd;
          if (k.f16)
            avx2::attention_rows_f16(qg + r0 * hd, R, static_cast<const uint16_t*>(k.data) + off,
                                     static_cast<const uint16_t*>(v.data) + off, stride, j1 - j0, hd,
                                     scale, s, m + r0, l + r0, o + r0 * hd);
          else
            avx2::attention_rows_f32(qg + r0 * hd, R, static_cast<const float*>(k.data) + off,
                                     static_cast<const float*>(v.data) + off, stride, j1 - j0, hd,
                                     scale, s, m + r0, l + r0, o + r0 * hd);
        }
        if (!split)
          for (int64_t r = 0; r < group; ++r) {
            const float inv = (float)(1.0 / l[r]);
            for (int64_t d = 0; d < hd; ++d) o[r * hd + d] *= inv;
          }
      }
    }
  });
  if (!split) return;
  // Combine the chunks of each (token, head), in double.
  std::vector<double> a((size_t)hd);  // [hd]
  for (int64_t t = 0; t < n_tok; ++t)
    for (int64_t h = 0; h < n_heads; ++h) {
      const int64_t g = h / group, r = h % group, u0 = (t * n_kv_heads + g) * n_chunks;
      float M = -INFINITY;
      for (int64_t c = 0; c < n_chunks; ++c) M = std::max(M, m_buf[(u0 + c) * group + r]);
      double L = 0.0;
      std::fill(a.begin(), a.end(), 0.0);
      for (int64_t c = 0; c < n_chunks; ++c) {
        const int64_t u = u0 + c;
        if (l_buf[u * group + r] == 0.0) continue;  // empty chunk
        const double w = std::exp((double)m_buf[u * group + r] - M);
        L += w * l_buf[u * group + r];
        const float* o = o_buf.data() + (u * group + r) * hd;
        for (int64_t d = 0; d < hd; ++d) a[d] += w * o[d];
      }
      float* dst = out + (t * n_heads + h) * hd;
      for (int64_t d = 0; d < hd; ++d) dst[d] = (float)(a[d] / L);
    }
}
#endif

}  // namespace

void attention(const float* q, const KvView& k, const KvView& v, int64_t n_tok, int64_t pos0,
               int32_t n_heads, int32_t n_kv_heads, int32_t head_dim, float scale, float* out) {
  if (n_heads <= 0 || n_kv_heads <= 0 || head_dim <= 0 || n_heads % n_kv_heads != 0)
    throw Error("attention: n_heads (" + std::to_string(n_heads) +
                ") must be a positive multiple of n_kv_heads (" + std::to_string(n_kv_heads) +
                ") and head_dim (" + std::to_string(head_dim) + ") positive");
  if (n_tok < 0 || pos0 < 0)
    throw Error("attention: n_tok and pos0 must be >= 0, got " + std::to_string(n_tok) + ", " +
                std::to_string(pos0));
  if (k.f16 != v.f16 || k.row_stride != v.row_stride ||
      k.row_stride < (int64_t)n_kv_heads * head_dim)
    throw Error("attention: K and V caches must share one element type and a row stride >= "
                "n_kv_heads * head_dim");
  if (n_tok == 0) return;

  const int64_t hd = head_dim, stride = k.row_stride, group = n_heads / n_kv_heads;
#if SPECD_HAVE_X86
  if (use_avx2() && hd % 8 == 0) {
    attention_fast(q, k, v, n_tok, pos0, n_heads, n_kv_heads, hd, scale, out);
    return;
  }
#endif
  const int64_t n_items = n_tok * n_heads;      // (token, head) pairs, token-major
  const int64_t n_ctx = pos0 + n_tok;           // longest causal window
  const int64_t lanes = std::min<int64_t>(std::max(1, num_threads()), n_items);
  std::vector<float> s_buf((size_t)(lanes * n_ctx));   // [lanes, n_ctx]
  std::vector<double> acc_buf((size_t)(lanes * hd));   // [lanes, hd]

  parallel_for(lanes, 1, [&](int64_t l0, int64_t l1) {
    for (int64_t lane = l0; lane < l1; ++lane) {
      float* s = s_buf.data() + lane * n_ctx;
      double* acc = acc_buf.data() + lane * hd;
      for (int64_t item = lane; item < n_items; item += lanes) {
        const int64_t t = item / n_heads, h = item % n_heads;
        const int64_t n = pos0 + t + 1;                // keys 0 .. pos0+t
        const int64_t off = (h / group) * hd;          // KV head's offset within a row
        const float* qh = q + item * hd;
        float* oh = out + item * hd;
        if (k.f16)
          head_scalar(qh, static_cast<const uint16_t*>(k.data) + off,
                      static_cast<const uint16_t*>(v.data) + off, stride, n, hd, scale, s, acc, oh);
        else
          head_scalar(qh, static_cast<const float*>(k.data) + off,
                      static_cast<const float*>(v.data) + off, stride, n, hd, scale, s, acc, oh);
      }
    }
  });
}

}  // namespace specd
