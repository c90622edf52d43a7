// AVX-512 halves of the head_dim-64 decode attention (attention_avx512.cpp): plain pointers
// only, no inline code, so this header is safe to include from files compiled for AVX2.
#pragma once
#include <cstdint>

namespace llmk_avx512 {

// True when this CPU has avx512f/bw/dq/vl (cpuid, not compiler flags).
bool cpu_supported();
// How many keys ahead the loops below prefetch (A/B).
void set_prefetch_keys(int keys);

// For `heads` (1-4) query heads sharing one KV head, q_g = q + 64 g:
// p[g * ps + j] = scale * q_g . K[j] for j < n, K[j] at keys + offsets[j] (64 floats each);
// with `prefetch`, rows a few keys ahead are prefetched (the first heads of a KV group).
void scores_d64(const float* q, int heads, const float* keys, const int64_t* offsets, int64_t n,
                float scale, float* p, int64_t ps, bool prefetch);
// The same over an fp16 cache (IEEE half bits).
void scores_d64(const float* q, int heads, const uint16_t* keys, const int64_t* offsets,
                int64_t n, float scale, float* p, int64_t ps, bool prefetch);

// out[64 g .. 64 g + 64) = inv[g] * sum_j p[g * ps + j] V[j], V[j] at values + offsets[j].
void weighted_sum_d64(const float* p, int64_t ps, int heads, const float* values,
                      const int64_t* offsets, int64_t n, const float* inv, float* out,
                      bool prefetch);
void weighted_sum_d64(const float* p, int64_t ps, int heads, const uint16_t* values,
                      const int64_t* offsets, int64_t n, const float* inv, float* out,
                      bool prefetch);

}  // namespace llmk_avx512
