// AVX-512 VNNI tiles (qgemm_vnni.cpp): plain pointers only, no inline code, so this header is
// safe to include from files compiled for AVX2.
#pragma once
#include <cstdint>

namespace llmk {
class SideCursor;   // side_prefetch.h
}

namespace llmk_vnni {

constexpr int kMaxRows = 8;   // activation rows per call of tile()

struct Acts {
  const int8_t* patterns;     // [M][groups][256] from build_patterns
  const float* scale;         // [M][groups]
  const float* sum;           // [M][groups]: scale * sum(q)
  int64_t groups;
};

// True when this CPU has avx512f/bw/vl/dq/vnni (checked with cpuid, not compiler flags).
bool cpu_supported();

// Whether the pattern tiles (tile()) beat the AVX2 ones for int8 at a few rows on this CPU: on
// Intel (measured on a Xeon), not on AMD (measured on a Zen 4).
bool patterns_pay();

// One activation row's int8 blocks (groups x 32 bytes) -> groups x 256 pattern bytes.
void build_patterns(const int8_t* q, int64_t groups, bool int4, int8_t* patterns);

// out[r][8] = rows r0 .. r0 + rows - 1 (rows <= kMaxRows) against one 8-channel weight tile,
// before the per-channel scale (int8) or with scale and min applied (int4), as the AVX2 tiles.
void tile(int rows, bool int4, const void* w, const uint16_t* sm, const Acts& a, int64_t r0,
          float* out, int64_t prefetch_bytes);

// The plain quantized rows, for the pair tiles (no patterns: activations are broadcast).
struct Rows {
  const int8_t* q;            // [M][kp]
  int64_t kp;
  const float* scale;         // [M][groups]
  const float* sum;           // [M][groups]
  const int32_t* qsum;        // [M][groups]: sum(q), exact
  int64_t groups;
};

// out[r][16] = rows r0 .. r0 + rows - 1 (rows <= kMaxRows) against two 8-channel weight tiles
// (w0's channels in out[r][0..7], w1's in out[r][8..15]), as tile() does for one.
// `side` (may be null) issues its prefetches between the 32-blocks (side_prefetch.h).
// prefetch_bytes: how far ahead of w0 and w1 to prefetch (0: not at all); int4 scales lead by
// an eighth of it (their share of a tile).
void pair(int rows, bool int4, const void* w0, const void* w1, const uint16_t* sm0,
          const uint16_t* sm1, const Rows& a, int64_t r0, float* out, int64_t prefetch_bytes,
          llmk::SideCursor* side);

}  // namespace llmk_vnni
