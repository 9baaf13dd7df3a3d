// Matrix multiply from GGUF blocks with int8 activations: llama.cpp's numerics, as a mode.
//
// Why: one decode row is bound by instructions, not by memory. The float32 kernel
// (gguf_kernels.cpp) widens every weight to fp32 before its FMA, ~16 instructions a 32-weight
// chunk; ggml instead quantises the activations to int8 per 32 values (scale max|x| / 127, its
// Q8_0/Q8_1) and takes each chunk's dot product in integers (maddubs, or one VNNI dpbusd),
// ~5 instructions a chunk. That changes the numbers, so it is a mode (EngineConfig.
// gguf_activations) chosen by `bench quality`, never a silent substitute.
//
// A chunk's weights are levels u with w = A * (u - offset) + B, A and B from the block
// (chunk_scale). With activations x ~ d * a:
//   sum w x = d * A * (sum u a - offset * sum a) + B * d * sum a.
// Each output's sum is formed in one fixed order whatever the number of rows, the tile or the
// thread, so a row is bitwise the same alone or in a batch and speculation stays lossless within
// this mode. AVX2, AVX-512 (256-bit ops, VNNI where present) and the scalar tier compute the same
// integers and the same float operations. Two forms, by type (each type always runs its own):
// - Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 (below, "outputs in lanes"): one exact integer sum per output
//   and chunk.
// - Q4_K, Q5_K, Q6_K ("per output"): per chunk, 8 int32 lanes (lane l: the exact
//   integer dot of k = 4l .. 4l + 3, less Q6_K's offset times the lane's activations) accumulated
//   by fma(lanes, A * d, acc) into 8 fp32 lanes, then one 8-lane reduction.
// Both add the B terms (mins, and the Q4_0 / Q5_0 offsets folded in) summed chunk by chunk.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "gguf_blocks.h"
#include "ops.h"
#include "vec_math.h"

namespace {

using namespace ngramspec;  // gguf_blocks.h's layouts

// Q6_K's levels are shifted by 32 in w = A * (u - 32): its two 16-weight halves have their own A,
// so the shift is taken off in integers, per lane. The other types fold theirs into a B term:
// Q4_0 w = A * u - 8 A, Q5_0 w = A * u - 16 A. Q8_0 is signed (no shift, no B).
constexpr int lane_offset(int64_t qtype) { return qtype == kQ6_K ? 32 : 0; }
constexpr bool has_min(int64_t qtype) { return qtype != kQ8_0 && qtype != kQ6_K; }

// M rows of activations quantised per 32-value chunk (C = K / 32 chunks a row).
struct QuantRows {
  int64_t K = 0, C = 0;
  std::vector<int8_t> q;         // [M, K]: round(x / d), |q| <= 127
  std::vector<int32_t> ncorr;    // [M, C, 8]: -offset * (q[4l] + ... + q[4l + 3]); empty if no offset
  std::vector<float> d;          // [M, C]: max|x| / 127
  std::vector<float> dsum;       // [M, C]: d * (sum of the chunk's q), for B terms

  const int8_t* qs(int64_t m, int64_t c) const { return q.data() + m * K + c * kChunk; }
  const int32_t* corr(int64_t m, int64_t c) const { return ncorr.data() + (m * C + c) * 8; }
};

// ggml's quantize_row_q8_0 rounding (x * 127 / max|x|, to nearest even), with float32 scales.
QuantRows quantize_rows(const float* x, int64_t M, int64_t K, int offset) {
  QuantRows a;
  a.K = K;
  a.C = K / kChunk;
  a.q.resize(static_cast<size_t>(M * K));
  a.ncorr.resize(offset ? static_cast<size_t>(M * a.C * 8) : 0);
  a.d.resize(static_cast<size_t>(M * a.C));
  a.dsum.resize(static_cast<size_t>(M * a.C));
  for (int64_t m = 0; m < M; ++m)
    for (int64_t c = 0; c < a.C; ++c) {
      const float* xc = x + m * K + c * kChunk;
      float amax = 0.0f;
      for (int i = 0; i < kChunk; ++i) amax = std::max(amax, std::fabs(xc[i]));
      const float d = amax / 127.0f, id = amax != 0.0f ? 127.0f / amax : 0.0f;
      int8_t* q = a.q.data() + m * K + c * kChunk;
      int sum = 0;
      for (int l = 0; l < 8; ++l) {
        int lane = 0;
        for (int i = 4 * l; i < 4 * l + 4; ++i) {
          q[i] = static_cast<int8_t>(std::nearbyint(xc[i] * id));
          lane += q[i];
        }
        if (offset) a.ncorr[(m * a.C + c) * 8 + l] = -offset * lane;
        sum += lane;
      }
      a.d[m * a.C + c] = d;
      a.dsum[m * a.C + c] = d * static_cast<float>(sum);
    }
  return a;
}

// The per-chunk float scales of output tiles: A (two for Q6_K's 16-weight halves) and B.
inline void chunk_factors(int64_t qtype, const uint8_t* b, int j, float& a_lo, float& a_hi, float& bmin) {
  const ChunkScale s = chunk_scale(qtype, b, j);
  a_lo = s.d;
  a_hi = qtype == kQ6_K ? s.d2 : s.d;
  bmin = has_min(qtype) ? s.m : 0.0f;
}

#if defined(__AVX512F__) || NGRAMSPEC_AVX2

// Chunk j's 32 unsigned levels as bytes in k order (the per-output types).
template <int64_t Q>
inline __m256i chunk_levels(const uint8_t* b, int j) {
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  if constexpr (Q == kQ4_K || Q == kQ5_K) {
    const uint8_t* qs = b + (Q == kQ4_K ? 16 : 48) + (j / 2) * 32;
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs));
    __m256i u = _mm256_and_si256(_mm256_srli_epi16(raw, 4 * (j & 1)), low4);
    if constexpr (Q == kQ5_K) {
      const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16));
      const __m256i top = _mm256_and_si256(_mm256_srli_epi16(qh, j), _mm256_set1_epi8(1));
      u = _mm256_or_si256(u, _mm256_slli_epi16(top, 4));
    }
    return u;
  } else {  // Q6_K
    const int sub = j % 4;
    const __m256i ql = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + (j / 4) * 64 + (sub & 1) * 32));
    const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + (j / 4) * 32));
    const __m256i low = _mm256_and_si256(_mm256_srli_epi16(ql, 4 * (sub >> 1)), low4);
    const __m256i top = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * sub), _mm256_set1_epi8(3));
    return _mm256_or_si256(low, _mm256_slli_epi16(top, 4));
  }
}

// acc + (lane l: sum of u[k] * a[k] over k = 4l .. 4l + 3), u unsigned, a signed. No int16
// saturation: |u| <= 128 and |a| <= 127 keep maddubs' pair sums within 32767.
inline __m256i dot_lanes(__m256i acc, __m256i u, __m256i a) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(acc, u, a);
#elif defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(acc, u, a);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, a), _mm256_set1_epi16(1)));
#endif
}

// vec_math.h's reduction order on 8 lanes (the scalar tier repeats it).
inline float reduce8(__m256 v) {
  const __m128 t = _mm_add_ps(_mm256_extractf128_ps(v, 1), _mm256_castps256_ps128(v));
  const __m128 u = _mm_add_ps(t, _mm_shuffle_ps(t, t, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm_cvtss_f32(u) + _mm_cvtss_f32(_mm_shuffle_ps(u, u, _MM_SHUFFLE(1, 1, 1, 1)));
}

// One row x NR outputs of one packed group, each chunk's levels decoded in registers.
template <int64_t Q, int NR>
void row_tile(const QuantRows& a, const uint8_t* w, float* out, int64_t ncols) {
  constexpr int64_t bb = block_bytes_of(Q), chunks = block_weights_of(Q) / kChunk;
  __m256 acc[NR];
  float mins[NR];
  for (int c = 0; c < NR; ++c) {
    acc[c] = _mm256_setzero_ps();
    mins[c] = 0.0f;
  }
  for (int64_t ch = 0; ch < a.C; ++ch) {
    const int64_t blk = ch / chunks;
    const int j = static_cast<int>(ch % chunks);
    const __m256i av = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.qs(0, ch)));
    const __m256 d = _mm256_set1_ps(a.d[ch]);
    const __m256i base = lane_offset(Q) ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.corr(0, ch)))
                                        : _mm256_setzero_si256();
    for (int c = 0; c < NR; ++c) {
      const uint8_t* b = w + (blk * kPack + c) * bb;
      float lo, hi, bmin;
      chunk_factors(Q, b, j, lo, hi, bmin);
      const __m256 scale = _mm256_set_m128(_mm_set1_ps(hi), _mm_set1_ps(lo));  // lanes 4..7: k = 16..31
      const __m256i lanes = dot_lanes(base, chunk_levels<Q>(b, j), av);
      acc[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lanes), _mm256_mul_ps(scale, d), acc[c]);
      if constexpr (has_min(Q)) mins[c] = std::fma(bmin, a.dsum[ch], mins[c]);
    }
  }
  for (int c = 0; c < NR && c < ncols; ++c) out[c] = reduce8(acc[c]) + mins[c];
}

// Tile shapes by register count: kDecodeNR outputs for one row (levels decoded in registers);
// kMR x kNR over a decoded panel for more rows.
#if defined(__AVX512F__)
constexpr int kMR = 4, kNR = 4, kDecodeNR = 8;  // of 32 registers
#else
constexpr int kMR = 4, kNR = 2, kDecodeNR = 4;  // of 16 registers
#endif

// A packed group's 8 outputs decoded once for many rows: levels as bytes and each chunk's factors.
struct Panel {
  std::vector<uint8_t> u;           // [C][8][32]
  std::vector<float> lo, hi, bmin;  // [C][8]
};

template <int64_t Q>
void decode_group(const uint8_t* w, int64_t C, Panel& p) {
  constexpr int64_t bb = block_bytes_of(Q), chunks = block_weights_of(Q) / kChunk;
  p.u.resize(static_cast<size_t>(C * kPack * kChunk));
  p.lo.resize(static_cast<size_t>(C * kPack));
  p.hi.resize(p.lo.size());
  p.bmin.resize(p.lo.size());
  for (int64_t ch = 0; ch < C; ++ch)
    for (int64_t c = 0; c < kPack; ++c) {
      const uint8_t* b = w + ((ch / chunks) * kPack + c) * bb;
      const int j = static_cast<int>(ch % chunks), at = static_cast<int>(ch * kPack + c);
      chunk_factors(Q, b, j, p.lo[at], p.hi[at], p.bmin[at]);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(p.u.data() + at * kChunk), chunk_levels<Q>(b, j));
    }
}

// MR rows x NR outputs (from output c0 of the panel): sum of the chunks' lanes times A * d, where
// sd_lo / sd_hi [rows][C][8] hold those products (the same float products row_tile() forms).
template <int64_t Q, int MR, int NR>
void panel_tile(const QuantRows& a, int64_t m0, const Panel& p, int64_t c0, const float* sd_lo,
                const float* sd_hi, float* out, int64_t ldo, int64_t ncols) {
  constexpr bool offset = lane_offset(Q) != 0;
  __m256 acc[MR][NR];
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < NR; ++c) acc[r][c] = _mm256_setzero_ps();
  for (int64_t ch = 0; ch < a.C; ++ch) {
    __m256i u[NR];
    for (int c = 0; c < NR; ++c)
      u[c] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p.u.data() + (ch * kPack + c0 + c) * kChunk));
    for (int r = 0; r < MR; ++r) {
      const __m256i av = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.qs(m0 + r, ch)));
      const __m256i base = offset ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.corr(m0 + r, ch)))
                                  : _mm256_setzero_si256();
      const int64_t at = (r * a.C + ch) * kPack + c0;
      for (int c = 0; c < NR; ++c) {
        const __m256 s = Q == kQ6_K
                             ? _mm256_set_m128(_mm_broadcast_ss(sd_hi + at + c), _mm_broadcast_ss(sd_lo + at + c))
                             : _mm256_broadcast_ss(sd_lo + at + c);
        acc[r][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_lanes(base, u[c], av)), s, acc[r][c]);
      }
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < NR && c < ncols; ++c) out[r * ldo + c] = reduce8(acc[r][c]);
}

// panel_tile<Q, rows, kNR> for 1 <= rows <= kMR.
template <int64_t Q, int R = kMR>
void panel_rows(int64_t rows, const QuantRows& a, int64_t m0, const Panel& p, int64_t c0, const float* sd_lo,
                const float* sd_hi, float* out, int64_t ldo, int64_t ncols) {
  if constexpr (R > 1) {
    if (rows < R) return panel_rows<Q, R - 1>(rows, a, m0, p, c0, sd_lo, sd_hi, out, ldo, ncols);
  }
  panel_tile<Q, R, kNR>(a, m0, p, c0, sd_lo, sd_hi, out, ldo, ncols);
}

// Rows [m0, m1) x the 8 outputs of a decoded panel, into out (row stride ldo, `cols` outputs).
template <int64_t Q>
void panel_rows_range(const QuantRows& a, int64_t m0, int64_t m1, const Panel& p, std::vector<float>& sd_lo,
                      std::vector<float>& sd_hi, float* out, int64_t ldo, int64_t cols) {
  const int64_t C = a.C, rows = m1 - m0;
  sd_lo.resize(static_cast<size_t>(rows * C * kPack));
  sd_hi.resize(Q == kQ6_K ? sd_lo.size() : 0);
  for (int64_t r = 0; r < rows; ++r)  // A * d for all 8 outputs at once
    for (int64_t ch = 0; ch < C; ++ch) {
      const __m256 d = _mm256_set1_ps(a.d[(m0 + r) * C + ch]);
      const int64_t at = (r * C + ch) * kPack;
      _mm256_storeu_ps(sd_lo.data() + at, _mm256_mul_ps(_mm256_loadu_ps(p.lo.data() + ch * kPack), d));
      if constexpr (Q == kQ6_K)
        _mm256_storeu_ps(sd_hi.data() + at, _mm256_mul_ps(_mm256_loadu_ps(p.hi.data() + ch * kPack), d));
    }
  for (int64_t m = m0; m < m1; m += kMR)
    for (int64_t c = 0; c < cols; c += kNR)
      panel_rows<Q>(std::min<int64_t>(kMR, m1 - m), a, m, p, c, sd_lo.data() + (m - m0) * C * kPack,
                    sd_hi.data() + (Q == kQ6_K ? (m - m0) * C * kPack : 0), out + (m - m0) * ldo + c, ldo,
                    cols - c);
  if constexpr (has_min(Q)) {  // the B terms, chunk by chunk for all 8 outputs at once
    float mins[kPack];
    for (int64_t r = 0; r < rows; ++r) {
      __m256 mv = _mm256_setzero_ps();
      for (int64_t ch = 0; ch < C; ++ch)
        mv = _mm256_fmadd_ps(_mm256_loadu_ps(p.bmin.data() + ch * kPack), _mm256_set1_ps(a.dsum[(m0 + r) * C + ch]),
                             mv);
      _mm256_storeu_ps(mins, mv);
      for (int64_t c = 0; c < cols; ++c) out[r * ldo + c] += mins[c];
    }
  }
}

// Outputs of packed groups [g0, g1) for all rows of `a`.
template <int64_t Q>
void matmul_groups(const QuantRows& a, int64_t M, const uint8_t* w, int64_t row_bytes, float* out, int64_t N,
                   int64_t g0, int64_t g1) {
  const int64_t bb = block_bytes_of(Q);
  if (M == 1) {
    for (int64_t g = g0; g < g1; ++g)
      for (int64_t c = 0; c < kPack && g * kPack + c < N; c += kDecodeNR)
        row_tile<Q, kDecodeNR>(a, w + g * kPack * row_bytes + c * bb, out + g * kPack + c, N - g * kPack - c);
    return;
  }
  // Rows go in chunks whose activations (~2 bytes a value with the lane sums) and scale products
  // stay in L2 while every group of the range passes over them; each group is decoded once a chunk.
  const int64_t chunk_rows = std::max<int64_t>(kMR, (131072 / (2 * a.K)) / kMR * kMR);
  Panel panel;
  std::vector<float> sd_lo, sd_hi;
  for (int64_t m0 = 0; m0 < M; m0 += chunk_rows) {
    const int64_t m1 = std::min(M, m0 + chunk_rows);
    for (int64_t g = g0; g < g1; ++g) {
      decode_group<Q>(w + g * kPack * row_bytes, a.C, panel);
      panel_rows_range<Q>(a, m0, m1, panel, sd_lo, sd_hi, out + m0 * N + g * kPack, N,
                          std::min(kPack, N - g * kPack));
    }
  }
}

#else  // no vector path: the same integers and float operations, lane by lane

// u of chunk j's weight i (level() folds Q6_K's shift in).
inline int unsigned_level(int64_t qtype, const uint8_t* b, int j, int i) {
  return level(qtype, b, j, i) + (qtype == kQ6_K ? 32 : 0);
}

template <int64_t Q>
void matmul_groups(const QuantRows& a, int64_t M, const uint8_t* w, int64_t row_bytes, float* out, int64_t N,
                   int64_t g0, int64_t g1) {
  constexpr int64_t bb = block_bytes_of(Q), chunks = block_weights_of(Q) / kChunk;
  for (int64_t n = g0 * kPack; n < std::min(N, g1 * kPack); ++n) {
    const uint8_t* wn = w + (n / kPack) * kPack * row_bytes + (n % kPack) * bb;
    for (int64_t m = 0; m < M; ++m) {
      float acc[8] = {0}, mins = 0.0f;
      for (int64_t ch = 0; ch < a.C; ++ch) {
        const uint8_t* b = wn + (ch / chunks) * kPack * bb;
        const int j = static_cast<int>(ch % chunks);
        float lo, hi, bmin;
        chunk_factors(Q, b, j, lo, hi, bmin);
        const int8_t* q = a.qs(m, ch);
        const float d = a.d[m * a.C + ch];
        for (int l = 0; l < 8; ++l) {
          int32_t lane = lane_offset(Q) ? a.corr(m, ch)[l] : 0;
          for (int i = 4 * l; i < 4 * l + 4; ++i) lane += unsigned_level(Q, b, j, i) * q[i];
          acc[l] = std::fma(static_cast<float>(lane), (l < 4 ? lo : hi) * d, acc[l]);
        }
        if (has_min(Q)) mins = std::fma(bmin, a.dsum[m * a.C + ch], mins);
      }
      float t[4], u[2];
      for (int i = 0; i < 4; ++i) t[i] = acc[i + 4] + acc[i];
      for (int i = 0; i < 2; ++i) u[i] = t[i] + t[i + 2];
      out[m * N + n] = (u[0] + u[1]) + mins;
    }
  }
}

#endif


// ------------------------------------------------ outputs in lanes (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0)
//
// The legacy 32-weight types run a second formulation, ggml's repacked "8 outputs x 4 weights"
// one: a group's 8 outputs lie in a register's 8 int32 lanes, each lane the dot of 4 weights
// with the same 4 activations (broadcast), so a 32-weight chunk is 8 such steps for all 8
// outputs at once and no lane reduction is left. Per output, per chunk: one exact integer sum,
// then acc = fma(sum, A * d, acc) and mins = fma(B, d * sum a, mins); out = acc + mins. A
// chunk costs about a third of the instructions of the per-output form. Packed once
// (gguf_pack_int8): per group and chunk, register r's 32 bytes [output o][4 weights] hold the
// levels of k = 4r .. 4r + 3 (Q8_0: 8 registers of signed bytes; the 4- and 5-bit types: 4
// registers of bytes with r = 0..3 in the low nibble and r + 4 in the high one, then for Q5 a
// 32-byte plane whose byte o * 4 + i has bit r = the fifth bit of register r's byte), then fp16
// A[8] (and B[8] for Q4_1 / Q5_1), the block's own half floats. Same bytes as the blocks.

constexpr bool lanes_type(int64_t qtype) {
  return qtype == kQ4_0 || qtype == kQ4_1 || qtype == kQ5_0 || qtype == kQ5_1 || qtype == kQ8_0;
}
constexpr bool five_bit(int64_t qtype) { return qtype == kQ5_0 || qtype == kQ5_1; }
constexpr bool half_min(int64_t qtype) { return qtype == kQ4_1 || qtype == kQ5_1; }  // B stored
constexpr int64_t lanes_plane(int64_t qtype) { return qtype == kQ8_0 ? 256 : five_bit(qtype) ? 160 : 128; }
constexpr int64_t lanes_bytes(int64_t qtype) {  // a group's chunk
  return lanes_plane(qtype) + 16 + (half_min(qtype) ? 16 : 0);
}
// Q4_0's and Q5_0's B, as a multiple of A (exact in float).
constexpr float lanes_shift(int64_t qtype) { return qtype == kQ5_0 ? -16.0f : -8.0f; }

#if defined(__AVX512F__) || NGRAMSPEC_AVX2

// One chunk's exact integer sums for a group's 8 outputs: registers lv[8] of levels against
// row aq's 32 activations, 4 at a time broadcast. Without VNNI, maddubs' int16 pair sums of
// several registers are added in int16 before one madd: a pair is at most 2 * 127 * (15 for
// Q4, 31 for Q5), so 8 (Q4) or 4 (Q5) of them stay within 32767 and the sum is still exact.
template <int64_t Q>
inline __m256i chunk_dot(const __m256i* lv, const int8_t* aq) {
  const auto act = [aq](int q) {
    return _mm256_set1_epi32(static_cast<int>(load_u32(reinterpret_cast<const uint8_t*>(aq + 4 * q))));
  };
  __m256i isum = _mm256_setzero_si256();
#if (defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__)
  for (int q = 0; q < 8; ++q) {
    if constexpr (Q == kQ8_0)
      isum = dot_lanes(isum, _mm256_sign_epi8(lv[q], lv[q]), _mm256_sign_epi8(act(q), lv[q]));
    else
      isum = dot_lanes(isum, lv[q], act(q));
  }
#else
  constexpr int per_madd = Q == kQ8_0 ? 1 : five_bit(Q) ? 4 : 8;
  for (int q0 = 0; q0 < 8; q0 += per_madd) {
    __m256i pairs = _mm256_setzero_si256();
    for (int q = q0; q < q0 + per_madd; ++q) {
      const __m256i p = Q == kQ8_0 ? _mm256_maddubs_epi16(_mm256_sign_epi8(lv[q], lv[q]), _mm256_sign_epi8(act(q), lv[q]))
                                   : _mm256_maddubs_epi16(lv[q], act(q));
      pairs = _mm256_add_epi16(pairs, p);
    }
    isum = _mm256_add_epi32(isum, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
  }
#endif
  return isum;
}

// MR rows x the 8 outputs of one group (`gp`: its C chunks of lanes_bytes).
template <int64_t Q, int MR>
void lanes_tile(const QuantRows& a, int64_t m0, int64_t rows, const uint8_t* gp, float* out, int64_t ldo,
                int64_t ncols) {
  constexpr int64_t plane = lanes_plane(Q), stride = lanes_bytes(Q);
  __m256 acc[MR], mins[MR];
  for (int r = 0; r < MR; ++r) acc[r] = mins[r] = _mm256_setzero_ps();
  for (int64_t ch = 0; ch < a.C; ++ch) {
    const uint8_t* p = gp + ch * stride;
    __m256i lv[8];
    if constexpr (Q == kQ8_0) {
      for (int q = 0; q < 8; ++q) lv[q] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32 * q));
    } else {
      const __m256i low4 = _mm256_set1_epi8(0x0F);
      for (int q = 0; q < 4; ++q) {
        const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32 * q));
        lv[q] = _mm256_and_si256(raw, low4);
        lv[q + 4] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4);
      }
      if constexpr (five_bit(Q)) {  // bit r of the plane's bytes to bit 4 of register r's
        const __m256i hb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 128));
        const __m256i bit4 = _mm256_set1_epi8(0x10);
        for (int r = 0; r < 8; ++r) {  // 16-bit shifts by <= 4 keep each byte's bit 4 its own
          const __m256i at4 = r <= 4 ? _mm256_slli_epi16(hb, 4 - r) : _mm256_srli_epi16(hb, r - 4);
          lv[r] = _mm256_or_si256(lv[r], _mm256_and_si256(at4, bit4));
        }
      }
    }
    const __m256 A = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + plane)));
    __m256 B = _mm256_setzero_ps();
    if constexpr (half_min(Q)) B = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + plane + 16)));
    if constexpr (Q == kQ4_0 || Q == kQ5_0) B = _mm256_mul_ps(A, _mm256_set1_ps(lanes_shift(Q)));
    for (int r = 0; r < MR && r < rows; ++r) {
      const __m256i isum = chunk_dot<Q>(lv, a.qs(m0 + r, ch));
      const float d = a.d[(m0 + r) * a.C + ch];
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(A, _mm256_set1_ps(d)), acc[r]);
      if constexpr (has_min(Q))
        mins[r] = _mm256_fmadd_ps(B, _mm256_set1_ps(a.dsum[(m0 + r) * a.C + ch]), mins[r]);
    }
  }
  for (int r = 0; r < MR && r < rows; ++r) {
    float v[8];
    _mm256_storeu_ps(v, _mm256_add_ps(acc[r], mins[r]));
    for (int c = 0; c < ncols && c < 8; ++c) out[r * ldo + c] = v[c];
  }
}

#if defined(__AVX512F__)
constexpr int kLanesMR = 8;  // of 32 registers (8 hold the levels)
#else
constexpr int kLanesMR = 2;  // of 16 registers
#endif

template <int64_t Q>
void lanes_groups(const QuantRows& a, int64_t M, const uint8_t* w, float* out, int64_t N, int64_t g0, int64_t g1) {
  const int64_t group_bytes = a.C * lanes_bytes(Q);
  for (int64_t g = g0; g < g1; ++g)
    for (int64_t m = 0; m < M; m += kLanesMR) {
      const int64_t rows = std::min<int64_t>(kLanesMR, M - m);
      if (rows == 1)
        lanes_tile<Q, 1>(a, m, 1, w + g * group_bytes, out + m * N + g * kPack, N, N - g * kPack);
      else
        lanes_tile<Q, kLanesMR>(a, m, rows, w + g * group_bytes, out + m * N + g * kPack, N, N - g * kPack);
    }
}

#else  // the same integer sums and float operations, output by output

template <int64_t Q>
void lanes_groups(const QuantRows& a, int64_t M, const uint8_t* w, float* out, int64_t N, int64_t g0, int64_t g1) {
  constexpr int64_t plane = lanes_plane(Q), stride = lanes_bytes(Q);
  for (int64_t g = g0; g < g1; ++g)
    for (int64_t m = 0; m < M; ++m)
      for (int64_t o = 0; o < kPack && g * kPack + o < N; ++o) {
        float acc = 0.0f, mins = 0.0f;
        for (int64_t ch = 0; ch < a.C; ++ch) {
          const uint8_t* p = w + g * a.C * stride + ch * stride;
          const int8_t* aq = a.qs(m, ch);
          int32_t isum = 0;
          for (int k = 0; k < kChunk; ++k) {
            const int q = k / 4, b = k % 4;
            int level;
            if (Q == kQ8_0)
              level = static_cast<int8_t>(p[(q * kPack + o) * 4 + b]);
            else
              level = (p[((q % 4) * kPack + o) * 4 + b] >> (q < 4 ? 0 : 4)) & 0xF;
            if (five_bit(Q)) level |= ((p[128 + o * 4 + b] >> q) & 1) << 4;
            isum += level * aq[k];
          }
          const float A = half_to_float(p + plane + 2 * o);
          const float B = half_min(Q) ? half_to_float(p + plane + 16 + 2 * o) : lanes_shift(Q) * A;
          acc = std::fma(static_cast<float>(isum), A * a.d[m * a.C + ch], acc);
          if (has_min(Q)) mins = std::fma(B, a.dsum[m * a.C + ch], mins);
        }
        out[m * N + g * kPack + o] = acc + mins;
      }
}

#endif

}  // namespace

// GGUF blocks [N, row_bytes] of a type that runs outputs in lanes (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0)
// -> that layout, [ceil(N / 8), K / 32 * lanes_bytes] (see above); other types -> gguf_pack's.
torch::Tensor gguf_pack_int8(const torch::Tensor& w, int64_t qtype, int64_t K) {
  if (!lanes_type(qtype)) return gguf_pack(w, qtype, K);
  check_weight(w, qtype, K);
  const int64_t N = w.size(0), groups = (N + kPack - 1) / kPack, C = K / kChunk, bb = block_bytes_of(qtype);
  const int64_t plane = lanes_plane(qtype), stride = lanes_bytes(qtype);
  // Where a block's nibbles start: after d (and m), and for Q5 the 32 fifth bits qh.
  const int nib = (half_min(qtype) ? 4 : 2) + (five_bit(qtype) ? 4 : 0);
  torch::Tensor out = torch::zeros({groups, C * stride}, w.options());
  const uint8_t* src = w.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  for (int64_t n = 0; n < N; ++n) {
    const int64_t g = n / kPack, o = n % kPack;
    for (int64_t ch = 0; ch < C; ++ch) {
      const uint8_t* b = src + n * w.size(1) + ch * bb;
      uint8_t* p = dst + g * C * stride + ch * stride;
      for (int k = 0; k < kChunk; ++k) {
        const int q = k / 4, i = k % 4;
        if (qtype == kQ8_0)
          p[(q * kPack + o) * 4 + i] = b[2 + k];
        else if (k < 16)  // byte k holds levels k (low nibble) and k + 16 (high), as in the block
          p[(q * kPack + o) * 4 + i] = b[nib + k];
        if (five_bit(qtype))  // register q = k / 4's fifth bit, from qh's bit k
          p[128 + o * 4 + i] |= static_cast<uint8_t>(((load_u32(b + nib - 4) >> k) & 1) << q);
      }
      std::memcpy(p + plane + 2 * o, b, 2);                                   // A: d
      if (half_min(qtype)) std::memcpy(p + plane + 16 + 2 * o, b + 2, 2);  // B: m
    }
  }
  return out;
}

// x: [M, K] float32 -> [M, N] float32, with w: GGUF blocks of type qtype packed by
// gguf_pack_int8; x is quantised to int8 per 32 values first (see the top).
torch::Tensor gguf_linear_int8(const torch::Tensor& x, const torch::Tensor& w, int64_t qtype, int64_t N,
                               const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kFloat32 && x.dim() == 2,
              "gguf_linear_int8: x must be a 2-D CPU float32 tensor");
  const int64_t M = x.size(0), K = x.size(1);
  block_bytes(qtype);  // names an unknown type
  TORCH_CHECK(K % block_weights_of(qtype) == 0, "GGUF row length ", K, " is not a multiple of ",
              block_weights_of(qtype), " (type ", qtype, ")");
  if (lanes_type(qtype)) {
    TORCH_CHECK(w.dim() == 2 && w.size(1) == K / kChunk * lanes_bytes(qtype) && N > (w.size(0) - 1) * kPack &&
                    N <= w.size(0) * kPack,
                "gguf_linear_int8: weights of shape ", w.sizes(), " are not ", N, " outputs of ", K,
                " inputs packed by gguf_pack_int8");
  } else {
    check_weight(w, qtype, K);
    TORCH_CHECK(w.size(0) % kPack == 0 && N > w.size(0) - kPack && N <= w.size(0), "gguf_linear_int8: ", N,
                " outputs do not fit packed weights of ", w.size(0), " rows (see gguf_pack)");
  }
  torch::Tensor out = torch::empty({M, N}, x.options());
  if (M == 0) return out;
  const torch::Tensor xc = x.contiguous();
  const QuantRows a = quantize_rows(xc.data_ptr<float>(), M, K, lane_offset(qtype));
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  const int64_t row_bytes = w.size(1), groups = (N + kPack - 1) / kPack;
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    switch (qtype) {
      case kQ4_0: lanes_groups<kQ4_0>(a, M, wp, op, N, g0, g1); break;
      case kQ4_1: lanes_groups<kQ4_1>(a, M, wp, op, N, g0, g1); break;
      case kQ5_0: lanes_groups<kQ5_0>(a, M, wp, op, N, g0, g1); break;
      case kQ5_1: lanes_groups<kQ5_1>(a, M, wp, op, N, g0, g1); break;
      case kQ8_0: lanes_groups<kQ8_0>(a, M, wp, op, N, g0, g1); break;
#define NGRAMSPEC_CASE(Q) \
  case Q: matmul_groups<Q>(a, M, wp, row_bytes, op, N, g0, g1); break;
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
