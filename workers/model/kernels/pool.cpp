// A work-sharing pool whose caller never waits for a helper that has not started.
//
// OpenMP's fork/join (at::parallel_for) hands each thread a fixed share and joins on all of them:
// when the second core is busy with another process (the normal state of a shared 2-core host),
// the caller waits out the other process's time slice — measured 2x slower than one thread for
// batch-1 projections. Here chunks are claimed from an atomic counter: a helper that wakes late
// finds the work already done, and the caller only waits for chunks a helper actually took.
//
// A batch-1 decode step forks ~150 times (4 projections + attention per layer, 30 layers), each
// job 5-50 us. Waking a helper through a futex costs ~5-20 us, so after each job helpers spin on
// the generation counter for a while (LLMMESH_POOL_SPIN_US, default 300) before they sleep; the
// caller only takes the lock and notifies when some helper actually sleeps. Before handing the
// cores to ATen's own threads (the bf16 GEMMs of prefill), park_pool_helpers() sends spinning
// helpers to sleep at once: spinning beside oneDNN's threads cost prefill ~20%.
//
// Each participant (the caller is 0, helper i is i) first claims chunks from its own contiguous
// segment of [0, n), front to back, and only then from the others' (stealing, chunk by chunk).
// With one shared counter, two threads took alternate chunks, so each one's weight stream broke
// at every chunk; few large chunks kept the streams whole but let a descheduled helper hold up
// the caller for a large share. Per-step A/B on a 2-core Zen 4 (weights on huge pages, 8 chunks
// a projection; set_tunable("pool_segments", 0) for the shared counter): int4 decode @1 227 ->
// 240 tok/s, @8 695 -> 729, @32 787 -> 823; int8 @1 198 -> 204. With segments the chunk count
// no longer mattered (int4 @1: 236-244 tok/s at 2, 8, 16 and 32 chunks).
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "kernels.h"

namespace llmk {
namespace {

// 1: per-participant segments (see above); 0: one shared counter (A/B).
bool g_segments = true;

double spin_us() {
  static const double value = [] {
    const char* env = std::getenv("LLMMESH_POOL_SPIN_US");
    return env ? std::atof(env) : 300.0;
  }();
  return value;
}

class Pool {
 public:
  explicit Pool(int helpers) {
    segments_ = std::make_unique<Segment[]>(helpers + 1);
    for (int i = 0; i < helpers; ++i) threads_.emplace_back([this, i] { helper(i + 1); });
  }

  ~Pool() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_.store(true);
    }
    cv_.notify_all();
    for (auto& t : threads_) t.join();
  }

  int size() const { return static_cast<int>(threads_.size()) + 1; }

  // Helpers stop spinning and sleep until the next run.
  void park() { park_.store(true, std::memory_order_relaxed); }

  void run(int64_t n, int64_t grain, const ChunkFn& fn) {
    // Only one run at a time and none in flight: every helper that joined the last run has left
    // (active_ == 0 below), so these plain fields are not read concurrently.
    park_.store(false, std::memory_order_relaxed);
    fn_ = &fn;
    grain_ = grain;
    parts_ = g_segments ? size() : 1;
    for (int s = 0; s < parts_; ++s) {
      segments_[s].next.store(n * s / parts_, std::memory_order_relaxed);
      segments_[s].end = n * (s + 1) / parts_;
    }
    open_.store(true);                       // seq_cst: publishes the fields above
    generation_.fetch_add(1);
    if (sleepers_.load() > 0) {
      // Pairs with the helper's check under the lock: it either saw the new generation or is
      // already waiting on the condition variable when we notify.
      { std::lock_guard<std::mutex> lock(mu_); }
      cv_.notify_all();
    }
    work(0);
    // A helper joins (active_++) then re-checks open_: after this store and a zero count, no
    // helper will ever touch fn.
    open_.store(false);
    for (int i = 1; active_.load() != 0; ++i) {
      _mm_pause();
      if ((i & 63) == 0) std::this_thread::yield();
    }
  }

 private:
  // Chunks of participant `self`'s own segment, then of every other one.
  void work(int self) {
    for (int i = 0; i < parts_; ++i) {
      Segment& seg = segments_[(self + i) % parts_];
      for (;;) {
        const int64_t begin = seg.next.fetch_add(grain_, std::memory_order_relaxed);
        if (begin >= seg.end) break;
        (*fn_)(begin, std::min(seg.end, begin + grain_));
      }
    }
  }

  // Waits for a generation other than `seen`: spinning first, then asleep.
  uint64_t wait_for_work(uint64_t seen) {
    using clock = std::chrono::steady_clock;
    const auto deadline = clock::now() + std::chrono::duration<double, std::micro>(spin_us());
    for (int i = 0;; ++i) {
      const uint64_t g = generation_.load();
      if (g != seen || stop_.load()) return g;
      if (park_.load(std::memory_order_relaxed)) break;
      _mm_pause();
      if ((i & 63) == 63) {
        // Yield: free on an idle core, and on a loaded host the core goes to whoever is ready
        // (the caller's own next step, or another process) instead of to our spinning.
        std::this_thread::yield();
        if (clock::now() > deadline) break;
      }
    }
    std::unique_lock<std::mutex> lock(mu_);
    sleepers_.fetch_add(1);
    cv_.wait(lock, [&] { return stop_.load() || generation_.load() != seen; });
    sleepers_.fetch_sub(1);
    return generation_.load();
  }

  void helper(int self) {
    uint64_t seen = generation_.load();
    for (;;) {
      seen = wait_for_work(seen);
      if (stop_.load()) return;
      active_.fetch_add(1);
      if (open_.load()) {
        work(self);
      }
      active_.fetch_sub(1);
    }
  }

  std::vector<std::thread> threads_;
  std::mutex mu_;
  std::condition_variable cv_;
  struct alignas(64) Segment {   // one cache line each: claims on one do not slow another's
    std::atomic<int64_t> next{0};
    int64_t end = 0;
  };
  const ChunkFn* fn_ = nullptr;
  int64_t grain_ = 1;
  int parts_ = 1;
  std::unique_ptr<Segment[]> segments_;
  std::atomic<int> active_{0}, sleepers_{0};
  std::atomic<uint64_t> generation_{0};
  std::atomic<bool> open_{false}, stop_{false}, park_{false};
};

// The one pool (the engine has one caller); see parallel_chunks.
std::unique_ptr<Pool> g_pool;
std::mutex g_pool_guard;

}  // namespace

void parallel_chunks(int64_t n, int64_t grain, const ChunkFn& fn) {
  // Sized by torch's thread count (EngineConfig.num_threads sets it); rebuilt if that changes.
  const int threads = at::get_num_threads();
  grain = std::max<int64_t>(grain, 1);
  if (threads <= 1 || n <= grain) {
    fn(0, n);
    return;
  }
  std::lock_guard<std::mutex> lock(g_pool_guard);   // one caller at a time (the engine has one)
  if (!g_pool || g_pool->size() != threads) g_pool = std::make_unique<Pool>(threads - 1);
  g_pool->run(n, grain, fn);
}

void set_pool_segments(bool on) {
  std::lock_guard<std::mutex> lock(g_pool_guard);   // never while a run is in flight
  g_segments = on;
}

void park_pool_helpers() {
  std::lock_guard<std::mutex> lock(g_pool_guard);
  if (g_pool) g_pool->park();
}

}  // namespace llmk
