// Fused fp32 ops for the decoder's small steps: each replaces 5-10 torch ops whose dispatch cost
// (~5-10 us apiece, x30 layers) dominates a batch-1 decode step on a 2-core CPU.
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "vec_math.h"

namespace {

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 2 && t.scalar_type() == at::kFloat && t.stride(1) == 1, name,
              ": expected fp32 [rows, cols] with contiguous rows");
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

// Rotate-half RoPE on the q and k heads of qkv [T, (H + 2 KVH) * D] in place, then store k and v
// at their cache slots: kv_cache [2, blocks, block_size, KVH, D].
void rope_write_kv(at::Tensor qkv, const at::Tensor& positions, const at::Tensor& cos,
                   const at::Tensor& sin, at::Tensor kv_cache, const at::Tensor& slot_mapping,
                   int64_t num_heads, int64_t num_kv_heads) {
  check_rows(qkv, "qkv");
  TORCH_CHECK(kv_cache.is_contiguous() && kv_cache.scalar_type() == at::kFloat, "kv_cache: fp32");
  const int64_t t = qkv.size(0), d = kv_cache.size(4), half = d / 2;
  const int64_t kv_row = num_kv_heads * d, v_offset = kv_cache.numel() / 2;
  const int64_t *pos = positions.data_ptr<int64_t>(), *slots = slot_mapping.data_ptr<int64_t>();
  const float *cs = cos.data_ptr<float>(), *sn = sin.data_ptr<float>();
  float *base = qkv.data_ptr<float>(), *cache = kv_cache.data_ptr<float>();
  at::parallel_for(0, t, 16, [&](int64_t begin, int64_t end) {
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
      std::copy(k, k + kv_row, cache + slots[i] * kv_row);
      std::copy(k + kv_row, k + 2 * kv_row, cache + v_offset + slots[i] * kv_row);
    }
  });
}

// softmax(q K^T * scale) V for the `group` query heads sharing one KV head of one sequence.
void attend_one(const float* q, int64_t group, int64_t d, const float* keys, const float* values,
                const int64_t* table, int64_t seq_len, int64_t block_size, int64_t token_stride,
                float scale, std::vector<float>& scores, float* out) {
  scores.resize(group * seq_len);
  for (int64_t j = 0; j < seq_len; ++j) {
    const int64_t slot = table[j / block_size] * block_size + j % block_size;
    for (int64_t g = 0; g < group; ++g)
      scores[g * seq_len + j] = vm::dot(q + g * d, keys + slot * token_stride, d) * scale;
  }
  for (int64_t g = 0; g < group; ++g) {
    float* s = scores.data() + g * seq_len;
    const float mx = *std::max_element(s, s + seq_len);
    __m256 sum = _mm256_setzero_ps();
    int64_t j = 0;
    for (; j + 8 <= seq_len; j += 8) {
      const __m256 e = vm::exp(_mm256_sub_ps(_mm256_loadu_ps(s + j), _mm256_set1_ps(mx)));
      _mm256_storeu_ps(s + j, e);
      sum = _mm256_add_ps(sum, e);
    }
    float total = vm::hsum(sum);
    for (; j < seq_len; ++j) total += (s[j] = std::exp(s[j] - mx));
    const float inv = 1.0f / total;
    for (j = 0; j < seq_len; ++j) s[j] *= inv;
    std::fill(out + g * d, out + (g + 1) * d, 0.0f);
  }
  for (int64_t j = 0; j < seq_len; ++j) {
    const int64_t slot = table[j / block_size] * block_size + j % block_size;
    for (int64_t g = 0; g < group; ++g)
      vm::axpy(scores[g * seq_len + j], values + slot * token_stride, out + g * d, d);
  }
}

// One new token per sequence: out[rows[b]] = attention of qkv[rows[b]]'s query heads over the
// first seq_lens[b] cached tokens, read through block_tables. Parallel over (sequence, KV head).
void paged_decode_attention(const at::Tensor& qkv, const at::Tensor& rows, const at::Tensor& kv_cache,
                            const at::Tensor& block_tables, const at::Tensor& seq_lens,
                            at::Tensor out, int64_t num_heads, int64_t num_kv_heads, double scale) {
  check_rows(qkv, "qkv");
  check_rows(out, "out");
  TORCH_CHECK(kv_cache.is_contiguous() && kv_cache.scalar_type() == at::kFloat, "kv_cache: fp32");
  TORCH_CHECK(block_tables.stride(1) == 1, "block_tables rows must be contiguous");
  const int64_t batch = seq_lens.size(0), block_size = kv_cache.size(2), d = kv_cache.size(4);
  const int64_t group = num_heads / num_kv_heads, token_stride = num_kv_heads * d;
  const float* keys = kv_cache.data_ptr<float>();
  const float* values = keys + kv_cache.numel() / 2;
  const int64_t *row_idx = rows.data_ptr<int64_t>(), *lens = seq_lens.data_ptr<int64_t>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  at::parallel_for(0, batch * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / num_kv_heads, h = task % num_kv_heads, r = row_idx[b];
      attend_one(qkv.data_ptr<float>() + r * qkv.stride(0) + h * group * d, group, d,
                 keys + h * d, values + h * d, tables + b * block_tables.stride(0), lens[b],
                 block_size, token_stride, static_cast<float>(scale), scores,
                 out.data_ptr<float>() + r * out.stride(0) + h * group * d);
    }
  });
}

}  // namespace

void register_fused_ops(pybind11::module& m) {
  m.def("rms_norm", &rms_norm);
  m.def("silu_mul", &silu_mul);
  m.def("rope_write_kv", &rope_write_kv);
  m.def("paged_decode_attention", &paged_decode_attention);
}
