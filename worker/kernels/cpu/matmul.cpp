// TEMPORARY stub (replaced by the real implementation before landing).
#include "cpu/matmul.h"
namespace specd {
void matmul(const WeightView&, const float*, int64_t, float*) { throw Error("not implemented"); }
}  // namespace specd
