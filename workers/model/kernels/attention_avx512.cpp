// The head_dim-64 decode attention's two loops (q . K and p V) on AVX-512, chosen at run time
// where the CPU has it (fused_ops.cpp: attend_heads_d64). A 64-float row is 4 zmm instead of
// 8 ymm: half the loads and FMAs per key. On the 2-core AMX Xeon, 32 sequences x 196 keys x 30
// layers took 16.7 ms here against 18.9 on AVX2: ~8 GB/s per thread either way. What bounds it
// is neither instructions nor bytes (a bf16 cache, half the bytes, left it at 17.4 vs 17.7 ms;
// an fp16 one on a 2-core Zen 4, 16.5-19.9 vs 17.9-19.9 ms;
// prefetching 8, 24 or 48 keys ahead measured the same there; a Zen 5 gains from 24, kAhead
// below): a thread's outstanding misses. On the
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

// Keys ahead that the first head of a KV group prefetches. On the Zen 4, 8, 24 and 48 measured
// the same; on a 2-core Zen 5 (per-step A/B against 8, 128-token prompts, 128 new tokens) 24
// gave int4 decode @8 +6.5%, @32 +7.0% (@1 +1%), int8 +7.1%, +1.3%; 48 the same as 24. At 8
// keys a thread had at most ~32 lines in flight, ~20 GB/s at DRAM latency: the attention read
// its KV at ~36 GB/s of a 53 GB/s stream. set_tunable("attention_ahead", keys) for A/B.
int kAhead = 24;

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

// The two loops below over an fp32 or an fp16 (uint16_t bits) cache, for G query heads that
// share one KV head (G <= 4): keys go in blocks of four, every head's dots per block, so the
// block's rows come from memory for the first head and from L1 for the others.
template <typename T, int G>
void scores_t(const float* q, const T* keys, const int64_t* offsets, int64_t n, float scale,
              float* p, int64_t ps, bool prefetch) {
  __m512 qv[G][4];
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < 4; ++i) qv[g][i] = _mm512_loadu_ps(q + 64 * g + 16 * i);
  auto dot = [&](int g, const T* k) {   // 16 partial sums of q_g . k, folded to 8
    const __m512 a = _mm512_fmadd_ps(qv[g][1], load16(k + 16), _mm512_mul_ps(qv[g][0], load16(k)));
    const __m512 b = _mm512_fmadd_ps(qv[g][3], load16(k + 48), _mm512_mul_ps(qv[g][2], load16(k + 32)));
    return fold(_mm512_add_ps(a, b));
  };
  const __m128 vscale = _mm_set1_ps(scale);
  int64_t j = 0;
  for (; j + 4 <= n; j += 4) {
    if (prefetch)
      for (int u = kAhead; u < kAhead + 4; ++u)
        if (j + u < n) prefetch_row(keys + offsets[j + u], sizeof(T) * 64);
    const T *k0 = keys + offsets[j], *k1 = keys + offsets[j + 1], *k2 = keys + offsets[j + 2],
            *k3 = keys + offsets[j + 3];
    for (int g = 0; g < G; ++g) {
      const __m256 s01 = _mm256_hadd_ps(dot(g, k0), dot(g, k1));
      const __m256 s23 = _mm256_hadd_ps(dot(g, k2), dot(g, k3));
      const __m256 s = _mm256_hadd_ps(s01, s23);   // per 128-bit lane: keys j..j+3
      const __m128 sums = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
      _mm_storeu_ps(p + g * ps + j, _mm_mul_ps(sums, vscale));
    }
  }
  for (; j < n; ++j)
    for (int g = 0; g < G; ++g) p[g * ps + j] = hsum(dot(g, keys + offsets[j])) * scale;
}

template <typename T, int G>
void weighted_sum_t(const float* p, int64_t ps, const T* values, const int64_t* offsets,
                    int64_t n, const float* inv, float* out, bool prefetch) {
  __m512 acc[G][4];
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < 4; ++i) acc[g][i] = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; ++j) {
    if (prefetch && j + kAhead < n) prefetch_row(values + offsets[j + kAhead], sizeof(T) * 64);
    const T* v = values + offsets[j];
    const __m512 v0 = load16(v), v1 = load16(v + 16), v2 = load16(v + 32), v3 = load16(v + 48);
    for (int g = 0; g < G; ++g) {
      const __m512 w = _mm512_set1_ps(p[g * ps + j]);
      acc[g][0] = _mm512_fmadd_ps(w, v0, acc[g][0]);
      acc[g][1] = _mm512_fmadd_ps(w, v1, acc[g][1]);
      acc[g][2] = _mm512_fmadd_ps(w, v2, acc[g][2]);
      acc[g][3] = _mm512_fmadd_ps(w, v3, acc[g][3]);
    }
  }
  for (int g = 0; g < G; ++g) {
    const __m512 r = _mm512_set1_ps(inv[g]);
    for (int i = 0; i < 4; ++i) _mm512_storeu_ps(out + 64 * g + 16 * i, _mm512_mul_ps(acc[g][i], r));
  }
}

template <typename T>
void scores_any(const float* q, int heads, const T* keys, const int64_t* offsets, int64_t n,
                float scale, float* p, int64_t ps, bool prefetch) {
  switch (heads) {
    case 1: return scores_t<T, 1>(q, keys, offsets, n, scale, p, ps, prefetch);
    case 2: return scores_t<T, 2>(q, keys, offsets, n, scale, p, ps, prefetch);
    case 3: return scores_t<T, 3>(q, keys, offsets, n, scale, p, ps, prefetch);
    default: return scores_t<T, 4>(q, keys, offsets, n, scale, p, ps, prefetch);
  }
}

template <typename T>
void weighted_sum_any(const float* p, int64_t ps, int heads, const T* values,
                      const int64_t* offsets, int64_t n, const float* inv, float* out,
                      bool prefetch) {
  switch (heads) {
    case 1: return weighted_sum_t<T, 1>(p, ps, values, offsets, n, inv, out, prefetch);
    case 2: return weighted_sum_t<T, 2>(p, ps, values, offsets, n, inv, out, prefetch);
    case 3: return weighted_sum_t<T, 3>(p, ps, values, offsets, n, inv, out, prefetch);
    default: return weighted_sum_t<T, 4>(p, ps, values, offsets, n, inv, out, prefetch);
  }
}

}  // namespace

namespace llmk_avx512 {
void set_prefetch_keys(int keys) { kAhead = keys; }

bool cpu_supported() {
  unsigned eax, ebx, ecx, edx;
  if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
  const unsigned need = (1u << 16) | (1u << 17) | (1u << 30) | (1u << 31);   // f, dq, bw, vl
  return (ebx & need) == need;
}

void scores_d64(const float* q, int heads, const float* keys, const int64_t* offsets, int64_t n,
                float scale, float* p, int64_t ps, bool prefetch) {
  scores_any(q, heads, keys, offsets, n, scale, p, ps, prefetch);
}
void scores_d64(const float* q, int heads, const uint16_t* keys, const int64_t* offsets,
                int64_t n, float scale, float* p, int64_t ps, bool prefetch) {
  scores_any(q, heads, keys, offsets, n, scale, p, ps, prefetch);
}
void weighted_sum_d64(const float* p, int64_t ps, int heads, const float* values,
                      const int64_t* offsets, int64_t n, const float* inv, float* out,
                      bool prefetch) {
  weighted_sum_any(p, ps, heads, values, offsets, n, inv, out, prefetch);
}
void weighted_sum_d64(const float* p, int64_t ps, int heads, const uint16_t* values,
                      const int64_t* offsets, int64_t n, const float* inv, float* out,
                      bool prefetch) {
  weighted_sum_any(p, ps, heads, values, offsets, n, inv, out, prefetch);
}

}  // namespace llmk_avx512

#pragma GCC pop_options
