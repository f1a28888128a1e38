// The order in which the grouped GEMMs walk their (m, n) tiles (MoePlan::m_band1 / m_band2), host and device: the
// plan's tests check it is a permutation of the grid.
#pragma once
#include "common/host_device.h"

namespace fp4moe {

// The (m, n) tile at place L of a grid of m_tiles x n_tiles: the m tiles in bands of `band` (0: one band), each
// band's tiles n by n with m fastest. A band's token rows are read from HBM once and from L2 for its other n tiles
// (with the whole grid as one band, a chunk whose rows outgrow the L2 reads them again for every n tile);
// neighbouring m tiles are mostly one expert's, so they share each weight tile. The plan sets a band only where
// m_tiles * n_tiles fits an int.
FP4MOE_HD void tile_of(int L, int m_tiles, int n_tiles, int band, int& m, int& n) {
  band = band <= 0 || band > m_tiles ? m_tiles : band;
  const int per_band = band * n_tiles, b = L / per_band, r = L - b * per_band;
  const int rest = m_tiles - b * band, width = rest < band ? rest : band;  // the last band may be narrower
  n = r / width;
  m = b * band + (r - n * width);
}

}  // namespace fp4moe
