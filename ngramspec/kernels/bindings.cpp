// Python bindings of the CPU kernels (one extension module, `ngramspec_cpu`).

#include <torch/extension.h>

torch::Tensor gguf_pack(const torch::Tensor& w, int64_t qtype, int64_t K);
torch::Tensor gguf_linear(const torch::Tensor& x, const torch::Tensor& w, int64_t qtype, int64_t N,
                          const c10::optional<torch::Tensor>& bias);
torch::Tensor gguf_rows(const torch::Tensor& w, const torch::Tensor& ids, int64_t qtype, int64_t K);
bool has_avx512();
torch::Tensor paged_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                              torch::Tensor k_cache, torch::Tensor v_cache,
                              const torch::Tensor& slot_mapping, const torch::Tensor& seq_offsets,
                              const torch::Tensor& prefix, const torch::Tensor& prefix_offsets,
                              const torch::Tensor& local, const torch::Tensor& local_offsets,
                              const torch::Tensor& causal, double scale);

torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps);
torch::Tensor add_rms_norm(torch::Tensor residual, const torch::Tensor& x, const torch::Tensor& weight,
                           double eps);
void rope_(torch::Tensor qkv, const torch::Tensor& cos, const torch::Tensor& sin, int64_t heads,
           int64_t head_dim);
torch::Tensor silu_mul(const torch::Tensor& gate_up);
std::vector<torch::Tensor> decoder_stack(
    torch::Tensor x, const std::vector<torch::Tensor>& norms, const std::vector<torch::Tensor>& blocks,
    const std::vector<int64_t>& qtypes, const std::vector<int64_t>& outputs,
    const torch::Tensor& k_cache, const torch::Tensor& v_cache, const torch::Tensor& cos,
    const torch::Tensor& sin, int64_t heads, int64_t kv_heads, int64_t head_dim, double eps,
    const torch::Tensor& slot_mapping, const torch::Tensor& seq_offsets, const torch::Tensor& prefix,
    const torch::Tensor& prefix_offsets, const torch::Tensor& local,
    const torch::Tensor& local_offsets, const torch::Tensor& causal, double scale);

torch::Tensor amx_pack_bf16(const torch::Tensor& w);
torch::Tensor amx_linear_bf16(const torch::Tensor& x, const torch::Tensor& w,
                              const c10::optional<torch::Tensor>& bias);
torch::Tensor amx_pack(const torch::Tensor& blocks, int64_t qtype, int64_t K);
bool amx_available();
torch::Tensor amx_linear(const torch::Tensor& x, const torch::Tensor& w, int64_t qtype,
                         const c10::optional<torch::Tensor>& bias);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("gguf_pack", &gguf_pack, "GGUF blocks in groups of 8 rows with interleaved blocks");
  m.def("gguf_linear", &gguf_linear, "x @ dequant(w).T from packed GGUF blocks (fp32 accumulate)");
  m.def("gguf_rows", &gguf_rows, "dequantised rows of a GGUF matrix");
  m.def("has_avx512", &has_avx512, "whether the vector paths were compiled");
  m.def("paged_attention", &paged_attention,
        "attention over the KV cache in place: per-sequence prefix + per-token visible slots");
  m.def("amx_pack", &amx_pack, "GGUF blocks re-ordered into AMX tiles (same bits)");
  m.def("amx_available", &amx_available, "whether AMX bf16 tiles can run here (asks Linux once)");
  m.def("amx_linear", &amx_linear, "x @ dequant(w).T on AMX tiles (bf16 products, fp32 sums)");
  m.def("amx_pack_bf16", &amx_pack_bf16, "a bf16 matrix re-ordered into AMX B tiles");
  m.def("amx_linear_bf16", &amx_linear_bf16, "x @ w.T on AMX tiles, each row as alone (fp32 sums)");
  m.def("rms_norm", &rms_norm, "RMSNorm(x) * weight, row by row");
  m.def("add_rms_norm", &add_rms_norm, "residual += x; RMSNorm(residual) * weight");
  m.def("rope_", &rope_, "rotary embedding in place on the q and k heads of a fused qkv row");
  m.def("silu_mul", &silu_mul, "silu(gate) * up of a fused gate_up row");
  m.def("decoder_stack", &decoder_stack,
        "every decoder layer in one call (GGUF weights): the Python layers' kernel calls, in order");
}
