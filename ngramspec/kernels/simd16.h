// Sixteen lanes, the GGUF kernels' unit of accumulation, over AVX-512 (one register) or AVX2 (two).
//
// The kernels are written once against these few operations. `F`/`I` are 16 float / int32 lanes;
// `Native` is one machine register of kLanes floats, what a register-blocked loop holds. Both
// ISAs do the same arithmetic lane for lane and reduce in the same order, so a row's sums are
// bitwise the same on either tier.
#pragma once

#include <cstdint>

#include "vec_math.h"

#if defined(__AVX512F__) || NGRAMSPEC_AVX2
#define NGRAMSPEC_SIMD16 1

namespace ngramspec::simd {

#if defined(__AVX512F__)

constexpr int kLanes = 16;
using Native = __m512;
inline Native nzero() { return _mm512_setzero_ps(); }
inline Native nload(const float* p) { return _mm512_loadu_ps(p); }
inline Native nfma(Native a, Native b, Native c) { return _mm512_fmadd_ps(a, b, c); }

struct F {
  __m512 v;
};
struct I {
  __m512i v;
};
inline F fset1(float x) { return {_mm512_set1_ps(x)}; }
inline F fzero() { return {_mm512_setzero_ps()}; }
inline F fload(const float* p) { return {_mm512_loadu_ps(p)}; }
inline void fstore(float* p, F a) { _mm512_storeu_ps(p, a.v); }
inline F ffma(F a, F b, F c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
inline F fmul(F a, F b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline F to_float(I q) { return {_mm512_cvtepi32_ps(q.v)}; }
inline I load_u8(const uint8_t* p) {  // 16 bytes, zero-extended
  return {_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))};
}
inline I load_i8(const uint8_t* p) {  // 16 bytes, sign-extended
  return {_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))};
}
inline I iset1(int x) { return {_mm512_set1_epi32(x)}; }
inline I iota(int from) {
  return {_mm512_add_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                           _mm512_set1_epi32(from))};
}
inline I iand(I a, int m) { return {_mm512_and_si512(a.v, _mm512_set1_epi32(m))}; }
inline I ior(I a, I b) { return {_mm512_or_si512(a.v, b.v)}; }
inline I isub(I a, int x) { return {_mm512_sub_epi32(a.v, _mm512_set1_epi32(x))}; }
inline I isrl(I a, int s) { return {_mm512_srli_epi32(a.v, s)}; }
inline I isll(I a, int s) { return {_mm512_slli_epi32(a.v, s)}; }
inline I isrlv(I a, I s) { return {_mm512_srlv_epi32(a.v, s.v)}; }
inline float freduce(F a) { return _mm512_reduce_add_ps(a.v); }
// One accumulator held as kHalves native registers (here one).
inline float reduce_native(const Native* acc) { return _mm512_reduce_add_ps(acc[0]); }

#else  // AVX2 + FMA + F16C

constexpr int kLanes = 8;
using Native = __m256;
inline Native nzero() { return _mm256_setzero_ps(); }
inline Native nload(const float* p) { return _mm256_loadu_ps(p); }
inline Native nfma(Native a, Native b, Native c) { return _mm256_fmadd_ps(a, b, c); }

struct F {
  __m256 a, b;
};
struct I {
  __m256i a, b;
};
inline F fset1(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
inline F fzero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline F fload(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline void fstore(float* p, F x) {
  _mm256_storeu_ps(p, x.a);
  _mm256_storeu_ps(p + 8, x.b);
}
inline F ffma(F x, F y, F z) { return {_mm256_fmadd_ps(x.a, y.a, z.a), _mm256_fmadd_ps(x.b, y.b, z.b)}; }
inline F fmul(F x, F y) { return {_mm256_mul_ps(x.a, y.a), _mm256_mul_ps(x.b, y.b)}; }
inline F to_float(I q) { return {_mm256_cvtepi32_ps(q.a), _mm256_cvtepi32_ps(q.b)}; }
inline I load_u8(const uint8_t* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return {_mm256_cvtepu8_epi32(raw), _mm256_cvtepu8_epi32(_mm_srli_si128(raw, 8))};
}
inline I load_i8(const uint8_t* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return {_mm256_cvtepi8_epi32(raw), _mm256_cvtepi8_epi32(_mm_srli_si128(raw, 8))};
}
inline I iset1(int x) { return {_mm256_set1_epi32(x), _mm256_set1_epi32(x)}; }
inline I iota(int from) {
  const __m256i base = _mm256_add_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(from));
  return {base, _mm256_add_epi32(base, _mm256_set1_epi32(8))};
}
inline I iand(I x, int m) {
  const __m256i v = _mm256_set1_epi32(m);
  return {_mm256_and_si256(x.a, v), _mm256_and_si256(x.b, v)};
}
inline I ior(I x, I y) { return {_mm256_or_si256(x.a, y.a), _mm256_or_si256(x.b, y.b)}; }
inline I isub(I x, int s) {
  const __m256i v = _mm256_set1_epi32(s);
  return {_mm256_sub_epi32(x.a, v), _mm256_sub_epi32(x.b, v)};
}
inline I isrl(I x, int s) { return {_mm256_srli_epi32(x.a, s), _mm256_srli_epi32(x.b, s)}; }
inline I isll(I x, int s) { return {_mm256_slli_epi32(x.a, s), _mm256_slli_epi32(x.b, s)}; }
inline I isrlv(I x, I s) { return {_mm256_srlv_epi32(x.a, s.a), _mm256_srlv_epi32(x.b, s.b)}; }
inline float freduce(F x) { return reduce_add16(V16{x.a, x.b}); }
inline float reduce_native(const Native* acc) { return reduce_add16(V16{acc[0], acc[1]}); }

#endif

constexpr int kHalves = 16 / kLanes;  // native registers per 16-lane accumulator

}  // namespace ngramspec::simd

#endif
