// specd/cuda/matmul.cu: linear() for n > kMaxSmallBatch rows of x (prefill): a GEMM whose
// weight tiles are decoded from the stored blocks into fp16 in shared memory and multiplied
// on tensor cores (nvcuda::wmma m16n16k16, fp16 x fp16 -> fp32), or by plain FMAs of the
// same tiling where wmma is absent (HIP, pre-Volta).
//
// Maths: C[m, o] = sum_k half(x[m, k]) * half(W[o, k]) in float32, then bias and epilogue
// in float32 (cuda/linear.cuh). The weights are decoded exactly (quants.cuh) and rounded to
// fp16 once, the activations too: relative error ~1e-3 (fp16 keeps 11 significant bits),
// not batch-invariant (prefill is; decode and verify take matvec.cu).
//
// Tiles: a CTA computes BM = 128 rows of x by BN = 64 weight rows (SwiGLU: 32 gate rows and
// the same 32 up rows, so the epilogue has both), stepping over K by BK = 128. 256 threads
// = 8 warps as 4 (M) x 2 (N), each 32 x 32 outputs = 2 x 2 fragments. Per step the CTA
// converts its x tile (16 float4 per thread) and decodes its W tile (4 pieces per thread)
// into shared memory, then runs 8 k-steps of MMAs; several CTAs per SM overlap one's loads
// with the others' MMAs. 52 KiB of shared memory: within the 64 KiB of sm_75 and gfx90a.
// At the end the accumulators go through shared memory so that the epilogue writes y row
// by row (coalesced).
#include <mutex>

#include "cuda/linear.cuh"
#include "cuda/linear_params.cuh"
#include "cuda/quants.cuh"

#if SPECD_WMMA
#include <mma.h>
#endif

namespace specd {
namespace gpu {

namespace {

constexpr int kThreads = 256;
constexpr int BM = 128, BN = 64, BK = 128;
constexpr int kLd = BK + 8;    // halves per tile row: 16-byte aligned, rows shifted by 4 banks
constexpr int kLdc = BN + 4;   // floats per row of the output tile
constexpr size_t kSmem = (size_t)(BM + BN) * kLd * sizeof(__half);
static_assert((size_t)BM * kLdc * sizeof(float) <= kSmem, "the output tile reuses the input tiles' memory");
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
constexpr int kXUnroll = 1, kWUnroll = 1;  // loads in flight per thread (sm_75 spills with more)
#else
constexpr int kXUnroll = 4, kWUnroll = 2;
#endif

using MmWeight = LinWeight;  // cta0: first blockIdx.y of the weight
using MmParams = LinParams;

__device__ __forceinline__ void store_half4(__half* dst, float a, float b, float c, float d) {
  __half2* h = reinterpret_cast<__half2*>(dst);
  h[0] = __floats2half2_rn(a, b);
  h[1] = __floats2half2_rn(c, d);
}

// Decodes rows o0 .. o0+rows-1 of one weight, elements k0 .. k0+BK-1, into dst[r * kLd + kk]
// as fp16 (zeros past n_out and past K). BK = 128 elements are exactly the pieces
// k0/8 .. k0/8 + 15 of a row for every type (quants.cuh).
template <GgmlType T>
__device__ __forceinline__ void decode_tile(const MmWeight& w, int64_t o0, int rows, int64_t k0, int64_t K,
                                            __half* dst) {
  using D = Dec<T>;
  constexpr int kPR = BK / 8;  // pieces per tile row
#pragma unroll kWUnroll
  for (int i = threadIdx.x; i < rows * kPR; i += kThreads) {
    const int r = i / kPR;
    const int64_t o = o0 + r, q = k0 / 8 + i % kPR;
    const int64_t blk = q / D::kPieces;
    const int sub = (int)(q % D::kPieces);
    __half* d = dst + r * kLd + (blk * D::kElems + D::pos(sub) - k0);
    float v[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    if (o < w.n_out && q < K / 8) {
      Piece pc;
      D::load(w.data + (size_t)o * w.stride + blk * D::kBytes, sub, pc);
      dequant<D::kForm>(pc, v);
    }
    store_half4(d, v[0], v[1], v[2], v[3]);
    store_half4(d + D::kGap, v[4], v[5], v[6], v[7]);
  }
}

__device__ __forceinline__ void decode_tile_any(const MmWeight& w, int64_t o0, int rows, int64_t k0, int64_t K,
                                                __half* dst) {
  with_type(w.type, [&](auto tag) { decode_tile<decltype(tag)::value>(w, o0, rows, k0, K, dst); });
}

__global__ void __launch_bounds__(kThreads, 2) matmul_kernel(const MmParams p) {
  gpu_grid_wait();  // (programmatic dependent launch: vendor.cuh)
  gpu_grid_launch_dependents();
  extern __shared__ __align__(128) uint8_t smem[];
  __half* As = reinterpret_cast<__half*>(smem);  // [BM][kLd] x tile, row-major
  __half* Bs = As + BM * kLd;                     // [BN][kLd] W tile: row o holds W[o, k0..]
  float* Cs = reinterpret_cast<float*>(smem);     // [BM][kLdc] output tile (after the K loop)
  const int tid = threadIdx.x, warp = tid / kGroup;
  const int64_t m0 = (int64_t)blockIdx.x * BM, K = p.K;

  int j = 0;
  int64_t o0;
  const bool swiglu = p.ep == Epilogue::SwiGLU;
  if (swiglu) {
    o0 = (int64_t)blockIdx.y * (BN / 2);
  } else {
    if (p.n_w > 1 && (int)blockIdx.y >= p.w[1].cta0) j = 1;
    if (p.n_w > 2 && (int)blockIdx.y >= p.w[2].cta0) j = 2;
    o0 = (int64_t)(blockIdx.y - p.w[j].cta0) * BN;
  }

#if SPECD_WMMA
  using namespace nvcuda;
  const int wm = warp / 2, wn = warp % 2;  // warp tile: rows 32*wm.., columns 32*wn..
  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[2][2];
#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int jn = 0; jn < 2; ++jn) wmma::fill_fragment(acc[i][jn], 0.f);
#else
  const int tm = tid / 16, tn = tid % 16;  // thread tile: rows 8*tm.., columns 4*tn..
  float acc[8][4];
#pragma unroll
  for (int i = 0; i < 8; ++i)
#pragma unroll
    for (int jn = 0; jn < 4; ++jn) acc[i][jn] = 0.f;
#endif

  for (int64_t k0 = 0; k0 < K; k0 += BK) {
    __syncthreads();  // the previous step's MMAs are done with the tiles
    // x tile -> fp16 (K % 8 == 0, so a float4 is either inside K or past it)
#pragma unroll kXUnroll
    for (int i = tid; i < BM * BK / 4; i += kThreads) {
      const int r = i / (BK / 4), c = 4 * (i % (BK / 4));
      const int64_t m = m0 + r, k = k0 + c;
      float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
      if (m < p.n && k < K) v = __ldg(reinterpret_cast<const float4*>(p.x + m * K + k));
      store_half4(As + r * kLd + c, v.x, v.y, v.z, v.w);
    }
    if (swiglu) {
      decode_tile_any(p.w[0], o0, BN / 2, k0, K, Bs);
      decode_tile_any(p.w[1], o0, BN / 2, k0, K, Bs + (BN / 2) * kLd);
    } else {
      decode_tile_any(p.w[j], o0, BN, k0, K, Bs);
    }
    __syncthreads();

#if SPECD_WMMA
#pragma unroll
    for (int kk = 0; kk < BK; kk += 16) {
      wmma::fragment<wmma::matrix_b, 16, 16, 16, __half, wmma::col_major> b[2];
#pragma unroll
      for (int jn = 0; jn < 2; ++jn) wmma::load_matrix_sync(b[jn], Bs + (32 * wn + 16 * jn) * kLd + kk, kLd);
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, __half, wmma::row_major> a;
        wmma::load_matrix_sync(a, As + (32 * wm + 16 * i) * kLd + kk, kLd);
#pragma unroll
        for (int jn = 0; jn < 2; ++jn) wmma::mma_sync(acc[i][jn], a, b[jn], acc[i][jn]);
      }
    }
#else
    for (int kk = 0; kk < BK; ++kk) {
      float a[8], b[4];
#pragma unroll
      for (int i = 0; i < 8; ++i) a[i] = __half2float(As[(8 * tm + i) * kLd + kk]);
#pragma unroll
      for (int jn = 0; jn < 4; ++jn) b[jn] = __half2float(Bs[(4 * tn + jn) * kLd + kk]);
#pragma unroll
      for (int i = 0; i < 8; ++i)
#pragma unroll
        for (int jn = 0; jn < 4; ++jn) acc[i][jn] = fmaf(a[i], b[jn], acc[i][jn]);
    }
#endif
  }

  __syncthreads();  // the tiles' memory becomes the output tile
#if SPECD_WMMA
#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int jn = 0; jn < 2; ++jn)
      wmma::store_matrix_sync(Cs + (32 * wm + 16 * i) * kLdc + 32 * wn + 16 * jn, acc[i][jn], kLdc,
                              wmma::mem_row_major);
#else
#pragma unroll
  for (int i = 0; i < 8; ++i)
#pragma unroll
    for (int jn = 0; jn < 4; ++jn) Cs[(8 * tm + i) * kLdc + 4 * tn + jn] = acc[i][jn];
#endif
  __syncthreads();

  // epilogue, row by row
  const int cols = swiglu ? BN / 2 : BN;
  for (int i = tid; i < BM * cols; i += kThreads) {
    const int r = i / cols, c = i % cols;
    const int64_t m = m0 + r, o = o0 + c;
    if (m >= p.n) break;  // rows only grow with i
    float* yr = p.y + m * p.ldy;
    if (swiglu) {
      if (o >= p.w[0].n_out) continue;
      float g = Cs[r * kLdc + c], u = Cs[r * kLdc + c + BN / 2];
      if (p.w[0].bias) g += p.w[0].bias[o];
      if (p.w[1].bias) u += p.w[1].bias[o];
      yr[o] = g / (1.f + __expf(-g)) * u;
    } else {
      const MmWeight& w = p.w[j];
      if (o >= w.n_out) continue;
      float v = Cs[r * kLdc + c];
      if (w.bias) v += w.bias[o];
      if (p.ep == Epilogue::Accumulate) yr[w.col + o] += v;
      else yr[w.col + o] = v;
    }
  }
}

}  // namespace

// Arguments were checked by linear() (matvec.cu); norm_w is null here.
void matmul_large(const LinearArgs& a, gpuStream_t s) {
  SPECD_CHECK(a.norm_w == nullptr, "linear: the fused RMSNorm is not available for n > kMaxSmallBatch");
  MmParams p;
  const int64_t ctas = fill_params(p, a, BN);  // SwiGLU: BN / 2 gate rows over the same up rows
  SPECD_CHECK(ctas <= 65535, "linear: too many output rows for one launch (" + std::to_string(ctas) +
                                 " tiles of " + std::to_string(BN) + ")");
  static std::once_flag once;
  std::call_once(once, [] {
    SPECD_GPU_CHECK(gpuFuncSetAttribute(matmul_kernel, gpuFuncAttributeMaxDynamicSharedMemorySize, (int)kSmem));
  });
  const dim3 grid((unsigned)ceil_div(a.n, BM), (unsigned)ctas);
  gpu_launch("matmul_kernel", matmul_kernel, grid, dim3(kThreads), kSmem, s, p);
}

}  // namespace gpu
}  // namespace specd
