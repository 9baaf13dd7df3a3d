// Every decoder layer of a Llama-family model in one call (CPU, GGUF weights, one rank).
//
// Why: at one token a layer is ten small kernel calls, and driving them from Python (module
// calls, argument conversion, tensor wrappers) costs a large share of a small model's decode
// step. This loop makes the same calls, in the same order, on the
// same tensors as LlamaForCausalLM's Python layers (models/llama.py), so its outputs are bitwise
// those of the Python path; it only drops the interpreter between them.

#include "torch_lite.h"

#include <vector>

#include "ops.h"

namespace {

constexpr int64_t kMatrices = 4;  // per layer: qkv, o, gate_up, down

}  // namespace

// x: [T, hidden] float32 embeddings -> (last layer's MLP output, residual stream before it),
// each [T, hidden]. Per layer l: norms[2l], norms[2l + 1] (input, post-attention); matrices
// [4l .. 4l + 3] (qkv, o, gate_up, down). Matrix m is parts[m] pieces of blocks, qtypes and
// outputs, in order (packed by gguf_pack, see gguf_kernels.cpp): one when its rows share a block
// type, more where a file mixes them (Q4_K_M: q/k Q5_0, v Q6_K), their outputs side by side;
// k_cache[l], v_cache[l]: [slots, KVH, D]. int8: the matrices quantise their inputs to int8
// (gguf_linear_int8), else they take them in float32 (gguf_linear). cos, sin: [T, D] float32;
// the rest as paged_attention.
std::vector<torch::Tensor> decoder_stack(
    torch::Tensor x, const std::vector<torch::Tensor>& norms, const std::vector<torch::Tensor>& blocks,
    const std::vector<int64_t>& qtypes, const std::vector<int64_t>& outputs,
    const std::vector<int64_t>& parts, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
    const torch::Tensor& cos, const torch::Tensor& sin, int64_t heads, int64_t kv_heads,
    int64_t head_dim, double eps,
    const torch::Tensor& slot_mapping, const torch::Tensor& seq_offsets, const torch::Tensor& prefix,
    const torch::Tensor& prefix_offsets, const torch::Tensor& local,
    const torch::Tensor& local_offsets, const torch::Tensor& causal, double scale, bool int8) {
  const int64_t layers = k_cache.size(0);
  std::vector<int64_t> first(parts.size() + 1, 0);  // matrix m's pieces: [first[m], first[m + 1])
  for (size_t m = 0; m < parts.size(); ++m) {
    TORCH_CHECK(parts[m] >= 1, "decoder_stack: a matrix has at least one piece");
    first[m + 1] = first[m] + parts[m];
  }
  TORCH_CHECK(static_cast<int64_t>(norms.size()) == 2 * layers &&
                  static_cast<int64_t>(parts.size()) == kMatrices * layers &&
                  static_cast<int64_t>(blocks.size()) == first.back() &&
                  qtypes.size() == blocks.size() && outputs.size() == blocks.size() &&
                  v_cache.size(0) == layers,
              "decoder_stack: 2 norms and 4 matrices a layer, one K and V cache a layer");
  const int64_t t = x.size(0), q_size = heads * head_dim, kv_size = kv_heads * head_dim;
  const c10::optional<torch::Tensor> no_bias;
  auto linear = [&](const torch::Tensor& in, int64_t m) {  // as GGUFLinear / GGUFStack
    std::vector<torch::Tensor> outs;
    for (int64_t i = first[m]; i < first[m + 1]; ++i)
      outs.push_back(int8 ? gguf_linear_int8(in, blocks[i], qtypes[i], outputs[i], no_bias)
                          : gguf_linear(in, blocks[i], qtypes[i], outputs[i], no_bias));
    return outs.size() == 1 ? outs[0] : torch::cat(outs, 1);
  };
  torch::Tensor residual = x;  // the embeddings; updated in place from the first add on
  torch::Tensor h;
  for (int64_t l = 0; l < layers; ++l) {
    h = l == 0 ? rms_norm(x, norms[0], eps) : add_rms_norm(residual, x, norms[2 * l], eps);
    torch::Tensor qkv = linear(h, kMatrices * l);  // [T, q_size + 2 kv_size]
    rope_(qkv, cos, sin, heads + kv_heads, head_dim);
    torch::Tensor q = qkv.narrow(1, 0, q_size).view({t, heads, head_dim});
    torch::Tensor k = qkv.narrow(1, q_size, kv_size).view({t, kv_heads, head_dim});
    torch::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({t, kv_heads, head_dim});
    torch::Tensor attn = paged_attention(q, k, v, k_cache[l], v_cache[l], slot_mapping, seq_offsets,
                                         prefix, prefix_offsets, local, local_offsets, causal, scale);
    h = add_rms_norm(residual, linear(attn, kMatrices * l + 1), norms[2 * l + 1], eps);
    x = linear(silu_mul(linear(h, kMatrices * l + 2)), kMatrices * l + 3);
  }
  return {x, residual};
}
