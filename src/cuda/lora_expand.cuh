// The LoRA expand of a GEMM tile on the tensor cores (SPEC §5): delta(row, n) = bf16(t[row] . B_{slot(row),e}[n]),
// computed by both GEMM kernels' epilogues as m16n8k16 fragments and added to their outputs; no [rows, N] delta
// goes through memory.
//
// A fragment's rows (or columns) belong to tokens of different adapters. For each adapter slot present (ascending,
// for_each_slot), one chain of k16 mma steps from +0 over k < r multiplies every row's t by that slot's B, and the
// outputs of the rows that name the slot are taken (select); the others are discarded. So a row's delta is its own
// chain, the same bits whatever the other rows, their adapters or the tile shape (the operand roles may swap: the
// mma sums the same 16 products either way, as the base GEMM relies on). t rows are bf16-exact (the shrink rounds
// them), so packing them to bf16 loses nothing; k >= r enters as zero.
#pragma once
#include <climits>
#include <cstdint>

#include "cuda/kernels.h"
#include "cuda/mma.cuh"
#include "cuda/nvfp4_device.cuh"

namespace fp4moe::cuda_backend::dev {

// One output row's expand operand: the slot whose B applies (-1: no delta — base token, no such projection, or
// SharedOuter's down, left to the combine) and its shrink row t.
struct LoraRowRef {
  const float* t = nullptr;
  int slot = -1;
  int r = 0;  // the slot's rank for this projection (0 without a delta)
};
// entry: the output row's (token, slot) entry; token = entry / token_div.
__device__ __forceinline__ LoraRowRef lora_row_ref(const LoraExpandParams& L, int entry, int token_div) {
  LoraRowRef rr;
  const int token = entry / token_div;
  if (!L.table) return rr;
  const int slot = L.adapter_ids ? checked_slot(L.table, L.num_slots, L.adapter_ids[token]) : L.token_slot[token];
  if (slot < 0) return rr;
  const LoraProj& pj = L.table[slot].proj[L.which];
  if (pj.r <= 0 || pj.b_shared) return rr;
  rr.slot = slot;
  rr.r = pj.r;
  rr.t = L.t + static_cast<int64_t>(pj.a_shared ? token * token_div : entry) * L.t_stride;
  return rr;
}

// Asks L2 for the line holding p (no register waits on it): the epilogue's B rows, requested when a tile's rows are
// looked up so that the mainloop hides their HBM latency.
__device__ __forceinline__ void prefetch_l2(const void* p) { asm volatile("prefetch.global.L2 [%0];" ::"l"(p)); }

// (t[k], t[k+1]) as bf16x2, zero at k >= r or without a row (k even).
__device__ __forceinline__ uint32_t lora_t_pair(const float* t, int r, int k) {
  if (!t || k >= r) return 0;
  return pack_bf16x2(t[k], k + 1 < r ? t[k + 1] : 0.f);
}
// (b[k], b[k+1]) of one B row (length r, bf16) as bf16x2, zero at k >= r or without a row (k even).
__device__ __forceinline__ uint32_t lora_b_pair(const uint16_t* b, int r, int k) {
  if (!b || k >= r) return 0;
  if ((r & 1) == 0) return *reinterpret_cast<const uint32_t*>(b + k);  // 4-byte aligned: row starts at n*r, k even
  return static_cast<uint32_t>(b[k]) | (k + 1 < r ? static_cast<uint32_t>(b[k + 1]) << 16 : 0u);
}

// Calls f(s) once for each slot among the warp's keys (N per lane, -1 for none), in ascending order; f runs
// warp-uniformly (every lane, same s), so it may use mma.sync. Each iteration is a chain of dependent loads
// (slot table, B, t): callers run it once per tile or fragment row block, not per output.
template <int N, class F> __device__ __forceinline__ void for_each_slot(const int (&keys)[N], F&& f) {
  for (int last = -1;;) {
    int m = INT_MAX;
#pragma unroll
    for (int i = 0; i < N; ++i) m = keys[i] > last && keys[i] < m ? keys[i] : m;
    const int s = __reduce_min_sync(0xffffffffu, m);
    if (s == INT_MAX) return;
    f(s);
    last = s;
  }
}

// d = sum over k < r (k16 steps from +0) of A(m, k) B(k, n) for one m16n8 fragment; afrag(k0, a[4]) and
// bfrag(k0, b[2]) fill the operands of the step at k0.
template <class AF, class BF> __device__ __forceinline__ void lora_mma(float d[4], int r, AF&& afrag, BF&& bfrag) {
  d[0] = d[1] = d[2] = d[3] = 0.f;
  for (int k0 = 0; k0 < r; k0 += 16) {
    uint32_t a[4], b[2];
    afrag(k0, a);
    bfrag(k0, b);
    mma_bf16_16816(d, a, b);
  }
}

}  // namespace fp4moe::cuda_backend::dev
