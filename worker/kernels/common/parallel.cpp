// specd/common/parallel.cpp: the thread pool behind parallel_for.
//
// Protocol. A job is published by one 64-bit atomic `claim_` = [gen:32 | total:16 |
// next:16]. Any thread claims chunk `next` by CAS(v -> v+1) while next < total; a
// successful CAS on generation g proves job g is still current, and the caller does not
// touch the job fields (fn_, ctx_, n_, per_) until every chunk of g has reported `done_`,
// so reading them after the CAS is race-free. Workers that wake late see a newer gen or
// no chunks left and simply go back to waiting.
#include "common/parallel.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <new>
#include <thread>
#include <vector>
#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define SPECD_PAUSE() _mm_pause()
#else
#define SPECD_PAUSE() std::this_thread::yield()
#endif

namespace specd {

namespace {

thread_local bool t_in_region = false;

using Clock = std::chrono::steady_clock;
constexpr auto kSpin = std::chrono::microseconds(50);    // busy-wait, then
constexpr auto kYield = std::chrono::milliseconds(3);    // yield the core, then sleep
constexpr int64_t kChunksPerThread = 4;                  // dynamic balance vs claim cost

class Pool {
 public:
  ~Pool() { stop(); }

  void resize(int n_threads) {
    std::lock_guard<std::mutex> run(run_mu_);
    stop();
    n_threads_ = std::max(1, n_threads);
  }

  int size() const { return n_threads_; }

  void run(int64_t n, int64_t grain, detail::ChunkFn fn, const void* ctx) {
    std::lock_guard<std::mutex> run(run_mu_);  // one job at a time, whoever calls
    ensure_started();
    const int64_t grains = (n + grain - 1) / grain;
    int64_t total = std::min<int64_t>({grains, (int64_t)n_threads_ * kChunksPerThread, 0xffff});
    const int64_t per = ((n + total - 1) / total + grain - 1) / grain * grain;
    total = (n + per - 1) / per;
    fn_ = fn;
    ctx_ = ctx;
    n_ = n;
    per_ = per;
    done_.store(0, std::memory_order_relaxed);
    ++gen_;
    claim_.store(((uint64_t)gen_ << 32) | ((uint64_t)total << 16), std::memory_order_seq_cst);
    if (sleepers_.load(std::memory_order_seq_cst) > 0) {
      std::lock_guard<std::mutex> lk(mu_);
      cv_.notify_all();
    }
    t_in_region = true;
    while (work_one()) {
    }
    t_in_region = false;
    wait_until([&] { return done_.load(std::memory_order_acquire) == total; });
  }

 private:
  // Claims and runs one chunk of the current job; false when none is left.
  bool work_one() {
    uint64_t v = claim_.load(std::memory_order_acquire);
    for (;;) {
      const uint64_t total = (v >> 16) & 0xffff, next = v & 0xffff;
      if (next >= total) return false;
      if (claim_.compare_exchange_weak(v, v + 1, std::memory_order_acq_rel, std::memory_order_acquire)) {
        const int64_t b = (int64_t)next * per_, e = std::min(n_, b + per_);
        fn_(ctx_, b, e);
        done_.fetch_add(1, std::memory_order_release);
        return true;
      }
    }
  }

  bool has_work() const {
    const uint64_t v = claim_.load(std::memory_order_seq_cst);
    return (v & 0xffff) < ((v >> 16) & 0xffff);
  }

  template <class Pred>
  static void wait_until(Pred ready) {
    const auto t0 = Clock::now();
    for (int i = 0; !ready(); ++i) {
      if (i < 64 || Clock::now() - t0 < kSpin) SPECD_PAUSE();
      else std::this_thread::yield();
    }
  }

  void worker_loop() {
    t_in_region = true;
    auto idle_since = Clock::now();
    while (!quit_.load(std::memory_order_acquire)) {
      if (work_one()) {
        idle_since = Clock::now();
        continue;
      }
      const auto idle = Clock::now() - idle_since;
      if (idle < kSpin) {
        SPECD_PAUSE();
      } else if (idle < kYield) {
        std::this_thread::yield();
      } else {
        std::unique_lock<std::mutex> lk(mu_);
        sleepers_.fetch_add(1, std::memory_order_seq_cst);
        cv_.wait_for(lk, std::chrono::milliseconds(100),
                     [&] { return quit_.load(std::memory_order_acquire) || has_work(); });
        sleepers_.fetch_sub(1, std::memory_order_seq_cst);
        idle_since = Clock::now();
      }
    }
  }

  // Threads start lazily, and again in a forked child (which inherits none of them).
  void ensure_started() {
    if (owner_pid_ == getpid() && (int)threads_.size() == n_threads_ - 1) return;
    if (owner_pid_ != getpid()) forget_threads();  // parent's threads do not exist here
    else stop();
    quit_.store(false);
    owner_pid_ = getpid();
    for (int i = 1; i < n_threads_; ++i) threads_.emplace_back([this] { worker_loop(); });
  }

  // Forked child: the handles name threads that exist only in the parent; neither join
  // nor destroy them (destroying a joinable std::thread aborts), just leak the vector.
  void forget_threads() {
    new (&threads_storage_) std::vector<std::thread>();
  }

  void stop() {
    if (owner_pid_ != getpid()) {
      forget_threads();
      return;
    }
    quit_.store(true, std::memory_order_release);
    {
      std::lock_guard<std::mutex> lk(mu_);
      cv_.notify_all();
    }
    for (auto& t : threads_) t.join();
    threads_.clear();
  }

  int n_threads_ = 1;
  pid_t owner_pid_ = 0;
  // placement-constructed so a forked child can abandon the parent's handles
  alignas(std::vector<std::thread>) unsigned char threads_storage_[sizeof(std::vector<std::thread>)];
  std::vector<std::thread>& threads_ = *new (&threads_storage_) std::vector<std::thread>();
  std::mutex run_mu_;
  // the current job (see the protocol above)
  std::atomic<uint64_t> claim_{0};
  std::atomic<int64_t> done_{0};
  uint32_t gen_ = 0;
  detail::ChunkFn fn_ = nullptr;
  const void* ctx_ = nullptr;
  int64_t n_ = 0, per_ = 1;
  // idle workers
  std::atomic<bool> quit_{false};
  std::atomic<int> sleepers_{0};
  std::mutex mu_;
  std::condition_variable cv_;
};

Pool& pool() {
  static Pool* p = new Pool();  // never destroyed: workers may outlive static teardown
  return *p;
}

int g_threads = 0;

}  // namespace

void set_num_threads(int n) {
  if (n <= 0) n = (int)std::max(1u, std::thread::hardware_concurrency());
  if (n == g_threads) return;
  g_threads = n;
  pool().resize(n);
}

int num_threads() {
  if (g_threads <= 0) set_num_threads(0);
  return g_threads;
}

namespace detail {

bool in_parallel_region() { return t_in_region; }

void run_parallel(int64_t n, int64_t grain, ChunkFn fn, const void* ctx) { pool().run(n, grain, fn, ctx); }

}  // namespace detail

}  // namespace specd
