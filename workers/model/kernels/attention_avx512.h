// AVX-512 halves of the head_dim-64 decode attention (attention_avx512.cpp): plain pointers
// only, no inline code, so this header is safe to include from files compiled for AVX2.
#pragma once
#include <cstdint>

namespace llmk_avx512 {

// True when this CPU has avx512f/bw/dq/vl (cpuid, not compiler flags).
bool cpu_supported();

// p[j] = scale * q . K[j] for j < n, K[j] at keys + offsets[j] (64 floats each); with
// `prefetch`, rows a few keys ahead are prefetched (the first head of a KV group).
void scores_d64(const float* q, const float* keys, const int64_t* offsets, int64_t n,
                float scale, float* p, bool prefetch);
// The same over an fp16 cache (IEEE half bits).
void scores_d64(const float* q, const uint16_t* keys, const int64_t* offsets, int64_t n,
                float scale, float* p, bool prefetch);

// out[0..64) = inv * sum_j p[j] V[j], V[j] at values + offsets[j].
void weighted_sum_d64(const float* p, const float* values, const int64_t* offsets, int64_t n,
                      float inv, float* out, bool prefetch);
void weighted_sum_d64(const float* p, const uint16_t* values, const int64_t* offsets, int64_t n,
                      float inv, float* out, bool prefetch);

}  // namespace llmk_avx512
