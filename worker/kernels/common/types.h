// specd/common/types.h: tensor element types (GGML numbering, as stored in GGUF files),
// their block layouts, fp16/bf16 conversion, and the one error type every C++ failure
// uses (mapped to one Python exception in bindings/module.cpp).
#pragma once
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>

namespace specd {

// Every failure the engine reports to Python. Messages say what was wrong, what was
// expected and, where it helps, what to do.
struct Error : std::runtime_error {
  explicit Error(const std::string& msg) : std::runtime_error(msg) {}
};

#define SPECD_CHECK(cond, msg)                          \
  do {                                                  \
    if (!(cond)) throw ::specd::Error(std::string(msg)); \
  } while (0)

// Numbering identical to ggml's `enum ggml_type` (and gguf.GGMLQuantizationType).
enum class GgmlType : int32_t {
  F32 = 0, F16 = 1, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8,
  Q4_K = 12, Q5_K = 13, Q6_K = 14, BF16 = 30,
};

struct TypeTraits {
  GgmlType type;
  const char* name;
  int32_t block_elems;  // elements per block (1 for float types)
  int32_t block_bytes;  // bytes per block
};

// Traits of a supported type; throws Error naming the supported types otherwise.
const TypeTraits& type_traits(int32_t type);
bool type_supported(int32_t type);
std::string supported_type_names();  // "F32, F16, BF16, Q8_0, ..."
// Bytes of one row of n elements; throws if n is not a multiple of the block size.
size_t row_bytes(GgmlType type, int64_t n);

// ---- scalar float conversions (IEEE half, bfloat16) ----
inline float fp16_to_fp32(uint16_t h) {
  const uint32_t sign = (uint32_t)(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1f, mant = h & 0x3ff, bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      exp = 127 - 15 + 1;
      while ((mant & 0x400) == 0) { mant <<= 1; --exp; }
      mant &= 0x3ff;
      bits = sign | (exp << 23) | (mant << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// Round-to-nearest-even fp32 -> fp16 (as numpy's astype(float16)).
inline uint16_t fp32_to_fp16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint32_t sign = (x >> 16) & 0x8000;
  int32_t exp = (int32_t)((x >> 23) & 0xff) - 127 + 15;
  uint32_t mant = x & 0x7fffff;
  if (((x >> 23) & 0xff) == 0xff) return (uint16_t)(sign | 0x7c00 | (mant ? 0x200 : 0));
  if (exp >= 31) return (uint16_t)(sign | 0x7c00);
  if (exp <= 0) {
    if (exp < -10) return (uint16_t)sign;
    mant |= 0x800000;
    const uint32_t shift = (uint32_t)(14 - exp);
    uint32_t half = mant >> shift;
    const uint32_t rem = mant & ((1u << shift) - 1), mid = 1u << (shift - 1);
    if (rem > mid || (rem == mid && (half & 1))) ++half;
    return (uint16_t)(sign | half);
  }
  uint32_t half = sign | ((uint32_t)exp << 10) | (mant >> 13);
  const uint32_t rem = mant & 0x1fff;
  if (rem > 0x1000 || (rem == 0x1000 && (half & 1))) ++half;  // may carry into exp: correct
  return (uint16_t)half;
}

inline float bf16_to_fp32(uint16_t h) {
  const uint32_t bits = (uint32_t)h << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

}  // namespace specd
