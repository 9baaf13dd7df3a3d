// Attention over the token-granular KV cache, read in place, for decodes, prefill chunks and
// draft trees alike (CPU).
//
// Each query token attends to an ordered key list: its sequence's cached prefix (shared by all of
// that sequence's query tokens) followed by its own visible query tokens (itself, and for a tree
// node its ancestors). No gather into a padded copy, no [queries x context] mask.
//
// The list is cut into chunks of kChunk keys at fixed list indices; each chunk gives a partial
// softmax (max, sum, weighted values) and the partials merge in chunk order (split-K, as flash
// decoding does). Work items are (token, chunk, kv head), so a long context spreads over the
// threads even for one decode token.
//
// Batch invariance: a query's output depends only on its ordered key list: one fixed instruction
// sequence per (query, key), chunk boundaries and 16-key blocks at fixed list indices, fixed
// reduction orders within and across chunks. A token decoded alone and the same token inside a
// draft tree see the same list (prefix + tree ancestors, in position order), so they get
// bitwise-equal outputs: speculation is lossless in every dtype.

#include "torch_lite.h"
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>

#include "amx_tiles.h"
#include "vec_math.h"

namespace {


template <typename T>
inline float to_float(T v) { return static_cast<float>(v); }

#if defined(__AVX512F__)

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

#endif

constexpr int64_t kChunk = 256;  // keys per partial softmax (a multiple of 16)

// A query's ordered key list: its sequence's prefix, then its own visible query-token slots.
struct KeyList {
  const int64_t* prefix;
  int64_t P;
  const int64_t* local;
  int64_t L;  // total length
  inline int64_t slot(int64_t i) const { return i < P ? prefix[i] : local[i - P]; }
};

template <typename T>
struct Cache {
  const T* k;
  const T* v;
  int64_t KVH, D;
  inline const T* krow(int64_t slot, int64_t g) const { return k + (slot * KVH + g) * D; }
  inline const T* vrow(int64_t slot, int64_t g) const { return v + (slot * KVH + g) * D; }
};

// A chunk's keys in the vector path's layout (AVX-512: transposed 16-key blocks, [n / 16][D][16];
// AVX2: float32 rows, [n][D]) and (AVX-512) its values widened to float32 ([n][D]), made once for
// every batch of queries that shares the chunk: a prefill chunk's keys serve hundreds of queries.
// The same floats the inline path makes per batch, so the numbers do not change.
struct Stage {
  const float* k;
  const float* v;  // nullptr: the cache's own float32 rows
};

constexpr int kMaxQ = 32;  // most queries sharing one pass over a chunk's keys (two AMX tiles)
// ... on the vector paths: AVX-512 keeps a query's accumulators in registers; AVX2 keeps scores
// in memory, so a draft tree of 8 tokens' 3 heads per kv head read the chunk's keys and values
// once.
constexpr int kMaxQVector = NGRAMSPEC_AVX2 ? 24 : 8;

#if defined(__AVX512F__)

// 16 x 16 transpose: c[j] lane i = r[i] lane j.
inline void transpose16(const __m512* r, __m512* c) {
  __m512 t[16], u[16], v[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int m = 0; m < 4; ++m) {
    u[4 * m + 0] = _mm512_shuffle_ps(t[4 * m], t[4 * m + 2], 0x44);
    u[4 * m + 1] = _mm512_shuffle_ps(t[4 * m], t[4 * m + 2], 0xEE);
    u[4 * m + 2] = _mm512_shuffle_ps(t[4 * m + 1], t[4 * m + 3], 0x44);
    u[4 * m + 3] = _mm512_shuffle_ps(t[4 * m + 1], t[4 * m + 3], 0xEE);
  }
  for (int k = 0; k < 4; ++k) {
    v[k] = _mm512_shuffle_f32x4(u[k], u[4 + k], 0x88);
    v[4 + k] = _mm512_shuffle_f32x4(u[k], u[4 + k], 0xDD);
    v[8 + k] = _mm512_shuffle_f32x4(u[8 + k], u[12 + k], 0x88);
    v[12 + k] = _mm512_shuffle_f32x4(u[8 + k], u[12 + k], 0xDD);
  }
  for (int k = 0; k < 4; ++k) {
    c[k] = _mm512_shuffle_f32x4(v[k], v[8 + k], 0x88);
    c[8 + k] = _mm512_shuffle_f32x4(v[k], v[8 + k], 0xDD);
    c[4 + k] = _mm512_shuffle_f32x4(v[4 + k], v[12 + k], 0x88);
    c[12 + k] = _mm512_shuffle_f32x4(v[4 + k], v[12 + k], 0xDD);
  }
}

constexpr int kKeyBlock = 16;

// Keys [j0, j0 + 16) of the chunk at list index i0, transposed into kt [D][16] (zeros past n).
template <typename T, int ND>
void stage_keys(const Cache<T>& c, int64_t g, const KeyList& keys, int64_t i0, int64_t j0, int64_t n,
                float* kt) {
  const int64_t nk = std::min<int64_t>(16, n - j0);
  for (int d = 0; d < ND; ++d) {
    __m512 rows[16], cols[16];
    for (int j = 0; j < 16; ++j)
      rows[j] = j < nk ? load16(c.krow(keys.slot(i0 + j0 + j), g) + 16 * d) : _mm512_setzero_ps();
    transpose16(rows, cols);
    for (int e = 0; e < 16; ++e) _mm512_store_ps(kt + (16 * d + e) * 16, cols[e]);
  }
}

// Partial softmax attention of nq <= kMaxQVector queries (ND * 16 dims each) over the same list
// indices [i0, i1) (i0 % 16 == 0): out[n] = [max, sum, acc[0 .. D)], acc = sum_i exp(s_i - max) v_i.
// Keys go through in transposed 16-key blocks, so a score is one FMA chain over the dims in
// order, and every block's key loads serve all nq queries. A query's numbers do not depend on nq.
// `st`: the chunk staged (keys transposed, values widened), or nullptr to read the cache.
template <typename T, int ND>
void chunk_partial(const Cache<T>& c, int64_t g, const float* const* qs, int nq, const KeyList& keys,
                   int64_t i0, int64_t i1, float scale, const Stage* st, float* const* out) {
  constexpr int D = ND * 16;
  alignas(64) float sc[kMaxQVector][kChunk];
  alignas(64) float own[D * 16];  // [D][16 keys], without a stage
  const int64_t n = i1 - i0;
  for (int64_t j0 = 0; j0 < n; j0 += 16) {
    const float* kt = st ? st->k + j0 * D : own;
    if (!st) stage_keys<T, ND>(c, g, keys, i0, j0, n, own);
    __m512 acc[kMaxQVector];
    for (int q = 0; q < nq; ++q) acc[q] = _mm512_setzero_ps();
    for (int d = 0; d < D; ++d) {
      const __m512 kd = _mm512_load_ps(kt + d * 16);
      for (int q = 0; q < nq; ++q) acc[q] = _mm512_fmadd_ps(_mm512_set1_ps(qs[q][d]), kd, acc[q]);
    }
    for (int q = 0; q < nq; ++q) _mm512_store_ps(sc[q] + j0, _mm512_mul_ps(acc[q], _mm512_set1_ps(scale)));
  }
  for (int q = 0; q < nq; ++q) {  // softmax numerators and sums, per query
    __m512 vmax = _mm512_set1_ps(-INFINITY);
    for (int64_t j0 = 0; j0 < n; j0 += 16) {
      const int64_t nk = std::min<int64_t>(16, n - j0);
      const __mmask16 m = static_cast<__mmask16>(nk == 16 ? 0xFFFF : (1u << nk) - 1);
      vmax = _mm512_mask_max_ps(vmax, m, vmax, _mm512_load_ps(sc[q] + j0));
    }
    const float mx = _mm512_reduce_max_ps(vmax);
    const __m512 vmx = _mm512_set1_ps(mx);
    __m512 vsum = _mm512_setzero_ps();
    for (int64_t j0 = 0; j0 < n; j0 += 16) {
      const int64_t nk = std::min<int64_t>(16, n - j0);
      const __mmask16 m = static_cast<__mmask16>(nk == 16 ? 0xFFFF : (1u << nk) - 1);
      const __m512 e = _mm512_maskz_mov_ps(m, ngramspec::exp16(_mm512_sub_ps(_mm512_load_ps(sc[q] + j0), vmx)));
      _mm512_store_ps(sc[q] + j0, e);
      vsum = _mm512_add_ps(vsum, e);
    }
    out[q][0] = mx;
    out[q][1] = _mm512_reduce_add_ps(vsum);
  }
  constexpr int QT = ND <= 4 ? 4 : (ND <= 8 ? 2 : 1);  // queries per pass over the values
  for (int q0 = 0; q0 < nq; q0 += QT) {
    const int nt = std::min(QT, nq - q0);
    __m512 acc[QT][ND];
    for (int q = 0; q < QT; ++q)
      for (int d = 0; d < ND; ++d) acc[q][d] = _mm512_setzero_ps();
    for (int64_t j = 0; j < n; ++j) {
      __m512 vv[ND];
      if (st && st->v) {
        for (int d = 0; d < ND; ++d) vv[d] = load16(st->v + j * D + 16 * d);
      } else {
        const T* v = c.vrow(keys.slot(i0 + j), g);
        for (int d = 0; d < ND; ++d) vv[d] = load16(v + 16 * d);
      }
      for (int q = 0; q < nt; ++q) {
        const __m512 p = _mm512_set1_ps(sc[q0 + q][j]);
        for (int d = 0; d < ND; ++d) acc[q][d] = _mm512_fmadd_ps(p, vv[d], acc[q][d]);
      }
    }
    for (int q = 0; q < nt; ++q)
      for (int d = 0; d < ND; ++d) _mm512_storeu_ps(out[q0 + q] + 2 + 16 * d, acc[q][d]);
  }
}

#endif

#if NGRAMSPEC_AVX2

// The AVX2 partial. Scores read each key as a row (no transpose: on a decode's 3 queries the
// transposes cost more than the products). A score is 8 lane chains over the dims (lane l: dims
// l, l + 8, ... in order), then the lanes summed as ((l0 + l1) + (l2 + l3)) + ((l4 + l5) +
// (l6 + l7)); eight_scores is the only place a score is formed, so every batch of queries,
// decode, tree or prefill chunk, gets the same numbers. The softmax and the value sums are the
// AVX-512 path's, lane for lane: exp8 is exp16's arithmetic, the sums keep 16 lanes
// (ngramspec::V16) and reduce in _mm512_reduce_add_ps's order, and a value sum is one FMA chain
// over the keys.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

// Lanes [0, n) all ones, the rest zero (n in [0, 8]).
inline __m256 first_lanes(int64_t n) {
  const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), idx));
}

// Scores of query q against the 8 key rows k[0..8) (float32, D8 * 8 dims), unscaled: key j in
// lane j. The hadd tree sums each key's 8 lane chains in the one order given above.
template <int D8>
inline __m256 eight_scores(const float* q, const float* const* k) {
  __m256 a[8];
  for (int j = 0; j < 8; ++j) a[j] = _mm256_setzero_ps();
  for (int i = 0; i < D8; ++i) {
    const __m256 qi = _mm256_loadu_ps(q + 8 * i);
    for (int j = 0; j < 8; ++j) a[j] = _mm256_fmadd_ps(qi, _mm256_loadu_ps(k[j] + 8 * i), a[j]);
  }
  const __m256 lo = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));  // keys 0-3
  const __m256 hi = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));  // keys 4-7
  return _mm256_add_ps(_mm256_permute2f128_ps(lo, hi, 0x20), _mm256_permute2f128_ps(lo, hi, 0x31));
}

// out[q][2 ..] = sum over the n keys of p[q][j] * v_j for NQ queries, 16 dims a pass: one FMA
// chain per (query, dim) over the keys in order. rows[j]: value row j.
template <int ND, int NQ, typename T>
inline void value_sums(const T* const* rows, int64_t n, const float (*p)[kChunk], float* const* out) {
  for (int d0 = 0; d0 < 2 * ND; d0 += 2) {
    __m256 acc[NQ][2];
    for (int q = 0; q < NQ; ++q) acc[q][0] = acc[q][1] = _mm256_setzero_ps();
    for (int64_t j = 0; j < n; ++j) {
      const T* v = rows[j] + 8 * d0;
      // Rows come from the slot list, in no order a hardware prefetcher follows.
      _mm_prefetch(reinterpret_cast<const char*>(rows[std::min(j + 16, n - 1)] + 8 * d0), _MM_HINT_T0);
      const __m256 v0 = load8(v), v1 = load8(v + 8);
      for (int q = 0; q < NQ; ++q) {
        const __m256 pj = _mm256_set1_ps(p[q][j]);
        acc[q][0] = _mm256_fmadd_ps(pj, v0, acc[q][0]);
        acc[q][1] = _mm256_fmadd_ps(pj, v1, acc[q][1]);
      }
    }
    for (int q = 0; q < NQ; ++q) {
      _mm256_storeu_ps(out[q] + 2 + 8 * d0, acc[q][0]);
      _mm256_storeu_ps(out[q] + 2 + 8 * d0 + 8, acc[q][1]);
    }
  }
}

constexpr int kKeyBlock = 8;

// A row of zeros for the keys past a chunk's end (their scores are masked off).
alignas(32) constexpr float kZeroRow[256] = {};

// Keys [j0, j0 + 8) of the chunk at list index i0 widened to float32 rows, dst [8][D] (zeros past n).
template <typename T, int ND>
void stage_keys(const Cache<T>& c, int64_t g, const KeyList& keys, int64_t i0, int64_t j0, int64_t n,
                float* dst) {
  constexpr int D = ND * 16;
  for (int64_t j = 0; j < 8; ++j)
    for (int d = 0; d < D; d += 8)
      _mm256_store_ps(dst + j * D + d, j0 + j < n ? load8(c.krow(keys.slot(i0 + j0 + j), g) + d) : _mm256_setzero_ps());
}

// Row pointers of keys [j0, j0 + 8): a stage's rows, a float32 cache's own rows, or rows widened
// into `own` [8][D]; the zero row past n.
template <typename T, int ND>
void key_rows(const Cache<T>& c, int64_t g, const KeyList& keys, int64_t i0, int64_t j0, int64_t n,
              const Stage* st, float* own, const float** rows) {
  constexpr int D = ND * 16;
  if (st) {
    for (int64_t j = 0; j < 8; ++j) rows[j] = st->k + (j0 + j) * D;
    return;
  }
  if constexpr (std::is_same_v<T, float>) {
    for (int64_t j = 0; j < 8; ++j) rows[j] = j0 + j < n ? c.krow(keys.slot(i0 + j0 + j), g) : kZeroRow;
  } else {
    stage_keys<T, ND>(c, g, keys, i0, j0, n, own);
    for (int64_t j = 0; j < 8; ++j) rows[j] = own + j * D;
  }
}

// Query q sees the chunk's first lens[q] keys (<= i1 - i0; a causal prefill chunk's tokens share
// one pass, as on the AMX path): the keys past it get probability 0 and add exact zeros to its
// sums, so its numbers are those of a pass over its own keys alone.
template <typename T, int ND>
void chunk_partial(const Cache<T>& c, int64_t g, const float* const* qs, const int64_t* lens, int nq,
                   const KeyList& keys, int64_t i0, int64_t i1, float scale, const Stage* st,
                   float* const* out) {
  constexpr int D = ND * 16;
  alignas(32) float sc[kMaxQVector][kChunk];
  alignas(32) float own[8 * D];  // [8 keys][D] widened, without a stage
  const int64_t n = i1 - i0;
  for (int64_t j0 = 0; j0 < n; j0 += 8) {
    const float* rows[8];
    key_rows<T, ND>(c, g, keys, i0, j0, n, st, own, rows);
    for (int q = 0; q < nq; ++q)
      _mm256_store_ps(sc[q] + j0, _mm256_mul_ps(eight_scores<2 * ND>(qs[q], rows), _mm256_set1_ps(scale)));
  }
  for (int q = 0; q < nq; ++q) {  // softmax numerators and sums, per query
    const int64_t len = lens[q];
    __m256 vmax = _mm256_set1_ps(-INFINITY);
    for (int64_t j0 = 0; j0 < n; j0 += 8) {
      const __m256 s = _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), _mm256_load_ps(sc[q] + j0),
                                        first_lanes(len - j0));
      vmax = _mm256_max_ps(vmax, s);
    }
    const __m128 m4 = _mm_max_ps(_mm256_extractf128_ps(vmax, 1), _mm256_castps256_ps128(vmax));
    const __m128 m2 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    const float mx = _mm_cvtss_f32(_mm_max_ss(m2, _mm_shuffle_ps(m2, m2, 1)));
    const __m256 vmx = _mm256_set1_ps(mx);
    ngramspec::V16 vsum{_mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t j0 = 0; j0 < n; j0 += 8) {
      const __m256 e = _mm256_and_ps(first_lanes(len - j0),
                                     ngramspec::exp8(_mm256_sub_ps(_mm256_load_ps(sc[q] + j0), vmx)));
      _mm256_store_ps(sc[q] + j0, e);
      __m256& half = (j0 / 8) % 2 ? vsum.b : vsum.a;  // key j0 + l is 16-lane lane (j0 % 16) + l
      half = _mm256_add_ps(half, e);
    }
    out[q][0] = mx;
    out[q][1] = ngramspec::reduce_add16(vsum);
  }
  // Values: 6 queries x 16 dims a pass (12 accumulators, the two value vectors and a
  // probability fill the 16 registers), so each value load and bf16 widening serves 6 queries.
  // The stage holds no values on AVX2 (stages_values): the cache's rows, found once per chunk.
  const T* vrows[kChunk];
  for (int64_t j = 0; j < n; ++j) vrows[j] = c.vrow(keys.slot(i0 + j), g);
  for (int q0 = 0; q0 < nq; q0 += 6) {
    switch (std::min(6, nq - q0)) {
      case 6: value_sums<ND, 6>(vrows, n, sc + q0, out + q0); break;
      case 5: value_sums<ND, 5>(vrows, n, sc + q0, out + q0); break;
      case 4: value_sums<ND, 4>(vrows, n, sc + q0, out + q0); break;
      case 3: value_sums<ND, 3>(vrows, n, sc + q0, out + q0); break;
      case 2: value_sums<ND, 2>(vrows, n, sc + q0, out + q0); break;
      default: value_sums<ND, 1>(vrows, n, sc + q0, out + q0); break;
    }
  }
}

#endif

#if defined(NGRAMSPEC_AMX)

// x (32 floats as two halves) -> bf16 hi + lo with hi + lo = x to ~16 mantissa bits, so bf16
// tile products keep the fp32 path's accuracy. Each is 32 bf16 in order.
inline void split_bf16(__m512 x0, __m512 x1, __m512i& hi, __m512i& lo) {
  hi = (__m512i)_mm512_cvtne2ps_pbh(x1, x0);
  const __m512 h0 = ngramspec::widen_bf16(_mm512_castsi512_si256(hi));
  const __m512 h1 = ngramspec::widen_bf16(_mm512_extracti64x4_epi64(hi, 1));
  lo = (__m512i)_mm512_cvtne2ps_pbh(_mm512_sub_ps(x1, h1), _mm512_sub_ps(x0, h0));
}

// All eight tiles 16 rows x 64 bytes. Scores: tmm0-3 query B tiles (two halves x hi, lo), tmm4
// key A tile, tmm6/7 score C tiles (one per half). Values: tmm0-3 output C tiles, tmm4/5
// probability A tiles (hi, lo), tmm6/7 value B tiles.
// C tile `C` += (hi + lo probabilities in tmm4, tmm5) . the value B tile loaded into `B`. A macro:
// GCC's tile intrinsics need literal tile numbers (templates do not do).
#define NGRAMSPEC_PV_TILE(C, B, values) \
  do {                                  \
    _tile_loadd(B, values, 64);         \
    _tile_dpbf16ps(C, 4, B);            \
    _tile_dpbf16ps(C, 5, B);            \
  } while (0)

inline void configure_attention_tiles() { ngramspec::configure_tiles(8, 0, 16); }

// The same partial as chunk_partial, on AMX tiles, for a bf16 cache and D % 32 == 0: scores
// S^T [16 keys x 16 queries] = K [16 keys x 32 dims] . Q^T per tile product, the softmax runs
// across queries (one query per lane), and out [16 queries x 16 dims] = P [16 x 32 keys] . V.
// Up to 32 queries in two halves of 16 share every key tile and value interleave. Queries and
// probabilities enter as bf16 hi + lo pairs. Query q sees the chunk's first lens[q] keys (a
// causal prefill chunk's tokens share one pass); the keys it does not see get probability 0 and
// add exact zeros, and every lane and tile row is computed independently of the others, so a
// query's numbers do not depend on which queries share its pass.
void chunk_partial_amx(const Cache<c10::BFloat16>& c, int64_t g, const float* const* qs,
                       const int64_t* lens, int nq, const KeyList& keys, int64_t i0, int64_t n,
                       float scale, float* const* out) {
  const int64_t D = c.D, DB = D / 32;
  const int halves = (nq + 15) / 16;
  const int64_t n32 = (n + 31) / 32 * 32, blocks32 = n32 / 32;
  alignas(64) uint32_t qb[8][2][2][16][16];     // [dim block][half][hi, lo][dim pair][query]
  alignas(64) float sc[kChunk][2][16];          // [key][half][query]: scores, then exp
  alignas(64) uint16_t pb[kChunk / 32][2][2][16][32];  // [key block][half][hi, lo][query][key]
  alignas(64) uint16_t kbuf[16 * 256];          // a block's gathered keys [16][D]
  alignas(64) uint16_t vb[kChunk / 32][4][16][32];  // [key block][16-dim tile][key pair][dim, key]
  alignas(64) float ob[16][16];
  const __m512 vscale = _mm512_set1_ps(scale);
  // 1. queries (scaled) -> hi/lo bf16, pair-transposed into B tiles
  for (int h = 0; h < halves; ++h)
    for (int64_t db = 0; db < DB; ++db) {
      __m512 hi[16], lo[16], cols[16];
      for (int r = 0; r < 16; ++r) {
        const int q = 16 * h + r;
        __m512i vh = _mm512_setzero_si512(), vl = _mm512_setzero_si512();
        if (q < nq) split_bf16(_mm512_mul_ps(_mm512_loadu_ps(qs[q] + db * 32), vscale),
                               _mm512_mul_ps(_mm512_loadu_ps(qs[q] + db * 32 + 16), vscale), vh, vl);
        hi[r] = _mm512_castsi512_ps(vh);
        lo[r] = _mm512_castsi512_ps(vl);
      }
      transpose16(hi, cols);
      for (int r = 0; r < 16; ++r) _mm512_store_ps(reinterpret_cast<float*>(qb[db][h][0][r]), cols[r]);
      transpose16(lo, cols);
      for (int r = 0; r < 16; ++r) _mm512_store_ps(reinterpret_cast<float*>(qb[db][h][1][r]), cols[r]);
    }
  // 2. scores, 16 keys per tile product; keys read in place where a block's slots are consecutive
  const uint16_t* kc = reinterpret_cast<const uint16_t*>(c.k);
  for (int64_t b0 = 0; b0 < n; b0 += 16) {
    const int64_t nk = std::min<int64_t>(16, n - b0);
    const int64_t s0 = keys.slot(i0 + b0);
    bool consecutive = nk == 16;
    for (int64_t j = 1; consecutive && j < 16; ++j) consecutive = keys.slot(i0 + b0 + j) == s0 + j;
    const uint16_t* src;
    int64_t stride;
    if (consecutive) {
      src = kc + (s0 * c.KVH + g) * D;
      stride = c.KVH * D * 2;
    } else {
      for (int64_t j = 0; j < 16; ++j) {
        if (j < nk) std::memcpy(kbuf + j * D, kc + (keys.slot(i0 + b0 + j) * c.KVH + g) * D, D * 2);
        else std::memset(kbuf + j * D, 0, D * 2);
      }
      src = kbuf;
      stride = D * 2;
    }
    // one accumulator per half (tmm6, tmm7): two independent chains
    _tile_zero(6);
    _tile_zero(7);
    for (int64_t db = 0; db < DB; ++db) {
      _tile_loadd(4, src + db * 32, stride);
      _tile_loadd(0, qb[db][0][0], 64);
      _tile_loadd(1, qb[db][0][1], 64);
      _tile_dpbf16ps(6, 4, 0);
      if (halves > 1) {
        _tile_loadd(2, qb[db][1][0], 64);
        _tile_loadd(3, qb[db][1][1], 64);
        _tile_dpbf16ps(7, 4, 2);
      }
      _tile_dpbf16ps(6, 4, 1);
      if (halves > 1) _tile_dpbf16ps(7, 4, 3);
    }
    _tile_stored(6, sc[b0][0], 128);
    if (halves > 1) _tile_stored(7, sc[b0][1], 128);
  }
  // 3. values pair-interleaved into B tiles once for both halves (at most 64 dims at a time)
  const uint16_t* vc = reinterpret_cast<const uint16_t*>(c.v);
  alignas(64) static const uint16_t kPairIdx[2][32] = {
      {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
       8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47},
      {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
       24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63}};
  const __m512i pair_lo = _mm512_load_si512(kPairIdx[0]), pair_hi = _mm512_load_si512(kPairIdx[1]);
  auto interleave_values = [&](int64_t d0, int nt) {
    for (int64_t j = 0; j < n32; j += 2) {  // keys j, j + 1 -> pair row (j % 32) / 2 of block j / 32
      const uint16_t* va = j < n ? vc + (keys.slot(i0 + j) * c.KVH + g) * D + d0 : nullptr;
      const uint16_t* vbp = j + 1 < n ? vc + (keys.slot(i0 + j + 1) * c.KVH + g) * D + d0 : nullptr;
      for (int hd = 0; hd < nt / 2; ++hd) {  // 32 dims at a time
        const __m512i a = va ? _mm512_loadu_si512(va + 32 * hd) : _mm512_setzero_si512();
        const __m512i b = vbp ? _mm512_loadu_si512(vbp + 32 * hd) : _mm512_setzero_si512();
        _mm512_store_si512(vb[j / 32][2 * hd][(j % 32) / 2], _mm512_permutex2var_epi16(a, pair_lo, b));
        _mm512_store_si512(vb[j / 32][2 * hd + 1][(j % 32) / 2], _mm512_permutex2var_epi16(a, pair_hi, b));
      }
    }
  };
  for (int h = 0; h < halves; ++h) {
    // 4. softmax numerators per query lane, over the keys that query sees
    alignas(64) int32_t len32[16];
    for (int r = 0; r < 16; ++r) len32[r] = 16 * h + r < nq ? static_cast<int32_t>(lens[16 * h + r]) : 0;
    const __m512i lenv = _mm512_load_si512(len32);
    __m512 vmax = _mm512_set1_ps(-INFINITY);
    for (int64_t j = 0; j < n; ++j) {
      const __mmask16 m = _mm512_cmpgt_epi32_mask(lenv, _mm512_set1_epi32(static_cast<int32_t>(j)));
      vmax = _mm512_mask_max_ps(vmax, m, vmax, _mm512_load_ps(sc[j][h]));
    }
    __m512 vsum = _mm512_setzero_ps();
    for (int64_t j = 0; j < n; ++j) {
      const __mmask16 m = _mm512_cmpgt_epi32_mask(lenv, _mm512_set1_epi32(static_cast<int32_t>(j)));
      const __m512 e = _mm512_maskz_mov_ps(m, ngramspec::exp16(_mm512_sub_ps(_mm512_load_ps(sc[j][h]), vmax)));
      _mm512_store_ps(sc[j][h], e);
      vsum = _mm512_add_ps(vsum, e);
    }
    for (int64_t j = n; j < n32; ++j) _mm512_store_ps(sc[j][h], _mm512_setzero_ps());
    alignas(64) float mx[16], sm[16];
    _mm512_store_ps(mx, vmax);
    _mm512_store_ps(sm, vsum);
    for (int r = 0; r < 16 && 16 * h + r < nq; ++r) {
      out[16 * h + r][0] = mx[r];
      out[16 * h + r][1] = sm[r];
    }
    // 5. probabilities -> A tiles [query][32 keys], hi + lo
    for (int64_t kb = 0; kb < blocks32; ++kb) {
      __m512 r0[16], r1[16], t0[16], t1[16];
      for (int j = 0; j < 16; ++j) {
        r0[j] = _mm512_load_ps(sc[kb * 32 + j][h]);
        r1[j] = _mm512_load_ps(sc[kb * 32 + 16 + j][h]);
      }
      transpose16(r0, t0);
      transpose16(r1, t1);
      for (int r = 0; r < 16; ++r) {
        __m512i vh, vl;
        split_bf16(t0[r], t1[r], vh, vl);
        _mm512_store_si512(pb[kb][h][0][r], vh);
        _mm512_store_si512(pb[kb][h][1][r], vl);
      }
    }
  }
  // 6. values: out tiles of 16 dims, four at a time (tmm0-3), keys in block order
  for (int64_t d0 = 0; d0 < D; d0 += 64) {
    const int nt = static_cast<int>(std::min<int64_t>(4, (D - d0) / 16));
    interleave_values(d0, nt);
    for (int h = 0; h < halves; ++h) {
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int64_t kb = 0; kb < blocks32; ++kb) {
        _tile_loadd(4, pb[kb][h][0], 64);
        _tile_loadd(5, pb[kb][h][1], 64);
        // one output tile each, the value B tile in tmm6 / tmm7 in turn
        NGRAMSPEC_PV_TILE(0, 6, vb[kb][0]);
        if (nt > 1) NGRAMSPEC_PV_TILE(1, 7, vb[kb][1]);
        if (nt > 2) NGRAMSPEC_PV_TILE(2, 6, vb[kb][2]);
        if (nt > 3) NGRAMSPEC_PV_TILE(3, 7, vb[kb][3]);
      }
      const int rows = std::min(16, nq - 16 * h);
      for (int t = 0; t < nt; ++t) {
        switch (t) { case 0: _tile_stored(0, ob, 64); break; case 1: _tile_stored(1, ob, 64); break;
                     case 2: _tile_stored(2, ob, 64); break; default: _tile_stored(3, ob, 64); break; }
        for (int r = 0; r < rows; ++r) std::memcpy(out[16 * h + r] + 2 + d0 + 16 * t, ob[r], 64);
      }
    }
  }
}

#endif

// Portable partial (any head size): the same chunking, scalar arithmetic, one query at a time.
template <typename T>
void chunk_partial_scalar(const Cache<T>& c, int64_t g, const float* qv, const KeyList& keys,
                          int64_t i0, int64_t i1, float scale, float* out) {
  float sc[kChunk];
  float mx = -INFINITY;
  for (int64_t i = i0; i < i1; ++i) {
    const T* k = c.krow(keys.slot(i), g);
    float acc = 0.0f;
    for (int64_t d = 0; d < c.D; ++d) acc = std::fma(qv[d], to_float(k[d]), acc);
    sc[i - i0] = acc * scale;
    mx = std::max(mx, sc[i - i0]);
  }
  float sum = 0.0f;
  float* acc = out + 2;
  for (int64_t d = 0; d < c.D; ++d) acc[d] = 0.0f;
  for (int64_t i = i0; i < i1; ++i) {
    const float p = std::exp(sc[i - i0] - mx);
    sum += p;
    const T* v = c.vrow(keys.slot(i), g);
    for (int64_t d = 0; d < c.D; ++d) acc[d] = std::fma(p, to_float(v[d]), acc[d]);
  }
  out[0] = mx;
  out[1] = sum;
}

// Whether a cache of dtype T and head size D runs on the AMX path (else AVX-512 / scalar). One
// answer per (dtype, head size, machine): a decode and a tree verify take the same path.
template <typename T>
bool use_amx(int64_t D) {
#if defined(NGRAMSPEC_AMX)
  return std::is_same_v<T, c10::BFloat16> && D % 32 == 0 && D <= 256 && ngramspec::amx_permitted();
#else
  (void)D;
  return false;
#endif
}

// The head sizes the vector paths (AVX-512, AVX2) run; others take the scalar partial.
constexpr bool vector_head(int64_t D) { return D == 16 || D == 32 || D == 64 || D == 128; }

// Whether the vector paths stage a chunk of head size D from a cache of dtype T. AVX2 reads a
// float32 cache's key rows as they are: nothing to stage.
template <typename T>
bool stages_run(int64_t D) {
#if defined(__AVX512F__) || NGRAMSPEC_AVX2
  return vector_head(D) && (!NGRAMSPEC_AVX2 || !std::is_same_v<T, float>);
#else
  (void)D;
  return false;
#endif
}

// Whether a stage also holds the values widened to float32. Not on AVX2, which widens a bf16
// cache's values as it reads them: float32 values are twice the bytes, and a chunk's would no
// longer fit in L1 for the value passes.
template <typename T>
constexpr bool stages_values() {
  return !std::is_same_v<T, float> && !NGRAMSPEC_AVX2;
}

#if defined(__AVX512F__) || NGRAMSPEC_AVX2
template <typename T, int ND>
void fill_stage(const Cache<T>& c, int64_t g, const KeyList& keys, int64_t i0, float* k, float* v) {
  constexpr int D = ND * 16;
  for (int64_t j0 = 0; j0 < kChunk; j0 += kKeyBlock) stage_keys<T, ND>(c, g, keys, i0, j0, kChunk, k + j0 * D);
  if (v == nullptr) return;
  for (int64_t j = 0; j < kChunk; ++j) {
    const T* r = c.vrow(keys.slot(i0 + j), g);
    for (int d = 0; d < D; ++d) v[j * D + d] = to_float(r[d]);
  }
}
#endif

// Stages the full chunk at list index i0 (kChunk keys): k [kChunk * D], v [kChunk * D] or
// nullptr (a float32 cache's rows serve as they are).
template <typename T>
void stage_chunk(const Cache<T>& c, int64_t g, const KeyList& keys, int64_t i0, float* k, float* v) {
#if defined(__AVX512F__) || NGRAMSPEC_AVX2
  switch (c.D) {
    case 64: return fill_stage<T, 4>(c, g, keys, i0, k, v);
    case 128: return fill_stage<T, 8>(c, g, keys, i0, k, v);
    case 16: return fill_stage<T, 1>(c, g, keys, i0, k, v);
    case 32: return fill_stage<T, 2>(c, g, keys, i0, k, v);
    default: break;
  }
#endif
  (void)c, (void)g, (void)keys, (void)i0, (void)k, (void)v;
}

// Chunk `chunk` of the key list for nq queries that share it; query q sees its first lens[q]
// keys (causal sharing, on the AMX and AVX2 paths; elsewhere every query sees the whole chunk).
// `st`: the chunk staged, or nullptr.
template <typename T>
void partials(const Cache<T>& c, int64_t g, const float* const* qs, const int64_t* lens, int nq,
              const KeyList& keys, int64_t chunk, float scale, bool amx, const Stage* st,
              float* const* out) {
  const int64_t i0 = chunk * kChunk, i1 = std::min(keys.L, i0 + kChunk);
#if defined(NGRAMSPEC_AMX)
  if constexpr (std::is_same_v<T, c10::BFloat16>)
    if (amx) return chunk_partial_amx(c, g, qs, lens, nq, keys, i0, i1 - i0, scale, out);
#endif
  (void)lens;
  (void)amx;
  (void)st;
#if defined(__AVX512F__) || NGRAMSPEC_AVX2
  const auto vector = [&](auto nd) {  // nd: std::integral_constant, the head size / 16
#if NGRAMSPEC_AVX2  // lengths per query (causal sharing)
    chunk_partial<T, decltype(nd)::value>(c, g, qs, lens, nq, keys, i0, i1, scale, st, out);
#else
    chunk_partial<T, decltype(nd)::value>(c, g, qs, nq, keys, i0, i1, scale, st, out);
#endif
  };
  switch (c.D) {
    case 64: return vector(std::integral_constant<int, 4>{});
    case 128: return vector(std::integral_constant<int, 8>{});
    case 16: return vector(std::integral_constant<int, 1>{});
    case 32: return vector(std::integral_constant<int, 2>{});
    default: break;
  }
#endif
  for (int q = 0; q < nq; ++q) chunk_partial_scalar<T>(c, g, qs[q], keys, i0, i1, scale, out[q]);
}

template <typename T>
void write_rows(const torch::Tensor& src, torch::Tensor& cache, const int64_t* slots) {
  const int64_t n = src.size(0), row = src.size(1) * src.size(2);
  const torch::Tensor rows = src.to(cache.scalar_type()).reshape({n, row}).contiguous();
  const T* s = rows.data_ptr<T>();
  T* c = cache.data_ptr<T>();
  for (int64_t i = 0; i < n; ++i) std::memcpy(c + slots[i] * row, s + i * row, row * sizeof(T));
}

// A work item: chunk `chunk` of the key list of up to kMaxQ queries (token, head) of kv head
// `group` that share it: all of a sequence's tokens for a chunk inside its prefix; in a causal
// chunk, the tokens whose lists cover the chunk (on the AMX path: every token that reaches into
// it, each seeing its own length); else one token's heads for a chunk that reaches its own query
// tokens.
struct Item {
  int64_t chunk, group, list_token;  // list_token: the longest key list of the item's tokens
  int nq;
  int64_t tokens[kMaxQ], heads[kMaxQ];
  bool shared = false;  // its tokens' lists agree over the chunk (each up to its own length)
  int64_t stage = -1;   // the chunk's stage (run's `stages`), or none
};

// Batches of queries sharing a chunk from which staging it pays: a few batches (a draft tree's
// 8 tokens) read their keys faster from the cache than from a stage written for them.
constexpr int kStageFrom = 4;

// A chunk to stage before the items run: kv head `group`, keys [i0, i0 + kChunk) of `keys`.
struct StageAt {
  int64_t group;
  const KeyList* keys;
  int64_t i0;
};

template <typename T>
torch::Tensor run(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                  torch::Tensor& kc, torch::Tensor& vc, const torch::Tensor& slot_mapping,
                  const torch::Tensor& seq_offsets, const torch::Tensor& prefix,
                  const torch::Tensor& prefix_offsets, const torch::Tensor& local,
                  const torch::Tensor& local_offsets, const torch::Tensor& causal, double scale) {
  const int64_t Tq = q.size(0), H = q.size(1), D = q.size(2), KVH = kc.size(1), G = H / KVH;
  const bool amx = use_amx<T>(D);
  const int max_q = amx ? kMaxQ : kMaxQVector;
  write_rows<T>(k, kc, slot_mapping.data_ptr<int64_t>());
  write_rows<T>(v, vc, slot_mapping.data_ptr<int64_t>());
  torch::Tensor out = torch::empty({Tq, H * D}, q.options().dtype(torch::kFloat));
  const int64_t B = seq_offsets.size(0) - 1;
  const int64_t* so = seq_offsets.data_ptr<int64_t>();
  TORCH_CHECK(so[0] == 0 && so[B] <= Tq, "paged_attention: sequences must cover query rows 0..");
  const int64_t* po = prefix_offsets.data_ptr<int64_t>();
  const int64_t* lo = local_offsets.data_ptr<int64_t>();
  const int64_t* pre = prefix.data_ptr<int64_t>();
  const int64_t* loc = local.data_ptr<int64_t>();
  const int64_t* cz = causal.data_ptr<int64_t>();
  // Per token: its key list, its number of chunks and where its partials start.
  std::vector<KeyList> lists(Tq);
  std::vector<int64_t> base(Tq + 1, 0);
  std::vector<Item> items;
  const bool staging = !amx && stages_run<T>(D);
  // Whether a causal chunk's tokens share a pass over a chunk they reach only part of, each with
  // its own length: the AMX path, and AVX2's vector path (partials()).
  const bool partial_sharing = amx || (NGRAMSPEC_AVX2 && vector_head(D));
  std::vector<StageAt> stages;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t P = po[b + 1] - po[b];
    int64_t most = 0;
    const int64_t* sm = slot_mapping.data_ptr<int64_t>() + so[b];
    for (int64_t t = so[b]; t < so[b + 1]; ++t) {
      // a causal chunk's token sees the chunk's slots up to itself: derived, not listed
      lists[t] = cz[b] ? KeyList{pre + po[b], P, sm, P + t - so[b] + 1}
                       : KeyList{pre + po[b], P, loc + lo[t], P + lo[t + 1] - lo[t]};
      const int64_t chunks = (lists[t].L + kChunk - 1) / kChunk;
      base[t + 1] = base[t] + chunks;
      most = std::max(most, chunks);
    }
    // chunk-major, so a thread's consecutive items reuse the same keys from cache
    for (int64_t c = 0; c < most; ++c) {
      for (int64_t g = 0; g < KVH; ++g) {
        const size_t first = items.size();
        Item it{c, g, so[b], 0, {}, {}};
        auto flush = [&]() { if (it.nq) { items.push_back(it); it.nq = 0; } };
        for (int64_t t = so[b]; t < so[b + 1]; ++t) {
          if (c >= base[t + 1] - base[t]) continue;
          // Tokens whose lists agree over the chunk share it: inside the prefix, and in a causal
          // chunk (each token's list extends the previous token's) wherever the token's list
          // covers the chunk, or with partial sharing wherever it reaches into it (lengths per
          // query).
          const bool shared = cz[b] ? partial_sharing || (c + 1) * kChunk <= lists[t].L : (c + 1) * kChunk <= P;
          if (!shared) flush();
          it.shared = shared;
          for (int64_t h = g * G; h < (g + 1) * G; ++h) {
            it.list_token = t;  // tokens come in order: in a causal chunk, the longest list last
            it.tokens[it.nq] = t;
            it.heads[it.nq++] = h;
            if (it.nq == max_q) flush();
          }
          if (!shared) flush();
        }
        flush();
        // Many batches of queries over the same full chunk: stage it once for them (a stage holds
        // the whole chunk, so only items whose longest list covers it read one).
        const auto full = [&](const Item& i) { return i.shared && (c + 1) * kChunk <= lists[i.list_token].L; };
        const auto shared_from = std::find_if(items.begin() + first, items.end(), full);
        if (staging && std::count_if(shared_from, items.end(), full) >= kStageFrom) {
          for (auto i = shared_from; i != items.end(); ++i)
            if (full(*i)) i->stage = static_cast<int64_t>(stages.size());
          stages.push_back({g, &lists[shared_from->list_token], c * kChunk});
        }
      }
    }
  }
  // Tokens past the last sequence (a CUDA-graph step's padding, engine/cuda_graphs.py) belong to
  // none: no chunks, and their rows come out as zeros.
  for (int64_t t = so[B]; t < Tq; ++t) base[t + 1] = base[t];
  // queries as float32, each [D]
  torch::Tensor qf = q.to(torch::kFloat).contiguous();
  const float* qp = qf.data_ptr<float>();
  const int64_t stride = D + 2;
  // every (token, head, chunk) partial is written by its item before the merge reads it, so the
  // buffer (megabytes for a prefill chunk) is not zeroed first
  const std::unique_ptr<float[]> parts(new float[static_cast<size_t>(base[Tq] * H * stride)]);
  const Cache<T> cache{kc.data_ptr<T>(), vc.data_ptr<T>(), KVH, D};
  const float sc = static_cast<float>(scale);
  auto part_of = [&](int64_t t, int64_t h, int64_t c) {
    return parts.get() + ((base[t] + c) * H + h) * stride;
  };
  // The staged chunks, 64-byte aligned (the key blocks are read with aligned loads).
  constexpr bool widen = stages_values<T>();
  const int64_t span = kChunk * D, n_stages = static_cast<int64_t>(stages.size());
  const std::unique_ptr<float[]> stage_mem(
      n_stages ? new float[static_cast<size_t>(n_stages * span * (widen ? 2 : 1) + 16)] : nullptr);
  float* const at = n_stages ? stage_mem.get() + (-reinterpret_cast<uintptr_t>(stage_mem.get()) / sizeof(float)) % 16
                             : nullptr;
  auto k_of = [&](int64_t i) { return at + i * span; };
  auto v_of = [&](int64_t i) { return widen ? at + (n_stages + i) * span : nullptr; };
  at::parallel_for(0, n_stages, 1, [&](int64_t s0, int64_t s1) {
    for (int64_t i = s0; i < s1; ++i) stage_chunk<T>(cache, stages[i].group, *stages[i].keys, stages[i].i0, k_of(i), v_of(i));
  });
  std::vector<Stage> staged(stages.size());
  for (int64_t i = 0; i < n_stages; ++i) staged[i] = {k_of(i), v_of(i)};
  // Items differ in cost (a shared prefix chunk of 32 queries vs a tree token's few own keys), so
  // threads take them one at a time in order (chunk-major: neighbours share keys) rather than in
  // fixed ranges. Which thread computes an item does not change its numbers.
  std::atomic<int64_t> next{0};
  const int64_t n_items = static_cast<int64_t>(items.size());
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), std::max<int64_t>(n_items, 1));
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
#if defined(NGRAMSPEC_AMX)
    if (amx) configure_attention_tiles();
#endif
    for (int64_t i = next.fetch_add(1); i < n_items; i = next.fetch_add(1)) {
      const Item& it = items[i];
      const float* qs[kMaxQ];
      float* outs[kMaxQ];
      int64_t lens[kMaxQ];
      for (int q = 0; q < it.nq; ++q) {
        qs[q] = qp + (it.tokens[q] * H + it.heads[q]) * D;
        outs[q] = part_of(it.tokens[q], it.heads[q], it.chunk);
        lens[q] = std::min(lists[it.tokens[q]].L - it.chunk * kChunk, kChunk);
      }
      partials<T>(cache, it.group, qs, lens, it.nq, lists[it.list_token], it.chunk, sc, amx,
                  it.stage >= 0 ? &staged[it.stage] : nullptr, outs);
    }
#if defined(NGRAMSPEC_AMX)
    if (amx) _tile_release();
#endif
  });
  // merge each query's chunk partials in chunk order
  float* op = out.data_ptr<float>();
  at::parallel_for(0, Tq * H, 16, [&](int64_t i0, int64_t i1) {
    std::vector<float> acc(D);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t t = i / H, h = i % H, chunks = base[t + 1] - base[t];
      float mx = -INFINITY;
      for (int64_t c = 0; c < chunks; ++c) mx = std::max(mx, part_of(t, h, c)[0]);
      float sum = 0.0f;
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t c = 0; c < chunks; ++c) {
        const float* p = part_of(t, h, c);
        const float w = std::exp(p[0] - mx);
        sum = std::fma(w, p[1], sum);
        for (int64_t d = 0; d < D; ++d) acc[d] = std::fma(w, p[2 + d], acc[d]);
      }
      const float inv = chunks > 0 ? 1.0f / sum : 0.0f;
      for (int64_t d = 0; d < D; ++d) op[t * H * D + h * D + d] = acc[d] * inv;
    }
  });
  return out.to(q.scalar_type());
}

}  // namespace

// q: [T, H, D]; k, v: [T, KVH, D] (written to the caches at slot_mapping first);
// k_cache, v_cache: [S, KVH, D]; query tokens of sequence b are rows [seq_offsets[b],
// seq_offsets[b + 1]); its prefix slots prefix[prefix_offsets[b] : prefix_offsets[b + 1]];
// token t's own visible slots local[local_offsets[t] : local_offsets[t + 1]], except where
// causal[b] != 0 (a prefill chunk or a decode): then token t sees b's query slots up to itself
// (slot_mapping[seq_offsets[b] .. t]) and its local list is not read. -> [T, H * D]
torch::Tensor paged_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                              torch::Tensor k_cache, torch::Tensor v_cache,
                              const torch::Tensor& slot_mapping, const torch::Tensor& seq_offsets,
                              const torch::Tensor& prefix, const torch::Tensor& prefix_offsets,
                              const torch::Tensor& local, const torch::Tensor& local_offsets,
                              const torch::Tensor& causal, double scale) {
  for (const torch::Tensor* t : {&q, &k, &v, static_cast<const torch::Tensor*>(&k_cache),
                                 static_cast<const torch::Tensor*>(&v_cache)})
    TORCH_CHECK(t->device().is_cpu() && t->dim() == 3 && t->stride(2) == 1 &&
                    t->stride(1) == t->size(2) &&
                    (t->scalar_type() == torch::kFloat || t->scalar_type() == torch::kBFloat16),
                "paged_attention: q, k, v and the caches must be 3-D float32/bfloat16 CPU tensors, "
                "each row's heads contiguous");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "paged_attention: K and V caches differ in dtype");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "paged_attention: caches must be contiguous");
  for (const torch::Tensor* t : {&slot_mapping, &seq_offsets, &prefix, &prefix_offsets, &local,
                                 &local_offsets, &causal})
    TORCH_CHECK(t->scalar_type() == torch::kLong && t->is_contiguous(),
                "paged_attention: index tensors must be contiguous int64");
  TORCH_CHECK(q.size(2) <= 256 && q.size(1) % k_cache.size(1) == 0,
              "paged_attention: head_dim <= 256 and heads a multiple of kv heads");
  TORCH_CHECK(local_offsets.size(0) == q.size(0) + 1 && slot_mapping.size(0) == q.size(0),
              "paged_attention: one slot and one local list per query token");
  TORCH_CHECK(causal.size(0) == seq_offsets.size(0) - 1, "paged_attention: one causal flag a sequence");
  // T is the cache's dtype; queries are read as float32 and the output has q's dtype
  if (k_cache.scalar_type() == torch::kFloat)
    return run<float>(q, k, v, k_cache, v_cache, slot_mapping, seq_offsets, prefix,
                      prefix_offsets, local, local_offsets, causal, scale);
  return run<c10::BFloat16>(q, k, v, k_cache, v_cache, slot_mapping, seq_offsets, prefix,
                            prefix_offsets, local, local_offsets, causal, scale);
}
