// AMX tile state for the kernels that use tiles (quant_gemm.cpp's int8 path, linear_amx.cpp's bf16
// linear): whether Linux grants this process the tile data (arch_prctl, asked once), and the one
// tile configuration both use, all eight tiles 16 rows x 64 bytes. Include only where the build
// has AMX (__AMX_TILE__).
#pragma once

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace portside_amx {

inline bool granted() {
  static const bool ok = [] {
    constexpr int ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  }();
  return ok;
}

// Loads palette 1 with tiles 0-7 at 16 rows x 64 bytes on the calling thread (each thread of a
// parallel region loads it before its first tile instruction; `_tile_release` when done).
inline void configure_16x64() {
  struct alignas(64) {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t colsb[16] = {64, 64, 64, 64, 64, 64, 64, 64};
    uint8_t rows[16] = {16, 16, 16, 16, 16, 16, 16, 16};
  } cfg;
  asm volatile("" ::: "memory");  // the stores above before the load of the configuration
  _tile_loadconfig(&cfg);
}

}  // namespace portside_amx
