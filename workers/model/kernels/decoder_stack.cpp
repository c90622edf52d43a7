// The whole decoder stack of a packed int8/int4 model as one call per forward: ~180 Python-level
// kernel calls and ~200 nn.Module calls per step become one, which at batch 1 was ~25% of a
// step (py-spy). Same kernels, same order as the Python path in llama.py (tests compare them).
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <vector>

#include "kernels.h"
#include "side_prefetch.h"

namespace llmk {

SideStream g_side;

void SideCursor::issue() {
  const int hint = g_side.hint;
  while (credit_ >= 1.0) {
    if (left_ == 0) {
      const int64_t i = g_side.next.fetch_add(1, std::memory_order_relaxed);
      if (i >= static_cast<int64_t>(g_side.ranges.size())) {   // the stream is done
        rate_ = 0.0;
        return;
      }
      p_ = g_side.ranges[i].p;
      left_ = g_side.ranges[i].lines;
    }
    const int64_t n = std::min<int64_t>(left_, static_cast<int64_t>(credit_));
    for (int64_t j = 0; j < n; ++j) {
      const char* line = p_ + 64 * j;
      switch (hint) {
        case 2: _mm_prefetch(line, _MM_HINT_T1); break;
        case 3: _mm_prefetch(line, _MM_HINT_T2); break;
        case 4: _mm_prefetch(line, _MM_HINT_NTA); break;
        default: _mm_prefetch(line, _MM_HINT_T0);
      }
    }
    p_ += 64 * n;
    left_ -= n;
    issued_ += n;
    credit_ -= static_cast<double>(n);
  }
}

void SideCursor::finish() {
  credit_ = static_cast<double>(left_);   // exactly the claimed range's rest: no new claim
  issue();
}

bool g_side_adaptive = true;
void set_side_adaptive(bool on) { g_side_adaptive = on; }

void set_side_prefetch(int mode) {
  TORCH_CHECK(mode >= 0 && mode <= 4, "side_prefetch: 0 (off) or 1-4 (T0, T1, T2, NTA), got ",
              mode);
  g_side.hint = mode;
}

struct Projection {
  at::Tensor packed, scales;
  int64_t n, k;
  bool int4;
  at::Tensor dense;   // optional bf16 copy [N, K] for qgemm_dense (prefill-sized calls)
  at::Tensor amx;     // or that copy packed for qgemm_amx (AMX CPUs: decode batches too)
};

struct Layer {
  at::Tensor input_norm, post_norm;
  Projection qkv, o, gate_up, down;
};

class DecoderStack {
 public:
  DecoderStack(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps)
      : heads_(num_heads), kv_heads_(num_kv_heads), head_dim_(head_dim), eps_(eps) {}

  // Projections in order qkv, o, gate_up, down: (packed, scales, out, in, is_int4) each.
  void add_layer(at::Tensor input_norm, at::Tensor post_norm, std::vector<at::Tensor> packed,
                 std::vector<at::Tensor> scales, std::vector<int64_t> n, std::vector<int64_t> k,
                 std::vector<bool> int4) {
    TORCH_CHECK(packed.size() == 4 && scales.size() == 4 && n.size() == 4 && k.size() == 4 &&
                int4.size() == 4, "a layer has four projections");
    Projection p[4];
    for (int i = 0; i < 4; ++i) p[i] = Projection{packed[i], scales[i], n[i], k[i], int4[i]};
    layers_.push_back(Layer{input_norm, post_norm, p[0], p[1], p[2], p[3]});
  }

  // bf16 copies [N, K] of the last added layer's projections (same order), used for calls of
  // at least `min_rows` rows (set_dense_min_rows; 0 = never).
  void add_dense_copies(std::vector<at::Tensor> dense) {
    TORCH_CHECK(!layers_.empty() && dense.size() == 4, "four copies per layer");
    Layer& l = layers_.back();
    Projection* p[4] = {&l.qkv, &l.o, &l.gate_up, &l.down};
    for (int i = 0; i < 4; ++i) {
      TORCH_CHECK(dense[i].size(0) == p[i]->n && dense[i].size(1) == p[i]->k,
                  "copy shape mismatch");
      p[i]->dense = dense[i].contiguous();
    }
  }
  // The same copies packed for AMX tiles (pack_amx), used instead of the plain ones.
  void add_amx_weights(std::vector<at::Tensor> packed) {
    TORCH_CHECK(!layers_.empty() && packed.size() == 4, "four packed copies per layer");
    Layer& l = layers_.back();
    Projection* p[4] = {&l.qkv, &l.o, &l.gate_up, &l.down};
    for (int i = 0; i < 4; ++i) {
      TORCH_CHECK(packed[i].numel() == p[i]->n * p[i]->k, "packed copy size mismatch");
      p[i]->amx = packed[i].contiguous();
    }
  }
  void set_dense_min_rows(int64_t rows) { dense_min_rows_ = rows; }

  // The model's whole forward for token ids: the embedding rows, every layer, the final norm.
  // After a step's weights have streamed through every cache, each torch call from Python costs
  // ~50 us instead of ~5 (measured on a 2-core Zen 3); these were two of them per step.
  at::Tensor forward_ids(const at::Tensor& input_ids, const at::Tensor& embedding,
                         const at::Tensor& final_norm, const at::Tensor& positions,
                         const at::Tensor& cos, const at::Tensor& sin,
                         const std::vector<at::Tensor>& kv_caches, const at::Tensor& slot_mapping,
                         const at::Tensor& token_rows, const at::Tensor& token_table_rows,
                         const at::Tensor& token_lens, const at::Tensor& block_tables) {
    TORCH_CHECK(input_ids.dim() == 1 && input_ids.scalar_type() == at::kLong &&
                input_ids.is_contiguous(), "input_ids: contiguous int64 [T]");
    TORCH_CHECK(embedding.dim() == 2 && embedding.scalar_type() == at::kFloat &&
                embedding.is_contiguous(), "embedding: contiguous fp32 [vocab, hidden]");
    const int64_t t = input_ids.size(0), vocab = embedding.size(0), hidden = embedding.size(1);
    at::Tensor x = at::empty({t, hidden}, embedding.options());
    const int64_t* ids = input_ids.data_ptr<int64_t>();
    const float* table = embedding.data_ptr<float>();
    float* dst = x.data_ptr<float>();
    for (int64_t i = 0; i < t; ++i) {
      TORCH_CHECK(ids[i] >= 0 && ids[i] < vocab, "input_ids[", i, "] = ", ids[i],
                  " is outside the vocabulary [0, ", vocab, ")");
      std::copy(table + ids[i] * hidden, table + (ids[i] + 1) * hidden, dst + i * hidden);
    }
    forward(x, positions, cos, sin, kv_caches, slot_mapping, token_rows, token_table_rows,
            token_lens, block_tables);
    return rms_norm(x, final_norm, eps_);
  }

  // Runs every layer on x [T, hidden] in place (residual adds accumulate into it).
  at::Tensor forward(at::Tensor x, const at::Tensor& positions, const at::Tensor& cos,
                     const at::Tensor& sin, const std::vector<at::Tensor>& kv_caches,
                     const at::Tensor& slot_mapping, const at::Tensor& token_rows,
                     const at::Tensor& token_table_rows, const at::Tensor& token_lens,
                     const at::Tensor& block_tables) {
    TORCH_CHECK(kv_caches.size() == layers_.size(), "one KV cache per layer");
    const double scale = 1.0 / std::sqrt(static_cast<double>(head_dim_));
    using clock = std::chrono::steady_clock;
    auto mark = clock::now();
    auto lap = [&](int phase) {   // per-phase wall time, only while profiling
      if (!profiling_) return;
      const auto now = clock::now();
      profile_[phase] += std::chrono::duration<double>(now - mark).count();
      mark = now;
    };
    // Scratch outputs allocated once per call, not per layer (every layer has the same shapes).
    const int64_t t = x.size(0);
    g_side.planned = 0;
    g_side.issued.store(0);
    // Batches of kSideMinRows+ rows prefetch the next layer's KV (side_prefetch.h), as the
    // controller decides (always, with side_adaptive off).
    const bool eligible = g_side.hint > 0 && t >= kSideMinRows && layers_.size() > 1;
    const bool adaptive = eligible && g_side_adaptive;
    const bool stream = adaptive ? side_control_.begin() : eligible;
    const auto started = clock::now();
    at::Tensor qkv, attn = at::empty({t, heads_ * head_dim_}, x.options()), gate_up;
    if (!layers_.empty()) {
      qkv = at::empty({t, layers_[0].qkv.n}, x.options());
      gate_up = at::empty({t, layers_[0].gate_up.n}, x.options());
    }
    for (size_t i = 0; i < layers_.size(); ++i) {
      const Layer& l = layers_[i];
      into(x, l.qkv, kRmsNorm, l.input_norm, qkv);
      g_side.lines_per_mac = 0.0;   // the stream set up by the last layer ends here
      lap(0);
      rope_write_kv(qkv, positions, cos, sin, kv_caches[i], slot_mapping, heads_, kv_heads_);
      lap(1);
      paged_attention(qkv, token_rows, token_table_rows, token_lens, kv_caches[i], block_tables,
                      attn, heads_, kv_heads_, scale);
      lap(2);
      if (stream && i + 1 < layers_.size())
        side_stream_for(kv_caches[i + 1], token_table_rows, token_lens, block_tables, t, l,
                        layers_[i + 1].qkv);
      run(attn, l.o, kNone, c10::nullopt, x);
      lap(3);
      into(x, l.gate_up, kRmsNorm, l.post_norm, gate_up);
      lap(4);
      run(gate_up, l.down, kSiluMul, c10::nullopt, x);
      lap(5);
    }
    g_side.lines_per_mac = 0.0;
    if (adaptive)
      side_control_.end(t, std::chrono::duration<double>(clock::now() - started).count());
    return x;
  }

 private:
  // The side stream (side_prefetch.h): every KV block the next layer's attention will read, K
  // then V per sequence, spread over the multiply-adds of this layer's o, gate_up and down and
  // the next layer's qkv.
  void side_stream_for(const at::Tensor& cache, const at::Tensor& table_rows,
                       const at::Tensor& lens, const at::Tensor& block_tables, int64_t t,
                       const Layer& l, const Projection& next_qkv) {
    const int64_t count = lens.size(0), block_size = cache.size(2);
    const int64_t token_bytes = cache.size(3) * cache.size(4) * cache.element_size();
    const int64_t block_bytes = block_size * token_bytes;
    const char* keys = static_cast<const char*>(cache.data_ptr());
    const char* values = keys + cache.numel() / 2 * cache.element_size();
    const int64_t *rows = table_rows.data_ptr<int64_t>(), *len = lens.data_ptr<int64_t>();
    const int64_t* tables = block_tables.data_ptr<int64_t>();
    const int64_t stride = block_tables.stride(0);
    // The longest length per block-table row (a prompt's rows share one).
    std::vector<std::pair<int64_t, int64_t>> seqs;
    for (int64_t i = 0; i < count; ++i) {
      if (!seqs.empty() && seqs.back().first == rows[i])
        seqs.back().second = std::max(seqs.back().second, len[i]);
      else
        seqs.emplace_back(rows[i], len[i]);
    }
    g_side.ranges.clear();
    int64_t lines = 0;
    for (const auto& [row, n] : seqs) {
      const int64_t* table = tables + row * stride;
      for (const char* base : {keys, values}) {
        for (int64_t b = 0; b * block_size < n; ++b) {
          const int64_t used = std::min(block_size, n - b * block_size);
          const int64_t k = (used * token_bytes + 63) / 64;
          g_side.ranges.push_back(SideRange{base + table[b] * block_bytes, k});
          lines += k;
        }
      }
    }
    const double macs = static_cast<double>(t) *
        (l.o.n * l.o.k + l.gate_up.n * l.gate_up.k + l.down.n * l.down.k + next_qkv.n * next_qkv.k);
    g_side.planned += lines;
    g_side.next.store(0, std::memory_order_relaxed);
    g_side.lines_per_mac = lines > 0 ? lines / macs : 0.0;
  }

  void into(const at::Tensor& input, const Projection& p, Pre pre, const at::Tensor& norm,
            const at::Tensor& out) {
    TORCH_CHECK(out.size(1) == p.n, "layers must share projection shapes");
    if (use_amx(input, p))
      qgemm_amx(input, p.amx, p.n, p.k, pre, norm, eps_, out, false);
    else if (use_dense(input, p))
      qgemm_dense(input, p.dense, pre, norm, eps_, out, false);
    else
      qgemm(input, p.packed, p.scales, p.n, p.k, p.int4, pre, norm, eps_, out, false);
  }

  at::Tensor run(const at::Tensor& input, const Projection& p, Pre pre,
                 const c10::optional<at::Tensor>& norm, c10::optional<at::Tensor> residual) {
    const bool accumulate = residual.has_value();
    if (use_amx(input, p))
      return qgemm_amx(input, p.amx, p.n, p.k, pre, norm, eps_, residual, accumulate);
    if (use_dense(input, p))
      return qgemm_dense(input, p.dense, pre, norm, eps_, residual, accumulate);
    return qgemm(input, p.packed, p.scales, p.n, p.k, p.int4, pre, norm, eps_, residual,
                 accumulate);
  }

  bool use_amx(const at::Tensor& input, const Projection& p) const {
    return p.amx.defined() && dense_min_rows_ > 0 && input.size(0) >= dense_min_rows_;
  }
  bool use_dense(const at::Tensor& input, const Projection& p) const {
    return p.dense.defined() && dense_min_rows_ > 0 && input.size(0) >= dense_min_rows_;
  }
  int64_t dense_min_rows_ = 0;

  // Seconds per phase (qkv, rope, attention, o, gate_up, down) summed over calls, while
  // profiling is on (a diagnostic for benchmarks; off by default, no cost then).
 public:
  void set_profiling(bool on) { profiling_ = on; std::fill(profile_, profile_ + 6, 0.0); }
  std::vector<double> profile() const { return std::vector<double>(profile_, profile_ + 6); }
  // The last forward's side stream: (lines planned, lines prefetched).
  std::vector<int64_t> side_prefetch_lines() const {
    return {g_side.planned, g_side.issued.load()};
  }

 private:
  SideController side_control_;
  bool profiling_ = false;
  double profile_[6] = {0, 0, 0, 0, 0, 0};
  int64_t heads_, kv_heads_, head_dim_;
  double eps_;
  std::vector<Layer> layers_;
};

void register_decoder_stack(pybind11::module& m) {
  namespace py = pybind11;
  py::class_<SideController>(m, "SideController")
      .def(py::init<>())
      .def("begin", &SideController::begin)
      .def("end", &SideController::end)
      .def("score", &SideController::score)
      .def("pairs", &SideController::pairs)
      .def("on", &SideController::on);
  py::class_<DecoderStack>(m, "DecoderStack")
      .def(py::init<int64_t, int64_t, int64_t, double>())
      .def("add_layer", &DecoderStack::add_layer)
      .def("add_dense_copies", &DecoderStack::add_dense_copies)
      .def("add_amx_weights", &DecoderStack::add_amx_weights)
      .def("set_dense_min_rows", &DecoderStack::set_dense_min_rows)
      .def("set_profiling", &DecoderStack::set_profiling)
      .def("profile", &DecoderStack::profile)
      .def("side_prefetch_lines", &DecoderStack::side_prefetch_lines)
      .def("forward", &DecoderStack::forward, py::call_guard<py::gil_scoped_release>())
      .def("forward_ids", &DecoderStack::forward_ids, py::call_guard<py::gil_scoped_release>());
}

}  // namespace llmk
