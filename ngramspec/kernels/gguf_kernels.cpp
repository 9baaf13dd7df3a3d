// Matrix multiply and row lookup straight from GGUF's block formats (Q4_0, Q4_1, Q8_0).
//
// Why: the decode step is bound by streaming weights from memory. SmolLM2-135M's linear weights
// are 540 MB in fp32 and about 96 MB in the bundled GGUF's Q4_1/Q8_0 blocks, so reading the blocks
// as they are and dequantising in registers cuts the bytes per step by ~5.6x. torch's own int8/int4
// weight-only CPU kernels are 4-8x slower than fp32 on this CPU (docs/ARCHITECTURE.md), so we
// hand-write this one kernel.
//
// Each output is sum_k x[k] * w[k] with w dequantised to fp32 and accumulated in fp32 in a fixed
// order (16 lanes, block by block along K, then one lane reduction), whatever the number of rows,
// the tile shape or the thread that computes it: a row's result is bitwise the same alone or in a
// batch, which is what keeps speculative verification lossless against plain decoding.
//
// Layout: the matrix is packed once (GGUFLinear) into groups of 8 output rows whose blocks are
// interleaved, [N / 8][K / 32][8][block bytes] (rows zero-padded to a multiple of 8), so the
// 8-output tile that a decode runs reads one contiguous stream. Reading 8 rows' blocks from 8
// places 612 bytes apart cost 3-4x the time: the 49152-row Q8_0 lm_head of SmolLM2-135M took
// 1.3-1.6 ms on 2 threads row-major and 0.45 ms packed (same arithmetic, bitwise-equal outputs).

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include "gguf_blocks.h"
#include "vec_math.h"

namespace {

using ngramspec::block_bytes;
using ngramspec::block_bytes_of;
using ngramspec::kBlock;
using ngramspec::kQ4_0;
using ngramspec::kQ4_1;
using ngramspec::kQ8_0;
using ngramspec::q4_offset;

inline float half_to_float(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

// Scalar dequantisation of one block into 32 floats: the reference the vector path matches.
// Q4_0 is written as d*q + (-8d), the same fused form the vector path uses.
inline void dequant_block(int64_t qtype, const uint8_t* b, float* out) {
  if (qtype == kQ8_0) {
    const float d = half_to_float(b);
    const int8_t* q = reinterpret_cast<const int8_t*>(b + 2);
    for (int i = 0; i < 32; ++i) out[i] = static_cast<float>(q[i]) * d;
    return;
  }
  const float d = half_to_float(b);
  const float m = qtype == kQ4_1 ? half_to_float(b + 2) : -8.0f * d;
  const uint8_t* q = b + q4_offset(qtype);
  for (int i = 0; i < 16; ++i) {
    out[i] = std::fma(static_cast<float>(q[i] & 0x0F), d, m);
    out[i + 16] = std::fma(static_cast<float>(q[i] >> 4), d, m);
  }
}

constexpr int64_t kPack = 8;  // output rows whose blocks are interleaved (see the top)

// Where output n's first block lies in the packed layout; its block b is kPack * bb further each.
inline const uint8_t* packed_row(const uint8_t* w, int64_t row_bytes, int64_t bb, int64_t n) {
  return w + (n / kPack) * kPack * row_bytes + (n % kPack) * bb;
}

// Rows in the next tile when `left` rows remain and a tile holds at most `most`: the rows split
// evenly into as few tiles as cover them (each tile dequantises the weights again).
inline int64_t tile_rows(int64_t left, int64_t most) {
  const int64_t tiles = (left + most - 1) / most;
  return (left + tiles - 1) / tiles;
}

#if defined(__AVX512F__)

// Dequantise one block into two 16-lane vectors: elements 0..15 and 16..31.
template <int64_t Q>
inline void dequant(const uint8_t* b, __m512& lo, __m512& hi) {
  if constexpr (Q == kQ8_0) {
    const __m512 d = _mm512_set1_ps(_cvtsh_ss(*reinterpret_cast<const uint16_t*>(b)));
    const __m128i q0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 2));
    const __m128i q1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 18));
    lo = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q0)), d);
    hi = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q1)), d);
  } else {
    const float df = _cvtsh_ss(*reinterpret_cast<const uint16_t*>(b));
    const float mf = Q == kQ4_1 ? _cvtsh_ss(*reinterpret_cast<const uint16_t*>(b + 2)) : -8.0f * df;
    const __m512 d = _mm512_set1_ps(df), m = _mm512_set1_ps(mf);
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + q4_offset(Q)));
    // One zero-extension of the 16 bytes; lane i then holds element i (low nibble) and i + 16.
    const __m512i bytes = _mm512_cvtepu8_epi32(raw);
    const __m512i q0 = _mm512_and_si512(bytes, _mm512_set1_epi32(0x0F));
    const __m512i q1 = _mm512_srli_epi32(bytes, 4);
    lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q0), d, m);
    hi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q1), d, m);
  }
}

// out[MR rows, NR outputs] = x[MR, K] . w[NR, K]^T for one tile; K = nblocks * 32. In the packed
// layout output c's block b is at w + c * bb + b * kPack * bb (bb: bytes a block).
template <int64_t Q, int MR, int NR>
void tile(const float* x, int64_t ldx, const uint8_t* w, int64_t nblocks, float* out, int64_t ldo) {
  constexpr int64_t bb = block_bytes_of(Q);
  __m512 acc[MR][NR];
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < NR; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t blk = 0; blk < nblocks; ++blk) {
    __m512 xlo[MR], xhi[MR];
    for (int r = 0; r < MR; ++r) {
      xlo[r] = _mm512_loadu_ps(x + r * ldx + blk * kBlock);
      xhi[r] = _mm512_loadu_ps(x + r * ldx + blk * kBlock + 16);
    }
    for (int c = 0; c < NR; ++c) {
      __m512 wlo, whi;
      dequant<Q>(w + c * bb + blk * kPack * bb, wlo, whi);
      for (int r = 0; r < MR; ++r) {
        acc[r][c] = _mm512_fmadd_ps(xlo[r], wlo, acc[r][c]);
        acc[r][c] = _mm512_fmadd_ps(xhi[r], whi, acc[r][c]);
      }
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < NR; ++c) out[r * ldo + c] = _mm512_reduce_add_ps(acc[r][c]);
}

// Outputs [n0, n1) (n0 a multiple of 8) for all M rows: weights stream once, x stays in cache.
template <int64_t Q>
void matmul_range(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t row_bytes,
                  float* out, int64_t N, int64_t n0, int64_t n1) {
  const int64_t nblocks = K / kBlock, bb = block_bytes_of(Q);
  constexpr int NR4 = 4, NR8 = 8;
  int64_t n = n0;
  if (M == 1) {
    for (; n + NR8 <= n1; n += NR8)
      tile<Q, 1, NR8>(x, K, packed_row(w, row_bytes, bb, n), nblocks, out + n, N);
  } else {
    for (; n + NR4 <= n1; n += NR4) {
      const uint8_t* wn = packed_row(w, row_bytes, bb, n);
      // Each row tile dequantises the weights again, so the rows go in as few tiles as the
      // registers allow (5 rows x 4 outputs: 20 accumulators and 10 row vectors), evenly split.
      for (int64_t m = 0; m < M;) {
        const int64_t rows = tile_rows(M - m, 5);
        const float* xm = x + m * K;
        float* om = out + m * N + n;
        switch (rows) {
          case 5: tile<Q, 5, NR4>(xm, K, wn, nblocks, om, N); break;
          case 4: tile<Q, 4, NR4>(xm, K, wn, nblocks, om, N); break;
          case 3: tile<Q, 3, NR4>(xm, K, wn, nblocks, om, N); break;
          case 2: tile<Q, 2, NR4>(xm, K, wn, nblocks, om, N); break;
          default: tile<Q, 1, NR4>(xm, K, wn, nblocks, om, N); break;
        }
        m += rows;
      }
    }
  }
  for (; n < n1; ++n)
    for (int64_t m = 0; m < M; ++m)
      tile<Q, 1, 1>(x + m * K, K, packed_row(w, row_bytes, bb, n), nblocks, out + m * N + n, N);
}

#elif NGRAMSPEC_AVX2

// AVX2 (+FMA, F16C): the AVX-512 path's arithmetic lane for lane, each 16-lane vector held as
// two 8-lane halves (ngramspec::V16), so both paths give bitwise the same outputs. With 16
// registers instead of 32 the tiles are smaller: 4 outputs for a decode row (8 accumulators, 4
// for a dequantised block, x read from memory), up to 6 rows x 1 output for several rows (more
// spill: one 8-row tile took 1.12x two 4-row tiles on a Zen 2).
// Tried and not kept: llama.cpp's int8 activation blocks with integer block dots (maddubs +
// madd). Plain decode on a 2-core Zen 2 went 12.0 -> 8.8 ms/token, but a verify row cost more
// relative to it (q = 2: 1.39x -> 1.5-1.7x one token), greedy argmax agreement with float32 fell
// from 100% to 97.5%, and the demo's cost-sized trees kept almost no drafts.
using ngramspec::V16;

template <int64_t Q>
inline void dequant(const uint8_t* b, V16& lo, V16& hi) {
  if constexpr (Q == kQ8_0) {
    const __m256 d = _mm256_set1_ps(_cvtsh_ss(*reinterpret_cast<const uint16_t*>(b)));
    auto q8 = [&](int off) {
      const __m128i raw = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + off));
      return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(raw)), d);
    };
    lo = {q8(2), q8(10)};
    hi = {q8(18), q8(26)};
  } else {
    const float df = _cvtsh_ss(*reinterpret_cast<const uint16_t*>(b));
    const float mf = Q == kQ4_1 ? _cvtsh_ss(*reinterpret_cast<const uint16_t*>(b + 2)) : -8.0f * df;
    const __m256 d = _mm256_set1_ps(df), m = _mm256_set1_ps(mf);
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + q4_offset(Q)));
    const __m256i b0 = _mm256_cvtepu8_epi32(raw);                     // bytes 0..7
    const __m256i b1 = _mm256_cvtepu8_epi32(_mm_srli_si128(raw, 8));  // bytes 8..15
    const __m256i low = _mm256_set1_epi32(0x0F);
    auto fma = [&](__m256i q) { return _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), d, m); };
    lo = {fma(_mm256_and_si256(b0, low)), fma(_mm256_and_si256(b1, low))};
    hi = {fma(_mm256_srli_epi32(b0, 4)), fma(_mm256_srli_epi32(b1, 4))};
  }
}

template <int64_t Q, int MR, int NR>
void tile(const float* x, int64_t ldx, const uint8_t* w, int64_t nblocks, float* out, int64_t ldo) {
  constexpr int64_t bb = block_bytes_of(Q);
  V16 acc[MR][NR];
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < NR; ++c) acc[r][c] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
  for (int64_t blk = 0; blk < nblocks; ++blk) {
    for (int c = 0; c < NR; ++c) {
      V16 wlo, whi;
      dequant<Q>(w + c * bb + blk * kPack * bb, wlo, whi);
      for (int r = 0; r < MR; ++r) {
        const float* xr = x + r * ldx + blk * kBlock;
        V16& a = acc[r][c];
        a.a = _mm256_fmadd_ps(_mm256_loadu_ps(xr), wlo.a, a.a);
        a.b = _mm256_fmadd_ps(_mm256_loadu_ps(xr + 8), wlo.b, a.b);
        a.a = _mm256_fmadd_ps(_mm256_loadu_ps(xr + 16), whi.a, a.a);
        a.b = _mm256_fmadd_ps(_mm256_loadu_ps(xr + 24), whi.b, a.b);
      }
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < NR; ++c) out[r * ldo + c] = ngramspec::reduce_add16(acc[r][c]);
}

template <int64_t Q>
void matmul_range(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t row_bytes,
                  float* out, int64_t N, int64_t n0, int64_t n1) {
  const int64_t nblocks = K / kBlock, bb = block_bytes_of(Q);
  constexpr int NR = 4, kMaxRows = 6;
  int64_t n = n0;
  if (M == 1) {
    for (; n + NR <= n1; n += NR)
      tile<Q, 1, NR>(x, K, packed_row(w, row_bytes, bb, n), nblocks, out + n, N);
  } else {
    for (; n < n1; ++n) {
      const uint8_t* wn = packed_row(w, row_bytes, bb, n);
      for (int64_t m = 0; m < M;) {  // rows evenly split into as few tiles as the registers allow
        const int64_t rows = tile_rows(M - m, kMaxRows);
        const float* xm = x + m * K;
        float* om = out + m * N + n;
        switch (rows) {
          case 6: tile<Q, 6, 1>(xm, K, wn, nblocks, om, N); break;
          case 5: tile<Q, 5, 1>(xm, K, wn, nblocks, om, N); break;
          case 4: tile<Q, 4, 1>(xm, K, wn, nblocks, om, N); break;
          case 3: tile<Q, 3, 1>(xm, K, wn, nblocks, om, N); break;
          case 2: tile<Q, 2, 1>(xm, K, wn, nblocks, om, N); break;
          default: tile<Q, 1, 1>(xm, K, wn, nblocks, om, N); break;
        }
        m += rows;
      }
    }
  }
  for (; n < n1; ++n)
    tile<Q, 1, 1>(x, K, packed_row(w, row_bytes, bb, n), nblocks, out + n, N);
}

#else  // neither AVX-512 nor AVX2: portable scalar path, same accumulation shape (16 lanes, then reduce)

template <int64_t Q>
void matmul_range(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t row_bytes,
                  float* out, int64_t N, int64_t n0, int64_t n1) {
  const int64_t nblocks = K / kBlock, bb = block_bytes(Q);
  float deq[32];
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* wn = packed_row(w, row_bytes, bb, n);
    for (int64_t m = 0; m < M; ++m) {
      float lanes[16] = {0};
      for (int64_t blk = 0; blk < nblocks; ++blk) {
        dequant_block(Q, wn + blk * kPack * bb, deq);
        const float* xb = x + m * K + blk * kBlock;
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

void check_weight(const torch::Tensor& w, int64_t qtype, int64_t K) {  // either layout
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == torch::kUInt8 && w.dim() == 2 &&
                  w.is_contiguous(),
              "GGUF weight must be a contiguous CPU uint8 tensor [N, row_bytes]");
  TORCH_CHECK(K % kBlock == 0, "GGUF row length ", K, " is not a multiple of 32");
  TORCH_CHECK(w.size(1) == K / kBlock * block_bytes(qtype), "GGUF weight has ", w.size(1),
              " bytes a row; type ", qtype, " with K=", K, " needs ", K / kBlock * block_bytes(qtype));
}

}  // namespace

// GGUF blocks [N, row_bytes] -> the packed layout [ceil(N / 8) * 8, row_bytes] (see the top).
torch::Tensor gguf_pack(const torch::Tensor& w, int64_t qtype, int64_t K) {
  check_weight(w, qtype, K);
  const int64_t N = w.size(0), groups = (N + kPack - 1) / kPack, nb = K / kBlock, bb = block_bytes(qtype);
  torch::Tensor padded = torch::zeros({groups * kPack, w.size(1)}, w.options());
  padded.narrow(0, 0, N).copy_(w);
  return padded.view({groups, kPack, nb, bb}).transpose(1, 2).contiguous().view({groups * kPack, w.size(1)});
}

// x: [M, K] float32 -> [M, N] float32, with w: GGUF blocks of type qtype packed by gguf_pack.
torch::Tensor gguf_linear(const torch::Tensor& x, const torch::Tensor& w, int64_t qtype, int64_t N,
                          const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kFloat32 && x.dim() == 2,
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
    const int64_t n0 = g0 * kPack, n1 = std::min(N, g1 * kPack);
    switch (qtype) {
      case kQ4_0: matmul_range<kQ4_0>(xp, M, K, wp, row_bytes, op, N, n0, n1); break;
      case kQ4_1: matmul_range<kQ4_1>(xp, M, K, wp, row_bytes, op, N, n0, n1); break;
      case kQ8_0: matmul_range<kQ8_0>(xp, M, K, wp, row_bytes, op, N, n0, n1); break;
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
  const int64_t T = idc.size(0), V = w.size(0), nblocks = K / kBlock, bb = block_bytes(qtype);
  torch::Tensor out = torch::empty({T, K}, torch::dtype(torch::kFloat32));
  const int64_t* ip = idc.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(ip[t] >= 0 && ip[t] < V, "token id ", ip[t], " out of range [0, ", V, ")");
    const uint8_t* row = w.data_ptr<uint8_t>() + ip[t] * w.size(1);
    float* o = out.data_ptr<float>() + t * K;
    for (int64_t blk = 0; blk < nblocks; ++blk) dequant_block(qtype, row + blk * bb, o + blk * kBlock);
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
