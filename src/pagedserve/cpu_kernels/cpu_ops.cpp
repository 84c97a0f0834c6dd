// The CPU kernels' Python module. Built with -O3 -ffast-math and each level's -m flags
// (isa.py): the portable loops of the kernels are written so that the compiler vectorizes them
// at every level; fast-math allows that, so no kernel relies on infinities or NaN. Parallel
// loops use torch's own thread pool (at::parallel_for), so they share its threads.
// Headers: the narrowest that declare what a file uses (pybind11's tensor casters here, not
// torch/extension.h; in the kernels ATen/core/Tensor.h, outputs by Tensor::new_empty, not
// ATen/ATen.h): parsing torch's umbrella headers was half of a level's build time.
#include <torch/csrc/utils/pybind.h>

#include <string>

#include "amx.h"
#include "cpu_ops.h"
#include "isa.h"
#include "prefill_attention.h"
#include "quant_linear.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // Without the GIL: the server's event loop thread (streaming the previous step's tokens)
  // runs while a step computes, instead of waiting for the whole forward.
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  m.def("rms_norm", &rms_norm, nogil);
  m.def("add_rms_norm_", &add_rms_norm_, nogil);
  m.def("rotary_", &rotary_, nogil);
  m.def("silu_and_mul", &silu_and_mul, nogil);
  m.def("argmax_rows", &argmax_rows, nogil);
  m.def("masked_logits", &masked_logits, nogil);
  m.def("write_kv_", &write_kv_, nogil);
  m.def("paged_decode_attention", &paged_decode_attention, nogil);
  m.def("prefill_attention_supported", &prefill_attention_supported, nogil);
  m.def("prefill_attention_", &prefill_attention_, nogil);
  m.def("decode_layer", &decode_layer, nogil);
  m.def("amx_available", &amx_available, nogil);
  m.def("kernel_level", [] { return std::string(kernel_level_name()); });
  // float_out: float32 y from bf16 x (the output matrix's logits).
  m.def("quant_linear", &quant_linear, py::arg("x"), py::arg("codes"), py::arg("scales"),
        py::arg("offsets"), py::arg("bias"), py::arg("bits"), py::arg("int8_activations"),
        py::arg("float_out") = false, nogil);
  m.def("quant_rows", &quant_rows, nogil);
  m.def("kquant_linear", &kquant_linear, py::arg("x"), py::arg("codes"), py::arg("supers"),
        py::arg("subs"), py::arg("bias"), py::arg("bits"), py::arg("int8_activations"),
        py::arg("float_out") = false, nogil);
  m.def("kquant_rows", &kquant_rows, nogil);
  m.def("pack_quant_blocks", &pack_quant_blocks, nogil);
  m.def("pack_kquant_blocks", &pack_kquant_blocks, nogil);
}

