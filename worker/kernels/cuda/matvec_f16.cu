// specd/cuda/matvec_f16.cu: linear() for n <= kMaxSmallBatch rows of x when every weight is
// F16 (or every weight BF16), in engines that do not speculate (LinearArgs::tensor_cores
// false): the weights loaded straight into registers, 16 bytes per load.
//
// Why a kernel of its own: a float weight is 2 bytes per element and nothing to decode, so
// a decode step is a pure stream of the weights; matvec.cu's staging through shared memory
// (cp.async ring, a group barrier per 512-element stage) costs more instructions than the
// sums and kept the 8B F16 shape at ~62 % of the copy bandwidth.
//
// Work (cuda/matvec_direct.cuh: the kernel shared with matvec_kq.cu): a step covers 4096
// elements of a row: lane l loads the 8-element chunks c = l + 32 u + 128 i (u < 4) of its
// group's two rows.
//
// Maths: x times the norm weight (float32, one rounding) is kept per CTA in shared memory;
// a lane adds its 8 products per chunk in element order with fmas, chunks in order, and the
// group reduces with a fixed butterfly; the norm factor inv_r multiplies the row's sum at the
// end (as matvec.cu's digit path). A row's result depends only on its weights and K, not on
// n, NR, the tile or the other rows: batch-invariant (every row of such a call comes here,
// for any n <= 64).
#include "cuda/matvec_direct.cuh"

namespace specd {
namespace gpu {

bool f16_linear(const LinearArgs& a, gpuStream_t s);

namespace {

using direct::kRpg;
using direct::kThreads;
constexpr int kU = 4;  // 16-byte loads per row and step (chunks l + 32 u)

struct F16Params : LinParams {
  int32_t half = 0;  // floats of one half-plane of a row of x: K / 2 rounded up to 4
  int32_t n_cb = 0;  // blocks of rows (direct::kWarps * kRpg weight rows each)
  int32_t halves = 0;  // (never: matvec_direct.cuh)
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

// The direct kernel's reader (cuda/matvec_direct.cuh) for weights of type T.
template <GgmlType T>
struct F16Reader {
  using Params = F16Params;
  struct Chunk {
    uint4 v[kU];
  };
  static constexpr const char* kName = "f16_kernel";
  static constexpr int kSpan = kGroup * kU;  // chunks of a row per step
  static constexpr int min_blocks(int nr) { return nr == 1 ? 2 : 1; }
  __device__ static int units(const Params& p) { return (int)(p.K / 8); }
  // chunks l + 32 u + 128 i: lanes 16..31 hold chunks whenever a row has 16 or more; no
  // half groups (a lane holds up to kU chunks of a step)
  static int64_t max_chunks(int64_t) { return kSpan; }
  __device__ static void load(const uint8_t* const (&rows)[kRpg], int nc, int lane, int i, Chunk (&ch)[kRpg],
                              GgmlType) {
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const int c = lane + kGroup * u + kSpan * i;
      if (c < nc) {
#pragma unroll
        for (int rr = 0; rr < kRpg; ++rr) ch[rr].v[u] = __ldg(reinterpret_cast<const uint4*>(rows[rr]) + c);
      }
    }
  }
  template <int NR>
  __device__ static void prep(const Params& p, const int32_t (&xoff)[NR], uint8_t* smem, float* ss) {
    prep_x<NR>(p, xoff, reinterpret_cast<float*>(smem), ss);
  }
  template <int NR>
  __device__ static void dot(const Params& p, const Chunk (&ch)[kRpg], const uint8_t* smem, int nc, int i, int lane,
                             float (&acc)[kRpg][NR], GgmlType) {
    const float* xs = reinterpret_cast<const float*>(smem);
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const int c = lane + kGroup * u + kSpan * i;
      if (c >= nc) break;
      float w[kRpg][8];
#pragma unroll
      for (int rr = 0; rr < kRpg; ++rr) to_float8<T>(ch[rr].v[u], w[rr]);
#pragma unroll
      for (int r = 0; r < NR; ++r) {
        const float4* row = reinterpret_cast<const float4*>(xs + (size_t)r * x_row_floats(p.half));
        const float4 a = row[c], b = row[p.half / 4 + c];
        const float x[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
        for (int rr = 0; rr < kRpg; ++rr)
#pragma unroll
          for (int e = 0; e < 8; ++e) acc[rr][r] = fmaf(w[rr][e], x[e], acc[rr][r]);
      }
    }
  }
};

}  // namespace

// Takes the call when tensor_cores is false, SPECD_GPU_DIRECT is not "0", every weight is F16
// (or every weight BF16) with 16-byte aligned rows, n <= 64 and x for the largest tile fits
// the device's shared memory (never a choice by n: batch invariance); returns whether it did.
bool f16_linear(const LinearArgs& a, gpuStream_t s) {
  if (!direct::applies(a)) return false;
  const GgmlType t = a.w[0]->type;
  if (t != GgmlType::F16 && t != GgmlType::BF16) return false;
  for (int j = 1; j < a.n_w; ++j)
    if (a.w[j]->type != t) return false;
  const int64_t K = a.w[0]->n_in;
  const int64_t half = ceil_div(K / 2, 4) * 4;
  if (K % 8 != 0 || half >= (1 << 27)) return false;
  const size_t row_bytes = (size_t)x_row_floats((int)half) * sizeof(float);
  if (!direct::tile_fits(row_bytes)) return false;
  const auto fill = [half](F16Params& p) { p.half = (int32_t)half; };
  if (t == GgmlType::F16) direct::launch<F16Reader<GgmlType::F16>>(a, row_bytes, s, fill);
  else direct::launch<F16Reader<GgmlType::BF16>>(a, row_bytes, s, fill);
  return true;
}

}  // namespace gpu
}  // namespace specd
