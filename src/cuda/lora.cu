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
  const int n_routed = gu.r > 0 ? (gu.a_shared ? 1 : p.k) * gu.r : 0;
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

void launch_lora_shrink2(const LoraShrink2Params& p, int threads, cudaStream_t stream) {
  if (p.rows <= 0) return;
  lora_shrink2_kernel<<<static_cast<unsigned>(p.rows), threads, 0, stream>>>(p);
  check_launch("lora_shrink2_kernel");
}

}  // namespace fp4moe::cuda_backend
