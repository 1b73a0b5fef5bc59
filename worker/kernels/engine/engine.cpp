// TEMPORARY stub (replaced by the real implementation before landing).
#include "engine/engine.h"
namespace specd {
struct Engine::Sequence {};
Engine::Engine(const ModelConfig& cfg, const std::vector<TensorRef>& t, const EngineOptions& o) : model_(cfg, t), opt_(o) {}
int32_t Engine::new_sequence() { throw Error("not implemented"); }
void Engine::free_sequence(int32_t) { throw Error("not implemented"); }
void Engine::prefill(int32_t, const int32_t*, int64_t, float*, bool) { throw Error("not implemented"); }
void Engine::set_sampling(int32_t, const SamplingParams&) { throw Error("not implemented"); }
std::vector<int32_t> Engine::step(int32_t) { throw Error("not implemented"); }
void Engine::truncate(int32_t, int64_t) { throw Error("not implemented"); }
SeqStats Engine::stats(int32_t) const { throw Error("not implemented"); }
}  // namespace specd
namespace specd { Engine::~Engine() = default; }
