// specd/engine/engine.h: the coarse API Python sees. An Engine owns one model and many
// sequences (handles), each with its own KV cache, sampler state and counters; several
// sequences can later share one forward (continuous batching) without changing callers.
//
// Decode protocol: prefill(tokens) fills the KV and keeps the last logits. step() samples
// the next token from the current logits and leaves it *pending* (not yet in the KV); the
// next step() first forwards the pending token. So no forward is wasted on the final
// token, and a speculative step (draft k, verify [pending, d1..dk] in one forward, accept,
// roll back) slots in behind the same call, returning 1..k+1 tokens.
//
// Speculative decoding (per sequence, set_speculation): while a token is pending, step()
// asks the sequence's Drafter (drafter.h) for up to k tokens d1..dn, runs the target once
// over [pending, d1..dn] (n+1 positions, all logits), and walks the positions with the
// accept rule (accept.h) on the same penalised, transformed distributions plain sampling
// uses: it keeps d1..dm, samples the bonus token from position m, and rolls the target KV
// back to pending + d1..dm (the rejected rows are simply overwritten later); the drafter
// is told through commit(). Returns [d1..dm, bonus]; the bonus is the new pending token.
// Lossless: greedy output is token-for-token plain greedy (the forward is batch-invariant:
// a position's logits are bit-identical whatever the batch), and sampled output follows
// the target's distribution exactly (rejection sampling).
#pragma once
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>
#include "engine/drafter.h"
#include "engine/sampler.h"
#include "model/forward.h"

namespace specd {

struct EngineOptions {
  int64_t n_ctx = 0;        // tokens per sequence; 0 = min(n_ctx_train, 4096)
  int32_t n_threads = 0;    // 0 = all hardware threads
  bool kv_f16 = true;       // fp16 KV cache (default) or fp32
  int64_t max_batch = 256;  // positions per forward when prefilling (bounds scratch memory)
  std::string device = "cpu";  // "cpu" | "cuda:N" | "hip:N" (model/forward.h make_model)
  bool tensor_cores = false;   // GPU: decode/verify forwards on tensor cores (make_model); for speculation
  // Run-ahead: when step() returns a greedy token (argmax on the device, no drafter), it
  // queues that token's forward before returning, so the device works while the caller
  // handles the token; the next step() only waits for it. With 2 it also queues the forward
  // after it, whose input is that forward's argmax taken on the device, so the device never
  // idles between steps waiting for the host (the next step() waits for the first and queues
  // another). -1: 2 where the model queues forwards (GPU), else 0; 1 or 2: also on the CPU
  // (the forwards then run inside the returning step: for tests); 0: never. Output is
  // unchanged: the same forwards, the same bits.
  int32_t run_ahead = -1;
};

constexpr int32_t kMaxDraft = 32;  // largest k of set_speculation

struct SpecParams {
  std::string mode = "none";  // "none" | "draft" (the engine's draft model) | "ngram" | a registered drafter
  int32_t k = 4;              // tokens drafted per step, 1..kMaxDraft (clamped near the end of the context)
  int32_t ngram_min = 1;      // ngram: shortest suffix matched
  int32_t ngram_max = 3;      // ngram: longest suffix matched (tried first)
  void validate() const;      // throws Error naming the bad field
};

struct SeqStats {
  int64_t n_past = 0;        // positions in the KV cache
  int64_t n_prompt = 0;      // tokens given through prefill
  int64_t n_generated = 0;   // tokens returned by step()
  int64_t n_steps = 0;
  // decode_seconds: the time of step()s' work: their time inside step(), not counting waits for
  // a forward queued ahead (run-ahead), plus the device time of each such forward they used.
  double prefill_seconds = 0, decode_seconds = 0;
  // Speculation. A speculative step is a step() that forwards the target while a drafter is
  // set (including those where the drafter proposed nothing: they return 1 token), so the
  // mean acceptance length tau = spec_tokens / spec_steps counts them honestly.
  int64_t spec_steps = 0;
  int64_t spec_tokens = 0;                  // tokens returned by speculative steps
  int64_t drafted = 0, accepted = 0;        // draft tokens proposed / accepted
  std::vector<int64_t> drafted_at, accepted_at;  // [kMaxDraft]: steps that drafted / accepted draft i+1
  double draft_seconds = 0, verify_seconds = 0;  // inside decode_seconds
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

  // A second model of the same vocabulary for mode "draft" (throws Error if n_vocab
  // differs). At most once, before sequences use it; the tensors must outlive the Engine.
  void set_draft_model(const ModelConfig& cfg, const std::vector<TensorRef>& tensors);
  bool has_draft_model() const { return draft_model_ != nullptr; }

  // Benchmarks: seconds of each of `reps` forwards of n random tokens at positions
  // pos0.. on a scratch KV store, synchronised. all_rows: every row's argmax on the device
  // (a greedy verify); else a prefill (chunks of max_batch, last row's logits only).
  std::vector<double> bench_forward(int64_t n, int64_t pos0, int32_t reps, bool all_rows);
  MemoryInfo memory() const;

  // Makes mode `name` available to set_speculation (e.g. "dflash"); the factory builds one
  // Drafter per sequence. Replaces an earlier registration of the same name.
  using DrafterFactory = std::function<std::unique_ptr<Drafter>(const DrafterEnv&)>;
  void register_drafter(const std::string& name, DrafterFactory factory);

  // Turns speculation on ("draft", "ngram", a registered mode) or off ("none") for a
  // sequence; validates (k in 1..kMaxDraft, the mode exists). Takes effect at the next step.
  void set_speculation(int32_t seq, const SpecParams& p);
  // Whether turning this sequence's speculation off keeps its drafter for a switch back to
  // the same settings (a drafter is set and reads no target hidden states): what a governor
  // that pauses speculation may pause (worker/generate.py SpeculationGovernor).
  bool speculation_pausable(int32_t seq) const;

  // Samples the next token(s); see the protocol above. Needs a prefill first.
  std::vector<int32_t> step(int32_t seq);

  // Keeps the first n_past positions (drops later ones and any pending token).
  void truncate(int32_t seq, int64_t n_past);

  SeqStats stats(int32_t seq) const;
  const ModelConfig& config() const { return model_->config(); }
  std::string device() const { return model_->device(); }
  int64_t n_ctx() const { return n_ctx_; }
  // EngineOptions::run_ahead after construction (benchmarks compare both in one engine).
  int32_t run_ahead() const { return run_ahead_; }
  void set_run_ahead(int32_t depth);

 private:
  struct Sequence;
  Sequence& get(int32_t seq);
  const Sequence& get(int32_t seq) const;
  static bool pausable(const Sequence& s);  // speculation_pausable of s
  void forward_chunked(Sequence& s, const int32_t* tokens, int64_t n, float* logits_out,
                       bool all_logits);
  void forward_pending(Sequence& s);
  int32_t sample_pending(Sequence& s);
  bool device_greedy(const Sequence& s) const;
  bool speculative_step(Sequence& s, int64_t k, std::vector<int32_t>& out);
  void target_forward(Sequence& s, const int32_t* tokens, int64_t n, float* logits, bool all_logits);
  void commit(Sequence& s, int64_t n_new, int64_t row0 = 0);
  // Run-ahead (EngineOptions::run_ahead). One sequence at a time has forwards queued ahead:
  // every call that may touch the model or a KV store first settles them (waits for them and
  // keeps their argmax in the sequence; a step() of that sequence waits for its oldest only);
  // a call that changes the sequence drops them.
  void start_ahead(Sequence& s);
  void settle(bool oldest = false);
  void drop_ahead(Sequence& s);

  std::unique_ptr<ForwardModel> model_;
  std::unique_ptr<ForwardModel> draft_model_;  // mode "draft" (same device); null = none
  std::map<std::string, DrafterFactory> factories_;
  EngineOptions opt_;
  int64_t n_ctx_ = 0;
  int32_t next_id_ = 1;
  std::unordered_map<int32_t, std::unique_ptr<Sequence>> seqs_;
  int32_t run_ahead_ = 0;          // forwards queued ahead at most (EngineOptions::run_ahead)
  Sequence* inflight_ = nullptr;  // whose forwards ahead are queued and not all waited for
  mutable std::mutex mu_;  // one engine call at a time (the GIL is released inside)
};

}  // namespace specd
