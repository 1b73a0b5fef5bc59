// specd/cpu/ops.h: the small ops of a transformer layer on the CPU (one .cpp each):
// RMSNorm, RoPE, causal attention over the KV cache, softmax, SwiGLU. Plain, readable
// reference code that is also the test oracle for the GPU backends.
#pragma once
#include <cstdint>
#include "common/types.h"

namespace specd {

// y[r] = x[r] / sqrt(mean(x[r]^2) + eps) * w    x, y: [n_rows, dim] (y may alias x); w: [dim]
void rmsnorm(const float* x, const float* w, float* y, int64_t n_rows, int64_t dim, float eps);

enum class RopeMode : int32_t {
  Normal = 0,  // rotate adjacent pairs (x[2i], x[2i+1])        - llama (GGUF stores Q/K permuted for it)
  Neox = 2,    // rotate halves (x[i], x[i + n_dims/2])          - qwen2, qwen3
};

struct RopeParams {
  int32_t n_dims = 0;        // rotated dims per head (<= head_dim; the rest pass through)
  float freq_base = 10000.f; // theta_i = pos * freq_scale * base^(-2i/n_dims) / factor_i
  float freq_scale = 1.f;    // 1 / linear scaling factor
  RopeMode mode = RopeMode::Normal;
  const float* freq_factors = nullptr;  // optional [n_dims/2] (llama3 `rope_freqs.weight`)
};

// In place. x: [n_tok, n_heads, head_dim]; pos: [n_tok] absolute positions.
// Angles are computed in double then rounded, so every backend agrees to float rounding.
void rope(float* x, const int32_t* pos, int64_t n_tok, int64_t n_heads, int64_t head_dim,
          const RopeParams& p);

// A layer's K or V cache: row p holds position p as [n_kv_heads, head_dim] elements,
// fp16 (uint16) or fp32, `row_stride` elements apart.
struct KvView {
  const void* data = nullptr;
  bool f16 = true;
  int64_t row_stride = 0;  // elements between positions (= n_kv_heads * head_dim)
};

// Causal grouped-query attention for n_tok new queries at positions pos0..pos0+n_tok-1.
// The cache must already hold K and V for positions 0..pos0+n_tok-1.
// q: [n_tok, n_heads, head_dim]; out: [n_tok, n_heads, head_dim];
// query head h reads KV head h / (n_heads / n_kv_heads); scores scaled by `scale`.
void attention(const float* q, const KvView& k, const KvView& v, int64_t n_tok, int64_t pos0,
               int32_t n_heads, int32_t n_kv_heads, int32_t head_dim, float scale, float* out);

// In place, numerically stable (max subtracted). x: [n]
void softmax(float* x, int64_t n);

// out[i] = silu(gate[i]) * up[i]   (silu(g) = g / (1 + exp(-g))); out may alias gate
void swiglu(const float* gate, const float* up, float* out, int64_t n);

}  // namespace specd
