// TEMPORARY stub (replaced by the real implementation before landing).
#include "cpu/quants.h"
namespace specd {
void dequantize_row(GgmlType, const void*, float*, int64_t) { throw Error("not implemented"); }
float dot_row(GgmlType, const void*, const float*, int64_t) { throw Error("not implemented"); }
float dot_row_scalar(GgmlType, const void*, const float*, int64_t) { throw Error("not implemented"); }
bool cpu_has_avx2() { return false; }
const char* simd_path() { return "scalar"; }
}  // namespace specd
