// specd/model/config.h: the model hyper-parameters the C++ side needs, filled from the
// validated Python config (worker/model_file.py reads them from GGUF metadata), and the
// tensors handed over as zero-copy views of the memmapped file.
#pragma once
#include <cstdint>
#include <string>
#include <vector>
#include "common/types.h"
#include "cpu/ops.h"

namespace specd {

enum class Arch : int32_t { Llama = 0, Qwen2 = 1, Qwen3 = 2 };

struct ModelConfig {
  Arch arch = Arch::Llama;
  int32_t n_layers = 0;
  int32_t dim = 0;          // n_embd
  int32_t n_heads = 0;
  int32_t n_kv_heads = 0;
  int32_t head_dim = 0;     // usually dim / n_heads (qwen3 may differ)
  int32_t ffn_dim = 0;
  int32_t n_vocab = 0;
  int32_t n_ctx_train = 0;
  float norm_eps = 1e-5f;
  // rope.freq_factors is filled by Model from `rope_freqs.weight` when present.
  RopeParams rope;
  void validate() const;  // throws Error naming the bad field
};

// One tensor of the GGUF file. ne[0] is the fastest-varying (row length), as in GGUF.
struct TensorRef {
  std::string name;
  GgmlType type = GgmlType::F32;
  std::vector<int64_t> ne;
  const uint8_t* data = nullptr;
  size_t nbytes = 0;
};

}  // namespace specd
