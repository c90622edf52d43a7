// AVX-512 VNNI tiles for the int8 / int4 GEMM (same packed layouts as qgemm.cpp's AVX2 tiles),
// chosen at run time when the CPU has avx512f/bw/vl/vnni (qgemm.cpp: use_vnni()).
//
// vpdpbusd multiplies 4 unsigned bytes by 4 signed bytes and adds them to an int32 lane: one
// instruction for what AVX2 does with abs/sign + maddubs + madd + add, on 64 bytes at a time.
// The activation bytes are the signed operand; each 64-byte weight load covers two k-steps
// (8 channels x 4 k, twice), so a row's activations are laid out once per call as "patterns":
// per 32-block, four zmm of [dword a] x 8 | [dword b] x 8 (build_patterns).
//   int8: weights are signed; w ^ 0x80 = w + 128 is the unsigned operand, and the 128 * sum(x)
//         that adds is taken off once per row (the `sum` of the activation blocks).
//   int4: nibbles are unsigned already.
//
// Only this file is compiled for AVX-512 (the pragma below, after every include): nothing here
// may be an inline function shared with other files, or the linker could pick an AVX-512 copy
// for the AVX2 code path. Everything is in an anonymous namespace except the entry points.
#include <immintrin.h>

#include <cstdint>

#include "qgemm_vnni.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")

namespace {

inline void prefetch_lines(const void* p, int lines) {
  for (int i = 0; i < lines; ++i)
    _mm_prefetch(static_cast<const char*>(p) + 64 * i, _MM_HINT_T0);
}

inline __m512i pattern(__m512i x, int a, int b) {
  const __m512i idx = _mm512_setr_epi32(a, a, a, a, a, a, a, a, b, b, b, b, b, b, b, b);
  return _mm512_permutexvar_epi32(idx, x);
}

inline __m256i fold(__m512i v) {
  return _mm256_add_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64(v, 1));
}

template <int R>
void tile_int8(const int8_t* w, const llmk_vnni::Acts& a, int64_t r0, float* out, int64_t pf) {
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  const int8_t* pat[R];
  const float* xs[R];
  __m512 acc[R];
  for (int r = 0; r < R; ++r) {
    pat[r] = a.patterns + (r0 + r) * a.groups * 256;
    xs[r] = a.scale + (r0 + r) * a.groups;
    acc[r] = _mm512_setzero_ps();
  }
  for (int64_t g = 0; g < a.groups; ++g) {
    if (pf) prefetch_lines(w + g * 256 + pf, 4);
    __m512i wv[4];
    for (int j = 0; j < 4; ++j)
      wv[j] = _mm512_xor_si512(_mm512_loadu_si512(w + g * 256 + 64 * j), flip);
    for (int r = 0; r < R; ++r) {
      const int8_t* p = pat[r] + g * 256;
      __m512i s0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wv[0], _mm512_loadu_si512(p));
      __m512i s1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wv[1], _mm512_loadu_si512(p + 64));
      s0 = _mm512_dpbusd_epi32(s0, wv[2], _mm512_loadu_si512(p + 128));
      s1 = _mm512_dpbusd_epi32(s1, wv[3], _mm512_loadu_si512(p + 192));
      // Both halves carry the same 8 channels and the same per-block scale: fold at the end.
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1)),
                               _mm512_set1_ps(xs[r][g]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    const float* sum = a.sum + (r0 + r) * a.groups;
    float bias = 0.0f;   // the +128 on every weight: 128 * sum_k x, as scaled per block
    for (int64_t g = 0; g < a.groups; ++g) bias += sum[g];
    const __m256 v = _mm256_add_ps(_mm512_castps512_ps256(acc[r]),
                                   _mm256_castpd_ps(_mm512_extractf64x4_pd(
                                       _mm512_castps_pd(acc[r]), 1)));
    _mm256_storeu_ps(out + 8 * r, _mm256_sub_ps(v, _mm256_set1_ps(128.0f * bias)));
  }
}

template <int R>
void tile_int4(const uint8_t* w, const uint16_t* sm, const llmk_vnni::Acts& a, int64_t r0,
               float* out, int64_t pf) {
  const __m512i low = _mm512_set1_epi8(0x0F);
  const int8_t* pat[R];
  const float *xs[R], *xsum[R];
  __m256 acc[R], accm[R];
  for (int r = 0; r < R; ++r) {
    pat[r] = a.patterns + (r0 + r) * a.groups * 256;
    xs[r] = a.scale + (r0 + r) * a.groups;
    xsum[r] = a.sum + (r0 + r) * a.groups;
    acc[r] = _mm256_setzero_ps();
    accm[r] = _mm256_setzero_ps();
  }
  for (int64_t g = 0; g < a.groups; ++g) {
    if (pf) {
      prefetch_lines(w + g * 128 + pf, 2);
      if ((g & 1) == 0) prefetch_lines(sm + g * 16 + pf / 4, 1);
    }
    const __m512i v0 = _mm512_loadu_si512(w + g * 128), v1 = _mm512_loadu_si512(w + g * 128 + 64);
    const __m512i lo0 = _mm512_and_si512(v0, low);
    const __m512i hi0 = _mm512_and_si512(_mm512_srli_epi16(v0, 4), low);
    const __m512i lo1 = _mm512_and_si512(v1, low);
    const __m512i hi1 = _mm512_and_si512(_mm512_srli_epi16(v1, 4), low);
    const __m128i* smv = reinterpret_cast<const __m128i*>(sm + g * 16);
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(smv));
    const __m256 mn = _mm256_cvtph_ps(_mm_loadu_si128(smv + 1));
    for (int r = 0; r < R; ++r) {
      const int8_t* p = pat[r] + g * 256;
      __m512i s0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo0, _mm512_loadu_si512(p));
      __m512i s1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), hi0, _mm512_loadu_si512(p + 64));
      s0 = _mm512_dpbusd_epi32(s0, lo1, _mm512_loadu_si512(p + 128));
      s1 = _mm512_dpbusd_epi32(s1, hi1, _mm512_loadu_si512(p + 192));
      const __m256 dot = _mm256_cvtepi32_ps(fold(_mm512_add_epi32(s0, s1)));
      acc[r] = _mm256_fmadd_ps(dot, _mm256_mul_ps(d, _mm256_set1_ps(xs[r][g])), acc[r]);
      accm[r] = _mm256_fmadd_ps(mn, _mm256_set1_ps(xsum[r][g]), accm[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(out + 8 * r, _mm256_add_ps(acc[r], accm[r]));
}

template <int R>
void dispatch(bool int4, const void* w, const uint16_t* sm, const llmk_vnni::Acts& a,
              int64_t r0, float* out, int64_t pf) {
  if (int4) tile_int4<R>(static_cast<const uint8_t*>(w), sm, a, r0, out, pf);
  else tile_int8<R>(static_cast<const int8_t*>(w), a, r0, out, pf);
}

}  // namespace

namespace llmk_vnni {

void build_patterns(const int8_t* q, int64_t groups, bool int4, int8_t* patterns) {
  // int8: zmm j holds k-steps 2j (low half) and 2j + 1: dwords (2j, 2j + 1).
  // int4: a 64-byte load holds p = 2j and 2j + 1; low nibbles need dwords (4j, 4j + 2), high
  //       nibbles (4j + 1, 4j + 3); stored lo0, hi0, lo1, hi1.
  static const int kInt8[4][2] = {{0, 1}, {2, 3}, {4, 5}, {6, 7}};
  static const int kInt4[4][2] = {{0, 2}, {1, 3}, {4, 6}, {5, 7}};
  const int(*order)[2] = int4 ? kInt4 : kInt8;
  for (int64_t g = 0; g < groups; ++g) {
    const __m512i x = _mm512_castsi256_si512(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + g * 32)));
    for (int j = 0; j < 4; ++j)
      _mm512_storeu_si512(patterns + g * 256 + 64 * j, pattern(x, order[j][0], order[j][1]));
  }
}

void tile(int rows, bool int4, const void* w, const uint16_t* sm, const Acts& a, int64_t r0,
          float* out, int64_t pf) {
  switch (rows) {
    case 1: dispatch<1>(int4, w, sm, a, r0, out, pf); break;
    case 2: dispatch<2>(int4, w, sm, a, r0, out, pf); break;
    case 3: dispatch<3>(int4, w, sm, a, r0, out, pf); break;
    case 4: dispatch<4>(int4, w, sm, a, r0, out, pf); break;
    case 5: dispatch<5>(int4, w, sm, a, r0, out, pf); break;
    case 6: dispatch<6>(int4, w, sm, a, r0, out, pf); break;
    case 7: dispatch<7>(int4, w, sm, a, r0, out, pf); break;
    default: dispatch<8>(int4, w, sm, a, r0, out, pf); break;
  }
}

}  // namespace llmk_vnni

#pragma GCC pop_options

namespace llmk_vnni {

bool cpu_supported() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
         __builtin_cpu_supports("avx512vnni");
}

}  // namespace llmk_vnni
