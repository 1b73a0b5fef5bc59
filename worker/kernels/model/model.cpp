// TEMPORARY stub (replaced by the real implementation before landing).
#include "model/model.h"
namespace specd {
void ModelConfig::validate() const { throw Error("not implemented"); }
Model::Model(const ModelConfig& cfg, const std::vector<TensorRef>&) : cfg_(cfg) { throw Error("not implemented"); }
void Model::forward(KvCache&, const int32_t*, int64_t, int64_t, float*, bool) const { throw Error("not implemented"); }
}  // namespace specd
