// specd/cuda/linear_params.cuh: what the three kernels of linear() (matvec.cu, matvec_tc.cu,
// matmul.cu) share: their parameter block and how their CTAs cover the call's weights.
// Internal to those files; linear.cuh is the interface.
#pragma once
#include <cstdint>

#include "cuda/linear.cuh"

namespace specd {
namespace gpu {

// One weight of a launch, as the kernels read it.
struct LinWeight {
  const uint8_t* data = nullptr;
  size_t stride = 0;
  int64_t n_out = 0;
  GgmlType type = GgmlType::F32;
  const float* bias = nullptr;   // [n_out] or null
  int64_t col = 0;               // first column of y (Store)
  int32_t cta0 = 0;              // first CTA (along the weights' grid dimension) of this weight
};

template <class W>
struct LinParamsOf {
  W w[3];
  int32_t n_w = 1;
  Epilogue ep = Epilogue::Store;
  const float* x = nullptr;       // [n, K]
  const float* norm_w = nullptr;  // [K] or null (fused RMSNorm: small paths only)
  float eps = 0.f;
  float* y = nullptr;             // [n, ldy]
  int64_t ldy = 0, n = 0, K = 0;
};
using LinParams = LinParamsOf<LinWeight>;

// CTAs covering the call's weights with `rows` weight rows per CTA: each weight on its own
// (Store, Accumulate), or gate and up rows together (SwiGLU: rows / 2 outputs per CTA).
inline int64_t cta_count(const LinearArgs& a, int64_t rows) {
  if (a.ep == Epilogue::SwiGLU) return ceil_div(a.w[0]->n_out, rows / 2);
  int64_t c = 0;
  for (int j = 0; j < a.n_w; ++j) c += ceil_div(a.w[j]->n_out, rows);
  return c;
}

// Copies the call into p (the LinWeight part of each weight, and each weight's cta0 for
// `rows` weight rows per CTA) and returns the number of CTAs.
template <class P>
int64_t fill_params(P& p, const LinearArgs& a, int64_t rows) {
  p.n_w = a.n_w;
  p.ep = a.ep;
  p.x = a.x;
  p.norm_w = a.norm_w;
  p.eps = a.eps;
  p.y = a.y;
  p.ldy = a.ldy;
  p.n = a.n;
  p.K = a.w[0]->n_in;
  int64_t ctas = 0, col = 0;
  for (int j = 0; j < a.n_w; ++j) {
    const GpuWeight& w = *a.w[j];
    LinWeight& m = p.w[j];
    m.data = w.data;
    m.stride = w.row_stride;
    m.n_out = w.n_out;
    m.type = w.type;
    m.bias = a.bias[j];
    m.col = col;
    col += w.n_out;
    m.cta0 = (int32_t)ctas;
    if (a.ep != Epilogue::SwiGLU) ctas += ceil_div(w.n_out, rows);
  }
  return cta_count(a, rows);
}

}  // namespace gpu
}  // namespace specd
