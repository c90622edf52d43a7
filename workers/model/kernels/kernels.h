// The kernels' C++ entry points, shared by the Python bindings (module.cpp) and DecoderStack.
#pragma once
#include <ATen/ATen.h>

#include <functional>
#include <optional>
#include <string>

namespace llmk {

using ChunkFn = std::function<void(int64_t, int64_t)>;

// fn over [0, n) in chunks of `grain`, shared with the pool's helpers (pool.cpp).
void parallel_chunks(int64_t n, int64_t grain, const ChunkFn& fn);
// Sends the pool's spinning helpers to sleep: call before ATen's own parallel work.
void park_pool_helpers();
void set_pool_segments(bool on);
// The next layer's KV prefetched during this layer's projections (side_prefetch.h): 0 off,
// 1-4 the hint (T0, T1, T2, NTA).
void set_side_prefetch(int mode);
// The decoder stack's probes decide when the stream runs (default); off: always (A/B, tests).
void set_side_adaptive(bool on);

bool attention_split_k();
void set_attention_split_k(bool on);
void set_attention_prefetch(bool on);
// The head_dim-64 decode attention on AVX-512 (default where the CPU has it; off: AVX2).
void set_attention_avx512(bool on);
// Prompt chunks of 8+ rows through the register-tiled span path (default on; off: per row).
void set_attention_prompt_tiles(bool on);
std::string qgemm_isa();
int64_t qgemm_vnni_mode();
int64_t qgemm_pair_min_rows();
bool qgemm_patterns_pay();
void set_tunable(const std::string& name, double value);

enum Pre : int64_t { kNone = 0, kRmsNorm = 1, kSiluMul = 2 };

at::Tensor qgemm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                 int64_t n, int64_t k, bool int4, int64_t pre,
                 const c10::optional<at::Tensor>& norm_w, double eps,
                 c10::optional<at::Tensor> out, bool accumulate);
// The same contract with a bf16 copy of the weight [N, K] and one oneDNN GEMM (qgemm.cpp):
// for prefill-sized calls where the CPU has AMX / AVX-512 bf16.
at::Tensor qgemm_dense(const at::Tensor& x, const at::Tensor& w, int64_t pre,
                       const c10::optional<at::Tensor>& norm_w, double eps,
                       c10::optional<at::Tensor> out, bool accumulate);
// The same contract on AMX bf16 tiles (qgemm_amx.cpp), with the bf16 copy packed by pack_amx:
// for calls of 16+ rows on CPUs with AMX, on our own pool.
bool amx_available();
at::Tensor qgemm_amx(const at::Tensor& x, const at::Tensor& w, int64_t n, int64_t k, int64_t pre,
                     const c10::optional<at::Tensor>& norm_w, double eps,
                     c10::optional<at::Tensor> out, bool accumulate);
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps);
at::Tensor silu_mul(const at::Tensor& x);
at::Tensor argmax_rows(const at::Tensor& x);
void rope_write_kv(at::Tensor qkv, const at::Tensor& positions, const at::Tensor& cos,
                   const at::Tensor& sin, at::Tensor kv_cache, const at::Tensor& slot_mapping,
                   int64_t num_heads, int64_t num_kv_heads);
void paged_attention(const at::Tensor& qkv, const at::Tensor& rows, const at::Tensor& table_rows,
                     const at::Tensor& seq_lens, const at::Tensor& kv_cache,
                     const at::Tensor& block_tables, at::Tensor out, int64_t num_heads,
                     int64_t num_kv_heads, double scale);

}  // namespace llmk
