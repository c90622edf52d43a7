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
  int hint = 3;                   // 1 = T0, 2 = T1, 3 = T2, 4 = NTA
  // Lines put in streams and lines prefetched from them, since the last reset (tests).
  int64_t planned = 0;
  std::atomic<int64_t> issued{0};
};

// The one stream (the engine has one caller); set only between parallel runs.
extern SideStream g_side;
// 0 turns the stream off; 1-4 pick the prefetch hint (set_tunable("side_prefetch", ...)).
extern int g_side_mode;
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

}  // namespace llmk
