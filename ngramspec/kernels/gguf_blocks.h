// GGUF's block layouts that the CPU kernels read in place, shared by them.
//
// Legacy types hold 32 weights a block; K-quants hold 256 in a super-block of eight 32-weight
// chunks (Q6_K: sixteen 16-weight groups, two per chunk). The kernels work chunk by chunk, so a
// chunk's 32 weights are what every type dequantises at once.
#pragma once

#include <c10/util/Exception.h>

#include <cstdint>

namespace ngramspec {

// ggml type ids (gguf.GGMLQuantizationType)
constexpr int64_t kQ4_0 = 2;
constexpr int64_t kQ4_1 = 3;
constexpr int64_t kQ5_0 = 6;
constexpr int64_t kQ5_1 = 7;
constexpr int64_t kQ8_0 = 8;
constexpr int64_t kQ4_K = 12;
constexpr int64_t kQ5_K = 13;
constexpr int64_t kQ6_K = 14;
constexpr int64_t kChunk = 32;  // weights dequantised at once, for every type

constexpr bool is_k_quant(int64_t qtype) { return qtype == kQ4_K || qtype == kQ5_K || qtype == kQ6_K; }

// Weights a block holds: 256 for K-quants, 32 for the rest.
constexpr int64_t block_weights_of(int64_t qtype) { return is_k_quant(qtype) ? 256 : 32; }

// Bytes a block: Q4_0 fp16 d + 16 nibble bytes; Q4_1 also fp16 m; Q5_0 d, 4 high-bit bytes, 16
// nibble bytes; Q5_1 also m; Q8_0 d + 32 int8; Q4_K d, dmin, 12 scale bytes, 128 nibble bytes;
// Q5_K the same plus 32 high-bit bytes; Q6_K 128 low-nibble, 64 high-pair, 16 int8 scales, d.
constexpr int64_t block_bytes_of(int64_t qtype) {
  switch (qtype) {
    case kQ4_0: return 18;
    case kQ4_1: return 20;
    case kQ5_0: return 22;
    case kQ5_1: return 24;
    case kQ8_0: return 34;
    case kQ4_K: return 144;
    case kQ5_K: return 176;
    case kQ6_K: return 210;
    default: return 0;
  }
}

// Where a Q4_0 / Q4_1 block's nibbles start (after d, and m for Q4_1).
constexpr int64_t q4_offset(int64_t qtype) { return qtype == kQ4_1 ? 4 : 2; }

inline int64_t block_bytes(int64_t qtype) {
  TORCH_CHECK(block_bytes_of(qtype) > 0, "unsupported GGUF block type ", qtype,
              " (have Q4_0=2, Q4_1=3, Q5_0=6, Q5_1=7, Q8_0=8, Q4_K=12, Q5_K=13, Q6_K=14)");
  return block_bytes_of(qtype);
}

}  // namespace ngramspec
