// specd/cpu/swiglu.cpp: the gated FFN activation silu(gate) * up.
#include <cmath>
#include "cpu/ops.h"

namespace specd {

void swiglu(const float* gate, const float* up, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float g = gate[i];
    out[i] = g / (1.0f + std::exp(-g)) * up[i];
  }
}

}  // namespace specd
