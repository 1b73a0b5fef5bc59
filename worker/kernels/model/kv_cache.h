// specd/model/kv_cache.h: one sequence's K and V cache for every layer, fp16 (default)
// or fp32. Rolling back is just lowering the sequence's length: rows past it are
// overwritten by the next write.
#pragma once
#include <cstdint>
#include <memory>
#include "cpu/ops.h"
#include "model/forward.h"

namespace specd {

class KvCache final : public KvStore {
 public:
  // k, v per layer: [n_ctx, kv_dim] elements (kv_dim = n_kv_heads * head_dim).
  KvCache(int32_t n_layers, int64_t n_ctx, int64_t kv_dim, bool f16);
  // Stores rows for positions pos0..pos0+n-1. k, v: [n, kv_dim] float32.
  void write(int32_t layer, int64_t pos0, int64_t n, const float* k, const float* v);
  KvView k(int32_t layer) const;
  KvView v(int32_t layer) const;
  int64_t n_ctx() const override { return n_ctx_; }
  bool f16() const { return f16_; }
  size_t bytes() const override;

 private:
  const void* layer_base(const void* base, int32_t layer) const;

  int32_t n_layers_;
  int64_t n_ctx_, kv_dim_;
  bool f16_;
  // [n_layers, n_ctx, kv_dim] elements each: uint16 (fp16 bits) when f16_, else float.
  // Left uninitialised on purpose: the OS commits pages only as positions get written,
  // so a sequence costs memory for the context it uses, not for n_ctx.
  std::unique_ptr<uint8_t[]> k_, v_;
};

}  // namespace specd
