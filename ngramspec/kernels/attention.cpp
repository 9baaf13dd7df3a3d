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

#if defined(__AVX512F__)

// r[j] = sum of the 16 lanes of a[j], for 16 vectors at once (a transpose-add tree).
inline __m512 hsum16(__m512* a) {
  __m512 b[8], c[4], d[2];
  for (int i = 0; i < 8; ++i)
    b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]),
                         _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  for (int i = 0; i < 4; ++i)
    c[i] = _mm512_add_ps(_mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0x44),
                         _mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0xEE));
  for (int i = 0; i < 2; ++i)
    d[i] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(d[0], d[1], 0x88), _mm512_shuffle_f32x4(d[0], d[1], 0xDD));
}

// Partial softmax attention of one query (ND * 16 dims) over list indices [i0, i1), i0 % 16 == 0:
// out = [max, sum, acc[0 .. D)] with acc = sum_i exp(s_i - max) v_i.
template <typename T, int ND>
void chunk_partial(const Cache<T>& c, int64_t g, const float* qv, const KeyList& keys, int64_t i0,
                   int64_t i1, float scale, float* out) {
  __m512 q[ND];
  for (int d = 0; d < ND; ++d) q[d] = _mm512_loadu_ps(qv + 16 * d);
  alignas(64) float sc[kChunk];
  const int64_t n = i1 - i0;
  __m512 vmax = _mm512_set1_ps(-INFINITY);
  for (int64_t j0 = 0; j0 < n; j0 += 16) {
    const int64_t nk = std::min<int64_t>(16, n - j0);
    __m512 acc[16];
    for (int j = 0; j < 16; ++j) {
      acc[j] = _mm512_setzero_ps();
      if (j < nk) {
        const T* k = c.krow(keys.slot(i0 + j0 + j), g);
        for (int d = 0; d < ND; ++d) acc[j] = _mm512_fmadd_ps(q[d], load16(k + 16 * d), acc[j]);
      }
    }
    const __mmask16 m = static_cast<__mmask16>(nk == 16 ? 0xFFFF : (1u << nk) - 1);
    const __m512 s = _mm512_mul_ps(hsum16(acc), _mm512_set1_ps(scale));
    _mm512_store_ps(sc + j0, s);
    vmax = _mm512_mask_max_ps(vmax, m, vmax, s);
  }
  const float mx = _mm512_reduce_max_ps(vmax);
  const __m512 vmx = _mm512_set1_ps(mx);
  __m512 vsum = _mm512_setzero_ps();
  for (int64_t j0 = 0; j0 < n; j0 += 16) {
    const int64_t nk = std::min<int64_t>(16, n - j0);
    const __mmask16 m = static_cast<__mmask16>(nk == 16 ? 0xFFFF : (1u << nk) - 1);
    const __m512 e = _mm512_maskz_mov_ps(m, ngramspec::exp16(_mm512_sub_ps(_mm512_load_ps(sc + j0), vmx)));
    _mm512_store_ps(sc + j0, e);
    vsum = _mm512_add_ps(vsum, e);
  }
  __m512 acc[ND];
  for (int d = 0; d < ND; ++d) acc[d] = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; ++j) {
    const T* v = c.vrow(keys.slot(i0 + j), g);
    const __m512 p = _mm512_set1_ps(sc[j]);
    for (int d = 0; d < ND; ++d) acc[d] = _mm512_fmadd_ps(p, load16(v + 16 * d), acc[d]);
  }
  out[0] = mx;
  out[1] = _mm512_reduce_add_ps(vsum);
  for (int d = 0; d < ND; ++d) _mm512_storeu_ps(out + 2 + 16 * d, acc[d]);
}

#endif

// Portable partial (any head size): the same chunking, scalar arithmetic.
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

template <typename T>
void partial(const Cache<T>& c, int64_t g, const float* qv, const KeyList& keys, int64_t chunk,
             float scale, float* out) {
  const int64_t i0 = chunk * kChunk, i1 = std::min(keys.L, i0 + kChunk);
#if defined(__AVX512F__)
  switch (c.D) {
    case 64: return chunk_partial<T, 4>(c, g, qv, keys, i0, i1, scale, out);
    case 128: return chunk_partial<T, 8>(c, g, qv, keys, i0, i1, scale, out);
    case 16: return chunk_partial<T, 1>(c, g, qv, keys, i0, i1, scale, out);
    case 32: return chunk_partial<T, 2>(c, g, qv, keys, i0, i1, scale, out);
    default: break;
  }
#endif
  chunk_partial_scalar<T>(c, g, qv, keys, i0, i1, scale, out);
}

// The step's K/V rows into the cache, converted to the cache's dtype (round to nearest even).
template <typename T>
void write_rows(const torch::Tensor& src, torch::Tensor& cache, const int64_t* slots) {
  const int64_t n = src.size(0), row = src.size(1) * src.size(2);
  const torch::Tensor rows = src.to(cache.scalar_type()).reshape({n, row}).contiguous();
  const T* s = rows.data_ptr<T>();
  T* c = cache.data_ptr<T>();
  for (int64_t i = 0; i < n; ++i) std::memcpy(c + slots[i] * row, s + i * row, row * sizeof(T));
}

struct Item {
  int64_t token, chunk, group;
};

template <typename T>
torch::Tensor run(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                  torch::Tensor& kc, torch::Tensor& vc, const torch::Tensor& slot_mapping,
                  const torch::Tensor& seq_offsets, const torch::Tensor& prefix,
                  const torch::Tensor& prefix_offsets, const torch::Tensor& local,
                  const torch::Tensor& local_offsets, double scale) {
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
  // Per token: its key list, its number of chunks and where its partials start.
  std::vector<KeyList> lists(Tq);
  std::vector<int64_t> base(Tq + 1, 0);
  std::vector<Item> items;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t P = po[b + 1] - po[b];
    int64_t most = 0;
    for (int64_t t = so[b]; t < so[b + 1]; ++t) {
      lists[t] = {pre + po[b], P, loc + lo[t], P + lo[t + 1] - lo[t]};
      const int64_t chunks = (lists[t].L + kChunk - 1) / kChunk;
      base[t + 1] = base[t] + chunks;
      most = std::max(most, chunks);
    }
    // chunk-major, so a thread's consecutive items reuse the same keys from cache; equal-sized
    // items, so parallel_for's even split is an even split of the work
    for (int64_t c = 0; c < most; ++c)
      for (int64_t t = so[b]; t < so[b + 1]; ++t)
        if (c < base[t + 1] - base[t])
          for (int64_t g = 0; g < KVH; ++g) items.push_back({t, c, g});
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
      const int64_t t = it.token;
      for (int64_t h = it.group * G; h < (it.group + 1) * G; ++h)
        partial<T>(cache, it.group, qp + (t * H + h) * D, lists[t], it.chunk, sc, part_of(t, h, it.chunk));
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
// token t's own visible slots local[local_offsets[t] : local_offsets[t + 1]]. -> [T, H * D]
torch::Tensor paged_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                              torch::Tensor k_cache, torch::Tensor v_cache,
                              const torch::Tensor& slot_mapping, const torch::Tensor& seq_offsets,
                              const torch::Tensor& prefix, const torch::Tensor& prefix_offsets,
                              const torch::Tensor& local, const torch::Tensor& local_offsets,
                              double scale) {
  for (const torch::Tensor* t : {&q, &k, &v, static_cast<const torch::Tensor*>(&k_cache),
                                 static_cast<const torch::Tensor*>(&v_cache)})
    TORCH_CHECK(t->device().is_cpu() && t->dim() == 3 && t->stride(2) == 1 &&
                    t->stride(1) == t->size(2) &&
                    (t->scalar_type() == torch::kFloat32 || t->scalar_type() == torch::kBFloat16),
                "paged_attention: q, k, v and the caches must be 3-D float32/bfloat16 CPU tensors, "
                "each row's heads contiguous");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "paged_attention: K and V caches differ in dtype");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "paged_attention: caches must be contiguous");
  for (const torch::Tensor* t : {&slot_mapping, &seq_offsets, &prefix, &prefix_offsets, &local, &local_offsets})
    TORCH_CHECK(t->scalar_type() == torch::kLong && t->is_contiguous(),
                "paged_attention: index tensors must be contiguous int64");
  TORCH_CHECK(q.size(2) <= 256 && q.size(1) % k_cache.size(1) == 0,
              "paged_attention: head_dim <= 256 and heads a multiple of kv heads");
  TORCH_CHECK(local_offsets.size(0) == q.size(0) + 1 && slot_mapping.size(0) == q.size(0),
              "paged_attention: one slot and one local list per query token");
  // T is the cache's dtype; queries are read as float32 and the output has q's dtype
  if (k_cache.scalar_type() == torch::kFloat32)
    return run<float>(q, k, v, k_cache, v_cache, slot_mapping, seq_offsets, prefix,
                      prefix_offsets, local, local_offsets, scale);
  return run<c10::BFloat16>(q, k, v, k_cache, v_cache, slot_mapping, seq_offsets, prefix,
                            prefix_offsets, local, local_offsets, scale);
}
