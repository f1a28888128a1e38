// Multi-LoRA shrink kernels (SPEC §5). The expand half runs inside the GEMM epilogues
// (lora_expand.cuh, on the tensor cores) and, for SharedOuter's down projection, in the combine:
// no [T, k, 2I] delta ever goes through memory.
//
// Every shrink output t = bf16(in . A[i]) has one order, on the tensor cores, in every kernel here: K is cut into
// chunks of kKChunk (the GEMMs' chunks); a chunk's sum is one chain of m16n8k16 steps from +0 (A rows as the mma A
// operand, up to 16 rank rows; the input rows as B, 8 a group), and t is bf16 of the chunk sums added in chunk
// order. The steps go in pairs over 32 k: lane t's 8 consecutive k of a pair (one 16-byte load of each row) feed
// the first step with their first four and the second with their last four (the same k on both operands; past K
// zeros). An output depends on its own A row and input row only, not on which rows share its mma, so the
// per-token, per-row and tiled kernels give the same bits (tested), and a token's bits never depend on the other
// tokens or on their adapters. (An earlier order, fp32 FMA on the CUDA cores then a butterfly, was issue-bound:
// bench/NOTES.md.)
#include <algorithm>
#include <string>

#include "cuda/kernels.h"
#include "cuda/mma.cuh"
#include "cuda/nvfp4_device.cuh"
#include "cuda/pdl.cuh"
#include "cuda/permute_one_block.cuh"

namespace fp4moe::cuda_backend {
namespace {

constexpr int kMaxTileRows = 128;  // the largest GEMM tile's rows (plan.h kGemmConfigs)
constexpr bool tiles_fit() {
  for (const GemmConfig& c : kGemmConfigs)
    if (c.bm > kMaxTileRows) return false;
  return true;
}
static_assert(tiles_fit(), "lora_shrink_tiled_kernel keeps a tile's rows in shared memory");
constexpr int kChunk = static_cast<int>(kKChunk);
static_assert(kChunk % 32 == 0, "a chunk holds whole pairs of k16 steps");

// One shrink item as one lane sees it: 16 rank rows of A (a0: row g, a1: row g + 8 of this lane; null past the
// rank) against NG groups of 8 input rows (x[j]: row g of group j; null past the rows).
template <int NG> struct ShrinkLane {
  const uint16_t* a0 = nullptr;
  const uint16_t* a1 = nullptr;
  const uint16_t* x[NG] = {};
};

__device__ __forceinline__ uint4 load16(const uint16_t* p, bool ok) {
  return ok && p ? __ldg(reinterpret_cast<const uint4*>(p)) : make_uint4(0u, 0u, 0u, 0u);
}

// d[j] = the chain of one K chunk [kb, ke) (kb a multiple of kChunk, ke of 16) from +0: thread (g, t) gets
// (rank g, row 2t), (g, 2t + 1), (g + 8, 2t), (g + 8, 2t + 1) of group j. U pairs of steps' loads in flight.
template <int NG>
__device__ __forceinline__ void shrink_chunk(float (&d)[NG][4], const ShrinkLane<NG>& L, int kb, int ke, int t) {
  constexpr int U = NG >= 4 ? 2 : 8;
#pragma unroll
  for (int j = 0; j < NG; ++j) d[j][0] = d[j][1] = d[j][2] = d[j][3] = 0.f;
  for (int k0 = kb; k0 < ke; k0 += 32 * U) {
    uint4 av[U][2], xv[U][NG];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int k = k0 + 32 * u + 8 * t;
      const bool in = k < ke;  // ke and k are multiples of 8: the lane's 8 k are all in or all out
      av[u][0] = load16(L.a0 + k, in && L.a0);
      av[u][1] = load16(L.a1 + k, in && L.a1);
#pragma unroll
      for (int j = 0; j < NG; ++j) xv[u][j] = load16(L.x[j] + k, in && L.x[j]);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (k0 + 32 * u >= ke) break;  // warp-uniform
#pragma unroll
      for (int j = 0; j < NG; ++j) {
        const uint32_t a1[4] = {av[u][0].x, av[u][1].x, av[u][0].y, av[u][1].y}, b1[2] = {xv[u][j].x, xv[u][j].y};
        dev::mma_bf16_16816(d[j], a1, b1);
        const uint32_t a2[4] = {av[u][0].z, av[u][1].z, av[u][0].w, av[u][1].w}, b2[2] = {xv[u][j].z, xv[u][j].w};
        dev::mma_bf16_16816(d[j], a2, b2);
      }
    }
  }
}

// The shrinks of `items` items by one block (every thread, block-uniform arguments): lane_at(item) gives the lane's
// ShrinkLane, store(item, s) takes the lane's sums s[j][q] (rounded by the caller). Warps take (item, chunk) units,
// up to kUnits a round, their chunk sums meet in part[unit][lane]; one warp an item adds them in chunk order (with
// more than kUnits chunks, one item a round and warp 0 carries the sum over rounds). So the chunks of one item run
// on several warps (a decode token's shrink is one item of ~14 chunks), and short-K items (one chunk) share a round.
constexpr int kUnits = 16;
template <int NG, class LaneAt, class Store>
__device__ __forceinline__ void block_shrink(int items, int K, float4 (*part)[32][NG], LaneAt&& lane_at,
                                             Store&& store) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5, t = lane & 3;
  const int chunks = (K + kChunk - 1) / kChunk, cpr = min(chunks, kUnits), nb = kUnits / cpr;
  float tot[NG][4];
  for (int b0 = 0; b0 < items; b0 += nb) {
    const int nbi = min(nb, items - b0);
    for (int c0 = 0; c0 < chunks; c0 += cpr) {
      const int nc = min(cpr, chunks - c0);
      for (int u = warp; u < nbi * nc; u += nw) {
        const int item = b0 + u / nc, c = c0 + u % nc;
        float d[NG][4];
        shrink_chunk<NG>(d, lane_at(item), c * kChunk, min(K, (c + 1) * kChunk), t);
#pragma unroll
        for (int j = 0; j < NG; ++j) part[u][lane][j] = make_float4(d[j][0], d[j][1], d[j][2], d[j][3]);
      }
      __syncthreads();
      for (int bi = warp; bi < nbi; bi += nw) {
        float s[NG][4];
        for (int c = 0; c < nc; ++c) {
#pragma unroll
          for (int j = 0; j < NG; ++j) {
            const float4 v = part[bi * nc + c][lane][j];
            const float w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
            for (int q = 0; q < 4; ++q)
              s[j][q] = c0 == 0 && c == 0 ? w[q] : __fadd_rn(c == 0 ? tot[j][q] : s[j][q], w[q]);
          }
        }
        if (c0 + nc == chunks) store(b0 + bi, s);
        else {
#pragma unroll
          for (int j = 0; j < NG; ++j)
#pragma unroll
            for (int q = 0; q < 4; ++q) tot[j][q] = s[j][q];
        }
      }
      __syncthreads();
    }
  }
}

// The per-token and per-row kernels' items: rpi (4, 8 or 16) rank rows of A from i0 against one input row (NG = 1,
// column 0 of the mma; lanes of other rows and columns load nothing). The plan takes fewer rows an item for a few
// tokens (plan.lora_shrink1_rows_per_item): a decode token's shrink is latency- and per-SM-bandwidth-bound, and 16
// rows an item put 229 KB of A1 (kimi_k3_tp8) on each of nine SMs (shrink1 at T=1 6.2 -> 9.4 us, ncu, r4).
__device__ __forceinline__ ShrinkLane<1> one_row_lane(const uint16_t* in, const uint16_t* A, int r, int i0, int K,
                                                      int rpi) {
  const int gq = (threadIdx.x & 31) >> 2;
  ShrinkLane<1> L;
  if (gq < rpi && i0 + gq < r) L.a0 = A + static_cast<int64_t>(i0 + gq) * K;
  if (gq + 8 < rpi && i0 + gq + 8 < r) L.a1 = A + static_cast<int64_t>(i0 + gq + 8) * K;
  if (gq == 0) L.x[0] = in;
  return L;
}
// Stores an item of one_row_lane: rank rows i0 + g and i0 + g + 8 of column 0 (lanes t = 0).
__device__ __forceinline__ void store_one_row(const float (&s)[1][4], float* dst, int r, int i0, int rpi) {
  const int lane = threadIdx.x & 31, gq = lane >> 2;
  if ((lane & 3) != 0) return;
  if (gq < rpi && i0 + gq < r) dst[i0 + gq] = dev::round_to_bf16(s[0][0]);
  if (gq + 8 < rpi && i0 + gq + 8 < r) dst[i0 + gq + 8] = dev::round_to_bf16(s[0][2]);
}

// One shrink1 item: rows_per_item rank rows of one A against the token's x.
struct Shrink1Item {
  const uint16_t* A = nullptr;
  float* dst = nullptr;
  int r = 0, i0 = 0;
};

// Block (token t, item y): the token's items are its routed entries' A1 (entry j, in rows_per_item-row blocks; one row t*k
// for a shared A1) then the shared expert's. Block y = 0 of each token also resolves and publishes its slot.
// Up to 512 threads (plan.lora_shrink1_threads: a warp a K chunk, at most 16): left to itself ptxas took 134
// registers, and 448-thread launches failed on the H200 (cudaErrorLaunchOutOfResources, deepseek_v3_ep8).
// PERMUTE (plan.lora_shrink1_permutes): grid row 0 is the chunk's one-block permutation in block (0, 0), the items
// follow from row 1. Both need only the routing, so in one launch they run side by side, where in two the
// permutation waited for the whole shrink.
template <bool PERMUTE>
__global__ void __launch_bounds__(512) lora_shrink1_kernel(LoraShrink1Params p, PermuteParams pp) {
  __shared__ float4 part[kUnits][32][1];
  __shared__ Shrink1Item s_item;
  const int t = static_cast<int>(blockIdx.x);
  int y = static_cast<int>(blockIdx.y);
  if constexpr (PERMUTE) {
    if (y == 0) {
      dev::pdl_wait();
      dev::pdl_launch_dependents();
      if (t == 0) perm::one_block(pp);
      return;
    }
    --y;
  }
  // Before the wait when another kernel of the call ran first: the slot, from the call's adapter_ids and the slot
  // table (written before the chain).
  if (!p.slots_before_wait) dev::pdl_wait();
  int slot = -1;
  LoraProj gu{}, sg{};
  if (threadIdx.x == 0) {
    // Where adapter_ids are flagged (GEMM1 beside this kernel reads them with the same check): anything but -1 or a
    // loaded slot is dropped (base) and flagged (by the token's first block, which also publishes the slot).
    const int id = p.adapter_ids[t];
    slot = checked_slot(p.table, p.num_slots, id);
    if (slot >= 0) {
      gu = p.table[slot].proj[kLoraGateUp];
      if (p.shared_expert) sg = p.table[slot].proj[kLoraSharedGateUp];
    }
    if (slot < 0 && id != -1) slot = -2;  // flagged after the wait, after the routing's own flags as before
  }
  if (p.slots_before_wait) dev::pdl_wait();  // the routing's ids
  dev::pdl_launch_dependents();
  if (threadIdx.x == 0) {
    if (slot == -2) {
      slot = -1;
      if (y == 0) atomicExch(p.error_flag, kErrAdapterIds);
    }
    if (y == 0) p.token_slot[t] = slot;
    Shrink1Item it;
    if (slot >= 0) {
      const int rpi = p.rows_per_item;
      const Shrink1Items n = shrink1_items(gu.r, gu.a_shared != 0, sg.r, p.k, rpi, p.routed_in_tiles);
      if (y < n.routed) {
        const int j = y / n.per_entry, entry = t * p.k + j;
        int e = 0;
        if (!gu.a_shared) e = p.ids[entry] - p.local_offset;
        if (e >= 0 && e < p.E_loc) {  // else another rank's expert or a dropped id: no GEMM row reads it
          it.A = gu.A + static_cast<int64_t>(e) * gu.r * p.H;
          it.dst = p.t1 + static_cast<int64_t>(entry) * p.t1_stride;
          it.r = gu.r;
          it.i0 = (y % n.per_entry) * rpi;
        }
      } else if (y < n.routed + n.shared) {
        it.A = sg.A;
        it.dst = p.st1 + static_cast<int64_t>(t) * p.st_stride;
        it.r = sg.r;
        it.i0 = (y - n.routed) * rpi;
      }
    }
    s_item = it;
  }
  __syncthreads();
  const Shrink1Item it = s_item;
  if (!it.A) return;  // block-uniform
  const uint16_t* x = p.x + static_cast<int64_t>(t) * p.H;
  block_shrink<1>(
      1, p.H, part, [&](int) { return one_row_lane(x, it.A, it.r, it.i0, p.H, p.rows_per_item); },
      [&](int, const float (&s)[1][4]) { store_one_row(s, it.dst, it.r, it.i0, p.rows_per_item); });
}

// The tiled shrink's runs: up to kRunRows rows of one adapter (4 groups of 8 in one item's mma B operand).
constexpr int kRunRows = 32, kRunGroups = kRunRows / 8;
constexpr int kTiledBlocks = 4;  // blocks a tile (the tile's items are dealt out among them)

// The routed shrinks over GEMM1's row tiles (plan.lora_shrink_tiled), after the permutation: a tile's rows are
// one expert's, ordered by adapter slot (order_by_adapter_kernel), so a run of rows with one slot shares
// A_{slot,e}: an item is (run, 16 rank rows), and one read of its A rows serves the run's rows. (The per-token
// kernel reads A1 once per (token, slot) entry: kimi_k3_tp8 T=1024 with eight rank-16 adapters touched 940 MB of
// A1 rows for 352 MB of distinct ones.)
__global__ void __launch_bounds__(128) lora_shrink_tiled_kernel(LoraTiledShrinkParams p) {
  __shared__ float4 part[kUnits][32][kRunGroups];
  __shared__ int s_entry[kMaxTileRows], s_slot[kMaxTileRows], s_run0[kMaxTileRows + 1], s_item0[kMaxTileRows + 1];
  __shared__ LoraProj s_proj[kMaxTileRows];
  dev::pdl_wait();
  dev::pdl_launch_dependents();
  __shared__ int s_runs;
  const int tile = static_cast<int>(blockIdx.x);
  if (tile >= p.tile_info[2 * p.max_tiles]) return;  // fewer tiles than the plan's bound
  const int e = p.tile_info[2 * tile], row0 = p.tile_info[2 * tile + 1];
  const int n = min(p.bm, p.expert_offsets[e + 1] - row0);
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    const int entry = p.row_entry[row0 + i];
    s_entry[i] = entry;
    s_slot[i] = p.token_slot[entry / p.k];
  }
  __syncthreads();
  if (threadIdx.x == 0) {  // runs of one slot (at most kRunRows rows) and their first item
    int runs = 0, items = 0;
    for (int r0 = 0; r0 < n;) {
      const int slot = s_slot[r0];
      int r1 = r0 + 1;
      while (r1 < n && r1 - r0 < kRunRows && s_slot[r1] == slot) ++r1;
      LoraProj pj = slot >= 0 ? p.table[slot].proj[p.which] : LoraProj{};
      // A shared A1 (SharedOuter gate_up) is the per-token kernel's: one t row per token.
      if (pj.r <= 0 || (pj.a_shared && p.which == kLoraGateUp)) pj.r = 0;
      s_run0[runs] = r0;
      s_item0[runs] = items;
      s_proj[runs] = pj;
      items += (pj.r + 15) / 16;
      ++runs;
      r0 = r1;
    }
    s_run0[runs] = n;
    s_item0[runs] = items;
    s_runs = runs;
  }
  __syncthreads();
  const int runs = s_runs, items = s_item0[runs], y = static_cast<int>(blockIdx.y);
  const int mine = items > y ? (items - y + kTiledBlocks - 1) / kTiledBlocks : 0;  // items y, y + 4, ...
  const int gq = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3;
  auto locate = [&](int m, int& run, int& i0) {  // this block's m-th item: its run and first rank row
    const int item = y + kTiledBlocks * m;
    run = 0;
    while (s_item0[run + 1] <= item) ++run;
    i0 = (item - s_item0[run]) * 16;
  };
  block_shrink<kRunGroups>(
      mine, p.K, part,
      [&](int m) {
        int run, i0;
        locate(m, run, i0);
        const LoraProj& pj = s_proj[run];
        const uint16_t* A = pj.A + static_cast<int64_t>(pj.a_shared ? 0 : e) * pj.r * p.K;
        ShrinkLane<kRunGroups> L;
        if (i0 + gq < pj.r) L.a0 = A + static_cast<int64_t>(i0 + gq) * p.K;
        if (i0 + gq + 8 < pj.r) L.a1 = A + static_cast<int64_t>(i0 + gq + 8) * p.K;
        const int r0 = s_run0[run], cnt = s_run0[run + 1] - r0;
#pragma unroll
        for (int j = 0; j < kRunGroups; ++j) {
          const int rr = j * 8 + gq;
          if (rr < cnt)
            L.x[j] = p.in + static_cast<int64_t>(p.gather ? s_entry[r0 + rr] / p.k : row0 + r0 + rr) * p.K;
        }
        return L;
      },
      [&](int m, const float (&s)[kRunGroups][4]) {
        int run, i0;
        locate(m, run, i0);
        const int r = s_proj[run].r, r0 = s_run0[run], cnt = s_run0[run + 1] - r0;
#pragma unroll
        for (int j = 0; j < kRunGroups; ++j)
#pragma unroll
          for (int q = 0; q < 4; ++q) {
            const int rr = j * 8 + 2 * t + (q & 1), i = i0 + gq + 8 * (q >> 1);
            if (rr < cnt && i < r)
              p.t[static_cast<int64_t>(s_entry[r0 + rr]) * p.t_stride + i] = dev::round_to_bf16(s[j][q]);
          }
      });
}

// Block per row: the row's items are rows_per_item-row blocks of its adapter's A (routed: A2 of the row's expert).
__global__ void __launch_bounds__(512) lora_shrink2_kernel(LoraShrink2Params p) {  // up to 16 warps (plan)
  __shared__ float4 part[kUnits][32][1];
  // Before the wait, the row's adapter: from the permutation (if any), the routing and the x shrink, which finished
  // before the GEMM that wrote a (this kernel's predecessor) let this one start.
  const int row = static_cast<int>(blockIdx.x);
  // Block 0 waits even without a LoRA row: GEMM2 beside this kernel starts its mainloop (GEMM1's a) only after a
  // block of this one saw GEMM1 finish.
  if (row == 0) dev::pdl_wait();
  if (p.row_count && row >= *p.row_count) return;  // rows the permutation did not fill
  int entry = row, token = row, e = 0;
  if (p.ids) {  // routed: permuted rows, or under entry tiles the entries themselves
    entry = p.row_entry ? p.row_entry[row] : row;
    token = entry / p.k;
    e = p.ids[entry] - p.local_offset;
    if (e < 0 || e >= p.E_loc) return;  // another rank's expert (entry tiles; the permutation placed only local ones)
  }
  const int slot = p.token_slot[token];
  if (slot < 0) return;
  const LoraProj pj = p.table[slot].proj[p.which];
  if (pj.r <= 0) return;
  const uint16_t* a = p.a + static_cast<int64_t>(row) * p.K;
  const uint16_t* A = pj.A + static_cast<int64_t>(pj.a_shared ? 0 : e) * pj.r * p.K;
  float* dst = p.t + static_cast<int64_t>(entry) * p.t_stride;
  const int rpi = p.rows_per_item;
  dev::pdl_wait();
  dev::pdl_launch_dependents();
  block_shrink<1>(
      (pj.r + rpi - 1) / rpi, p.K, part, [&](int m) { return one_row_lane(a, A, pj.r, rpi * m, p.K, rpi); },
      [&](int m, const float (&s)[1][4]) { store_one_row(s, dst, pj.r, rpi * m, rpi); });
}

}  // namespace

void launch_lora_shrink1(const LoraShrink1Params& p, int threads, const PermuteParams* permute, cudaStream_t stream) {
  if (p.T <= 0) return;
  const unsigned items = static_cast<unsigned>(p.max_items) + (permute ? 1u : 0u);
  if (permute)
    launch_pdl(lora_shrink1_kernel<true>, dim3(static_cast<unsigned>(p.T), items), dim3(threads), 0, stream,
               "lora_shrink1_kernel", p, *permute);
  else
    launch_pdl(lora_shrink1_kernel<false>, dim3(static_cast<unsigned>(p.T), items), dim3(threads), 0, stream,
               "lora_shrink1_kernel", p, PermuteParams{});
}

void launch_lora_shrink_tiled(const LoraTiledShrinkParams& p, cudaStream_t stream) {
  if (p.max_tiles <= 0) return;
  // 4 warps a block, kTiledBlocks blocks a tile: the tile's (run, 16 rank rows) items are dealt out to the blocks,
  // an item's chunks to a block's warps.
  launch_pdl(lora_shrink_tiled_kernel, dim3(static_cast<unsigned>(p.max_tiles), kTiledBlocks), dim3(128), 0, stream,
             "lora_shrink_tiled_kernel", p);
}

void launch_lora_shrink2(const LoraShrink2Params& p, int threads, cudaStream_t stream) {
  if (p.rows <= 0) return;
  launch_pdl(lora_shrink2_kernel, dim3(static_cast<unsigned>(p.rows)), dim3(threads), 0, stream, "lora_shrink2_kernel", p);
}

}  // namespace fp4moe::cuda_backend
