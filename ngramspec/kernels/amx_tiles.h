// Intel AMX tile helpers shared by the CPU kernels: build-time detection, the tile
// configuration, and the once-per-process permission request Linux needs.
#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define NGRAMSPEC_AMX 1
#include <immintrin.h>
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace ngramspec {

struct TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles [0, count) of 64-byte rows: the first `short_tiles` with `rows` rows (A and C tiles of a
// chunk of rows <= 16), the rest with 16 (B tiles).
inline void configure_tiles(int count, int short_tiles, int rows) {
  TileConfig cfg;
  for (int i = 0; i < count; ++i) {
    cfg.rows[i] = static_cast<uint8_t>(i < short_tiles ? rows : 16);
    cfg.colsb[i] = 64;
  }
  _tile_loadconfig(&cfg);
}

// Whether this CPU has AMX bf16 tiles and Linux lets this process use them. Linux hands out the
// tile state only on request (ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA); asked once.
inline bool amx_permitted() {
  static const bool ok = [] {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    const bool amx_bf16 = (d >> 22) & 1, amx_tile = (d >> 24) & 1;
    return amx_bf16 && amx_tile && syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  }();
  return ok;
}

}  // namespace ngramspec

#endif
