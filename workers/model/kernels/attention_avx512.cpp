// The head_dim-64 decode attention's two loops (q . K and p V) on AVX-512, chosen at run time
// where the CPU has it (fused_ops.cpp: attend_heads_d64). A 64-float row is 4 zmm instead of
// 8 ymm: half the loads and FMAs per key. On the 2-core AMX Xeon, 32 sequences x 196 keys x 30
// layers took 16.7 ms here against 18.9 on AVX2: ~8 GB/s per thread either way. What bounds it
// is neither instructions nor bytes (a bf16 cache, half the bytes, left it at 17.4 vs 17.7 ms;
// an fp16 one on a 2-core Zen 4, 16.5-19.9 vs 17.9-19.9 ms;
// prefetching 8, 24 or 48 keys ahead measured the same): a thread's outstanding misses. On the
// Zen 4 one thread reads the cache at 21 GB/s from L3 and 7.3 GB/s from DRAM, two at 43 and 14
// (a plain sum streams 24 GB/s). Neither the block order (random or in sequence), a layout with
// each KV head's tokens contiguous (emulated: 96 sequences x 1 KV head), prefetching V during
// the K pass, nor prefetching 16 keys ahead into L2 instead of 8 into L1 changed it beyond
// the host's noise.
//
// Only this file is compiled for AVX-512 (the pragma below, after every include): nothing here
// may be an inline function shared with other files (see qgemm_vnni.cpp).
#include <cpuid.h>
#include <immintrin.h>

#include <cstdint>

#include "attention_avx512.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl")

namespace {

// Keys ahead that the first head of a KV group prefetches (8, 24 and 48 measured the same).
constexpr int kAhead = 8;

inline __m256 fold(__m512 v) {   // 16 lanes -> 8 partial sums
  return _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
}

inline float hsum(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}

inline void prefetch_row(const void* row, int bytes) {   // a 64-element row: 2 or 4 lines
  for (int l = 0; l < bytes; l += 64) _mm_prefetch(static_cast<const char*>(row) + l, _MM_HINT_T0);
}

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// The two loops below over an fp32 or an fp16 (uint16_t bits) cache.
template <typename T>
void scores_t(const float* q, const T* keys, const int64_t* offsets, int64_t n, float scale,
              float* p, bool prefetch) {
  const __m512 q0 = _mm512_loadu_ps(q), q1 = _mm512_loadu_ps(q + 16),
               q2 = _mm512_loadu_ps(q + 32), q3 = _mm512_loadu_ps(q + 48);
  auto dot = [&](const T* k) {   // 16 partial sums of q . k, folded to 8
    const __m512 a = _mm512_fmadd_ps(q1, load16(k + 16), _mm512_mul_ps(q0, load16(k)));
    const __m512 b = _mm512_fmadd_ps(q3, load16(k + 48), _mm512_mul_ps(q2, load16(k + 32)));
    return fold(_mm512_add_ps(a, b));
  };
  const __m128 vscale = _mm_set1_ps(scale);
  int64_t j = 0;
  for (; j + 4 <= n; j += 4) {
    if (prefetch)
      for (int u = kAhead; u < kAhead + 4; ++u)
        if (j + u < n) prefetch_row(keys + offsets[j + u], sizeof(T) * 64);
    const __m256 s01 = _mm256_hadd_ps(dot(keys + offsets[j]), dot(keys + offsets[j + 1]));
    const __m256 s23 = _mm256_hadd_ps(dot(keys + offsets[j + 2]), dot(keys + offsets[j + 3]));
    const __m256 s = _mm256_hadd_ps(s01, s23);   // per 128-bit lane: keys j..j+3
    const __m128 sums = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
    _mm_storeu_ps(p + j, _mm_mul_ps(sums, vscale));
  }
  for (; j < n; ++j) p[j] = hsum(dot(keys + offsets[j])) * scale;
}

template <typename T>
void weighted_sum_t(const float* p, const T* values, const int64_t* offsets, int64_t n,
                    float inv, float* out, bool prefetch) {
  __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps(), a2 = _mm512_setzero_ps(),
         a3 = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; ++j) {
    if (prefetch && j + kAhead < n) prefetch_row(values + offsets[j + kAhead], sizeof(T) * 64);
    const __m512 w = _mm512_set1_ps(p[j]);
    const T* v = values + offsets[j];
    a0 = _mm512_fmadd_ps(w, load16(v), a0);
    a1 = _mm512_fmadd_ps(w, load16(v + 16), a1);
    a2 = _mm512_fmadd_ps(w, load16(v + 32), a2);
    a3 = _mm512_fmadd_ps(w, load16(v + 48), a3);
  }
  const __m512 r = _mm512_set1_ps(inv);
  _mm512_storeu_ps(out, _mm512_mul_ps(a0, r));
  _mm512_storeu_ps(out + 16, _mm512_mul_ps(a1, r));
  _mm512_storeu_ps(out + 32, _mm512_mul_ps(a2, r));
  _mm512_storeu_ps(out + 48, _mm512_mul_ps(a3, r));
}

}  // namespace

namespace llmk_avx512 {

bool cpu_supported() {
  unsigned eax, ebx, ecx, edx;
  if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
  const unsigned need = (1u << 16) | (1u << 17) | (1u << 30) | (1u << 31);   // f, dq, bw, vl
  return (ebx & need) == need;
}

void scores_d64(const float* q, const float* keys, const int64_t* offsets, int64_t n,
                float scale, float* p, bool prefetch) {
  scores_t(q, keys, offsets, n, scale, p, prefetch);
}
void scores_d64(const float* q, const uint16_t* keys, const int64_t* offsets, int64_t n,
                float scale, float* p, bool prefetch) {
  scores_t(q, keys, offsets, n, scale, p, prefetch);
}
void weighted_sum_d64(const float* p, const float* values, const int64_t* offsets, int64_t n,
                      float inv, float* out, bool prefetch) {
  weighted_sum_t(p, values, offsets, n, inv, out, prefetch);
}
void weighted_sum_d64(const float* p, const uint16_t* values, const int64_t* offsets, int64_t n,
                      float inv, float* out, bool prefetch) {
  weighted_sum_t(p, values, offsets, n, inv, out, prefetch);
}

}  // namespace llmk_avx512

#pragma GCC pop_options
