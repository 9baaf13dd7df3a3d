// The CPU kernels' entry points, as bindings.cpp exposes them and decoder_stack.cpp calls them.
#pragma once

#include "torch_lite.h"

#include <vector>

torch::Tensor gguf_pack(const torch::Tensor& w, int64_t qtype, int64_t K);
torch::Tensor gguf_linear(const torch::Tensor& x, const torch::Tensor& w, int64_t qtype, int64_t N,
                          const c10::optional<torch::Tensor>& bias);
torch::Tensor gguf_pack_int8(const torch::Tensor& w, int64_t qtype, int64_t K);
torch::Tensor gguf_linear_int8(const torch::Tensor& x, const torch::Tensor& w, int64_t qtype, int64_t N,
                               const c10::optional<torch::Tensor>& bias);
torch::Tensor gguf_rows(const torch::Tensor& w, const torch::Tensor& ids, int64_t qtype, int64_t K);
std::string vector_isa();
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
    const std::vector<int64_t>& parts, const torch::Tensor& k_cache, const torch::Tensor& v_cache, const torch::Tensor& cos,
    const torch::Tensor& sin, int64_t heads, int64_t kv_heads, int64_t head_dim, double eps,
    const torch::Tensor& slot_mapping, const torch::Tensor& seq_offsets, const torch::Tensor& prefix,
    const torch::Tensor& prefix_offsets, const torch::Tensor& local,
    const torch::Tensor& local_offsets, const torch::Tensor& causal, double scale, bool int8);

torch::Tensor amx_pack_bf16(const torch::Tensor& w);
torch::Tensor amx_linear_bf16(const torch::Tensor& x, const torch::Tensor& w,
                              const c10::optional<torch::Tensor>& bias);
torch::Tensor amx_pack(const torch::Tensor& blocks, int64_t qtype, int64_t K);
bool amx_available();
torch::Tensor amx_linear(const torch::Tensor& x, const torch::Tensor& w, int64_t qtype,
                         const c10::optional<torch::Tensor>& bias);
