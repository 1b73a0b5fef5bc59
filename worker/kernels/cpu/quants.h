// specd/cpu/quants.h: GGUF block formats on the CPU: dequantization of rows and dot
// products of one stored row with a float32 activation vector. Activations stay float32
// (no 8-bit rounding, unlike llama.cpp), so results match float64 math to float32
// rounding. Scalar code is the reference; *_avx2.cpp files hold the fast paths, chosen at
// run time when the CPU has AVX2+FMA+F16C.
//
// Block layouts (little endian, `d`/`m`/`dmin` are fp16; QK = 32, QK_K = 256):
//   Q8_0 {d; int8 qs[32]}                       x = d*q
//   Q4_0 {d; u8 qs[16]}                         x = d*(q-8), q = low nibbles (elems 0..15) then high (16..31)
//   Q4_1 {d; m; u8 qs[16]}                      x = d*q + m
//   Q5_0 {d; u8 qh[4]; u8 qs[16]}               q |= bit j of qh (as u32) <<4 for elem j; x = d*(q-16)
//   Q5_1 {d; m; u8 qh[4]; u8 qs[16]}            x = d*q + m
//   Q4_K {d; dmin; u8 scales[12]; u8 qs[128]}   8 sub-blocks of 32, 6-bit scale/min each
//   Q5_K {d; dmin; u8 scales[12]; u8 qh[32]; u8 qs[128]}
//   Q6_K {u8 ql[128]; u8 qh[64]; int8 scales[16]; d}  16 sub-blocks of 16, x = d*sc*(q-32)
#pragma once
#include <cstdint>
#include "common/types.h"

namespace specd {

// dst[0..n) = values of one stored row (n a multiple of the block size).
void dequantize_row(GgmlType type, const void* src, float* dst, int64_t n);

// sum_i row[i] * x[i] over n elements, accumulated in float32 (fast path) - the result
// agrees with float64 math to a relative error of about n * 2^-24.
float dot_row(GgmlType type, const void* row, const float* x, int64_t n);

// Same, forcing the portable scalar code (tests compare both paths).
float dot_row_scalar(GgmlType type, const void* row, const float* x, int64_t n);

// True when the AVX2 paths are compiled in and the CPU supports them.
bool cpu_has_avx2();
// The hardware check alone (AVX2 + FMA + F16C), ignoring SPECD_SIMD.
bool cpu_supports_avx2_fma_f16c();
// Name of the active SIMD path ("avx2" or "scalar"), for stats and benchmarks.
const char* simd_path();

}  // namespace specd
