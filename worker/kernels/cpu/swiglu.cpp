// specd/cpu/swiglu.cpp: the gated FFN activation silu(gate) * up, silu(g) = g / (1 + e^-g).
// The AVX2 path (vector exp, attention_avx2.cpp) agrees with this scalar reference to a
// few float ulps. out may alias gate (each element is read before it is written).
#include <cmath>
#include "common/parallel.h"
#include "cpu/ops.h"

namespace specd {

#if SPECD_HAVE_X86
namespace avx2 {  // defined in attention_avx2.cpp
void swiglu(const float* gate, const float* up, float* out, int64_t n);
}
#endif

void swiglu(const float* gate, const float* up, float* out, int64_t n) {
  if (n <= 0) return;
#if SPECD_HAVE_X86
  static const bool fast = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#endif
  // A prefill's [n_tok, ffn] goes to the threads in chunks of >= 32k elements (multiples
  // of 8, so only the last chunk has a vector tail).
  parallel_for(n, 32768, [&](int64_t b, int64_t e) {
#if SPECD_HAVE_X86
    if (fast) { avx2::swiglu(gate + b, up + b, out + b, e - b); return; }
#endif
    for (int64_t i = b; i < e; ++i) {
      const float g = gate[i];
      out[i] = g / (1.0f + std::exp(-g)) * up[i];
    }
  });
}

}  // namespace specd
