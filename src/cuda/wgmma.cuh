// wgmma (sm_90a): the warpgroup MMA of the Hopper tile (gemm/mainloop_wgmma.cuh, the Wgmma64 tile). The
// weights are the register A operand (decoded NVFP4, the same fragments as mma.sync's A), the tokens the
// shared-memory B operand, in the 128-byte-swizzled rows the TileLoader writes (row r's 16-byte chunk c at
// r * 128 + ((c ^ (r & 7)) << 4), 1024-byte aligned stage): wgmma's SWIZZLE_128B K-major layout.
#pragma once
#include <cstdint>
#include <type_traits>

#include "cuda/wgmma_ops.cuh"

namespace fp4moe::cuda_backend::dev {

// The matrix descriptor of a K-major, 128-byte-swizzled operand whose rows are 128 bytes (64 bf16) and whose
// 8-row groups are 1024 bytes apart; addr: the shared-space address of the 16 K (32 bytes) to read from row 0
// (the group's base, 1024-byte aligned, plus 32 * k16 step). The leading offset is unused for this layout (set
// to 1, as the PTX ISA's canonical layouts list it).
__device__ __forceinline__ uint64_t wgmma_desc_sw128(uint32_t addr) {
  return static_cast<uint64_t>((addr & 0x3ffffu) >> 4) | (static_cast<uint64_t>(1) << 16) |
         (static_cast<uint64_t>(1024 >> 4) << 32) | (static_cast<uint64_t>(1) << 62);
}

// wgmma_desc_sw128(addr + bytes) from d = wgmma_desc_sw128(addr): only the start-address field (addr >> 4, the low
// 14 bits: shared addresses stay below 256 KB, so nothing carries out of it) moves; the upper word is unchanged, so
// a loop's descriptors cost one add each instead of the mask, shift and or of every address.
__device__ __forceinline__ uint64_t wgmma_desc_advance(uint64_t d, uint32_t bytes) {
  return (d & 0xffffffff00000000ull) | static_cast<uint32_t>(static_cast<uint32_t>(d) + (bytes >> 4));
}

// f(std::integral_constant<int, NG>) for the first NG of the list that holds `groups` token groups (of 8), the last
// one else: the one branch a tile takes to a mainloop of wgmmas of N = 8 NG.
template <int G, class F> __device__ __forceinline__ void with_token_groups(int, F&& f) {
  f(std::integral_constant<int, G>{});
}
template <int G, int G2, int... Gs, class F> __device__ __forceinline__ void with_token_groups(int groups, F&& f) {
  if (groups <= G) return f(std::integral_constant<int, G>{});
  with_token_groups<G2, Gs...>(groups, f);
}

// Orders this thread's register writes (the A fragments, the accumulators) before the wgmmas that read them.
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
// Waits until at most N committed groups are pending; the accumulators are then readable.
template <int N> __device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Keeps the compiler from moving accumulator reads or writes across a wgmma (their registers are asm operands
// only at the issue; the hardware writes them until wgmma_wait).
template <int G> __device__ __forceinline__ void wgmma_fence_acc(float (&d)[G][4]) {
#pragma unroll
  for (int j = 0; j < G; ++j)
#pragma unroll
    for (int q = 0; q < 4; ++q) asm volatile("" : "+f"(d[j][q])::"memory");
}

}  // namespace fp4moe::cuda_backend::dev
