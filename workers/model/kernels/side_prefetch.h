// Prefetching the next layer's KV cache while this layer's projections compute (the "side
// stream"). Header-only fast path: safe to include from files compiled for AVX2 or AVX-512.
//
// A decode step's attention reads every sequence's K and V rows of that layer from DRAM, and
// read that way (short runs in blocks scattered over the pool, compute between the loads) it
// stalls on memory: on a 2-core Zen 4, 32 sequences x 160 keys x 30 layers took 17 ms cold, 3 ms
// with each layer's cache in L3, against 7 ms for a plain sum of the same bytes. Meanwhile the
// projections of a batch of rows are bound by arithmetic, not by DRAM. So the decoder stack
// hands the next layer's KV blocks to the projections in between (o, gate_up, down, then the
// next qkv), and every tile of those GEMMs issues a few prefetches of them, spread in proportion
// to its multiply-adds, so the lines arrive while the GEMM computes and the attention that
// follows reads them from cache.
#pragma once
#include <xmmintrin.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <vector>

namespace llmk {

struct SideRange {
  const char* p;
  int64_t lines;   // 64-byte lines from p
};

struct SideStream {
  std::vector<SideRange> ranges;
  std::atomic<int64_t> next{0};   // the next range to claim
  double lines_per_mac = 0.0;     // 0: no stream
  int hint = 3;                   // 0 = off, 1 = T0, 2 = T1, 3 = T2, 4 = NTA
  // Lines put in streams and lines prefetched from them, since the last reset (tests).
  int64_t planned = 0;
  std::atomic<int64_t> issued{0};
};

// The one stream (the engine has one caller); set only between parallel runs. Its hint is
// set_tunable("side_prefetch", ...): 0 turns the stream off.
extern SideStream g_side;
// Batches of fewer rows get no stream: their projections stream weights from DRAM themselves
// (per-step A/B, int4, 2-core Zen 4: @1 and @2 unchanged, @4 +5%, @8 +12%, @32 +16%).
constexpr int64_t kSideMinRows = 4;

// One kernel body's share: call advance(macs) after each tile; it issues prefetches worth of
// the multiply-adds done, claiming ranges from g_side as it goes.
class SideCursor {
 public:
  // Credit starts at one line, so each cursor rounds its share up (the stream ends the
  // overshoot): no line is left unissued by rounding.
  SideCursor() : rate_(g_side.lines_per_mac), credit_(rate_ > 0.0 ? 1.0 : 0.0) {}
  // A range it claimed is finished here: no other cursor can reach its lines.
  ~SideCursor() {
    if (left_ > 0) finish();
    if (issued_) g_side.issued.fetch_add(issued_, std::memory_order_relaxed);
  }
  SideCursor(const SideCursor&) = delete;
  SideCursor& operator=(const SideCursor&) = delete;
  // Whether advance() can still issue anything (kernels without a stream skip it entirely).
  bool active() const { return rate_ != 0.0; }
  inline void advance(double macs) {
    if (rate_ == 0.0) return;
    credit_ += macs * rate_;
    if (credit_ >= 1.0) issue();
  }

 private:
  void issue();
  void finish();
  double rate_, credit_;
  const char* p_ = nullptr;
  int64_t left_ = 0, issued_ = 0;
};

// Whether the side stream pays changes with what else shares the host's caches and memory: on
// the same 2-core Zen 4, int4 decode @32 measured +11-16% with it, and an hour later, with the
// host slower overall, -4 to -12%. So the decoder stack probes: every kPeriod-th eligible call
// outside a pair starts one (that call and the next, one with the stream and one without, the
// order alternating); the log of their time ratio feeds an exponential average, and between
// probes the stream runs while that average says it is faster. A pair whose row counts differ
// is dropped (a different batch is no comparison).
class SideController {
 public:
  static constexpr int64_t kPeriod = 8;
  static constexpr double kAlpha = 0.25;

  // Whether this call runs with the stream (end() gets its rows, to compare a pair's).
  bool begin() {
    if (phase_ == kFirstDone) {
      phase_ = kSecond;
      return !first_on_;
    }
    if (++calls_ % kPeriod == 0) {
      phase_ = kFirst;
      first_on_ = next_first_on_;
      next_first_on_ = !next_first_on_;
      return first_on_;
    }
    phase_ = kNone;
    return on();
  }

  void end(int64_t rows, double seconds) {
    if (phase_ == kFirst) {
      first_seconds_ = seconds;
      first_rows_ = rows;
      phase_ = kFirstDone;
    } else if (phase_ == kSecond) {
      if (rows == first_rows_ && seconds > 0.0 && first_seconds_ > 0.0) {
        const double on = first_on_ ? first_seconds_ : seconds;
        const double off = first_on_ ? seconds : first_seconds_;
        score_ = (1.0 - kAlpha) * score_ + kAlpha * std::log(on / off);
        ++pairs_;
      }
      phase_ = kNone;
    }
  }

  double score() const { return score_; }   // mean log(time with / time without); < 0: pays
  int64_t pairs() const { return pairs_; }
  bool on() const { return score_ <= 0.0; }

 private:
  enum Phase { kNone, kFirst, kFirstDone, kSecond };
  Phase phase_ = kNone;
  int64_t calls_ = 0, first_rows_ = 0, pairs_ = 0;
  bool first_on_ = true, next_first_on_ = true;
  double first_seconds_ = 0.0, score_ = 0.0;
};

}  // namespace llmk
