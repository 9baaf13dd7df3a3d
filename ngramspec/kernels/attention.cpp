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

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

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

constexpr int kMaxQ = 8;  // queries sharing one pass over a chunk's keys

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

// Partial softmax attention of nq <= kMaxQ queries (ND * 16 dims each) over the same list
// indices [i0, i1) (i0 % 16 == 0): out[n] = [max, sum, acc[0 .. D)], acc = sum_i exp(s_i - max) v_i.
// Keys go through in transposed 16-key blocks, so a score is one FMA chain over the dims in
// order, and every block's key loads serve all nq queries. A query's numbers do not depend on nq.
template <typename T, int ND>
void chunk_partial(const Cache<T>& c, int64_t g, const float* const* qs, int nq, const KeyList& keys,
                   int64_t i0, int64_t i1, float scale, float* const* out) {
  constexpr int D = ND * 16;
  alignas(64) float sc[kMaxQ][kChunk];
  alignas(64) float kt[D * 16];  // [D][16 keys]
  const int64_t n = i1 - i0;
  for (int64_t j0 = 0; j0 < n; j0 += 16) {
    const int64_t nk = std::min<int64_t>(16, n - j0);
    for (int d = 0; d < ND; ++d) {
      __m512 rows[16], cols[16];
      for (int j = 0; j < 16; ++j)
        rows[j] = j < nk ? load16(c.krow(keys.slot(i0 + j0 + j), g) + 16 * d) : _mm512_setzero_ps();
      transpose16(rows, cols);
      for (int e = 0; e < 16; ++e) _mm512_store_ps(kt + (16 * d + e) * 16, cols[e]);
    }
    __m512 acc[kMaxQ];
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
      const T* v = c.vrow(keys.slot(i0 + j), g);
      __m512 vv[ND];
      for (int d = 0; d < ND; ++d) vv[d] = load16(v + 16 * d);
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

// Chunk `chunk` of the key list for nq queries that share it.
template <typename T>
void partials(const Cache<T>& c, int64_t g, const float* const* qs, int nq, const KeyList& keys,
              int64_t chunk, float scale, float* const* out) {
  const int64_t i0 = chunk * kChunk, i1 = std::min(keys.L, i0 + kChunk);
#if defined(__AVX512F__)
  switch (c.D) {
    case 64: return chunk_partial<T, 4>(c, g, qs, nq, keys, i0, i1, scale, out);
    case 128: return chunk_partial<T, 8>(c, g, qs, nq, keys, i0, i1, scale, out);
    case 16: return chunk_partial<T, 1>(c, g, qs, nq, keys, i0, i1, scale, out);
    case 32: return chunk_partial<T, 2>(c, g, qs, nq, keys, i0, i1, scale, out);
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
// `group` that share it: all of a sequence's tokens for a chunk inside its prefix, one token's
// heads for a chunk that reaches its own query tokens.
struct Item {
  int64_t chunk, group, list_token;  // list_token: whose key list (the same over the chunk)
  int nq;
  int64_t tokens[kMaxQ], heads[kMaxQ];
};

template <typename T>
torch::Tensor run(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                  torch::Tensor& kc, torch::Tensor& vc, const torch::Tensor& slot_mapping,
                  const torch::Tensor& seq_offsets, const torch::Tensor& prefix,
                  const torch::Tensor& prefix_offsets, const torch::Tensor& local,
                  const torch::Tensor& local_offsets, const torch::Tensor& causal, double scale) {
  const int64_t Tq = q.size(0), H = q.size(1), D = q.size(2), KVH = kc.size(1), G = H / KVH;
  write_rows<T>(k, kc, slot_mapping.data_ptr<int64_t>());
  write_rows<T>(v, vc, slot_mapping.data_ptr<int64_t>());
  torch::Tensor out = torch::empty({Tq, H * D}, q.options().dtype(torch::kFloat32));
  const int64_t B = seq_offsets.size(0) - 1;
  const int64_t* so = seq_offsets.data_ptr<int64_t>();
  const int64_t* po = prefix_offsets.data_ptr<int64_t>();
  const int64_t* lo = local_offsets.data_ptr<int64_t>();
  const int64_t* pre = prefix.data_ptr<int64_t>();
  const int64_t* loc = local.data_ptr<int64_t>();
  const int64_t* cz = causal.data_ptr<int64_t>();
  // Per token: its key list, its number of chunks and where its partials start.
  std::vector<KeyList> lists(Tq);
  std::vector<int64_t> base(Tq + 1, 0);
  std::vector<Item> items;
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
        Item it{c, g, so[b], 0, {}, {}};
        auto flush = [&]() { if (it.nq) { items.push_back(it); it.nq = 0; } };
        for (int64_t t = so[b]; t < so[b + 1]; ++t) {
          if (c >= base[t + 1] - base[t]) continue;
          // Tokens whose lists agree over the whole chunk share it: inside the prefix, and in a
          // causal chunk (each token's local slots extend the previous token's) wherever the
          // token's list covers the chunk.
          const bool shared = (c + 1) * kChunk <= (cz[b] ? lists[t].L : P);
          if (!shared) flush();
          if (it.nq == 0) it.list_token = t;  // a token whose list covers the chunk
          for (int64_t h = g * G; h < (g + 1) * G; ++h) {
            it.tokens[it.nq] = t;
            it.heads[it.nq++] = h;
            if (it.nq == kMaxQ) flush();
          }
          if (!shared) flush();
        }
        flush();
      }
    }
  }
  // queries as float32, each [D]
  torch::Tensor qf = q.to(torch::kFloat32).contiguous();
  const float* qp = qf.data_ptr<float>();
  const int64_t stride = D + 2;
  std::vector<float> parts(static_cast<size_t>(base[Tq] * H * stride));
  const Cache<T> cache{kc.data_ptr<T>(), vc.data_ptr<T>(), KVH, D};
  const float sc = static_cast<float>(scale);
  auto part_of = [&](int64_t t, int64_t h, int64_t c) {
    return parts.data() + ((base[t] + c) * H + h) * stride;
  };
  at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const Item& it = items[i];
      const float* qs[kMaxQ];
      float* outs[kMaxQ];
      for (int q = 0; q < it.nq; ++q) {
        qs[q] = qp + (it.tokens[q] * H + it.heads[q]) * D;
        outs[q] = part_of(it.tokens[q], it.heads[q], it.chunk);
      }
      partials<T>(cache, it.group, qs, it.nq, lists[it.list_token], it.chunk, sc, outs);
    }
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
      const float inv = 1.0f / sum;
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
                    (t->scalar_type() == torch::kFloat32 || t->scalar_type() == torch::kBFloat16),
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
  if (k_cache.scalar_type() == torch::kFloat32)
    return run<float>(q, k, v, k_cache, v_cache, slot_mapping, seq_offsets, prefix,
                      prefix_offsets, local, local_offsets, causal, scale);
  return run<c10::BFloat16>(q, k, v, k_cache, v_cache, slot_mapping, seq_offsets, prefix,
                            prefix_offsets, local, local_offsets, causal, scale);
}
