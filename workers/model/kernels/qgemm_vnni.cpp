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
// The pair tiles (pair()) take two 8-channel weight tiles at once and broadcast the activations
// from the plain int8 rows instead: one 4-byte broadcast feeds 16 channels, and nothing is built
// or re-read per row. They serve batches (decode steps); see qgemm.cpp for where each runs.
//
// Only this file is compiled for AVX-512 (the pragma below, after every include): nothing here
// may be an inline function shared with other files, or the linker could pick an AVX-512 copy
// for the AVX2 code path. Everything is in an anonymous namespace except the entry points.
#include <immintrin.h>

#include <cstdint>

#include "qgemm_vnni.h"
#include "side_prefetch.h"

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

// Two weight tiles at once (16 channels in a zmm: the first tile's 8 in the low half), and the
// activations broadcast 4 bytes at a time from the plain rows: each broadcast serves 16 channels,
// and no pattern buffer (8 bytes per activation byte, re-read from L2 for every weight tile)
// is built or streamed. Batched decode: every row of the batch against the same weights.
inline __m512i join(const void* lo, const void* hi) {
  return _mm512_inserti64x4(
      _mm512_castsi256_si512(_mm256_loadu_si256(static_cast<const __m256i*>(lo))),
      _mm256_loadu_si256(static_cast<const __m256i*>(hi)), 1);
}

inline __m512 join_ph(const uint16_t* lo, const uint16_t* hi) {
  const __m256 a = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(lo)));
  const __m256 b = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(hi)));
  return _mm512_insertf32x8(_mm512_castps256_ps512(a), b, 1);
}

inline __m512i bcast4(const int8_t* p) {
  int32_t v;
  __builtin_memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// sum over one 32-block of w[j] (16 channels x 4 k) times activation bytes 4j .. 4j + 3, in two
// chains so the dpbusd latencies overlap.
inline __m512i dot32(const __m512i (&w)[8], const int8_t* xp) {
  __m512i s0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[0], bcast4(xp));
  __m512i s1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[1], bcast4(xp + 4));
  for (int j = 2; j < 8; j += 2) {
    s0 = _mm512_dpbusd_epi32(s0, w[j], bcast4(xp + 4 * j));
    s1 = _mm512_dpbusd_epi32(s1, w[j + 1], bcast4(xp + 4 * j + 4));
  }
  return _mm512_add_epi32(s0, s1);
}

template <int R, bool kSide>
void pair_int8(const int8_t* w0, const int8_t* w1, const llmk_vnni::Rows& a, int64_t r0,
               float* out, int64_t pf, llmk::SideCursor* side) {
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  const int8_t* x[R];
  const float* xs[R];
  const int32_t* qs[R];
  __m512 acc[R];
  for (int r = 0; r < R; ++r) {
    x[r] = a.q + (r0 + r) * a.kp;
    xs[r] = a.scale + (r0 + r) * a.groups;
    qs[r] = a.qsum + (r0 + r) * a.groups;
    acc[r] = _mm512_setzero_ps();
  }
  for (int64_t g = 0; g < a.groups; ++g) {
    if (kSide) side->advance(R * 16 * 32);
    if (pf) {
      prefetch_lines(w0 + g * 256 + pf, 4);
      prefetch_lines(w1 + g * 256 + pf, 4);
    }
    __m512i wv[8];
    for (int s = 0; s < 8; ++s)
      wv[s] = _mm512_xor_si512(join(w0 + g * 256 + 32 * s, w1 + g * 256 + 32 * s), flip);
    for (int r = 0; r < R; ++r) {
      // The +128 on every weight added 128 * sum(q): taken off in integers, exactly (in fp32
      // after the K sum it cancelled digits: 1e-4 off on K = 1536).
      const __m512i s = _mm512_sub_epi32(dot32(wv, x[r] + g * 32),
                                         _mm512_set1_epi32(128 * qs[r][g]));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_set1_ps(xs[r][g]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + 16 * r, acc[r]);
}

template <int R, bool kSide>
void pair_int4(const uint8_t* w0, const uint8_t* w1, const uint16_t* sm0, const uint16_t* sm1,
               const llmk_vnni::Rows& a, int64_t r0, float* out, int64_t pf,
               llmk::SideCursor* side) {
  const __m512i low = _mm512_set1_epi8(0x0F);
  const int8_t* x[R];
  const float *xs[R], *xsum[R];
  __m512 acc[R];
  for (int r = 0; r < R; ++r) {
    x[r] = a.q + (r0 + r) * a.kp;
    xs[r] = a.scale + (r0 + r) * a.groups;
    xsum[r] = a.sum + (r0 + r) * a.groups;
    acc[r] = _mm512_setzero_ps();
  }
  for (int64_t g = 0; g < a.groups; ++g) {
    if (kSide) side->advance(R * 16 * 32);
    if (pf) {
      prefetch_lines(w0 + g * 128 + pf, 2);
      prefetch_lines(w1 + g * 128 + pf, 2);
      if ((g & 1) == 0) {   // a tile's scales, in uint16s, number 1/8 of its weight bytes
        prefetch_lines(sm0 + g * 16 + pf / 8, 1);
        prefetch_lines(sm1 + g * 16 + pf / 8, 1);
      }
    }
    __m512i wv[8];   // low nibbles (k = 8p + j) at 2p, high ones (k + 4) at 2p + 1
    for (int p = 0; p < 4; ++p) {
      const __m512i v = join(w0 + g * 128 + 32 * p, w1 + g * 128 + 32 * p);
      wv[2 * p] = _mm512_and_si512(v, low);
      wv[2 * p + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
    }
    const __m512 d = join_ph(sm0 + g * 16, sm1 + g * 16);
    const __m512 mn = join_ph(sm0 + g * 16 + 8, sm1 + g * 16 + 8);
    for (int r = 0; r < R; ++r) {
      const __m512 dot = _mm512_cvtepi32_ps(dot32(wv, x[r] + g * 32));
      acc[r] = _mm512_fmadd_ps(dot, _mm512_mul_ps(d, _mm512_set1_ps(xs[r][g])), acc[r]);
      acc[r] = _mm512_fmadd_ps(mn, _mm512_set1_ps(xsum[r][g]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + 16 * r, acc[r]);
}

template <int R>
void dispatch_pair(bool int4, const void* w0, const void* w1, const uint16_t* sm0,
                   const uint16_t* sm1, const llmk_vnni::Rows& a, int64_t r0, float* out,
                   int64_t pf, llmk::SideCursor* side) {
  // Without a stream the tiles are instantiated without the cursor: its out-of-line issue()
  // in the group loop, even never called, made gcc spill every accumulator around it each
  // 32-block (a standalone copy of pair_int8<8>, weights in cache, one thread: 796 GOP/s
  // without the cursor, 605 with it at rate 0). Per-step A/B in the engine on the 2-core Zen 5
  // (where the adaptive stream mostly stays off): int4 decode @8 +7.5%, @32 +9%; int8 +2%, +6.6%.
  const bool stream = side != nullptr && side->active();
  if (int4) {
    auto* w0q = static_cast<const uint8_t*>(w0);
    auto* w1q = static_cast<const uint8_t*>(w1);
    if (stream) pair_int4<R, true>(w0q, w1q, sm0, sm1, a, r0, out, pf, side);
    else pair_int4<R, false>(w0q, w1q, sm0, sm1, a, r0, out, pf, side);
  } else {
    auto* w0q = static_cast<const int8_t*>(w0);
    auto* w1q = static_cast<const int8_t*>(w1);
    if (stream) pair_int8<R, true>(w0q, w1q, a, r0, out, pf, side);
    else pair_int8<R, false>(w0q, w1q, a, r0, out, pf, side);
  }
}

}  // namespace

namespace llmk_vnni {

void pair(int rows, bool int4, const void* w0, const void* w1, const uint16_t* sm0,
          const uint16_t* sm1, const Rows& a, int64_t r0, float* out, int64_t pf,
          llmk::SideCursor* side) {
  switch (rows) {
    case 1: dispatch_pair<1>(int4, w0, w1, sm0, sm1, a, r0, out, pf, side); break;
    case 2: dispatch_pair<2>(int4, w0, w1, sm0, sm1, a, r0, out, pf, side); break;
    case 3: dispatch_pair<3>(int4, w0, w1, sm0, sm1, a, r0, out, pf, side); break;
    case 4: dispatch_pair<4>(int4, w0, w1, sm0, sm1, a, r0, out, pf, side); break;
    case 5: dispatch_pair<5>(int4, w0, w1, sm0, sm1, a, r0, out, pf, side); break;
    case 6: dispatch_pair<6>(int4, w0, w1, sm0, sm1, a, r0, out, pf, side); break;
    case 7: dispatch_pair<7>(int4, w0, w1, sm0, sm1, a, r0, out, pf, side); break;
    default: dispatch_pair<8>(int4, w0, w1, sm0, sm1, a, r0, out, pf, side); break;
  }
}

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

bool patterns_pay() {
  __builtin_cpu_init();
  return !__builtin_cpu_is("amd");
}

}  // namespace llmk_vnni
