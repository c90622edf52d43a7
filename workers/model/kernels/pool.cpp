// A work-sharing pool whose caller never waits for a helper that has not started.
//
// OpenMP's fork/join (at::parallel_for) hands each thread a fixed share and joins on all of them:
// when the second core is busy with another process (the normal state of a shared 2-core host),
// the caller waits out the other process's time slice — measured 2x slower than one thread for
// batch-1 projections. Here chunks are claimed from an atomic counter: a helper that wakes late
// finds the work already done, and the caller only waits for chunks a helper actually took.
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "kernels.h"

namespace llmk {
namespace {

class Pool {
 public:
  explicit Pool(int helpers) {
    for (int i = 0; i < helpers; ++i) threads_.emplace_back([this] { helper(); });
  }

  ~Pool() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    for (auto& t : threads_) t.join();
  }

  int size() const { return static_cast<int>(threads_.size()) + 1; }

  void run(int64_t n, int64_t grain, const ChunkFn& fn) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      fn_ = &fn;
      n_ = n;
      grain_ = grain;
      next_.store(0, std::memory_order_relaxed);
      open_ = true;
      ++generation_;
    }
    cv_.notify_all();
    work(fn, n, grain);
    {
      // Closed under the lock: a helper joins (active_++) only while open, so after this every
      // helper that will ever touch fn is counted.
      std::lock_guard<std::mutex> lock(mu_);
      open_ = false;
    }
    while (active_.load(std::memory_order_acquire) != 0) _mm_pause();
  }

 private:
  void work(const ChunkFn& fn, int64_t n, int64_t grain) {
    for (;;) {
      const int64_t begin = next_.fetch_add(grain, std::memory_order_relaxed);
      if (begin >= n) return;
      fn(begin, std::min(n, begin + grain));
    }
  }

  void helper() {
    uint64_t seen = 0;
    for (;;) {
      const ChunkFn* fn;
      int64_t n, grain;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return stop_ || (open_ && generation_ != seen); });
        if (stop_) return;
        seen = generation_;
        active_.fetch_add(1, std::memory_order_relaxed);
        fn = fn_, n = n_, grain = grain_;
      }
      work(*fn, n, grain);
      active_.fetch_sub(1, std::memory_order_release);
    }
  }

  std::vector<std::thread> threads_;
  std::mutex mu_;
  std::condition_variable cv_;
  const ChunkFn* fn_ = nullptr;
  int64_t n_ = 0, grain_ = 1;
  std::atomic<int64_t> next_{0};
  std::atomic<int> active_{0};
  uint64_t generation_ = 0;
  bool open_ = false, stop_ = false;
};

}  // namespace

void parallel_chunks(int64_t n, int64_t grain, const ChunkFn& fn) {
  // Sized by torch's thread count (EngineConfig.num_threads sets it); rebuilt if that changes.
  static std::unique_ptr<Pool> pool;
  static std::mutex guard;
  const int threads = at::get_num_threads();
  grain = std::max<int64_t>(grain, 1);
  if (threads <= 1 || n <= grain) {
    fn(0, n);
    return;
  }
  std::lock_guard<std::mutex> lock(guard);   // one caller at a time (the engine has one)
  if (!pool || pool->size() != threads) pool = std::make_unique<Pool>(threads - 1);
  pool->run(n, grain, fn);
}

}  // namespace llmk
