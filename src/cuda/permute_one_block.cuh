// The permutation's device code that other kernels share (permute.cu): an entry's local expert, the block scan,
// the expert offsets and tile list, the in-order placement, and the whole one-block permutation, which the LoRA x
// shrink's kernel runs in a block of its own at decode (lora.cu: the two are independent, so in one launch they
// overlap).
#pragma once
#include "cuda/kernels.h"

namespace fp4moe::cuda_backend::perm {

// Local expert of entry i, -1 when the expert is another rank's; -2 when the id is out of range.
__device__ __forceinline__ int local_expert(const PermuteParams& p, int i) {
  const int id = p.ids[i];
  if (id < 0 || id >= p.E_total) return -2;
  const int e = id - p.local_offset;
  return (e >= 0 && e < p.E_loc) ? e : -1;
}

// Exclusive scan of v over the block (thread order); returns the total.
__device__ inline int block_exclusive_scan(int& v) {
  __shared__ int warp_tot[32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int x = v;
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
    const int y = __shfl_up_sync(0xffffffffu, x, off);
    if (lane >= off) x += y;
  }
  if (lane == 31) warp_tot[warp] = x;
  __syncthreads();
  if (warp == 0) {
    int w = lane < (blockDim.x >> 5) ? warp_tot[lane] : 0;
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
      const int y = __shfl_up_sync(0xffffffffu, w, off);
      if (lane >= off) w += y;
    }
    warp_tot[lane] = w;  // inclusive
  }
  __syncthreads();
  const int before = (warp > 0 ? warp_tot[warp - 1] : 0) + x - v;
  const int total = warp_tot[(blockDim.x >> 5) - 1];
  __syncthreads();
  v = before;
  return total;
}

// From the rows of each expert (offs[e], e < E_loc): offs becomes the experts' exclusive row offsets (offs[E] the
// total), written to expert_offsets with the tile list. Every thread of the block calls it.
__device__ inline void offsets_and_tiles(const PermuteParams& p, int* offs, int* toffs) {
  const int E = p.E_loc;
  // Scan over experts: each thread a contiguous segment.
  const int seg = (E + blockDim.x - 1) / blockDim.x;
  const int lo = min(E, static_cast<int>(threadIdx.x) * seg), hi = min(E, lo + seg);
  int rows = 0, tiles = 0;
  for (int e = lo; e < hi; ++e) { rows += offs[e]; tiles += (offs[e] + p.bm - 1) / p.bm; }
  const int total_rows = block_exclusive_scan(rows);
  const int total_tiles = block_exclusive_scan(tiles);
  for (int e = lo; e < hi; ++e) {
    const int n = offs[e];
    offs[e] = rows;
    toffs[e] = tiles;
    rows += n;
    tiles += (n + p.bm - 1) / p.bm;
  }
  __syncthreads();
  if (threadIdx.x == 0) { offs[E] = total_rows; toffs[E] = total_tiles; }
  __syncthreads();
  for (int e = threadIdx.x; e <= E; e += blockDim.x) p.expert_offsets[e] = offs[e];
  // The tile list: tile q belongs to the last expert whose tile offset is <= q.
  const int ntiles = min(total_tiles, p.max_tiles);  // the plan guarantees total_tiles <= max_tiles
  if (threadIdx.x == 0) {
    p.tile_info[2 * p.max_tiles] = ntiles;
    if (total_tiles > p.max_tiles) atomicExch(p.error_flag, 2);
  }
  for (int q = threadIdx.x; q < ntiles; q += blockDim.x) {
    int a = 0, b = E - 1;
    while (a < b) {  // last e with toffs[e] <= q; at most log2(E)+1 steps
      const int mid = (a + b + 1) >> 1;
      if (toffs[mid] <= q) a = mid; else b = mid - 1;
    }
    p.tile_info[2 * q] = a;
    p.tile_info[2 * q + 1] = offs[a] + (q - toffs[a]) * p.bm;
  }
}

// The lanes of the warp whose key equals this lane's, for keys in [-1, 2^bits): __match_any_sync's result from one
// ballot a bit: in permute_mid_kernel, 32 warps calling MATCH.ANY at once took 30 us at 8192 entries, ballots 24.
__device__ __forceinline__ unsigned match_key(int key, int bits) {
  const unsigned valid = __ballot_sync(0xffffffffu, key >= 0);
  unsigned m = key >= 0 ? valid : ~valid;
  for (int b = 0; b < bits; ++b) {
    const bool one = (key >> b) & 1;
    const unsigned v = __ballot_sync(0xffffffffu, one);
    m &= one ? v : ~v;
  }
  return m;
}
// Bits of the largest local expert id (at least one).
__device__ __forceinline__ int expert_bits(int E_loc) { return 32 - __clz(max(E_loc - 1, 1)); }

// One warp gives entries [begin, end), in order, the next rows of their experts (next[e]: e's next row).
// cached: the entries' local experts (local_expert) already in shared memory, or null.
__device__ inline void place_entries(const PermuteParams& p, int* next, int begin, int end, const int16_t* cached) {
  const int lane = threadIdx.x & 31;
  const unsigned lt = (1u << lane) - 1u;
  for (int i0 = begin; i0 < end; i0 += 32) {
    const int i = i0 + lane;
    const int e = i < end ? (cached ? cached[i] : local_expert(p, i)) : -1;
    const int key = e >= 0 ? e : -1;
    const unsigned peers = __match_any_sync(0xffffffffu, key);
    int pos = 0;
    if (key >= 0) pos = next[key] + __popc(peers & lt);
    __syncwarp();
    if (key >= 0) {
      p.row_entry[pos] = i;
      if ((peers >> lane) == 1u) next[key] += __popc(peers);  // the highest lane of the group advances it
    }
    __syncwarp();
  }
}

// All of count, scan and place in one block of any size from 32 threads, for a chunk of at most kOneBlockPermEntries
// entries (plan.h; decode and small batches, where three launches cost more than the work). The entries' experts are
// read once, into shared memory, for warp 0's in-order placement (a global read a step made it a row of memory
// latencies). The caller has waited for the routing (PDL).
__device__ __forceinline__ void one_block(const PermuteParams& p) {
  __shared__ int offs[4097];
  __shared__ int toffs[4097];
  __shared__ int16_t s_exp[kOneBlockPermEntries];
  for (int e = threadIdx.x; e < p.E_loc; e += blockDim.x) offs[e] = 0;
  for (int c = threadIdx.x; c < p.num_counters; c += blockDim.x) p.zero_counters[c] = 0;
  __syncthreads();
  bool bad = false;
  for (int i = threadIdx.x; i < p.rows; i += blockDim.x) {
    const int e = local_expert(p, i);
    if (i < kOneBlockPermEntries) s_exp[i] = static_cast<int16_t>(e);
    if (e >= 0) atomicAdd(&offs[e], 1);  // integer counts: the result does not depend on the order
    bad |= e == -2;
  }
  if (bad) atomicExch(p.error_flag, 1);
  __syncthreads();
  offsets_and_tiles(p, offs, toffs);
  __syncthreads();  // the tile list has read offs; warp 0 now advances it as each expert's next row
  if (threadIdx.x < 32) place_entries(p, offs, 0, p.rows, p.rows <= kOneBlockPermEntries ? s_exp : nullptr);
}

}  // namespace fp4moe::cuda_backend::perm
