// Fused fp32 ops for the decoder's small steps: each replaces 5-10 torch ops whose dispatch cost
// (~5-10 us apiece, x30 layers) dominates a batch-1 decode step on a 2-core CPU.
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <utility>
#include <vector>

#include "attention_avx512.h"
#include "kernels.h"
#include "vec_math.h"

namespace llmk {
namespace {

bool g_split_k = true;
bool g_attention_prefetch = true;
bool g_prompt_tiles = true;
// The decode attention's loops on AVX-512 where the CPU has it (attention_avx512.cpp).
bool g_attention_avx512 = llmk_avx512::cpu_supported();

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 2 && t.scalar_type() == at::kFloat && t.stride(1) == 1, name,
              ": expected fp32 [rows, cols] with contiguous rows");
}

// Whether a (checked) KV cache holds fp16 (IEEE half bits, read as uint16_t); else fp32.
bool half_kv_cache(const at::Tensor& kv_cache) {
  TORCH_CHECK(kv_cache.is_contiguous() &&
                  (kv_cache.scalar_type() == at::kFloat || kv_cache.scalar_type() == at::kHalf),
              "kv_cache: contiguous fp32 or fp16");
  return kv_cache.scalar_type() == at::kHalf;
}

}  // namespace

// s[j] = exp(s[j] - mx) for j < n, in place (mx: the row's max); returns their sum.
static float exp_shifted(float* s, int64_t n, float mx) {
  __m256 sum = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const __m256 e = vm::exp(_mm256_sub_ps(_mm256_loadu_ps(s + j), _mm256_set1_ps(mx)));
    _mm256_storeu_ps(s + j, e);
    sum = _mm256_add_ps(sum, e);
  }
  float total = vm::hsum(sum);
  for (; j < n; ++j) total += (s[j] = std::exp(s[j] - mx));
  return total;
}

bool attention_split_k() { return g_split_k; }
void set_attention_split_k(bool on) { g_split_k = on; }
void set_attention_prefetch(bool on) { g_attention_prefetch = on; }
void set_attention_prompt_tiles(bool on) { g_prompt_tiles = on; }
void set_attention_avx512(bool on) {
  TORCH_CHECK(!on || llmk_avx512::cpu_supported(), "this CPU has no AVX-512");
  g_attention_avx512 = on;
}

// out = w * x * rsqrt(mean(x^2) + eps), row by row (HF LlamaRMSNorm in fp32).
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  check_rows(x, "x");
  const int64_t m = x.size(0), k = x.size(1);
  at::Tensor y = at::empty({m, k}, x.options());
  const float *src = x.data_ptr<float>(), *wp = w.data_ptr<float>();
  float* dst = y.data_ptr<float>();
  at::parallel_for(0, m, 32, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row = src + r * x.stride(0);
      const float inv = 1.0f / std::sqrt(vm::sum_squares(row, k) / k + static_cast<float>(eps));
      for (int64_t i = 0; i < k; ++i) dst[r * k + i] = wp[i] * (row[i] * inv);
    }
  });
  return y;
}

// Index of each row's largest value, as torch.argmax(x, dim=1): the first one on ties, the
// first NaN if the row has one. Greedy sampling over a 49,152-token vocabulary: torch's argmax
// took 110 us for one row and 550 us for 8 on a 2-core Zen 3; this is one AVX2 pass for the
// maximum and one (from L1/L2) for its first index.
static int64_t argmax_row(const float* x, int64_t n) {
  __m256 mx = _mm256_set1_ps(-INFINITY), nan = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    mx = _mm256_max_ps(mx, v);
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, mx);
  float best = lanes[0];
  for (int l = 1; l < 8; ++l) best = std::max(best, lanes[l]);
  bool has_nan = _mm256_movemask_ps(nan) != 0;
  for (int64_t j = i; j < n; ++j) {
    if (std::isnan(x[j])) has_nan = true;
    else best = std::max(best, x[j]);
  }
  if (has_nan) {
    for (int64_t j = 0; j < n; ++j)
      if (std::isnan(x[j])) return j;
  }
  const __m256 target = _mm256_set1_ps(best);
  for (i = 0; i + 8 <= n; i += 8) {
    const int mask = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), target, _CMP_EQ_OQ));
    if (mask) return i + __builtin_ctz(mask);
  }
  for (; i < n; ++i)
    if (x[i] == best) return i;
  return 0;   // n == 0 is refused by the caller; -inf everywhere matches at index 0 above
}

at::Tensor argmax_rows(const at::Tensor& x) {
  check_rows(x, "x");
  TORCH_CHECK(x.size(1) > 0, "x: rows must not be empty");
  const int64_t m = x.size(0), n = x.size(1);
  at::Tensor out = at::empty({m}, x.options().dtype(at::kLong));
  const float* src = x.data_ptr<float>();
  int64_t* dst = out.data_ptr<int64_t>();
  // One row is ~10 us; fork from 4 rows on.
  parallel_chunks(m, 2, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) dst[r] = argmax_row(src + r * x.stride(0), n);
  });
  return out;
}

// [M, 2I] = [gate | up] -> silu(gate) * up, [M, I]
at::Tensor silu_mul(const at::Tensor& x) {
  check_rows(x, "x");
  const int64_t m = x.size(0), k = x.size(1) / 2;
  at::Tensor y = at::empty({m, k}, x.options());
  const float* src = x.data_ptr<float>();
  float* dst = y.data_ptr<float>();
  at::parallel_for(0, m, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* g = src + r * x.stride(0);
      int64_t i = 0;
      for (; i + 8 <= k; i += 8)
        _mm256_storeu_ps(dst + r * k + i,
                         vm::silu_mul(_mm256_loadu_ps(g + i), _mm256_loadu_ps(g + k + i)));
      for (; i < k; ++i) dst[r * k + i] = g[i] / (1.0f + std::exp(-g[i])) * g[k + i];
    }
  });
  return y;
}

// Widens or narrows n floats into the cache's element type.
static void store_row(const float* src, float* dst, int64_t n) { std::copy(src, src + n, dst); }
static void store_row(const float* src, uint16_t* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) vm::store8(dst + i, _mm256_loadu_ps(src + i));
  for (; i < n; ++i) dst[i] = _cvtss_sh(src[i], _MM_FROUND_TO_NEAREST_INT);
}

template <typename T>
static void rope_write_kv_impl(at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& cos,
                               const at::Tensor& sin, at::Tensor& kv_cache,
                               const at::Tensor& slot_mapping, int64_t num_heads,
                               int64_t num_kv_heads) {
  const int64_t t = qkv.size(0), d = kv_cache.size(4), half = d / 2;
  const int64_t kv_row = num_kv_heads * d, v_offset = kv_cache.numel() / 2;
  T* cache = static_cast<T*>(kv_cache.data_ptr());
  const int64_t *pos = positions.data_ptr<int64_t>(), *slots = slot_mapping.data_ptr<int64_t>();
  const float *cs = cos.data_ptr<float>(), *sn = sin.data_ptr<float>();
  float* base = qkv.data_ptr<float>();
  parallel_chunks(t, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      float* row = base + i * qkv.stride(0);
      const float *c = cs + pos[i] * half, *s = sn + pos[i] * half;
      for (int64_t h = 0; h < num_heads + num_kv_heads; ++h) {
        float* x = row + h * d;
        for (int64_t j = 0; j < half; ++j) {
          const float x1 = x[j], x2 = x[j + half];
          x[j] = x1 * c[j] - x2 * s[j];
          x[j + half] = x2 * c[j] + x1 * s[j];
        }
      }
      const float* k = row + num_heads * d;
      store_row(k, cache + slots[i] * kv_row, kv_row);
      store_row(k + kv_row, cache + v_offset + slots[i] * kv_row, kv_row);
    }
  });
}

// Rotate-half RoPE on the q and k heads of qkv [T, (H + 2 KVH) * D] in place, then store k and v
// at their cache slots: kv_cache [2, blocks, block_size, KVH, D].
void rope_write_kv(at::Tensor qkv, const at::Tensor& positions, const at::Tensor& cos,
                   const at::Tensor& sin, at::Tensor kv_cache, const at::Tensor& slot_mapping,
                   int64_t num_heads, int64_t num_kv_heads) {
  check_rows(qkv, "qkv");
  if (half_kv_cache(kv_cache))
    rope_write_kv_impl<uint16_t>(qkv, positions, cos, sin, kv_cache, slot_mapping, num_heads,
                                 num_kv_heads);
  else
    rope_write_kv_impl<float>(qkv, positions, cos, sin, kv_cache, slot_mapping, num_heads,
                              num_kv_heads);
}

// softmax(q K^T * scale) V for query heads [h0, h1) of one sequence (query head h reads KV head
// h / group). Keys are walked token by token with every head's row of a token together, so one
// sequence streams its cache rows contiguously instead of one head's 256-byte slice per pass.
template <typename T>
static void attend_heads(const float* q, float* out, int64_t h0, int64_t h1, int64_t group, int64_t d,
                  const T* keys, const T* values, const int64_t* table, int64_t seq_len,
                  int64_t block_size, int64_t token_stride, float scale, std::vector<float>& p) {
  const int64_t heads = h1 - h0;
  p.resize(heads * seq_len);
  // Block by block: no integer division per key (it cost as much as a head's dot product).
  for (int64_t start = 0; start < seq_len; start += block_size) {
    const T* k = keys + table[start / block_size] * block_size * token_stride;
    const int64_t stop = std::min(seq_len, start + block_size);
    for (int64_t j = start; j < stop; ++j, k += token_stride)
      for (int64_t h = h0; h < h1; ++h)
        p[(h - h0) * seq_len + j] = vm::dot(q + h * d, k + (h / group) * d, d) * scale;
  }
  for (int64_t h = 0; h < heads; ++h) {
    float* s = p.data() + h * seq_len;
    const float inv = 1.0f / exp_shifted(s, seq_len, *std::max_element(s, s + seq_len));
    for (int64_t j = 0; j < seq_len; ++j) s[j] *= inv;
    std::fill(out + (h0 + h) * d, out + (h0 + h + 1) * d, 0.0f);
  }
  for (int64_t start = 0; start < seq_len; start += block_size) {
    const T* v = values + table[start / block_size] * block_size * token_stride;
    const int64_t stop = std::min(seq_len, start + block_size);
    for (int64_t j = start; j < stop; ++j, v += token_stride)
      for (int64_t h = h0; h < h1; ++h)
        vm::axpy(p[(h - h0) * seq_len + j], v + (h / group) * d, out + h * d, d);
  }
}

// The two loops of one head_dim-64 head, on AVX2 (attention_avx512.h has the AVX-512 pair, which
// takes up to four heads of a KV group per call; here `heads` is always 1 and `ps` unused):
// p[j] = scale * q . K[j], and out = inv[0] * sum_j p[j] V[j], row j at base + offsets[j]. Eight
// ymm hold the query (or the output): no per-key horizontal sum (four keys reduce together) and
// no output load/store per key. With `prefetch` (the first head of a KV group, which reads the
// rows from L3/DRAM; the group's other heads find them in L1/L2), rows a few keys ahead are
// prefetched, 4 lines per 256-byte row.
template <typename T>
static void prefetch_row_d64(const T* row) {   // 64 elements: 4 lines of fp32, 2 of fp16
  for (int l = 0; l < static_cast<int>(sizeof(T)) * 64; l += 64)
    _mm_prefetch(reinterpret_cast<const char*>(row) + l, _MM_HINT_T0);
}

template <typename T>
static void scores_d64_avx2(const float* q, int /*heads: 1*/, const T* keys,
                            const int64_t* offsets, int64_t n, float scale, float* p,
                            int64_t /*ps*/, bool prefetch) {
  __m256 qv[8];
  for (int i = 0; i < 8; ++i) qv[i] = _mm256_loadu_ps(q + 8 * i);
  auto dot8 = [&](const T* k) {   // 8 partial sums of q . k
    __m256 a = _mm256_mul_ps(qv[0], vm::load8(k));
    __m256 b = _mm256_mul_ps(qv[1], vm::load8(k + 8));
    for (int i = 2; i < 8; i += 2) {
      a = _mm256_fmadd_ps(qv[i], vm::load8(k + 8 * i), a);
      b = _mm256_fmadd_ps(qv[i + 1], vm::load8(k + 8 * i + 8), b);
    }
    return _mm256_add_ps(a, b);
  };
  int64_t j = 0;
  for (; j + 4 <= n; j += 4) {
    if (prefetch)
      for (int u = 8; u < 12; ++u)
        if (j + u < n) prefetch_row_d64(keys + offsets[j + u]);
    const __m256 s01 = _mm256_hadd_ps(dot8(keys + offsets[j]), dot8(keys + offsets[j + 1]));
    const __m256 s23 = _mm256_hadd_ps(dot8(keys + offsets[j + 2]), dot8(keys + offsets[j + 3]));
    const __m256 s = _mm256_hadd_ps(s01, s23);   // per 128-bit lane: keys j..j+3
    const __m128 sums = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
    _mm_storeu_ps(p + j, _mm_mul_ps(sums, _mm_set1_ps(scale)));
  }
  for (; j < n; ++j) p[j] = vm::hsum(dot8(keys + offsets[j])) * scale;
}

template <typename T>
static void weighted_sum_d64_avx2(const float* p, int64_t /*ps*/, int /*heads: 1*/,
                                  const T* values, const int64_t* offsets, int64_t n,
                                  const float* inv, float* out, bool prefetch) {
  __m256 acc[8];
  for (int i = 0; i < 8; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t j = 0; j < n; ++j) {
    if (prefetch && j + 8 < n) prefetch_row_d64(values + offsets[j + 8]);
    const __m256 w = _mm256_set1_ps(p[j]);
    const T* v = values + offsets[j];
    for (int i = 0; i < 8; ++i) acc[i] = _mm256_fmadd_ps(w, vm::load8(v + 8 * i), acc[i]);
  }
  const __m256 r = _mm256_set1_ps(inv[0]);
  for (int i = 0; i < 8; ++i) _mm256_storeu_ps(out + 8 * i, _mm256_mul_ps(acc[i], r));
}

// attend_heads for head_dim 64, a KV group's query heads together through the loops above
// (AVX-512 where the CPU has it); batch-1 attention was a quarter of a step.
//
// Keys [j0, j1) only; with `partial` (max, sum) per head go to partial[2 (h - h0)], and out gets
// the unnormalised sum of exp(s - max) v, for a split-K combine (combine_partials).
template <typename T>
static void attend_heads_d64(const float* q, float* out, int64_t h0, int64_t h1, int64_t group,
                             const T* keys, const T* values, const int64_t* table,
                             int64_t j0, int64_t j1, int64_t block_size, int64_t token_stride,
                             float scale, std::vector<float>& p, float* partial = nullptr) {
  // Row offsets once per key range, shared by every head, K and V: no division per key.
  // (offsets[j - j0] and p[j - j0]: the loops index from the range start.)
  const int64_t seq_len = j1 - j0;
  thread_local std::vector<int64_t> offsets;
  offsets.resize(seq_len);
  for (int64_t j = j0; j < j1;) {
    const int64_t block = j / block_size, stop = std::min(j1, (block + 1) * block_size);
    const int64_t base = table[block] * block_size - block * block_size;
    for (; j < stop; ++j) offsets[j - j0] = (base + j) * token_stride;
  }
  const int64_t ps = seq_len + 4;   // up to four heads' scores, ps apart
  p.resize(4 * ps);
  using Scores = void (*)(const float*, int, const T*, const int64_t*, int64_t, float, float*,
                          int64_t, bool);
  using Sum = void (*)(const float*, int64_t, int, const T*, const int64_t*, int64_t,
                       const float*, float*, bool);
  const Scores scores = g_attention_avx512 ? static_cast<Scores>(llmk_avx512::scores_d64)
                                           : scores_d64_avx2<T>;
  const Sum weighted_sum = g_attention_avx512 ? static_cast<Sum>(llmk_avx512::weighted_sum_d64)
                                              : weighted_sum_d64_avx2<T>;
  // On AVX-512 the heads of one KV group together (up to four at a time): each K and V row is
  // read from the cache once per group instead of once per head. The AVX2 loops take one head
  // at a time: grouped (the query from L1, the weighted sum in 2-ymm slices to fit 16
  // registers) they measured 25-35% slower on the Zen 4 with AVX-512 turned off (640 keys,
  // cache cold: 141 -> 183-199 us a layer).
  const int64_t most = g_attention_avx512 ? 4 : 1;
  for (int64_t h = h0; h < h1;) {
    const int64_t kv = h / group;
    const int heads = static_cast<int>(std::min({h1, (kv + 1) * group, h + most}) - h);
    const bool pf = g_attention_prefetch && (h == h0 || h % group == 0);
    scores(q + h * 64, heads, keys + kv * 64, offsets.data(), seq_len, scale, p.data(), ps, pf);
    float inv[4];
    for (int g = 0; g < heads; ++g) {
      float* pg = p.data() + g * ps;
      const float mx = *std::max_element(pg, pg + seq_len);
      const float total = exp_shifted(pg, seq_len, mx);
      inv[g] = partial ? 1.0f : 1.0f / total;
      if (partial) {
        partial[2 * (h + g - h0)] = mx;
        partial[2 * (h + g - h0) + 1] = total;
      }
    }
    weighted_sum(p.data(), ps, heads, values + kv * 64, offsets.data(), seq_len, inv,
                 out + h * 64, pf);
    h += heads;
  }
}

// Merges `parts` split-K partials of `heads` heads (d = 64): acc [parts][heads * 64]
// unnormalised, stats [parts][heads][2] (max, sum) -> out [heads * 64].
static void combine_partials(const float* acc, const float* stats, int64_t parts, int64_t heads,
                             float* out) {
  for (int64_t h = 0; h < heads; ++h) {
    float mx = -INFINITY;
    for (int64_t s = 0; s < parts; ++s) mx = std::max(mx, stats[(s * heads + h) * 2]);
    __m256 o[8];
    for (int i = 0; i < 8; ++i) o[i] = _mm256_setzero_ps();
    float total = 0.0f;
    for (int64_t s = 0; s < parts; ++s) {
      const float* st = stats + (s * heads + h) * 2;
      if (st[1] == 0.0f) continue;   // an empty key range
      const float w = std::exp(st[0] - mx);
      total += w * st[1];
      const __m256 wv = _mm256_set1_ps(w);
      const float* a = acc + s * heads * 64 + h * 64;
      for (int i = 0; i < 8; ++i) o[i] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(a + 8 * i), o[i]);
    }
    const __m256 inv = _mm256_set1_ps(1.0f / total);
    for (int i = 0; i < 8; ++i) _mm256_storeu_ps(out + h * 64 + 8 * i, _mm256_mul_ps(o[i], inv));
  }
}

// ---- Prompt spans: GEMM-shaped attention ------------------------------------------------------
// A prompt chunk's rows are consecutive tokens of one sequence: row t sees keys [0, len0 + t).
// Per row and head the generic path streams every key through one dot product (~33 GFLOP/s
// here); a span instead packs its KV head's keys once, transposed in blocks of 16 (kt) and its
// values densely (vc), then computes 6 query vectors (the group's heads of consecutive rows)
// against 16 keys at a time in 12 accumulators: a register-blocked GEMM for Q K^T and for P V.

constexpr int64_t kSpanMinRows = 8;   // shorter prompt chunks stay on the per-row path
constexpr int kTile = 6;              // query vectors per tile

struct PromptSpan {
  int64_t first;   // index i of its first row in the rows/lens arrays
  int64_t rows;
  int64_t max_len; // keys seen by its last row
  int64_t packed;  // offset of its packed K/V (all KV heads) in the scratch buffer
};

static int64_t pad16(int64_t n) { return (n + 15) / 16 * 16; }
static int64_t packed_floats(int64_t max_len) { return pad16(max_len) * 64 * 2; }

// kt [blocks][64][16] (zero beyond len) and vc [len][64] for one KV head.
template <typename T>
static void pack_head(const T* keys, const T* values, const int64_t* table,
                      int64_t block_size, int64_t token_stride, int64_t head_offset, int64_t len,
                      float* kt, float* vc) {
  for (int64_t j = 0; j < len; ++j) {
    const int64_t at = (table[j / block_size] * block_size + j % block_size) * token_stride + head_offset;
    const T* k = keys + at;
    float* dst = kt + (j / 16) * 1024 + (j % 16);
    for (int d = 0; d < 64; ++d) dst[d * 16] = vm::to_float(k[d]);
    for (int d = 0; d < 64; d += 8) _mm256_storeu_ps(vc + j * 64 + d, vm::load8(values + at + d));
  }
  for (int64_t j = len; j < pad16(len); ++j) {
    float* dst = kt + (j / 16) * 1024 + (j % 16);
    for (int d = 0; d < 64; ++d) dst[d * 16] = 0.0f;
  }
}

// Up to kTile query vectors q[v] (d = 64) of one KV head, vector v seeing keys [0, lens[v]).
// Unused slots repeat the last vector and write to a scratch row.
static void attend_tile(const float* const* q, float* const* out, const int64_t* lens,
                        const float* kt, const float* vc, float scale, std::vector<float>& s) {
  int64_t lmax = 0;
  for (int v = 0; v < kTile; ++v) lmax = std::max(lmax, lens[v]);
  const int64_t stride = pad16(lmax), blocks = stride / 16;
  s.resize(kTile * stride);
  float* sc = s.data();
  const __m256 vscale = _mm256_set1_ps(scale);
  for (int64_t b = 0; b < blocks; ++b) {
    __m256 acc[kTile][2];
#pragma GCC unroll 6
    for (int v = 0; v < kTile; ++v) acc[v][0] = acc[v][1] = _mm256_setzero_ps();
    const float* kb = kt + b * 1024;
    for (int d = 0; d < 64; ++d) {
      const __m256 k0 = _mm256_loadu_ps(kb + d * 16), k1 = _mm256_loadu_ps(kb + d * 16 + 8);
#pragma GCC unroll 6
      for (int v = 0; v < kTile; ++v) {
        const __m256 x = _mm256_broadcast_ss(q[v] + d);
        acc[v][0] = _mm256_fmadd_ps(x, k0, acc[v][0]);
        acc[v][1] = _mm256_fmadd_ps(x, k1, acc[v][1]);
      }
    }
#pragma GCC unroll 6
    for (int v = 0; v < kTile; ++v) {
      _mm256_storeu_ps(sc + v * stride + b * 16, _mm256_mul_ps(acc[v][0], vscale));
      _mm256_storeu_ps(sc + v * stride + b * 16 + 8, _mm256_mul_ps(acc[v][1], vscale));
    }
  }
  float inv[kTile];
  for (int v = 0; v < kTile; ++v) {   // softmax over the vector's own keys; zero after them
    float* row = sc + v * stride;
    const int64_t n = lens[v];
    inv[v] = 1.0f / exp_shifted(row, n, *std::max_element(row, row + n));
    std::fill(row + n, row + lmax, 0.0f);
  }
  for (int half = 0; half < 2; ++half) {       // P V: 3 vectors x 32 dims in 12 accumulators
    for (int t = 0; t < kTile; t += 3) {
      __m256 acc[3][4];
#pragma GCC unroll 3
      for (int x = 0; x < 3; ++x)
        for (int i = 0; i < 4; ++i) acc[x][i] = _mm256_setzero_ps();
      const float* p0 = sc + t * stride;
      for (int64_t j = 0; j < lmax; ++j) {
        const float* vr = vc + j * 64 + half * 32;
        const __m256 v0 = _mm256_loadu_ps(vr), v1 = _mm256_loadu_ps(vr + 8),
                     v2 = _mm256_loadu_ps(vr + 16), v3 = _mm256_loadu_ps(vr + 24);
#pragma GCC unroll 3
        for (int x = 0; x < 3; ++x) {
          const __m256 w = _mm256_broadcast_ss(p0 + x * stride + j);
          acc[x][0] = _mm256_fmadd_ps(w, v0, acc[x][0]);
          acc[x][1] = _mm256_fmadd_ps(w, v1, acc[x][1]);
          acc[x][2] = _mm256_fmadd_ps(w, v2, acc[x][2]);
          acc[x][3] = _mm256_fmadd_ps(w, v3, acc[x][3]);
        }
      }
      for (int x = 0; x < 3; ++x) {
        const __m256 r = _mm256_set1_ps(inv[t + x]);
        for (int i = 0; i < 4; ++i)
          _mm256_storeu_ps(out[t + x] + half * 32 + 8 * i, _mm256_mul_ps(acc[x][i], r));
      }
    }
  }
}

// Finds the prompt spans among the rows (consecutive rows of one block-table row whose lengths
// grow by one); returns them and marks their rows in `in_span`.
static std::vector<PromptSpan> find_spans(const int64_t* row_idx, const int64_t* table_idx,
                                          const int64_t* lens, int64_t count,
                                          std::vector<char>& in_span) {
  std::vector<PromptSpan> spans;
  in_span.assign(count, 0);
  for (int64_t i = 0; i < count;) {
    int64_t e = i + 1;
    while (e < count && table_idx[e] == table_idx[i] && lens[e] == lens[e - 1] + 1 &&
           row_idx[e] == row_idx[e - 1] + 1)
      ++e;
    if (e - i >= kSpanMinRows) {
      spans.push_back(PromptSpan{i, e - i, lens[e - 1], 0});
      std::fill(in_span.begin() + i, in_span.begin() + e, 1);
    }
    i = e;
  }
  return spans;
}

// Every span's rows, all heads: pack per (span, KV head), then tiles of kTile query vectors
// ordered (row, head within the KV group), heaviest tiles first.
template <typename T>
static void attend_spans(std::vector<PromptSpan> spans, const float* qbase,
                         int64_t q_stride, float* obase, int64_t o_stride, const int64_t* row_idx,
                         const int64_t* table_idx, const int64_t* lens, const int64_t* tables,
                         int64_t table_stride, const T* keys, const T* values,
                         int64_t block_size, int64_t token_stride, int64_t num_heads,
                         int64_t num_kv_heads, float scale) {
  const int64_t group = num_heads / num_kv_heads;
  int64_t total = 0;
  for (auto& sp : spans) {
    sp.packed = total;
    total += packed_floats(sp.max_len) * num_kv_heads;
  }
  // The caller's buffer, reused across calls; helpers get its address (a thread_local named in
  // the lambdas would be each helper's own, empty one).
  thread_local std::vector<float> buffer;
  if (static_cast<int64_t>(buffer.size()) < total) buffer.resize(total);
  float* const packed = buffer.data();
  const int64_t jobs = static_cast<int64_t>(spans.size()) * num_kv_heads;
  parallel_chunks(jobs, 1, [&](int64_t begin, int64_t end) {
    for (int64_t job = begin; job < end; ++job) {
      const PromptSpan& sp = spans[job / num_kv_heads];
      const int64_t g = job % num_kv_heads;
      float* kt = packed + sp.packed + g * packed_floats(sp.max_len);
      const int64_t* table = tables + table_idx[sp.first] * table_stride;
      pack_head(keys, values, table, block_size, token_stride, g * 64, sp.max_len, kt,
                kt + pad16(sp.max_len) * 64);
    }
  });
  struct Tile { int32_t span, head; int64_t first; };   // first vector, ordered (row, head)
  std::vector<Tile> tiles;
  for (int32_t si = static_cast<int32_t>(spans.size()) - 1; si >= 0; --si) {
    const int64_t vectors = spans[si].rows * group;
    for (int64_t v = (vectors - 1) / kTile * kTile; v >= 0; v -= kTile)
      for (int32_t g = 0; g < num_kv_heads; ++g) tiles.push_back(Tile{si, g, v});
  }
  parallel_chunks(static_cast<int64_t>(tiles.size()), 1, [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> scores;
    float scratch[64];
    for (int64_t ti = begin; ti < end; ++ti) {
      const Tile& tile = tiles[ti];
      const PromptSpan& sp = spans[tile.span];
      const float* kt = packed + sp.packed + tile.head * packed_floats(sp.max_len);
      const float* q[kTile];
      float* out[kTile];
      int64_t len[kTile];
      const int64_t vectors = sp.rows * group;
      for (int v = 0; v < kTile; ++v) {
        const int64_t vec = std::min(tile.first + v, vectors - 1);
        const int64_t i = sp.first + vec / group, h = tile.head * group + vec % group;
        q[v] = qbase + row_idx[i] * q_stride + h * 64;
        out[v] = tile.first + v < vectors ? obase + row_idx[i] * o_stride + h * 64 : scratch;
        len[v] = lens[i];
      }
      attend_tile(q, out, len, kt, kt + pad16(sp.max_len) * 64, scale, scores);
    }
  });
}

// Attention for any mix of decode and prompt tokens, all read from the paged cache: query row
// rows[i] attends to the first seq_lens[i] tokens of block-table row table_rows[i] (a prompt
// token's own causal length). Rows are dealt out zig-zag (first, last, second, ...), so the
// contiguous halves that two threads get carry equal work when lengths grow along a prompt; a
// batch smaller than the thread count is also split by KV head.
template <typename T>
static void paged_attention_impl(const at::Tensor& qkv, const at::Tensor& rows,
                                 const at::Tensor& table_rows, const at::Tensor& seq_lens,
                                 const at::Tensor& kv_cache, const at::Tensor& block_tables,
                                 at::Tensor& out, int64_t num_heads, int64_t num_kv_heads,
                                 double scale) {
  const T* keys = static_cast<const T*>(kv_cache.data_ptr());
  const int64_t count = seq_lens.size(0), block_size = kv_cache.size(2), d = kv_cache.size(4);
  const int64_t group = num_heads / num_kv_heads, token_stride = num_kv_heads * d;
  const int64_t splits = count < at::get_num_threads() ? num_kv_heads : 1;
  const T* values = keys + kv_cache.numel() / 2;
  const int64_t *row_idx = rows.data_ptr<int64_t>(), *lens = seq_lens.data_ptr<int64_t>();
  const int64_t *table_idx = table_rows.data_ptr<int64_t>(), *tables = block_tables.data_ptr<int64_t>();
  const float* qbase = qkv.data_ptr<float>();
  float* obase = out.data_ptr<float>();
  // Prompt chunks of kSpanMinRows+ rows go through the tiled path; the other rows (decodes,
  // short chunks) through the per-row one below.
  std::vector<char> in_span;
  std::vector<PromptSpan> spans;
  if (d == 64 && g_prompt_tiles && count >= kSpanMinRows)
    spans = find_spans(row_idx, table_idx, lens, count, in_span);
  if (!spans.empty()) {
    attend_spans(std::move(spans), qbase, qkv.stride(0), obase, out.stride(0), row_idx, table_idx, lens,
                 tables, block_tables.stride(0), keys, values, block_size, token_stride,
                 num_heads, num_kv_heads, static_cast<float>(scale));
    std::vector<int64_t> rest;
    for (int64_t i = 0; i < count; ++i)
      if (!in_span[i]) rest.push_back(i);
    if (rest.empty()) return;
    // The remaining rows, one task each (all heads): few of them, next to a prompt.
    parallel_chunks(static_cast<int64_t>(rest.size()), 1, [&](int64_t begin, int64_t end) {
      std::vector<float> p;
      for (int64_t t = begin; t < end; ++t) {
        const int64_t i = rest[t];
        const int64_t* table = tables + table_idx[i] * block_tables.stride(0);
        attend_heads_d64(qbase + row_idx[i] * qkv.stride(0), obase + row_idx[i] * out.stride(0),
                         0, num_heads, group, keys, values, table, 0, lens[i], block_size,
                         token_stride, static_cast<float>(scale), p);
      }
    });
    return;
  }
  int64_t total_keys = 0;
  for (int64_t i = 0; i < count; ++i) total_keys += lens[i];
  auto body = [&](int64_t begin, int64_t end) {
    std::vector<float> p;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t slot = task / splits, part = task % splits;
      const int64_t i = slot % 2 == 0 ? slot / 2 : count - 1 - slot / 2;
      const int64_t r = row_idx[i];
      const int64_t h0 = part * num_heads / splits, h1 = (part + 1) * num_heads / splits;
      const int64_t* table = tables + table_idx[i] * block_tables.stride(0);
      if (d == 64)
        attend_heads_d64(qbase + r * qkv.stride(0), obase + r * out.stride(0), h0, h1, group,
                         keys, values, table, 0, lens[i], block_size, token_stride,
                         static_cast<float>(scale), p);
      else
        attend_heads(qbase + r * qkv.stride(0), obase + r * out.stride(0), h0, h1, group, d,
                     keys, values, table, lens[i], block_size, token_stride,
                     static_cast<float>(scale), p);
    }
  };
  // One thread streams the fp32 cache at ~5-14 GB/s (K and V: 8 bytes per key element); fork
  // only when that takes well over what handing work to a (spinning) helper costs.
  const double solo_us = total_keys * num_kv_heads * d * 2 * sizeof(T) / 8e3;
  const int threads = at::get_num_threads();
  if (solo_us < 10.0 || threads <= 1) {
    body(0, count * splits);
    return;
  }
  if (d == 64 && count < threads && attention_split_k()) {
    // Few sequences (batch-1 decode): split each one's keys into equal ranges, all heads per
    // range, so every thread streams a disjoint part of the cache once; then merge (flash
    // decoding). Splitting by KV head gave 3 tasks to 2 threads, and each head re-read nothing
    // less than the whole context.
    const int64_t parts = 2 * threads;
    std::vector<float> acc(count * parts * num_heads * 64), stats(count * parts * num_heads * 2);
    parallel_chunks(count * parts, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> p;
      for (int64_t task = begin; task < end; ++task) {
        const int64_t i = task / parts, s = task % parts;
        const int64_t j0 = lens[i] * s / parts, j1 = lens[i] * (s + 1) / parts;
        float* st = stats.data() + task * num_heads * 2;
        float* a = acc.data() + task * num_heads * 64;
        if (j1 <= j0) {
          for (int64_t h = 0; h < num_heads; ++h) st[2 * h] = -INFINITY, st[2 * h + 1] = 0.0f;
          continue;
        }
        const int64_t* table = tables + table_idx[i] * block_tables.stride(0);
        attend_heads_d64(qbase + row_idx[i] * qkv.stride(0), a, 0, num_heads, group, keys,
                         values, table, j0, j1, block_size, token_stride,
                         static_cast<float>(scale), p, st);
      }
    });
    for (int64_t i = 0; i < count; ++i)
      combine_partials(acc.data() + i * parts * num_heads * 64,
                       stats.data() + i * parts * num_heads * 2, parts, num_heads,
                       obase + row_idx[i] * out.stride(0));
    return;
  }
  parallel_chunks(count * splits, 1, body);
}

// Attention for any mix of decode and prompt tokens, all read from the paged cache (fp32, or
// fp16 widened as it loads): see paged_attention_impl.
void paged_attention(const at::Tensor& qkv, const at::Tensor& rows, const at::Tensor& table_rows,
                     const at::Tensor& seq_lens, const at::Tensor& kv_cache,
                     const at::Tensor& block_tables, at::Tensor out, int64_t num_heads,
                     int64_t num_kv_heads, double scale) {
  check_rows(qkv, "qkv");
  check_rows(out, "out");
  TORCH_CHECK(block_tables.stride(1) == 1, "block_tables rows must be contiguous");
  if (half_kv_cache(kv_cache))
    paged_attention_impl<uint16_t>(qkv, rows, table_rows, seq_lens, kv_cache, block_tables, out,
                                   num_heads, num_kv_heads, scale);
  else
    paged_attention_impl<float>(qkv, rows, table_rows, seq_lens, kv_cache, block_tables, out,
                                num_heads, num_kv_heads, scale);
}

}  // namespace llmk
