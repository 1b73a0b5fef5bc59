// specd/cpu/matmul.h: y = x @ W^T for a stored (possibly quantized) weight matrix, the
// only heavy op of a transformer step. Threaded across output rows.
#pragma once
#include <cstddef>
#include <cstdint>
#include "common/types.h"

namespace specd {

// A 2-D weight as stored in GGUF: n_out rows (ne1) of n_in elements (ne0) each,
// rows `row_stride` bytes apart. Not owned (points into the memmapped file).
struct WeightView {
  GgmlType type = GgmlType::F32;
  int64_t n_in = 0;   // ne0: elements per row (the reduction dimension K)
  int64_t n_out = 0;  // ne1: number of rows (output features N)
  const uint8_t* data = nullptr;
  size_t row_stride = 0;  // bytes between rows (= row_bytes(type, n_in))
  bool valid() const { return data != nullptr; }
  const uint8_t* row(int64_t r) const { return data + (size_t)r * row_stride; }
};

// x: [m, n_in] float32 row-major; y: [m, n_out] float32 row-major (overwritten).
// m = 1 is the decode path (one dot per weight row); m > 1 (prefill / speculative
// verify) reuses each weight row for all m activation rows while it is in cache.
void matmul(const WeightView& w, const float* x, int64_t m, float* y);

}  // namespace specd
