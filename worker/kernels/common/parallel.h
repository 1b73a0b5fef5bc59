// specd/common/parallel.h: the one way the CPU backend uses threads. OpenMP when the
// build found it (threads stay warm between calls), else serial.
#pragma once
#include <algorithm>
#include <cstdint>
#ifdef _OPENMP
#include <omp.h>
#endif

namespace specd {

void set_num_threads(int n);  // <= 0: all hardware threads
int num_threads();

// Calls f(begin, end) on contiguous chunks of [0, n) across the pool; chunks are
// multiples of `grain` (except the last). f must not throw.
template <class F>
void parallel_for(int64_t n, int64_t grain, F&& f) {
  if (n <= 0) return;
  const int nt = num_threads();
  if (nt <= 1 || n <= grain) { f((int64_t)0, n); return; }
#ifdef _OPENMP
  const int64_t chunks = std::min<int64_t>(nt, (n + grain - 1) / grain);
  const int64_t per = ((n + chunks - 1) / chunks + grain - 1) / grain * grain;
#pragma omp parallel for num_threads((int)chunks) schedule(static, 1)
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t b = c * per, e = std::min(n, b + per);
    if (b < e) f(b, e);
  }
#else
  f((int64_t)0, n);
#endif
}

}  // namespace specd
