// specd/cpu/attention.cpp: causal grouped-query attention of new queries over the KV cache.
// For query token t (absolute position pos0 + t) and head h, with g = h / (n_heads/n_kv_heads):
//   s_j   = scale * q[t,h] . K[j,g]              j = 0 .. pos0 + t   (causal: no later keys)
//   p_j   = exp(s_j - max s) / sum exp(s - max s)
//   out   = sum_j p_j V[j,g]
// Scalar path (the reference; double accumulation): one (token, head) at a time.
// AVX2 path (attention_avx2.cpp; F16C, FMA, vector exp, float32 accumulation): a work unit
// is (token, KV head, chunk of positions) and serves all query heads of that KV head, so
// each K/V row is loaded and converted once per group. Positions are cut into chunks of
// kChunk at FIXED boundaries (multiples of kChunk), and each chunk returns
// (m = max s, l = sum exp(s - m), o = sum exp(s - m) V); a query's chunks combine as
//   out = sum_c e^(m_c - M) o_c / sum_c e^(m_c - M) l_c,   M = max_c m_c   (c ascending, double).
// Batch invariance (needed by lossless speculative decoding): every query's arithmetic then
// depends only on its own position, never on how many tokens share the call (decode,
// prefill chunk or speculative verify) nor on the thread count; so a position's output is
// bit-identical however it is batched. Chunks also give decode (one token) parallelism
// over positions (flash-decoding). Units are dealt round-robin to threads, so the causal
// cost (later tokens see more keys) spreads evenly during prefill and verify.
#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "common/parallel.h"
#include "cpu/ops.h"
#include "cpu/quants.h"

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
bool use_avx2() { return cpu_supports_avx2_fma_f16c(); }  // cpu/quants.cpp

// Positions per chunk of the AVX2 path. Fixed (see the header): changing it changes
// rounding, but never makes results depend on batching or threads.
constexpr int64_t kChunk = 128;

// Scratch reused across calls (grown on demand; attention runs on the calling thread and
// its pool, never re-entered from inside the pool).
struct FastScratch {
  std::vector<float> s;          // [lanes, 4 rows, kChunk] scores
  std::vector<int64_t> first;    // [n_tok + 1] first unit of each token
  std::vector<float> m;          // [n_units, group] chunk maxima
  std::vector<double> l;         // [n_units, group] chunk sums
  std::vector<float> o;          // [n_units, group, hd] un-normalised chunk outputs
};

template <class T>
void grow(std::vector<T>& v, size_t n) {
  if (v.size() < n) v.resize(n);
}

// The AVX2 path (see the header comment). Token t has nc(t) = ceil((pos0 + t + 1) / kChunk)
// chunks; its units are first[t] + g * nc(t) + c.
void attention_fast(const float* q, const KvView& k, const KvView& v, int64_t n_tok, int64_t pos0,
                    int64_t n_heads, int64_t n_kv_heads, int64_t hd, float scale, float* out) {
  static thread_local FastScratch sc;
  const int64_t group = n_heads / n_kv_heads, stride = k.row_stride;
  auto n_chunks = [&](int64_t t) { return (pos0 + t + kChunk) / kChunk; };  // ceil((pos0+t+1)/kChunk)
  grow(sc.first, (size_t)n_tok + 1);
  int64_t* first = sc.first.data();
  first[0] = 0;
  for (int64_t t = 0; t < n_tok; ++t) first[t + 1] = first[t] + n_kv_heads * n_chunks(t);
  const int64_t n_units = first[n_tok];
  const int64_t lanes = std::min<int64_t>(std::max(1, num_threads()), n_units);
  grow(sc.s, (size_t)(lanes * 4 * kChunk));
  grow(sc.m, (size_t)(n_units * group));
  grow(sc.l, (size_t)(n_units * group));
  grow(sc.o, (size_t)(n_units * group * hd));
  float* s_buf = sc.s.data();
  float* m_buf = sc.m.data();
  double* l_buf = sc.l.data();
  float* o_buf = sc.o.data();

  parallel_for(lanes, 1, [&](int64_t l0, int64_t l1) {
    for (int64_t lane = l0; lane < l1; ++lane) {
      float* s = s_buf + lane * 4 * kChunk;
      int64_t t = 0;
      for (int64_t u = lane; u < n_units; u += lanes) {
        while (first[t + 1] <= u) ++t;  // units ascend with the lane's stride
        const int64_t nc = n_chunks(t), g = (u - first[t]) / nc, c = (u - first[t]) % nc;
        const int64_t j0 = c * kChunk, j1 = std::min(j0 + kChunk, pos0 + t + 1);  // causal end
        float* m = m_buf + u * group;
        double* l = l_buf + u * group;
        // A single-chunk query is normalised right here, into `out`: the same arithmetic
        // as the combine below with one chunk (weight e^0 = 1, division in double).
        float* o = nc == 1 ? out + (t * n_heads + g * group) * hd : o_buf + u * group * hd;
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
        if (nc == 1)
          for (int64_t r = 0; r < group; ++r)
            for (int64_t d = 0; d < hd; ++d) o[r * hd + d] = (float)((double)o[r * hd + d] / l[r]);
      }
    }
  });
  // Combine the chunks of each multi-chunk (token, head), in double, c ascending.
  parallel_for(n_tok * n_heads, 4, [&](int64_t i0, int64_t i1) {
    double a[512];  // [hd] (hd <= 512 is checked by the caller)
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t t = i / n_heads, h = i % n_heads, nc = n_chunks(t);
      if (nc == 1) continue;
      const int64_t g = h / group, r = h % group, u0 = first[t] + g * nc;
      float M = -INFINITY;
      for (int64_t c = 0; c < nc; ++c) M = std::max(M, m_buf[(u0 + c) * group + r]);
      double L = 0.0;
      std::fill(a, a + hd, 0.0);
      for (int64_t c = 0; c < nc; ++c) {
        const int64_t u = u0 + c;
        const double w = std::exp((double)m_buf[u * group + r] - M);
        L += w * l_buf[u * group + r];
        const float* o = o_buf + (u * group + r) * hd;
        for (int64_t d = 0; d < hd; ++d) a[d] += w * o[d];
      }
      float* dst = out + (t * n_heads + h) * hd;
      for (int64_t d = 0; d < hd; ++d) dst[d] = (float)(a[d] / L);
    }
  });
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
  if (use_avx2() && hd % 8 == 0 && hd <= 512) {
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
