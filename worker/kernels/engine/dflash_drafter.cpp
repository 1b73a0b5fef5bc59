// specd/engine/dflash_drafter.cpp: the DFlash block drafter behind the Drafter interface
// (drafter.h), one object per sequence. The maths is model/dflash.h; this file keeps the
// sequence's draft KV cache in step with the target and turns block logits into tokens.
//
// Sync: the draft cache holds the context keys/values of target positions 0..n_cached-1.
// commit() appends the hidden states of newly committed positions (after a prefill, the
// prompt; after a verified step, the pending token and the accepted drafts) and rollback()
// just lowers n_cached (rows past it are overwritten later). If the cache ever misses a
// committed position (the engine committed without hidden states), draft() proposes
// nothing rather than draft from a wrong context; exactness never depends on drafts.
//
// Drafting: one block at positions n_past .. n_past+B-1 from [pending, MASK x (B-1)],
// B = block_size always (the drafters are trained on full blocks); drafts are block rows
// 1..n, n = min(k, B-1). Greedy: argmax of the (penalised) logits. Sampling: row i drawn
// from sampling_probs of its penalised logits (penalties over the history extended by the
// earlier drafts), which is then q's row i.
#include <algorithm>
#include <cstring>
#include <memory>
#include <string>

#include "common/types.h"
#include "engine/drafter.h"
#include "model/dflash.h"
#include "model/kv_cache.h"
#include "model/model.h"

namespace specd {

namespace {

class DFlashDrafter final : public Drafter {
 public:
  DFlashDrafter(const DFlashModel& m, const DrafterEnv& env)
      : m_(m), target_(*env.target), kv_(m.new_cache(env.n_ctx, env.kv_f16)) {
    const DFlashConfig& c = m.config();
    embd_.resize((size_t)c.block_size * c.dim);
    hidden_.resize((size_t)c.block_size * c.dim);
  }

  const char* name() const override { return "dflash"; }

  std::vector<int32_t> hidden_layers() const override { return m_.config().target_layer_ids; }

  void draft(const DraftContext& ctx, int k, std::vector<int32_t>& tokens, std::vector<float>& q) override {
    tokens.clear();
    q.clear();
    if (k < 1 || ctx.n_tokens < 1 || n_cached_ != ctx.n_past) return;  // context incomplete: no proposal
    const DFlashConfig& c = m_.config();
    const int64_t B = c.block_size, nv = c.n_vocab, dim = c.dim;
    const int64_t n = std::min<int64_t>(k, B - 1);
    SPECD_CHECK(ctx.n_past + B <= kv_.n_ctx(), "DFlash: a block at position " + std::to_string(ctx.n_past) +
                                                   " passes the end of the draft cache");

    m_.block_input(target_.token_embedding(), ctx.tokens[ctx.n_tokens - 1], B, embd_.data());
    m_.forward_block(kv_, embd_.data(), B, ctx.n_past, hidden_.data());
    logits_.resize((size_t)(n * nv));
    m_.logits(target_.output_head(), hidden_.data() + dim, n, logits_.data());  // rows 1..n

    const SamplingParams* sp = ctx.params;
    const bool greedy = sp == nullptr || sp->greedy();
    gen_.assign(ctx.generated, ctx.generated + ctx.n_generated);
    work_.resize((size_t)nv);
    if (!greedy) q.resize((size_t)(n * nv));
    for (int64_t i = 0; i < n; ++i) {
      std::memcpy(work_.data(), logits_.data() + i * nv, sizeof(float) * (size_t)nv);
      if (sp) apply_penalties(work_.data(), nv, *sp, ctx.prompt, ctx.n_prompt, gen_.data(), (int64_t)gen_.size());
      int32_t t;
      if (greedy) {
        t = argmax(work_.data(), nv);
      } else {
        float* qi = q.data() + i * nv;  // [n_vocab] the distribution t is drawn from
        sampling_probs(work_.data(), nv, *sp, qi);
        t = sample_from(qi, nv, ctx.rng->uniform());
      }
      tokens.push_back(t);
      gen_.push_back(t);
    }
  }

  void commit(const CommitInfo& info) override {
    const int64_t start = info.n_past - info.n_new;  // first newly committed position
    n_cached_ = std::min(n_cached_, start);           // anything past it was replaced
    const HiddenStates* h = info.hidden;
    if (h == nullptr || info.n_new <= 0 || n_cached_ != start) return;  // gap: stays incomplete
    const DFlashConfig& c = m_.config();
    SPECD_CHECK(h->n_layers == (int32_t)c.target_layer_ids.size() && h->dim == c.target_dim,
                "DFlash: the engine captured " + std::to_string(h->n_layers) + " layers of width " +
                    std::to_string(h->dim) + ", the drafter reads " + std::to_string(c.target_layer_ids.size()) +
                    " of width " + std::to_string(c.target_dim));
    SPECD_CHECK(h->pos0 <= start && h->pos0 + h->n_pos >= info.n_past,
                "DFlash: hidden states of positions " + std::to_string(h->pos0) + ".." +
                    std::to_string(h->pos0 + h->n_pos) + " do not cover the committed " + std::to_string(start) +
                    ".." + std::to_string(info.n_past));
    const float* rows = h->data + (start - h->pos0) * c.target_layer_ids.size() * c.target_dim;
    m_.append_context(kv_, rows, info.n_new, start);
    n_cached_ = info.n_past;
  }

  void rollback(int64_t n_past) override { n_cached_ = std::min(n_cached_, n_past); }

 private:
  const DFlashModel& m_;
  const ForwardModel& target_;    // its token embedding and output head (host views)
  KvCache kv_;                    // context K/V of positions 0..n_cached_-1, then block scratch
  int64_t n_cached_ = 0;
  std::vector<float> embd_;       // [B, dim] block input
  std::vector<float> hidden_;     // [B, dim] block output after the final norm
  std::vector<float> logits_;     // [n, n_vocab] draft rows 1..n
  std::vector<float> work_;       // [n_vocab] penalised logits
  std::vector<int32_t> gen_;      // generated tokens + drafts so far (penalties)
};

}  // namespace

// Declared in engine/drafter.h. The caller keeps `draft` alive (it outlives the drafters);
// the pairing with the target is checked here again, with the message the user sees.
std::unique_ptr<Drafter> make_dflash_drafter(const DFlashModel& draft, const DrafterEnv& env) {
  SPECD_CHECK(env.target != nullptr, "the DFlash drafter needs the target model");
  draft.check_target(env.target->config());
  return std::make_unique<DFlashDrafter>(draft, env);
}

}  // namespace specd
