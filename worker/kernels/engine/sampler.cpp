// TEMPORARY stub (replaced by the real implementation before landing).
#include "engine/sampler.h"
#include "common/types.h"
namespace specd {
void SamplingParams::validate() const { throw Error("not implemented"); }
void apply_penalties(float*, int64_t, const SamplingParams&, const int32_t*, int64_t, const int32_t*, int64_t) { throw Error("not implemented"); }
void sampling_probs(const float*, int64_t, const SamplingParams&, float*) { throw Error("not implemented"); }
int32_t argmax(const float*, int64_t) { throw Error("not implemented"); }
int32_t sample_from(const float*, int64_t, double) { throw Error("not implemented"); }
Rng::Rng(uint64_t) : s_{} {}
uint64_t Rng::next_u64() { throw Error("not implemented"); }
double Rng::uniform() { throw Error("not implemented"); }
}  // namespace specd
