// Multi-LoRA shrink kernels (SPEC §5). The expand half runs inside the GEMM epilogues
// (lora_expand.cuh, on the tensor cores) and, for SharedOuter's down projection, in the combine:
// no [T, k, 2I] delta ever goes through memory. Each shrink output depends on its own row only (a token's
// bits never depend on the other tokens or on their adapters):
//   - the routed gate_up shrink with per-expert A1 (the bulk: k * r1 outputs of length H a token) runs on the
//     tensor cores over the permuted rows (lora_shrink1_routed_kernel): one mma chain per adapter of a 16-row
//     block, K split over the warps in fixed slices added in warp order, rows of other adapters discarded;
//   - the others (per token: SharedOuter's shared A1, the shared expert's; per row: the down shrink) are one
//     warp's dot product in a fixed order (lanes stride over 8-element chunks, then a butterfly).
#include <algorithm>

#include "cuda/kernels.h"
#include "cuda/lora_expand.cuh"
#include "cuda/nvfp4_device.cuh"

namespace fp4moe::cuda_backend {
namespace {

__device__ __forceinline__ float lo_bf16(uint32_t w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float hi_bf16(uint32_t w) { return __uint_as_float(w & 0xffff0000u); }

// sum_k x[k] * a[k] over K (a multiple of 8; x and a 16-byte aligned), fp32, same value in every lane.
__device__ __forceinline__ float warp_dot_bf16(const uint16_t* x, const uint16_t* a, int K, int lane) {
  float acc = 0.f;
  const int chunks = K >> 3;
  for (int c = lane; c < chunks; c += 32) {
    const uint4 xv = *reinterpret_cast<const uint4*>(x + c * 8);
    const uint4 av = *reinterpret_cast<const uint4*>(a + c * 8);
    acc = __fmaf_rn(lo_bf16(xv.x), lo_bf16(av.x), acc);
    acc = __fmaf_rn(hi_bf16(xv.x), hi_bf16(av.x), acc);
    acc = __fmaf_rn(lo_bf16(xv.y), lo_bf16(av.y), acc);
    acc = __fmaf_rn(hi_bf16(xv.y), hi_bf16(av.y), acc);
    acc = __fmaf_rn(lo_bf16(xv.z), lo_bf16(av.z), acc);
    acc = __fmaf_rn(hi_bf16(xv.z), hi_bf16(av.z), acc);
    acc = __fmaf_rn(lo_bf16(xv.w), lo_bf16(av.w), acc);
    acc = __fmaf_rn(hi_bf16(xv.w), hi_bf16(av.w), acc);
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) acc = __fadd_rn(acc, __shfl_xor_sync(0xffffffffu, acc, off));
  return acc;
}

__device__ __forceinline__ float round_bf16(float v) { return dev::bf16_to_f32(dev::f32_to_bf16(v)); }

constexpr int kRoutedWarps = 8;  // K slices of lora_shrink1_routed_kernel

// Block (tile, y): permuted rows [row0 + 16y, +16) of a GEMM tile (one expert). For each adapter of those rows
// (ascending), t1[entry][0:r1] = bf16(x_token . A1_{s,e}^T) for its rows: A = 16 x rows, B = A1 rows (n = rank
// index), 32 ranks at a time; warp w sums K slice w, and warp 0 adds the slices in warp order.
__global__ void __launch_bounds__(kRoutedWarps * 32) lora_shrink1_routed_kernel(LoraShrinkRoutedParams p) {
  __shared__ float part[kRoutedWarps][4][4][32];  // [warp][n tile][reg][lane]
  const int tile = static_cast<int>(blockIdx.x);
  if (tile >= p.tile_info[2 * p.max_tiles]) return;
  const int e = p.tile_info[2 * tile];
  const int row0 = p.tile_info[2 * tile + 1] + 16 * static_cast<int>(blockIdx.y);
  const int row_end = min(p.tile_info[2 * tile + 1] + p.bm, p.expert_offsets[e + 1]);
  if (row0 >= row_end) return;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  // This lane's A rows g and g + 8: entry, x row, and the slot if its gate_up A is per expert (else -1).
  int entry[2], key[2];
  const uint16_t* xrow[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = row0 + g + 8 * h;
    entry[h] = -1;
    key[h] = -1;
    xrow[h] = nullptr;
    if (r < row_end) {
      entry[h] = p.row_entry[r];
      const int tok = entry[h] / p.k;
      xrow[h] = p.x + static_cast<int64_t>(tok) * p.H;
      const int slot = p.token_slot[tok];
      if (slot >= 0) {
        const LoraProj& pj = p.table[slot].proj[kLoraGateUp];
        if (pj.r > 0 && !pj.a_shared) key[h] = slot;
      }
    }
  }
  const int steps = p.H / 16, per_warp = (steps + kRoutedWarps - 1) / kRoutedWarps;
  const int k_lo = warp * per_warp * 16, k_hi = min(steps, (warp + 1) * per_warp) * 16;
  dev::for_each_slot(key, [&](int s) {  // the same slots, in the same order, in every warp of the block
    const LoraProj& pj = p.table[s].proj[kLoraGateUp];
    const int r1 = pj.r;
    const uint16_t* A = pj.A + static_cast<int64_t>(e) * r1 * p.H;
    for (int n0 = 0; n0 < r1; n0 += 32) {
      float acc[4][4] = {};
      const uint16_t* arow[4];
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) {
        const int n = n0 + nt * 8 + g;
        arow[nt] = n < r1 ? A + static_cast<int64_t>(n) * p.H : nullptr;
      }
      for (int k0 = k_lo; k0 < k_hi; k0 += 16) {
        uint32_t a[4];
        a[0] = xrow[0] ? *reinterpret_cast<const uint32_t*>(xrow[0] + k0 + 2 * t) : 0u;
        a[1] = xrow[1] ? *reinterpret_cast<const uint32_t*>(xrow[1] + k0 + 2 * t) : 0u;
        a[2] = xrow[0] ? *reinterpret_cast<const uint32_t*>(xrow[0] + k0 + 2 * t + 8) : 0u;
        a[3] = xrow[1] ? *reinterpret_cast<const uint32_t*>(xrow[1] + k0 + 2 * t + 8) : 0u;
#pragma unroll
        for (int nt = 0; nt < 4; ++nt) {
          uint32_t b[2];
          b[0] = arow[nt] ? *reinterpret_cast<const uint32_t*>(arow[nt] + k0 + 2 * t) : 0u;
          b[1] = arow[nt] ? *reinterpret_cast<const uint32_t*>(arow[nt] + k0 + 2 * t + 8) : 0u;
          dev::mma_bf16_16816(acc[nt], a, b);
        }
      }
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int q = 0; q < 4; ++q) part[warp][nt][q][lane] = acc[nt][q];
      __syncthreads();
      if (warp == 0) {
#pragma unroll
        for (int nt = 0; nt < 4; ++nt)
#pragma unroll
          for (int q = 0; q < 4; ++q) {
            float v = part[0][nt][q][lane];
            for (int w = 1; w < kRoutedWarps; ++w) v = __fadd_rn(v, part[w][nt][q][lane]);
            const int h = q >> 1, n = n0 + nt * 8 + 2 * t + (q & 1);  // D: rows g, g + 8; columns 2t, 2t + 1
            if (key[h] == s && n < r1) p.t1[static_cast<int64_t>(entry[h]) * p.t1_stride + n] = round_bf16(v);
          }
      }
      __syncthreads();
    }
  });
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
  // Per-expert A1 is left to lora_shrink1_routed_kernel; SharedOuter's one A1: once per token, in row t*k.
  const int n_routed = gu.r > 0 && gu.a_shared ? gu.r : 0;
  const int n_total = n_routed + (sg.r > 0 ? sg.r : 0);
  const int lane = threadIdx.x & 31, nwarps = (blockDim.x >> 5) * gridDim.y;
  const int warp = static_cast<int>(blockIdx.y) * (blockDim.x >> 5) + (threadIdx.x >> 5);
  for (int o = warp; o < n_total; o += nwarps) {  // o is warp-uniform; the token's blocks share its outputs
    const uint16_t* arow;
    float* dst;
    if (o < n_routed) {
      arow = gu.A + static_cast<int64_t>(o) * p.H;
      dst = p.t1 + static_cast<int64_t>(t) * p.k * p.t1_stride + o;
    } else {
      const int i = o - n_routed;
      arow = sg.A + static_cast<int64_t>(i) * p.H;
      dst = p.st1 + static_cast<int64_t>(t) * p.st_stride + i;
    }
    const float v = warp_dot_bf16(x, arow, p.H, lane);
    if (lane == 0) *dst = round_bf16(v);
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
    if (lane == 0) p.t[static_cast<int64_t>(entry) * p.t_stride + i] = round_bf16(v);
  }
}

}  // namespace

void launch_lora_shrink1(const LoraShrink1Params& p, int threads, cudaStream_t stream) {
  if (p.T <= 0) return;
  const int warps = threads / 32, per_token = std::max(1, (p.max_outputs + warps - 1) / warps);
  lora_shrink1_kernel<<<dim3(static_cast<unsigned>(p.T), static_cast<unsigned>(per_token)), threads, 0, stream>>>(p);
  check_launch("lora_shrink1_kernel");
}

void launch_lora_shrink1_routed(const LoraShrinkRoutedParams& p, cudaStream_t stream) {
  if (p.max_tiles <= 0) return;
  const dim3 grid(static_cast<unsigned>(p.max_tiles), static_cast<unsigned>((p.bm + 15) / 16));
  lora_shrink1_routed_kernel<<<grid, kRoutedWarps * 32, 0, stream>>>(p);
  check_launch("lora_shrink1_routed_kernel");
}

void launch_lora_shrink2(const LoraShrink2Params& p, int threads, cudaStream_t stream) {
  if (p.rows <= 0) return;
  lora_shrink2_kernel<<<static_cast<unsigned>(p.rows), threads, 0, stream>>>(p);
  check_launch("lora_shrink2_kernel");
}

}  // namespace fp4moe::cuda_backend
