// specd/engine/drafter.h: the interface every speculative drafter implements (draft
// model, n-gram lookup, DFlash block drafter). One Drafter object serves ONE sequence
// (it may keep per-sequence state: a draft KV cache, context features); shared weights
// live outside it (e.g. the Engine's draft Model) and are handed in at construction.
//
// The engine's speculative step (engine.cpp) drives it:
//   1. draft(ctx, k, tokens, q)      propose up to k tokens after ctx.tokens
//   2. the target verifies [pending, d1..dn] in ONE forward of n+1 positions, the accept
//      rule (engine/accept.h) keeps a prefix d1..dm and appends a bonus token
//   3. commit(info)                  the target's KV now holds exactly info.n_past
//      positions (prompt + accepted output; the bonus is the new pending token)
// rollback(n_past) is called when the sequence loses positions for other reasons
// (truncate(), an error). Drafters must stay correct if commit/rollback report fewer
// positions than they have seen: positions >= n_past are gone and will be replaced.
//
// Exactness does not depend on the drafter: any proposal is verified by the target. A
// drafter only has to report its proposal distribution q honestly when sampling (a
// deterministic proposal, e.g. argmax or n-gram, is one-hot and needs no q).
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "engine/sampler.h"

namespace specd {

class ForwardModel;
class DFlashModel;

// What a drafter may read when asked to draft. Pointers are valid for the call only.
struct DraftContext {
  // The committed sequence: the target KV's positions 0..n_past-1 followed by the pending
  // token (sampled, not yet forwarded), i.e. n_tokens = n_past + 1. Drafts continue it.
  const int32_t* tokens = nullptr;  // [n_tokens]
  int64_t n_tokens = 0;
  int64_t n_past = 0;               // positions in the target's KV cache (= n_tokens - 1)
  // The same tokens split as the penalties see them (sampler.h apply_penalties): prefilled
  // ones, and generated ones (returned by step(), the pending token last). A drafter that
  // samples applies penalties with `generated` extended by its own drafts so far.
  const int32_t* prompt = nullptr;     // [n_prompt]
  int64_t n_prompt = 0;
  const int32_t* generated = nullptr;  // [n_generated]
  int64_t n_generated = 0;
  const SamplingParams* params = nullptr;  // the sequence's sampling parameters
  Rng* rng = nullptr;               // the draft's own random stream (never the target's)
};

// Target hidden states handed to drafters that ask for them (hidden_layers() non-empty).
// Row r is position pos0 + r; entry j of a row is the residual stream AFTER target block
// layers[j] (the input of block layers[j] + 1), float32.
struct HiddenStates {
  const float* data = nullptr;  // [n_pos, n_layers, dim]
  int64_t pos0 = 0;
  int64_t n_pos = 0;
  int32_t n_layers = 0;         // = hidden_layers().size()
  int32_t dim = 0;              // the target's n_embd
};

// What changed in the target's KV cache (after a prefill or a verified step).
struct CommitInfo {
  const int32_t* tokens = nullptr;  // [n_past] every token now in the target's KV
  int64_t n_past = 0;               // positions in the target's KV after the change
  int64_t n_new = 0;                // positions n_past - n_new .. n_past - 1 are newly committed
  const HiddenStates* hidden = nullptr;  // their hidden states (rows = the n_new new positions),
                                         // non-null only for drafters that asked for layers
};

class Drafter {
 public:
  virtual ~Drafter() = default;

  // Short name for stats and errors: "draft", "ngram", "dflash".
  virtual const char* name() const = 0;

  // Target layers whose outputs this drafter reads through CommitInfo::hidden (empty =
  // none; the target then captures nothing). Asked once, right after construction.
  virtual std::vector<int32_t> hidden_layers() const { return {}; }

  // Proposes up to k (>= 1) tokens continuing ctx.tokens. On return:
  //   tokens: resized to n in 0..k, the proposals (n = 0: nothing to propose; the engine
  //           then takes a plain step);
  //   q:      left EMPTY for a deterministic proposal (one-hot on each token), or resized
  //           to [n, n_vocab] with row i = the distribution tokens[i] was drawn from,
  //           after the same sampling transforms as the target (sampling_probs of the
  //           penalised logits). Only read when the sequence samples (temperature > 0).
  // Must not touch the target's KV cache. May throw Error (the step then fails cleanly).
  virtual void draft(const DraftContext& ctx, int k, std::vector<int32_t>& tokens,
                     std::vector<float>& q) = 0;

  // The target's KV now holds info.n_past positions (see CommitInfo). Called after every
  // target forward that commits positions: each prefill chunk (<= max_batch positions),
  // a plain step's pending token, a speculative step's pending token + accepted drafts.
  virtual void commit(const CommitInfo& info) {}

  // The target's KV was cut back to n_past positions (truncate(), or a failed call).
  virtual void rollback(int64_t n_past) {}
};

// What a drafter factory gets from the engine (see Engine::register_drafter).
struct DrafterEnv {
  const ForwardModel* target = nullptr;  // the target model (shared token embedding / output head)
  int64_t n_ctx = 0;              // positions per sequence
  bool kv_f16 = true;             // the engine's KV cache type
};

// The built-in drafters (engine/draft_model.cpp, engine/ngram.cpp).
// A second model of the same vocabulary, with its own KV cache for this sequence. The
// caller keeps `draft` alive (the Engine owns it).
std::unique_ptr<Drafter> make_draft_model_drafter(const ForwardModel& draft, const DrafterEnv& env);
// Prompt lookup: the continuation of the latest earlier occurrence of the last n tokens,
// n from ngram_max down to ngram_min (1 <= ngram_min <= ngram_max).
std::unique_ptr<Drafter> make_ngram_drafter(int32_t ngram_min, int32_t ngram_max);
// The DFlash block drafter (engine/dflash_drafter.cpp; model/dflash.h), registered with
// Engine::register_drafter("dflash", ...) by whoever loads the DFlash model.
std::unique_ptr<Drafter> make_dflash_drafter(const DFlashModel& draft, const DrafterEnv& env);

}  // namespace specd
