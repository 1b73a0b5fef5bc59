// specd/common/parallel.cpp: thread count shared by all CPU ops.
#include "common/parallel.h"
#include <thread>

namespace specd {

static int g_threads = 0;

void set_num_threads(int n) {
  if (n <= 0) n = (int)std::max(1u, std::thread::hardware_concurrency());
  g_threads = n;
}

int num_threads() {
  if (g_threads <= 0) set_num_threads(0);
  return g_threads;
}

}  // namespace specd
