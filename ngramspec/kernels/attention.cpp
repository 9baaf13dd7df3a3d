// Attention over the token-granular KV cache, read in place, for decodes, prefill chunks and
// draft trees alike (CPU).
//
// Each query token attends to an ordered key list: its sequence's cached prefix (shared by all of
// that sequence's query tokens) followed by its own visible query tokens (itself, and for a tree
// node its ancestors). No gather into a padded copy, no [queries x context] mask.
//
// Batch invariance: a query's output depends only on its ordered key list, computed with one
// fixed instruction sequence per (query, key) and one fixed reduction order over the list (score
// j goes to lane j % 16 of the softmax sum; values accumulate in key order). A token decoded alone
// and the same token inside a draft tree see the same list (prefix + tree ancestors, in position
// order), so they get bitwise-equal outputs: speculation is lossless in every dtype.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "vec_math.h"

namespace {

constexpr int kTile = 4;  // query tokens of one sequence sharing each key load

template <typename T>
inline float to_float(T v) { return static_cast<float>(v); }

#if defined(__AVX512F__)

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

#endif

// One (sequence, query head) work item's state, reused across items on a thread.
struct Scratch {
  std::vector<float> scores;  // [kTile, L]
};

template <typename T>
struct Args {
  const T* q;        // [Tq, H, D], rows q_stride apart
  int64_t q_stride;
  const T* kc;       // [S, KVH, D]
  const T* vc;
  T* out;            // [Tq, H * D]
  int64_t H, KVH, D;
  const int64_t* prefix;  // this sequence's prefix slots
  int64_t P;
  const int64_t* local;          // [N] all tokens' local slots
  const int64_t* local_offsets;  // [Tq + 1]
  float scale;
};

// Score of query row (t, h) against cache slot s.
template <typename T>
inline float dot(const Args<T>& a, const float* qv, int64_t s, int64_t g) {
  const T* k = a.kc + (s * a.KVH + g) * a.D;
#if defined(__AVX512F__)
  if (a.D % 16 == 0) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t d = 0; d < a.D; d += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(qv + d), load16(k + d), acc);
    return _mm512_reduce_add_ps(acc) * a.scale;
  }
#endif
  float acc = 0.0f;
  for (int64_t d = 0; d < a.D; ++d) acc = std::fma(qv[d], to_float(k[d]), acc);
  return acc * a.scale;
}

// softmax over scores[0, L) in place; returns 1 / sum.
inline float softmax_inplace(float* s, int64_t L) {
  float mx = -INFINITY;
  for (int64_t j = 0; j < L; ++j) mx = std::max(mx, s[j]);
#if defined(__AVX512F__)
  const __m512 vmx = _mm512_set1_ps(mx);
  __m512 vsum = _mm512_setzero_ps();
  int64_t j = 0;
  for (; j + 16 <= L; j += 16) {
    const __m512 e = ngramspec::exp16(_mm512_sub_ps(_mm512_loadu_ps(s + j), vmx));
    _mm512_storeu_ps(s + j, e);
    vsum = _mm512_add_ps(vsum, e);
  }
  if (j < L) {
    const __mmask16 m = static_cast<__mmask16>((1u << (L - j)) - 1);
    const __m512 e = ngramspec::exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, s + j), vmx));
    _mm512_mask_storeu_ps(s + j, m, e);
    vsum = _mm512_add_ps(vsum, _mm512_maskz_mov_ps(m, e));
  }
  return 1.0f / _mm512_reduce_add_ps(vsum);
#else
  float lanes[16] = {0};
  for (int64_t j = 0; j < L; ++j) {
    s[j] = std::exp(s[j] - mx);
    lanes[j % 16] += s[j];
  }
  float sum = 0;
  for (int i = 0; i < 16; ++i) sum += lanes[i];
  return 1.0f / sum;
#endif
}

// acc[0, D) += p * v[slot]
template <typename T>
inline void axpy(const Args<T>& a, float p, int64_t s, int64_t g, float* acc) {
  const T* v = a.vc + (s * a.KVH + g) * a.D;
#if defined(__AVX512F__)
  if (a.D % 16 == 0) {
    const __m512 vp = _mm512_set1_ps(p);
    for (int64_t d = 0; d < a.D; d += 16)
      _mm512_storeu_ps(acc + d, _mm512_fmadd_ps(vp, load16(v + d), _mm512_loadu_ps(acc + d)));
    return;
  }
#endif
  for (int64_t d = 0; d < a.D; ++d) acc[d] = std::fma(p, to_float(v[d]), acc[d]);
}

// Query rows [t0, t1) of one sequence (t1 - t0 <= kTile), head h.
template <typename T>
void attend_tile(const Args<T>& a, int64_t t0, int64_t t1, int64_t h, Scratch& scratch) {
  const int64_t g = h / (a.H / a.KVH), n = t1 - t0;
  int64_t max_local = 0;
  for (int64_t t = t0; t < t1; ++t)
    max_local = std::max(max_local, a.local_offsets[t + 1] - a.local_offsets[t]);
  const int64_t width = a.P + max_local;
  scratch.scores.resize(static_cast<size_t>(kTile * width));
  float qv[kTile][256], acc[kTile][256];
  for (int64_t i = 0; i < n; ++i) {
    const T* q = a.q + (t0 + i) * a.q_stride + h * a.D;
    for (int64_t d = 0; d < a.D; ++d) {
      qv[i][d] = to_float(q[d]);
      acc[i][d] = 0.0f;
    }
  }
  float* sc = scratch.scores.data();
  for (int64_t j = 0; j < a.P; ++j)  // shared prefix: each key row is read once for the tile
    for (int64_t i = 0; i < n; ++i) sc[i * width + j] = dot(a, qv[i], a.prefix[j], g);
  float inv[kTile];
  for (int64_t i = 0; i < n; ++i) {
    const int64_t lo = a.local_offsets[t0 + i], hi = a.local_offsets[t0 + i + 1];
    for (int64_t j = lo; j < hi; ++j) sc[i * width + a.P + (j - lo)] = dot(a, qv[i], a.local[j], g);
    inv[i] = softmax_inplace(sc + i * width, a.P + hi - lo);
  }
  for (int64_t j = 0; j < a.P; ++j)
    for (int64_t i = 0; i < n; ++i) axpy(a, sc[i * width + j], a.prefix[j], g, acc[i]);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t lo = a.local_offsets[t0 + i], hi = a.local_offsets[t0 + i + 1];
    for (int64_t j = lo; j < hi; ++j) axpy(a, sc[i * width + a.P + (j - lo)], a.local[j], g, acc[i]);
    T* o = a.out + (t0 + i) * a.H * a.D + h * a.D;
    for (int64_t d = 0; d < a.D; ++d) o[d] = static_cast<T>(acc[i][d] * inv[i]);
  }
}

template <typename T>
void write_rows(const torch::Tensor& src, torch::Tensor& cache, const int64_t* slots) {
  const int64_t n = src.size(0), row = src.size(1) * src.size(2), ld = src.stride(0);
  const T* s = src.data_ptr<T>();
  T* c = cache.data_ptr<T>();
  for (int64_t i = 0; i < n; ++i) std::memcpy(c + slots[i] * row, s + i * ld, row * sizeof(T));
}

template <typename T>
torch::Tensor run(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                  torch::Tensor& kc, torch::Tensor& vc, const torch::Tensor& slot_mapping,
                  const torch::Tensor& seq_offsets, const torch::Tensor& prefix,
                  const torch::Tensor& prefix_offsets, const torch::Tensor& local,
                  const torch::Tensor& local_offsets, double scale) {
  const int64_t Tq = q.size(0), H = q.size(1), D = q.size(2), KVH = kc.size(1);
  write_rows<T>(k, kc, slot_mapping.data_ptr<int64_t>());
  write_rows<T>(v, vc, slot_mapping.data_ptr<int64_t>());
  torch::Tensor out = torch::empty({Tq, H * D}, q.options());
  const int64_t B = seq_offsets.size(0) - 1;
  const int64_t* so = seq_offsets.data_ptr<int64_t>();
  const int64_t* po = prefix_offsets.data_ptr<int64_t>();
  // Work items: (sequence, tile of its query tokens, head).
  std::vector<int64_t> item_seq, item_t0;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = so[b]; t < so[b + 1]; t += kTile) {
      item_seq.push_back(b);
      item_t0.push_back(t);
    }
  const int64_t items = static_cast<int64_t>(item_seq.size()) * H;
  at::parallel_for(0, items, 1, [&](int64_t i0, int64_t i1) {
    Scratch scratch;
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t w = i / H, h = i % H, b = item_seq[w], t0 = item_t0[w];
      Args<T> a{q.data_ptr<T>(), q.stride(0), kc.data_ptr<T>(), vc.data_ptr<T>(), out.data_ptr<T>(), H, KVH, D,
                prefix.data_ptr<int64_t>() + po[b], po[b + 1] - po[b], local.data_ptr<int64_t>(),
                local_offsets.data_ptr<int64_t>(), static_cast<float>(scale)};
      attend_tile<T>(a, t0, std::min(t0 + kTile, so[b + 1]), h, scratch);
    }
  });
  return out;
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
                    t->stride(1) == t->size(2) && t->scalar_type() == q.scalar_type(),
                "paged_attention: q, k, v and the caches must be 3-D CPU tensors of one dtype, "
                "each row's heads contiguous");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "paged_attention: caches must be contiguous");
  for (const torch::Tensor* t : {&slot_mapping, &seq_offsets, &prefix, &prefix_offsets, &local, &local_offsets})
    TORCH_CHECK(t->scalar_type() == torch::kLong && t->is_contiguous(),
                "paged_attention: index tensors must be contiguous int64");
  TORCH_CHECK(q.size(2) <= 256 && q.size(1) % k_cache.size(1) == 0,
              "paged_attention: head_dim <= 256 and heads a multiple of kv heads");
  TORCH_CHECK(local_offsets.size(0) == q.size(0) + 1 && slot_mapping.size(0) == q.size(0),
              "paged_attention: one slot and one local list per query token");
  if (q.scalar_type() == torch::kFloat32)
    return run<float>(q, k, v, k_cache, v_cache, slot_mapping, seq_offsets, prefix,
                      prefix_offsets, local, local_offsets, scale);
  TORCH_CHECK(q.scalar_type() == torch::kBFloat16, "paged_attention: float32 or bfloat16 only");
  return run<c10::BFloat16>(q, k, v, k_cache, v_cache, slot_mapping, seq_offsets, prefix,
                            prefix_offsets, local, local_offsets, scale);
}
