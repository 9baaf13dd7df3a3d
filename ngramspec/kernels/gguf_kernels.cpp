// Matrix multiply and row lookup straight from GGUF's block formats (Q4_0, Q4_1, Q5_0, Q5_1,
// Q8_0, Q4_K, Q5_K, Q6_K).
//
// Why: the decode step is bound by streaming weights from memory. SmolLM2-135M's linear weights
// are 540 MB in fp32 and about 96 MB in 4-bit blocks, so reading the blocks as they are and
// dequantising in registers cuts the bytes per step by ~5.6x. torch's own int8/int4 weight-only
// CPU kernels are much slower than fp32 on CPUs (docs/ARCHITECTURE.md), so we hand-write this one.
//
// Each output is sum_k x[k] * w[k] with w dequantised to fp32 and accumulated in fp32 in one
// fixed order: 16 lanes, lane i taking k = i, i + 16, i + 32, ... (chunk by chunk along K), then
// one lane reduction. Every path below keeps that order, whatever the number of rows, the tile
// shape, the thread or the ISA tier (AVX-512 and AVX2 do the same lane arithmetic), so a row's
// result is bitwise the same alone or in a batch: what keeps speculative verification lossless.
//
// Two paths share the dequantisation (dequant_chunk):
// - a few rows (a decode, a small draft tree): each 32-weight chunk is dequantised in registers
//   and used by every row at once;
// - more rows (prefill, a larger tree, a batch): a group of 8 outputs is dequantised once into
//   an fp32 panel in cache, then a register-blocked micro-kernel (MR rows x NR outputs, each a
//   16-lane accumulator) runs every row over it. Dequantising costs several times an FMA pass,
//   so doing it once per panel rather than per row tile is what lets many rows run near the FMA
//   peak.
//
// Layout: the matrix is packed once (GGUFLinear) into groups of 8 output rows whose blocks are
// interleaved, [N / 8][K / QK][8][block bytes] (rows zero-padded to a multiple of 8), so one
// group is one contiguous stream rather than 8 strided ones.

#include "torch_lite.h"
#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "gguf_blocks.h"
#include "simd16.h"

namespace {

using namespace ngramspec;  // gguf_blocks.h's layouts

inline bool scaled_only(int64_t qtype) { return qtype == kQ5_0 || qtype == kQ8_0 || qtype == kQ6_K; }

// Chunk j (32 weights) of a block, dequantised by scalar code: the reference the vector path
// matches bitwise, the scalar tier's path, and the embedding lookup's.
inline void dequant_chunk_scalar(int64_t qtype, const uint8_t* b, int j, float* out) {
  const ChunkScale s = chunk_scale(qtype, b, j);
  for (int i = 0; i < 32; ++i) {
    const float q = static_cast<float>(level(qtype, b, j, i));
    if (scaled_only(qtype))
      out[i] = q * (qtype == kQ6_K && i >= 16 ? s.d2 : s.d);
    else
      out[i] = std::fma(q, s.d, s.m);
  }
}

#if defined(NGRAMSPEC_SIMD16)

using simd::F;
using simd::I;

// Chunk j of a block as two 16-lane vectors: weights 0..15 and 16..31.
template <int64_t Q>
inline void dequant_chunk(const uint8_t* b, int j, F& lo, F& hi) {
  if constexpr (Q == kQ4_0 || Q == kQ4_1) {
    const ChunkScale s = chunk_scale(Q, b, j);
    const F d = simd::fset1(s.d), m = simd::fset1(s.m);
    const I bytes = simd::load_u8(b + ngramspec::q4_offset(Q));  // lane i: weights i and i + 16
    lo = simd::ffma(simd::to_float(simd::iand(bytes, 0x0F)), d, m);
    hi = simd::ffma(simd::to_float(simd::isrl(bytes, 4)), d, m);
  } else if constexpr (Q == kQ5_0 || Q == kQ5_1) {
    constexpr int off = Q == kQ5_0 ? 2 : 4;
    const ChunkScale s = chunk_scale(Q, b, j);
    const I qh = simd::iset1(static_cast<int>(load_u32(b + off)));
    const I bytes = simd::load_u8(b + off + 4);
    auto high = [&](int from) { return simd::isll(simd::iand(simd::isrlv(qh, simd::iota(from)), 1), 4); };
    I qlo = simd::ior(simd::iand(bytes, 0x0F), high(0));
    I qhi = simd::ior(simd::isrl(bytes, 4), high(16));
    if constexpr (Q == kQ5_0) {
      const F d = simd::fset1(s.d);
      lo = simd::fmul(simd::to_float(simd::isub(qlo, 16)), d);
      hi = simd::fmul(simd::to_float(simd::isub(qhi, 16)), d);
    } else {
      const F d = simd::fset1(s.d), m = simd::fset1(s.m);
      lo = simd::ffma(simd::to_float(qlo), d, m);
      hi = simd::ffma(simd::to_float(qhi), d, m);
    }
  } else if constexpr (Q == kQ8_0) {
    const F d = simd::fset1(half_to_float(b));
    lo = simd::fmul(simd::to_float(simd::load_i8(b + 2)), d);
    hi = simd::fmul(simd::to_float(simd::load_i8(b + 18)), d);
  } else if constexpr (Q == kQ4_K || Q == kQ5_K) {
    const ChunkScale s = chunk_scale(Q, b, j);
    const F d = simd::fset1(s.d), m = simd::fset1(s.m);
    const uint8_t* qs = b + (Q == kQ4_K ? 16 : 48) + (j / 2) * 32;
    const int shift = 4 * (j & 1);
    I qlo = simd::iand(simd::isrl(simd::load_u8(qs), shift), 0x0F);
    I qhi = simd::iand(simd::isrl(simd::load_u8(qs + 16), shift), 0x0F);
    if constexpr (Q == kQ5_K) {
      qlo = simd::ior(qlo, simd::isll(simd::iand(simd::isrl(simd::load_u8(b + 16), j), 1), 4));
      qhi = simd::ior(qhi, simd::isll(simd::iand(simd::isrl(simd::load_u8(b + 32), j), 1), 4));
    }
    lo = simd::ffma(simd::to_float(qlo), d, m);
    hi = simd::ffma(simd::to_float(qhi), d, m);
  } else {  // Q6_K
    const ChunkScale s = chunk_scale(Q, b, j);
    const int sub = j % 4, nshift = 4 * (sub >> 1), hshift = 2 * sub;
    const uint8_t* ql = b + (j / 4) * 64 + (sub & 1) * 32;
    const uint8_t* qh = b + 128 + (j / 4) * 32;
    auto levels = [&](int at) {
      const I low = simd::iand(simd::isrl(simd::load_u8(ql + at), nshift), 0x0F);
      const I top = simd::isll(simd::iand(simd::isrl(simd::load_u8(qh + at), hshift), 3), 4);
      return simd::to_float(simd::isub(simd::ior(low, top), 32));
    };
    lo = simd::fmul(levels(0), simd::fset1(s.d));
    hi = simd::fmul(levels(16), simd::fset1(s.d2));
  }
}

// A few rows (a decode, a small draft tree): MR rows x NR outputs of one packed group, each chunk
// dequantised in registers once and used by all MR rows.
template <int64_t Q, int MR, int NR>
void fused_tile(const float* x, int64_t ldx, const uint8_t* w, int64_t nblocks, float* out, int64_t ldo,
                int64_t ncols) {
  constexpr int64_t bb = block_bytes_of(Q), qk = block_weights_of(Q), chunks = qk / kChunk;
  F acc[MR][NR];
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < NR; ++c) acc[r][c] = simd::fzero();
  for (int64_t blk = 0; blk < nblocks; ++blk) {
    for (int c = 0; c < NR; ++c) {
      const uint8_t* b = w + c * bb + blk * kPack * bb;
      for (int j = 0; j < chunks; ++j) {
        F lo, hi;
        dequant_chunk<Q>(b, j, lo, hi);
        for (int r = 0; r < MR; ++r) {
          const float* xk = x + r * ldx + blk * qk + j * kChunk;
          acc[r][c] = simd::ffma(simd::fload(xk), lo, acc[r][c]);
          acc[r][c] = simd::ffma(simd::fload(xk + 16), hi, acc[r][c]);
        }
      }
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < NR && c < ncols; ++c) out[r * ldo + c] = simd::freduce(acc[r][c]);
}

// A packed group's 8 outputs dequantised into panel [8][K] (fp32, the same values as fused_tile's).
template <int64_t Q>
void dequant_group(const uint8_t* w, int64_t nblocks, int64_t K, float* panel) {
  constexpr int64_t bb = block_bytes_of(Q), qk = block_weights_of(Q), chunks = qk / kChunk;
  for (int64_t blk = 0; blk < nblocks; ++blk)
    for (int64_t c = 0; c < kPack; ++c) {
      const uint8_t* b = w + (blk * kPack + c) * bb;
      float* o = panel + c * K + blk * qk;
      for (int j = 0; j < chunks; ++j) {
        F lo, hi;
        dequant_chunk<Q>(b, j, lo, hi);
        simd::fstore(o + j * kChunk, lo);
        simd::fstore(o + j * kChunk + 16, hi);
      }
    }
}

// out[MR rows, ncols <= NR] = x[MR, K] . panel[NR, K]^T, each sum in the 16-lane order of the
// top; accumulators are kHalves native registers each (kLanes floats), x and panel read in place.
template <int MR, int NR>
void micro(const float* x, int64_t ldx, const float* panel, int64_t K, float* out, int64_t ldo,
           int64_t ncols) {
  using simd::kHalves;
  using simd::kLanes;
  simd::Native acc[MR][NR][kHalves];
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < NR; ++c)
      for (int h = 0; h < kHalves; ++h) acc[r][c][h] = simd::nzero();
  for (int64_t k = 0; k < K; k += 16) {
    for (int h = 0; h < kHalves; ++h) {
      simd::Native wv[NR];
      for (int c = 0; c < NR; ++c) wv[c] = simd::nload(panel + c * K + k + h * kLanes);
      for (int r = 0; r < MR; ++r) {
        const simd::Native xv = simd::nload(x + r * ldx + k + h * kLanes);
        for (int c = 0; c < NR; ++c) acc[r][c][h] = simd::nfma(xv, wv[c], acc[r][c][h]);
      }
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < NR && c < ncols; ++c) out[r * ldo + c] = simd::reduce_native(acc[r][c]);
}

// Tile shapes by register count. kMR x kNR: the panel micro-kernel. kDecodeNR: one row's
// outputs. kFusedRows x kFusedNR: the most rows a fused tile takes; up to that many rows are
// cheaper fused (one dequantisation in registers) than through a panel (stores and reloads).
#if defined(__AVX512F__)
constexpr int kMR = 6, kNR = 4, kDecodeNR = 8, kFusedRows = 5, kFusedNR = 4;  // of 32 registers
#else
constexpr int kMR = 3, kNR = 2, kDecodeNR = 4, kFusedRows = 6, kFusedNR = 1;  // of 16 registers
#endif

// micro<rows, NR> for 1 <= rows <= kMR (rows is a run-time count, the tile a compile-time shape).
template <int NR, int R = kMR>
void micro_rows(int64_t rows, const float* x, int64_t ldx, const float* panel, int64_t K, float* out,
                int64_t ldo, int64_t ncols) {
  if constexpr (R > 1) {
    if (rows < R) return micro_rows<NR, R - 1>(rows, x, ldx, panel, K, out, ldo, ncols);
  }
  micro<R, NR>(x, ldx, panel, K, out, ldo, ncols);
}

// fused_tile<Q, rows, kFusedNR> for 1 <= rows <= kFusedRows.
template <int64_t Q, int R = kFusedRows>
void fused_rows(int64_t rows, const float* x, int64_t ldx, const uint8_t* w, int64_t nblocks, float* out,
                int64_t ldo, int64_t ncols) {
  if constexpr (R > 1) {
    if (rows < R) return fused_rows<Q, R - 1>(rows, x, ldx, w, nblocks, out, ldo, ncols);
  }
  fused_tile<Q, R, kFusedNR>(x, ldx, w, nblocks, out, ldo, ncols);
}

// Outputs of packed groups [g0, g1) for all M rows.
template <int64_t Q>
void matmul_groups(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t row_bytes, float* out,
                   int64_t N, int64_t g0, int64_t g1) {
  const int64_t nblocks = K / block_weights_of(Q), bb = block_bytes_of(Q);
  if (M == 1) {
    for (int64_t g = g0; g < g1; ++g)
      for (int64_t c = 0; c < kPack && g * kPack + c < N; c += kDecodeNR)
        fused_tile<Q, 1, kDecodeNR>(x, K, w + g * kPack * row_bytes + c * bb, nblocks, out + g * kPack + c,
                                    N, N - g * kPack - c);
    return;
  }
  if (M <= kFusedRows) {
    for (int64_t g = g0; g < g1; ++g)
      for (int64_t c = 0; c < kPack && g * kPack + c < N; c += kFusedNR)
        fused_rows<Q>(M, x, K, w + g * kPack * row_bytes + c * bb, nblocks, out + g * kPack + c, N,
                      N - g * kPack - c);
    return;
  }
  // Rows go in chunks whose activations stay in L2 (~256 KB) while every group of the range
  // passes over them; each group is dequantised once a chunk.
  const int64_t chunk_rows = std::max<int64_t>(kMR, (65536 / K) / kMR * kMR);
  std::vector<float> panel(static_cast<size_t>(kPack * K));
  for (int64_t m0 = 0; m0 < M; m0 += chunk_rows) {
    const int64_t m1 = std::min(M, m0 + chunk_rows);
    for (int64_t g = g0; g < g1; ++g) {
      dequant_group<Q>(w + g * kPack * row_bytes, nblocks, K, panel.data());
      const int64_t n = g * kPack, cols = std::min(kPack, N - n);
      for (int64_t m = m0; m < m1; m += kMR) {
        const int64_t rows = std::min<int64_t>(kMR, m1 - m);
        for (int64_t c = 0; c < cols; c += kNR)
          micro_rows<kNR>(rows, x + m * K, K, panel.data() + c * K, K, out + m * N + n + c, N, cols - c);
      }
    }
  }
}

#else  // neither AVX-512 nor AVX2: portable scalar path, the same accumulation order

// Where output n's first block lies in the packed layout; its block b is kPack * bb further each.
inline const uint8_t* packed_row(const uint8_t* w, int64_t row_bytes, int64_t bb, int64_t n) {
  return w + (n / kPack) * kPack * row_bytes + (n % kPack) * bb;
}

template <int64_t Q>
void matmul_groups(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t row_bytes, float* out,
                   int64_t N, int64_t g0, int64_t g1) {
  const int64_t bb = block_bytes(Q), qk = block_weights_of(Q), nblocks = K / qk;
  float deq[32];
  for (int64_t n = g0 * kPack; n < std::min(N, g1 * kPack); ++n) {
    const uint8_t* wn = packed_row(w, row_bytes, bb, n);
    for (int64_t m = 0; m < M; ++m) {
      float lanes[16] = {0};
      for (int64_t blk = 0; blk < nblocks; ++blk)
        for (int j = 0; j < qk / kChunk; ++j) {
          dequant_chunk_scalar(Q, wn + blk * kPack * bb, j, deq);
          const float* xb = x + m * K + blk * qk + j * kChunk;
          for (int i = 0; i < 16; ++i) lanes[i] = std::fma(xb[i], deq[i], lanes[i]);
          for (int i = 0; i < 16; ++i) lanes[i] = std::fma(xb[16 + i], deq[16 + i], lanes[i]);
        }
      float s = 0;
      for (int i = 0; i < 16; ++i) s += lanes[i];
      out[m * N + n] = s;
    }
  }
}

#endif

}  // namespace

// GGUF blocks [N, row_bytes] -> the packed layout [ceil(N / 8) * 8, row_bytes] (see the top).
torch::Tensor gguf_pack(const torch::Tensor& w, int64_t qtype, int64_t K) {
  check_weight(w, qtype, K);
  const int64_t N = w.size(0), groups = (N + kPack - 1) / kPack, bb = block_bytes(qtype);
  const int64_t nb = K / block_weights_of(qtype);
  torch::Tensor padded = torch::zeros({groups * kPack, w.size(1)}, w.options());
  padded.narrow(0, 0, N).copy_(w);
  return padded.view({groups, kPack, nb, bb}).transpose(1, 2).contiguous().view({groups * kPack, w.size(1)});
}

// x: [M, K] float32 -> [M, N] float32, with w: GGUF blocks of type qtype packed by gguf_pack.
torch::Tensor gguf_linear(const torch::Tensor& x, const torch::Tensor& w, int64_t qtype, int64_t N,
                          const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kFloat && x.dim() == 2,
              "gguf_linear: x must be a 2-D CPU float32 tensor");
  const int64_t M = x.size(0), K = x.size(1);
  check_weight(w, qtype, K);
  TORCH_CHECK(w.size(0) % kPack == 0 && N > w.size(0) - kPack && N <= w.size(0), "gguf_linear: ", N,
              " outputs do not fit packed weights of ", w.size(0), " rows (see gguf_pack)");
  const torch::Tensor xc = x.contiguous();
  torch::Tensor out = torch::empty({M, N}, x.options());
  if (M == 0) return out;
  const float* xp = xc.data_ptr<float>();
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  const int64_t row_bytes = w.size(1);
  // Whole packed groups per task, so every thread runs the same tile shapes.
  const int64_t groups = (N + kPack - 1) / kPack;
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    switch (qtype) {
#define NGRAMSPEC_CASE(Q) \
  case Q: matmul_groups<Q>(xp, M, K, wp, row_bytes, op, N, g0, g1); break;
      NGRAMSPEC_CASE(kQ4_0)
      NGRAMSPEC_CASE(kQ4_1)
      NGRAMSPEC_CASE(kQ5_0)
      NGRAMSPEC_CASE(kQ5_1)
      NGRAMSPEC_CASE(kQ8_0)
      NGRAMSPEC_CASE(kQ4_K)
      NGRAMSPEC_CASE(kQ5_K)
      NGRAMSPEC_CASE(kQ6_K)
#undef NGRAMSPEC_CASE
      default: break;  // rejected by check_weight
    }
  });
  if (bias.has_value() && bias->defined()) out.add_(*bias);
  return out;
}

// Rows `ids` of a GGUF matrix, dequantised: [T] int64 -> [T, K] float32 (embedding lookup).
torch::Tensor gguf_rows(const torch::Tensor& w, const torch::Tensor& ids, int64_t qtype, int64_t K) {
  check_weight(w, qtype, K);
  TORCH_CHECK(ids.scalar_type() == torch::kLong && ids.dim() == 1, "gguf_rows: ids must be 1-D int64");
  const torch::Tensor idc = ids.contiguous().cpu();
  const int64_t T = idc.size(0), V = w.size(0), bb = block_bytes(qtype), qk = block_weights_of(qtype);
  torch::Tensor out = torch::empty({T, K}, torch::dtype(torch::kFloat));
  const int64_t* ip = idc.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(ip[t] >= 0 && ip[t] < V, "token id ", ip[t], " out of range [0, ", V, ")");
    const uint8_t* row = w.data_ptr<uint8_t>() + ip[t] * w.size(1);
    float* o = out.data_ptr<float>() + t * K;
    for (int64_t blk = 0; blk < K / qk; ++blk)
      for (int j = 0; j < qk / kChunk; ++j)
        dequant_chunk_scalar(qtype, row + blk * bb, j, o + blk * qk + j * kChunk);
  }
  return out;
}

// Which vector path the kernels were compiled with for this CPU: "avx512", "avx2" or "scalar".
std::string vector_isa() {
#if defined(__AVX512F__)
  return "avx512";
#elif NGRAMSPEC_AVX2
  return "avx2";
#else
  return "scalar";
#endif
}
