// specd/model/dflash.cpp: the DFlash drafter forward (see dflash.h for the maths):
// config validation, tensor resolution by GGUF name, context projection into the draft
// KV cache, the block forward, and the logits through the target's head. Heavy steps
// are the shared ops; the one op written here is windowed block attention, which the
// shared causal attention cannot express.
#include "model/dflash.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <unordered_map>

#include "common/parallel.h"
#include "cpu/quants.h"
#include "model/tensor_table.h"

namespace specd {

// ---------------------------------------------------------------- config validation

void DFlashConfig::validate() const {
  auto positive = [](int64_t v, const char* field) {
    if (v <= 0)
      throw Error(std::string("dflash config: ") + field + " must be positive, got " + std::to_string(v));
  };
  positive(n_layers, "n_layers");
  positive(dim, "dim");
  positive(n_heads, "n_heads");
  positive(n_kv_heads, "n_kv_heads");
  positive(head_dim, "head_dim");
  positive(ffn_dim, "ffn_dim");
  positive(n_vocab, "n_vocab");
  positive(target_dim, "target_dim");
  if (n_heads % n_kv_heads != 0)
    throw Error("dflash config: n_heads (" + std::to_string(n_heads) + ") must be a multiple of n_kv_heads (" +
                std::to_string(n_kv_heads) + ")");
  if (block_size < 2 || block_size > 1024)
    throw Error("dflash config: block_size must be in [2, 1024] (one known token plus at least one mask), got " +
                std::to_string(block_size));
  if (mask_token_id < 0 || mask_token_id >= n_vocab)
    throw Error("dflash config: mask_token_id " + std::to_string(mask_token_id) + " is outside the vocabulary [0, " +
                std::to_string(n_vocab) + ")");
  if (target_layer_ids.empty())
    throw Error("dflash config: target_layer_ids is empty; it names the tapped target layers");
  for (int32_t id : target_layer_ids)
    if (id < 0) throw Error("dflash config: target_layer_ids holds a negative layer " + std::to_string(id));
  if (target_dim != dim)
    throw Error("dflash config: target hidden size " + std::to_string(target_dim) + " differs from the drafter's " +
                std::to_string(dim) + "; DFlash adds target embeddings to its residual stream, so they must match");
  if ((int64_t)layer_causal.size() != n_layers || (int64_t)layer_window.size() != n_layers)
    throw Error("dflash config: layer_causal and layer_window need one entry per layer (" + std::to_string(n_layers) +
                "), got " + std::to_string(layer_causal.size()) + " and " + std::to_string(layer_window.size()));
  for (int32_t w : layer_window)
    if (w < 0) throw Error("dflash config: sliding window must be >= 0 (0 = none), got " + std::to_string(w));
  if (rope.n_dims <= 0 || rope.n_dims % 2 != 0 || rope.n_dims > head_dim)
    throw Error("dflash config: rope_dims must be even and in [2, head_dim=" + std::to_string(head_dim) + "], got " +
                std::to_string(rope.n_dims));
  if (!std::isfinite(rope.freq_base) || rope.freq_base <= 0 || !std::isfinite(rope.freq_scale) || rope.freq_scale <= 0)
    throw Error("dflash config: rope_base and rope_scale must be finite and > 0");
  if (!std::isfinite(norm_eps) || norm_eps < 0)
    throw Error("dflash config: norm_eps must be finite and >= 0, got " + std::to_string(norm_eps));
  if (!std::isfinite(input_embedding_scale) || !std::isfinite(output_multiplier) || !std::isfinite(logit_softcap) ||
      logit_softcap < 0)
    throw Error("dflash config: input_embedding_scale, output_multiplier must be finite and logit_softcap >= 0");
}

// ---------------------------------------------------------------- tensor resolution

namespace {

// What a DFlash tensor's expected shape comes from, for shape errors.
constexpr const char* kFromMeta = "from the DFlash metadata";

inline float load(const void* base, bool f16, int64_t i) {
  return f16 ? fp16_to_fp32(static_cast<const uint16_t*>(base)[i]) : static_cast<const float*>(base)[i];
}

// Context rows projected per append_context chunk (bounds the scratch during prefill).
constexpr int64_t kContextChunk = 256;

}  // namespace

DFlashModel::DFlashModel(const DFlashConfig& cfg, const std::vector<TensorRef>& tensors) : cfg_(cfg) {
  cfg_.validate();
  cfg_.rope.mode = RopeMode::Neox;  // qwen3-style rotate-half; the published drafters use it
  cfg_.rope.freq_factors = nullptr;
  const TensorTable T(tensors, {"the DFlash file", "", "convert the checkpoint again with worker/dflash_convert.py"});
  const int64_t dim = cfg_.dim, hd = cfg_.head_dim, ffn = cfg_.ffn_dim;
  const int64_t q_dim = (int64_t)cfg_.n_heads * hd, kvd = cfg_.kv_dim();

  fc_ = T.matrix("dflash_fc.weight", cfg_.feature_dim(), dim, kFromMeta);
  hidden_norm_ = T.vec("dflash_hidden_norm.weight", dim, kFromMeta);
  output_norm_ = T.vec("output_norm.weight", dim, kFromMeta);
  layers_.resize((size_t)cfg_.n_layers);
  for (int32_t i = 0; i < cfg_.n_layers; ++i) {
    const std::string p = "blk." + std::to_string(i) + ".";
    DFlashLayerWeights& L = layers_[(size_t)i];
    L.attn_norm = T.vec(p + "attn_norm.weight", dim, kFromMeta);
    L.wq = T.matrix(p + "attn_q.weight", dim, q_dim, kFromMeta);
    L.wk = T.matrix(p + "attn_k.weight", dim, kvd, kFromMeta);
    L.wv = T.matrix(p + "attn_v.weight", dim, kvd, kFromMeta);
    L.wo = T.matrix(p + "attn_output.weight", q_dim, dim, kFromMeta);
    L.bq = T.vec_opt(p + "attn_q.bias", q_dim, kFromMeta);
    L.bk = T.vec_opt(p + "attn_k.bias", kvd, kFromMeta);
    L.bv = T.vec_opt(p + "attn_v.bias", kvd, kFromMeta);
    L.bo = T.vec_opt(p + "attn_output.bias", dim, kFromMeta);
    L.q_norm = T.vec(p + "attn_q_norm.weight", hd, kFromMeta);
    L.k_norm = T.vec(p + "attn_k_norm.weight", hd, kFromMeta);
    L.ffn_norm = T.vec(p + "ffn_norm.weight", dim, kFromMeta);
    L.w_gate = T.matrix(p + "ffn_gate.weight", dim, ffn, kFromMeta);
    L.w_up = T.matrix(p + "ffn_up.weight", dim, ffn, kFromMeta);
    L.w_down = T.matrix(p + "ffn_down.weight", ffn, dim, kFromMeta);
  }
}

void DFlashModel::check_target(const ModelConfig& t) const {
  if (t.dim != cfg_.target_dim)
    throw Error("the DFlash drafter was trained on a target of hidden size " + std::to_string(cfg_.target_dim) +
                ", this target has " + std::to_string(t.dim) + "; use the drafter made for this target model");
  if (t.n_vocab != cfg_.n_vocab)
    throw Error("the DFlash drafter's vocabulary has " + std::to_string(cfg_.n_vocab) + " tokens, the target's " +
                std::to_string(t.n_vocab) + "; drafter and target must share one vocabulary");
  for (int32_t id : cfg_.target_layer_ids)
    if (id >= t.n_layers)
      throw Error("the DFlash drafter taps target layer " + std::to_string(id) + " but the target has only " +
                  std::to_string(t.n_layers) + " layers; use the drafter made for this target model");
}

KvCache DFlashModel::new_cache(int64_t n_ctx, bool f16) const {
  SPECD_CHECK(n_ctx > 0, "the DFlash cache needs n_ctx > 0");
  return KvCache(cfg_.n_layers, n_ctx + cfg_.block_size, cfg_.kv_dim(), f16);
}

// ---------------------------------------------------------------- context

void DFlashModel::append_context(KvCache& kv, const float* features, int64_t n, int64_t pos0) const {
  SPECD_CHECK(n >= 0 && pos0 >= 0, "append_context: n and pos0 must be >= 0");
  SPECD_CHECK(pos0 + n + cfg_.block_size <= kv.n_ctx(),
              "DFlash context positions " + std::to_string(pos0) + ".." + std::to_string(pos0 + n) +
                  " do not fit the draft cache of " + std::to_string(kv.n_ctx() - cfg_.block_size) + " positions");
  const int64_t dim = cfg_.dim, hd = cfg_.head_dim, kvd = cfg_.kv_dim(), F = cfg_.feature_dim();
  const int32_t nkv = cfg_.n_kv_heads;
  for (int64_t done = 0; done < n; done += kContextChunk) {
    const int64_t m = std::min(kContextChunk, n - done), p0 = pos0 + done;
    grow(a_, (size_t)(m * dim));
    grow(k_, (size_t)(m * kvd));
    grow(v_, (size_t)(m * kvd));
    grow(pos_, (size_t)m);
    float *c = a_.data(), *k = k_.data(), *v = v_.data();
    for (int64_t i = 0; i < m; ++i) pos_[(size_t)i] = (int32_t)(p0 + i);
    // c = hidden_norm(fc(features))   [m, dim]: the same context rows feed every layer
    matmul(fc_, features + done * F, m, c);
    rmsnorm(c, hidden_norm_, c, m, dim, cfg_.norm_eps);
    for (int32_t l = 0; l < cfg_.n_layers; ++l) {
      const DFlashLayerWeights& L = layers_[(size_t)l];
      matmul(L.wk, c, m, k);  // [m, kv_dim]
      matmul(L.wv, c, m, v);  // [m, kv_dim]
      if (L.bk) add_rows(k, L.bk, m, kvd);
      if (L.bv) add_rows(v, L.bv, m, kvd);
      rmsnorm(k, L.k_norm, k, m * nkv, hd, cfg_.norm_eps);
      rope(k, pos_.data(), m, nkv, hd, cfg_.rope);
      kv.write(l, p0, m, k, v);
    }
  }
}

// ---------------------------------------------------------------- block

void DFlashModel::block_input(const WeightView& tok_embd, int32_t last_token, int64_t B, float* x) const {
  SPECD_CHECK(B >= 2 && B <= cfg_.block_size, "DFlash block of " + std::to_string(B) +
                                                  " positions is out of range: this drafter runs blocks of 2.." +
                                                  std::to_string(cfg_.block_size));
  SPECD_CHECK(tok_embd.n_in == cfg_.dim, "the target's token embedding has rows of " + std::to_string(tok_embd.n_in) +
                                              ", the drafter needs " + std::to_string(cfg_.dim));
  SPECD_CHECK(last_token >= 0 && last_token < tok_embd.n_out,
              "token id " + std::to_string(last_token) + " is out of range [0, " + std::to_string(tok_embd.n_out) +
                  ")");
  const int64_t dim = cfg_.dim;
  dequantize_row(tok_embd.type, tok_embd.row(last_token), x, dim);
  dequantize_row(tok_embd.type, tok_embd.row(cfg_.mask_token_id), x + dim, dim);
  for (int64_t i = 2; i < B; ++i) std::memcpy(x + i * dim, x + dim, sizeof(float) * (size_t)dim);
  if (cfg_.input_embedding_scale != 1.0f)
    for (int64_t i = 0; i < B * dim; ++i) x[i] *= cfg_.input_embedding_scale;
}

void DFlashModel::block_attention(int32_t layer, const KvCache& kv, const float* q, int64_t B, int64_t pos0,
                                  float* out) const {
  const int32_t nh = cfg_.n_heads, nkv = cfg_.n_kv_heads, hd = cfg_.head_dim;
  const int64_t group = nh / nkv, n_keys = pos0 + B;
  const float scale = 1.0f / std::sqrt((float)hd);
  const bool causal = cfg_.layer_causal[(size_t)layer] != 0;
  const int64_t window = cfg_.layer_window[(size_t)layer];
  const KvView K = kv.k(layer), V = kv.v(layer);

  if (window == 0 && causal) {  // exactly the shared causal contract
    attention(q, K, V, B, pos0, nh, nkv, hd, scale, out);
    return;
  }
  if (window == 0) {
    // Non-causal: every query sees all pos0 + B keys. The shared op gives that to ONE
    // query token at position pos0 + B - 1, so the B block queries become extra heads of
    // one token: q [B, nkv, group, hd] -> qp [nkv, B, group, hd], where head
    // h' = (g*B + i)*group + r still reads KV head h' / (B*group) = g.
    grow(qp_, (size_t)(B * nh * hd));
    grow(op_, (size_t)(B * nh * hd));
    float *qp = qp_.data(), *op = op_.data();
    for (int64_t i = 0; i < B; ++i)
      for (int64_t g = 0; g < nkv; ++g)
        std::memcpy(qp + ((g * B + i) * group) * hd, q + (i * nh + g * group) * hd, sizeof(float) * group * hd);
    attention(qp, K, V, 1, n_keys - 1, (int32_t)(B * nh), nkv, hd, scale, op);
    for (int64_t i = 0; i < B; ++i)
      for (int64_t g = 0; g < nkv; ++g)
        std::memcpy(out + (i * nh + g * group) * hd, op + ((g * B + i) * group) * hd, sizeof(float) * group * hd);
    return;
  }
  // Sliding window (causal or not): query at position p sees keys j with p - j < window
  // (and j <= p when causal, j - p < window otherwise). Plain loops, double accumulation.
  const int64_t stride = K.row_stride;
  parallel_for(B * nh, 1, [&](int64_t i0, int64_t i1) {
    std::vector<double> s((size_t)n_keys), acc((size_t)hd);
    for (int64_t item = i0; item < i1; ++item) {
      const int64_t i = item / nh, h = item % nh, p = pos0 + i, off = (h / group) * hd;
      const int64_t lo = std::max<int64_t>(0, p - window + 1);
      const int64_t hi = causal ? p + 1 : std::min(n_keys, p + window);  // keys [lo, hi)
      const float* qh = q + item * hd;
      double mx = -INFINITY;
      for (int64_t j = lo; j < hi; ++j) {
        double dot = 0.0;
        for (int64_t d = 0; d < hd; ++d) dot += (double)qh[d] * load(K.data, K.f16, j * stride + off + d);
        s[(size_t)j] = dot * scale;
        mx = std::max(mx, s[(size_t)j]);
      }
      double sum = 0.0;
      std::fill(acc.begin(), acc.end(), 0.0);
      for (int64_t j = lo; j < hi; ++j) {
        const double w = std::exp(s[(size_t)j] - mx);
        sum += w;
        for (int64_t d = 0; d < hd; ++d) acc[(size_t)d] += w * load(V.data, V.f16, j * stride + off + d);
      }
      for (int64_t d = 0; d < hd; ++d) out[item * hd + d] = (float)(acc[(size_t)d] / sum);
    }
  });
}

void DFlashModel::forward_block(KvCache& kv, const float* block_embd, int64_t B, int64_t pos0, float* hidden) const {
  SPECD_CHECK(B >= 2 && B <= cfg_.block_size, "DFlash block of " + std::to_string(B) +
                                                  " positions is out of range: this drafter runs blocks of 2.." +
                                                  std::to_string(cfg_.block_size));
  SPECD_CHECK(pos0 >= 0 && pos0 + B <= kv.n_ctx(),
              "DFlash block at positions " + std::to_string(pos0) + ".." + std::to_string(pos0 + B) +
                  " past the draft cache's " + std::to_string(kv.n_ctx()) + " positions");
  const int64_t dim = cfg_.dim, hd = cfg_.head_dim, ffn = cfg_.ffn_dim;
  const int32_t nh = cfg_.n_heads, nkv = cfg_.n_kv_heads;
  const int64_t q_dim = (int64_t)nh * hd, kvd = cfg_.kv_dim();
  const float eps = cfg_.norm_eps;

  grow(x_, (size_t)(B * dim));
  grow(a_, (size_t)(B * dim));
  grow(q_, (size_t)(B * q_dim));
  grow(att_, (size_t)(B * q_dim));
  grow(k_, (size_t)(B * kvd));
  grow(v_, (size_t)(B * kvd));
  grow(gate_, (size_t)(B * ffn));
  grow(up_, (size_t)(B * ffn));
  grow(pos_, (size_t)B);
  float *x = x_.data(), *a = a_.data(), *q = q_.data(), *att = att_.data();
  float *k = k_.data(), *v = v_.data(), *gate = gate_.data(), *up = up_.data();
  for (int64_t i = 0; i < B; ++i) pos_[(size_t)i] = (int32_t)(pos0 + i);
  std::memcpy(x, block_embd, sizeof(float) * (size_t)(B * dim));

  for (int32_t l = 0; l < cfg_.n_layers; ++l) {
    const DFlashLayerWeights& L = layers_[(size_t)l];
    // ---- attention: x += Wo attention(q of the block -> context keys + block keys)
    rmsnorm(x, L.attn_norm, a, B, dim, eps);
    matmul(L.wq, a, B, q);  // [B, nh*hd]
    matmul(L.wk, a, B, k);  // [B, kv_dim]
    matmul(L.wv, a, B, v);  // [B, kv_dim]
    if (L.bq) add_rows(q, L.bq, B, q_dim);
    if (L.bk) add_rows(k, L.bk, B, kvd);
    if (L.bv) add_rows(v, L.bv, B, kvd);
    rmsnorm(q, L.q_norm, q, B * nh, hd, eps);
    rmsnorm(k, L.k_norm, k, B * nkv, hd, eps);
    rope(q, pos_.data(), B, nh, hd, cfg_.rope);
    rope(k, pos_.data(), B, nkv, hd, cfg_.rope);
    kv.write(l, pos0, B, k, v);  // scratch: the next append_context overwrites these rows
    block_attention(l, kv, q, B, pos0, att);
    matmul(L.wo, att, B, a);  // [B, dim]
    if (L.bo) add_rows(a, L.bo, B, dim);
    add_inplace(x, a, B * dim);
    // ---- MLP: x += Wdown(silu(Wgate f) * Wup f),  f = post_attention_layernorm(x)
    rmsnorm(x, L.ffn_norm, a, B, dim, eps);
    matmul(L.w_gate, a, B, gate);
    matmul(L.w_up, a, B, up);
    swiglu(gate, up, gate, B * ffn);
    matmul(L.w_down, gate, B, a);
    add_inplace(x, a, B * dim);
  }
  rmsnorm(x, output_norm_, hidden, B, dim, eps);
}

void DFlashModel::logits(const WeightView& head, const float* hidden, int64_t m, float* out) const {
  SPECD_CHECK(head.n_in == cfg_.dim, "the output head reads rows of " + std::to_string(head.n_in) +
                                         ", the drafter's hidden size is " + std::to_string(cfg_.dim));
  matmul(head, hidden, m, out);  // [m, n_vocab]
  const int64_t n = m * head.n_out;
  const float mult = cfg_.output_multiplier, cap = cfg_.logit_softcap;
  if (mult != 1.0f)
    for (int64_t i = 0; i < n; ++i) out[i] *= mult;
  if (cap > 0.0f)  // soft-cap: cap * tanh(l / cap) keeps logits in (-cap, cap)
    for (int64_t i = 0; i < n; ++i) out[i] = cap * std::tanh(out[i] / cap);
}

}  // namespace specd
