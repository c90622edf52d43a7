// AMX bf16 tiles for the decoder stack's projections on CPUs that have them (Sapphire Rapids and
// later), on a bf16 copy of the quantized weight packed once at load.
//
// Why not oneDNN (at::mm on that copy, as AVX-512 bf16 CPUs without AMX do): its GEMM runs on
// OpenMP threads beside our pool. At decode sizes the handoff costs more than the arithmetic:
// on the 2-core AMX Xeon a 32-row step's projections took 21 ms through oneDNN (8 ms for the
// same calls alone), and OpenMP's spinning threads slowed the attention that follows each one
// from 12 to 22 ms. These tiles run on our own pool, in the same step as everything else.
//
// One tile op, tdpbf16ps, adds a [16 rows x 32 k] bf16 A tile times a [16 k-pairs x 16 channels
// x 2] bf16 B tile into a [16 x 16] fp32 C tile. Each pass keeps 2 x 2 C tiles (32 rows x 32
// channels) over the whole K, so every weight tile is read once per 32 activation rows.
//
// Only this file is compiled for AMX / AVX-512 (the pragma below, after every include): nothing
// here may be an inline function shared with other files (see qgemm_vnni.cpp).
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>

#include "qgemm_amx.h"

#pragma GCC push_options
#pragma GCC target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512bf16")

namespace {

constexpr long kArchReqXcompPerm = 0x1023;
constexpr long kXfeatureXtiledata = 18;

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

TileConfig make_config() {
  TileConfig c;
  for (int t = 0; t < 8; ++t) {   // C 0-3, A 4-5, B 6-7: all 16 rows of 64 bytes
    c.colsb[t] = 64;
    c.rows[t] = 16;
  }
  return c;
}

bool detect() {
  unsigned eax, ebx, ecx, edx;
  if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
  const bool bf16 = edx & (1u << 22), tile = edx & (1u << 24);
  if (!bf16 || !tile) return false;
  // Linux hands out the 8 KB of tile state only to a process that asks (kernel 5.16+).
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
}

}  // namespace

namespace llmk_amx {

bool available() {
  static const bool ok = detect();
  return ok;
}

void to_bf16(const float* src, int64_t n, uint16_t* dst) {
  for (int64_t i = 0; i < n; i += 16) {
    const __m256bh v = _mm512_cvtneps_pbh(_mm512_loadu_ps(src + i));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), reinterpret_cast<const __m256i&>(v));
  }
}

void gemm(const uint16_t* a, int64_t m, int64_t mp, int64_t k, const uint16_t* w, int64_t nb0,
          int64_t nb1, float* out, int64_t ldo, bool accumulate) {
  static const TileConfig config = make_config();
  _tile_loadconfig(&config);
  const int64_t kbs = k / kKBlock, tile_elems = 16 * 32, a_stride = k * 2;
  alignas(64) float c[4][16 * 16];
  for (int64_t nb = nb0; nb < nb1; nb += 2) {
    const bool two = nb + 1 < nb1;
    const uint16_t* b0 = w + nb * kbs * tile_elems;
    const uint16_t* b1 = b0 + kbs * tile_elems;
    for (int64_t mb = 0; mb < mp; mb += kRowBlock) {
      const uint16_t* a0 = a + mb * k;
      const uint16_t* a1 = a0 + 16 * k;
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int64_t kb = 0; kb < kbs; ++kb) {
        _tile_loadd(4, a0 + kb * kKBlock, a_stride);
        _tile_loadd(5, a1 + kb * kKBlock, a_stride);
        _tile_loadd(6, b0 + kb * tile_elems, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(2, 5, 6);
        if (two) {
          _tile_loadd(7, b1 + kb * tile_elems, 64);
          _tile_dpbf16ps(1, 4, 7);
          _tile_dpbf16ps(3, 5, 7);
        }
      }
      _tile_stored(0, c[0], 64);
      _tile_stored(1, c[1], 64);
      _tile_stored(2, c[2], 64);
      _tile_stored(3, c[3], 64);
      for (int half = 0; half < 2; ++half) {        // rows mb + 16 * half ...
        for (int r = 0; r < 16; ++r) {
          const int64_t row = mb + 16 * half + r;
          if (row >= m) break;
          for (int j = 0; j < (two ? 2 : 1); ++j) {  // channels (nb + j) * 16 ...
            float* dst = out + row * ldo + (nb + j) * kColBlock;
            const __m512 v = _mm512_load_ps(c[2 * half + j] + r * 16);
            _mm512_storeu_ps(dst, accumulate ? _mm512_add_ps(_mm512_loadu_ps(dst), v) : v);
          }
        }
      }
    }
  }
  _tile_release();
}

}  // namespace llmk_amx

#pragma GCC pop_options
