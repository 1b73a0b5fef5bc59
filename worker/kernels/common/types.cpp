// specd/common/types.cpp: the table of supported tensor types.
#include "common/types.h"

namespace specd {

namespace {
// Block layouts (bytes): see cpu/quants.h for the field order of each block.
const TypeTraits kTraits[] = {
    {GgmlType::F32, "F32", 1, 4},     {GgmlType::F16, "F16", 1, 2},
    {GgmlType::BF16, "BF16", 1, 2},   {GgmlType::Q8_0, "Q8_0", 32, 34},
    {GgmlType::Q4_0, "Q4_0", 32, 18}, {GgmlType::Q4_1, "Q4_1", 32, 20},
    {GgmlType::Q5_0, "Q5_0", 32, 22}, {GgmlType::Q5_1, "Q5_1", 32, 24},
    {GgmlType::Q4_K, "Q4_K", 256, 144}, {GgmlType::Q5_K, "Q5_K", 256, 176},
    {GgmlType::Q6_K, "Q6_K", 256, 210},
};
}  // namespace

bool type_supported(int32_t type) {
  for (const auto& t : kTraits)
    if ((int32_t)t.type == type) return true;
  return false;
}

std::string supported_type_names() {
  std::string s;
  for (const auto& t : kTraits) {
    if (!s.empty()) s += ", ";
    s += t.name;
  }
  return s;
}

const TypeTraits& type_traits(int32_t type) {
  for (const auto& t : kTraits)
    if ((int32_t)t.type == type) return t;
  throw Error("unsupported tensor type id " + std::to_string(type) +
              "; supported: " + supported_type_names());
}

size_t row_bytes(GgmlType type, int64_t n) {
  const TypeTraits& t = type_traits((int32_t)type);
  SPECD_CHECK(n >= 0 && n % t.block_elems == 0,
              std::string("row of ") + std::to_string(n) + " elements is not a multiple of the " +
                  t.name + " block size " + std::to_string(t.block_elems));
  return (size_t)(n / t.block_elems) * (size_t)t.block_bytes;
}

}  // namespace specd
