// Weight-only int8 / int4 GEMM for AVX2+FMA CPUs, llama.cpp-style: activations are quantized per
// row in blocks of 32 to int8, products are summed in integers with maddubs/madd, and each
// 32-block is scaled once in fp32. torch's _weight_int8pack_mm / _weight_int4pack_mm have no fast
// AVX2 path (9x / 18x slower than fp32 F.linear on this CPU), hence these.
//
// Packed layout: output channels in blocks of 8 (`nb`), K zero-padded to a multiple of 32.
//   int8: [NB][Kp/4][8 n][4 k] signed bytes + fp32 scale per channel.
//   int4: [NB][Kp/32][4 p][8 n][4 k] bytes; the low nibble holds k = 32g + 8p + j, the high
//         nibble k + 4; [NB][Kp/32][2][8] fp16 (scale, min): w = scale * q + min, q in [0, 15].
// One 32-byte load then serves 8 outputs x 4 (int8) or 8 (int4) k for every activation row: the
// weight tile is read from memory once per call, whatever the batch.
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <ATen/ATen.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "kernels.h"
#include "side_prefetch.h"
#include "qgemm_amx.h"
#include "qgemm_vnni.h"
#include "attention_avx512.h"
#include "vec_math.h"

namespace {

constexpr int64_t kBlock = 32;
constexpr int kMr = 4;  // activation rows per micro-tile: 4 fp32 + 4 int accumulators in ymm

using llmk::Pre;
using llmk::kNone;
using llmk::kRmsNorm;
using llmk::kSiluMul;

struct QuantizedRows {
  std::vector<int8_t> q;    // [M][Kp]
  std::vector<float> scale; // [M][G]
  std::vector<float> sum;   // [M][G]: scale * sum(q) (the int4 min term needs it)
  std::vector<int32_t> qsum;  // [M][G]: sum(q), exact (the VNNI pair tiles' int8 weight offset)
  std::vector<int8_t> patterns;  // [M][G][256] for the VNNI tiles, empty otherwise
  int64_t kp = 0, groups = 0;
};

// One row through the optional fused pre-op into fp32 `row` (K values, zero-padded to Kp).
void pre_row(const float* x, int64_t k, int64_t kp, Pre pre, const float* norm_w, float eps,
             float* row) {
  if (pre == kSiluMul) {  // x holds [gate | up], 2K values
    int64_t i = 0;
    for (; i + 8 <= k; i += 8)
      _mm256_storeu_ps(row + i, vm::silu_mul(_mm256_loadu_ps(x + i), _mm256_loadu_ps(x + k + i)));
    for (; i < k; ++i) row[i] = x[i] / (1.0f + std::exp(-x[i])) * x[k + i];
  } else if (pre == kRmsNorm) {
    float r = 1.0f / std::sqrt(vm::sum_squares(x, k) / static_cast<float>(k) + eps);
    for (int64_t i = 0; i < k; ++i) row[i] = norm_w[i] * (x[i] * r);
  } else {
    std::memcpy(row, x, k * sizeof(float));
  }
  std::fill(row + k, row + kp, 0.0f);
}

// Blocks of 32 -> int8 with scale amax/127, round-to-nearest (as llama.cpp's q8_0/q8_1).
void quantize_row(const float* row, int64_t groups, int8_t* q, float* scale, float* sum,
                  int32_t* qsum) {
  for (int64_t g = 0; g < groups; ++g) {
    const float* v = row + g * kBlock;
    __m256 x[4];
    __m256 amax = _mm256_setzero_ps();
    const __m256 sign_bit = _mm256_set1_ps(-0.0f);
    for (int j = 0; j < 4; ++j) {
      x[j] = _mm256_loadu_ps(v + 8 * j);
      amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign_bit, x[j]));
    }
    float d = vm::hmax(amax) / 127.0f;
    __m256 id = _mm256_set1_ps(d > 0.0f ? 1.0f / d : 0.0f);
    __m256i i[4];
    for (int j = 0; j < 4; ++j) i[j] = _mm256_cvtps_epi32(_mm256_mul_ps(x[j], id));
    __m256i total = _mm256_add_epi32(_mm256_add_epi32(i[0], i[1]), _mm256_add_epi32(i[2], i[3]));
    __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(i[0], i[1]),
                                        _mm256_packs_epi32(i[2], i[3]));
    // packs work per 128-bit lane: restore element order.
    packed = _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + g * kBlock), packed);
    scale[g] = d;
    const int32_t total_q = vm::hsum_epi32(total);
    sum[g] = d * static_cast<float>(total_q);
    qsum[g] = total_q;
  }
}

QuantizedRows quantize_rows(const at::Tensor& x, int64_t k, Pre pre, const float* norm_w,
                            float eps, bool vnni, bool int4) {
  const int64_t m = x.size(0), stride = x.stride(0);
  QuantizedRows out;
  out.kp = (k + kBlock - 1) / kBlock * kBlock;
  out.groups = out.kp / kBlock;
  out.q.resize(m * out.kp);
  out.scale.resize(m * out.groups);
  out.sum.resize(m * out.groups);
  out.qsum.resize(m * out.groups);
  if (vnni) out.patterns.resize(m * out.groups * 256);
  const float* src = x.data_ptr<float>();
  llmk::parallel_chunks(m, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> row(out.kp);
    for (int64_t r = begin; r < end; ++r) {
      pre_row(src + r * stride, k, out.kp, pre, norm_w, eps, row.data());
      quantize_row(row.data(), out.groups, out.q.data() + r * out.kp,
                   out.scale.data() + r * out.groups, out.sum.data() + r * out.groups,
                   out.qsum.data() + r * out.groups);
      if (vnni)
        llmk_vnni::build_patterns(out.q.data() + r * out.kp, out.groups, int4,
                                  out.patterns.data() + r * out.groups * 256);
    }
  });
  return out;
}

// Single-thread time (estimated, us) below which a kernel does not fork; env-tunable for A/B.
double g_parallel_min_us = [] {
  const char* env = std::getenv("LLMMESH_PARALLEL_MIN_US");
  return env ? std::atof(env) : 60.0;
}();

double parallel_min_us() { return g_parallel_min_us; }

// Software prefetch distance in bytes ahead of the weight stream (LLMMESH_PREFETCH, 0 = off).
// A batch-1 step streams ~90-130 MB of weights from DRAM; the hardware prefetchers alone
// reached ~13 GB/s per core on the Xeon host, prefetching ahead ~20 GB/s. In-engine A/B
// (8 chunks): int4 decode @1 265 / 288 / 315 tok/s at 1 / 2 / 4 KB, int8 166 / 186 / 206;
// 6 KB and more no better.
int64_t g_prefetch_bytes = [] {
  const char* env = std::getenv("LLMMESH_PREFETCH");
  return env ? std::atoll(env) : 4096;
}();

inline int64_t prefetch_bytes() { return g_prefetch_bytes; }

// A projection's output blocks are claimed in ~this many chunks: few, so each thread streams long
// contiguous runs that its prefetches stay inside (A/B int4 decode @1: 32 -> 262, 8 -> 297-303,
// 4 -> 300 tok/s), enough that a helper descheduled mid-chunk holds up at most 1/8.
int64_t g_chunks = 8;

// AVX-512 VNNI tiles when the CPU has them (cpuid at first use), unless LLMMESH_KERNEL_ISA=avx2:
// 0 = AVX2 only, 1 = VNNI where it measured faster (see qgemm), 2 = VNNI for every int8/int4
// call (tests and A/B).
const bool kVnniSupported = llmk_vnni::cpu_supported();
// int8 at 1-3 rows, in-engine A/B of the pattern tiles against AVX2 (same process, alternating):
// the Xeon decoded @1 at 186 against 166 tok/s; the Zen 4 at 117 against 132 (medians of 5;
// @2 137 against 161). So the pattern tiles run there only on Intel CPUs.
const bool kPatternsPay = llmk_vnni::patterns_pay();
int g_vnni = [] {
  const char* env = std::getenv("LLMMESH_KERNEL_ISA");
  return kVnniSupported && !(env && std::string(env) == "avx2") ? 1 : 0;
}();

// Rows from which a VNNI CPU runs the pair tiles (two 8-channel weight tiles per activation
// broadcast, llmk_vnni::pair); 0 = never. LLMMESH_VNNI_PAIR_MIN_ROWS sets it (A/B in the engine).
// In-engine A/B on the 2-core Zen 4 (same process, alternating, best of 3): int4 decode @32
// 484 -> 580 tok/s, @8 365 -> 461, @4 303 -> 318, @2 196 -> 175; int8 @32 420 -> 522, @8
// 281 -> 372, @2 and @4 even. At @32 a step's projections went 36 -> 25.5 ms. At 1-2 rows the
// weights stream from DRAM and the AVX2 tiles keep up better, hence 4.
int64_t g_pair_min_rows = [] {
  const char* env = std::getenv("LLMMESH_VNNI_PAIR_MIN_ROWS");
  return env ? std::max<int64_t>(0, std::atoll(env)) : int64_t{4};
}();

// The pair tiles' software prefetch leads by one pair of weight tiles: in a call's first block
// of rows, pair i prefetches pair i + 1's lines in step with its own, and the later row blocks
// (which re-read pair i from L1) prefetch nothing. The fixed lead before (prefetch_bytes, 4 KiB,
// tuned at batch 1 on one tile) landed mostly inside pair i's own second tile and left pair
// i + 1's second tile to the hardware prefetchers. Per-step A/B on the 2-core Zen 5 (same
// process, alternating every step): int8 decode @8 +16%, @32 +12%; int4 +4.6%, +4.0%. Leading
// by two pairs, or prefetching in every row block, measured the same as one. set_tunable
// ("pair_next", 0) restores the fixed lead (A/B).
bool g_pair_next = true;

inline void prefetch_lines(const void* p, int lines) {
  for (int i = 0; i < lines; ++i)
    _mm_prefetch(static_cast<const char*>(p) + 64 * i, _MM_HINT_T0);
}

inline __m256i broadcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// acc[r] (8 outputs) = sum_k w[n, k] * x[r, k] for `rows` rows, int8 weights (scale applied later).
template <int R>
void tile_int8(const int8_t* w, const QuantizedRows& a, int64_t r0, __m256* out) {
  // Local accumulators and a rolled k-loop: with the output array as accumulator and the k-loop
  // fully unrolled, gcc kept the sums on the stack and spilled every madd result (~2x slower).
  const __m256i ones = _mm256_set1_epi16(1);
  const int8_t* x[R];
  const float* xs[R];
  __m256 acc[R];
  for (int r = 0; r < R; ++r) {
    acc[r] = _mm256_setzero_ps();
    x[r] = a.q.data() + (r0 + r) * a.kp;
    xs[r] = a.scale.data() + (r0 + r) * a.groups;
  }
  const int64_t pf = prefetch_bytes();
  for (int64_t g = 0; g < a.groups; ++g) {
    if (pf) prefetch_lines(w + g * 256 + pf, 4);
    __m256i iacc[R];
    for (int r = 0; r < R; ++r) iacc[r] = _mm256_setzero_si256();
    auto step = [&](int s) {
      const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + (g * 8 + s) * 32));
      const __m256i wa = _mm256_abs_epi8(wv);  // maddubs wants one unsigned operand
      for (int r = 0; r < R; ++r) {
        const __m256i xv = _mm256_sign_epi8(broadcast4(x[r] + g * kBlock + s * 4), wv);
        // |w| * (x * sign w) pairs stay within int16: 2 * 127 * 127 < 32767.
        iacc[r] = _mm256_add_epi32(iacc[r], _mm256_madd_epi16(_mm256_maddubs_epi16(wa, xv), ones));
      }
    };
    if constexpr (R <= 2) {  // few rows: unrolled, so one row's add chain does not serialise
      for (int s = 0; s < 8; ++s) step(s);
    } else {
#pragma GCC unroll 1
      for (int s = 0; s < 8; ++s) step(s);
    }
    for (int r = 0; r < R; ++r)
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(iacc[r]), _mm256_set1_ps(xs[r][g]), acc[r]);
  }
  for (int r = 0; r < R; ++r) out[r] = acc[r];
}

template <int R>
void tile_int4(const uint8_t* w, const uint16_t* sm, const QuantizedRows& a, int64_t r0,
               __m256* out) {
  const __m256i ones = _mm256_set1_epi16(1), low = _mm256_set1_epi8(0x0F);
  const int8_t* x[R];
  const float *xs[R], *xsum[R];
  __m256 acc[R];
  for (int r = 0; r < R; ++r) {
    acc[r] = _mm256_setzero_ps();
    x[r] = a.q.data() + (r0 + r) * a.kp;
    xs[r] = a.scale.data() + (r0 + r) * a.groups;
    xsum[r] = a.sum.data() + (r0 + r) * a.groups;
  }
  const int64_t pf = prefetch_bytes();
  for (int64_t g = 0; g < a.groups; ++g) {
    if (pf) {
      prefetch_lines(w + g * 128 + pf, 2);
      if ((g & 1) == 0) prefetch_lines(sm + g * 16 + pf / 4, 1);
    }
    __m256i iacc[R];
    for (int r = 0; r < R; ++r) iacc[r] = _mm256_setzero_si256();
    auto step = [&](int p) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + (g * 4 + p) * 32));
      const __m256i lo = _mm256_and_si256(v, low);
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
      for (int r = 0; r < R; ++r) {
        const int8_t* xp = x[r] + g * kBlock + p * 8;
        // q <= 15: eight int16 pair sums stay below 8 * 2 * 15 * 127 < 32767.
        iacc[r] = _mm256_add_epi16(iacc[r], _mm256_maddubs_epi16(lo, broadcast4(xp)));
        iacc[r] = _mm256_add_epi16(iacc[r], _mm256_maddubs_epi16(hi, broadcast4(xp + 4)));
      }
    };
    if constexpr (R <= 2) {
      for (int p = 0; p < 4; ++p) step(p);
    } else {
#pragma GCC unroll 1
      for (int p = 0; p < 4; ++p) step(p);
    }
    const __m128i* smv = reinterpret_cast<const __m128i*>(sm + g * 16);
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(smv));
    const __m256 mn = _mm256_cvtph_ps(_mm_loadu_si128(smv + 1));
    for (int r = 0; r < R; ++r) {
      const __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(iacc[r], ones));
      acc[r] = _mm256_fmadd_ps(dot, _mm256_mul_ps(d, _mm256_set1_ps(xs[r][g])), acc[r]);
      acc[r] = _mm256_fmadd_ps(mn, _mm256_set1_ps(xsum[r][g]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) out[r] = acc[r];
}

void store_tile(const __m256* acc, int rows, const float* col_scale, float* out, int64_t ldo,
                int64_t n0, int64_t n, bool accumulate) {
  const int64_t valid = std::min<int64_t>(8, n - n0);
  for (int r = 0; r < rows; ++r) {
    __m256 v = col_scale ? _mm256_mul_ps(acc[r], _mm256_loadu_ps(col_scale + n0)) : acc[r];
    float* dst = out + r * ldo + n0;
    if (valid == 8) {
      if (accumulate) v = _mm256_add_ps(v, _mm256_loadu_ps(dst));
      _mm256_storeu_ps(dst, v);
    } else {
      alignas(32) float tmp[8];
      _mm256_store_ps(tmp, v);
      for (int64_t j = 0; j < valid; ++j) dst[j] = accumulate ? dst[j] + tmp[j] : tmp[j];
    }
  }
}

template <int R>
void run_tile(bool int4, const void* w, const uint16_t* sm, const QuantizedRows& a, int64_t r0,
              __m256* acc) {
  if (int4) tile_int4<R>(static_cast<const uint8_t*>(w), sm, a, r0, acc);
  else tile_int8<R>(static_cast<const int8_t*>(w), a, r0, acc);
}

}  // namespace

namespace llmk {

std::string qgemm_isa() { return g_vnni ? "avx512_vnni" : "avx2"; }
int64_t qgemm_vnni_mode() { return g_vnni; }
// 0 wherever the pair tiles never run (no VNNI, VNNI turned off, or every call forced to the
// pattern tiles): not the 4 rows a VNNI CPU starts them from.
int64_t qgemm_pair_min_rows() { return g_vnni == 1 ? g_pair_min_rows : 0; }
bool qgemm_patterns_pay() { return kPatternsPay; }

// A/B knobs for benchmarks (not thread-safe against a running kernel; set between calls).
void set_tunable(const std::string& name, double value) {
  if (name == "prefetch_bytes") g_prefetch_bytes = static_cast<int64_t>(value);
  else if (name == "vnni") {
    TORCH_CHECK(value == 0.0 || kVnniSupported, "this CPU has no AVX-512 VNNI");
    g_vnni = static_cast<int>(value);
  } else if (name == "qgemm_chunks") g_chunks = std::max<int64_t>(1, static_cast<int64_t>(value));
  else if (name == "parallel_min_us") g_parallel_min_us = value;
  else if (name == "vnni_pair_min_rows") {
    TORCH_CHECK(value == 0.0 || kVnniSupported, "this CPU has no AVX-512 VNNI");
    g_pair_min_rows = static_cast<int64_t>(value);
  }
  else if (name == "attention_prefetch") set_attention_prefetch(value != 0.0);
  else if (name == "attention_split_k") set_attention_split_k(value != 0.0);
  else if (name == "attention_prompt_tiles") set_attention_prompt_tiles(value != 0.0);
  else if (name == "attention_avx512") set_attention_avx512(value != 0.0);
  else if (name == "pool_segments") set_pool_segments(value != 0.0);
  else if (name == "side_prefetch") set_side_prefetch(static_cast<int>(value));
  else if (name == "side_adaptive") set_side_adaptive(value != 0.0);
  else if (name == "attention_ahead") {
    TORCH_CHECK(value >= 1.0 && value <= 256.0, "attention_ahead: 1-256 keys, got ", value);
    llmk_avx512::set_prefetch_keys(static_cast<int>(value));
  }
  else if (name == "pair_next") g_pair_next = value != 0.0;
  else TORCH_CHECK(false, "unknown tunable ", name);
}

// out[M, N] (+)= pre(x)[M, K] @ W^T. Parallel over blocks of 8 output channels; inside a block
// the rows go 4 at a time, so the block's weights come from L1 after the first 4 rows.
at::Tensor qgemm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                 int64_t n, int64_t k, bool int4, int64_t pre, const c10::optional<at::Tensor>& norm_w,
                 double eps, c10::optional<at::Tensor> out, bool accumulate) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1, "x: fp32 [M, K] rows");
  TORCH_CHECK(x.size(1) == (pre == kSiluMul ? 2 * k : k), "x has ", x.size(1), " columns, K is ", k);
  const int64_t m = x.size(0), nb = (n + 7) / 8;
  const float* nw = pre == kRmsNorm ? norm_w.value().data_ptr<float>() : nullptr;
  // VNNI tiles only where they measured faster: int8 weights and a pattern buffer (8 bytes per
  // activation byte) that stays in L2. Same-process A/B on the Xeon: int8 decode @1 166 -> 186
  // tok/s; int4 decode @1 303 -> 296 and int4 prefill 1,320 -> 1,170 (M=128), 1,280 -> 530 (M in
  // the hundreds: the patterns, re-read for every weight tile, fell out of L2).
  const int64_t groups = (k + kBlock - 1) / kBlock;
  // Batches of rows (decode steps) take the pair tiles: 16 channels per activation broadcast,
  // 1.3-2.5x the GMAC/s of the tiles below at 32 rows (isolated calls, weights in cache).
  const bool pairs = g_vnni == 1 && g_pair_min_rows > 0 && m >= g_pair_min_rows && nb >= 2;
  const bool vnni = !pairs && (g_vnni == 2 ||
                    (g_vnni == 1 && !int4 && kPatternsPay &&
                     x.size(0) * groups * 256 <= (256 << 10)));
  const QuantizedRows a = quantize_rows(x, k, static_cast<Pre>(pre), nw, static_cast<float>(eps),
                                        vnni, int4);
  TORCH_CHECK(packed.numel() == nb * a.kp * 8 / (int4 ? 2 : 1), "packed weight size mismatch");
  at::Tensor y = out.has_value() ? out.value() : at::empty({m, n}, x.options());
  TORCH_CHECK(y.size(0) == m && y.size(1) == n && y.stride(1) == 1, "out must be [M, N] rows");
  const int64_t tile_bytes = a.kp * 8 / (int4 ? 2 : 1);
  const uint8_t* wbase = static_cast<const uint8_t*>(packed.data_ptr());
  const uint16_t* sm = int4 ? static_cast<const uint16_t*>(scales.data_ptr()) : nullptr;
  const float* col_scale = int4 ? nullptr : scales.data_ptr<float>();
  float* ybase = y.data_ptr<float>();
  const int64_t ldo = y.stride(0);
  const llmk_vnni::Acts acts{a.patterns.data(), a.scale.data(), a.sum.data(), a.groups};
  auto body_vnni = [&](int64_t begin, int64_t end) {
    alignas(32) float tmp[llmk_vnni::kMaxRows * 8];
    __m256 acc[llmk_vnni::kMaxRows];
    const int64_t pf = prefetch_bytes();
    SideCursor side;
    for (int64_t b = begin; b < end; ++b) {
      const void* w = wbase + b * tile_bytes;
      const uint16_t* smb = sm ? sm + b * a.groups * 16 : nullptr;
      for (int64_t r0 = 0; r0 < m; r0 += llmk_vnni::kMaxRows) {
        const int rows = static_cast<int>(std::min<int64_t>(llmk_vnni::kMaxRows, m - r0));
        side.advance(static_cast<double>(rows) * 8 * k);
        llmk_vnni::tile(rows, int4, w, smb, acts, r0, tmp, pf);
        for (int r = 0; r < rows; ++r) acc[r] = _mm256_load_ps(tmp + 8 * r);
        store_tile(acc, rows, col_scale, ybase + r0 * ldo, ldo, b * 8, n, accumulate);
      }
    }
  };
  auto body_avx2 = [&](int64_t begin, int64_t end) {
    __m256 acc[kMr];
    SideCursor side;
    for (int64_t b = begin; b < end; ++b) {
      const void* w = wbase + b * tile_bytes;
      const uint16_t* smb = sm ? sm + b * a.groups * 16 : nullptr;
      side.advance(static_cast<double>(m) * 8 * k);
      int64_t r0 = 0;
      for (; r0 + kMr <= m; r0 += kMr) {
        run_tile<kMr>(int4, w, smb, a, r0, acc);
        store_tile(acc, kMr, col_scale, ybase + r0 * ldo, ldo, b * 8, n, accumulate);
      }
      const int rest = static_cast<int>(m - r0);
      if (rest == 3) run_tile<3>(int4, w, smb, a, r0, acc);
      if (rest == 2) run_tile<2>(int4, w, smb, a, r0, acc);
      if (rest == 1) run_tile<1>(int4, w, smb, a, r0, acc);
      if (rest) store_tile(acc, rest, col_scale, ybase + r0 * ldo, ldo, b * 8, n, accumulate);
    }
  };
  const llmk_vnni::Rows rows_q{a.q.data(), a.kp, a.scale.data(), a.sum.data(), a.qsum.data(),
                               a.groups};
  auto body_pairs = [&](int64_t begin, int64_t end) {   // in pairs of blocks
    alignas(64) float tmp[llmk_vnni::kMaxRows * 16];
    __m256 acc[llmk_vnni::kMaxRows];
    const int64_t pf = prefetch_bytes();
    SideCursor side;
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = 2 * i;
      if (b + 1 >= nb) {   // an odd last block
        body_avx2(b, b + 1);
        continue;
      }
      const void* w0 = wbase + b * tile_bytes;
      const void* w1 = wbase + (b + 1) * tile_bytes;
      const uint16_t* sm0 = sm ? sm + b * a.groups * 16 : nullptr;
      const uint16_t* sm1 = sm ? sm0 + a.groups * 16 : nullptr;
      for (int64_t r0 = 0; r0 < m; r0 += llmk_vnni::kMaxRows) {
        const int rows = static_cast<int>(std::min<int64_t>(llmk_vnni::kMaxRows, m - r0));
        const int64_t lead = !g_pair_next || pf == 0 ? pf : r0 == 0 ? 2 * tile_bytes : 0;
        llmk_vnni::pair(rows, int4, w0, w1, sm0, sm1, rows_q, r0, tmp, lead, &side);
        for (int half = 0; half < 2; ++half) {
          for (int r = 0; r < rows; ++r) acc[r] = _mm256_load_ps(tmp + 16 * r + 8 * half);
          store_tile(acc, rows, col_scale, ybase + r0 * ldo, ldo, (b + half) * 8, n, accumulate);
        }
      }
    }
  };
  auto body = [&](int64_t begin, int64_t end) {
    if (vnni) return body_vnni(begin, end);
    body_avx2(begin, end);
  };
  // Waking a sleeping helper costs ~5-20 us, more when its core is busy elsewhere: below ~3x
  // that one thread is faster (batch-1 qkv: 16 us alone, 31 us on two OpenMP threads).
  const double solo_us = tile_bytes * nb / 5e3 + static_cast<double>(m) * n * k / 50e3;
  if (pairs) {
    const int64_t np = (nb + 1) / 2;
    if (solo_us < parallel_min_us()) body_pairs(0, np);
    else parallel_chunks(np, std::max<int64_t>(1, np / (m <= 8 ? g_chunks : 32)), body_pairs);
  } else if (solo_us < parallel_min_us()) body(0, nb);
  else {
    // Few long chunks for a weight stream (decode, a few rows); many for compute-bound calls
    // (prefill), where a helper preempted by another process mid-chunk would hold up the
    // caller for a larger share.
    const int64_t chunks = m <= 8 ? g_chunks : 32;
    parallel_chunks(nb, std::max<int64_t>(1, nb / chunks), body);
  }
  return y;
}

}  // namespace llmk

namespace llmk {

// Prefill-sized calls (64+ rows by default) on CPUs with AMX / AVX-512 bf16, where oneDNN's bf16 GEMM runs at
// ~1.4 TFLOP/s on the 2-core Xeon against ~0.3 TOP/s for our packed int8 tiles at M=128: the
// pre-op'd activations in bf16, one at::mm against a bf16 copy of the (dequantized) weight
// [N, K], the residual added in fp32. bf16 activations keep every channel's outliers (an int8
// per-row quantization of them, tried first, cost +3.3% perplexity).
at::Tensor qgemm_dense(const at::Tensor& x, const at::Tensor& w, int64_t pre,
                       const c10::optional<at::Tensor>& norm_w, double eps,
                       c10::optional<at::Tensor> out, bool accumulate) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1, "x: fp32 [M, K] rows");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16 && w.is_contiguous(), "w: bf16 [N, K]");
  const int64_t m = x.size(0), n = w.size(0), k = w.size(1);
  TORCH_CHECK(x.size(1) == (pre == kSiluMul ? 2 * k : k), "x has ", x.size(1), " columns, K is ", k);
  at::Tensor xb;
  if (pre == kNone) {
    xb = x.to(at::kBFloat16);
  } else {
    const float* nw = pre == kRmsNorm ? norm_w.value().data_ptr<float>() : nullptr;
    at::Tensor rows = at::empty({m, k}, x.options());
    const float* src = x.data_ptr<float>();
    float* dst = rows.data_ptr<float>();
    const int64_t stride = x.stride(0);
    parallel_chunks(m, 8, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r)
        pre_row(src + r * stride, k, k, static_cast<Pre>(pre), nw, static_cast<float>(eps),
                dst + r * k);
    });
    xb = rows.to(at::kBFloat16);
  }
  park_pool_helpers();   // the cores are oneDNN's now
  const at::Tensor yb = at::mm(xb, w.t());
  if (!out.has_value()) return yb.to(at::kFloat);
  at::Tensor y = out.value();
  TORCH_CHECK(y.size(0) == m && y.size(1) == n, "out must be [M, N]");
  if (accumulate) y.add_(yb);
  else y.copy_(yb);
  return y;
}

bool amx_available() { return llmk_amx::available(); }

at::Tensor qgemm_amx(const at::Tensor& x, const at::Tensor& w, int64_t n, int64_t k, int64_t pre,
                     const c10::optional<at::Tensor>& norm_w, double eps,
                     c10::optional<at::Tensor> out, bool accumulate) {
  TORCH_CHECK(llmk_amx::available(), "this CPU (or kernel) gives no AMX tiles");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1, "x: fp32 [M, K] rows");
  TORCH_CHECK(k % llmk_amx::kKBlock == 0 && n % llmk_amx::kColBlock == 0, "AMX tiles need K % 32 == 0 and N % 16 == 0");
  TORCH_CHECK(w.scalar_type() == at::kBFloat16 && w.is_contiguous() && w.numel() == n * k,
              "w: bf16 packed by pack_amx");
  const int64_t m = x.size(0), mp = (m + llmk_amx::kRowBlock - 1) / llmk_amx::kRowBlock * llmk_amx::kRowBlock;
  TORCH_CHECK(x.size(1) == (pre == kSiluMul ? 2 * k : k), "x has ", x.size(1), " columns, K is ", k);
  // The pre-op and the bf16 rounding in one pass per row; rows past M are zeros.
  at::Tensor a = at::empty({mp, k}, x.options().dtype(at::kBFloat16));
  auto* ab = reinterpret_cast<uint16_t*>(a.data_ptr<at::BFloat16>());
  const float* nw = pre == kRmsNorm ? norm_w.value().data_ptr<float>() : nullptr;
  const float* src = x.data_ptr<float>();
  const int64_t stride = x.stride(0);
  parallel_chunks(m, 4, [&](int64_t begin, int64_t end) {
    std::vector<float> row(k);
    for (int64_t r = begin; r < end; ++r) {
      pre_row(src + r * stride, k, k, static_cast<Pre>(pre), nw, static_cast<float>(eps), row.data());
      llmk_amx::to_bf16(row.data(), k, ab + r * k);
    }
  });
  std::memset(ab + m * k, 0, (mp - m) * k * sizeof(uint16_t));
  at::Tensor y;
  if (out.has_value()) {
    y = out.value();
    TORCH_CHECK(y.size(0) == m && y.size(1) == n && y.stride(1) == 1, "out must be [M, N] rows");
  } else {
    y = at::empty({m, n}, x.options());
    accumulate = false;
  }
  float* yp = y.data_ptr<float>();
  const int64_t ldo = y.stride(0), blocks = n / llmk_amx::kColBlock;
  const auto* wp = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  parallel_chunks((blocks + 1) / 2, 1, [&](int64_t begin, int64_t end) {
    llmk_amx::gemm(ab, m, mp, k, wp, 2 * begin, std::min(2 * end, blocks), yp, ldo, accumulate);
  });
  return y;
}

}  // namespace llmk
