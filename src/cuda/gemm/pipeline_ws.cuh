// The stage ring of a warp-specialised tile (kernel_ws_wgmma.cuh): the producer warpgroup fills the stages, the
// math warps only wait for a stage and hand it back. Stage s has a full barrier (each producer thread once its
// cp.async copies of the stage landed, plus the bulk copies' bytes) and an empty barrier (one arrival a math warp
// once its wgmmas have read the stage). No __syncthreads in the loop.
#pragma once
#include <cstdint>

#include "cuda/gemm/pipeline.cuh"

namespace fp4moe::cuda_backend {

namespace dev {
// setmaxnreg (sm_90a): a warpgroup's register budget moves from the producer to the math warpgroups.
template <int N> __device__ __forceinline__ void regs_dealloc() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
#endif
}
template <int N> __device__ __forceinline__ void regs_alloc() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
#endif
}
// A barrier of the first `threads` threads of the block (id 1; __syncthreads is 0).
template <int threads> __device__ __forceinline__ void named_sync() {
  asm volatile("bar.sync 1, %0;\n" ::"n"(threads) : "memory");
}
}  // namespace dev

template <class C> struct WsRing {
  static_assert(C::WS, "warp-specialised tiles");
  static constexpr int S = C::STAGES;
  static constexpr bool kBulk = TileLoader<C>::kBulk;
  uint32_t base, full0, empty0;

  // Every thread of the block (the barriers' initialization, then one __syncthreads).
  __device__ __forceinline__ explicit WsRing(uint8_t* smem) {
    __shared__ __align__(8) uint64_t bars[2 * S];
    base = dev::smem_addr(smem);
    full0 = dev::smem_addr(bars);
    empty0 = full0 + 8 * S;
    if (threadIdx.x < S) {
      dev::mbar_init(full0 + 8 * threadIdx.x, C::PRODUCER_THREADS + (kBulk ? 1 : 0));
      dev::mbar_init(empty0 + 8 * threadIdx.x, C::THREADS / 32);
    }
    dev::mbar_init_fence();
    __syncthreads();
  }

  // The producer's place in the ring, kept from tile to tile: the next stage and the parity its empty barrier must
  // complete (a fresh barrier's phase "before the first" counts as complete: the first round passes).
  struct Writer {
    int s = 0;
    uint32_t eph = 1;
  };
  // The producer warpgroup: k-blocks [0, nkb) of one tile, each into the next stage once the math warps handed it
  // back; each thread's arrival on the stage's full barrier fires when its copies have landed (no wait here). The
  // caller waits for its copies (cp_async_wait) before it exits.
  template <class Rows>
  __device__ __forceinline__ void produce(Writer& w, const GemmProblem& g, const Rows& tr, int n0, int nkb) const {
    TileLoader<C> ld(g, tr, n0, 0);
    for (int j = 0; j < nkb; ++j) {
      dev::mbar_wait(empty0 + 8 * w.s, w.eph);
      ld.load_next(base + w.s * C::STAGE_BYTES, full0 + 8 * w.s);
      dev::cp_async_mbar_arrive(full0 + 8 * w.s);
      if (++w.s == S) w.s = 0, w.eph ^= 1u;
    }
  }

  // A math warp's place in the ring: the stage of its next k-block and the parity of that stage's full phase.
  struct Reader {
    int s = 0;
    uint32_t ph = 0;
  };
  // The shared-space address of the reader's next stage once its copies landed; advances the reader. The token rows
  // came by cp.async (the generic proxy) and wgmma reads them through the async proxy: the PTX memory model asks for
  // the proxy fence after the barrier that orders them.
  __device__ __forceinline__ uint32_t wait_full(Reader& r) const {
    dev::mbar_wait(full0 + 8 * r.s, r.ph);
    dev::fence_proxy_async();
    const uint32_t st = base + r.s * C::STAGE_BYTES;
    if (++r.s == S) r.s = 0, r.ph ^= 1u;
    return st;
  }
  // Hands stage s back: one arrival a warp, after its wgmmas on the stage completed.
  __device__ __forceinline__ void release(int s) const {
    if ((threadIdx.x & 31) == 0) dev::mbar_arrive(empty0 + 8 * s);
  }
};

}  // namespace fp4moe::cuda_backend
