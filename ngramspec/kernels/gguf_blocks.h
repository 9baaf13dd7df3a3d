// GGUF's Q4_0 / Q4_1 / Q8_0 block layouts, shared by the CPU kernels.
#pragma once

#include <c10/util/Exception.h>

#include <cstdint>

namespace ngramspec {

// ggml type ids (gguf.GGMLQuantizationType)
constexpr int64_t kQ4_0 = 2;
constexpr int64_t kQ4_1 = 3;
constexpr int64_t kQ8_0 = 8;
constexpr int64_t kBlock = 32;  // weights per block, for all three types

// Bytes per block: fp16 d, [fp16 m,] then 16 bytes of nibbles (Q4) or 32 int8 (Q8_0).
constexpr int64_t block_bytes_of(int64_t qtype) {
  return qtype == kQ8_0 ? 34 : (qtype == kQ4_1 ? 20 : 18);
}
// Where a Q4 block's nibbles start (after d, and m for Q4_1).
constexpr int64_t q4_offset(int64_t qtype) { return qtype == kQ4_1 ? 4 : 2; }

inline int64_t block_bytes(int64_t qtype) {
  TORCH_CHECK(qtype == kQ4_0 || qtype == kQ4_1 || qtype == kQ8_0, "unsupported GGUF block type ",
              qtype, " (have Q4_0=2, Q4_1=3, Q8_0=8)");
  return block_bytes_of(qtype);
}

}  // namespace ngramspec
