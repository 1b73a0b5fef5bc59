// specd/model/model.cpp: the llama-family forward pass (see model.h for the maths),
// resolving GGUF tensors by name with shape/type checks, and ModelConfig::validate.
// Every heavy step is a shared op (cpu/matmul.h, cpu/ops.h, cpu/quants.h); this file
// only sequences them and owns the activation scratch.
#include "model/model.h"

#include <cmath>
#include <cstring>
#include <string>
#include <unordered_map>

#include "cpu/ops.h"
#include "cpu/quants.h"
#include "model/tensor_table.h"

namespace specd {

// ---------------------------------------------------------------- config validation

void ModelConfig::validate() const {
  auto positive = [](int64_t v, const char* field) {
    if (v <= 0)
      throw Error(std::string("model config: ") + field + " must be positive, got " + std::to_string(v));
  };
  positive(n_layers, "n_layers");
  positive(dim, "dim");
  positive(n_heads, "n_heads");
  positive(n_kv_heads, "n_kv_heads");
  positive(head_dim, "head_dim");
  positive(ffn_dim, "ffn_dim");
  positive(n_vocab, "n_vocab");
  positive(n_ctx_train, "n_ctx_train");
  if (n_heads % n_kv_heads != 0)
    throw Error("model config: n_heads (" + std::to_string(n_heads) +
                ") must be a multiple of n_kv_heads (" + std::to_string(n_kv_heads) + ")");
  if (rope.n_dims <= 0 || rope.n_dims % 2 != 0 || rope.n_dims > head_dim)
    throw Error("model config: rope_dims must be even and in [2, head_dim=" + std::to_string(head_dim) +
                "], got " + std::to_string(rope.n_dims));
  if (!std::isfinite(norm_eps) || norm_eps < 0)
    throw Error("model config: norm_eps must be finite and >= 0, got " + std::to_string(norm_eps));
  if (!std::isfinite(rope.freq_base) || rope.freq_base <= 0)
    throw Error("model config: rope_base must be finite and > 0, got " + std::to_string(rope.freq_base));
  if (!std::isfinite(rope.freq_scale) || rope.freq_scale <= 0)
    throw Error("model config: rope_scale must be finite and > 0, got " + std::to_string(rope.freq_scale));
  if (rope.mode != RopeMode::Normal && rope.mode != RopeMode::Neox)
    throw Error("model config: rope_mode must be normal or neox");
}

// ---------------------------------------------------------------- tensor resolution

namespace {

const char* arch_name(Arch a) {
  switch (a) {
    case Arch::Llama: return "llama";
    case Arch::Qwen2: return "qwen2";
    case Arch::Qwen3: return "qwen3";
  }
  return "?";
}

}  // namespace

Model::Model(const ModelConfig& cfg, const std::vector<TensorRef>& tensors) : cfg_(cfg) {
  cfg_.validate();
  const TensorTable T(tensors, {"the model file", std::string("a ") + arch_name(cfg_.arch) + " model needs it, ",
                                "is the file complete?"});
  const int64_t dim = cfg_.dim, hd = cfg_.head_dim, ffn = cfg_.ffn_dim, nv = cfg_.n_vocab;
  const int64_t q_dim = (int64_t)cfg_.n_heads * hd, kvd = kv_dim();

  tok_embd_ = T.matrix("token_embd.weight", dim, nv, "dim x n_vocab");
  output_norm_ = T.vec("output_norm.weight", dim, "dim");
  if (const TensorRef* out = T.find("output.weight"))
    output_ = T.matrix(*out, dim, nv, "dim x n_vocab");
  else
    output_ = tok_embd_;  // tied embeddings

  cfg_.rope.freq_factors = nullptr;
  if (const float* f = T.vec_opt("rope_freqs.weight", cfg_.rope.n_dims / 2, "rope_dims / 2")) {
    rope_factors_.assign(f, f + cfg_.rope.n_dims / 2);
    cfg_.rope.freq_factors = rope_factors_.data();
  }

  layers_.resize((size_t)cfg_.n_layers);
  for (int32_t i = 0; i < cfg_.n_layers; ++i) {
    const std::string p = "blk." + std::to_string(i) + ".";
    LayerWeights& L = layers_[(size_t)i];
    L.attn_norm = T.vec(p + "attn_norm.weight", dim, "dim");
    L.wq = T.matrix(p + "attn_q.weight", dim, q_dim, "dim x n_heads*head_dim");
    L.wk = T.matrix(p + "attn_k.weight", dim, kvd, "dim x n_kv_heads*head_dim");
    L.wv = T.matrix(p + "attn_v.weight", dim, kvd, "dim x n_kv_heads*head_dim");
    L.wo = T.matrix(p + "attn_output.weight", q_dim, dim, "n_heads*head_dim x dim");
    // QKV biases: qwen2 always has them; other llama-family files may (used if present,
    // as llama.cpp does, so we compute the model the file defines).
    if (cfg_.arch == Arch::Qwen2) {
      L.bq = T.vec(p + "attn_q.bias", q_dim, "n_heads*head_dim");
      L.bk = T.vec(p + "attn_k.bias", kvd, "n_kv_heads*head_dim");
      L.bv = T.vec(p + "attn_v.bias", kvd, "n_kv_heads*head_dim");
    } else {
      L.bq = T.vec_opt(p + "attn_q.bias", q_dim, "n_heads*head_dim");
      L.bk = T.vec_opt(p + "attn_k.bias", kvd, "n_kv_heads*head_dim");
      L.bv = T.vec_opt(p + "attn_v.bias", kvd, "n_kv_heads*head_dim");
    }
    if (cfg_.arch == Arch::Qwen3) {
      L.q_norm = T.vec(p + "attn_q_norm.weight", hd, "head_dim");
      L.k_norm = T.vec(p + "attn_k_norm.weight", hd, "head_dim");
    }
    L.ffn_norm = T.vec(p + "ffn_norm.weight", dim, "dim");
    L.w_gate = T.matrix(p + "ffn_gate.weight", dim, ffn, "dim x ffn_dim");
    L.w_up = T.matrix(p + "ffn_up.weight", dim, ffn, "dim x ffn_dim");
    L.w_down = T.matrix(p + "ffn_down.weight", ffn, dim, "ffn_dim x dim");
  }
}

// ---------------------------------------------------------------- forward

void Model::forward(KvCache& kv, const int32_t* tokens, int64_t n, int64_t pos0, float* logits,
                    bool all_logits, const HiddenCapture* capture) const {
  SPECD_CHECK(n > 0, "forward needs at least one token");
  if (capture) {
    SPECD_CHECK(capture->n_layers > 0 && capture->layers && capture->out, "hidden capture needs layers and an output");
    for (int32_t j = 0; j < capture->n_layers; ++j)
      SPECD_CHECK(capture->layers[j] >= 0 && capture->layers[j] < cfg_.n_layers,
                  "hidden capture of layer " + std::to_string(capture->layers[j]) + ": the model has layers 0.." +
                      std::to_string(cfg_.n_layers - 1));
  }
  SPECD_CHECK(pos0 >= 0 && pos0 + n <= kv.n_ctx(),
              "forward of positions " + std::to_string(pos0) + ".." + std::to_string(pos0 + n) +
                  " past the KV cache's " + std::to_string(kv.n_ctx()) + " positions");
  const int64_t dim = cfg_.dim, hd = cfg_.head_dim, ffn = cfg_.ffn_dim;
  const int32_t nh = cfg_.n_heads, nkv = cfg_.n_kv_heads;
  const int64_t q_dim = (int64_t)nh * hd, kvd = kv_dim();
  const float eps = cfg_.norm_eps;
  const float scale = 1.0f / std::sqrt((float)hd);

  grow(h_, (size_t)(n * dim));
  grow(a_, (size_t)(n * dim));
  grow(q_, (size_t)(n * q_dim));
  grow(att_, (size_t)(n * q_dim));
  grow(k_, (size_t)(n * kvd));
  grow(v_, (size_t)(n * kvd));
  grow(gate_, (size_t)(n * ffn));
  grow(up_, (size_t)(n * ffn));
  grow(last_, (size_t)dim);
  grow(pos_, (size_t)n);
  float *h = h_.data(), *a = a_.data(), *q = q_.data(), *att = att_.data();
  float *k = k_.data(), *v = v_.data(), *gate = gate_.data(), *up = up_.data();
  int32_t* pos = pos_.data();

  // h = embd[tokens]   [n, dim]
  for (int64_t i = 0; i < n; ++i) {
    const int32_t t = tokens[i];
    SPECD_CHECK(t >= 0 && t < cfg_.n_vocab, "token id " + std::to_string(t) + " is out of range [0, " +
                                                std::to_string(cfg_.n_vocab) + ")");
    dequantize_row(tok_embd_.type, tok_embd_.row(t), h + i * dim, dim);
    pos[i] = (int32_t)(pos0 + i);
  }

  for (int32_t l = 0; l < cfg_.n_layers; ++l) {
    const LayerWeights& L = layers_[(size_t)l];

    // ---- attention block: h += Wo * attention(rope(Wq a), rope(Wk a), Wv a)
    rmsnorm(h, L.attn_norm, a, n, dim, eps);
    matmul(L.wq, a, n, q);  // [n, n_heads*hd]
    matmul(L.wk, a, n, k);  // [n, kv_dim]
    matmul(L.wv, a, n, v);  // [n, kv_dim]
    if (L.bq) add_rows(q, L.bq, n, q_dim);
    if (L.bk) add_rows(k, L.bk, n, kvd);
    if (L.bv) add_rows(v, L.bv, n, kvd);
    if (L.q_norm) {  // qwen3: RMSNorm over each head's head_dim, before RoPE
      rmsnorm(q, L.q_norm, q, n * nh, hd, eps);
      rmsnorm(k, L.k_norm, k, n * nkv, hd, eps);
    }
    rope(q, pos, n, nh, hd, cfg_.rope);
    rope(k, pos, n, nkv, hd, cfg_.rope);
    kv.write(l, pos0, n, k, v);
    attention(q, kv.k(l), kv.v(l), n, pos0, nh, nkv, (int32_t)hd, scale, att);  // [n, n_heads*hd]
    matmul(L.wo, att, n, a);  // [n, dim]
    add_inplace(h, a, n * dim);

    // ---- FFN block: h += Wdown (silu(Wgate f) * Wup f),  f = rmsnorm(h)
    rmsnorm(h, L.ffn_norm, a, n, dim, eps);
    matmul(L.w_gate, a, n, gate);  // [n, ffn]
    matmul(L.w_up, a, n, up);      // [n, ffn]
    swiglu(gate, up, gate, n * ffn);
    matmul(L.w_down, gate, n, a);  // [n, dim]
    add_inplace(h, a, n * dim);

    if (capture) {  // h after block l -> out[i, j] for every j with layers[j] == l
      const int32_t nc = capture->n_layers;
      for (int32_t j = 0; j < nc; ++j) {
        if (capture->layers[j] != l) continue;
        for (int64_t i = 0; i < n; ++i)
          std::memcpy(capture->out + (i * nc + j) * dim, h + i * dim, sizeof(float) * (size_t)dim);
      }
    }
  }

  if (logits == nullptr) return;
  if (all_logits) {
    rmsnorm(h, output_norm_, a, n, dim, eps);
    matmul(output_, a, n, logits);  // [n, n_vocab]
  } else {
    // Only the last position: the output head is the largest matrix of a small model.
    rmsnorm(h + (n - 1) * dim, output_norm_, last_.data(), 1, dim, eps);
    matmul(output_, last_.data(), 1, logits);  // [n_vocab]
  }
}

}  // namespace specd

// ---------------------------------------------------------------- ForwardModel

namespace specd {

std::unique_ptr<KvStore> Model::new_kv(int64_t n_ctx, bool f16) const {
  return std::make_unique<KvCache>(cfg_.n_layers, n_ctx, kv_dim(), f16);
}

void Model::forward(KvStore& kv, const int32_t* tokens, int64_t n, int64_t pos0, float* logits, bool all_logits,
                    const HiddenCapture* capture) const {
  auto* cache = dynamic_cast<KvCache*>(&kv);
  SPECD_CHECK(cache != nullptr, "the CPU model got a KV store of another device");
  forward(*cache, tokens, n, pos0, logits, all_logits, capture);
}

MemoryInfo Model::memory() const {
  MemoryInfo m;
  m.device_name = "cpu";
  auto add = [&](const WeightView& w) { m.weights_bytes += w.valid() ? w.row_stride * (size_t)w.n_out : 0; };
  add(tok_embd_);
  if (output_.data != tok_embd_.data) add(output_);
  for (const LayerWeights& L : layers_)
    for (const WeightView* w : {&L.wq, &L.wk, &L.wv, &L.wo, &L.w_gate, &L.w_up, &L.w_down}) add(*w);
  return m;
}

}  // namespace specd
