// Matrix multiply from GGUF blocks with int8 activations: llama.cpp's numerics, as a mode.
//
// Why: one decode row is bound by instructions, not by memory. The float32 kernel
// (gguf_kernels.cpp) widens every weight to fp32 before its FMA, ~16 instructions a 32-weight
// chunk; ggml instead quantises the activations to int8 per 32 values (scale max|x| / 127, its
// Q8_0/Q8_1) and takes each chunk's dot product in integers (maddubs, or one VNNI dpbusd),
// ~5 instructions a chunk. That changes the numbers, so it is a mode (EngineConfig.
// gguf_activations) chosen by `bench quality`, never a silent substitute.
//
// A chunk's weights are levels u with w = A * u + B (Q6_K: A * (u - 32) per 16-weight half,
// Q8_0: w = A * u, u signed). With activations x ~ d * a:
//   sum w x = d * A * (sum u a) + B * d * sum a.
// Every type runs ggml's repacked "8 outputs x 4 weights" form: a group's 8 outputs lie in a
// register's 8 int32 lanes, each lane the dot of 4 weights with the same 4 activations
// (broadcast), so a 32-weight chunk is 8 such steps for all 8 outputs at once and no lane
// reduction is left. Per output, per chunk: one exact integer sum (Q6_K: one a half, less 32
// times the half's activations), then acc = fma(sum, A * d, acc) and mins = fma(B, d * sum a,
// mins); out = acc + mins. Each output's sum is formed in this one order whatever the number of
// rows, the tile or the thread, so a row is bitwise the same alone or in a batch and speculation
// stays lossless within this mode. AVX2, AVX-512 (256-bit ops, VNNI where present) and the
// scalar tier compute the same integers and the same float operations.
//
// Packed once (gguf_pack_int8), per group of 8 outputs, a record per chunk: register r's 32
// bytes [output o][4 weights] hold the levels of k = 4r .. 4r + 3.
// - Q8_0: 8 registers of signed bytes. The others: unsigned levels as 4 registers of nibbles
//   (r = 0..3 low, r + 4 high), then a 32-byte plane per level bit above 4 (Q5_*: bit 4; Q6_K:
//   bits 4 and 5) whose byte o * 4 + i holds register r's bit in its bit r.
// - Then the factors. Legacy types: fp16 A[8] (and B[8] for Q4_1 / Q5_1), the blocks' own
//   halves. K-quants: sc[8], m[8] bytes (Q6_K: the halves' int8 scales), and before each
//   super-block's 8 records its fp16 d[8] (and dmin[8]): A = d * sc, B = -(dmin * m), the
//   products chunk_scale() forms.
// That is about the blocks' own bytes (Q4_K 148 a record against 8 x 18).

#include "torch_lite.h"
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

// Q4_0 and Q5_0 fold their level shift into B = shift * A (exact in float); Q6_K takes its 32 off
// in integers; Q8_0 and Q6_K have no B.
constexpr bool has_min(int64_t qtype) { return qtype != kQ8_0 && qtype != kQ6_K; }
constexpr bool half_min(int64_t qtype) { return qtype == kQ4_1 || qtype == kQ5_1; }  // B stored
constexpr float level_shift(int64_t qtype) { return qtype == kQ5_0 ? -16.0f : -8.0f; }  // Q4_0, Q5_0
constexpr int unsigned_offset(int64_t qtype) {  // level() of gguf_blocks.h -> u
  return qtype == kQ5_0 ? 16 : qtype == kQ6_K ? 32 : 0;
}

// The packed layout (see the top).
constexpr int high_bits(int64_t qtype) {
  return qtype == kQ6_K ? 2 : (qtype == kQ5_0 || qtype == kQ5_1 || qtype == kQ5_K) ? 1 : 0;
}
constexpr int64_t level_bytes(int64_t qtype) { return qtype == kQ8_0 ? 256 : 128 + 32 * high_bits(qtype); }
constexpr int64_t record_bytes(int64_t qtype) {
  return level_bytes(qtype) + (half_min(qtype) ? 32 : 16);
}
constexpr int64_t head_bytes(int64_t qtype) {  // a K-quant super-block's d[8] (and dmin[8])
  return qtype == kQ6_K ? 16 : is_k_quant(qtype) ? 32 : 0;
}
constexpr int64_t group_bytes(int64_t qtype, int64_t C) {
  return C * record_bytes(qtype) + (C / 8) * head_bytes(qtype);
}
constexpr int64_t record_at(int64_t qtype, int64_t ch) {  // in a group
  return ch * record_bytes(qtype) + (is_k_quant(qtype) ? (ch / 8 + 1) * head_bytes(qtype) : 0);
}
constexpr int64_t head_at(int64_t qtype, int64_t ch) {  // a super-block: its head, then 8 records
  return (ch / 8) * (8 * record_bytes(qtype) + head_bytes(qtype));
}

// M rows of activations quantised per 32-value chunk (C = K / 32 chunks a row).
struct QuantRows {
  int64_t K = 0, C = 0;
  std::vector<int8_t> q;      // [M, K]: round(x / d), |q| <= 127
  std::vector<float> d;       // [M, C]: max|x| / 127
  std::vector<float> dsum;    // [M, C]: d * (sum of the chunk's q), for B terms
  std::vector<int32_t> half;  // [M, C, 2]: sums of q over k < 16 and k >= 16 (Q6_K's shift)

  const int8_t* qs(int64_t m, int64_t c) const { return q.data() + m * K + c * kChunk; }
  const int32_t* halves(int64_t m, int64_t c) const { return half.data() + (m * C + c) * 2; }
};

// One chunk of 32 values: ggml's quantize_row_q8_0 rounding (x * 127 / max|x|, to nearest even),
// with float32 scales. The vector form takes the same products and the same rounding.
inline void quantize_chunk(const float* xc, int8_t* q, float& d, float& dsum, int32_t* half) {
#if defined(__AVX512F__) || NGRAMSPEC_AVX2
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 v[4], amax8 = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_loadu_ps(xc + 8 * i);
    amax8 = _mm256_max_ps(amax8, _mm256_andnot_ps(sign, v[i]));
  }
  const __m128 m4 = _mm_max_ps(_mm256_extractf128_ps(amax8, 1), _mm256_castps256_ps128(amax8));
  const __m128 m2 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  const float amax = _mm_cvtss_f32(_mm_max_ss(m2, _mm_shuffle_ps(m2, m2, 1)));
  const float id = amax != 0.0f ? 127.0f / amax : 0.0f;
  __m256i qi[4];
  for (int i = 0; i < 4; ++i) qi[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], _mm256_set1_ps(id)));  // to even
  // int32 -> int8 in order: packs interleave 128-bit lanes, the permute puts them back.
  const __m256i w16 = _mm256_packs_epi32(qi[0], qi[1]), x16 = _mm256_packs_epi32(qi[2], qi[3]);
  const __m256i b8 = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(w16, x16), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), b8);
  const __m256i lo = _mm256_add_epi32(qi[0], qi[1]), hi = _mm256_add_epi32(qi[2], qi[3]);
  alignas(32) int32_t l[8], h[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(l), lo);
  _mm256_store_si256(reinterpret_cast<__m256i*>(h), hi);
  half[0] = half[1] = 0;
  for (int i = 0; i < 8; ++i) {
    half[0] += l[i];
    half[1] += h[i];
  }
#else
  float amax = 0.0f;
  for (int i = 0; i < kChunk; ++i) amax = std::max(amax, std::fabs(xc[i]));
  const float id = amax != 0.0f ? 127.0f / amax : 0.0f;
  half[0] = half[1] = 0;
  for (int i = 0; i < kChunk; ++i) {
    q[i] = static_cast<int8_t>(std::nearbyint(xc[i] * id));
    half[i / 16] += q[i];
  }
#endif
  d = amax / 127.0f;
  dsum = d * static_cast<float>(half[0] + half[1]);
}

QuantRows quantize_rows(const float* x, int64_t M, int64_t K) {
  QuantRows a;
  a.K = K;
  a.C = K / kChunk;
  a.q.resize(static_cast<size_t>(M * K));
  a.d.resize(static_cast<size_t>(M * a.C));
  a.dsum.resize(static_cast<size_t>(M * a.C));
  a.half.resize(static_cast<size_t>(M * a.C * 2));
  // a prefill's rows are a few percent of its step: worth both threads; a decode row is not
  at::parallel_for(0, M, M * K >= (1 << 15) ? 1 : M, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m)
      for (int64_t c = 0; c < a.C; ++c) {
        const int64_t at = m * a.C + c;
        quantize_chunk(x + m * K + c * kChunk, a.q.data() + m * K + c * kChunk, a.d[at], a.dsum[at],
                       a.half.data() + at * 2);
      }
  });
  return a;
}

#if defined(__AVX512F__) || NGRAMSPEC_AVX2

#if (defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__)
#define NGRAMSPEC_VNNI 1
#else
#define NGRAMSPEC_VNNI 0
#endif

#if NGRAMSPEC_VNNI
// acc + (lane l: sum of u[k] * a[k] over k = 4l .. 4l + 3), u unsigned, a signed.
inline __m256i dot_lanes(__m256i acc, __m256i u, __m256i a) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(acc, u, a);
#else
  return _mm256_dpbusd_avx_epi32(acc, u, a);
#endif
}
#endif

// Register q (0..7) of a record's levels: nibbles (low for q < 4, high after), then bit 4 (and 5)
// from the planes, whose byte o * 4 + i holds register q's bit in its bit q. 16-bit shifts by at
// most the bit's place keep each byte's bit its own.
template <int64_t Q>
inline __m256i level_reg(const uint8_t* p, int q) {
  if constexpr (Q == kQ8_0) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32 * q));
  } else {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32 * (q % 4)));
    __m256i lv = _mm256_and_si256(q < 4 ? raw : _mm256_srli_epi16(raw, 4), _mm256_set1_epi8(0x0F));
    const auto plane_bit = [&](int bit, int64_t at) {
      const __m256i plane = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + at));
      const __m256i moved = q <= bit ? _mm256_slli_epi16(plane, bit - q) : _mm256_srli_epi16(plane, q - bit);
      return _mm256_and_si256(moved, _mm256_set1_epi8(static_cast<char>(1 << bit)));
    };
    if constexpr (high_bits(Q) >= 1) lv = _mm256_or_si256(lv, plane_bit(4, 128));
    if constexpr (high_bits(Q) >= 2) lv = _mm256_or_si256(lv, plane_bit(5, 160));
    return lv;
  }
}

// Products of registers of levels with 4 activations broadcast, summed per lane. With VNNI each
// goes straight into int32 lanes. Without it, maddubs' int16 pair sums of several registers are
// added in int16 before one widening madd: a pair is at most 2 * 127 * (15, 31 or 63 by level
// bits; Q8_0's |w| <= 128 one at a time), so 8, 4 or 2 of them stay within 32767 and every sum
// is exact.
template <int64_t Q>
constexpr int products_per_widen() {
#if NGRAMSPEC_VNNI
  return 8;
#else
  return Q == kQ8_0 ? 1 : 8 >> high_bits(Q);
#endif
}

inline __m256i broadcast4(const int8_t* aq) {
  return _mm256_set1_epi32(static_cast<int>(load_u32(reinterpret_cast<const uint8_t*>(aq))));
}

// part + register lv's products with act (Q8_0's signed levels: |lv| times act with lv's sign).
template <int64_t Q>
inline __m256i add_products(__m256i part, __m256i lv, __m256i act) {
  const __m256i u = Q == kQ8_0 ? _mm256_sign_epi8(lv, lv) : lv;
  const __m256i s = Q == kQ8_0 ? _mm256_sign_epi8(act, lv) : act;
#if NGRAMSPEC_VNNI
  return dot_lanes(part, u, s);
#else
  return _mm256_add_epi16(part, _mm256_maddubs_epi16(u, s));
#endif
}

inline __m256i widen(__m256i part) {  // int32 lanes
#if NGRAMSPEC_VNNI
  return part;
#else
  return _mm256_madd_epi16(part, _mm256_set1_epi16(1));
#endif
}

// The exact integer sums of registers [R0, R1) against row aq's activations.
template <int64_t Q, int R0, int R1>
inline __m256i chunk_dot(const __m256i* lv, const int8_t* aq) {
  constexpr int W = products_per_widen<Q>();
  __m256i isum = _mm256_setzero_si256();
  for (int q0 = R0; q0 < R1; q0 += W) {
    __m256i part = _mm256_setzero_si256();
    for (int q = q0; q < q0 + W && q < R1; ++q) part = add_products<Q>(part, lv[q], broadcast4(aq + 4 * q));
    isum = _mm256_add_epi32(isum, widen(part));
  }
  return isum;
}

inline __m256 bytes_to_float(const uint8_t* p, bool is_signed) {
  const __m128i raw = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm256_cvtepi32_ps(is_signed ? _mm256_cvtepi8_epi32(raw) : _mm256_cvtepu8_epi32(raw));
}

// A record's float factors for its 8 outputs: A (a2: Q6_K's second half) and B. d, nmin: the
// super-block's d and -dmin (K-quants).
struct Factors {
  __m256 a, a2, b;
};

template <int64_t Q>
inline Factors record_factors(const uint8_t* p, __m256 d, __m256 nmin) {
  const uint8_t* f = p + level_bytes(Q);
  Factors r{_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
  if constexpr (Q == kQ6_K) {
    r.a = _mm256_mul_ps(d, bytes_to_float(f, true));
    r.a2 = _mm256_mul_ps(d, bytes_to_float(f + 8, true));
  } else if constexpr (is_k_quant(Q)) {
    r.a = _mm256_mul_ps(d, bytes_to_float(f, false));
    r.b = _mm256_mul_ps(nmin, bytes_to_float(f + 8, false));
  } else {
    r.a = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(f)));
    if constexpr (half_min(Q)) r.b = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(f + 16)));
    if constexpr (Q == kQ4_0 || Q == kQ5_0) r.b = _mm256_mul_ps(r.a, _mm256_set1_ps(level_shift(Q)));
  }
  return r;
}

// Asks for [p, p + n) ahead of use: the next tile's weights, spread over this tile's chunks, so
// they stream from memory while this tile computes (a hardware prefetcher stops at each 4 KB page).
inline void prefetch_span(const uint8_t* p, int64_t n) {
  for (int64_t b = 0; b < n; b += 64) __builtin_prefetch(p + b, 0, 3);
}

// Row m x the 8 outputs of one group (`gp`: its records), all 8 registers of a record's levels
// decoded at once; ncols (<= 8) of them stored.
template <int64_t Q>
void row_tile(const QuantRows& a, int64_t m, const uint8_t* gp, float* out, int64_t ncols) {
  __m256 acc = _mm256_setzero_ps(), mins = _mm256_setzero_ps();
  __m256 d = _mm256_setzero_ps(), nmin = _mm256_setzero_ps();
  const int64_t gb = group_bytes(Q, a.C), span = (gb + a.C - 1) / a.C;
  for (int64_t ch = 0; ch < a.C; ++ch) {
    prefetch_span(gp + gb + ch * span, span);
    if constexpr (is_k_quant(Q)) {
      if (ch % 8 == 0) {
        const uint8_t* h = gp + head_at(Q, ch);
        d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h)));
        if constexpr (Q != kQ6_K)
          nmin = _mm256_xor_ps(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + 16))),
                               _mm256_set1_ps(-0.0f));
      }
    }
    const uint8_t* p = gp + record_at(Q, ch);
    __m256i lv[8];
    for (int q = 0; q < 8; ++q) lv[q] = level_reg<Q>(p, q);
    const Factors f = record_factors<Q>(p, d, nmin);
    const int8_t* aq = a.qs(m, ch);
    const __m256 xd = _mm256_set1_ps(a.d[m * a.C + ch]);
    if constexpr (Q == kQ6_K) {
      const int32_t* hs = a.halves(m, ch);
      const __m256i lo = _mm256_sub_epi32(chunk_dot<Q, 0, 4>(lv, aq), _mm256_set1_epi32(32 * hs[0]));
      const __m256i hi = _mm256_sub_epi32(chunk_dot<Q, 4, 8>(lv, aq), _mm256_set1_epi32(32 * hs[1]));
      acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lo), _mm256_mul_ps(f.a, xd), acc);
      acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(hi), _mm256_mul_ps(f.a2, xd), acc);
    } else {
      acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(chunk_dot<Q, 0, 8>(lv, aq)), _mm256_mul_ps(f.a, xd), acc);
      if constexpr (has_min(Q)) mins = _mm256_fmadd_ps(f.b, _mm256_set1_ps(a.dsum[m * a.C + ch]), mins);
    }
  }
  float v[8];
  _mm256_storeu_ps(v, _mm256_add_ps(acc, mins));
  for (int c = 0; c < ncols && c < 8; ++c) out[c] = v[c];
}

// An empty asm that "changes" v: GCC otherwise regroups a tile's integer adds into a tree of
// every product, which holds them all at once and spills them to the stack.
inline void in_register(__m256i& v) {
#if defined(__AVX512F__)
  asm("" : "+v"(v));
#else
  asm("" : "+x"(v));
#endif
}

// The tile for more than one row: MR rows x G groups (8 G outputs). Each register of levels is
// decoded once for the tile and each row's broadcast activations once for its G groups, so a
// chunk costs its 8 products per (row, group) and little else. The integer sums are exact and
// each output's float operations are row_tile's, in its order (acc here, the B terms in a
// second pass over the factors alone, out = acc + mins), so every row's outputs are bitwise
// those of the one-row tile.
template <int64_t Q, int MR, int G>
void block_tile(const QuantRows& a, int64_t m0, const uint8_t* gp, int64_t gb, float* out, int64_t ldo) {
  __m256 acc[MR][G];
  for (int r = 0; r < MR; ++r)
    for (int g = 0; g < G; ++g) acc[r][g] = _mm256_setzero_ps();
  // Q6_K closes a sum at each half (its own scale); the others once a chunk.
  constexpr int kSpan = Q == kQ6_K ? 4 : 8;
  constexpr int W = std::min(products_per_widen<Q>(), kSpan);
  const int64_t span = (G * gb + a.C - 1) / a.C;
  for (int64_t ch = 0; ch < a.C; ++ch) {
    prefetch_span(gp + G * gb + ch * span, span);
    for (int q0 = 0; q0 < 8; q0 += kSpan) {
      __m256i isum[MR][G];
      for (int r = 0; r < MR; ++r)
        for (int g = 0; g < G; ++g) isum[r][g] = _mm256_setzero_si256();
      // Unrolled: GCC otherwise keeps these loops rolled, paying a branch and index arithmetic
      // per register of levels.
#pragma GCC unroll 8
      for (int qw = q0; qw < q0 + kSpan; qw += W) {
        __m256i part[MR][G];
        for (int r = 0; r < MR; ++r)
          for (int g = 0; g < G; ++g) part[r][g] = _mm256_setzero_si256();
#pragma GCC unroll 8
        for (int q = qw; q < qw + W; ++q) {
          __m256i lv[G];
          for (int g = 0; g < G; ++g) lv[g] = level_reg<Q>(gp + g * gb + record_at(Q, ch), q);
          for (int r = 0; r < MR; ++r) {
            const __m256i act = broadcast4(a.qs(m0 + r, ch) + 4 * q);
            for (int g = 0; g < G; ++g) {
              part[r][g] = add_products<Q>(part[r][g], lv[g], act);
              in_register(part[r][g]);
            }
          }
        }
        for (int r = 0; r < MR; ++r)
          for (int g = 0; g < G; ++g) {
            isum[r][g] = _mm256_add_epi32(isum[r][g], widen(part[r][g]));
            in_register(isum[r][g]);
          }
      }
      for (int g = 0; g < G; ++g) {
        const uint8_t* p = gp + g * gb + record_at(Q, ch);
        __m256 d = _mm256_setzero_ps();
        if constexpr (is_k_quant(Q))
          d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(gp + g * gb + head_at(Q, ch))));
        const Factors f = record_factors<Q>(p, d, _mm256_setzero_ps());
        const __m256 scale = Q == kQ6_K && q0 == 4 ? f.a2 : f.a;
        for (int r = 0; r < MR; ++r) {
          __m256i s = isum[r][g];
          if constexpr (Q == kQ6_K) s = _mm256_sub_epi32(s, _mm256_set1_epi32(32 * a.halves(m0 + r, ch)[q0 / 4]));
          const __m256 xd = _mm256_set1_ps(a.d[(m0 + r) * a.C + ch]);
          acc[r][g] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(scale, xd), acc[r][g]);
        }
      }
    }
  }
  for (int g = 0; g < G; ++g) {
    __m256 mins[MR];
    for (int r = 0; r < MR; ++r) mins[r] = _mm256_setzero_ps();
    if constexpr (has_min(Q)) {
      __m256 nmin = _mm256_setzero_ps();
      for (int64_t ch = 0; ch < a.C; ++ch) {
        if constexpr (is_k_quant(Q))
          nmin = _mm256_xor_ps(
              _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(gp + g * gb + head_at(Q, ch) + 16))),
              _mm256_set1_ps(-0.0f));
        const Factors f = record_factors<Q>(gp + g * gb + record_at(Q, ch), _mm256_setzero_ps(), nmin);
        for (int r = 0; r < MR; ++r)
          mins[r] = _mm256_fmadd_ps(f.b, _mm256_set1_ps(a.dsum[(m0 + r) * a.C + ch]), mins[r]);
      }
    }
    for (int r = 0; r < MR; ++r) _mm256_storeu_ps(out + r * ldo + g * kPack, _mm256_add_ps(acc[r][g], mins[r]));
  }
}

// A tile's rows (at most kTileMR; tile_rows<Q>() for type Q) and groups.
constexpr int kTileMR = 4;
#if NGRAMSPEC_VNNI || defined(__AVX512F__)
constexpr int kTileG = 3;  // 32 registers: 12 sums, 12 accumulators
template <int64_t Q>
constexpr int tile_rows() { return kTileMR; }
#else
constexpr int kTileG = 2;  // 16 registers
// Q8_0 widens every product here: 4 rows' sums beside their accumulators for 2 groups spill.
template <int64_t Q>
constexpr int tile_rows() { return Q == kQ8_0 ? 3 : kTileMR; }
#endif

// Rows m0 .. m0 + MR (MR <= kTileMR) x groups [g0, g1): full tiles of kTileG groups, then the
// last groups one at a time, each into a scratch row when the matrix ends inside it.
template <int64_t Q, int MR>
void block_rows(const QuantRows& a, int64_t m0, const uint8_t* w, float* out, int64_t N, int64_t g0, int64_t g1) {
  const int64_t gb = group_bytes(Q, a.C);
  int64_t g = g0;
  for (; g + kTileG <= g1 && (g + kTileG) * kPack <= N; g += kTileG)
    block_tile<Q, MR, kTileG>(a, m0, w + g * gb, gb, out + m0 * N + g * kPack, N);
  for (; g < g1; ++g) {
    if ((g + 1) * kPack <= N) {
      block_tile<Q, MR, 1>(a, m0, w + g * gb, gb, out + m0 * N + g * kPack, N);
      continue;
    }
    float tail[MR * kPack];
    block_tile<Q, MR, 1>(a, m0, w + g * gb, gb, tail, kPack);
    for (int r = 0; r < MR; ++r)
      for (int64_t c = 0; c < N - g * kPack; ++c) out[(m0 + r) * N + g * kPack + c] = tail[r * kPack + c];
  }
}

template <int64_t Q>
void rows_groups(const QuantRows& a, int64_t M, const uint8_t* w, float* out, int64_t N, int64_t g0, int64_t g1) {
  int64_t m = 0;
  constexpr int MR = tile_rows<Q>();
  for (; m + MR <= M; m += MR) block_rows<Q, MR>(a, m, w, out, N, g0, g1);
  switch (M - m) {
    case 3: return block_rows<Q, 3>(a, m, w, out, N, g0, g1);
    case 2: return block_rows<Q, 2>(a, m, w, out, N, g0, g1);
    case 1: {
      const int64_t gb = group_bytes(Q, a.C);
      for (int64_t g = g0; g < g1; ++g) row_tile<Q>(a, m, w + g * gb, out + m * N + g * kPack, N - g * kPack);
      return;
    }
    default: return;
  }
}

// From 2 to kFewRows blocks of rows (a batch of decodes, a draft tree) take each tile of groups
// through all their rows before the next, so the weights stream from memory once a step, not once
// per block; more rows (a prefill chunk) keep each block over the thread's groups. Either way each
// output is one tile's, in its order.
constexpr int64_t kFewRows = 32;

template <int64_t Q>
void lanes_groups(const QuantRows& a, int64_t M, const uint8_t* w, float* out, int64_t N, int64_t g0, int64_t g1) {
  if (M <= tile_rows<Q>() || M > kFewRows) return rows_groups<Q>(a, M, w, out, N, g0, g1);
  for (int64_t g = g0; g < g1; g += kTileG) rows_groups<Q>(a, M, w, out, N, g, std::min(g + kTileG, g1));
}

#else  // the same integer sums and float operations, output by output

// Output o's level of weight k in a record.
template <int64_t Q>
int packed_level(const uint8_t* p, int64_t o, int k) {
  const int r = k / 4, i = k % 4;
  if (Q == kQ8_0) return static_cast<int8_t>(p[(r * kPack + o) * 4 + i]);
  int u = (p[((r % 4) * kPack + o) * 4 + i] >> (r < 4 ? 0 : 4)) & 0xF;
  for (int b = 0; b < high_bits(Q); ++b) u |= ((p[128 + 32 * b + o * 4 + i] >> r) & 1) << (4 + b);
  return u;
}

template <int64_t Q>
void lanes_groups(const QuantRows& a, int64_t M, const uint8_t* w, float* out, int64_t N, int64_t g0, int64_t g1) {
  const int64_t gb = group_bytes(Q, a.C);
  for (int64_t g = g0; g < g1; ++g)
    for (int64_t m = 0; m < M; ++m)
      for (int64_t o = 0; o < kPack && g * kPack + o < N; ++o) {
        float acc = 0.0f, mins = 0.0f, d = 0.0f, nmin = 0.0f;
        for (int64_t ch = 0; ch < a.C; ++ch) {
          if (is_k_quant(Q) && ch % 8 == 0) {
            const uint8_t* h = w + g * gb + head_at(Q, ch);
            d = half_to_float(h + 2 * o);
            if (Q != kQ6_K) nmin = -half_to_float(h + 16 + 2 * o);
          }
          const uint8_t* p = w + g * gb + record_at(Q, ch);
          const uint8_t* f = p + level_bytes(Q);
          const int8_t* aq = a.qs(m, ch);
          int32_t sums[2] = {0, 0};  // k < 16, k >= 16
          for (int k = 0; k < kChunk; ++k) sums[k / 16] += packed_level<Q>(p, o, k) * aq[k];
          const float xd = a.d[m * a.C + ch];
          if (Q == kQ6_K) {
            const int32_t* hs = a.halves(m, ch);
            const float a_lo = d * static_cast<float>(static_cast<int8_t>(f[o]));
            const float a_hi = d * static_cast<float>(static_cast<int8_t>(f[8 + o]));
            acc = std::fma(static_cast<float>(sums[0] - 32 * hs[0]), a_lo * xd, acc);
            acc = std::fma(static_cast<float>(sums[1] - 32 * hs[1]), a_hi * xd, acc);
            continue;
          }
          float A, B = 0.0f;
          if (is_k_quant(Q)) {
            A = d * static_cast<float>(f[o]);
            B = nmin * static_cast<float>(f[8 + o]);
          } else {
            A = half_to_float(f + 2 * o);
            if (half_min(Q)) B = half_to_float(f + 16 + 2 * o);
            if (Q == kQ4_0 || Q == kQ5_0) B = A * level_shift(Q);
          }
          acc = std::fma(static_cast<float>(sums[0] + sums[1]), A * xd, acc);
          if (has_min(Q)) mins = std::fma(B, a.dsum[m * a.C + ch], mins);
        }
        out[m * N + g * kPack + o] = acc + mins;
      }
}

#endif

}  // namespace

// GGUF blocks [N, row_bytes] -> the packed records, [ceil(N / 8), group_bytes] (see the top).
torch::Tensor gguf_pack_int8(const torch::Tensor& w, int64_t qtype, int64_t K) {
  check_weight(w, qtype, K);
  const int64_t N = w.size(0), groups = (N + kPack - 1) / kPack, C = K / kChunk, bb = block_bytes_of(qtype);
  const int64_t chunks = block_weights_of(qtype) / kChunk, gb = group_bytes(qtype, C), lb = level_bytes(qtype);
  torch::Tensor out = torch::zeros({groups, gb}, w.options());
  const uint8_t* src = w.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  for (int64_t n = 0; n < N; ++n) {
    const int64_t g = n / kPack, o = n % kPack;
    for (int64_t ch = 0; ch < C; ++ch) {
      const uint8_t* b = src + n * w.size(1) + (ch / chunks) * bb;
      const int j = static_cast<int>(ch % chunks);
      uint8_t* p = dst + g * gb + record_at(qtype, ch);
      for (int k = 0; k < kChunk; ++k) {
        const int r = k / 4, i = k % 4;
        if (qtype == kQ8_0) {
          p[(r * kPack + o) * 4 + i] = b[2 + k];
          continue;
        }
        const int u = level(qtype, b, j, k) + unsigned_offset(qtype);
        p[((r % 4) * kPack + o) * 4 + i] |= static_cast<uint8_t>((u & 0xF) << (r < 4 ? 0 : 4));
        for (int hb = 0; hb < high_bits(qtype); ++hb)
          p[128 + 32 * hb + o * 4 + i] |= static_cast<uint8_t>(((u >> (4 + hb)) & 1) << r);
      }
      uint8_t* f = p + lb;
      uint8_t* h = dst + g * gb + head_at(qtype, ch);
      if (qtype == kQ6_K) {
        f[o] = b[192 + 2 * j];
        f[8 + o] = b[192 + 2 * j + 1];
        if (j == 0) std::memcpy(h + 2 * o, b + 208, 2);
      } else if (is_k_quant(qtype)) {
        int sc, m;
        scale_min_k4(j, b + 4, sc, m);
        f[o] = static_cast<uint8_t>(sc);
        f[8 + o] = static_cast<uint8_t>(m);
        if (j == 0) {
          std::memcpy(h + 2 * o, b, 2);           // d
          std::memcpy(h + 16 + 2 * o, b + 2, 2);  // dmin
        }
      } else {
        std::memcpy(f + 2 * o, b, 2);                                 // A: d
        if (half_min(qtype)) std::memcpy(f + 16 + 2 * o, b + 2, 2);  // B: m
      }
    }
  }
  return out;
}

// x: [M, K] float32 -> [M, N] float32, with w: GGUF blocks of type qtype packed by
// gguf_pack_int8; x is quantised to int8 per 32 values first (see the top).
torch::Tensor gguf_linear_int8(const torch::Tensor& x, const torch::Tensor& w, int64_t qtype, int64_t N,
                               const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kFloat && x.dim() == 2,
              "gguf_linear_int8: x must be a 2-D CPU float32 tensor");
  const int64_t M = x.size(0), K = x.size(1);
  block_bytes(qtype);  // names an unknown type
  TORCH_CHECK(K % block_weights_of(qtype) == 0, "GGUF row length ", K, " is not a multiple of ",
              block_weights_of(qtype), " (type ", qtype, ")");
  TORCH_CHECK(w.dim() == 2 && w.size(1) == group_bytes(qtype, K / kChunk) && N > (w.size(0) - 1) * kPack &&
                  N <= w.size(0) * kPack,
              "gguf_linear_int8: weights of shape ", w.sizes(), " are not ", N, " outputs of ", K,
              " inputs packed by gguf_pack_int8");
  torch::Tensor out = torch::empty({M, N}, x.options());
  if (M == 0) return out;
  const torch::Tensor xc = x.contiguous();
  const QuantRows a = quantize_rows(xc.data_ptr<float>(), M, K);
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  const int64_t groups = (N + kPack - 1) / kPack;
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    switch (qtype) {
      case kQ4_0: lanes_groups<kQ4_0>(a, M, wp, op, N, g0, g1); break;
      case kQ4_1: lanes_groups<kQ4_1>(a, M, wp, op, N, g0, g1); break;
      case kQ5_0: lanes_groups<kQ5_0>(a, M, wp, op, N, g0, g1); break;
      case kQ5_1: lanes_groups<kQ5_1>(a, M, wp, op, N, g0, g1); break;
      case kQ8_0: lanes_groups<kQ8_0>(a, M, wp, op, N, g0, g1); break;
      case kQ4_K: lanes_groups<kQ4_K>(a, M, wp, op, N, g0, g1); break;
      case kQ5_K: lanes_groups<kQ5_K>(a, M, wp, op, N, g0, g1); break;
      case kQ6_K: lanes_groups<kQ6_K>(a, M, wp, op, N, g0, g1); break;
      default: break;  // rejected by block_bytes
    }
  });
  if (bias.has_value() && bias->defined()) out.add_(*bias);
  return out;
}
