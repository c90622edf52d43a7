// AMX bf16 tiles (qgemm_amx.cpp): plain pointers only, no inline code, so this header is safe to
// include from files compiled for AVX2.
#pragma once
#include <cstdint>

namespace llmk_amx {

constexpr int64_t kRowBlock = 32;   // activation rows per pass: two 16-row A tiles
constexpr int64_t kColBlock = 16;   // output channels per B tile
constexpr int64_t kKBlock = 32;     // bf16 k per tile row

// True when this CPU has AMX-TILE and AMX-BF16 (cpuid) and Linux lets this process use the
// tile registers (arch_prctl ARCH_REQ_XCOMP_PERM, asked once here).
bool available();

// n floats -> bf16 (round to nearest even), n a multiple of 16.
void to_bf16(const float* src, int64_t n, uint16_t* dst);

// out[r, nb*16 + c] (+)= sum_k a[r, k] * w[nb*16 + c, k] for r < m and n blocks [nb0, nb1).
//   a: bf16 [mp, k] row-major, mp a multiple of kRowBlock (rows >= m zero), k % 32 == 0;
//   w: bf16 packed [N/16][K/32][16 k-pairs][16 channels][2] (qgemm.cpp: pack_amx);
//   out: fp32 rows of stride ldo.
void gemm(const uint16_t* a, int64_t m, int64_t mp, int64_t k, const uint16_t* w, int64_t nb0,
          int64_t nb1, float* out, int64_t ldo, bool accumulate);

}  // namespace llmk_amx
