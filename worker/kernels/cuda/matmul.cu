// specd/cuda/matmul.cu: linear() for n > kMaxSmallBatch rows of x (prefill): a GEMM on
// tensor cores, fp16 x fp16 -> fp32, three kernels.
//
// Maths (all): C[m, o] = sum_k half(x[m, k]) * half(W[o, k]) in float32, then bias and
// epilogue in float32 (cuda/linear.cuh). The weights are decoded exactly (quants.cuh) and
// rounded to fp16 once, the activations too: relative error ~1e-3 (fp16 keeps 11
// significant bits), not batch-invariant (prefill is; decode and verify take matvec.cu).
//
// gemm_kernel (NVIDIA sm_80+). x is first rounded to fp16 into the call's workspace
// (half_kernel), once per call instead of once per CTA. A CTA computes BM = 128 (or 64, when
// 128 would leave SMs idle or does not fit the device's shared memory) rows of x by 128
// weight rows (SwiGLU: 64 gate rows and the same 64 up rows, so that the epilogue has both),
// stepping over K by 64 through a 3-stage ring of shared-memory tiles: cp.async copies the
// x tile (and an F16 weight tile as stored) two steps ahead; other types are decoded to fp16
// by the threads two steps ahead, after the current step's MMAs. From kDequantMinRows rows
// of x, quantized weights are instead decoded to fp16 once per call into the workspace
// (dequant_kernel) and copied like F16 (decoding per tile stalls every warp on its loads).
// 8 warps as 2 (M) x 4 (N), each BM/2 x 32 outputs: ldmatrix.x4 fragments, mma.sync
// m16n8k16. Rows are padded to 72 halves, so ldmatrix reads are free of bank conflicts. The
// copies' sources and row bounds are computed once per thread (only k advances per step):
// recomputing them each step cost 3x the instructions of the step's MMAs (H200: +17-21 %).
//
// wgmma_kernel (NVIDIA sm_90a builds on sm_90 devices, where every weight is F16 as stored
// or decoded by dequant_kernel): Hopper's warpgroup MMA. A CTA of two warpgroups computes 128
// rows of x by BN = 128 weight rows (wgmma m64n128k16, 64 float accumulators per thread) or
// 256 (m64n256k16; where 128 x 256 tiles make two waves of CTAs), stepping over K by 64: every
// thread copies 16-byte pieces of both tiles with cp.async into a ring of 5 (BN 128) or 4
// stages laid out with the 128-byte swizzle the wgmma shared-memory descriptors read, and each
// step leaves its 4 MMAs in flight while it waits for the previous step's. The products of
// each 16 elements are summed in K order as mma.sync sums them: the same bits as gemm_kernel.
//
// wmma_kernel (HIP, pre-sm_80): BM = 128 by BN = 64, stepping over K by 128; per step the
// CTA converts its x tile (16 float4 per thread) and decodes its W tile (4 pieces per thread)
// into shared memory, then runs 8 k-steps of nvcuda::wmma m16n16k16 (the FMA fallback of
// the same tiling on HIP); several CTAs per SM overlap one's loads with the others' MMAs. 52
// KiB of shared memory: within the 64 KiB of sm_75 and gfx90a.
//
// All write the accumulators through shared memory, so that the epilogue writes y row by
// row (coalesced).
#include <mutex>

#include "cuda/linear.cuh"
#include "cuda/linear_params.cuh"
#include "cuda/mma.cuh"
#include "cuda/quants.cuh"

#if SPECD_WMMA
#include <mma.h>
#endif

namespace specd {
namespace gpu {

namespace {

constexpr int kThreads = 256;
using MmWeight = LinWeight;  // cta0: first blockIdx.y of the weight
using MmParams = LinParams;

__device__ __forceinline__ void store_half4(__half* dst, float a, float b, float c, float d) {
  __half2* h = reinterpret_cast<__half2*>(dst);
  h[0] = __floats2half2_rn(a, b);
  h[1] = __floats2half2_rn(c, d);
}

// The CTA's weight: j (index into p.w) and its first row o0 (SwiGLU: the gate/up row pair
// index; bn weight rows per CTA, bn / 2 of each for SwiGLU).
__device__ __forceinline__ void cta_weight(const MmParams& p, int bn, int& j, int64_t& o0) {
  j = 0;
  if (p.ep == Epilogue::SwiGLU) {
    o0 = (int64_t)blockIdx.y * (bn / 2);
    return;
  }
  if (p.n_w > 1 && (int)blockIdx.y >= p.w[1].cta0) j = 1;
  if (p.n_w > 2 && (int)blockIdx.y >= p.w[2].cta0) j = 2;
  o0 = (int64_t)(blockIdx.y - p.w[j].cta0) * bn;
}

// Decodes rows o0 .. o0+rows-1 of one weight, elements k0 .. k0+bk-1, into dst[r * ld + kk]
// as fp16 (zeros past n_out and past K), with the CTA's threads. k0 is a multiple of bk (64 or
// 128). The pieces of 64 consecutive elements (from a multiple of 64) are 8 consecutive
// pieces of a row for every type but Q6_K, whose pieces pair elements 64 apart: there 128
// elements are 16 pieces, and a 64-wide tile decodes all 16 and keeps the runs inside it.
// Where piece q of a row starts (its first run; the second starts Dec<T>::kGap later), and
// its 8 values in row o of w (quants.cuh).
template <GgmlType T>
__device__ __forceinline__ int64_t piece_pos(int64_t q) {
  return q / Dec<T>::kPieces * Dec<T>::kElems + Dec<T>::pos((int)(q % Dec<T>::kPieces));
}
template <GgmlType T>
__device__ __forceinline__ void decode_piece(const MmWeight& w, int64_t o, int64_t q, float (&v)[8]) {
  using D = Dec<T>;
  Piece pc;
  D::load(w.data + (size_t)o * w.stride + q / D::kPieces * D::kBytes, (int)(q % D::kPieces), pc);
  dequant<D::kForm>(pc, v);
}

template <GgmlType T, int bk, int ld, int unroll>
__device__ __forceinline__ void decode_tile(const MmWeight& w, int64_t o0, int rows, int64_t k0, int64_t K,
                                            __half* dst) {
  using D = Dec<T>;
  constexpr int kSpan = D::kGap == 64 && bk < 128 ? 128 : bk;  // elements the tile's pieces cover
  constexpr int kPR = kSpan / 8;                              // pieces per tile row
  const int64_t k_span = k0 - k0 % kSpan;
#pragma unroll unroll
  for (int i = threadIdx.x; i < rows * kPR; i += blockDim.x) {
    const int r = i / kPR;
    const int64_t o = o0 + r, q = k_span / 8 + i % kPR;
    const int64_t e = piece_pos<T>(q) - k0;  // the first run, relative to k0
    float v[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    if (o < w.n_out && q < K / 8) decode_piece<T>(w, o, q, v);
    __half* d = dst + r * ld;
    if (kSpan == bk || (e >= 0 && e < bk)) store_half4(d + e, v[0], v[1], v[2], v[3]);
    if (kSpan == bk || (e + D::kGap >= 0 && e + D::kGap < bk)) store_half4(d + e + D::kGap, v[4], v[5], v[6], v[7]);
  }
}

template <int bk, int ld, int unroll>
__device__ __forceinline__ void decode_tile_any(const MmWeight& w, int64_t o0, int rows, int64_t k0, int64_t K,
                                                __half* dst) {
  with_type(w.type, [&](auto tag) { decode_tile<decltype(tag)::value, bk, ld, unroll>(w, o0, rows, k0, K, dst); });
}

// The epilogue, from the CTA's output tile Cs [bm][ldc] (SwiGLU: gate columns 0 .. bn/2-1,
// up columns bn/2 .. bn-1), row by row.
__device__ __forceinline__ void store_tile(const MmParams& p, const float* Cs, int ldc, int bm, int bn, int64_t m0,
                                           int j, int64_t o0) {
  const bool swiglu = p.ep == Epilogue::SwiGLU;
  const int cols = swiglu ? bn / 2 : bn;
  for (int i = threadIdx.x; i < bm * cols; i += blockDim.x) {
    const int r = i / cols, c = i % cols;
    const int64_t m = m0 + r, o = o0 + c;
    if (m >= p.n) break;  // rows only grow with i
    float* yr = p.y + m * p.ldy;
    if (swiglu) {
      if (o >= p.w[0].n_out) continue;
      store_swiglu(p, yr, o, Cs[r * ldc + c], Cs[r * ldc + c + bn / 2]);
    } else {
      const MmWeight& w = p.w[j];
      if (o >= w.n_out) continue;
      store_value(p.ep, w, yr, o, Cs[r * ldc + c]);
    }
  }
}

// ---- gemm_kernel: NVIDIA sm_80+ (see the top of the file)

// From this many rows of x, quantized weights are decoded to fp16 once per call (dequant_kernel)
// where the workspace allows, rather than once per 128 rows of x in every CTA.
constexpr int64_t kDequantMinRows = 256;

namespace pipe {
constexpr int BN = 128, BK = 64, kStages = 3;
constexpr int kLd = BK + 8;   // halves per tile row (144 bytes: 8 rows hit 8 distinct 4-bank groups)
constexpr int kLdc = BN + 4;  // floats per row of the output tile
template <int BM>
constexpr size_t smem_bytes() { return (size_t)kStages * (BM + BN) * kLd * sizeof(__half); }
static_assert((size_t)128 * kLdc * sizeof(float) <= smem_bytes<128>(), "output tile fits the ring");
static_assert((size_t)64 * kLdc * sizeof(float) <= smem_bytes<64>(), "output tile fits the ring");
}  // namespace pipe

// xh: x rounded to fp16, [n, K]. kCopyW: every weight of the call is F16 (copied as stored).
template <int BM, bool kCopyW>
__global__ void __launch_bounds__(kThreads, 2) gemm_kernel(const MmParams p, const __half* __restrict__ xh) {
  gpu_grid_wait();  // (programmatic dependent launch: vendor.cuh)
  gpu_grid_launch_dependents();
#if SPECD_MMA
  using namespace pipe;
  constexpr int MT = BM / 32;  // m16 tiles per warp: the warp's BM / 2 rows
  constexpr int NT = 4;        // n8 tiles per warp: its 32 weight rows
  constexpr int kStageHalves = (BM + BN) * kLd;
  constexpr int kRowStep = kThreads / (BK / 8);  // a thread copies rows r0, r0 + 32, ...
  constexpr int kItA = BM / kRowStep, kItB = BN / kRowStep;
  extern __shared__ __align__(128) uint8_t smem[];
  __half* ring = reinterpret_cast<__half*>(smem);
  float* Cs = reinterpret_cast<float*>(smem);  // [BM][kLdc] output tile (after the K loop)
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32, wm = warp / 4, wn = warp % 4;
  const int64_t m0 = (int64_t)blockIdx.x * BM, K = p.K;
  const bool swiglu = p.ep == Epilogue::SwiGLU;
  int j;
  int64_t o0;
  cta_weight(p, BN, j, o0);
  const int nk = (int)((K + BK - 1) / BK);

  // The thread's copies, fixed for the whole K loop: 16 bytes at column c of rows r0 + 32 i
  // of each tile; sources and row validity computed once (per step only k advances).
  const int r0 = tid / (BK / 8), c = 8 * (tid % (BK / 8));
  const __half* a_src = xh + (m0 + r0) * K + c;
  const int64_t a_step = (int64_t)kRowStep * K;
  uint32_t a_ok = 0;
#pragma unroll
  for (int i = 0; i < kItA; ++i) a_ok |= (uint32_t)(m0 + r0 + kRowStep * i < p.n) << i;
  const uint8_t* b_src[kCopyW ? kItB : 1];
  uint32_t b_ok = 0;
  if constexpr (kCopyW) {
#pragma unroll
    for (int i = 0; i < kItB; ++i) {
      const int r = r0 + kRowStep * i;
      const MmWeight& w = swiglu ? p.w[r / (BN / 2)] : p.w[j];
      const int64_t o = o0 + (swiglu ? r % (BN / 2) : r);
      const bool ok = o < w.n_out;
      b_src[i] = ok ? w.data + (size_t)o * w.stride + 2 * c : w.data;
      b_ok |= (uint32_t)ok << i;
    }
  }

  // Stage t's asynchronous copies: the x tile, and the weight tile when it is F16.
  auto copy_stage = [&](int t) {
    __half* As = ring + (t % kStages) * kStageHalves + r0 * kLd + c;
    const int64_t k0 = (int64_t)t * BK;
    const bool k_ok = k0 + c < K;  // K % 8 == 0: 8 elements are all inside K or all past it
#pragma unroll
    for (int i = 0; i < kItA; ++i) {
      const bool ok = k_ok && (a_ok >> i & 1);
      cp_async16(As + kRowStep * i * kLd, ok ? a_src + i * a_step + k0 : xh, ok);
    }
    if constexpr (kCopyW) {
      __half* Bs = As + BM * kLd;
#pragma unroll
      for (int i = 0; i < kItB; ++i) {
        const bool ok = k_ok && (b_ok >> i & 1);
        cp_async16(Bs + kRowStep * i * kLd, ok ? b_src[i] + 2 * k0 : b_src[i], ok);
      }
    }
  };
  // Stage t's weight tile decoded by the threads (types other than F16).
  auto decode_stage = [&](int t) {
    if constexpr (!kCopyW) {
      __half* Bs = ring + (t % kStages) * kStageHalves + BM * kLd;
      const int64_t k0 = (int64_t)t * BK;
      if (swiglu) {
        decode_tile_any<BK, kLd, 2>(p.w[0], o0, BN / 2, k0, K, Bs);
        decode_tile_any<BK, kLd, 2>(p.w[1], o0, BN / 2, k0, K, Bs + (BN / 2) * kLd);
      } else {
        decode_tile_any<BK, kLd, 2>(p.w[j], o0, BN, k0, K, Bs);
      }
    }
  };

  float acc[MT][NT][4];
  zero_tiles(acc);

  // Ring: stages 0 .. kStages-2 in flight before the loop; step t waits for stage t, starts
  // the copies of stage t + kStages - 1 (into the slot step t - 1 read: every warp is past it
  // after the barrier), runs its MMAs, then decodes that stage's weights. One commit group
  // per step (empty at the end) keeps the wait count fixed.
#pragma unroll
  for (int t = 0; t < kStages - 1; ++t) {
    if (t < nk) {
      copy_stage(t);
      decode_stage(t);
    }
    cp_async_commit();
  }
  for (int t = 0; t < nk; ++t) {
    cp_async_wait<kStages - 2>();
    __syncthreads();
    const int tn = t + kStages - 1;
    if (tn < nk) copy_stage(tn);
    cp_async_commit();

    const __half* As = ring + (t % kStages) * kStageHalves;
    const __half* Bs = As + BM * kLd;
#pragma unroll
    for (int kk = 0; kk < BK; kk += 16) {
      uint32_t a[MT][4], b[NT / 2][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
        ldmatrix_x4(a[mt], As + (wm * (BM / 2) + 16 * mt + lane % 16) * kLd + kk + 8 * (lane / 16));
#pragma unroll
      for (int np = 0; np < NT / 2; ++np)
        ldmatrix_x4(b[np], Bs + (wn * 32 + 16 * np + lane % 8 + 8 * (lane / 16)) * kLd + kk + 8 * ((lane / 8) % 2));
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
          mma16816(acc[mt][nt], a[mt][0], a[mt][1], a[mt][2], a[mt][3], b[nt / 2][2 * (nt % 2)],
                   b[nt / 2][2 * (nt % 2) + 1]);
    }
    if (tn < nk) decode_stage(tn);
  }
  cp_async_wait<0>();
  __syncthreads();  // the ring becomes the output tile

  const int g = lane / 4, c2 = 2 * (lane % 4);
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      const int r = wm * (BM / 2) + 16 * mt + g, col = wn * 32 + 8 * nt + c2;
      *reinterpret_cast<float2*>(Cs + r * kLdc + col) = make_float2(acc[mt][nt][0], acc[mt][nt][1]);
      *reinterpret_cast<float2*>(Cs + (r + 8) * kLdc + col) = make_float2(acc[mt][nt][2], acc[mt][nt][3]);
    }
  __syncthreads();
  store_tile(p, Cs, kLdc, BM, BN, m0, j, o0);
#else
  (void)p;
  (void)xh;
#endif
}

// ---- wgmma_kernel: NVIDIA sm_90a (see the top of the file)

namespace wg {
constexpr int BM = 128, BK = 64;  // BK halves: one 128-byte swizzle row
constexpr int kRowBytes = BK * 2;
constexpr int kTileA = BM * kRowBytes;  // the x tile; the weight tile is BN rows
template <int BN>
constexpr int stage_bytes() { return (BM + BN) * kRowBytes; }
template <int BN>
constexpr int ldc() { return BN + 4; }  // floats per row of the output tile
// + 1 KiB: the ring starts at the first 1024-byte boundary (the swizzle's alignment)
template <int BN, int S>
constexpr size_t smem_bytes() { return (size_t)S * stage_bytes<BN>() + 1024; }
static_assert(kTileA % 1024 == 0, "the weight tile starts on a swizzle boundary, like the x tile");
static_assert((size_t)BM * ldc<128>() * sizeof(float) <= 3 * (size_t)stage_bytes<128>(), "output tile fits");
static_assert((size_t)BM * ldc<256>() * sizeof(float) <= 3 * (size_t)stage_bytes<256>(), "output tile fits");
}  // namespace wg

// Every weight F16 (as stored or decoded by dequant_kernel); xh: x rounded to fp16. BN weight
// rows per CTA (SwiGLU: BN / 2 gate rows and the same up rows), S stages.
template <int BN, int S>
__global__ void __launch_bounds__(kThreads, 1) wgmma_kernel(const MmParams p, const __half* __restrict__ xh) {
  gpu_grid_wait();  // (programmatic dependent launch: vendor.cuh)
  gpu_grid_launch_dependents();
#if SPECD_WGMMA
  using namespace wg;
  static_assert(S >= 3, "two stages besides the one being copied");
  constexpr int kAhead = S - 2;           // stages copied ahead of the one the MMAs read
  constexpr int kRowStep = kThreads / 8;  // a thread copies piece c of rows r0, r0 + 32, ...
  constexpr int kItA = BM / kRowStep, kItB = BN / kRowStep;
  constexpr int kStage = stage_bytes<BN>(), kLdc = ldc<BN>();
  extern __shared__ __align__(128) uint8_t smem_raw[];
  uint8_t* ring = smem_raw + (1024 - (uint32_t)__cvta_generic_to_shared(smem_raw) % 1024) % 1024;
  float* Cs = reinterpret_cast<float*>(ring);  // [BM][kLdc] output tile (after the K loop)
  const int tid = threadIdx.x, group = tid / 128;
  const int64_t m0 = (int64_t)blockIdx.x * BM, K = p.K;
  const bool swiglu = p.ep == Epilogue::SwiGLU;
  int j;
  int64_t o0;
  cta_weight(p, BN, j, o0);
  const int nk = (int)((K + BK - 1) / BK);

  // The thread's copies, fixed for the whole K loop: 16-byte piece c (elements 8c..8c+7 of the
  // step) of rows r0 + 32 i of both tiles, stored at piece c ^ (r0 % 8) of the row (the
  // 128-byte swizzle; r0 + 32 i has the same row % 8).
  const int r0 = tid / 8, c = tid % 8;
  const uint32_t dst = (uint32_t)r0 * kRowBytes + (uint32_t)((c ^ (r0 % 8)) * 16);
  const __half* a_src = xh + (m0 + r0) * K + 8 * c;
  const int64_t a_step = (int64_t)kRowStep * K;
  uint32_t a_ok = 0, b_ok = 0;
#pragma unroll
  for (int i = 0; i < kItA; ++i) a_ok |= (uint32_t)(m0 + r0 + kRowStep * i < p.n) << i;
  const uint8_t* b_src[kItB];
#pragma unroll
  for (int i = 0; i < kItB; ++i) {
    const int r = r0 + kRowStep * i;
    const MmWeight& w = swiglu ? p.w[r / (BN / 2)] : p.w[j];
    const int64_t o = o0 + (swiglu ? r % (BN / 2) : r);
    const bool ok = o < w.n_out;
    b_src[i] = ok ? w.data + (size_t)o * w.stride + 16 * c : w.data;
    b_ok |= (uint32_t)ok << i;
  }
  auto copy_stage = [&](int t) {
    uint8_t* st = ring + (t % S) * kStage + dst;
    const int64_t k0 = (int64_t)t * BK;
    const bool k_ok = k0 + 8 * c < K;  // K % 8 == 0: a piece is all inside K or all past it
#pragma unroll
    for (int i = 0; i < kItA; ++i) {
      const bool ok = k_ok && (a_ok >> i & 1);
      cp_async16(st + i * kRowStep * kRowBytes, ok ? a_src + i * a_step + k0 : xh, ok);
    }
#pragma unroll
    for (int i = 0; i < kItB; ++i) {
      const bool ok = k_ok && (b_ok >> i & 1);
      cp_async16(st + kTileA + i * kRowStep * kRowBytes, ok ? b_src[i] + 2 * k0 : b_src[i], ok);
    }
  };

  float acc[BN / 2];
#pragma unroll
  for (int i = 0; i < BN / 2; ++i) acc[i] = 0.f;

  // Ring: stages 0 .. kAhead-1 in flight before the loop. Step t waits for stage t (and makes
  // it visible to the async proxy wgmma reads through), starts the copies of stage t + kAhead
  // into the slot stage t - 2 used (each warpgroup waited for its step t - 2 MMAs at the end
  // of step t - 1, and the barrier orders that before the copies), then issues its 4 MMAs
  // and leaves them in flight while it waits for the previous step's. One commit group per
  // step (empty at the end) keeps the wait count fixed.
#pragma unroll
  for (int t = 0; t < kAhead; ++t) {
    if (t < nk) copy_stage(t);
    cp_async_commit();
  }
  for (int t = 0; t < nk; ++t) {
    cp_async_wait<kAhead - 1>();
    fence_proxy_async_shared();
    __syncthreads();
    if (t + kAhead < nk) copy_stage(t + kAhead);
    cp_async_commit();

    const uint8_t* st = ring + (t % S) * kStage;
    const uint64_t da = wgmma_desc_sw128(st + group * 64 * kRowBytes), db = wgmma_desc_sw128(st + kTileA);
    wgmma_pin(acc);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < BK / 16; ++kk) wgmma_m64k16<BN>(acc, da + 2 * kk, db + 2 * kk);
    wgmma_commit();
    wgmma_wait<1>();
    wgmma_pin(acc);
  }
  wgmma_wait<0>();
  wgmma_pin(acc);
  cp_async_wait<0>();
  __syncthreads();  // the ring becomes the output tile

  const int lane = tid % 32, r = group * 64 + (tid % 128) / 32 * 16 + lane / 4, c2 = 2 * (lane % 4);
#pragma unroll
  for (int i = 0; i < BN / 8; ++i) {
    *reinterpret_cast<float2*>(Cs + r * kLdc + 8 * i + c2) = make_float2(acc[4 * i], acc[4 * i + 1]);
    *reinterpret_cast<float2*>(Cs + (r + 8) * kLdc + 8 * i + c2) = make_float2(acc[4 * i + 2], acc[4 * i + 3]);
  }
  __syncthreads();
  store_tile(p, Cs, kLdc, BM, BN, m0, j, o0);
#else
  (void)p;
  (void)xh;
  gpu_trap();  // chosen only where dev_limits().wgmma: a build without sm_90a code for this device
#endif
}

// x (count floats, count % 4 == 0) -> fp16
__global__ void half_kernel(const float* __restrict__ x, __half* __restrict__ xh, int64_t count) {
  gpu_grid_wait();
  gpu_grid_launch_dependents();
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < count / 4; i += stride) {
    const float4 v = __ldg(reinterpret_cast<const float4*>(x) + i);
    store_half4(xh + 4 * i, v.x, v.y, v.z, v.w);
  }
}

// Every row of w decoded to fp16 into dst [n_out, K] (quantized prefill: the GEMM then copies
// it like an F16 weight instead of decoding a tile per CTA).
__global__ void dequant_kernel(const MmWeight w, int64_t K, __half* __restrict__ dst) {
  gpu_grid_wait();
  gpu_grid_launch_dependents();
  with_type(w.type, [&](auto tag) {
    constexpr GgmlType T = decltype(tag)::value;
    const int64_t per_row = K / 8, count = w.n_out * per_row, stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < count; i += stride) {
      const int64_t o = i / per_row, q = i % per_row;
      float v[8];
      decode_piece<T>(w, o, q, v);
      __half* d = dst + o * K + piece_pos<T>(q);
      store_half4(d, v[0], v[1], v[2], v[3]);
      store_half4(d + Dec<T>::kGap, v[4], v[5], v[6], v[7]);
    }
  });
}

// ---- wmma_kernel: HIP and pre-sm_80 (see the top of the file)

namespace tiles {
constexpr int BM = 128, BN = 64, BK = 128;
constexpr int kLd = BK + 8;    // halves per tile row: 16-byte aligned, rows shifted by 4 banks
constexpr int kLdc = BN + 4;   // floats per row of the output tile
constexpr size_t kSmem = (size_t)(BM + BN) * kLd * sizeof(__half);
static_assert((size_t)BM * kLdc * sizeof(float) <= kSmem, "the output tile reuses the input tiles' memory");
}  // namespace tiles
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
constexpr int kXUnroll = 1, kWUnroll = 1;  // loads in flight per thread (sm_75 spills with more)
#else
constexpr int kXUnroll = 4, kWUnroll = 2;
#endif

__global__ void __launch_bounds__(kThreads, 2) wmma_kernel(const MmParams p) {
  gpu_grid_wait();  // (programmatic dependent launch: vendor.cuh)
  gpu_grid_launch_dependents();
  using namespace tiles;
  extern __shared__ __align__(128) uint8_t smem[];
  __half* As = reinterpret_cast<__half*>(smem);  // [BM][kLd] x tile, row-major
  __half* Bs = As + BM * kLd;                     // [BN][kLd] W tile: row o holds W[o, k0..]
  float* Cs = reinterpret_cast<float*>(smem);     // [BM][kLdc] output tile (after the K loop)
  const int tid = threadIdx.x;
  const int64_t m0 = (int64_t)blockIdx.x * BM, K = p.K;
  const bool swiglu = p.ep == Epilogue::SwiGLU;
  int j;
  int64_t o0;
  cta_weight(p, BN, j, o0);
#if SPECD_WMMA
  using namespace nvcuda;
  const int warp = tid / kGroup, wm = warp / 2, wn = warp % 2;  // warp tile: rows 32*wm.., columns 32*wn..
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
      decode_tile_any<BK, kLd, kWUnroll>(p.w[0], o0, BN / 2, k0, K, Bs);
      decode_tile_any<BK, kLd, kWUnroll>(p.w[1], o0, BN / 2, k0, K, Bs + (BN / 2) * kLd);
    } else {
      decode_tile_any<BK, kLd, kWUnroll>(p.w[j], o0, BN, k0, K, Bs);
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

  store_tile(p, Cs, kLdc, BM, BN, m0, j, o0);
}

// SPECD_GPU_GEMM, read once: the benchmarks' choice of prefill kernel ("wmma", "mma", "bm128":
// mma.sync with 128-row tiles wherever they fit; unset or anything else: the defaults).
const std::string& gemm_setting() {
  static const std::string v = env_value("SPECD_GPU_GEMM");
  return v;
}

// The sm_80+ kernel unless SPECD_GPU_GEMM=wmma or the device lacks it.
bool use_pipe() {
  const bool off = gemm_setting() == "wmma";
  return !SPECD_HIP && dev_limits().mma && !off && dev_limits().smem_per_block >= pipe::smem_bytes<64>();
}

template <int BM, bool kCopyW>
void launch_gemm(const MmParams& p, int64_t ctas, const __half* xh, gpuStream_t s) {
  static std::once_flag once;
  std::call_once(once, [] {
    SPECD_GPU_CHECK(gpuFuncSetAttribute((gemm_kernel<BM, kCopyW>), gpuFuncAttributeMaxDynamicSharedMemorySize,
                                        (int)pipe::smem_bytes<BM>()));
  });
  const dim3 grid((unsigned)ceil_div(p.n, BM), (unsigned)ctas);
  gpu_launch("gemm_kernel", gemm_kernel<BM, kCopyW>, grid, dim3(kThreads), pipe::smem_bytes<BM>(), s, p, xh);
}

template <int BM>
void launch_gemm(const MmParams& p, int64_t ctas, const __half* xh, bool copy_w, gpuStream_t s) {
  copy_w ? launch_gemm<BM, true>(p, ctas, xh, s) : launch_gemm<BM, false>(p, ctas, xh, s);
}

// The sm_90a kernel for F16 weights (as stored or decoded) unless SPECD_GPU_GEMM names another
// kernel ("mma", "bm128": the mma.sync kernel; "wmma").
bool use_wgmma() {
  const std::string& g = gemm_setting();
  const bool off = g == "mma" || g == "bm128" || g == "wmma";
  return dev_limits().wgmma && !off && dev_limits().smem_per_block >= wg::smem_bytes<128, 4>();
}

template <int BN, int S>
void launch_wgmma(const MmParams& p, int64_t ctas, const __half* xh, gpuStream_t s) {
  constexpr size_t smem = wg::smem_bytes<BN, S>();
  static std::once_flag once;
  std::call_once(once, [] {
    SPECD_GPU_CHECK(gpuFuncSetAttribute((wgmma_kernel<BN, S>), gpuFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
  });
  const dim3 grid((unsigned)ceil_div(p.n, wg::BM), (unsigned)ctas);
  gpu_launch("wgmma_kernel", wgmma_kernel<BN, S>, grid, dim3(kThreads), smem, s, p, xh);
}

}  // namespace

size_t kq_mma_work_bytes(int64_t n, int64_t K);  // matvec_kq_mma.cu

size_t linear_work_bytes(int64_t n, int64_t K, int64_t dequant_rows) {
  if (n <= kMaxSmallBatch) return kq_mma_work_bytes(n, K);
  if (!use_pipe()) return 0;
  return sizeof(__half) * (size_t)((n + (n >= kDequantMinRows ? dequant_rows : 0)) * K);
}

// Arguments were checked by linear() (matvec.cu); norm_w is null here.
void matmul_large(const LinearArgs& a, gpuStream_t s) {
  SPECD_CHECK(a.norm_w == nullptr, "linear: the fused RMSNorm is not available for n > kMaxSmallBatch");
  MmParams p;
  const int64_t K = a.w[0]->n_in;
  if (use_pipe()) {
    const size_t need = linear_work_bytes(a.n, K);
    SPECD_CHECK(a.work != nullptr && a.work_bytes >= need && (uintptr_t)a.work % 16 == 0,
                "linear: n = " + std::to_string(a.n) + " rows need a 16-byte aligned workspace of " +
                    std::to_string(need) + " bytes (LinearArgs::work, linear_work_bytes), got " +
                    std::to_string(a.work ? a.work_bytes : 0));
    bool all_f16 = true;
    int64_t rows = 0;
    for (int j = 0; j < a.n_w; ++j) {
      all_f16 = all_f16 && a.w[j]->type == GgmlType::F16;
      rows += a.w[j]->n_out;
    }
    // Large batches of other types: every weight decoded to fp16 once (after x in the
    // workspace), then copied like F16 weights, when the workspace has room for them.
    const bool dequant = !all_f16 && a.n >= kDequantMinRows && a.work_bytes >= linear_work_bytes(a.n, K, rows);
    const bool copy_w = all_f16 || dequant;
    // The sm_90a kernel takes 128 x 256 tiles where they make two waves of CTAs
    // (SPECD_GPU_WGMMA_BN=128 / 256: always that width), else 128 x 128, like the mma.sync
    // kernel's (whose BM is 64 or 128).
    static const std::string bn_env = env_value("SPECD_GPU_WGMMA_BN");
    const bool wgmma = copy_w && use_wgmma();
    const bool wide = wgmma && dev_limits().smem_per_block >= wg::smem_bytes<256, 4>() &&
                      (bn_env == "256" || (bn_env != "128" && ceil_div(a.n, wg::BM) * cta_count(a, 256) >=
                                                                   2 * (int64_t)dev_limits().sms));
    const int bn = wide ? 256 : pipe::BN;
    const int64_t ctas = fill_params(p, a, bn);  // SwiGLU: bn / 2 gate rows over the same up rows
    SPECD_CHECK(ctas <= 65535, "linear: too many output rows for one launch (" + std::to_string(ctas) +
                                   " tiles of " + std::to_string(bn) + ")");
    __half* xh = static_cast<__half*>(a.work);
    const int64_t count = a.n * K, grid_cap = 8 * (int64_t)dev_limits().sms;
    gpu_launch("half_kernel", half_kernel, dim3((unsigned)std::min<int64_t>(ceil_div(count / 4, kThreads), grid_cap)),
               dim3(kThreads), 0, s, a.x, xh, count);
    if (dequant) {
      __half* wh = xh + count;
      for (int j = 0; j < a.n_w; ++j) {
        MmWeight& w = p.w[j];
        const int64_t pieces = w.n_out * (K / 8);
        gpu_launch("dequant_kernel", dequant_kernel, dim3((unsigned)std::min<int64_t>(ceil_div(pieces, kThreads), grid_cap)),
                   dim3(kThreads), 0, s, w, K, wh);
        w.data = reinterpret_cast<const uint8_t*>(wh);
        w.stride = sizeof(__half) * (size_t)K;
        w.type = GgmlType::F16;
        wh += w.n_out * K;
      }
    }
    if (wgmma) {
      // SPECD_GPU_WGMMA_STAGES=4: a 4-stage ring for 128-wide tiles too (default 5; 4 for 256)
      static const bool four = env_value("SPECD_GPU_WGMMA_STAGES") == "4";
      if (wide) launch_wgmma<256, 4>(p, ctas, xh, s);
      else if (four || dev_limits().smem_per_block < wg::smem_bytes<128, 5>()) launch_wgmma<128, 4>(p, ctas, xh, s);
      else launch_wgmma<128, 5>(p, ctas, xh, s);
      return;
    }
    // 128-row tiles where they fill every SM twice (SPECD_GPU_GEMM=bm128: always) and fit,
    // else 64
    const bool always128 = gemm_setting() == "bm128";
    const bool big = (always128 || ceil_div(a.n, 128) * ctas >= 2 * (int64_t)dev_limits().sms) &&
                     dev_limits().smem_per_block >= pipe::smem_bytes<128>();
    if (big) launch_gemm<128>(p, ctas, xh, copy_w, s);
    else launch_gemm<64>(p, ctas, xh, copy_w, s);
    return;
  }
  const int64_t ctas = fill_params(p, a, tiles::BN);  // SwiGLU: BN / 2 gate rows over the same up rows
  SPECD_CHECK(ctas <= 65535, "linear: too many output rows for one launch (" + std::to_string(ctas) +
                                 " tiles of " + std::to_string(tiles::BN) + ")");
  static std::once_flag once;
  std::call_once(once, [] {
    SPECD_GPU_CHECK(gpuFuncSetAttribute(wmma_kernel, gpuFuncAttributeMaxDynamicSharedMemorySize, (int)tiles::kSmem));
  });
  const dim3 grid((unsigned)ceil_div(a.n, tiles::BM), (unsigned)ctas);
  gpu_launch("wmma_kernel", wmma_kernel, grid, dim3(kThreads), tiles::kSmem, s, p);
}

}  // namespace gpu
}  // namespace specd
