// Which work a block does: its (m, n) tile of the grid (bands of m tiles, common/tile_order.h), the expert and
// rows of its m tile (the permutation's tile list, or consecutive rows of a dense problem), and its split of K
// (split_k.cuh).
#pragma once
#include "common/tile_order.h"
#include "cuda/kernels.h"

namespace fp4moe::cuda_backend {

// The (token, slot) entry of permuted row r (dense problems: the row itself).
__device__ __forceinline__ int entry_of(const GemmProblem& g, int r) { return g.row_entry ? g.row_entry[r] : r; }

// Tile -> (expert, rows). Routed: tile_info from the permutation, or one entry a tile (entry tiles); dense (shared
// expert): consecutive rows.
struct TileRows {
  int expert, row0, row_end;
};
template <int BM> __device__ __forceinline__ bool resolve_tile(const GemmProblem& g, TileRows& tr, int tile) {
  if (g.tile_info) {
    if (tile >= g.tile_info[2 * g.max_tiles]) return false;  // fewer tiles than the plan's bound
    tr.expert = g.tile_info[2 * tile];
    tr.row0 = g.tile_info[2 * tile + 1];
    tr.row_end = min(tr.row0 + BM, g.expert_offsets[tr.expert + 1]);
    return true;
  }
  // Dense rows (the shared expert: expert 0, BM consecutive rows a tile) or entry tiles (tile = entry, one row; the
  // grid's m tiles are the entries, so entry_ids[tile] is in the chunk; another rank's expert: no tile).
  const bool entry = g.entry_ids != nullptr;
  tr.expert = entry ? g.entry_ids[tile] - g.local_offset : 0;
  tr.row0 = entry ? tile : tile * BM;
  tr.row_end = entry ? tile + 1 : min(tr.row0 + BM, g.dense_rows);
  return entry ? tr.expert >= 0 && tr.expert < g.E_loc : tr.row0 < g.dense_rows;
}

// The (m, n) tile of this block of a grid (m tiles, n tiles[, splits]).
__device__ __forceinline__ void grid_tile(int band, int& m, int& n) {
  if (band <= 0) {
    m = static_cast<int>(blockIdx.x);
    n = static_cast<int>(blockIdx.y);
  } else {
    tile_of(static_cast<int>(blockIdx.y * gridDim.x + blockIdx.x), static_cast<int>(gridDim.x),
            static_cast<int>(gridDim.y), band, m, n);
  }
}

// This block's tile of a (m tiles, n tiles) grid: its rows tr and its first weight row (n tiles of bn rows); false
// for a tile without rows.
template <int BM> __device__ __forceinline__ bool block_tile(const GemmProblem& g, TileRows& tr, int& n0, int bn) {
  int m, n;
  grid_tile(g.m_band, m, n);
  n0 = n * bn;
  return resolve_tile<BM>(g, tr, m);
}
template <int BM, int BN> __device__ __forceinline__ bool block_tile(const GemmProblem& g, TileRows& tr, int& n0) {
  return block_tile<BM>(g, tr, n0, BN);
}

}  // namespace fp4moe::cuda_backend
