// TEMPORARY stub (replaced by the real implementation before landing).
#include "cpu/ops.h"
namespace specd {
void rope(float*, const int32_t*, int64_t, int64_t, int64_t, const RopeParams&) { throw Error("not implemented"); }
}  // namespace specd
