// Intel AMX basics shared by the kernels: whether this build has it, and the one tile shape
// they all use (16 rows of 64 bytes: 16x32 bfloat16 operands, 16x16 float32 accumulators).
#pragma once

#include <cstdint>

#include "isa.h"

// Whether this CPU and kernel let us use AMX tiles (requests them from Linux once).
bool amx_available();

#ifdef PAGEDSERVE_AMX
struct TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// All eight tiles 16 rows x 64 bytes; load it (_tile_loadconfig) in each thread before use.
inline const TileConfig& tile_config() {
  static const TileConfig cfg = [] {
    TileConfig c;
    for (int i = 0; i < 8; ++i) {
      c.colsb[i] = 64;
      c.rows[i] = 16;
    }
    return c;
  }();
  return cfg;
}
#endif
