// specd/model/kv_cache.cpp: storage and fp32 -> fp16 conversion of one sequence's K/V.
#include "model/kv_cache.h"

#include <cstring>
#include <string>

#include "common/types.h"

namespace specd {

KvCache::KvCache(int32_t n_layers, int64_t n_ctx, int64_t kv_dim, bool f16)
    : n_layers_(n_layers), n_ctx_(n_ctx), kv_dim_(kv_dim), f16_(f16) {
  SPECD_CHECK(n_layers > 0 && n_ctx > 0 && kv_dim > 0,
              "KV cache needs positive sizes, got n_layers=" + std::to_string(n_layers) +
                  " n_ctx=" + std::to_string(n_ctx) + " kv_dim=" + std::to_string(kv_dim));
  // new[] without () leaves the bytes uninitialised (see the header).
  k_.reset(new uint8_t[bytes() / 2]);
  v_.reset(new uint8_t[bytes() / 2]);
}

size_t KvCache::bytes() const {
  const size_t elem = f16_ ? sizeof(uint16_t) : sizeof(float);
  return 2 * (size_t)n_layers_ * (size_t)n_ctx_ * (size_t)kv_dim_ * elem;
}

const void* KvCache::layer_base(const void* base, int32_t layer) const {
  SPECD_CHECK(layer >= 0 && layer < n_layers_, "KV cache: layer " + std::to_string(layer) + " out of range");
  const size_t elem = f16_ ? sizeof(uint16_t) : sizeof(float);
  return static_cast<const uint8_t*>(base) + (size_t)layer * (size_t)n_ctx_ * (size_t)kv_dim_ * elem;
}

void KvCache::write(int32_t layer, int64_t pos0, int64_t n, const float* k, const float* v) {
  SPECD_CHECK(pos0 >= 0 && n >= 0 && pos0 + n <= n_ctx_,
              "KV cache write of positions " + std::to_string(pos0) + ".." + std::to_string(pos0 + n) +
                  " past its " + std::to_string(n_ctx_) + " positions");
  const int64_t count = n * kv_dim_;  // rows are contiguous: one flat copy per tensor
  if (f16_) {
    uint16_t* kd = (uint16_t*)layer_base(k_.get(), layer) + pos0 * kv_dim_;
    uint16_t* vd = (uint16_t*)layer_base(v_.get(), layer) + pos0 * kv_dim_;
    for (int64_t i = 0; i < count; ++i) kd[i] = fp32_to_fp16(k[i]);
    for (int64_t i = 0; i < count; ++i) vd[i] = fp32_to_fp16(v[i]);
  } else {
    float* kd = (float*)layer_base(k_.get(), layer) + pos0 * kv_dim_;
    float* vd = (float*)layer_base(v_.get(), layer) + pos0 * kv_dim_;
    std::memcpy(kd, k, sizeof(float) * (size_t)count);
    std::memcpy(vd, v, sizeof(float) * (size_t)count);
  }
}

KvView KvCache::k(int32_t layer) const { return KvView{layer_base(k_.get(), layer), f16_, kv_dim_}; }
KvView KvCache::v(int32_t layer) const { return KvView{layer_base(v_.get(), layer), f16_, kv_dim_}; }

}  // namespace specd
