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
// batch, which is what keeps speculative verification lossless against plain decoding. (On a CPU
// with AVX2 but no AVX-512 the activations are int8 blocks instead; see the AVX2 section.)
//
// Layout: the matrix is packed once (GGUFLinear) into groups of 8 output rows whose blocks are
// interleaved, [N / 8][K / 32][8][block bytes] (rows zero-padded to a multiple of 8), so the
// 8-output tile that a decode runs reads one contiguous stream. Reading 8 rows' blocks from 8
// places 612 bytes apart cost 3-4x the time: the 49152-row Q8_0 lm_head of SmolLM2-135M took
// 1.3-1.6 ms on 2 threads row-major and 0.45 ms packed (same arithmetic, bitwise-equal outputs).

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

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
        const int64_t tiles = (M - m + 4) / 5, rows = (M - m + tiles - 1) / tiles;
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

// AVX2 (+FMA, F16C; e.g. AMD Zen 2/3): activations quantised to int8 per 32-element block, as
// llama.cpp's CPU path does for these weight types, and integer block dot products
// (maddubs + madd). Why: dequantising every weight to fp32 costs ~27 vector ops a block, which
// kept a decode row at ~2.5x the memory-bound time on a Zen 2; the integer dot is ~12. It
// changes the numbers against fp32 activations (each x block rounded to 8 bits, as llama.cpp
// rounds it), not the row invariance: every row is quantised alone and each output's sum runs
// in one fixed order (8 lanes block by block, then one reduction, then the Q4_1 min terms).

// Rows of x as int8 blocks: q[M][K] with, per (row, block), scale d and d * sum(q).
struct Q8Rows {
  std::vector<int8_t> q;
  std::vector<float> d, s;
  int64_t nblocks;
};

Q8Rows quantize_rows(const float* x, int64_t M, int64_t K) {
  const int64_t nb = K / kBlock;
  Q8Rows r{std::vector<int8_t>(M * K), std::vector<float>(M * nb), std::vector<float>(M * nb), nb};
  for (int64_t i = 0; i < M * nb; ++i) {
    const float* xb = x + i * kBlock;
    float amax = 0.0f;
    for (int k = 0; k < kBlock; ++k) amax = std::max(amax, std::fabs(xb[k]));
    const float d = amax / 127.0f, id = amax > 0.0f ? 127.0f / amax : 0.0f;
    int sum = 0;
    for (int k = 0; k < kBlock; ++k) {
      const int v = static_cast<int>(std::nearbyint(xb[k] * id));  // |v| <= 127
      r.q[i * kBlock + k] = static_cast<int8_t>(v);
      sum += v;
    }
    r.d[i] = d;
    r.s[i] = d * static_cast<float>(sum);
  }
  return r;
}

// One weight block's 32 values as bytes in element order: unsigned nibbles (Q4_1), or signed
// (Q4_0: q - 8; Q8_0: q).
template <int64_t Q>
inline __m256i weight_bytes(const uint8_t* b) {
  if constexpr (Q == kQ8_0) return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 2));
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + q4_offset(Q)));
  const __m128i low = _mm_set1_epi8(0x0F);
  const __m256i q = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), low), _mm_and_si128(raw, low));
  if constexpr (Q == kQ4_0) return _mm256_sub_epi8(q, _mm256_set1_epi8(8));
  return q;
}

// sum_k w[k] * x[k] of one block as 8 int32 lanes (pairs of pairs), x signed bytes in [-127, 127].
template <int64_t Q>
inline __m256i block_dot(__m256i w, __m256i x) {
  __m256i p;
  if constexpr (Q == kQ4_1) {
    p = _mm256_maddubs_epi16(w, x);  // w in [0, 15]: no saturation
  } else {  // signed w: |w| times x with w's sign (|w| <= 128, so pairs stay below 2^15)
    p = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
  }
  return _mm256_madd_epi16(p, _mm256_set1_epi16(1));
}

inline float reduce_add8(__m256 v) {
  const __m128 h = _mm_add_ps(_mm256_extractf128_ps(v, 1), _mm256_castps256_ps128(v));
  const __m128 q = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(q, _mm_shuffle_ps(q, q, 1)));
}

// out[MR rows, NR outputs] for one tile; the packed layout as on the AVX-512 path.
template <int64_t Q, int MR, int NR>
void tile(const Q8Rows& x, int64_t m0, const uint8_t* w, int64_t nblocks, float* out, int64_t ldo) {
  constexpr int64_t bb = block_bytes_of(Q);
  __m256 acc[MR][NR];
  float mins[MR][NR];  // Q4_1: sum over blocks of m * d_x * sum(q_x)
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < NR; ++c) {
      acc[r][c] = _mm256_setzero_ps();
      mins[r][c] = 0.0f;
    }
  for (int64_t blk = 0; blk < nblocks; ++blk) {
    for (int c = 0; c < NR; ++c) {
      const uint8_t* b = w + c * bb + blk * kPack * bb;
      const __m256i wq = weight_bytes<Q>(b);
      const float dw = _cvtsh_ss(*reinterpret_cast<const uint16_t*>(b));
      for (int r = 0; r < MR; ++r) {
        const int64_t xb = (m0 + r) * nblocks + blk;
        const __m256i xq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.q.data() + xb * kBlock));
        const __m256 dot = _mm256_cvtepi32_ps(block_dot<Q>(wq, xq));
        acc[r][c] = _mm256_fmadd_ps(dot, _mm256_set1_ps(dw * x.d[xb]), acc[r][c]);
        if constexpr (Q == kQ4_1)
          mins[r][c] = std::fma(_cvtsh_ss(*reinterpret_cast<const uint16_t*>(b + 2)), x.s[xb], mins[r][c]);
      }
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < NR; ++c) out[r * ldo + c] = reduce_add8(acc[r][c]) + mins[r][c];
}

template <int64_t Q>
void matmul_range(const Q8Rows& x, int64_t M, int64_t K, const uint8_t* w, int64_t row_bytes,
                  float* out, int64_t N, int64_t n0, int64_t n1) {
  const int64_t nblocks = K / kBlock, bb = block_bytes_of(Q);
  constexpr int NR = 8, kMaxRows = 6;
  int64_t n = n0;
  if (M == 1) {
    for (; n + NR <= n1; n += NR)
      tile<Q, 1, NR>(x, 0, packed_row(w, row_bytes, bb, n), nblocks, out + n, N);
  } else {
    for (; n < n1; ++n) {
      const uint8_t* wn = packed_row(w, row_bytes, bb, n);
      for (int64_t m = 0; m < M;) {  // rows evenly split into as few tiles as the registers allow
        const int64_t tiles = (M - m + kMaxRows - 1) / kMaxRows, rows = (M - m + tiles - 1) / tiles;
        float* om = out + m * N + n;
        switch (rows) {
          case 6: tile<Q, 6, 1>(x, m, wn, nblocks, om, N); break;
          case 5: tile<Q, 5, 1>(x, m, wn, nblocks, om, N); break;
          case 4: tile<Q, 4, 1>(x, m, wn, nblocks, om, N); break;
          case 3: tile<Q, 3, 1>(x, m, wn, nblocks, om, N); break;
          case 2: tile<Q, 2, 1>(x, m, wn, nblocks, om, N); break;
          default: tile<Q, 1, 1>(x, m, wn, nblocks, om, N); break;
        }
        m += rows;
      }
    }
  }
  for (; n < n1; ++n) tile<Q, 1, 1>(x, 0, packed_row(w, row_bytes, bb, n), nblocks, out + n, N);
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
#if NGRAMSPEC_AVX2
  const Q8Rows xp = quantize_rows(xc.data_ptr<float>(), M, K);
#else
  const float* xp = xc.data_ptr<float>();
#endif
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
