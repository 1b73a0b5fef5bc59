// specd/engine/draft_model.cpp: the draft-model drafter: a second (smaller or more
// quantized) model of the same vocabulary proposes k tokens autoregressively from its own
// KV cache, kept in step with the target's.
//
// Sync: the draft KV holds `cached_` (tokens at positions 0..size-1). Before drafting it
// keeps the longest common prefix of cached_ and the target's sequence (so rejected drafts,
// truncation and new prompts need no bookkeeping beyond this compare) and forwards the
// tokens it has not seen (after a step: the bonus token, plus the last draft when all
// were accepted), keeping the last position's logits.
// Drafting: token i is the argmax (greedy) or a draw from the draft's own transformed
// distribution (same sampling parameters, penalties over the history extended by the
// drafts so far, the draft RNG stream), which is then q's row i. d1..d_{k-1} are forwarded
// into the draft KV (d_k is not: nothing reads its logits unless it is accepted).
#include <algorithm>
#include <cstring>
#include <string>

#include "common/types.h"
#include "engine/drafter.h"
#include "model/forward.h"

namespace specd {

namespace {

constexpr int64_t kCatchUpChunk = 256;  // positions per forward when catching up (bounds scratch)
// A greedy catch-up of up to this many tokens is one forward_argmax (every row's logits: the
// weights read once); longer ones run without the output head, then the last token alone.
constexpr int64_t kArgmaxRows = 16;

class DraftModelDrafter final : public Drafter {
 public:
  DraftModelDrafter(const ForwardModel& m, const DrafterEnv& env)
      : m_(m),
        kv_(m.new_kv(env.n_ctx, env.kv_f16)),
        logits_((size_t)m.config().n_vocab),
        work_((size_t)m.config().n_vocab) {}

  const char* name() const override { return "draft"; }

  void draft(const DraftContext& ctx, int k, std::vector<int32_t>& tokens, std::vector<float>& q) override {
    const int64_t nv = m_.config().n_vocab, n = ctx.n_tokens;
    SPECD_CHECK(n >= 1 && n + k - 1 <= kv_->n_ctx(), "draft model: sequence of " + std::to_string(n) +
                                                        " tokens + " + std::to_string(k) + " drafts exceeds its context");
    // ---- catch up: keep the common prefix, forward the rest (at least the last token)
    const SamplingParams& sp = *ctx.params;
    const bool greedy = sp.greedy();
    // Greedy without penalties needs only each position's argmax: on a GPU draft only the
    // token ids come back (ForwardModel::forward_argmax), never the logits.
    const bool argmax_only = greedy && !sp.has_penalties();
    int64_t keep = 0;
    const int64_t lim = std::min<int64_t>((int64_t)cached_.size(), n - 1);
    while (keep < lim && cached_[(size_t)keep] == ctx.tokens[keep]) ++keep;
    cached_.resize((size_t)keep);
    int32_t top = -1;
    for (int64_t done = keep; done < n;) {
      const int64_t c = std::min(kCatchUpChunk, n - done);
      const bool last = done + c == n;
      if (last && argmax_only && c <= kArgmaxRows) {
        // one forward (after a step: [last draft, bonus]), every row's argmax, the last kept
        tops_.resize((size_t)c);
        m_.forward_argmax(*kv_, ctx.tokens + done, c, done, tops_.data());
        top = tops_[(size_t)c - 1];
      } else if (last && argmax_only) {
        m_.forward(*kv_, ctx.tokens + done, c - 1, done, nullptr, false);
        m_.forward_argmax(*kv_, ctx.tokens + n - 1, 1, n - 1, &top);
      } else {
        m_.forward(*kv_, ctx.tokens + done, c, done, last ? logits_.data() : nullptr, false);
      }
      cached_.insert(cached_.end(), ctx.tokens + done, ctx.tokens + done + c);
      done += c;
    }

    // ---- draft k tokens
    gen_.assign(ctx.generated, ctx.generated + ctx.n_generated);
    tokens.clear();
    q.clear();
    if (!greedy) q.resize((size_t)(k * nv));
    for (int i = 0; i < k; ++i) {
      int32_t t;
      if (argmax_only) {
        t = top;
      } else {
        std::memcpy(work_.data(), logits_.data(), sizeof(float) * (size_t)nv);
        apply_penalties(work_.data(), nv, sp, ctx.prompt, ctx.n_prompt, gen_.data(), (int64_t)gen_.size());
        if (greedy) {
          t = argmax(work_.data(), nv);
        } else {
          float* qi = q.data() + (size_t)i * nv;  // [n_vocab] the distribution t is drawn from
          sampling_probs(work_.data(), nv, sp, qi);
          t = sample_from(qi, nv, ctx.rng->uniform());
        }
      }
      tokens.push_back(t);
      gen_.push_back(t);
      if (i + 1 < k) {
        if (argmax_only) m_.forward_argmax(*kv_, &t, 1, n + i, &top);
        else m_.forward(*kv_, &t, 1, n + i, logits_.data(), false);
        cached_.push_back(t);
      }
    }
  }

  void rollback(int64_t n_past) override {
    if ((int64_t)cached_.size() > n_past) cached_.resize((size_t)n_past);
  }

 private:
  const ForwardModel& m_;
  std::unique_ptr<KvStore> kv_;   // this sequence's draft KV (on the draft's device)
  std::vector<int32_t> cached_;   // [positions in kv_] the tokens they hold
  std::vector<float> logits_;     // [n_vocab] the draft's logits at the last cached position
  std::vector<float> work_;       // [n_vocab] penalised logits
  std::vector<int32_t> gen_;      // generated tokens + drafts so far (penalties)
  std::vector<int32_t> tops_;     // [<= kArgmaxRows] argmax rows of a catch-up
};

}  // namespace

std::unique_ptr<Drafter> make_draft_model_drafter(const ForwardModel& draft, const DrafterEnv& env) {
  SPECD_CHECK(env.target != nullptr && env.target->config().n_vocab == draft.config().n_vocab,
              "draft model vocabulary differs from the target's");
  return std::make_unique<DraftModelDrafter>(draft, env);
}

}  // namespace specd
