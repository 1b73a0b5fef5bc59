// specd/engine/engine.h: the coarse API Python sees. An Engine owns one model and many
// sequences (handles), each with its own KV cache, sampler state and counters; several
// sequences can later share one forward (continuous batching) without changing callers.
//
// Decode protocol: prefill(tokens) fills the KV and keeps the last logits. step() samples
// the next token from the current logits and leaves it *pending* (not yet in the KV); the
// next step() first forwards the pending token. So no forward is wasted on the final
// token, and a speculative step (draft k, verify [pending, d1..dk] in one forward, accept,
// roll back) slots in behind the same call, returning 1..k+1 tokens.
#pragma once
#include <cstdint>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>
#include "engine/sampler.h"
#include "model/kv_cache.h"
#include "model/model.h"

namespace specd {

struct EngineOptions {
  int64_t n_ctx = 0;        // tokens per sequence; 0 = min(n_ctx_train, 4096)
  int32_t n_threads = 0;    // 0 = all hardware threads
  bool kv_f16 = true;       // fp16 KV cache (default) or fp32
  int64_t max_batch = 256;  // positions per forward when prefilling (bounds scratch memory)
};

struct SeqStats {
  int64_t n_past = 0;        // positions in the KV cache
  int64_t n_prompt = 0;      // tokens given through prefill
  int64_t n_generated = 0;   // tokens returned by step()
  int64_t n_steps = 0;
  double prefill_seconds = 0, decode_seconds = 0;
};

class Engine {
 public:
  Engine(const ModelConfig& cfg, const std::vector<TensorRef>& tensors, const EngineOptions& opt);
  ~Engine();  // defined where Sequence is complete

  int32_t new_sequence();
  void free_sequence(int32_t seq);

  // Appends tokens (after any pending token) to the sequence, computing their logits.
  // logits_out (may be null): [n, n_vocab] if all_logits else [n_vocab] (last position).
  // Throws Error on context overflow or out-of-range token ids.
  void prefill(int32_t seq, const int32_t* tokens, int64_t n, float* logits_out, bool all_logits);

  void set_sampling(int32_t seq, const SamplingParams& p);  // validates

  // Samples the next token(s); see the protocol above. Needs a prefill first.
  std::vector<int32_t> step(int32_t seq);

  // Keeps the first n_past positions (drops later ones and any pending token).
  void truncate(int32_t seq, int64_t n_past);

  SeqStats stats(int32_t seq) const;
  const ModelConfig& config() const { return model_.config(); }
  int64_t n_ctx() const { return n_ctx_; }

 private:
  struct Sequence;
  Sequence& get(int32_t seq);
  const Sequence& get(int32_t seq) const;
  void forward_chunked(Sequence& s, const int32_t* tokens, int64_t n, float* logits_out,
                       bool all_logits);

  Model model_;
  EngineOptions opt_;
  int64_t n_ctx_ = 0;
  int32_t next_id_ = 1;
  std::unordered_map<int32_t, std::unique_ptr<Sequence>> seqs_;
  mutable std::mutex mu_;  // one engine call at a time (the GIL is released inside)
};

}  // namespace specd
