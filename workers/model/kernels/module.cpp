// Python bindings. Every entry point releases the GIL: the async engine runs steps on a worker
// thread, and the event loop must keep serving streams while a step computes.
#include <torch/csrc/utils/pybind.h>
#include <pybind11/stl.h>

#include "kernels.h"

namespace llmk {
void register_decoder_stack(pybind11::module& m);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  using release = py::call_guard<py::gil_scoped_release>;
  m.def("qgemm", &llmk::qgemm, release(), "out (+)= pre(x) @ W^T for packed int8/int4 weights",
        py::arg("x"), py::arg("packed"), py::arg("scales"), py::arg("n"), py::arg("k"),
        py::arg("int4"), py::arg("pre"), py::arg("norm_w"), py::arg("eps"), py::arg("out"),
        py::arg("accumulate"));
  m.def("qgemm_dense", &llmk::qgemm_dense, release(),
        "out (+)= pre(x) @ W^T with a bf16 copy W [N, K] (oneDNN GEMM, prefill-sized calls)",
        py::arg("x"), py::arg("w"), py::arg("pre"), py::arg("norm_w"), py::arg("eps"),
        py::arg("out"), py::arg("accumulate"));
  m.def("qgemm_amx", &llmk::qgemm_amx, release(),
        "out (+)= pre(x) @ W^T with W's bf16 copy packed for AMX tiles (pack_amx in Python)",
        py::arg("x"), py::arg("w"), py::arg("n"), py::arg("k"), py::arg("pre"),
        py::arg("norm_w"), py::arg("eps"), py::arg("out"), py::arg("accumulate"));
  m.def("amx_available", &llmk::amx_available, "AMX-BF16 tiles usable in this process");
  m.def("rms_norm", &llmk::rms_norm, release());
  m.def("silu_mul", &llmk::silu_mul, release());
  m.def("argmax_rows", &llmk::argmax_rows, release(),
        "each row's index of its largest value (torch.argmax(x, 1) semantics)");
  m.def("rope_write_kv", &llmk::rope_write_kv, release());
  m.def("paged_attention", &llmk::paged_attention, release());
  m.def("isa", &llmk::qgemm_isa, "the GEMM tiles in use: 'avx512_vnni' or 'avx2'");
  m.def("vnni_mode", &llmk::qgemm_vnni_mode, "0 AVX2 only, 1 VNNI where faster, 2 VNNI always");
  m.def("pair_min_rows", &llmk::qgemm_pair_min_rows,
        "rows from which a VNNI CPU runs the pair tiles (0: never)");
  m.def("patterns_pay", &llmk::qgemm_patterns_pay,
        "whether int8 calls of a few rows take the VNNI pattern tiles here (else AVX2)");
  m.def("set_tunable", &llmk::set_tunable, "A/B knob for benchmarks (prefetch_bytes, ...)");
  llmk::register_decoder_stack(m);
}
