// The AMX tile configuration block (LDTILECFG's 64-byte operand), shared by the AMX kernels.
#pragma once

#include <cstdint>

namespace specengine {

struct TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];  // bytes per row of each tile
  uint8_t rows[16];    // rows of each tile
};

}  // namespace specengine
