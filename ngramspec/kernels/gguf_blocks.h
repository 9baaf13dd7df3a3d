// GGUF's block layouts that the CPU kernels read in place, shared by them.
//
// Legacy types hold 32 weights a block; K-quants hold 256 in a super-block of eight 32-weight
// chunks (Q6_K: sixteen 16-weight groups, two per chunk). The kernels work chunk by chunk, so a
// chunk's 32 weights are what every type dequantises at once.
#pragma once

#include "torch_lite.h"
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>

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

inline float half_to_float(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

inline uint32_t load_u32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// A K-quant chunk's 6-bit scale and min (ggml's get_scale_min_k4), j in [0, 8).
inline void scale_min_k4(int j, const uint8_t* q, int& sc, int& m) {
  if (j < 4) {
    sc = q[j] & 63;
    m = q[j + 4] & 63;
  } else {
    sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

// The per-chunk scalars every path uses, so the scalar and vector dequantisations agree bitwise.
// Affine types give w = fma(q, d, m); Q5_0, Q8_0 and Q6_K give w = q * d (d2 for Q6_K's second
// 16 weights), as gguf-py computes them.
struct ChunkScale {
  float d, m, d2;
};

inline ChunkScale chunk_scale(int64_t qtype, const uint8_t* b, int j) {
  switch (qtype) {
    case kQ4_0: {
      const float d = half_to_float(b);
      return {d, -8.0f * d, 0.0f};
    }
    case kQ4_1:
    case kQ5_1: return {half_to_float(b), half_to_float(b + 2), 0.0f};
    case kQ4_K:
    case kQ5_K: {
      int sc, m;
      scale_min_k4(j, b + 4, sc, m);
      const float d = half_to_float(b), dmin = half_to_float(b + 2);
      return {d * static_cast<float>(sc), -(dmin * static_cast<float>(m)), 0.0f};
    }
    case kQ6_K: {
      const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
      const float d = half_to_float(b + 208);
      return {d * static_cast<float>(sc[2 * j]), 0.0f, d * static_cast<float>(sc[2 * j + 1])};
    }
    default: return {half_to_float(b), 0.0f, 0.0f};  // Q5_0, Q8_0
  }
}

// Chunk j's 32 integer levels: what dequant_chunk's vector code computes lane by lane.
inline int level(int64_t qtype, const uint8_t* b, int j, int i) {
  switch (qtype) {
    case kQ4_0: return i < 16 ? b[2 + i] & 0xF : b[2 + i - 16] >> 4;
    case kQ4_1: return i < 16 ? b[4 + i] & 0xF : b[4 + i - 16] >> 4;
    case kQ5_0:
    case kQ5_1: {
      const int off = qtype == kQ5_0 ? 2 : 4;
      const uint32_t qh = load_u32(b + off);
      const uint8_t* qs = b + off + 4;
      const int low = i < 16 ? qs[i] & 0xF : qs[i - 16] >> 4;
      return (low | (((qh >> i) & 1) << 4)) - (qtype == kQ5_0 ? 16 : 0);
    }
    case kQ8_0: return static_cast<int8_t>(b[2 + i]);
    case kQ4_K: return (b[16 + (j / 2) * 32 + i] >> (4 * (j & 1))) & 0xF;
    case kQ5_K: return ((b[48 + (j / 2) * 32 + i] >> (4 * (j & 1))) & 0xF) | (((b[16 + i] >> j) & 1) << 4);
    case kQ6_K: {
      const int s = j % 4;
      const int low = (b[(j / 4) * 64 + (s & 1) * 32 + i] >> (4 * (s >> 1))) & 0xF;
      return (low | (((b[128 + (j / 4) * 32 + i] >> (2 * s)) & 3) << 4)) - 32;
    }
    default: return 0;
  }
}

// Output rows whose blocks gguf_pack interleaves: [N / kPack][K / QK][kPack][block bytes], so a
// group of outputs is one contiguous stream. Both GGUF kernels (float32 and int8 activations) read it.
constexpr int64_t kPack = 8;

inline void check_weight(const torch::Tensor& w, int64_t qtype, int64_t K) {  // either layout
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == torch::kByte && w.dim() == 2 &&
                  w.is_contiguous(),
              "GGUF weight must be a contiguous CPU uint8 tensor [N, row_bytes]");
  const int64_t bb = block_bytes(qtype), qk = block_weights_of(qtype);
  TORCH_CHECK(K % qk == 0, "GGUF row length ", K, " is not a multiple of ", qk, " (type ", qtype, ")");
  TORCH_CHECK(w.size(1) == K / qk * bb, "GGUF weight has ", w.size(1), " bytes a row; type ", qtype,
              " with K=", K, " needs ", K / qk * bb);
}

}  // namespace ngramspec
