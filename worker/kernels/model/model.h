// specd/model/model.h: the transformer forward pass for the llama family
// (llama, qwen2 = + QKV bias, qwen3 = + per-head Q/K RMSNorm), over stored weights.
//
//   h = embd[tokens]                                  [n, dim]
//   per layer:  a = rmsnorm(h) ; q,k,v = a Wq,Wk,Wv (+bias) ; (qwen3: rmsnorm per head)
//               rope(q,k) ; kv.write ; o = attention(q, K, V) Wo ; h += o
//               f = rmsnorm(h) ; h += (silu(f Wgate) * f Wup) Wdown
//   logits = rmsnorm(h) Wout   (Wout = embd when tied)
#pragma once
#include <cstdint>
#include <vector>
#include "cpu/matmul.h"
#include "model/config.h"
#include "model/forward.h"
#include "model/kv_cache.h"

namespace specd {

struct LayerWeights {
  const float* attn_norm = nullptr;           // [dim]
  WeightView wq, wk, wv, wo;                  // [dim -> n_heads*hd], [dim -> kv_dim] x2, [n_heads*hd -> dim]
  const float* bq = nullptr;                  // qwen2: [n_heads*hd]
  const float* bk = nullptr;                  // qwen2: [kv_dim]
  const float* bv = nullptr;                  // qwen2: [kv_dim]
  const float* q_norm = nullptr;              // qwen3: [hd]
  const float* k_norm = nullptr;              // qwen3: [hd]
  const float* ffn_norm = nullptr;            // [dim]
  WeightView w_gate, w_up, w_down;            // [dim -> ffn], [dim -> ffn], [ffn -> dim]
};

// The CPU model (ForwardModel on "cpu"); its KV stores are KvCache.
class Model final : public ForwardModel {
 public:
  // Resolves every tensor by its GGUF name and checks types and shapes; throws Error
  // naming the missing or mismatched tensor. Norm/bias tensors must be F32.
  Model(const ModelConfig& cfg, const std::vector<TensorRef>& tensors);

  const ModelConfig& config() const override { return cfg_; }
  std::string device() const override { return "cpu"; }
  std::unique_ptr<KvStore> new_kv(int64_t n_ctx, bool f16) const override;

  Model(const Model&) = delete;  // cfg_.rope.freq_factors points into this object
  Model& operator=(const Model&) = delete;

  // Runs tokens[0..n) at positions pos0..pos0+n-1, writing their K/V into `kv`.
  // logits: [n, n_vocab] when all_logits, else [n_vocab] for the last token only;
  // null skips the output head (a prompt chunk whose logits nobody reads).
  // n is bounded by the caller (the engine splits long prompts into chunks).
  // capture (optional): also writes the residual stream after the given layers.
  void forward(KvCache& kv, const int32_t* tokens, int64_t n, int64_t pos0, float* logits,
               bool all_logits, const HiddenCapture* capture = nullptr) const;
  // ForwardModel: kv must be a KvCache (Error otherwise).
  void forward(KvStore& kv, const int32_t* tokens, int64_t n, int64_t pos0, float* logits,
               bool all_logits, const HiddenCapture* capture = nullptr) const override;

  // The shared input embedding and output head (drafters such as DFlash reuse them).
  const WeightView& token_embedding() const override { return tok_embd_; }  // [n_vocab rows of dim]
  const WeightView& output_head() const override { return output_; }        // [n_vocab rows of dim]
  MemoryInfo memory() const override;

  // The resolved (host) weights, for backends that upload them (cuda/gpu_model.cu).
  const std::vector<LayerWeights>& layers() const { return layers_; }
  const float* output_norm() const { return output_norm_; }

 private:
  ModelConfig cfg_;
  WeightView tok_embd_;          // [n_vocab rows of dim]
  const float* output_norm_ = nullptr;
  WeightView output_;            // [n_vocab rows of dim] (tok_embd_ when tied)
  std::vector<float> rope_factors_;
  std::vector<LayerWeights> layers_;
  // scratch, grown on demand; forward() is not re-entrant (the engine serialises calls)
  //   h_ [n, dim] residual stream; a_ [n, dim] normed input / projection output;
  //   q_, att_ [n, n_heads*hd]; k_, v_ [n, kv_dim]; gate_, up_ [n, ffn]; last_ [dim];
  //   pos_ [n] absolute positions
  mutable std::vector<float> h_, a_, q_, k_, v_, att_, gate_, up_, last_;
  mutable std::vector<int32_t> pos_;
};

}  // namespace specd
