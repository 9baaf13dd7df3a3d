// The small per-layer ops of a decoder step, fused (CPU): residual add + RMSNorm, rotary
// embedding in place, SiLU(gate) * up.
//
// Why: at batch 1 a step runs ~25 ATen ops a layer; torch's RMSNorm alone is six of them on CPU
// (pow, mean, add, rsqrt, mul, mul), each dispatch costing more than its work. These are single
// passes over a few kB; each is one call here. Every op works row by row with a fixed order, so
// results do not depend on how many rows a step has (speculation stays lossless).

#include "torch_lite.h"
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <cstdint>

#include "vec_math.h"

namespace {

template <typename T>
inline float f(T v) { return static_cast<float>(v); }

// fn(r0, r1) over rows [0, rows): split over the threads when the rows hold enough work (a
// prefill chunk, where the other thread would otherwise wait), inline for a decode's few rows.
// Rows are independent, so the split changes no number.
template <typename F>
void over_rows(int64_t rows, int64_t row_elems, const F& fn) {
  at::parallel_for(0, rows, std::max<int64_t>(1, (int64_t{1} << 14) / std::max<int64_t>(row_elems, 1)), fn);
}

template <typename T>
void rms_rows(const T* x, const T* w, T* out, int64_t r0, int64_t r1, int64_t dim, int64_t ld, float eps) {
  for (int64_t r = r0; r < r1; ++r) {
    const T* xr = x + r * ld;
    float part[8] = {0, 0, 0, 0, 0, 0, 0, 0};  // 8 partial sums: fixed order, no long dependency chain
    int64_t i = 0;
    for (; i + 8 <= dim; i += 8)
      for (int j = 0; j < 8; ++j) part[j] = std::fma(f(xr[i + j]), f(xr[i + j]), part[j]);
    for (; i < dim; ++i) part[0] = std::fma(f(xr[i]), f(xr[i]), part[0]);
    float ss = ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]));
    const float inv = 1.0f / std::sqrt(ss / static_cast<float>(dim) + eps);
    T* o = out + r * dim;
    for (int64_t k = 0; k < dim; ++k) o[k] = static_cast<T>(f(w[k]) * (f(xr[k]) * inv));
  }
}

void check(const torch::Tensor& x, const char* what) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.stride(1) == 1, what,
              ": a 2-D CPU tensor with contiguous rows");
  TORCH_CHECK(x.scalar_type() == torch::kFloat || x.scalar_type() == torch::kBFloat16, what,
              ": float32 or bfloat16");
}

}  // namespace

// x: [T, D] -> RMSNorm(x) * weight: [T, D]
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  check(x, "rms_norm");
  const torch::Tensor w = weight.to(x.scalar_type()).contiguous();
  torch::Tensor out = torch::empty({x.size(0), x.size(1)}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND(at::ScalarType::BFloat16, x.scalar_type(), "rms_norm", [&] {
    over_rows(x.size(0), x.size(1), [&](int64_t r0, int64_t r1) {
      rms_rows<scalar_t>(x.data_ptr<scalar_t>(), w.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), r0, r1,
                         x.size(1), x.stride(0), static_cast<float>(eps));
    });
  });
  return out;
}

// residual += x (in place); returns RMSNorm(residual) * weight. The pre-norm block's
// "x = x + sublayer(...); h = norm(x)" in one pass.
torch::Tensor add_rms_norm(torch::Tensor residual, const torch::Tensor& x, const torch::Tensor& weight,
                           double eps) {
  check(residual, "add_rms_norm");
  check(x, "add_rms_norm");
  TORCH_CHECK(residual.is_contiguous() && residual.sizes() == x.sizes() &&
                  residual.scalar_type() == x.scalar_type(),
              "add_rms_norm: residual must be contiguous and match x");
  const int64_t rows = x.size(0), dim = x.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND(at::ScalarType::BFloat16, x.scalar_type(), "add_rms_norm", [&] {
    scalar_t* r = residual.data_ptr<scalar_t>();
    const scalar_t* xp = x.data_ptr<scalar_t>();
    over_rows(rows, dim, [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i)
        for (int64_t k = 0; k < dim; ++k)
          r[i * dim + k] = static_cast<scalar_t>(f(r[i * dim + k]) + f(xp[i * x.stride(0) + k]));
    });
  });
  return rms_norm(residual, weight, eps);
}

// Rotary embedding (rotate halves) in place on the q and k heads of qkv: [T, (H + 2 KVH) * D],
// heads [0, H + KVH) rotated; cos, sin: [T, D] float32.
void rope_(torch::Tensor qkv, const torch::Tensor& cos, const torch::Tensor& sin, int64_t heads,
           int64_t head_dim) {
  check(qkv, "rope_");
  TORCH_CHECK(cos.scalar_type() == torch::kFloat && sin.scalar_type() == torch::kFloat &&
                  cos.is_contiguous() && sin.is_contiguous() && cos.size(0) == qkv.size(0) &&
                  cos.size(1) == head_dim && head_dim % 2 == 0,
              "rope_: cos and sin must be contiguous float32 [T, head_dim]");
  const int64_t rows = qkv.size(0), half = head_dim / 2;
  AT_DISPATCH_FLOATING_TYPES_AND(at::ScalarType::BFloat16, qkv.scalar_type(), "rope_", [&] {
    over_rows(rows, heads * head_dim, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        const float* c = cos.data_ptr<float>() + t * head_dim;
        const float* s = sin.data_ptr<float>() + t * head_dim;
        for (int64_t h = 0; h < heads; ++h) {
          scalar_t* x = qkv.data_ptr<scalar_t>() + t * qkv.stride(0) + h * head_dim;
          for (int64_t i = 0; i < half; ++i) {
            const float a = f(x[i]), b = f(x[i + half]);
            // the same two products and one sum per element as x * cos + rotate_half(x) * sin
            x[i] = static_cast<scalar_t>(a * f(static_cast<scalar_t>(c[i])) - b * f(static_cast<scalar_t>(s[i])));
            x[i + half] = static_cast<scalar_t>(b * f(static_cast<scalar_t>(c[i + half])) +
                                                a * f(static_cast<scalar_t>(s[i + half])));
          }
        }
      }
    });
  });
}

// gate_up: [T, 2 I] (gate | up) -> silu(gate) * up: [T, I]
torch::Tensor silu_mul(const torch::Tensor& gate_up) {
  check(gate_up, "silu_mul");
  const int64_t rows = gate_up.size(0), inter = gate_up.size(1) / 2;
  torch::Tensor out = torch::empty({rows, inter}, gate_up.options());
  AT_DISPATCH_FLOATING_TYPES_AND(at::ScalarType::BFloat16, gate_up.scalar_type(), "silu_mul", [&] {
    over_rows(rows, 2 * inter, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        const scalar_t* g = gate_up.data_ptr<scalar_t>() + t * gate_up.stride(0);
        scalar_t* o = out.data_ptr<scalar_t>() + t * inter;
        int64_t i = 0;
#if defined(__AVX512F__)
        if constexpr (std::is_same_v<scalar_t, float>) {
          const __m512 one = _mm512_set1_ps(1.0f);
          for (; i + 16 <= inter; i += 16) {
            const __m512 x = _mm512_loadu_ps(g + i);
            const __m512 e = ngramspec::exp16(_mm512_sub_ps(_mm512_setzero_ps(), x));
            const __m512 silu = _mm512_div_ps(x, _mm512_add_ps(one, e));
            _mm512_storeu_ps(o + i, _mm512_mul_ps(silu, _mm512_loadu_ps(g + inter + i)));
          }
        }
#elif NGRAMSPEC_AVX2
        if constexpr (std::is_same_v<scalar_t, float>) {  // the same arithmetic, 8 lanes
          const __m256 one = _mm256_set1_ps(1.0f);
          const float* gf = reinterpret_cast<const float*>(g);  // scalar_t is float here
          float* of = reinterpret_cast<float*>(o);
          for (; i + 8 <= inter; i += 8) {
            const __m256 x = _mm256_loadu_ps(gf + i);
            const __m256 e = ngramspec::exp8(_mm256_sub_ps(_mm256_setzero_ps(), x));
            const __m256 silu = _mm256_div_ps(x, _mm256_add_ps(one, e));
            _mm256_storeu_ps(of + i, _mm256_mul_ps(silu, _mm256_loadu_ps(gf + inter + i)));
          }
        }
#endif
        for (; i < inter; ++i) {
          const float x = f(g[i]);
          const float silu = f(static_cast<scalar_t>(x / (1.0f + std::exp(-x))));
          o[i] = static_cast<scalar_t>(silu * f(g[inter + i]));
        }
      }
    });
  });
  return out;
}
