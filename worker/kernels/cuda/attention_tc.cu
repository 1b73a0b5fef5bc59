// specd/cuda/attention_tc.cu: causal grouped-query attention of a PREFILL (n > kMaxSmallBatch
// queries) on tensor cores, FlashAttention-2 style, for fp16 KV caches and head_dim 64 or 128
// on NVIDIA sm_80+ (attention() in attention.cu takes it there; everything else, and every
// small n, goes through the batch-invariant flash-decoding kernels).
//
// Maths, per query r (position p = *d_pos0 + r) and head h (KV head g = h / group):
//   s_j = dot(fp16(q), K_j) in float32 on the tensor cores (products exact, fp32 sums),
//   then the online softmax over key tiles of 64 in float32 (exp2 of s_j * scale * log2 e
//   minus the running maximum), p_j rounded to fp16 for P V (fp32 accumulation), and
//   out = o / l at the end. Errors: q and p_j rounded to fp16 (relative 2^-11 each): a few
//   1e-3 relative, like the prefill GEMM; NOT batch-invariant (a prefill's attention only
//   feeds its own rows; decode and verify never come here).
//
// CTA: 4 warps, 64 queries of one head (16 per warp); K and V tiles of 64 positions x
// head_dim go through shared memory with cp.async, double-buffered (the next tile's copies
// run during this tile's MMAs). Per warp and tile: S = Q K^T (Q's fp16 fragments kept in
// registers for the whole loop, K fragments by ldmatrix), the softmax update in registers
// (the S accumulator layout is the A-fragment layout of P), then O += P V (V fragments by
// ldmatrix.trans). Positions past the CTA's last query are never read: the copies fill
// zeros there (the cache may hold anything, NaN too, past the live length).
#include <mutex>
#include <string>

#include "cuda/attention.cuh"
#include "cuda/linear.cuh"
#include "cuda/mma.cuh"

namespace specd {
namespace gpu {

namespace {

constexpr int kFlashThreads = 128;  // 4 warps
constexpr int kBQ = 64;             // queries per CTA (16 per warp)
constexpr int kBKV = 64;            // positions per K / V tile

template <int HD>
struct FlashShape {
  static constexpr int kLd = HD + 8;  // halves per smem row: ldmatrix free of bank conflicts
  static constexpr size_t kTileHalves = (size_t)kBKV * kLd;
  static constexpr size_t kSmemBytes = 4 * kTileHalves * sizeof(__half);  // K, V x 2 buffers
};

struct FlashParams {
  const float* q;            // query r at q + r * ld_q: [n_heads * hd]
  int64_t ld_q;
  const __half* k;           // [n_ctx, n_kv * hd]
  const __half* v;
  float* out;                // [n, n_heads * hd]
  const int32_t* d_pos0;
  int32_t n, n_heads, group, ld_kv;
  float scale_log2;          // scale * log2(e)
};

template <int HD>
__global__ void __launch_bounds__(kFlashThreads) flash_prefill_kernel(const FlashParams P) {
  gpu_grid_wait();
  gpu_grid_launch_dependents();
#if SPECD_MMA
  using S = FlashShape<HD>;
  constexpr int kLd = S::kLd, KS = HD / 16, DT = HD / 8;  // k-steps over head_dim, d n-tiles
  extern __shared__ __align__(128) uint8_t smem[];
  __half* tiles = reinterpret_cast<__half*>(smem);  // [buf][K|V][kBKV][kLd]
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32, g = lane / 4, c = lane % 4;
  const int h = blockIdx.y, kvh = h / P.group;
  const int q0 = blockIdx.x * kBQ;
  const int pos0 = *P.d_pos0;
  const int last_row = min(q0 + kBQ, P.n) - 1;
  const int p_max = pos0 + last_row;  // the CTA's last position: keys 0 .. p_max
  const int n_tiles = p_max / kBKV + 1;

  auto load_tile = [&](int t) {
    __half* Kt = tiles + (size_t)(t % 2) * 2 * S::kTileHalves;
    __half* Vt = Kt + S::kTileHalves;
    const int j0 = t * kBKV;
    for (int i = tid; i < kBKV * (HD / 8); i += kFlashThreads) {
      const int r = i / (HD / 8), col = 8 * (i % (HD / 8));
      const int j = j0 + r;
      const bool ok = j <= p_max;
      const size_t off = (size_t)j * P.ld_kv + (size_t)kvh * HD + col;
      cp_async16(Kt + r * kLd + col, ok ? P.k + off : P.k, ok);
      cp_async16(Vt + r * kLd + col, ok ? P.v + off : P.v, ok);
    }
  };
  load_tile(0);
  cp_async_commit();

  // Q fragments (fp16) of this warp's rows g and g + 8, for every k-step over head_dim
  const int r_lo = q0 + warp * 16 + g, r_hi = r_lo + 8;
  uint32_t qf[KS][4];
  {
    const size_t ldq = (size_t)P.ld_q;
    const float* qlo = P.q + (size_t)r_lo * ldq + (size_t)h * HD;
    const float* qhi = P.q + (size_t)r_hi * ldq + (size_t)h * HD;
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) {
      const int d = 16 * ks + 2 * c;
      float2 a = make_float2(0.f, 0.f), b = a, e = a, f = a;
      if (r_lo < P.n) {
        a = *reinterpret_cast<const float2*>(qlo + d);
        e = *reinterpret_cast<const float2*>(qlo + d + 8);
      }
      if (r_hi < P.n) {
        b = *reinterpret_cast<const float2*>(qhi + d);
        f = *reinterpret_cast<const float2*>(qhi + d + 8);
      }
      qf[ks][0] = h2_bits(__floats2half2_rn(a.x, a.y));
      qf[ks][1] = h2_bits(__floats2half2_rn(b.x, b.y));
      qf[ks][2] = h2_bits(__floats2half2_rn(e.x, e.y));
      qf[ks][3] = h2_bits(__floats2half2_rn(f.x, f.y));
    }
  }
  const int p_lo = pos0 + r_lo, p_hi = pos0 + r_hi;

  float o[DT][4];
#pragma unroll
  for (int dt = 0; dt < DT; ++dt) o[dt][0] = o[dt][1] = o[dt][2] = o[dt][3] = 0.f;
  float m_lo = -INFINITY, m_hi = -INFINITY, l_lo = 0.f, l_hi = 0.f;  // l: this lane's part

  for (int t = 0; t < n_tiles; ++t) {
    if (t + 1 < n_tiles) {
      load_tile(t + 1);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    const __half* Kt = tiles + (size_t)(t % 2) * 2 * S::kTileHalves;
    const __half* Vt = Kt + S::kTileHalves;
    const int j0 = t * kBKV;

    // S = Q K^T: 16 rows x 64 positions (8 n-tiles)
    float s[8][4];
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) {
#pragma unroll
      for (int np = 0; np < 4; ++np) {
        uint32_t b[4];
        ldmatrix_x4(b, Kt + (16 * np + lane % 8 + 8 * (lane / 16)) * kLd + 16 * ks + 8 * ((lane / 8) % 2));
        mma16816(s[2 * np], qf[ks][0], qf[ks][1], qf[ks][2], qf[ks][3], b[0], b[1]);
        mma16816(s[2 * np + 1], qf[ks][0], qf[ks][1], qf[ks][2], qf[ks][3], b[2], b[3]);
      }
    }
    // scale to log2 units; mask positions past each row's own (only near the diagonal)
    const bool diag = j0 + kBKV - 1 > pos0 + q0 + warp * 16;
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) s[nt][e] *= P.scale_log2;
      if (diag) {
        const int j = j0 + 8 * nt + 2 * c;
        if (j > p_lo) s[nt][0] = -INFINITY;
        if (j + 1 > p_lo) s[nt][1] = -INFINITY;
        if (j > p_hi) s[nt][2] = -INFINITY;
        if (j + 1 > p_hi) s[nt][3] = -INFINITY;
      }
    }
    // online softmax: new row maxima over the quad's lanes
    float mx_lo = m_lo, mx_hi = m_hi;
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
      mx_lo = fmaxf(mx_lo, fmaxf(s[nt][0], s[nt][1]));
      mx_hi = fmaxf(mx_hi, fmaxf(s[nt][2], s[nt][3]));
    }
#pragma unroll
    for (int sh = 1; sh <= 2; sh <<= 1) {
      mx_lo = fmaxf(mx_lo, __shfl_xor_sync(0xffffffffu, mx_lo, sh));
      mx_hi = fmaxf(mx_hi, __shfl_xor_sync(0xffffffffu, mx_hi, sh));
    }
    const float f_lo = exp2f(m_lo - mx_lo), f_hi = exp2f(m_hi - mx_hi);  // 0 on the first tile
    m_lo = mx_lo;
    m_hi = mx_hi;
    l_lo *= f_lo;
    l_hi *= f_hi;
#pragma unroll
    for (int dt = 0; dt < DT; ++dt) {
      o[dt][0] *= f_lo;
      o[dt][1] *= f_lo;
      o[dt][2] *= f_hi;
      o[dt][3] *= f_hi;
    }
    // P (fp16, as A fragments: positions 16 kk .. 16 kk + 15 are n-tiles 2 kk, 2 kk + 1)
    uint32_t pf[4][4];
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
      const float e0 = exp2f(s[nt][0] - m_lo), e1 = exp2f(s[nt][1] - m_lo);
      const float e2 = exp2f(s[nt][2] - m_hi), e3 = exp2f(s[nt][3] - m_hi);
      const __half2 lo = __floats2half2_rn(e0, e1), hi = __floats2half2_rn(e2, e3);
      // l sums the rounded weights, the ones P V uses
      const float2 rl = __half22float2(lo), rh = __half22float2(hi);
      l_lo += rl.x + rl.y;
      l_hi += rh.x + rh.y;
      pf[nt / 2][2 * (nt % 2)] = h2_bits(lo);
      pf[nt / 2][2 * (nt % 2) + 1] = h2_bits(hi);
    }
    // O += P V
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
#pragma unroll
      for (int dp = 0; dp < DT / 2; ++dp) {
        uint32_t b[4];
        ldmatrix_x4_trans(b, Vt + (16 * kk + lane % 8 + 8 * ((lane / 8) % 2)) * kLd + 16 * dp + 8 * (lane / 16));
        mma16816(o[2 * dp], pf[kk][0], pf[kk][1], pf[kk][2], pf[kk][3], b[0], b[1]);
        mma16816(o[2 * dp + 1], pf[kk][0], pf[kk][1], pf[kk][2], pf[kk][3], b[2], b[3]);
      }
    }
    __syncthreads();  // every warp is done with this buffer before the next copies reuse it
  }

#pragma unroll
  for (int sh = 1; sh <= 2; sh <<= 1) {
    l_lo += __shfl_xor_sync(0xffffffffu, l_lo, sh);
    l_hi += __shfl_xor_sync(0xffffffffu, l_hi, sh);
  }
  const float inv_lo = 1.f / l_lo, inv_hi = 1.f / l_hi;
  const size_t ldo = (size_t)P.n_heads * HD;
#pragma unroll
  for (int dt = 0; dt < DT; ++dt) {
    const int d = h * HD + 8 * dt + 2 * c;
    if (r_lo < P.n)
      *reinterpret_cast<float2*>(P.out + (size_t)r_lo * ldo + d) = make_float2(o[dt][0] * inv_lo, o[dt][1] * inv_lo);
    if (r_hi < P.n)
      *reinterpret_cast<float2*>(P.out + (size_t)r_hi * ldo + d) = make_float2(o[dt][2] * inv_hi, o[dt][3] * inv_hi);
  }
#else
  (void)P;
#endif
}

template <int HD>
void launch_flash(const FlashParams& p, gpuStream_t s) {
  using S = FlashShape<HD>;
  static std::once_flag once;
  std::call_once(once, [] {
    SPECD_GPU_CHECK(gpuFuncSetAttribute(flash_prefill_kernel<HD>, gpuFuncAttributeMaxDynamicSharedMemorySize,
                                        (int)S::kSmemBytes));
  });
  const dim3 grid((unsigned)ceil_div(p.n, kBQ), (unsigned)p.n_heads);
  gpu_launch("flash_prefill_kernel", flash_prefill_kernel<HD>, grid, dim3(kFlashThreads), S::kSmemBytes, s, p);
}

}  // namespace

bool attention_prefill_tc(const AttnArgs& a, gpuStream_t s) {
  static const bool off = env_value("SPECD_GPU_FLASH") == "0";
  if (SPECD_HIP || off || a.n <= kMaxSmallBatch || !a.kv_f16 || (a.head_dim != 64 && a.head_dim != 128) ||
      !dev_limits().mma || dev_limits().smem_per_block < FlashShape<128>::kSmemBytes)
    return false;
  SPECD_CHECK((uintptr_t)a.q % 8 == 0 && (uintptr_t)a.out % 8 == 0 && (uintptr_t)a.k_cache % 16 == 0 &&
                  (uintptr_t)a.v_cache % 16 == 0,
              "attention: q and out must be 8-byte aligned, the caches 16-byte aligned");
  SPECD_CHECK(a.n < (int64_t)1 << 31, "attention: too many queries");  // (n_ctx: checked by attention())
  FlashParams p;
  p.q = a.q;
  p.ld_q = a.ld_q ? a.ld_q : (int64_t)a.n_heads * a.head_dim;
  p.k = static_cast<const __half*>(a.k_cache);
  p.v = static_cast<const __half*>(a.v_cache);
  p.out = a.out;
  p.d_pos0 = a.d_pos0;
  p.n = (int32_t)a.n;
  p.n_heads = a.n_heads;
  p.group = a.n_heads / a.n_kv_heads;
  p.ld_kv = a.n_kv_heads * a.head_dim;
  p.scale_log2 = a.scale * 1.44269504088896341f;
  if (a.head_dim == 64) launch_flash<64>(p, s);
  else launch_flash<128>(p, s);
  return true;
}

}  // namespace gpu
}  // namespace specd
