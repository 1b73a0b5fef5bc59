// specd/engine/ngram.cpp: the n-gram (prompt lookup) drafter: no model. For n from
// ngram_max down to ngram_min, find the latest earlier occurrence of the sequence's last n
// tokens (prompt + output + pending) and propose the k tokens that followed it. Past the
// end of the sequence the copy continues from its own proposals (the match is read as a
// period), so a repetition shorter than k still yields k drafts. Deterministic, so its
// proposals are one-hot (q empty). Great on code edits, RAG and repetitive text; on
// open-ended text it proposes little (no match: the step is a plain step).
#include <algorithm>
#include <string>

#include "common/types.h"
#include "engine/drafter.h"

namespace specd {

namespace {

class NgramDrafter final : public Drafter {
 public:
  NgramDrafter(int32_t n_min, int32_t n_max) : n_min_(n_min), n_max_(n_max) {}

  const char* name() const override { return "ngram"; }

  void draft(const DraftContext& ctx, int k, std::vector<int32_t>& tokens, std::vector<float>& q) override {
    const int32_t* s = ctx.tokens;
    const int64_t n = ctx.n_tokens;
    tokens.clear();
    q.clear();
    for (int64_t len = std::min<int64_t>(n_max_, n - 1); len >= n_min_; --len) {
      const int32_t* suffix = s + n - len;
      // Latest start j whose match ends before the suffix starts overlapping the end:
      // j + len <= n - 1, so at least one real token follows the match.
      for (int64_t j = n - len - 1; j >= 0; --j) {
        if (!std::equal(suffix, suffix + len, s + j)) continue;
        const int64_t src = j + len;  // continuation: s[src], s[src + 1], ... of s ++ tokens
        for (int64_t i = 0; i < k; ++i) {
          const int64_t at = src + i;
          tokens.push_back(at < n ? s[at] : tokens[(size_t)(at - n)]);
        }
        return;
      }
    }
  }

 private:
  int32_t n_min_, n_max_;
};

}  // namespace

std::unique_ptr<Drafter> make_ngram_drafter(int32_t ngram_min, int32_t ngram_max) {
  SPECD_CHECK(ngram_min >= 1 && ngram_max >= ngram_min,
              "ngram sizes must satisfy 1 <= ngram_min <= ngram_max, got " + std::to_string(ngram_min) + ", " +
                  std::to_string(ngram_max));
  return std::make_unique<NgramDrafter>(ngram_min, ngram_max);
}

}  // namespace specd
