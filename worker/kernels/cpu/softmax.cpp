// specd/cpu/softmax.cpp: in-place softmax, max subtracted (no overflow for large logits),
// sum in double. The AVX2 path (vector exp, attention_avx2.cpp) agrees with this scalar
// reference to a few float ulps.
#include <cmath>
#include "cpu/ops.h"

namespace specd {

#if SPECD_HAVE_X86
namespace avx2 {  // defined in attention_avx2.cpp
void softmax(float* x, int64_t n);
}
#endif

void softmax(float* x, int64_t n) {
  if (n <= 0) return;
#if SPECD_HAVE_X86
  static const bool fast = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (fast) { avx2::softmax(x, n); return; }
#endif
  float mx = x[0];
  for (int64_t i = 1; i < n; ++i) mx = x[i] > mx ? x[i] : mx;
  double sum = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    x[i] = (float)std::exp((double)x[i] - mx);  // x - mx exact in double
    sum += x[i];
  }
  const float inv = (float)(1.0 / sum);
  for (int64_t i = 0; i < n; ++i) x[i] *= inv;
}

}  // namespace specd
