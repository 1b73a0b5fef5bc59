// specd/cuda/matvec_tc.cu: linear() for n <= kMaxSmallBatch rows of x on TENSOR CORES, for
// F16 weights on NVIDIA sm_80+ (every other type, HIP and older GPUs take matvec.cu). Same
// contract as matvec.cu: float32-accurate and BATCH-INVARIANT, so decode (n = 1) and a
// speculative verify (n = k + 1) give bit-identical rows; but the work per weight is a
// fraction of an instruction, so a verify of 16 positions costs about what one decode step
// costs (the weights are read once; the MMAs are nearly free).
//
// Maths, per row r of x (a token) and output o:
//   v_r[k] = x_r[k] * f_r, or (x_r[k] * nw[k]) * f_r with the fused RMSNorm, where
//            f_r = inv_r * s_r, inv_r = 1/sqrt(mean(x_r^2) + eps) (1 without the norm) and
//            s_r = 2^(14 - floor(log2 max_k |x_r[k] (nw[k]) inv_r|)): a power of two that
//            puts the row's largest value in [2^14, 2^15), inside fp16's range;
//   v = hi + lo, hi = fp16(v), lo = fp16(v - hi) (v - hi is exact in float32): 22 significant
//            bits, or an absolute 2^-25 below fp16's normal range (2^-39 of the row's max);
//   y[r, o] = (sum over warps w = 0..7, in order, of P_w[o, r]) / s_r  (+ bias, epilogue)
//   P_w     = the float32 tensor-core accumulation (mma m16n8k16, fp16 x fp16 -> f32, exact
//            products) over the K units of 32 elements u = w, w + 8, w + 16, ... in
//            ascending order, each unit as 4 MMAs: hi of its first 16, lo of them, hi of its
//            last 16, lo of them.
// Nothing in it depends on n, on the other rows of x, on which column of the MMA a row sits
// in, or on the launch shape (rows per CTA): a row's result is bit-identical whatever else
// is computed with it (the tests check this on the device).
//
// Fragments: a lane (g = lane / 4, c = lane % 4) loads 16 bytes of weight rows g and g + 8
// of its m-tile, elements 32u + 8c .. 32u + 8c + 7 (coalesced: a row's 64 bytes per unit
// come from its 4 lanes), and the same 8 positions of x row g of each n-tile (8 rows of x).
// A dot product does not care in which order its k are summed as long as A and B agree, so
// these 8 elements are the lane's k-slots of two MMAs: elements 0-1 and 2-3 are slots
// (2c, 2c+1) and (2c+8, 2c+9) of the first MMA, 4-5 and 6-7 those of the second.
//
// CTA: 8 warps share 16 * MT weight rows (MT m-tiles of 16; SwiGLU: 8 gate rows over the
// same 8 up rows per m-tile) and all n <= 8 * NT rows of x, splitting K by units as above;
// their partial sums meet in shared memory. Each CTA computes f_r for every row of x itself
// (a warp per row, lanes over K, fixed butterfly order: the same in every CTA).
#include <cstdlib>
#include <mutex>
#include <string>

#include "cuda/linear.cuh"
#include "cuda/quants.cuh"

#if !SPECD_HIP && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
#define SPECD_MMA 1
#else
#define SPECD_MMA 0
#endif

namespace specd {
namespace gpu {

namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / kGroup;
constexpr int kUnit = 32;  // K elements per unit

struct TcWeight {
  const uint8_t* data = nullptr;
  size_t stride = 0;
  int64_t n_out = 0;
  const float* bias = nullptr;
  int64_t col = 0;    // first column of y (Store)
  int32_t cta0 = 0;   // first blockIdx.x of this weight
};

struct TcParams {
  TcWeight w[3];
  int32_t n_w = 1;
  Epilogue ep = Epilogue::Store;
  const float* x = nullptr;       // [n, K]
  const float* norm_w = nullptr;  // [K] or null
  float eps = 0.f;
  float* y = nullptr;
  int64_t ldy = 0, n = 0, K = 0;
};

#if SPECD_MMA
// d += A (16 x 16, rows g/g+8, slots 2c.. and 2c+8..) * B (16 x 8), fp16 in, float32 accumulate
__device__ __forceinline__ void mma16816(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t pack_half2(__half a, __half b) {
  return (uint32_t)__half_as_ushort(a) | ((uint32_t)__half_as_ushort(b) << 16);
}

// v -> (hi, lo) halves of two values, packed as the MMA wants them (first value low).
__device__ __forceinline__ void split2(float v0, float v1, uint32_t& hi, uint32_t& lo) {
  const __half h0 = __float2half_rn(v0), h1 = __float2half_rn(v1);
  const __half l0 = __float2half_rn(v0 - __half2float(h0)), l1 = __float2half_rn(v1 - __half2float(h1));
  hi = pack_half2(h0, h1);
  lo = pack_half2(l0, l1);
}

// 2^(14 - floor(log2 m)) for finite m > 0 (clamped to float's normal range), else 1.
__device__ __forceinline__ float fp16_range_scale(float m) {
  const int e = (int)((__float_as_uint(m) >> 23) & 0xFF) - 127;
  if (!(m > 0.f) || e == 128) return 1.f;
  const int se = min(127, max(-126, 14 - e));
  return __uint_as_float((uint32_t)(se + 127) << 23);
}
#endif

template <int MT, int NT>
__global__ void __launch_bounds__(kThreads, NT >= 4 ? 1 : 2) tc_kernel(const TcParams p) {
#if SPECD_MMA
  extern __shared__ __align__(16) float red[];  // [kWarps][16 * MT][8 * NT] partial sums
  __shared__ float fac[kMaxSmallBatch], unscale[kMaxSmallBatch];
  const int lane = threadIdx.x % kGroup, warp = threadIdx.x / kGroup, g = lane / 4, c = lane % 4;
  const int64_t K = p.K, n = p.n;
  const bool swiglu = p.ep == Epilogue::SwiGLU;
  constexpr int kRows = 16 * MT, kCols = 8 * NT;

  // this CTA's weight and rows; the lane's rows g and g + 8 of each m-tile
  TcWeight w0 = p.w[0];
  int64_t o0;
  if (swiglu) {
    o0 = (int64_t)blockIdx.x * 8 * MT;
  } else {
    if (p.n_w > 1 && (int)blockIdx.x >= p.w[1].cta0) w0 = p.w[1];
    if (p.n_w > 2 && (int)blockIdx.x >= p.w[2].cta0) w0 = p.w[2];
    o0 = (int64_t)(blockIdx.x - w0.cta0) * kRows;
  }
  const uint8_t* rp[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const TcWeight& w = swiglu && h ? p.w[1] : w0;
      const int64_t o = swiglu ? o0 + 8 * mt + g : o0 + 16 * mt + 8 * h + g;
      rp[mt][h] = w.data + (size_t)min(o, w.n_out - 1) * w.stride + 16 * c;  // clamped; dropped at the end
    }
  const int64_t n_units = K / kUnit;
  // the first unit's weights: immutable, loaded before waiting for the previous kernel
  uint4 wa[MT][2];
  if (warp < n_units) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int h = 0; h < 2; ++h) wa[mt][h] = __ldg(reinterpret_cast<const uint4*>(rp[mt][h] + 64 * (size_t)warp));
  }

  gpu_grid_wait();
  gpu_grid_launch_dependents();

  // f_r and 1/s_r of every row of x: warp r % 8 takes row r (fixed order: lanes over K in
  // float4 steps, then the butterfly)
  for (int64_t r = warp; r < n; r += kWarps) {
    const float* xr = p.x + r * K;
    float ss = 0.f, mx = 0.f;
    for (int64_t k = 4 * lane; k < K; k += 4 * kGroup) {
      const float4 v = __ldg(reinterpret_cast<const float4*>(xr + k));
      ss = fmaf(v.x, v.x, ss);
      ss = fmaf(v.y, v.y, ss);
      ss = fmaf(v.z, v.z, ss);
      ss = fmaf(v.w, v.w, ss);
      if (p.norm_w != nullptr) {
        const float4 nw = __ldg(reinterpret_cast<const float4*>(p.norm_w + k));
        mx = fmaxf(fmaxf(mx, fabsf(v.x * nw.x)), fmaxf(fabsf(v.y * nw.y), fmaxf(fabsf(v.z * nw.z), fabsf(v.w * nw.w))));
      } else {
        mx = fmaxf(fmaxf(mx, fabsf(v.x)), fmaxf(fabsf(v.y), fmaxf(fabsf(v.z), fabsf(v.w))));
      }
    }
    ss = group_sum(ss);
    mx = group_max(mx);
    const float inv = p.norm_w != nullptr ? rsqrtf(ss / (float)K + p.eps) : 1.f;
    const float s = fp16_range_scale(mx * inv);
    if (lane == 0) {
      fac[r] = inv * s;
      unscale[r] = 1.f / s;
    }
  }
  __syncthreads();

  float acc[MT][NT][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int t = 0; t < NT; ++t)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[mt][t][i] = 0.f;

  for (int64_t u = warp; u < n_units; u += kWarps) {
    // next unit's weights in flight while this one is used
    uint4 wn[MT][2];
    const int64_t un = u + kWarps;
    if (un < n_units) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) wn[mt][h] = __ldg(reinterpret_cast<const uint4*>(rp[mt][h] + 64 * (size_t)un));
    }
    // B fragments of every n-tile: x row 8t + g, elements 32u + 8c .. + 7
    const int64_t k = kUnit * u + 8 * c;
    float nw[8];
    if (p.norm_w != nullptr) {
      const float4 a = __ldg(reinterpret_cast<const float4*>(p.norm_w + k));
      const float4 b = __ldg(reinterpret_cast<const float4*>(p.norm_w + k + 4));
      nw[0] = a.x; nw[1] = a.y; nw[2] = a.z; nw[3] = a.w; nw[4] = b.x; nw[5] = b.y; nw[6] = b.z; nw[7] = b.w;
    }
    uint32_t bh[NT][4], bl[NT][4];
#pragma unroll
    for (int t = 0; t < NT; ++t) {
      const int64_t r = 8 * t + g;
      float v[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
      if (r < n) {
        const float4 a = __ldg(reinterpret_cast<const float4*>(p.x + r * K + k));
        const float4 b = __ldg(reinterpret_cast<const float4*>(p.x + r * K + k + 4));
        v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w; v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
        const float f = fac[r];
        if (p.norm_w != nullptr) {
#pragma unroll
          for (int i = 0; i < 8; ++i) v[i] = (v[i] * nw[i]) * f;
        } else {
#pragma unroll
          for (int i = 0; i < 8; ++i) v[i] *= f;
        }
      }
#pragma unroll
      for (int i = 0; i < 4; ++i) split2(v[2 * i], v[2 * i + 1], bh[t][i], bl[t][i]);
    }
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      const uint4 r0 = wa[mt][0], r1 = wa[mt][1];
#pragma unroll
      for (int t = 0; t < NT; ++t) {
        mma16816(acc[mt][t], r0.x, r1.x, r0.y, r1.y, bh[t][0], bh[t][1]);
        mma16816(acc[mt][t], r0.x, r1.x, r0.y, r1.y, bl[t][0], bl[t][1]);
        mma16816(acc[mt][t], r0.z, r1.z, r0.w, r1.w, bh[t][2], bh[t][3]);
        mma16816(acc[mt][t], r0.z, r1.z, r0.w, r1.w, bl[t][2], bl[t][3]);
      }
    }
    if (un < n_units) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) wa[mt][h] = wn[mt][h];
    }
  }

  // partial sums -> shared memory: acc[mt][t] = rows (16mt + g, 16mt + g + 8), columns
  // (8t + 2c, 8t + 2c + 1)
  float* mine = red + (size_t)warp * kRows * kCols;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int t = 0; t < NT; ++t) {
      const int row = 16 * mt + g, col = 8 * t + 2 * c;
      mine[row * kCols + col] = acc[mt][t][0];
      mine[row * kCols + col + 1] = acc[mt][t][1];
      mine[(row + 8) * kCols + col] = acc[mt][t][2];
      mine[(row + 8) * kCols + col + 1] = acc[mt][t][3];
    }
  __syncthreads();

  // sum over the warps in order, unscale, epilogue: thread -> (row of x, output row)
  const int out_rows = swiglu ? 8 * MT : kRows;
  for (int i = threadIdx.x; i < (int)n * out_rows; i += kThreads) {
    const int r = i / out_rows, j = i % out_rows;
    float* yr = p.y + (int64_t)r * p.ldy;
    auto total = [&](int row) {
      float v = 0.f;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) v += red[((size_t)w * kRows + row) * kCols + r];
      return v * unscale[r];
    };
    if (swiglu) {
      const int mt = j / 8, jj = j % 8;
      const int64_t o = o0 + j;
      if (o >= p.w[0].n_out) continue;
      float gv = total(16 * mt + jj), uv = total(16 * mt + 8 + jj);
      if (p.w[0].bias) gv += p.w[0].bias[o];
      if (p.w[1].bias) uv += p.w[1].bias[o];
      yr[o] = gv / (1.f + __expf(-gv)) * uv;
    } else {
      const int64_t o = o0 + j;
      if (o >= w0.n_out) continue;
      float v = total(j);
      if (w0.bias) v += w0.bias[o];
      if (p.ep == Epilogue::Accumulate) yr[w0.col + o] += v;
      else yr[w0.col + o] = v;
    }
  }
#else
  // (never launched: tc_linear() takes this path only on sm_80+ NVIDIA devices)
  (void)p;
#endif
}

constexpr size_t tc_smem(int mt, int nt) { return sizeof(float) * (size_t)kWarps * 16 * mt * 8 * nt; }

template <int MT, int NT>
void launch_tc(const TcParams& p, int ctas, gpuStream_t s) {
  static std::once_flag once;
  std::call_once(once, [] {
    SPECD_GPU_CHECK(gpuFuncSetAttribute((tc_kernel<MT, NT>), gpuFuncAttributeMaxDynamicSharedMemorySize,
                                        (int)tc_smem(MT, NT)));
  });
  gpu_launch("tc_kernel", tc_kernel<MT, NT>, dim3((unsigned)ctas), dim3(kThreads), tc_smem(MT, NT), s, p);
}

template <int MT>
void launch_tc(const TcParams& p, int nt, int ctas, gpuStream_t s) {
  switch (nt) {
    case 1: launch_tc<MT, 1>(p, ctas, s); break;
    case 2: launch_tc<MT, 2>(p, ctas, s); break;
    case 4: launch_tc<MT, 4>(p, ctas, s); break;
    default: launch_tc<MT, 8>(p, ctas, s); break;
  }
}

bool tc_enabled() {
  static const bool on = [] {
    const char* e = std::getenv("SPECD_GPU_TC");
    return !(e && std::string(e) == "0");
  }();
  return on && dev_limits().mma;
}

}  // namespace

// Takes the call (returns true) when every weight has a tensor-core reader and the device
// has the MMAs; the choice depends on the weight types and the device only (never on n),
// so a weight is read the same way for decode and verify. Arguments checked by linear().
bool tc_linear(const LinearArgs& a, gpuStream_t s) {
  if (SPECD_HIP || a.n > kMaxSmallBatch || !tc_enabled()) return false;
  const int64_t K = a.w[0]->n_in;
  if (K % kUnit != 0) return false;
  for (int j = 0; j < a.n_w; ++j)
    if (a.w[j]->type != GgmlType::F16) return false;
  TcParams p;
  p.n_w = a.n_w;
  p.ep = a.ep;
  p.x = a.x;
  p.norm_w = a.norm_w;
  p.eps = a.eps;
  p.y = a.y;
  p.ldy = a.ldy;
  p.n = a.n;
  p.K = K;
  const int nt = a.n <= 8 ? 1 : a.n <= 16 ? 2 : a.n <= 32 ? 4 : 8;
  // 32 rows per CTA (each x fragment feeds two m-tiles) unless that leaves fewer CTAs than SMs
  const int64_t sms = dev_limits().sms;
  auto count = [&](int mt) {
    if (a.ep == Epilogue::SwiGLU) return ceil_div(a.w[0]->n_out, 8 * mt);
    int64_t c = 0;
    for (int j = 0; j < a.n_w; ++j) c += ceil_div(a.w[j]->n_out, 16 * mt);
    return c;
  };
  const int mt = count(2) >= sms ? 2 : 1;
  int64_t ctas = 0, col = 0;
  for (int j = 0; j < a.n_w; ++j) {
    const GpuWeight& w = *a.w[j];
    TcWeight& m = p.w[j];
    m.data = w.data;
    m.stride = w.row_stride;
    m.n_out = w.n_out;
    m.bias = a.bias[j];
    m.col = col;
    col += w.n_out;
    m.cta0 = (int32_t)ctas;
    if (a.ep != Epilogue::SwiGLU) ctas += ceil_div(w.n_out, 16 * mt);
  }
  if (a.ep == Epilogue::SwiGLU) ctas = count(mt);
  SPECD_CHECK(ctas < (int64_t)1 << 31, "linear: too many output rows");
  if (mt == 2) launch_tc<2>(p, nt, (int)ctas, s);
  else launch_tc<1>(p, nt, (int)ctas, s);
  return true;
}

}  // namespace gpu
}  // namespace specd
