// Python bindings of the CPU kernels (one extension module, `ngramspec_cpu`).

#include <torch/extension.h>

#include "ops.h"

// The compute-heavy calls drop the GIL while they run (they touch no Python object): a server's
// event loop then answers, streams and parses while the engine thread is in a forward, instead of
// waiting for it and then taking the GIL from it between kernels.
using NoGil = py::call_guard<py::gil_scoped_release>;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("gguf_pack", &gguf_pack, "GGUF blocks in groups of 8 rows with interleaved blocks");
  m.def("gguf_linear", &gguf_linear, NoGil(), "x @ dequant(w).T from packed GGUF blocks (fp32 accumulate)");
  m.def("gguf_pack_int8", &gguf_pack_int8, "GGUF blocks in gguf_linear_int8's layout (outputs in lanes for Q4_0/Q4_1/Q8_0)");
  m.def("gguf_linear_int8", &gguf_linear_int8, NoGil(),
        "x @ dequant(w).T from packed GGUF blocks with x quantised to int8 per 32 (llama.cpp's numerics)");
  m.def("gguf_rows", &gguf_rows, "dequantised rows of a GGUF matrix");
  m.def("vector_isa", &vector_isa, "the vector path compiled for this CPU: avx512, avx2 or scalar");
  m.def("paged_attention", &paged_attention, NoGil(),
        "attention over the KV cache in place: per-sequence prefix + per-token visible slots");
  m.def("amx_pack", &amx_pack, "GGUF blocks re-ordered into AMX tiles (same bits)");
  m.def("amx_available", &amx_available, "whether AMX bf16 tiles can run here (asks Linux once)");
  m.def("amx_linear", &amx_linear, NoGil(), "x @ dequant(w).T on AMX tiles (bf16 products, fp32 sums)");
  m.def("amx_pack_bf16", &amx_pack_bf16, "a bf16 matrix re-ordered into AMX B tiles");
  m.def("amx_linear_bf16", &amx_linear_bf16, NoGil(), "x @ w.T on AMX tiles, each row as alone (fp32 sums)");
  m.def("rms_norm", &rms_norm, "RMSNorm(x) * weight, row by row");
  m.def("add_rms_norm", &add_rms_norm, "residual += x; RMSNorm(residual) * weight");
  m.def("rope_", &rope_, "rotary embedding in place on the q and k heads of a fused qkv row");
  m.def("silu_mul", &silu_mul, "silu(gate) * up of a fused gate_up row");
  m.def("decoder_stack", &decoder_stack, NoGil(),
        "every decoder layer in one call (GGUF weights): the Python layers' kernel calls, in order");
}
