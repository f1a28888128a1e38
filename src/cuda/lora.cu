// Multi-LoRA shrink kernels (SPEC §5). The expand half runs inside the GEMM epilogues
// (lora_expand.cuh, on the tensor cores) and, for SharedOuter's down projection, in the combine:
// no [T, k, 2I] delta ever goes through memory. Each shrink output is one warp's dot product in a fixed
// order (lanes stride over 8-element chunks, then a butterfly), so it depends on its own row only: a
// token's bits never depend on the other tokens or on their adapters.
#include <algorithm>

#include "cuda/kernels.h"
#include "cuda/nvfp4_device.cuh"

namespace fp4moe::cuda_backend {
namespace {

constexpr int kMaxTileRows = 64;  // the largest GEMM tile's rows (plan.h kGemmConfigs)
constexpr bool tiles_fit() {
  for (const GemmConfig& c : kGemmConfigs)
    if (c.bm > kMaxTileRows) return false;
  return true;
}
static_assert(tiles_fit(), "lora_shrink_tiled_kernel keeps a tile's rows in shared memory");

__device__ __forceinline__ float lo_bf16(uint32_t w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float hi_bf16(uint32_t w) { return __uint_as_float(w & 0xffff0000u); }

// One 8-element chunk of a lane's chain: acc += x[i] * a[i], i = 0..7 in order, fp32 FMA.
__device__ __forceinline__ void fma_chunk8(float& acc, const uint4& xv, const uint4& av) {
  acc = __fmaf_rn(lo_bf16(xv.x), lo_bf16(av.x), acc);
  acc = __fmaf_rn(hi_bf16(xv.x), hi_bf16(av.x), acc);
  acc = __fmaf_rn(lo_bf16(xv.y), lo_bf16(av.y), acc);
  acc = __fmaf_rn(hi_bf16(xv.y), hi_bf16(av.y), acc);
  acc = __fmaf_rn(lo_bf16(xv.z), lo_bf16(av.z), acc);
  acc = __fmaf_rn(hi_bf16(xv.z), hi_bf16(av.z), acc);
  acc = __fmaf_rn(lo_bf16(xv.w), lo_bf16(av.w), acc);
  acc = __fmaf_rn(hi_bf16(xv.w), hi_bf16(av.w), acc);
}
// The lanes' partial sums added by a fixed butterfly: the same value in every lane.
__device__ __forceinline__ float warp_sum(float acc) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) acc = __fadd_rn(acc, __shfl_xor_sync(0xffffffffu, acc, off));
  return acc;
}

// sum_k x_j[k] * a[k] over K (a multiple of 8; x_j and a 16-byte aligned) for the first n <= ROWS rows x_j, fp32,
// the same value in every lane: per row one chain over the lane's chunks c = lane, lane + 32, ... in order, then a
// fixed butterfly — the same bits whatever ROWS and UNROLL. One read of the row of A serves all the rows x_j. The
// loads of UNROLL chunks a lane are issued before their multiply-adds: with one chunk in flight a decode token's
// shrink was a row of dependent memory latencies (ncu, kimi_k3_tp8 T=1: shrink1 ~10 us for 14 chunks a lane), and
// the tiled shrink latency-bound (kimi T=1024: 270 us against the per-token kernel's 235).
template <int ROWS, int UNROLL>
__device__ __forceinline__ void warp_dot_rows(const uint16_t* const xr[ROWS], int n, const uint16_t* a, int K, int lane,
                                              float out[ROWS]) {
  float acc[ROWS];
#pragma unroll
  for (int j = 0; j < ROWS; ++j) acc[j] = 0.f;
  const int chunks = K >> 3;
  for (int c0 = lane; c0 < chunks; c0 += 32 * UNROLL) {
    uint4 av[UNROLL], xv[ROWS][UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int c = c0 + 32 * u;
      if (c < chunks) av[u] = *reinterpret_cast<const uint4*>(a + c * 8);
#pragma unroll
      for (int j = 0; j < ROWS; ++j)
        if (j < n && c < chunks) xv[j][u] = *reinterpret_cast<const uint4*>(xr[j] + c * 8);
    }
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      if (c0 + 32 * u >= chunks) break;
#pragma unroll
      for (int j = 0; j < ROWS; ++j) {
        if (j >= n) break;
        fma_chunk8(acc[j], xv[j][u], av[u]);
      }
    }
  }
#pragma unroll
  for (int j = 0; j < ROWS; ++j) out[j] = warp_sum(acc[j]);
}
// One row: sum_k x[k] * a[k], eight chunks a lane in flight.
__device__ __forceinline__ float warp_dot_bf16(const uint16_t* x, const uint16_t* a, int K, int lane) {
  const uint16_t* const xr[1] = {x};
  float v[1];
  warp_dot_rows<1, 8>(xr, 1, a, K, lane, v);
  return v[0];
}

__global__ void lora_shrink1_kernel(LoraShrink1Params p) {
  const int t = static_cast<int>(blockIdx.x);
  __shared__ int s_slot;
  if (threadIdx.x == 0) {
    // The only place adapter_ids are read: anything but -1 or a loaded slot is dropped (base) and flagged (by the
    // token's first block, which also publishes the slot).
    const int id = p.adapter_ids[t];
    int slot = -1;
    if (id >= 0 && id < p.num_slots && p.table[id].loaded) slot = id;
    else if (id != -1 && blockIdx.y == 0) atomicExch(p.error_flag, kErrAdapterIds);
    if (blockIdx.y == 0) p.token_slot[t] = slot;
    s_slot = slot;
  }
  __syncthreads();
  const int slot = s_slot;
  if (slot < 0) return;
  const LoraProj gu = p.table[slot].proj[kLoraGateUp];
  const LoraProj sg = p.shared_expert ? p.table[slot].proj[kLoraSharedGateUp] : LoraProj{};
  const uint16_t* x = p.x + static_cast<int64_t>(t) * p.H;
  const int n_routed = gu.r > 0 && (gu.a_shared || !p.routed_in_tiles) ? (gu.a_shared ? 1 : p.k) * gu.r : 0;
  const int n_total = n_routed + (sg.r > 0 ? sg.r : 0);
  const int lane = threadIdx.x & 31, nwarps = (blockDim.x >> 5) * gridDim.y;
  const int warp = static_cast<int>(blockIdx.y) * (blockDim.x >> 5) + (threadIdx.x >> 5);
  for (int o = warp; o < n_total; o += nwarps) {  // o is warp-uniform; the token's blocks share its outputs
    const uint16_t* arow;
    float* dst;
    if (o < n_routed) {
      const int j = o / gu.r, i = o % gu.r;
      const int entry = t * p.k + j;
      int e = 0;
      if (!gu.a_shared) {
        e = p.ids[entry] - p.local_offset;
        if (e < 0 || e >= p.E_loc) continue;  // another rank's expert or a dropped id: no GEMM row reads it
      }
      arow = gu.A + (static_cast<int64_t>(e) * gu.r + i) * p.H;
      dst = p.t1 + static_cast<int64_t>(entry) * p.t1_stride + i;
    } else {
      const int i = o - n_routed;
      arow = sg.A + static_cast<int64_t>(i) * p.H;
      dst = p.st1 + static_cast<int64_t>(t) * p.st_stride + i;
    }
    const float v = warp_dot_bf16(x, arow, p.H, lane);
    if (lane == 0) *dst = dev::round_to_bf16(v);
  }
}

// The tiled shrink's runs: up to kRunRows rows of x against one row of A, kUnroll chunks a lane in flight.
constexpr int kRunRows = 4, kUnroll = 4;

// The routed shrinks over GEMM1's row tiles (plan.lora_shrink_tiled), after the permutation: a tile's rows are
// one expert's, ordered by adapter slot (order_by_adapter_kernel), so a run of rows with one slot shares
// A_{slot,e}. The per-token kernel read A1 once per (token, slot) entry: kimi_k3_tp8 T=1024 with eight rank-16
// adapters touched 940 MB of A1 rows for 352 MB of distinct ones (ncu: 235 us). Each output is the warp dot of
// warp_dot_bf16 (the per-token / per-row kernels' bits). Work items (run of <= kRunRows rows, row i of A) are
// spread over the warps of the tile's gridDim.y blocks.
__global__ void lora_shrink_tiled_kernel(LoraTiledShrinkParams p) {
  __shared__ int s_entry[kMaxTileRows], s_slot[kMaxTileRows], s_run0[kMaxTileRows + 1], s_item0[kMaxTileRows + 1];
  __shared__ LoraProj s_proj[kMaxTileRows];
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
  if (threadIdx.x == 0) {  // runs of one slot (at most kRunRows rows) and their first work item
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
      items += pj.r;
      ++runs;
      r0 = r1;
    }
    s_run0[runs] = n;
    s_item0[runs] = items;
    s_runs = runs;
  }
  __syncthreads();
  const int runs = s_runs, items = s_item0[runs];
  const int lane = threadIdx.x & 31, nwarps = (blockDim.x >> 5) * gridDim.y;
  const int warp = static_cast<int>(blockIdx.y) * (blockDim.x >> 5) + (threadIdx.x >> 5);
  int run = 0;
  for (int item = warp; item < items; item += nwarps) {  // warp-uniform
    while (s_item0[run + 1] <= item) ++run;
    const LoraProj& pj = s_proj[run];
    const int i = item - s_item0[run], r0 = s_run0[run], cnt = s_run0[run + 1] - r0;
    const uint16_t* xr[kRunRows];
#pragma unroll
    for (int j = 0; j < kRunRows; ++j) {
      const int r = r0 + (j < cnt ? j : 0);
      xr[j] = p.in + static_cast<int64_t>(p.gather ? s_entry[r] / p.k : row0 + r) * p.K;
    }
    const uint16_t* arow = pj.A + (static_cast<int64_t>(pj.a_shared ? 0 : e) * pj.r + i) * p.K;
    float v[kRunRows];
    warp_dot_rows<kRunRows, kUnroll>(xr, cnt, arow, p.K, lane, v);
    if (lane == 0) {
#pragma unroll
      for (int j = 0; j < kRunRows; ++j)
        if (j < cnt) p.t[static_cast<int64_t>(s_entry[r0 + j]) * p.t_stride + i] = dev::round_to_bf16(v[j]);
    }
  }
}

__global__ void lora_shrink2_kernel(LoraShrink2Params p) {
  const int row = static_cast<int>(blockIdx.x);
  if (p.row_count && row >= *p.row_count) return;  // rows the permutation did not fill
  int entry = row, token = row, e = 0;
  if (p.row_entry) {
    entry = p.row_entry[row];
    token = entry / p.k;
    e = p.ids[entry] - p.local_offset;  // a local expert: the permutation placed only those
  }
  const int slot = p.token_slot[token];
  if (slot < 0) return;
  const LoraProj pj = p.table[slot].proj[p.which];
  if (pj.r <= 0) return;
  const uint16_t* a = p.a + static_cast<int64_t>(row) * p.K;
  const uint16_t* A = pj.A + static_cast<int64_t>(pj.a_shared ? 0 : e) * pj.r * p.K;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  for (int i = warp; i < pj.r; i += nwarps) {
    const float v = warp_dot_bf16(a, A + static_cast<int64_t>(i) * p.K, p.K, lane);
    if (lane == 0) p.t[static_cast<int64_t>(entry) * p.t_stride + i] = dev::round_to_bf16(v);
  }
}

}  // namespace

void launch_lora_shrink1(const LoraShrink1Params& p, int threads, cudaStream_t stream) {
  if (p.T <= 0) return;
  const int warps = threads / 32, per_token = std::max(1, (p.max_outputs + warps - 1) / warps);
  lora_shrink1_kernel<<<dim3(static_cast<unsigned>(p.T), static_cast<unsigned>(per_token)), threads, 0, stream>>>(p);
  check_launch("lora_shrink1_kernel");
}

void launch_lora_shrink_tiled(const LoraTiledShrinkParams& p, cudaStream_t stream) {
  if (p.max_tiles <= 0) return;
  // 4 warps a block, 4 blocks a tile: 16 warps share the tile's (run, A row) items.
  lora_shrink_tiled_kernel<<<dim3(static_cast<unsigned>(p.max_tiles), 4u), 128, 0, stream>>>(p);
  check_launch("lora_shrink_tiled_kernel");
}

void launch_lora_shrink2(const LoraShrink2Params& p, int threads, cudaStream_t stream) {
  if (p.rows <= 0) return;
  lora_shrink2_kernel<<<static_cast<unsigned>(p.rows), threads, 0, stream>>>(p);
  check_launch("lora_shrink2_kernel");
}

}  // namespace fp4moe::cuda_backend
