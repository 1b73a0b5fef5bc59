// specd/cpu/attention.cpp: causal grouped-query attention of new queries over the KV cache.
// For query token t (absolute position pos0 + t) and head h, with g = h / (n_heads/n_kv_heads):
//   s_j   = scale * q[t,h] . K[j,g]              j = 0 .. pos0 + t   (causal: no later keys)
//   p_j   = exp(s_j - max s) / sum exp(s - max s)
//   out   = sum_j p_j V[j,g]
// Work items are (token, head) pairs dealt round-robin to the threads, so the causal cost
// (later tokens see more keys) spreads evenly during prefill / speculative verify.
// The scalar path accumulates in double and is the reference; attention_avx2.cpp holds the
// fast path (F16C conversion, FMA dot products, vector exp; float32 accumulation).
#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "common/parallel.h"
#include "cpu/ops.h"

namespace specd {

#if SPECD_HAVE_X86
namespace avx2 {  // defined in attention_avx2.cpp; q, out: [hd]; s: scratch [n]; hd % 8 == 0
void attention_head_f16(const float* q, const uint16_t* k, const uint16_t* v, int64_t stride,
                        int64_t n, int64_t hd, float scale, float* s, float* out);
void attention_head_f32(const float* q, const float* k, const float* v, int64_t stride, int64_t n,
                        int64_t hd, float scale, float* s, float* out);
}  // namespace avx2
#endif

namespace {

bool use_avx2() {
#if SPECD_HAVE_X86
  static const bool ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                         __builtin_cpu_supports("f16c");
  return ok;
#else
  return false;
#endif
}

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
  const int64_t n_items = n_tok * n_heads;      // (token, head) pairs, token-major
  const int64_t n_ctx = pos0 + n_tok;           // longest causal window
  const int64_t lanes = std::min<int64_t>(std::max(1, num_threads()), n_items);
  const bool fast = use_avx2() && hd % 8 == 0;
  std::vector<float> s_buf((size_t)(lanes * n_ctx));                 // [lanes, n_ctx]
  std::vector<double> acc_buf(fast ? 0 : (size_t)(lanes * hd));     // [lanes, hd]

  parallel_for(lanes, 1, [&](int64_t l0, int64_t l1) {
    for (int64_t lane = l0; lane < l1; ++lane) {
      float* s = s_buf.data() + lane * n_ctx;
      for (int64_t item = lane; item < n_items; item += lanes) {
        const int64_t t = item / n_heads, h = item % n_heads;
        const int64_t n = pos0 + t + 1;                // keys 0 .. pos0+t
        const int64_t off = (h / group) * hd;          // KV head's offset within a row
        const float* qh = q + item * hd;
        float* oh = out + item * hd;
        if (k.f16) {
          const uint16_t* kp = static_cast<const uint16_t*>(k.data) + off;
          const uint16_t* vp = static_cast<const uint16_t*>(v.data) + off;
#if SPECD_HAVE_X86
          if (fast) { avx2::attention_head_f16(qh, kp, vp, stride, n, hd, scale, s, oh); continue; }
#endif
          head_scalar(qh, kp, vp, stride, n, hd, scale, s, acc_buf.data() + lane * hd, oh);
        } else {
          const float* kp = static_cast<const float*>(k.data) + off;
          const float* vp = static_cast<const float*>(v.data) + off;
#if SPECD_HAVE_X86
          if (fast) { avx2::attention_head_f32(qh, kp, vp, stride, n, hd, scale, s, oh); continue; }
#endif
          head_scalar(qh, kp, vp, stride, n, hd, scale, s, acc_buf.data() + lane * hd, oh);
        }
      }
    }
  });
}

}  // namespace specd
