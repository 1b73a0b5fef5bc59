// specd/model/tensor_table.h: looking up a file's tensors by GGUF name with the checks
// every weight needs (present, shape, type, byte count), shared by the target model and
// the DFlash drafter so both reject a bad file the same way.
#pragma once
#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

#include "cpu/matmul.h"
#include "model/config.h"

namespace specd {

// What errors say about a missing tensor: "<file> has no tensor 'x' (<needed_by>shape [..]);
// <advice>".
struct TensorFileHints {
  std::string file;       // e.g. "the model file"
  std::string needed_by;  // e.g. "a llama model needs it, " (may be empty)
  std::string advice;     // e.g. "is the file complete?"
};

class TensorTable {
 public:
  TensorTable(const std::vector<TensorRef>& ts, TensorFileHints hints);  // duplicates: first wins

  const TensorRef* find(const std::string& name) const;
  const TensorRef& need(const std::string& name, const std::vector<int64_t>& shape) const;

  // A stored matrix ne = [n_in, n_out] (any supported type) as a matmul operand.
  // `meaning` explains the expected shape in errors (e.g. "dim x n_vocab").
  WeightView matrix(const TensorRef& t, int64_t n_in, int64_t n_out, const char* meaning) const;
  WeightView matrix(const std::string& name, int64_t n_in, int64_t n_out, const char* meaning) const;

  // A float32 vector (norm weight, bias, rope factors) of n elements.
  const float* vec(const TensorRef& t, int64_t n, const char* meaning) const;
  const float* vec(const std::string& name, int64_t n, const char* meaning) const;
  const float* vec_opt(const std::string& name, int64_t n, const char* meaning) const;

 private:
  TensorFileHints hints_;
  std::unordered_map<std::string, const TensorRef*> by_name_;
};

// ---- small row helpers of the forward passes ----

template <class T>
void grow(std::vector<T>& v, size_t n) {
  if (v.size() < n) v.resize(n);
}

// y[r] += b for each of n rows.   y: [n, d]; b: [d]
inline void add_rows(float* y, const float* b, int64_t n, int64_t d) {
  for (int64_t r = 0; r < n; ++r)
    for (int64_t i = 0; i < d; ++i) y[r * d + i] += b[i];
}

// y += x over n elements (the residual connection).
inline void add_inplace(float* y, const float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += x[i];
}

}  // namespace specd
