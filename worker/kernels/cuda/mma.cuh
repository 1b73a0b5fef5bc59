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

namespace specd {
namespace gpu {

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

}  // namespace gpu
}  // namespace specd
