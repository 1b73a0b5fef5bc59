// specd/common/parallel.h: the one way the CPU backend uses threads: a persistent pool
// that splits [0, n) into chunks claimed dynamically (an atomic counter), the calling
// thread working too. Dynamic claiming matters on shared machines: a worker the OS
// descheduled does not stall a whole op (its chunks are taken by the others), unlike a
// static split. Idle workers spin briefly, then yield, then sleep (no CPU burnt between
// requests).
#pragma once
#include <cstdint>
#include <type_traits>

namespace specd {

void set_num_threads(int n);  // <= 0: all hardware threads
int num_threads();

namespace detail {
using ChunkFn = void (*)(const void* ctx, int64_t begin, int64_t end);
bool in_parallel_region();
void run_parallel(int64_t n, int64_t grain, ChunkFn fn, const void* ctx);
}  // namespace detail

// Calls f(begin, end) on contiguous chunks covering [0, n) exactly once, chunk sizes
// multiples of `grain` (except the last). f must not throw. Nested calls run serially.
template <class F>
void parallel_for(int64_t n, int64_t grain, F&& f) {
  if (n <= 0) return;
  if (grain < 1) grain = 1;
  if (num_threads() <= 1 || n <= grain || detail::in_parallel_region()) {
    f((int64_t)0, n);
    return;
  }
  using Fn = std::remove_reference_t<F>;
  detail::run_parallel(
      n, grain,
      [](const void* ctx, int64_t b, int64_t e) { (*static_cast<Fn*>(const_cast<void*>(ctx)))(b, e); },
      static_cast<const void*>(&f));
}

}  // namespace specd
