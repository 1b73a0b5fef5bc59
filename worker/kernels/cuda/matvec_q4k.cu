// specd/cuda/matvec_q4k.cu: linear() for n <= kMaxSmallBatch rows of x when every weight
// is Q4_K, in engines that do not speculate (LinearArgs::tensor_cores false): the digit
// reader with the weights loaded straight into registers.
//
// Why a kernel of its own: matvec.cu stages every weight byte through shared memory (cp.async
// into a ring of stages, a group barrier per stage) so that one kernel reads every type at
// any alignment, and two thirds of its instructions are that bookkeeping. A Q4_K block is
// 144 = 9 x 16 bytes: its header (d, dmin, 12 scale bytes) and its qs are 16-byte aligned
// whenever the rows are, so a lane fetches what it sums with three 16-byte loads.
//
// Work: 256 threads = 8 groups of 32 lanes; a group owns kRpg = 2 weight rows (a gate / up
// pair for SwiGLU) of a CTA-sized block of 16 rows (group_rows, linear_params.cuh);
// persistent CTAs take the blocks blockIdx.x, + gridDim.x, ...; grid.y = tiles of NR <= 4
// rows of x. Lane l takes the 64-element chunks c = l + 32 i of its rows, i = 0, 1, ...:
// chunk c is qs group g = c % 4 of block c / 4 (32 bytes: low nibbles = elements 64c ..
// 64c + 31 = sub-block 2g, high nibbles = 64c + 32 .. 64c + 63 = sub-block 2g + 1), loaded
// with the block's header; the next chunk's loads are in flight while one is summed, and
// the stream runs on into the next block of rows.
//
// Maths: x times the norm weight in 23-bit integer digits per 32-element block
// (cuda/digits.cuh), in shared memory once per CTA. Per chunk, weight row and row of x: the
// exact sums S_t (8 dp4a per byte plane and sub-block), S = S0 2^16 + (S1 2^8 + S2) (one or
// two roundings), times the block's grid step (exact), times the sub-block scale d sc in the
// accumulating fma; then its minimum -(dmin mn) times the sub-block's sum of x (one more
// fma). The high nibbles are read in place as 16 q (scale d sc / 16: exact). A lane adds
// its chunks in order and the group reduces with a fixed butterfly, so a row's result
// depends only on its weights and K, not on n, NR, the tile or the other rows: batch
// invariance as on matvec.cu's paths (every Q4_K row of such a call comes here, for any n).
#include <algorithm>
#include <mutex>

#include "cuda/digits.cuh"
#include "cuda/linear.cuh"
#include "cuda/linear_params.cuh"
#include "cuda/quants.cuh"

namespace specd {
namespace gpu {

bool q4k_linear(const LinearArgs& a, gpuStream_t s);

namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / kGroup;
constexpr int kRpg = 2;       // weight rows per group
constexpr int kMaxTile = 4;   // rows of x per CTA
constexpr int kSpan = 2048;   // elements the 32 lanes of a group cover in one step
constexpr size_t kStaticSmem = 1024;  // room left for the kernel's static shared memory

struct Q4kParams : LinParams {
  int32_t plane = 0;  // bytes of one digit plane of a row of x (K rounded up to kSpan)
  int32_t n_cb = 0;   // blocks of rows (kWarps * kRpg weight rows each)
};

// Digits of one row of x in shared memory: planes D0, D1, D2 (`plane` bytes each), element
// 64c + 16q + j (c = chunk, q < 4, j < 16) at byte ((c / 32) 4 + q) 512 + (c % 32) 16 + j of
// each, so the 32 lanes of a step read 32 consecutive 16-byte pieces (no bank conflicts);
// then per chunk a float4 {grid step of sub-block 2c, its sum of x, the same for 2c + 1}.
__host__ __device__ constexpr int digit_row_bytes(int plane) { return 3 * plane + plane / 4; }
__device__ __forceinline__ int digit_at(int e) {
  const int c = e >> 6;
  return ((((c >> 5) << 2) + ((e >> 4) & 3)) << 9) + ((c & 31) << 4) + (e & 15);
}

// The digits of x[r] (times norm_w) for the tile's NR rows, all of K: thread t takes the
// units (4 elements) t, t + 256, ... of every row (8 consecutive lanes a 32-element block),
// C units of each row with all their loads in flight before any is used; with ss, also each
// row's sum of squares in unit order (the same in every CTA, for every n).
template <int NR>
__device__ __forceinline__ void prep_digits(const Q4kParams& p, const int32_t (&xoff)[NR], uint8_t* dig,
                                            float* ss) {
  constexpr int C = NR >= 4 ? 1 : 4 / NR;
  const int units = (int)(p.K / 4), plane = p.plane;
  for (int i0 = 0; i0 * kThreads < units; i0 += C) {  // (uniform trip count: whole groups shuffle)
    float4 a[C][NR], n[C];
#pragma unroll
    for (int c = 0; c < C; ++c) {
      const int u = (i0 + c) * kThreads + (int)threadIdx.x;
      n[c] = make_float4(1.f, 1.f, 1.f, 1.f);
      if (u < units && p.norm_w != nullptr) n[c] = __ldg(reinterpret_cast<const float4*>(p.norm_w) + u);
#pragma unroll
      for (int r = 0; r < NR; ++r)
        a[c][r] = u < units ? __ldg(reinterpret_cast<const float4*>(p.x + xoff[r]) + u) : make_float4(0.f, 0.f, 0.f, 0.f);
    }
#pragma unroll
    for (int c = 0; c < C; ++c) {
      const int u = (i0 + c) * kThreads + (int)threadIdx.x;
#pragma unroll
      for (int r = 0; r < NR; ++r) {
        if (ss != nullptr && u < units) ss[r] = add_squares(a[c][r], ss[r]);
        const float v[4] = {a[c][r].x * n[c].x, a[c][r].y * n[c].y, a[c][r].z * n[c].z, a[c][r].w * n[c].w};
        const Digits4 d = digits4(v);
        int sum = d.sum;  // over the 32-element block: |sum| <= 2^27, exact
        sum += gpu_shfl_xor(sum, 1);
        sum += gpu_shfl_xor(sum, 2);
        sum += gpu_shfl_xor(sum, 4);
        if (u < units) {
          uint8_t* row = dig + (size_t)r * digit_row_bytes(plane);
          const int at = digit_at(4 * u);
          *reinterpret_cast<uint32_t*>(row + at) = d.d0;
          *reinterpret_cast<uint32_t*>(row + plane + at) = d.d1;
          *reinterpret_cast<uint32_t*>(row + 2 * plane + at) = d.d2;
          if ((u & 7) == 0) {  // sub-block u / 8 = 2c + h: meta[4c + 2h], [4c + 2h + 1]
            float* meta = reinterpret_cast<float*>(row + 3 * plane);
            meta[u / 4] = d.xsb;
            meta[u / 4 + 1] = (float)sum * d.xsb;
          }
        }
      }
    }
  }
}

// One chunk of a weight row as loaded: the block's header and qs bytes 32g .. 32g + 31.
struct Chunk {
  uint4 h, a, b;
};

__device__ __forceinline__ void load_chunk(const uint8_t* row, int c, Chunk& ch) {
  const uint4* blk = reinterpret_cast<const uint4*>(row + 144 * (c >> 2));
  ch.h = __ldg(blk);
  ch.a = __ldg(blk + 1 + 2 * (c & 3));
  ch.b = __ldg(blk + 2 + 2 * (c & 3));
}

// The chunks (step i, this lane) of the group's kRpg rows times the tile's NR rows of x.
template <int NR>
__device__ __forceinline__ void chunk_dot(const Chunk (&ch)[kRpg], const uint8_t* dig, int plane, int i, int lane,
                                          float (&acc)[kRpg][NR]) {
  const int g = lane & 3;  // (c = lane + 32 i)
  float s[kRpg][2], m[kRpg][2];
#pragma unroll
  for (int rr = 0; rr < kRpg; ++rr) {
    const uint32_t sh = 16 * (g & 1);  // scale bytes 2 (g % 2) .. of each 4
    uint32_t sc, mn;
    kquant_pair_of(ch[rr].h.y >> sh, ch[rr].h.z >> sh, ch[rr].h.w >> sh, g, sc, mn);
    kquant_sm(ch[rr].h.x, sc, mn, s[rr], m[rr]);
    s[rr][1] *= 0.0625f;  // (high nibbles read as 16 q)
  }
  const int at = (i << 11) + (lane << 4);  // digit_at(64 c) for this lane's chunk
#pragma unroll
  for (int r = 0; r < NR; ++r) {
    const uint8_t* d = dig + (size_t)r * digit_row_bytes(plane) + at;
    int S[kRpg][2][3];
#pragma unroll
    for (int rr = 0; rr < kRpg; ++rr)
#pragma unroll
      for (int h = 0; h < 2; ++h) S[rr][h][0] = S[rr][h][1] = S[rr][h][2] = 0;
#pragma unroll
    for (int q = 0; q < 4; ++q) {  // elements 64c + 16q ..: low nibbles of a, b, then high
      const uint4 p0 = *reinterpret_cast<const uint4*>(d + (q << 9));
      const uint4 p1 = *reinterpret_cast<const uint4*>(d + plane + (q << 9));
      const uint4 p2 = *reinterpret_cast<const uint4*>(d + 2 * plane + (q << 9));
#pragma unroll
      for (int rr = 0; rr < kRpg; ++rr) {
        const uint4 v = (q & 1) ? ch[rr].b : ch[rr].a;
        const uint32_t mask = q < 2 ? 0x0F0F0F0Fu : 0xF0F0F0F0u;
        const uint32_t w[4] = {v.x & mask, v.y & mask, v.z & mask, v.w & mask};
        int* t = S[rr][q >> 1];
        t[0] = gpu_dot4<false, true>(w[0], p0.x, t[0]);
        t[1] = gpu_dot4<false, false>(w[0], p1.x, t[1]);
        t[2] = gpu_dot4<false, false>(w[0], p2.x, t[2]);
        t[0] = gpu_dot4<false, true>(w[1], p0.y, t[0]);
        t[1] = gpu_dot4<false, false>(w[1], p1.y, t[1]);
        t[2] = gpu_dot4<false, false>(w[1], p2.y, t[2]);
        t[0] = gpu_dot4<false, true>(w[2], p0.z, t[0]);
        t[1] = gpu_dot4<false, false>(w[2], p1.z, t[1]);
        t[2] = gpu_dot4<false, false>(w[2], p2.z, t[2]);
        t[0] = gpu_dot4<false, true>(w[3], p0.w, t[0]);
        t[1] = gpu_dot4<false, false>(w[3], p1.w, t[1]);
        t[2] = gpu_dot4<false, false>(w[3], p2.w, t[2]);
      }
    }
    const float4 meta = *reinterpret_cast<const float4*>(d - at + 3 * plane + 16 * (lane + kGroup * i));
#pragma unroll
    for (int rr = 0; rr < kRpg; ++rr) {
      const float x0 = fmaf((float)S[rr][0][0], 65536.f, (float)(S[rr][0][1] * 256 + S[rr][0][2])) * meta.x;
      acc[rr][r] = fmaf(x0, s[rr][0], acc[rr][r]);
      acc[rr][r] = fmaf(m[rr][0], meta.y, acc[rr][r]);
      const float x1 = fmaf((float)S[rr][1][0], 65536.f, (float)(S[rr][1][1] * 256 + S[rr][1][2])) * meta.z;
      acc[rr][r] = fmaf(x1, s[rr][1], acc[rr][r]);
      acc[rr][r] = fmaf(m[rr][1], meta.w, acc[rr][r]);
    }
  }
}

// Programmatic dependent launch (sm_90): the first chunks' loads are issued before
// gpu_grid_wait() (weights only), so they overlap the end of the kernel this one depends on.
template <int NR>
__global__ void __launch_bounds__(kThreads, NR == 1 ? 3 : 2) q4k_kernel(const Q4kParams p) {
  extern __shared__ __align__(16) uint8_t dig[];
  __shared__ float red[kGroup];
  __shared__ float inv[NR];  // fused RMSNorm factor of each row (1 without the norm)
  const int lane = threadIdx.x % kGroup, warp = threadIdx.x / kGroup;
  const int64_t K = p.K, row0 = (int64_t)blockIdx.y * NR;
  int32_t xoff[NR];  // x row offsets; rows past n repeat row n-1, their results are dropped
#pragma unroll
  for (int r = 0; r < NR; ++r) xoff[r] = (int32_t)(min(row0 + r, p.n - 1) * K);
  const int nc = (int)(K / 64), ni = (nc + kGroup - 1) / kGroup;  // chunks per row, steps
  const int n_cb = p.n_cb, step = (int)gridDim.x;

  // the load stream: step l_i of block l_cb (rows lsrc)
  int l_cb = blockIdx.x, l_i = 0;
  const uint8_t* lsrc[kRpg];
  {
    int j0;
    int64_t o;
    group_rows<kRpg>(p, l_cb, warp, kWarps, j0, o, lsrc);
  }
  auto fetch = [&](Chunk (&dst)[kRpg]) {
    if (l_cb >= n_cb) return;
    const int c = lane + kGroup * l_i;
    if (c < nc) {
#pragma unroll
      for (int rr = 0; rr < kRpg; ++rr) load_chunk(lsrc[rr], c, dst[rr]);
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
  Chunk cur[kRpg], nxt[kRpg];
  fetch(cur);

  gpu_grid_wait();
  gpu_grid_launch_dependents();

  // inv_r = 1/sqrt(mean(x_r^2) + eps): one fixed-order CTA reduction per row, in the same
  // pass over x as the digits
  if (p.norm_w != nullptr) {
    float ss[NR];
#pragma unroll
    for (int r = 0; r < NR; ++r) ss[r] = 0.f;
    prep_digits<NR>(p, xoff, dig, ss);
#pragma unroll
    for (int r = 0; r < NR; ++r) {
      const float t = block_sum(ss[r], red);
      if (threadIdx.x == 0) inv[r] = rsqrtf(t / (float)K + p.eps);
    }
  } else {
    prep_digits<NR>(p, xoff, dig, nullptr);
    if (threadIdx.x < NR) inv[threadIdx.x] = 1.f;
  }
  __syncthreads();  // inv[] and the digits are visible

  for (int cb = blockIdx.x; cb < n_cb; cb += step) {
    float acc[kRpg][NR];
#pragma unroll
    for (int rr = 0; rr < kRpg; ++rr)
#pragma unroll
      for (int r = 0; r < NR; ++r) acc[rr][r] = 0.f;
    for (int i = 0; i < ni; ++i) {
      fetch(nxt);
      if (lane + kGroup * i < nc) chunk_dot<NR>(cur, dig, p.plane, i, lane, acc);
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

template <int NR>
void launch(const Q4kParams& p, int64_t blocks, size_t smem, gpuStream_t s) {
  static std::once_flag once;  // allow the device's largest shared memory once per kernel
  std::call_once(once, [] {
    SPECD_GPU_CHECK(gpuFuncSetAttribute((q4k_kernel<NR>), gpuFuncAttributeMaxDynamicSharedMemorySize,
                                        (int)(dev_limits().smem_per_block - kStaticSmem)));
  });
  int per_sm = 0;  // persistent CTAs: as many as fit at once
  SPECD_GPU_CHECK(gpuOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, (q4k_kernel<NR>), kThreads, smem));
  const int64_t ctas = std::min<int64_t>(blocks, (int64_t)std::max(per_sm, 1) * dev_limits().sms);
  const dim3 grid((unsigned)ctas, (unsigned)ceil_div(p.n, NR));
  gpu_launch("q4k_kernel", q4k_kernel<NR>, grid, dim3(kThreads), smem, s, p);
}

}  // namespace

// Takes the call when the digit reader applies (tensor_cores false, SPECD_GPU_DIGITS and
// SPECD_GPU_Q4K not "0"), every weight is Q4_K with 16-byte aligned rows, n <= 64 and the
// digits of the largest tile fit the device's shared memory (never a choice by n: batch
// invariance); returns whether it did.
bool q4k_linear(const LinearArgs& a, gpuStream_t s) {
  static const bool on = env_value("SPECD_GPU_DIGITS") != "0" && env_value("SPECD_GPU_Q4K") != "0";
  if (!on || a.tensor_cores || a.n > kMaxSmallBatch) return false;
  for (int j = 0; j < a.n_w; ++j) {
    const GpuWeight& w = *a.w[j];
    if (w.type != GgmlType::Q4_K || (uintptr_t)w.data % 16 != 0 || w.row_stride % 16 != 0) return false;
  }
  const int64_t K = a.w[0]->n_in;
  const int nr = a.n <= 1 ? 1 : a.n <= 2 ? 2 : kMaxTile;
  const int64_t plane = ceil_div(K, kSpan) * kSpan;
  if (plane >= (1 << 28) || (size_t)kMaxTile * digit_row_bytes((int)plane) + kStaticSmem > dev_limits().smem_per_block)
    return false;
  const size_t smem = (size_t)nr * digit_row_bytes((int)plane);
  Q4kParams p;
  const int64_t blocks = fill_params(p, a, (int64_t)kWarps * kRpg);
  SPECD_CHECK(blocks < (int64_t)1 << 31, "linear: too many output rows");
  SPECD_CHECK(a.n * K < (int64_t)1 << 31, "linear: x has more than 2^31 elements");
  p.plane = (int32_t)plane;
  p.n_cb = (int32_t)blocks;
  switch (nr) {
    case 1: launch<1>(p, blocks, smem, s); break;
    case 2: launch<2>(p, blocks, smem, s); break;
    default: launch<4>(p, blocks, smem, s); break;
  }
  return true;
}

}  // namespace gpu
}  // namespace specd
