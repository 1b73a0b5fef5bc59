// specd/model/dflash.h: the DFlash block drafter's forward pass (docs/dflash-gguf.md has
// the file layout; /shared/design/DFLASH.md the published checkpoints). A DFlash drafter
// is a small qwen3-style stack with no embedding and no output head of its own: it reads
// the target's token embedding and output head, and is conditioned on target hidden
// states tapped after the layers `target_layer_ids`.
//
// Context (once per committed target position p, kept in the draft KV cache):
//   c_p = hidden_norm(fc([h_p after layer ids[0]; ...; h_p after ids[m-1]]))   [dim]
//   per layer l:  K_l[p] = rope(k_norm(Wk_l c_p), p) ;  V_l[p] = Wv_l c_p
// Block (one draft of B tokens at positions P..P+B-1, P = cached context length):
//   x_i = embd[t_i] * input_embedding_scale,  t = [last committed token, MASK x (B-1)]
//   per layer:  a = input_layernorm(x) ; q = rope(q_norm(Wq a)) ; k = rope(k_norm(Wk a)) ;
//               v = Wv a ; x += Wo attention(q -> [K_l[0..P), k], [V_l[0..P), v]) ;
//               x += Wdown(silu(Wgate f) * Wup f),  f = post_attention_layernorm(x)
//   logits_i = softcap(head(norm(x_i)) * output_multiplier),  draft token i = argmax / sample
//   of row i, i = 1..B-1 (row 0 predicts the already known token and is never computed).
// Attention per layer: non-causal over every context and block key (default for full
// attention layers), or causal (key pos <= query pos), and optionally windowed
// (|query pos - key pos| < window; the upper side only matters when non-causal).
// The block's own K/V are written past the context as scratch and dropped: the next
// append_context overwrites them.
#pragma once
#include <cstdint>
#include <vector>
#include "cpu/matmul.h"
#include "cpu/ops.h"
#include "model/config.h"
#include "model/kv_cache.h"

namespace specd {

struct DFlashConfig {
  int32_t n_layers = 0;
  int32_t dim = 0;            // hidden size (= the target's n_embd)
  int32_t n_heads = 0;
  int32_t n_kv_heads = 0;
  int32_t head_dim = 0;
  int32_t ffn_dim = 0;
  int32_t n_vocab = 0;        // the vocabulary it was trained with (= the target's)
  float norm_eps = 1e-6f;
  RopeParams rope;            // neox (qwen3 style); n_dims = head_dim
  int32_t block_size = 16;    // B: positions per drafted block (1 known + B-1 masks)
  int32_t mask_token_id = -1;
  std::vector<int32_t> target_layer_ids;  // [m] target blocks whose outputs are tapped
  int32_t target_dim = 0;     // the target's n_embd (fc reads m * target_dim features)
  float input_embedding_scale = 1.0f;
  float output_multiplier = 1.0f;
  float logit_softcap = 0.0f;          // tanh soft-cap of the logits; 0 = off
  std::vector<uint8_t> layer_causal;   // [n_layers] 1 = causal attention
  std::vector<int32_t> layer_window;   // [n_layers] sliding window in positions; 0 = none

  void validate() const;  // throws Error naming the bad field
  int64_t feature_dim() const { return (int64_t)target_layer_ids.size() * target_dim; }
  int64_t kv_dim() const { return (int64_t)n_kv_heads * head_dim; }
};

struct DFlashLayerWeights {
  const float* attn_norm = nullptr;          // input_layernorm [dim]
  WeightView wq, wk, wv, wo;                 // [dim -> nh*hd], [dim -> kv_dim] x2, [nh*hd -> dim]
  const float *bq = nullptr, *bk = nullptr, *bv = nullptr, *bo = nullptr;  // optional biases
  const float* q_norm = nullptr;             // [hd]
  const float* k_norm = nullptr;             // [hd]
  const float* ffn_norm = nullptr;           // post_attention_layernorm [dim]
  WeightView w_gate, w_up, w_down;           // [dim -> ffn] x2, [ffn -> dim]
};

class DFlashModel {
 public:
  // Resolves the tensors of docs/dflash-gguf.md with shape/type checks; throws Error
  // naming the missing or mismatched tensor.
  DFlashModel(const DFlashConfig& cfg, const std::vector<TensorRef>& tensors);
  DFlashModel(const DFlashModel&) = delete;
  DFlashModel& operator=(const DFlashModel&) = delete;

  const DFlashConfig& config() const { return cfg_; }

  // Throws Error saying what differs when this drafter cannot serve `target` (hidden
  // size, vocabulary, tapped layers).
  void check_target(const ModelConfig& target) const;

  // A draft KV cache for one sequence: context positions plus one block of scratch.
  KvCache new_cache(int64_t n_ctx, bool f16) const;

  // Projects the context features of positions pos0..pos0+n-1 and writes their keys and
  // values. features: [n, m, target_dim] (m = target_layer_ids.size()).
  void append_context(KvCache& kv, const float* features, int64_t n, int64_t pos0) const;

  // block_embd [B, dim] <- target embedding rows of [last, MASK x (B-1)] x input scale.
  void block_input(const WeightView& tok_embd, int32_t last_token, int64_t B, float* block_embd) const;

  // Runs one block at positions pos0..pos0+B-1 over context positions 0..pos0-1 of kv
  // (2 <= B <= block_size); writes the block's K/V at pos0.. as scratch.
  // block_embd: [B, dim]; hidden: [B, dim] after the final norm.
  void forward_block(KvCache& kv, const float* block_embd, int64_t B, int64_t pos0, float* hidden) const;

  // logits [m, n_vocab] = softcap(head(hidden [m, dim]) * output_multiplier).
  void logits(const WeightView& head, const float* hidden, int64_t m, float* out) const;

 private:
  // out [B, nh*hd] = the layer's attention of q [B, nh, hd] over kv positions 0..pos0+B-1.
  void block_attention(int32_t layer, const KvCache& kv, const float* q, int64_t B, int64_t pos0,
                       float* out) const;

  DFlashConfig cfg_;
  WeightView fc_;                   // [m*target_dim -> dim]
  const float* hidden_norm_ = nullptr;  // [dim]
  const float* output_norm_ = nullptr;  // [dim]
  std::vector<DFlashLayerWeights> layers_;
  // scratch (not re-entrant; the engine serialises calls):
  //   x_ [B, dim] residual; a_ [n, dim] normed input / projections; q_, att_, qp_, op_
  //   [B, nh*hd]; k_, v_ [n, kv_dim]; gate_, up_ [B, ffn]; pos_ [n]
  mutable std::vector<float> x_, a_, q_, att_, qp_, op_, k_, v_, gate_, up_;
  mutable std::vector<int32_t> pos_;
};

}  // namespace specd
