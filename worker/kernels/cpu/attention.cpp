// TEMPORARY stub (replaced by the real implementation before landing).
#include "cpu/ops.h"
namespace specd {
void attention(const float*, const KvView&, const KvView&, int64_t, int64_t, int32_t, int32_t, int32_t, float, float*) { throw Error("not implemented"); }
}  // namespace specd
