// GGUF Q4_0 / Q4_1 / Q8_0 matrices multiplied on Intel AMX tiles (bf16 products, fp32 sums).
//
// Why: the AVX-512 block kernel (gguf_kernels.cpp) spends ~17 vector ops per 32 weights per
// output on dequantising, and every extra row costs two more FMAs per 32 weights, so a draft
// tree's rows cost well above one token's. Here each 16-output x 32-input tile of weights is
// dequantised once into bf16 and one TDPBF16PS multiplies it with up to 16 rows at once, so 1
// to 16 rows cost the same: verifying a draft tree is as cheap as decoding one token.
//
// Layout (built once at load by amx_pack from the GGUF blocks, same bits re-ordered): per tile of
// 16 outputs and block of 32 inputs, 16 rows r of the weights for inputs (2r, 2r + 1) of every
// output, which is the pair-interleaved order a TDPBF16PS B tile needs, then the 16 outputs' fp16
// scales (and mins). Q4: row r is 16 bytes, byte j holding output j/2 (low nibble) and 8 + j/2
// (high nibble), input 2r + j%2. Q8_0: row r is 32 int8, byte j = output j/2, input 2r + j%2.
//
// Numerics: activations and dequantised weights are rounded to bf16, products summed in fp32 in a
// fixed order (block by block along the input); a row's result does not depend on the other rows.

#include "torch_lite.h"
#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include "gguf_blocks.h"
#include "vec_math.h"

#include <cstdint>
#include <cstring>
#include <vector>

#include "amx_tiles.h"

namespace {

using ngramspec::kQ4_0;
using ngramspec::kQ4_1;
using ngramspec::kQ8_0;

inline bool is_q4(int64_t qtype) { return qtype == kQ4_0 || qtype == kQ4_1; }
// packed bytes per (16-output tile, 32-input block)
inline int64_t tile_bytes(int64_t qtype) { return is_q4(qtype) ? 16 * 16 + 64 : 16 * 32 + 32; }

inline uint16_t load_u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

}  // namespace

// blocks: [N, K / 32 * block_bytes] GGUF rows -> [N / 16, K / 32, tile_bytes] uint8
torch::Tensor amx_pack(const torch::Tensor& blocks, int64_t qtype, int64_t K) {
  const int64_t bb = ngramspec::block_bytes(qtype);
  TORCH_CHECK(blocks.scalar_type() == torch::kByte && blocks.is_contiguous() && blocks.dim() == 2,
              "amx_pack: contiguous uint8 [N, row_bytes]");
  const int64_t N = blocks.size(0), nb = K / 32;
  TORCH_CHECK(N % 16 == 0 && K % 32 == 0 && blocks.size(1) == nb * bb,
              "amx_pack: N must be a multiple of 16 and rows whole blocks");
  const int64_t tb = tile_bytes(qtype);
  torch::Tensor out = torch::zeros({N / 16, nb, tb}, torch::kByte);
  const uint8_t* src = blocks.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  for (int64_t t = 0; t < N / 16; ++t) {
    for (int64_t b = 0; b < nb; ++b) {
      uint8_t* o = dst + (t * nb + b) * tb;
      auto block = [&](int64_t n) { return src + (t * 16 + n) * blocks.size(1) + b * bb; };
      if (is_q4(qtype)) {
        const int64_t qoff = ngramspec::q4_offset(qtype);
        auto nib = [&](int64_t n, int64_t k) {  // GGUF: element k < 16 low nibble of byte k
          const uint8_t byte = block(n)[qoff + (k & 15)];
          return static_cast<uint8_t>(k < 16 ? byte & 0x0F : byte >> 4);
        };
        for (int64_t r = 0; r < 16; ++r)
          for (int64_t j = 0; j < 16; ++j) {
            const int64_t k = 2 * r + (j & 1);
            o[r * 16 + j] = static_cast<uint8_t>(nib(j / 2, k) | (nib(8 + j / 2, k) << 4));
          }
        uint16_t* scales = reinterpret_cast<uint16_t*>(o + 256);  // d[16], m[16] as fp16
        for (int64_t n = 0; n < 16; ++n) {
          const uint16_t d = load_u16(block(n));
          scales[n] = d;
          if (qtype == kQ4_1) {
            scales[16 + n] = load_u16(block(n) + 2);
          } else {  // Q4_0: w = d * (q - 8) = d * q + (-8 d); -8 d is exact in fp16
            const float md = -8.0f * static_cast<float>(c10::Half(d, c10::Half::from_bits()));
            scales[16 + n] = c10::Half(md).x;
          }
        }
      } else {
        for (int64_t r = 0; r < 16; ++r)
          for (int64_t j = 0; j < 32; ++j) o[r * 32 + j] = block(j / 2)[2 + 2 * r + (j & 1)];
        uint16_t* scales = reinterpret_cast<uint16_t*>(o + 512);
        for (int64_t n = 0; n < 16; ++n) scales[n] = load_u16(block(n));
      }
    }
  }
  return out;
}

#if defined(NGRAMSPEC_AMX)

namespace {

// tiles 0, 1: C (rows x 16 fp32); 2: A (rows x 32 bf16); 3, 4: B (16 pair-rows x 16 outputs).
// rows = M for one chunk of M <= 16 rows (a decode stores one C row, not sixteen), else 16.
inline void configure_tiles(int rows) { ngramspec::configure_tiles(5, 3, rows); }

// bf16 bit patterns of 0..15 (exact), for vpermw
alignas(64) const uint16_t kNibbleBf16[32] = {
    0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0,
    0x4100, 0x4110, 0x4120, 0x4130, 0x4140, 0x4150, 0x4160, 0x4170,
    0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0,
    0x4100, 0x4110, 0x4120, 0x4130, 0x4140, 0x4150, 0x4160, 0x4170};

// The integer weights of one (tile, block) -> 16 pair-rows x 32 bf16 (1 KB), the B-tile order.
// Scales are applied after the tile product, so this is exact.
template <int64_t Q>
inline void unpack_tile(const uint8_t* p, uint16_t* out) {
  if constexpr (Q != kQ8_0) {
    const __m512i lut = _mm512_load_si512(kNibbleBf16);
    for (int r = 0; r < 16; r += 2) {  // two rows (32 bytes) at a time
      const __m512i words = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + r * 16)));
      const __m512i lo = _mm512_and_si512(words, _mm512_set1_epi16(0x0F));  // outputs 0..7
      const __m512i hi = _mm512_srli_epi16(words, 4);                        // outputs 8..15
      const __m512i row0 = _mm512_shuffle_i64x2(lo, hi, 0x44), row1 = _mm512_shuffle_i64x2(lo, hi, 0xEE);
      _mm512_storeu_si512(out + r * 32, _mm512_permutexvar_epi16(row0, lut));
      _mm512_storeu_si512(out + (r + 1) * 32, _mm512_permutexvar_epi16(row1, lut));
    }
  } else {
    for (int r = 0; r < 16; ++r) {
      const uint8_t* row = p + r * 32;
      const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row))));
      const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 16))));
      _mm512_storeu_si512(out + r * 32, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    }
  }
}

// One (tile, block): its integer weights into B-tile order, its scales d and mins m (0 for Q8_0).
template <int64_t Q>
inline void load_block(const uint8_t* p, uint16_t* bt, __m512& d, __m512& m) {
  constexpr int64_t scale_off = Q != kQ8_0 ? 256 : 512;
  unpack_tile<Q>(p, bt);
  d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + scale_off)));
  m = Q != kQ8_0 ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + scale_off + 32)))
                 : _mm512_setzero_ps();
}

// Outputs of tiles [t0, t1) for all M rows. Per block: C = A . Q on the tiles (exact integer
// weights), then acc += d * C + m * sum(x over the block), in block order.
template <int64_t Q>
void tiles_range(const uint16_t* xb, const float* xsum, int64_t M, int64_t K, const uint8_t* w,
                 int64_t t0, int64_t t1, float* out, int64_t N) {
  const int64_t nb = K / 32, tb = tile_bytes(Q), m_chunks = (M + 15) / 16;
  alignas(64) uint16_t bt[2][16 * 32];
  alignas(64) float c[2][16 * 16];
  std::vector<float> acc(static_cast<size_t>(M * 32));
  configure_tiles(static_cast<int>(std::min<int64_t>(M, 16)));
  for (int64_t t = t0; t < t1; t += 2) {
    const int64_t pair = std::min<int64_t>(2, t1 - t);
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int64_t b = 0; b < nb; ++b) {
      __m512 d[2], m[2];
      for (int64_t i = 0; i < pair; ++i) load_block<Q>(w + ((t + i) * nb + b) * tb, bt[i], d[i], m[i]);
      _tile_loadd(3, bt[0], 64);
      if (pair == 2) _tile_loadd(4, bt[1], 64);
      for (int64_t mc = 0; mc < m_chunks; ++mc) {
        _tile_loadd(2, xb + mc * 16 * K + b * 32, K * 2);
        _tile_zero(0);
        _tile_dpbf16ps(0, 2, 3);
        _tile_stored(0, c[0], 64);
        if (pair == 2) {
          _tile_zero(1);
          _tile_dpbf16ps(1, 2, 4);
          _tile_stored(1, c[1], 64);
        }
        const int64_t rows = std::min<int64_t>(16, M - mc * 16);
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t row = mc * 16 + r;
          const __m512 xs = _mm512_set1_ps(xsum[row * nb + b]);
          for (int64_t i = 0; i < pair; ++i) {
            float* a = acc.data() + row * 32 + i * 16;
            __m512 v = _mm512_fmadd_ps(_mm512_load_ps(c[i] + r * 16), d[i], _mm512_loadu_ps(a));
            if constexpr (Q != kQ8_0) v = _mm512_fmadd_ps(xs, m[i], v);
            _mm512_storeu_ps(a, v);
          }
        }
      }
    }
    for (int64_t row = 0; row < M; ++row)
      std::memcpy(out + row * N + t * 16, acc.data() + row * 32, pair * 64);
  }
  _tile_release();
}

// M <= R <= 8 rows (a decode, a draft tree): the same sums in the same order as tiles_range,
// with the 2 x R accumulators in registers instead of memory (R is a constant).
template <int64_t Q, int R>
void tiles_small(const uint16_t* xb, const float* xsum, int64_t M, int64_t K, const uint8_t* w,
                 int64_t t0, int64_t t1, float* out, int64_t N) {
  const int64_t nb = K / 32, tb = tile_bytes(Q);
  alignas(64) uint16_t bt[2][16 * 32];
  alignas(64) float c[2][16 * 16];
  configure_tiles(static_cast<int>(M));
  for (int64_t t = t0; t < t1; t += 2) {
    const bool pair = t + 1 < t1;
    __m512 acc[2][R];
    for (int r = 0; r < R; ++r) acc[0][r] = acc[1][r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      __m512 d[2], m[2];
      for (int64_t i = 0; i < 1 + pair; ++i) load_block<Q>(w + ((t + i) * nb + b) * tb, bt[i], d[i], m[i]);
      _tile_loadd(3, bt[0], 64);
      _tile_loadd(2, xb + b * 32, K * 2);
      _tile_zero(0);
      _tile_dpbf16ps(0, 2, 3);
      _tile_stored(0, c[0], 64);
      if (pair) {
        _tile_loadd(4, bt[1], 64);
        _tile_zero(1);
        _tile_dpbf16ps(1, 2, 4);
        _tile_stored(1, c[1], 64);
      }
      for (int r = 0; r < R; ++r) {
        if (r < M) {
          const __m512 xs = _mm512_set1_ps(xsum[r * nb + b]);
          __m512 v = _mm512_fmadd_ps(_mm512_load_ps(c[0] + r * 16), d[0], acc[0][r]);
          if constexpr (Q != kQ8_0) v = _mm512_fmadd_ps(xs, m[0], v);
          acc[0][r] = v;
          if (pair) {
            v = _mm512_fmadd_ps(_mm512_load_ps(c[1] + r * 16), d[1], acc[1][r]);
            if constexpr (Q != kQ8_0) v = _mm512_fmadd_ps(xs, m[1], v);
            acc[1][r] = v;
          }
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      if (r < M) {
        _mm512_storeu_ps(out + r * N + t * 16, acc[0][r]);
        if (pair) _mm512_storeu_ps(out + r * N + t * 16 + 16, acc[1][r]);
      }
    }
  }
  _tile_release();
}

template <int64_t Q>
void run_tiles(const uint16_t* xb, const float* xsum, int64_t M, int64_t K, const uint8_t* w,
               int64_t t0, int64_t t1, float* out, int64_t N) {
  if (M == 1) return tiles_small<Q, 1>(xb, xsum, M, K, w, t0, t1, out, N);
  if (M <= 2) return tiles_small<Q, 2>(xb, xsum, M, K, w, t0, t1, out, N);
  if (M <= 4) return tiles_small<Q, 4>(xb, xsum, M, K, w, t0, t1, out, N);
  if (M <= 8) return tiles_small<Q, 8>(xb, xsum, M, K, w, t0, t1, out, N);
  tiles_range<Q>(xb, xsum, M, K, w, t0, t1, out, N);
}

// x [M, K] float32 -> bf16 rows (round to nearest even) and each row's sum of its bf16 values
// over every 32-input block (for the Q4_1 / Q4_0 mins), in one pass.
void to_bf16_with_block_sums(const float* x, int64_t M, int64_t K, uint16_t* xb, float* xsum) {
  const int64_t nb = K / 32;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < nb; ++b) {
      const float* src = x + m * K + b * 32;
      const __m256i lo = (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(src));
      const __m256i hi = (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(src + 16));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(xb + m * K + b * 32), lo);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(xb + m * K + b * 32 + 16), hi);
      xsum[m * nb + b] = _mm512_reduce_add_ps(_mm512_add_ps(ngramspec::widen_bf16(lo),
                                                            ngramspec::widen_bf16(hi)));
    }
}

}  // namespace

bool amx_available() { return ngramspec::amx_permitted(); }

// x: [M, K] float32 -> [M, N] float32 with w = amx_pack(...) of a GGUF matrix.
torch::Tensor amx_linear(const torch::Tensor& x, const torch::Tensor& w, int64_t qtype,
                         const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kFloat && x.dim() == 2,
              "amx_linear: x must be a 2-D CPU float32 tensor");
  TORCH_CHECK(w.dim() == 3 && w.size(2) == tile_bytes(qtype) && w.size(1) * 32 == x.size(1),
              "amx_linear: weight was not packed for this type and input size");
  TORCH_CHECK(ngramspec::amx_permitted(), "amx_linear: AMX bf16 tiles are not available on this CPU");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0) * 16;
  torch::Tensor out = torch::empty({M, N}, x.options());
  if (M == 0) return out;
  const int64_t m_chunks = (M + 15) / 16, nb = K / 32;
  // activations in bf16, zero-padded to whole 16-row tiles (pad rows never touch real ones),
  // and each row's sum over every 32-input block (of the bf16 values) for the mins
  std::vector<uint16_t> xb(static_cast<size_t>(m_chunks * 16 * K), 0);
  std::vector<float> xsum(static_cast<size_t>(M * nb));
  to_bf16_with_block_sums(x.contiguous().data_ptr<float>(), M, K, xb.data(), xsum.data());
  const uint16_t* xp = xb.data();
  const float* sp = xsum.data();
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  const int64_t tiles = N / 16, pairs = (tiles + 1) / 2;
  at::parallel_for(0, pairs, 1, [&](int64_t p0, int64_t p1) {
    const int64_t t0 = 2 * p0, t1 = std::min(tiles, 2 * p1);
    switch (qtype) {
      case kQ4_0: run_tiles<kQ4_0>(xp, sp, M, K, wp, t0, t1, op, N); break;
      case kQ4_1: run_tiles<kQ4_1>(xp, sp, M, K, wp, t0, t1, op, N); break;
      default: run_tiles<kQ8_0>(xp, sp, M, K, wp, t0, t1, op, N); break;
    }
  });
  if (bias.has_value() && bias->defined()) out.add_(*bias);
  return out;
}

#else  // built without AMX: the AVX-512 block kernel serves instead

bool amx_available() { return false; }

torch::Tensor amx_linear(const torch::Tensor&, const torch::Tensor&, int64_t,
                         const c10::optional<torch::Tensor>&) {
  TORCH_CHECK(false, "amx_linear: this build has no AMX support");
}

#endif
