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
  // direct readers (matvec_direct.cuh) only: the slow blocks' move (blocks [n_cb - move_n,
  // n_cb) are taken at loop positions [move_at, move_at + move_n); 0: none)
  int32_t move_n = 0, move_at = 0;
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

// ---- the CUDA-core small-path kernels (matvec.cu, matvec_kq.cu): a CTA of `warps` groups,
// each owning RPG weight rows of a CTA-sized block cb of the call's rows.

// Group `warp`'s rows in block cb: weight j0 and output o_first (Store / Accumulate: rows
// o_first + rr of weight j0; SwiGLU (RPG even): outputs o_first + j, j < RPG/2, as gate row
// rr = 2j of weight 0 and up row 2j + 1 of weight 1); row rr's bytes start at src[rr]
// (rows past a weight's end are clamped to its last row; their results are dropped).
template <int RPG, class P>
__device__ __forceinline__ void group_rows(const P& p, int cb, int warp, int warps, int& j0, int64_t& o_first,
                                           const uint8_t* (&src)[RPG]) {
  const bool swiglu = p.ep == Epilogue::SwiGLU;
  j0 = 0;
  if (swiglu) {
    o_first = ((int64_t)cb * warps + warp) * (RPG / 2);
  } else {
    if (p.n_w > 1 && cb >= p.w[1].cta0) j0 = 1;
    if (p.n_w > 2 && cb >= p.w[2].cta0) j0 = 2;
    o_first = (int64_t)(cb - p.w[j0].cta0) * warps * RPG + (int64_t)warp * RPG;
  }
#pragma unroll
  for (int rr = 0; rr < RPG; ++rr) {
    const auto& w = p.w[swiglu ? (rr & 1) : j0];
    const int64_t o = min(swiglu ? o_first + rr / 2 : o_first + rr, w.n_out - 1);
    src[rr] = w.data + (size_t)o * w.stride;
  }
}

// The epilogue of one value of a Store / Accumulate: output o of weight w (its bias, its
// column) into the row yr of y.
template <class W>
__device__ __forceinline__ void store_value(Epilogue ep, const W& w, float* yr, int64_t o, float v) {
  if (w.bias) v += w.bias[o];
  if (ep == Epilogue::Accumulate) yr[w.col + o] += v;
  else yr[w.col + o] = v;
}

// The epilogue of one SwiGLU output o: silu(g + gate bias) (u + up bias) into the row yr.
template <class P>
__device__ __forceinline__ void store_swiglu(const P& p, float* yr, int64_t o, float g, float u) {
  if (p.w[0].bias) g += p.w[0].bias[o];
  if (p.w[1].bias) u += p.w[1].bias[o];
  yr[o] = g / (1.f + __expf(-g)) * u;
}

// The group's results (acc: reduced over the group, times the norm factor) into y for the
// tile's rows row0 .. row0 + NR - 1 (< n), one lane per value, with bias and epilogue.
template <int RPG, int NR, class P>
__device__ __forceinline__ void group_store(const P& p, int lane, int64_t row0, int j0, int64_t o_first,
                                            const float (&acc)[RPG][NR]) {
  const auto& w0 = p.w[j0];
#pragma unroll
  for (int rr = 0; rr < RPG; ++rr)
#pragma unroll
    for (int r = 0; r < NR; ++r) {
      if (lane != (rr * NR + r) % kGroup || row0 + r >= p.n) continue;
      float* yr = p.y + (row0 + r) * p.ldy;
      if (p.ep == Epilogue::SwiGLU) {
        if constexpr (RPG % 2 == 0) {
          const int64_t o = o_first + rr / 2;
          if ((rr & 1) || o >= p.w[0].n_out) continue;
          store_swiglu(p, yr, o, acc[rr][r], acc[rr | 1][r]);
        }
      } else {
        const int64_t o = o_first + rr;
        if (o >= w0.n_out) continue;
        store_value(p.ep, w0, yr, o, acc[rr][r]);
      }
    }
}

}  // namespace gpu
}  // namespace specd
