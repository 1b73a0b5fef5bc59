// TEMPORARY stub (replaced by the real implementation before landing).
#include "model/kv_cache.h"
#include "common/types.h"
namespace specd {
KvCache::KvCache(int32_t, int64_t, int64_t, bool) { throw Error("not implemented"); }
void KvCache::write(int32_t, int64_t, int64_t, const float*, const float*) { throw Error("not implemented"); }
KvView KvCache::k(int32_t) const { throw Error("not implemented"); }
KvView KvCache::v(int32_t) const { throw Error("not implemented"); }
size_t KvCache::bytes() const { return 0; }
}  // namespace specd
