// specd/cuda/matvec_direct.cuh: the kernel and launcher the direct readers of linear() share
// (matvec_kq.cu: Q4_K / Q6_K / Q8_0 against integer digits of x; matvec_f16.cu: F16 / BF16),
// for n <= kMaxSmallBatch rows of x in engines that do not speculate: each lane loads the
// weight bytes it sums straight into registers, with no staging through shared memory.
//
// Work: 256 threads = 8 groups of 32 lanes; a group owns kRpg = 2 weight rows (a gate / up
// pair for SwiGLU) of a CTA-sized block of 16 rows (group_rows, linear_params.cuh); persistent
// CTAs take the blocks blockIdx.x, + gridDim.x, ...; grid.y = tiles of NR <= 4 rows of x. Half
// groups (p.halves, where the reader says a row has at most 16 chunks: the digit reader at K
// <= 1024, where lanes 16..31 would hold no chunk): each 16 lanes act as a group of their own,
// so a CTA takes blocks of 32 rows; a lane's sums are the same, and the reduction over 16
// lanes adds what the 32-lane butterfly adds (its first step only adds +0: half_sum), so every
// row keeps its bits. A row is read in steps of R::kSpan chunks (the reader's unit of
// loading); the next step's loads are in flight while one is summed, the first is issued
// before the grid dependency wait (weights only: it overlaps the end of the kernel this one
// depends on), and the stream runs on into the next block of rows. x (times the norm weight)
// is prepared once per CTA in shared memory by the reader; the RMSNorm factor inv_r multiplies
// each row's sum at the end. A lane adds its chunks in order and the group reduces with a
// fixed butterfly, so a row's result depends only on its weights and K: batch-invariant for
// every n <= 64.
//
// A reader R provides:
//   Params (LinParams plus n_cb, the blocks of rows, halves, and its own fields),
//   max_chunks(K) (host: the most chunks a lane of a 32-lane group takes in a row of K),
//   Chunk (one row's registers of a step), kName, kSpan, min_blocks(nr) (CTAs per SM the
//   kernel is compiled for), units(p) (chunks of a row), load(rows, nc, lane, i, ch, type) (step i of the
//   group's rows; chunks >= nc untouched), prep<NR>(p, xoff, smem, ss) (x of the tile into
//   shared memory; with ss, each row's sum of squares in a fixed order) and
//   dot<NR>(p, ch, smem, nc, i, lane, acc, type) (the sums of step i). `type` is the block's
//   weight type, for readers of mixed calls.
#pragma once
#include <algorithm>
#include <cstdint>
#include <mutex>
#include <type_traits>

#include "cuda/linear.cuh"
#include "cuda/linear_params.cuh"
#include "cuda/trace.cuh"

namespace specd {
namespace gpu {
namespace direct {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / kGroup;
constexpr int kRpg = 2;      // weight rows per group
constexpr int kMaxTile = 4;  // rows of x per CTA
constexpr size_t kStaticSmem = 1024;  // room left for the kernel's static shared memory

// group_sum of a half group (16 lanes, partners within the half) whose other half would hold
// +0: the 32-lane butterfly's first step (v + the lane 16 away, +0) then its last four.
__device__ __forceinline__ float half_sum(float v) {
  v = __fadd_rn(v, 0.f);  // (-0 becomes +0, as it does there)
#pragma unroll
  for (int m = kGroup / 4; m > 0; m >>= 1) v += gpu_shfl_xor(v, m);
  return v;
}

// Staged readers (R::kStaged): the weights go to shared memory first (R::issue: each group
// copies its rows' bytes of a step there with coalesced cp.async, R::kSlots - 1 steps in
// flight per group ahead of the one being summed), and a lane takes its chunk from there
// (R::take): for layouts whose per-lane loads would touch many lines each (Q6_K blocks of 210
// bytes), or to keep more bytes in flight than registers hold. They also provide commit(),
// wait_groups<n>(), region_bytes(halves) (a row's step), stage_bytes(halves) (the CTA's
// staging area) and the Params field stage_off (where it starts in dynamic shared memory).
// The sums are the same: only the loads differ.
template <class R, class = void>
struct IsStaged : std::false_type {};
template <class R>
struct IsStaged<R, std::void_t<decltype(R::kStaged)>> : std::bool_constant<R::kStaged> {};
template <class R>
__host__ __device__ constexpr int stage_slots() {
  if constexpr (IsStaged<R>::value) return R::kSlots;
  else return 1;
}

// Readers loading two steps ahead (R::kAhead): the stream's first two steps are issued before
// the grid wait (into cur and nxt), and each step's successor two ahead after its sums. For
// calls where a CTA's whole stream is those two steps (kq_ahead: one block of rows per CTA, two
// steps a row), every weight byte is in flight while the kernel before finishes. The same sums.
template <class R, class = void>
struct IsAhead : std::false_type {};
template <class R>
struct IsAhead<R, std::void_t<decltype(R::kAhead)>> : std::bool_constant<R::kAhead> {};

// Mixed readers (R::kMixed: blocks of rows of different weight types, one launch; with
// R::last_is_slow(p): whether the last weight's blocks take longest) may have their slow
// blocks moved to CTAs that take one block only (LinParams::move_n).
template <class R, class = void>
struct IsMixed : std::false_type {};
template <class R>
struct IsMixed<R, std::void_t<decltype(R::kMixed)>> : std::bool_constant<R::kMixed> {};

// The block of rows a CTA takes at position i of the persistent loop: i, except that the last
// move_n blocks (the slow ones) are taken at positions move_at .. move_at + move_n - 1, where
// no CTA takes a second block (those after shift up).
template <class P>
__device__ __forceinline__ int block_at(const P& p, int i) {
  if (p.move_n == 0 || i < p.move_at) return i;
  return i < p.move_at + p.move_n ? p.n_cb - p.move_n + (i - p.move_at) : i - p.move_n;
}

template <class R, int NR>
__global__ void __launch_bounds__(kThreads, R::min_blocks(NR)) direct_kernel(const typename R::Params p) {
  extern __shared__ __align__(16) uint8_t smem[];
  __shared__ float red[kGroup];
  __shared__ float inv[NR];  // fused RMSNorm factor of each row (1 without the norm)
  SPECD_TRACE_DECL;
  SPECD_TRACE_MARK(0);
  // (half groups: 16 "groups" of 16 lanes)
  const int hv = p.halves, lane = threadIdx.x % (kGroup >> hv), warp = threadIdx.x / (kGroup >> hv);
  const int warps = kWarps << hv;
  const int64_t K = p.K, row0 = (int64_t)blockIdx.y * NR;
  int32_t xoff[NR];  // x row offsets; rows past n repeat row n-1, their results are dropped
#pragma unroll
  for (int r = 0; r < NR; ++r) xoff[r] = (int32_t)(min(row0 + r, p.n - 1) * K);
  const int nc = R::units(p), ni = (nc + R::kSpan - 1) / R::kSpan;  // chunks per row, steps
  const int n_cb = p.n_cb, step = (int)gridDim.x;

  // the load stream: step l_i of block l_cb (rows lsrc, of type ltype)
  int l_cb = blockIdx.x, l_i = 0;
  const uint8_t* lsrc[kRpg];
  GgmlType ltype;
  {
    int j0;
    int64_t o;
    group_rows<kRpg>(p, block_at(p, l_cb), warp, warps, j0, o, lsrc);
    ltype = p.w[j0].type;
  }
  auto advance = [&] {  // the stream's next step
    if (++l_i == ni) {
      l_i = 0;
      l_cb += step;
      if (l_cb < n_cb) {
        int j0;
        int64_t o;
        group_rows<kRpg>(p, block_at(p, l_cb), warp, warps, j0, o, lsrc);
        ltype = p.w[j0].type;
      }
    }
  };
  auto fetch = [&](typename R::Chunk (&dst)[kRpg]) {
    if (l_cb >= n_cb) return;
    R::load(lsrc, nc, lane, l_i, dst, ltype);
    advance();
  };
  // staged: the group's ring of kSlots slots (kRpg row regions each); issue() copies the
  // stream's next step into slot l_seq % kSlots and commits it (an empty group past the end)
  constexpr bool kStaged = IsStaged<R>::value;
  constexpr int kSlots = stage_slots<R>();
  uint8_t* stage = nullptr;
  int l_seq = 0, c_seq = 0;  // steps issued, steps taken
  auto issue = [&] {
    if constexpr (kStaged) {
      if (l_cb < n_cb) {
        R::issue(p, lsrc, nc, lane, kGroup >> hv, l_i, stage + (l_seq % kSlots) * kRpg * R::region_bytes(hv));
        advance();
      }
      R::commit();
      ++l_seq;
    }
  };
  constexpr bool kAhead = IsAhead<R>::value;
  typename R::Chunk cur[kRpg], nxt[kRpg];
  if constexpr (kStaged) {
    stage = smem + p.stage_off + (size_t)warp * kSlots * kRpg * R::region_bytes(hv);
    for (int k = 0; k + 1 < kSlots; ++k) issue();
  } else {
    fetch(cur);
    if constexpr (kAhead) fetch(nxt);
  }

  gpu_grid_wait();
  gpu_grid_launch_dependents();
  SPECD_TRACE_MARK(1);

  // inv_r = 1/sqrt(mean(x_r^2) + eps): one fixed-order CTA reduction per row, in the same
  // pass over x as its preparation
  if (p.norm_w != nullptr) {
    float ss[NR];
#pragma unroll
    for (int r = 0; r < NR; ++r) ss[r] = 0.f;
    R::template prep<NR>(p, xoff, smem, ss);
#pragma unroll
    for (int r = 0; r < NR; ++r) {
      const float t = block_sum(ss[r], red);
      if (threadIdx.x == 0) inv[r] = rsqrtf(t / (float)K + p.eps);
    }
  } else {
    R::template prep<NR>(p, xoff, smem, nullptr);
    if (threadIdx.x < NR) inv[threadIdx.x] = 1.f;
  }
  __syncthreads();  // inv[] and x are visible
  SPECD_TRACE_MARK(2);

  for (int i_cb = blockIdx.x; i_cb < n_cb; i_cb += step) {
    const int cb = block_at(p, i_cb);
    GgmlType type;  // (for readers of mixed calls; the others ignore it)
    {
      int j;
      int64_t o;
      const uint8_t* src[kRpg];
      group_rows<kRpg>(p, cb, warp, warps, j, o, src);
      type = p.w[j].type;
    }
    float acc[kRpg][NR];
#pragma unroll
    for (int rr = 0; rr < kRpg; ++rr)
#pragma unroll
      for (int r = 0; r < NR; ++r) acc[rr][r] = 0.f;
    for (int i = 0; i < ni; ++i) {
      if constexpr (kStaged) {
        // the step kSlots - 1 ahead into the slot taken last, then this step's copies: landed
        // (this lane's: all but the latest kSlots - 1 groups), visible to the group, taken
        issue();
        R::template wait_groups<kSlots - 1>();
        group_sync();
        R::take(p, stage + (c_seq++ % kSlots) * kRpg * R::region_bytes(hv), nc, lane, i, cur);
        group_sync();  // every lane has its chunk before the slot is refilled
      } else if constexpr (!kAhead) {
        fetch(nxt);
      }
      R::template dot<NR>(p, cur, smem, nc, i, lane, acc, type);
      if constexpr (!kStaged) {
#pragma unroll
        for (int rr = 0; rr < kRpg; ++rr) cur[rr] = nxt[rr];
        if constexpr (kAhead) fetch(nxt);
      }
    }
    int j0;
    int64_t o_first;
    const uint8_t* src[kRpg];
    group_rows<kRpg>(p, cb, warp, warps, j0, o_first, src);
#pragma unroll
    for (int rr = 0; rr < kRpg; ++rr)
#pragma unroll
      for (int r = 0; r < NR; ++r) acc[rr][r] = (hv ? half_sum(acc[rr][r]) : group_sum(acc[rr][r])) * inv[r];
    group_store<kRpg, NR>(p, lane, row0, j0, o_first, acc);
  }
  SPECD_TRACE_MARK(3);
  SPECD_TRACE_RECORD(kTraceDirect, (unsigned long long)(uintptr_t)p.y ^ (unsigned long long)K << 48);
}

// SPECD_GPU_MIX_ORDER=0: mixed calls' blocks in their plain order (benchmarks).
inline bool mix_order_on() {
  static const bool on = env_value("SPECD_GPU_MIX_ORDER") != "0";
  return on;
}

template <class R, int NR>
void launch_tile(typename R::Params p, size_t smem, gpuStream_t s) {
  static std::once_flag once;  // allow the device's largest shared memory once per kernel
  std::call_once(once, [] {
    SPECD_GPU_CHECK(gpuFuncSetAttribute((direct_kernel<R, NR>), gpuFuncAttributeMaxDynamicSharedMemorySize,
                                        (int)(dev_limits().smem_per_block - kStaticSmem)));
  });
  int per_sm = 0;  // persistent CTAs: as many as fit at once
  SPECD_GPU_CHECK(gpuOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, (direct_kernel<R, NR>), kThreads, smem));
  const int64_t ctas = std::min<int64_t>(p.n_cb, (int64_t)std::max(per_sm, 1) * dev_limits().sms);
  // Mixed calls: the last weight's blocks (QKV with a Q6_K V: the slow ones) go to CTAs that
  // take no second block, where there are enough of them
  if constexpr (IsMixed<R>::value) {
    const int64_t slow = p.n_w > 1 && R::last_is_slow(p) ? p.n_cb - p.w[p.n_w - 1].cta0 : 0;
    if (mix_order_on() && slow > 0 && p.n_cb > ctas && p.n_cb + slow <= 2 * ctas) {
      p.move_n = (int32_t)slow;
      p.move_at = (int32_t)(ctas - slow);
    }
  }
  const dim3 grid((unsigned)ctas, (unsigned)ceil_div(p.n, NR));
  gpu_launch(R::kName, direct_kernel<R, NR>, grid, dim3(kThreads), smem, s, p);
}

// What every direct reader needs of a call: SPECD_GPU_DIRECT not "0", an engine that does not
// speculate (tensor_cores false; any engine with any_engine), n <= kMaxSmallBatch, 16-byte
// aligned data and rows a multiple of row_align bytes (a power of two, <= 16; the reader's
// loads say how much: 16 for 16-byte loads of every row).
inline bool applies(const LinearArgs& a, bool any_engine = false, size_t row_align = 16) {
  static const bool on = env_value("SPECD_GPU_DIRECT") != "0";
  if (!on || (a.tensor_cores && !any_engine) || a.n > kMaxSmallBatch) return false;
  for (int j = 0; j < a.n_w; ++j)
    if ((uintptr_t)a.w[j]->data % 16 != 0 || a.w[j]->row_stride % row_align != 0) return false;
  return true;
}

// Whether `row_bytes` of shared memory per row of x fit the largest tile on this device (the
// choice never depends on n: batch invariance).
inline bool tile_fits(size_t row_bytes) {
  return (size_t)kMaxTile * row_bytes + kStaticSmem <= dev_limits().smem_per_block;
}

// Rows of x per CTA for a call of n rows.
inline int tile_rows(int64_t n) { return n <= 1 ? 1 : n <= 2 ? 2 : kMaxTile; }

// SPECD_GPU_HALF_GROUPS=0: never half groups (benchmarks).
inline bool halves_on() {
  static const bool on = env_value("SPECD_GPU_HALF_GROUPS") != "0";
  return on;
}

// The call's parameters (the LinParams part, n_cb and halves), then the launch with
// `row_bytes` of shared memory per row of x of the tile (and a staged reader's staging area
// after them); `fill` sets the reader's own fields.
template <class R, class F>
void launch(const LinearArgs& a, size_t row_bytes, gpuStream_t s, F&& fill) {
  SPECD_CHECK(a.n * a.w[0]->n_in < (int64_t)1 << 31, "linear: x has more than 2^31 elements");
  typename R::Params p;
  p.halves = halves_on() && R::max_chunks(a.w[0]->n_in) <= kGroup / 2 ? 1 : 0;
  const int64_t blocks = fill_params(p, a, (int64_t)(kWarps << p.halves) * kRpg);
  SPECD_CHECK(blocks < (int64_t)1 << 31, "linear: too many output rows");
  p.n_cb = (int32_t)blocks;
  fill(p);
  const int nr = tile_rows(a.n);
  size_t smem = (size_t)nr * row_bytes;
  if constexpr (IsStaged<R>::value) {
    p.stage_off = (int32_t)smem;  // (row_bytes: a multiple of 16)
    smem += R::stage_bytes(p.halves);
  }
  if constexpr (IsAhead<R>::value) {  // (one row of x only: kq_linear)
    SPECD_CHECK(nr == 1, "linear: the two-steps-ahead reader takes one row of x");
    launch_tile<R, 1>(p, smem, s);
  } else {
    switch (nr) {
      case 1: launch_tile<R, 1>(p, smem, s); break;
      case 2: launch_tile<R, 2>(p, smem, s); break;
      default: launch_tile<R, kMaxTile>(p, smem, s); break;
    }
  }
}

}  // namespace direct
}  // namespace gpu
}  // namespace specd
