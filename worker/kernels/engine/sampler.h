// specd/engine/sampler.h: turning logits into a token. The transforms are pure
// functions so that speculative verification (a later issue) applies exactly the same
// distribution as plain sampling. Order (as vLLM / HF): penalties -> temperature ->
// top-k -> top-p -> min-p -> renormalise -> draw.
#pragma once
#include <cstdint>
#include <vector>

namespace specd {

struct SamplingParams {
  float temperature = 1.0f;         // 0 = greedy (argmax, lowest id on ties)
  int32_t top_k = 0;                // keep the k most likely; 0 = off
  float top_p = 1.0f;               // keep the smallest prefix with mass >= top_p; 1 = off
  float min_p = 0.0f;               // keep tokens with p >= min_p * p_max; 0 = off
  float repetition_penalty = 1.0f;  // CTRL-style, over prompt + generated tokens; 1 = off
  float presence_penalty = 0.0f;    // OpenAI: minus this once per token seen in the output
  float frequency_penalty = 0.0f;   // OpenAI: minus this times the token's output count
  uint64_t seed = 0;                // same seed + same inputs -> same tokens
  // Throws Error with a clear message for out-of-range values:
  // temperature >= 0 finite, top_k >= 0, 0 < top_p <= 1, 0 <= min_p <= 1,
  // repetition_penalty > 0, |presence|,|frequency| <= 2.
  void validate() const;
  bool greedy() const { return temperature == 0.0f; }
  bool has_penalties() const {
    return repetition_penalty != 1.0f || presence_penalty != 0.0f || frequency_penalty != 0.0f;
  }
};

// In place on logits[n_vocab]:
//   repetition: for each distinct token t in prompt+generated: l = l > 0 ? l / r : l * r
//   presence/frequency: for each distinct t in generated: l -= presence + frequency * count(t)
void apply_penalties(float* logits, int64_t n_vocab, const SamplingParams& p,
                     const int32_t* prompt, int64_t n_prompt, const int32_t* generated,
                     int64_t n_generated);

// probs[n_vocab] = the final distribution after temperature, top-k, top-p, min-p on
// (already penalised) logits; exactly 0 outside the kept set, sums to 1. For greedy
// params it is one-hot on the argmax. Ties at a top-k / top-p boundary keep lower ids.
void sampling_probs(const float* logits, int64_t n_vocab, const SamplingParams& p, float* probs);

// Index of the largest value; the lowest index on ties.
int32_t argmax(const float* x, int64_t n);

// The smallest i with cumsum(probs[0..i]) > u * sum(probs), u in [0, 1). Accumulated
// in double so the tests' numpy twin agrees exactly.
int32_t sample_from(const float* probs, int64_t n, double u);

// xoshiro256** seeded through splitmix64: fixed, portable, fast.
class Rng {
 public:
  explicit Rng(uint64_t seed = 0);
  uint64_t next_u64();
  double uniform();  // [0, 1) with 53 random bits
 private:
  uint64_t s_[4];
};

}  // namespace specd
