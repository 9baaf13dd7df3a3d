// Dense bf16 matrices multiplied on Intel AMX tiles, each row of a batch exactly as it would be
// alone (the bf16 mode's linear layers).
//
// Why: oneDNN's bf16 matmul picks its blocking by the number of rows, so a row's sums come out in
// a different order inside a draft tree than in a one-token decode; greedy speculative output then
// drifts from plain bf16 decoding. Here a row's result is one fixed chain of tile products along
// the input (32 inputs per product, fp32 sums), whatever the other rows: bitwise the same alone or
// in a batch, so bf16 speculation is lossless against bf16 plain decoding.
//
// Layout (amx_pack_bf16, once at load): per tile of 16 outputs and block of 32 inputs, 16 rows r
// holding inputs (2r, 2r + 1) of every output: the pair-interleaved order of a TDPBF16PS B tile.

#include "torch_lite.h"
#include <ATen/Parallel.h>

#include "amx_tiles.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

// w: [N, K] bfloat16 -> [N / 16, K / 32, 16, 32] (same values, B-tile order)
torch::Tensor amx_pack_bf16(const torch::Tensor& w) {
  TORCH_CHECK(w.scalar_type() == torch::kBFloat16 && w.dim() == 2 && w.device().is_cpu(),
              "amx_pack_bf16: a 2-D CPU bfloat16 weight");
  const int64_t N = w.size(0), K = w.size(1);
  TORCH_CHECK(N % 16 == 0 && K % 32 == 0, "amx_pack_bf16: outputs % 16 == 0 and inputs % 32 == 0");
  const torch::Tensor src = w.contiguous();
  const uint16_t* s = reinterpret_cast<const uint16_t*>(src.data_ptr<c10::BFloat16>());
  torch::Tensor out = torch::empty({N / 16, K / 32, 16, 32}, w.options());
  uint16_t* o = reinterpret_cast<uint16_t*>(out.data_ptr<c10::BFloat16>());
  for (int64_t t = 0; t < N / 16; ++t)
    for (int64_t b = 0; b < K / 32; ++b)
      for (int64_t r = 0; r < 16; ++r)
        for (int64_t j = 0; j < 32; ++j)  // output j / 2, input 2r + j % 2
          o[(((t * (K / 32) + b) * 16 + r) * 32) + j] = s[(t * 16 + j / 2) * K + b * 32 + 2 * r + (j & 1)];
  return out;
}

#if defined(NGRAMSPEC_AMX)

namespace {

// Output tiles [t0, t1) for all rows of xb ([m_chunks * 16, K] bf16, zero-padded rows): two
// tiles share each activation tile; each C tile accumulates its whole input in block order.
void dense_range(const uint16_t* xb, int64_t M, int64_t K, const uint16_t* w, int64_t t0,
                 int64_t t1, float* out, int64_t N) {
  const int64_t nb = K / 32, m_chunks = (M + 15) / 16;
  alignas(64) float c[2][16 * 16];
  // tiles 0, 1: C (rows x 16 fp32) for two output tiles; 2: A (rows x 32 bf16); 3, 4: B
  ngramspec::configure_tiles(5, 3, static_cast<int>(std::min<int64_t>(M, 16)));
  for (int64_t t = t0; t < t1; t += 2) {
    const bool pair = t + 1 < t1;
    const uint16_t* w0 = w + t * nb * 512;
    const uint16_t* w1 = w0 + nb * 512;
    for (int64_t mc = 0; mc < m_chunks; ++mc) {
      const uint16_t* xa = xb + mc * 16 * K;
      _tile_zero(0);
      _tile_zero(1);
      for (int64_t b = 0; b < nb; ++b) {
        _tile_loadd(2, xa + b * 32, K * 2);
        _tile_loadd(3, w0 + b * 512, 64);
        _tile_dpbf16ps(0, 2, 3);
        if (pair) {
          _tile_loadd(4, w1 + b * 512, 64);
          _tile_dpbf16ps(1, 2, 4);
        }
      }
      _tile_stored(0, c[0], 64);
      if (pair) _tile_stored(1, c[1], 64);
      const int64_t rows = std::min<int64_t>(16, M - mc * 16);
      for (int64_t r = 0; r < rows; ++r) {
        float* o = out + (mc * 16 + r) * N + t * 16;
        std::memcpy(o, c[0] + r * 16, 64);
        if (pair) std::memcpy(o + 16, c[1] + r * 16, 64);
      }
    }
  }
  _tile_release();
}

}  // namespace

// x: [M, K] bfloat16, w = amx_pack_bf16(weight [N, K]) -> [M, N] float32 (+ bias)
torch::Tensor amx_linear_bf16(const torch::Tensor& x, const torch::Tensor& w,
                              const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kBFloat16 && x.dim() == 2,
              "amx_linear_bf16: x must be a 2-D CPU bfloat16 tensor");
  TORCH_CHECK(w.dim() == 4 && w.size(2) == 16 && w.size(3) == 32 && w.size(1) * 32 == x.size(1),
              "amx_linear_bf16: weight was not packed for this input size");
  TORCH_CHECK(ngramspec::amx_permitted(), "amx_linear_bf16: AMX bf16 tiles are not available on this CPU");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0) * 16;
  torch::Tensor out = torch::empty({M, N}, x.options().dtype(torch::kFloat));
  if (M == 0) return out;
  const int64_t m_chunks = (M + 15) / 16;
  // rows zero-padded to whole 16-row tiles (pad rows never touch real ones)
  std::vector<uint16_t> xb(static_cast<size_t>(m_chunks * 16 * K), 0);
  const torch::Tensor xc = x.contiguous();
  std::memcpy(xb.data(), xc.data_ptr<c10::BFloat16>(), M * K * 2);
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(w.data_ptr<c10::BFloat16>());
  float* op = out.data_ptr<float>();
  const int64_t pairs = (N / 16 + 1) / 2;
  at::parallel_for(0, pairs, 1, [&](int64_t p0, int64_t p1) {
    dense_range(xb.data(), M, K, wp, 2 * p0, std::min(N / 16, 2 * p1), op, N);
  });
  if (bias.has_value() && bias->defined()) out.add_(bias->to(torch::kFloat));
  return out;
}

#else  // built without AMX

torch::Tensor amx_linear_bf16(const torch::Tensor&, const torch::Tensor&,
                              const c10::optional<torch::Tensor>&) {
  TORCH_CHECK(false, "amx_linear_bf16: this build has no AMX support");
}

#endif
