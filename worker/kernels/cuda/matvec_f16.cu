// specd/cuda/matvec_f16.cu: linear() for n <= kMaxSmallBatch rows of x when every weight is
// F16 (or every weight BF16), in engines that do not speculate (LinearArgs::tensor_cores
// false): the weights loaded straight into registers, 16 bytes per load.
//
// Why a kernel of its own: a float weight is 2 bytes per element and nothing to decode, so
// a decode step is a pure stream of the weights; matvec.cu's staging through shared memory
// (cp.async ring, a group barrier per 512-element stage) costs more instructions than the
// sums and kept the 8B F16 shape at ~62 % of the copy bandwidth.
//
// Work: 256 threads = 8 groups of 32 lanes; a group owns 2 weight rows (a gate / up pair for
// SwiGLU) of a CTA-sized block of 16 rows (group_rows, linear_params.cuh); persistent CTAs
// take the blocks blockIdx.x, + gridDim.x, ...; grid.y = tiles of NR <= 4 rows of x. A step
// covers 4096 elements of a row: lane l loads the 8-element chunks c = l + 32 u + 128 i
// (u < 4) of both rows, the next step's loads in flight while one is summed, and the stream
// runs on into the next block of rows.
//
// Maths: x times the norm weight (float32, one rounding) is kept per CTA in shared memory;
// a lane adds its 8 products per chunk in element order with fmas, chunks in order, and the
// group reduces with a fixed butterfly; the norm factor inv_r multiplies the row's sum at the
// end (as matvec.cu's digit path). A row's result depends only on its weights and K, not on
// n, NR, the tile or the other rows: batch-invariant (every row of such a call comes here,
// for any n <= 64).
#include <algorithm>
#include <mutex>

#include "cuda/linear.cuh"
#include "cuda/linear_params.cuh"

namespace specd {
namespace gpu {

bool f16_linear(const LinearArgs& a, gpuStream_t s);

namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / kGroup;
constexpr int kRpg = 2;      // weight rows per group
constexpr int kMaxTile = 4;  // rows of x per CTA
constexpr int kU = 4;        // 16-byte loads per row and step (chunks l + 32 u)
constexpr size_t kStaticSmem = 1024;  // room left for the kernel's static shared memory

struct F16Params : LinParams {
  int32_t half = 0;  // floats of one half-plane of a row of x: K / 2 rounded up to 4
  int32_t n_cb = 0;  // blocks of rows (kWarps * kRpg weight rows each)
};

// x times norm_w of one row in shared memory as two half-planes: elements 8c .. 8c + 3 at
// float4 c of the first, 8c + 4 .. 8c + 7 at float4 c of the second, so the 32 lanes of a
// load read consecutive 16-byte pieces.
__host__ __device__ constexpr int x_row_floats(int half) { return 2 * half; }

// Fills the tile's NR rows (thread t: chunks t, t + 256, ...) and, with ss, each row's sum of
// squares in chunk order (the same in every CTA, for every n).
template <int NR>
__device__ __forceinline__ void prep_x(const F16Params& p, const int32_t (&xoff)[NR], float* xs, float* ss) {
  const int nc = (int)(p.K / 8), half = p.half;
  for (int c = threadIdx.x; c < nc; c += kThreads) {
    float4 n0 = make_float4(1.f, 1.f, 1.f, 1.f), n1 = n0;
    if (p.norm_w != nullptr) {
      n0 = __ldg(reinterpret_cast<const float4*>(p.norm_w) + 2 * c);
      n1 = __ldg(reinterpret_cast<const float4*>(p.norm_w) + 2 * c + 1);
    }
#pragma unroll
    for (int r = 0; r < NR; ++r) {
      const float4 a = __ldg(reinterpret_cast<const float4*>(p.x + xoff[r]) + 2 * c);
      const float4 b = __ldg(reinterpret_cast<const float4*>(p.x + xoff[r]) + 2 * c + 1);
      if (ss != nullptr) ss[r] = add_squares(b, add_squares(a, ss[r]));
      float4* row = reinterpret_cast<float4*>(xs + (size_t)r * x_row_floats(half));
      row[c] = make_float4(a.x * n0.x, a.y * n0.y, a.z * n0.z, a.w * n0.w);
      row[half / 4 + c] = make_float4(b.x * n1.x, b.y * n1.y, b.z * n1.z, b.w * n1.w);
    }
  }
}

template <GgmlType T>
__device__ __forceinline__ void to_float8(const uint4& v, float (&w)[8]) {
  const uint32_t u[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    if constexpr (T == GgmlType::F16) {
      const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&u[k]));
      w[2 * k] = f.x;
      w[2 * k + 1] = f.y;
    } else {
      w[2 * k] = __uint_as_float(u[k] << 16);
      w[2 * k + 1] = __uint_as_float(u[k] & 0xFFFF0000u);
    }
  }
}

struct Chunks {
  uint4 v[kU];
};

template <GgmlType T, int NR>
__global__ void __launch_bounds__(kThreads, NR == 1 ? 2 : 1) f16_kernel(const F16Params p) {
  extern __shared__ __align__(16) float xs[];
  __shared__ float red[kGroup];
  __shared__ float inv[NR];  // fused RMSNorm factor of each row (1 without the norm)
  const int lane = threadIdx.x % kGroup, warp = threadIdx.x / kGroup;
  const int64_t K = p.K, row0 = (int64_t)blockIdx.y * NR;
  int32_t xoff[NR];  // x row offsets; rows past n repeat row n-1, their results are dropped
#pragma unroll
  for (int r = 0; r < NR; ++r) xoff[r] = (int32_t)(min(row0 + r, p.n - 1) * K);
  const int nc = (int)(K / 8), span = kGroup * kU, ni = (nc + span - 1) / span;  // chunks, steps
  const int n_cb = p.n_cb, step = (int)gridDim.x, half = p.half;

  // the load stream: step l_i of block l_cb (rows lsrc)
  int l_cb = blockIdx.x, l_i = 0;
  const uint8_t* lsrc[kRpg];
  {
    int j0;
    int64_t o;
    group_rows<kRpg>(p, l_cb, warp, kWarps, j0, o, lsrc);
  }
  auto fetch = [&](Chunks (&dst)[kRpg]) {
    if (l_cb >= n_cb) return;
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const int c = lane + kGroup * u + span * l_i;
      if (c < nc) {
#pragma unroll
        for (int rr = 0; rr < kRpg; ++rr) dst[rr].v[u] = __ldg(reinterpret_cast<const uint4*>(lsrc[rr]) + c);
      }
    }
    if (++l_i == ni) {
      l_i = 0;
      l_cb += step;
      if (l_cb < n_cb) {
        int j0;
        int64_t o;
        group_rows<kRpg>(p, l_cb, warp, kWarps, j0, o, lsrc);
      }
    }
  };
  Chunks cur[kRpg], nxt[kRpg];
  fetch(cur);

  gpu_grid_wait();
  gpu_grid_launch_dependents();

  if (p.norm_w != nullptr) {
    float ss[NR];
#pragma unroll
    for (int r = 0; r < NR; ++r) ss[r] = 0.f;
    prep_x<NR>(p, xoff, xs, ss);
#pragma unroll
    for (int r = 0; r < NR; ++r) {
      const float t = block_sum(ss[r], red);
      if (threadIdx.x == 0) inv[r] = rsqrtf(t / (float)K + p.eps);
    }
  } else {
    prep_x<NR>(p, xoff, xs, nullptr);
    if (threadIdx.x < NR) inv[threadIdx.x] = 1.f;
  }
  __syncthreads();  // inv[] and x are visible

  for (int cb = blockIdx.x; cb < n_cb; cb += step) {
    float acc[kRpg][NR];
#pragma unroll
    for (int rr = 0; rr < kRpg; ++rr)
#pragma unroll
      for (int r = 0; r < NR; ++r) acc[rr][r] = 0.f;
    for (int i = 0; i < ni; ++i) {
      fetch(nxt);
#pragma unroll
      for (int u = 0; u < kU; ++u) {
        const int c = lane + kGroup * u + span * i;
        if (c >= nc) break;
        float w[kRpg][8];
#pragma unroll
        for (int rr = 0; rr < kRpg; ++rr) to_float8<T>(cur[rr].v[u], w[rr]);
#pragma unroll
        for (int r = 0; r < NR; ++r) {
          const float4* row = reinterpret_cast<const float4*>(xs + (size_t)r * x_row_floats(half));
          const float4 a = row[c], b = row[half / 4 + c];
          const float x[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
          for (int rr = 0; rr < kRpg; ++rr)
#pragma unroll
            for (int e = 0; e < 8; ++e) acc[rr][r] = fmaf(w[rr][e], x[e], acc[rr][r]);
        }
      }
#pragma unroll
      for (int rr = 0; rr < kRpg; ++rr) cur[rr] = nxt[rr];
    }
    int j0;
    int64_t o_first;
    const uint8_t* src[kRpg];
    group_rows<kRpg>(p, cb, warp, kWarps, j0, o_first, src);
#pragma unroll
    for (int rr = 0; rr < kRpg; ++rr)
#pragma unroll
      for (int r = 0; r < NR; ++r) acc[rr][r] = group_sum(acc[rr][r]) * inv[r];
    group_store<kRpg, NR>(p, lane, row0, j0, o_first, acc);
  }
}

template <GgmlType T, int NR>
void launch(const F16Params& p, int64_t blocks, size_t smem, gpuStream_t s) {
  static std::once_flag once;  // allow the device's largest shared memory once per kernel
  std::call_once(once, [] {
    SPECD_GPU_CHECK(gpuFuncSetAttribute((f16_kernel<T, NR>), gpuFuncAttributeMaxDynamicSharedMemorySize,
                                        (int)(dev_limits().smem_per_block - kStaticSmem)));
  });
  int per_sm = 0;  // persistent CTAs: as many as fit at once
  SPECD_GPU_CHECK(gpuOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, (f16_kernel<T, NR>), kThreads, smem));
  const int64_t ctas = std::min<int64_t>(blocks, (int64_t)std::max(per_sm, 1) * dev_limits().sms);
  const dim3 grid((unsigned)ctas, (unsigned)ceil_div(p.n, NR));
  gpu_launch("f16_kernel", f16_kernel<T, NR>, grid, dim3(kThreads), smem, s, p);
}

template <GgmlType T>
void launch(const F16Params& p, int nr, int64_t blocks, size_t smem, gpuStream_t s) {
  switch (nr) {
    case 1: launch<T, 1>(p, blocks, smem, s); break;
    case 2: launch<T, 2>(p, blocks, smem, s); break;
    default: launch<T, kMaxTile>(p, blocks, smem, s); break;
  }
}

}  // namespace

// Takes the call when tensor_cores is false, SPECD_GPU_DIRECT is not "0", every weight is F16
// (or every weight BF16) with 16-byte aligned rows, n <= 64 and x for the largest tile fits
// the device's shared memory (never a choice by n: batch invariance); returns whether it did.
bool f16_linear(const LinearArgs& a, gpuStream_t s) {
  static const bool on = env_value("SPECD_GPU_DIRECT") != "0";
  if (!on || a.tensor_cores || a.n > kMaxSmallBatch) return false;
  const GgmlType t = a.w[0]->type;
  if (t != GgmlType::F16 && t != GgmlType::BF16) return false;
  for (int j = 0; j < a.n_w; ++j) {
    const GpuWeight& w = *a.w[j];
    if (w.type != t || (uintptr_t)w.data % 16 != 0 || w.row_stride % 16 != 0) return false;
  }
  const int64_t K = a.w[0]->n_in;
  const int64_t half = ceil_div(K / 2, 4) * 4;
  if (K % 8 != 0 || half >= (1 << 27) ||
      (size_t)kMaxTile * x_row_floats((int)half) * sizeof(float) + kStaticSmem > dev_limits().smem_per_block)
    return false;
  SPECD_CHECK(a.n * K < (int64_t)1 << 31, "linear: x has more than 2^31 elements");
  const int nr = a.n <= 1 ? 1 : a.n <= 2 ? 2 : kMaxTile;
  const size_t smem = (size_t)nr * x_row_floats((int)half) * sizeof(float);
  F16Params p;
  const int64_t blocks = fill_params(p, a, (int64_t)kWarps * kRpg);
  SPECD_CHECK(blocks < (int64_t)1 << 31, "linear: too many output rows");
  p.half = (int32_t)half;
  p.n_cb = (int32_t)blocks;
  if (t == GgmlType::F16) launch<GgmlType::F16>(p, nr, blocks, smem, s);
  else launch<GgmlType::BF16>(p, nr, blocks, smem, s);
  return true;
}

}  // namespace gpu
}  // namespace specd
