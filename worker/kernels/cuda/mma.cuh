// specd/cuda/mma.cuh: the NVIDIA sm_80+ tensor-core and asynchronous-copy instructions that
// matvec_tc.cu and matmul.cu use, as inline PTX. SPECD_MMA is 1 in device code compiled for
// sm_80+ on CUDA, else 0 (HIP, older targets, host code): code that uses these helpers sits
// under `#if SPECD_MMA`, and its host side chooses it with dev_limits().mma.
#pragma once
#include <cstdint>

#include "cuda/common.cuh"

#if !SPECD_HIP && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
#define SPECD_MMA 1
#else
#define SPECD_MMA 0
#endif

// SPECD_WGMMA is 1 in device code compiled for sm_90a (Hopper's warpgroup MMA: the
// architecture-specific target, "90a" in the CMake list), else 0. Its host side chooses it
// with dev_limits().wgmma, which needs the build to have had 90a in its list (SPECD_SM90A).
#if !SPECD_HIP && defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define SPECD_WGMMA 1
#else
#define SPECD_WGMMA 0
#endif

namespace specd {
namespace gpu {

#if SPECD_MMA
// MMA accumulators (MT m-tiles x NT n-tiles of the 4 floats a lane holds of each) set to zero
template <int MT, int NT>
__device__ __forceinline__ void zero_tiles(float (&a)[MT][NT][4]) {
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int t = 0; t < NT; ++t)
#pragma unroll
      for (int e = 0; e < 4; ++e) a[mt][t][e] = 0.f;
}

// d += A (16 x 16, rows g/g+8, slots 2c.. and 2c+8..) * B (16 x 8), fp16 in, float32 accumulate
__device__ __forceinline__ void mma16816(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Four 8x8 fp16 matrices from shared memory: lanes 8i..8i+7 give the row addresses of matrix
// i (16 bytes each); lane l receives row l / 4, elements 2 (l % 4) and 2 (l % 4) + 1 of each.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* smem_row) {
  const uint32_t a = (uint32_t)__cvta_generic_to_shared(smem_row);
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(a));
}

// The same with each matrix transposed: lane l receives column l / 4, rows 2 (l % 4) and
// 2 (l % 4) + 1 (B fragments from a row-major [k][n] tile).
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* smem_row) {
  const uint32_t a = (uint32_t)__cvta_generic_to_shared(smem_row);
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(a));
}

// Exact integer products of 8-bit operands (s32 sums, from c): d = c + A (16 x 32: a0 rows g,
// slots 4c..4c+3; a1 rows g + 8, the same slots; a2, a3 the same at slots 16 + 4c..) * B
// (32 x 8: b0 slots 4c.., b1 16 + 4c.., column g); d0, d1 = row g, columns 2c, 2c + 1; d2, d3 =
// row g + 8. kAS / kBS: signed (s8) or unsigned (u8) operands.
template <bool kAS, bool kBS>
__device__ __forceinline__ void mma_i8_k32(int (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1, int c = 0) {
#define SPECD_MMA_K32(AT, BT)                                                                          \
  asm volatile("mma.sync.aligned.m16n8k32.row.col.s32." AT "." BT ".s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, " \
               "{%8,%9}, {%10,%10,%10,%10};\n"                                                       \
               : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])                                        \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "r"(c))
  if constexpr (kAS && kBS) SPECD_MMA_K32("s8", "s8");
  else if constexpr (kAS) SPECD_MMA_K32("s8", "u8");
  else if constexpr (kBS) SPECD_MMA_K32("u8", "s8");
  else SPECD_MMA_K32("u8", "u8");
#undef SPECD_MMA_K32
}
// The same for 16 slots: A 16 x 16 (a0 row g, slots 4c..4c+3; a1 row g + 8), B 16 x 8 (b0).
template <bool kAS, bool kBS>
__device__ __forceinline__ void mma_i8_k16(int (&d)[4], uint32_t a0, uint32_t a1, uint32_t b0, int c = 0) {
#define SPECD_MMA_K16(AT, BT)                                                                                 \
  asm volatile("mma.sync.aligned.m16n8k16.row.col.s32." AT "." BT ".s32 {%0,%1,%2,%3}, {%4,%5}, {%6}, "       \
               "{%7,%7,%7,%7};\n"                                                                            \
               : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])                                               \
               : "r"(a0), "r"(a1), "r"(b0), "r"(c))
  if constexpr (kAS && kBS) SPECD_MMA_K16("s8", "s8");
  else if constexpr (kAS) SPECD_MMA_K16("s8", "u8");
  else if constexpr (kBS) SPECD_MMA_K16("u8", "s8");
  else SPECD_MMA_K16("u8", "u8");
#undef SPECD_MMA_K16
}

__device__ __forceinline__ uint32_t h2_bits(__half2 v) { return *reinterpret_cast<uint32_t*>(&v); }

// 16 bytes global -> shared, asynchronously (L2 only), of which the first `bytes` (0..16) are
// read and the rest zero-filled (src must still be a valid address).
__device__ __forceinline__ void cp_async16_n(void* smem, const void* src, int bytes) {
  const uint32_t a = (uint32_t)__cvta_generic_to_shared(smem);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(a), "l"(src), "r"(bytes) : "memory");
}
// All 16 bytes (no source-size operand: the cheapest form).
__device__ __forceinline__ void cp_async16_all(void* smem, const void* src) {
  const uint32_t a = (uint32_t)__cvta_generic_to_shared(smem);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(a), "l"(src) : "memory");
}
// All 16 bytes, or zeros when !valid (src is then not read).
__device__ __forceinline__ void cp_async16(void* smem, const void* src, bool valid) {
  cp_async16_n(smem, src, valid ? 16 : 0);
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
// Waits until at most `pending` of this thread's committed groups are still in flight.
template <int pending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(pending) : "memory");
}
#endif

#if SPECD_WGMMA
// The shared-memory matrix descriptor of a K-major operand tile stored with the 128-byte
// swizzle: rows of 64 halves (128 bytes), 8-row groups 1024 bytes apart, the 16-byte piece c
// of row r at piece c ^ (r % 8) (the tile 1024-byte aligned). Adding 2 to the descriptor moves
// its start 32 bytes along K: the next 16 elements.
__device__ __forceinline__ uint64_t wgmma_desc_sw128(const void* tile) {
  const uint32_t a = (uint32_t)__cvta_generic_to_shared(tile);
  return (uint64_t)((a & 0x3FFFF) >> 4) | (uint64_t)1 << 16 | (uint64_t)(1024 >> 4) << 32 | (uint64_t)1 << 62;
}
// Orders this warpgroup's register and shared-memory writes before its next wgmma.
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
// Waits until at most `pending` of the warpgroup's committed wgmma groups are in flight.
template <int pending>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(pending) : "memory");
}
// Makes this thread's generic-proxy shared-memory writes (cp.async, st.shared) visible to the
// async proxy that wgmma reads shared memory through.
__device__ __forceinline__ void fence_proxy_async_shared() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
// Keeps the compiler from moving accesses to the accumulators across a wgmma boundary.
template <int R>
__device__ __forceinline__ void wgmma_pin(float (&d)[R]) {
#pragma unroll
  for (int i = 0; i < R; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
// d (64 x N, float32) += A (64 x 16, fp16, descriptor da) times B^T (B: N x 16, fp16,
// descriptor db), both K-major, asynchronously (wgmma_commit, wgmma_wait); N = 128 or 256.
// The warpgroup's 128 threads hold d: lane l of warp w of the group has rows 16 w + l / 4 (in
// d[4 i], d[4 i + 1]) and 16 w + l / 4 + 8 (d[4 i + 2], d[4 i + 3]), columns 8 i + 2 (l % 4), + 1.
template <int N>
__device__ void wgmma_m64k16(float (&d)[N / 2], uint64_t da, uint64_t db);
// (the accumulator operands: 8 of d from d[i], 64 from d[i])
#define SPECD_ACC8(i)                                                                                      \
  "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), "+f"(d[i + 6]), \
      "+f"(d[i + 7])
#define SPECD_ACC64(i)                                                                                    \
  SPECD_ACC8(i), SPECD_ACC8(i + 8), SPECD_ACC8(i + 16), SPECD_ACC8(i + 24), SPECD_ACC8(i + 32), SPECD_ACC8(i + 40), \
      SPECD_ACC8(i + 48), SPECD_ACC8(i + 56)
#define SPECD_REGS_0_63 \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
  "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
  "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define SPECD_REGS_64_127 \
  "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, " \
  "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, " \
  "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, " \
  "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
template <>
__device__ __forceinline__ void wgmma_m64k16<128>(float (&d)[64], uint64_t da, uint64_t db) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 {" SPECD_REGS_0_63 "}, %64, %65, p, 1, 1, 0, 0;\n}\n"
      : SPECD_ACC64(0)
      : "l"(da), "l"(db), "r"(1));
}
template <>
__device__ __forceinline__ void wgmma_m64k16<256>(float (&d)[128], uint64_t da, uint64_t db) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.f16.f16 {" SPECD_REGS_0_63 ", " SPECD_REGS_64_127
      "}, %128, %129, p, 1, 1, 0, 0;\n}\n"
      : SPECD_ACC64(0), SPECD_ACC64(64)
      : "l"(da), "l"(db), "r"(1));
}
#undef SPECD_ACC8
#undef SPECD_ACC64
#undef SPECD_REGS_0_63
#undef SPECD_REGS_64_127
#endif

}  // namespace gpu
}  // namespace specd
